"""The CUDA kernels on a real device (CuPy), against reference.py: the same cases as the host
harness, plus the tensor-core path the harness only emulates. Skipped without a GPU; run with
--require-gpu on a GPU machine so that a skip fails the run."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from metrale_cli.ops import costs, kernels, plans, reference, sources
from tests.support.kernel_cases import (
    BGMV_CASES,
    DECODE_BATCHES,
    FUSED_CASES,
    FUSED_WIDTHS,
    SGMV_CASES,
    Case,
    Pool,
    check_slices,
    check_t,
    check_y,
    fused_pools,
    make_pool,
)

pytestmark = pytest.mark.gpu

Y_DTYPES = [torch.bfloat16, torch.float32]


def _cupy() -> Any:
    from metrale_cli import compat

    return compat.cupy_module()


def _to_device(tensor: torch.Tensor) -> Any:
    cupy = _cupy()
    if tensor.dtype == torch.bfloat16:
        return cupy.asarray(tensor.view(torch.int16).numpy().view(np.uint16))
    return cupy.asarray(tensor.numpy())


def _to_host(array: Any, dtype: torch.dtype) -> torch.Tensor:
    host = torch.from_numpy(_cupy().asnumpy(array))
    return host.view(torch.int16).view(torch.bfloat16) if dtype == torch.bfloat16 else host


def _device_tables(pool: Pool) -> tuple[Any, Any, Any]:
    """The pool copied to the device, and its tables rebased onto the device allocation."""
    device_pool = _to_device(pool.pool)
    a_table, b_table = pool.tables(base_address=int(device_pool.data.ptr))
    return device_pool, _to_device(a_table).view("uint64"), _to_device(b_table).view("uint64")


def _nan_t(case: Case) -> Any:
    """t NaN-filled: an element the shrink fails to write shows (a split shrink zeroes nothing:
    its last CTA of each tile writes t)."""
    cupy = _cupy()
    return cupy.full((case.num_tokens, case.max_rank), cupy.nan, dtype=cupy.float32)


@pytest.mark.parametrize("y_dtype", Y_DTYPES, ids=["y_bf16", "y_f32"])
@pytest.mark.parametrize("case", BGMV_CASES, ids=[c.name for c in BGMV_CASES])
def test_bgmv_on_device(case: Case, y_dtype: torch.dtype) -> None:
    pool = case.pool()
    a_weights, b_weights = pool.weights()
    _keep, a_table, b_table = _device_tables(pool)
    x, y0, slots = case.x(), case.y(y_dtype), case.token_slots()
    y = _to_device(y0)
    ranks, scales = _to_device(pool.ranks), _to_device(pool.scales)

    t = kernels.bgmv_shrink(_to_device(x), _to_device(slots), a_table, ranks, case.max_rank,
                            _nan_t(case), splits=case.num_splits)
    kernels.bgmv_expand(t, _to_device(slots), b_table, scales, ranks, y, case.max_rank)
    _cupy().cuda.Device().synchronize()

    check_t(_to_host(t, torch.float32),
            reference.shrink(x, slots, a_weights, pool.ranks, case.max_rank))
    expected = reference.lora_delta(x, y0, slots, a_weights, b_weights, pool.scales, pool.ranks,
                                    case.max_rank)
    check_y(_to_host(y, y_dtype), y0, expected, case, "bgmv")


@pytest.mark.parametrize("y_dtype", Y_DTYPES, ids=["y_bf16", "y_f32"])
@pytest.mark.parametrize("case", SGMV_CASES, ids=[c.name for c in SGMV_CASES])
def test_sgmv_on_device(case: Case, y_dtype: torch.dtype) -> None:
    pool = case.pool()
    a_weights, b_weights = pool.weights()
    _keep, a_table, b_table = _device_tables(pool)
    x, y0, slots = case.x(), case.y(y_dtype), case.token_slots()
    seg_starts, seg_slots = (_to_device(s) for s in case.segments())
    y = _to_device(y0)
    ranks, scales = _to_device(pool.ranks), _to_device(pool.scales)

    t = kernels.sgmv_shrink(_to_device(x), seg_starts, seg_slots, a_table, ranks, case.max_rank,
                            _nan_t(case), splits=case.num_splits)
    kernels.sgmv_expand(t, seg_starts, seg_slots, b_table, scales, ranks, y, case.max_rank)
    _cupy().cuda.Device().synchronize()

    check_t(_to_host(t, torch.float32),
            reference.shrink(x, slots, a_weights, pool.ranks, case.max_rank))
    expected = reference.lora_delta(x, y0, slots, a_weights, b_weights, pool.scales, pool.ranks,
                                    case.max_rank)
    check_y(_to_host(y, y_dtype), y0, expected, case, "sgmv")


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "per_token"])
@pytest.mark.parametrize("case", DECODE_BATCHES, ids=[c.name for c in DECODE_BATCHES])
def test_decode_with_a_batch_plan_on_device(case: Case, grouped: bool) -> None:
    pool = case.pool()
    a_weights, b_weights = pool.weights()
    _keep, a_table, b_table = _device_tables(pool)
    x, y0, slots = case.x(), case.y(torch.bfloat16), case.token_slots()
    y = _to_device(y0)
    plan = plans.plan_batch(slots.numpy(), pool.ranks.numpy(), case.max_rank,
                              group_min_tokens=1 if grouped else 10**9)
    kernels.bgmv(_to_device(x), y, _to_device(slots), a_table, b_table,
                 _to_device(pool.scales), _to_device(pool.ranks), case.max_rank, batch=plan)
    expected = reference.lora_delta(x, y0, slots, a_weights, b_weights, pool.scales, pool.ranks,
                                    case.max_rank)
    check_y(_to_host(y, torch.bfloat16), y0, expected, case, "sgmv" if grouped else "bgmv")


@pytest.mark.parametrize(("case", "widths"), FUSED_CASES, ids=[c.name for c, _ in FUSED_CASES])
def test_fused_slices_on_device(case: Case, widths: tuple[int, ...]) -> None:
    pools = [make_pool(case.in_dim, width, case.max_rank, case.ranks, case.absent, seed)
             for seed, width in enumerate(widths)]
    device = [_device_tables(pool) for pool in pools]
    cupy = _cupy()
    a_tables = cupy.stack([tables[1] for tables in device])
    b_tables = cupy.stack([tables[2] for tables in device])
    cols = [0, *np.cumsum(widths).tolist()]
    y0 = torch.randn(case.num_tokens, cols[-1],
                     generator=torch.Generator().manual_seed(2)).bfloat16()
    x, slots, ranks, scales = case.x(), case.token_slots(), pools[0].ranks, pools[0].scales
    y = _to_device(y0)
    kernels.bgmv_fused(_to_device(x), y, cols, _to_device(slots), a_tables, b_tables,
                       _to_device(scales), _to_device(ranks), case.max_rank)
    got = _to_host(y, torch.bfloat16)
    for z, pool in enumerate(pools):
        a_weights, b_weights = pool.weights()
        part = slice(cols[z], cols[z + 1])
        expected = reference.lora_delta(x, y0[:, part], slots, a_weights, b_weights, scales,
                                        ranks, case.max_rank)
        check_y(got[:, part], y0[:, part], expected, case, "bgmv")


@pytest.mark.parametrize("case", [*SGMV_CASES, *DECODE_BATCHES],
                         ids=[c.name for c in (*SGMV_CASES, *DECODE_BATCHES)])
def test_sgmv_fused_slices_on_device(case: Case) -> None:
    """The SGMV kernels' fused slices: prefill segments through sgmv_fused, decode batches
    grouped (the token order) through bgmv_fused."""
    pools = fused_pools(case)
    device = [_device_tables(pool) for pool in pools]
    cupy = _cupy()
    a_tables = cupy.stack([tables[1] for tables in device])
    b_tables = cupy.stack([tables[2] for tables in device])
    cols = [0, *np.cumsum(FUSED_WIDTHS).tolist()]
    y0 = torch.randn(case.num_tokens, cols[-1],
                     generator=torch.Generator().manual_seed(2)).bfloat16()
    x, slots, ranks, scales = case.x(), case.token_slots(), pools[0].ranks, pools[0].scales
    y = _to_device(y0)
    args = (_to_device(scales), _to_device(ranks), case.max_rank)
    if case.seg_starts is not None:
        seg_starts, seg_slots = (_to_device(s) for s in case.segments())
        kernels.sgmv_fused(_to_device(x), y, cols, seg_starts, seg_slots, a_tables, b_tables,
                           *args)
        family = "sgmv"
    else:
        plan = plans.plan_batch(slots.numpy(), ranks.numpy(), case.max_rank, group_min_tokens=1)
        kernels.bgmv_fused(_to_device(x), y, cols, _to_device(slots), a_tables, b_tables, *args,
                           batch=plan)
        sms = kernels.device_sm_count()
        family = "sgmv" if costs.grouped_expand(case.num_tokens, cols[-1], plan.t_cols,
                                                len(plan.chunks), sms) else "bgmv"
    check_slices(case, pools, x, _to_host(y, torch.bfloat16), y0, slots, family)


def test_sgmv_tensor_cores_at_prefill_size() -> None:
    # A prefill-sized batch at the model's real dims (q_proj of Qwen3-Next: 2048 -> 8192), with
    # every rank-tile shape in play, through the planner's own split choice.
    case = Case("prefill", 1024, 2048, 8192, 128, [128, 64, 16, 72],
                seg_starts=[0, 300, 301, 700, 1024], seg_slots=[0, 1, 2, 3])
    pool = case.pool()
    a_weights, b_weights = pool.weights()
    _keep, a_table, b_table = _device_tables(pool)
    x, y0, slots = case.x(), case.y(torch.bfloat16), case.token_slots()
    seg_starts, seg_slots = (_to_device(s) for s in case.segments())
    y = _to_device(y0)
    ranks, scales = _to_device(pool.ranks), _to_device(pool.scales)
    kernels.sgmv(_to_device(x), y, seg_starts, seg_slots, a_table, b_table, scales, ranks,
                 case.max_rank)
    expected = reference.lora_delta(x, y0, slots, a_weights, b_weights, pool.scales, pool.ranks,
                                    case.max_rank)
    check_y(_to_host(y, torch.bfloat16), y0, expected, case, "sgmv")


def test_kernels_compile_through_nvrtc() -> None:
    for name in sources.KERNEL_SOURCES:
        assert kernels.get_kernel(name) is not None
