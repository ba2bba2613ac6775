"""Audit findings: severity, a stable code, one line; and the collector that groups one finding
over every layer it hits. Shared by the audit and the expert and overlay scans.

`Code` is every code they emit; docs/inspect.md documents each (a test holds the two equal).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from enum import Enum


class Severity(str, Enum):
    ERROR = "error"
    WARNING = "warning"
    INFO = "info"


class Code(str, Enum):
    """The stable finding codes, grouped by what they judge."""

    # One (A, B) pair, wherever it sits (pairs.py).
    MISSING_A = "missing_a"
    MISSING_B = "missing_b"
    BAD_DTYPE = "bad_dtype"
    MIXED_DTYPE = "mixed_dtype"
    SHAPE_MISMATCH = "shape_mismatch"
    RANK_AB_MISMATCH = "rank_ab_mismatch"
    RANK_CONFIG_MISMATCH = "rank_config_mismatch"
    RANK_ABOVE_MAX = "rank_above_max"
    # Where a pair sits.
    LAYER_OUT_OF_RANGE = "layer_out_of_range"
    MODULE_NOT_APPLICABLE = "module_not_applicable"
    UNSERVABLE_MODULE = "unservable_module"
    UNKNOWN_TENSOR = "unknown_tensor"
    NO_SERVABLE_MODULES = "no_servable_modules"
    # Routed experts and the router.
    EXPERT_LORA = "expert_lora"
    EXPERT_OUT_OF_RANGE = "expert_out_of_range"
    EXPERT_AMBIGUOUS = "expert_ambiguous"
    RSLORA_REWRITE = "rslora_rewrite"
    MOE_REWRITE = "moe_rewrite"
    # Token overlays.
    TOKEN_OVERLAY = "token_overlay"
    OVERLAY_CONFIG = "overlay_config"
    OVERLAY_INDICES_MISSING = "overlay_indices_missing"
    OVERLAY_MISSING = "overlay_missing"
    OVERLAY_SHAPE = "overlay_shape"
    OVERLAY_TOKEN_RANGE = "overlay_token_range"
    OVERLAY_DUPLICATE_TOKENS = "overlay_duplicate_tokens"
    OVERLAY_TABLE = "overlay_table"
    # Not plain LoRA.
    DORA = "dora"
    LORA_BIAS = "lora_bias"
    BIAS = "bias"
    MODULES_TO_SAVE = "modules_to_save"
    QALORA = "qalora"
    BDLORA = "bdlora"
    ALORA = "alora"
    MEGATRON = "megatron"
    LAYER_REPLICATION = "layer_replication"
    BASE_MUTATING_INIT = "base_mutating_init"
    VARIANT = "variant"
    FULL_WEIGHTS = "full_weights"
    EMBEDDING_LORA = "embedding_lora"
    # The config against the file.
    BAD_PATTERN = "bad_pattern"
    SLOW_PATTERN = "slow_pattern"
    LARGE_PATTERN = "large_pattern"
    BAD_CONFIG_VALUE = "bad_config_value"
    PATTERN_OVERLAP = "pattern_overlap"
    UNEXPLAINED_KEY = "unexplained_key"
    TARGETED_MISSING = "targeted_missing"
    LAYERS_WITH_REGEX = "layers_with_regex"
    FAN_IN_FAN_OUT = "fan_in_fan_out"
    VELORA = "velora"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Finding:
    severity: Severity
    code: Code
    message: str

    def record(self) -> dict[str, str]:
        return {"severity": self.severity.value, "code": self.code.value,
                "message": self.message}


def layer_ranges(layers: list[int]) -> str:
    """`[0, 1, 2, 5, 7, 8]` -> `0-2, 5, 7-8`."""
    if not layers:
        return "-"
    ordered = sorted(set(layers))
    spans: list[str] = []
    start = prev = ordered[0]
    for n in ordered[1:] + [None]:  # type: ignore[list-item]
        if n is not None and n == prev + 1:
            prev = n
            continue
        spans.append(str(start) if start == prev else f"{start}-{prev}")
        if n is not None:
            start = prev = n
    return ", ".join(spans)


class Collector:
    """Findings grouped by (severity, code, subject) so one line names every layer it hits."""

    def __init__(self) -> None:
        self.layers: dict[tuple[Severity, Code, str], list[int]] = defaultdict(list)
        self.single: list[Finding] = []

    # `Code(code)`: a code missing from the enum fails here, at the first finding that uses it.
    def add(self, severity: Severity, code: Code, message: str) -> None:
        self.single.append(Finding(severity, Code(code), message))

    def at(self, severity: Severity, code: Code, subject: str, layer: int | None) -> None:
        """A finding on `layer` (None: not on a layer); `{where}` in `subject` becomes the
        layers, so the same subject on several layers is one finding."""
        self.layers[(severity, Code(code), subject)].append(-1 if layer is None else layer)

    def findings(self) -> list[Finding]:
        grouped = []
        for (severity, code, subject), layers in self.layers.items():
            real = [n for n in layers if n >= 0]
            where = f" on layers {layer_ranges(real)}" if real else ""
            if len(real) == 1:
                where = f" on layer {real[0]}"
            grouped.append(Finding(severity, code, subject.replace("{where}", where)))
        order = {Severity.ERROR: 0, Severity.WARNING: 1, Severity.INFO: 2}
        return sorted(self.single + grouped, key=lambda f: order[f.severity])
