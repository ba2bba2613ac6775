"""One workload replayed against the pool's own slot manager (`SlotManager`) at one policy and
size, and what its loads cost: the links they cross (a busy-until clock per link), the host tier
in front of the GPU slots, and each adapter's own bytes. `Replay.lru_sweep` answers every LRU
size of a paging workload from one pass (stack distances).

Two modes, chosen by the workload. **Paging** (every request holds its slot for zero time): the
requests are served one at a time in order, the classic paging problem, where `min` (Belady) is the
optimum; a request that arrives before its adapter's load ends is a delayed hit and starts when the
load does, as in concurrent mode. **Concurrent**: a request takes a seat (at most
`max_concurrency`) and a ref count on its adapter's slot from admission to completion; a miss loads
the adapter into the victim slot and the request starts when the load ends; when every cache slot
has in-flight sequences the slot manager says `PoolFull` and the request waits at the head of the
queue (admission is first come, first served), never evicting an adapter in flight.

A request's added latency is how much later it starts than it would with every adapter resident
(the same queue, no loads, no stalls), and never below 0: under skip admission a request that
starts earlier (it took a seat a stalled head did not hold) is counted apart (`moved_ahead`,
`gained_s`). Admission's waiting requests are a `WaitingQueue`, indexed by adapter for skip.
"""

from __future__ import annotations

import array
import heapq
import itertools
import math
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from metrale_cli.errors import PoolFull, UsageError
from metrale_cli.pool.slots import NEVER, AdapterSlot, SlotManager, SlotState
from metrale_cli.sim.stack_distance import stack_distances
from metrale_cli.sim.workload import Workload

# Named links a slot's bytes cross on a swap: (bytes per second, per-swap latency in seconds,
# what it is). PCIe figures are typical achieved pinned host-to-device copies, not the raw link.
BANDWIDTHS: dict[str, tuple[float, float, str]] = {
    "pcie4": (25e9, 10e-6, "PCIe 4.0 x16 host to GPU, pinned (32 GB/s raw)"),
    "pcie5": (50e9, 10e-6, "PCIe 5.0 x16 host to GPU, pinned (64 GB/s raw)"),
    "nvlink": (450e9, 10e-6, "NVLink 4 GPU to GPU, one direction (H100/H200, nominal)"),
    "nvme": (7e9, 100e-6, "PCIe 4.0 NVMe SSD sequential read"),
}
PROGRESS_EVERY = 1 << 16  # requests between progress callbacks
# Copy links per GPU: a GPU has a few copy engines; past this a figure is a typo, and the
# link clock would allocate one entry per link.
MAX_LINKS = 1024
# What a replay loop counts: hits, delayed hits, misses, swaps, stall waits (s); `Loads` counts
# what the loads moved.
Counts = tuple[int, int, int, int, list[float]]


@dataclass(frozen=True)
class CacheState:
    """Where the adapters are after a request (paging: once it is placed; concurrent: when it
    ends): the adapter each GPU slot holds (None: empty or
    loading), in slot order, and the host tier's adapters, least recently used first (empty
    without a host tier). What tests/test_engine_vllm_cache.py compares with vLLM's own."""

    slots: tuple[str | None, ...]
    host: tuple[str, ...]


# Called after each request has been placed: (request index, the cache state then).
Observer = Callable[[int, CacheState], None]


@dataclass(frozen=True)
class Link:
    """A link a slot's bytes cross on a load: a preset of BANDWIDTHS or a figure."""

    name: str
    bytes_per_s: float
    latency_s: float

    def __post_init__(self) -> None:
        if not 0 < self.bytes_per_s < math.inf:
            raise UsageError(f"a link's bandwidth must be positive and finite, got "
                             f"{self.bytes_per_s:g} B/s")
        if not 0 <= self.latency_s < math.inf:
            raise UsageError(f"--swap-latency-ms must be >= 0 and finite, got "
                             f"{1e3 * self.latency_s:g}")

    @classmethod
    def preset(cls, name: str) -> Link:
        bytes_per_s, latency_s, _ = BANDWIDTHS[name]
        return cls(name, bytes_per_s, latency_s)


@dataclass(frozen=True)
class SwapCost:
    """What one load moves and how long it takes, and how many loads run at once: a GPU has
    `links` copy links (1: the engine loads one adapter at a time), and a load waits for one."""

    slot_bytes: int           # one slot (and its expert slot): the bytes a load writes
    bytes_per_s: float
    latency_s: float
    bandwidth: str            # a preset name or the figure as given
    links: int = 1

    def __post_init__(self) -> None:
        if not 0 < self.links <= MAX_LINKS:
            raise UsageError(f"--links must be between 1 and {MAX_LINKS:,}, got "
                             f"{self.links:,}")

    @property
    def seconds(self) -> float:
        return self.load_seconds(self.slot_bytes)

    def load_seconds(self, load_bytes: int) -> float:
        """How long a load of `load_bytes` takes once it has its link."""
        return load_bytes / self.bytes_per_s + self.latency_s

    def record(self) -> dict[str, Any]:
        return {**asdict(self), "swap_s": self.seconds}


class LinkClock:
    """When each of a GPU's links is free: a load begins when the earliest-free link is (or at
    once) and holds it for its duration, so loads asked for together queue, never overlap."""

    def __init__(self, links: int) -> None:
        self._free = [0.0] * links  # a heap of busy-until times

    def load(self, now: float, seconds: float) -> tuple[float, float]:
        """A load asked for at `now`: (when it ends, how long it waited for a link)."""
        free = self._free[0]
        begin = free if free > now else now
        heapq.heapreplace(self._free, begin + seconds)
        return begin + seconds, begin - now


@dataclass(frozen=True)
class HostTier:
    """Host memory in front of the GPU slots (vLLM's `--max-cpu-loras`): an LRU of `slots`
    adapters. A GPU miss whose adapter is there copies it to the GPU; one that is not first
    reads it over `link` (disk or hub) into the tier, evicting the tier's least recently used."""

    slots: int
    link: Link

    def __post_init__(self) -> None:
        if self.slots <= 0:
            raise UsageError(f"--host-slots must be positive, got {self.slots}")


class Loads:
    """Every load of one run: its bytes and time by adapter (an adapter of rank r in a pool of
    max rank R moves r/R of a slot), the GPU link's queue, and the host tier when there is one,
    with what each moved."""

    def __init__(self, cost: SwapCost, load_bytes: Sequence[int], host: HostTier | None) -> None:
        self.cost, self.host = cost, host
        self.load_bytes = load_bytes
        self.load_s = [cost.load_seconds(b) for b in load_bytes]
        self.gpu = LinkClock(cost.links)
        self.bytes_moved = 0
        self.swap_s = self.link_wait_s = 0.0
        self.host_hits = self.host_misses = self.host_bytes_moved = 0
        if host is not None:
            self.read_s = [b / host.link.bytes_per_s + host.link.latency_s for b in load_bytes]
            self.disk = LinkClock(1)
            self.resident: OrderedDict[int, None] = OrderedDict()

    def touch(self, adapter: int) -> None:
        """A request used `adapter`: the host tier's LRU moves it up, as vLLM's registered
        adapters are touched on each use."""
        if adapter in self.resident:
            self.resident.move_to_end(adapter)

    def load(self, adapter: int, now: float) -> float:
        """Load `adapter` onto the GPU, asked for at `now`: when the copy ends."""
        ready = now
        if self.host is not None:
            if adapter in self.resident:
                self.host_hits += 1
            else:
                self.host_misses += 1
                self.host_bytes_moved += self.load_bytes[adapter]
                if len(self.resident) == self.host.slots:
                    self.resident.popitem(last=False)
                self.resident[adapter] = None
                ready, _ = self.disk.load(now, self.read_s[adapter])
        seconds = self.load_s[adapter]
        end, wait = self.gpu.load(ready, seconds)
        self.bytes_moved += self.load_bytes[adapter]
        self.swap_s += seconds
        self.link_wait_s += wait
        return end


@dataclass
class RunResult:
    """One policy at one pool size. `start` (when each request started, in seconds),
    `served`, `ref_counts_at_end` and `waits` (each stall's wait) are for tests and the replica
    totals, and are not part of the record; `lru_sweep` leaves them empty (a list of every
    slot's zero count per size cost more than the sweep itself at 1,000 sizes)."""

    policy: str
    max_loras: int
    pinned: int
    requests: int
    adapter_requests: int
    hits: int
    delayed_hits: int
    misses: int
    swaps: int
    bytes_moved: int
    swap_s: float
    link_wait_s: float
    host_hits: int
    host_misses: int
    host_bytes_moved: int
    stalls: int
    stall_total_s: float
    stall_p50_s: float
    stall_p99_s: float
    added_latency_p50_s: float
    added_latency_p99_s: float
    added_latency_mean_s: float
    # Under --admission skip a request can start before its all-resident baseline (it took a
    # seat a stalled head did not hold): how many did, and the seconds they gained in all.
    # Their added latency is 0: added latency is how much later loads made a request start.
    moved_ahead: int
    gained_s: float
    # Time to first token (admission wait, loads, stalls, then the prefill), adapter requests
    # apart from base-model ones (None where there are none), and completed requests per second
    # from the first arrival to the last completion.
    ttft_adapter_p50_s: float | None
    ttft_adapter_p99_s: float | None
    ttft_base_p50_s: float | None
    ttft_base_p99_s: float | None
    throughput_req_s: float
    pool_bytes: int
    fits_budget: bool | None = None
    extra_misses_vs_min: int | None = None
    hit_rate_gap_vs_min: float | None = None
    # With --replicas, a summary per replica (the other figures are their totals).
    replicas: list[dict[str, Any]] | None = None
    # With --seeds K, each figure's min, median and max over the K seeds.
    spread: dict[str, dict[str, float] | None] | None = None
    start: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    waits: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    served: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64), repr=False)
    ref_counts_at_end: list[int] = field(default_factory=list, repr=False)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.adapter_requests if self.adapter_requests else 1.0

    def record(self) -> dict[str, Any]:
        skip = {"start", "served", "ref_counts_at_end", "waits"}
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}
        for optional in ("replicas", "spread"):
            if out[optional] is None:
                del out[optional]
        out["hit_rate"] = self.hit_rate
        # Belady's `min` evicts the adapter wanted furthest ahead: it needs the future, so no
        # engine can run it; it is the floor the others' misses are measured against.
        out["offline_bound"] = self.policy == "min"
        return out


def _column(code: str, values: np.ndarray) -> array.array[Any]:
    column = array.array(code)
    column.frombytes(np.ascontiguousarray(values, dtype=np.float64 if code == "d"
                                          else np.int64).tobytes())
    return column


ADMISSIONS = ("fcfs", "skip")


def serving_stats(start: np.ndarray, arrival: np.ndarray, hold: np.ndarray,
                  first_token: np.ndarray, adapter: np.ndarray) -> dict[str, Any]:
    """TTFT percentiles (adapter requests apart from base-model ones) and throughput of requests
    that started at `start`; `adapter` marks the adapter requests."""
    ttft = start - arrival + first_token
    out: dict[str, Any] = {}
    for name, mask in (("adapter", adapter), ("base", ~adapter)):
        mine = ttft[mask]
        for q in (50, 99):
            out[f"ttft_{name}_p{q}_s"] = float(np.percentile(mine, q)) if mine.size else None
    n = int(start.size)
    out["throughput_req_s"] = _throughput(n, float(arrival.min()) if n else 0.0,
                                          float((start + hold).max()) if n else 0.0)
    return out


def added_latency(start: np.ndarray, baseline: np.ndarray) -> dict[str, Any]:
    """Added latency (how much later than its all-resident baseline each request started, 0
    for one that started earlier) as its p50, p99 and mean, and apart from it the requests that
    started earlier (`moved_ahead`) and the seconds they gained (`gained_s`)."""
    late = start - baseline
    ahead = late < 0
    added = np.where(ahead, 0.0, late)
    n = int(start.size)
    return {"added_latency_p50_s": float(np.percentile(added, 50)) if n else 0.0,
            "added_latency_p99_s": float(np.percentile(added, 99)) if n else 0.0,
            "added_latency_mean_s": float(added.mean()) if n else 0.0,
            "moved_ahead": int(ahead.sum()), "gained_s": float((baseline - start)[ahead].sum())}


def _throughput(n: int, first: float, last: float) -> float:
    return n / (last - first) if last > first else 0.0


class WaitingQueue:
    """The requests waiting for admission in a concurrent replay, in arrival order, each
    leaving when it starts or joins a load. `indexed` (skip admission) adds an index by
    adapter, so that a pass past a stalled head visits the requests that can start, in arrival
    order, and not the whole queue at every event: a heap of each startable adapter's earliest
    waiting request, checked when taken (an adapter evicted since is dropped, and offered
    again when it next loads). Base-model requests are adapter -1, always startable."""

    def __init__(self, n: int, adapter: array.array[int], indexed: bool) -> None:
        self._order: deque[int] = deque()
        self._gone = bytearray(n)
        self._adapter, self._indexed = adapter, indexed
        self._by_adapter: dict[int, deque[int]] = {}
        self._heap: list[tuple[int, int]] = []  # (earliest waiting request, adapter)
        self._offered: set[int] = set()
        self.considered = 0  # requests below this were looked at by a pass past the head

    def arrive(self, r: int, startable: Callable[[int], bool]) -> None:
        self._order.append(r)
        if self._indexed:
            a = self._adapter[r]
            self._by_adapter.setdefault(a, deque()).append(r)
            if startable(a):
                self.offer(a)

    def head(self) -> int | None:
        order, gone = self._order, self._gone
        while order and gone[order[0]]:
            order.popleft()
        return order[0] if order else None

    def gone(self, r: int) -> bool:
        return bool(self._gone[r])

    def leave(self, r: int) -> None:
        self._gone[r] = 1

    def _earliest(self, a: int) -> int | None:
        waiting = self._by_adapter.get(a)
        while waiting and self._gone[waiting[0]]:
            waiting.popleft()
        if not waiting:
            self._by_adapter.pop(a, None)
            return None
        return waiting[0]

    def offer(self, a: int) -> None:
        """Adapter `a` became startable (it arrived so, or its load began)."""
        if self._indexed and a not in self._offered:
            r = self._earliest(a)
            if r is not None:
                self._offered.add(a)
                heapq.heappush(self._heap, (r, a))

    def startable_in_order(self, startable: Callable[[int], bool]) -> Iterator[int]:
        """The waiting requests whose adapter is `startable`, earliest first, each leaving as
        it is yielded (the caller stops taking them when seats run out)."""
        heap, offered = self._heap, self._offered
        while heap:
            r, a = heap[0]
            if not startable(a):
                heapq.heappop(heap)
                offered.discard(a)
                continue
            earliest = self._earliest(a)
            if earliest is None:
                heapq.heappop(heap)
                offered.discard(a)
                continue
            if earliest != r:  # its earlier requests left: its place in the heap moves
                heapq.heapreplace(heap, (earliest, a))
                continue
            self._gone[r] = 1
            following = self._earliest(a)
            if following is None:
                heapq.heappop(heap)
                offered.discard(a)
            else:
                heapq.heapreplace(heap, (following, a))
            yield r

    def consider(self, upto: int) -> range:
        """Requests first looked at by this pass: from the last pass's end to `upto`."""
        first = self.considered
        self.considered = max(first, upto)
        return range(first, self.considered)


class Replay:
    """One workload, prepared once (hold times, next uses, the no-cache baseline), replayed
    against a fresh `SlotManager` per (policy, size)."""

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
                             f"{admission!r}")
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
        self.max_concurrency = max_concurrency
        self.paging = not bool(hold.any())
        # Columns the loops index per request: arrays of 8-byte values, not lists of Python
        # objects (four of those took 250 MB at 2,000,000 requests), and as fast to index.
        self._hold = _column("d", hold)
        self._adapter = _column("q", workload.adapter)
        self._arrival = _column("d", workload.arrival)
        nxt = workload.next_use()
        self._next = _column("q", np.where(nxt < 0, NEVER, nxt))
        pinned_set = set(self.pinned)
        used = {workload.adapters[a] for a in np.unique(workload.adapter[workload.adapter >= 0])}
        self.unpinned = len(used - pinned_set)  # requested adapters that need a cache slot
        self.baseline = self._baseline(hold)

    @property
    def mode(self) -> str:
        return "paging" if self.paging else "concurrent"

    def _baseline(self, hold: np.ndarray) -> np.ndarray:
        """Start times with every adapter resident: arrival, or the first free seat."""
        arrival = self.workload.arrival
        if self.paging or self.max_concurrency is None:
            return arrival.copy()
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
        loop that drives the pool's own `SlotManager`, the reference the core is tested
        against."""
        self._check_size(max_loras)
        n = len(self._adapter)
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
        manager = SlotManager(max_loras, policy=policy)
        manager.load_pinned([AdapterSlot(name=n) for n in self.pinned])
        served = np.zeros(n, dtype=np.int64)
        loop = self._paging if self.paging else self._concurrent
        told = self._observer(manager, loads, observe) if observe is not None else None
        hits, delayed, misses, swaps, waits = loop(manager, loads, start, served, progress,
                                                   told)
        return self._result(policy, max_loras, loads, start, served,
                            [manager.ref_count(k) for k in range(max_loras)],
                            hits, delayed, misses, swaps, waits, detail)

    def _in_core(self, policy: str, max_loras: int, loads: Loads, start: np.ndarray) -> Counts:
        """The replay in the compiled core, its load totals written into `loads`."""
        from metrale_cli.sim import core

        names = {name: a for a, name in enumerate(self.workload.adapters)}
        adapters = len(names)
        # A pinned adapter no request names holds its slot all the same (-1).
        pinned = np.array([names.get(p, -1) for p in self.pinned], dtype=np.int64)
        read_s = (np.asarray(loads.read_s, dtype=np.float64) if self.host is not None
                  else np.zeros(adapters))
        adapter = np.frombuffer(self._adapter, dtype=np.int64)
        arrival = np.frombuffer(self._arrival, dtype=np.float64)
        nxt = np.frombuffer(self._next, dtype=np.int64)
        load_s = np.asarray(loads.load_s, dtype=np.float64)
        load_bytes = np.asarray(self.load_bytes, dtype=np.int64)
        host_slots = self.host.slots if self.host is not None else 0
        if self.paging:
            (hits, delayed, misses, swaps, loads.bytes_moved, loads.swap_s, loads.link_wait_s,
             loads.host_hits, loads.host_misses, loads.host_bytes_moved) = core.paging(
                adapter, arrival, nxt, core.POLICY_CODES[policy], max_loras, pinned, adapters,
                load_s, load_bytes, self.cost.links, host_slots, read_s, start)
            return hits, delayed, misses, swaps, []
        waits = np.empty(len(adapter))
        counts, seconds = core.concurrent(
            adapter, arrival, np.frombuffer(self._hold, dtype=np.float64), nxt,
            core.POLICY_CODES[policy], max_loras, pinned, adapters,
            self.max_concurrency or len(adapter) + 1, self.admission == "skip", load_s,
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
        n = len(self._adapter)
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
        ticks = None if progress is None else (lambda k: progress(k * len(sizes)))
        distance = stack_distances(adapter[counted], ticks)
        if progress is not None:
            progress((self.workload.requests - counted.size) * len(sizes))
        # Every load moves the same bytes (sweepable): the adapters' one load, which is less
        # than a slot when they share a rank below the pool's max rank.
        load = self.load_bytes[0] if self.load_bytes else self.cost.slot_bytes
        n, swap_s, links = self.workload.requests, self.cost.load_seconds(load), self.cost.links
        n_adapter = pinned_requests + counted.size
        rows = core.lru_sweep(
            np.ascontiguousarray(adapter[counted]), np.ascontiguousarray(arrival[counted]),
            distance, np.array([size - len(self.pinned) for size in sizes], dtype=np.int64),
            swap_s, links, len(self.workload.adapters), n, n_adapter)
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
                swap_s=misses * swap_s, link_wait_s=load_added - misses * swap_s,
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
                throughput_req_s=_throughput(n, float(arrival[0]) if n else 0.0,
                                             max(float(arrival[-1]) if n else 0.0, last)),
                pool_bytes=0,
            ))
        return results

    def _observer(self, manager: SlotManager, loads: Loads,
                  observe: Observer) -> Callable[[int], None]:
        """`observe` fed the state of `manager` and `loads` after request r."""
        names = self.workload.adapters

        def told(r: int) -> None:
            slots = tuple(s.name if manager.state(k) is SlotState.READY else None
                          for k, s in enumerate(manager.slots()))
            host = (tuple(names[a] for a in loads.resident) if self.host is not None
                    else ())
            observe(r, CacheState(slots, host))
        return told

    def _load(self, manager: SlotManager) -> tuple[int, bool]:
        """Pick a victim and begin loading into it: (slot, whether it evicted an adapter)."""
        victim = manager.select_victim_slot()
        evicts = manager.state(victim) is SlotState.READY
        manager.begin_load(victim)
        return victim, evicts

    def _paging(self, manager: SlotManager, loads: Loads, start: np.ndarray,
                served: np.ndarray, progress: Callable[[int], None] | None,
                observe: Callable[[int], None] | None) -> Counts:
        names, adapter, nxt = self.workload.adapters, self._adapter, self._next
        arrival = self._arrival
        use_next, tiered = manager.policy == "min", self.host is not None
        # A zero-length request takes and returns its count at once: a touch, one call.
        slot_of, touch, set_next_use = manager.slot_of, manager.touch_slot, manager.set_next_use
        hits = delayed = misses = swaps = 0
        ready: dict[int, float] = {}  # adapter -> when its latest load ends
        start[:] = self.workload.arrival
        for r, a in enumerate(adapter):
            served[r] += 1
            if progress is not None and r % PROGRESS_EVERY == PROGRESS_EVERY - 1:
                progress(PROGRESS_EVERY)
            if a < 0:
                if observe is not None:
                    observe(r)
                continue
            if tiered:
                loads.touch(a)
            slot = slot_of(names[a])
            if slot is None:
                slot, evicts = self._load(manager)
                manager.finish_load(slot, AdapterSlot(name=names[a]))
                misses += 1
                swaps += evicts
                start[r] = ready[a] = loads.load(a, arrival[r])
            elif ready.get(a, 0.0) > arrival[r]:  # its load is still under way: it waits
                delayed += 1
                start[r] = ready[a]
            else:
                hits += 1
            touch(slot)
            if use_next:
                set_next_use(slot, nxt[r])
            if observe is not None:
                observe(r)
        if progress is not None:
            progress(len(adapter) % PROGRESS_EVERY)
        return hits, delayed, misses, swaps, []

    def _concurrent(self, manager: SlotManager, loads: Loads, start: np.ndarray,
                    served: np.ndarray, progress: Callable[[int], None] | None,
                    observe: Callable[[int], None] | None) -> Counts:
        names, adapter, arrival = self.workload.adapters, self._adapter, self._arrival
        hold, nxt = self._hold, self._next
        use_next, tiered = manager.policy == "min", self.host is not None
        slot_of, acquire, release = manager.slot_of, manager.acquire_slot, manager.release_slot
        set_next_use, touch = manager.set_next_use, manager.touch_slot
        n = len(adapter)
        seats = self.max_concurrency or n + 1
        # Events: (time, kind, seq, x, y); kind 0 = a request ends (x = its slot or -1, y = the
        # request), kind 1 = a load ends (x = the slot, y = the adapter). At equal times, ends come
        # before arrivals so that what they free is there for the next admission.
        events: list[tuple[float, int, int, int, int]] = []
        seq = itertools.count()  # ties in time and kind keep the order things happened in
        loading: dict[int, list[int]] = {}  # adapter -> requests waiting for its load
        skip = self.admission == "skip"
        queue = WaitingQueue(n, adapter, indexed=skip)
        stalled_since: dict[int, float] = {}
        waits: list[float] = []
        running = hits = delayed = misses = swaps = 0
        i = 0

        def startable(a: int) -> bool:
            """A request for `a` can start now: the base model, or resident, or loading."""
            return a < 0 or a in loading or slot_of(names[a]) is not None

        def skip_ahead(head: int, now: float, running: int) -> int:
            """The head cannot be placed: later requests whose adapter is resident or loading
            (or that need none) start now, in order, while seats last, as vLLM's scheduler
            lets them; those that need a load wait behind the head, stalled from the first
            time they were passed over with a seat free. Returns `running`."""
            nonlocal hits, delayed
            went: list[int] = []
            for r in queue.startable_in_order(startable):
                a = adapter[r]
                went.append(r)
                running += 1
                if a < 0:
                    serve(r, -1, now)
                elif a in loading:
                    delayed += 1
                    loading[a].append(r)
                else:
                    hits += 1
                    serve(r, slot_of(names[a]), now)
                if running >= seats:
                    break
            # The requests this pass looked at for the first time: up to the one that took
            # the last seat, or every one that has arrived. Each is touched once in the host
            # tier (a use), and waits stalled if it is still waiting.
            upto = went[-1] + 1 if running >= seats else i
            left = set(went)
            for r in queue.consider(upto):
                a = adapter[r]
                if r == head or a < 0 or (queue.gone(r) and r not in left):
                    continue
                if tiered and r not in stalled_since:
                    loads.touch(a)
                if not queue.gone(r):
                    stalled_since.setdefault(r, now)
            return running

        def serve(r: int, slot: int, now: float) -> None:
            """Request `r` starts now on `slot` (-1: the base model, no slot)."""
            if slot >= 0:
                acquire(slot)
                if use_next:
                    set_next_use(slot, nxt[r])
            start[r] = now
            served[r] += 1
            heapq.heappush(events, (now + hold[r], 0, next(seq), slot, r))

        while i < n or events:
            if events and (i >= n or events[0][0] <= arrival[i]):
                now, kind, _, x, y = heapq.heappop(events)
                if kind == 0:
                    if x >= 0:
                        # The engine touches every adapter in the batch each step, so a slot
                        # was last used when its last sequence ended, not when it began.
                        touch(x)
                        release(x)
                    running -= 1
                    if observe is not None:
                        observe(y)
                else:
                    manager.finish_load(x, AdapterSlot(name=names[y]))
                    for r in loading.pop(y):
                        serve(r, x, now)
            else:
                now = arrival[i]
                queue.arrive(i, startable)
                i += 1
                if progress is not None and i % PROGRESS_EVERY == 0:
                    progress(PROGRESS_EVERY)
            while running < seats and (r := queue.head()) is not None:
                a = adapter[r]
                slot = -1
                if a >= 0:
                    if tiered and r not in stalled_since:  # one use, however long it waits
                        loads.touch(a)
                    slot = slot_of(names[a])
                    if slot is None:
                        if a in loading:  # its load is under way: no second load
                            delayed += 1
                            loading[a].append(r)
                            queue.leave(r)
                            running += 1
                            continue
                        try:
                            victim, evicts = self._load(manager)
                        except PoolFull:
                            if not events:
                                raise UsageError("the slot cache can never free a slot "
                                                 "(no request in flight)") from None
                            stalled_since.setdefault(r, now)
                            if skip:
                                running = skip_ahead(r, now, running)
                            break
                        misses += 1
                        swaps += evicts
                        if r in stalled_since:
                            waits.append(now - stalled_since.pop(r))
                        loading[a] = [r]
                        queue.leave(r)
                        queue.offer(a)  # its later requests can start: a delayed hit each
                        heapq.heappush(events, (loads.load(a, now), 1, next(seq), victim, a))
                        running += 1
                        continue
                    hits += 1
                serve(r, slot, now)
                queue.leave(r)
                running += 1
        if progress is not None:
            progress(n % PROGRESS_EVERY)
        return hits, delayed, misses, swaps, waits
