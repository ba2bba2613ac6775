"""The engine-neutral answer about one adapter: a verdict, the engine's reason, and per module
whether it is served and why not. Every engine module returns these records."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from metrale_cli.adapters.findings import layer_ranges


class Verdict(str, Enum):
    # The engine loads it and applies what PEFT applies.
    SERVES = "serves"
    # It loads and serves something else: part of it ignored, a scale taken otherwise.
    DIFFERS = "differs"
    # It loads and changes nothing: every LoRA weight unused.
    IGNORES = "ignores"
    # The load fails with an error and the engine keeps serving.
    REFUSES = "refuses"
    # The error takes the engine down, every other adapter's requests with it.
    CRASHES = "crashes"
    # Named at start-up, the error stops the server starting: nothing is ever served.
    FAILS_STARTUP = "fails_startup"
    # The engine cannot serve the base model with LoRA at all.
    UNSUPPORTED_MODEL = "unsupported_model"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class ModuleOutcome:
    """One adapter module (as the adapter names it) on the layers where the engine treats it
    alike: served there, or dropped and why."""

    module: str
    engine_module: str | None
    layers: tuple[int, ...]
    served: bool
    why: str = ""

    def record(self) -> dict[str, Any]:
        return {"module": self.module, "engine_module": self.engine_module,
                "layers": list(self.layers), "layer_ranges": layer_ranges(list(self.layers)),
                "served": self.served, "why": self.why}


@dataclass(frozen=True)
class EngineVerdict:
    """What `engine` at `version` does with one adapter under `flags`."""

    engine: str
    version: str
    verdict: Verdict
    # The engine's own words where it gives them (its error text), else metrale's.
    reason: str
    # A stable name for the kind of reason (`rank_above_max`, `dora`, `target_modules`, ...).
    reason_class: str
    flags: dict[str, Any]
    # "given": the flags the user passed; "recommended": the ones metrale recommends.
    flags_source: str
    modules: list[ModuleOutcome] = field(default_factory=list)
    # Where another build answers otherwise (vLLM's CPU build).
    elsewhere: dict[str, dict[str, str]] = field(default_factory=dict)
    # Per load path (`runtime`, `startup`, `offline`): its verdict and the engine's words.
    # `verdict` is the runtime path's.
    paths: dict[str, dict[str, str]] = field(default_factory=dict)

    @property
    def serves(self) -> bool:
        return self.verdict is Verdict.SERVES

    def record(self) -> dict[str, Any]:
        return {"name": self.engine, "version": self.version, "verdict": self.verdict.value,
                "reason": self.reason, "reason_class": self.reason_class,
                "flags": self.flags, "flags_source": self.flags_source,
                "modules": [m.record() for m in self.modules], "elsewhere": self.elsewhere,
                "paths": self.paths}
