"""SGLang 0.5.23's model as its LoRA code sees it: the per-family table, the pool a server
builds from its start-up adapters under its flags (flags.py), and the bytes of that pool's A
and B buffers per GPU. From configs only; read from SGLang 0.5.23's installed source
(`sglang/srt/lora/`, `sglang/srt/arg_groups/`) and checked against its own `LoRAMemoryPool`
running on CPU tensors (tests/test_engine_sglang_memory.py). `rules.py` holds the rules
that judge one adapter's config; this module turns them into what the engine behind the seam
(`SglangEngine` in __init__.py) answers: a verdict per load path, the launch line, the pool's
bytes.

How SGLang takes adapters, in order (lora_manager.py init_state, tokenizer_control_mixin.py),
each answered by `rules.judge_report` (`judgements`), never decided here:
1. `--lora-paths`: each through `_load_lora_adapter`; the first failure is
   `init_lora_adapters`' RuntimeError and the server never starts (`path="startup"`).
2. init_lora_shapes: the pool's targets (`--lora-target-modules`, else the start-up adapters'
   union) and max rank (`--max-lora-rank`, else their largest `r`): `rules.startup_pool`; a
   start-up adapter outside given targets stops the start.
3. Runtime `POST /load_lora_adapter`: against that pool (its `can_support`, then the load); a
   refusal is HTTP 400 with SGLang's text and the server keeps serving (`path="runtime"`).
4. Either path's first batch naming it: a pool-slot copy that raises takes the server down.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from metrale_cli.engines.sglang import rules
from metrale_cli.engines.sglang.flags import DEFAULT_LORA_BACKEND, Flags
from metrale_cli.engines.sglang.rules import VERSION, Judgement
from metrale_cli.engines.shared import (
    DTYPE_BYTES,
    divide,
    family_row,
    model_id,
    raw_text_config,
    refuse_absurd,
)
from metrale_cli.engines.verdict import EngineVerdict, Verdict
from metrale_cli.errors import UsageError
from metrale_cli.files.jsondoc import shown
from metrale_cli.model.config import ModelConfig

if TYPE_CHECKING:
    from metrale_cli.adapters.audit import AdapterReport

NAME = "sglang"


@dataclass(frozen=True)
class SglangFamily:
    """What SGLang 0.5.23 does for one `model_type` that changes its LoRA: one row per row of
    model/families.py FAMILIES (tests/test_engine_seam.py holds every engine's table to the
    same keys)."""

    model_type: str
    # The class SGLang's registry builds (sglang/srt/models/*.py `EntryClass`).
    architectures: tuple[str, ...]
    # "dense": the class defines no `get_hidden_dim`, so the pool takes SGLang's default dims
    # and stacking (lora/utils.py get_default_hidden_dim, get_stacked_multiply), which metrale
    # sizes. "moe": the same beside FusedMoE experts, whose MLP targets take per-expert 4-D
    # buffers (mem_pool.py init_buffers, `*_moe`), which metrale sizes too
    # (`moe_buffer_shapes`); a wrapper's own `get_hidden_dim` where metrale has read it
    # (`_WRAPPER_DIMS`). "hybrid": the class's own `get_hidden_dim` (models/nemotron_h.py):
    # metrale gives no bytes for them, but for a wrapper in `_WRAPPER_DIMS` (Gemma 4's).
    pool: str
    # "run": SGLang's own LoRA code was run on this family's PEFT adapters (tests); "source":
    # the answer comes from reading the source only.
    checked: str
    note: str = ""
    # The config class names SGLang registers no class for, so that it builds its Transformers
    # backend (model_loader/utils.py get_model_architecture, resolve_transformers_arch:
    # models/transformers.py TransformersForCausalLM) around the HF model (`hf_backbone`).
    transformers: tuple[str, ...] = ()
    # What `--lora-target-modules all` (or an adapter's string `all`/`all-linear`) resolves
    # to on this class, embeddings aside, where it is not the dense set (rules.DENSE_MODULES):
    # lora/utils.py auto_detect_lora_target_modules, the class's LinearBase leaves normalised
    # plus its own `supported_lora_modules` (those it bypasses normalisation for).
    all_targets: frozenset[str] | None = None
    # How the pool's bytes were checked where not as the verdicts (`checked`): "run", SGLang's
    # own LoRAMemoryPool was built over its own class for this family
    # (tests/test_engine_sglang_moe.py).
    pool_checked: str = ""


FAMILIES: dict[str, SglangFamily] = {f.model_type: f for f in (
    SglangFamily("llama", ("LlamaForCausalLM",), "dense", "run"),
    SglangFamily("mistral", ("MistralForCausalLM",), "dense", "run",
                 "models/mistral.py subclasses the Llama class"),
    SglangFamily("qwen2", ("Qwen2ForCausalLM",), "dense", "run"),
    SglangFamily("qwen3", ("Qwen3ForCausalLM",), "dense", "run"),
    SglangFamily("qwen3_moe", ("Qwen3MoeForCausalLM",), "moe", "source",
                 "routed experts take gate_up_proj_moe / down_proj_moe buffers per expert, "
                 "on every layer (SGLang's class reads no mlp_only_layers)", pool_checked="run"),
    SglangFamily("mixtral", ("MixtralForCausalLM",), "moe", "source",
                 "routed experts take gate_up_proj_moe / down_proj_moe buffers per expert",
                 pool_checked="run"),
    SglangFamily("qwen3_next", ("Qwen3NextForCausalLM",), "moe", "source",
                 "the class defines no get_hidden_dim: a Gated-DeltaNet target's pool raises "
                 "(get_default_hidden_dim has no in_proj_qkvz, in_proj_ba or out_proj); "
                 "attention at the default dims (the output gate not counted), routed experts "
                 "per expert and the shared expert 3-D on every layer", pool_checked="run"),
    # The text classes (models/qwen3_5_text.py, the registry's pick for a text config) define
    # no get_hidden_dim; the wrappers (models/qwen3_5.py) take the model's own
    # (`_WRAPPER_DIMS`).
    SglangFamily("qwen3_5", ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"),
                 "dense", "source",
                 "the text class: the default dims (a Gated-DeltaNet target's pool raises); "
                 "the wrapper: its own get_hidden_dim (qkv_proj with the query's gate, "
                 "out_proj at the value heads' width)", pool_checked="run"),
    SglangFamily("qwen3_5_moe", ("Qwen3_5MoeForCausalLM",
                                 "Qwen3_5MoeForConditionalGeneration"), "moe", "source",
                 "the text class: the default dims, routed and shared experts as qwen3_next; "
                 "the wrapper: its own get_hidden_dim (qkv_proj with the query's gate, "
                 "out_proj at the value heads' width)", pool_checked="run"),
    SglangFamily("gemma", ("GemmaForCausalLM",), "dense", "run"),
    SglangFamily("gemma2", ("Gemma2ForCausalLM",), "dense", "run"),
    SglangFamily("gemma3", ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"), "dense",
                 "run"),
    SglangFamily("granite", ("GraniteForCausalLM",), "dense", "run"),
    SglangFamily("olmo2", ("Olmo2ForCausalLM",), "dense", "run"),
    SglangFamily("olmo3", ("Olmo2ForCausalLM",), "dense", "run",
                 "configs/olmo3.py renames Olmo3ForCausalLM to the Olmo2 class"),
    SglangFamily("cohere", ("CohereForCausalLM",), "dense", "run"),
    SglangFamily("cohere2", ("Cohere2ForCausalLM",), "dense", "run"),
    SglangFamily("exaone4", ("Exaone4ForCausalLM",), "dense", "run"),
    # models/ernie4.py registers `Ernie4_5_ForCausalLM` (Llama-shaped: qkv_proj, gate_up_proj);
    # transformers' own class name, `Ernie4_5ForCausalLM`, gets the Transformers backend.
    SglangFamily("ernie4_5", ("Ernie4_5_ForCausalLM",), "dense", "run",
                 "Ernie4_5ForCausalLM: the Transformers backend", ("Ernie4_5ForCausalLM",)),
    SglangFamily("seed_oss", (), "dense", "run", "the Transformers backend",
                 ("SeedOssForCausalLM",)),
    SglangFamily("smollm3", (), "dense", "run", "the Transformers backend",
                 ("SmolLM3ForCausalLM",)),
    # models/ministral3.py registers Ministral3ForCausalLM only.
    SglangFamily("ministral", (), "dense", "run", "the Transformers backend",
                 ("MinistralForCausalLM",)),
    SglangFamily("qwen2_vl", ("Qwen2VLForConditionalGeneration",), "dense", "source"),
    SglangFamily("qwen2_5_vl", ("Qwen2_5_VLForConditionalGeneration",), "dense", "source"),
    SglangFamily("qwen3_vl", ("Qwen3VLForConditionalGeneration",), "dense", "source"),
    SglangFamily("qwen2_moe", ("Qwen2MoeForCausalLM",), "moe", "source",
                 "routed experts take gate_up_proj_moe / down_proj_moe buffers per expert, "
                 "the shared expert 3-D ones; its gate (a torch Linear) takes no LoRA",
                 pool_checked="run"),
    SglangFamily("olmoe", ("OlmoeForCausalLM",), "moe", "source",
                 "routed experts take gate_up_proj_moe / down_proj_moe buffers per expert",
                 pool_checked="run"),
    SglangFamily("glm4_moe", ("Glm4MoeForCausalLM",), "moe", "source",
                 "routed experts take gate_up_proj_moe / down_proj_moe buffers per expert, "
                 "the dense first layers and the shared experts 3-D ones", pool_checked="run"),
    SglangFamily("starcoder2", ("Starcoder2ForCausalLM",), "dense", "source"),
    SglangFamily("gpt_oss", ("GptOssForCausalLM",), "moe", "source",
                 "routed experts take gate_up_proj_moe / down_proj_moe buffers per expert",
                 pool_checked="run"),
    SglangFamily("deepseek_v2", ("DeepseekV2ForCausalLM",), "moe", "source",
                 "multi-head latent attention (fused_qkv_a_proj_with_mqa, q_b_proj, kv_b_proj); "
                 "routed experts per expert, the dense first layers and the shared experts 3-D",
                 pool_checked="run"),
    SglangFamily("deepseek_v3", ("DeepseekV3ForCausalLM",), "moe", "source",
                 "multi-head latent attention (fused_qkv_a_proj_with_mqa, q_b_proj, kv_b_proj); "
                 "routed experts per expert, the dense first layers and the shared experts 3-D",
                 pool_checked="run"),
    SglangFamily("phi3", ("Phi3ForCausalLM",), "dense", "run",
                 "models/llama.py's Phi3ForCausalLM; a checkpoint-fused qkv_proj or "
                 "gate_up_proj A is stacked once per slice (lora.py normalize_qkv_proj)"),
    SglangFamily("glm4", ("Glm4ForCausalLM",), "dense", "run"),
    SglangFamily("granitemoe", ("GraniteMoeForCausalLM",), "moe", "source",
                 "routed experts take gate_up_proj_moe / down_proj_moe buffers per expert",
                 pool_checked="run"),
    SglangFamily("phimoe", ("PhiMoEForCausalLM",), "moe", "source",
                 "routed experts take gate_up_proj_moe / down_proj_moe buffers per expert",
                 pool_checked="run"),
    SglangFamily("llama4", ("Llama4ForCausalLM", "Llama4ForConditionalGeneration"), "moe",
                 "source", "routed experts per expert as qwen3_moe; a gate_up_proj / "
                 "down_proj pool raises (its dense and shared-expert linears get no buffer); "
                 "the wrapper (models/mllama4.py): its own get_hidden_dim, attention alone",
                 pool_checked="run"),
    # Its verdicts are the generic rules' (a q_proj without v_proj on a layer, as PEFT's
    # gemma4 adapters have on keys-as-values and KV-shared layers, fails lora.py
    # normalize_qkv_proj); a full layer's q/k/v/o wider than the wrapper's buffers is not judged.
    SglangFamily("gemma4", ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"), "hybrid",
                 "source", "models/gemma4_mm.py's wrapper defines its own get_hidden_dim, every "
                 "layer at head_dim (the full-attention layers' global_head_dim is not its "
                 "width): attention alone, and only where the full layers' widths are the "
                 "others'; models/gemma4_causal.py's text class marks supports_lora = False",
                 pool_checked="run"),
    SglangFamily("nemotron_h", ("NemotronHForCausalLM", "NemotronHPuzzleForCausalLM"), "hybrid",
                 "source", "the class defines its own get_hidden_dim, by block kind (a MoE "
                 "block's up_proj/down_proj are its shared expert's)",
                 # models/nemotron_h.py NemotronHForCausalLM.supported_lora_modules (its
                 # leaves, in_proj/out_proj/up_proj/down_proj/qkv_proj/o_proj, and FusedMoE's
                 # gate_up_proj, are among them): with `all` the MLP blocks' and the shared
                 # experts' up_proj get their own buffers (get_hidden_dim "up_proj"); a
                 # normalised up_proj target is gate_up_proj, which neither is.
                 all_targets=frozenset({"qkv_proj", "o_proj", "out_proj", "in_proj", "up_proj",
                                        "gate_up_proj", "down_proj", "fc1_latent_proj",
                                        "fc2_latent_proj"})),
)}


def family(model: ModelConfig) -> SglangFamily:
    """The row for `model`'s family; a family without one is refused, never guessed."""
    return family_row(FAMILIES, model, f"SGLang {VERSION}", "engines/sglang/model.py FAMILIES")


def hf_backbone(model: ModelConfig) -> bool:
    """Whether SGLang builds its Transformers backend for `model`: its config names a class
    SGLang registers none of (its row's `transformers`), and none it registers (a class of
    `architectures` wins: get_model_architecture's `is_native_supported`). Its pool is the
    dense one (TransformersForCausalLM defines no get_hidden_dim); its LoRA is
    `rules.hf_backbone_judgement`'s."""
    row = family(model)
    named = {a for a in model.architectures or () if isinstance(a, str)}  # a list: no name
    return bool(named & set(row.transformers)) and not named & set(row.architectures)


# lora/utils.py EMBEDDING_NAMES, in the order init_buffers allocates their pairs.
EMBEDDINGS = ("embed_tokens", "lm_head")
# lora/utils.py ROW_PARALLELISM_LINEAR_LORA_NAMES (the dense ones): A's input split over TP;
# REPLICATED_LINEAR_LORA_NAMES: neither split.
_ROW_PARALLEL = ("o_proj", "out_proj", "down_proj")
_REPLICATED = ("fused_qkv_a_proj_with_mqa",)
# How each module's buffers split over TP (the view's "kind").
_KINDS = {"qkv_proj": "column (qkv)", "gate_up_proj": "column", "o_proj": "row",
          "down_proj": "row", "embed_tokens": "embedding", "lm_head": "lm_head",
          "gate_up_proj_moe": "experts (column)", "down_proj_moe": "experts (row)",
          "fused_qkv_a_proj_with_mqa": "replicated (q_a, kv_a)", "q_b_proj": "column",
          "kv_b_proj": "column", "out_proj": "row"}
# The pool keys lora/utils.py get_default_hidden_dim gives widths for (a class without a
# get_hidden_dim of its own): out_proj is a Qwen3.5 wrapper's alone (`_WRAPPER_DIMS`).
_DEFAULT_DIMS = frozenset(_KINDS) - {"out_proj"}
# The wrappers whose own get_hidden_dim the pool reads (lora/utils.py get_hidden_dim prefers
# the model's): the pool keys each gives widths for; it raises NotImplementedError for any
# other. models/mllama4.py Llama4ForConditionalGeneration.get_hidden_dim: attention and a 3-D
# MLP (which init_buffers never asks for: Llama 4's config has no shared-expert key), no
# `_moe` key, no embeddings, its error without text. models/qwen3_5.py
# Qwen3_5ForCausalLM.get_hidden_dim (both wrappers' `self.model`): qkv_proj with the query's
# output gate (`attn_output_gate`, default true), out_proj from the value heads, the MLP, the
# experts and the embeddings at the default widths; its error names the module.
_WRAPPER_DIMS = {
    "llama4": frozenset({"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}),
    # models/gemma4_mm.py Gemma4ForConditionalGeneration.get_hidden_dim: attention at the
    # config's head_dim (`_gemma4_wrapper_error`: what it raises for the rest).
    "gemma4": frozenset({"qkv_proj", "o_proj"}),
    **dict.fromkeys(("qwen3_5", "qwen3_5_moe"), frozenset({
        "qkv_proj", "o_proj", "out_proj", "gate_up_proj", "down_proj", "gate_up_proj_moe",
        "down_proj_moe", "embed_tokens", "lm_head"})),
}
# The MLP targets init_buffers calls ambiguous: on a model with FusedMoE experts each takes a
# per-expert buffer (`<module>_moe`) and, where the config has shared experts, a 3-D one too.
_MLP = ("gate_up_proj", "down_proj")
# layers/vocab_parallel_embedding.py DEFAULT_VOCAB_PADDING_SIZE.
_VOCAB_PADDING = 64


@dataclass(frozen=True)
class Pool:
    """The pool a server builds (lora_manager.py init_lora_shapes): its max rank and its
    normalised target modules."""

    max_rank: int
    targets: frozenset[str]

    @classmethod
    def at_startup(cls, flags: Flags, model: ModelConfig,
                   configs: Iterable[Mapping[str, Any]]) -> Pool:
        """`rules.startup_pool` for the start-up adapters' configs under `flags`."""
        rank, targets = rules.startup_pool(configs, flags.max_lora_rank, flags.target_modules,
                                            tie_word_embeddings=model.tie_word_embeddings,
                                            all_targets=family(model).all_targets)
        return cls(rank, frozenset(targets))

    def rules(self) -> tuple[int, set[str]]:
        """As `rules.judge` takes a pool."""
        return self.max_rank, set(self.targets)

    def record(self) -> dict[str, Any]:
        return {"max_lora_rank": self.max_rank, "target_modules": sorted(self.targets)}


# -- memory ----------------------------------------------------------------------------------


def _divide(size: int, tp: int, what: str) -> int:
    return divide(size, tp, what, "SGLang")


def buffer_shapes(model: ModelConfig, module: str, rank: int, slots: int, tp: int,
                  ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The A and B buffers one GPU (TP rank 0) allocates for `module` on one layer, as
    mem_pool.py shapes them: get_lora_A_shape (N, r * c, in; a row-parallel module's `in`
    split over TP), get_lora_B_shape (N, out, r; a column-parallel module's `out` split over
    TP, `qkv_proj` keeping whole KV heads when TP exceeds them:
    _column_parallel_lora_b_per_rank_dim), and for the embedding and output head
    get_embedding_lora_A_shape / get_embedding_lora_B_shape (A (N, r, vocab or hidden),
    unsharded; the head's B (N, vocab rows, r): get_lm_head_lora_b_shard_size,
    `_lm_head_rows`). Dims are lora/utils.py get_default_hidden_dim's: `o_proj` at the
    config's `v_head_dim` where it has one (multi-head latent attention), its fused
    `q_a`/`kv_a` down-projection (`fused_qkv_a_proj_with_mqa`, replicated: neither split),
    `q_b_proj` and `kv_b_proj` from its ranks and per-head widths. A Qwen3.5 wrapper's own
    (`_WRAPPER_DIMS`): the query with its gate, `out_proj` from the value heads."""
    H, hd = model.hidden_size, _config_head_dim(model)
    heads, kv, inter, vocab = (model.num_attention_heads, model.num_key_value_heads,
                               model.intermediate_size, model.vocab_size)
    own = _wrapper_dims(model) or frozenset()
    q = model.q_width if "out_proj" in own else hd * heads
    if module == "embed_tokens":
        return (slots, rank, vocab), (slots, H, rank)
    if module == "lm_head":
        return (slots, rank, H), (slots, _lm_head_rows(model, tp), rank)
    rope, nope = model.qk_rope_head_dim, model.qk_nope_head_dim
    dims = {"qkv_proj": (H, q + 2 * hd * kv), "o_proj": ((model.v_head_dim or hd) * heads, H),
            "gate_up_proj": (H, 2 * inter), "down_proj": (inter, H),
            "out_proj": (model.linear_value_width, H)}
    if model.kv_lora_rank:
        dims |= {"fused_qkv_a_proj_with_mqa": (H, model.q_lora_rank + model.kv_lora_rank + rope),
                 "q_b_proj": (model.q_lora_rank, heads * (nope + rope)),
                 "kv_b_proj": (model.kv_lora_rank, heads * (nope + model.v_head_dim))}
    if module not in dims:
        raise UsageError(f"SGLang {VERSION}: no dense pool rule for {module!r}")
    d_in, d_out = dims[module]
    c = rules.STACKED.get(module, 1)
    if module in _REPLICATED:
        pass
    elif module in _ROW_PARALLEL:
        d_in = _divide(d_in, tp, module)
    elif module == "qkv_proj" and kv < tp:
        d_out = _divide(q, tp, module) + 2 * hd
    else:
        d_out = _divide(d_out, tp, module)
    return (slots, rank * c, d_in), (slots, d_out, rank)


def _has_shared_experts(model: ModelConfig) -> bool:
    """mem_pool.py init_buffers' `has_shared_experts`: the config's
    `shared_expert_intermediate_size` or `n_shared_experts` above 0. Llama 4's config has
    neither key (transformers' configuration_llama4.py; metrale's ModelConfig gives its
    shared expert `intermediate_size` wide)."""
    if model.model_type == "llama4":
        return False
    return model.shared_expert_intermediate_size > 0 or model.n_shared_experts > 0


def _mlp_width(model: ModelConfig, layer: int) -> int:
    """The width of the gate_up_proj / down_proj linears SGLang's class builds on `layer` of a
    MoE model, beside its FusedMoE experts (0: none), which mem_pool.py _dense_local_dim reads
    the 3-D buffers' widths from: llama4's dense MLP (intermediate_size_mlp) or its MoE
    layers' shared expert (intermediate_size) (models/llama4.py); a dense first layer
    (first_k_dense_replace: intermediate_size) or the shared experts after it
    (n_shared_experts x moe_intermediate_size) (models/deepseek_v2.py, glm4_moe.py); qwen2_moe's
    shared expert (models/qwen2_moe.py Qwen2MoeSparseMoeBlock; SGLang makes every layer
    sparse: Qwen2MoeDecoderLayer.stage_facts)."""
    if model.model_type == "llama4":
        return model.intermediate_size if model.is_moe_layer(layer) else (
            model.intermediate_size_mlp)
    if layer < model.first_k_dense_replace:
        return model.intermediate_size
    return model.shared_experts_width or model.shared_expert_intermediate_size


# Families whose SGLang class builds `mlp.shared_expert_gate` as a torch.nn.Linear (the
# ReplicatedLinear only on a CPU AMX engine): models/qwen2_moe.py Qwen2MoeSparseMoeBlock, which
# models/qwen3_next.py and qwen3_5.py build too.
_PLAIN_SHARED_GATE = frozenset({"qwen2_moe", "qwen3_next", "qwen3_5_moe"})


def _config_head_dim(model: ModelConfig) -> int:
    """The `head_dim` SGLang's LoRA pool reads off the config object (lora/utils.py
    get_default_hidden_dim): DeepSeek's config classes set it to `qk_rope_head_dim`
    whatever the file says (transformers' configuration_deepseek_v2.py, _v3.py
    `__post_init__`)."""
    if model.model_type in ("deepseek_v2", "deepseek_v3"):
        return model.qk_rope_head_dim
    return model.head_dim


def _pool_run(model: ModelConfig) -> bool:
    """Whether SGLang's pool over `model`'s class was run (`pool_checked`), so `pool_error`
    answers for it: a hybrid row's only on a wrapper in `_WRAPPER_DIMS`."""
    row = family(model)
    return bool(row.pool_checked) and (row.pool != "hybrid" or bool(_wrapper_dims(model)))


def _wrapper_dims(model: ModelConfig) -> frozenset[str] | None:
    """The pool keys a wrapper SGLang builds for `model` gives widths for (`_WRAPPER_DIMS`), or
    None where the class it builds takes the default dims."""
    return _WRAPPER_DIMS.get(model.model_type) if model.composite else None


def _pool_keys(model: ModelConfig, targets: Iterable[str]) -> list[str]:
    """mem_pool.py init_buffers' keys for `targets`: on a MoE model gate_up_proj and down_proj
    take per-expert buffers (`_moe`), and 3-D ones only where the config has shared experts."""
    keys = []
    for m in sorted(targets):
        if m in _MLP and model.num_experts:
            keys += [m, f"{m}_moe"] if _has_shared_experts(model) else [f"{m}_moe"]
        else:
            keys.append(m)
    return keys


# transformers' refusal of a per-layer attribute read off a heterogeneous config
# (integrations/heterogeneity/configuration_utils.py HeterogeneousConfigMixin.__getattribute__).
_PER_LAYER_HEAD_DIM = (
    "'head_dim' is a per-layer attribute and may vary across layers. Access it via the "
    "individual layer configs instead (e.g. config.per_layer_config[i].head_dim). To read the "
    "global config value from config.head_dim anyway, set `allow_global_per_layer_attribute_"
    "access` to `True` on the config. Warning: only do this if the caller can safely handle "
    "heterogeneous configs; code that assumes a homogeneous model may use the global value "
    "incorrectly.")


def _gemma4_wrapper_error(model: ModelConfig, targets: set[str]) -> tuple[str, str] | None:
    """What LoRAManager.init_state raises on Gemma 4's wrapper (models/gemma4_mm.py
    Gemma4ForConditionalGeneration) for a pool of `targets`, in its order: init_lora_modules
    builds a separate ParallelLMHead for a head tied to the embedding from the embedding's
    `org_vocab_size`, which Gemma's embedding has not; init_buffers asks the wrapper's
    get_hidden_dim for the embeddings, then each layered key in its set order: qkv_proj and
    o_proj read the config's `head_dim`, which transformers refuses on a config whose full
    layers differ (per_layer_config); gate_up_proj and down_proj assert one width over
    `set(config.intermediate_size)`, an int; any other key raises with no text."""
    if "lm_head" in targets and model.tie_word_embeddings:
        return ("AttributeError", "'Gemma3TextScaledWordEmbedding' object has no attribute "
                "'org_vocab_size': the head is tied to the embedding, so lora_manager.py "
                "init_lora_modules builds a ParallelLMHead from the embedding's org_vocab_size, "
                "which Gemma's embedding class has not")
    keys = [m for m in EMBEDDINGS if m in targets] + _pool_keys(
        model, (m for m in targets if m not in EMBEDDINGS))
    raised = {}
    for key in keys:
        if key in _MLP:
            raised.setdefault("TypeError", f"'int' object is not iterable: "
                              "models/gemma4_mm.py get_hidden_dim takes the config's "
                              f"intermediate_size for a list of per-layer widths ({key})")
        elif key in ("qkv_proj", "o_proj") and (
                model.global_head_width != model.head_dim
                or model.global_kv_heads != model.num_key_value_heads):
            raised.setdefault("AmbiguousGlobalPerLayerAttributeError", _PER_LAYER_HEAD_DIM +
                              ": the full layers' head width or KV heads differ "
                              "(per_layer_config), and models/gemma4_mm.py get_hidden_dim "
                              f"reads config.head_dim ({key})")
        elif key not in ("qkv_proj", "o_proj"):
            raised.setdefault("NotImplementedError", "(no text): models/gemma4_mm.py "
                              f"get_hidden_dim has no width for {key}")
        if key in EMBEDDINGS and raised:  # init_buffers' embeddings come first
            break
    if not raised:
        return None
    return (" or ".join(raised), "; ".join(f"{c}: {t}" if len(raised) > 1 else t
                                          for c, t in raised.items()) +
            (" (init_buffers raises at the first it meets)" if len(raised) > 1 else ""))


def pool_error(model: ModelConfig, targets: Iterable[str]) -> tuple[str, str] | None:
    """Why LoRAManager.init_state raises on a model for a pool of `targets` once its
    adapters have loaded (init_memory_pool, update_lora_info: the server never starts): the
    exception's class and SGLang's text, with what it means; or None."""
    targets = set(targets)
    if "shared_expert_gate" in targets and model.model_type in _PLAIN_SHARED_GATE:
        # init_lora_modules wraps every module named by a target, before the pool.
        return ("Exception", "No corresponding LoRA layer supported for <class "
                "'torch.nn.modules.linear.Linear'>.: SGLang builds the shared expert's gate "
                "as a plain torch Linear off a CPU engine (models/qwen2_moe.py "
                "Qwen2MoeSparseMoeBlock), which lora/layers.py get_lora_layer cannot wrap")
    own = _wrapper_dims(model)
    if model.model_type == "gemma4" and own is not None:
        return _gemma4_wrapper_error(model, targets)
    if own is not None:
        # The wrapper's own get_hidden_dim: init_buffers raises for any other key, whichever
        # its set order meets first.
        undimmed = [k for k in _pool_keys(model, targets) if k not in own]
        if undimmed and model.model_type == "llama4":
            return ("NotImplementedError", "(no text): models/mllama4.py "
                    "Llama4ForConditionalGeneration.get_hidden_dim gives widths for qkv_proj, "
                    "o_proj and a 3-D MLP alone, and mem_pool.py init_buffers asks it for " +
                    ", ".join(undimmed))
        if undimmed:
            return ("NotImplementedError", f"get_hidden_dim not implemented for {undimmed[0]}: "
                    "models/qwen3_5.py Qwen3_5ForCausalLM.get_hidden_dim (the wrapper's) has "
                    "no width for " + ", ".join(undimmed) +
                    " (init_buffers raises at the first of them it meets)")
        return None
    # lora/utils.py get_default_hidden_dim's modules (the class defines no get_hidden_dim):
    # init_buffers raises for any other, whichever of them its set order meets first.
    undimmed = sorted(targets - _DEFAULT_DIMS - set(EMBEDDINGS))
    if undimmed:
        return ("NotImplementedError", f"get_hidden_dim not implemented for {undimmed[0]}: "
                "SGLang's class for this model defines no get_hidden_dim, and lora/utils.py "
                "get_default_hidden_dim has no width for " + ", ".join(undimmed) +
                " (init_buffers raises at the first of them it meets)")
    if "q_b_proj" in targets and model.kv_lora_rank and not model.q_lora_rank:
        return ("TypeError", "zeros(): argument 'size' failed to unpack the object at pos 3 with "
                "error \"type must be tuple of ints,but got NoneType\": the config has no "
                "q_lora_rank (one q_proj, no q_b_proj), which lora/utils.py "
                "get_default_hidden_dim gives as q_b_proj's input width")
    dense = next((m for m in _MLP if m in targets), None)
    if dense is not None and model.num_experts and not _has_shared_experts(model) and any(
            _mlp_width(model, i) for i in range(model.num_hidden_layers)):
        return ("KeyError", f"'{dense}': SGLang wraps the model's dense MLP / shared-expert "
                f"{dense} linears but gives them no buffer (mem_pool.py init_buffers allocates "
                "a 3-D gate_up_proj / down_proj only when the config has "
                "shared_expert_intermediate_size or n_shared_experts; lora_manager.py "
                "update_lora_info then looks it up)")
    return None


def moe_buffer_shapes(model: ModelConfig, module: str, rank: int, slots: int, tp: int,
                      layer: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The A and B buffers one GPU allocates for pool key `module` on `layer` of a MoE model
    (mem_pool.py init_buffers over SGLang's class, expert parallelism 1): a per-expert
    `gate_up_proj_moe` / `down_proj_moe` (get_lora_A_shape / get_lora_B_shape: (N, E, r * c,
    in) and (N, E, out, r), get_default_hidden_dim's `moe_intermediate_size or
    intermediate_size` split over the MoE TP group, which is TP); a 3-D gate_up_proj /
    down_proj at the layer's dense MLP or shared-expert width (`_mlp_width`, split over TP);
    attention as on a dense model (`buffer_shapes`)."""
    H, E = model.hidden_size, model.num_experts
    if module.endswith("_moe"):
        inter = _divide(model.expert_intermediate_size, tp, module)
        if module == "gate_up_proj_moe":
            return (slots, E, 2 * rank, H), (slots, E, 2 * inter, rank)
        return (slots, E, rank, inter), (slots, E, H, rank)
    if module in _MLP:
        width = _divide(_mlp_width(model, layer), tp, module)
        if module == "gate_up_proj":
            return (slots, 2 * rank, H), (slots, 2 * width, rank)
        return (slots, rank, width), (slots, H, rank)
    return buffer_shapes(model, module, rank, slots, tp)


def _lm_head_rows(model: ModelConfig, tp: int) -> int:
    """The output head's rows on TP rank 0, as its LoRA B takes them: the base ParallelLMHead's
    `shard_indices.num_org_elements` (layers/vocab_parallel_embedding.py: the vocabulary padded
    to 64, or to 64 * tp when that does not split over tp, rank 0's share of it, padding
    removed). Under TP 1, or with tied embeddings (the head is then the embedding module, no
    ParallelLMHead for mem_pool.py to find), the whole vocabulary."""
    vocab = model.vocab_size
    if tp == 1 or model.tie_word_embeddings:
        return vocab
    pad = _VOCAB_PADDING if (-(-vocab // _VOCAB_PADDING) * _VOCAB_PADDING) % tp == 0 \
        else _VOCAB_PADDING * tp
    return min(-(-vocab // pad) * pad // tp, vocab)


@dataclass(frozen=True)
class Memory:
    """SGLang's LoRA pool on one GPU for a model, flags and the pool they make."""

    model: ModelConfig
    flags: Flags
    pool: Pool
    # (module, layers, copies of each layer's pair, A shape, B shape, bytes in all), per
    # target module.
    per_module: list[tuple[str, int, int, tuple[int, ...], tuple[int, ...], int]]
    # Adapters held in CPU memory (--max-loaded-loras of them, else every start-up one).
    host_bytes: int
    budget_bytes: int | None = None

    @classmethod
    def of(cls, model: ModelConfig, flags: Flags, pool: Pool,
           adapters: list[AdapterReport] | None = None,
           budget_bytes: int | None = None) -> Memory:
        row = family(model)
        if row.pool not in ("dense", "moe") and _wrapper_dims(model) is None:
            raise UsageError(
                f"--engine sglang: SGLang {VERSION} sizes the LoRA pool of a {row.model_type} "
                f"model ({row.pool}) from its model class "
                f"({row.note}); metrale sizes the dense and MoE families (" +
                ", ".join(f for f, r in FAMILIES.items() if r.pool in ("dense", "moe")) + ")")
        moe = row.pool == "moe"
        # The rows run over SGLang's own class (`pool_checked`): what stops their start.
        failed = pool_error(model, pool.targets) if _pool_run(model) else None
        if failed is not None:
            raise UsageError(f"--engine sglang: SGLang {VERSION} never starts with this pool "
                             f"({failed[0]}: {failed[1]})")
        elem = DTYPE_BYTES[flags.model_dtype(model)]
        per_module = []
        # mem_pool.py init_buffers: the embedding and head pairs, then every other target's
        # A and B per layer (`_pool_keys`).
        layered = sorted(_pool_keys(model, (m for m in pool.targets if m not in EMBEDDINGS)))
        order = [m for m in EMBEDDINGS if m in pool.targets] + layered
        # With both targeted, each of init_buffers' two embedding tables (embedding_A/B_buffer
        # and lm_head_A/B_buffer) takes a pair for every one of embed_tokens and lm_head
        # (init_embedding_buffer allocates `target_modules & EMBEDDING_NAMES` into each), and
        # only one pair of each is ever read (get_embedding_tensor): both pairs twice over.
        copies = 2 if set(EMBEDDINGS) <= pool.targets else 1
        slots, rank, tp = flags.max_loras_per_batch, pool.max_rank, flags.tp
        for module in order:
            if module in EMBEDDINGS or not moe:
                a, b = buffer_shapes(model, module, rank, slots, tp)
                layers, n = (1, copies) if module in EMBEDDINGS else (model.num_hidden_layers, 1)
                per_module.append((module, layers, n, a, b,
                                   (math.prod(a) + math.prod(b)) * elem * layers * n))
                continue
            # Every layer takes the key's pair (init_buffer: `for idx in range(num_layer)`),
            # each at its own layer's widths; the record shows layer 0's.
            shapes = [moe_buffer_shapes(model, module, rank, slots, tp, i)
                      for i in range(model.num_hidden_layers)]
            per_module.append((module, len(shapes), 1, *shapes[0],
                               sum(math.prod(a) + math.prod(b) for a, b in shapes) * elem))
        sizes = sorted((_file_bytes(r) for r in adapters or []), reverse=True)
        held = sizes if flags.max_loaded_loras is None else sizes[:flags.max_loaded_loras]
        refuse_absurd(f"SGLang {VERSION}", sum(b for *_, b in per_module), sum(held),
                      "--max-loaded-loras")
        return cls(model, flags, pool, per_module, sum(held), budget_bytes)

    @property
    def lora_bytes(self) -> int:
        return sum(b for *_, b in self.per_module)

    @property
    def slot_bytes(self) -> int:
        """One slot: every buffer's leading dimension is --max-loras-per-batch."""
        return self.lora_bytes // self.flags.max_loras_per_batch

    @property
    def max_loras_fit(self) -> int | None:
        if self.budget_bytes is None or not self.slot_bytes:
            return None
        return self.budget_bytes // self.slot_bytes

    def record(self) -> dict[str, Any]:
        rec: dict[str, Any] = {
            "name": NAME, "version": VERSION, "flags": self.flags.record(self.model),
            "pool": self.pool.record(), "lora_bytes": self.lora_bytes,
            "slot_bytes": self.slot_bytes, "host_cache_bytes": self.host_bytes,
            "per_gpu": True,
            "checked": family(self.model).pool_checked or family(self.model).checked,
            "modules": [{"module": m, "kind": _KINDS[m], "layers": n, "copies": c,
                         "bytes": b, "buffers": [["A", list(a)], ["B", list(bb)]]}
                        for m, n, c, a, bb, b in self.per_module],
        }
        if self.budget_bytes is not None:
            rec["budget_bytes"] = self.budget_bytes
            rec["max_loras_fit"] = self.max_loras_fit
            rec["budget_left_bytes"] = self.budget_bytes - self.lora_bytes
        return rec


def _file_bytes(report: AdapterReport) -> int:
    """What an adapter holds in CPU memory once loaded: every tensor of its file as stored
    (lora.py LoRAAdapter.initialize_weights keeps `loaded_weight.cpu()`, no cast)."""
    return sum(t.end - t.begin for t in report.adapter.header.tensors.values())


# -- verdicts per load path --------------------------------------------------------------------


def judgements(report: AdapterReport, model: ModelConfig, flags: Flags,
               ) -> dict[str, Judgement]:
    """The rules' judgement (`rules.judge_report`) of the adapter on each load path: at
    start-up against the pool a start-up naming it builds under `flags` (the other start-up
    adapters can only widen a pool the flags do not fix, which changes none of its checks), at
    runtime against the running pool (`flags.pool`, else the one it builds alone)."""
    alone = Pool.at_startup(flags, model, [report.adapter.config.raw])
    backend = {"hf_backbone": hf_backbone(model), "lora_backend": flags.lora_backend}
    startup = rules.judge_report(report, model, pool=alone.rules(), path="startup", **backend)
    # Once its adapters load, a start-up builds the pool (init_memory_pool) and points the
    # wrapped modules at it (update_lora_info): a pool SGLang cannot build stops it there.
    failed = pool_error(model, alone.targets) if _pool_run(model) else None
    if failed is not None and startup.accepted:
        startup = Judgement(False, *failed, reason_class="pool_build", path="startup")
    return {"startup": startup,
            "runtime": rules.judge_report(report, model, pool=(flags.pool or alone).rules(),
                                           path="runtime", **backend)}


# A stacked part's tensor name, as SGLang's KeyError gives it.
_FUSED_PART = re.compile(r"layers\.(\d+)\.(?:[\w.]*\.)?([kv]_proj)\.lora_[AB]\.weight")


def _in_words(got: Judgement) -> str:
    """What SGLang's text leaves unsaid, where it is a bare tensor name (its KeyError when a
    layer's q_proj cannot be stacked: lora.py normalize_qkv_proj): empty elsewhere."""
    found = _FUSED_PART.search(got.error) if got.reason_class == "fused_part_missing" else None
    if found is None:
        return ""
    layer, missing = found.groups()
    return (f": layer {layer} has q_proj without {missing}, and SGLang stacks each layer's "
            "q_proj, k_proj and v_proj into one qkv_proj, which needs v_proj beside q_proj "
            "(and k_proj where the layer has any)")


def reason(got: Judgement) -> str:
    """A judgement in words: what the server does, and SGLang's own text where it raises (in
    words where that text is a bare tensor name)."""
    v = got.verdict
    if v is Verdict.FAILS_STARTUP:
        return (f"naming it in --lora-paths stops the server from starting ({got.error_type}: "
                f"{got.error}){_in_words(got)}")
    if v is Verdict.REFUSES:
        return (f"POST /load_lora_adapter answers HTTP 400 ({got.error}){_in_words(got)}; the "
                "server keeps serving the base model and every other adapter")
    if v is Verdict.CRASHES:
        loads = ("named in --lora-paths it loads" if got.path == "startup"
                 else "POST /load_lora_adapter loads it")
        if got.reason_class == "hf_backbone_forward":
            # The GPU kernels' bare assert has no text: its line says what failed.
            raised = (f"{got.batch_error_type}: {got.batch_error}" if got.batch_error else
                      f"{got.batch_error_type} (assert len(x.shape) == 2)")
            return (f"{loads}, and the first forward pass fails: SGLang builds its "
                    "Transformers backend for this model (no class of its own), whose "
                    "LoRA-wrapped o_proj/down_proj (RowParallelLinearWithLoRA) are handed HF's "
                    "(1, tokens, hidden) input where SGLang's LoRA kernels take (tokens, "
                    f"hidden): the kernel raises {raised}, "
                    "taking the scheduler and the server down whatever adapter the batch "
                    "names")
        return (f"{loads}, and the first batch naming it fails copying it into a pool slot "
                f"(mem_pool.py load_lora_weight_to_buffer raises {got.batch_error_type}: "
                f"{got.batch_error}), taking the scheduler and the server down")
    if v is Verdict.IGNORES:
        return "loads and changes nothing: " + "; ".join(got.differs)
    if v is Verdict.DIFFERS:
        return "loads and serves otherwise than PEFT: " + "; ".join(got.differs)
    return "loads and applies every module at PEFT's scale (lora_alpha / r)"


def starts(got: Judgement) -> bool:
    """Whether a start-up judgement leaves the adapter on the launch line: the server starts
    with it and its first batch does not take it down."""
    return got.verdict in (Verdict.SERVES, Verdict.DIFFERS, Verdict.IGNORES)


def model_support(model: ModelConfig) -> tuple[str, str] | None:
    """Why SGLang cannot start on `model` whatever the adapters, or None: a text-only gemma4
    config with per-layer widths (below), or no model class to pick. SGLang reads the
    config's `architectures[0]` before it picks a model class: none at all (or null) is a
    TypeError in configs/model_config.py `ModelConfig.__init__` (`self.hf_config.
    architectures[0] in mm_disabled_models`), an empty list an IndexError as the config is
    loaded (utils/hf_transformers/config.py `HFConfigParser.parse`: `config.architectures[0]
    == "Phi4MMForCausalLM"`); either stops the server starting. A preset names none: its
    family's own class."""
    if model.family.global_attention and not model.composite and (
            model.global_head_width != model.head_dim
            or model.global_kv_heads != model.num_key_value_heads):
        # A text-only gemma4 config whose full layers differ (transformers' per_layer_config):
        # under SGLang's transformers 5.19 a per-layer attribute read off the whole config
        # raises; the wrapper's config (text settings under text_config) does not.
        return ("per_layer_config", "AmbiguousGlobalPerLayerAttributeError: the full-attention "
                "layers' head_dim and KV heads differ from the sliding layers' (per_layer_config), "
                "and SGLang reads every key of a text config off the config object "
                "(utils/hf_transformers/config.py HFConfigParser.parse: `hasattr(config, key)`), "
                "which transformers refuses for a per-layer attribute; the server never starts "
                "(the gemma4 wrapper's config, text settings under text_config, does)")
    odd = next((a for a in model.architectures or () if isinstance(a, (list, dict))), None)
    if odd is not None:
        return ("architecture", f"the config's `architectures` holds {shown(odd)}, not a "
                "class name: SGLang cannot pick a model class by it (models/registry.py "
                "`_normalize_archs` looks each entry up in a dict: a TypeError); the server "
                "never starts")
    if model.architectures is None or model.architectures:
        return None
    if raw_text_config(model).get("architectures") is None:
        return ("architecture", "TypeError: 'NoneType' object is not subscriptable: the "
                "config has no `architectures`, which SGLang indexes to pick its model class "
                "(configs/model_config.py ModelConfig.__init__); the server never starts")
    return ("architecture", "IndexError: list index out of range: the config's "
            "`architectures` is empty, and SGLang indexes it as it loads the config "
            "(utils/hf_transformers/config.py HFConfigParser.parse); the server never starts")


def verdict_of(report: AdapterReport, model: ModelConfig, flags: Flags,
               flags_source: str = "given") -> EngineVerdict:
    """The adapter on both of SGLang's load paths under `flags` (whose `pool` is the one its
    start-up adapters build), each the rules' judgement; `verdict` is the runtime path's. The
    rules were run against SGLang's own code for the families marked `checked: run`. On a
    model SGLang cannot start (`model_support`), `unsupported_model` on both paths."""
    pool = flags.pool or Pool.at_startup(flags, model, [report.adapter.config.raw])
    record = {**flags.record(model), "pool": pool.record()}
    unsupported = model_support(model)
    if unsupported is not None:
        cls, text = unsupported
        paths = {path: {"verdict": Verdict.UNSUPPORTED_MODEL.value, "reason": text,
                        "checked": "run"} for path in ("startup", "runtime")}
        return EngineVerdict(NAME, VERSION, Verdict.UNSUPPORTED_MODEL, text, cls, record,
                             flags_source, [], {}, paths)
    judged = judgements(report, model, flags)
    checked = family(model).checked
    paths = {path: {"verdict": got.verdict.value, "reason": reason(got), "checked": checked}
             for path, got in judged.items()}
    runtime = judged["runtime"]
    return EngineVerdict(NAME, VERSION, runtime.verdict, paths["runtime"]["reason"],
                         runtime.reason_class, record, flags_source, [], {}, paths)


# -- the launch line metrale recommends --------------------------------------------------------


@dataclass(frozen=True)
class Recommendation:
    """The launch flags for a set of adapters: every one SGLang starts with named in
    `--lora-paths` (by absolute path), the others left out with the reason."""

    flags: Flags
    model: ModelConfig
    lora_paths: list[tuple[str, str]]
    memory: Memory | None
    memory_note: str = ""
    shut_out: list[str] = field(default_factory=list)
    # Why SGLang never starts on the model (`model_support`): then no launch line.
    never_starts: str = ""

    def serve_line(self) -> str | None:
        f = self.flags
        if self.never_starts:
            return None
        if not self.lora_paths and (f.max_lora_rank is None or f.target_modules is None):
            return None  # SGLang refuses a LoRA server with nothing to size its pool from
        parts = ["python -m sglang.launch_server", "--model-path",
                 model_id(self.model, absolute=True), "--enable-lora"]
        if self.lora_paths:
            parts.append("--lora-paths " + " ".join(f"{n}={p}" for n, p in self.lora_paths))
        if f.max_lora_rank is not None:
            parts.append(f"--max-lora-rank {f.max_lora_rank}")
        if f.target_modules is not None:
            parts.append("--lora-target-modules " + " ".join(f.target_modules))
        parts.append(f"--max-loras-per-batch {f.max_loras_per_batch}")
        if f.max_loaded_loras is not None:
            parts.append(f"--max-loaded-loras {f.max_loaded_loras}")
        if f.lora_backend != DEFAULT_LORA_BACKEND:
            parts.append(f"--lora-backend {f.lora_backend}")
        if f.eviction_policy != "lru":
            parts.append(f"--lora-eviction-policy {f.eviction_policy}")
        if f.tp > 1:
            parts.append(f"--tp-size {f.tp}")
        if f.dtype != "auto":
            parts.append(f"--dtype {f.dtype}")
        return " ".join(parts)

    def record(self) -> dict[str, Any]:
        return {
            "flags": self.flags.record(self.model),
            "pool": self.flags.pool.record() if self.flags.pool else None,
            "serve": self.serve_line(),
            "lora_paths": [{"name": n, "path": p} for n, p in self.lora_paths],
            "lora_bytes": self.memory.lora_bytes if self.memory else None,
            "slot_bytes": self.memory.slot_bytes if self.memory else None,
            "host_cache_bytes": self.memory.host_bytes if self.memory else None,
            "memory_note": self.memory_note,
            "never_starts": self.never_starts or None,
            # Adapters the launch line leaves out, each with SGLang's reason.
            "shut_out": self.shut_out,
        }
