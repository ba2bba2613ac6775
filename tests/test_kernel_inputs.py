"""Launch inputs the kernels' planners must take or refuse (no tokens, split counts and max ranks
outside the kernels' range, work lists that leave rows unwritten, offsets past 32 bits, expert
entries, tiles and pairs outside their tables): every one answered by its own check, naming what
is wrong, before anything is launched or allocated."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from metrale_cli.ops import expert_kernels as ek
from metrale_cli.ops import host_harness, plans

# The host harness is built before the first test (conftest.host_library).
pytestmark = pytest.mark.usefixtures("host_library")

I32 = torch.int32


def _pool(slots: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(a_table, b_table, scales, ranks) of a pool whose slots adapt nothing."""
    table = torch.zeros(slots, dtype=torch.int64)
    return table, table.clone(), torch.ones(slots), torch.zeros(slots, dtype=I32)


def test_sgmv_of_no_tokens_is_a_no_op_as_bgmv_is() -> None:
    a, b, scales, ranks = _pool()
    x = torch.zeros(0, 64, dtype=torch.bfloat16)
    y = torch.zeros(0, 64, dtype=torch.bfloat16)
    starts, slots = torch.zeros(1, dtype=I32), torch.zeros(0, dtype=I32)
    assert tuple(host_harness.sgmv_shrink(x, starts, slots, a, ranks, 16).shape) == (0, 16)
    assert host_harness.sgmv(x, y, starts, slots, a, b, scales, ranks, 16) is y
    assert tuple(host_harness.bgmv_shrink(x, slots, a, ranks, 16).shape) == (0, 16)
    # An empty NumPy work list too, whatever strides NumPy gives it: no index reads them.
    assert plans.check_chunks(np.zeros((0, 8), dtype=np.int32)[:, ::2], 0) == 0


@pytest.mark.parametrize("splits", [0, -1, 33, 2.5])
def test_a_split_count_outside_the_kernels_range_is_refused(splits: object) -> None:
    a, _, _, ranks = _pool()
    x = torch.zeros(4, 2048, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="splits must be"):
        host_harness.bgmv_shrink(x, torch.zeros(4, dtype=I32), a, ranks, 16, splits=splits)
    with pytest.raises(ValueError, match="splits must be"):
        host_harness.sgmv_shrink(x, torch.tensor([0, 4], dtype=I32), torch.zeros(1, dtype=I32),
                                 a, ranks, 16, splits=splits)


@pytest.mark.parametrize("max_rank", [0, 12, 512])
def test_a_max_rank_the_kernels_cannot_serve_is_named(max_rank: int) -> None:
    a, _, _, ranks = _pool()
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    for run in (lambda: host_harness.bgmv_shrink(x, torch.zeros(4, dtype=I32), a, ranks,
                                                 max_rank),
                lambda: host_harness.sgmv_shrink(x, torch.tensor([0, 4], dtype=I32),
                                                 torch.zeros(1, dtype=I32), a, ranks, max_rank)):
        with pytest.raises(ValueError, match=f"max_rank must be a multiple of 8 in 8..256, "
                                             f"got {max_rank}"):
            run()


@pytest.mark.parametrize(("chunks", "message"), [
    ([[0, 2, 0, 0], [4, 8, 0, 0]], r"chunks\[1\] starts at position 4, after chunks\[0\] ends "
                                   r"at 2: positions 2 to 3 are in no chunk"),
    ([[2, 8, 0, 0]], r"cover positions \[2, 8\) of \[0, 8\)"),
    ([[0, 6, 0, 0]], r"cover positions \[0, 6\) of \[0, 8\)"),
    ([], r"cover positions \[0, 0\) of \[0, 8\)"),
])
def test_a_work_list_that_leaves_t_rows_unwritten_is_refused(chunks: list[list[int]],
                                                             message: str) -> None:
    a, b, scales, ranks = _pool()
    work = torch.tensor(chunks, dtype=I32).reshape(-1, 4)
    t = torch.zeros(8, 16)
    with pytest.raises(ValueError, match=message):
        plans.plan_sgmv_expand(t, work, b, scales, ranks, torch.zeros(8, 64), 16)
    with pytest.raises(ValueError, match=message):
        host_harness.sgmv_shrink(torch.zeros(8, 64, dtype=torch.bfloat16), None, None, a, ranks,
                                 16, chunks=work)


def test_sgmv_expand_refuses_t_past_its_32_bit_offsets() -> None:
    # Meta tensors: the planner reads shapes, strides and addresses, never the 16 GiB of t.
    _, b, scales, ranks = _pool()
    tokens = 2**32 // 256
    t = torch.empty(tokens, 256, device="meta")
    y = torch.empty(tokens, 64, dtype=torch.bfloat16, device="meta")
    work = torch.zeros(1, 4, dtype=I32)
    with pytest.raises(ValueError, match="t offsets .* in 32 bits: 16,777,216 tokens x 256"):
        plans.plan_sgmv_expand(t, work, b, scales, ranks, y, 256)


def _expert_tables(**change: object) -> ek.ExpertTables:
    fields = {"a_tables": torch.zeros(3, 4, dtype=torch.int64),
              "b_tables": torch.zeros(3, 4, dtype=torch.int64),
              "gate_up": torch.tensor([[0, 1], [2, -1]], dtype=I32),
              "down": torch.tensor([[1, 2]], dtype=I32), "router": -1,
              "scale_table": torch.ones(4), "ranks": torch.full((4,), 8, dtype=I32),
              "max_rank": 8, "num_experts": 2}
    fields.update(change)
    return ek.ExpertTables(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(("change", "message"), [
    ({"gate_up": torch.tensor([[0, 3], [2, -1]], dtype=I32)}, "gate_up entry 3 .at 1."),
    ({"down": torch.tensor([[-2, 0]], dtype=I32)}, "down entry -2 .at 0."),
    ({"router": 7}, "router entry 7"),
])
def test_expert_entries_outside_the_tables_are_refused(change: dict, message: str) -> None:
    _expert_tables()  # the unchanged tables are taken
    with pytest.raises(ValueError, match=message + " is not -1 or a row of the 3-row"):
        _expert_tables(**change)


@pytest.mark.parametrize(("pairs", "tiles", "message"), [
    ([0, 1, 9], [[0, 2, 0, 0], [2, 3, 0, 1]], r"sorted_pairs\[2\] = 9 is outside the 6 pairs"),
    ([0, 1, 2], [[0, 2, 0, 0], [2, 4, 0, 1]], r"tiles\[1\] = pairs \[2, 4\) is not 0 to 2 of "
                                              "the 3 sorted pairs"),
    ([0, 1, 2], [[0, 3, 0, 0]], r"tiles\[0\] = pairs \[0, 3\) is not 0 to 2"),
    ([0, 1, 2], [[-1, 1, 0, 0]], r"tiles\[0\] = pairs \[-1, 1\)"),
])
def test_expert_tiles_and_pairs_the_kernels_cannot_index_are_refused(
        pairs: list[int], tiles: list[list[int]], message: str) -> None:
    ek.ExpertBatch(3, 2, np.asarray([0, 1, 2], np.int32),
                   np.asarray([[0, 2, 0, 0], [2, 3, 0, 1], [0, 0, 0, 0]], np.int32), 2, 8, 2)
    with pytest.raises(ValueError, match=message):
        ek.ExpertBatch(3, 2, np.asarray(pairs, np.int32), np.asarray(tiles, np.int32), 2, 8, 2)
    with pytest.raises(ValueError, match="tile must be 1..2 .* or 8"):
        ek.ExpertBatch(3, 2, np.asarray([0], np.int32), np.zeros((0, 4), np.int32), 4, 8, 0)
