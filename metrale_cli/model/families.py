"""The model families metrale knows, one row each: every fact that differs by `model_type`.

A new family whose layers carry the eight pool modules (model/modules.py) is one row here, a
preset in model/config.py if it has one, and its tests; the config parser, the audit, the
expert keys and PEFT's defaults all read this table (docs/architecture.md).
"""

from __future__ import annotations

from dataclasses import dataclass

# transformers-4 per-expert leaf names of the routed experts' projections, most families'.
EXPERT_LEAVES = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}


@dataclass(frozen=True)
class Family:
    model_type: str
    # A Gated-DeltaNet hybrid: linear- and full-attention layers (transformers' interval of 4
    # when the config gives neither), q_proj gated unless `attn_output_gate` is false.
    hybrid: bool = False
    # MoE layers follow `mlp_only_layers` and `decoder_sparse_step` (qwen3_moe's decoder
    # layers); otherwise, with routed experts, every layer is MoE.
    sparse_step: bool = False
    # PEFT's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING: what a config without
    # target_modules meant when it was trained (none for the MoE and hybrid types).
    peft_default_targets: tuple[str, ...] = ()
    # PEFT >= 0.19 with transformers 5 rewrites gate/up/down targets into expert LoRA on this
    # type (PEFT 0.21's conversion table, checked against PEFT); only with routed experts.
    peft_rewrites_moe_targets: bool = True
    # The decoder layer's MoE block and its experts' projection leaves (transformers 4 names).
    moe_block: str = "mlp"
    expert_leaves: tuple[tuple[str, str], ...] = tuple(EXPERT_LEAVES.items())


_Q_V = ("q_proj", "v_proj")
FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", peft_default_targets=_Q_V),
    Family("mistral", peft_default_targets=_Q_V),
    Family("qwen2", peft_default_targets=_Q_V),
    Family("qwen3", peft_default_targets=_Q_V),
    Family("qwen3_moe", sparse_step=True),
    Family("mixtral", peft_default_targets=_Q_V, moe_block="block_sparse_moe",
           expert_leaves=(("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2"))),
    Family("qwen3_next", hybrid=True, sparse_step=True),
    Family("qwen3_5", hybrid=True),
    Family("qwen3_5_moe", hybrid=True, peft_rewrites_moe_targets=False),
)}
