"""Replicas behind a router: each its own pool, totals that add up, and the routes."""

from __future__ import annotations

import numpy as np
import pytest

from metrale_cli.errors import UsageError
from metrale_cli.sim.costs import SwapCost
from metrale_cli.sim.replay import Replay
from metrale_cli.sim.replicas import Replicas, Routing, route
from metrale_cli.sim.workload import GeneratorSpec, Workload, generate
from tests.support.cli_runner import metrale
from tests.support.hostile_inputs import one_line_error

COST = SwapCost(slot_bytes=1000, bytes_per_s=1e6, latency_s=0.0, bandwidth="test")  # 1 ms
SLOT = ["--model", "qwen3-8b", "--modules", "q_proj", "--max-rank", "8"]


def requests(refs: list[int], hold: float = 0.0) -> Workload:
    n = len(refs)
    return Workload(
        adapters=tuple(f"a{i}" for i in range(max(refs) + 1)),
        adapter=np.array(refs, dtype=np.int64), arrival=np.arange(n, dtype=np.float64),
        input_tokens=np.zeros(n, dtype=np.int64), output_tokens=np.zeros(n, dtype=np.int64),
        duration=np.full(n, hold))


def test_routes() -> None:
    w = requests([0, 1, 0, 1, 2, 0])
    hold = np.zeros(6)
    assert route(w, hold, Routing(2, "round-robin"), 1, (), None).tolist() == [0, 1, 0, 1, 0, 1]
    rnd = route(w, hold, Routing(3, "random", seed=4), 1, (), None)
    assert (rnd == route(w, hold, Routing(3, "random", seed=4), 1, (), None)).all()
    # Affinity with nothing in flight: every replica idle. Ties went to the lowest index, so
    # every request to replica 0; now a new adapter goes to the replica sent
    # the fewest requests: a1 to 1, a2 to 0 (2 each; the lower index), evicting a0 from 0's
    # one cache slot, so a0 goes to 1, sent fewer.
    assert route(w, hold, Routing(2, "affinity"), 1, (), None).tolist() == [0, 1, 0, 1, 0, 1]
    # Holding 10 s: a0 to 0; a1 to the less loaded 1; a0 and a1 back where they are; a2 to 0
    # (a tie), evicting a0 from 0's one cache slot, so a0 goes to the less loaded 1.
    held = np.full(6, 10.0)
    assert route(w, held, Routing(2, "affinity"), 1, (), None).tolist() == [0, 1, 0, 1, 0, 1]
    # A replica with no free seat (2 in flight) sends even its own adapter elsewhere.
    same = requests([0, 0, 0])
    assert route(same, np.full(3, 10.0), Routing(2, "affinity"), 1, (), 2).tolist() == [0, 0, 1]
    assert route(same, np.full(3, 10.0), Routing(2, "affinity"), 1, (), None).tolist() == [0] * 3
    for bad, message in ((lambda: Routing(0), "--replicas must be between 1 and 1,024, got 0"),
                         (lambda: Routing(2, "sticky"), "--route must be one of")):
        with pytest.raises(UsageError, match=message):
            bad()


def test_replicas_replay_their_own_requests_and_add_up() -> None:
    w = generate(GeneratorSpec("zipf", 3000, adapters=60, rate=20.0, seed=2))
    hold = w.hold_seconds(1e4, 50.0)
    reps = Replicas(w, hold, COST, (), 16, [COST.slot_bytes] * 60, None,
                    Routing(3, "round-robin"))
    total = reps.run("lru", 8)
    assert total.requests == 3000 and [x["replica"] for x in total.replicas] == [0, 1, 2]
    for k, x in enumerate(total.replicas):
        mask = np.arange(3000) % 3 == k
        sub = Workload(w.adapters, w.adapter[mask], w.arrival[mask], w.input_tokens[mask],
                       w.output_tokens[mask], w.duration[mask])
        alone = Replay(sub, hold[mask], COST, (), 16).run("lru", 8)
        assert (x["hits"], x["misses"], x["stalls"]) == (alone.hits, alone.misses, alone.stalls)
    for f in ("requests", "hits", "delayed_hits", "misses", "stalls"):
        assert getattr(total, f) == sum(x[f] for x in total.replicas)
    assert total.hits + total.delayed_hits + total.misses == total.adapter_requests


def test_affinity_routing_beats_random_on_hit_rate() -> None:
    w = generate(GeneratorSpec("zipf", 4000, adapters=400, zipf_s=1.1, rate=8.0))
    hold = w.hold_seconds(1e4, 50.0)
    rate = {r: Replicas(w, hold, COST, (), None, [1000] * 400, None, Routing(2, r))
            .run("lru", 32).hit_rate for r in ("random", "affinity")}
    assert rate["affinity"] > rate["random"] + 0.05


def test_cli_replicas() -> None:
    r = metrale("simulate", *SLOT, "--requests", "600", "--adapters", "40", "--max-loras", "4,8",
                "--policy", "lru", "--replicas", "2", "--route", "affinity", "--json")
    assert r.code == 0, r.stderr
    rec = r.json()
    assert rec["routing"] == {"replicas": 2, "route": "affinity", "seed": 0}
    assert all(len(x["replicas"]) == 2 for x in rec["results"])
    single = metrale("simulate", *SLOT, "--requests", "600", "--adapters", "40", "--max-loras",
                     "4", "--policy", "lru", "--json").json()
    assert single["routing"] is None and "replicas" not in single["results"][0]
    view = metrale("simulate", *SLOT, "--requests", "300", "--max-loras", "4", "--policy",
                   "lru", "--replicas", "2")
    assert "2, affinity routing" in view.stdout and "hit % by" in view.stdout
    bad = metrale("simulate", *SLOT, "--requests", "30", "--replicas", "0")
    assert bad.code == 2 and "--replicas must be between 1 and 1,024, got 0" in bad.stderr
    # A typo's 10**20 replicas is refused at once (the router made a queue for each replica:
    # MemoryError, exit 70 after 40 s).
    huge = metrale("simulate", *SLOT, "--requests", "30", "--replicas", "99999999999999999999")
    one_line_error(huge, 2)
    assert "--replicas must be between 1 and 1,024, got 99,999,999,999,999,999,999" in huge.stderr


def test_affinity_in_paging_mode_spreads_over_every_replica() -> None:
    """Zipf over 100 adapters, zero-length requests, 4 replicas; affinity
    sent all 2,000 requests to replica 0 and listed only it."""
    r = metrale("simulate", "--workload", "zipf", "--adapters", "100", "--requests", "2000",
                "--input-tokens", "0", "--output-tokens", "0", "--replicas", "4", "--route",
                "affinity", "--model", "llama-3.1-8b", "--modules", "q_proj", "--max-rank", "16",
                "--max-loras", "8", "--policy", "lru", "--json")
    assert r.code == 0, r.stderr
    (x,) = r.json()["results"]
    assert [p["replica"] for p in x["replicas"]] == [0, 1, 2, 3]
    sent = [p["requests"] for p in x["replicas"]]
    assert sum(sent) == 2000 and min(sent) >= 2000 // 8, sent
    # Affinity still keeps an adapter where it is held: it beats round-robin's hit rate.
    rr = metrale("simulate", "--workload", "zipf", "--adapters", "100", "--requests", "2000",
                 "--input-tokens", "0", "--output-tokens", "0", "--replicas", "4", "--route",
                 "round-robin", "--model", "llama-3.1-8b", "--modules", "q_proj", "--max-rank",
                 "16", "--max-loras", "8", "--policy", "lru", "--json").json()["results"][0]
    assert x["hit_rate"] > rr["hit_rate"]


def test_a_replica_sent_no_requests_is_listed_with_zeros() -> None:
    w = requests([0, 1])
    total = Replicas(w, np.zeros(2), COST, (), None, [1000] * 2, None,
                     Routing(3, "round-robin")).run("lru", 2)
    assert [x["replica"] for x in total.replicas] == [0, 1, 2]
    assert total.replicas[2] == {"replica": 2, "requests": 0, "adapter_requests": 0, "hits": 0,
                                 "delayed_hits": 0, "misses": 0, "hit_rate": 0.0, "stalls": 0,
                                 "added_latency_p99_s": 0.0}
    assert total.requests == sum(x["requests"] for x in total.replicas) == 2
