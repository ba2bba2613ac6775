"""Audit findings: severity, a stable code, one line; and the collector that groups one finding
over every layer it hits. Shared by the audit and the expert and overlay scans."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from enum import Enum


class Severity(str, Enum):
    ERROR = "error"
    WARNING = "warning"
    INFO = "info"


@dataclass(frozen=True)
class Finding:
    severity: Severity
    code: str
    message: str

    def record(self) -> dict[str, str]:
        return {"severity": self.severity.value, "code": self.code, "message": self.message}


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
        self.layers: dict[tuple[Severity, str, str], list[int]] = defaultdict(list)
        self.single: list[Finding] = []

    def add(self, severity: Severity, code: str, message: str) -> None:
        self.single.append(Finding(severity, code, message))

    def at(self, severity: Severity, code: str, subject: str, layer: int | None) -> None:
        self.layers[(severity, code, subject)].append(-1 if layer is None else layer)

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
