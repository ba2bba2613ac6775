"""What `metrale simulate` is asked, as one record: `SimulateRequest`, the command's options with
their text already read into values (the CLI parses; a library caller gives the values). Making
one applies every rule between the options, the same for both (a flag one engine does not take,
a trace and a generator at once, `--seeds` over a trace nothing seeds), so a conflict is refused
before any work starts. `plan` sizes the pool, `workload` reads or draws the requests of a
seed, `run` replays them (`sim/simulate.py`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from metrale_cli.errors import UsageError
from metrale_cli.layout.sharding import ShardSpec
from metrale_cli.model.modules import LoraModule
from metrale_cli.pool.slot_cache import POLICIES
from metrale_cli.sim import simulate as sim
from metrale_cli.sim.costs import HostTier, Link
from metrale_cli.sim.replicas import Routing
from metrale_cli.sim.simulate import EngineCache, Simulation, Targets, check_seeds, check_work
from metrale_cli.sim.workload import GeneratorSpec, Workload, generate, read_trace

if TYPE_CHECKING:
    from metrale_cli.engines.engine import Engine
    from metrale_cli.layout.expert_layout import ExpertLayout
    from metrale_cli.layout.pipeline import AuditedAdapters, PlannedPool
    from metrale_cli.layout.slot_layout import SlotLayout
    from metrale_cli.sim.trace_formats import Assign

Progress = Callable[[int, int], None]  # (done, total)


@dataclass(frozen=True)
class PlannedSimulation:
    """The pool a request replays against: its layouts (the busiest rank's are chosen by the
    replay), the audit behind them (an engine's cache reads its reports), and what metrale's
    kernels would refuse of the adapters (`warnings`; an engine serves with its own)."""

    layout: SlotLayout
    expert_layout: ExpertLayout | None
    planned: PlannedPool | AuditedAdapters
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True)
class SimulateRequest:
    """`metrale simulate`'s options, each named after its flag (`requests` is `--requests`,
    `adapter_count` is `--adapters`, `adapters` the ADAPTER arguments), parsed. `engine` is the
    `--engine` text (`metrale`, `vllm`, `vllm==0.32.0`, `sglang`); `policies` and `admission`
    None are the default (all three and fcfs, or the engine's own)."""

    adapters: tuple[str, ...] = ()
    model: str | None = None
    modules: str | None = None  # the --modules text: an engine reads it as its own flag
    max_rank: int | None = None
    experts: bool = False
    # Workload: a trace, or a generator (`workload`, None: zipf) of the fields below it.
    trace: Path | None = None
    trace_format: str = "metrale"
    assign: Assign | None = None  # its seed is --seed's; --seeds redraws it per seed
    workload: str | None = None
    requests: int = 10_000
    adapter_count: int = 100
    rate: float = 10.0
    cv: float = 1.0
    seed: int = 0
    seeds: int = 1
    zipf_s: float = 1.5
    alpha: float = 1.0
    input_tokens: tuple[int, int] = (8, 512)
    output_tokens: tuple[int, int] = (8, 512)
    ranks: tuple[int, ...] | None = None
    # Serving and loads.
    prefill_tok_s: float = 10_000.0
    decode_tok_s: float = 50.0
    max_concurrency: int | None = None
    policies: tuple[str, ...] | None = None
    pin: tuple[str, ...] = ()
    pinned: int | None = None
    sizes: tuple[int, ...] | None = None  # --max-loras; None: powers of two to all resident
    bandwidth: Link = dataclasses.field(default_factory=lambda: Link.preset("pcie4"))
    links: int = 1
    host_slots: int | None = None
    host_bandwidth: Link = dataclasses.field(default_factory=lambda: Link.preset("nvme"))
    admission: str | None = None
    replicas: int = 1
    route: str = "affinity"
    target_hit_rate: float | None = None
    target_p99_ms: float | None = None
    budget_bytes: int | None = None
    tp: int | None = None
    ep: int | None = None
    fully_sharded: bool = False
    # The engine and its own flags.
    engine: str = "metrale"
    max_cpu_loras: int | None = None
    dtype: str | None = None
    lora_dtype: str | None = None
    max_loaded_loras: int | None = None
    eviction_policy: str | None = None
    lora_backend: str | None = None

    def __post_init__(self) -> None:
        from metrale_cli.engines import refuse_other_options

        chosen = self.chosen_engine
        refuse_other_options(chosen.name if chosen else "metrale", "simulate", {
            "--max-cpu-loras": self.max_cpu_loras, "--dtype": self.dtype,
            "--lora-dtype": self.lora_dtype, "--max-loaded-loras": self.max_loaded_loras,
            "--eviction-policy": self.eviction_policy, "--lora-backend": self.lora_backend,
            "--fully-sharded": self.fully_sharded, "--host-slots": self.host_slots,
            "--pin": self.pin or None, "--pinned": self.pinned, "--experts": self.experts,
            "--ep": self.ep})
        if chosen is not None:
            for name, value in (("--policy", self.policies), ("--admission", self.admission)):
                if value is not None:
                    raise UsageError(f"{name}: --engine {chosen.name} evicts and admits as the "
                                     "engine does (docs/simulate.md); leave it out")
        for name, value in (("--tp", self.tp), ("--max-rank", self.max_rank),
                            ("--seeds", self.seeds)):
            # --tp 0 too: SGLang's rules would run it as 1.
            if value is not None and value <= 0:
                raise UsageError(f"{name} must be positive, got {value}")
        if chosen is None:
            ShardSpec.from_options(self.tp, self.ep, self.fully_sharded)  # refused before work
        if self.modules:
            LoraModule.parse_option(self.modules)
        if self.target_hit_rate is not None and not 0 < self.target_hit_rate <= 1:
            raise UsageError(f"--target-hit-rate must be in (0, 1], got {self.target_hit_rate}")
        if self.target_p99_ms is not None and not 0 <= self.target_p99_ms < math.inf:
            raise UsageError(f"--target-p99-ms must be >= 0 and finite, got "
                             f"{self.target_p99_ms}")
        if self.model is None and not self.adapters:
            raise UsageError("--model is required (or give adapters)")
        if self.trace is not None and self.workload is not None:
            raise UsageError("give --trace or --workload, not both")
        if self.trace is not None and self.ranks is not None:
            raise UsageError("--ranks is for generated workloads; a trace gives ranks in its "
                             "rank column")
        if self.trace is None and (self.assign is not None or self.trace_format != "metrale"):
            raise UsageError("--trace-format and --assign are for --trace")
        if self.assign is not None and self.trace_format == "metrale":
            raise UsageError("--assign is for trace formats that name no adapter")
        check_seeds(self.seeds)
        if self.seeds > 1 and self.trace is not None and self.assign is None:
            raise UsageError("--seeds needs a seeded workload: a generator, or a trace with "
                             "--assign")
        if self.trace is None and self.sizes is not None:
            self.generator().check()  # each option's own bound is the clearer refusal
            # The work is known before anything is drawn: refused now. A trace's requests, or
            # the default sizes (up to every requested adapter resident), are known once the
            # workload is read or drawn (check_work_of).
            self._check_work(self.requests, self.sizes)

    @property
    def chosen_engine(self) -> Engine | None:
        """None for metrale's own pool, else the engine `--engine` names."""
        from metrale_cli.engines import get_engine

        return None if self.engine.strip() == "metrale" else get_engine(self.engine)

    @property
    def shard(self) -> ShardSpec | None:
        """Rank 0 of the deployment --tp/--ep/--fully-sharded name; None without --tp, and
        with an engine, whose --tp and --fully-sharded are its own flags."""
        return (ShardSpec.from_options(self.tp, self.ep, self.fully_sharded)
                if self.engine.strip() == "metrale" else None)

    def check_work_of(self, workload: Workload) -> None:
        """Refuse this request's work on `workload` (its first seed's) past MAX_REPLAYS, before
        anything is replayed or written: `run` checks it too, for a caller that skips this."""
        self._check_work(workload.requests, sim.replay_sizes(
            workload, sim.pinned_adapters(workload, self.pin, self.pinned), self.sizes))

    def _check_work(self, requests: int, sizes: Sequence[int]) -> None:
        policies = 1 if self.chosen_engine else len(dict.fromkeys(self.policies or POLICIES))
        check_work(requests, len(set(sizes)), policies, self.seeds, self.routing)

    @property
    def routing(self) -> Routing | None:
        """The replicas and their router; None for one replica routed as one always is."""
        return (Routing(self.replicas, self.route, self.seed)
                if self.replicas != 1 or self.route != "affinity" else None)

    def plan(self) -> PlannedSimulation:
        """The pool's layouts: planned from the adapters (or --model, --modules, --max-rank)
        for metrale's pool; for an engine, which judges the adapters and sizes its own slots
        (`EngineCache`), only the modules the record names."""
        from metrale_cli.layout.pipeline import audit_adapters, plan_pool
        from metrale_cli.layout.slot_layout import SlotLayout
        from metrale_cli.model.modules import ALL

        chosen = self.chosen_engine
        modules = LoraModule.parse_option(self.modules) if self.modules else None
        if chosen is None or not self.adapters:
            # A slot sized by an adapter pack would refuse sizes nothing: plan_pool refuses it.
            pool = plan_pool(list(self.adapters), self.model, modules=modules,
                             max_rank=self.max_rank, experts=self.experts)
            warnings = tuple(pool.warnings) if chosen is None else ()
            planned = PlannedSimulation(pool.layout, pool.expert_layout, pool, warnings)
        else:
            audited = audit_adapters(list(self.adapters), self.model, experts=False)
            layout = SlotLayout.build(audited.model, list(modules or [
                m for m in ALL if any(m in r.module_set for r in audited.reports)]),
                self.max_rank or max(r.adapter.config.r for r in audited.reports))
            planned = PlannedSimulation(layout, None, audited)
        shard = self.shard
        if shard is not None:
            from metrale_cli.layout.sharding import refuse_unshardable

            refuse_unshardable(planned.planned.reports, shard)
        return planned

    def generator(self, seed: int | None = None) -> GeneratorSpec:
        """The generator of a request without a trace, under `seed` (default --seed)."""
        return GeneratorSpec(
            self.workload or "zipf", self.requests, self.adapter_count, self.rate, self.cv,
            self.seed if seed is None else seed, self.zipf_s, self.alpha, self.input_tokens,
            self.output_tokens, self.ranks or ())

    def read(self, seed: int | None = None, progress: Progress | None = None) -> Workload:
        """The requests under `seed` (default --seed): the generator's draw, or the trace
        (its adapters drawn by --assign under that seed)."""
        seed = self.seed if seed is None else seed
        if self.trace is None:
            return generate(self.generator(seed))
        if self.trace_format == "metrale":
            return read_trace(self.trace, progress)
        from metrale_cli.sim import trace_formats

        assign = None if self.assign is None else dataclasses.replace(self.assign, seed=seed)
        return trace_formats.read_public_trace(self.trace, self.trace_format, assign, progress)

    def options(self, planned: PlannedSimulation) -> dict[str, Any]:
        """`sim.simulate.run`'s keyword options for this request on `planned`."""
        chosen = self.chosen_engine
        targets = (Targets(self.target_hit_rate, self.target_p99_ms)
                   if self.target_hit_rate is not None or self.target_p99_ms is not None
                   else None)
        return dict(
            link=self.bandwidth, links=self.links, prefill_tok_s=self.prefill_tok_s,
            decode_tok_s=self.decode_tok_s, max_concurrency=self.max_concurrency,
            pin=self.pin, pinned=self.pinned,
            policies=list(self.policies or POLICIES),
            sizes=list(self.sizes) if self.sizes is not None else None, targets=targets,
            budget_bytes=self.budget_bytes, shard=self.shard,
            host=(HostTier(self.host_slots, self.host_bandwidth)
                  if self.host_slots is not None else None),
            routing=self.routing,
            admission=self.admission or "fcfs",
            engine=None if chosen is None else EngineCache(
                chosen, planned.planned.model, tuple(planned.planned.reports), tuple({
                    "--max-rank": self.max_rank, "--max-cpu-loras": self.max_cpu_loras,
                    "--tp": self.tp, "--fully-sharded": self.fully_sharded,
                    "--modules": self.modules,
                    "--dtype": self.dtype, "--lora-dtype": self.lora_dtype,
                    "--max-loaded-loras": self.max_loaded_loras,
                    "--eviction-policy": self.eviction_policy,
                    "--lora-backend": self.lora_backend}.items()),
                self.host_bandwidth))

    def run(self, progress: Progress | None = None, *, planned: PlannedSimulation | None = None,
            first: Workload | None = None) -> Simulation:
        """The whole simulation: every seed's workload replayed per policy and size. `planned`
        and `first` (the first seed's workload) are what the caller has made already."""
        planned = planned or self.plan()
        first = first or self.read()
        options = self.options(planned)
        if self.seeds == 1:
            return sim.run(first, planned.layout, planned.expert_layout, **options,
                       progress=progress)
        made = iter([first])  # the first seed's workload is read already
        seeds: Sequence[int] = [self.seed + k for k in range(self.seeds)]
        return sim.run_seeds(lambda s: next(made, None) or self.read(s), seeds, planned.layout,
                         planned.expert_layout, progress=progress, **options)
