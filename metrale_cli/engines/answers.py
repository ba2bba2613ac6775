"""An engine's answers to `inspect` and `layout`, as library calls: the records the CLI
prints (`inspect --engine E --json`, `layout --engine E --json`), for any registered engine."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

# At run time, not only for type checking: the library's argument check reads them.
from metrale_cli.engines import check_given
from metrale_cli.engines.engine import Engine
from metrale_cli.errors import NotServable, refused_line
from metrale_cli.layout.pipeline import AuditedAdapters

if TYPE_CHECKING:
    from metrale_cli.adapters.audit import AdapterReport
    from metrale_cli.engines.verdict import EngineVerdict
    from metrale_cli.model.config import ModelConfig


@dataclass(frozen=True)
class EngineInspection:
    """The audit's record with each adapter's verdict in `adapters[i].engine` and the
    engine's flags and recommendation in `engine`; `flags` the engine's flags object the
    verdicts were judged under (what `--confirm` starts the engine with)."""

    record: dict[str, Any]
    verdicts: list[EngineVerdict]
    flags: Any

    @property
    def all_serve(self) -> bool:
        return all(v.serves for v in self.verdicts)


def engine_inspect(audited: AuditedAdapters, engine: Engine,
                   given: Mapping[str, object] | None = None) -> EngineInspection:
    """What `engine` does with each audited adapter under the flags in `given` (CLI option
    names to values) and the ones it recommends for the rest."""
    given = dict(given or {})
    check_given("engine_inspect", given)
    cfg, reports = audited.model, audited.reports
    # `recommend` refuses a TP degree the model cannot take before it sizes anything; the
    # given flags then replace the recommended ones they name, and only those.
    recommendation = engine.recommend(reports, cfg, given)
    flags = engine.flags(cfg, given, recommendation.flags)
    source = "given" if flags is not None else "recommended"
    flags = engine.startup(cfg, flags if flags is not None else recommendation.flags, reports)
    verdicts = [engine.judge(r, cfg, flags, source) for r in reports]
    record = audited.record()
    for adapter, verdict in zip(record["adapters"], verdicts, strict=True):
        adapter["engine"] = verdict.record()
    record["engine"] = engine.inspect_record(cfg, verdicts, recommendation, flags, source,
                                             reports)
    # Which of the flags judged are the user's (the rest are the recommended ones), and, where
    # the flags judged are not the recommended ones, their LoRA bytes: what `layout` gives for
    # the same options, beside the recommended line's.
    record["engine"]["given"] = [k for k, v in given.items()
                                 if v is not None and v is not False and k not in _NOT_FLAGS]
    judged = None
    if (record["engine"]["flags"] != record["engine"]["recommended"]["flags"]
            and engine.model_support(cfg) is None):
        memory = engine.memory(cfg, flags, reports or None, None).record()
        judged = {k: memory[k] for k in ("lora_bytes", "slot_bytes", "host_cache_bytes")}
    record["engine"]["memory"] = judged
    return EngineInspection(record, verdicts, flags)


# Options of `inspect --engine` that are not the engine's serve flags.
_NOT_FLAGS = ("--experts", "--confirm", "--engine-python", "--engine-args", "--confirm-timeout")


def engine_layout(audited: AuditedAdapters, engine: Engine,
                  given: Mapping[str, object] | None = None,
                  budget_bytes: int | None = None) -> dict[str, Any]:
    """The engine's LoRA bytes on one GPU (and its host cache, and what `simulate` replays);
    with adapters, their rank, count and modules fill in what `given` leaves out. The engine
    allocates its buffers whatever it does with the adapters: each it would not serve as PEFT
    serves it is named in `engine.not_served` with its verdict and reason (`layout` then
    exits 1), the bytes given all the same."""
    given = dict(given or {})
    check_given("engine_layout", given)
    cfg, reports = audited.model, audited.reports
    flags = startable_layout_flags(engine, cfg, reports, given)
    memory = engine.memory(cfg, flags, reports or None, budget_bytes)
    not_served = [{"adapter": r.name, "verdict": v.verdict.value, "reason": v.reason}
                  for r, v in unserved(engine, cfg, reports, flags)]
    return {"model": cfg.record(), "engine": {**memory.record(),
                                              "tiers": engine.tiers(memory).record(),
                                              "not_served": not_served}}


def startable_layout_flags(engine: Engine, model: ModelConfig, reports: list[AdapterReport],
                           given: Mapping[str, object]) -> Any:
    """`engine.layout_flags`, where the engine starts on `model` at all: where it never does
    it allocates no buffers, so `layout` and `simulate` size none and say why (NotServable,
    exit 1), as `inspect` recommends no serve line."""
    unsupported = engine.model_support(model)
    if unsupported is not None:
        raise NotServable(f"{engine.title} never starts on this model: {unsupported[1]}")
    return engine.layout_flags(model, reports, given)


def unserved(engine: Engine, model: ModelConfig, reports: Sequence[AdapterReport],
             flags: Any) -> list[tuple[AdapterReport, EngineVerdict]]:
    """Each adapter `engine` would not serve as PEFT serves it under `flags`, with its
    verdict: under an engine the engine's judgement, not the pool's audit, decides."""
    return [(r, v) for r, v in ((r, engine.judge(r, model, flags)) for r in reports)
            if not v.serves]


def refuse_unserved(engine: Engine, model: ModelConfig, reports: Sequence[AdapterReport],
                    flags: Any) -> None:
    """NotServable naming every adapter `engine` would not serve as PEFT serves it under
    `flags`, with its verdict and reason (`simulate --engine` replays only adapters the
    engine serves)."""
    refused = unserved(engine, model, reports, flags)
    if refused:
        raise NotServable(refused_line([f"{r.name} ({v.verdict.value})" for r, v in refused],
                                       len(reports), f"not served as PEFT serves them by "
                                       f"{engine.label} {engine.version} under these flags"),
                          [f"{r.name}: {engine.label} {v.verdict.value}: {v.reason}"
                           for r, v in refused])
