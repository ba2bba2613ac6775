"""The pool's LoRA modules (`LoraModule`, the `--modules` vocabulary), where each applies and
its dims, as the model's family declares them (model/families.py)."""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum

from metrale_cli.errors import UsageError, did_you_mean
from metrale_cli.model.config import ATTENTION_KINDS, LayerType, ModelConfig
from metrale_cli.model.families import VOCABULARY, Layers, ModuleSpec


class LoraModule(str, Enum):
    """The vocabulary in layer order: a fused projection sits where its slices would, so the
    seed's eight keep their relative order and any family's modules read in this order."""

    Q_PROJ = "q_proj"
    # Multi-head latent attention's low-rank query and compressed KV (deepseek_v2/v3).
    Q_A_PROJ = "q_a_proj"
    Q_B_PROJ = "q_b_proj"
    KV_A_PROJ_WITH_MQA = "kv_a_proj_with_mqa"
    KV_B_PROJ = "kv_b_proj"
    K_PROJ = "k_proj"
    V_PROJ = "v_proj"
    # Fused projections (phi3's q|k|v and gate|up, glm4's gate|up): one pair spans the slices.
    QKV_PROJ = "qkv_proj"
    O_PROJ = "o_proj"
    GATE_PROJ = "gate_proj"
    UP_PROJ = "up_proj"
    GATE_UP_PROJ = "gate_up_proj"
    DOWN_PROJ = "down_proj"
    # starcoder2's MLP: up (c_fc) and down (c_proj), no gate.
    C_FC = "c_fc"
    C_PROJ = "c_proj"
    # Gemma 4's per-layer input: hidden to its width (gate) and back (projection).
    PER_LAYER_INPUT_GATE = "per_layer_input_gate"
    PER_LAYER_PROJECTION = "per_layer_projection"
    # The Gated-DeltaNet block's output projection (`linear_attn.out_proj`), linear-attention
    # value width to hidden. O_PROJ instead reads the attention head width and applies only to
    # attention layers.
    OUT_PROJ = "out_proj"

    @property
    def peft_name(self) -> str:
        """The module's name in a PEFT `target_modules` list."""
        return self.value

    @property
    def peft_path(self) -> str:
        """The module's usual path inside a decoder layer (`self_attn.q_proj`,
        `linear_attn.out_proj`); `path_in(cfg, layer)` is a family's own."""
        return _VOCABULARY[self.value].path

    def path_in(self, cfg: ModelConfig, layer: int) -> str:
        """The module's path inside `cfg`'s decoder layer `layer`, as its family declares it."""
        return self.declared(cfg, layer).path

    def spec(self, cfg: ModelConfig, layer: int) -> ModuleSpec | None:
        """The family's entry for this module on `layer`: attention modules on attention
        layers (full, sliding-window or chunked), the dense MLP's on every layer of a model with
        no routed experts (deepseek's and llama4's: on its dense layers), a shared expert's on
        the MoE layers, out_proj on linear-attention layers, nemotron_h's up/down on its MLP
        blocks, a family read from weights' modules on the layers whose weights carry them;
        None where the family has no such module there, or the config lacks what it needs
        (MLA's q_a_proj without a q_lora_rank). A family declares a module once per group of
        layers whose path or widths differ; ValueError where two of its entries claim `layer`
        (a family row's mistake: tests/test_families.py asks every layer of every family)."""
        name = self.value
        found = [spec for spec in cfg.family.modules
                 if spec.name == name and _on_layer(cfg, spec, layer)]
        if len(found) > 1:
            raise ValueError(f"{cfg.model_type} declares {self.value} {len(found)} times on "
                             f"layer {layer}")
        return found[0] if found else None

    def applies_to_layer(self, cfg: ModelConfig, layer: int) -> bool:
        """Whether `layer` carries this module, as the family declares it (`spec`). Layout,
        packing and landing all filter by it, so the reserved and the written offsets agree."""
        return self.spec(cfg, layer) is not None

    def dims(self, cfg: ModelConfig, layer: int) -> tuple[int, int]:
        """`(out_dim, in_dim)` of the base projection on `layer`: A is `[r, in_dim]`, B is
        `[out_dim, r]`. On a gated-attention model q_proj's output includes the gate, so it is
        twice `num_attention_heads * head_dim`; a fused projection's output is its slices'
        sum."""
        spec = self.declared(cfg, layer)
        return sum(_width(cfg, w) for w in spec.out), _width(cfg, spec.in_)

    def slices(self, cfg: ModelConfig, layer: int) -> tuple[int, ...]:
        """The output widths of the projection's slices on `layer`, in the weight's order (one
        for an unfused projection)."""
        return tuple(_width(cfg, w) for w in self.declared(cfg, layer).out)

    def declared(self, cfg: ModelConfig, layer: int) -> ModuleSpec:
        """The family's entry for this module on `layer`; ValueError where it has none."""
        spec = self.spec(cfg, layer)
        if spec is None:
            raise ValueError(f"{cfg.model_type} layer {layer} has no {self.value}")
        return spec

    def shapes(self, cfg: ModelConfig) -> tuple[tuple[int, int], ...]:
        """Every `(out_dim, in_dim)` the module has on `cfg`'s layers, in layer order, once
        each."""
        return tuple(dict.fromkeys(self.dims(cfg, layer) for layer in range(cfg.num_hidden_layers)
                                   if self.applies_to_layer(cfg, layer)))

    @classmethod
    def parse_list(cls, text: str) -> list[LoraModule]:
        """`q_proj,k_proj,...` (or `all`) into modules in `ALL` order; ValueError names the bad
        one."""
        names = [n.strip() for n in text.split(",") if n.strip()]
        if names == ["all"]:
            return list(ALL)
        chosen: set[LoraModule] = set()
        for name in names:
            try:
                chosen.add(cls(name))
            except ValueError:
                known = [m.value for m in ALL]
                raise ValueError(f"unknown module {name!r}{did_you_mean(name, known)}; modules: "
                                 f"{', '.join(known)}") from None
        return [m for m in ALL if m in chosen]

    @classmethod
    def parse_option(cls, text: str, option: str = "--modules") -> list[LoraModule]:
        """`parse_list` for an option's value: a UsageError naming `option`; never empty."""
        try:
            modules = cls.parse_list(text)
        except ValueError as exc:
            raise UsageError(f"{option}: {exc}") from None
        if not modules:
            raise UsageError(f"{option} is empty")
        return modules


def _on_layer(cfg: ModelConfig, spec: ModuleSpec, layer: int) -> bool:
    """Whether `spec`'s layers (its `Layers` kind, its config condition) include `layer`."""
    if (spec.needs and not getattr(cfg, spec.needs)) or (spec.unless and getattr(cfg, spec.unless)):
        return False
    if spec.layers is Layers.LISTED:
        return layer in spec.on_layers
    kind = cfg.layer_type(layer)
    if spec.layer_type and kind.value != spec.layer_type:
        return False
    if spec.layers is Layers.EVERY:
        return True
    if spec.layers is Layers.OWN_KV:
        return not cfg.is_kv_shared_layer(layer)
    if spec.layers is Layers.SHARED_KV:
        return cfg.is_kv_shared_layer(layer)
    if spec.layers is Layers.DENSE_MLP:
        return cfg.num_experts == 0
    if spec.layers is Layers.DENSE_MLP_LAYERS:
        return not cfg.is_moe_layer(layer)
    if spec.layers is Layers.MOE_LAYERS:
        return cfg.is_moe_layer(layer)
    if spec.layers is Layers.LINEAR_ATTENTION:
        return kind is LayerType.LINEAR_ATTENTION
    if spec.layers is Layers.MLP_BLOCKS:
        return kind is LayerType.MLP
    return kind in ATTENTION_KINDS


def _width(cfg: ModelConfig, width: str | int) -> int:
    """A width a family names (a `ModelConfig` field or property), or gives in elements."""
    return width if isinstance(width, int) else getattr(cfg, width)


_VOCABULARY = {spec.name: spec for spec in VOCABULARY}
ALL: tuple[LoraModule, ...] = tuple(LoraModule)


def family_modules(cfg: ModelConfig) -> tuple[LoraModule, ...]:
    """The modules `cfg`'s family declares, in its slot order (a module declared for several
    groups of layers sits where its first entry does)."""
    return tuple(dict.fromkeys(LoraModule(spec.name) for spec in cfg.family.modules))


def in_slot_order(cfg: ModelConfig, modules: Iterable[LoraModule]) -> tuple[LoraModule, ...]:
    """`modules` that `cfg`'s family declares, in the family's slot order (a module it does not
    declare applies on no layer, so it holds no bytes)."""
    chosen = set(modules)
    return tuple(m for m in family_modules(cfg) if m in chosen)
