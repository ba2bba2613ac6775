"""The model families metrale knows, one row each: every fact that differs by `model_type`,
the modules its decoder layers carry among them.

A family is data. Its `modules` say, per LoRA-able projection of a decoder layer: the name PEFT
targets, the path inside the layer, `(out, in)` as named widths of the config, which layers
carry it, how TP splits it, and for a fused projection its slices. A new family with a known
vocabulary is one row here, a preset in model/config.py if it has one, and its tests; the config
parser, the audit, the layouts, the expert keys and PEFT's defaults all read this table
(docs/architecture.md). tests/test_families.py builds every row's model with transformers on the
meta device and fails on any module whose presence or shape differs from its row.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

# transformers-4 per-expert leaf names of the routed experts' projections, most families'.
EXPERT_LEAVES = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}


class Layers(str, Enum):
    """Which decoder layers carry a module (read by `LoraModule.applies_to_layer`)."""

    # Attention layers: full or sliding-window (not a hybrid's linear-attention layers).
    ATTENTION = "attention"
    # A hybrid's Gated-DeltaNet layers.
    LINEAR_ATTENTION = "linear_attention"
    # Every layer of a model without routed experts (its dense MLP).
    DENSE_MLP = "dense_mlp"
    # The layers whose MLP is dense in a model with routed experts too (deepseek's first
    # `first_k_dense_replace` layers): every layer that is not an MoE layer.
    DENSE_MLP_LAYERS = "dense_mlp_layers"
    # The layers with routed experts (`ModelConfig.is_moe_layer`): their shared expert's.
    MOE_LAYERS = "moe_layers"
    # A block-typed hybrid's MLP blocks (nemotron_h's `-` layers: an MLP and nothing else).
    MLP_BLOCKS = "mlp_blocks"
    # Layers computing their own keys and values: every layer but gemma4's last
    # `num_kv_shared_layers` (`ModelConfig.is_kv_shared_layer`), which reuse an earlier layer's
    # and so have no k_proj or v_proj (and, with use_double_wide_mlp, an MLP twice as wide).
    OWN_KV = "own_kv"
    SHARED_KV = "shared_kv"
    # Every decoder layer (gemma4's per-layer-input projections).
    EVERY = "every"
    # The layers `ModuleSpec.on_layers` lists: a family read from a checkpoint's own tensor
    # names (model/weights.py).
    LISTED = "listed"


class Split(str, Enum):
    """How tensor parallelism splits the base projection (layout/sharding.py)."""

    COLUMN = "column"  # output rows over the ranks; the LoRA A whole
    ROW = "row"  # input columns over the ranks; the LoRA B whole
    REPLICATED = "replicated"  # whole on every rank (MLA's q_a_proj, kv_a_proj_with_mqa)


@dataclass(frozen=True)
class ModuleSpec:
    """One LoRA-able projection of a family's decoder layer.

    `out` and `in_` name widths of a `ModelConfig` (its fields or properties: `hidden_size`,
    `q_width`, `kv_width`, `attn_width`, `intermediate_size`, `linear_value_width`); a fused
    projection's `out` names one width per slice, in the order the weight stacks them (phi3's
    `qkv_proj` is q|k|v), and its output is their sum. A family read from a checkpoint's weights
    gives a width the config does not name in elements (an int)."""

    name: str
    path: str
    out: tuple[str | int, ...]
    in_: str | int
    layers: Layers
    split: Split
    # A config field that must be non-zero for the module to exist (`needs`), or zero
    # (`unless`): MLA has q_a_proj/q_b_proj with a `q_lora_rank`, else one q_proj.
    needs: str = ""
    unless: str = ""
    on_layers: tuple[int, ...] = ()  # with Layers.LISTED
    # Only on layers of this `layer_types` kind: gemma4's sliding and full attention layers
    # differ in head width (`head_dim`, `global_head_dim`), so each has an entry.
    layer_type: str = ""

    @property
    def fused(self) -> bool:
        return len(self.out) > 1


def _attn(name: str, out: tuple[str, ...], in_: str = "hidden_size",
          split: Split = Split.COLUMN) -> ModuleSpec:
    return ModuleSpec(name, f"self_attn.{name}", out, in_, Layers.ATTENTION, split)


def _mlp(name: str, out: tuple[str, ...], in_: str = "hidden_size",
         split: Split = Split.COLUMN) -> ModuleSpec:
    return ModuleSpec(name, f"mlp.{name}", out, in_, Layers.DENSE_MLP, split)


Q_PROJ = _attn("q_proj", ("q_width",))
K_PROJ = _attn("k_proj", ("kv_width",))
V_PROJ = _attn("v_proj", ("kv_width",))
O_PROJ = _attn("o_proj", ("hidden_size",), "attn_width", Split.ROW)
GATE_PROJ = _mlp("gate_proj", ("intermediate_size",))
UP_PROJ = _mlp("up_proj", ("intermediate_size",))
DOWN_PROJ = _mlp("down_proj", ("hidden_size",), "intermediate_size", Split.ROW)
# The Gated-DeltaNet block's output projection, linear-attention value width to hidden. o_proj
# instead reads the attention head width and applies only to attention layers.
OUT_PROJ = ModuleSpec("out_proj", "linear_attn.out_proj", ("hidden_size",),
                      "linear_value_width", Layers.LINEAR_ATTENTION, Split.ROW)
# Fused projections (phi3, glm4): one LoRA pair spans every slice.
QKV_PROJ = _attn("qkv_proj", ("q_width", "kv_width", "kv_width"))
GATE_UP_PROJ = _mlp("gate_up_proj", ("intermediate_size", "intermediate_size"))

# starcoder2's MLP: no gate, one up projection (c_fc) and one down (c_proj).
C_FC = _mlp("c_fc", ("intermediate_size",))
C_PROJ = _mlp("c_proj", ("hidden_size",), "intermediate_size", Split.ROW)


def _shared(block: str, width: str, names: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")
            ) -> tuple[ModuleSpec, ...]:
    """An MoE layer's shared expert(s) under `block`: a dense MLP beside the routed experts, `width`
    wide (while the config gives it), whose projections PEFT names as a dense MLP's, so a plain
    `gate_proj` target reaches both (where PEFT does not rewrite it into expert LoRA). Gate and up
    split by columns under TP, down by rows."""
    return tuple(ModuleSpec(name, f"{block}.{name}", ("hidden_size",) if name == "down_proj"
                            else (width,), width if name == "down_proj" else "hidden_size",
                            Layers.MOE_LAYERS, Split.ROW if name == "down_proj" else Split.COLUMN,
                            needs=width) for name in names)


# Nemotron-H: each layer is one block (`mixer`) of one kind: Mamba-2, attention, an MLP
# (non-gated: up and down) or MoE. PEFT 0.21 refuses LoRA on a Mamba `out_proj`
# (_check_lora_target_modules_mamba), so the Mamba blocks carry no module of the pool.
_NEMOTRON_H = (*(ModuleSpec(m.name, f"mixer.{m.name}", m.out, m.in_, Layers.ATTENTION, m.split)
                 for m in (Q_PROJ, K_PROJ, V_PROJ, O_PROJ)),
               ModuleSpec("up_proj", "mixer.up_proj", ("intermediate_size",), "hidden_size",
                          Layers.MLP_BLOCKS, Split.COLUMN),
               ModuleSpec("down_proj", "mixer.down_proj", ("hidden_size",), "intermediate_size",
                          Layers.MLP_BLOCKS, Split.ROW))
# Llama 4's dense layers: a gated MLP under `feed_forward`, `intermediate_size_mlp` wide.
_LLAMA4 = (Q_PROJ, K_PROJ, V_PROJ, O_PROJ, *(
    ModuleSpec(m.name, f"feed_forward.{m.name}", tuple("intermediate_size_mlp" if w ==
                                                        "intermediate_size" else w for w in m.out),
               "intermediate_size_mlp" if m.in_ == "intermediate_size" else m.in_,
               Layers.DENSE_MLP_LAYERS, m.split) for m in (GATE_PROJ, UP_PROJ, DOWN_PROJ)))
# Gemma 4's per-layer input (PLE): each layer gates the hidden state down to the per-layer
# input's width and projects it back (vLLM's ReplicatedLinear: whole on every rank).
PER_LAYER_INPUT_GATE = ModuleSpec("per_layer_input_gate", "per_layer_input_gate",
                                  ("hidden_size_per_layer_input",), "hidden_size", Layers.EVERY,
                                  Split.REPLICATED, needs="hidden_size_per_layer_input")
PER_LAYER_PROJECTION = ModuleSpec("per_layer_projection", "per_layer_projection",
                                  ("hidden_size",), "hidden_size_per_layer_input", Layers.EVERY,
                                  Split.REPLICATED, needs="hidden_size_per_layer_input")


def _gemma4_attention() -> tuple[ModuleSpec, ...]:
    """Each attention module once per layer kind: sliding layers at `head_dim` and the KV
    heads, full layers at `global_head_dim` and their own KV heads; k_proj and v_proj only on
    layers computing their own KV, and no v_proj on full layers with attention_k_eq_v (k_proj's
    output is the values too)."""
    out = []
    for m, full_out, full_in in ((Q_PROJ, "global_attn_width", "hidden_size"),
                                 (K_PROJ, "global_kv_width", "hidden_size"),
                                 (V_PROJ, "global_kv_width", "hidden_size"),
                                 (O_PROJ, "hidden_size", "global_attn_width")):
        layers = Layers.OWN_KV if m in (K_PROJ, V_PROJ) else Layers.ATTENTION
        out += [ModuleSpec(m.name, m.path, m.out, m.in_, layers, m.split,
                           layer_type="sliding_attention"),
                ModuleSpec(m.name, m.path, (full_out,), full_in, layers, m.split,
                           unless="attention_k_eq_v" if m is V_PROJ else "",
                           layer_type="full_attention")]
    return tuple(out)


# Gemma 4's MLP, on every layer (beside the routed experts too): intermediate_size wide, twice
# that on the KV-shared layers with use_double_wide_mlp (`kv_shared_mlp_width`).
_GEMMA4_MLP = tuple(
    spec for m in (GATE_PROJ, UP_PROJ, DOWN_PROJ) for spec in (
        ModuleSpec(m.name, m.path, m.out, m.in_, Layers.OWN_KV, m.split),
        ModuleSpec(m.name, m.path, tuple("kv_shared_mlp_width" if w == "intermediate_size"
                                         else w for w in m.out),
                   "kv_shared_mlp_width" if m.in_ == "intermediate_size" else m.in_,
                   Layers.SHARED_KV, m.split)))
_GEMMA4 = (*_gemma4_attention(), *_GEMMA4_MLP, PER_LAYER_INPUT_GATE, PER_LAYER_PROJECTION)
# Multi-head latent attention (deepseek_v2/v3): a low-rank query (or one q_proj without
# q_lora_rank), the compressed KV and its up-projection, and o_proj over the heads' values.
MLA_Q_PROJ = ModuleSpec("q_proj", "self_attn.q_proj", ("mla_q_width",), "hidden_size",
                        Layers.ATTENTION, Split.COLUMN, unless="q_lora_rank")
Q_A_PROJ = ModuleSpec("q_a_proj", "self_attn.q_a_proj", ("q_lora_rank",), "hidden_size",
                      Layers.ATTENTION, Split.REPLICATED, needs="q_lora_rank")
Q_B_PROJ = ModuleSpec("q_b_proj", "self_attn.q_b_proj", ("mla_q_width",), "q_lora_rank",
                      Layers.ATTENTION, Split.COLUMN, needs="q_lora_rank")
KV_A_PROJ = _attn("kv_a_proj_with_mqa", ("mla_kv_a_width",), split=Split.REPLICATED)
KV_B_PROJ = _attn("kv_b_proj", ("mla_kv_b_width",), "kv_lora_rank")
MLA_O_PROJ = _attn("o_proj", ("hidden_size",), "mla_v_width", Split.ROW)
_DENSE_FIRST = tuple(ModuleSpec(m.name, m.path, m.out, m.in_, Layers.DENSE_MLP_LAYERS, m.split)
                     for m in (GATE_PROJ, UP_PROJ, DOWN_PROJ))
_MLA = (MLA_Q_PROJ, Q_A_PROJ, Q_B_PROJ, KV_A_PROJ, KV_B_PROJ, MLA_O_PROJ, *_DENSE_FIRST)

# The seed's eight, in the order a slot's entries follow: every seed family carries all eight
# (out_proj on no layer of a model without linear attention), so their layouts and pool images
# are what they were before families became data.
SEED_MODULES = (Q_PROJ, K_PROJ, V_PROJ, O_PROJ, GATE_PROJ, UP_PROJ, DOWN_PROJ, OUT_PROJ)
# The llama-like decoder layer: attention and a gated MLP, nothing else LoRA-able.
DENSE_MODULES = (Q_PROJ, K_PROJ, V_PROJ, O_PROJ, GATE_PROJ, UP_PROJ, DOWN_PROJ)
# Every module a family may declare: the `--modules` vocabulary (model/modules.py LoraModule).
VOCABULARY = (*SEED_MODULES, QKV_PROJ, GATE_UP_PROJ, Q_A_PROJ, Q_B_PROJ, KV_A_PROJ, KV_B_PROJ,
              C_FC, C_PROJ, PER_LAYER_INPUT_GATE, PER_LAYER_PROJECTION)


@dataclass(frozen=True)
class Family:
    model_type: str
    # A Gated-DeltaNet hybrid: linear- and full-attention layers (transformers' interval of 4
    # when the config gives neither), q_proj gated unless `attn_output_gate` is false.
    hybrid: bool = False
    # MoE layers follow `mlp_only_layers` and `decoder_sparse_step` (qwen3_moe's decoder
    # layers); otherwise, with routed experts, every layer is MoE.
    sparse_step: bool = False
    # Each layer is one block whose kind `layers_block_type` (or `hybrid_override_pattern`)
    # gives: Mamba-2 (linear attention), attention, MLP or MoE (nemotron_h); the list's length
    # is the layer count, and MoE layers are the MoE blocks.
    block_types: bool = False
    # PEFT's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING: what a config without
    # target_modules meant when it was trained (none for the MoE and hybrid types).
    peft_default_targets: tuple[str, ...] = ()
    # PEFT's default for the family's vision-language wrapper where its model_type has one of
    # its own (a regex over the whole model: gemma4's reaches the language model alone).
    peft_wrapper_targets: str = ""
    # PEFT >= 0.19 with transformers 5 rewrites gate/up/down targets into expert LoRA on this
    # type (PEFT 0.21's conversion table, checked against PEFT); only with routed experts.
    peft_rewrites_moe_targets: bool = True
    # The decoder layer's MoE block and its experts' projection leaves (transformers 4 names).
    moe_block: str = "mlp"
    expert_leaves: tuple[tuple[str, str], ...] = tuple(EXPERT_LEAVES.items())
    # The block holding transformers 5's fused experts (`experts.gate_up_proj`, `.down_proj`)
    # and router (`gate`), as PEFT's target_parameters name them: `mlp` on most families.
    fused_experts_block: str = "mlp"
    # The LoRA-able projections of a decoder layer, in slot order. A module whose path or
    # widths differ by layer (the dense MLP's gate_proj and the MoE layers' shared expert's) is
    # declared once per group of layers, the groups disjoint; it sits in the slot where its
    # first entry does.
    modules: tuple[ModuleSpec, ...] = SEED_MODULES
    # transformers' config-class defaults for keys a config.json may leave out, where they are
    # not metrale's (`head_dim` from `hidden_size / heads`, 0 for the rest): a value, or the
    # name of another key whose value it takes (deepseek's head_dim is its qk_rope_head_dim).
    config_defaults: tuple[tuple[str, int | str], ...] = ()
    # Where this family's vision-language wrapper keeps its language model (its decoder layers
    # are `<language_model>.layers.N`): `model.language_model` in transformers 5, llama4's
    # `language_model.model`.
    language_model: str = "model.language_model"
    # Why the expert pool cannot read this family's routed-expert LoRA (it reads gate and up
    # stacked, (E, out, in) experts): the experts' own layout, which it would misread; "" where
    # it reads it.
    experts_unreadable: str = ""
    # How a fused `gate_up_proj`'s 2I output columns hold gate and up: "stacked" (`[gate; up]`)
    # or "interleaved" (gate the even columns, up the odd: gpt_oss's `gate_up[..., ::2]`). PEFT
    # keeps the order in its lora_B's rows, so the expert pool reads gate and up rows with a
    # step of 2 there, and unpack writes them back so.
    experts_gate_up: str = "stacked"
    # Whether the router is `<moe_block>.gate`, the expert pool's router entry: False where no
    # adapter of the family has one (gpt_oss's router is `mlp.router`), so `layout --experts`
    # reserves none.
    expert_router: bool = True
    # PEFT swaps A's and B's roles on the fused experts: they are (E, in, out) without
    # transformers' `is_transposed` mark (llama4), so PEFT's in and out are the weight's out and
    # in: gate_up's A [E*r, 2I], B [H, E*r], the weight's delta per expert `A_e^T B_e^T`.
    experts_peft_swapped: bool = False
    # Full-attention layers with widths of their own: `global_head_dim` (or transformers'
    # `per_layer_config`) and, with attention_k_eq_v, `num_global_key_value_heads`; the last
    # layer always full attention, as transformers forces it (gemma4).
    global_attention: bool = False
    # A config key that must be true for the routed experts to exist, their sizes given or not
    # (gemma4's enable_moe_block).
    moe_flag: str = ""
    # Routed experts (transformers' modeling code): the config key counting them, "" for a
    # family without any (and for one read from weights: its experts are not read); the key
    # giving one expert's FFN width, `intermediate_size` where the experts are as wide as a
    # dense MLP (mixtral, olmoe, gpt_oss, granitemoe, phimoe, llama4). A count of 0 is a dense
    # model where transformers builds the experts only with `num_experts > 0`
    # (`experts_optional`: qwen2_moe, qwen3_moe, qwen3_next); elsewhere it builds every MoE
    # layer's block whatever the count, and a block of no experts routes a token nowhere.
    experts_key: str = ""
    expert_width: str = "moe_intermediate_size"
    experts_optional: bool = False
    # The other keys transformers' class reads as `experts_key` (its `attribute_map`: qwen3_moe's
    # `num_local_experts`, glm4_moe's): where a file gives both, the alias wins, as the class
    # sets its own field first and the alias over it.
    experts_aliases: tuple[str, ...] = ()
    # transformers' defaults for the keys sizing the routed experts and the shared expert beside
    # them, on an `experts_optional` family: applied only where the model has experts (the
    # count given or transformers' default), so a config of 0 experts reads as a dense one.
    expert_defaults: tuple[tuple[str, int], ...] = ()
    # The config key sizing the shared experts beside the routed ones, where the family has
    # them: `shared_expert_intermediate_size` (one MLP that wide) or `n_shared_experts` (that
    # many of `moe_intermediate_size`, one MLP); another family's class never reads either.
    shared_experts_key: str = ""

    def key_of(self, name: str) -> str:
        """The config key a `ModelConfig` field is read from: `experts_key` for the expert
        count, the one `config_defaults` takes it from where it names one (gemma4's
        `top_k_experts`), else its own."""
        if name == "num_experts" and self.experts_key:
            return self.experts_key
        alias = dict(self.config_defaults).get(name)
        return alias if isinstance(alias, str) else name


_Q_V = ("q_proj", "v_proj")
_PHI3 = (QKV_PROJ, O_PROJ, GATE_UP_PROJ, DOWN_PROJ)
# DeepseekV2Config's and DeepseekV3Config's defaults (transformers 5).
_MLA_DEFAULTS: tuple[tuple[str, int | str], ...] = (
    ("q_lora_rank", 1536), ("kv_lora_rank", 512), ("qk_nope_head_dim", 128),
    ("qk_rope_head_dim", 64), ("v_head_dim", 128), ("head_dim", "qk_rope_head_dim"))
_GLM4 = (Q_PROJ, K_PROJ, V_PROJ, O_PROJ, GATE_UP_PROJ, DOWN_PROJ)


def _dense(model_type: str, *targets: str, modules: tuple[ModuleSpec, ...] = DENSE_MODULES
           ) -> Family:
    return Family(model_type, peft_default_targets=targets, modules=modules)


FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", peft_default_targets=_Q_V),
    Family("mistral", peft_default_targets=_Q_V),
    Family("qwen2", peft_default_targets=_Q_V),
    Family("qwen3", peft_default_targets=_Q_V),
    # transformers builds its 128 experts where the config leaves the count out (0: dense).
    Family("qwen3_moe", sparse_step=True, experts_key="num_experts", experts_optional=True,
           experts_aliases=("num_local_experts",),
           expert_defaults=(("moe_intermediate_size", 768),),
           config_defaults=(("num_experts", 128), ("num_experts_per_tok", 8),
                            ("intermediate_size", 6144))),
    Family("mixtral", peft_default_targets=_Q_V, moe_block="block_sparse_moe",
           expert_leaves=(("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")),
           experts_key="num_local_experts", experts_aliases=("num_experts",),
           expert_width="intermediate_size",
           config_defaults=(("num_local_experts", 8), ("intermediate_size", 14336),
                            ("num_experts_per_tok", 2))),
    Family("qwen3_next", hybrid=True, sparse_step=True, experts_key="num_experts",
           shared_experts_key="shared_expert_intermediate_size", experts_optional=True,
           expert_defaults=(("moe_intermediate_size", 512),
                            ("shared_expert_intermediate_size", 512)),
           config_defaults=(("num_experts", 512), ("num_experts_per_tok", 10),
                            ("intermediate_size", 5632))),
    Family("qwen3_5", hybrid=True),
    Family("qwen3_5_moe", hybrid=True, peft_rewrites_moe_targets=False, experts_key="num_experts",
           shared_experts_key="shared_expert_intermediate_size",
           config_defaults=(("num_experts", 256), ("moe_intermediate_size", 512),
                            ("shared_expert_intermediate_size", 512),
                            ("num_experts_per_tok", 8))),
    # Dense, llama-like layers (sliding-window layers carry the same modules). gemma3 is the
    # text model of Gemma 3 (gemma3_text) and of its vision-language wrapper (gemma3).
    _dense("gemma", *_Q_V),
    _dense("gemma2", *_Q_V),
    _dense("gemma3", *_Q_V),
    _dense("granite"),
    _dense("olmo2"),
    _dense("olmo3"),
    _dense("cohere"),
    _dense("cohere2"),
    _dense("exaone4"),
    _dense("ernie4_5"),
    _dense("seed_oss"),
    _dense("smollm3"),
    _dense("ministral"),
    # The language models of vision-language wrappers (text settings under text_config, layers
    # under model.language_model.layers.N); mistral3's is mistral's, gemma3's is above.
    _dense("qwen2_vl"),
    _dense("qwen2_5_vl"),
    _dense("qwen3_vl"),
    # Attention (with biases) as llama's; a two-projection MLP (c_fc, c_proj, with biases).
    _dense("starcoder2", modules=(Q_PROJ, K_PROJ, V_PROJ, O_PROJ, C_FC, C_PROJ)),
    # Routed experts in transformers 5's fused layout (gate|up (E, 2I, H), down (E, H, I)) and
    # the router `mlp.gate`: the expert pool's, with --experts. qwen2_moe's layers in
    # mlp_only_layers (or off the sparse step) and glm4_moe's first ones have a dense MLP, the
    # MoE layers a shared expert (glm4_moe's `n_shared_experts` of them, one MLP) beside the
    # routed ones: gate/up/down of the slot pool on both. PEFT 0.21 adapts qwen2_moe's with a
    # plain gate_proj target; on glm4_moe it rewrites the target into expert LoRA and adapts
    # neither (an adapter made before the rewrite carries both). qwen2_moe's
    # `shared_expert_gate` ([1, hidden]) is not served: one output row, under the kernels'
    # 8-wide vector.
    Family("qwen2_moe", sparse_step=True, peft_rewrites_moe_targets=False,
           experts_key="num_experts", experts_optional=True,
           shared_experts_key="shared_expert_intermediate_size",
           modules=(Q_PROJ, K_PROJ, V_PROJ, O_PROJ, *_DENSE_FIRST,
                    *_shared("mlp.shared_expert", "shared_expert_intermediate_size")),
           config_defaults=(
               ("num_experts", 60), ("moe_intermediate_size", 1408),
               ("shared_expert_intermediate_size", 5632), ("num_experts_per_tok", 4),
               ("intermediate_size", 5632))),
    Family("olmoe", modules=(Q_PROJ, K_PROJ, V_PROJ, O_PROJ), experts_key="num_experts",
           experts_aliases=("num_local_experts",), expert_width="intermediate_size",
           config_defaults=(("num_experts", 64), ("intermediate_size", 2048),
                            ("num_experts_per_tok", 8))),
    Family("glm4_moe", modules=(Q_PROJ, K_PROJ, V_PROJ, O_PROJ, *_DENSE_FIRST,
                                *_shared("mlp.shared_experts", "shared_experts_width")),
           experts_key="n_routed_experts", experts_aliases=("num_local_experts",),
           shared_experts_key="n_shared_experts",
           config_defaults=(("n_routed_experts", 128), ("first_k_dense_replace", 1),
                            ("n_shared_experts", 1), ("moe_intermediate_size", 1408),
                            ("num_experts_per_tok", 8), ("intermediate_size", 10944))),
    # Every layer MoE (routed experts only, no dense MLP): the attention modules, with their
    # biases and sinks, are the slot pool's. Its fused experts store (E, in, out), marked
    # `is_transposed` so PEFT keeps A [E*r, in], B [out, E*r] as for (E, out, in) experts, and
    # interleave gate and up columns (B's rows): the expert pool reads them with --experts.
    Family("gpt_oss", peft_rewrites_moe_targets=False, modules=(Q_PROJ, K_PROJ, V_PROJ, O_PROJ),
           experts_gate_up="interleaved", expert_router=False, experts_key="num_local_experts",
           experts_aliases=("num_experts",), expert_width="intermediate_size",
           config_defaults=(("num_local_experts", 128), ("intermediate_size", 2880),
                            ("num_experts_per_tok", 4))),
    # Multi-head latent attention; dense MLPs on the first `first_k_dense_replace` layers, then
    # routed experts with shared experts beside them (`n_shared_experts` of them, one MLP): the
    # dense MLP's and the shared experts' gate/up/down are the slot pool's. PEFT 0.21 rewrites
    # gate/up/down targets into expert LoRA here and adapts neither; an adapter made before the
    # rewrite (transformers 4) carries both.
    # DeepseekV2Config has no default top-k (None: its router's topk fails).
    Family("deepseek_v2", modules=(*_MLA, *_shared("mlp.shared_experts", "shared_experts_width")),
           experts_key="n_routed_experts", experts_aliases=("num_experts",),
           shared_experts_key="n_shared_experts",
           config_defaults=(*_MLA_DEFAULTS, ("n_routed_experts", 64),
                            ("moe_intermediate_size", 1407), ("n_shared_experts", 2),
                            ("intermediate_size", 11008))),
    Family("deepseek_v3", modules=(*_MLA, *_shared("mlp.shared_experts", "shared_experts_width")),
           experts_key="n_routed_experts", experts_aliases=("num_local_experts",),
           shared_experts_key="n_shared_experts",
           config_defaults=(*_MLA_DEFAULTS, ("n_routed_experts", 256),
                            ("moe_intermediate_size", 2048), ("first_k_dense_replace", 3),
                            ("num_experts_per_tok", 8), ("n_shared_experts", 1),
                            ("intermediate_size", 18432))),
    # Mamba-2, attention, MLP and MoE blocks, one per layer: attention modules on the attention
    # blocks, up/down on the MLP blocks and on the MoE blocks' shared experts (non-gated,
    # `moe_shared_expert_intermediate_size` wide: a plain up_proj target reaches both); the MoE
    # blocks' non-gated routed experts are not served, nor the Mamba blocks' projections (PEFT
    # refuses out_proj). transformers' NemotronHConfig defaults.
    Family("nemotron_h", block_types=True, peft_default_targets=("q_proj", "k_proj", "v_proj",
                                                                 "o_proj"),
           peft_rewrites_moe_targets=False,
           modules=(*_NEMOTRON_H, *_shared("mixer.shared_experts",
                                           "shared_expert_intermediate_size",
                                           ("up_proj", "down_proj"))),
           experts_unreadable="are non-gated (up and down, no gate)",
           experts_key="n_routed_experts", experts_aliases=("num_local_experts",),
           shared_experts_key="shared_expert_intermediate_size",
           config_defaults=(("hidden_size", 4096), ("num_attention_heads", 32),
                            ("num_key_value_heads", 8), ("head_dim", 128),
                            ("intermediate_size", 21504), ("n_routed_experts", 8),
                            ("moe_intermediate_size", 7688), ("num_experts_per_tok", 2),
                            ("moe_shared_expert_intermediate_size", 7688),
                            ("shared_expert_intermediate_size",
                             "moe_shared_expert_intermediate_size"))),
    # Granite 3 MoE: every layer routed experts under `block_sparse_moe` (fused experts one
    # intermediate_size wide, a router parameter), attention as llama's. Its
    # GraniteMoeConfig defaults.
    Family("granitemoe", moe_block="block_sparse_moe", fused_experts_block="block_sparse_moe",
           modules=(Q_PROJ, K_PROJ, V_PROJ, O_PROJ), experts_key="num_local_experts",
           expert_width="intermediate_size",
           config_defaults=(("num_local_experts", 8), ("intermediate_size", 11008),
                            ("num_experts_per_tok", 2))),
    # Phi-3.5-MoE: every layer routed experts (transformers 5: fused under `mlp`, the router
    # `mlp.router`; transformers 4 and its adapters: Mixtral's `block_sparse_moe` and w1/w3/w2),
    # attention as llama's. transformers' PhimoeConfig defaults.
    Family("phimoe", moe_block="block_sparse_moe",
           expert_leaves=(("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")),
           modules=(Q_PROJ, K_PROJ, V_PROJ, O_PROJ), experts_key="num_local_experts",
           expert_width="intermediate_size", config_defaults=(
               ("num_key_value_heads", 8), ("intermediate_size", 6400),
               ("num_local_experts", 16), ("num_experts_per_tok", 2))),
    # Llama 4 (llama4_text, and the language model of the llama4 wrapper): MoE layers every
    # `interleave_moe_layer_step` (or those `moe_layers` lists), dense MLPs on the rest; the
    # MoE layers' shared expert (`feed_forward.shared_expert`, `intermediate_size` wide: a plain
    # gate_proj target reaches both) is the slot pool's too, their router is not served, and
    # their fused experts store (E, in, out) as gpt_oss's but are not marked `is_transposed`,
    # so PEFT swaps in and out there (gate_up's A [E*r, 2I], B [H, E*r]: A holds each expert's
    # output side, B its input side): the expert pool reads them so with --experts. PEFT's
    # default targets are the wrapper's (q_proj, v_proj on every q_proj/v_proj, the vision
    # tower's too); the text model has none. The wrapper (Llama4ForConditionalGeneration)
    # keeps its text model at `language_model.model` and its vision tower at `vision_model`.
    # transformers' Llama4TextConfig defaults.
    Family("llama4", sparse_step=True, peft_rewrites_moe_targets=False, moe_block="feed_forward",
           modules=(*_LLAMA4, *_shared("feed_forward.shared_expert",
                                       "shared_expert_intermediate_size")),
           language_model="language_model.model",
           fused_experts_block="feed_forward", experts_peft_swapped=True, expert_router=False,
           experts_key="num_local_experts", expert_width="intermediate_size",
           shared_experts_key="shared_expert_intermediate_size",
           config_defaults=(
               ("hidden_size", 5120), ("num_hidden_layers", 48), ("num_attention_heads", 40),
               ("num_key_value_heads", 8), ("head_dim", 128), ("intermediate_size", 8192),
               ("intermediate_size_mlp", 16384), ("num_local_experts", 16),
               ("num_experts_per_tok", 1), ("decoder_sparse_step", "interleave_moe_layer_step"),
               ("shared_expert_intermediate_size", "intermediate_size"))),
    # Gemma 4 (gemma4_text, and the language model of the gemma4 wrapper): sliding and full
    # attention layers of different widths, KV-shared last layers, the per-layer input's
    # projections, a dense MLP on every layer and, with enable_moe_block, routed experts beside
    # it (`experts`, the router `router.proj`: not served, the audit says why). PEFT's default
    # targets are the
    # wrapper's (a regex reaching the language model's q_proj and v_proj alone); the text model
    # has none. transformers' Gemma4TextConfig defaults.
    Family("gemma4", peft_rewrites_moe_targets=False, modules=_GEMMA4, global_attention=True,
           moe_flag="enable_moe_block", experts_key="num_experts",
           peft_wrapper_targets=r".*language_model\..*\.(q_proj|v_proj)",
           config_defaults=(
               ("hidden_size", 2304), ("intermediate_size", 9216), ("num_hidden_layers", 30),
               ("num_attention_heads", 8), ("num_key_value_heads", 4), ("head_dim", 256),
               ("global_head_dim", 512), ("hidden_size_per_layer_input", 256),
               ("vocab_size", 262144), ("sliding_window_pattern", 6),
               ("num_experts_per_tok", "top_k_experts"), ("tie_word_embeddings", True))),
    # Fused projections: one pair spans q|k|v (phi3) or gate|up (phi3, glm4).
    _dense("phi3", modules=_PHI3),
    _dense("glm4", modules=_GLM4),
)}
