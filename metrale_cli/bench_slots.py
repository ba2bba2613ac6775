"""`metrale bench slots`: does the slot manager's cost per victim, and the simulator's cost per
request, stay flat from 64 to 4096 slots? Both sizes are timed in one run and reported as a ratio;
a full scan (what the pool did before: a list of every cache slot per call) is timed beside
them as the reference that does grow."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from metrale_cli.errors import UsageError
from metrale_cli.simulate import Replay, SwapCost
from metrale_cli.slots import AdapterSlot, SlotManager
from metrale_cli.workload import GeneratorSpec, generate

SIZES = (64, 4096)


def _full_manager(n: int) -> SlotManager:
    m = SlotManager(n)
    for k in range(n):
        m.begin_load(k)
        m.finish_load(k, AdapterSlot(name=f"a{k}"))
        m.touch_slot(k)
    return m


def _scan_victim(refs: list[int], last_used: list[int]) -> int:
    """The pool's former victim choice: build the idle list, take its least recently used."""
    idle = [(t, k) for k, (r, t) in enumerate(zip(refs, last_used, strict=True)) if r == 0]
    return min(idle)[1]


def victim_cycle_ns(n: int, cycles: int) -> tuple[float, float]:
    """Nanoseconds per miss cycle (select the victim, reload it, touch it) on a full pool of `n`
    LRU slots, and per full-scan victim choice on the same state. Validated first: the two
    agree on every victim of a warm-up run."""
    m = _full_manager(n)
    refs = [0] * n
    last_used = [m.last_used(k) for k in range(n)]
    for _ in range(min(cycles, 256)):
        want = _scan_victim(refs, last_used)
        got = m.select_victim_slot()
        if got != want:
            raise UsageError(f"bench slots: victim {got} but the scan says {want} at {n} slots")
        m.begin_load(got)
        m.finish_load(got, AdapterSlot(name=f"warm{got}-{m.lru_tick}"))
        m.touch_slot(got)
        last_used[got] = m.last_used(got)
    infos = [AdapterSlot(name=f"new{i}") for i in range(cycles)]  # every load a new adapter
    started = time.perf_counter()
    for info in infos:
        v = m.select_victim_slot()
        m.begin_load(v)
        m.finish_load(v, info)
        m.touch_slot(v)
    heap_ns = (time.perf_counter() - started) / cycles * 1e9
    scans = max(1, cycles // 16)
    started = time.perf_counter()
    for _ in range(scans):
        _scan_victim(refs, last_used)
    scan_ns = (time.perf_counter() - started) / scans * 1e9
    return heap_ns, scan_ns


def simulate_req_per_s(n: int, requests: int, paging: bool) -> float:
    """Requests per second replaying a `distinct` workload (every request a miss, so every
    request chooses a victim) against `n` slots with the lru policy, at 5 requests/s of
    8-512 tokens: about 26 in flight, so no stalls at either size."""
    lengths = (0, 0) if paging else (8, 512)
    workload = generate(GeneratorSpec("distinct", requests, rate=5.0, input_range=lengths,
                                      output_range=lengths))
    replay = Replay(workload, workload.hold_seconds(10_000.0, 50.0),
                    SwapCost(1 << 20, 25e9, 10e-6, "bench"))
    started = time.perf_counter()
    result = replay.run("lru", n)
    seconds = time.perf_counter() - started
    if result.misses != requests or int(result.served.sum()) != requests:
        raise UsageError(f"bench slots: a distinct workload of {requests} requests gave "
                         f"{result.misses} misses at {n} slots")
    return requests / seconds


def run(requests: int = 200_000, cycles: int = 100_000, repeats: int = 3) -> dict[str, Any]:
    """Best of `repeats` per size, sizes interleaved so that machine noise hits both."""
    if min(requests, cycles, repeats) <= 0:
        raise UsageError("--requests, --cycles and --repeats must be positive")
    heap: dict[int, list[float]] = {n: [] for n in SIZES}
    scan: dict[int, list[float]] = {n: [] for n in SIZES}
    sims: dict[tuple[int, bool], list[float]] = {(n, p): [] for n in SIZES for p in (True, False)}
    for _ in range(repeats):
        for n in SIZES:
            h, s = victim_cycle_ns(n, cycles)
            heap[n].append(h)
            scan[n].append(s)
            for paging in (True, False):
                sims[(n, paging)].append(simulate_req_per_s(n, requests, paging))
    lo, hi = SIZES
    best_heap = {n: min(v) for n, v in heap.items()}
    best_scan = {n: min(v) for n, v in scan.items()}
    out: dict[str, Any] = {
        "setup": {"sizes": list(SIZES), "requests": requests, "cycles": cycles,
                  "repeats": repeats, "workload": "distinct (every request a miss)",
                  "policy": "lru"},
        "victim_cycle_ns": {str(n): best_heap[n] for n in SIZES},
        "victim_cycle_ratio": best_heap[hi] / best_heap[lo],
        "scan_ns": {str(n): best_scan[n] for n in SIZES},
        "scan_ratio": best_scan[hi] / best_scan[lo],
    }
    for paging, mode in ((True, "paging"), (False, "concurrent")):
        best = {n: float(np.max(sims[(n, paging)])) for n in SIZES}
        out[f"simulate_{mode}_req_per_s"] = {str(n): best[n] for n in SIZES}
        # Cost per request at 4096 slots over cost at 64: 1.0 = flat.
        out[f"simulate_{mode}_cost_ratio"] = best[lo] / best[hi]
    return out
