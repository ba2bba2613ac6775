"""The seam every stage asks an engine through: the `Engine` protocol and what `simulate`
needs of an engine's cache (`SlotTiers`). An engine module (vllm.py) defines one object that
satisfies the protocol, `ENGINE`, and engines/__init__.py registers it by name."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from metrale_cli.adapters.audit import AdapterReport
    from metrale_cli.engines.verdict import EngineVerdict
    from metrale_cli.model.config import ModelConfig


@dataclass(frozen=True)
class SlotTiers:
    """An engine's adapter cache as `simulate` replays it: `gpu_slots` adapters in the running
    batch's GPU buffers, up to `host_slots` loaded adapters kept in host memory (a hit there
    skips the disk), each tier's eviction order, and the scheduler's admission of a request
    whose adapter cannot get a GPU slot now. Bytes are one GPU's (the engine's `memory`)."""

    # The GPU slots adapters get: vLLM's --max-loras; SGLang's --max-loras-per-batch less the
    # one its base model holds.
    gpu_slots: int
    # None: no limit (SGLang without --max-loaded-loras keeps every adapter it loaded).
    host_slots: int | None
    slot_bytes: int
    host_bytes: int
    # The rank a slot is padded to: an adapter of rank r copies r/max_rank of a slot.
    max_rank: int
    # "lru": the least recently used adapter not in the running batch; "fifo": the one loaded
    # longest ago (SGLang's --lora-eviction-policy fifo).
    gpu_eviction: str
    host_eviction: str
    # "skip": the request waits and later requests whose adapters fit go ahead (vLLM's V1
    # scheduler); "fcfs": it blocks the queue.
    admission: str
    # Where each rule was read (file and function in the engine's source).
    source: str

    def record(self) -> dict[str, Any]:
        return {"gpu_slots": self.gpu_slots, "host_slots": self.host_slots,
                "slot_bytes": self.slot_bytes, "host_bytes": self.host_bytes,
                "max_rank": self.max_rank,
                "gpu_eviction": self.gpu_eviction, "host_eviction": self.host_eviction,
                "admission": self.admission, "source": self.source}


class Engine(Protocol):
    """One serving engine at the versions its rules were read from. `given` maps the CLI's
    option names (`--max-rank`, `--tp`, ...) to the values the user passed (None: not given);
    an engine reads those of `options[command]` and refuses bad values with UsageError."""

    name: str
    version: str
    versions: tuple[str, ...]
    # model_type -> the engine's facts for that family: a row for every FAMILIES row.
    families: Mapping[str, Any]
    # command (`inspect`, `layout`) -> the option names it takes there.
    options: Mapping[str, frozenset[str]]

    def installed_warning(self) -> str | None:
        """One line when the engine is importable here at a version the rules are not."""

    def check_tp(self, model: ModelConfig, tp: int, fully_sharded: bool) -> None:
        """Refuse a TP degree the engine cannot build `model` at (UsageError)."""

    def flags(self, model: ModelConfig, given: Mapping[str, object]) -> Any | None:
        """The engine's flags from what the user gave, its defaults for the rest; None when
        nothing was given (then `recommend` chooses them)."""

    def startup(self, model: ModelConfig, flags: Any, reports: list[AdapterReport]) -> Any:
        """`flags` as the server holds them once `reports` are its start-up adapters (SGLang
        sizes its pool from them; vLLM's flags are what they are)."""

    def layout_flags(self, model: ModelConfig, reports: list[AdapterReport],
                     given: Mapping[str, object]) -> Any:
        """`layout`'s flags: the given ones, what the startup adapters need for the rest."""

    def judge(self, report: AdapterReport, model: ModelConfig, flags: Any,
              flags_source: str = "given") -> EngineVerdict:
        """What the engine does with one adapter under `flags`."""

    def recommend(self, reports: list[AdapterReport], model: ModelConfig,
                  given: Mapping[str, object]) -> Any:
        """The smallest flags under which every adapter the engine can take loads; has
        `.flags` and `.record()`."""

    def memory(self, model: ModelConfig, flags: Any, reports: list[AdapterReport] | None,
               budget_bytes: int | None) -> Any:
        """The engine's LoRA bytes on one GPU; has `.record()`."""

    def tiers(self, memory: Any) -> SlotTiers:
        """The adapter cache `simulate` replays for these flags and bytes."""

    def inspect_record(self, model: ModelConfig, verdicts: list[EngineVerdict],
                       recommendation: Any, flags: Any, source: str,
                       reports: list[AdapterReport]) -> dict[str, Any]:
        """The `engine` part of `inspect --json` for `reports`, judged in `verdicts`."""
