"""The eight pool modules (`LoraModule`, in the fixed `ALL` order a slot's entries follow),
where each applies, and their dims."""

from __future__ import annotations

from enum import Enum

from metrale_cli.model.config import LayerType, ModelConfig


class LoraModule(str, Enum):
    Q_PROJ = "q_proj"
    K_PROJ = "k_proj"
    V_PROJ = "v_proj"
    O_PROJ = "o_proj"
    GATE_PROJ = "gate_proj"
    UP_PROJ = "up_proj"
    DOWN_PROJ = "down_proj"
    # The Gated-DeltaNet block's output projection (`linear_attn.out_proj`), linear-attention
    # value width to hidden. O_PROJ instead reads the attention head width and applies only to
    # full-attention layers.
    OUT_PROJ = "out_proj"

    @property
    def is_dense_ffn(self) -> bool:
        return self in (LoraModule.GATE_PROJ, LoraModule.UP_PROJ, LoraModule.DOWN_PROJ)

    @property
    def is_gdn_out(self) -> bool:
        return self is LoraModule.OUT_PROJ

    @property
    def peft_name(self) -> str:
        """The module's name in a PEFT `target_modules` list."""
        return self.value

    @property
    def peft_path(self) -> str:
        """The module's path inside a decoder layer (`self_attn.q_proj`, `linear_attn.out_proj`)."""
        if self.is_dense_ffn:
            return f"mlp.{self.value}"
        if self.is_gdn_out:
            return f"linear_attn.{self.value}"
        return f"self_attn.{self.value}"

    def applies_to_layer(self, cfg: ModelConfig, layer: int) -> bool:
        """q/k/v/o on full-attention layers; gate/up/down on every layer of a model with no
        routed experts; out_proj on every other layer. Layout, packing and landing all filter by
        it, so the reserved and the written offsets agree."""
        full_attn = cfg.layer_type(layer) is LayerType.FULL_ATTENTION
        if self.is_dense_ffn:
            return cfg.num_experts == 0
        if self.is_gdn_out:
            return not full_attn
        return full_attn

    def dims(self, cfg: ModelConfig) -> tuple[int, int]:
        """`(out_dim, in_dim)` of the base projection: A is `[r, in_dim]`, B is `[out_dim, r]`.
        On a gated-attention model q_proj's output includes the gate, so it is twice
        `num_attention_heads * head_dim`."""
        h = cfg.hidden_size
        attn_width = cfg.num_attention_heads * cfg.head_dim
        if self is LoraModule.Q_PROJ:
            return (2 if cfg.attn_gated else 1) * attn_width, h
        if self in (LoraModule.K_PROJ, LoraModule.V_PROJ):
            return cfg.num_key_value_heads * cfg.head_dim, h
        if self is LoraModule.O_PROJ:
            return h, attn_width
        if self in (LoraModule.GATE_PROJ, LoraModule.UP_PROJ):
            return cfg.intermediate_size, h
        if self is LoraModule.DOWN_PROJ:
            return h, cfg.intermediate_size
        return h, cfg.linear_value_width

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
                raise ValueError(
                    f"unknown module {name!r}; modules: {', '.join(m.value for m in ALL)}"
                ) from None
        return [m for m in ALL if m in chosen]


ALL: tuple[LoraModule, ...] = tuple(LoraModule)
