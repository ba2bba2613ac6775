"""The CUDA kernels, run unchanged on the CPU by the host harness, against reference.py.

The SGMV kernels run their tensor-core code here too: the shim emulates mma.sync m16n8k16 with
the PTX fragment layout, so these tests check the kernels' fragment indexing; that the hardware
agrees with the layout is what tests/test_kernels_gpu.py checks.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from metrale_cli import host_harness, kernels, reference
from metrale_cli.errors import ToolMissing
from tests.kernel_cases import BGMV_CASES, SGMV_CASES, Case, check_t, check_y

Y_DTYPES = [torch.bfloat16, torch.float32]


def _t_buffer(case: Case) -> torch.Tensor | None:
    if case.num_splits is None:
        return None
    return torch.full((case.num_splits, case.num_tokens, case.max_rank), float("nan"))


@pytest.mark.parametrize("y_dtype", Y_DTYPES, ids=["y_bf16", "y_f32"])
@pytest.mark.parametrize("case", BGMV_CASES, ids=[c.name for c in BGMV_CASES])
def test_bgmv_matches_reference(case: Case, y_dtype: torch.dtype) -> None:
    pool = case.pool()
    a_table, b_table = pool.tables()
    a_weights, b_weights = pool.weights()
    x, y = case.x(), case.y(y_dtype)
    y0 = y.clone()
    slots = case.token_slots()

    t = host_harness.bgmv_shrink(x, slots, a_table, pool.ranks, case.max_rank, _t_buffer(case),
                                 num_sms=case.num_sms)
    expected_t = reference.shrink(x, slots, a_weights, pool.ranks, case.max_rank)
    check_t(t, expected_t)

    host_harness.bgmv_expand(t, slots, b_table, pool.scales, pool.ranks, y, num_sms=case.num_sms)
    expected_y = reference.lora_delta(x, y0, slots, a_weights, b_weights, pool.scales, pool.ranks,
                                      case.max_rank)
    check_y(y, y0, expected_y, case, "bgmv")


@pytest.mark.parametrize("y_dtype", Y_DTYPES, ids=["y_bf16", "y_f32"])
@pytest.mark.parametrize("case", SGMV_CASES, ids=[c.name for c in SGMV_CASES])
def test_sgmv_matches_reference(case: Case, y_dtype: torch.dtype) -> None:
    pool = case.pool()
    a_table, b_table = pool.tables()
    a_weights, b_weights = pool.weights()
    x, y = case.x(), case.y(y_dtype)
    y0 = y.clone()
    seg_starts, seg_slots = case.segments()
    slots = case.token_slots()

    t = host_harness.sgmv_shrink(x, seg_starts, seg_slots, a_table, pool.ranks, case.max_rank,
                                 _t_buffer(case), num_sms=case.num_sms)
    check_t(t, reference.shrink(x, slots, a_weights, pool.ranks, case.max_rank))

    host_harness.sgmv_expand(t, seg_starts, seg_slots, b_table, pool.scales, pool.ranks, y)
    expected_y = reference.lora_delta(x, y0, slots, a_weights, b_weights, pool.scales, pool.ranks,
                                      case.max_rank)
    check_y(y, y0, expected_y, case, "sgmv")


def test_split_k_planning_matches_the_device_shape() -> None:
    # Decode at T = 1 on an H200 has 4 CTAs per rank-16 token without splitting: split K.
    assert kernels.shrink_splits("bgmv", 1, 4096, 16, 132) == 4
    # A large batch already fills the device: no split.
    assert kernels.shrink_splits("bgmv", 256, 4096, 64, 132) == 1
    assert kernels.shrink_splits("sgmv", 32768, 2048, 16, 132) == 1
    # 128 token tiles do not cover 132 SMs twice: 3 splits; 8 tiles: as many as K allows.
    assert kernels.shrink_splits("sgmv", 8192, 2048, 16, 132) == 3
    assert kernels.shrink_splits("sgmv", 512, 2048, 16, 132) == 8


def test_host_and_gpu_share_one_plan() -> None:
    case = BGMV_CASES[0]
    pool = case.pool()
    a_table, _ = pool.tables()
    t = torch.empty(2, case.num_tokens, case.max_rank)
    plan = kernels.plan_bgmv_shrink(case.x(), case.token_slots(), a_table, pool.ranks, t)
    assert plan.kernel == "bgmv_shrink"
    assert plan.grid == (case.num_tokens, case.max_rank // kernels.SHRINK_ROWS, 2)
    assert plan.block == (kernels.THREADS, 1, 1)


def test_plans_refuse_unaligned_dims() -> None:
    pool = BGMV_CASES[0].pool()
    a_table, _ = pool.tables()
    x = torch.zeros(2, 12, dtype=torch.bfloat16)  # in_dim not a multiple of 8
    t = torch.empty(1, 2, 16)
    with pytest.raises(ValueError, match="multiples of 8"):
        kernels.plan_bgmv_shrink(x, torch.zeros(2, dtype=torch.int32), a_table, pool.ranks, t)
    with pytest.raises(ValueError, match="int32"):
        kernels.plan_bgmv_shrink(torch.zeros(2, 16, dtype=torch.bfloat16),
                                 torch.zeros(2, dtype=torch.int64), a_table, pool.ranks, t)


def test_empty_batch_is_a_no_op() -> None:
    pool = BGMV_CASES[0].pool()
    a_table, _ = pool.tables()
    x = torch.zeros(0, 200, dtype=torch.bfloat16)
    t = host_harness.bgmv_shrink(x, torch.zeros(0, dtype=torch.int32), a_table, pool.ranks, 16)
    assert t.shape[1:] == (0, 16)


def test_loader_prefers_metrale_kernel_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = kernels.find_kernel_dir()
    for path in source.iterdir():
        if path.suffix in (".cu", ".cuh", ".h"):
            shutil.copy(path, tmp_path / path.name)
    monkeypatch.setenv("METRALE_KERNEL_DIR", str(tmp_path))
    assert kernels.find_kernel_dir() == tmp_path


def test_loader_names_every_path_tried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tried = [tmp_path / "override", tmp_path / "installed", tmp_path / "checkout"]
    monkeypatch.setattr(kernels, "kernel_dir_candidates", lambda: tried)
    with pytest.raises(ToolMissing) as error:
        kernels.find_kernel_dir()
    for path in tried:
        assert str(path) in str(error.value)
    assert error.value.exit_code == 3


def test_sources_are_inlined_for_nvrtc() -> None:
    source = kernels.read_source("sgmv.cu")
    assert '#include "' not in source
    assert "mma.sync.aligned.m16n8k16" in source
    assert source.count("typedef unsigned short bf16_t;") == 1


def test_host_build_is_cached_by_source_hash(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    source = kernels.find_kernel_dir()
    for path in source.iterdir():
        if path.suffix in (".cu", ".cuh", ".h"):
            shutil.copy(path, tmp_path / path.name)
    first = host_harness.library_path(tmp_path)
    with (tmp_path / "bgmv.cu").open("a") as handle:
        handle.write("\n// edited\n")
    assert host_harness.library_path(tmp_path) != first


def test_missing_compiler_is_tool_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_harness.shutil, "which", lambda name: None)
    with pytest.raises(ToolMissing):
        host_harness.compiler()


def test_bench_counts_compulsory_bytes() -> None:
    from metrale_cli import bench_kernels

    # kernel_perf.md 5.1: h = 4096, r = 16, B = D = 64, F32 t: shrink = weights + x + t.
    shrink = bench_kernels.compulsory_bytes("shrink", 64, 64, 16, 4096, 4096)
    assert shrink == 2 * 64 * 16 * 4096 + 2 * 64 * 4096 + 4 * 64 * 16
    expand = bench_kernels.compulsory_bytes("expand", 64, 64, 16, 4096, 4096)
    assert expand == 2 * 64 * 4096 * 16 + 4 * 64 * 16 + 4 * 64 * 4096


def test_bench_needs_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from metrale_cli import bench_kernels, compat
    from metrale_cli.errors import NoDevice

    monkeypatch.setattr(compat, "gpu_status", lambda: (False, "no device in this test"))
    with pytest.raises(NoDevice) as error:
        bench_kernels.run([("q_proj", 8192, 2048)], ranks=(16,), tokens=(1,))
    assert error.value.exit_code == 3


def test_harness_takes_numpy_buffers() -> None:
    # The pool keeps host pools as NumPy arrays (BF16 as uint16 bits, tables as uint64).
    case = BGMV_CASES[0]
    pool = case.pool()
    a_weights, b_weights = pool.weights()
    x, y0, slots = case.x(), case.y(torch.bfloat16), case.token_slots()
    a_table, b_table = (table.numpy().view(np.uint64) for table in pool.tables())
    x_bits = x.view(torch.int16).numpy().view(np.uint16)
    y_bits = y0.view(torch.int16).numpy().view(np.uint16).copy()
    ranks, scales = pool.ranks.numpy(), pool.scales.numpy()

    t = host_harness.bgmv_shrink(x_bits, slots.numpy(), a_table, ranks, case.max_rank)
    host_harness.bgmv_expand(t, slots.numpy(), b_table, scales, ranks, y_bits)

    y = torch.from_numpy(y_bits.view(np.int16)).view(torch.bfloat16)
    expected = reference.lora_delta(x, y0, slots, a_weights, b_weights, pool.scales, pool.ranks,
                                    case.max_rank)
    check_y(y, y0, expected, case, "bgmv")
