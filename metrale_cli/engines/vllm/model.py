"""vLLM 0.32.0's model as its LoRA code sees it: the modules it wraps per family and layer
type, and the bytes its stacked LoRA buffers take per GPU (host cache too) under its flags
(flags.py). From configs only; read from vLLM's source (`vllm/lora/layers`,
`vllm/lora/model_manager.py`, the models' `packed_modules_mapping`) and checked against the
engine's own allocation in tests/test_engine_vllm.py. rules.py judges adapters against it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

from metrale_cli.engines.shared import (
    DTYPE_BYTES,
    config_width,
    divide,
    family_row,
    raw_text_config,
    refuse_absurd,
)
from metrale_cli.errors import FormatError, UsageError
from metrale_cli.model.config import LayerType, ModelConfig

if TYPE_CHECKING:
    from metrale_cli.adapters.audit import AdapterReport
    from metrale_cli.engines.vllm.flags import Flags

# LogitsProcessorWithLoRA refuses a larger output head.
MAX_LORA_VOCAB = 258048
# GDN's short convolution width when a config does not say (transformers' default).
DEFAULT_CONV_KERNEL = 4

NAME = "vllm"
VERSION = "0.32.0"  # every rule of this package is this version's


# packed_modules_mapping as most classes declare it (llama.py's LlamaForCausalLM): PEFT's q/k/v
# and gate/up land in one fused layer each, one LoRA slice per adapter name.
_PACKED = (("qkv_proj", ("q_proj", "k_proj", "v_proj")),
           ("gate_up_proj", ("gate_proj", "up_proj")))
# phi3.py's Phi3ForCausalLM: each fused layer packs itself, as the checkpoint (and PEFT) fuse
# it: one LoRA pair spans q|k|v, one gate|up (QKVParallelLinearWithLoRA and
# ColumnParallelLinearWithLoRA, one slice each).
_PACKED_AS_ITSELF = (("qkv_proj", ("qkv_proj",)), ("gate_up_proj", ("gate_up_proj",)))
# The class declares `embedding_modules` with both (llama.py's LlamaForCausalLM): embed_tokens
# gets VocabParallelEmbeddingWithLoRA, lm_head LogitsProcessorWithLoRA.
_EMBED_HEAD = ("embed_tokens", "lm_head")
# vLLM's transformers backend (model_executor/models/transformers/base.py `Base`):
# embedding_modules = {"embed_tokens": ...}, no lm_head.
_EMBED = ("embed_tokens",)
_BACKEND = "transformers/base.py Base"
# deepseek_v2.py DeepseekV2ForCausalLM: gate/up as llama.py, and with a q_lora_rank the MLA's
# q_a_proj and kv_a_proj_with_mqa fused into one `fused_qkv_a_proj` (one slice each).
_PACKED_MLA = (("gate_up_proj", ("gate_proj", "up_proj")),
               ("fused_qkv_a_proj", ("q_a_proj", "kv_a_proj_with_mqa")))


@dataclass(frozen=True)
class VllmFamily:
    """What vLLM 0.32's model class for one `model_type` does that changes its LoRA: one row
    per row of model/families.py FAMILIES (tests/test_engine_rules.py holds the two tables to
    the same keys, so a new family is never silently "supported"). TP bounds are the one TP
    rule every command and engine applies (layout/sharding.py `check_model_split`).
    docs/engines.md's family table says how each row was checked: the engine run on a tiny
    model (tests/test_engine_vllm.py), or the source line cited here."""

    model_type: str
    # The `architectures` names vLLM's registry (model_executor/models/registry.py) builds
    # this family's class from; vLLM picks the class from `architectures`, not `model_type`.
    architectures: tuple[str, ...]
    # Where the rest of the row is read: the file under vllm/model_executor/models/ and the
    # class whose `embedding_modules` and `packed_modules_mapping` (its own or its bases') the
    # row copies (tests/test_engine_rules.py holds each row to it).
    cites: str
    # "run": tests/test_engine_vllm.py starts the CPU build on a tiny model of the family (its
    # verdicts and LoRA bytes, or the CPU build's failure with LoRA on MoE layers); "source":
    # the row is the cited source alone.
    checked: str
    # The class's `embedding_modules` keys: which of embed_tokens and lm_head get LoRA (vLLM's
    # Qwen2, Mistral, Gemma, GLM-4 and Qwen3-Next classes declare none, so an adapter training
    # either names a module vLLM does not expect; Cohere's declares embed_tokens alone).
    embedding_modules: tuple[str, ...] = ()
    # The class's `packed_modules_mapping`: fused layer -> the adapter names it takes.
    packed_modules: tuple[tuple[str, tuple[str, ...]], ...] = _PACKED
    # Gated-DeltaNet in_proj_qkvz and in_proj_ba as one fused, head-interleaved output each
    # (qwen3_next.py's gqa_interleaved_layout); else split per slice (qwen3_5.py).
    fused_qkvz: bool = False
    # The routed experts' LoRA wrapper takes PEFT's fused 3-D gate_up (FusedMoE3DWithLoRA).
    experts_3d: bool = False
    # The decoder layer's MoE block name as vLLM's class spells it (its LoRA loader renames
    # no module: Mixtral keeps transformers 4's `block_sparse_moe`).
    moe_block: str = "mlp"
    # The MoE layers' shared expert(s), as the class builds them beside FusedMoE: a dense MLP
    # under this path (gate_up_proj MergedColumnParallelLinear, down_proj RowParallelLinear),
    # which the LoRA manager wraps as any other MLP (lora/model_manager.py
    # `_create_lora_modules`: the leaf names gate_up_proj and down_proj), so an adapter's
    # `<path>.gate_proj` reaches it through packed_modules_mapping. Its width is the config's
    # shared_expert_intermediate_size (qwen2_moe.py) or n_shared_experts x
    # moe_intermediate_size (glm4_moe.py Glm4MoE). "": the row models none, so a family
    # whose shared expert is built otherwise (non-gated, another path) is never given Qwen's.
    shared_expert: str = ""
    # Qwen's sigmoid gate over the shared expert (qwen2_moe.py Qwen2MoeSparseMoeBlock
    # `shared_expert_gate`, a ReplicatedLinear with one output): wrapped too.
    shared_expert_gate: bool = False
    # The dense MLP's name in the decoder layer (Llama 4's `feed_forward`) and the MoE block's
    # router leaf (Llama 4's `router`).
    mlp_block: str = "mlp"
    router: str = "gate"
    # A non-gated dense MLP's up and down projections (starcoder2's c_fc and c_proj), each a
    # layer of its own (ColumnParallelLinearWithLoRA, RowParallelLinearWithLoRA); () where the
    # MLP is gated (gate_up_proj, down_proj).
    up_down: tuple[str, str] = ()
    # The config key whose step alone places the MoE layers, where vLLM's class reads no list
    # of them (Llama 4: `interleave_moe_layer_step`, not transformers' `moe_layers`); "": the
    # layers ModelConfig gives.
    moe_step: str = ""
    # The attention's name in vLLM's decoder layer where its hf_to_vllm_mapper renames the
    # checkpoint's (and an adapter's) `self_attn` (gpt_oss.py: `attn`).
    attn_block: str = "self_attn"
    # One block a layer, its `mixer` of the layer's kind (nemotron_h.py): `_block_modules`.
    blocks: bool = False
    # Attention of each layer's own widths, KV-shared layers, the per-layer input (gemma4.py):
    # `_gemma4_modules`.
    layer_kinds: bool = False
    # Multi-head latent attention (deepseek_v2.py DeepseekV2MLAAttention): `_mla_modules`.
    mla: bool = False
    # The wrapper's vision tower and its connector into the language model (vLLM's prefixes,
    # as an adapter's `model.visual.` reads after the class's hf_to_vllm_mapper) and the leaf
    # names of their linear layers: lora/utils.py get_supported_lora_modules takes every
    # LinearBase of the model, the tower's too, so their weights pass the name check
    # (lora_model.py check_unexpected_modules); without --enable-tower-connector-lora they get no
    # punica wrapper (model_manager.py `_maybe_init_mm`) and no LoRA layer, so they load and are
    # never applied. Only where vLLM builds the wrapper (`vision_tower`): a text class beside
    # it has none.
    towers: tuple[str, ...] = ()
    tower_modules: tuple[str, ...] = ()

    def packs(self, fused: str) -> tuple[str, ...]:
        """The adapter names vLLM loads into the fused layer `fused`."""
        return dict(self.packed_modules)[fused]


FAMILIES: dict[str, VllmFamily] = {f.model_type: f for f in (
    VllmFamily("llama", ("LlamaForCausalLM", "LLaMAForCausalLM"), "llama.py LlamaForCausalLM",
               "run", _EMBED_HEAD),
    VllmFamily("mistral", ("MistralForCausalLM", "Ministral3ForCausalLM",
                           "Mistral3ForConditionalGeneration"),
               "mistral.py MistralForCausalLM", "run"),
    VllmFamily("qwen2", ("Qwen2ForCausalLM",), "qwen2.py Qwen2ForCausalLM", "run"),
    VllmFamily("qwen3", ("Qwen3ForCausalLM",), "qwen3.py Qwen3ForCausalLM", "run",
               _EMBED_HEAD),
    VllmFamily("qwen3_moe", ("Qwen3MoeForCausalLM",), "qwen3_moe.py Qwen3MoeForCausalLM",
               "run", _EMBED_HEAD),
    VllmFamily("mixtral", ("MixtralForCausalLM",), "mixtral.py MixtralForCausalLM", "run",
               _EMBED_HEAD, moe_block="block_sparse_moe"),
    VllmFamily("qwen3_next", ("Qwen3NextForCausalLM",), "qwen3_next.py Qwen3NextForCausalLM",
               "run", fused_qkvz=True, shared_expert="mlp.shared_expert",
               shared_expert_gate=True),
    # The wrapper (Qwen3_5ForConditionalGeneration, a Qwen3VLForConditionalGeneration) builds
    # Qwen3-VL's tower.
    VllmFamily("qwen3_5", ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"),
               "qwen3_5.py Qwen3_5ForCausalLM", "run", _EMBED_HEAD, towers=("visual",),
               tower_modules=("qkv", "proj", "linear_fc1", "linear_fc2")),
    VllmFamily("qwen3_5_moe", ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
               "qwen3_5.py Qwen3_5MoeForCausalLM", "source", _EMBED_HEAD, experts_3d=True,
               shared_expert="mlp.shared_expert", shared_expert_gate=True),
    # No embedding_modules (the head is the tied embedding).
    VllmFamily("gemma", ("GemmaForCausalLM",), "gemma.py GemmaForCausalLM", "run"),
    VllmFamily("gemma2", ("Gemma2ForCausalLM",), "gemma2.py Gemma2ForCausalLM", "run"),
    VllmFamily("gemma3", ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
               "gemma3.py Gemma3ForCausalLM", "run"),
    VllmFamily("granite", ("GraniteForCausalLM",), "granite.py GraniteForCausalLM", "run",
               _EMBED_HEAD),
    # registry.py maps these to the transformers backend (TransformersForCausalLM), not a
    # native class: its fusers pack q/k/v and gate/up at load time as the native classes do.
    VllmFamily("olmo2", ("Olmo2ForCausalLM",), _BACKEND, "run", _EMBED),
    VllmFamily("olmo3", ("Olmo3ForCausalLM",), _BACKEND, "run", _EMBED),
    # One class serves both: lm_head is the tied embedding (no module of its own).
    VllmFamily("cohere", ("CohereForCausalLM",), "commandr.py CohereForCausalLM", "run",
               _EMBED),
    VllmFamily("cohere2", ("Cohere2ForCausalLM",), "commandr.py CohereForCausalLM", "run",
               _EMBED),
    VllmFamily("exaone4", ("Exaone4ForCausalLM",), "exaone4.py Exaone4ForCausalLM", "run",
               _EMBED_HEAD),
    # A subclass of vLLM's LlamaForCausalLM: its embedding_modules.
    VllmFamily("ernie4_5", ("Ernie4_5ForCausalLM",), "ernie45.py Ernie4_5ForCausalLM",
               "run", _EMBED_HEAD),
    VllmFamily("seed_oss", ("SeedOssForCausalLM",), _BACKEND, "run", _EMBED),
    VllmFamily("smollm3", ("SmolLM3ForCausalLM",), _BACKEND, "run", _EMBED),
    # vLLM 0.32 registers Ministral3ForCausalLM (mistral's row), not MinistralForCausalLM; for
    # a class it does not register that transformers has, registry.py `resolve_model_cls`
    # falls back to the transformers backend ("Fallback to transformers impl",
    # `_try_resolve_transformers`).
    VllmFamily("ministral", ("MinistralForCausalLM",), _BACKEND, "run", _EMBED),
    # The wrappers build their language model's class (init_vllm_registered_model's
    # `architectures`), whose embedding_modules and packing the LoRA manager reads. Their
    # towers' linear layers: attention `qkv` and `proj`, the MLP (Qwen2-VL's fc1, fc2;
    # Qwen2.5-VL's gate_up_proj, packing gate_proj and up_proj, and down_proj; Qwen3-VL's
    # linear_fc1, linear_fc2, its mergers' too) and the merger's `mlp.0`, `mlp.2` (an
    # nn.ModuleList or nn.Sequential of two linears around a GELU).
    VllmFamily("qwen2_vl", ("Qwen2VLForConditionalGeneration",), "qwen2.py Qwen2ForCausalLM",
               "run", towers=("visual",), tower_modules=("qkv", "proj", "fc1", "fc2", "0", "2")),
    VllmFamily("qwen2_5_vl", ("Qwen2_5_VLForConditionalGeneration",),
               "qwen2.py Qwen2ForCausalLM", "run", towers=("visual",),
               tower_modules=("qkv", "proj", "gate_proj", "up_proj", "down_proj", "0", "2")),
    VllmFamily("qwen3_vl", ("Qwen3VLForConditionalGeneration",), "qwen3.py Qwen3ForCausalLM",
               "run", _EMBED_HEAD, towers=("visual",),
               tower_modules=("qkv", "proj", "linear_fc1", "linear_fc2")),
    # MoE families: their classes declare no embedding_modules.
    VllmFamily("qwen2_moe", ("Qwen2MoeForCausalLM",), "qwen2_moe.py Qwen2MoeForCausalLM",
               "run", shared_expert="mlp.shared_expert", shared_expert_gate=True),
    VllmFamily("olmoe", ("OlmoeForCausalLM",), "olmoe.py OlmoeForCausalLM", "run"),
    # Glm4MoE: the router a GateLinear (a ReplicatedLinear), `n_shared_experts` shared experts
    # as one Glm4MoeMLP under mlp.shared_experts, no gate over them.
    VllmFamily("glm4_moe", ("Glm4MoeForCausalLM",), "glm4_moe.py Glm4MoeForCausalLM",
               "run", shared_expert="mlp.shared_experts"),
    # The transformers backend again: its QKVFuser packs q/k/v; the MLP is no GLU, so no fuser
    # matches it and c_fc and c_proj stay one linear each, replaced by the config's TP plan
    # (base_model_tp_plan: c_fc colwise, c_proj rowwise; base.py `recursive_replace`).
    VllmFamily("starcoder2", ("Starcoder2ForCausalLM",), _BACKEND, "run", _EMBED,
               up_down=("c_fc", "c_proj")),
    # Packs q/k/v alone, no embedding_modules; its hf_to_vllm_mapper renames `.self_attn.` to
    # `.attn.` (LoRA tensor names too: lora/utils.py parse_fine_tuned_lora_name). Every layer
    # MoE: the `router` (GateLinear: replicated) and the 3-D fused experts (is_3d_moe_weight),
    # whose interleaved gate|up LoRA B the loader splits (model_manager.py: `gate_up_b[:, ::2]`
    # for GptOssForCausalLM). The attention sinks are a parameter, not a LoRA layer.
    VllmFamily("gpt_oss", ("GptOssForCausalLM",), "gpt_oss.py GptOssForCausalLM", "run",
               packed_modules=(("qkv_proj", ("q_proj", "k_proj", "v_proj")),),
               experts_3d=True, router="router", attn_block="attn"),
    # Multi-head latent attention (`_mla_modules`); gate/up packed, no embedding_modules. The
    # class adds `fused_qkv_a_proj` to its packing in __init__ where the config has a
    # q_lora_rank (DeepseekV2ForCausalLM.__init__). Dense MLPs on the first
    # `first_k_dense_replace` layers, then the router (`mlp.gate`, a GateLinear: replicated),
    # the 2-D fused experts and `n_shared_experts` shared experts as one dense MLP
    # (DeepseekV2MoE: `mlp.shared_experts`, n_shared_experts x moe_intermediate_size wide, no
    # gate). V3 is the same class.
    VllmFamily("deepseek_v2", ("DeepseekV2ForCausalLM",),
               "deepseek_v2.py DeepseekV2ForCausalLM", "run", packed_modules=_PACKED_MLA,
               shared_expert="mlp.shared_experts", mla=True),
    VllmFamily("deepseek_v3", ("DeepseekV3ForCausalLM",),
               "deepseek_v2.py DeepseekV3ForCausalLM", "run", packed_modules=_PACKED_MLA,
               shared_expert="mlp.shared_experts", mla=True),
    # A LlamaForCausalLM whose fused layers pack themselves.
    VllmFamily("phi3", ("Phi3ForCausalLM",), "phi3.py Phi3ForCausalLM", "run", _EMBED_HEAD,
               _PACKED_AS_ITSELF),
    # Packs gate_proj and up_proj into gate_up_proj, as llama.py does, although the checkpoint
    # (and a PEFT adapter) has gate_up_proj fused: an adapter's gate_up_proj is a module name
    # vLLM does not expect.
    VllmFamily("glm4", ("Glm4ForCausalLM",), "glm4.py Glm4ForCausalLM", "run"),
    # Mixtral's layout (block_sparse_moe: gate, experts), every layer MoE; packs q/k/v.
    VllmFamily("granitemoe", ("GraniteMoeForCausalLM",), "granitemoe.py GraniteMoeForCausalLM",
               "run", _EMBED_HEAD, moe_block="block_sparse_moe"),
    # The published checkpoints' spelling; transformers' own (what it writes on save) is
    # TRANSFORMERS_FALLBACK's.
    VllmFamily("phimoe", ("PhiMoEForCausalLM",), "phimoe.py PhiMoEForCausalLM", "run",
               _EMBED_HEAD, moe_block="block_sparse_moe"),
    # A LlamaForCausalLM (its embedding_modules) whose layers interleave MoE and dense MLPs,
    # both under `feed_forward` (llama4.py Llama4DecoderLayer: MoE where `(layer_idx + 1) %
    # interleave_moe_layer_step == 0`, else a LlamaMLP `intermediate_size_mlp` wide). The MoE
    # block (Llama4MoE): a `router` (GateLinear, a ReplicatedLinear), a `shared_expert` LlamaMLP
    # (gate_up_proj packed, `intermediate_size` wide, no gate of its own) and the fused experts
    # (2-D wrapper: the class does not set is_3d_moe_weight). The wrapper (mllama4.py) packs
    # alike; its tower (vision_model: attention qkv_proj, packing q/k/v, and o_proj, MLPs fc1
    # and fc2, the patch embedding's `linear`) and projector (multi_modal_projector.linear_1)
    # are vLLM linears.
    VllmFamily("llama4", ("Llama4ForCausalLM", "Llama4ForConditionalGeneration"),
               "llama4.py Llama4ForCausalLM", "run", _EMBED_HEAD, moe_block="feed_forward",
               mlp_block="feed_forward", router="router",
               shared_expert="feed_forward.shared_expert",
               moe_step="interleave_moe_layer_step",
               towers=("vision_model", "multi_modal_projector"),
               tower_modules=("q_proj", "k_proj", "v_proj", "o_proj", "fc1", "fc2", "linear",
                              "linear_1")),
    # Packs q/k/v and gate/up as llama.py (_PACKED), no embedding_modules; its layers are not
    # one shape (`_gemma4_modules`). The wrapper (gemma4_mm.py Gemma4ForConditionalGeneration)
    # packs alike.
    VllmFamily("gemma4", ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"),
               "gemma4.py Gemma4ForCausalLM", "run", layer_kinds=True),
    # One block a layer (`_block_modules`): q/k/v packed into qkv_proj on the attention
    # blocks, a non-gated MLP (up_proj, down_proj) on the MLP blocks, Mamba-2 mixers (in_proj,
    # conv1d, out_proj) and non-gated MoE (experts, shared experts; no router LoRA) beside them.
    VllmFamily("nemotron_h", ("NemotronHForCausalLM", "NemotronHPuzzleForCausalLM"),
               "nemotron_h.py NemotronHForCausalLM", "run", _EMBED_HEAD,
               (("qkv_proj", ("q_proj", "k_proj", "v_proj")),), blocks=True),
)}


# Where transformers names a family's class otherwise than vLLM registers it: a config naming
# only classes vLLM does not register is built on the transformers backend from its first
# (registry.py `resolve_model_cls`, "Fallback to transformers impl": `_try_resolve_transformers`
# takes a class transformers has; config/model.py `_get_transformers_backend_cls`:
# TransformersMoEForCausalLM for an MoE config). transformers writes its own spelling into a
# checkpoint it saves (phimoe: PhimoeForCausalLM, where vLLM registers PhiMoEForCausalLM).
# The backend wraps what transformers builds: attention and MLP as the fusers pack them,
# transformers' own router (`mlp.router`) and experts (`mlp.experts`, replaced by a 2-D
# fused MoE: moe.py `MoEMixin.recursive_replace`), `embed_tokens` alone.
TRANSFORMERS_FALLBACK: dict[str, VllmFamily] = {f.model_type: f for f in (
    VllmFamily("phimoe", ("PhimoeForCausalLM",), _BACKEND, "run", _EMBED, router="router"),
)}


def family(model: ModelConfig) -> VllmFamily:
    """The row for `model`'s family, as vLLM's registry picks the class from `architectures`:
    its native class, or the transformers backend where the config names transformers' class
    and none vLLM registers (TRANSFORMERS_FALLBACK); a family without one is refused, never
    guessed."""
    row = family_row(FAMILIES, model, f"vLLM {VERSION}", "engines/vllm/model.py FAMILIES")
    fallback = TRANSFORMERS_FALLBACK.get(model.model_type)
    archs = model.architectures or ()
    registered = {a for f in FAMILIES.values() for a in f.architectures}
    if fallback and archs and archs[0] in fallback.architectures and \
            not registered.intersection(archs):
        return fallback
    return row


def vision_tower(model: ModelConfig) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The vision tower and connector of the class vLLM builds for `model` (VllmFamily.towers
    and tower_modules), or ((), ()) where that class is a text model: the wrapper's when the
    config's `architectures` names a ForConditionalGeneration class (a preset names none: the
    family's own class, its first)."""
    row = family(model)
    built = model.architectures or row.architectures[:1]
    if not any(str(a).endswith("ForConditionalGeneration") for a in built):
        return (), ()
    return row.towers, row.tower_modules


class Kind(str, Enum):
    """The LoRA wrapper vLLM puts on a layer, which decides its buffers' shapes."""

    # MergedQKVParallelLinearWithLoRA: slices q, k, v; QKVParallelLinearWithLoRA where one
    # adapter name packs all three (one slice over q|k|v).
    QKV = "qkv"
    COLUMN = "column"  # (Merged)ColumnParallelLinearWithLoRA: one A/B per output slice
    ROW = "row"  # RowParallelLinearWithLoRA
    # ReplicatedLinearWithLoRA (routers, the shared-expert gate, MLA's kv_a_proj_with_mqa);
    # also MLA's fused_qkv_a_proj, a MergedColumnParallelLinear built with disable_tp
    # (DeepSeekV2FusedQkvAProjLinear), which MergedColumnParallelLinearWithLoRA wraps at the
    # layer's own TP size of 1: one full A and B per output slice on every GPU, fully sharded
    # or not.
    REPLICATED = "replicated"
    EMBEDDING = "embedding"  # VocabParallelEmbeddingWithLoRA
    LOGITS = "logits"  # LogitsProcessorWithLoRA (lm_head)
    EXPERTS = "experts"  # FusedMoEWithLoRA: gate (w1) and up (w3) in separate slices
    EXPERTS_3D = "experts_3d"  # FusedMoE3DWithLoRA: gate_up fused, as PEFT's 3-D format
    # FusedMoEWithLoRA on a non-gated MoE (`is_act_and_mul` False: nemotron_h): one w13 slice,
    # the up projection alone.
    EXPERTS_UP = "experts_up"


@dataclass(frozen=True)
class EngineModule:
    """One module vLLM wraps for LoRA, on the layers where it sits, with its full (unsharded)
    sizes. `adapter_names` are the leaf names an adapter uses for it (a packed module takes
    several)."""

    path: str  # inside a decoder layer (`self_attn.qkv_proj`), or top-level (`lm_head`)
    kind: Kind
    layers: tuple[int, ...]
    in_size: int
    out_sizes: tuple[int, ...]
    adapter_names: tuple[str, ...]
    # QKV: the head width and KV heads (KV heads are replicated, not split, past their count).
    head_dim: int = 0
    kv_heads: int = 0
    # EXPERTS: routed experts; in_size is hidden, out_sizes is (expert FFN width,).
    experts: int = 0
    # Where the module sits as an adapter's tensor names spell it, where vLLM's class renames
    # them (gpt_oss's `self_attn`, its `attn`); "": the path's own.
    adapter_parent: str = ""
    # A linear layer of the model, outside the decoder layers (gemma4's
    # per_layer_model_projection).
    model_level: bool = False
    # QKV: the layer's k_proj weight is loaded into both the K and V shards (gemma4's
    # attention_k_eq_v), so an adapter's k_proj delta reaches the keys alone.
    keys_as_values: bool = False
    # Why vLLM wraps the module, loads an adapter's weights into its buffers and never applies
    # them (MLA's kv_b_proj); "": it applies them.
    unapplied: str = ""

    @property
    def name(self) -> str:
        return self.path.rsplit(".", 1)[-1]

    @property
    def top_level(self) -> bool:
        return self.model_level or self.kind in (Kind.EMBEDDING, Kind.LOGITS)

    def buffers(self, max_loras: int, rank: int, tp: int, fully_sharded: bool,
                ) -> list[tuple[str, tuple[int, ...]]]:
        """The stacked buffers one GPU allocates for this module on one layer, as vLLM's
        `create_lora_weights` shapes them: A `[max_loras, 1, rank, in]` and B
        `[max_loras, 1, out, rank]` per slice (experts: per expert instead of 1)."""
        L, R = max_loras, rank
        # Fully sharded column layers split A's rank, row layers B's output, over TP.
        r_col = _divide(R, tp, "--max-lora-rank") if fully_sharded else R
        if self.kind is Kind.QKV:
            q, kv = self.out_sizes[0], self.kv_heads * self.head_dim
            kv_rank = (self.kv_heads // tp if tp <= self.kv_heads else 1) * self.head_dim
            outs = (_divide(q, tp, self.path), kv_rank if kv else 0, kv_rank if kv else 0)
            if len(self.adapter_names) == 1:
                # One slice: B spans this GPU's q, k and v rows (output_size_per_partition).
                return [("lora_a", (L, 1, r_col, self.in_size)), ("lora_b", (L, 1, sum(outs), R))]
            return ([("lora_a", (L, 1, r_col, self.in_size))] * 3
                    + [("lora_b", (L, 1, o, R)) for o in outs])
        if self.kind is Kind.COLUMN:
            return ([("lora_a", (L, 1, r_col, self.in_size))] * len(self.out_sizes)
                    + [("lora_b", (L, 1, _divide(o, tp, self.path), R))
                       for o in self.out_sizes])
        if self.kind is Kind.ROW:
            out = self.out_sizes[0]
            return [("lora_a", (L, 1, R, _divide(self.in_size, tp, self.path))),
                    ("lora_b", (L, 1, _divide(out, tp, self.path) if fully_sharded else out,
                                R))]
        if self.kind is Kind.REPLICATED:
            return ([("lora_a", (L, 1, R, self.in_size))] * len(self.out_sizes)
                    + [("lora_b", (L, 1, o, R)) for o in self.out_sizes])
        if self.kind is Kind.EMBEDDING:
            # A is the vocabulary by rank (one row per token id), not split over TP.
            return [("lora_a", (L, self.in_size, R)), ("lora_b", (L, 1, self.out_sizes[0], R))]
        if self.kind is Kind.LOGITS:
            return [("lora_a", (L, 1, R, self.in_size)), ("lora_b", (L, 1, self.out_sizes[0], R))]
        E, H = self.experts, self.in_size
        ffn = _divide(self.out_sizes[0], tp, self.path)
        h_out = _divide(H, tp, self.path) if fully_sharded else H
        # fused_moe.py FusedMoEWithLoRA: `_w13_slices` A and B pairs (2 gated, 1 non-gated);
        # FusedMoE3DWithLoRA: one pair, B over gate|up.
        w13 = ([("w13_lora_a", (L, E, r_col, H))] * 2 + [("w13_lora_b", (L, E, ffn, R))] * 2
               if self.kind is Kind.EXPERTS else
               [("w13_lora_a", (L, E, r_col, H)), ("w13_lora_b", (L, E, ffn, R))]
               if self.kind is Kind.EXPERTS_UP else
               [("w13_lora_a", (L, E, r_col, H)), ("w13_lora_b", (L, E, 2 * ffn, R))])
        return w13 + [("w2_lora_a", (L, E, R, ffn)), ("w2_lora_b", (L, E, h_out, R))]

    def layer_bytes(self, max_loras: int, rank: int, tp: int, fully_sharded: bool,
                    elem_bytes: int) -> int:
        return sum(math.prod(s) for _, s in self.buffers(max_loras, rank, tp, fully_sharded)
                   ) * elem_bytes

    def adapter_elements(self, names: set[str], rank: int) -> int:
        """Elements one adapter's own A and B take for this module on one layer at `rank`,
        for the leaf names it has (unsharded: what the host cache holds)."""
        if self.kind in (Kind.EXPERTS, Kind.EXPERTS_3D, Kind.EXPERTS_UP):
            h, ffn = self.in_size, self.out_sizes[0]
            # Per expert: gate and up A [r, h] and B [ffn, r] (one A for the fused 3-D gate_up;
            # up alone where non-gated), down A [r, ffn] and B [h, r].
            if self.kind is Kind.EXPERTS_UP:
                return self.experts * rank * (h + ffn + ffn + h) if names else 0
            a_in = 2 * h if self.kind is Kind.EXPERTS else h
            return self.experts * rank * (a_in + 2 * ffn + ffn + h) if names else 0
        outs = self._slice_outs()
        total = 0
        for name, out in zip(self._slice_names(), outs, strict=True):
            if name in names:
                total += rank * (self.in_size + out)
        return total

    def _slice_names(self) -> tuple[str, ...]:
        if self.kind is Kind.QKV:
            return self.adapter_names
        if self.kind in (Kind.COLUMN, Kind.REPLICATED) and \
                len(self.adapter_names) == len(self.out_sizes):
            return self.adapter_names
        # One adapter name over several slices (Qwen3.5's in_proj_qkv over q, k, v).
        return tuple(self.adapter_names[0] if len(self.adapter_names) == 1 else
                     _spread(self.adapter_names, len(self.out_sizes))[i]
                     for i in range(len(self.out_sizes)))

    def _slice_outs(self) -> tuple[int, ...]:
        if self.kind is Kind.QKV:
            kv = self.kv_heads * self.head_dim
            return ((self.out_sizes[0] + 2 * kv,) if len(self.adapter_names) == 1 else
                    (self.out_sizes[0], kv, kv))
        return self.out_sizes


def _spread(names: tuple[str, ...], slices: int) -> tuple[str, ...]:
    """Qwen3.5's in_proj_qkvz: in_proj_qkv takes the first three slices, in_proj_z the last."""
    return tuple(names[0] for _ in range(slices - 1)) + (names[-1],)


def _divide(size: int, tp: int, what: str) -> int:
    return divide(size, tp, what, "vLLM")


# -- the model as vLLM builds it -----------------------------------------------------------------


def engine_modules(model: ModelConfig) -> list[EngineModule]:
    """Every module vLLM 0.32 wraps for LoRA in `model` (with no --lora-target-modules), one
    entry per (path, kind) with the layers it sits on; UsageError for a family whose layers
    this does not model."""
    if family(model).blocks:
        return _block_modules(model, family(model))
    if family(model).layer_kinds:
        return _gemma4_modules(model)
    H, hd = model.hidden_size, model.head_dim
    full = tuple(model.attention_layers)
    linear = tuple(model.linear_attention_layers)
    row = family(model)
    moe = _moe_layers(model, row)
    dense = tuple(i for i in range(model.num_hidden_layers) if i not in moe)
    gate = 2 if model.attn_gated else 1
    q = model.num_attention_heads * hd
    attn = row.attn_block
    out: list[EngineModule] = _mla_modules(model, row, full) if row.mla else [
        EngineModule(f"{attn}.qkv_proj", Kind.QKV, full, H, (gate * q,), row.packs("qkv_proj"),
                     head_dim=hd, kv_heads=model.num_key_value_heads,
                     adapter_parent="self_attn"),
        EngineModule(f"{attn}.o_proj", Kind.ROW, full, q, (H,), ("o_proj",),
                     adapter_parent="self_attn"),
    ]
    if linear:
        kd = model.linear_num_key_heads * model.linear_key_head_dim
        vd = model.linear_value_width
        nv = model.linear_num_value_heads
        conv = config_width(model, "linear_conv_kernel_dim", DEFAULT_CONV_KERNEL)
        if row.fused_qkvz:
            # One fused, head-interleaved output each (gqa_interleaved_layout).
            out += [EngineModule("linear_attn.in_proj_qkvz", Kind.COLUMN, linear, H,
                                 (2 * kd + 2 * vd,), ("in_proj_qkvz",)),
                    EngineModule("linear_attn.in_proj_ba", Kind.COLUMN, linear, H, (2 * nv,),
                                 ("in_proj_ba",))]
        else:
            out += [EngineModule("linear_attn.in_proj_qkvz", Kind.COLUMN, linear, H,
                                 (kd, kd, vd, vd), ("in_proj_qkv", "in_proj_z")),
                    EngineModule("linear_attn.in_proj_ba", Kind.COLUMN, linear, H, (nv, nv),
                                 ("in_proj_b", "in_proj_a"))]
        # The short convolution is a ColumnParallelLinear over the kernel taps: vLLM wraps it
        # like any other linear layer although no PEFT adapter can target it as one.
        out += [EngineModule("linear_attn.conv1d", Kind.COLUMN, linear, conv,
                             (2 * kd + vd,), ("conv1d",)),
                EngineModule("linear_attn.out_proj", Kind.ROW, linear, vd, (H,), ("out_proj",))]
    if dense:
        ffn = model.intermediate_size_mlp or model.intermediate_size
        mlp = row.mlp_block
        if row.up_down:
            up, down = row.up_down
            out += [EngineModule(f"{mlp}.{up}", Kind.COLUMN, dense, H, (ffn,), (up,)),
                    EngineModule(f"{mlp}.{down}", Kind.ROW, dense, ffn, (H,), (down,))]
        else:
            gate_up = row.packs("gate_up_proj")
            # One slice per adapter name: gate|up as one output where one name packs both.
            out += [EngineModule(f"{mlp}.gate_up_proj", Kind.COLUMN, dense, H,
                                 (ffn, ffn) if len(gate_up) == 2 else (2 * ffn,), gate_up),
                    EngineModule(f"{mlp}.down_proj", Kind.ROW, dense, ffn, (H,),
                                 ("down_proj",))]
    if moe:
        E = model.num_experts
        experts = Kind.EXPERTS_3D if row.experts_3d else Kind.EXPERTS
        # PEFT's transformers-5 `mlp.gate` / `mlp.experts` weights match nothing under
        # Mixtral's `block_sparse_moe`.
        block = row.moe_block
        out += [EngineModule(f"{block}.{row.router}", Kind.REPLICATED, moe, H, (E,),
                             (row.router,)),
                EngineModule(f"{block}.experts", experts, moe, H,
                             (model.expert_intermediate_size,), ("experts",), experts=E)]
        shared = model.shared_expert_intermediate_size or model.shared_experts_width
        if shared and row.shared_expert:
            path = row.shared_expert
            out += [EngineModule(f"{path}.gate_up_proj", Kind.COLUMN, moe, H,
                                 (shared, shared), ("gate_proj", "up_proj")),
                    EngineModule(f"{path}.down_proj", Kind.ROW, moe, shared, (H,),
                                 ("down_proj",))]
            if row.shared_expert_gate:
                out.append(EngineModule(f"{path}_gate", Kind.REPLICATED, moe, H, (1,),
                                        ("shared_expert_gate",)))
    V = model.vocab_size
    if "embed_tokens" in row.embedding_modules:
        out.append(EngineModule("embed_tokens", Kind.EMBEDDING, (), V, (H,), ("embed_tokens",)))
    if "lm_head" in row.embedding_modules:
        out.append(EngineModule("lm_head", Kind.LOGITS, (), H, (V,), ("lm_head",)))
    return [m for m in out if m.layers or m.top_level]


# mla_attention.py: the attention backend's impl (MLACommonBaseImpl and its subclasses, the
# CPU's CPUMLAImpl; no torch module) keeps the kv_b_proj it was built with and calls that layer
# in prefill (forward_mha); decode multiplies by W_UK_T and W_UV, split off kv_b_proj's base
# weight at load (process_weights_after_loading). The LoRA manager swaps the wrapper in on the
# modules that hold kv_b_proj as a submodule, never in the impl, so its LoRA is applied on no
# token.
KV_B_UNAPPLIED = ("vLLM's MLA backend runs kv_b_proj's base weight itself (prefill through "
                  "the layer it was built with, decode through the weights absorbed from it): "
                  "the weights load into kv_b_proj's LoRA buffers and are never applied")


def _mla_modules(model: ModelConfig, row: VllmFamily, on: tuple[int, ...]) -> list[EngineModule]:
    """deepseek_v2.py DeepseekV2MLAAttention on layers `on`: with a q_lora_rank,
    `fused_qkv_a_proj` (q_a_proj | kv_a_proj_with_mqa, replicated) and `q_b_proj` (column);
    without, `q_proj` (column) and `kv_a_proj_with_mqa` (a ReplicatedLinear); then
    `kv_b_proj` (column, wrapped and never applied: KV_B_UNAPPLIED) and `o_proj` (row). The
    class builds plain multi-head attention (qkv_proj) where both qk head widths are 0, and
    MoE layers every `moe_layer_freq`: neither is modelled, so both are refused."""
    if not (model.qk_nope_head_dim or model.qk_rope_head_dim) or \
            raw_text_config(model).get("moe_layer_freq", 1) != 1:
        raise UsageError(f"--engine vllm: metrale models vLLM {VERSION}'s {model.model_type} "
                         "LoRA layers with multi-head latent attention and an MoE layer "
                         "frequency of 1 only; use --engine metrale")
    H = model.hidden_size
    kv_a = model.mla_kv_a_width
    if model.q_lora_rank:
        q = [EngineModule("self_attn.fused_qkv_a_proj", Kind.REPLICATED, on, H,
                          (model.q_lora_rank, kv_a), row.packs("fused_qkv_a_proj")),
             EngineModule("self_attn.q_b_proj", Kind.COLUMN, on, model.q_lora_rank,
                          (model.mla_q_width,), ("q_b_proj",))]
    else:
        q = [EngineModule("self_attn.q_proj", Kind.COLUMN, on, H, (model.mla_q_width,),
                          ("q_proj",)),
             EngineModule("self_attn.kv_a_proj_with_mqa", Kind.REPLICATED, on, H, (kv_a,),
                          ("kv_a_proj_with_mqa",))]
    return q + [EngineModule("self_attn.kv_b_proj", Kind.COLUMN, on, model.kv_lora_rank,
                             (model.mla_kv_b_width,), ("kv_b_proj",), unapplied=KV_B_UNAPPLIED),
                EngineModule("self_attn.o_proj", Kind.ROW, on, model.mla_v_width, (H,),
                             ("o_proj",))]


def _gemma4_modules(model: ModelConfig) -> list[EngineModule]:
    """gemma4.py Gemma4DecoderLayer: attention at each layer's own head width and KV heads
    (`per_layer_config`: full layers at `global_head_dim`), a `qkv_proj` on the layers
    computing their own KV (Gemma4Attention; with attention_k_eq_v the full layers' K shard
    loaded into V too, `_gemma4_layer_weights_mapper`) and a `q_proj` ColumnParallelLinear
    alone on the last `num_kv_shared_layers`; Gemma4MLP's `gate_up_proj`, twice as wide on the
    KV-shared layers with `use_double_wide_mlp`; the per-layer input's `per_layer_input_gate`
    and `per_layer_projection` (ReplicatedLinear) and the model's `per_layer_model_projection`
    (Gemma4Model: a ColumnParallelLinear over every layer's slice). With routed experts beside
    the MLP (Gemma4DecoderLayer's `enable_moe_block`), the router's `router.proj` (a
    GateLinear: replicated) and the `experts` (FusedMoEFactory, gated: the 2-D wrapper, the
    class sets no is_3d_moe_weight) `moe_intermediate_size` wide."""
    text = raw_text_config(model)
    if text.get("num_experts") is not None and not model.moe_layers:
        # vLLM builds the experts wherever num_experts is set; transformers (and metrale) only
        # with enable_moe_block, so the checkpoint has none for vLLM's layers to load. (The
        # block with num_experts 0 is refused where the config is read, model/config.py.)
        raise UsageError(f"--engine vllm: this gemma4 config sets num_experts without "
                         f"enable_moe_block: vLLM {VERSION} builds routed experts on every "
                         "layer (gemma4.py Gemma4DecoderLayer: `num_experts is not None`), "
                         "transformers none; metrale does not model that model")
    H, N = model.hidden_size, model.num_attention_heads
    every = range(model.num_hidden_layers)
    out: list[EngineModule] = []
    for full in (False, True):
        on = tuple(i for i in every if model.layer_types[i] is LayerType.FULL_ATTENTION) if full \
            else tuple(i for i in every if model.layer_types[i] is not LayerType.FULL_ATTENTION)
        hd = model.global_head_width if full else model.head_dim
        kv = model.global_kv_heads if full else model.num_key_value_heads
        own = tuple(i for i in on if not model.is_kv_shared_layer(i))
        shared = tuple(i for i in on if model.is_kv_shared_layer(i))
        out += [EngineModule("self_attn.qkv_proj", Kind.QKV, own, H, (N * hd,),
                             ("q_proj", "k_proj", "v_proj"), head_dim=hd, kv_heads=kv,
                             keys_as_values=full and model.attention_k_eq_v),
                EngineModule("self_attn.q_proj", Kind.COLUMN, shared, H, (N * hd,),
                             ("q_proj",)),
                EngineModule("self_attn.o_proj", Kind.ROW, on, N * hd, (H,), ("o_proj",))]
    for wide in (False, True):
        on = tuple(i for i in every if model.is_kv_shared_layer(i) == wide)
        ffn = model.kv_shared_mlp_width if wide else model.intermediate_size
        out += [EngineModule("mlp.gate_up_proj", Kind.COLUMN, on, H, (ffn, ffn),
                             ("gate_proj", "up_proj")),
                EngineModule("mlp.down_proj", Kind.ROW, on, ffn, (H,), ("down_proj",))]
    if model.moe_layers:
        E, moe = model.num_experts, tuple(model.moe_layers)
        out += [EngineModule("router.proj", Kind.REPLICATED, moe, H, (E,), ("proj",)),
                EngineModule("experts", Kind.EXPERTS, moe, H, (model.expert_intermediate_size,),
                             ("experts",), experts=E)]
    per = model.hidden_size_per_layer_input
    if per:
        out += [EngineModule("per_layer_input_gate", Kind.REPLICATED, tuple(every), H, (per,),
                             ("per_layer_input_gate",)),
                EngineModule("per_layer_projection", Kind.REPLICATED, tuple(every), per, (H,),
                             ("per_layer_projection",)),
                EngineModule("per_layer_model_projection", Kind.COLUMN, (), H,
                             (model.num_hidden_layers * per,), ("per_layer_model_projection",),
                             model_level=True)]
    return [m for m in out if m.layers or m.top_level]


# transformers' NemotronHConfig defaults for the Mamba-2 mixer's widths.
_MAMBA_DEFAULTS = (("mamba_num_heads", 128), ("mamba_head_dim", 64), ("n_groups", 8),
                   ("ssm_state_size", 128), ("conv_kernel", 4))


def _block_modules(model: ModelConfig, row: VllmFamily) -> list[EngineModule]:
    """nemotron_h.py NemotronHModel: each layer one block, its `mixer` of the layer's kind.
    Mamba-2 (layers/mamba/mamba_mixer2.py MambaMixer2): `in_proj` a MergedColumnParallelLinear
    of five slices (z and x, `mamba_num_heads * mamba_head_dim` each; B and C, `n_groups *
    ssm_state_size` each; dt, one per head), `conv1d` one of three over the kernel taps (x, B,
    C), both wrapped one LoRA slice per output slice (MergedColumnParallelLinearVariableSlice-
    WithLoRA), and `out_proj` row-parallel. Attention (NemotronHAttention): `qkv_proj` and
    `o_proj`. MLP (NemotronHMLP): `up_proj`, `down_proj`, non-gated. MoE (NemotronHMoE): its
    non-gated fused experts (one w13 slice), its `shared_experts` NemotronHMLP, and with
    `moe_latent_size` the experts' latent projections `fc1_latent_proj`/`fc2_latent_proj`
    (ReplicatedLinear); its `gate` takes no LoRA (lora/model_manager.py
    `_create_lora_modules` skips `mixer.gate` on a non-gated MoE)."""
    H, hd = model.hidden_size, model.head_dim
    on = {kind: tuple(i for i, t in enumerate(model.layer_types) if t is kind) for kind in
          (LayerType.LINEAR_ATTENTION, LayerType.MLP, LayerType.MOE)}
    mamba, mlp, moe = on[LayerType.LINEAR_ATTENTION], on[LayerType.MLP], on[LayerType.MOE]
    w = {key: config_width(model, key, default) for key, default in _MAMBA_DEFAULTS}
    inner = w["mamba_num_heads"] * w["mamba_head_dim"]
    groups = w["n_groups"] * w["ssm_state_size"]
    q = model.num_attention_heads * hd
    ffn = model.intermediate_size
    out = [EngineModule("mixer.in_proj", Kind.COLUMN, mamba, H,
                        (inner, inner, groups, groups, w["mamba_num_heads"]), ("in_proj",)),
           EngineModule("mixer.conv1d", Kind.COLUMN, mamba, w["conv_kernel"],
                        (inner, groups, groups), ("conv1d",)),
           EngineModule("mixer.out_proj", Kind.ROW, mamba, inner, (H,), ("out_proj",)),
           EngineModule("mixer.qkv_proj", Kind.QKV, tuple(model.attention_layers), H, (q,),
                        row.packs("qkv_proj"), head_dim=hd, kv_heads=model.num_key_value_heads),
           EngineModule("mixer.o_proj", Kind.ROW, tuple(model.attention_layers), q, (H,),
                        ("o_proj",)),
           EngineModule("mixer.up_proj", Kind.COLUMN, mlp, H, (ffn,), ("up_proj",)),
           EngineModule("mixer.down_proj", Kind.ROW, mlp, ffn, (H,), ("down_proj",))]
    if moe:
        raw = raw_text_config(model)
        latent = config_width(model, "moe_latent_size", 0) if raw.get("moe_latent_size") \
            else 0
        out.append(EngineModule("mixer.experts", Kind.EXPERTS_UP, moe, latent or H,
                                (model.expert_intermediate_size,), ("experts",),
                                experts=model.num_experts))
        # transformers' NemotronHConfig: one shared expert unless the config says otherwise.
        if raw.get("n_shared_experts", 1):
            shared = config_width(model, "moe_shared_expert_intermediate_size", 7688) * \
                config_width(model, "n_shared_experts", 1)
            out += [EngineModule("mixer.shared_experts.up_proj", Kind.COLUMN, moe, H, (shared,),
                                 ("up_proj",)),
                    EngineModule("mixer.shared_experts.down_proj", Kind.ROW, moe, shared, (H,),
                                 ("down_proj",))]
        if latent:
            out += [EngineModule("mixer.fc1_latent_proj", Kind.REPLICATED, moe, H, (latent,),
                                 ("fc1_latent_proj",)),
                    EngineModule("mixer.fc2_latent_proj", Kind.REPLICATED, moe, latent, (H,),
                                 ("fc2_latent_proj",))]
    V = model.vocab_size
    out += [EngineModule("embed_tokens", Kind.EMBEDDING, (), V, (H,), ("embed_tokens",)),
            EngineModule("lm_head", Kind.LOGITS, (), H, (V,), ("lm_head",))]
    return [m for m in out if m.layers or m.top_level]


def _moe_layers(model: ModelConfig, row: VllmFamily) -> tuple[int, ...]:
    """The layers vLLM builds routed experts on: ModelConfig's, or where the row names a step
    key, every layer `(i + 1) % step == 0` (none for a step of 0; transformers' default 1)."""
    if not row.moe_step or not model.num_experts:
        return tuple(model.moe_layers)
    step = raw_text_config(model).get(row.moe_step, 1)
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise FormatError(f"{model.source or 'config'}: {row.moe_step!r} is not a count")
    return tuple(i for i in range(model.num_hidden_layers) if step and (i + 1) % step == 0)


def expected_names(modules: list[EngineModule]) -> set[str]:
    """The leaf names vLLM accepts in an adapter's tensor names for this model."""
    return {n for m in modules for n in m.adapter_names}


# -- memory ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Memory:
    """vLLM's LoRA allocation on one GPU for a model and flags."""

    model: ModelConfig
    flags: Flags
    # (module, bytes over its layers) for every wrapped module.
    per_module: list[tuple[EngineModule, int]]
    host_cache_bytes: int
    budget_bytes: int | None = None

    @classmethod
    def of(cls, model: ModelConfig, flags: Flags, adapters: list[AdapterReport] | None = None,
           budget_bytes: int | None = None) -> Memory:
        elem = DTYPE_BYTES[flags.resolved_lora_dtype(model)]
        if family(model).blocks and flags.tp > 1 and \
                config_width(model, "n_groups", dict(_MAMBA_DEFAULTS)["n_groups"]) % flags.tp:
            # mamba_mixer2.py: in_proj and conv1d are then one ColumnParallelLinear whose
            # groups are repeated over the ranks (extra_groups_for_head_shards).
            raise UsageError(f"--engine vllm: metrale models vLLM {VERSION}'s Mamba-2 LoRA "
                             "layers where --tp divides n_groups only")
        wrapped = [m for m in engine_modules(model) if flags.wraps(m)]
        per_module = [(m, m.layer_bytes(flags.max_loras, flags.max_lora_rank, flags.tp,
                                        flags.fully_sharded, elem) * max(1, len(m.layers)))
                      for m in wrapped]
        if adapters:
            sizes = sorted((host_bytes(model, a, elem) for a in adapters), reverse=True)
            # The host cache holds up to max_cpu_loras adapters, each at its own ranks and
            # unsharded (every TP worker loads the whole adapter, then slices it).
            host = sum(sizes[: flags.cpu_loras])
        else:
            one = sum(m.adapter_elements(set(m.adapter_names), flags.max_lora_rank)
                      * max(1, len(m.layers)) for m in wrapped) * elem
            host = one * flags.cpu_loras
        refuse_absurd(f"vLLM {VERSION}", sum(b for _, b in per_module), host,
                      "--max-cpu-loras")
        return cls(model, flags, per_module, host, budget_bytes)

    @property
    def lora_bytes(self) -> int:
        return sum(b for _, b in self.per_module)

    @property
    def slot_bytes(self) -> int:
        """One adapter slot: every buffer's leading dimension is max_loras."""
        return self.lora_bytes // self.flags.max_loras

    @property
    def max_loras_fit(self) -> int | None:
        if self.budget_bytes is None:
            return None
        return self.budget_bytes // self.slot_bytes if self.slot_bytes else None

    def record(self) -> dict[str, Any]:
        rec: dict[str, Any] = {
            "name": NAME, "version": VERSION, "build": "gpu",
            "flags": self.flags.record(self.model), "lora_bytes": self.lora_bytes,
            "slot_bytes": self.slot_bytes, "host_cache_bytes": self.host_cache_bytes,
            "per_gpu": True,
            "modules": [{"module": m.path, "kind": m.kind.value, "layers": len(m.layers),
                         "bytes": b, "buffers": [[n, list(s)] for n, s in m.buffers(
                             self.flags.max_loras, self.flags.max_lora_rank, self.flags.tp,
                             self.flags.fully_sharded)]}
                        for m, b in self.per_module],
        }
        if self.budget_bytes is not None:
            rec["budget_bytes"] = self.budget_bytes
            rec["max_loras_fit"] = self.max_loras_fit
            rec["budget_left_bytes"] = self.budget_bytes - self.lora_bytes
        return rec


def host_bytes(model: ModelConfig, report: AdapterReport, elem_bytes: int) -> int:
    """Bytes one adapter takes in vLLM's host cache: every LoRA tensor of its file, cast to
    the LoRA dtype (vLLM keeps even weights it will not apply)."""
    tensors = report.adapter.header.tensors
    return sum(math.prod(t.shape) for t in tensors.values()) * elem_bytes
