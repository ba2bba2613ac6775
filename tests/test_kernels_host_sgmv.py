"""The SGMV kernels' work list and pipelines on the host harness: segments cut into chunks of at
most 64 positions (plans.segment_chunks), one CTA per (chunk, column tile), and the cp.async
stages that the shim runs with their PTX meaning (a copy lands at the wait that completes it;
its destination holds NaN until then), so a pipeline that reads a stage too early fails here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from metrale_cli.ops import costs, host_harness, plans, reference, sources
from tests.support.kernel_cases import (
    DECODE_BATCHES,
    FUSED_WIDTHS,
    SGMV_CASES,
    Case,
    check_slices,
    check_t,
    check_y,
    fused_pools,
    fused_tables,
)
from tests.support.mutated_kernels import run_mutated, sgmv_stage_probe, stage_race

# The host harness is built before the first test (conftest.host_library).
pytestmark = pytest.mark.usefixtures("host_library")


def _chunks(starts: list[int], slots: list[int]) -> list[list[int]]:
    return plans.segment_chunks(np.asarray(starts, dtype=np.int32),
                                np.asarray(slots, dtype=np.int32), starts[-1]).tolist()


def test_segments_are_cut_into_chunks_of_at_most_64_positions() -> None:
    # 3 positions before the first segment (slot -1, so the shrink writes their t rows), an
    # empty segment (no chunk), one of 1 position, one of 130 (64 + 64 + 2).
    assert _chunks([3, 5, 5, 6, 136], [7, 8, 9, 4]) == [
        [0, 3, -1, 0], [3, 5, 7, 0], [5, 6, 9, 0],
        [6, 70, 4, 0], [70, 134, 4, 0], [134, 136, 4, 0]]
    # Every position in exactly one chunk, in order; no chunk for an empty batch.
    starts = [0, 1, 65, 65, 200, 201, 1000]
    chunks = np.asarray(_chunks(starts, [0, 1, 2, 3, 4, 5]))
    assert (chunks[1:, 0] == chunks[:-1, 1]).all() and chunks[-1, 1] == 1000
    assert ((chunks[:, 1] - chunks[:, 0] >= 1) & (chunks[:, 1] - chunks[:, 0] <= 64)).all()
    assert len(chunks) == sum(-(-(b - a) // 64) for a, b in zip(starts, starts[1:], strict=False))
    assert plans.segment_chunks(np.zeros(1, np.int32), np.zeros(0, np.int32), 0).shape == (0, 4)


@pytest.mark.parametrize(("chunk", "message"), [
    ([0, 0, 0, 0], r"chunks\[0\] = positions \[0, 0\)"),  # empty
    ([0, 65, 0, 0], "1 to 64 positions"),  # too long for one CTA
    ([60, 71, 0, 0], r"within \[0, 70\)"),  # past the batch
    ([-1, 3, 0, 0], r"\[-1, 3\)"),
])
def test_work_lists_the_kernels_cannot_index_are_refused(chunk: list[int], message: str) -> None:
    t = torch.zeros(70, 16)
    y = torch.zeros(70, 64, dtype=torch.bfloat16)
    table = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match=message):
        plans.plan_sgmv_expand(t, torch.tensor([chunk], dtype=torch.int32), table,
                               torch.ones(1), torch.ones(1, dtype=torch.int32), y, 16)
    with pytest.raises(ValueError, match="chunks must have shape"):
        plans.plan_sgmv_expand(t, torch.tensor(chunk, dtype=torch.int32), table, torch.ones(1),
                               torch.ones(1, dtype=torch.int32), y, 16)


@pytest.mark.parametrize(("chunks", "message"), [
    ([[0, 4, 0, 0], [0, 4, 0, 0]], r"chunks\[1\] starts at position 0, before chunks\[0\] ends"),
    ([[0, 4, 0, 0], [2, 6, 1, 0]], "must not overlap"),
    ([[8, 12, 0, 0], [0, 4, 0, 0]], "must be in order"),
])
def test_chunks_that_would_race_are_refused(chunks: list[list[int]], message: str) -> None:
    # Two CTAs over one row add into y without atomics: on a GPU one update is lost.
    t = torch.zeros(16, 16)
    y = torch.zeros(16, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=message):
        plans.plan_sgmv_expand(t, torch.tensor(chunks, dtype=torch.int32),
                               torch.zeros(1, dtype=torch.int64), torch.ones(1),
                               torch.ones(1, dtype=torch.int32), y, 16)


@pytest.mark.parametrize(("order", "message"), [
    ([0, 1, 2, 8], r"token_order\[3\] = 8 is outside \[0, 4\)"),
    ([0, -1, 2, 3], r"token_order\[1\] = -1"),
    ([0, 1, 1, 3], "repeats a token"),
])
def test_a_token_order_that_is_no_permutation_is_refused(order: list[int], message: str) -> None:
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    t = torch.zeros(4, 16)
    chunks = torch.tensor([[0, 4, 0, 0]], dtype=torch.int32)
    with pytest.raises(ValueError, match=message):
        plans.plan_sgmv_shrink(x, chunks, torch.zeros(1, dtype=torch.int64),
                               torch.ones(1, dtype=torch.int32), t, 16,
                               torch.tensor(order, dtype=torch.int32))


SKEWED = next(c for c in SGMV_CASES if c.name == "skewed")


def test_the_launches_are_one_cta_row_per_chunk() -> None:
    case = SKEWED
    i = case.inputs(torch.bfloat16)
    seg_starts, seg_slots = case.segments()
    chunks = torch.from_numpy(plans.segment_chunks(seg_starts, seg_slots, case.num_tokens))
    t = torch.zeros(case.num_tokens, case.max_rank)
    shrink = plans.plan_sgmv_shrink(i.x, chunks, i.a_table, i.pool.ranks, t, case.max_rank)
    expand = plans.plan_sgmv_expand(t, chunks, i.b_table, i.pool.scales, i.pool.ranks, i.y,
                                    case.max_rank)
    # 2 uncovered positions, 3 one-token segments, 150 tokens in 3 chunks, 5 tokens.
    assert chunks.shape[0] == 8
    assert shrink.grid == (-(-case.max_rank // 64), 8, 1)
    assert expand.grid == (-(-case.out_dim // 64), 8, 1)


# The pipelines broken in a copy of kernels/: each waits for one group fewer than the tile it
# reads (cp_async_wait<STAGES> instead of <STAGES - 1>), so the tile is read before its copies
# complete. On a GPU that is a race that may pass; the shim makes it fail every time.
READ_TOO_EARLY = sgmv_stage_probe("from tests.support.kernel_cases import SGMV_CASES; "
                                "case = SGMV_CASES[0]")


@pytest.mark.proc
def test_a_stage_read_before_its_wait_fails_on_the_host(tmp_path: Path) -> None:
    # The shrink's and the expand's wait.
    result = run_mutated(tmp_path, [("sgmv.cu", r"cp_async_wait<(SGMV_\w+_STAGES) - 1>",
                                     r"cp_async_wait<\1>", 2)], READ_TOO_EARLY,
                         keep=("sgmv.cu",))
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout)
    assert stage_race(outcome["t"], "sgmv_shrink"), outcome
    assert stage_race(outcome["y"], "sgmv_expand_f32"), outcome


@pytest.mark.parametrize("out_tiles", [2, 3])
@pytest.mark.parametrize("name", ["segments", "skewed"])
def test_an_expand_cta_over_several_output_tiles_matches_reference(name: str,
                                                                     out_tiles: int) -> None:
    # 136 outputs are 3 tiles of 64: 2 a CTA leaves the last CTA one (a short last column), 3
    # one CTA for all; the skewed case streams 4 rank chunks per output tile through the
    # pipeline, so output tiles change inside it.
    case = next(c for c in SGMV_CASES if c.name == name)
    i = case.inputs(torch.bfloat16)
    seg_starts, seg_slots = case.segments()
    chunks = torch.from_numpy(plans.segment_chunks(seg_starts, seg_slots, case.num_tokens))
    t = reference.shrink(i.x, i.slots, i.a_weights, i.pool.ranks, case.max_rank)
    plan = plans.plan_sgmv_expand(t, chunks, i.b_table, i.pool.scales, i.pool.ranks, i.y,
                                  case.max_rank, out_tiles=out_tiles)
    assert plan.grid[0] == {2: 2, 3: 1}[out_tiles]
    host_harness.launch(plan)
    expected = reference.lora_delta(i.x, i.y0, i.slots, i.a_weights, i.b_weights,
                                    i.pool.scales, i.pool.ranks, case.max_rank)
    check_y(i.y, i.y0, expected, case, "sgmv")


def test_small_chunks_take_several_output_tiles_a_cta() -> None:
    # A segment per token (4096 chunks of one row) over 8192 outputs: a CTA per (chunk, 64
    # outputs) would move one 2 KiB B tile after its metadata; the planner gives each CTA more.
    assert costs.expand_out_tiles(4096, 8192, 16, 132) > 1
    # 64 full chunks over the same outputs fill the device either way; one wave of CTAs.
    tiles = costs.expand_out_tiles(64, 8192, 64, 132)
    assert -(-128 // tiles) * 64 <= 132 * sources.min_ctas_per_sm("sgmv_expand_bf16")
    with pytest.raises(ValueError, match="out_tiles must be in"):
        plans.plan_sgmv_expand(torch.zeros(4, 16), torch.tensor([[0, 4, 0, 0]], dtype=torch.int32),
                               torch.zeros(1, dtype=torch.int64), torch.ones(1),
                               torch.ones(1, dtype=torch.int32),
                               torch.zeros(4, 64, dtype=torch.bfloat16), 16, out_tiles=0)


# --- fused slices (kernels.sgmv_fused; bgmv_fused on a grouped batch) --------------------------

class Recording:
    """The host backend, keeping the kernels it launches."""

    def __init__(self) -> None:
        self.kernels: list[str] = []

    def launch(self, plan: plans.KernelLaunch) -> None:
        self.kernels.append(plan.kernel)
        host_harness.HOST.launch(plan)

    def __getattr__(self, name: str) -> object:
        return getattr(host_harness.HOST, name)


# A long K over few chunks, which the planner splits for the fused shrink's CTAs (22 splits).
LONG_K = Case("long_k", 6, 4096, 64, 32, [32, 20], seg_starts=[1, 4, 6], seg_slots=[1, 0])
FULL_SHAPES = {"skewed", "split_k", "long_k"}


@pytest.mark.parametrize("y_dtype", [torch.bfloat16, torch.float32], ids=["y_bf16", "y_f32"])
@pytest.mark.parametrize("case", [
    # The quick tier keeps the small shapes; the large ones take seconds each here: slow.
    pytest.param(c, id=c.name, marks=[pytest.mark.slow] if c.name in FULL_SHAPES else [])
    for c in [*SGMV_CASES, LONG_K]])
def test_sgmv_fused_matches_reference_per_slice(case: Case, y_dtype: torch.dtype) -> None:
    """Prefill's fused slices on every segment shape (tokens outside all segments, empty,
    1-token, straddling and skewed segments, split-K as given and as planned): one shrink and
    one expand launch, each slice's t plane and y columns as its own (layer, module) delta."""
    pools = fused_pools(case)
    a_tables, b_tables = fused_tables(pools)
    x, slots = case.x(), case.token_slots()
    seg_starts, seg_slots = case.segments()
    generator = torch.Generator().manual_seed(3)
    y = torch.randn(case.num_tokens, sum(FUSED_WIDTHS), generator=generator).to(y_dtype)
    y0 = y.clone()
    backend = Recording()
    cols = [0, *np.cumsum(FUSED_WIDTHS).tolist()]
    chunks = torch.from_numpy(plans.segment_chunks(seg_starts, seg_slots, case.num_tokens))
    planned = costs.shrink_splits("sgmv", case.num_tokens, case.in_dim, 3 * case.max_rank,
                                  case.num_sms, len(chunks))
    # LONG_K is split; with no memset to pay, a short K over few chunks may be too.
    assert planned > 1 or case is not LONG_K
    host_harness.sgmv_fused(x, y, cols, seg_starts, seg_slots, a_tables, b_tables,
                            pools[0].scales, pools[0].ranks, case.max_rank,
                            num_sms=case.num_sms, backend=backend)
    y_kind = "bf16" if y_dtype == torch.bfloat16 else "f32"
    assert backend.kernels == ["sgmv_shrink", f"sgmv_expand_{y_kind}"]
    check_slices(case, pools, x, y, y0, slots, "sgmv")

    # t per slice, the case's split-K count included (split: the last split of each tile
    # writes its slice's plane, NaN before: no zeroing).
    t = torch.full((3, case.num_tokens, case.max_rank), float("nan"))
    splits = case.num_splits or 1
    grid = (-(-3 * case.max_rank // 64), len(chunks), splits)
    workspace = (host_harness.HOST.workspace(x, *plans.split_workspace("sgmv_shrink", grid,
                                                                      splits))
                 if splits > 1 else None)
    shrink = plans.plan_sgmv_shrink(x, chunks, a_tables, pools[0].ranks, t, case.max_rank,
                                    splits=splits, workspace=workspace)
    assert shrink.grid == grid
    host_harness.launch(shrink)
    for z, pool in enumerate(pools):
        check_t(t[z], reference.shrink(x, slots, pool.weights()[0], pool.ranks, case.max_rank))


# Grouped batches, the SMs planned for, the slices' widths, and whether grouped_expand sends the
# fused expand through SGMV: narrow slices fill one SM's SGMV CTAs, while 1024 outputs over 8
# tokens on one SM take the per-token expand.
GROUPED_FUSED = [*((case, 132, FUSED_WIDTHS, True) for case in DECODE_BATCHES),
                 (DECODE_BATCHES[2], 1, (512, 256, 256), False)]


@pytest.mark.parametrize(("case", "num_sms", "widths", "sgmv_expand"), GROUPED_FUSED,
                         ids=[f"{c.name}-{n}sm-{w[0]}" for c, n, w, _ in GROUPED_FUSED])
def test_grouped_fused_decode_is_two_launches(case: Case, num_sms: int,
                                              widths: tuple[int, ...], sgmv_expand: bool) -> None:
    """A grouped batch's fused slices: the SGMV shrink over the tokens sorted by slot (token
    order) and one expand, SGMV or per token as grouped_expand picks for the slices' outputs
    together: 2 launches, not 2 per slice."""
    pools = fused_pools(case, widths)
    a_tables, b_tables = fused_tables(pools)
    x, slots = case.x(), case.token_slots()
    plan = plans.plan_batch(slots.numpy(), pools[0].ranks.numpy(), case.max_rank,
                            group_min_tokens=1)
    assert plan.grouped and (plan.order != np.arange(case.num_tokens)).any() == (
        case.name != "one_slot")
    y = torch.randn(case.num_tokens, sum(widths),
                    generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    y0 = y.clone()
    backend = Recording()
    cols = [0, *np.cumsum(widths).tolist()]
    host_harness.bgmv_fused(x, y, cols, slots, a_tables, b_tables, pools[0].scales,
                            pools[0].ranks, case.max_rank, batch=plan, num_sms=num_sms,
                            backend=backend)
    assert sgmv_expand == costs.grouped_expand(case.num_tokens, cols[-1], plan.t_cols,
                                               len(plan.chunks), num_sms)
    assert backend.kernels == ["sgmv_shrink",
                               "sgmv_expand_bf16" if sgmv_expand else "bgmv_expand_bf16"]
    check_slices(case, pools, x, y, y0, slots, "sgmv" if sgmv_expand else "bgmv")


def test_slices_whose_ranks_fit_one_tile_read_x_once_per_chunk() -> None:
    """q, k and v at rank 16 are 48 rank columns: one column tile, so a chunk's x tiles are
    streamed once for the three slices (three unfused shrinks stream them three times)."""
    x = torch.zeros(130, 64, dtype=torch.bfloat16)
    chunks = torch.tensor([[0, 64, 0, 0], [64, 128, 0, 0], [128, 130, 0, 0]], dtype=torch.int32)
    tables = torch.zeros(3, 2, dtype=torch.int64)
    fused = plans.plan_sgmv_shrink(x, chunks, tables, torch.tensor([16, 16], dtype=torch.int32),
                                   torch.zeros(3, 130, 16), 16)
    assert fused.grid == (1, 3, 1)
    with pytest.raises(ValueError, match=r"t \[S, T, t_cols\]"):
        plans.plan_sgmv_shrink(x, chunks, tables, torch.tensor([16, 16], dtype=torch.int32),
                               torch.zeros(130, 16), 16)


class Uploads(Recording):
    """The host backend, counting the host arrays it is asked to move (to the device, on a
    GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.moved = 0

    def array(self, like: Any, values: np.ndarray) -> Any:
        self.moved += 1
        return host_harness.HOST.array(like, values)


def _counting(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Count the calls of plans.`name` (a check that, on a GPU, copies its array back)."""
    calls = [0]
    checked = getattr(plans, name)

    def counted(*args: Any) -> Any:
        calls[0] += 1
        return checked(*args)

    monkeypatch.setattr(plans, name, counted)
    return calls


def test_a_batch_plan_moves_and_checks_its_work_list_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layer's grouped launches of one batch plan reuse its order and work list where
    the kernels read them: moved and checked once (BatchPlan.placed), not per launch, where
    each check of a device array is a host sync (and no CUDA graph could hold the layer)."""
    case = DECODE_BATCHES[0]
    i = case.inputs(torch.bfloat16)
    plan = plans.plan_batch(i.slots.numpy(), i.pool.ranks.numpy(), case.max_rank,
                            group_min_tokens=1)
    assert plan.grouped
    chunk_checks = _counting(monkeypatch, "check_chunks")
    order_checks = _counting(monkeypatch, "_order_arg")
    backend = Uploads()
    layers = 3
    for _ in range(layers):
        y = i.y0.clone()
        host_harness.bgmv(i.x, y, i.slots, i.a_table, i.b_table, i.pool.scales, i.pool.ranks,
                          case.max_rank, batch=plan, num_sms=132, backend=backend)
        expected = reference.lora_delta(i.x, i.y0, i.slots, i.a_weights, i.b_weights,
                                        i.pool.scales, i.pool.ranks, case.max_rank)
        check_y(y, i.y0, expected, case, "sgmv")
    assert backend.kernels == ["sgmv_shrink", "sgmv_expand_bf16"] * layers
    assert (backend.moved, chunk_checks[0], order_checks[0]) == (2, 1, 1)
    work = plan.placed("torch", lambda a: torch.from_numpy(a))
    assert plan.placed("torch", lambda a: pytest.fail("moved twice")) is work
    # Another placement (a NumPy caller here; another GPU there) gets its own copies.
    numpy_work = plan.placed("numpy", np.ascontiguousarray)
    assert numpy_work is not work and isinstance(numpy_work.chunks, np.ndarray)


@pytest.mark.slow
def test_a_caller_s_raw_work_list_is_still_checked_at_every_launch() -> None:
    case = SKEWED
    i = case.inputs(torch.bfloat16)
    seg_starts, seg_slots = case.segments()
    chunks = torch.from_numpy(plans.segment_chunks(seg_starts, seg_slots, case.num_tokens))
    racing = torch.cat([chunks, chunks[-1:]])  # the last chunk twice: two CTAs, one row
    with pytest.raises(ValueError, match="must not overlap"):
        host_harness.sgmv_shrink(i.x, seg_starts, seg_slots, i.a_table, i.pool.ranks,
                                 case.max_rank, chunks=racing)
    t = host_harness.sgmv_shrink(i.x, seg_starts, seg_slots, i.a_table, i.pool.ranks,
                                 case.max_rank, chunks=chunks)
    with pytest.raises(ValueError, match="must not overlap"):
        host_harness.sgmv_expand(t, seg_starts, seg_slots, i.b_table, i.pool.scales,
                                 i.pool.ranks, i.y, case.max_rank, chunks=racing)


def test_a_work_list_is_refused_for_another_batch_or_beside_a_token_order() -> None:
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    t = torch.zeros(4, 16)
    table, ranks = torch.zeros(1, dtype=torch.int64), torch.ones(1, dtype=torch.int32)
    order = np.array([3, 2, 1, 0], dtype=np.int32)
    work = plans.work_list(np.array([[0, 4, 0, 0]], dtype=np.int32), order, 4, torch.from_numpy)
    assert plans.plan_sgmv_shrink(x, work, table, ranks, t, 16).args[3] is work.order
    with pytest.raises(ValueError, match="give no token_order beside it"):
        plans.plan_sgmv_shrink(x, work, table, ranks, t, 16, torch.from_numpy(order))
    with pytest.raises(ValueError, match="checked for 4 tokens, the launch has 8"):
        plans.plan_sgmv_shrink(torch.zeros(8, 64, dtype=torch.bfloat16), work, table, ranks,
                               torch.zeros(8, 16), 16)
    # Made from arrays the kernels cannot index: refused when made, as a raw list at launch.
    with pytest.raises(ValueError, match="repeats a token"):
        plans.work_list(np.array([[0, 4, 0, 0]], dtype=np.int32),
                        np.array([0, 0, 1, 2], dtype=np.int32), 4, torch.from_numpy)
    with pytest.raises(ValueError, match="must not overlap"):
        plans.work_list(np.array([[0, 4, 0, 0], [2, 4, 0, 0]], dtype=np.int32), None, 4,
                        torch.from_numpy)
