"""`metrale simulate`: a workload replayed (`sim/replay.py`) for each policy and pool size, and
the record of it: hits, loads, bytes moved, swap time, `PoolFull` stalls and the latency they
add, the sizing answer for a target, and the plot.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from metrale_cli import compat
from metrale_cli.arguments import checked_fields
from metrale_cli.errors import UsageError, did_you_mean
from metrale_cli.files.atomic import atomic_write
from metrale_cli.layout.expert_layout import ExpertLayout
from metrale_cli.layout.plan import PoolPlan
from metrale_cli.layout.sharding import ShardSpec, all_rank_layouts
from metrale_cli.layout.slot_layout import SlotLayout
from metrale_cli.pool.slot_cache import POLICIES
from metrale_cli.sim.costs import HostTier, Link, SwapCost
from metrale_cli.sim.replay import Replay
from metrale_cli.sim.replicas import Replicas, Routing
from metrale_cli.sim.results import RunResult
from metrale_cli.sim.workload import Workload

if TYPE_CHECKING:
    from metrale_cli.adapters.audit import AdapterReport
    from metrale_cli.engines.engine import Engine, SlotTiers
    from metrale_cli.model.config import ModelConfig


def default_sizes(unpinned: int, pinned: int) -> list[int]:
    """Powers of two from above the pinned slots up to the size that holds every requested
    adapter beside the pinned ones."""
    need = unpinned + pinned
    sizes, size = [], 1
    while size < need:
        if size > pinned:
            sizes.append(size)
        size *= 2
    return [*sizes, max(need, pinned + 1)]


@dataclass(frozen=True)
class EngineCache:
    """A serving engine's adapter cache as `simulate --engine` replays it: at each size, the
    engine's flags with `--max-loras` that size (the rest as `given`, the CLI's option names),
    its LoRA bytes on one GPU (`memory`) and its tiers (`SlotTiers`: GPU slots, host cache,
    eviction, admission). The engine's own rules refuse a size its flags cannot take, and an
    adapter of `reports` it would not serve (metrale's pool refusals do not apply here)."""

    engine: Engine
    model: ModelConfig
    reports: tuple[AdapterReport, ...] = ()
    given: tuple[tuple[str, object], ...] = ()
    # What a host-cache miss reads the adapter over (the engine loads it from disk).
    host_link: Link = dataclasses.field(default_factory=lambda: Link.preset("nvme"))

    def at(self, max_loras: int) -> tuple[SlotTiers, int]:
        """(the tiers, the LoRA bytes on one GPU) at `max_loras` GPU slots."""
        from metrale_cli.engines.answers import refuse_unserved, startable_layout_flags

        given = {**dict(self.given), "--max-loras": max_loras}
        flags = startable_layout_flags(self.engine, self.model, list(self.reports), given)
        refuse_unserved(self.engine, self.model, self.reports, flags)
        memory = self.engine.memory(self.model, flags, list(self.reports) or None, None)
        return self.engine.tiers(memory), memory.lora_bytes

    def record(self, sizes: Sequence[int]) -> dict[str, Any]:
        return {"name": self.engine.name, "version": self.engine.version,
                "tiers": {str(n): self.at(n)[0].record() for n in sizes}}


@checked_fields("Targets")
@dataclass(frozen=True)
class Targets:
    hit_rate: float | None = None
    p99_ms: float | None = None

    def met_by(self, result: RunResult) -> bool:
        if self.hit_rate is not None and result.hit_rate < self.hit_rate:
            return False
        return self.p99_ms is None or result.added_latency_p99_s * 1e3 <= self.p99_ms

    def record(self) -> dict[str, Any]:
        return {"hit_rate": self.hit_rate, "p99_ms": self.p99_ms}


@dataclass
class Simulation:
    """The record of `metrale simulate`: the setup, one result per (policy, size), and for a
    target the smallest size that meets it per policy."""

    mode: str
    workload: dict[str, Any]
    layout: dict[str, Any]
    cost: SwapCost
    pinned: list[str]
    max_concurrency: int | None
    prefill_tok_s: float
    decode_tok_s: float
    policies: list[str]
    sizes: list[int]
    results: list[RunResult]
    targets: Targets | None = None
    budget_bytes: int | None = None
    host: dict[str, Any] | None = None
    routing: dict[str, Any] | None = None
    admission: str = "fcfs"
    # --engine: the engine, its version and its tiers at each size (EngineCache.record).
    engine: dict[str, Any] | None = None
    seeds: list[int] | None = None
    max_rank_options: list[dict[str, Any]] | None = None
    seconds: float = 0.0

    def smallest_meeting(self) -> list[dict[str, Any]]:
        """Per policy, the smallest size from which every simulated size meets the targets (a
        size that meets them with a larger one failing is no answer: FIFO's anomaly), the first
        size that meets them, and whether the hit rate (and the p99 added latency, for a p99
        target) is monotonic in the size."""
        if self.targets is None:
            return []
        out = []
        for policy in self.policies:
            mine = [r for r in self.results if r.policy == policy]  # sizes ascending
            met = [self.targets.met_by(r) for r in mine]
            best = None
            for r, ok in zip(reversed(mine), reversed(met), strict=True):
                if not ok:
                    break
                best = r
            first = next((r for r, ok in zip(mine, met, strict=True) if ok), None)
            hit_rates = [r.hit_rate for r in mine]
            monotonic = all(b >= a for a, b in itertools.pairwise(hit_rates))
            if self.targets.p99_ms is not None:
                p99 = [r.added_latency_p99_s for r in mine]
                monotonic = monotonic and all(b <= a for a, b in itertools.pairwise(p99))
            out.append({
                "policy": policy, "max_loras": best.max_loras if best else None,
                "pool_bytes": best.pool_bytes if best else None,
                "fits_budget": best.fits_budget if best else None,
                "first_meeting": first.max_loras if first else None,
                "monotonic": monotonic,
            })
        return out

    def record(self) -> dict[str, Any]:
        return {
            "mode": self.mode, "workload": self.workload, "layout": self.layout,
            "swap": self.cost.record(), "pinned": self.pinned,
            "max_concurrency": self.max_concurrency, "prefill_tok_s": self.prefill_tok_s,
            "decode_tok_s": self.decode_tok_s, "policies": self.policies, "sizes": self.sizes,
            "budget_bytes": self.budget_bytes, "host": self.host, "routing": self.routing,
            "admission": self.admission, "engine": self.engine, "seeds": self.seeds,
            "max_rank_options": self.max_rank_options,
            "targets": self.targets.record() if self.targets else None,
            "smallest_meeting": self.smallest_meeting() if self.targets else None,
            "results": [r.record() for r in self.results],
            "seconds": self.seconds,
        }


def simulate(
    replay: Replay | Replicas, policies: Sequence[str], sizes: Sequence[int],
    pool_bytes: Callable[[int], int], budget_bytes: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[RunResult]:
    """Every policy at every size, sizes ascending; `min`'s misses are the bound the others are
    measured against when it runs."""
    bad = [p for p in policies if p not in POLICIES]
    if bad or not policies:
        hint = did_you_mean(bad[0], POLICIES) if len(bad) == 1 else ""
        raise UsageError(f"--policy: {', '.join(bad) or 'none given'}{hint}; choose from "
                         f"{', '.join(POLICIES)}")
    results = []
    sizes = sorted(set(sizes))
    # Past every requested adapter resident, more slots change nothing but the pool's bytes:
    # such a size replays at that one (--max-loras 10**20 allocated 10**20 slots).
    replayed = [min(size, max(replay.unpinned + len(replay.pinned), 1)) for size in sizes]
    for policy in dict.fromkeys(policies):
        if policy == "lru" and replay.paging and replay.sweepable:  # every size in one pass
            swept = replay.lru_sweep(replayed, progress)
        else:
            swept = [replay.run(policy, size, progress, detail=False) for size in replayed]
        for result, size in zip(swept, sizes, strict=True):
            result.max_loras = size
            result.pool_bytes = pool_bytes(size)
            if budget_bytes is not None:
                result.fits_budget = result.pool_bytes <= budget_bytes
            results.append(result)
    bound = {r.max_loras: r for r in results if r.policy == "min"}
    for r in results:
        if r.max_loras in bound:
            r.extra_misses_vs_min = r.misses - bound[r.max_loras].misses
            r.hit_rate_gap_vs_min = bound[r.max_loras].hit_rate - r.hit_rate
    return results


def plot(sim: Simulation, path: Path, force: bool = False) -> None:
    """Hit rate and p99 added latency against max_loras, a line per policy (PNG)."""
    plt = compat.pyplot()
    from matplotlib.ticker import ScalarFormatter
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), dpi=110, sharex=True)
    for policy in sim.policies:
        mine = [r for r in sim.results if r.policy == policy]
        sizes = [r.max_loras for r in mine]
        top.plot(sizes, [100 * r.hit_rate for r in mine], marker="o", ms=3, label=policy)
        bottom.plot(sizes, [1e3 * r.added_latency_p99_s for r in mine], marker="o", ms=3,
                    label=policy)
    if sim.targets is not None and sim.targets.hit_rate is not None:
        top.axhline(100 * sim.targets.hit_rate, color="gray", ls="--", lw=1, label="target")
    if sim.targets is not None and sim.targets.p99_ms is not None:
        bottom.axhline(sim.targets.p99_ms, color="gray", ls="--", lw=1, label="target")
    top.set_ylabel("hit rate (%)")
    bottom.set_ylabel("p99 added latency (ms)")
    bottom.set_xlabel("max_loras (slots)")
    # Added latency spans a load (sub-ms) to stalls of seconds, and is 0 where nothing waits.
    bottom.set_yscale("symlog", linthresh=0.1)
    bottom.set_ylim(0, 2 * max([1e3 * r.added_latency_p99_s for r in sim.results] + [1.0]))
    if len(sim.sizes) > 1 and sim.sizes[-1] / sim.sizes[0] >= 16:
        bottom.set_xscale("log", base=2)
        bottom.xaxis.set_major_formatter(ScalarFormatter())
    w = sim.workload
    top.set_title(f"{w.get('kind', 'trace')} workload, {w['requests']:,} requests, "
                  f"{w['distinct_adapters']:,} adapters ({sim.mode})", fontsize=10)
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_write(Path(path), lambda f: fig.savefig(f, format="png"), force)
    plt.close(fig)


def run(
    workload: Workload,
    layout: SlotLayout,
    expert_layout: ExpertLayout | None = None,
    *,
    link: Link | None = None,
    links: int = 1,
    prefill_tok_s: float = 10_000.0,
    decode_tok_s: float = 50.0,
    max_concurrency: int | None = None,
    pin: Sequence[str] = (),
    pinned: int | None = None,
    policies: Sequence[str] = POLICIES,
    sizes: Sequence[int] | None = None,
    targets: Targets | None = None,
    budget_bytes: int | None = None,
    shard: ShardSpec | None = None,
    host: HostTier | None = None,
    routing: Routing | None = None,
    admission: str = "fcfs",
    engine: EngineCache | None = None,
    progress: Callable[[int, int], None] | None = None,
    runs: int = 1,
) -> Simulation:
    """The whole of `metrale simulate` for a workload and a pool layout, loads crossing `link`
    (default pcie4), `links` at a time per GPU. With `shard` (a TP
    deployment) every GPU holds its rank's pool and loads its rank's part of an adapter at once:
    a swap moves the largest rank's slot (and expert slot) per GPU, and a pool size must fit
    `budget_bytes` on the largest rank. An adapter whose rank the workload gives moves its
    share of a slot (rank r of max rank R: r/R of it); `host` puts a host tier in front of the
    GPU slots; `routing` (more than one replica) gives each replica its own pool of each size
    behind a router. With `engine`, the engine's own cache at each size instead of the pool's:
    its slot bytes, GPU slots, host cache (`host` is not given), eviction and admission (not
    given: `policies` is the engine's and `admission` too), LoRA bytes for `budget_bytes`.
    `progress(n, total)` is told of every 65,536 requests replayed. `runs` is how many runs
    like this one the caller makes in all (`run_seeds`: one per seed): the work of all of them
    is held to MAX_REPLAYS (`check_work`) before the first replay."""
    started = time.perf_counter()
    names = pinned_adapters(workload, pin, pinned)
    link = link or Link.preset("pcie4")
    ranks: list[tuple[SlotLayout, ExpertLayout | None]] = (
        [(layout, expert_layout)] if shard is None
        else all_rank_layouts(layout, expert_layout, shard))
    swapped = [r.slot_bytes + (x.slot_bytes if x is not None else 0) for r, x in ranks]
    busiest = swapped.index(max(swapped))
    gpu_layout, gpu_experts = ranks[busiest]
    slot_bytes, max_rank = swapped[busiest], layout.max_rank
    if engine is not None:
        if shard is not None or names or host is not None:
            raise UsageError(f"--engine {engine.engine.name}: the engine's own flags shard, "
                             "pin and cache adapters (not --ep, --pin, --pinned, --host-slots)")
        first = engine.at(min(sizes) if sizes else 1)[0]
        slot_bytes, max_rank = first.slot_bytes, first.max_rank
        policies, admission = [first.gpu_eviction], first.admission
    # The sizes and the work they make, refused before anything is replayed (a Replay's
    # baseline alone is a pass over every request).
    sizes = replay_sizes(workload, names, sizes)
    policies = list(dict.fromkeys(policies))
    check_work(workload.requests, len(set(sizes)), len(policies), runs, routing)
    cost = SwapCost(slot_bytes, link.bytes_per_s, link.latency_s, link.name, links)
    load_bytes = adapter_load_bytes(workload, max_rank, cost.slot_bytes)
    hold = workload.hold_seconds(prefill_tok_s, decode_tok_s)
    first_token = workload.input_tokens / prefill_tok_s  # the prefill

    def replay_for(host: HostTier | None) -> Replay | Replicas:
        if routing is None or routing.replicas == 1:
            return Replay(workload, hold, cost, names, max_concurrency, load_bytes, host,
                          first_token, admission)
        return Replicas(workload, hold, cost, names, max_concurrency, load_bytes, host,
                        routing, first_token, admission)

    replay = replay_for(host)
    total = len(policies) * len(set(sizes)) * workload.requests
    told = (lambda k: progress(k, total)) if progress is not None else None
    if engine is None:
        results = simulate(
            replay, policies, sizes,
            lambda n: max(PoolPlan(r, x, n).total_bytes or 0 for r, x in ranks),
            budget_bytes, told)
    else:
        # The host cache's size follows --max-loras unless --max-cpu-loras fixes it: a replay
        # per size, each with its own host tier.
        results = []
        # Every size's flags judged before any replay: a flag conflict at the largest size
        # (--max-cpu-loras below it) is refused before the work, not half-way through it.
        at = {n: engine.at(n) for n in sorted(set(sizes))}
        for n, (tiers, lora_bytes) in at.items():
            # The replay runs the slots the engine gives adapters (SGLang's base model keeps
            # one of its --max-loras-per-batch), reported under the engine's flag.
            got = simulate(replay_for(HostTier(_host_slots(tiers, workload), engine.host_link)),
                           policies, [tiers.gpu_slots], lambda _, b=lora_bytes: b,
                           budget_bytes, told)
            for result in got:
                result.max_loras = n
            results += got
    engine_record = None
    host_tier = None if host is None else _host_record(host.slots, host.link,
                                                       host.slots * max(load_bytes, default=0))
    if engine is not None:
        engine_record = engine.record(sorted(set(sizes)))
        tiers = list(engine_record["tiers"].values())
        held = {t["host_slots"] if t["host_slots"] is not None else len(workload.adapters)
                for t in tiers}
        # One host size when --max-cpu-loras fixes it; else each size's own (None here).
        host_tier = _host_record(held.pop() if len(held) == 1 else None, engine.host_link,
                                 max(t["host_bytes"] for t in tiers))
    # An engine's --tp is its own flag, and its slot bytes are one GPU's.
    engine_tp = dict(engine.given).get("--tp") if engine is not None else None
    return Simulation(
        mode=replay.mode, workload=workload.record(),
        layout={"model": layout.model.source or layout.model.model_type,
                "modules": [m.peft_name for m in layout.modules], "max_rank": max_rank,
                "slot_bytes": slot_bytes if engine is not None else gpu_layout.slot_bytes,
                "expert_slot_bytes": gpu_experts.slot_bytes if gpu_experts else 0,
                "fingerprint": gpu_layout.fingerprint,
                **({"tp_size": shard.tp_size, "ep_size": shard.ep_size,
                    "fully_sharded": shard.fully_sharded, "tp_rank": busiest}
                   if shard is not None else {}),
                **({"tp_size": engine_tp} if engine_tp else {})},
        cost=cost, pinned=replay.pinned, max_concurrency=max_concurrency,
        prefill_tok_s=prefill_tok_s, decode_tok_s=decode_tok_s, policies=policies,
        sizes=sorted(set(sizes)), results=results, targets=targets, budget_bytes=budget_bytes,
        routing=routing.record() if routing is not None else None, admission=admission,
        max_rank_options=(max_rank_options(workload, layout, expert_layout, budget_bytes)
                          if shard is None and engine is None else None),
        host=host_tier, engine=engine_record,
        seconds=time.perf_counter() - started,
    )


def pinned_adapters(workload: Workload, pin: Sequence[str] = (),
                    pinned: int | None = None) -> list[str]:
    """The adapters pinned at startup: `pin`'s, else the `pinned` most requested."""
    if pin and pinned is not None:
        raise UsageError("give --pin or --pinned, not both")
    if pinned is not None and pinned < 0:
        raise UsageError(f"--pinned must be >= 0, got {pinned}")
    used = workload.requested_among(pin)
    for n in pin:
        if n not in used:  # it would only take a slot from the cache
            raise UsageError(f"--pin {n}: no request in the workload uses that adapter")
    return list(pin) if pin else workload.most_requested(pinned or 0)


def replay_sizes(workload: Workload, pinned: Sequence[str],
                 sizes: Sequence[int] | None = None) -> list[int]:
    """`sizes`, or by default powers of two up to every requested adapter resident beside the
    `pinned` ones (default_sizes)."""
    if sizes:
        return list(sizes)
    return default_sizes(workload.unpinned(pinned), len(set(pinned)))


def _host_slots(tiers: SlotTiers, workload: Workload) -> int:
    """The engine's host tier in adapters: no limit (SGLang without --max-loaded-loras keeps
    every adapter it has loaded) holds every adapter of the workload."""
    return tiers.host_slots if tiers.host_slots is not None else max(1, len(workload.adapters))


def _host_record(slots: int | None, link: Link, host_bytes: int) -> dict[str, Any]:
    """The record's host tier: its adapters (None: as many as each size's GPU slots), what a
    miss reads over, and what it holds at most."""
    return {"slots": slots, "bandwidth": link.name, "bytes_per_s": link.bytes_per_s,
            "latency_s": link.latency_s, "host_bytes": host_bytes}


def max_rank_options(workload: Workload, layout: SlotLayout,
                     expert_layout: ExpertLayout | None,
                     budget_bytes: int | None) -> list[dict[str, Any]] | None:
    """What the equal-slot pool trades, for a workload whose adapters have their own ranks: per
    max rank a requested adapter has (up to the pool's), the slot it makes, how many such slots
    fit `budget_bytes` (with their tables, as `layout --budget` counts), and the adapters, and
    their requests, that a pool of that max rank cannot serve. None without ranks."""
    if workload.adapter_rank is None:
        return None
    counts = workload.counts()
    used = counts > 0
    ranks = workload.adapter_rank
    options = []
    for r in sorted({int(x) for x in ranks[used] if 0 < x <= layout.max_rank}):
        lower = dataclasses.replace(layout, max_rank=r)
        experts = (dataclasses.replace(expert_layout, max_rank=r)
                   if expert_layout is not None else None)
        # An adapter of unknown rank is taken to need the pool's max rank.
        out = used & ((ranks > r) | ((ranks == 0) & (r < layout.max_rank)))
        options.append({
            "max_rank": r, "slot_bytes": lower.slot_bytes,
            "expert_slot_bytes": experts.slot_bytes if experts is not None else 0,
            "slots_in_budget": (PoolPlan.sized(lower, experts, budget_bytes=budget_bytes)
                                .max_loras if budget_bytes is not None else None),
            "adapters_shut_out": int(out.sum()),
            "requests_shut_out": int(counts[out].sum()),
        })
    return options


def adapter_load_bytes(workload: Workload, max_rank: int, slot_bytes: int) -> list[int]:
    """Per adapter, the bytes a load moves: an adapter of rank r in a pool of max rank R copies
    its r rows of A and r columns of B into the padded slot, r/R of the slot (rounded up); the
    pool zeroes the rest without a transfer. Unknown ranks move the whole slot. An adapter above
    the pool's max rank cannot be served: refused, naming it."""
    if workload.adapter_rank is None:
        return [slot_bytes] * len(workload.adapters)
    used = workload.counts() > 0
    above = np.flatnonzero(used & (workload.adapter_rank > max_rank))
    if above.size:
        a = int(above[0])
        raise UsageError(f"{above.size:,} requested adapter{'s' if above.size > 1 else ''} "
                         f"above the pool's max rank {max_rank} (first {workload.adapters[a]!r}"
                         f", rank {int(workload.adapter_rank[a])}): raise --max-rank")
    rank = np.where(workload.adapter_rank > 0, workload.adapter_rank, max_rank)
    return (-(-slot_bytes * rank // max_rank)).astype(np.int64).tolist()


# Seeds in one run: each is a whole simulation, and the list of them is made first.
MAX_SEEDS = 1000
# The figures whose spread over seeds `run_seeds` reports.
SPREAD_FIELDS = ("hit_rate", "misses", "stalls", "added_latency_p99_s", "ttft_adapter_p99_s",
                 "throughput_req_s")


def check_seeds(count: int) -> None:
    """Refuse more than MAX_SEEDS seeds before anything is made for them."""
    if count > MAX_SEEDS:
        raise UsageError(f"--seeds {count:,} is more than a simulation takes ({MAX_SEEDS:,}: "
                         "each seed is a whole run)")


# Request-replays in one simulation: every request replayed once per policy, size and seed.
# Whole runs replay 1.7-9.9 million a second on a 2-core VM (docs/simulate.md, Speed: "How long
# a simulation may take"), so this is 17 to 100 minutes; the limits of each option alone
# (10,000,000 requests, 1,000 sizes, 1,000 seeds, 1,024 replicas) multiply to months, decades
# with the router.
MAX_REPLAYS = 10**10
# What each replica's own replay at a policy and size costs beside its requests, in
# request-replays: its run's set-up and its result (percentiles), about 50 us, as long as
# about 100 requests take at the concurrent core's 2.1 million a second (1,024 replicas
# routed round-robin, 100 requests, 41 sizes against 2: 50 ms a size more).
REPLICA_REPLAY = 100


def check_work(requests: int, sizes: int, policies: int, seeds: int = 1,
               routing: Routing | None = None) -> None:
    """Refuse a simulation of more than MAX_REPLAYS request-replays before anything is replayed,
    naming the product and the options that lower it. Over replicas each replica's replay at a
    policy and size costs REPLICA_REPLAY beside the requests, however few it is given; the
    affinity router weighs every replica for every request at each size (a step that costs no
    more than a replay of the request), so with it each replica counts as one more replay of
    the workload per size."""
    replicas = routing.replicas if routing is not None else 1
    routed = replicas if routing is not None and routing.route == "affinity" and replicas > 1 \
        else 0
    own = replicas * REPLICA_REPLAY if replicas > 1 else 0
    work = seeds * sizes * (policies * (requests + own) + routed * requests)
    if work <= MAX_REPLAYS:
        return
    named = f"{policies:,} {'policy' if policies == 1 else 'policies'}"
    per = f"({named} + {routed:,} replicas the router weighs)" if routed else named
    counted = (f"{seeds:,} seed{'s' if seeds > 1 else ''} x {per} x {sizes:,} "
               f"size{'s' if sizes > 1 else ''} x {requests:,} requests")
    if own:
        counted += (f", plus each of the {replicas:,} replicas' own replay at every seed, "
                    f"policy and size, counted as {REPLICA_REPLAY:,} requests")
    lower = ["--seeds" if seeds > 1 else "", "--policy" if policies > 1 else "",
             "--replicas" if replicas > 1 else "", "--max-loras" if sizes > 1 else "",
             "--requests or the trace"]
    raise UsageError(
        f"{work:,} request-replays ({counted}) is more than a simulation takes "
        f"({MAX_REPLAYS:,}, about an hour): lower {', '.join(o for o in lower if o)}")


def run_seeds(make: Callable[[int], Workload], seeds: Sequence[int], layout: SlotLayout,
              expert_layout: ExpertLayout | None = None,
              progress: Callable[[int, int], None] | None = None,
              **options: Any) -> Simulation:
    """`run` once per seed of `seeds` on the workload `make(seed)` gives, every seed at the
    sizes the first one chose: the first seed's record, each result with the `spread` (min,
    median, max) of SPREAD_FIELDS over the seeds, so that a difference between sizes can be
    told from noise."""
    if not seeds:
        raise UsageError("--seeds must be positive")
    check_seeds(len(seeds))
    if len(seeds) != len(set(seeds)):
        raise UsageError("--seeds: the seeds must differ")

    def told(k: int) -> Callable[[int, int], None] | None:
        if progress is None:
            return None
        return lambda n, total: progress(n, total * len(seeds))

    first = run(make(seeds[0]), layout, expert_layout, progress=told(0), runs=len(seeds),
                **options)
    options = {**options, "sizes": first.sizes}
    others = [run(make(s), layout, expert_layout, progress=told(k), **options)
              for k, s in enumerate(seeds[1:], start=1)]
    for i, result in enumerate(first.results):
        spread: dict[str, dict[str, float] | None] = {}
        for name in SPREAD_FIELDS:
            values = [getattr(sim.results[i], name) for sim in (first, *others)]
            known = [float(v) for v in values if v is not None]
            spread[name] = ({"min": min(known), "median": float(np.median(known)),
                             "max": max(known)} if known else None)
        result.spread = spread
    first.seeds = list(seeds)
    first.seconds += sum(sim.seconds for sim in others)
    return first
