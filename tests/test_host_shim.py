"""The host shim is as strict as the hardware: each test puts a bug into a copy of kernels/ that
a more forgiving emulation hid (the kernel passed on the CPU and may fail on a GPU) and checks
that the host run now fails, while the unbroken kernel passes the same case."""

from __future__ import annotations

import json
import platform
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from metrale_cli.ops import host_harness, reference
from tests.support.kernel_cases import BGMV_CASES, Case, check_t, check_y
from tests.support.mutated_kernels import run_mutated, sgmv_stage_probe, stage_race

# The host harness is built before the first test (conftest.host_library).
pytestmark = pytest.mark.usefixtures("host_library")

# Two segments of exactly 64 tokens: every chunk is a full 64-row CTA (all four warps run the
# mma), K deep enough for the shrink's 3 stages to be refilled (10 K tiles), rank 200 for the
# expand's 2 stages (4 rank chunks an output tile).
FULL_CHUNKS = Case("full_chunks", 128, 584, 136, 200, [200, 129], seg_starts=[0, 64, 128],
                   seg_slots=[0, 1], num_splits=1)

# On one SM an expand CTA takes several output tiles (costs.expand_out_tiles: 4 of the 4 here),
# so the next tile's first item is in flight when a tile's epilogue runs.
TILES_IN_FLIGHT = Case("tiles_in_flight", 70, 64, 256, 128, [128, 100], seg_starts=[0, 64, 70],
                       seg_slots=[0, 1], num_splits=1, num_sms=1)
SGMV_FULL_CHUNKS = sgmv_stage_probe("from tests.test_host_shim import FULL_CHUNKS as case")


def test_full_chunks_pass_on_the_unbroken_kernels() -> None:
    case = FULL_CHUNKS
    i = case.inputs(torch.float32)
    starts, slots = case.segments()
    t = host_harness.sgmv_shrink(i.x, starts, slots, i.a_table, i.pool.ranks, case.max_rank,
                                 splits=1)
    good_t = reference.shrink(i.x, i.slots, i.a_weights, i.pool.ranks, case.max_rank)
    check_t(t, good_t)
    host_harness.sgmv_expand(good_t, starts, slots, i.b_table, i.pool.scales, i.pool.ranks,
                             i.y, case.max_rank)
    expected = reference.lora_delta(i.x, i.y0, i.slots, i.a_weights, i.b_weights,
                                    i.pool.scales, i.pool.ranks, case.max_rank)
    check_y(i.y, i.y0, expected, case, "sgmv")


@pytest.mark.proc
def test_a_stage_refilled_while_other_warps_read_it_fails(tmp_path: Path) -> None:
    # The write-after-read __syncthreads before a stage is refilled, deleted in the shrink and
    # the expand. Warps that ran in lockstep at every mma had all read the stage before any
    # refilled it; run warp by warp, the first to reach the refill overwrites the others'
    # operands, on full 64-row chunks as on short ones.
    result = run_mutated(tmp_path, [
        ("sgmv.cu", r"\n *__syncthreads\(\);  // every warp is done with the stage[^\n]*", "", 2),
    ], SGMV_FULL_CHUNKS, keep=("sgmv.cu",))
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout)
    assert stage_race(outcome["t"], "sgmv_shrink"), outcome
    assert stage_race(outcome["y"], "sgmv_expand_f32"), outcome


BGMV_SHRINK = """
import json, torch
from metrale_cli.ops import host_harness, reference
from tests.support.kernel_cases import BGMV_CASES
case = BGMV_CASES[0]
i = case.inputs(torch.float32)
try:
    t = host_harness.bgmv_shrink(i.x, i.slots, i.a_table, i.pool.ranks, case.max_rank)
except RuntimeError as error:
    print(json.dumps({"error": str(error)}))
else:
    print(json.dumps({"t_nan": bool(torch.isnan(t).any())}))
"""


@pytest.mark.proc
def test_shared_memory_never_written_reads_nan(tmp_path: Path) -> None:
    # A warp whose partial sums are zero skips storing them, counting on shared memory that
    # starts zeroed (it does not on a GPU). K = 200 is one warp's share of a pass, so warps 1-3
    # never store: with `static` arrays they read zeros and the result was right; poisoned at
    # each CTA's start, they read NaN.
    assert BGMV_CASES[0].in_dim <= 32 * 8
    result = run_mutated(tmp_path, [
        ("bgmv.cu", r"if \(lane == 0\) partial\[warp\]\[i\] = v;",
         "if (lane == 0 && v != 0.f) partial[warp][i] = v;", 1),
    ], BGMV_SHRINK, keep=("bgmv.cu",))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"t_nan": True}


# B rows 0-7 of every slot zeroed: those output rows' sums are exact zeros in every CTA.
BGMV_EXPAND_ZERO_ROWS = """
import json, torch
from metrale_cli.ops import host_harness, reference
from tests.support.kernel_cases import BGMV_CASES
case = BGMV_CASES[0]
i = case.inputs(torch.float32)
for b in i.b_weights:
    if b is not None:
        b[:8] = 0
t = reference.shrink(i.x, i.slots, i.a_weights, i.pool.ranks, case.max_rank)
host_harness.bgmv_expand(t, i.slots, i.b_table, i.pool.scales, i.pool.ranks, i.y, case.max_rank)
print(json.dumps({"y_nan": bool(torch.isnan(i.y).any())}))
"""


@pytest.mark.proc
def test_a_template_kernel_s_shared_memory_never_written_reads_nan(tmp_path: Path) -> None:
    # bgmv_expand_body is a template: its row sums' shared array was a common symbol in .bss,
    # outside the poisoned section, zero at the first CTA and the last CTA's afterwards. A
    # group that skips storing a zero sum (counting on shared memory that starts zeroed) read
    # zeros in every CTA and passed; in the section, poisoned at each CTA's start, it reads NaN.
    result = run_mutated(tmp_path, [
        ("bgmv.cu", r"if \(s < BGMV_EXPAND_STEPS && row < rows\) acc_s\[row\] = v\[i\];",
         "if (s < BGMV_EXPAND_STEPS && row < rows && v[i] != 0.f) acc_s[row] = v[i];", 1),
    ], BGMV_EXPAND_ZERO_ROWS, keep=("bgmv.cu",))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"y_nan": True}
    unbroken = run_mutated(tmp_path / "unbroken", [], BGMV_EXPAND_ZERO_ROWS, keep=("bgmv.cu",))
    assert unbroken.returncode == 0, unbroken.stderr
    assert json.loads(unbroken.stdout) == {"y_nan": False}


def test_every_function_static_array_lies_in_the_poisoned_section() -> None:
    # g++ ignores the section attribute on a template's statics; the build's linker script
    # (host_harness.SHARED_SECTION_SCRIPT) gathers them, as common symbols, with the others.
    # Every function-static object of the build (the kernels' __shared__ arrays: CUDA allows no
    # other) lies between __start_ and __stop_metrale_shared, and nothing else does.
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) is absent")
    listing = subprocess.run([nm, "-S", str(host_harness.build())], capture_output=True,
                             text=True, check=True).stdout
    symbols = {}
    for line in listing.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[2] in "bBdD":
            symbols[parts[3]] = (int(parts[0], 16), int(parts[1], 16))
        elif len(parts) == 3 and parts[2].startswith("__st"):
            symbols[parts[2]] = (int(parts[0], 16), 0)
    start, stop = symbols["__start_metrale_shared"][0], symbols["__stop_metrale_shared"][0]
    statics = {n: at for n, at in symbols.items() if n.startswith("_ZZ")}
    templates = [n for n in statics if "_body" in n]
    assert templates, "no template kernel's __shared__ array among the build's statics"
    outside = [n for n, (at, size) in statics.items() if not (start <= at and at + size <= stop)]
    assert outside == [], f"__shared__ arrays outside the poisoned section: {outside}"
    inside = [n for n, (at, size) in symbols.items()
              if size and start <= at < stop and n not in statics]
    assert inside == [], f"objects that are no __shared__ array in the section: {inside}"


@pytest.mark.proc
def test_a_lane_that_exited_fails_a_shuffle_naming_it(tmp_path: Path) -> None:
    # The upper half of warps 1-3 (whose sums are zero at K = 200) returns before the
    # reduction: the full-mask shuffles name exited lanes (undefined on a GPU), which the shim
    # used to release without them, their stale exchange slots reading as zeros.
    result = run_mutated(tmp_path, [
        ("bgmv.cu", r"(\n  __shared__ float partial\[METRALE_WARPS\]\[BGMV_SHRINK_ROWS\];\n)",
         r"\n  if (tid >= 32 && (tid & 31) >= 16) return;\1", 1),
    ], BGMV_SHRINK, keep=("bgmv.cu",))
    assert result.returncode == 0, result.stderr
    error = json.loads(result.stdout)["error"]
    assert "lane 16, named in the mask 0xffffffff, has exited" in error
    assert "__shfl_xor_sync at " in error and "lora_common.cuh" in error


@pytest.mark.proc
def test_lanes_at_different_collectives_fail(tmp_path: Path) -> None:
    # The group sums' exchange written as two intrinsics, one per half of the lane group: the
    # same values, but on a GPU lanes of one shuffle at different intrinsics are undefined.
    script = """
import json, torch
from metrale_cli.ops import host_harness, reference
from tests.support.kernel_cases import BGMV_CASES
case = BGMV_CASES[0]
i = case.inputs(torch.float32)
t = reference.shrink(i.x, i.slots, i.a_weights, i.pool.ranks, case.max_rank)
try:
    host_harness.bgmv_expand(t, i.slots, i.b_table, i.pool.scales, i.pool.ranks, i.y,
                             case.max_rank)
except RuntimeError as error:
    print(json.dumps({"error": str(error)}))
else:
    print(json.dumps({"error": None}))
"""
    result = run_mutated(tmp_path, [
        ("bgmv.cu", r"v\[i\] = keep \+ __shfl_xor_sync\(0xffffffffu, send, offset\);",
         "v[i] = keep + (upper ? __shfl_xor_sync(0xffffffffu, send, offset)\n"
         "                                   : __shfl_sync(0xffffffffu, send, lane ^ offset));",
         1),
    ], script, keep=("bgmv.cu",))
    assert result.returncode == 0, result.stderr
    error = json.loads(result.stdout)["error"]
    assert error is not None and "meet at different collectives" in error
    assert "__shfl_xor_sync at " in error and "__shfl_sync at " in error


@pytest.mark.proc
def test_cp_async_misuse_fails_the_launch(tmp_path: Path) -> None:
    # The shrink's x copies from a source 2 bytes off its 16-byte vectors, and the expand's B
    # copies with a source size of 17 bytes: both undefined on a GPU (a misaligned cp.async
    # faults); the shim used to copy them (the 17th byte landing in the next vector, which its
    # own copy then overwrote).
    script = """
import json, torch
from metrale_cli.ops import host_harness, reference
from tests.test_host_shim import FULL_CHUNKS as case
i = case.inputs(torch.float32)
starts, slots = case.segments()
errors = []
try:
    host_harness.sgmv_shrink(i.x, starts, slots, i.a_table, i.pool.ranks, case.max_rank,
                             splits=1)
except RuntimeError as error:
    errors.append(str(error))
good_t = reference.shrink(i.x, i.slots, i.a_weights, i.pool.ranks, case.max_rank)
try:
    host_harness.sgmv_expand(good_t, starts, slots, i.b_table, i.pool.scales, i.pool.ranks, i.y,
                             case.max_rank)
except RuntimeError as error:
    errors.append(str(error))
print(json.dumps(errors))
"""
    result = run_mutated(tmp_path, [
        ("sgmv.cu", r"x_src\[i\] \+ at, col_ok", "x_src[i] + at + 1, col_ok", 1),
        ("sgmv.cu", r"out < out_dim \? b_bytes : 0\)", "out < out_dim ? (b_bytes ? 17 : 0) : 0)",
         1),
    ], script, keep=("sgmv.cu",))
    assert result.returncode == 0, result.stderr
    shrink, expand = json.loads(result.stdout)
    assert shrink.startswith("sgmv_shrink") and "not 16-byte aligned" in shrink
    assert expand.startswith("sgmv_expand") and "source size of 17 bytes (0..16)" in expand


@pytest.mark.proc
@pytest.mark.parametrize(("pattern", "replacement", "message"), [
    # The same barrier written once per branch of a divergent if: threads of one CTA at
    # different __syncthreads (undefined on a GPU, and released together by a shim that only
    # counted arrivals).
    (r"\n  __syncthreads\(\);\n  if \(tid < BGMV_SHRINK_ROWS",
     "\n  if (tid < 64) {\n    __syncthreads();\n  } else {\n    __syncthreads();\n  }\n"
     "  if (tid < BGMV_SHRINK_ROWS", "wait at different __syncthreads"),
    # Half of each warp skips the reduction: the other half waits at a full-mask shuffle that
    # its lanes at the __syncthreads never reach.
    (r"const float v = warp_sum\(acc\[i\]\);",
     "const float v = lane < 16 ? warp_sum(acc[i]) : acc[i];",
     "deadlock in block (0, 0, 0): warp 0 waits at a collective"),
], ids=["divergent_syncthreads", "partial_warp_shuffle"])
def test_divergent_barriers_fail_the_launch(tmp_path: Path, pattern: str, replacement: str,
                                            message: str) -> None:
    result = run_mutated(tmp_path, [("bgmv.cu", pattern, replacement, 1)], BGMV_SHRINK,
                         keep=("bgmv.cu",))
    assert result.returncode == 0, result.stderr
    error = json.loads(result.stdout)["error"]
    assert error.startswith("bgmv_shrink on the host: ") and message in error


# --- across CTAs: interleaved schedules, store visibility, and every buffer bounded -------------

# A split shrink (4 splits) and an SGMV shrink of 70 tokens (a full chunk, then 6 rows), small
# enough for a process of its own per mutation.
SPLIT_SHRINK = """
import json, os, torch
from metrale_cli.ops import host_harness, reference
from tests.support.kernel_cases import Case, check_t
kind = {kind!r}
if kind == "bgmv":
    case = Case("bgmv_split", 3, 1000, 64, 16, [16, 5, 9], slots=[0, 1, -1])
else:  # the last chunk (rows 64-69) is adapted and ends at the last row of x and t
    case = Case("sgmv_split", 70, 584, 64, 32, [32, 20], seg_starts=[0, 40, 70],
                seg_slots=[1, 0])
i = case.inputs(torch.float32)
expected = reference.shrink(i.x, i.slots, i.a_weights, i.pool.ranks, case.max_rank)
out = {{}}
for seed in {seeds!r}:
    os.environ["METRALE_HOST_SEED"] = str(seed)
    try:
        if kind == "bgmv":
            t = host_harness.bgmv_shrink(i.x, i.slots, i.a_table, i.pool.ranks, case.max_rank,
                                         splits={splits})
        else:
            starts, slots = case.segments()
            t = host_harness.sgmv_shrink(i.x, starts, slots, i.a_table, i.pool.ranks,
                                         case.max_rank, splits={splits})
    except RuntimeError as error:
        out[seed] = str(error)
    else:
        out[seed] = "same" if torch.allclose(t, expected, rtol=1e-3, atol=1e-3) else "differs"
print(json.dumps(out))
"""


def split_shrink(kind: str, splits: int, seeds: tuple[int, ...] = (0, 1, 2, 3)) -> str:
    return SPLIT_SHRINK.format(kind=kind, splits=splits, seeds=list(seeds))


def _results(result: Any) -> dict[str, str]:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.proc  # a process of its own builds the mutated kernels
@pytest.mark.parametrize("kind", ["bgmv", "sgmv"])
def test_every_schedule_runs_the_unbroken_split_shrinks(tmp_path: Path, kind: str) -> None:
    # Round-robin, reversed, random and depth-first CTA schedules: the reference's t each time.
    result = run_mutated(tmp_path, [], split_shrink(kind, 4), keep=(f"{kind}.cu",))
    assert _results(result) == {"0": "same", "1": "same", "2": "same", "3": "same"}


# The last CTA's reads of the partials moved before its ticket: the CTA that draws the last
# ticket has read while other splits had not yet stored. A shim that ran CTAs one at a time in
# grid order passed it (the last ticket was always drawn after every split had stored).
READ_BEFORE_TICKET = {
    "bgmv": [
        ("bgmv.cu", r"\n    if \(!split_last\(tickets, tile, active, &ticket\)\) return;", "", 1),
        ("bgmv.cu", r"(tid % BGMV_SHRINK_ROWS\]\);\n)    __syncthreads\(\);",
         r"\1    if (!split_last(tickets, tile, active, &ticket)) return;", 1),
    ],
    "sgmv": [
        ("sgmv.cu", r"if \(!split_last\(tickets, tile, active, reinterpret_cast<unsigned\*>"
                    r"\(x_tile\[0\]\)\)\) return;", "__threadfence();", 1),
        ("sgmv.cu", r"(      \}\n    \}\n)(  \}\n\n  // Rows of a skipped chunk)",
         r"\1    if (!split_last(tickets, tile, active, reinterpret_cast<unsigned*>(x_tile[0])))"
         r" return;\n\2", 1),
    ],
}


@pytest.mark.proc  # a process of its own builds the mutated kernels
@pytest.mark.parametrize("kind", ["bgmv", "sgmv"])
def test_partials_read_before_the_last_ticket_fail_on_both_kernels(tmp_path: Path,
                                                                   kind: str) -> None:
    # Depth-first: the first CTA reads, is held at its ticket, and draws the last one after the
    # other splits stored; a race of the read and a store, whichever comes first, is named.
    results = _results(run_mutated(tmp_path, READ_BEFORE_TICKET[kind], split_shrink(kind, 4),
                                   keep=(f"{kind}.cu",)))
    error = results["3"]
    assert error.startswith(f"{kind}_shrink on the host: block ("), error
    assert re.search(r"__stcg to partials\[\d+\].*read \(__ldcg\) earlier in this launch"
                     r"|__ldcg of partials\[\d+\].*had not fenced", error), error
    # The SGMV shrink issues cp.async copies: its failures name their landing too.
    assert re.search(r"\[depth-first CTA schedule, (cp\.async landing at its wait, )?seed 3\]$",
                     error), error


@pytest.mark.proc  # a process of its own builds the mutated kernels
def test_partials_unfenced_at_the_ticket_fail_naming_the_store(tmp_path: Path) -> None:
    # The fence moved after the ticket: the last CTA reads a partial another CTA has stored but
    # not fenced (on a GPU it may land after the read).
    results = _results(run_mutated(tmp_path, [
        ("lora_common.cuh", r"\n  __threadfence\(\);  // this thread's partial stores[^\n]*", "",
         1),
        ("lora_common.cuh", r"(\*ticket = atomicAdd\(&tickets\[tile\], 1u\);\n)",
         r"\1  __threadfence();\n", 1),
    ], split_shrink("bgmv", 4, (0,)), keep=("bgmv.cu",)))
    assert "__ldcg of partials[" in results["0"] and "had not fenced" in results["0"]
    assert results["0"].endswith("[round-robin CTA schedule, seed 0]")


# SGMV row-bound bugs: each was caught, if at all, by a SIGSEGV of the test process.
ROW_BOUND_BUGS = {
    # A chunk's row count one too many: its CTA copies and writes one row past the chunk.
    "chunk_rows_one_too_many": (
        ("sgmv.cu", r"static_cast<int>\(v\.y\) - static_cast<int>\(v\.x\),",
         "static_cast<int>(v.y) - static_cast<int>(v.x) + 1,", 1),
        r"a store to t\[2240\]|cp_async16 of 16 bytes at x\[\d+\]"),
    # The shrink copies one x row past its chunk.
    "x_row_past_the_chunk": (
        ("sgmv.cu", r"x_keep\[i\] = row < chunk\.rows;", "x_keep[i] = row <= chunk.rows;", 1),
        r"cp_async16 of 16 bytes at x\[\d+\]"),
    # The shrink stores one t row past its chunk.
    "t_row_past_the_chunk": (
        ("sgmv.cu", r"if \(row >= chunk\.rows\) continue;", "if (row > chunk.rows) continue;", 1),
        r"a store to t\[2240\] \(t has 2240; out of bounds\) faulted"),
}


@pytest.mark.proc  # a process of its own builds the mutated kernels
@pytest.mark.parametrize("bug", sorted(ROW_BOUND_BUGS))
def test_a_row_past_a_chunk_fails_naming_buffer_element_and_thread(tmp_path: Path,
                                                                  bug: str) -> None:
    edit, message = ROW_BOUND_BUGS[bug]
    # Two launches in one process: a fault leaves the next launch's faults caught too (the
    # handler jumps out with its signal unblocked; blocked, the second would kill the process).
    results = _results(run_mutated(tmp_path, [edit], split_shrink("sgmv", 1, (0, 1)),
                                   keep=("sgmv.cu",)))
    for error in (results["0"], results["1"]):
        assert error.startswith("sgmv_shrink on the host: block ("), error
        assert re.search(r"block \(\d+, \d+, \d+\) thread \d+: ", error), error
        assert re.search(message, error) and "out of bounds" in error, error


# A rank loop one row too far: the shrink reads A's row r, past the rank. The pool promises
# zeros there, and the cases used to keep them, so the extra row added nothing and both passed
# every test; the cases' padding now holds finite junk (kernel_cases.make_pool), which the
# extra row carries into t.
RANK_TAIL_BUGS = {
    "bgmv": ("bgmv.cu", r"const int rows = imin\(BGMV_SHRINK_ROWS, rank - j0\);",
             "const int rows = imin(BGMV_SHRINK_ROWS, rank - j0 + 1);", 1),
    "sgmv": ("sgmv.cu", r"&& j < rank;", "&& j <= rank;", 1),
}


@pytest.mark.proc  # a process of its own builds the mutated kernels
@pytest.mark.parametrize("kind", sorted(RANK_TAIL_BUGS))
def test_a_rank_loop_one_row_too_far_fails(tmp_path: Path, kind: str) -> None:
    # Ranks 5 and 9 (BGMV's 4-row tiles end past them) and 20 (SGMV's n8 tile 16-23 is live).
    results = _results(run_mutated(tmp_path, [RANK_TAIL_BUGS[kind]],
                                   split_shrink(kind, 1, (0,)), keep=(f"{kind}.cu",)))
    assert results == {"0": "differs"}, results


@pytest.mark.proc  # a process of its own builds the mutated kernels
def test_a_store_to_a_stage_in_flight_is_a_race_naming_both_sides(tmp_path: Path) -> None:
    # The expand stages its finished output tile in the stage whose copies (the next item's)
    # are still in flight, and reads it back before the wait that lands them. Copies that land
    # only at their wait never show it (the stores are read and then overwritten by the copies,
    # as the kernel meant); on a GPU the copies may land in between. The shim checks, after each
    # warp runs, that no store reached a copy's destination while it was in flight.
    result = run_mutated(tmp_path, [
        ("sgmv.cu", r"float\* staged = t_tile\[stage\];",
         "float* staged = t_tile[(stage + 1) % SGMV_EXPAND_STAGES];", 1),
    ], sgmv_stage_probe("from tests.test_host_shim import TILES_IN_FLIGHT as case"),
        keep=("sgmv.cu",))
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout)
    assert outcome["t"] == "ok", outcome
    # The writer (a warp of the CTA) and the copy (its thread and the cp_async16 call site).
    assert re.search(r"^sgmv_expand_f32 on the host: block \(\d+, \d+, \d+\): warp \d \(threads "
                     r"\d+\.\.\d+\) stored to shared byte \d+, the destination of thread \d+'s "
                     r"cp_async16 at .*sgmv\.cu:\d+, while that copy was in flight",
                     outcome["y"]), outcome


# split_last's ticket drawn by a plain load and store of the counter instead of atomicAdd.
PLAIN_TICKET = ("lora_common.cuh", r"\*ticket = atomicAdd\(&tickets\[tile\], 1u\);",
                "{ *ticket = tickets[tile]; tickets[tile] = *ticket + 1u; }", 1)


@pytest.mark.proc  # a process of its own builds the mutated kernels
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                    reason="the shim single-steps plain accesses by x86-64's trap flag")
@pytest.mark.parametrize("kind", ["bgmv", "sgmv"])
def test_a_ticket_drawn_by_a_plain_read_and_write_loses_updates(tmp_path: Path,
                                                                kind: str) -> None:
    # On a GPU two splits may read the counter before either writes it back: both draw the same
    # ticket and one count is lost. The shim seals the workspace while a CTA runs, so each plain
    # load or store of it is a point where another CTA may run: under round-robin every split
    # reads the counter before any writes it, no split draws the last ticket, and the launch
    # leaves t unwritten and its counters non-zero, which the harness refuses.
    results = _results(run_mutated(tmp_path, [PLAIN_TICKET], split_shrink(kind, 4),
                                   keep=(f"{kind}.cu",)))
    assert results["0"].startswith(f"{kind}_shrink left ") and "ticket counter" in results["0"], (
        results)
