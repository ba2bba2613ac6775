"""`metrale bench slots`: does the slot manager's cost per victim, and the simulator's cost per
request, stay flat from 64 to 4096 slots? Both sizes are timed in one run and reported as a ratio;
a full scan (what the pool did before: a list of every cache slot per call) is timed beside
them as the reference that does grow. Skip admission is timed against first come, first served
at 10,000 and 100,000 requests (it must grow as fcfs does, not with the queue squared). Where
libCacheSim is installed (the `libcachesim` extra), a zipf trace replayed by metrale (read from
its file, 5 sizes) and by libCacheSim in one run: the times as ratios, the misses compared.
`at_scale` does the same at a real trace's size (10 million requests, 3 policies, 8 sizes), each
side in a process of its own so that its peak memory is its own."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from metrale_cli.errors import UsageError
from metrale_cli.pool.slots import AdapterSlot, SlotManager
from metrale_cli.sim.costs import SwapCost
from metrale_cli.sim.replay import Replay
from metrale_cli.sim.simulate import simulate
from metrale_cli.sim.workload import MAX_REQUESTS, GeneratorSpec, generate, read_trace

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


def _validated_manager(n: int) -> tuple[SlotManager, list[int], list[int]]:
    """A full pool of `n` LRU slots after a warm-up in which every victim equals the one a full
    scan picks; with the scan's view of its state (ref counts, last-used ticks)."""
    m = _full_manager(n)
    refs = [0] * n
    last_used = [m.last_used(k) for k in range(n)]
    for i in range(256):
        want = _scan_victim(refs, last_used)
        got = m.select_victim_slot()
        if got != want:
            raise UsageError(f"bench slots: victim {got} but the scan says {want} at {n} slots")
        m.begin_load(got)
        m.finish_load(got, AdapterSlot(name=f"warm{i}"))
        m.touch_slot(got)
        last_used[got] = m.last_used(got)
    return m, refs, last_used


def victim_cycle_ns(cycles: int, chunk: int = 2000) -> tuple[dict[int, float], dict[int, float]]:
    """Per size, nanoseconds per miss cycle (select the victim, load a new adapter into it,
    touch it) on a full pool with the lru policy, and per full-scan victim choice on the same
    state. The sizes alternate in chunks of `chunk` cycles and each keeps its best chunk, so
    that a noisy neighbour slows both rather than one."""
    chunk = min(chunk, cycles)
    pools = {n: _validated_manager(n) for n in SIZES}
    infos = {n: iter([AdapterSlot(name=f"new{i}") for i in range(cycles)]) for n in SIZES}
    heap = {n: float("inf") for n in SIZES}
    scan = {n: float("inf") for n in SIZES}
    for _ in range(cycles // chunk):
        for n in SIZES:
            m, refs, last_used = pools[n]
            batch = [next(infos[n]) for _ in range(chunk)]
            started = time.perf_counter()
            for info in batch:
                v = m.select_victim_slot()
                m.begin_load(v)
                m.finish_load(v, info)
                m.touch_slot(v)
            heap[n] = min(heap[n], (time.perf_counter() - started) / chunk * 1e9)
            started = time.perf_counter()
            for _ in range(16):
                _scan_victim(refs, last_used)
            scan[n] = min(scan[n], (time.perf_counter() - started) / 16 * 1e9)
    return heap, scan


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


SWEEP_SIZES = 1_000  # the most a --max-loras sweep takes (cli.parsing.MAX_SIZES)
SWEEP_ADAPTERS = 100_000
# Requests per second of the sweep's two setups: links idle, and overloaded at the small sizes
# (a 52 us load per miss: at 20,000 requests/s a miss ratio above 0.96 keeps the link busy).
SWEEP_RATES = {"lru_sweep": 10.0, "lru_sweep_overloaded": 20_000.0}


def lru_sweep_seconds(requests: int, rate: float) -> tuple[float, float]:
    """(one paging LRU replay, the one-pass sweep over SWEEP_SIZES sizes) in seconds, on
    `requests` zipf(0.8) requests over SWEEP_ADAPTERS adapters at `rate` requests/s; the
    sweep's misses and delayed hits at one size are checked against the replay's."""
    workload = generate(GeneratorSpec("zipf", requests, adapters=SWEEP_ADAPTERS, zipf_s=0.8,
                                      rate=rate, input_range=(0, 0), output_range=(0, 0)))
    replay = Replay(workload, np.zeros(requests), SwapCost(1 << 20, 25e9, 10e-6, "bench"))
    step = SWEEP_ADAPTERS // SWEEP_SIZES
    sizes = list(range(step, SWEEP_ADAPTERS + 1, step))
    started = time.perf_counter()
    swept = replay.lru_sweep(sizes)
    sweep_s = time.perf_counter() - started
    started = time.perf_counter()
    one = replay.run("lru", sizes[9], detail=False)
    replay_s = time.perf_counter() - started
    if (one.hits, one.delayed_hits, one.misses) != (swept[9].hits, swept[9].delayed_hits,
                                                     swept[9].misses):
        raise UsageError(f"bench slots: the LRU sweep gave {swept[9].misses} misses and "
                         f"{swept[9].delayed_hits} delayed hits at {sizes[9]} slots, the "
                         f"replay {one.misses} and {one.delayed_hits}")
    return replay_s, sweep_s


# Skip admission against first come, first served at these many requests, on the setup where
# skip was found quadratic in the queue (zipf 1.1 over 200 adapters at 50 requests/s, 8-512
# tokens each way, 4 slots): its pass over the whole queue at every event took 75.6 s at 10,000.
ADMISSION_REQUESTS = (10_000, 100_000)


def admission_seconds(requests: int) -> dict[str, float]:
    """Seconds of one lru replay under each admission on the item-5 workload at `requests`."""
    workload = generate(GeneratorSpec("zipf", requests, adapters=200, rate=50.0, zipf_s=1.1))
    hold = workload.hold_seconds(10_000.0, 50.0)
    out = {}
    for admission in ("fcfs", "skip"):
        replay = Replay(workload, hold, SwapCost(1 << 20, 25e9, 10e-6, "bench"),
                        admission=admission)
        started = time.perf_counter()
        result = replay.run("lru", 4, detail=False)
        out[f"{admission}_s"] = time.perf_counter() - started
        if result.hits + result.delayed_hits + result.misses != result.adapter_requests:
            raise UsageError(f"bench slots: {admission} admission lost requests")
    return out


# The comparison with libCacheSim: a zipf(1.0) trace over this many adapters at these sizes.
LIBCACHESIM_ADAPTERS = 1_000
LIBCACHESIM_SIZES = (10, 50, 100, 200, 500)


def against_libcachesim(requests: int) -> dict[str, Any] | None:
    """metrale and libCacheSim (C) on one zipf trace of `requests` requests written as CSV, each
    policy at LIBCACHESIM_SIZES: metrale's seconds (reading the file, then `simulate` as the
    CLI runs it: LRU swept in one pass, FIFO replayed per size, in paging mode), libCacheSim's
    (its CSV reader and cache per size), and for concurrent mode (requests hold their slot,
    which libCacheSim has no mode for) metrale's LRU against libCacheSim's paging LRU. The
    misses must be libCacheSim's at every size (its miss ratio times the requests; a delayed
    hit is a hit to it), or UsageError. None where libCacheSim is not installed."""
    try:
        import libcachesim as lcs
    except ImportError:
        return None
    spec = GeneratorSpec("zipf", requests, adapters=LIBCACHESIM_ADAPTERS, zipf_s=1.0,
                         input_range=(0, 0), output_range=(0, 0))
    cost = SwapCost(1 << 20, 25e9, 10e-6, "bench")
    sizes = list(LIBCACHESIM_SIZES)
    params = lcs.ReaderInitParam(has_header=True, has_header_set=True, delimiter=",",
                                 obj_id_is_num=False, obj_id_is_num_set=True,
                                 ignore_obj_size=True)
    params.time_field, params.obj_id_field = 1, 2  # timestamp, adapter (1-based columns)
    out: dict[str, Any] = {"requests": requests, "adapters": LIBCACHESIM_ADAPTERS,
                           "sizes": sizes}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "zipf.csv"
        generate(spec).save(path, force=False)

        def theirs(cache: Any) -> tuple[float, list[int]]:
            started = time.perf_counter()
            ratios = [cache(cache_size=n).process_trace(
                lcs.TraceReader(str(path), lcs.TraceType.CSV_TRACE, params))[0] for n in sizes]
            return time.perf_counter() - started, [round(r * requests) for r in ratios]

        for policy, cache in (("fifo", lcs.FIFO), ("lru", lcs.LRU)):
            started = time.perf_counter()
            workload = read_trace(path)
            results = simulate(Replay(workload, np.zeros(workload.requests), cost), [policy],
                               sizes, lambda n: 0)
            ours_s = time.perf_counter() - started
            their_s, their_misses = theirs(cache)
            misses = [r.misses for r in results]
            if misses != their_misses:
                raise UsageError(f"bench slots: {policy} misses {misses} at sizes {sizes}, "
                                 f"libCacheSim's {their_misses}")
            out[policy] = {"metrale_s": ours_s, "libcachesim_s": their_s,
                           "ratio": ours_s / their_s, "misses": misses,
                           "hit_rate": [1 - m / requests for m in misses]}
        workload = generate(GeneratorSpec("zipf", requests, adapters=LIBCACHESIM_ADAPTERS,
                                          zipf_s=1.0))
        started = time.perf_counter()
        simulate(Replay(workload, workload.hold_seconds(10_000.0, 50.0), cost), ["lru"], sizes,
                 lambda n: 0)
        ours_s = time.perf_counter() - started
        out["concurrent_lru"] = {"metrale_s": ours_s, "libcachesim_paging_lru_s":
                                 out["lru"]["libcachesim_s"],
                                 "ratio": ours_s / out["lru"]["libcachesim_s"]}
    return out


# A real trace's size: `at_scale` replays one zipf(1.0) trace over SCALE_ADAPTERS adapters under
# every policy at SCALE_SIZES.
SCALE_ADAPTERS = 1_000
SCALE_SIZES = (10, 25, 50, 100, 200, 300, 500, 750)
SCALE_POLICIES = ("lru", "fifo", "min")


def _rss_bytes(field: str) -> int:
    """This process's `VmRSS` or `VmHWM` (its peak) from /proc/self/status, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # the kernel writes kB
    raise UsageError(f"bench slots --scale: no {field} in /proc/self/status (Linux only)")


def scale_side(side: str, path: str, requests: str) -> None:
    """One side of `at_scale`, run as a child process: replay the CSV trace at `path` under
    every SCALE_POLICIES at SCALE_SIZES and print one JSON line: seconds per policy, and in all
    (`total_s`: metrale reads the file once, libCacheSim once per policy and size), misses per
    size, this process's resident bytes once its modules are imported and its peak
    (`ru_maxrss`) at the end."""
    n, sizes = int(requests), list(SCALE_SIZES)
    out: dict[str, Any] = {"seconds": {}, "misses": {}}
    if side == "metrale":
        from metrale_cli.sim import core  # noqa: F401  (the compiled core's modules: numba)

        out["rss_after_imports"] = _rss_bytes("VmRSS")
        started = time.perf_counter()
        workload = read_trace(Path(path))
        replay = Replay(workload, np.zeros(workload.requests),
                        SwapCost(1 << 20, 25e9, 10e-6, "bench"))
        out["read_s"] = time.perf_counter() - started
        for policy in SCALE_POLICIES:
            begun = time.perf_counter()
            results = simulate(replay, [policy], sizes, lambda size: 0)
            out["seconds"][policy] = time.perf_counter() - begun
            out["misses"][policy] = [r.misses for r in results]
    else:
        import libcachesim as lcs

        out["rss_after_imports"] = _rss_bytes("VmRSS")
        params = lcs.ReaderInitParam(has_header=True, has_header_set=True, delimiter=",",
                                     obj_id_is_num=False, obj_id_is_num_set=True,
                                     ignore_obj_size=True)
        params.time_field, params.obj_id_field = 1, 2  # timestamp, adapter (1-based columns)
        caches = {"lru": lcs.LRU, "fifo": lcs.FIFO, "min": lcs.Belady}
        for policy in SCALE_POLICIES:
            begun = time.perf_counter()
            trace, kind, given = path, lcs.TraceType.CSV_TRACE, params
            if policy == "min":
                # Belady needs each request's next use, which only its oracle format carries:
                # the conversion (a pass over the CSV) is part of its time.
                trace = str(Path(path).with_suffix(".oracle"))
                lcs.Util.convert_to_oracleGeneral(
                    lcs.TraceReader(path, lcs.TraceType.CSV_TRACE, params)._reader, trace)
                kind, given = lcs.TraceType.ORACLE_GENERAL_TRACE, lcs.ReaderInitParam(
                    ignore_obj_size=True)
            ratios = [caches[policy](cache_size=size).process_trace(
                lcs.TraceReader(trace, kind, given))[0] for size in sizes]
            out["seconds"][policy] = time.perf_counter() - begun
            out["misses"][policy] = [round(r * n) for r in ratios]
    out["total_s"] = out.get("read_s", 0.0) + sum(out["seconds"].values())
    # Linux gives ru_maxrss in KiB.
    out["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps(out))


def _scale_child(side: str, path: Path, requests: int) -> dict[str, Any]:
    command = [sys.executable, "-c", "import sys; from metrale_cli.bench.slots import "
               "scale_side; scale_side(*sys.argv[1:])", side, str(path), str(requests)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise UsageError(f"bench slots --scale: the {side} process failed "
                         f"(exit {done.returncode}): {tail}")
    record: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return record


def at_scale(requests: int) -> dict[str, Any]:
    """A zipf trace of `requests` requests (10 million is the most a trace may hold), written
    as CSV, replayed under every SCALE_POLICIES at SCALE_SIZES by metrale (`simulate` as the
    CLI runs it: LRU swept in one pass, FIFO and min replayed per size, paging mode) and by
    libCacheSim where it is installed, each in a fresh process: seconds per policy (the file
    read included), misses per size (libCacheSim's must equal metrale's, or UsageError), and
    each process's peak resident memory (`ru_maxrss`) beside its resident memory once its
    modules are imported."""
    spec = GeneratorSpec("zipf", requests, adapters=SCALE_ADAPTERS, zipf_s=1.0,
                         input_range=(0, 0), output_range=(0, 0))
    if not 0 < requests <= MAX_REQUESTS:
        raise UsageError(f"--scale must be 1 to {MAX_REQUESTS:,} requests (the most a trace "
                         f"may hold), got {requests:,}")
    try:
        import libcachesim  # noqa: F401
        sides = ("metrale", "libcachesim")
    except ImportError:
        sides = ("metrale",)
    out: dict[str, Any] = {"requests": requests, "adapters": SCALE_ADAPTERS,
                           "sizes": list(SCALE_SIZES), "policies": list(SCALE_POLICIES),
                           "memory": "peak_rss: ru_maxrss of each side's own process; "
                                     "rss_after_imports: its VmRSS before the trace is read"}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "zipf.csv"
        generate(spec).save(path, force=False)
        out["trace_bytes"] = path.stat().st_size
        for side in sides:
            out[side] = _scale_child(side, path, requests)
    if "libcachesim" in out:
        ours, theirs = out["metrale"], out["libcachesim"]
        for policy in SCALE_POLICIES:
            if ours["misses"][policy] != theirs["misses"][policy]:
                raise UsageError(f"bench slots --scale: {policy} misses "
                                 f"{ours['misses'][policy]}, libCacheSim's "
                                 f"{theirs['misses'][policy]}")
        out["ratio"] = ours["total_s"] / theirs["total_s"]
    return out


def run(requests: int = 200_000, cycles: int = 100_000, repeats: int = 3) -> dict[str, Any]:
    """Victim cycles in alternating chunks, then `repeats` simulator runs per size and mode,
    sizes interleaved, best of each: machine noise slows both sizes, not one."""
    if min(requests, cycles, repeats) <= 0:
        raise UsageError("--requests, --cycles and --repeats must be positive")
    best_heap, best_scan = victim_cycle_ns(cycles)
    sims: dict[tuple[int, bool], list[float]] = {(n, p): [] for n in SIZES for p in (True, False)}
    for _ in range(repeats):
        for n in SIZES:
            for paging in (True, False):
                sims[(n, paging)].append(simulate_req_per_s(n, requests, paging))
    lo, hi = SIZES
    out: dict[str, Any] = {
        "setup": {"sizes": list(SIZES), "requests": requests, "cycles": cycles,
                  "repeats": repeats, "workload": "distinct (every request a miss)",
                  "policy": "lru"},
        "victim_cycle_ns": {str(n): best_heap[n] for n in SIZES},
        "victim_cycle_ratio": best_heap[hi] / best_heap[lo],
        "scan_ns": {str(n): best_scan[n] for n in SIZES},
        "scan_ratio": best_scan[hi] / best_scan[lo],
    }
    for name, rate in SWEEP_RATES.items():
        replay_s, sweep_s = min((lru_sweep_seconds(requests, rate) for _ in range(repeats)),
                                key=lambda t: t[1])
        out[name] = {"sizes": SWEEP_SIZES, "adapters": SWEEP_ADAPTERS, "rate": rate,
                     "replay_s": replay_s, "sweep_s": sweep_s,
                     # A sweep replayed size by size over the time of one pass: the speed-up.
                     "speedup": SWEEP_SIZES * replay_s / sweep_s,
                     "over_one_replay": sweep_s / replay_s}
    out["libcachesim"] = against_libcachesim(requests)
    out["admission"] = {}
    for n in ADMISSION_REQUESTS:
        times = admission_seconds(n)
        out["admission"][str(n)] = {**times, "skip_over_fcfs": times["skip_s"] / times["fcfs_s"]}
    for paging, mode in ((True, "paging"), (False, "concurrent")):
        best = {n: float(np.max(sims[(n, paging)])) for n in SIZES}
        out[f"simulate_{mode}_req_per_s"] = {str(n): best[n] for n in SIZES}
        # Cost per request at 4096 slots over cost at 64: 1.0 = flat.
        out[f"simulate_{mode}_cost_ratio"] = best[lo] / best[hi]
    return out
