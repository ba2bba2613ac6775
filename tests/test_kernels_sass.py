"""What the kernels' speed rests on, checked in their sm_90 machine code without a GPU.

Each kernel source is compiled for sm_90 (nvcc -cubin) and disassembled (nvdisasm, from the
`nvidia-cuda-nvdisasm` wheel in the test extra, or the CUDA toolkit's). Then, per kernel:

- no local memory: no LDL/STL instruction (a register spill would put local-memory round trips
  inside the streaming loops);
- memory-level parallelism: in every hot loop (an innermost loop that issues 128-bit global
  loads), at least the number of independent LDG.E.128 that kernels/lora_config.h states
  (`<KERNEL>_LOADS`) are issued before the first instruction that reads a register one of them
  loads. A loop that branches around each load, or uses each load before issuing the next, has
  a count of 1 or 2 and fails. A cp.async pipeline (the SGMV kernels) counts its distinct
  copies per iteration times the groups its wait leaves in flight: waiting for every group
  (`cp_async_wait<0>`) drops the shrink from 24 to 8 and fails;
- split-K's hand-off (sass.split_handoff): the fence between a split's partial stores and its
  ticket, the fence after the ticket, and L2-coherent reads of the partials; removing the
  first fence, or reading the partials with plain loads, fails;
- the last CTA's reads of the partials (sass.split_reads), for sm_80 and sm_90: the round
  trips the model charges (costs.SPLIT_READS) at every split count are the machine code's.

Skipped, with the reason, where nvcc or nvdisasm is absent; --require-nvcc makes that a failure.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from metrale_cli.bench import roofline
from metrale_cli.ops import costs, sass, sources
from metrale_cli.ops.sass import hot_loops, loads_before_first_use, parse
from tests.support.mutated_kernels import kernel_copy

pytestmark = pytest.mark.nvcc
# The tests that compile the kernels (every source by nvcc and by NVRTC, about 50 CPU-seconds in
# all) are slow; the counter tests read made-up listings and stay in the quick tier.

ARCH = "sm_90"
# nvcc is what CI compiles; NVRTC is what CuPy compiles with at run time.
COMPILERS = ("nvcc", "nvrtc")


@pytest.fixture(autouse=True)
def _tools(request: pytest.FixtureRequest) -> None:
    """Skip where nvdisasm (or, for NVRTC's machine code, libnvrtc) is absent, with the reason
    (a failure under --require-nvcc, as in CI, which installs both with the test extra)."""
    if request.node.name.startswith("test_the_counter"):
        return
    missing = []
    if sass.nvdisasm() is None:
        missing.append("nvdisasm (pip install nvidia-cuda-nvdisasm)")
    if "nvrtc" in request.node.name and sass.nvrtc_library() is None:
        missing.append("libnvrtc (pip install nvidia-cuda-nvrtc)")
    if "nvcc" in request.node.name and shutil.which("nvcc") is None:
        missing.append("nvcc")
    if not missing:
        return
    reason = f"{', '.join(missing)} absent; both wheels are in the test extra"
    if request.config.getoption("--require-nvcc"):
        pytest.fail(f"--require-nvcc was given but {reason}", pytrace=False)
    pytest.skip(reason)


def kernel_code(name: str, compiler: str = "nvcc") -> list[sass.Instruction]:
    return parse(sass.listing(sources.KERNEL_SOURCES[name], compiler, ARCH))[name]


@pytest.mark.slow
@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("name", sorted(sources.KERNEL_SOURCES))
def test_no_local_memory(name: str, compiler: str) -> None:
    local = [f"{i.opcode} {i.operands}" for i in kernel_code(name, compiler)
             if i.opcode.startswith(("LDL", "STL"))]
    assert not local, f"{name} ({compiler}) spills to local memory: {local[:4]}"


# What the check found in NVRTC's machine code before the SGMV pipelines: NVRTC 13.5 issued the
# SGMV expand's rank-chunk pass (4 B and 8 t vectors into registers) one load before the first
# use, converting each t vector as it landed, where nvcc kept 7. The expand now streams both
# tiles by cp.async, which loads no register: NVRTC keeps the 24 copies in flight as nvcc does,
# and the strict expected failure that held the finding became a pass.
def _hot_loop_cases() -> list[Any]:
    return [pytest.param(name, compiler, id=f"{name}-{compiler}")
            for name in sorted(sources.KERNEL_SOURCES) for compiler in COMPILERS]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "compiler"), _hot_loop_cases())
def test_hot_loops_keep_the_documented_loads_in_flight(name: str, compiler: str) -> None:
    code = kernel_code(name, compiler)
    loops = hot_loops(code)
    assert loops, f"{name} has no loop issuing 128-bit global loads"
    wanted = sources.loads_in_flight(name)
    counts = [sass.loop_loads(code, head, end) for head, end in loops]
    assert min(counts) >= wanted, (
        f"{name} ({compiler}): a hot loop keeps only {min(counts)} distinct, unpredicated "
        f"128-bit loads in flight (per loop: {counts}); kernels/lora_config.h promises {wanted}"
    )


@pytest.mark.slow
@pytest.mark.parametrize("compiler", COMPILERS)
def test_load_chains_are_what_the_model_charges(compiler: str) -> None:
    """The dependent loads before the weight stream and the loops that carry a load chain, as
    the machine code has them, against the serial round trips the roofline model charges."""
    # bgmv_shrink: slots[b] -> a_table[slot] -> A: the model's 2 chains, then the stream.
    shrink = sass.kernel_report(kernel_code("bgmv_shrink", compiler))
    work = roofline.plan_launch("shrink", 256, 256, 64, 2048, 8192, 132)
    assert work.kernel == "bgmv_shrink"
    assert shrink["stream_depth"] == work.cta_chains + 1
    # bgmv_expand: slots[b], then b_table[slot] beside ranks[slot] (slot_rank: not behind the
    # address), then the t row: at most the model's 3 chains before the B stream.
    for name in ("bgmv_expand_bf16", "bgmv_expand_f32"):
        expand = sass.kernel_report(kernel_code(name, compiler))
        work = roofline.plan_launch("expand", 256, 256, 64, 2048, 8192, 132)
        assert work.kernel.startswith("bgmv_expand")
        assert expand["stream_depth"] <= work.cta_chains + 1, name
    # SGMV: a CTA's chunk, then its slot's table entry (beside the rank and the token order),
    # then the cp.async stream: the model's 2 chains, and no loop carries a load chain (the
    # binary search over the segments is gone with the work list).
    for name, kind in (("sgmv_shrink", "shrink"), ("sgmv_expand_bf16", "expand"),
                       ("sgmv_expand_f32", "expand")):
        report = sass.kernel_report(kernel_code(name, compiler))
        work = roofline.plan_launch(kind, 4096, 8, 64, 2048, 8192, 132)
        assert work.kernel.startswith(name.removesuffix("_f32").removesuffix("_bf16"))
        # The split shrink's ticket and reads of the partials come after its stream.
        after = (costs.split_reduction_round_trips("sgmv", work.splits, 64)
                 if kind == "shrink" else 0)
        assert report["copy_depth"] == work.cta_chains - after + 1, name
        assert report["chained_loops"] == 0, name


@pytest.mark.slow
@pytest.mark.parametrize(("name", "compiler"), _hot_loop_cases())
def test_pipeline_loops_wait_for_no_load_of_their_own(name: str, compiler: str) -> None:
    """The model charges an SGMV CTA ceil(items / SGMV_EXPAND_STAGES) round trips (roofline
    _sgmv_work's cta_passes): true only while nothing a pipeline iteration uses is loaded in
    that iteration. The expand's y vectors, loaded at the start of the item whose epilogue
    adds into them, cost every such item a round trip (4 BF16 / 8 F32 loads an iteration in
    the kernel before y was loaded a tile ahead); the check fails on that source."""
    code = kernel_code(name, compiler)
    trips = [sass.pipeline_round_trips(code, head, end) for head, end in hot_loops(code)]
    assert sum(trips) == 0, f"{name} ({compiler}): pipeline loops wait on their own loads: {trips}"
    if name.startswith("sgmv_expand"):
        items = 2 * 3  # 2 output tiles of rank 136 (3 rank chunks each) in one CTA
        work = roofline._sgmv_work("expand", (1, 1, 1), np.array([[0, 64, 0, 0]]), 64, 136,
                                   64, 128, 1, 2, out_tiles=2)
        assert work[3] == -(-items // sources.SGMV_EXPAND_STAGES)


@pytest.mark.slow
def test_the_nvrtc_report_covers_every_kernel() -> None:
    report = sass.report("nvrtc", ARCH)
    assert set(report["kernels"]) == set(sources.KERNEL_SOURCES)
    assert all(v["ok"] for v in report["kernels"].values()) and report["ok"]


SERIAL_LOOP = """
.text.k:
        /*0000*/                   MOV R2, R4 ;
.L_x_1:
        /*0010*/                   LDG.E.128.CONSTANT R12, desc[UR4][R2.64] ;
        /*0020*/                   SHF.L.U32 R7, R12, 0x10, RZ ;
        /*0030*/                   LDG.E.128.CONSTANT R16, desc[UR4][R8.64] ;
        /*0040*/                   FFMA R20, R17, R7, R20 ;
        /*0050*/               @P0 BRA `(.L_x_1) ;
        /*0060*/                   EXIT ;
"""


def test_the_counter_sees_serial_loads() -> None:
    code = parse(SERIAL_LOOP)["k"]
    assert hot_loops(code) == [(1, 5)]
    assert loads_before_first_use(code, 1, 5) == 1


DUPLICATES_AND_PREDICATED = """
.text.k:
        /*0000*/                   MOV R2, R4 ;
.L_x_1:
        /*0010*/                   LDG.E.128.CONSTANT R12, desc[UR4][R2.64] ;
        /*0020*/                   LDG.E.128.CONSTANT R16, desc[UR4][R2.64] ;
        /*0030*/               @P1 LDG.E.128.CONSTANT R20, desc[UR4][R8.64] ;
        /*0040*/                   IADD3 R2, R2, 0x10, RZ ;
        /*0050*/                   LDG.E.128.CONSTANT R24, desc[UR4][R2.64] ;
        /*0060*/                   FFMA R30, R13, R17, R30 ;
        /*0070*/               @P0 BRA `(.L_x_1) ;
        /*0080*/                   EXIT ;
"""


def test_the_counter_counts_distinct_unpredicated_loads() -> None:
    # A second load of [R2] is a duplicate, @P1's may never run; R2 rewritten is a new address.
    code = parse(DUPLICATES_AND_PREDICATED)["k"]
    assert loads_before_first_use(code, 1, 7) == 2


SEARCH_LOOP = """
.text.k:
        /*0000*/                   MOV R2, R4 ;
.L_x_1:
        /*0010*/                   LDG.E R5, desc[UR4][R2.64] ;
        /*0020*/                   ISETP.GT.AND P0, PT, R5, R7, PT ;
        /*0030*/                   SEL R6, R6, R5, P0 ;
        /*0040*/                   IMAD.WIDE R2, R6, 0x4, R10 ;
        /*0050*/               @P1 BRA `(.L_x_1) ;
        /*0060*/                   LDG.E.128.CONSTANT R12, desc[UR4][R2.64] ;
        /*0070*/                   EXIT ;
"""


def test_the_counter_sees_load_chains() -> None:
    search = parse(SEARCH_LOOP)["k"]
    assert sass.chained_loops(search) == [(1, 5)]
    assert sass.stream_depth(search) == 2
    streaming = parse(SERIAL_LOOP)["k"]
    assert sass.chained_loops(streaming) == []


# A switch over two instantiations: case .L_x_2 loads a vector whose value the other case's
# code (after it in program order) would feed into an address if the cases chained; after the
# join, one more load on the vector each case produced.
SWITCH = """
.text.k:
        /*0000*/                   LDG.E R4, desc[UR4][R2.64] ;
        /*0010*/                   BRX R4 -0x20 (*"BRANCH_TARGETS .L_x_1,.L_x_2"*) ;
.L_x_1:
        /*0020*/                   LDG.E.128.CONSTANT R8, desc[UR4][R6.64] ;
        /*0030*/                   BRA `(.L_x_3) ;
.L_x_2:
        /*0040*/                   IMAD.WIDE R6, R9, 0x4, R10 ;
        /*0050*/                   LDG.E.128.CONSTANT R12, desc[UR4][R6.64] ;
.L_x_3:
        /*0060*/                   LDG.E.128.CONSTANT R16, desc[UR4][R8.64] ;
        /*0070*/                   EXIT ;
"""


def test_the_chain_depth_follows_the_control_flow() -> None:
    # In program order R9 (loaded at depth 1 by case 1) would make case 2's load depth 2; the
    # cases are alternatives, so case 2's is depth 1. At the join R8 may come from case 1's
    # load: the last load is depth 2, the deepest.
    code = parse(SWITCH)["k"]
    assert sass.stream_depth(code) == 2
    assert sass.stream_depth(code[:-2] + code[-1:]) == 1


# An m16n8k16 mma's B fragment is two registers: the first HMMA reads R6-R7 (not R8, which the
# loop's first load writes); its A fragment is four (R6 as A would read R6-R9).
MMA_LOOP = """
.text.k:
.L_x_1:
        /*0000*/                   LDG.E.128.CONSTANT R8, desc[UR4][R2.64] ;
        /*0010*/                   HMMA.16816.F32.BF16 R20, R12, R6, R20 ;
        /*0020*/                   LDG.E.128.CONSTANT R24, desc[UR4][R4.64] ;
        /*0030*/                   HMMA.16816.F32.BF16 R20, R12, R8, R20 ;
        /*0040*/               @P0 BRA `(.L_x_1) ;
        /*0050*/                   EXIT ;
"""


def test_the_counter_reads_an_mma_s_fragments_at_their_widths() -> None:
    code = parse(MMA_LOOP)["k"]
    assert loads_before_first_use(code, 0, 4) == 2
    a_operand = parse(MMA_LOOP.replace("R20, R12, R6, R20", "R20, R6, R14, R20"))["k"]
    assert loads_before_first_use(a_operand, 0, 4) == 1


PIPELINE = """
.text.k:
        /*0000*/                   MOV R2, R4 ;
.L_x_1:
        /*0010*/                   DEPBAR.LE SB0, 0x2 ;
        /*0020*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0030*/                   LDS R7, [R9] ;
        /*0040*/                   LDGSTS.E.BYPASS.128 [R10], desc[UR4][R2.64], P0 ;
        /*0050*/                   LDGSTS.E.BYPASS.128 [R11], desc[UR4][R2.64], P0 ;
        /*0060*/                   LDGSTS.E.BYPASS.128.ZFILL [R12], desc[UR4][R14.64], P1 ;
        /*0070*/               @P2 LDGSTS.E.BYPASS.128 [R13], desc[UR4][R16.64], P0 ;
        /*0080*/                   LDGDEPBAR ;
        /*0090*/               @P3 BRA `(.L_x_1) ;
        /*00a0*/                   EXIT ;
"""


def test_the_counter_counts_a_pipeline_s_copies_across_its_groups() -> None:
    # 2 distinct unpredicated copies an iteration (a repeated address and a predicated copy do
    # not count), 3 groups in flight at DEPBAR.LE SB0, 2: 6. Waiting for all (0x0): 2.
    code = parse(PIPELINE)["k"]
    assert hot_loops(code) == [(1, 9)]
    assert sass.loop_loads(code, 1, 9) == 6
    serial = parse(PIPELINE.replace("SB0, 0x2", "SB0, 0x0"))["k"]
    assert sass.loop_loads(serial, 1, 9) == 2
    assert not code[8].is_global_load  # LDGDEPBAR commits; it loads nothing


CARRY_CHAIN = """
.text.k:
        /*0000*/                   LDG.E.64.CONSTANT R14, desc[UR8][R2.64] ;
        /*0010*/                   ISETP.EQ.U32.AND P2, PT, R14, RZ, PT ;
        /*0020*/                   LEA R32, P2, R7, UR4, 0x2 ;
        /*0030*/                   LEA.HI.X R33, R7, UR5, R8, 0x2, P2 ;
        /*0040*/                   LDG.E.CONSTANT R9, desc[UR8][R32.64] ;
        /*0050*/                   LDGSTS.E.BYPASS.128 [R10], desc[UR8][R32.64] ;
        /*0060*/                   EXIT ;
"""


def test_a_carry_out_beside_the_destination_is_written_not_read() -> None:
    # LEA's P2 is its carry out: the address in R32:R33 does not wait for the table entry
    # behind the older P2, so the copy is 1 load deep, not 2 (NVRTC reuses such predicates).
    code = parse(CARRY_CHAIN)["k"]
    assert code[2].writes() == {"R32", "P2"} and "P2" not in code[2].reads()
    assert "P2" in code[3].reads()
    assert sass.stream_depth(code, copies_only=True) == 1


# A pipeline iteration that loads R20 (y) beside its copies and reads it in its epilogue: one
# round trip of its own; the same load a tile ahead (read only by a later iteration's code,
# outside this loop) is none.
PIPELINE_WITH_Y = """
.text.k:
.L_x_1:
        /*0000*/                   LDG.E.128 R20, desc[UR4][R4.64] ;
        /*0010*/                   DEPBAR.LE SB0, 0x1 ;
        /*0020*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0030*/                   HMMA.16816.F32.BF16 R8, R12, R6, R8 ;
        /*0040*/                   FADD R21, R21, R8 ;
        /*0050*/                   STG.E.128 desc[UR4][R4.64], R20 ;
        /*0060*/                   LDGSTS.E.BYPASS.128 [R10], desc[UR4][R2.64], P0 ;
        /*0070*/                   LDGDEPBAR ;
        /*0080*/               @P3 BRA `(.L_x_1) ;
        /*0090*/                   EXIT ;
"""


def test_the_counter_sees_a_pipeline_loop_s_own_round_trips() -> None:
    code = parse(PIPELINE_WITH_Y)["k"]
    assert sass.pipeline_round_trips(code, 0, 8) == 1
    ahead = parse(PIPELINE_WITH_Y.replace("FADD R21, R21, R8", "FADD R31, R31, R8")
                  .replace("[R4.64], R20", "[R4.64], R28"))["k"]
    assert sass.pipeline_round_trips(ahead, 0, 8) == 0
    # Without copies the loop is a register-load pass (loads_before_first_use counts it).
    plain = parse(PIPELINE_WITH_Y.replace("LDGSTS.E.BYPASS.128 [R10], desc[UR4][R2.64], P0",
                                          "NOP"))["k"]
    assert sass.pipeline_round_trips(plain, 0, 8) == 0


# --- split-K's hand-off: the release fence before the ticket, coherent reads after it --------

SPLIT_KERNELS = ("bgmv_shrink", "sgmv_shrink")


@pytest.mark.slow
@pytest.mark.parametrize(("name", "compiler"),
                         [pytest.param(n, c, id=f"{n}-{c}") for n in SPLIT_KERNELS
                          for c in COMPILERS])
def test_the_split_handoff_is_fenced_and_reads_at_l2(name: str, compiler: str) -> None:
    handoff = sass.split_handoff(kernel_code(name, compiler))
    assert handoff is not None, f"{name} ({compiler}) takes no ticket"
    assert sass.handoff_ok(handoff), f"{name} ({compiler}): {handoff}"


@pytest.mark.slow
def test_only_the_split_kernels_take_tickets() -> None:
    report = sass.report("nvrtc", ARCH)["kernels"]
    assert {n for n, k in report.items() if k["split_handoff"]} == set(SPLIT_KERNELS)


@pytest.mark.slow
@pytest.mark.parametrize(("edit", "broken"), [
    # The release: without it a split's partial stores may land after its ticket, and the
    # last CTA sums stale partials.
    (("lora_common.cuh", r"\n  __threadfence\(\);  // this thread's partial stores[^\n]*", "",
      1), "release"),
    # The partials read by weak loads: the last CTA's L1 may hold lines of them from before
    # the other splits stored (the acquire fence orders the loads, not the cache they hit).
    (("{source}", r"__ldcg\(", "*(", 1), "weak_reads"),
], ids=["fence_before_the_ticket_removed", "partials_read_weakly"])
@pytest.mark.parametrize("name", SPLIT_KERNELS)
def test_the_handoff_check_fails_without_the_fence_or_the_coherent_reads_nvcc(
        tmp_path: Path, name: str, edit: tuple[str, str, str, int], broken: str) -> None:
    source = sources.KERNEL_SOURCES[name]
    file, pattern, replacement, count = edit
    directory = kernel_copy(tmp_path, [(file.format(source=source), pattern, replacement, count)])
    code = parse(sass.disassemble(sass.nvcc_cubin(directory / source, ARCH)))[name]
    handoff = sass.split_handoff(code)
    assert handoff is not None and not sass.handoff_ok(handoff)
    assert (handoff[broken] > 0) if broken == "weak_reads" else not handoff[broken], handoff


SPLIT_HANDOFF = """
.text.k:
        /*0000*/                   STG.E.STRONG.GPU desc[UR4][R2.64], R3 ;
        /*0010*/                   MEMBAR.SC.GPU ;
        /*0020*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0030*/                   ATOMG.E.ADD.STRONG.GPU PT, R4, desc[UR4][R6.64], R7 ;
        /*0040*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0050*/                   ISETP.NE.AND P0, PT, R4, R8, PT ;
        /*0060*/               @P0 EXIT ;
        /*0070*/                   MEMBAR.SC.GPU ;
.L_x_1:
        /*0080*/                   LDG.E.STRONG.GPU R9, desc[UR4][R10.64] ;
        /*0090*/                   LDG.E.CONSTANT R11, desc[UR4][R12.64] ;
        /*00a0*/                   FADD R13, R9, R13 ;
        /*00b0*/               @P1 BRA `(.L_x_1) ;
        /*00c0*/                   EXIT ;
"""


def test_the_counter_reads_the_split_handoff() -> None:
    good = sass.split_handoff(parse(SPLIT_HANDOFF)["k"])
    assert good == {"tickets": 1, "release": True, "acquire": True, "coherent_reads": 1,
                    "weak_reads": 0}
    assert sass.handoff_ok(good)
    for old, new, broken in [
        ("MEMBAR.SC.GPU ;\n        /*0020*/", "NOP ;\n        /*0020*/", "release"),
        ("MEMBAR.SC.GPU ;\n.L_x_1:", "NOP ;\n.L_x_1:", "acquire"),
        ("LDG.E.STRONG.GPU R9", "LDG.E R9", "weak_reads"),
        ("MEMBAR.SC.GPU ;\n        /*0020*/", "MEMBAR.SC.CTA ;\n        /*0020*/", "release"),
    ]:
        handoff = sass.split_handoff(parse(SPLIT_HANDOFF.replace(old, new, 1))["k"])
        assert handoff is not None and not sass.handoff_ok(handoff), (old, new)
        assert (handoff[broken] > 0) if broken == "weak_reads" else not handoff[broken]
    # An F32 atomic is no ticket; a kernel without one has no hand-off to check.
    no_ticket = SPLIT_HANDOFF.replace("ATOMG.E.ADD.STRONG.GPU", "ATOMG.E.ADD.F32.FTZ.RN.STRONG.GPU")
    assert sass.split_handoff(parse(no_ticket)["k"]) is None


# --- the last CTA's reads of the partials: the round trips the model charges ------------------

SPLIT_ARCHS = ("sm_80", "sm_90")


def modelled_reads(code: list[sass.Instruction], name: str) -> dict[str, tuple[Any, ...]]:
    """A split kernel's reads of the partials as its machine code runs them (sass.split_reads),
    in the model's form (costs.SPLIT_READS: per shape class, (splits an iteration, round trips
    an iteration, whether it loops) in code order). BGMV's one read is a partial a thread, every
    split at once; an SGMV class is named by its values a thread a split (the loads' greatest
    common divisor: 8 at rank 16, 32 otherwise, costs.SPLIT_READ_VALUES)."""
    classes = sass.split_reads(code)
    if name == "bgmv_shrink":
        assert len(classes) == 1 and [(r.loads, r.repeats) for r in classes[0]] == [(1, False)], (
            f"{name}: the last CTA's reads are not one load a thread: {classes}")
        return {"bgmv": tuple((sources.MAX_SPLITS, r.trips, False) for r in classes[0])}
    named = {values: kind for kind, values in costs.SPLIT_READ_VALUES.items()}
    found: dict[str, tuple[Any, ...]] = {}
    for reads in classes:
        values = math.gcd(*(r.loads for r in reads))
        assert values in named, f"{name}: reads of {values} values a thread a split: {reads}"
        found[named[values]] = tuple((r.loads // values, r.trips, r.repeats) for r in reads)
    return found


def split_read_mismatches(code: list[sass.Instruction], name: str, arch: str) -> list[str]:
    """Where the model's charge for the last CTA's reads (costs.SPLIT_READS and
    split_reduction_round_trips at every split count) is not what the machine code runs."""
    kind = name.removesuffix("_shrink")
    found = modelled_reads(code, name)
    modelled = {c: r for c, r in costs.SPLIT_READS[arch].items() if c.startswith(kind)}
    problems = [f"{name} ({arch}) {c}: the machine code reads {found.get(c)}, the model charges "
                f"{modelled.get(c)} (splits an iteration, round trips an iteration, loops)"
                for c in sorted(set(found) | set(modelled)) if found.get(c) != modelled.get(c)]
    columns = {"bgmv": 64, "sgmv_narrow": 16, "sgmv_wide": 64}
    for c, reads in found.items():
        for splits in range(2, sources.MAX_SPLITS + 1):
            runs = costs.TICKET_ROUND_TRIPS + costs.read_round_trips(reads, splits)
            charged = costs.split_reduction_round_trips(kind, splits, columns[c], arch)
            if charged != runs:
                problems.append(f"{name} ({arch}) {c}, {splits} splits: the model charges "
                                f"{charged} round trips, the machine code takes {runs}")
                break
    return problems


@pytest.mark.slow
@pytest.mark.parametrize("arch", SPLIT_ARCHS)
@pytest.mark.parametrize("name", SPLIT_KERNELS)
def test_the_model_charges_the_reads_the_machine_code_runs_nvcc(name: str, arch: str) -> None:
    """The last CTA's reads of the partials, read from the nvcc machine code (its loops and
    their round trips an iteration), against what the model charges at every split count: the
    SGMV narrow tail unrolled by two, the wide pair of splits 2 round trips on sm_90."""
    code = parse(sass.listing(sources.KERNEL_SOURCES[name], "nvcc", arch))[name]
    assert split_read_mismatches(code, name, arch) == []


@pytest.mark.slow
def test_the_read_tie_fails_on_a_mutated_model_or_kernel_nvcc(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tie fails, naming the class, where the model prices the rank-16 read tail one split
    a round trip (the model before: it ignored the unroll), and where the kernel's tail is
    kept from unrolling (`#pragma unroll 1`: one split a round trip, against the model's two)."""
    code = parse(sass.listing("sgmv.cu", "nvcc", ARCH))["sgmv_shrink"]
    old = {**costs.SPLIT_READS[ARCH], "sgmv_narrow": ((sources.SGMV_SPLITS_PER_TRIP, 1, True),
                                                      (1, 1, True))}
    monkeypatch.setitem(costs.SPLIT_READS, ARCH, old)
    problems = split_read_mismatches(code, "sgmv_shrink", ARCH)
    assert any(p.startswith("sgmv_shrink (sm_90) sgmv_narrow: the machine code reads") for p in
               problems), problems
    # Named at the first split count the mutated model misprices.
    assert any("sgmv_narrow, 2 splits: the model charges 4 round trips, the machine code "
               "takes 3" in p for p in problems), problems
    monkeypatch.undo()
    directory = kernel_copy(tmp_path, [("sgmv.cu", r"\n(      for \(; z < active; \+\+z\)\n"
                                        r"#pragma unroll\n        for \(int nt = 0; nt < 2;)",
                                        r"\n#pragma unroll 1\n\1", 1)])
    mutated = parse(sass.disassemble(sass.nvcc_cubin(directory / "sgmv.cu", ARCH)))["sgmv_shrink"]
    problems = split_read_mismatches(mutated, "sgmv_shrink", ARCH)
    assert problems and all("sgmv_narrow" in p for p in problems), problems


SPLIT_READ_LISTING = """
.text.k:
        /*0000*/                   MEMBAR.SC.GPU ;
        /*0010*/                   ATOMG.E.ADD.STRONG.GPU PT, R4, desc[UR4][R6.64], R7 ;
        /*0020*/                   MEMBAR.SC.GPU ;
        /*0030*/               @P2 BRA `(.L_x_3) ;
.L_x_1:
        /*0040*/                   LDG.E.STRONG.GPU R9, desc[UR4][R10.64] ;
        /*0050*/                   LDG.E.STRONG.GPU R11, desc[UR4][R10.64+0x200] ;
        /*0060*/                   FADD R13, R9, R13 ;
        /*0070*/                   LDG.E.STRONG.GPU R9, desc[UR4][R10.64+0x400] ;
        /*0080*/                   FADD R13, R11, R13 ;
        /*0090*/                   FADD R13, R9, R13 ;
        /*00a0*/               @P1 BRA `(.L_x_1) ;
        /*00b0*/                   LDG.E.STRONG.GPU R9, desc[UR4][R10.64] ;
        /*00c0*/                   FADD R13, R9, R13 ;
        /*00d0*/                   BRA `(.L_x_4) ;
.L_x_3:
        /*00e0*/                   LDG.E.STRONG.GPU R9, desc[UR4][R10.64] ;
        /*00f0*/                   LDG.E.STRONG.GPU R11, desc[UR4][R10.64+0x200] ;
        /*0100*/                   FADD R13, R9, R13 ;
        /*0110*/                   FADD R13, R11, R13 ;
        /*0120*/               @P1 BRA `(.L_x_3) ;
.L_x_4:
        /*0130*/                   STG.E desc[UR4][R2.64], R13 ;
        /*0140*/                   EXIT ;
"""


def test_the_counter_reads_the_split_reads() -> None:
    # Two classes branch apart after the ticket and meet at the store: one a loop of 3 loads
    # whose third is issued after a wait for the first (2 round trips), then a straight read
    # of one; the other a loop of 2 loads issued back to back (1 round trip).
    code = parse(SPLIT_READ_LISTING)["k"]
    classes = [[(r.loads, r.trips, r.repeats) for r in c] for c in sass.split_reads(code)]
    assert classes == [[(3, 2, True), (1, 1, False)], [(2, 1, True)]]
    no_ticket = SPLIT_READ_LISTING.replace("ATOMG.E.ADD.STRONG.GPU", "NOP")
    assert sass.split_reads(parse(no_ticket)["k"]) == []
    # The model's reads: loops take whole iterations, largest first, a straight read the rest.
    assert costs.read_round_trips(((4, 1, True), (1, 1, False), (2, 1, True)), 7) == 3
    assert costs.read_round_trips(((2, 2, True), (1, 1, True)), 5) == 5
    with pytest.raises(ValueError, match="leave 1 of 3 splits unread"):
        costs.read_round_trips(((2, 1, True),), 3)
