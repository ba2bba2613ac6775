"""The one-pass LRU sweep (Mattson's stack distances) against replays of the slot manager at each
size, on random paging traces, and the distances against their definition."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from metrale_cli.sim.costs import SwapCost
from metrale_cli.sim.replay import Replay
from metrale_cli.sim.stack_distance import COLD, stack_distances
from metrale_cli.sim.workload import Workload

COST = SwapCost(slot_bytes=1000, bytes_per_s=1e6, latency_s=0.0, bandwidth="test")  # 1 ms


def paging(refs: list[int], arrival: list[float]) -> Workload:
    n = len(refs)
    return Workload(
        adapters=tuple(f"a{i}" for i in range(max(refs, default=-1) + 1)),
        adapter=np.array(refs, dtype=np.int64), arrival=np.array(arrival, dtype=np.float64),
        input_tokens=np.zeros(n, dtype=np.int64), output_tokens=np.zeros(n, dtype=np.int64),
        duration=np.zeros(n))


def distance_by_definition(refs: list[int]) -> list[int]:
    out = []
    for j, a in enumerate(refs):
        before = [k for k in range(j) if refs[k] == a]
        out.append(COLD if not before else len(set(refs[before[-1] + 1:j])))
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 9), max_size=80))
def test_distances_are_the_distinct_adapters_between_uses(refs: list[int]) -> None:
    got = stack_distances(np.array(refs, dtype=np.int64))
    assert got.tolist() == distance_by_definition(refs)


@pytest.mark.sweep
@settings(max_examples=300, deadline=None)
# A request that arrives as its adapter's load ends (4 + 0.0005 s, the load ending at 4.00025 +
# 0.00025 s): the sweep's closed-form load ends rounded below the replay's, a hit against a
# delayed hit.
@example(data=[(0, 0.0), (1, 0.0), (0, 0.0), (1, 0.0), (0, 2.0), (0, 2.0), (1, 0.0), (0, 0.0),
               (0, 0.0005)], pin_count=0, links=1, load=250)
@given(
    data=st.lists(st.tuples(st.integers(-1, 12), st.sampled_from([0.0, 0.0, 0.0005, 0.3, 2.0])),
                  min_size=1, max_size=120),
    pin_count=st.integers(0, 2), links=st.integers(1, 3),
    load=st.sampled_from([None, 1000, 250, 1]),
)
def test_the_sweep_is_a_replay_at_every_size(data: list[tuple[int, float]], pin_count: int,
                                             links: int, load: int | None) -> None:
    """Every setup the sweep takes: whole-slot loads, and one rank every adapter shares, at or
    below the pool's max rank (250: rank 16 of 64, which the sweep once charged
    a whole slot)."""
    refs = [r for r, _ in data]
    w = paging(refs, np.cumsum([g for _, g in data]).tolist())
    used = sorted({r for r in refs if r >= 0})
    pinned = [f"a{i}" for i in used[:pin_count]]
    cost = dataclasses.replace(COST, links=links)
    rp = Replay(w, np.zeros(len(refs)), cost, pinned,
                load_bytes=None if load is None else [load] * len(w.adapters))
    assert rp.sweepable
    sizes = [k for k in range(1, 16) if k > len(pinned) or (k == len(pinned) and not rp.unpinned)]
    swept = rp.lru_sweep(sizes)
    for size, s in zip(sizes, swept, strict=True):
        r = rp.run("lru", size, detail=False)
        exact = {f: getattr(r, f) for f in ("max_loras", "pinned", "requests", "adapter_requests",
                                             "hits", "delayed_hits", "misses", "swaps",
                                             "bytes_moved", "stalls")}
        assert {f: getattr(s, f) for f in exact} == exact, size
        for f in ("swap_s", "link_wait_s", "added_latency_p50_s", "added_latency_p99_s",
                  "added_latency_mean_s", "stall_p99_s", "ttft_adapter_p50_s",
                  "ttft_adapter_p99_s", "ttft_base_p50_s", "ttft_base_p99_s",
                  "throughput_req_s"):
            want = getattr(r, f)
            assert getattr(s, f) == (None if want is None else
                                     pytest.approx(want, rel=1e-9, abs=1e-12)), (f, size)


def test_the_sweeps_link_wait_is_never_below_zero() -> None:
    """20,000 requests over 50 adapters at 10 a second: at 49 and 50 slots no load waits, and
    the sweep's running sum less the loads' own time came out at -8.4e-12 and -4e-16 s, where
    the replay says 0."""
    rng = np.random.default_rng(0)
    n = 20_000
    refs = rng.integers(0, 50, n).tolist()
    rp = Replay(paging(refs, np.cumsum(rng.exponential(0.1, n)).tolist()), np.zeros(n), COST)
    swept = rp.lru_sweep(list(range(1, 51)))
    assert all(s.link_wait_s >= 0 for s in swept)
    for s in swept[-2:]:
        assert s.link_wait_s == pytest.approx(rp.run("lru", s.max_loras, detail=False)
                                              .link_wait_s, rel=1e-9, abs=1e-12)


def test_a_paging_lru_sweep_takes_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """simulate() sweeps LRU in paging mode without replaying it per size; other policies and
    concurrent mode still replay."""
    from metrale_cli.sim import simulate as sim

    w = paging([0, 1, 2, 0, 3, 1, 0], [0.0, 1, 2, 3, 4, 5, 6])
    rp = Replay(w, np.zeros(7), COST)
    replayed: list[tuple[str, int]] = []
    real = Replay.run

    def spy(self: Replay, policy: str, size: int, *args: object, **kw: object) -> object:
        replayed.append((policy, size))
        return real(self, policy, size, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(Replay, "run", spy)
    results = sim.simulate(rp, ["lru", "fifo"], [1, 2, 3, 4], lambda n: n)
    assert replayed == [("fifo", k) for k in (1, 2, 3, 4)]
    assert [r.misses for r in results if r.policy == "lru"] == [7, 7, 5, 4]
    # Sizes in any order: the core sweeps them ascending, each result where its size was asked.
    assert [(r.max_loras, r.misses) for r in rp.lru_sweep([3, 1, 4, 2])] == [
        (3, 5), (1, 7), (4, 4), (2, 7)]


def test_a_shared_rank_below_the_max_moves_its_share_in_the_sweep() -> None:
    """50 distinct rank-16 adapters in a max-rank-64 pool, 50 misses each
    way: lru (swept) and fifo (replayed) move the same bytes, a quarter of a slot each."""
    from tests.support.cli_runner import metrale

    r = metrale("simulate", "--workload", "distinct", "--requests", "50", "--ranks", "16",
                "--model", "llama-3.1-8b", "--modules", "q_proj", "--max-rank", "64",
                "--input-tokens", "0", "--output-tokens", "0", "--max-loras", "4",
                "--policy", "lru,fifo", "--json")
    assert r.code == 0, r.stderr
    rec = r.json()
    lru, fifo = rec["results"]
    quarter = rec["layout"]["slot_bytes"] // 4
    assert lru["misses"] == fifo["misses"] == 50
    assert lru["bytes_moved"] == fifo["bytes_moved"] == 50 * quarter
    for f in ("swap_s", "link_wait_s", "added_latency_p99_s", "throughput_req_s"):
        assert lru[f] == pytest.approx(fifo[f], rel=1e-9), f


@pytest.mark.parametrize(("seed", "links", "pin_count", "load"),
                         [(0, 1, 0, None), (1, 2, 1, 250), (2, 3, 0, None), (3, 1, 2, 1000)])
def test_the_sweep_is_a_replay_on_overloaded_links(seed: int, links: int, pin_count: int,
                                                   load: int | None) -> None:
    """Traces long enough that the sweep's percentile windows are set, outrun and set again:
    3,000 zipf-like requests over 400 adapters, asked for faster than the links load them at
    the small sizes (bursts of requests together, then lulls), with base requests among them;
    60 sizes, each against a replay at that size."""
    rng = np.random.default_rng(seed)
    n = 3000
    refs = np.minimum(rng.zipf(1.3, n) - 1, 399)
    refs[rng.random(n) < 0.05] = -1  # base requests: no adapter
    gaps = np.where(rng.random(n) < 0.7, 0.0, rng.exponential(0.004 / links, n))  # 1 ms loads
    w = paging(refs.tolist(), np.cumsum(gaps).tolist())
    used = sorted({int(r) for r in refs if r >= 0})
    pinned = [f"a{i}" for i in used[:pin_count]]
    cost = dataclasses.replace(COST, links=links)
    rp = Replay(w, np.zeros(n), cost, pinned,
                load_bytes=None if load is None else [load] * len(w.adapters))
    sizes = sorted(rng.choice(np.arange(pin_count + 1, 420), 60, replace=False).tolist())
    swept = rp.lru_sweep(sizes)
    waited = 0
    for size, s in zip(sizes, swept, strict=True):
        r = rp.run("lru", size, detail=False)
        assert (s.hits, s.delayed_hits, s.misses, s.swaps) == (
            r.hits, r.delayed_hits, r.misses, r.swaps), size
        for f in ("link_wait_s", "added_latency_p50_s", "added_latency_p99_s",
                  "added_latency_mean_s", "ttft_adapter_p50_s", "ttft_adapter_p99_s",
                  "throughput_req_s"):
            assert getattr(s, f) == pytest.approx(getattr(r, f), rel=1e-9, abs=1e-12), (f, size)
        waited += r.link_wait_s > 0
    # Loads queued at every size, half a load time each on average at the smallest.
    assert swept[0].delayed_hits and swept[0].link_wait_s > swept[0].swap_s / 2
    assert waited == len(sizes)


@pytest.mark.parametrize(("seed", "links", "pin_count"), [(0, 1, 0), (1, 2, 1), (2, 1, 0)])
def test_the_sweep_reads_queued_medians_as_a_replay_does(seed: int, links: int,
                                                         pin_count: int) -> None:
    """Where the median itself is a load's wait for the link (more than half the requests
    queued), its window is read at many sizes in a row while the waits fall under it: 4,000
    requests, half spread over 400 adapters, asked for 2.5 times as fast as the links load
    them; 50 sizes, the p50 and p99 at each against a replay at that size."""
    rng = np.random.default_rng(seed)
    n = 4000
    refs = np.where(rng.random(n) < 0.5, np.minimum(rng.zipf(1.5, n) - 1, 399),
                    rng.integers(0, 400, n))
    refs[rng.random(n) < 0.03] = -1  # base requests: no adapter
    w = paging(refs.tolist(), np.cumsum(rng.exponential(0.0004 / links, n)).tolist())
    pinned = [f"a{i}" for i in sorted({int(r) for r in refs if r >= 0})[:pin_count]]
    rp = Replay(w, np.zeros(n), dataclasses.replace(COST, links=links), pinned)
    sizes = sorted(rng.choice(np.arange(pin_count + 1, 300), 50, replace=False).tolist())
    swept = rp.lru_sweep(sizes)
    queued = {"added_latency_p50_s": 0, "added_latency_p99_s": 0}
    for size, s in zip(sizes, swept, strict=True):
        r = rp.run("lru", size, detail=False)
        assert (s.hits, s.delayed_hits, s.misses) == (r.hits, r.delayed_hits, r.misses), size
        for f in ("link_wait_s", "added_latency_p50_s", "added_latency_p99_s",
                  "ttft_adapter_p50_s", "ttft_adapter_p99_s"):
            assert getattr(s, f) == pytest.approx(getattr(r, f), rel=1e-9, abs=1e-12), (f, size)
        for f in queued:
            queued[f] += getattr(r, f) > r.swap_s / r.misses  # above one load time: queued
    assert queued["added_latency_p50_s"] >= 15 and queued["added_latency_p99_s"] == len(sizes)
