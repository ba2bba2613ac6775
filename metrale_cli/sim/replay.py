"""One workload replayed at one policy and size (`Replay.run`), or every LRU size of a paging
workload from one pass (`Replay.lru_sweep`, stack distances). The workload is prepared once (hold
times, next uses, the all-resident baseline); each run goes to the compiled core (sim/core.py)
or to the reference loops (sim/reference.py) that drive the pool's own slot state machine
(`SlotCache`, which `SlotManager` wraps in its lock), the reference the core is tested against.
What loads cost is in sim/costs.py, what a run reports in sim/results.py, the admission queue in
sim/admission.py.

A request's added latency is how much later it starts than it would with every adapter resident
(the same queue, no loads, no stalls), and never below 0: under skip admission a request that
starts earlier (it took a seat a stalled head did not hold) is counted apart (`moved_ahead`,
`gained_s`).
"""

from __future__ import annotations

import functools
import heapq
from collections.abc import Callable, Sequence

import numpy as np

from metrale_cli.errors import UsageError, did_you_mean
from metrale_cli.pool.slot_cache import NEVER, SlotCache
from metrale_cli.sim import reference
from metrale_cli.sim.admission import ADMISSIONS
from metrale_cli.sim.costs import HostTier, Loads, SwapCost
from metrale_cli.sim.reference import Columns, Counts
from metrale_cli.sim.results import Observer, RunResult, added_latency, serving_stats, throughput
from metrale_cli.sim.stack_distance import stack_distances
from metrale_cli.sim.workload import Workload


class Replay:
    """One workload, prepared once (hold times, next uses, the no-cache baseline), replayed
    against a fresh `SlotCache` per (policy, size)."""

    def __init__(self, workload: Workload, hold: np.ndarray, cost: SwapCost,
                 pinned: Sequence[str] = (), max_concurrency: int | None = None,
                 load_bytes: Sequence[int] | None = None, host: HostTier | None = None,
                 first_token: np.ndarray | None = None, admission: str = "fcfs") -> None:
        """`load_bytes[a]`: what loading adapter `a` moves (default a whole slot each);
        `first_token[r]`: seconds from request r's start to its first token (default 0);
        `admission`: `fcfs`, or `skip` (ADMISSIONS)."""
        if max_concurrency is not None and max_concurrency <= 0:
            raise UsageError(f"--max-concurrency must be positive, got {max_concurrency}")
        if admission not in ADMISSIONS:
            raise UsageError(f"--admission must be one of {', '.join(ADMISSIONS)}, got "
                             f"{admission!r}{did_you_mean(admission, ADMISSIONS)}")
        self.admission = admission
        # A request's first token comes after its prefill, never after it ends.
        self.first_token = (np.zeros(workload.requests) if first_token is None
                            else np.minimum(first_token, hold))
        self.hold = hold
        self.workload = workload
        self.cost = cost
        self.host = host
        self.load_bytes = (list(load_bytes) if load_bytes is not None
                           else [cost.slot_bytes] * len(workload.adapters))
        # The one-pass LRU sweep needs equal loads and no host tier.
        self.sweepable = host is None and len(set(self.load_bytes)) <= 1
        self.pinned = list(dict.fromkeys(pinned))
        # Each pinned adapter's index for the core, once (not a dict of every adapter a run);
        # a pinned adapter no request names holds its slot all the same (-1).
        names = {n: a for a, n in enumerate(workload.adapters)} if self.pinned else {}
        self._pinned_ids = np.array([names.get(p, -1) for p in self.pinned], dtype=np.int64)
        self.max_concurrency = max_concurrency
        self.paging = not bool(hold.any())
        # [N] int64: the next request for the same adapter, NEVER if none (the core's, and
        # min's). The other columns the core reads are the workload's own, not copies.
        self.next_use = workload.next_use()
        self.next_use[self.next_use < 0] = NEVER
        self.unpinned = workload.unpinned(self.pinned)  # requested ones needing a cache slot
        self.baseline = self._baseline(hold)

    @functools.cached_property
    def columns(self) -> Columns:
        """The columns the Python loop indexes (`reference.py`), made on its first run."""
        return Columns.of(self.workload, self.hold, self.next_use)

    @property
    def mode(self) -> str:
        return "paging" if self.paging else "concurrent"

    def _pinned_keys(self) -> list[int]:
        """The pinned adapters as `SlotCache` keys: the workload's index, or for one no
        request names (it holds its slot all the same) a key below -1, that of `adapter_name`."""
        index = {name: a for a, name in enumerate(self.workload.adapters)}
        return [index.get(name, -2 - i) for i, name in enumerate(self.pinned)]

    def adapter_name(self, key: int) -> str:
        """The adapter a `SlotCache` key of this replay names (`_pinned_keys`)."""
        return self.workload.adapters[key] if key >= 0 else self.pinned[-2 - key]

    def _baseline(self, hold: np.ndarray) -> np.ndarray:
        """Start times with every adapter resident: arrival, or the first free seat."""
        arrival = self.workload.arrival
        if self.paging or self.max_concurrency is None:
            return arrival  # read, never written
        seats: list[float] = []
        start = np.empty_like(arrival)
        for r, (t, h) in enumerate(zip(arrival.tolist(), hold.tolist(), strict=True)):
            s = t if len(seats) < self.max_concurrency else max(t, heapq.heappop(seats))
            start[r] = s
            heapq.heappush(seats, s + h)
        return start

    def run(self, policy: str, max_loras: int,
            progress: Callable[[int], None] | None = None, detail: bool = True,
            observe: Observer | None = None, compiled: bool = True) -> RunResult:
        """Replay every request at `max_loras` slots under `policy`. Without `detail` the
        result drops its per-request arrays (a sweep of a million requests keeps none);
        `observe` hears the cache state after each request is placed (a slow path, for
        checking the replay against an engine). The replay runs in the compiled core
        (sim/core.py) unless `compiled` is False or `observe` is given: then in the Python
        loop that drives the pool's own `SlotCache`, the reference the core is tested
        against."""
        self._check_size(max_loras)
        n = self.workload.requests
        start = np.empty(n)
        loads = Loads(self.cost, self.load_bytes, self.host)
        if compiled and observe is None:
            served = np.ones(n, dtype=np.int64)
            hits, delayed, misses, swaps, waits = self._in_core(policy, max_loras, loads,
                                                                start)
            if progress is not None:
                progress(n)
            return self._result(policy, max_loras, loads, start, served, [0] * max_loras,
                                hits, delayed, misses, swaps, waits, detail)
        cache = SlotCache(max_loras, policy=policy)
        cache.load_pinned(self._pinned_keys())
        served = np.zeros(n, dtype=np.int64)
        loop = reference.paging if self.paging else reference.concurrent
        told = reference.observer(self, cache, loads, observe) if observe is not None else None
        hits, delayed, misses, swaps, waits = loop(self, cache, loads, start, served, progress,
                                                   told)
        return self._result(policy, max_loras, loads, start, served,
                            list(cache.refs),
                            hits, delayed, misses, swaps, waits, detail)

    def _in_core(self, policy: str, max_loras: int, loads: Loads, start: np.ndarray) -> Counts:
        """The replay in the compiled core, its load totals written into `loads`."""
        from metrale_cli.sim import core

        adapters = len(self.workload.adapters)
        pinned = self._pinned_ids
        read_s = (np.asarray(loads.read_s, dtype=np.float64) if self.host is not None
                  else np.zeros(adapters))
        adapter = np.ascontiguousarray(self.workload.adapter, dtype=np.int64)
        arrival = np.ascontiguousarray(self.workload.arrival, dtype=np.float64)
        nxt = self.next_use
        load_s = np.asarray(loads.load_s, dtype=np.float64)
        load_bytes = np.asarray(self.load_bytes, dtype=np.int64)
        # The core takes int64s: a host tier past every adapter holds every one, and a cap past
        # every request caps nothing (10**20 of either overflowed, exit 70).
        host_slots = min(self.host.slots, adapters) if self.host is not None else 0
        seats = min(self.max_concurrency or len(adapter) + 1, len(adapter) + 1)
        if self.paging:
            (hits, delayed, misses, swaps, loads.bytes_moved, loads.swap_s, loads.link_wait_s,
             loads.host_hits, loads.host_misses, loads.host_bytes_moved) = core.paging(
                adapter, arrival, nxt, core.POLICY_CODES[policy], max_loras, pinned, adapters,
                load_s, load_bytes, self.cost.links, host_slots, read_s, start)
            return hits, delayed, misses, swaps, []
        waits = np.empty(len(adapter))
        counts, seconds = core.concurrent(
            adapter, arrival, np.ascontiguousarray(self.hold, dtype=np.float64), nxt,
            core.POLICY_CODES[policy], max_loras, pinned, adapters,
            seats, self.admission == "skip", load_s,
            load_bytes, self.cost.links,
            host_slots, read_s, start, waits)
        (hits, delayed, misses, swaps, stalls, loads.bytes_moved, loads.host_hits,
         loads.host_misses, loads.host_bytes_moved, error) = counts.tolist()
        if error:
            raise UsageError("the slot cache can never free a slot (no request in flight)")
        loads.swap_s, loads.link_wait_s = seconds.tolist()
        return hits, delayed, misses, swaps, waits[:stalls].tolist()

    def _result(self, policy: str, max_loras: int, loads: Loads, start: np.ndarray,
                served: np.ndarray, ref_counts: list[int], hits: int, delayed: int,
                misses: int, swaps: int, waits: list[float], detail: bool) -> RunResult:
        n = self.workload.requests
        adapter_requests = int((self.workload.adapter >= 0).sum())
        wait = np.asarray(waits) if waits else np.zeros(1)
        return RunResult(
            policy=policy, max_loras=max_loras, pinned=len(self.pinned), requests=n,
            adapter_requests=adapter_requests, hits=hits, delayed_hits=delayed, misses=misses,
            swaps=swaps, bytes_moved=loads.bytes_moved, swap_s=loads.swap_s,
            link_wait_s=loads.link_wait_s, host_hits=loads.host_hits,
            host_misses=loads.host_misses, host_bytes_moved=loads.host_bytes_moved,
            stalls=len(waits), stall_total_s=float(sum(waits)),
            stall_p50_s=float(np.percentile(wait, 50)),
            stall_p99_s=float(np.percentile(wait, 99)),
            **added_latency(start, self.baseline),
            **serving_stats(start, self.workload.arrival, self.hold, self.first_token,
                            self.workload.adapter >= 0),
            pool_bytes=0, start=start if detail else np.empty(0),
            served=served if detail else np.empty(0, dtype=np.int64),
            ref_counts_at_end=ref_counts,
            waits=np.asarray(waits, dtype=np.float64) if detail else np.empty(0),
        )

    def _check_size(self, max_loras: int) -> None:
        if len(self.pinned) > max_loras:
            raise UsageError(f"{len(self.pinned)} pinned adapters do not fit in "
                             f"--max-loras {max_loras}")
        if len(self.pinned) == max_loras and self.unpinned:
            raise UsageError(f"--max-loras {max_loras} leaves no cache slot beside the "
                             f"{len(self.pinned)} pinned adapters, and unpinned ones are "
                             "requested")

    def lru_sweep(self, sizes: Sequence[int],
                  progress: Callable[[int], None] | None = None) -> list[RunResult]:
        """LRU in paging mode at every size of `sizes` from one pass (stack distances), each
        result what `run("lru", size, detail=False)` gives, up to float rounding in the
        latencies; `progress` hears of every request once per size."""
        if not (self.paging and self.sweepable):
            raise UsageError("the one-pass LRU sweep is for paging mode (requests that hold "
                             "no slot) with equal loads and no host tier")
        from metrale_cli.sim import core

        for size in sizes:
            self._check_size(size)
        adapter, arrival = self.workload.adapter, self.workload.arrival
        pinned_ids = [a for a, name in enumerate(self.workload.adapters) if name in self.pinned]
        counted = np.flatnonzero((adapter >= 0) & ~np.isin(adapter, pinned_ids))
        pinned_requests = int((adapter >= 0).sum()) - counted.size
        # The requests a cache slot serves; every one: the columns themselves, not copies.
        cached_adapter, cached_arrival = ((adapter, arrival) if counted.size == adapter.size
                                          else (adapter[counted], arrival[counted]))
        ticks = None if progress is None else (lambda k: progress(k * len(sizes)))
        distance = stack_distances(cached_adapter, ticks)
        if progress is not None:
            progress((self.workload.requests - counted.size) * len(sizes))
        # Every load moves the same bytes (sweepable): the adapters' one load, which is less
        # than a slot when they share a rank below the pool's max rank.
        load = self.load_bytes[0] if self.load_bytes else self.cost.slot_bytes
        n, swap_s, links = self.workload.requests, self.cost.load_seconds(load), self.cost.links
        n_adapter = pinned_requests + counted.size
        caches = np.array([size - len(self.pinned) for size in sizes], dtype=np.int64)
        order = np.argsort(caches, kind="stable")
        rows = np.empty((len(sizes), 9))
        rows[order] = core.lru_sweep(
            np.ascontiguousarray(cached_adapter), np.ascontiguousarray(cached_arrival), distance,
            caches[order], swap_s, links, len(self.workload.adapters), n, n_adapter)
        results = []
        for size, row in zip(sizes, rows.tolist(), strict=True):
            cache = size - len(self.pinned)
            misses, delayed = int(row[0]), int(row[1])
            load_added, added, last, p50, p99, ttft50, ttft99 = row[2:]
            results.append(RunResult(
                policy="lru", max_loras=size, pinned=len(self.pinned), requests=n,
                adapter_requests=n_adapter, hits=n_adapter - misses - delayed,
                delayed_hits=delayed, misses=misses,
                swaps=misses - min(cache, self.unpinned), bytes_moved=misses * load,
                # The loads' summed waits, each at least 0: the sweep's running sum less the
                # loads' own time rounds a few ulps below 0 where no load waited.
                swap_s=misses * swap_s, link_wait_s=max(0.0, load_added - misses * swap_s),
                host_hits=0, host_misses=0, host_bytes_moved=0,
                stalls=0, stall_total_s=0.0, stall_p50_s=0.0, stall_p99_s=0.0,
                added_latency_p50_s=p50, added_latency_p99_s=p99,
                added_latency_mean_s=added / n if n else 0.0,
                moved_ahead=0, gained_s=0.0,  # paging: every request at its arrival or later
                # Paging: zero-length requests, so the first token is at the start.
                ttft_adapter_p50_s=ttft50 if n_adapter else None,
                ttft_adapter_p99_s=ttft99 if n_adapter else None,
                ttft_base_p50_s=0.0 if n_adapter < n else None,
                ttft_base_p99_s=0.0 if n_adapter < n else None,
                throughput_req_s=throughput(n, float(arrival[0]) if n else 0.0,
                                             max(float(arrival[-1]) if n else 0.0, last)),
                pool_bytes=0,
            ))
        return results
