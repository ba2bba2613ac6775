"""Split-K's serial reduction on the host harness (kernels/lora_common.cuh, split_last): every
split count, forced or planned, equals the reference; the last CTA's in-order sum is the same
in every run; the ticket counters are zero after every launch; and the shim's store visibility
makes a kernel without its counter reset or with its fence after the ticket fail."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from metrale_cli.bench import roofline
from metrale_cli.ops import costs, host_harness, kernels, plans, reference, sources
from tests.support.kernel_cases import Case, check_t, make_pool

# The host harness is built before the first test (conftest.host_library).
pytestmark = pytest.mark.usefixtures("host_library")

# K = 1000 is no multiple of most split counts: 17 splits round their chunk up to 64, so only
# 16 of them have K (the 17th is an empty trailing split); 32 splits are 32 chunks of 32.
BGMV = Case("bgmv_split", 3, 1000, 64, 16, [16, 5, 9], slots=[0, 1, -1])
# 70 tokens (2 chunks), K = 584 (9 K tiles and 8 columns): past 10 splits the trailing ones
# are empty; rank 20 beside rank 32, and a skipped slot.
SGMV = Case("sgmv_split", 70, 584, 64, 32, [32, 20], seg_starts=[0, 40, 66, 70],
            seg_slots=[1, 0, -1])
# Rank 16 alone: the last CTA reads SGMV_SPLITS_PER_TRIP splits at a time, then the rest two a
# round trip, the odd one first (7 = 4 + 1 + 2; ptxas unrolls that loop by two).
SGMV16 = Case("sgmv_rank16_split", 70, 584, 64, 16, [16, 12], seg_starts=[0, 40, 66, 70],
              seg_slots=[1, 0, -1])
BGMV_SPLITS = [1, 2, 3, 5, 8, 17, 31, 32]
SGMV_SPLITS = [1, 2, 3, 7, 9, 10, 32]
SGMV16_SPLITS = [2, 4, 7, 9, 32]


def _shrink(case: Case, splits: int | None, backend: kernels.Backend,
            x: torch.Tensor | None = None) -> torch.Tensor:
    pool = case.pool()
    a_table, _ = pool.tables()
    x = case.x() if x is None else x
    if case.slots is not None:
        return kernels.bgmv_shrink(x, case.token_slots(), a_table, pool.ranks, case.max_rank,
                                   splits=splits, backend=backend)
    seg_starts, seg_slots = case.segments()
    return kernels.sgmv_shrink(x, seg_starts, seg_slots, a_table, pool.ranks, case.max_rank,
                               splits=splits, backend=backend)


def _expected(case: Case) -> torch.Tensor:
    pool = case.pool()
    return reference.shrink(case.x(), case.token_slots(), pool.weights()[0], pool.ranks,
                            case.max_rank)


def _tickets(backend: host_harness.HostBackend) -> np.ndarray:
    return backend.workspace(None, 0, 0)[1]


# The quick tier keeps the split counts up to QUICK_SPLITS; the larger ones (the empty trailing
# splits, the read tail past one trip) take seconds each on the host harness and are slow.
QUICK_SPLITS = 5
SPLIT_CASES = [pytest.param(c, s, id=f"{c.name}-{s}",
                            marks=[pytest.mark.slow] if s > QUICK_SPLITS else [])
               for c, splits in ((BGMV, BGMV_SPLITS), (SGMV, SGMV_SPLITS),
                                 (SGMV16, SGMV16_SPLITS)) for s in splits]


@pytest.mark.parametrize(("case", "splits"), SPLIT_CASES)
def test_every_split_count_matches_the_reference_and_repeats_bit_for_bit(
        case: Case, splits: int) -> None:
    backend = host_harness.HostBackend()
    first = _shrink(case, splits, backend)
    check_t(first, _expected(case))
    # The last CTA sums the splits in split order: a second launch (on the workspace the first
    # left) gives the same bits, and leaves every ticket counter at zero.
    second = _shrink(case, splits, backend)
    assert torch.equal(first, second)
    assert not _tickets(backend).any()


@pytest.mark.slow
def test_planned_splits_of_a_long_k_match_the_reference_on_both_paths() -> None:
    """A decode batch with a long K over few tokens, which the planner splits, on the
    per-token path and on the grouped one (SGMV over the tokens sorted by slot), fused and
    not: t and y equal the reference, and the counters end at zero."""
    in_dim, max_rank = 16384, 16
    pool = make_pool(in_dim, 64, max_rank, [16, 12], set(), 0)
    a_table, b_table = pool.tables()
    a_weights, b_weights = pool.weights()
    slots = torch.tensor([0, 1, 0, 1, 1, 0, 0, 1], dtype=torch.int32)
    x = torch.randn(8, in_dim, generator=torch.Generator().manual_seed(3)).bfloat16()
    batch = plans.plan_batch(slots.numpy(), pool.ranks.numpy(), max_rank)
    assert batch.grouped
    assert costs.shrink_splits("sgmv", 8, in_dim, batch.t_cols, sources.H200_SMS,
                               len(batch.chunks)) > 1
    assert costs.shrink_splits("bgmv", 8, in_dim, max_rank, sources.H200_SMS) > 1
    expected_t = reference.shrink(x, slots, a_weights, pool.ranks, max_rank)
    backend = host_harness.HostBackend()
    check_t(kernels.bgmv_shrink(x, slots, a_table, pool.ranks, max_rank, backend=backend),
            expected_t)
    y0 = torch.zeros(8, 64)
    expected_y = reference.lora_delta(x, y0, slots, a_weights, b_weights, pool.scales,
                                      pool.ranks, max_rank)
    for plan in (None, batch):
        y = kernels.bgmv(x, y0.clone(), slots, a_table, b_table, pool.scales, pool.ranks,
                         max_rank, batch=plan, backend=backend)
        torch.testing.assert_close(y, expected_y, **_y_tolerance(plan))
        fused = kernels.bgmv_fused(x, torch.zeros(8, 128), [0, 64, 128], slots,
                                   torch.stack([a_table, a_table]),
                                   torch.stack([b_table, b_table]), pool.scales, pool.ranks,
                                   max_rank, batch=plan, backend=backend)
        for z in range(2):
            torch.testing.assert_close(fused[:, 64 * z:64 * (z + 1)], expected_y,
                                       **_y_tolerance(plan))
    assert not _tickets(backend).any()


@pytest.mark.parametrize(("kind", "tokens", "in_dim", "rank", "adapters"), [
    ("bgmv", 8, 16384, 16, 8),  # the per-token path, split 8 ways
    ("sgmv", 8, 4096, 16, 1),  # grouped decode at rank 16: 4 splits a read round trip
    ("sgmv", 256, 2048, 64, 1),  # grouped decode at rank 64: 2 splits a read round trip
])
def test_the_model_charges_the_reduction_the_launch_makes(kind: str, tokens: int, in_dim: int,
                                                          rank: int, adapters: int) -> None:
    """The roofline model's split shrink is the launch the launchers make: one kernel node (no
    memset), its partials' bytes twice the workspace the launcher sizes (written, then read
    back), and the last CTA's ticket and reads on its critical path."""
    work = roofline.plan_launch("shrink", tokens, adapters, rank, in_dim, 4096, sources.H200_SMS)
    assert work.splits > 1 and work.launches == 1
    floats, tickets = plans.split_workspace(work.kernel, work.grid, work.splits)
    assert costs.split_partial_bytes(kind, tickets, work.splits) == 2 * 4 * floats
    assert work.cta_chains == 2 + costs.split_reduction_round_trips(kind, work.splits, rank)
    unsplit = costs.shrink_cost_us(kind, tokens, in_dim, rank, 1, sources.H200_SMS,
                                   None if kind == "bgmv" else work.grid[1])
    split = costs.shrink_cost_us(kind, tokens, in_dim, rank, work.splits, sources.H200_SMS,
                                 None if kind == "bgmv" else work.grid[1])
    assert split < unsplit


def _y_tolerance(plan: plans.BatchPlan | None) -> dict[str, float]:
    # The SGMV expand rounds t to BF16 for the tensor cores (reference.TOLERANCES).
    rtol, atol = reference.TOLERANCES[("sgmv" if plan else "bgmv", torch.float32)]
    return {"rtol": rtol, "atol": atol}


TICKET = "  if (threadIdx.x == 0) *ticket = atomicAdd(&tickets[tile], 1u);\n"
RESET = "    if (threadIdx.x == 0) tickets[tile] = 0u;"
FENCE = ("  __threadfence();  // this thread's partial stores are visible device-wide before the "
         "ticket\n")
MUTATIONS = {
    "no_reset": [(RESET, "")],
    "fence_after_ticket": [(FENCE, ""), (TICKET, TICKET + FENCE)],
}


def _mutated(tmp_path: Path, edits: list[tuple[str, str]]) -> Path:
    directory = tmp_path / "kernels"
    shutil.copytree(sources.find_kernel_dir(), directory)
    common = directory / "lora_common.cuh"
    text = common.read_text()
    for old, new in edits:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    common.write_text(text)
    return directory


@pytest.mark.proc
@pytest.mark.parametrize("case", [BGMV, SGMV], ids=["bgmv", "sgmv"])
@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_a_broken_reduction_fails(case: Case, mutation: str, tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """What the tests above check goes wrong on the two ways to break the design: the last
    CTA not resetting its counter (the next launch's tickets never reach the last), or a
    split's partials not fenced before its ticket (the shim lands them after the launch, as a
    GPU may, and fails the last CTA's read of one)."""
    directory = _mutated(tmp_path, MUTATIONS[mutation])
    monkeypatch.setenv("METRALE_KERNEL_DIR", str(directory))
    backend = host_harness.HostBackend()
    expected = _expected(case)
    if mutation == "no_reset":
        # The host backend checks the counters after every split launch (kernels.check_tickets).
        with pytest.raises(RuntimeError, match=r"left \d+ split-K ticket counter\(s\) non-zero"):
            _shrink(case, 4, backend)
        return
    if mutation == "fence_after_ticket":
        # The last CTA reads a partial another split stored and has not fenced: named.
        with pytest.raises(RuntimeError, match=r"__ldcg of partials\[\d+\].* had not fenced"):
            _shrink(case, 4, backend)
        return
    first = _shrink(case, 4, backend)
    second = _shrink(case, 4, backend)
    broken = (_tickets(backend).any() or torch.isnan(first).any() or torch.isnan(second).any()
              or not torch.allclose(first, expected, rtol=1e-3, atol=1e-3)
              or not torch.allclose(second, expected, rtol=1e-3, atol=1e-3))
    assert broken


# --- the workspace: one per stream, its counters checked, CUDA graph captures ---------------------


def _against_reference(case: Case, backend: kernels.Backend, seed: int) -> bool:
    """Whether a split shrink of a fresh x (`seed`) on `backend` equals the reference."""
    x = case.x(seed)
    pool = case.pool()
    got = _shrink(case, 4, backend, x)
    want = reference.shrink(x, case.token_slots(), pool.weights()[0], pool.ranks, case.max_rank)
    return bool(torch.allclose(got, want, rtol=1e-3, atol=1e-3))


@pytest.mark.parametrize("case", [BGMV, SGMV], ids=["bgmv", "sgmv"])
def test_a_stray_count_is_caught_and_does_not_corrupt_later_launches(
        case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = host_harness.HostBackend()
    assert _against_reference(case, backend, 1)
    _tickets(backend)[0] = 1  # one stray count, as a killed launch or a buggy caller leaves
    # A fixed schedule (round-robin): under some random ones the split that draws the early
    # "last" ticket reads a partial not yet fenced, and the shim names that race first (seed
    # 222 did, as the 222nd launch of a worker's process).
    with monkeypatch.context() as fixed, pytest.raises(
            RuntimeError, match=r"left 1 split-K ticket counter\(s\) non-zero "
                                r"\(tile 0: 1\).*the workspace is released"):
        fixed.setenv("METRALE_HOST_SEED", "0")
        _shrink(case, 4, backend, case.x(2))
    # The poisoned workspace is gone: three launches with fresh x each are right.
    assert all(_against_reference(case, backend, seed) for seed in (3, 4, 5))
    assert not _tickets(backend).any()


def test_the_counters_are_checked_in_debug_mode_where_a_backend_does_not(
        monkeypatch: pytest.MonkeyPatch) -> None:
    class Unchecked(host_harness.HostBackend):
        checks_tickets = False  # as CupyBackend: no host copy after a launch by default

    backend = Unchecked()
    _shrink(BGMV, 4, backend)
    _tickets(backend)[0] = 1
    monkeypatch.delenv("METRALE_DEBUG", raising=False)
    _shrink(BGMV, 4, backend)  # unchecked: the stray count goes unseen
    assert _tickets(backend)[0] == 1
    monkeypatch.setenv("METRALE_DEBUG", "1")
    # The stray count is named by the debug check, or first by the shim (under some CTA
    # schedules it makes a CTA read partials another split has not fenced yet).
    with pytest.raises(RuntimeError, match="ticket counter|had not fenced"):
        _shrink(BGMV, 4, backend)


def test_each_stream_has_its_own_workspace() -> None:
    backend = host_harness.HostBackend()
    held = {}
    for stream in ("s1", "s2"):
        with backend.on_stream(stream):
            assert _against_reference(SGMV, backend, 1)
            held[stream] = backend.workspace(None, 0, 0)
    one, two = held["s1"], held["s2"]
    assert plans.address(one[0]) != plans.address(two[0])
    assert plans.address(one[1]) != plans.address(two[1])
    with backend.on_stream("s1"):
        assert backend.workspace(None, 0, 0)[1] is one[1]  # kept for the stream's next launch


def test_a_capture_allocates_nothing_and_its_workspace_never_grows() -> None:
    backend = host_harness.HostBackend()
    with backend.capture(), pytest.raises(RuntimeError, match="being captured into a CUDA "
                                                              "graph.*warm it up"):
        _shrink(BGMV, 4, backend)
    _shrink(BGMV, 4, backend)  # warmed up outside the capture
    with backend.capture():
        assert _against_reference(BGMV, backend, 2)  # the warm workspace serves the capture
        assert _against_reference(BGMV, backend, 3)
    with pytest.raises(RuntimeError, match="captured into a CUDA graph.*would free memory the "
                                           "graph still writes"):
        _shrink(BGMV, 8, backend)  # more splits: a larger workspace than the graph's
    backend.release_workspace()  # the graph is gone
    _shrink(BGMV, 8, backend)
    with backend.on_stream("other"):
        _shrink(BGMV, 8, backend)  # another stream's workspace was never captured


def test_a_rank_16_split_stores_only_the_columns_that_hold_rank_rows() -> None:
    """An SGMV split shrink whose rank rows lie in a tile's first 16 columns stores 2 of its
    partial tile's 8 column groups (the others are zeros in every split): the workspace's
    partials (NaN when allocated, on the host backend) keep NaN in the other 6, and t equals
    the reference."""
    backend = host_harness.HostBackend()
    splits = 4
    t = _shrink(SGMV16, splits, backend)
    check_t(t, _expected(SGMV16))
    # 3 chunks: slot 1 (rank 16), slot 0 (rank 12), slot -1 (skipped: stored as zeros by split
    # 0 alone, nothing in the workspace).
    grid = plans.launch_grid("sgmv_shrink", 3, SGMV16.in_dim, 16, splits)
    floats, _ = plans.split_workspace("sgmv_shrink", grid, splits)
    # (split, tile, column group, fragment value, thread), as kernels/sgmv.cu lays them out.
    partials = backend.workspace(None, 0, 0)[0][:floats].reshape(splits, 3, 8, 4, 128)
    assert not np.isnan(partials[:, :2, :2]).any()
    assert np.isnan(partials[:, :2, 2:]).all() and np.isnan(partials[:, 2]).all()
