"""The SGMV kernels' work list and pipelines on the host harness: segments cut into chunks of at
most 64 positions (plans.segment_chunks), one CTA per (chunk, column tile), and the cp.async
stages that the shim runs with their PTX meaning (a copy lands at the wait that completes it;
its destination holds NaN until then), so a pipeline that reads a stage too early fails here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from metrale_cli.ops import host_harness, plans, reference, sources
from tests.support.kernel_cases import SGMV_CASES, check_y


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
READ_TOO_EARLY = """
import json, torch
from metrale_cli.ops import host_harness, reference
from tests.support.kernel_cases import SGMV_CASES
case = SGMV_CASES[0]
i = case.inputs(torch.float32)
starts, slots = case.segments()
t = host_harness.sgmv_shrink(i.x, starts, slots, i.a_table, i.pool.ranks, case.max_rank,
                             splits=1)
good_t = reference.shrink(i.x, i.slots, i.a_weights, i.pool.ranks, case.max_rank)
host_harness.sgmv_expand(good_t, starts, slots, i.b_table, i.pool.scales, i.pool.ranks, i.y,
                         case.max_rank)
print(json.dumps({"t_nan": bool(torch.isnan(t).any()), "y_nan": bool(torch.isnan(i.y).any())}))
"""


def test_a_stage_read_before_its_wait_fails_on_the_host(tmp_path: Path) -> None:
    directory = tmp_path / "kernels"
    shutil.copytree(sources.find_kernel_dir(), directory)
    sgmv = directory / "sgmv.cu"
    text, waits = re.subn(r"cp_async_wait<(SGMV_\w+_STAGES) - 1>", r"cp_async_wait<\1>",
                          sgmv.read_text())
    assert waits == 2  # the shrink's and the expand's
    sgmv.write_text(text)
    environment = {**os.environ, "METRALE_KERNEL_DIR": str(directory),
                   "METRALE_CACHE_DIR": str(tmp_path / "cache")}
    result = subprocess.run([sys.executable, "-c", READ_TOO_EARLY], capture_output=True,
                            text=True, env=environment, check=False, timeout=600,
                            cwd=Path(__file__).resolve().parent.parent)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"t_nan": True, "y_nan": True}


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
    assert plans.expand_out_tiles(4096, 8192, 16, 132) > 1
    # 64 full chunks over the same outputs fill the device either way; one wave of CTAs.
    tiles = plans.expand_out_tiles(64, 8192, 64, 132)
    assert -(-128 // tiles) * 64 <= 132 * sources.min_ctas_per_sm("sgmv_expand_bf16")
    with pytest.raises(ValueError, match="out_tiles must be in"):
        plans.plan_sgmv_expand(torch.zeros(4, 16), torch.tensor([[0, 4, 0, 0]], dtype=torch.int32),
                               torch.zeros(1, dtype=torch.int64), torch.ones(1),
                               torch.ones(1, dtype=torch.int32),
                               torch.zeros(4, 64, dtype=torch.bfloat16), 16, out_tiles=0)
