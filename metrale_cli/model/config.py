"""Base-model configs: `ModelConfig`, read from a `config.json` or a preset (`--model` is
resolved to one by model/resolve.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from dataclasses import fields as dataclass_fields
from enum import Enum
from functools import cached_property
from pathlib import Path
from typing import Any

from metrale_cli.errors import FormatError, UnsupportedModel, UsageError
from metrale_cli.files.jsondoc import load_json, shown
from metrale_cli.files.regular import refuse_not_regular
from metrale_cli.model.families import (
    FAMILIES,
    KV_B_PROJ,
    VOCABULARY,
    Family,
    Layers,
    ModuleSpec,
    Split,
)

# transformers' default when a hybrid config carries neither `layer_types` nor the interval.
DEFAULT_FULL_ATTENTION_INTERVAL = 4
# ModelConfig fields a summary carries only when set (deepseek's MLA and dense first layers,
# llama4's dense-MLP width).
_WHEN_SET = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
             "v_head_dim", "first_k_dense_replace", "intermediate_size_mlp", "n_shared_experts",
             "global_head_dim", "num_global_key_value_heads", "attention_k_eq_v",
             "num_kv_shared_layers", "use_double_wide_mlp", "hidden_size_per_layer_input")
# Upper bounds on a config's counts and widths, far above any real model (the largest have
# ~126 layers, 512 experts, a 262k vocabulary, 53k-wide FFNs) and low enough that planning a
# pool stays quick: a config past them is malformed, not a bigger model.
MAX_LAYERS = 1024
MAX_EXPERTS = 8192
MAX_WIDTH = 1 << 22
MAX_VOCAB = 1 << 26
# Routed experts over all MoE layers (Qwen3-Next: 48 x 512 = 24,576): bounds the expert layout.
MAX_LAYER_EXPERTS = 1 << 18
# `ModelConfig.shapes_from`: where a model's module shapes came from.
SHAPES_CONFIG = "config"
SHAPES_CHECKED = "config checked against weights"
SHAPES_WEIGHTS = "weights"
_LIMITS = {"num_hidden_layers": MAX_LAYERS, "num_experts": MAX_EXPERTS,
           "num_local_experts": MAX_EXPERTS, "n_routed_experts": MAX_EXPERTS,
           "vocab_size": MAX_VOCAB}


def _limit(key: str) -> int:
    """The bound on a config key's or a `ModelConfig` field's value, a config file's and a pool
    image header's alike: `_LIMITS`, else a width's."""
    return _LIMITS.get(key, MAX_WIDTH)


class LayerType(str, Enum):
    FULL_ATTENTION = "full_attention"
    LINEAR_ATTENTION = "linear_attention"
    # Attention over a window of recent tokens (gemma2/3, cohere2, olmo3, exaone4, ministral):
    # the same projections as full attention, so the same LoRA modules.
    SLIDING_ATTENTION = "sliding_attention"
    # llama4's attention over chunks of the sequence (its rope layers): the same projections.
    CHUNKED_ATTENTION = "chunked_attention"
    # A block-typed hybrid's layers without attention (nemotron_h): an MLP, or routed experts.
    MLP = "mlp"
    MOE = "moe"


# Attention of either kind: the layers the attention modules apply to.
ATTENTION_KINDS = (LayerType.FULL_ATTENTION, LayerType.SLIDING_ATTENTION,
                   LayerType.CHUNKED_ATTENTION)
# nemotron_h's `hybrid_override_pattern`, one character a layer (transformers' mapping).
_BLOCK_PATTERN = {"M": LayerType.LINEAR_ATTENTION, "*": LayerType.FULL_ATTENTION,
                  "-": LayerType.MLP, "E": LayerType.MOE}


@dataclass(frozen=True)
class ModelConfig:
    """The text decoder of a base model, as far as LoRA serving needs it."""

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    layer_types: tuple[LayerType, ...]
    attn_gated: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    # deepseek's and glm4_moe's shared experts: this many of `moe_intermediate_size`, one MLP
    # of their summed width (`shared_experts_width`) on each MoE layer.
    n_shared_experts: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    vocab_size: int = 0
    # Layers whose MLP is dense although the model has routed experts (qwen3_moe, qwen3_next);
    # with `decoder_sparse_step` this decides which layers carry experts (transformers' rule).
    mlp_only_layers: tuple[int, ...] = ()
    # llama4's dense layers' MLP width (its `intermediate_size` is one expert's); 0 elsewhere.
    intermediate_size_mlp: int = 0
    decoder_sparse_step: int = 1
    # The output head shares the input embedding: a token overlay on one is on both (PEFT ties
    # its trainable-token adapter on lm_head to the embedding's).
    tie_word_embeddings: bool = False
    # Multi-head latent attention (deepseek_v2/v3): the query's low-rank width (0: one q_proj,
    # no q_a_proj/q_b_proj), the compressed KV width, and the per-head widths of the query's
    # rope-free and rope parts and of the value. Summaries leave them out while 0 (_WHEN_SET).
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # The first layers whose MLP is dense although the model has routed experts (deepseek's
    # first_k_dense_replace).
    first_k_dense_replace: int = 0
    # gemma4: the full-attention layers' head width and KV heads (0: head_dim and
    # num_key_value_heads, as on the sliding layers and every other family); whether those layers
    # compute keys alone, k_proj's output serving as the values (no v_proj there); how many last
    # layers reuse an earlier layer's keys and values (no k_proj, v_proj there), and whether
    # their MLP is twice intermediate_size wide; the per-layer input's width (each layer's
    # per_layer_input_gate and per_layer_projection, 0: none). Summaries leave them out while 0.
    global_head_dim: int = 0
    num_global_key_value_heads: int = 0
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int = 0
    use_double_wide_mlp: bool = False
    hidden_size_per_layer_input: int = 0
    # The config nests the text model under `text_config` (a vision-language checkpoint).
    composite: bool = False
    # Where the config came from: a preset name, a file path, or a hub id.
    source: str = ""
    # The config's `architectures` as written (the model classes an engine builds from): ()
    # when it names none, a non-name entry kept as it is; None for a preset, whose re-typed
    # dims keep no class name (an engine then takes its family's own class).
    architectures: tuple[Any, ...] | None = field(default=None, compare=False)
    # A model_type no FAMILIES row knows: its family as its checkpoint's tensor names and
    # shapes give it (model/weights.py), kept in pool images; None for a known type.
    weights_family: Family | None = None
    # Where the modules' shapes came from: the config alone, the config checked against the
    # weights' headers, or the weights (SHAPES_*).
    shapes_from: str = field(default="config", compare=False)
    # The config key the expert count was read from where the file gave one: the family's
    # `experts_key` or another name transformers' class reads as it (`experts_aliases`), so
    # that messages name the key the file has; "" for a preset's default and an image's.
    experts_key: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        self._check_routed_experts()

    def _check_routed_experts(self) -> None:
        """A FormatError naming the config key where the routed experts are not a model
        transformers can run (its modeling code, per family): a family that builds its MoE
        layers' block whatever the count with none in it, experts 0 wide, a token routed to
        more experts than there are, MoE layers every 0th layer (each only where a layer
        builds the block: with none, transformers reads neither); and metrale's bounds on the
        experts over all layers and on the shared experts' width. Here, so that a config read
        from any file, a preset and a pool image's header meet the same rule (a top-k of 0 is
        from_dict's, and an image header's read_tables's: a family read from weights whose
        config gives none keeps 0)."""
        where = self.source or "config"
        if self.num_hidden_layers * self.num_experts > MAX_LAYER_EXPERTS:
            raise FormatError(f"{where}: {self.num_hidden_layers} layers x {self.num_experts} "
                              f"experts is above the {MAX_LAYER_EXPERTS:,} that metrale accepts; "
                              "not a real model's config")
        if self.shared_experts_width > MAX_WIDTH:
            # One MLP of their summed width: a width, bounded as every width is.
            raise FormatError(f"{where}: 'n_shared_experts' {self.n_shared_experts} x "
                              f"'moe_intermediate_size' {self.moe_intermediate_size} is above "
                              f"the {MAX_WIDTH:,} that metrale accepts; not a real model's "
                              "config")
        family = self.weights_family or FAMILIES.get(self.model_type)
        if family is None or not family.experts_key:
            return
        if not self.num_experts:
            # gemma4's block is built only with its flag, which from_dict reads; nemotron_h's
            # on the MoE blocks of its pattern.
            builds = (LayerType.MOE in self.layer_types if family.block_types
                      else not (family.experts_optional or family.moe_flag))
            if builds:
                raise FormatError(f"{where}: {self.key_of('num_experts')!r} is 0 or missing: every "
                                  f"{self.model_type} MoE layer routes each token to its "
                                  "routed experts, and transformers builds that block with none")
            return
        if family.sparse_step and self.decoder_sparse_step <= 0 and not self._mlp_only.issuperset(
                range(self.num_hidden_layers)):
            raise FormatError(f"{where}: {self.key_of('decoder_sparse_step')!r} is 0: the MoE "
                              "layers are every that many layers (transformers divides by it)")
        if not any(self.is_moe_layer(i) for i in range(self.num_hidden_layers)):
            return  # no layer builds the block: transformers reads neither width nor top-k
        width = family.expert_width
        if getattr(self, width) <= 0:
            raise FormatError(f"{where}: {width!r} is 0 or missing: it is one routed expert's "
                              "FFN width, and experts 0 wide compute nothing")
        if self.num_experts_per_tok > self.num_experts:
            raise FormatError(f"{where}: {self.key_of('num_experts_per_tok')!r} is "
                              f"{self.num_experts_per_tok}, more than the {self.num_experts} "
                              "routed experts each token goes to that many of (transformers' "
                              "top-k fails)")

    def key_of(self, name: str) -> str:
        """The config key a field was read from: where the file named the expert count its own
        way, that name; else the family's (`Family.key_of`)."""
        if name == "num_experts" and self.experts_key:
            return self.experts_key
        return self.family.key_of(name)

    @cached_property
    def _mlp_only(self) -> frozenset[int]:
        return frozenset(self.mlp_only_layers)

    def layer_type(self, layer: int) -> LayerType:
        return self.layer_types[layer]

    @property
    def family(self) -> Family:
        """What differs by `model_type` (model/families.py), or what the weights gave."""
        return self.weights_family or FAMILIES[self.model_type]

    @property
    def is_hybrid(self) -> bool:
        return self.family.hybrid

    @property
    def q_width(self) -> int:
        """q_proj's output: the query heads, each with its gate on a gated-attention model."""
        return (2 if self.attn_gated else 1) * self.attn_width

    @property
    def kv_width(self) -> int:
        """k_proj's and v_proj's output: the KV heads."""
        return self.num_key_value_heads * self.head_dim

    @property
    def attn_width(self) -> int:
        """The attention heads' width, o_proj's input."""
        return self.num_attention_heads * self.head_dim

    @property
    def global_head_width(self) -> int:
        """A gemma4 full-attention layer's head width."""
        return self.global_head_dim or self.head_dim

    @property
    def global_kv_heads(self) -> int:
        """A gemma4 full-attention layer's KV heads."""
        return self.num_global_key_value_heads or self.num_key_value_heads

    @property
    def global_attn_width(self) -> int:
        """A gemma4 full-attention layer's query heads: q_proj's output, o_proj's input."""
        return self.num_attention_heads * self.global_head_width

    @property
    def global_kv_width(self) -> int:
        """A gemma4 full-attention layer's KV heads: k_proj's (and v_proj's) output."""
        return self.global_kv_heads * self.global_head_width

    @property
    def kv_shared_mlp_width(self) -> int:
        """The MLP width of a layer that reuses another's KV: doubled with use_double_wide_mlp."""
        return self.intermediate_size * (2 if self.use_double_wide_mlp else 1)

    def is_kv_shared_layer(self, layer: int) -> bool:
        """Whether `layer` reuses an earlier layer's keys and values (gemma4's last
        `num_kv_shared_layers`): its attention has no k_proj or v_proj."""
        return layer >= self.num_hidden_layers - self.num_kv_shared_layers

    @property
    def mla_q_width(self) -> int:
        """MLA's query (q_proj, or q_b_proj's output): each head's rope-free and rope parts."""
        return self.num_attention_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)

    @property
    def mla_kv_a_width(self) -> int:
        """kv_a_proj_with_mqa's output: the compressed KV and the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def mla_kv_b_width(self) -> int:
        """kv_b_proj's output: each head's rope-free key and its value."""
        return self.num_attention_heads * (self.qk_nope_head_dim + self.v_head_dim)

    @property
    def mla_v_width(self) -> int:
        """The heads' values, o_proj's input under MLA."""
        return self.num_attention_heads * self.v_head_dim

    @property
    def linear_value_width(self) -> int:
        """Gated-DeltaNet value width `Nv * dv`: the input width of `linear_attn.out_proj`."""
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def language_model(self) -> str:
        """Where PEFT finds the language model (its `layers`, `embed_tokens`): `model`, or on a
        vision-language checkpoint its family's (`model.language_model`, llama4's
        `language_model.model`). Unpack writes its keys there and synth its adapters."""
        return self.family.language_model if self.composite else "model"

    @property
    def shared_experts_width(self) -> int:
        """The width of deepseek's and glm4_moe's shared-experts MLP: `n_shared_experts` experts
        of `moe_intermediate_size` side by side, as transformers builds it."""
        return self.n_shared_experts * self.moe_intermediate_size

    @property
    def expert_intermediate_size(self) -> int:
        """One routed expert's FFN width: the family's `expert_width` key (Mixtral's experts use
        `intermediate_size`); for a family read from weights, whose experts are not read,
        `moe_intermediate_size` where the config gives it."""
        if not self.num_experts:
            return 0
        if not self.family.experts_key:
            return self.moe_intermediate_size or self.intermediate_size
        return int(getattr(self, self.family.expert_width))

    def is_moe_layer(self, layer: int) -> bool:
        """Whether `layer`'s MLP is routed experts: every layer from `first_k_dense_replace` on
        (deepseek's dense first layers; 0 elsewhere), unless the family's MoE layers follow the
        sparse step (qwen3_moe, qwen3_next): then not in `mlp_only_layers` and
        `(layer + 1) % decoder_sparse_step == 0` (their decoder layers' rule)."""
        if not self.num_experts:
            return False
        if self.family.block_types:
            return self.layer_type(layer) is LayerType.MOE
        if layer < self.first_k_dense_replace:
            return False
        if not self.family.sparse_step:
            return True
        return layer not in self._mlp_only and (layer + 1) % self.decoder_sparse_step == 0

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @property
    def attention_layers(self) -> list[int]:
        """Layers with softmax attention, full or sliding-window (not linear attention, not
        nemotron_h's MLP and MoE blocks)."""
        return [i for i, t in enumerate(self.layer_types) if t in ATTENTION_KINDS]

    @property
    def full_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t is LayerType.FULL_ATTENTION]

    @property
    def linear_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t is LayerType.LINEAR_ATTENTION]

    def summary(self) -> dict[str, Any]:
        """The JSON record of this config (also stored in pool images)."""
        record = asdict(self)
        del record["architectures"]  # an engine's input, not a dimension images keep
        del record["shapes_from"]  # how this run learnt the shapes, not the model's
        del record["experts_key"]  # how the file spelt a key, not the model's
        if self.weights_family is None:
            del record["weights_family"]  # images of known families read as they always did
        else:
            record["weights_family"] = _family_record(self.weights_family)
        record["layer_types"] = [t.value for t in self.layer_types]
        record["mlp_only_layers"] = list(self.mlp_only_layers)
        for name in _WHEN_SET:  # absent on other families, so their images read as before
            if not record[name]:
                del record[name]
        return record

    def record(self) -> dict[str, Any]:
        """The summary with the counts a view of the model shows (records of `models`,
        `inspect`, `layout` and `show`); images store the summary alone."""
        return {**self.summary(), "shapes_from": self.shapes_from,
                "full_attention_layers": len(self.full_attention_layers),
                "linear_attention_layers": len(self.linear_attention_layers),
                "expert_intermediate_size": self.expert_intermediate_size}

    @classmethod
    def from_summary(cls, record: dict[str, Any]) -> ModelConfig:
        """The config `summary()` recorded; ValueError when a field is not of its type (an
        image's metadata is input: `inf` for a flag, `null` for a width)."""
        fields = dict(record)
        fields["layer_types"] = tuple(LayerType(t) for t in fields["layer_types"])
        fields["mlp_only_layers"] = tuple(fields.get("mlp_only_layers") or ())
        if "weights_family" in fields:
            fields["weights_family"] = _family_from_record(fields["model_type"],
                                                           fields["weights_family"])
            fields["shapes_from"] = SHAPES_WEIGHTS
        kinds = {"int": int, "bool": bool, "str": str}
        for f in dataclass_fields(cls):
            kind = kinds.get(str(f.type))
            value = fields.get(f.name)
            if kind is None or (value is None and f.name not in record):
                continue  # the tuples, checked above; a field the record leaves at its default
            if not isinstance(value, kind) or (kind is int and (isinstance(value, bool)
                                                                or value < 0)):
                raise ValueError(f"model {f.name} {value!r} is not a "
                                 f"{'non-negative integer' if kind is int else kind.__name__}")
            if kind is int and value > _limit(f.name):
                # A config file's bounds: a header is a config too (10**9 layers would hang
                # the layout's rebuild, a width that wide its tables).
                raise ValueError(f"model {f.name} {value} is above the {_limit(f.name):,} that "
                                 "metrale accepts")
        if not fields.get("num_hidden_layers"):
            raise ValueError("model num_hidden_layers is 0 or missing")
        if not all(isinstance(i, int) and not isinstance(i, bool)
                   for i in fields["mlp_only_layers"]):
            raise ValueError("model mlp_only_layers is not a list of layer numbers")
        return cls(**fields)

    # -- named constructors -------------------------------------------------------------------

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "",
                  family: Family | None = None) -> ModelConfig:
        """Read an HF `config.json` dict (composite configs use their `text_config`); `family`
        serves a `model_type` no FAMILIES row knows (read from its weights: model/weights.py)."""
        if not isinstance(raw, dict):
            raise FormatError(f"{source or 'config'}: not a JSON object")
        composite = isinstance(raw.get("text_config"), dict)
        text = raw["text_config"] if composite else raw
        model_type = str(text.get("model_type") or raw.get("model_type") or "")
        model_type = model_type.removesuffix("_text")
        known = FAMILIES.get(model_type) or family
        if known is None:
            raise UnsupportedModel(
                f"{source or 'config'}: model type {model_type or '(none)'!r} is not supported: "
                "no family row says which modules its decoder layers carry; its weights would "
                "(the model directory holding its model.safetensors, or index and shards; its "
                "hub id, with --online when not cached), or a row in model/families.py; "
                f"supported: {', '.join(FAMILIES)}"
            )
        count_key = known.experts_key
        given = [k for k in (*known.experts_aliases, count_key) if count_key and k in text]
        if given:
            # transformers' attribute_map: its class reads an alias as the family's key, and
            # an alias given beside that key over it; messages name the one read.
            count_key = given[0]
            text = {**text, known.experts_key: text[count_key]}
        defaults = known.config_defaults
        if defaults:
            text = dict(text)
            for key, value in defaults:
                if key not in text:  # absent; an explicit null stays null
                    text[key] = text.get(value) if isinstance(value, str) else value
        blocks = _block_types(text, source) if known.block_types else None
        if blocks is not None:
            # transformers derives the layer count from the blocks and ignores the key.
            text = {**text, "num_hidden_layers": len(blocks)}

        def bounded(key: str, value: int) -> int:
            limit = _limit(key)
            if value > limit:
                raise FormatError(f"{source or 'config'}: {key!r} is {value}, above the {limit:,} "
                                  "that metrale accepts; not a real model's config")
            return value

        def need(key: str) -> int:
            value = text.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise FormatError(
                    f"{source or 'config'}: {key!r} missing or not a positive integer")
            return bounded(key, value)

        def opt(key: str, default: int = 0) -> int:
            value = text.get(key)
            if value is None:
                return default
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise FormatError(f"{source or 'config'}: {key!r} is not a non-negative integer")
            return bounded(key, value)

        def given(key: str) -> int | None:
            """A positive integer, or None when the key is absent or null."""
            return None if text.get(key) is None else need(key)

        hidden = need("hidden_size")
        layers = need("num_hidden_layers")
        if model_type not in FAMILIES:  # read from weights: whichever key the config has
            num_experts = opt("num_experts") or opt("num_local_experts") or opt("n_routed_experts")
        else:  # a dense family's class never reads the keys (transformers')
            num_experts = opt(count_key) if count_key else 0
        if blocks is not None and LayerType.MOE not in blocks:
            num_experts = 0  # a config default, on no layer
        heads = need("num_attention_heads")
        # Absent (or null) means hidden_size / heads, as transformers derives it; 0 is no width.
        head_dim = given("head_dim") or hidden // heads
        if head_dim == 0:
            raise FormatError(f"{source or 'config'}: no 'head_dim', and 'hidden_size' "
                              f"{hidden} is smaller than 'num_attention_heads' {heads}")
        kv_heads = given("num_key_value_heads") or heads
        if heads % kv_heads:
            # Grouped-query attention: each KV head serves a whole group of query heads.
            raise FormatError(f"{source or 'config'}: 'num_key_value_heads' {kv_heads} does not "
                              f"divide 'num_attention_heads' {heads}")
        layer_types = blocks or _layer_types(text, known.hybrid, layers, source)
        global_head_dim = global_kv_heads = 0
        if known.global_attention:
            # transformers forces the last layer to full attention (with a warning).
            layer_types = (*layer_types[:-1], LayerType.FULL_ATTENTION)
            global_head_dim, global_kv_heads = _global_attention(text, layer_types, source)
            if global_kv_heads and heads % global_kv_heads:
                raise FormatError(f"{source or 'config'}: the full-attention layers' "
                                  f"{global_kv_heads} KV heads do not divide "
                                  f"'num_attention_heads' {heads}")
        if known.moe_flag and not text.get(known.moe_flag):
            num_experts = 0  # the experts' sizes without the block that holds them
        elif known.moe_flag and not num_experts:
            raise FormatError(f"{source or 'config'}: {known.moe_flag!r} is set and "
                              f"{count_key!r} is 0 or missing: transformers builds each "
                              "layer's routed-expert block with no experts in it")
        if num_experts and known.expert_defaults:
            text = {**dict(known.expert_defaults), **text}
        # A model without experts routes nothing (its class's default top-k unused).
        top_k = opt("num_experts_per_tok") if num_experts else 0
        shared_kv = opt("num_kv_shared_layers")
        if shared_kv > layers:
            raise FormatError(f"{source or 'config'}: 'num_kv_shared_layers' {shared_kv} is more "
                              f"than the {layers} layers")
        only = text.get("mlp_only_layers") or []
        step = opt("decoder_sparse_step", 1)  # 0 with experts: refused (__post_init__)
        moe = text.get("moe_layers")
        if known.sparse_step and isinstance(moe, list) and all(
                isinstance(i, int) and not isinstance(i, bool) for i in moe):
            # llama4's explicit MoE layers (over its interleave step): the rest are dense.
            only, step = [i for i in range(layers) if i not in moe], 1
        if not isinstance(only, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in only
        ):
            raise FormatError(f"{source or 'config'}: 'mlp_only_layers' must be a list of ints")
        def shared(key: str) -> int:
            # A known family whose class has no such shared experts never reads the key.
            unread = model_type in FAMILIES and key != known.shared_experts_key
            return 0 if unread else opt(key)

        shared_experts = shared("n_shared_experts") if num_experts else 0
        tied = text.get("tie_word_embeddings", raw.get("tie_word_embeddings", False))
        gate = text.get("attn_output_gate")
        attn_gated = gate is not False if known.hybrid else bool(gate)
        model = cls(
            model_type=model_type,
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=opt("intermediate_size"),
            layer_types=layer_types,
            attn_gated=attn_gated,
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=opt("moe_intermediate_size"),
            shared_expert_intermediate_size=shared("shared_expert_intermediate_size"),
            n_shared_experts=shared_experts,
            linear_num_key_heads=opt("linear_num_key_heads"),
            linear_num_value_heads=opt("linear_num_value_heads"),
            linear_key_head_dim=opt("linear_key_head_dim"),
            linear_value_head_dim=opt("linear_value_head_dim"),
            vocab_size=opt("vocab_size"),
            mlp_only_layers=tuple(sorted(set(only))),
            intermediate_size_mlp=opt("intermediate_size_mlp"),
            decoder_sparse_step=step,
            q_lora_rank=opt("q_lora_rank"),
            # Latent attention's kv_b_proj reads the compressed KV and o_proj the heads'
            # values: neither is a layer at width 0 (a zero-width A was a division by zero).
            kv_lora_rank=need("kv_lora_rank") if KV_B_PROJ in known.modules else opt(
                "kv_lora_rank"),
            qk_nope_head_dim=opt("qk_nope_head_dim"),
            qk_rope_head_dim=opt("qk_rope_head_dim"),
            v_head_dim=need("v_head_dim") if KV_B_PROJ in known.modules else opt("v_head_dim"),
            first_k_dense_replace=opt("first_k_dense_replace") if num_experts else 0,
            global_head_dim=global_head_dim,
            num_global_key_value_heads=global_kv_heads,
            attention_k_eq_v=bool(text.get("attention_k_eq_v")),
            num_kv_shared_layers=shared_kv,
            use_double_wide_mlp=bool(text.get("use_double_wide_mlp")),
            hidden_size_per_layer_input=opt("hidden_size_per_layer_input"),
            tie_word_embeddings=bool(tied),
            composite=composite,
            source=source,
            architectures=_architectures(raw),
            weights_family=None if model_type in FAMILIES else known,
            experts_key=count_key if given else "",
        )
        if not top_k and model.moe_layers:
            # Judged only where a layer builds the MoE block, as transformers reads it there
            # alone; a family read from weights whose config gives none keeps 0 (its class's
            # default unknown), and an image header recording 0 is refused as this is
            # (image/format.py read_tables).
            key = known.key_of("num_experts_per_tok")
            if text.get("num_experts_per_tok") is None and model_type in FAMILIES:
                raise FormatError(f"{source or 'config'}: {key!r} is missing or null: "
                                  f"transformers' {model_type} class has no default, and its "
                                  "router cannot pick None experts")
            if text.get("num_experts_per_tok") is not None:
                raise FormatError(f"{source or 'config'}: {key!r} is 0: each token goes to no "
                                  "routed expert, which is no MoE")
        return model

    @classmethod
    def from_hf(cls, path: str | Path, family: Family | None = None) -> ModelConfig:
        """A `config.json` file, or a directory holding one (`family` as `from_dict`'s)."""
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        refuse_not_regular(file)
        if not file.is_file():
            raise UsageError(f"{path}: no config.json there")
        try:
            text = file.read_bytes()
        except OSError as exc:
            raise FormatError(f"{file}: not a readable JSON config ({exc})") from exc
        return cls.from_dict(load_json(file, text, "JSON config"), source=str(file), family=family)

    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        preset = find_preset(name)
        if preset is None:
            raise UsageError(f"unknown preset {name!r}; `metrale models` lists them")
        return replace(cls.from_dict(preset.config, source=preset.name), architectures=None)


def _architectures(raw: dict[str, Any]) -> tuple[Any, ...]:
    """`architectures` as transformers keeps it: a list as it is, one name as a list of one,
    missing or null as none."""
    value = raw.get("architectures")
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)


# The widths a family read from weights may name (the vocabulary's): any other is given in
# elements.
_WIDTH_NAMES = frozenset(w for spec in VOCABULARY for w in (*spec.out, spec.in_))


def _family_record(family: Family) -> dict[str, Any]:
    """A family read from weights, as pool images keep it: its modules, each width in elements
    or by the config's name for it."""
    return {"modules": [{"name": m.name, "path": m.path, "out": list(m.out), "in": m.in_,
                         "split": m.split.value, "layers": list(m.on_layers)}
                        for m in family.modules]}


def _family_from_record(model_type: str, record: Any) -> Family:
    """The family `_family_record` kept; ValueError or TypeError for anything else (an image's
    metadata is input)."""
    names = {spec.name for spec in VOCABULARY}
    modules: list[ModuleSpec] = []
    for m in record["modules"]:
        widths = [*m["out"], m["in"]]
        known_widths = all((isinstance(w, int) and not isinstance(w, bool) and 0 < w <= MAX_WIDTH)
                           or (isinstance(w, str) and w in _WIDTH_NAMES) for w in widths)
        if (m["name"] not in names or not isinstance(m["path"], str) or not m["out"]
                or not known_widths):
            raise ValueError(f"weights_family module {shown(m['name'])} is not a module of "
                             "known widths")
        layers = m["layers"]
        if not isinstance(layers, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < MAX_LAYERS
                for i in layers):
            raise ValueError(f"weights_family module {m['name']!r}: layers is not a list of "
                             "layer numbers")
        if any(k.name == m["name"] and set(k.on_layers) & set(layers) for k in modules):
            raise ValueError(f"weights_family module {m['name']!r} is declared twice on one "
                             "layer")
        modules.append(ModuleSpec(m["name"], m["path"], tuple(m["out"]), m["in"], Layers.LISTED,
                                  Split(m["split"]), on_layers=tuple(layers)))
    return Family(model_type, modules=tuple(modules))


def _global_attention(text: dict[str, Any], layer_types: tuple[LayerType, ...],
                      source: str) -> tuple[int, int]:
    """gemma4's full-attention layers' head width and KV heads (0: the config's own):
    transformers' `per_layer_config` (what it writes: layer number -> overrides), else
    `global_head_dim` and, with attention_k_eq_v, `num_global_key_value_heads` (what it reads).
    metrale models one width for every full layer and none apart on the sliding ones."""
    where = source or "config"

    def width(v: Any) -> bool:
        return v is None or (isinstance(v, int) and not isinstance(v, bool) and 0 < v <= MAX_WIDTH)

    per_layer = text.get("per_layer_config")
    if per_layer is None:
        head_dim, kv_heads = text.get("global_head_dim"), (
            text.get("num_global_key_value_heads") if text.get("attention_k_eq_v") else None)
        if not (width(head_dim) and width(kv_heads)):
            raise FormatError(f"{where}: 'global_head_dim' and 'num_global_key_value_heads' "
                              "must be positive integers")
        return head_dim or 0, kv_heads or 0
    entries = per_layer.items() if isinstance(per_layer, dict) else [(None, None)]
    if not all(isinstance(k, str) and k.isdigit() and isinstance(v, dict)
               and set(v) <= {"head_dim", "num_key_value_heads"} and all(map(width, v.values()))
               for k, v in entries):
        raise FormatError(f"{where}: per_layer_config must map layer numbers to a head_dim and "
                          "num_key_value_heads, each a positive integer")
    overrides = {int(k): (v.get("head_dim"), v.get("num_key_value_heads")) for k, v in entries}
    full = {i for i, t in enumerate(layer_types) if t is LayerType.FULL_ATTENTION}
    widths = set(overrides.values())
    if (overrides and set(overrides) != full) or len(widths) > 1:
        raise FormatError(f"{where}: per_layer_config must give every full-attention layer the "
                          "same head_dim and num_key_value_heads, and no other layer any: "
                          "metrale models gemma4's sliding and full widths alone")
    head_dim, kv_heads = next(iter(widths), (None, None))
    return head_dim or 0, kv_heads or 0


def _block_types(text: dict[str, Any], source: str) -> tuple[LayerType, ...]:
    """A block-typed hybrid's layer kinds (nemotron_h): `layers_block_type` (transformers 5,
    `layer_types` its alias), else `hybrid_override_pattern` (`M`amba, `*` attention, `-` MLP,
    `E` MoE), else transformers' default four."""
    raw = text.get("layers_block_type")
    raw = text.get("layer_types") if raw is None else raw
    pattern = text.get("hybrid_override_pattern")
    if raw is None and isinstance(pattern, str) and pattern:
        raw = [_BLOCK_PATTERN.get(c, c) for c in pattern]
    elif raw is None:
        raw = ["linear_attention", "moe", "full_attention", "mlp"]
    kinds = (LayerType.LINEAR_ATTENTION, LayerType.FULL_ATTENTION, LayerType.MLP, LayerType.MOE)
    if not isinstance(raw, list) or not 0 < len(raw) <= MAX_LAYERS or not all(
            isinstance(k, str) and k in kinds for k in raw):
        raise FormatError(f"{source or 'config'}: layers_block_type (or hybrid_override_pattern) "
                          f"must give 1 to {MAX_LAYERS} layers, each one of "
                          f"{', '.join(k.value for k in kinds)} (M, *, -, E)")
    return tuple(LayerType(k) for k in raw)


def _layer_types(
    text: dict[str, Any], hybrid: bool, layers: int, source: str
) -> tuple[LayerType, ...]:
    """Per-layer attention kind: `layer_types`, else `full_attention_interval`, else
    `sliding_window_pattern` (every Nth layer full, the rest sliding, as gemma3's config derives
    them), else all full attention (hybrid families default to transformers' interval of 4)."""
    raw = text.get("layer_types")
    if raw is not None:
        if not isinstance(raw, list) or len(raw) != layers:
            raise FormatError(
                f"{source or 'config'}: layer_types must list {layers} entries, one per layer"
            )
        try:
            types = tuple(LayerType(t) for t in raw)
        except ValueError as exc:
            raise FormatError(f"{source or 'config'}: {exc}") from exc
        if LayerType.MLP in types or LayerType.MOE in types:
            raise FormatError(f"{source or 'config'}: layer_types names mlp or moe blocks, "
                              "which only a block-typed hybrid (nemotron_h) has")
        return types
    pattern = text.get("sliding_window_pattern")
    if text.get("full_attention_interval") is None and pattern is not None:
        if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern <= 0:
            raise FormatError(f"{source or 'config'}: sliding_window_pattern must be a "
                              "positive int")
        return tuple(
            LayerType.SLIDING_ATTENTION if (i + 1) % pattern else LayerType.FULL_ATTENTION
            for i in range(layers)
        )
    interval = text.get("full_attention_interval")
    if interval is None and hybrid:
        interval = DEFAULT_FULL_ATTENTION_INTERVAL
    if interval is None:
        return (LayerType.FULL_ATTENTION,) * layers
    if not isinstance(interval, int) or isinstance(interval, bool) or interval <= 0:
        raise FormatError(f"{source or 'config'}: full_attention_interval must be a positive int")
    return tuple(
        LayerType.LINEAR_ATTENTION if (i + 1) % interval else LayerType.FULL_ATTENTION
        for i in range(layers)
    )


# -- presets -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Preset:
    name: str
    hub_ids: tuple[str, ...]
    config: dict[str, Any] = field(repr=False)

    def record(self) -> dict[str, Any]:
        """`metrale models --json`: the names, the config summary, and the layer and expert
        counts the table shows."""
        cfg = ModelConfig.from_dict(self.config, source=self.name)
        return {"name": self.name, "hub_ids": list(self.hub_ids), **cfg.record()}


def _hybrid_text(**values: Any) -> dict[str, Any]:
    return {"full_attention_interval": 4, **values}


def _sliding(layers: int, every: int) -> list[str]:
    """`layer_types` with every `every`-th layer full attention, the others sliding-window."""
    return ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)]


# Values re-typed from the public config.json of each model (see docs/models.md for sources).
PRESETS: tuple[Preset, ...] = (
    Preset(
        "qwen3-next-80b-a3b",
        ("Qwen/Qwen3-Next-80B-A3B-Instruct", "Qwen/Qwen3-Next-80B-A3B-Thinking"),
        _hybrid_text(
            model_type="qwen3_next", hidden_size=2048, num_hidden_layers=48,
            num_attention_heads=16, num_key_value_heads=2, head_dim=256, intermediate_size=5120,
            num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
            shared_expert_intermediate_size=512, linear_num_key_heads=16,
            linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
            vocab_size=151936,
        ),
    ),
    Preset(
        "qwen3.5-35b-a3b",
        ("Qwen/Qwen3.5-35B-A3B",),
        {"model_type": "qwen3_5_moe", "text_config": _hybrid_text(
            model_type="qwen3_5_moe_text", hidden_size=2048, num_hidden_layers=40,
            num_attention_heads=16, num_key_value_heads=2, head_dim=256, attn_output_gate=True,
            num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
            shared_expert_intermediate_size=512, linear_num_key_heads=16,
            linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
            vocab_size=248320,
        )},
    ),
    Preset(
        "qwen3.5-122b-a10b",
        ("Qwen/Qwen3.5-122B-A10B", "Qwen/Qwen3.5-122B-A10B-FP8"),
        {"model_type": "qwen3_5_moe", "text_config": _hybrid_text(
            model_type="qwen3_5_moe_text", hidden_size=3072, num_hidden_layers=48,
            num_attention_heads=32, num_key_value_heads=2, head_dim=256, attn_output_gate=True,
            num_experts=256, num_experts_per_tok=8, moe_intermediate_size=1024,
            shared_expert_intermediate_size=1024, linear_num_key_heads=16,
            linear_num_value_heads=64, linear_key_head_dim=128, linear_value_head_dim=128,
            vocab_size=248320,
        )},
    ),
    # Dense Qwen3.5: transformers' Qwen3_5TextConfig defaults (the 9B text stack).
    Preset(
        "qwen3.5-9b",
        ("Qwen/Qwen3.5-9B",),
        {"model_type": "qwen3_5", "text_config": _hybrid_text(
            model_type="qwen3_5_text", hidden_size=4096, num_hidden_layers=32,
            num_attention_heads=16, num_key_value_heads=4, head_dim=256, intermediate_size=12288,
            attn_output_gate=True, linear_num_key_heads=16, linear_num_value_heads=32,
            linear_key_head_dim=128, linear_value_head_dim=128, vocab_size=248320,
        )},
    ),
    Preset(
        "qwen3-8b",
        ("Qwen/Qwen3-8B",),
        {"model_type": "qwen3", "hidden_size": 4096, "num_hidden_layers": 36,
         "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
         "intermediate_size": 12288, "vocab_size": 151936},
    ),
    Preset(
        "qwen3-30b-a3b",
        ("Qwen/Qwen3-30B-A3B", "Qwen/Qwen3-30B-A3B-Instruct-2507"),
        {"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48,
         "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
         "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
         "num_experts_per_tok": 8, "vocab_size": 151936},
    ),
    Preset(
        "llama-3.1-8b",
        ("meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-8B-Instruct"),
        {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
         "vocab_size": 128256},
    ),
    Preset(
        "gemma-3-27b",
        ("google/gemma-3-27b-it", "google/gemma-3-27b-pt"),
        {"model_type": "gemma3", "tie_word_embeddings": True, "text_config": {
            "model_type": "gemma3_text", "hidden_size": 5376, "num_hidden_layers": 62,
            "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128,
            "intermediate_size": 21504, "layer_types": _sliding(62, 6), "vocab_size": 262144,
        }},
    ),
    Preset(
        "olmo-3-7b",
        ("allenai/Olmo-3-7B", "allenai/Olmo-3-1025-7B"),
        {"model_type": "olmo3", "hidden_size": 4096, "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": 32, "intermediate_size": 11008,
         "layer_types": _sliding(32, 4), "vocab_size": 100278},
    ),
    # ibm-granite/granite-3.3-8b-instruct's config.json (docs/models.md gives the source).
    Preset(
        "granite-3.3-8b",
        ("ibm-granite/granite-3.3-8b-instruct", "ibm-granite/granite-3.3-8b-base"),
        {"model_type": "granite", "hidden_size": 4096, "num_hidden_layers": 40,
         "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 12800,
         "vocab_size": 49159, "tie_word_embeddings": True},
    ),
    # microsoft/Phi-4-mini-instruct's config.json: fused qkv_proj and gate_up_proj.
    Preset(
        "phi-4-mini",
        ("microsoft/Phi-4-mini-instruct",),
        {"model_type": "phi3", "hidden_size": 3072, "num_hidden_layers": 32,
         "num_attention_heads": 24, "num_key_value_heads": 8, "intermediate_size": 8192,
         "vocab_size": 200064, "tie_word_embeddings": True},
    ),
    # Every layer MoE; sliding and full attention alternate (the attention is the slot pool's).
    Preset(
        "gpt-oss-20b",
        ("openai/gpt-oss-20b",),
        {"model_type": "gpt_oss", "hidden_size": 2880, "num_hidden_layers": 24,
         "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
         "intermediate_size": 2880, "num_local_experts": 32, "num_experts_per_tok": 4,
         "layer_types": _sliding(24, 2), "vocab_size": 201088},
    ),
    Preset(
        "gpt-oss-120b",
        ("openai/gpt-oss-120b",),
        {"model_type": "gpt_oss", "hidden_size": 2880, "num_hidden_layers": 36,
         "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
         "intermediate_size": 2880, "num_local_experts": 128, "num_experts_per_tok": 4,
         "layer_types": _sliding(36, 2), "vocab_size": 201088},
    ),
    # Multi-head latent attention; dense first layers, then routed and shared experts.
    Preset(
        "deepseek-v2-lite",
        ("deepseek-ai/DeepSeek-V2-Lite", "deepseek-ai/DeepSeek-V2-Lite-Chat"),
        {"model_type": "deepseek_v2", "hidden_size": 2048, "num_hidden_layers": 27,
         "num_attention_heads": 16, "num_key_value_heads": 16, "intermediate_size": 10944,
         "moe_intermediate_size": 1408, "num_experts_per_tok": 6, "first_k_dense_replace": 1,
         "q_lora_rank": None, "vocab_size": 102400},
    ),
    Preset(
        "deepseek-v3",
        ("deepseek-ai/DeepSeek-V3", "deepseek-ai/DeepSeek-V3-0324"),
        {"model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61,
         "num_attention_heads": 128, "num_key_value_heads": 128, "intermediate_size": 18432,
         "vocab_size": 129280},
    ),
    # transformers' Gemma4TextConfig defaults (no published Gemma 4 config.json was at hand to
    # re-type: no hub id): sliding layers at head_dim 256, every sixth full at 512.
    Preset(
        "gemma-4-defaults", (),
        {"model_type": "gemma4_text", "hidden_size": 2304, "num_hidden_layers": 30,
         "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
         "global_head_dim": 512, "intermediate_size": 9216, "hidden_size_per_layer_input": 256,
         "layer_types": _sliding(30, 6), "vocab_size": 262144, "tie_word_embeddings": True},
    ),
    Preset(
        "mixtral-8x7b",
        ("mistralai/Mixtral-8x7B-v0.1", "mistralai/Mixtral-8x7B-Instruct-v0.1"),
        {"model_type": "mixtral", "hidden_size": 4096, "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
         "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000},
    ),
)


def find_preset(name: str) -> Preset | None:
    """A preset by its name or one of its hub ids (case-insensitive)."""
    wanted = name.strip().lower()
    for preset in PRESETS:
        if wanted == preset.name or wanted in (h.lower() for h in preset.hub_ids):
            return preset
    return None

