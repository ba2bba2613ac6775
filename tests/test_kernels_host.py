"""The CUDA kernels, run unchanged on the CPU by the host harness, against reference.py.

The SGMV kernels run their tensor-core code here too: the shim emulates mma.sync m16n8k16 with
the PTX fragment layout, so these tests check the kernels' fragment indexing; that the hardware
agrees with the layout is what tests/test_kernels_gpu.py checks.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from metrale_cli import kernel_config
from metrale_cli.errors import ToolMissing
from metrale_cli.ops import costs, host_harness, plans, reference, sources
from tests.support.kernel_cases import (
    BGMV_CASES,
    DECODE_BATCHES,
    FUSED_CASES,
    SGMV_CASES,
    Case,
    check_t,
    check_y,
    make_pool,
)

# The host harness is built before the first test (conftest.host_library).
pytestmark = pytest.mark.usefixtures("host_library")

Y_DTYPES = [torch.bfloat16, torch.float32]


@pytest.mark.parametrize("y_dtype", Y_DTYPES, ids=["y_bf16", "y_f32"])
@pytest.mark.parametrize("case", BGMV_CASES, ids=[c.name for c in BGMV_CASES])
def test_bgmv_matches_reference(case: Case, y_dtype: torch.dtype) -> None:
    i = case.inputs(y_dtype)
    pool, a_table, b_table, x, y, y0, slots = i.pool, i.a_table, i.b_table, i.x, i.y, i.y0, i.slots
    a_weights, b_weights = i.a_weights, i.b_weights

    t = host_harness.bgmv_shrink(x, slots, a_table, pool.ranks, case.max_rank,
                                 splits=case.num_splits, num_sms=case.num_sms)
    expected_t = reference.shrink(x, slots, a_weights, pool.ranks, case.max_rank)
    check_t(t, expected_t)

    host_harness.bgmv_expand(t, slots, b_table, pool.scales, pool.ranks, y, case.max_rank)
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
                                 splits=case.num_splits, num_sms=case.num_sms)
    check_t(t, reference.shrink(x, slots, a_weights, pool.ranks, case.max_rank))

    host_harness.sgmv_expand(t, seg_starts, seg_slots, b_table, pool.scales, pool.ranks, y,
                             case.max_rank)
    expected_y = reference.lora_delta(x, y0, slots, a_weights, b_weights, pool.scales, pool.ranks,
                                      case.max_rank)
    check_y(y, y0, expected_y, case, "sgmv")


@pytest.mark.parametrize(("kind", "tokens", "in_dim", "t_cols", "want"), [
    # 2 passes of one CTA: the ticket and the partials' round trip cost more than a pass saves
    ("bgmv", 1, 4096, 16, 1),
    ("bgmv", 1, 16384, 16, 8),  # 8 passes of one CTA: one each, and 3 L2 round trips
    ("bgmv", 256, 4096, 64, 1),  # the batch fills the device
    # 512 CTAs are 1.3 waves of 396, each 11 pipelined passes of 3 K tiles: 2 splits even the
    # waves for a reduction of 3 round trips (the ticket, then both rank-16 partials in one:
    # ptxas unrolls the read loop by two), a hair cheaper than none; 3 cost more.
    ("sgmv", 32768, 2048, 16, 2),
    # 4 CTAs of 32 K tiles each: on sm_90 the last CTA reads the wide splits one a round trip
    # (a pair's 64 loads are 2), so 4 splits of 3 passes beat 6 of 2.
    ("sgmv", 256, 2048, 64, 4),
    # 8 CTAs of 16 K tiles at rank 16: 6 splits of 1 pass (3 K tiles), the last CTA reading 4
    # splits in a round trip and the other 2 in one more; 8 take as many round trips (4 + 4)
    # and move more partials at L2.
    ("sgmv", 512, 1024, 16, 6),
])
def test_split_k_is_planned_by_modelled_cost(kind: str, tokens: int, in_dim: int, t_cols: int,
                                             want: int) -> None:
    splits = costs.shrink_splits(kind, tokens, in_dim, t_cols, 132)
    assert splits == want
    least = 8 * sources.THREADS if kind == "bgmv" else sources.SGMV_TILE
    modelled = [costs.shrink_cost_us(kind, tokens, in_dim, t_cols, s, 132)
                for s in range(1, min(sources.MAX_SPLITS, in_dim // least) + 1)]
    assert modelled[splits - 1] == pytest.approx(min(modelled))


def test_host_and_gpu_share_one_plan() -> None:
    case = BGMV_CASES[0]
    pool = case.pool()
    a_table, _ = pool.tables()
    t = torch.empty(case.num_tokens, case.max_rank)
    grid = (case.num_tokens, case.max_rank // sources.SHRINK_ROWS, 2)
    floats, tickets = plans.split_workspace("bgmv_shrink", grid, 2)
    workspace = (np.empty(floats, np.float32), np.zeros(tickets, np.uint32))
    plan = plans.plan_bgmv_shrink(case.x(), case.token_slots(), a_table, pool.ranks, t,
                                    case.max_rank, splits=2, workspace=workspace)
    assert plan.kernel == "bgmv_shrink"
    assert plan.grid == grid
    assert plan.block == (sources.THREADS, 1, 1)
    assert plan.args[-2:] == workspace
    # A split launch without its workspace, or with one too small, is refused.
    with pytest.raises(ValueError, match="needs a workspace"):
        plans.plan_bgmv_shrink(case.x(), case.token_slots(), a_table, pool.ranks, t,
                               case.max_rank, splits=2)
    with pytest.raises(ValueError, match="tickets hold"):
        plans.plan_bgmv_shrink(case.x(), case.token_slots(), a_table, pool.ranks, t,
                               case.max_rank, splits=2,
                               workspace=(workspace[0], workspace[1][:tickets - 1]))


def test_plans_refuse_unaligned_dims() -> None:
    pool = BGMV_CASES[0].pool()
    a_table, _ = pool.tables()
    x = torch.zeros(2, 12, dtype=torch.bfloat16)  # in_dim not a multiple of 8
    t = torch.empty(2, 16)
    with pytest.raises(ValueError, match="multiples of 8"):
        plans.plan_bgmv_shrink(x, torch.zeros(2, dtype=torch.int32), a_table, pool.ranks, t, 16)
    with pytest.raises(ValueError, match="int32"):
        plans.plan_bgmv_shrink(torch.zeros(2, 16, dtype=torch.bfloat16),
                                 torch.zeros(2, dtype=torch.int64), a_table, pool.ranks, t, 16)


def test_empty_batch_is_a_no_op() -> None:
    pool = BGMV_CASES[0].pool()
    a_table, _ = pool.tables()
    x = torch.zeros(0, 200, dtype=torch.bfloat16)
    t = host_harness.bgmv_shrink(x, torch.zeros(0, dtype=torch.int32), a_table, pool.ranks, 16)
    assert t.shape == (0, 16)


def test_loader_prefers_metrale_kernel_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = sources.find_kernel_dir()
    for path in source.iterdir():
        if path.suffix in (".cu", ".cuh", ".h"):
            shutil.copy(path, tmp_path / path.name)
    monkeypatch.setenv("METRALE_KERNEL_DIR", str(tmp_path))
    assert sources.find_kernel_dir() == tmp_path


def test_loader_names_every_path_tried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tried = [tmp_path / "override", tmp_path / "installed", tmp_path / "checkout"]
    monkeypatch.setattr(sources, "kernel_dir_candidates", lambda: tried)
    with pytest.raises(ToolMissing) as error:
        sources.find_kernel_dir()
    for path in tried:
        assert str(path) in str(error.value)
    assert error.value.exit_code == 3


def test_sources_are_inlined_for_nvrtc() -> None:
    source = sources.read_source("sgmv.cu")
    assert '#include "' not in source
    assert "mma.sync.aligned.m16n8k16" in source
    assert source.count("typedef unsigned short bf16_t;") == 1


def test_host_build_is_cached_by_source_hash(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    source = sources.find_kernel_dir()
    for path in source.iterdir():
        if path.suffix in (".cu", ".cuh", ".h"):
            shutil.copy(path, tmp_path / path.name)
    first = host_harness.library_path(tmp_path)
    with (tmp_path / "bgmv.cu").open("a") as handle:
        handle.write("\n// edited\n")
    assert host_harness.library_path(tmp_path) != first


@pytest.mark.proc
def test_the_host_build_is_warning_free_at_o2_too(tmp_path: Path) -> None:
    """The harness builds at -O1 (host_harness.CXX_FLAGS); the warnings g++ finds only with
    -O2's analyses (array bounds from value ranges, uninitialised reads across inlining) are
    errors here, on the same command at -O2."""
    output = str(tmp_path / "libmetrale_host.so")
    command = host_harness.build_command(sources.find_kernel_dir(), output)
    assert command.count("-O1") == 1
    Path(output + ".ld").write_text(host_harness.SHARED_SECTION_SCRIPT)
    result = subprocess.run([("-O2" if arg == "-O1" else arg) for arg in command],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0 and not result.stderr, result.stderr


def test_missing_compiler_is_tool_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_harness.shutil, "which", lambda name: None)
    with pytest.raises(ToolMissing):
        host_harness.compiler()


def test_bench_counts_compulsory_bytes() -> None:
    from metrale_cli.bench import roofline

    # h = 4096, r = 16, B = D = 64, F32 t: shrink = weights + x + t.
    shrink = roofline.compulsory_bytes("shrink", 64, 64, 16, 4096, 4096)
    assert shrink == 2 * 64 * 16 * 4096 + 2 * 64 * 4096 + 4 * 64 * 16
    expand = roofline.compulsory_bytes("expand", 64, 64, 16, 4096, 4096)
    assert expand == 2 * 64 * 4096 * 16 + 4 * 64 * 16 + 4 * 64 * 4096


def test_bench_needs_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from metrale_cli import compat
    from metrale_cli.bench import kernels as bench_kernels
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
    host_harness.bgmv_expand(t, slots.numpy(), b_table, scales, ranks, y_bits, case.max_rank)

    y = torch.from_numpy(y_bits.view(np.int16)).view(torch.bfloat16)
    expected = reference.lora_delta(x, y0, slots, a_weights, b_weights, pool.scales, pool.ranks,
                                    case.max_rank)
    check_y(y, y0, expected, case, "bgmv")


def test_constants_are_the_headers_as_compiled(tmp_path: Path) -> None:
    # sources.py reads lora_config.h; a C++ program including it prints what the compiler sees.
    config = sources.CONFIG
    program = tmp_path / "print.cpp"
    program.write_text(
        f'#include "{sources.find_kernel_dir() / sources.CONFIG_HEADER}"\n#include <cstdio>\n'
        "int main() {\n"
        + "".join(f'  std::printf("{name} %d\\n", {name});\n' for name in config)
        + "}\n"
    )
    binary = tmp_path / "print"
    subprocess.run([host_harness.compiler(), str(program), "-o", str(binary)], check=True)
    printed = subprocess.run([str(binary)], capture_output=True, text=True, check=True).stdout
    assert dict(line.split() for line in printed.splitlines()) == {
        name: str(value) for name, value in config.items()
    }
    names = {"THREADS": "METRALE_THREADS", "VECTOR": "METRALE_VECTOR",
             "MAX_RANK": "METRALE_MAX_RANK", "SHRINK_ROWS": "BGMV_SHRINK_ROWS",
             "EXPAND_ROWS": "BGMV_EXPAND_ROWS", "SGMV_TILE": "SGMV_TILE"}
    for attribute, define in names.items():
        assert getattr(sources, attribute) == config[define], attribute
    # The planner's copy of the kernels' limits (no kernel sources needed to plan a layout).
    assert (kernel_config.VECTOR, kernel_config.MAX_RANK) == (sources.VECTOR, sources.MAX_RANK)
    for kernel in sources.KERNEL_SOURCES:
        assert sources.loads_in_flight(kernel) > 1 and sources.min_ctas_per_sm(kernel) >= 1


def test_kernel_constants_import_without_torch_or_cupy() -> None:
    code = ("import sys; from metrale_cli.kernel_config import VECTOR, MAX_RANK; "
            "print(VECTOR, MAX_RANK, 'torch' in sys.modules, 'cupy' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.split() == ["8", "256", "False", "False"]


def _run_case(case: Case) -> torch.Tensor:
    pool = case.pool()
    a_table, b_table = pool.tables()
    y = case.y(torch.float32)
    host_harness.bgmv(case.x(), y, case.token_slots(), a_table, b_table, pool.scales,
                      pool.ranks, case.max_rank, num_sms=case.num_sms)
    return y


@pytest.mark.slow
def test_host_launches_from_two_threads_match_serial_runs() -> None:
    # ctypes releases the GIL: without the harness's lock the two launches would share the
    # emulation's globals and __shared__ arrays.
    cases = [BGMV_CASES[0], BGMV_CASES[3]] * 3
    serial = [_run_case(case) for case in cases]
    with ThreadPoolExecutor(max_workers=2) as pool:
        concurrent = list(pool.map(_run_case, cases))
    for expected, got in zip(serial, concurrent, strict=True):
        assert torch.equal(expected, got)


def test_batch_plan_groups_by_slot_and_narrows_to_the_ranks_present() -> None:
    ranks = [12, 64, 0, 40]
    plan = plans.plan_batch([1, 0, 0, -1, 0, 2, 0, 9], ranks, max_rank=64)
    assert plan.t_cols == 64 and plan.distinct_slots == 2 and plan.adapted_tokens == 5
    assert plan.order.tolist() == [3, 1, 2, 4, 6, 0, 5, 7]
    assert plan.seg_starts.tolist() == [0, 1, 5, 6, 7, 8]
    assert plan.seg_slots.tolist() == [-1, 0, 1, 2, 9]
    assert not plan.grouped  # 5 tokens over 2 slots: under GROUP_MIN_TOKENS per slot
    narrow = plans.plan_batch([0] * 8 + [-1], ranks, max_rank=64)
    assert narrow.grouped and narrow.t_cols == 16  # rank 12, rounded up to a vector
    everyone = plans.plan_batch(list(range(4)), [8, 16, 24, 32], max_rank=64)
    assert not everyone.grouped and everyone.t_cols == 32
    assert plans.plan_batch([], ranks, 64).seg_starts.tolist() == [0]


def test_shrink_grid_covers_the_ranks_present_not_max_rank() -> None:
    case = BGMV_CASES[0]  # max_rank 16, ranks up to 16
    pool = case.pool()
    a_table, _ = pool.tables()
    wide = torch.empty(case.num_tokens, 16)
    narrow = torch.empty(case.num_tokens, 8)
    x, slots = case.x(), case.token_slots()
    assert plans.plan_bgmv_shrink(x, slots, a_table, pool.ranks, wide, 16).grid[1] == 4
    assert plans.plan_bgmv_shrink(x, slots, a_table, pool.ranks, narrow, 16).grid[1] == 2
    # Split-K sees the narrower grid: rank 16 in a max-rank-64 pool splits as rank 16 does.
    assert costs.shrink_splits("bgmv", 32, 16384, 16, 132) > costs.shrink_splits(
        "bgmv", 32, 16384, 256, 132)




@pytest.mark.parametrize("y_dtype", Y_DTYPES, ids=["y_bf16", "y_f32"])
@pytest.mark.parametrize(("case", "widths"), FUSED_CASES, ids=[c.name for c, _ in FUSED_CASES])
def test_fused_slices_match_reference_per_slice(case: Case, widths: tuple[int, ...],
                                                y_dtype: torch.dtype) -> None:
    pools = [make_pool(case.in_dim, width, case.max_rank, case.ranks, case.absent, seed)
             for seed, width in enumerate(widths)]
    a_tables = torch.stack([pool.tables()[0] for pool in pools])
    b_tables = torch.stack([pool.tables()[1] for pool in pools])
    cols = [0, *np.cumsum(widths).tolist()]
    generator = torch.Generator().manual_seed(2)
    y = torch.randn(case.num_tokens, cols[-1], generator=generator).to(y_dtype)
    y0 = y.clone()
    x, slots, ranks, scales = case.x(), case.token_slots(), pools[0].ranks, pools[0].scales
    fused_splits = costs.shrink_splits("bgmv", len(widths) * case.num_tokens, case.in_dim,
                                         case.max_rank, case.num_sms)
    assert (fused_splits > 1) == (case.name == "split_k")
    host_harness.bgmv_fused(x, y, cols, slots, a_tables, b_tables, scales, ranks,
                            case.max_rank, num_sms=case.num_sms)
    for z, pool in enumerate(pools):
        a_weights, b_weights = pool.weights()
        expected = reference.lora_delta(x, y0[:, cols[z]:cols[z + 1]], slots, a_weights,
                                        b_weights, scales, ranks, case.max_rank)
        check_y(y[:, cols[z]:cols[z + 1]], y0[:, cols[z]:cols[z + 1]], expected, case, "bgmv")


def test_fused_slices_are_one_shrink_and_one_expand_launch() -> None:
    case, widths = FUSED_CASES[0]
    pools = [make_pool(case.in_dim, width, case.max_rank, case.ranks, case.absent, seed)
             for seed, width in enumerate(widths)]
    a_tables = torch.stack([pool.tables()[0] for pool in pools])
    b_tables = torch.stack([pool.tables()[1] for pool in pools])
    cols = torch.tensor([0, 72, 88, 128], dtype=torch.int32)
    t = torch.zeros(3, case.num_tokens, case.max_rank)
    y = torch.zeros(case.num_tokens, 128)
    slots, ranks, scales = case.token_slots(), pools[0].ranks, pools[0].scales
    grid = (case.num_tokens, case.max_rank // sources.SHRINK_ROWS, 3 * 2)
    workspace = host_harness.HOST.workspace(case.x(), *plans.split_workspace("bgmv_shrink", grid,
                                                                             2))
    shrink = plans.plan_bgmv_shrink(case.x(), slots, a_tables, ranks, t, case.max_rank, 2,
                                    workspace)
    assert shrink.grid == grid
    expand = plans.plan_bgmv_expand(t, slots, b_tables, scales, ranks, y, case.max_rank, cols)
    assert expand.grid == (case.num_tokens, 1, 3)  # the widest slice, 72, in one CTA per token
    with pytest.raises(ValueError, match="need slice_cols"):
        plans.plan_bgmv_expand(t, slots, b_tables, scales, ranks, y, case.max_rank)
    with pytest.raises(ValueError, match="multiples of 8"):
        plans.check_slice_cols([0, 72, 84, 128], 3, 128)
    with pytest.raises(ValueError, match="past y"):
        plans.check_slice_cols([0, 72, 88, 136], 3, 128)
    with pytest.raises(ValueError, match=r"t \[S, T, t_cols\]"):
        plans.plan_bgmv_shrink(case.x(), slots, a_tables, ranks, t[0], case.max_rank)


# The SMs each grouped batch is planned for, and whether its expand then runs through SGMV
# (costs.grouped_expand): SGMV's CTAs, one per (chunk, 64 outputs), read B once per chunk in
# one pass; a wide output over 8 tokens on one SM is 32 of them, 11 waves of 3, against 8
# per-token CTAs in 2 waves of 4.
SGMV_EXPAND = {"shared_slots": (132, True), "one_slot": (132, True), "wide_output": (1, False)}


# The per-token path launches a kernel per token on the host harness: the full run's.
@pytest.mark.parametrize("grouped", [True, pytest.param(False, marks=pytest.mark.slow)],
                         ids=["grouped", "per_token"])
@pytest.mark.parametrize("y_dtype", Y_DTYPES, ids=["y_bf16", "y_f32"])
@pytest.mark.parametrize("case", DECODE_BATCHES, ids=[c.name for c in DECODE_BATCHES])
def test_decode_with_a_batch_plan_matches_reference(case: Case, y_dtype: torch.dtype,
                                                    grouped: bool) -> None:
    num_sms, sgmv_wanted = SGMV_EXPAND[case.name]
    i = case.inputs(y_dtype)
    pool, a_table, b_table, x, y, y0, slots = i.pool, i.a_table, i.b_table, i.x, i.y, i.y0, i.slots
    a_weights, b_weights = i.a_weights, i.b_weights
    plan = plans.plan_batch(slots.numpy(), pool.ranks.numpy(), case.max_rank,
                              group_min_tokens=1 if grouped else 10**9)
    assert plan.grouped == grouped and plan.t_cols < case.max_rank
    sgmv_expand = grouped and costs.grouped_expand(case.num_tokens, case.out_dim,
                                                     plan.t_cols, plan.chunks.shape[0], num_sms)
    assert sgmv_expand == (grouped and sgmv_wanted)
    host_harness.bgmv(x, y, slots, a_table, b_table, pool.scales, pool.ranks, case.max_rank,
                      batch=plan, num_sms=num_sms)
    expected = reference.lora_delta(x, y0, slots, a_weights, b_weights, pool.scales, pool.ranks,
                                    case.max_rank)
    check_y(y, y0, expected, case, "sgmv" if sgmv_expand else "bgmv")

    # t is as wide as the batch's widest rank; the reference's columns past it are zero.
    expected_t = reference.shrink(x, slots, a_weights, pool.ranks, case.max_rank)
    if grouped:
        order = torch.from_numpy(plan.order)
        t = host_harness.sgmv_shrink(x, torch.from_numpy(plan.seg_starts),
                                     torch.from_numpy(plan.seg_slots), a_table, pool.ranks,
                                     case.max_rank, t_cols=plan.t_cols, token_order=order)
    else:
        t = host_harness.bgmv_shrink(x, slots, a_table, pool.ranks, case.max_rank, batch=plan)
    assert t.shape[1] == plan.t_cols
    assert not expected_t[:, plan.t_cols:].any()
    check_t(t, expected_t[:, : plan.t_cols])


def test_misaligned_table_addresses_are_refused() -> None:
    case = BGMV_CASES[0]
    pool = case.pool()
    a_table, b_table = pool.tables()
    t = torch.empty(case.num_tokens, case.max_rank)
    shifted = a_table.clone()
    shifted[3] += 8  # 8 bytes off: a 128-bit load there faults on a GPU
    with pytest.raises(ValueError, match=r"a_table\[3\] .* not 16-byte aligned"):
        plans.plan_bgmv_shrink(case.x(), case.token_slots(), shifted, pool.ranks, t, 16)
    shifted_b = b_table.numpy().view(np.uint64).copy()
    shifted_b[0] += np.uint64(2)
    with pytest.raises(ValueError, match=r"b_table\[0\]"):
        plans.plan_sgmv_expand(t, torch.tensor([[0, 11, 0, 0]], dtype=torch.int32), shifted_b,
                               pool.scales, pool.ranks, case.y(torch.float32), 16)


def test_layouts_refuse_alignments_the_kernels_cannot_load() -> None:
    from metrale_cli.errors import UsageError
    from metrale_cli.layout.slot_layout import check_rank_and_align

    check_rank_and_align(16, 16)
    with pytest.raises(UsageError, match="at least 16 bytes"):
        check_rank_and_align(16, 8)


# --- launches the planners must refuse ------------------------------------------------------------


def test_buffers_read_as_dense_arrays_must_be_contiguous() -> None:
    # A t sliced from a wider tensor passed the last-dimension check, and the expand then read
    # its rows at the wrong stride (3 of 6 rows left unwritten, the rest off).
    case = BGMV_CASES[0]
    i, max_rank = case.inputs(torch.float32), case.max_rank
    wide = torch.zeros(i.x.shape[0], 2 * max_rank)
    with pytest.raises(ValueError, match="t must be contiguous"):
        host_harness.bgmv_expand(wide[:, :max_rank], i.slots, i.b_table, i.pool.scales,
                                 i.pool.ranks, i.y, max_rank)
    t = torch.zeros(i.x.shape[0], max_rank)
    every_other = torch.zeros(2 * len(i.pool.ranks), dtype=torch.int32)[::2]
    with pytest.raises(ValueError, match="ranks must be contiguous"):
        host_harness.bgmv_expand(t, i.slots, i.b_table, i.pool.scales, every_other, i.y,
                                 max_rank)
    table = torch.zeros(len(i.pool.ranks), 2, dtype=torch.int64)[:, 0]
    with pytest.raises(ValueError, match="a_table must be contiguous"):
        host_harness.bgmv_shrink(i.x, i.slots, table, i.pool.ranks, max_rank, t)
    starts = torch.tensor([0, 0, 5, 5, 11, 11], dtype=torch.int32)[::2]
    with pytest.raises(ValueError, match="seg_starts must be contiguous"):
        host_harness.sgmv_shrink(i.x, starts, torch.tensor([0, 1], dtype=torch.int32),
                                 i.a_table, i.pool.ranks, max_rank)
    # x and y carry their own row stride: a row-strided view is fine, overlapping rows are not.
    host_harness.bgmv_shrink(torch.cat([i.x, i.x], dim=1)[:, : i.x.shape[1]], i.slots,
                             i.a_table, i.pool.ranks, max_rank, t)
    with pytest.raises(ValueError, match="rows overlap"):
        host_harness.bgmv_shrink(i.x[:1].expand(i.x.shape[0], -1), i.slots, i.a_table,
                                 i.pool.ranks, max_rank, t)


@pytest.mark.parametrize(("starts", "message"), [
    ([0, 64, 32, 128], "non-decreasing: seg_starts\\[2\\] = 32 < seg_starts\\[1\\] = 64"),
    ([0, 64, 96, 120], "end at the token count \\(128\\), got 120"),
    ([0, 64, 96, 130], "end at the token count \\(128\\), got 130"),
    ([-4, 64, 96, 128], "within \\[0, 128\\], got -4"),
])
def test_sgmv_segments_are_checked(starts: list[int], message: str) -> None:
    case = SGMV_CASES[3]  # 130 tokens; use the first 128
    pool = case.pool()
    a_table, b_table = pool.tables()
    x, y = case.x()[:128], case.y(torch.float32)[:128]
    seg_slots = torch.tensor([0, 1, 0], dtype=torch.int32)
    seg_starts = torch.tensor(starts, dtype=torch.int32)
    with pytest.raises(ValueError, match=message):
        host_harness.sgmv_shrink(x, seg_starts, seg_slots, a_table, pool.ranks, case.max_rank)
    t = torch.zeros(128, case.max_rank)
    with pytest.raises(ValueError, match=message):
        host_harness.sgmv_expand(t, seg_starts, seg_slots, b_table, pool.scales, pool.ranks, y,
                                 case.max_rank)


def test_expand_takes_the_pool_max_rank_never_t_s_width() -> None:
    # A t narrowed to the batch's ranks (40 of a max-rank-48 pool): B's rows are 48 long. The
    # expand used to default max_rank to t's width and read B at the wrong row stride.
    case = DECODE_BATCHES[0]
    i = case.inputs(torch.float32)
    plan = plans.plan_batch(i.slots.numpy(), i.pool.ranks.numpy(), case.max_rank,
                              group_min_tokens=10**9)
    assert plan.t_cols < case.max_rank
    t = host_harness.bgmv_shrink(i.x, i.slots, i.a_table, i.pool.ranks, case.max_rank,
                                 batch=plan)
    with pytest.raises(TypeError):
        no_max_rank: Any = host_harness.bgmv_expand
        no_max_rank(t, i.slots, i.b_table, i.pool.scales, i.pool.ranks, i.y)
    with pytest.raises(TypeError, match="max_rank"):
        plans.plan_sgmv_expand(t, torch.tensor([[0, case.num_tokens, 0, 0]], dtype=torch.int32),
                               i.b_table, i.pool.scales, i.pool.ranks, i.y,
                               None)  # type: ignore[arg-type]
    host_harness.bgmv_expand(t, i.slots, i.b_table, i.pool.scales, i.pool.ranks, i.y,
                             case.max_rank)
    expected = reference.lora_delta(i.x, i.y0, i.slots, i.a_weights, i.b_weights, i.pool.scales,
                                    i.pool.ranks, case.max_rank)
    check_y(i.y, i.y0, expected, case, "bgmv")


def test_grids_past_cuda_s_limits_are_refused() -> None:
    # SGMV's grid.y is its chunk count (one per 64 tokens of a segment): past 65,535 chunks a
    # GPU launch fails.
    most = plans.MAX_GRID[1]
    grid = plans.launch_grid("sgmv_shrink", most, 64, 16)
    assert grid[1] == plans.MAX_GRID[1]
    plans.KernelLaunch("sgmv_shrink", grid, (sources.THREADS, 1, 1), ())
    for kernel in ("sgmv_shrink", "sgmv_expand_bf16"):
        too_many = plans.launch_grid(kernel, most + 1, 64, 16)
        with pytest.raises(ValueError, match="65,535 on y"):
            plans.KernelLaunch(kernel, too_many, (sources.THREADS, 1, 1), ())
