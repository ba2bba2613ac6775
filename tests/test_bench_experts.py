"""`metrale bench kernels --experts`: the shapes, bytes and roofline model without a GPU, and
the benchmark's own buffers, tables and validation run through the host harness (the GPU run
uses the very same ExpertGroup on CuPy)."""

from __future__ import annotations

import numpy as np
import pytest

from metrale_cli import compat
from metrale_cli.bench import experts as be
from metrale_cli.ops import expert_kernels, host_harness
from tests.support.cli_runner import metrale

# The host harness is built before the first test (conftest.host_library).
pytestmark = pytest.mark.usefixtures("host_library")

TINY = be.ExpertShape("tiny", hidden=64, inter=32, experts=8, top_k=2, rank=8, tokens=5,
                      adapters=2)


def _group(shape: be.ExpertShape = TINY) -> be.ExpertGroup:
    topk, slots = be.routing(shape)
    batch = expert_kernels.plan_pairs(topk, slots, np.full(shape.adapters, shape.rank,
                                                           np.int32), shape.rank,
                                      num_experts=shape.experts)
    return be.ExpertGroup(np, np.random.default_rng(0), shape, batch, topk, slots,
                          host_harness.HOST)


@pytest.mark.slow
@pytest.mark.parametrize("proj", be.PROJECTIONS)
def test_the_benchmark_validates_its_kernels_on_the_host(proj: str) -> None:
    group = _group()
    before = group.output(proj).copy()
    group.validate(proj)
    assert np.array_equal(group.output(proj), before)  # validation leaves the buffers as found


def test_validation_fails_when_the_kernel_reads_other_weights() -> None:
    group = _group()
    name = {"gate_up": "up", "down": "down", "router": "router"}
    for proj in be.PROJECTIONS:
        a, b = group.weights[name[proj]]
        # The tables keep pointing at the old arrays: the kernel no longer computes this.
        group.weights[name[proj]] = (a, b ^ np.uint16(0x8000))  # B negated
        with pytest.raises(AssertionError):
            group.validate(proj)


def test_routing_is_real_top_k() -> None:
    shape = be.expert_shapes(("qwen3-next-80b-a3b",), (16,), (256,), (8,))[0]
    assert (shape.experts, shape.top_k, shape.hidden, shape.inter) == (512, 10, 2048, 512)
    topk, slots = be.routing(shape)
    assert topk.shape == (256, 10) and all(len(set(row)) == 10 for row in topk.tolist())
    assert sorted(set(slots.tolist())) == list(range(8))


def test_compulsory_bytes_count_each_group_once() -> None:
    shape = be.ExpertShape("m", hidden=2048, inter=768, experts=128, top_k=8, rank=16,
                           tokens=1, adapters=1)
    # One token, 8 distinct experts: 8 groups' gate and up A [16, 2048], B [768, 16], BF16;
    # x once; h [8, 1536] read and written; t [2, 8, 16] F32 written and read.
    assert be.compulsory_bytes("gate_up", shape, 8) == (
        8 * 2 * (16 * 2048 + 768 * 16) * 2 + 2048 * 2 + 8 * 1536 * 2 * 2 + 2 * 8 * 16 * 4 * 2)


def test_model_only_covers_both_models_ranks_and_paths() -> None:
    result = metrale("bench", "kernels", "--experts", "--model-only", "--json")
    assert result.code == 0, result.stderr
    records = result.json()["records"]
    assert {r["model"] for r in records} == set(be.EXPERT_MODELS)
    assert {r["rank"] for r in records} == set(be.EXPERT_RANKS)
    assert {r["tokens"] for r in records} == set(be.EXPERT_TOKENS)
    assert {r["projection"] for r in records} == set(be.PROJECTIONS)
    prefill = [r for r in records if r["tokens"] == 4096 and r["projection"] != "router"]
    assert prefill and all(r["path"] == "prefill" for r in prefill)
    for r in records:
        assert [k["kernel"].split("_")[0] for k in r["kernels"]] in (["expert", "expert"],
                                                                     ["router"])
        assert 0 < r["expected_pct_peak"] < 100


def test_model_only_view_counts_bytes_in_mib() -> None:
    """The table's compulsory bytes are MiB, as every byte amount metrale prints is (the view
    printed decimal MB beside the L2's MiB)."""
    args = ["bench", "kernels", "--experts", "--model-only", "--rank", 16, "--tokens", 1]
    record = metrale(*args, "--json").json()["records"][0]
    shown = metrale(*args, columns=120).stdout
    assert "MiB: compulsory bytes" in shown and " MB " not in shown
    header = next(line for line in shown.splitlines() if line.startswith("projection"))
    assert header.split()[5] == "MiB"
    row = next(line for line in shown.splitlines() if line.startswith(record["projection"]))
    assert row.split()[5] == f"{record['bytes'] / 2**20:.2f}"


@pytest.mark.skipif(compat.has_gpu(), reason="a GPU is present")
def test_bench_experts_needs_a_gpu() -> None:
    result = metrale("bench", "kernels", "--experts", "--tokens", 1)
    assert result.code == 3 and result.stderr.startswith("error: a GPU is needed")


@pytest.mark.parametrize("proj", be.PROJECTIONS)
def test_the_torch_baseline_computes_the_same_delta(proj: str) -> None:
    """gather + bmm (what the speedup is measured against) adds the kernels' delta."""
    group = _group()
    out = group.output(proj)
    before = out.copy()
    group.call(proj)()
    ours = out.copy()
    out[...] = before
    (baseline,) = be._torch_baseline(proj, [group])
    baseline()
    as_float = (lambda v: v) if proj == "router" else be._f64
    got, want = as_float(out), as_float(ours)
    assert not np.array_equal(got, as_float(before))
    np.testing.assert_allclose(got, want, rtol=0, atol=3e-2 * float(np.abs(want).max()))


def test_the_prefill_model_is_the_mma_launch_plan() -> None:
    """The model's prefill launches are the plans ExpertGroup makes (kernel and grid: 64 rank
    rows per shrink CTA on the mma tiles), and a pass's distinct bytes are what its loads
    bring: all of them at rank 64; at rank 8 the expand's one pass holds the CTA's 1024 rows
    of one vector each, and the shrink's m16 tiles re-read rows past the rank."""
    shape = be.ExpertShape("m", hidden=256, inter=128, experts=4, top_k=2, rank=64, tokens=64,
                           adapters=1)
    batch = be.plan(shape)
    assert batch.prefill
    group = be.ExpertGroup(np, np.random.default_rng(0), shape, batch, *be.routing(shape),
                           host_harness.HOST)
    for proj in ("gate_up", "down"):
        modelled = [(kernel, grid) for kernel, grid, _, _ in be._launches(proj, shape, batch)]
        planned = [(p.kernel.replace("_f32", "_bf16"), p.grid) for p in group.plans(proj)]
        assert modelled == planned
        assert planned[0][1][1] == 1  # rank 64: one 64-row CTA per tile, not 16 of 4 rows
    loads = 16 * 128  # bytes of one 16-byte load per thread of a CTA
    assert be.prefill_pass_bytes("shrink", 64, 8) == 18 * loads
    assert be.prefill_pass_bytes("expand", 64, 8) == 16 * loads
    assert be.prefill_pass_bytes("expand", 8, 8) == 1024 * 16
    assert be.prefill_pass_bytes("expand", 16, 8) == 1024 * 32
    assert be.prefill_pass_bytes("shrink", 8, 8) < 18 * loads
