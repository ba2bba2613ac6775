"""SGLang 0.5.23 behind the engine seam (engines/engine.py): its rules for one adapter, read
from its source (rules.py), its launch_server flags (flags.py), and its model: the per-family
table, the pool a start-up builds and its bytes, the verdict per load path and the launch line
(model.py). `ENGINE` is what engines/__init__.py registers as `sglang`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from metrale_cli.engines.engine import SlotTiers
from metrale_cli.engines.sglang.flags import FLAG_OPTIONS, Flags, flags_from
from metrale_cli.engines.sglang.model import (
    FAMILIES,
    NAME,
    VERSION,
    Memory,
    Pool,
    Recommendation,
    family,
    judgements,
    model_support,
    reason,
    starts,
    verdict_of,
)
from metrale_cli.engines.shared import check_tp, installed_warning
from metrale_cli.engines.verdict import Verdict
from metrale_cli.errors import NotServable, UsageError, refused_line

if TYPE_CHECKING:
    from metrale_cli.adapters.audit import AdapterReport
    from metrale_cli.engines.engine import Confirmation
    from metrale_cli.engines.verdict import EngineVerdict
    from metrale_cli.layout.pipeline import AuditedAdapters
    from metrale_cli.model.config import ModelConfig


def lacks_pool_flags(flags: Flags) -> bool:
    """Whether a server with no start-up adapter lacks what SGLang needs to build its pool
    (--max-lora-rank and --lora-target-modules: server_args.py check_lora_server_args)."""
    return flags.max_lora_rank is None or flags.target_modules is None


def startup_batch(adapters: int) -> int:
    """--max-loras-per-batch for `adapters` start-up adapters: each and the base model (SGLang
    counts a base-only request as one of the batch: arg_groups/fields/lora.py), two at least
    (the base model and one adapter loaded at runtime)."""
    return max(2, adapters + 1)


class SglangEngine:
    """SGLang 0.5.23 as an `Engine`: its options, verdicts per load path, launch line, pool
    bytes and cache."""

    name = NAME
    version = VERSION
    versions = (VERSION,)
    families = FAMILIES
    options = {"inspect": frozenset(FLAG_OPTIONS),
               "layout": frozenset({*FLAG_OPTIONS, "--budget"}),
               "simulate": frozenset({*FLAG_OPTIONS, "--budget"})}

    label = "SGLang"
    title = f"SGLang {VERSION}"
    module_column = "SGLang module"
    other_paths = (("startup", "--lora-paths"),)
    slots_flag = "--max-loras (--max-loras-per-batch)"
    host_flag = "--max-loaded-loras"
    can_confirm = False

    def installed_warning(self) -> str | None:
        """SGLang's installed version where `sglang` is importable here."""
        return installed_warning("sglang", ("sglang",), VERSION, "the installed {dist} is "
                                 f"{{installed}}; these are SGLang {VERSION}'s rules")

    def flag_line(self, flags: Mapping[str, Any], pool: Mapping[str, Any] | None) -> str:
        """The given flags, and where a flag is left to the start-up, what it infers (the
        pool's rank and targets)."""
        targets = flags["lora_target_modules"]
        # A pool of rank 0 and no targets: no start-up adapter to infer them from.
        unset = "not inferred (no adapter starts the server)"
        rank = flags["max_lora_rank"] if flags["max_lora_rank"] is not None else (
            (f"{pool['max_lora_rank']} (inferred)" if pool["max_lora_rank"] else unset)
            if pool else "inferred")
        modules = ", ".join(targets) if targets else (
            (f"{', '.join(pool['target_modules'])} (inferred)" if pool["target_modules"]
             else unset) if pool else "inferred")
        loaded = flags["max_loaded_loras"]
        return (f"max_lora_rank {rank}, max_loras_per_batch {flags['max_loras_per_batch']}, "
                f"max_loaded_loras {loaded if loaded is not None else 'no limit'}, "
                f"eviction {flags['lora_eviction_policy']}, tp {flags['tp_size']}, "
                f"lora_backend {flags['lora_backend']}, dtype {flags['dtype']}, target "
                f"modules {modules}")

    def flags(self, model: ModelConfig, given: Mapping[str, object],
              recommended: Flags) -> Flags | None:
        """The flags given, the recommended --max-loras-per-batch where it is not (the rest
        are what the start-up infers, as in the recommendation)."""
        if all(given.get(k) in (None, False) for k in FLAG_OPTIONS):
            return None
        flags = flags_from(given, recommended.max_loras_per_batch)
        if flags.tp > 1:
            check_tp(model, flags.tp, False, self.label)
        return flags

    def startup(self, model: ModelConfig, flags: Flags,
                reports: list[AdapterReport]) -> Flags:
        """`flags` with the pool a server builds when every adapter that can start it is in
        `--lora-paths` (the others are left out of the launch line); SGLang's start-up checks
        of the set (arg_groups/lora_hook.py) refuse it as SGLang would."""
        family(model)
        kept = [r for r in reports if starts(judgements(r, model, flags)["startup"])]
        if flags.max_loaded_loras is not None and len(kept) > flags.max_loaded_loras:
            raise UsageError("--max-loaded-loras: The number of LoRA paths should not exceed "
                             f"max_loaded_loras. max_loaded_loras={flags.max_loaded_loras}, "
                             f"lora_paths={len(kept)}")
        return replace(flags, pool=Pool.at_startup(flags, model,
                                                   [r.adapter.config.raw for r in kept]))

    def model_support(self, model: ModelConfig) -> tuple[str, str] | None:
        return model_support(model)

    def layout_flags(self, model: ModelConfig, reports: list[AdapterReport],
                     given: Mapping[str, object]) -> Flags:
        # Without --max-loras, the batch `recommend` gives the start-up adapters that start
        # the server, so that `layout` and `inspect` size the same pool (SGLang's own default,
        # 8, without any).
        probe = flags_from(given)
        at_startup = [(r, judgements(r, model, probe)["startup"]) for r in reports]
        starting = [r for r, got in at_startup if starts(got)]
        if reports and not starting and lacks_pool_flags(probe):
            # No server starts: no pool to size, as `inspect --engine sglang` says.
            raise NotServable(
                refused_line([r.name for r in reports], len(reports), f"start no {self.title} "
                             "server, which without one needs --max-rank and --modules"),
                [f"{r.name}: {reason(got)}" for r, got in at_startup])
        flags = flags_from(given, startup_batch(len(starting)) if reports else None)
        if not reports and lacks_pool_flags(flags):
            raise UsageError("--engine sglang without adapters needs --max-rank and --modules: "
                             "When no initial --lora-paths is provided, you need to specify "
                             "both --max-lora-rank and --lora-target-modules for LoRA "
                             "initialization.")
        if flags.tp > 1:
            check_tp(model, flags.tp, False, self.label)
        return self.startup(model, flags, reports)

    def judge(self, report: AdapterReport, model: ModelConfig, flags: Flags,
              flags_source: str = "given") -> EngineVerdict:
        return verdict_of(report, model, flags, flags_source)

    def recommend(self, reports: list[AdapterReport], model: ModelConfig,
                  given: Mapping[str, object]) -> Recommendation:
        """The given flags, and without `--max-loras` a batch that holds every start-up
        adapter and the base model (`startup_batch`)."""
        probe = flags_from(given)
        if probe.tp > 1:
            check_tp(model, probe.tp, False, self.label)
        at_startup = [(r, judgements(r, model, probe)["startup"]) for r in reports]
        unsupported = model_support(model)
        if unsupported is not None:
            # No adapter starts a server that cannot start: each is left out with the reason.
            kept, shut_out = [], [f"{r.name}: {unsupported[1]}" for r in reports]
        else:
            kept = [r for r, got in at_startup if starts(got)]
            shut_out = [f"{r.name}: {reason(got)}" for r, got in at_startup if not starts(got)]
        flags = self.startup(model, flags_from(given, startup_batch(len(kept))), kept)
        memory, note = None, ""
        if unsupported is not None:
            note = f"none: SGLang never starts on this model ({unsupported[1]})"
        elif not kept and lacks_pool_flags(probe):
            note = ("none: no adapter can start the server, and without one it needs --max-rank "
                    "and --modules")
        else:
            try:
                memory = Memory.of(model, flags, flags.pool or Pool.at_startup(flags, model, []),
                                   kept)
            except UsageError as exc:
                note = str(exc)
        paths = [(r.name, str(Path(r.adapter.path).resolve())) for r in kept]
        return Recommendation(flags, model, paths, memory, note, shut_out,
                              "" if unsupported is None else unsupported[1])

    def memory(self, model: ModelConfig, flags: Flags, reports: list[AdapterReport] | None,
               budget_bytes: int | None) -> Memory:
        return Memory.of(model, flags, flags.pool or Pool.at_startup(flags, model, []), reports,
                         budget_bytes)

    def tiers(self, memory: Memory) -> SlotTiers:
        f = memory.flags
        # The base model holds a slot of its own: init_memory_pool loads it (fetch_new_loras
        # ({None})) and prepare_lora_batch evicts it only when no adapter outside the batch
        # can go (mem_pool.py get_available_buffer_slot: "Prefer evicting LoRA adapters over
        # the base model"), so with two slots or more adapters get one fewer. One slot is
        # shared with the base model, which the replay does not model.
        slots = f.max_loras_per_batch - 1 if f.max_loras_per_batch > 1 else 1
        return SlotTiers(
            gpu_slots=slots, host_slots=f.max_loaded_loras,
            slot_bytes=memory.slot_bytes, host_bytes=memory.host_bytes,
            max_rank=memory.pool.max_rank, gpu_eviction=f.eviction_policy,
            host_eviction="lru", admission="skip",
            source="sglang/srt/managers/scheduler.py get_new_batch_prefill / "
                   "can_schedule_lora_req (a waiting request whose adapter does not fit the "
                   "batch is skipped: lora/lora_manager.py validate_lora_batch); "
                   "lora/mem_pool.py prepare_lora_batch and lora/eviction_policy.py (GPU "
                   "slots, --lora-eviction-policy); managers/tokenizer_control_mixin.py "
                   "load_lora_adapter and lora/lora_registry.py lru_lora_name (after a load, "
                   "the least recently used unpinned adapter over --max-loaded-loras is "
                   "unloaded; a later request reloads it from disk: tokenizer_manager.py "
                   "_resolve_lora_path)")

    def inspect_record(self, model: ModelConfig, verdicts: list[EngineVerdict],
                       recommendation: Recommendation, flags: Flags, source: str,
                       reports: list[AdapterReport]) -> dict[str, Any]:
        fails = [r.name for r, v in zip(reports, verdicts, strict=True)
                 if v.paths["startup"]["verdict"] not in (
                     Verdict.SERVES.value, Verdict.DIFFERS.value, Verdict.IGNORES.value)]
        return {"name": NAME, "version": VERSION, "flags": flags.record(model),
                "pool": flags.pool.record() if flags.pool else None, "flags_source": source,
                "all_serve": all(v.serves for v in verdicts), "startup_fails": bool(fails),
                "checked": family(model).checked, "recommended": recommendation.record()}


    def confirm(self, audited: AuditedAdapters, given: Mapping[str, object], *,
                python: str | None, engine_args: str | None, timeout_s: float | None,
                progress: Callable[[str], None]) -> Confirmation:
        raise UsageError(f"--confirm: metrale cannot start SGLang {VERSION} to check it")


ENGINE = SglangEngine()
