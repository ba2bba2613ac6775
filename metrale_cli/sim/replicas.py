"""Data-parallel replicas, each with its own pool, and the router in front of them.

A router sends each request, in arrival order, to one replica: `random` (seeded),
`round-robin`, or `affinity`, as dLoRA and Punica route: to a replica that holds the request's
adapter and has a free seat, else to the least loaded one (fewest requests in flight; on a tie,
the one sent the fewest requests so far, then the lowest index, so that equally loaded replicas
share new adapters). The router knows what each replica holds as a router that tracks its replicas'
recent adapters does: per replica, the adapters an LRU of the replica's cache slots would hold
given the requests routed there (pinned adapters are on every replica), and which requests are
in flight from their hold times. Each replica then replays its requests against its own slot
manager, link and host tier; the totals add the replicas' counts and take the percentiles over
every request.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from metrale_cli.errors import UsageError, did_you_mean
from metrale_cli.sim.costs import HostTier, SwapCost
from metrale_cli.sim.replay import Replay
from metrale_cli.sim.results import RunResult, added_latency, serving_stats
from metrale_cli.sim.workload import Workload

ROUTES = ("random", "round-robin", "affinity")
# Data-parallel replicas: past this a figure is a typo, and the router weighs every replica for
# every request (10**20 ran out of memory making their queues).
MAX_REPLICAS = 1024


@dataclass(frozen=True)
class Routing:
    replicas: int
    route: str = "affinity"
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.replicas <= MAX_REPLICAS:
            raise UsageError(f"--replicas must be between 1 and {MAX_REPLICAS:,}, got "
                             f"{self.replicas:,}")
        if self.route not in ROUTES:
            raise UsageError(f"--route must be one of {', '.join(ROUTES)}, got {self.route!r}"
                             f"{did_you_mean(self.route, ROUTES)}")

    def record(self) -> dict[str, Any]:
        return {"replicas": self.replicas, "route": self.route, "seed": self.seed}


def route(workload: Workload, hold: np.ndarray, routing: Routing, cache_slots: int,
          pinned: Sequence[str], max_concurrency: int | None) -> np.ndarray:
    """[N] int64: the replica of each request."""
    n, count = workload.requests, routing.replicas
    if routing.route == "round-robin":
        return np.arange(n, dtype=np.int64) % count
    if routing.route == "random":
        return np.random.default_rng(routing.seed).integers(0, count, size=n)
    seats = max_concurrency or n + 1
    pinned_ids = {workload.adapters.index(p) for p in pinned}
    held: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(count)]
    ends: list[list[float]] = [[] for _ in range(count)]  # in flight, by end time
    sent = [0] * count  # requests routed to each replica so far
    out = np.empty(n, dtype=np.int64)
    for r, (a, t, h) in enumerate(zip(workload.adapter.tolist(), workload.arrival.tolist(),
                                      hold.tolist(), strict=True)):
        for e in ends:
            while e and e[0] <= t:
                heapq.heappop(e)
        load = [len(e) for e in ends]
        cached = a >= 0 and a not in pinned_ids
        holders = [k for k in range(count) if cached and a in held[k] and load[k] < seats]
        # Equally loaded replicas (nothing in flight: every paging request) share the new
        # adapters: the one sent the fewest requests so far, then the lowest index.
        k = min(holders or range(count), key=lambda j: (load[j], sent[j], j))
        out[r] = k
        sent[k] += 1
        heapq.heappush(ends[k], t + h)
        if cached and cache_slots > 0:
            lru = held[k]
            if a in lru:
                lru.move_to_end(a)
            else:
                if len(lru) == cache_slots:
                    lru.popitem(last=False)
                lru[a] = None
    return out


def _subset(w: Workload, mask: np.ndarray) -> Workload:
    return Workload(adapters=w.adapters, adapter=w.adapter[mask], arrival=w.arrival[mask],
                    input_tokens=w.input_tokens[mask], output_tokens=w.output_tokens[mask],
                    duration=w.duration[mask], source=w.source, adapter_rank=w.adapter_rank)


class Replicas:
    """Replays for `routing.replicas` replicas behind a router, answering `run` as a `Replay`
    does, with the totals and a summary per replica."""

    def __init__(self, workload: Workload, hold: np.ndarray, cost: SwapCost,
                 pinned: Sequence[str], max_concurrency: int | None,
                 load_bytes: Sequence[int], host: HostTier | None, routing: Routing,
                 first_token: np.ndarray | None = None, admission: str = "fcfs") -> None:
        self.whole = Replay(workload, hold, cost, pinned, max_concurrency, load_bytes, host,
                            first_token, admission)
        self.first_token, self.admission = self.whole.first_token, admission
        self.workload, self.hold, self.cost = workload, hold, cost
        self.max_concurrency, self.load_bytes, self.host = max_concurrency, load_bytes, host
        self.routing = routing
        self.pinned, self.unpinned = self.whole.pinned, self.whole.unpinned
        self.paging, self.mode = self.whole.paging, self.whole.mode
        self.sweepable = False  # a sweep is of one pool
        self._routes: dict[int, np.ndarray] = {}

    def run(self, policy: str, max_loras: int, progress: Callable[[int], None] | None = None,
            detail: bool = True) -> RunResult:
        self.whole._check_size(max_loras)
        if max_loras not in self._routes:  # the router is the same for every policy
            self._routes[max_loras] = route(self.workload, self.hold, self.routing,
                                            max_loras - len(self.pinned), self.pinned,
                                            self.max_concurrency)
        where = self._routes[max_loras]
        parts: list[tuple[RunResult, Replay]] = []
        for k in range(self.routing.replicas):
            mask = where == k
            if not mask.any():
                continue  # listed in the totals with zeros
            sub = Replay(_subset(self.workload, mask), self.hold[mask], self.cost, self.pinned,
                         self.max_concurrency, self.load_bytes, self.host,
                         self.first_token[mask], self.admission)
            parts.append((sub.run(policy, max_loras, progress, detail=True), sub))
        return _total(policy, max_loras, len(self.pinned), where, parts, self.routing.replicas)


SUMMARY = ("requests", "adapter_requests", "hits", "delayed_hits", "misses", "hit_rate",
           "stalls", "added_latency_p99_s")


def _total(policy: str, max_loras: int, pinned: int, where: np.ndarray,
           parts: list[tuple[RunResult, Replay]], replicas: int) -> RunResult:
    def joined(column: Callable[[RunResult, Replay], np.ndarray]) -> np.ndarray:
        return np.concatenate([column(r, sub) for r, sub in parts])

    late = added_latency(joined(lambda r, _: r.start), joined(lambda _, sub: sub.baseline))
    waits = joined(lambda r, _: r.waits)
    stats = serving_stats(joined(lambda r, _: r.start), joined(lambda _, s: s.workload.arrival),
                          joined(lambda _, s: s.hold), joined(lambda _, s: s.first_token),
                          joined(lambda _, s: s.workload.adapter >= 0))
    wait = waits if waits.size else np.zeros(1)

    def total(name: str) -> Any:
        return sum(getattr(r, name) for r, _ in parts)

    # Every replica, in order; one the router sent nothing has zeros.
    mine = dict(zip((int(k) for k in np.unique(where)), (r for r, _ in parts), strict=True))
    summary = [{"replica": k, **{f: getattr(mine[k], f) if k in mine
                                    else 0.0 if f.endswith(("_rate", "_s")) else 0
                                    for f in SUMMARY}}
               for k in range(replicas)]
    return RunResult(
        policy=policy, max_loras=max_loras, pinned=pinned, requests=int(where.size),
        adapter_requests=total("adapter_requests"), hits=total("hits"),
        delayed_hits=total("delayed_hits"), misses=total("misses"), swaps=total("swaps"),
        bytes_moved=total("bytes_moved"), swap_s=total("swap_s"),
        link_wait_s=total("link_wait_s"), host_hits=total("host_hits"),
        host_misses=total("host_misses"), host_bytes_moved=total("host_bytes_moved"),
        stalls=int(waits.size), stall_total_s=float(waits.sum()),
        stall_p50_s=float(np.percentile(wait, 50)), stall_p99_s=float(np.percentile(wait, 99)),
        **late, **stats, pool_bytes=0,
        replicas=summary,
    )
