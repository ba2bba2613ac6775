"""The simulator's host tier (against a two-tier LRU written plainly) and adapters of their own
size (S-LoRA's rank cycle against its suite definition, a trace's rank column)."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale_cli.errors import FormatError, UsageError
from metrale_cli.sim.costs import HostTier, Link, SwapCost
from metrale_cli.sim.replay import Replay
from metrale_cli.sim.simulate import adapter_load_bytes
from metrale_cli.sim.workload import SLORA_RANKS, GeneratorSpec, Workload, generate, read_trace
from tests.support.cli_runner import metrale

SLOT = ["--model", "qwen3-next-80b-a3b", "--modules", "q_proj,v_proj", "--max-rank", "64"]
COST = SwapCost(slot_bytes=6400, bytes_per_s=6.4e6, latency_s=0.0, bandwidth="test")  # 1 ms
DISK = Link("disk", 6.4e5, 0.0)  # a whole slot in 10 ms


def paging(refs: list[int], ranks: list[int] | None = None) -> Workload:
    n = len(refs)
    count = max(refs, default=-1) + 1
    return Workload(
        adapters=tuple(f"a{i}" for i in range(count)), adapter=np.array(refs, dtype=np.int64),
        arrival=np.arange(n, dtype=np.float64) * 100.0, input_tokens=np.zeros(n, dtype=np.int64),
        output_tokens=np.zeros(n, dtype=np.int64), duration=np.zeros(n),
        adapter_rank=None if ranks is None else np.array(ranks[:count], dtype=np.int64))


def two_tier_lru(refs: list[int], gpu_slots: int, host_slots: int,
                 size: list[int]) -> dict[str, int]:
    """GPU slots and host memory, each a plain LRU: a request moves its adapter up in host
    memory when it is there; a GPU miss copies it from host memory, or reads it from disk into
    host memory first (evicting host memory's least recently used)."""
    gpu: OrderedDict[int, None] = OrderedDict()
    host: OrderedDict[int, None] = OrderedDict()
    out = dict(hits=0, misses=0, host_hits=0, host_misses=0, bytes_moved=0, host_bytes_moved=0)
    for a in refs:
        if a < 0:
            continue
        if a in host:
            host.move_to_end(a)
        if a in gpu:
            gpu.move_to_end(a)
            out["hits"] += 1
            continue
        out["misses"] += 1
        out["bytes_moved"] += size[a]
        if a in host:
            out["host_hits"] += 1
        else:
            out["host_misses"] += 1
            out["host_bytes_moved"] += size[a]
            if len(host) == host_slots:
                host.popitem(last=False)
            host[a] = None
        if len(gpu) == gpu_slots:
            gpu.popitem(last=False)
        gpu[a] = None
    return out


@settings(max_examples=300, deadline=None)
@given(refs=st.lists(st.integers(-1, 9), min_size=1, max_size=100),
       gpu_slots=st.integers(1, 6), host_slots=st.integers(1, 8),
       ranks=st.lists(st.sampled_from([0, 8, 16, 32, 64]), min_size=10, max_size=10))
def test_two_tiers_against_a_plain_two_tier_lru(refs: list[int], gpu_slots: int,
                                                host_slots: int, ranks: list[int]) -> None:
    w = paging(refs, ranks)
    size = adapter_load_bytes(w, 64, COST.slot_bytes)
    rp = Replay(w, np.zeros(len(refs)), COST, (), None, size, HostTier(host_slots, DISK))
    r = rp.run("lru", gpu_slots)
    want = two_tier_lru(refs, gpu_slots, host_slots, size)
    assert {k: getattr(r, k) for k in want} == want
    assert r.host_hits + r.host_misses == r.misses


def test_a_host_miss_reads_from_disk_then_copies() -> None:
    """a0 at t=0: read from disk (10 ms) then copied (1 ms); a1 evicts a0 from the one GPU slot
    at t=100; a0 at t=200 is in host memory: the copy alone."""
    w = paging([0, 1, 0])
    r = Replay(w, np.zeros(3), COST, (), None, None, HostTier(2, DISK)).run("lru", 1)
    np.testing.assert_allclose(r.start - w.arrival, [0.011, 0.011, 0.001])
    assert (r.host_misses, r.host_hits, r.host_bytes_moved) == (2, 1, 2 * 6400)
    with pytest.raises(UsageError, match="--host-slots must be positive"):
        HostTier(0, DISK)


def test_an_adapter_moves_its_share_of_the_slot() -> None:
    """Rank 8 in a rank-64 pool moves an eighth of a slot; unknown ranks move all of it; an
    adapter above the pool's max rank cannot be served."""
    w = paging([0, 1, 2, 0], ranks=[8, 0, 32])
    assert adapter_load_bytes(w, 64, 6400) == [800, 6400, 3200]
    r = Replay(w, np.zeros(4), COST, (), None, adapter_load_bytes(w, 64, 6400)).run("lru", 1)
    assert r.bytes_moved == 800 + 6400 + 3200 + 800
    assert r.swap_s == pytest.approx((800 + 6400 + 3200 + 800) / 6.4e6)
    np.testing.assert_allclose(r.start - w.arrival, [1 / 8000, 1e-3, 5e-4, 1 / 8000])
    with pytest.raises(UsageError, match=r"1 requested adapter above the pool's max rank 16 "
                                         r"\(first 'a2', rank 32\)"):
        adapter_load_bytes(w, 16, 6400)


# S-LoRA benchmarks/exp_suite.py LORA_DIR and run_exp.py get_adapter_dirs, restated: the server
# registers `{dir}-{i}` for i in range(n // len(dirs) + 1), for each dir in order, and request
# adapter k is entry k of that list.
SLORA_LORA_DIR = {
    "S1": ["dummy-lora-7b-rank-8"],
    "S2": ["dummy-lora-7b-rank-64", "dummy-lora-7b-rank-32", "dummy-lora-7b-rank-16",
           "dummy-lora-7b-rank-8"],
    "S3": ["dummy-lora-13b-rank-16"],
    "S4": ["dummy-lora-13b-rank-64", "dummy-lora-13b-rank-32", "dummy-lora-13b-rank-16"],
}


def slora_adapter_ranks(setting: str, num_adapters: int) -> list[int]:
    dirs = SLORA_LORA_DIR[setting]
    registered = [f"{d}-{i}" for i in range(num_adapters // len(dirs) + 1) for d in dirs]
    return [int(name.split("-rank-")[1].split("-")[0]) for name in registered[:num_adapters]]


@pytest.mark.parametrize("setting", sorted(SLORA_LORA_DIR))
@pytest.mark.parametrize("num_adapters", [1, 5, 100, 2000])
def test_slora_rank_cycle_is_the_suites(setting: str, num_adapters: int) -> None:
    w = generate(GeneratorSpec("slora", 50, adapters=num_adapters, ranks=SLORA_RANKS[setting]))
    assert w.adapter_rank is not None
    assert w.adapter_rank.tolist() == slora_adapter_ranks(setting, num_adapters)


def test_trace_rank_column(tmp_path: Path) -> None:
    p = tmp_path / "t.csv"
    p.write_text("timestamp,adapter,rank\n0,a,8\n1,b,\n2,a,8\n3,,\n")
    w = read_trace(p)
    assert w.adapter_rank is not None and w.adapter_rank.tolist() == [8, 0]
    w.save(tmp_path / "back.csv", force=False)
    assert read_trace(tmp_path / "back.csv").adapter_rank.tolist() == [8, 0]
    bad = tmp_path / "bad.csv"
    bad.write_text("timestamp,adapter,rank\n0,a,8\n1,a,16\n")
    with pytest.raises(FormatError, match=r"adapter 'a' is given rank 8 and rank 16"):
        read_trace(bad)
    r = metrale("simulate", *SLOT[:4], "--max-rank", "4", "--trace", p)
    assert r.code == 2 and "above the pool's max rank 4 (first 'a', rank 8)" in r.stderr


def test_cli_host_tier_and_ranks() -> None:
    r = metrale("simulate", *SLOT, "--workload", "slora", "--adapters", "40", "--ranks",
                "slora:S2", "--host-slots", "10", "--requests", "400", "--rate", "2",
                "--max-loras", "4,8", "--policy", "lru", "--json")
    assert r.code == 0, r.stderr
    rec = r.json()
    assert rec["workload"]["adapter_ranks"] == {"8": 10, "16": 10, "32": 10, "64": 10}
    assert rec["host"]["slots"] == 10 and rec["host"]["bandwidth"] == "nvme"
    for x in rec["results"]:
        assert x["host_hits"] + x["host_misses"] == x["misses"] and x["host_misses"] > 0
        assert 0 < x["bytes_moved"] < x["misses"] * rec["swap"]["slot_bytes"]
    view = metrale("simulate", *SLOT, "--workload", "slora", "--adapters", "40", "--ranks",
                   "64,8", "--host-slots", "10", "--requests", "400", "--max-loras", "4")
    assert "10 adapters in host memory" in view.stdout and "from\n" not in view.stdout[:10]
    assert "20 at rank 8, 20 at rank 64" in view.stdout
    for args, message in ((["--host-slots", "0"], "--host-slots must be positive"),
                          (["--ranks", "slora:S9"], "S-LoRA settings are S1, S2, S3, S4"),
                          (["--ranks", "8,x"], "--ranks: expected ranks like"),
                          (["--ranks", "0"], "--ranks must be positive"),
                          # Past int64: an OverflowError, exit 70.
                          (["--ranks", "4,99999999999999999999"],
                           "--ranks must be below 2**53, got 99,999,999,999,999,999,999"),
                          (["--host-slots", "4", "--host-bandwidth", "warp"],
                           "--host-bandwidth: 'warp' is neither a preset")):
        bad = metrale("simulate", *SLOT, "--requests", "50", *args)
        assert bad.code == 2 and message in bad.stderr, (args, bad.stderr)
        assert len(bad.stderr.strip().splitlines()) == 1


def test_max_rank_options_trade_slots_for_adapters() -> None:
    """Per max rank the adapters have: the slot the planner makes at that rank, the slots a
    budget holds, and the adapters (and requests) above it."""
    from metrale_cli.layout.plan import PoolPlan, plan_layouts
    from metrale_cli.layout.slot_layout import SlotLayout
    from metrale_cli.model.modules import LoraModule
    from metrale_cli.model.resolve import resolve_model
    from metrale_cli.sim.simulate import max_rank_options

    model = resolve_model("qwen3-8b")
    modules = LoraModule.parse_list("q_proj,v_proj")
    layout, _ = plan_layouts(model, [], modules, 64)
    w = paging([0, 1, 2, 3, 0, 0, 2], ranks=[8, 64, 16, 0])
    options = max_rank_options(w, layout, None, 1 << 30)
    assert [o["max_rank"] for o in options] == [8, 16, 64]
    for o in options:
        lower = SlotLayout.build(model, modules, o["max_rank"])
        assert o["slot_bytes"] == lower.slot_bytes
        assert o["slots_in_budget"] == PoolPlan.sized(lower, None, budget_bytes=1 << 30).max_loras
    # Shut out: above the max rank, or of unknown rank below the pool's (it may need it all).
    assert [(o["adapters_shut_out"], o["requests_shut_out"]) for o in options] == [
        (3, 4), (2, 2), (0, 0)]
    assert max_rank_options(paging([0, 1]), layout, None, None) is None
