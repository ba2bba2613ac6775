"""The one plan pipeline: adapters and a model spec -> audited reports -> the refusal of the
unservable -> the pool's layouts. Every command that takes adapters runs it once (`inspect`
the first half, `layout`, `pack` and `simulate` all of it), and so does a Python user:

    planned = plan_pool(["chat", "code"], max_rank=16)
    plan = planned.sized(budget_bytes=40 << 30)

Adapters are given as arguments (a path, a hub id, `NAME=` either) or as loaded `Adapter`s;
the model as a `--model` value, a `ModelConfig`, or None for the adapters' common
`base_model_name_or_path`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from metrale_cli import env
from metrale_cli.adapters.adapter import Adapter
from metrale_cli.adapters.audit import AdapterReport, audit, layer_rows
from metrale_cli.adapters.loading import load_adapters, model_for
from metrale_cli.arguments import checked_as
from metrale_cli.errors import NotServable, refused_line
from metrale_cli.layout.expert_layout import ExpertLayout
from metrale_cli.layout.plan import Footprint, PoolPlan, max_rank_warnings, plan_layouts

# ShardSpec at run time, not only for type checking: `PlannedPool.sharded`'s check reads it.
from metrale_cli.layout.sharding import ShardedPlan, ShardSpec, refuse_unshardable
from metrale_cli.layout.slot_layout import DEFAULT_ALIGN, SlotLayout
from metrale_cli.model.config import ModelConfig
from metrale_cli.model.modules import LoraModule


@dataclass(frozen=True)
class AuditedAdapters:
    """The adapters audited against one base model, for a pool of `max_rank` (None: each
    adapter's own rank rounded up to one the kernels serve)."""

    model: ModelConfig
    reports: list[AdapterReport]
    max_rank: int | None
    experts: bool

    @property
    def servable(self) -> bool:
        return all(r.servable for r in self.reports)

    @property
    def warnings(self) -> list[str]:
        """What the kernels would refuse about the given max rank."""
        return max_rank_warnings(self.max_rank)

    def footprints(self) -> list[Footprint]:
        """What each adapter alone needs in the pool, in report order."""
        return [Footprint.of(self.model, r, self.max_rank) for r in self.reports]

    def refuse_unservable(self) -> None:
        """What `pack` would refuse, every planning command refuses: NotServable (exit 1)
        naming the refused adapters, with each error finding as a detail line and the audit's
        record (`--json` prints it)."""
        refused = [r for r in self.reports if not r.servable]
        if refused:
            raise NotServable(
                refused_line([r.name for r in refused], len(self.reports), "not servable"),
                [f"{r.name}: {f.code}: {f.message}" for r in refused for f in r.errors()],
                self.record())

    def pool_slot(self) -> dict[str, Any] | None:
        """The slot of a pool of these adapters, the one `layout`, `pack` and `show` report:
        their modules' union at `max_rank` (or their largest rank rounded up to one the kernels
        serve). None when no adapter gives modules and a usable rank."""
        usable = [r for r in self.reports if r.rank is not None and r.module_set]
        if not usable:
            return None
        layout, _ = plan_layouts(self.model, usable, None, self.max_rank)
        return {"slot_bytes": layout.slot_bytes, "max_rank": layout.max_rank,
                "modules": [m.peft_name for m in layout.modules]}

    def record(self) -> dict[str, Any]:
        """`metrale inspect --json`: the model summary, the warnings about the max rank, the
        slot of a pool of these adapters (`pool_slot`), and each adapter's report with its
        footprint (`own_slot_bytes`: what it alone takes, at its own rank unless --max-rank;
        named apart from `pool_slot.slot_bytes`, the slot `layout` gives)."""
        adapters = []
        for report, footprint in zip(self.reports, self.footprints(), strict=True):
            slot, expert_slot = footprint.layout, footprint.expert_layout
            adapters.append({
                **report.record(),
                "config_rank": report.adapter.config.r,
                "module_set": [m.peft_name for m in report.module_set],
                "layer_rows": layer_rows(self.model, report),
                "expert_layers": sorted({p.layer for p in report.expert_pairs}),
                "expert_ranks": sorted({p.r for p in report.expert_pairs}),
                "own_slot_bytes": footprint.slot_bytes,
                "own_slot_max_rank": slot.max_rank if slot is not None else None,
                "own_slot_rank_reason": footprint.rank_reason if slot is not None else None,
                "own_expert_slot_bytes": footprint.expert_slot_bytes,
                "own_expert_slot_max_rank": expert_slot.max_rank if expert_slot else None,
                "own_expert_slot_rank_reason": (footprint.expert_rank_reason if expert_slot
                                            else None),
            })
        return {"model": self.model.record(), "experts_enabled": self.experts,
                "warnings": self.warnings, "pool_slot": self.pool_slot(), "adapters": adapters}


@dataclass(frozen=True)
class PlannedPool:
    """Servable adapters and the layouts of the pool they start: sized by `sized` (one pool)
    or `sharded` (one per tensor-parallel rank)."""

    audited: AuditedAdapters
    layout: SlotLayout
    expert_layout: ExpertLayout | None

    @property
    def model(self) -> ModelConfig:
        return self.audited.model

    @property
    def reports(self) -> list[AdapterReport]:
        return self.audited.reports

    @property
    def warnings(self) -> list[str]:
        """What the kernels would refuse about the pool's max rank (its layout holds)."""
        return max_rank_warnings(self.layout.max_rank)

    @checked_as("PlannedPool.sized")
    def sized(self, max_loras: int | None = None, budget_bytes: int | None = None) -> PoolPlan:
        """`max_loras` slots, or as many as fit in `budget_bytes` (both pools and tables)."""
        return PoolPlan.sized(self.layout, self.expert_layout, max_loras, budget_bytes)

    @checked_as("PlannedPool.sharded")
    def sharded(self, spec: ShardSpec, max_loras: int | None = None,
                budget_bytes: int | None = None) -> ShardedPlan:
        """Every rank's pool of the deployment `spec` names, `budget_bytes` per GPU; an adapter
        the deployment cannot take (`refuse_unshardable`) is refused first."""
        refuse_unshardable(self.reports, spec)
        return ShardedPlan.sized(self.layout, self.expert_layout, spec, max_loras, budget_bytes)


def audit_adapters(
    adapters: Sequence[str | Path | Adapter],
    model: str | ModelConfig | None = None,
    *,
    max_rank: int | None = None,
    experts: bool | None = None,
    online: bool = False,
    weights: bool = False,
) -> AuditedAdapters:
    """Load the adapters (arguments, or `Adapter`s as they are), resolve the base model and
    audit each against it. `experts` is the expert-pool opt-in (None reads
    METRALE_LORA_EXPERTS); `online` lets hub ids be fetched; `weights` downloads a hub
    adapter's tensors too (for packing), not only their header."""
    loaded = [a for a in adapters if isinstance(a, Adapter)]
    named = [str(a) for a in adapters if not isinstance(a, Adapter)]
    if named:
        by_arg = iter(load_adapters(named, online, weights))
        loaded = [a if isinstance(a, Adapter) else next(by_arg) for a in adapters]
    cfg = model if isinstance(model, ModelConfig) else model_for(model, loaded, online)
    enabled = env.experts_enabled() if experts is None else experts
    return AuditedAdapters(cfg, [audit(a, cfg, max_rank, enabled) for a in loaded], max_rank,
                           enabled)


def plan_pool(
    adapters: Sequence[str | Path | Adapter] = (),
    model: str | ModelConfig | None = None,
    *,
    modules: Sequence[LoraModule] | None = None,
    max_rank: int | None = None,
    align: int = DEFAULT_ALIGN,
    experts: bool | None = None,
    online: bool = False,
    weights: bool = False,
) -> PlannedPool:
    """The whole pipeline: `audit_adapters`, NotServable if any adapter is not servable, then
    the layouts (`plan_layouts`: `modules` or the union of the adapters', `max_rank` or their
    largest rounded up to one the kernels serve). Without adapters `model`, `modules` (or
    `experts`) and `max_rank` give the pool."""
    audited = audit_adapters(adapters, model, max_rank=max_rank, experts=experts,
                             online=online, weights=weights)
    audited.refuse_unservable()
    layout, expert_layout = plan_layouts(audited.model, audited.reports,
                                         list(modules) if modules else None, max_rank, align,
                                         audited.experts)
    return PlannedPool(audited, layout, expert_layout)
