"""The seam every stage asks an engine through: the `Engine` protocol and what `simulate`
needs of an engine's cache (`SlotTiers`). An engine package (vllm/, sglang/) defines one object
that satisfies the protocol, `ENGINE`, and engines/__init__.py registers it by name; a third
engine is one more such object given to `register`. The protocol carries what the commands
and views ask of an engine, so none of them names one."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from metrale_cli.adapters.audit import AdapterReport
    from metrale_cli.engines.verdict import EngineVerdict
    from metrale_cli.layout.pipeline import AuditedAdapters
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


class Recommendation(Protocol):
    """The flags an engine recommends for a set of adapters and the line that starts it."""

    flags: Any

    def serve_line(self) -> str | None:
        """The command that starts the engine with these flags and adapters (None: no adapter
        can start it, and it cannot start without one)."""

    def record(self) -> dict[str, Any]:
        """`inspect --json`'s `engine.recommended`: `flags`, `serve`, `lora_bytes` (None when
        not sized, `memory_note` saying why), `slot_bytes`, `host_cache_bytes`, `shut_out`."""


class Confirmation(Protocol):
    """An engine's prediction set against the engine running."""

    @property
    def agrees(self) -> bool: ...

    @property
    def record(self) -> dict[str, Any]: ...


class Engine(Protocol):
    """One serving engine at the versions its rules were read from. `given` maps the CLI's
    option names (`--max-rank`, `--tp`, ...) to the values the user passed (None: not given);
    an engine reads those of `options[command]` and refuses bad values with UsageError."""

    name: str
    version: str
    versions: tuple[str, ...]
    # model_type -> the engine's facts for that family: a row for every FAMILIES row.
    families: Mapping[str, Any]
    # command (`inspect`, `layout`, `simulate`) -> the option names it takes there (those of
    # the CLI's options that mean something to this engine; the others are refused by name).
    options: Mapping[str, frozenset[str]]
    # How the views name it: `label` alone (`vLLM`), `title` with its version and build.
    label: str
    title: str
    # The column of `inspect`'s module table that names the engine's own module.
    module_column: str
    # The load paths a verdict's `paths` holds beside the runtime one, as (key, label):
    # shown where they answer otherwise.
    other_paths: tuple[tuple[str, str], ...]
    # The flag the GPU slots are (what `--budget` answers in), and the one that sizes the
    # host cache, as the engine spells them.
    slots_flag: str
    host_flag: str
    # Whether `inspect --confirm` can start this engine and check its verdicts (`confirm`).
    can_confirm: bool

    def installed_warning(self) -> str | None:
        """One line when the engine is importable here at a version the rules are not."""

    def flag_line(self, flags: Mapping[str, Any], pool: Mapping[str, Any] | None) -> str:
        """The flags of a record (`flags.record()`, and the pool its start-up infers where
        the engine infers one) in one line of words, for the views."""

    def flags(self, model: ModelConfig, given: Mapping[str, object],
              recommended: Any) -> Any | None:
        """The flags the user gave, the `recommended` ones (`recommend`'s) for the rest; None
        when nothing was given (then the recommended ones are judged under)."""

    def startup(self, model: ModelConfig, flags: Any, reports: list[AdapterReport]) -> Any:
        """`flags` as the server holds them once `reports` are its start-up adapters (SGLang
        sizes its pool from them; vLLM's flags are what they are)."""

    def model_support(self, model: ModelConfig) -> tuple[str, str] | None:
        """Why the engine never starts on `model`, whatever the adapters and flags (no
        `architectures`, a class it cannot pick, ...): the reason's class and the engine's
        words; None where it starts."""

    def layout_flags(self, model: ModelConfig, reports: list[AdapterReport],
                     given: Mapping[str, object]) -> Any:
        """`layout`'s flags: the given ones, what the startup adapters need for the rest."""

    def judge(self, report: AdapterReport, model: ModelConfig, flags: Any,
              flags_source: str = "given") -> EngineVerdict:
        """What the engine does with one adapter under `flags`."""

    def recommend(self, reports: list[AdapterReport], model: ModelConfig,
                  given: Mapping[str, object]) -> Recommendation:
        """The smallest flags under which every adapter the engine can take loads, at the
        deployment `given` names (its TP degree, dtypes); a TP degree the model cannot take is
        refused (UsageError) before anything is sized."""

    def memory(self, model: ModelConfig, flags: Any, reports: list[AdapterReport] | None,
               budget_bytes: int | None) -> Any:
        """The engine's LoRA bytes on one GPU: has `.lora_bytes` and `.record()`, the
        `engine` part of `layout --json` (`name`, `version`, `flags`, `lora_bytes`,
        `slot_bytes`, `host_cache_bytes`, `modules`: each `module`, `kind`, `layers`,
        `bytes`; under a budget `budget_bytes` and `max_loras_fit`), which the views draw;
        a plan no machine holds is refused (engines/shared.py `refuse_absurd`)."""

    def tiers(self, memory: Any) -> SlotTiers:
        """The adapter cache `simulate` replays for these flags and bytes."""

    def inspect_record(self, model: ModelConfig, verdicts: list[EngineVerdict],
                       recommendation: Recommendation, flags: Any, source: str,
                       reports: list[AdapterReport]) -> dict[str, Any]:
        """The `engine` part of `inspect --json` for `reports`, judged in `verdicts`: `name`,
        `version`, `flags` (`flags.record()`), `flags_source`, `all_serve` and `recommended`
        (`recommendation.record()`), and what else the engine says."""

    def confirm(self, audited: AuditedAdapters, given: Mapping[str, object], *,
                python: str | None, engine_args: str | None, timeout_s: float | None,
                progress: Callable[[str], None]) -> Confirmation:
        """`inspect --confirm` (only where `can_confirm`): the prediction, then the engine
        started here (`python` runs it, with `engine_args` more of its own arguments) and
        each prediction set against what it did, within `timeout_s` (None: the engine's
        default)."""
