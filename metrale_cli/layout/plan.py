"""Planning a pool from audited adapters: which layouts, how many slots fit, what it all costs.

Sits after the audit and both layouts: `layout`, `inspect` and `pack` plan through here, so the
three commands size a pool the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from metrale_cli.adapters.audit import AdapterReport
from metrale_cli.arguments import checked_fields
from metrale_cli.errors import UsageError
from metrale_cli.layout.expert_layout import ExpertLayout
from metrale_cli.layout.slot_layout import DEFAULT_ALIGN, SlotLayout, refuse_past_plan_bytes
from metrale_cli.model.config import ModelConfig
from metrale_cli.model.modules import ALL, LoraModule


def kernel_max_rank(rank: int) -> int:
    """The smallest max rank at or above `rank` whose rows the CUDA kernels read: a multiple of
    their 16-byte vector (8 BF16 elements). Above their largest max rank no rounding helps;
    `max_rank_warnings` says so."""
    from metrale_cli.kernel_config import VECTOR

    return -(-rank // VECTOR) * VECTOR


def max_rank_warnings(max_rank: int | None) -> list[str]:
    """Why the CUDA kernels cannot serve a pool of this max rank, naming the nearest they
    serve, as one line; none when they can (or no max rank is given). The layout itself holds
    either way."""
    from metrale_cli.kernel_config import MAX_RANK, VECTOR

    if max_rank is None or (max_rank % VECTOR == 0 and max_rank <= MAX_RANK):
        return []
    nearest = min(kernel_max_rank(max_rank), MAX_RANK)
    return [f"max rank {max_rank}: the CUDA kernels serve multiples of {VECTOR} up to "
            f"{MAX_RANK} and would refuse this pool (its layout holds); the nearest max rank "
            f"they serve is {nearest}"]


def plan_layouts(
    model: ModelConfig,
    reports: list[AdapterReport],
    modules: list[LoraModule] | None = None,
    max_rank: int | None = None,
    align: int = DEFAULT_ALIGN,
    experts: bool = False,
) -> tuple[SlotLayout, ExpertLayout | None]:
    """The layouts of a pool for these startup adapters: `modules` or the union of theirs;
    `max_rank` or their largest rank rounded up to one the kernels serve (`kernel_max_rank`).
    With `experts`, the expert layout: the union of their expert pairs, or without adapters
    every routed expert and router of the model."""
    pairs = [p for r in reports for p in r.expert_pairs]
    # An adapter may carry only experts or overlays: then the slot layout may be empty.
    other_content = bool(pairs) or any(r.overlays for r in reports) or (experts and not reports)
    if modules is None:
        union = {m for r in reports for m in r.module_set}
        if not union and not other_content:
            raise UsageError("--modules is required when no adapter gives the module set: name "
                             "them (q_proj,v_proj,...) or pass --modules all")
        modules = [m for m in ALL if m in union]
    given = max_rank is not None
    if max_rank is None:
        if not reports:
            raise UsageError("--max-rank is required when no adapter gives the rank")
        max_rank = kernel_max_rank(max(r.rank for r in reports))
    expert_layout = None
    if experts and pairs:
        expert_rank = max(p.r for p in pairs)
        rank = max(max_rank, expert_rank if given else kernel_max_rank(expert_rank))
        expert_layout = ExpertLayout.for_pairs(model, pairs, rank, align)
    elif experts and not reports:
        if not model.num_experts:
            raise UsageError(f"--experts: {model.source or model.model_type} has no routed "
                             "experts")
        expert_layout = ExpertLayout.for_model(model, max_rank, align)
    layout = SlotLayout.build(model, modules, max_rank, align)
    for report in reports:
        # What pack_slot would refuse, refused while planning, so `layout` says it too.
        missing = [m for m in report.modules if (m.layer, m.module) not in layout.index]
        if missing:
            raise UsageError(f"{report.name}: {missing[0].module.peft_name} on layer "
                             f"{missing[0].layer} is not in the pool's layout (its module set "
                             "is too small)")
    if not layout.entries and expert_layout is None and not other_content:
        raise UsageError(f"no module of {', '.join(m.peft_name for m in modules)} applies to any "
                         f"layer of {model.source or model.model_type}: a pool of 0-byte slots")
    return layout, expert_layout


@checked_fields("PoolPlan")
@dataclass(frozen=True)
class PoolPlan:
    """A pool's layouts and size: `max_loras` slots, or as many as fit in `budget_bytes`."""

    layout: SlotLayout
    expert_layout: ExpertLayout | None = None
    max_loras: int | None = None
    budget_bytes: int | None = None

    def __post_init__(self) -> None:
        # 10**20 slots (or a budget of 10**30 B) is a typo, not 10**14 TiB to print with exit 0.
        if self.max_loras:
            refuse_past_plan_bytes(f"a pool of {self.max_loras:,} slots and its tables",
                                   self.max_loras * self.bytes_per_slot,
                                   "--max-loras" if self.budget_bytes is None else "--budget")

    @classmethod
    def sized(
        cls, layout: SlotLayout, expert_layout: ExpertLayout | None,
        max_loras: int | None = None, budget_bytes: int | None = None,
    ) -> PoolPlan:
        if max_loras is not None and budget_bytes is not None:
            raise UsageError("give --max-loras or --budget, not both")
        if budget_bytes is not None:
            per_slot = cls(layout, expert_layout).bytes_per_slot
            max_loras = budget_bytes // per_slot if per_slot else 0
        return cls(layout, expert_layout, max_loras, budget_bytes)

    @property
    def bytes_per_slot(self) -> int:
        """One slot in both pools, with its share of every table."""
        size = self.layout.slot_bytes + self.layout.table_bytes(1)
        if self.expert_layout is not None:
            size += self.expert_layout.slot_bytes + self.expert_layout.table_bytes(1)
        return size

    @property
    def total_bytes(self) -> int | None:
        """Both pools and all their tables for `max_loras` slots."""
        return self.max_loras * self.bytes_per_slot if self.max_loras else None

    @property
    def warnings(self) -> list[str]:
        """What the plan holds that the kernels would refuse."""
        return max_rank_warnings(self.layout.max_rank)

    def record(self) -> dict[str, Any]:
        n = self.max_loras
        ex = self.expert_layout
        return {
            "model": self.layout.model.record(),
            **self.layout.record(n),
            "warnings": self.warnings,
            "table_bytes": self.layout.table_bytes(n) if n else None,
            "budget_bytes": self.budget_bytes,
            "shares": self.layout.shares(),
            # The expert pool's part; its entries are in the pool image.
            "experts": None if ex is None else {
                **ex.record(n, entries=False),
                "table_bytes": ex.table_bytes(n) if n else None,
                "shares": ex.shares(),
            },
            "total_bytes": self.total_bytes,
        }


@dataclass(frozen=True)
class Footprint:
    """What one adapter alone needs: its modules padded to the pool's max rank (or its own
    rank rounded up to one the kernels serve) in the slot pool, and its expert pairs likewise
    in the expert pool."""

    layout: SlotLayout | None
    expert_layout: ExpertLayout | None
    # Why each slot has the rank it has, for the view: "--max-rank 4 ...", "its rank 2 rounded
    # up to 8, ...".
    rank_reason: str = ""
    expert_rank_reason: str = ""

    @classmethod
    def of(cls, model: ModelConfig, report: AdapterReport, max_rank: int | None) -> Footprint:
        from metrale_cli.kernel_config import VECTOR

        def padded(rank: int) -> int:
            return kernel_max_rank(rank) if max_rank is None else max(max_rank, rank)

        def reason(rank: int) -> str:
            if max_rank is None:
                return ("its own rank" if padded(rank) == rank else
                        f"its rank {rank} rounded up to a multiple of {VECTOR} (the kernels')")
            if rank > max_rank:
                return f"its own rank, above --max-rank {max_rank} (refused)"
            return f"--max-rank {max_rank}" + ("" if rank == max_rank else
                                                f" (its rank is {rank})")

        layout = expert_layout = None
        if report.modules:
            layout = SlotLayout.build(model, report.module_set, padded(report.rank))
        if report.expert_pairs:
            expert_layout = ExpertLayout.for_pairs(model, report.expert_pairs,
                                                   padded(report.expert_rank))
        return cls(layout, expert_layout, reason(report.rank), reason(report.expert_rank))

    @property
    def slot_bytes(self) -> int:
        return self.layout.slot_bytes if self.layout else 0

    @property
    def expert_slot_bytes(self) -> int:
        return self.expert_layout.slot_bytes if self.expert_layout else 0
