"""`metrale simulate`: the replay against the slot manager (exact miss counts, properties, waiting
instead of evicting), the workload generators (S-LoRA's draw for draw), traces, and the CLI."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import time
from collections import OrderedDict, deque
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale_cli.cli import render
from metrale_cli.cli.parsing import parse_bandwidth, parse_size_list
from metrale_cli.errors import FormatError, OutputExists, UsageError
from metrale_cli.sim.costs import Link, SwapCost
from metrale_cli.sim.replay import Replay
from metrale_cli.sim.workload import GeneratorSpec, Workload, generate, read_trace
from tests.support.cli_runner import metrale
from tests.support.hostile_inputs import one_line_error

SLOT = ["--model", "qwen3-next-80b-a3b", "--modules", "q_proj,v_proj", "--max-rank", "16"]
COST = SwapCost(slot_bytes=1000, bytes_per_s=1e6, latency_s=0.0, bandwidth="test")  # 1 ms


def workload(refs: list[int], arrival: list[float] | None = None,
             hold: list[float] | None = None) -> Workload:
    """Requests for adapters `refs` (-1 = base model), holding their slot for `hold` seconds."""
    n = len(refs)
    names = max(refs, default=-1) + 1
    return Workload(
        adapters=tuple(f"a{i}" for i in range(names)), adapter=np.array(refs, dtype=np.int64),
        arrival=np.array(arrival if arrival is not None else range(n), dtype=np.float64),
        input_tokens=np.zeros(n, dtype=np.int64), output_tokens=np.zeros(n, dtype=np.int64),
        duration=np.array(hold if hold is not None else [0.0] * n, dtype=np.float64))


def replay(w: Workload, pinned: list[str] | None = None, seats: int | None = None) -> Replay:
    return Replay(w, w.hold_seconds(1.0, 1.0), COST, pinned or [], seats)


# -- independent textbook paging, for the exact counts ------------------------------------------


def lru_faults(refs: list[int], frames: int) -> int:
    resident: OrderedDict[int, None] = OrderedDict()
    faults = 0
    for r in refs:
        if r in resident:
            resident.move_to_end(r)
            continue
        faults += 1
        if len(resident) == frames:
            resident.popitem(last=False)
        resident[r] = None
    return faults


def fifo_faults(refs: list[int], frames: int) -> int:
    resident: deque[int] = deque()
    faults = 0
    for r in refs:
        if r in resident:
            continue
        faults += 1
        if len(resident) == frames:
            resident.popleft()
        resident.append(r)
    return faults


def opt_faults(refs: list[int], frames: int) -> int:
    resident: set[int] = set()
    faults = 0
    for i, r in enumerate(refs):
        if r in resident:
            continue
        faults += 1
        if len(resident) == frames:
            future = refs[i + 1:]
            resident.remove(max(resident, key=lambda p: future.index(p) if p in future
                                else len(refs)))
        resident.add(r)
    return faults


# The textbook reference string (Silberschatz, Operating System Concepts): with 3 frames FIFO
# takes 15 faults, LRU 12, OPT 9.
BOOK = [7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1]
# Belady's anomaly: FIFO takes 9 faults with 3 frames and 10 with 4.
ANOMALY = [1, 2, 3, 4, 1, 2, 5, 1, 2, 3, 4, 5]


def test_exact_miss_counts_on_hand_made_traces() -> None:
    assert (fifo_faults(BOOK, 3), lru_faults(BOOK, 3), opt_faults(BOOK, 3)) == (15, 12, 9)
    assert (fifo_faults(ANOMALY, 3), fifo_faults(ANOMALY, 4)) == (9, 10)
    rp = replay(workload(BOOK))
    assert rp.mode == "paging"
    assert [rp.run(p, 3).misses for p in ("fifo", "lru", "min")] == [15, 12, 9]
    rp = replay(workload(ANOMALY))
    assert [rp.run("fifo", k).misses for k in (3, 4)] == [9, 10]
    for refs in (BOOK, ANOMALY, [0, 1, 0, 2, 0, 3, 0, 1, 2, 3, 1, 1, 4, 0]):
        rp = replay(workload(refs))
        for frames in (1, 2, 3, 4, 5):
            assert rp.run("lru", frames).misses == lru_faults(refs, frames)
            assert rp.run("fifo", frames).misses == fifo_faults(refs, frames)
            assert rp.run("min", frames).misses == opt_faults(refs, frames)


def test_counts_bytes_and_base_requests() -> None:
    w = workload([0, -1, 1, 0, -1, 2, 1])
    r = replay(w).run("lru", 2)
    # 0 1 0 2 1 over two slots: 0, 1 load into empty slots; 2 evicts 1; 1 evicts 0.
    assert (r.requests, r.adapter_requests, r.hits, r.misses, r.swaps) == (7, 5, 1, 4, 2)
    assert r.bytes_moved == 4 * COST.slot_bytes and r.swap_s == pytest.approx(4e-3)
    assert r.hit_rate == pytest.approx(1 / 5)
    # A miss adds one load to its request and nothing else; base-model requests add nothing.
    np.testing.assert_allclose(r.start - w.arrival, [1e-3, 0, 1e-3, 0, 0, 1e-3, 1e-3])
    assert r.added_latency_p99_s == pytest.approx(1e-3)


# -- properties ----------------------------------------------------------------------------------

refs_strategy = st.lists(st.integers(0, 7), min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(refs=refs_strategy, frames=st.integers(1, 9))
def test_min_never_misses_more_than_lru_or_fifo(refs: list[int], frames: int) -> None:
    rp = replay(workload(refs))
    least = rp.run("min", frames).misses
    assert least <= rp.run("lru", frames).misses
    assert least <= rp.run("fifo", frames).misses
    assert least == opt_faults(refs, frames)


@settings(max_examples=100, deadline=None)
@given(refs=refs_strategy, pin_count=st.integers(0, 3), extra=st.integers(0, 3),
       concurrent=st.booleans())
def test_enough_slots_miss_once_per_adapter(refs: list[int], pin_count: int, extra: int,
                                            concurrent: bool) -> None:
    hold = [float(i % 3) for i in range(len(refs))] if concurrent else None
    w = workload(refs, hold=hold)
    pinned = [f"a{i}" for i in range(pin_count)]
    unpinned = {r for r in refs if f"a{r}" not in pinned}
    rp = replay(w, pinned)
    for policy in ("lru", "fifo", "min"):
        r = rp.run(policy, len(unpinned) + len(pinned) + extra or 1)
        assert r.misses == len(unpinned) and r.swaps == 0 and r.stalls == 0


@settings(max_examples=100, deadline=None)
@given(refs=refs_strategy, pin_count=st.integers(0, 2))
def test_paging_lru_never_misses_more_with_more_slots(refs: list[int], pin_count: int) -> None:
    pinned = [f"a{i}" for i in range(pin_count)]
    rp = replay(workload(refs), pinned)
    misses = [rp.run("lru", k).misses for k in range(pin_count + 1, pin_count + 10)]
    assert misses == sorted(misses, reverse=True)


@settings(max_examples=120, deadline=None)
@given(
    data=st.lists(st.tuples(st.integers(-1, 6), st.floats(0, 5), st.floats(0, 8)),
                  min_size=1, max_size=50),
    slots=st.integers(1, 6), pin_count=st.integers(0, 2), seats=st.none() | st.integers(1, 6),
    policy=st.sampled_from(["lru", "fifo", "min"]), admission=st.sampled_from(["fcfs", "skip"]),
)
def test_concurrent_replay_serves_each_request_once(
    data: list[tuple[int, float, float]], slots: int, pin_count: int, seats: int | None,
    policy: str, admission: str,
) -> None:
    refs = [d[0] for d in data]
    arrival = np.cumsum([d[1] for d in data]).tolist()
    w = workload(refs, arrival, [d[2] for d in data])
    pinned = [f"a{i}" for i in range(min(pin_count, slots - 1))]
    rp = Replay(w, w.hold_seconds(1.0, 1.0), COST, pinned, seats, admission=admission)
    r = rp.run(policy, slots)
    assert r.served.tolist() == [1] * len(refs)  # none lost, none served twice
    assert r.ref_counts_at_end == [0] * slots
    assert r.hits + r.delayed_hits + r.misses == r.adapter_requests
    assert (r.start >= w.arrival).all() and (rp.baseline >= w.arrival).all()
    early = r.start < rp.baseline - 1e-9
    if admission == "fcfs":  # a cache never makes a request start earlier
        assert not early.any() and r.moved_ahead == 0
    # Skip: only by taking a seat a stalled head does not hold, counted apart from the latency.
    assert r.moved_ahead == int((r.start < rp.baseline).sum()) >= int(early.sum())
    assert r.gained_s == pytest.approx(float((rp.baseline - r.start)[r.start < rp.baseline].sum()))
    assert r.added_latency_mean_s == pytest.approx(float(np.maximum(r.start - rp.baseline,
                                                                    0).mean()))


def test_busy_slots_make_a_request_wait_not_evict() -> None:
    # Two slots, both held until t=10 by a0 and a1; a2 arrives at t=1 and must wait. A base-model
    # request ending at t=5 frees no slot: a2 tries again and still waits.
    w = workload([0, 1, -1, 2, 0], arrival=[0.0, 0.0, 0.0, 1.0, 11.0],
                 hold=[10.0, 10.0, 5.0, 1.0, 1.0])
    for policy in ("lru", "fifo", "min"):
        r = replay(w).run(policy, 2)
        assert r.stalls == 1 and r.stall_total_s == pytest.approx(10.001 - 1.0)
        # a0 and a1 start after their loads, one after the other on the one link; a2 only once
        # a0 finishes (10.001) and it loads.
        np.testing.assert_allclose(r.start[:4], [1e-3, 2e-3, 0.0, 10.002])
        assert r.misses == 4 and r.swaps == 2  # the fourth, a0 again, was evicted for a2
        assert r.ref_counts_at_end == [0, 0]
    # With a batch cap of 2, the third request queues for a seat: that is not a stall.
    w = workload([0, 1, 2, 0], arrival=[0.0, 0.0, 1.0, 11.0], hold=[10.0, 10.0, 1.0, 1.0])
    r = replay(w, seats=2).run("lru", 3)
    assert r.stalls == 0 and r.start[2] == pytest.approx(10.001 + 1e-3)
    assert r.added_latency_p99_s < 0.01  # the baseline queues for the seat just as long


def test_loads_share_the_link() -> None:
    """Four misses at once each took the whole link (all started at 1 ms):
    on one link they queue, 1, 2, 3, 4 ms; on two, two at a time. The wait is recorded."""
    w = workload([0, 1, 2, 3, 0], arrival=[0.0, 0.0, 0.0, 0.0, 5.0], hold=[1.0] * 5)
    r = replay(w).run("lru", 4)
    np.testing.assert_allclose(r.start[:4], [1e-3, 2e-3, 3e-3, 4e-3])
    assert r.link_wait_s == pytest.approx(0.006) and r.swap_s == pytest.approx(0.004)
    two = Replay(w, w.hold_seconds(1.0, 1.0), dataclasses.replace(COST, links=2)).run("lru", 4)
    np.testing.assert_allclose(two.start[:4], [1e-3, 1e-3, 2e-3, 2e-3])
    # Paging mode too: a miss's load begins when the link is free.
    p = replay(workload([0, 1, 2, 0], arrival=[0.0, 0.0, 0.0, 0.0])).run("lru", 3)
    np.testing.assert_allclose(p.start, [1e-3, 2e-3, 3e-3, 1e-3])
    with pytest.raises(UsageError, match="--links must be between 1 and 1,024"):
        SwapCost(1, 1.0, 0.0, "x", links=0)


def test_a_request_before_its_adapters_load_ends_is_a_delayed_hit_in_both_modes() -> None:
    """a0 misses at 0 and loads until 2 ms (behind a1's load on the one link); a0 again at
    0.5 ms was counted a hit with no added latency in paging mode. In both modes it
    is a delayed hit that starts when the load ends; at 5 ms it is a plain hit."""
    arrival = [0.0, 0.0, 0.0005, 0.005]
    paging = replay(workload([1, 0, 0, 0], arrival=arrival)).run("lru", 2)
    concurrent = replay(workload([1, 0, 0, 0], arrival=arrival, hold=[1e-9] * 4)).run("lru", 2)
    assert not replay(workload([1, 0, 0, 0], arrival=arrival, hold=[1e-9] * 4)).paging
    for r in (paging, concurrent):
        assert (r.hits, r.delayed_hits, r.misses) == (1, 1, 2)
        np.testing.assert_allclose(r.start, [0.001, 0.002, 0.002, 0.005])
        assert r.added_latency_mean_s == pytest.approx((0.001 + 0.002 + 0.0015) / 4)
    swept = replay(workload([1, 0, 0, 0], arrival=arrival)).lru_sweep([2])[0]
    assert (swept.hits, swept.delayed_hits) == (1, 1)
    assert swept.added_latency_mean_s == pytest.approx(paging.added_latency_mean_s)


def test_lru_orders_by_use_not_by_admission() -> None:
    """a0 admitted first and running until t=10 was older than a1, which ended at t=2, so a2
    evicted a0 (4 misses where there are 3). A sequence in flight keeps its slot in use."""
    w = workload([0, 1, 2, 0], arrival=[0.0, 1.0, 20.0, 21.0], hold=[10.0, 1.0, 1.0, 1.0])
    r = replay(w).run("lru", 2)
    assert (r.misses, r.hits) == (3, 1)


def test_a_request_joining_a_load_is_a_delayed_hit() -> None:
    """It waits for the load another request started: neither a hit nor a miss (it was counted
    as a hit, and --target-hit-rate read that)."""
    w = workload([0, 0, 0], arrival=[0.0, 0.0005, 2.0], hold=[1.0, 1.0, 1.0])
    r = replay(w).run("lru", 1)
    assert (r.hits, r.delayed_hits, r.misses) == (1, 1, 1)
    assert r.hit_rate == pytest.approx(1 / 3) and r.start[1] == pytest.approx(1e-3)


def test_smallest_size_on_a_curve_that_is_not_monotonic(tmp_path: Path) -> None:
    """FIFO's anomaly: 3 slots give 3 hits, 4 slots 2. A target of 3 hits was met 'at 3 slots'
    though 4 fail; the answer is the smallest size from which every size meets it."""
    p = tmp_path / "belady.csv"
    refs = [1, 2, 3, 4, 1, 2, 5, 1, 2, 3, 4, 5]
    p.write_text("timestamp,adapter\n" + "".join(f"{t},a{a}\n" for t, a in enumerate(refs)))
    r = metrale("simulate", *SLOT, "--trace", p, "--policy", "fifo,lru", "--max-loras", "3,4,5",
                "--target-hit-rate", "0.25", "--json")
    assert r.code == 0, r.stderr
    rec = r.json()
    assert [x["hits"] for x in rec["results"]] == [3, 2, 7, 2, 4, 7]
    fifo, lru = rec["smallest_meeting"]
    assert (fifo["max_loras"], fifo["first_meeting"], fifo["monotonic"]) == (5, 3, False)
    assert (lru["max_loras"], lru["first_meeting"], lru["monotonic"]) == (4, 4, True)
    view = metrale("simulate", *SLOT, "--trace", p, "--policy", "fifo", "--max-loras", "3,4,5",
                   "--target-hit-rate", "0.25")
    assert "fifo: 5 slots and every larger size reach hit rate >= 25%" in view.stdout
    assert "not monotonic: 3 slots meet it, a larger size does not" in view.stdout


def test_pinned_adapters_are_never_loaded() -> None:
    w = workload([0, 1, 2, 0, 3, 0, 1, 0])
    rp = replay(w, ["a0"])
    assert rp.run("lru", 2).misses == lru_faults([1, 2, 3, 1], 1)
    with pytest.raises(UsageError, match="leaves no cache slot"):
        rp.run("lru", 1)


# -- workloads -----------------------------------------------------------------------------------


def slora_reference(num_adapters: int, alpha: float, req_rate: float, cv: float,
                    tot_req: int, seed: int) -> tuple[np.ndarray, ...]:
    """S-LoRA benchmarks/trace.py generate_requests, as published (its draws, in its order)."""
    np.random.seed(seed)
    probs = np.random.power(alpha, tot_req)
    ind = (probs * num_adapters).astype(int)
    input_lens = np.random.randint(8, 512, tot_req)
    output_lens = np.random.randint(8, 512, tot_req)
    shape, scale = 1 / (cv * cv), cv * cv / req_rate
    intervals = np.random.gamma(shape, scale, tot_req)
    return ind, input_lens, output_lens, np.cumsum(intervals)


@pytest.mark.parametrize("alpha,cv", [(1.0, 1.0), (0.1, 4.0), (0.6, 2.0)])
def test_slora_generator_is_slora_draw_for_draw(alpha: float, cv: float) -> None:
    w = generate(GeneratorSpec("slora", 5000, adapters=200, rate=2.0, cv=cv, seed=42,
                               alpha=alpha))
    ind, inputs, outputs, times = slora_reference(200, alpha, 2.0, cv, 5000, 42)
    np.testing.assert_array_equal(w.adapter, ind)
    np.testing.assert_array_equal(w.input_tokens, inputs)
    np.testing.assert_array_equal(w.output_tokens, outputs)
    np.testing.assert_allclose(w.arrival, times, rtol=1e-12)


def test_slora_distribution() -> None:
    uniform = generate(GeneratorSpec("slora", 200_000, adapters=20, alpha=1.0, seed=1))
    counts = uniform.counts()
    assert counts.size == 20 and np.abs(counts / 10_000 - 1).max() < 0.05
    skewed = generate(GeneratorSpec("slora", 200_000, adapters=200, alpha=0.1, seed=1))
    # P(index 0) = P(x < 1/200) = (1/200)^0.1 = 0.589 for a power(0.1) draw.
    assert skewed.counts()[0] / 200_000 == pytest.approx(200 ** -0.1, abs=0.01)
    bursty = generate(GeneratorSpec("slora", 200_000, adapters=10, rate=4.0, cv=3.0, seed=1))
    gaps = np.diff(bursty.arrival)
    assert gaps.mean() == pytest.approx(0.25, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(3.0, rel=0.05)


def test_other_generators() -> None:
    z = generate(GeneratorSpec("zipf", 100_000, adapters=50, zipf_s=1.5, seed=3))
    weights = 1 / np.arange(1, 51) ** 1.5
    np.testing.assert_allclose(z.counts() / 100_000, weights / weights.sum(), atol=0.01)
    d = generate(GeneratorSpec("distinct", 1000))
    assert len(d.adapters) == 1000 and np.unique(d.adapter).size == 1000
    i = generate(GeneratorSpec("identical", 1000, input_range=(5, 5), output_range=(0, 0)))
    assert set(i.adapter.tolist()) == {0} and set(i.input_tokens.tolist()) == {5}
    u = generate(GeneratorSpec("uniform", 100_000, adapters=10, seed=2))
    assert np.abs(u.counts() / 10_000 - 1).max() < 0.05
    again = generate(GeneratorSpec("uniform", 100_000, adapters=10, seed=2))
    np.testing.assert_array_equal(u.adapter, again.adapter)  # seeded


def test_trace_roundtrip(tmp_path: Path) -> None:
    w = generate(GeneratorSpec("zipf", 300, adapters=7, seed=5))
    for name in ("t.csv", "t.jsonl"):
        w.save(tmp_path / name, force=False)
        back = read_trace(tmp_path / name)
        np.testing.assert_array_equal(back.arrival, w.arrival)
        assert [back.adapters[a] for a in back.adapter] == [w.adapters[a] for a in w.adapter]
        np.testing.assert_array_equal(back.output_tokens, w.output_tokens)
        assert np.isnan(back.duration).all()
        with pytest.raises(OutputExists, match="exists"):
            w.save(tmp_path / name, force=False)


def test_trace_rows(tmp_path: Path) -> None:
    p = tmp_path / "t.csv"
    p.write_text("timestamp,adapter,duration,extra\n2.5,b,1,x\n1,,0.5,y\n3,a,,z\n")
    w = read_trace(p)
    assert w.adapters == ("b", "a") and w.adapter.tolist() == [-1, 0, 1]  # sorted by time
    assert w.arrival.tolist() == [1.0, 2.5, 3.0]
    hold = w.hold_seconds(100.0, 10.0)
    assert hold[0] == 0.5 and hold[1] == 1.0 and hold[2] == 0.0
    j = tmp_path / "t.jsonl"
    j.write_text('{"timestamp": 0, "adapter": "x", "input_tokens": 100, "output_tokens": 20}\n'
                 '\n{"timestamp": 1, "adapter": null}\n')
    w = read_trace(j)
    assert w.adapter.tolist() == [0, -1]
    assert w.hold_seconds(100.0, 10.0).tolist() == [3.0, 0.0]


@pytest.mark.parametrize("name,text,message", [
    ("t.csv", "timestamp,adapter\n1,a\nx,b\n", r"t\.csv:3: timestamp 'x' is not a number"),
    ("t.csv", "time,adapter\n1,a\n", r"t\.csv:1: the header has no timestamp column"),
    ("t.csv", "timestamp,adapter\n1,a\n-2,b\n", r"t\.csv:3: timestamp '-2' must be"),
    ("t.csv", "timestamp,adapter,output_tokens\n1,a,2.5\n", r"t\.csv:2: output_tokens '2\.5' "
                                                            "is not a whole number"),
    ("t.csv", "timestamp,adapter\n1,a,zz\n", r"t\.csv:2: more cells than the header"),
    ("t.csv", "timestamp,adapter\n,a\n", r"t\.csv:2: no timestamp"),
    ("t.jsonl", '{"timestamp": 1, "adapter": "a"}\n{"timestamp": 2\n',
     r"t\.jsonl:2: not a readable JSON request \(Expecting ',' delimiter at character 17\)$"),
    # A key given twice: the last one was kept, where another reader may keep the first (images
    # and configs refuse such a key); a number of 4,301 digits and nesting past the parser were
    # internal errors (exit 70).
    ("t.jsonl", '{"timestamp": 0, "adapter": "a"}\n{"timestamp": 0, "timestamp": 5, '
     '"adapter": "b"}\n', r"t\.jsonl:2: not a readable JSON request \(key 'timestamp' is "
     r"given twice in one object\)$"),
    ("t.jsonl", '{"timestamp": 1, "adapter": {"a": 1, "a": 2}}\n',
     r"t\.jsonl:1: .* \(key 'a' is given twice in one object\)$"),
    ("t.jsonl", '{"timestamp": ' + "1" * 4301 + ', "adapter": "a"}\n',
     r"t\.jsonl:1: not a readable JSON request \(Exceeds the limit"),
    # An integer past float64: was an internal error (OverflowError).
    ("t.jsonl", '{"timestamp": 1' + "0" * 400 + ', "adapter": "a"}\n',
     r"t\.jsonl:1: timestamp 10{400} must be a finite number >= 0$"),
    ("t.jsonl", "[" * 60_000 + "\n", r"t\.jsonl:1: not a readable JSON request \(nested too "
     r"deeply\)$"),
    ("t.jsonl", '[1, 2]\n', r"t\.jsonl:1: a request must be a JSON object"),
    ("t.jsonl", '{"timestamp": 1}\n', r"t\.jsonl:1: no adapter"),
    ("t.jsonl", '{"timestamp": 1, "adapter": 5}\n', r"t\.jsonl:1: adapter 5 is not a name"),
    ("t.jsonl", '{"timestamp": "nan", "adapter": "a"}\n', r"t\.jsonl:1: timestamp 'nan' must"),
    ("t.jsonl", "", r"t\.jsonl: no requests"),
    # A header alone: was an internal error (exit 70).
    ("t.csv", "timestamp,adapter\n", r"t\.csv: no requests"),
    # Past int64 once read: was an internal error (JSON) or a count wrapped to garbage (CSV).
    ("t.jsonl", '{"timestamp": 1, "adapter": "a", "input_tokens": 99999999999999999999999}\n',
     r"t\.jsonl:1: input_tokens 99999999999999999999999 is not below 2\*\*53"),
    ("t.csv", "timestamp,adapter,output_tokens\n1,a,1e30\n",
     r"t\.csv:2: output_tokens '1e30' is not below 2\*\*53"),
    # No line breaks (a binary file, a dump): refused at the bound, never held whole.
    ("t.jsonl", '{"timestamp": 1, "adapter": "' + "a" * (1 << 20) + '"}\n',
     r"t\.jsonl:1: a line longer than 65536 characters"),
    ("t.csv", "timestamp,adapter\n1," + "a" * (1 << 20) + "\n",
     r"t\.csv:2: a line longer than 65536 characters"),
    # Durations each finite, their sum not: a trace no replay can add up.
    ("t.csv", "timestamp,adapter,duration\n0,a,1e308\n1,a,1e308\n",
     r"t\.csv: its durations add up beyond floating point$"),
    # Short lines, but one quoted cell across them past the csv module's field limit.
    ("t.csv", 'timestamp,adapter\n1,"' + ("a" * 60_000 + "\n") * 3 + '"\n',
     r"t\.csv:\d+: not CSV \(field larger than field limit"),
])
def test_malformed_trace_is_one_line_exit_2(tmp_path: Path, name: str, text: str,
                                            message: str) -> None:
    p = tmp_path / name
    p.write_text(text)
    r = metrale("simulate", *SLOT, "--trace", p)
    assert r.code == 2 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1
    assert re.search(message, r.stderr), r.stderr


def test_a_spreadsheet_csv_with_a_byte_order_mark_is_read(tmp_path: Path) -> None:
    """A UTF-8 BOM (what a spreadsheet's CSV export starts with) was part of the first column's
    name, and the refusal listed the columns metrale knows, not the ones in the file."""
    p = tmp_path / "export.csv"
    p.write_bytes(b"\xef\xbb\xbftimestamp,adapter\r\n0.5,a\r\n1,b\r\n")
    w = read_trace(p)
    assert w.adapters == ("a", "b") and w.arrival.tolist() == [0.5, 1.0]
    bad = tmp_path / "bad.csv"
    bad.write_text("time,adapter,tokens\n1,a,3\n")
    r = metrale("simulate", *SLOT, "--trace", bad)
    assert r.code == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "the header has no timestamp column (columns found: 'time', 'adapter', 'tokens')" \
        in r.stderr, r.stderr


def test_a_trace_is_read_in_chunks_into_columns(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 3 rows give the workload one chunk gives, name a bad row's line in a later
    chunk (also when quoted cells span lines before it), report progress, and stop at the
    request bound."""
    import metrale_cli.sim.workload as wl

    p = tmp_path / "t.csv"
    rows = [f"{t / 4},a{t % 3},{t},{2 * t}" for t in range(10)]
    p.write_text("timestamp,adapter,input_tokens,output_tokens\n" + "\n".join(rows) + "\n")
    whole = read_trace(p)
    monkeypatch.setattr(wl, "TRACE_CHUNK", 3)
    seen: list[tuple[int, int]] = []
    chunked = read_trace(p, progress=lambda done, total: seen.append((done, total)))
    assert chunked.adapters == whole.adapters
    for column in ("adapter", "arrival", "input_tokens", "output_tokens"):
        np.testing.assert_array_equal(getattr(chunked, column), getattr(whole, column))
    size = p.stat().st_size
    assert len(seen) == 4 and seen[-1] == (size, size)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    bad = tmp_path / "bad.csv"
    bad.write_text("timestamp,adapter\n0,a\n1,b\n2,c\n3,d\n4,x\ny,z\n")
    with pytest.raises(FormatError, match=r"bad\.csv:7: timestamp 'y' is not a number"):
        read_trace(bad)
    spans = tmp_path / "spans.csv"
    spans.write_text('timestamp,adapter\n0,"a\nb"\n1,b\n2,c\n3,"d\n\ne"\n-4,x\n')
    with pytest.raises(FormatError, match=r"spans\.csv:9: timestamp '-4' must be"):
        read_trace(spans)
    monkeypatch.setattr(wl, "MAX_REQUESTS", 9)
    with pytest.raises(UsageError, match=r"more than 9 requests, the most a simulation takes"):
        read_trace(p)


@pytest.mark.parametrize("suffix,row,odd", [
    # A lone carriage return ends a JSON line for the line reader, not for the block scan.
    (".jsonl", '{{"timestamp": {t}, "adapter": "é{t}"}}\n',
     '{{"timestamp": {t}, "adapter": "é"}}\r'),
    # A quoted cell: csv's reader reads it, the plain-CSV blocks do not.
    (".csv", "{t},é{t}\n", '{t},"é"\n'),
])
def test_progress_goes_on_where_a_block_falls_back_to_the_line_reader(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, suffix: str, row: str,
        odd: str) -> None:
    """The block readers leave a file to the line reader at its first block they cannot
    read, which reads it again from the start: the count told to the progress bar started
    again from 0 (a bar at 67% went back to 0%), and ended short of the file's size where the
    line reader counted characters of a non-ASCII trace, or a byte-order mark. Now it never
    goes back, and ends at the size."""
    import metrale_cli.sim.workload as wl

    monkeypatch.setattr(wl, "TRACE_CHUNK", 3)
    p = tmp_path / f"t{suffix}"
    lines = [(odd if t == 7 else row).format(t=t) for t in range(10)]
    header = "timestamp,adapter\n" if suffix == ".csv" else ""
    p.write_text("\ufeff" + header + "".join(lines), encoding="utf-8")
    seen: list[tuple[int, int]] = []
    assert read_trace(p, progress=lambda done, total: seen.append((done, total))).requests == 10
    size = p.stat().st_size
    counts = [done for done, _ in seen]
    assert len(seen) > 3 and counts == sorted(set(counts)), seen  # on, never back
    assert {total for _, total in seen} == {size} and counts[-1] == size



def test_progress_ends_at_the_size_past_blank_last_lines(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A JSON-lines file's last block of only blank lines holds no row and is no chunk: the
    count stopped at the block before it, short of the file's size (found by a hypothesis
    search over traces)."""
    import metrale_cli.sim.workload as wl

    monkeypatch.setattr(wl, "TRACE_CHUNK", 3)
    p = tmp_path / "t.jsonl"
    p.write_text("".join(f'{{"timestamp": {t}, "adapter": "a"}}\n' for t in range(9)) + "\n\n")
    seen: list[int] = []
    assert read_trace(p, progress=lambda done, _: seen.append(done)).requests == 9
    assert seen[-1] == p.stat().st_size and seen == sorted(set(seen)), seen



PLAIN_CSV_CASES = [
    b"timestamp,adapter,input_tokens\n0.5,a,3\n0.25,b,4\n1,a,5\n",
    b"\xef\xbb\xbftimestamp,adapter\r\n0,a\r\n1, b \r\n2,\r\n",  # BOM, CRLF, base model
    b"timestamp,adapter,duration\n0,a,\n\n1,b, 2\n \n",  # blank lines, empty optional cell
    b"timestamp,adapter,rank\n0,a,8\n1,a,16\n",  # an adapter given two ranks
    b"timestamp,adapter,x,x\n0,a,1,2\n1,b,3\n",  # a repeated column, a short row
    b"timestamp,adapter\n0,a\n1,b,c\n",  # more cells than the header
    # More cells on a last line with no line end: its last comma went uncounted, so the block
    # was split as if every line had the header's cells (an internal error, or columns
    # shifted: a wrong workload read).
    b"adapter,timestamp\na,0\nb,1,",
    b"adapter,timestamp,rank\na,0.1,\nb,1,0,",
    b"timestamp,adapter\n0,a\n1,b\n-2,c\n",  # out of bounds, line 4
    b"timestamp,adapter,input_tokens\n0,a,1.5\n",  # not whole
    b"timestamp,adapter\n0,a\n1,\xff\n",  # not UTF-8, line 3
    b'timestamp,adapter\n0,"a,b"\n1,b\n',  # a quoted cell
    b"timestamp,adapter\n0,a\r1,b\n",  # a lone carriage return
    b"time,adapter\n0,a\n",  # no timestamp column
    b"timestamp,adapter\n0,a\n1," + b"b" * 70_000 + b"\n",  # a line too long
    b"",
]


def _trace_or_error(p: Path) -> tuple[str, ...] | str:
    """What `read_trace` makes of `p`: every column to the bit, or its error line."""
    try:
        w = read_trace(p)
    except (FormatError, UsageError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return (repr(w.adapters), repr(w.adapter_rank), *(
        getattr(w, c).tobytes().hex() for c in ("adapter", "arrival", "input_tokens",
                                               "output_tokens", "duration")))


def _count_calls(monkeypatch: pytest.MonkeyPatch, module: Any,
                 name: str) -> tuple[list[int], Any]:
    """`module.name` patched to count its calls: the count (one item, kept up to date) and the
    function itself, to put back where calls are not to be counted."""
    original = getattr(module, name)
    count = [0]

    def counted(*args: Any) -> Any:
        count[0] += 1
        return original(*args)

    monkeypatch.setattr(module, name, counted)
    return count, original


def _not_plain(path: Path) -> Any:
    import metrale_cli.sim.workload as wl

    raise wl._NotPlain


@pytest.mark.parametrize("data", PLAIN_CSV_CASES)
def test_the_block_reader_reads_what_the_line_reader_reads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data: bytes) -> None:
    """A CSV file read by blocks (split at its commas, `_plain_csv_chunks`) gives the workload,
    or the one-line error, that the csv module's line reader gives."""
    import metrale_cli.sim.workload as wl

    p = tmp_path / "t.csv"
    p.write_bytes(data)
    monkeypatch.setattr(wl, "TRACE_CHUNK", 2)  # blocks of two lines
    blocks = _trace_or_error(p)
    monkeypatch.setattr(wl, "_plain_csv_chunks", _not_plain)
    assert blocks == _trace_or_error(p)


# CSV cells the compiled scan must read as the csv module's reader does, or leave to it: signs,
# blanks, leading zeros, fractions and exponents, out-of-bounds values, names with blanks.
_CSV_NUMBERS = ["0", "1", "2.5", "1e3", "1E+2", "7.0", "1e400", "1" + "0" * 400, "-1", "-0",
                "01", "1.", ".5", " 3", "3 ", "+4", "nan", "inf", "1_0", "x", "",
                "9007199254740993", "9007199254740991", "1" * 30, "0.1e-5", "\u0663"]
_CSV_NAMES = ["a", "b", " a", "a ", "", " ", "\u00e9", "a\u00a0", "\u3000b", "x\x1fy",
              "\x1c", "\u00e9\u00e9", "lora-001", "\x01a"]


def _csv_file(rng: np.random.Generator) -> str:
    """A random plain CSV trace: a header of the columns metrale reads (in any order, maybe
    another column or a repeated one), rows mostly of plain cells, some of any kind, some
    short or long rows and blank lines; line ends \n or \r\n, the last sometimes missing."""
    columns = ["timestamp", "adapter"] + [k for k in ("input_tokens", "output_tokens",
                                                      "duration", "rank", "x")
                                          if rng.random() < 0.5]
    rng.shuffle(columns)
    if rng.random() < 0.05:
        columns.append(str(rng.choice(columns)))

    def row() -> str:
        r = rng.random()
        if r < 0.03:
            return str(rng.choice(["", " ", "1,a,2,3,4,5,6,7"]))
        cells = []
        for c in columns:
            if c == "adapter":
                cell = str(rng.choice(_CSV_NAMES[:2] + ["lora-001"]))
            elif c in ("timestamp", "duration"):
                cell = str(rng.choice(["0", "0.25", "17", "1e3", "3.0625"]))
            else:
                cell = str(rng.choice(["0", "3", "12", "", "2048"]))
            if rng.random() < 0.02:
                cell = str(rng.choice(_CSV_NAMES if c == "adapter" else _CSV_NUMBERS))
            cells.append(cell)
        if rng.random() < 0.02:
            cells.pop()
        return ",".join(cells)

    end = "\r\n" if rng.random() < 0.2 else "\n"
    lines = [",".join(columns)] + [row() for _ in range(int(rng.integers(1, 14)))]
    return end.join(lines) + (end if rng.random() < 0.8 else "")


@pytest.mark.parametrize("seed", range(2))
def test_the_csv_scan_reads_what_the_line_reader_reads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """Random plain CSV files (blocks of 3 lines, sometimes a bound of 12 requests) read by
    blocks (`_plain_csv_chunks`: the compiled scan, or the split for a block it does not take
    whole) and by the csv module's line reader: the same columns to the bit, or the same error
    line; and most blocks taken by the scan."""
    import metrale_cli.sim.workload as wl

    rng = np.random.default_rng(seed)
    monkeypatch.setattr(wl, "TRACE_CHUNK", 3)
    p = tmp_path / "t.csv"
    outcomes: dict[str, int] = {}
    blocks_read = 0  # blocks read by blocks; `split`: of them, those the scan left to the split
    split, cell_columns = _count_calls(monkeypatch, wl, "_cell_columns")
    for _ in range(150):
        text = _csv_file(rng)
        p.write_bytes(text.encode())
        monkeypatch.setattr(wl, "MAX_REQUESTS", int(rng.choice([12] + [10_000_000] * 8)))
        blocks = _trace_or_error(p)
        blocks_read += text.count("\n") // 3 + 1
        with monkeypatch.context() as m:
            m.setattr(wl, "_plain_csv_chunks", _not_plain)
            m.setattr(wl, "_cell_columns", cell_columns)  # the line reader's calls not counted
            assert blocks == _trace_or_error(p), text
        kind = blocks.split(":")[0] if isinstance(blocks, str) else "read"
        outcomes[kind] = outcomes.get(kind, 0) + 1
    assert set(outcomes) == {"read", "FormatError", "UsageError"} and outcomes["read"] > 30
    assert split[0] < blocks_read / 2


@pytest.mark.parametrize("line,taken", [
    ('{"timestamp": 1.5, "adapter": "a", "input_tokens": 3}', True),
    ('{"timestamp":1.5,"adapter":"a","input_tokens":3}', True),
    (' {\t"timestamp" :\t1.5 ,  "adapter": null, "input_tokens": null } ', True),
    ('{"timestamp": 1.5, "adapter": "a", "input_tokens": 3}\r', True),
    ('{"timestamp": 1.5, "adapter": "\u00e9\u00e9", "input_tokens": 9007199254740991}', True),
    ('{"timestamp": 1.5, "adapter": "a", "input_tokens": 9007199254740992}', False),  # 2**53
    ('{"timestamp": 1.5, "adapter": "a", "input_tokens": 3.0}', False),  # not an integer
    ('{"timestamp": 1.5, "adapter": "a", "input_tokens": 03}', False),
    ('{"timestamp": -1.5, "adapter": "a", "input_tokens": 3}', False),
    ('{"timestamp": null, "adapter": "a", "input_tokens": 3}', False),
    ('{"timestamp": 1.5, "adapter": " a", "input_tokens": 3}', False),  # a blank: strip
    ('{"timestamp": 1.5, "adapter": "a\u3000", "input_tokens": 3}', False),
    ('{"timestamp": 1.5, "adapter": "a\\u0062", "input_tokens": 3}', False),  # an escape
    ('{"timestamp": 1.5, "adapter": 5, "input_tokens": 3}', False),
    ('{"adapter": "a", "timestamp": 1.5, "input_tokens": 3}', False),  # another order
    ('{"timestamp": 1.5, "adapter": "a"}', False),  # another key set
    ('{"timestamp": 1.5, "adapter": "a", "input_tokens": 3,}', False),
    ('{"timestamp": 1.5, "adapter": "a", "input_tokens": 3} x', False),
    ('{"timestamp": 1.5., "adapter": "a", "input_tokens": 3}', False),
    ("", False),
])
def test_the_scan_takes_the_common_json_line_only(line: str, taken: bool) -> None:
    """What the compiled scan takes of a JSON line of the keys timestamp, adapter,
    input_tokens (every other line goes to `json`), and that it reads what it takes as `json`
    does."""
    from metrale_cli.sim.trace_scan import Scan

    keys = ["timestamp", "adapter", "input_tokens"]
    scan = Scan(line.encode() + b"\n", keys, json=True)
    assert scan.taken.tolist() == [taken]
    if taken:
        row = json.loads(line)
        assert scan.arrival[0] == row["timestamp"] and scan.inputs[0] == (row["input_tokens"]
                                                                           or 0)
        assert (scan.names[scan.adapter[0]] if scan.adapter[0] >= 0 else None) == row["adapter"]


def test_a_csv_block_the_scan_does_not_take_is_split(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain CSV block with a cell the scan leaves (a fraction `1.0` of a token count, a
    name with a blank) is read by the split, as before; a block of plain cells by the scan
    alone."""
    import metrale_cli.sim.workload as wl

    monkeypatch.setattr(wl, "TRACE_CHUNK", 2)
    p = tmp_path / "t.csv"
    p.write_text("timestamp,adapter,input_tokens\n0,a,1\n1,b,2\n2,c,3\n3,d,1.0\n4, e ,5\n")
    split: list[int] = []
    cell_columns = wl._cell_columns
    monkeypatch.setattr(wl, "_cell_columns", lambda *a: split.append(a[2]) or cell_columns(*a))
    w = read_trace(p)
    assert w.adapters == tuple("abcde") and w.input_tokens.tolist() == [1, 2, 3, 1, 5]
    assert split == [2]  # the third block only (the first is the header and a row)


# JSON-lines lines of every kind the block reader must take as `json` does, or leave to it:
# spacings, nulls, fractions and exponents, values out of bounds, escapes, other columns,
# duplicate keys, keys out of order, and lines that are no request.
_JSON_VALUES = ["0", "1", "2.5", "1e3", "1E+2", "7.0", "1e400", "1" + "0" * 400, "-1", "-0",
                "01", "1.", '"3"', '""', "null", "true", "9007199254740993",
                "9007199254740991", "1" * 30, "0.1e-5", "[1]", "{}"]
_JSON_NAMES = ['"a"', '"b"', '" a "', '"\\u0062"', '"\\"q"', '""', "null", "5", '"\u00e9"',
               '"\u2028"', '"x,y"', '"a\\tb"']
_JSON_OTHERS = ['"x": 1', '"x": -2.5', '"x": "s"', '"x": [1, {"y": 2}]', '"x": true',
                '"x": ' + "1" * 120, '"tim\\u0065stamp": 4', '"\u00fc": null',
                '"q\\"k": 1']  # a key `json` writes with an escape: no scan of that shape


def _jsonl_file(rng: np.random.Generator) -> str:
    """A random JSON-lines file: most lines objects of one set of keys in one order and
    spacing (what the block reader's pattern takes), some of them with a value out of
    bounds, some lines of another shape, blank or no request; line ends \\n or \\r\\n, the
    last sometimes missing, sometimes blank lines at the end."""
    keys = ["timestamp", "adapter"] + [k for k in ("input_tokens", "output_tokens", "duration",
                                                   "rank") if rng.random() < 0.5]
    other = str(rng.choice(_JSON_OTHERS)) if rng.random() < 0.3 else None
    rng.shuffle(keys)
    spacing = int(rng.integers(3))

    def line() -> str:
        r = rng.random()
        if r < 0.06:
            return str(rng.choice(["", " ", "\t", "  \t ", "\x0c", "\u00a0"]))  # blank
        if r < 0.08:
            return str(rng.choice(["[1, 2]", "{", '{"timestamp": 1, "adapter": "a"} x', "nul",
                                   '{"timestamp": 1, "adapter": "a",}', "\ufeff{}"]))
        values = {k: str(rng.choice(["0", "1", "2.5", "1e3", "0.25", "17"])) for k in keys}
        values["adapter"] = str(rng.choice(_JSON_NAMES[:4]))
        for k in ("input_tokens", "output_tokens", "duration", "rank"):
            if k in values:
                values[k] = str(rng.choice(["3", "0", "null", "12", "4.0"]))
        if rng.random() < 0.12:  # a value of any kind, most of them refused
            k = str(rng.choice(keys))
            values[k] = str(rng.choice(_JSON_NAMES if k == "adapter" else _JSON_VALUES))
        texts = [f'"{k}": {v}' for k, v in values.items()]
        if other is not None:
            texts.append(other)
        if rng.random() < 0.02:
            texts.append('"timestamp": 5')  # a key given twice
        if rng.random() < 0.02:
            texts = [t for t in texts if not t.startswith('"adapter"')]
        if rng.random() < 0.05:
            rng.shuffle(texts)
        style = spacing if rng.random() < 0.9 else int(rng.integers(3))
        if style == 0:
            return "{" + ", ".join(texts) + "}"
        if style == 1:
            return "{" + ",".join(t.replace(": ", ":") for t in texts) + "}"
        return " {\t" + " ,  ".join(t.replace(": ", " :\t") for t in texts) + " } "

    end = "\r\n" if rng.random() < 0.2 else "\n"
    lines = [line() for _ in range(int(rng.integers(1, 14)))]
    lines += [""] * (int(rng.integers(1, 5)) if rng.random() < 0.3 else 0)
    return end.join(lines) + (end if rng.random() < 0.8 else "")


@pytest.mark.parametrize("seed", range(4))
def test_the_jsonl_block_reader_reads_what_the_line_reader_reads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """Random JSON-lines files (blocks of 3 lines, line ends \\n or \\r\\n, with or without
    the last, sometimes a bound of 12 requests and blank lines) read by blocks
    (`_plain_jsonl_chunks`: the compiled scan a block, `json` for the lines it leaves) and
    by the line reader (`json` per line): the same columns to the bit, or the same error
    line."""
    import metrale_cli.sim.workload as wl

    rng = np.random.default_rng(seed)
    monkeypatch.setattr(wl, "TRACE_CHUNK", 3)
    p = tmp_path / "t.jsonl"
    outcomes: dict[str, int] = {}
    calls, _ = _count_calls(monkeypatch, wl, "_jsonl_row")  # the line reader's
    lines_total = by_json = 0  # lines read; of them, those the block reader left to `json`
    row = '{"timestamp": 1, "adapter": "a"}\n'
    # Two cases chance seldom makes: a last line with no line end whose error is at its end
    # (the character counts the line end), and blank lines in a last block short of
    # TRACE_CHUNK lines, which take a trace past the bound only in a full block.
    fixed = [(row + '{"timestamp": 2', 10_000_000), (row * 6 + "\n\n", 7)]
    for _ in range(150):
        text, bound = fixed.pop() if fixed else (_jsonl_file(rng), int(rng.choice(
            [4, 7] + [10_000_000] * 8)))
        p.write_bytes(text.encode())
        monkeypatch.setattr(wl, "MAX_REQUESTS", bound)
        before = calls[0]
        blocks = _trace_or_error(p)
        by_json += calls[0] - before
        lines_total += text.count("\n") + 1
        with monkeypatch.context() as m:
            m.setattr(wl, "_plain_jsonl_chunks", _not_plain)
            lines_read = _trace_or_error(p)
        assert blocks == lines_read, text
        kind = blocks.split(":")[0] if isinstance(blocks, str) else "read"
        outcomes[kind] = outcomes.get(kind, 0) + 1
    # Each kind of outcome met, and most lines of the files read by the compiled scan.
    assert set(outcomes) == {"read", "FormatError", "UsageError"} and outcomes["read"] > 30
    assert by_json < lines_total / 2


def test_a_plain_csv_trace_is_read_without_the_line_reader(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import metrale_cli.sim.workload as wl

    p = tmp_path / "t.csv"
    p.write_bytes(PLAIN_CSV_CASES[0])
    monkeypatch.setattr(wl, "BoundedLines", None)  # the line reader, unusable
    w = read_trace(p)
    assert w.adapters == ("a", "b") and w.arrival.tolist() == [0.25, 0.5, 1.0]
    assert w.input_tokens.tolist() == [4, 3, 5]


def test_trace_memory_follows_the_columns(tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """50,000 rows held as row objects took about 20 MB of Python objects; as columns, read 8,192
    at a time, the reader's peak stays near the columns (2,000,000 rows as row objects
    took 1.14 GB)."""
    import tracemalloc

    import metrale_cli.sim.workload as wl

    monkeypatch.setattr(wl, "TRACE_CHUNK", 8192)
    p = tmp_path / "t.csv"
    n = 50_000
    p.write_text("timestamp,adapter,input_tokens,output_tokens\n"
                 + "".join(f"{t / 8},lora-{t % 97:03d},{t % 500},{t % 300}\n" for t in range(n)))
    tracemalloc.start()
    try:
        w = read_trace(p)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert w.requests == n
    columns = 5 * 8 * n  # five 8-byte columns
    assert peak < 5 * columns + (2 << 20), f"peak {peak / 2**20:.1f} MiB"


def test_the_reader_fills_its_columns_in_place(tmp_path: Path) -> None:
    """Chunks go straight into columns sized from the file's bytes per row: no chunk is kept
    to be joined (joined chunks left 976 MiB resident for 400 MB of columns at 10,000,000
    requests), no rank column is kept for a trace without ranks, and a trace already in time
    order is not moved."""
    import tracemalloc

    from metrale_cli.sim.workload import TraceColumns

    n, chunks, row_bytes = 8192, 16, 40
    columns = TraceColumns(tmp_path / "t.csv", size=n * chunks * row_bytes)
    tracemalloc.start()
    try:
        for k in range(chunks):
            columns.add(np.arange(k * n, (k + 1) * n, dtype=np.float64), ["a", "b"],
                        np.arange(n, dtype=np.int64) % 3 - 1, np.ones(n, dtype=np.int64),
                        np.zeros(n, dtype=np.int64), np.full(n, np.nan),
                        np.zeros(n, dtype=np.int64), done=(k + 1) * n * row_bytes)
        w = columns.workload()
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert w.requests == n * chunks and w.adapter_rank is None and w.adapters == ("a", "b")
    assert w.arrival.tolist() == list(range(n * chunks))
    assert w.adapter.tolist() == (np.arange(n * chunks) % n % 3 - 1).tolist()
    whole = 5 * 8 * n * chunks  # five 8-byte columns, no rank
    assert peak < 1.25 * whole, f"peak {peak / whole:.2f} of the columns"
    assert held < 1.15 * whole, f"held {held / whole:.2f} of the columns"


@pytest.mark.parametrize("suffix,row", [(".csv", "{t},a\n"),
                                        (".jsonl", '{{"timestamp": {t}, "adapter": "a"}}\n')])
def test_blank_lines_count_toward_the_request_bound(tmp_path: Path, suffix: str, row: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A file of blank lines holds no request, but each is read: a 2 GB one took 17 minutes
    before saying so. They count toward the bound, and reading stops at the chunk that
    passes it."""
    import metrale_cli.sim.workload as wl

    monkeypatch.setattr(wl, "MAX_REQUESTS", 9)
    monkeypatch.setattr(wl, "TRACE_CHUNK", 4)
    p = tmp_path / f"t{suffix}"
    header = "timestamp,adapter\n" if suffix == ".csv" else ""
    p.write_text(header + row.format(t=0) + row.format(t=1) + "\n" * 40)
    seen: list[int] = []
    with pytest.raises(UsageError, match=r"more than 9 requests and blank lines, the most"):
        read_trace(p, progress=lambda done, _: seen.append(done))
    assert seen and seen[-1] < p.stat().st_size  # stopped before the end of the file
    p.write_text(header + row.format(t=0) + row.format(t=1) + "\n" * 5)
    assert read_trace(p).requests == 2


def test_a_trace_that_is_not_a_regular_file_is_never_read(tmp_path: Path) -> None:
    fifo = tmp_path / "requests.jsonl"
    os.mkfifo(fifo)  # opening it would wait for a writer forever
    for path in (Path("/dev/zero"), fifo, tmp_path):
        r = metrale("simulate", *SLOT, "--trace", path)
        assert r.code == 2 and r.stdout == "", r.stderr
        assert r.stderr == f"error: {path} is not a regular file; a trace is a CSV or " \
                           "JSON-lines file\n"


# -- parsing and the CLI -------------------------------------------------------------------------


def test_parse_sizes_and_bandwidth() -> None:
    assert parse_size_list("--max-loras", "16,8,8..10,32..64:16") == [8, 9, 10, 16, 32, 48, 64]
    assert parse_size_list("--max-loras", "1..1000,1..1000:2") == list(range(1, 1001))
    assert parse_size_list("--max-loras", "8..8000:8")[-1] == 8000
    assert parse_bandwidth("pcie5") == Link("pcie5", 50e9, 10e-6)
    assert parse_bandwidth("25GB/s") == Link("25GB/s", 25e9, 0.0)
    assert parse_bandwidth("1.5 GiB/s").bytes_per_s == 1.5 * 2**30


@pytest.mark.parametrize("args,message", [
    (["--max-loras", "0"], "sizes must be positive"),
    (["--max-loras", "8..4"], "not a size"),
    # Each size replays the workload: this sweep never finished.
    (["--max-loras", "1..100000000"], "'1..100000000' is 100,000,000 sizes, more than a sweep"),
    (["--max-loras", "1..1000,1001"], "'1..1000,1001' is 1,001 sizes"),
    (["--bandwidth", "fast"], "neither a preset"),
    (["--bandwidth", "xGB/s"], "not a size"),
    (["--policy", "lru,random"], "random"),
    (["--pin", "lora-001", "--pinned", "2"], "not both"),
    (["--workload", "pareto"], "--workload must be one of"),
    (["--requests", "0"], "--requests must be positive"),
    (["--input-tokens", "9,3"], "LO <= HI"),
    (["--target-hit-rate", "95"], "--target-hit-rate must be in"),
    (["--max-concurrency", "0"], "--max-concurrency must be positive"),
    (["--pinned", "3", "--max-loras", "3"], "leaves no cache slot"),
    (["--trace", "t.csv", "--workload", "zipf"], "not both"),
    # Not finite: each made the record NaN or infinite (--json an internal error, exit 70).
    (["--rate", "inf"], "--rate must be positive and finite"),
    (["--cv", "inf"], "--cv must be positive and finite"),
    (["--zipf-s", "inf"], "--zipf-s must be positive and finite"),
    (["--workload", "slora", "--alpha", "inf"], "--alpha must be positive and finite"),
    (["--decode-tok-s", "inf"], "must be positive and finite"),
    (["--prefill-tok-s", "nan"], "must be positive and finite"),
    (["--swap-latency-ms", "nan"], "--swap-latency-ms must be between 0 and 86,400,000 (a day), "
     "got nan"),
    # Finite, but the replay's sums of latencies and of request times were not: inf in the
    # view, and --json exited 70 on inf or nan.
    (["--swap-latency-ms", "1e308", "--json"], "--swap-latency-ms must be between 0 and "
     "86,400,000 (a day), got 1e+308"),
    # 1 / cv**2 divided by zero (exit 70).
    (["--cv", "1e-308"], "--cv 1e-308 is too small: its square underflows floating point"),
    (["--decode-tok-s", "1e-308", "--json"], "--prefill-tok-s 10000 and --decode-tok-s 1e-308 "
     "give request times beyond floating point; choose larger ones"),
    (["--decode-tok-s", "1e-303", "--json"], "--prefill-tok-s 10000 and --decode-tok-s 1e-303 "
     "give request times beyond floating point; choose larger ones"),
    (["--target-p99-ms", "inf"], "--target-p99-ms must be >= 0 and finite"),
    (["--rate", "1e308", "--cv", "1e300"], "beyond floating point"),
    (["--seed", "-1"], "--seed must be non-negative"),
    # A pin no request uses only took a slot from the cache.
    (["--pin", "lora-01", "--pin", "nobody"], "--pin nobody: no request in the workload uses"),
    # Grew past 12 GB in 20 s: refused before a column is allocated, as --max-loras sizes are.
    (["--requests", "1000000000"], "--requests 1,000,000,000 is more than a simulation takes "
                                   "(10,000,000)"),
    (["--adapters", "1000000000000"], "--adapters 1,000,000,000,000 is more than"),
    # A billion seeds grew to 24 GB making the seeds' list, and then exited 70.
    (["--adapters", "20", "--max-loras", "4,8", "--seeds", "1000000000"],
     "--seeds 1,000,000,000 is more than a simulation takes (1,000"),
    (["--links", "99999999999999999999"],
     "--links must be between 1 and 1,024, got 99,999,999,999,999,999,999"),
])
def test_bad_options_are_one_line(args: list[str], message: str) -> None:
    r = metrale("simulate", *SLOT, "--requests", "200", *args)
    assert r.code == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_a_size_past_every_adapter_resident_replays_as_that_size() -> None:
    """--max-loras 10**20 allocated slots until memory ran out (exit 70), and 10**6 beside 20
    adapters took 14 s: past every adapter resident, a size replays as that size, and only its
    pool's bytes differ; a size whose pool passes 1 PiB (10**20 slots) is a typo, refused as
    every command and engine refuses it."""
    r = metrale("simulate", *SLOT, "--adapters", "20", "--requests", "300", "--policy",
                "lru,fifo", "--max-loras", "20,1000000", "--json")
    assert r.code == 0, r.stderr
    results = r.json()["results"]
    for policy in ("lru", "fifo"):
        small, huge = (x for x in results if x["policy"] == policy)
        assert (small["max_loras"], huge["max_loras"]) == (20, 1000000)
        assert huge["pool_bytes"] > small["pool_bytes"]
        differ = {"max_loras", "pool_bytes"}
        assert {k: v for k, v in huge.items() if k not in differ} == \
            {k: v for k, v in small.items() if k not in differ}
    typo = metrale("simulate", *SLOT, "--adapters", "20", "--requests", "300", "--max-loras",
                   "20,99999999999999999999")
    one_line_error(typo, 2)
    assert typo.stderr.startswith("error: a pool of 99,999,999,999,999,999,999 slots and its "
                                  "tables would take ") and "check --max-loras" in typo.stderr


@pytest.mark.sweep
def test_cli_json_record(tmp_path: Path) -> None:
    trace = tmp_path / "gen.csv"
    r = metrale("simulate", *SLOT, "--workload", "slora", "--adapters", "40", "--alpha", "0.3",
                "--requests", "3000", "--max-loras", "4,8..16:4,64", "--pinned", "2",
                "--max-concurrency", "32", "--bandwidth", "pcie5", "--target-hit-rate", "0.9",
                "--budget", "1GiB", "--save-trace", trace, "--json")
    assert r.code == 0, r.stderr
    rec = r.json()
    assert rec["mode"] == "concurrent" and rec["sizes"] == [4, 8, 12, 16, 64]
    assert rec["workload"]["kind"] == "slora" and rec["workload"]["requests"] == 3000
    assert len(rec["pinned"]) == 2 and rec["max_concurrency"] == 32
    results = rec["results"]
    assert [(x["policy"], x["max_loras"]) for x in results] == [
        (p, k) for p in ("lru", "fifo", "min") for k in (4, 8, 12, 16, 64)]
    slot_bytes = rec["swap"]["slot_bytes"]
    assert slot_bytes == rec["layout"]["slot_bytes"] > 0
    for x in results:
        for key in ("policy", "max_loras", "requests", "hits", "misses", "swaps", "bytes_moved",
                    "hit_rate", "stalls", "stall_p99_s", "added_latency_p99_s", "swap_s"):
            assert key in x
        assert x["bytes_moved"] == x["misses"] * slot_bytes
        assert x["hits"] + x["delayed_hits"] + x["misses"] == x["adapter_requests"]
        assert x["extra_misses_vs_min"] == x["misses"] - next(
            y["misses"] for y in results if y["policy"] == "min" and
            y["max_loras"] == x["max_loras"])
    for s in rec["smallest_meeting"]:
        mine = [x for x in results if x["policy"] == s["policy"]]
        want = next(x for k, x in enumerate(mine)
                    if all(y["hit_rate"] >= 0.9 for y in mine[k:]))
        assert s["max_loras"] == want["max_loras"]
        assert s["fits_budget"] == (want["pool_bytes"] <= 2**30)
    # The saved trace replays to the same numbers.
    again = metrale("simulate", *SLOT, "--trace", trace, "--max-loras", "4,8..16:4,64",
                    "--pinned", "2", "--max-concurrency", "32", "--bandwidth", "pcie5", "--budget",
                    "1GiB", "--json")
    assert again.code == 0, again.stderr
    strip = ("seconds",)
    assert [{k: v for k, v in x.items() if k not in strip} for x in again.json()["results"]] \
        == [{k: v for k, v in x.items() if k not in strip} for x in results]
    # --save-trace never overwrites without --force.
    r = metrale("simulate", *SLOT, "--requests", "10", "--save-trace", trace)
    assert r.code == 2 and "exists" in r.stderr


def test_cli_paging_mode_view_and_plot(tmp_path: Path) -> None:
    plot = tmp_path / "sim.png"
    r = metrale("simulate", *SLOT, "--workload", "zipf", "--adapters", "30", "--requests",
                "2000", "--input-tokens", "0", "--output-tokens", "0", "--max-loras", "2..6",
                "--policy", "lru,min", "--target-hit-rate", "0.8", "--plot", plot)
    assert r.code == 0, r.stderr
    assert "exact paging" in r.stdout and "min" in r.stdout
    assert "slots and every larger size reach" in r.stdout
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    r = metrale("simulate", *SLOT, "--requests", "20", "--plot", plot)
    assert r.code == 2 and "exists" in r.stderr
    rec = metrale("simulate", *SLOT, "--requests", "500", "--input-tokens", "0",
                  "--output-tokens", "0", "--json").json()
    assert rec["mode"] == "paging" and all(x["stalls"] == 0 for x in rec["results"])
    # Default sizes: powers of two up to every adapter resident, where misses = distinct.
    last = [x for x in rec["results"] if x["max_loras"] == rec["sizes"][-1]]
    assert rec["sizes"][-1] == rec["workload"]["distinct_adapters"]
    assert {x["misses"] for x in last} == {rec["workload"]["distinct_adapters"]}


def test_trace_json_written_by_hand(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    rows = [{"timestamp": t, "adapter": a, "duration": 0} for t, a in enumerate("abcabdab")]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rec = metrale("simulate", *SLOT, "--trace", p, "--max-loras", "2", "--policy", "lru",
                  "--json").json()
    refs = [ord(c) - ord("a") for c in "abcabdab"]
    assert rec["results"][0]["misses"] == lru_faults(refs, 2)


@pytest.mark.slow  # about 4 s: 100,000 requests under each admission
def test_bench_slots_record() -> None:
    r = metrale("bench", "slots", "--requests", "2000", "--cycles", "300", "--repeats", "1",
                "--json")
    assert r.code == 0, r.stderr
    rec = r.json()
    assert rec["setup"]["sizes"] == [64, 4096]
    for key in ("victim_cycle_ns", "scan_ns", "simulate_paging_req_per_s",
                "simulate_concurrent_req_per_s"):
        assert set(rec[key]) == {"64", "4096"} and min(rec[key].values()) > 0
    ns = rec["victim_cycle_ns"]
    assert rec["victim_cycle_ratio"] == ns["4096"] / ns["64"]
    for name, rate in (("lru_sweep", 10), ("lru_sweep_overloaded", 20_000)):
        sweep = rec[name]
        assert sweep["sizes"] == 1000 and sweep["adapters"] == 100_000 and sweep["rate"] == rate
        assert sweep["speedup"] == 1000 * sweep["replay_s"] / sweep["sweep_s"] > 0
        assert sweep["over_one_replay"] == sweep["sweep_s"] / sweep["replay_s"]
    # libCacheSim (the test extra) on the same trace: the misses are checked before the times.
    theirs = rec["libcachesim"]
    assert theirs["sizes"] == [10, 50, 100, 200, 500] and theirs["requests"] == 2000
    for policy in ("fifo", "lru"):
        t = theirs[policy]
        assert t["ratio"] == t["metrale_s"] / t["libcachesim_s"] > 0
        assert t["misses"] == sorted(t["misses"], reverse=True) and t["misses"][0] < 2000
    assert set(rec["admission"]) == {"10000", "100000"}
    for times in rec["admission"].values():
        assert times["skip_over_fcfs"] == times["skip_s"] / times["fcfs_s"] > 0
    from metrale_cli.cli.render_sim import bench_slots_view

    view = str(bench_slots_view(rec))
    assert "admission, 100,000 requests on 4 slots: skip" in view
    assert "  lru, paging: metrale" in view and "the same misses" in view
    assert "100,000 adapters at 20,000 req/s:" in view
    r = metrale("bench", "slots", "--repeats", "0")
    assert r.code == 2 and "must be positive" in r.stderr


@pytest.mark.slow  # about 3 s: a process for each side, numba and libCacheSim imported in each
def test_bench_slots_at_scale_record() -> None:
    r = metrale("bench", "slots", "--scale", "20000", "--json")
    assert r.code == 0, r.stderr
    rec = r.json()
    assert rec["requests"] == 20000 and rec["policies"] == ["lru", "fifo", "min"]
    assert rec["sizes"] == [10, 25, 50, 100, 200, 300, 500, 750]
    ours, theirs = rec["metrale"], rec["libcachesim"]
    # The same misses as libCacheSim's LRU, FIFO and Belady (checked before anything is timed
    # as a result), falling as the pool grows; min below the others.
    assert ours["misses"] == theirs["misses"]
    for policy in ("lru", "fifo", "min"):
        misses = ours["misses"][policy]
        assert misses == sorted(misses, reverse=True) and 0 < misses[-1] < misses[0] < 20000
    assert all(m < f for m, f in zip(ours["misses"]["min"], ours["misses"]["fifo"],
                                     strict=True))
    assert ours["total_s"] == pytest.approx(ours["read_s"] + sum(ours["seconds"].values()))
    assert rec["ratio"] == ours["total_s"] / theirs["total_s"] > 0
    for side in (ours, theirs):
        # Each side's own process: its peak is at least what it held once imported.
        assert side["peak_rss"] >= side["rss_after_imports"] > 10 << 20
    from metrale_cli.cli.render_sim import bench_slots_scale_view

    view = str(bench_slots_scale_view(rec))
    assert "20,000 zipf requests over 1,000 adapters" in view and "the same misses" in view
    del rec["libcachesim"], rec["ratio"]  # the record where libCacheSim is not installed
    view = str(bench_slots_scale_view(rec))
    assert "libCacheSim: not installed" in view and "the same misses" not in view
    for bad in ("0", "10000001"):
        r = metrale("bench", "slots", "--scale", bad)
        assert r.code == 2 and "--scale must be 1 to 10,000,000 requests" in r.stderr


def test_slot_bytes_come_from_the_layout_planner(tmp_path: Path) -> None:
    adapter = tmp_path / "a"
    assert metrale("synth", adapter, "--model", "qwen3-8b", "--modules", "q_proj,v_proj",
                   "--rank", 8).code == 0
    layout = metrale("layout", adapter, "--json").json()
    r = metrale("simulate", adapter, "--requests", "300", "--max-loras", "4", "--bandwidth",
                "2GB/s", "--swap-latency-ms", "0.5", "--target-p99-ms", "100", "--json")
    assert r.code == 0, r.stderr
    rec = r.json()
    assert rec["swap"]["slot_bytes"] == layout["slot_bytes"] == rec["layout"]["slot_bytes"]
    assert rec["layout"]["fingerprint"] == layout["fingerprint"]
    assert rec["swap"]["swap_s"] == pytest.approx(layout["slot_bytes"] / 2e9 + 0.5e-3)
    for x in rec["results"]:
        assert x["swap_s"] == pytest.approx(x["misses"] * rec["swap"]["swap_s"])
        assert x["pool_bytes"] == layout["slot_bytes"] * 4 + metrale(
            "layout", adapter, "--max-loras", "4", "--json").json()["table_bytes"]
    for s in rec["smallest_meeting"]:
        met = [x for x in rec["results"] if x["policy"] == s["policy"]
               and x["added_latency_p99_s"] <= 0.1]
        assert s["max_loras"] == (met[0]["max_loras"] if met else None)


@pytest.mark.sweep
def test_progress_counts_every_request_once_and_pins_by_name() -> None:
    from metrale_cli.cli.parsing import parse_modules
    from metrale_cli.layout.plan import plan_layouts
    from metrale_cli.model.resolve import resolve_model
    from metrale_cli.sim import simulate as sim

    layouts = plan_layouts(resolve_model("qwen3-8b"), [], parse_modules("q_proj"), 8)
    for lengths in ((0, 0), (8, 512)):
        w = generate(GeneratorSpec("zipf", 70_000, adapters=40, input_range=lengths,
                                   output_range=lengths))
        seen: list[tuple[int, int]] = []
        result = sim.run(w, *layouts, policies=["lru", "min"], sizes=[4, 16],
                         pin=["lora-00", "lora-07"],
                         progress=lambda n, t, seen=seen: seen.append((n, t)))
        assert sum(n for n, _ in seen) == 4 * 70_000 and {t for _, t in seen} == {4 * 70_000}
        assert result.pinned == ["lora-00", "lora-07"]
        assert all(r.pinned == 2 for r in result.results)
    r = metrale("simulate", *SLOT, "--requests", "300", "--pin", "lora-03", "--pin", "lora-00",
                "--max-loras", "3", "--json")
    assert r.code == 0, r.stderr
    assert r.json()["pinned"] == ["lora-03", "lora-00"]


def test_an_expert_slot_is_swapped_with_its_slot() -> None:
    """With --experts a load moves the slot and the expert slot, as `layout --experts` sizes."""
    args = ["-m", "qwen3-30b-a3b", "--modules", "q_proj", "--max-rank", 8, "--experts"]
    layout = metrale("layout", *args, "--json").json()
    r = metrale("simulate", *args, "--requests", 100, "--max-loras", 4, "--json")
    assert r.code == 0, r.stderr
    rec = r.json()
    expert_slot = layout["experts"]["expert_slot_bytes"]
    assert rec["layout"]["expert_slot_bytes"] == expert_slot > 0
    assert rec["swap"]["slot_bytes"] == layout["slot_bytes"] + expert_slot


@pytest.mark.sweep
@pytest.mark.parametrize("shard", [["--tp", "4"], ["--tp", "4", "--ep", "2"],
                                   ["--tp", "2", "--fully-sharded"]])
def test_tp_swaps_the_largest_ranks_slot_per_gpu(shard: list[str]) -> None:
    """With --tp a swap moves, per GPU, the largest rank's slot and expert slot that
    `layout --tp` lays out; pool sizes are that rank's pool and tables."""
    args = ["-m", "qwen3-30b-a3b", "--modules", "q_proj,o_proj", "--max-rank", 8, "--experts",
            *shard]
    ranks = metrale("layout", *args, "--max-loras", 4, "--json").json()["rank_layouts"]
    r = metrale("simulate", *args, "--requests", 100, "--max-loras", 4, "--json")
    assert r.code == 0, r.stderr
    rec = r.json()
    per_rank = [(g["slot_bytes"] + g["expert_slot_bytes"], g) for g in ranks]
    swapped, busiest = max(per_rank, key=lambda x: x[0])
    unsharded = metrale("layout", *args[:-len(shard)], "--json").json()
    assert rec["swap"]["slot_bytes"] == swapped < (unsharded["slot_bytes"]
                                                   + unsharded["experts"]["expert_slot_bytes"])
    lay = rec["layout"]
    assert lay["tp_rank"] in busiest["ranks"]
    assert lay["fingerprint"] == busiest["fingerprints"][busiest["ranks"].index(lay["tp_rank"])]
    assert (lay["slot_bytes"], lay["expert_slot_bytes"]) == (busiest["slot_bytes"],
                                                             busiest["expert_slot_bytes"])
    assert lay["tp_size"] == int(shard[1])
    assert [x["pool_bytes"] for x in rec["results"]] == [
        max(g["total_bytes"] for g in ranks)] * len(rec["results"])
    assert "per GPU at --tp" in metrale("simulate", *args, "--requests", 100, "--max-loras",
                                        4).stdout


def test_admission_skip_lets_resident_adapters_go_ahead() -> None:
    """One slot, a0 held until 10: a1 (t=1) cannot be placed. First come first served keeps the
    base-model request (t=2) and a0 again (t=3) behind it; skip starts them at once, as vLLM's
    scheduler does, and a1 still loads as soon as the slot frees."""
    w = workload([0, 1, -1, 0], arrival=[0.0, 1.0, 2.0, 3.0], hold=[10.0, 1.0, 1.0, 1.0])
    fcfs = replay(w).run("lru", 1)
    np.testing.assert_allclose(fcfs.start, [0.001, 10.002, 10.001, 11.003])
    skip = Replay(w, w.hold_seconds(1.0, 1.0), COST, (), None, admission="skip").run("lru", 1)
    np.testing.assert_allclose(skip.start, [0.001, 10.002, 2.0, 3.0])
    assert (skip.hits, skip.misses) == (1, 2) and (fcfs.hits, fcfs.misses) == (0, 3)
    # Time to first token, adapter requests apart from base-model ones (no prefill here).
    assert fcfs.ttft_base_p50_s == pytest.approx(8.001) and skip.ttft_base_p50_s == 0.0
    assert skip.ttft_adapter_p99_s == pytest.approx(np.percentile([0.001, 9.002, 0.0], 99))
    assert fcfs.throughput_req_s == pytest.approx(4 / 12.003)
    with pytest.raises(UsageError, match="--admission must be one of fcfs, skip"):
        Replay(w, w.hold_seconds(1.0, 1.0), COST, admission="lifo")


def test_a_request_that_gains_from_a_stall_adds_no_negative_latency() -> None:
    """One slot, two seats; a0 runs 0-1.001, a1 (0.1) stalls holding no
    seat, and a0 again (0.2) takes the free seat under skip and starts at 0.2, before its
    all-resident start (1.0, when the first seat frees): -0.8 was its added latency, and the
    mean fell below what the loads cost. It adds 0 and is counted apart."""
    w = workload([0, 1, 0], arrival=[0.0, 0.1, 0.2], hold=[1.0, 1.0, 1.0])
    skip = Replay(w, w.hold_seconds(1.0, 1.0), COST, (), 2, admission="skip").run("lru", 1)
    np.testing.assert_allclose(skip.start, [0.001, 1.201, 0.2])
    assert (skip.moved_ahead, skip.gained_s) == (1, pytest.approx(0.8))
    assert skip.added_latency_mean_s == pytest.approx((0.001 + 1.101) / 3)
    assert skip.added_latency_p50_s == pytest.approx(0.001)
    fcfs = Replay(w, w.hold_seconds(1.0, 1.0), COST, (), 2).run("lru", 1)
    assert (fcfs.moved_ahead, fcfs.gained_s) == (0, 0.0)
    assert json.dumps(fcfs.record()["gained_s"]) == "0.0"  # not -0.0, no gain negated
    assert fcfs.record()["moved_ahead"] == 0 and skip.record()["gained_s"] == pytest.approx(0.8)


def test_the_view_shows_the_skip_gains_where_there_are_some(tmp_path: Path) -> None:
    """The trace of the test above through the CLI: the gains were in the record only. The serving
    table shows `moved_ahead` and `gained_s` when a result has any, and fcfs (none) shows no
    such columns."""
    trace = tmp_path / "t.csv"
    trace.write_text("timestamp,adapter,duration\n0,A,1\n0.1,B,1\n0.2,A,1\n")
    args = ["simulate", *SLOT, "--trace", trace, "--max-loras", "1", "--max-concurrency", "2",
            "--policy", "lru"]
    skip = metrale(*args, "--admission", "skip", columns=80)
    assert skip.code == 0, skip.stderr
    lines = skip.stdout.splitlines()
    at = next(k for k, line in enumerate(lines) if "TTFT p50" in line)
    header, names, _, row = lines[at:at + 4]
    assert header.split()[-2:] == ["moved", "gained"]
    assert names.split()[-3:] == ["ahead", "in", "all"]
    assert row.split()[-3:] == ["1", "800", "ms"]
    assert max(len(line) for line in skip.stdout.splitlines() if "TTFT" in line) <= 80
    # With the offline bound beside them (the default policies) nothing is cut at 80 columns:
    # "min (offline bound)" in the policy column cut every figure to an ellipsis.
    default = metrale(*args, "--admission", "skip", "--policy", "lru,fifo,min", columns=80)
    assert default.code == 0 and "min*" in default.stdout and "moved" in default.stdout
    assert "\u2026" not in default.stdout, default.stdout
    fcfs = metrale(*args, "--admission", "fcfs", columns=80)
    assert fcfs.code == 0 and "TTFT" in fcfs.stdout and "moved" not in fcfs.stdout


def test_skip_admission_grows_as_fcfs_does_not_with_the_queue_squared() -> None:
    """Zipf 1.1 over 200 adapters at 50 requests/s, 4 slots, 10,000 requests: skip walked the
    whole queue at every event (28 s here against fcfs's 0.12 s, x235); with the queue indexed
    by adapter it costs what fcfs does, give or take, and gives the same record as before
    (stalls, hits, loads)."""
    import time

    w = generate(GeneratorSpec("zipf", 10_000, adapters=200, rate=50.0, zipf_s=1.1))
    hold = w.hold_seconds(10_000.0, 50.0)
    seconds, results = {}, {}
    for admission in ("fcfs", "skip", "fcfs"):  # fcfs again: the faster of two, if noisy
        replay = Replay(w, hold, COST, admission=admission)
        started = time.perf_counter()
        results[admission] = replay.run("lru", 4)
        took = time.perf_counter() - started
        seconds[admission] = min(seconds.get(admission, took), took)
    assert seconds["skip"] < 4 * seconds["fcfs"] + 0.5, seconds
    r = results["skip"]
    assert r.hits + r.delayed_hits + r.misses == r.adapter_requests and r.stalls > 0
    assert (r.served == 1).all() and r.ref_counts_at_end == [0] * 4
    assert r.added_latency_p99_s < results["fcfs"].added_latency_p99_s


def test_cli_admission_and_ttft() -> None:
    r = metrale("simulate", *SLOT, "--requests", "800", "--adapters", "60", "--rate", "40",
                "--max-loras", "4", "--policy", "lru", "--admission", "skip", "--json")
    assert r.code == 0, r.stderr
    rec = r.json()
    assert rec["admission"] == "skip"
    x = rec["results"][0]
    assert x["ttft_adapter_p99_s"] >= x["ttft_adapter_p50_s"] > 0
    assert x["ttft_base_p50_s"] is None and x["throughput_req_s"] > 0
    bad = metrale("simulate", *SLOT, "--requests", "30", "--admission", "lifo")
    assert bad.code == 2 and "--admission must be one of" in bad.stderr


def test_seeds_report_the_spread_of_each_figure() -> None:
    """--seeds 3 is three runs, seeds 5, 6, 7, at the sizes the first chose: the record is seed
    5's with each figure's min/median/max over the three."""
    r = metrale("simulate", *SLOT, "--requests", "600", "--adapters", "30", "--seed", "5",
                "--seeds", "3", "--input-tokens", "0", "--output-tokens", "0", "--policy",
                "lru,fifo", "--json")
    assert r.code == 0, r.stderr
    rec = r.json()
    assert rec["seeds"] == [5, 6, 7]
    alone = {s: metrale("simulate", *SLOT, "--requests", "600", "--adapters", "30", "--seed",
                        str(s), "--input-tokens", "0", "--output-tokens", "0", "--policy",
                        "lru,fifo", "--max-loras", ",".join(map(str, rec["sizes"])),
                        "--json").json()["results"] for s in (5, 6, 7)}
    for i, x in enumerate(rec["results"]):
        assert x["misses"] == alone[5][i]["misses"]
        misses = sorted(alone[s][i]["misses"] for s in (5, 6, 7))
        assert x["spread"]["misses"] == {"min": misses[0], "median": misses[1],
                                         "max": misses[2]}
    view = metrale("simulate", *SLOT, "--requests", "300", "--seeds", "2", "--max-loras", "4",
                   "--policy", "lru")
    assert "over 2 seeds (0..1): min/median/max" in view.stdout
    for args, message in ((["--seeds", "0"], "--seeds must be positive"),
                          (["--seeds", "2", "--trace", Path(__file__)],
                           "--seeds needs a seeded workload")):
        bad = metrale("simulate", *SLOT, "--requests", "30", *args)
        assert bad.code == 2 and message in bad.stderr, bad.stderr


def test_plot_without_matplotlib_is_refused_before_the_work(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No matplotlib: one line naming the install that works from a checkout, before any
    replay (no progress line, no table), and no PNG."""
    from metrale_cli.sim import simulate as sim

    replays = []
    monkeypatch.setattr(sim, "run", lambda *a, **k: replays.append(a))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    plot = tmp_path / "sim.png"
    r = metrale("simulate", *SLOT, "--requests", "200", "--plot", plot)
    assert r.code == 3 and r.stdout == "" and not plot.exists() and replays == []
    assert r.stderr.count("\n") == 1 and "pip install -e '.[plot]'" in r.stderr


def test_a_plot_that_cannot_be_written_keeps_the_table(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The table comes first; the plot's error line follows it."""
    from metrale_cli.errors import FormatError
    from metrale_cli.sim import simulate as sim

    def fail(*_: object) -> None:
        raise FormatError("the PNG could not be written")

    monkeypatch.setattr(sim, "plot", fail)
    r = metrale("simulate", *SLOT, "--requests", "200", "--plot", tmp_path / "sim.png")
    assert r.code == 2 and "the PNG could not be written" in r.stderr
    assert r.stdout == metrale("simulate", *SLOT, "--requests", "200").stdout


def test_a_pool_its_tables_push_over_the_budget_says_so_in_bytes() -> None:
    """A budget of exactly four slots: the slots fit, their tables do not, and the two GiB
    figures are equal; the answer line gives the bytes and how many are over."""
    slot = metrale("layout", *SLOT, "--json").json()["slot_bytes"]
    args = (*SLOT, "--requests", "100", "--max-loras", "4", "--target-hit-rate", "0.01",
            "--budget", 4 * slot)
    (best,) = metrale("simulate", *args, "--policy", "lru", "--json").json()["smallest_meeting"]
    over = best["pool_bytes"] - 4 * slot
    assert best["fits_budget"] is False and over > 0
    shown = metrale("simulate", *args, "--policy", "lru").stdout
    assert (f"does NOT fit the {render.human_bytes(4 * slot)} budget "
            f"({best['pool_bytes']:,} B with its tables, {over:,} B over)") in shown


def test_cli_min_is_labelled_an_offline_bound() -> None:
    """Belady's `min` needs the future: the view and the record mark it as the offline bound,
    apart from the policies an engine runs."""
    r = metrale("simulate", *SLOT, "--workload", "zipf", "--adapters", "30", "--requests",
                "500", "--input-tokens", "0", "--output-tokens", "0", "--max-loras", "2..4",
                "--policy", "lru,min", "--target-hit-rate", "0.5")
    assert r.code == 0, r.stderr
    lines = r.stdout.splitlines()
    assert sum(bool(re.match(r"\s*min\*\s+\d", x)) for x in lines) == 3, r.stdout
    assert not any(re.match(r"\s*min\s+\d", x) for x in lines), r.stdout
    assert re.search(r"^min\*\s+Belady's offline bound \(it knows every future request, so no "
                     "engine can run it\)", r.stdout, re.M), r.stdout
    assert "min (offline bound): 3 slots" in r.stdout
    rec = metrale("simulate", *SLOT, "--workload", "zipf", "--adapters", "30", "--requests",
                  "500", "--max-loras", "2..4", "--policy", "lru,min", "--json")
    assert rec.code == 0, rec.stderr
    results = json.loads(rec.stdout)["results"]
    assert {x["policy"]: x["offline_bound"] for x in results} == {"lru": False, "min": True}


def test_progress_off_a_terminal_is_quiet_for_short_work(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Piped, a simulate of well under a second prints no progress (it printed a line at each
    tenth, however short); work that runs past the quiet time is told at each tenth."""
    from metrale_cli.cli import console

    args = ["simulate", *SLOT, "--workload", "zipf", "--adapters", 50, "--requests", 300,
            "--max-loras", 8]
    short = metrale(*args)
    assert short.code == 0 and short.stderr == "", short.stderr
    monkeypatch.setattr(console, "QUIET_S", 0.0)  # as if it had run long
    told = metrale(*args).stderr.splitlines()
    assert told and all(re.fullmatch(r"simulating: \d0% of 900 request replays", line)
                        for line in told), told


def test_a_cap_past_every_request_or_a_host_tier_past_every_adapter_changes_nothing() -> None:
    """--max-concurrency 10**20 and --host-slots 10**20 overflowed the core's int64s (exit 70):
    a cap past every request caps nothing and a host tier past every adapter holds each one,
    so each replays as the largest size that can matter."""
    def hits(*args: str) -> list[tuple[int, int, int]]:
        r = metrale("simulate", *SLOT, "--requests", "300", "--adapters", "10", "--max-loras",
                    "2,4", "--policy", "lru", "--json", *args)
        assert r.code == 0, r.stderr
        return [(x["hits"], x["misses"], x["host_hits"]) for x in r.json()["results"]]

    huge = "99999999999999999999"
    assert hits("--max-concurrency", huge) == hits()
    assert hits("--host-slots", huge) == hits("--host-slots", "10") != hits("--host-slots", "3")


def test_a_zipf_exponent_past_floating_point_sends_every_request_to_the_first_adapter() -> None:
    """--zipf-s 1e308: every weight but the first is 0, as the formula says; NumPy's overflow
    warning was a second line on stderr."""
    r = metrale("simulate", *SLOT, "--requests", "200", "--adapters", "10", "--max-loras", "2",
                "--policy", "lru", "--zipf-s", "1e308", "--json")
    assert r.code == 0 and r.stderr == "", r.stderr
    assert r.json()["workload"]["distinct_adapters"] == 1


@pytest.mark.slow
def test_adapters_no_request_names_cost_a_run_little() -> None:
    """--adapters 10,000,000 beside 300 requests took 144 s: every run made a dict of every
    adapter's name and a load time per adapter through a method call. At 2,000,000 (23 s
    before, 4 s after on an idle machine) a run's per-adapter work is NumPy's."""
    started = time.perf_counter()
    r = metrale("simulate", *SLOT, "--requests", "300", "--adapters", "2000000", "--workload",
                "uniform", "--max-loras", "2,4", "--json")
    assert r.code == 0, r.stderr
    assert r.json()["workload"]["adapters"] == 2_000_000
    assert time.perf_counter() - started < 12


# -- the work limit: the options' product, refused before any work -------------------------------


def test_a_simulation_past_the_work_limit_is_refused_before_anything_is_drawn(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each option within its own limit, their product months of replays: one line naming the
    product and the options to lower, exit 2, before a request is drawn or the pool planned."""
    from metrale_cli.sim import request

    drawn: list[object] = []
    monkeypatch.setattr(request, "generate", lambda *a: drawn.append(a))
    r = metrale("simulate", *SLOT, "--seeds", "1000", "--requests", "10000000", "--max-loras",
                "1..1000")
    one_line_error(r, 2)
    assert r.stderr == (
        "error: 30,000,000,000,000 request-replays (1,000 seeds x 3 policies x 1,000 sizes "
        "x 10,000,000 requests) is more than a simulation takes (10,000,000,000, about an "
        "hour): lower --seeds, --policy, --max-loras, --requests or the trace\n")
    assert drawn == [] and r.stdout == ""


def test_the_work_limit_counts_each_replicas_own_replay(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Over replicas, each replica's replay at a policy and size costs its set-up and result
    (50 us) however few requests it is given: 1,024 replicas routed round-robin, 1,024
    requests, 1,000 sizes, 3 policies and 1,000 seeds were 3,072,000,000 request-replays,
    within the limit, and some 40 hours of replicas' replays. Refused before any work, one
    line naming --replicas among the options to lower."""
    from metrale_cli.sim import request

    drawn: list[object] = []
    monkeypatch.setattr(request, "generate", lambda *a: drawn.append(a))
    r = metrale("simulate", *SLOT, "--seeds", "1000", "--requests", "1024", "--max-loras",
                "1..1000", "--replicas", "1024", "--route", "round-robin")
    one_line_error(r, 2)
    assert r.stderr.startswith("error: 310,272,000,000 request-replays (1,000 seeds x 3 "
                               "policies x 1,000 sizes x 1,024 requests, plus each of the "
                               "1,024 replicas' own replay")
    assert "lower --seeds, --policy, --replicas, --max-loras" in r.stderr
    assert drawn == [] and r.stdout == ""


def test_the_work_limit_counts_every_axis_and_a_run_at_it_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeds x policies x sizes x requests, and the affinity router's replicas: at the limit
    a run replays, past it each axis is refused before the first replay (the library's
    `simulate`, `SimulateRequest` and the CLI alike; a trace's requests and the default sizes
    once the workload is read or drawn)."""
    from metrale_cli.sim import replay
    from metrale_cli.sim import simulate as sim
    from metrale_cli.sim.request import SimulateRequest

    # 2 seeds x 2 policies x 3 sizes x 50 requests; with 2 affinity replicas, (2 + 2) per size.
    monkeypatch.setattr(sim, "MAX_REPLAYS", 2 * 2 * 3 * 50)
    base = dict(model="qwen3-next-80b-a3b", modules="q_proj,v_proj", max_rank=16,
                requests=50, adapter_count=10, policies=("lru", "fifo"), sizes=(2, 4, 8),
                seeds=2)
    assert len(SimulateRequest(**base).run().results) == 6
    replays: list[object] = []
    monkeypatch.setattr(replay.Replay, "run", lambda *a, **k: replays.append(a))
    for over, words in (({"seeds": 3}, "(3 seeds x 2 policies x 3 sizes x 50 requests)"),
                        ({"requests": 51}, "x 51 requests"),
                        ({"sizes": (2, 4, 8, 16)}, "x 4 sizes"),
                        ({"policies": ("lru", "fifo", "min")}, "x 3 policies"),
                        ({"replicas": 2},
                         "(2 seeds x (2 policies + 2 replicas the router weighs) x 3 sizes")):
        with pytest.raises(UsageError, match=re.escape(words)):
            SimulateRequest(**{**base, **over})
    r = metrale("simulate", *SLOT, "--requests", "50", "--adapters", "10", "--seeds", "3",
                "--policy", "lru,fifo", "--max-loras", "2,4,8")
    one_line_error(r, 2)
    # Round-robin routes without weighing the replicas, but each replica's replay costs
    # REPLICA_REPLAY beside its requests.
    with pytest.raises(UsageError, match=re.escape(
            "(2 seeds x 2 policies x 3 sizes x 50 requests, plus each of the 2 replicas' own "
            "replay at every seed, policy and size, counted as 100 requests)")):
        SimulateRequest(**{**base, "replicas": 2, "route": "round-robin"})
    # The library's simulate, on a workload already drawn, and SimulateRequest's default sizes
    # (1, 2, 4, 8, 10 over 10 adapters) are counted once the workload is drawn.
    w = generate(GeneratorSpec("zipf", 50, 10, seed=0))
    planned = SimulateRequest(**base).plan()
    with pytest.raises(UsageError, match=re.escape("(1 seed x 3 policies x 5 sizes x 50 ")):
        sim.run(w, planned.layout, sizes=[2, 4, 8, 16, 32])
    with pytest.raises(UsageError, match=re.escape("(2 seeds x 2 policies x 5 sizes x 50 ")):
        SimulateRequest(**{**base, "sizes": None}).run()
    # The CLI refuses a drawn workload's work before writing its trace.
    trace = tmp_path / "t.csv"
    r = metrale("simulate", *SLOT, "--requests", "50", "--adapters", "10", "--seeds", "2",
                "--policy", "lru,fifo", "--save-trace", trace)
    one_line_error(r, 2)
    assert "(2 seeds x 2 policies x 5 sizes x 50 requests)" in r.stderr and not trace.exists()
    w.save(trace, False)
    read = SimulateRequest(**{**base, "seeds": 1, "sizes": (2, 4, 8, 16, 32), "requests": 10**7,
                              "policies": None}, trace=trace)
    with pytest.raises(UsageError, match=re.escape("(1 seed x 3 policies x 5 sizes x 50 ")):
        read.run()
    assert replays == []
