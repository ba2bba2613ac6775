"""The compiled replay core (sim/core.py) against the Python replay that drives the pool's own
`SlotManager` (`Replay.run(..., compiled=False)`), request by request: every figure of the
record and every request's start, on seeded random workloads in both modes (concurrent under
fcfs and skip admission, with and without a cap on requests in flight) across the policies, sizes,
pinned adapters, adapters' own load sizes, links, the host tier and arrivals dense enough for
loads to queue, hits to be delayed and requests to stall."""

from __future__ import annotations

import numpy as np
import pytest

from metrale_cli.sim.costs import HostTier, Link, SwapCost
from metrale_cli.sim.replay import Replay
from metrale_cli.sim.workload import Workload


def random_replay(seed: int, concurrent: bool = False) -> tuple[Replay, list[int]]:
    """A replay drawn from `seed` (paging, or with requests that hold their slot), and the
    sizes to run it at."""
    rng = np.random.default_rng(seed)
    adapters = int(rng.integers(1, 40))
    n = int(rng.integers(1, 3000))
    # Skewed draws (some adapters hot), a share of base-model requests (-1).
    weights = rng.pareto(1.0, adapters) + 1e-3
    adapter = rng.choice(adapters, n, p=weights / weights.sum()).astype(np.int64)
    adapter[rng.random(n) < rng.uniform(0, 0.3)] = -1
    # Inter-arrival times from far below a load's time to far above it; some ties.
    gaps = rng.exponential(10 ** rng.uniform(-5, -2), n)
    gaps[rng.random(n) < 0.1] = 0.0
    w = Workload(adapters=tuple(f"a{i}" for i in range(adapters)), adapter=adapter,
                 arrival=np.cumsum(gaps), input_tokens=np.zeros(n, dtype=np.int64),
                 output_tokens=np.zeros(n, dtype=np.int64), duration=np.zeros(n))
    used = [f"a{a}" for a in np.unique(adapter[adapter >= 0])]
    pinned = list(rng.choice(used, int(rng.integers(0, min(3, len(used)) + 1)),
                             replace=False)) if used else []
    if rng.random() < 0.2:
        pinned.append("never-requested")  # holds its slot all the same
    load_bytes = [int(b) for b in rng.integers(1, 4, adapters) * 1000]
    host = (HostTier(int(rng.integers(1, adapters + 2)), Link("disk", 2e6, 1e-4))
            if rng.random() < 0.5 else None)
    cost = SwapCost(3000, 1e6, float(rng.choice([0.0, 1e-5])), "test",
                    links=int(rng.integers(1, 4)))
    # Held from nothing to many loads' time; some requests hold it for nothing.
    hold = (rng.exponential(10 ** rng.uniform(-4, -1), n) * (rng.random(n) < 0.9)
            if concurrent else np.zeros(n))
    seats = int(rng.integers(1, 12)) if concurrent and rng.random() < 0.5 else None
    admission = "skip" if concurrent and rng.random() < 0.5 else "fcfs"
    replay = Replay(w, hold, cost, pinned, seats, load_bytes=load_bytes, host=host,
                    admission=admission)
    sizes = sorted({len(pinned) + int(k) for k in rng.integers(1, adapters + 3, 3)})
    return replay, sizes


@pytest.mark.parametrize("concurrent", [False, True])
@pytest.mark.parametrize("seed", range(40))
def test_the_core_is_the_python_replay_request_by_request(seed: int, concurrent: bool) -> None:
    replay, sizes = random_replay(seed, concurrent)
    assert replay.mode == ("concurrent" if concurrent else "paging")
    for policy in ("lru", "fifo", "min"):
        for size in sizes:
            core = replay.run(policy, size)
            python = replay.run(policy, size, compiled=False)
            assert core.record() == python.record(), (policy, size)
            np.testing.assert_array_equal(core.start, python.start)
            np.testing.assert_array_equal(core.served, python.served)


def test_the_core_counts_what_the_textbook_does() -> None:
    """Belady's anomaly under FIFO, and the three policies on a textbook string, in the core."""
    refs = [0, 1, 2, 3, 0, 1, 4, 0, 1, 2, 3, 4]
    n = len(refs)
    w = Workload(adapters=tuple(f"a{i}" for i in range(5)), adapter=np.array(refs),
                 arrival=np.arange(n, dtype=np.float64), input_tokens=np.zeros(n, np.int64),
                 output_tokens=np.zeros(n, np.int64), duration=np.zeros(n))
    replay = Replay(w, np.zeros(n), SwapCost(1000, 1e6, 0.0, "test"))
    assert [replay.run("fifo", k).misses for k in (3, 4)] == [9, 10]
    assert [replay.run(p, 3).misses for p in ("lru", "min")] == [10, 7]
