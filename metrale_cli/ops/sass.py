"""The kernels' machine code, read without a GPU: compile a kernel source (nvcc, or NVRTC as
CuPy compiles it at run time), disassemble it (nvdisasm) and check what the kernels' speed rests
on, per kernel:

- no local memory (LDL/STL: a register spill puts local-memory round trips in the loops);
- in every hot loop (an innermost loop issuing 128-bit global loads), the distinct 128-bit loads
  issued before the first instruction that reads a register one of them loaded. Distinct: a
  load whose predicate may turn it off (`@P0 LDG`) is not counted, nor a second load of the
  same address operand. A pipelined loop of cp.async copies (LDGSTS, which load no register)
  keeps its distinct copies per iteration times the groups in flight at its wait
  (`DEPBAR.LE SB0, N`: N + 1). kernels/lora_config.h states the count each kernel keeps;
- the dependent global-load chains: how many loads, one waiting for another's value, precede
  the first 128-bit stream load (slot -> table[slot] -> weights is 3; `copy_depth`: the same
  for cp.async copies, the SGMV pipelines' stream), and which loops carry a
  load chain from one iteration to the next (a binary search: each probe's address depends on
  the last probe's value). The roofline model (bench_kernels) charges these as serial round
  trips; tests/test_kernels_sass.py ties the two;
- in a cp.async pipeline loop, no register load whose value the same iteration reads
  (`pipeline_round_trips`): the pipeline's wait covers only copies issued iterations before,
  so such a load (the SGMV expand's y vectors, until they were loaded a tile ahead) costs every
  iteration a round trip of its own that the model would not charge;
- split-K's hand-off (`split_handoff`): in a kernel that takes a ticket (a 32-bit integer
  `ATOMG.E.ADD`), a GPU-scope fence (`MEMBAR.*.GPU` or `.SYS`) between the CTA's last global
  store before the ticket and the ticket (the release of its partials), another between the
  ticket and the first load after it (the acquire), and every load the ticket can reach
  L2-coherent (`LDG.E.STRONG.GPU`) but those of the read-only path (`.CONSTANT`, which the
  kernels use only for inputs that no thread writes). A weak `LDG.E` may hit a stale L1 line.

NVRTC is loaded from the `nvidia-cuda-nvrtc` wheel (or the CUDA toolkit), which needs no GPU;
nvdisasm likewise from `nvidia-cuda-nvdisasm`. `python -m metrale_cli.ops.sass` writes the report
for every kernel as JSON (`--nvrtc-device`: NVRTC for the present GPU's architecture, what
scripts/gpu_check.sh runs).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import json
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from metrale_cli.errors import ToolMissing
from metrale_cli.ops import sources

# The options CuPy's RawModule compiles the kernels with (kernels._module), and the arch.
NVRTC_OPTIONS = ("-std=c++17",)
_REGISTER = re.compile(r"(?<![A-Z_])(U?R|P)(\d+)(\.64)?\b")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_INSTRUCTION = re.compile(
    r"/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*(.*?)\s*;")
_BRANCH_TARGET = re.compile(r"`\((\.L_x_\d+)\)")
_BRX_TARGETS = re.compile(r"\.L_x_\d+")
_NO_DESTINATION = {"ST", "STG", "STS", "STL", "RED", "BRA", "EXIT", "BAR", "RET", "CALL",
                   "BSYNC", "BSSY", "WARPSYNC", "NOP", "DEPBAR"}


# --- the tools ----------------------------------------------------------------------------------


def nvdisasm() -> str | None:
    """nvdisasm from the toolkit on PATH, else from the nvidia-cuda-nvdisasm wheel."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    for root in map(Path, sys.path):
        for candidate in sorted(root.glob("nvidia/cu*/bin/nvdisasm")):
            if candidate.is_file():
                return str(candidate)
    return None


def nvrtc_library() -> str | None:
    """libnvrtc from the nvidia-cuda-nvrtc wheel, else the toolkit's, else the loader's."""
    for root in map(Path, sys.path):
        for candidate in sorted(root.glob("nvidia/cu*/lib/libnvrtc.so*")):
            if candidate.is_file():
                return str(candidate)
    cuda = Path("/usr/local/cuda")
    for toolkit in (cuda / "lib64", cuda / "targets" / "x86_64-linux" / "lib"):
        found = sorted(toolkit.glob("libnvrtc.so*"))
        if found:
            return str(found[0])
    return ctypes.util.find_library("nvrtc")


@functools.cache
def _nvrtc(path: str) -> ctypes.CDLL:
    return ctypes.CDLL(path)


def nvrtc_cubin(source: str, arch: str, name: str = "kernel.cu") -> bytes:
    """Machine code for `arch` (sm_XX) of the CUDA source text, compiled by NVRTC with CuPy's
    options; ToolMissing without libnvrtc, RuntimeError (with NVRTC's log) on a failed compile."""
    path = nvrtc_library()
    if path is None:
        raise ToolMissing("NVRTC is absent (pip install nvidia-cuda-nvrtc; it is in the test "
                          "extra)")
    lib = _nvrtc(path)
    program = ctypes.c_void_p()

    def check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"NVRTC {what} failed with status {status}")

    check(lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), name.encode(), 0, None,
                                 None), "nvrtcCreateProgram")
    try:
        options = [*NVRTC_OPTIONS, f"-arch={arch}"]
        array = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
        status = lib.nvrtcCompileProgram(program, len(options), array)
        if status != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(program, log)
            raise RuntimeError(f"NVRTC could not compile {name} for {arch}:\n"
                               f"{log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        check(lib.nvrtcGetCUBINSize(program, ctypes.byref(size)), "nvrtcGetCUBINSize")
        cubin = ctypes.create_string_buffer(size.value)
        check(lib.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN")
        return cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(program))


def nvcc_cubin(source_path: Path, arch: str) -> bytes:
    """Machine code for `arch` of a kernel source file, compiled by nvcc -cubin."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise ToolMissing("nvcc is not on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        subprocess.run([nvcc, f"-arch={arch}", "-std=c++17", "-cubin", "-o", str(cubin),
                        str(source_path)], check=True, capture_output=True, text=True)
        return cubin.read_bytes()


def disassemble(cubin: bytes) -> str:
    """nvdisasm's listing of a cubin; ToolMissing without nvdisasm."""
    tool = nvdisasm()
    if tool is None:
        raise ToolMissing("nvdisasm is absent (pip install nvidia-cuda-nvdisasm; it is in the "
                          "test extra)")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        return subprocess.run([tool, "-c", str(path)], check=True, capture_output=True,
                              text=True).stdout


@functools.cache
def listing(source: str, compiler: str, arch: str) -> str:
    """The disassembly of kernels/<source> compiled by `compiler` ("nvcc" or "nvrtc")."""
    directory = sources.find_kernel_dir()
    if compiler == "nvcc":
        return disassemble(nvcc_cubin(directory / source, arch))
    if compiler == "nvrtc":
        return disassemble(nvrtc_cubin(sources.read_source(source, directory), arch, source))
    raise ValueError(f"unknown compiler {compiler!r}")


# --- reading the machine code -------------------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    opcode: str
    operands: str
    label: str | None  # the label just above it, if any
    predicate: str | None = None  # "@P0", "@!P1"...; None (or "@PT") always executes

    @property
    def is_global_load(self) -> bool:
        return self.opcode.startswith("LDG") and not self.opcode.startswith("LDGDEPBAR")

    @property
    def is_async_copy(self) -> bool:
        """cp.async (LDGSTS): a global load into shared memory that writes no register."""
        return self.opcode.startswith("LDGSTS")

    @property
    def is_vector_load(self) -> bool:
        return self.opcode.startswith("LDG.E.128") or (self.is_async_copy
                                                        and ".128" in self.opcode)

    @property
    def always_runs(self) -> bool:
        return self.predicate in (None, "@PT")

    def address(self) -> str:
        """The global address operand of a load ('desc[UR4][R2.64+0x10]'): the second operand,
        after the destination register (LDG) or shared address (LDGSTS)."""
        parts = self.operands.split(",")
        return parts[1].strip() if len(parts) > 1 else ""

    def _registers(self) -> list[re.Match[str]]:
        return list(_REGISTER.finditer(self.operands))

    def _has_destination(self) -> bool:
        return self.opcode.split(".")[0] not in _NO_DESTINATION

    def _destinations(self) -> list[re.Match[str]]:
        """The destination register, then the predicates written beside it: the operands
        right after it that are predicates (ISETP's second result, the carry out of LEA,
        IADD3 and IMAD.WIDE: `LEA R2, P0, R7, R4`); a predicate later on (LEA.HI.X's carry
        in, SEL's condition) is read."""
        registers = self._registers()
        if not self._has_destination() or not registers:
            return []
        if "[" in self.operands[: registers[0].start()]:
            return []
        written = [registers[0]]
        for match in registers[1:]:
            gap = self.operands[written[-1].end(): match.start()]
            if match.group(1) != "P" or gap.strip() != ",":
                break
            written.append(match)
        return written

    def writes(self) -> set[str]:
        """Registers written: the destination, widened to a load's vector width, and the
        predicates written beside it."""
        written = self._destinations()
        if not written:
            return set()
        first = written[0]
        width = 1
        if self.is_global_load:
            width = 4 if ".128" in self.opcode else 2 if ".64" in self.opcode else 1
        elif first.group(3) or ".WIDE" in self.opcode:
            width = 2  # a 64-bit result: IMAD.WIDE writes its destination and the next
        kind, base = first.group(1), int(first.group(2))
        return ({f"{kind}{base + i}" for i in range(width)}
                | {f"{m.group(1)}{m.group(2)}" for m in written[1:]})

    def reads(self) -> set[str]:
        """Registers read, widened: a vector or matrix operand names only its first register,
        so a 128-bit operand counts as four, and an m16n8k16 mma's A and C four and its B two
        (HMMA.16816 D, A, B, C: its B fragment is two registers); any other mma, four each."""
        registers = self._registers()[len(self._destinations()):]
        wide = 4 if (".128" in self.opcode or self.opcode.startswith("HMMA")) else 1
        read: set[str] = set()
        for position, match in enumerate(registers):
            kind, base = match.group(1), int(match.group(2))
            before = self.operands[: match.start()]
            in_address = before.count("[") > before.count("]")
            width = 2 if match.group(3) else (1 if in_address or kind == "P" else wide)
            if self.opcode.startswith("HMMA.16816") and position == 1:
                width = 2
            read.update(f"{kind}{base + i}" for i in range(width))
        if self.predicate and self.predicate != "@PT":
            read.add(self.predicate.lstrip("@!"))
        return read


def parse(sass: str) -> dict[str, list[Instruction]]:
    """nvdisasm output -> instructions per kernel (its .text section)."""
    functions: dict[str, list[Instruction]] = {}
    current: list[Instruction] | None = None
    label = None
    for line in sass.splitlines():
        section = re.match(r"^\.text\.(\w+):", line)
        if section:
            current = functions.setdefault(section.group(1), [])
            label = None
            continue
        if current is None:
            continue
        found = _LABEL.match(line)
        if found:
            label = found.group(1)
            continue
        found = _INSTRUCTION.search(line)
        if found:
            predicate = found.group(1).strip() if found.group(1) else None
            current.append(Instruction(found.group(2), found.group(3), label, predicate))
            label = None
    return functions


def loops(code: list[Instruction]) -> list[tuple[int, int]]:
    """(head, end) index ranges of innermost loops (a backward branch to a label)."""
    heads = {ins.label: i for i, ins in enumerate(code) if ins.label}
    found = []
    for end, ins in enumerate(code):
        if not ins.opcode.startswith("BRA"):
            continue
        target = _BRANCH_TARGET.search(ins.operands)
        if target and heads.get(target.group(1), end + 1) <= end:
            found.append((heads[target.group(1)], end))
    return [(h, e) for h, e in found
            if not any(h <= h2 and e2 <= e and (h2, e2) != (h, e) for h2, e2 in found)]


def hot_loops(code: list[Instruction]) -> list[tuple[int, int]]:
    """Innermost loops that issue 128-bit global loads."""
    return [(h, e) for h, e in loops(code) if any(code[i].is_vector_load for i in range(h, e))]


def loads_before_first_use(code: list[Instruction], head: int, end: int) -> int:
    """Distinct 128-bit loads issued from the loop head before the first instruction that reads
    a register one of them loaded: loads that may be predicated off, and repeats of an address
    already loaded, are not counted."""
    loaded: set[str] = set()
    addresses: dict[str, set[str]] = {}  # address operand -> the registers it is made of
    count = 0
    for ins in code[head:end + 1]:
        if ins.reads() & loaded:
            break
        if ins.is_vector_load and ins.always_runs and ins.address() not in addresses:
            count += 1
            addresses[ins.address()] = _registers_of(ins.address())
        written = ins.writes()
        if ins.is_vector_load:
            loaded |= written
        # An address whose registers are rewritten names a new address from then on.
        addresses = {a: regs for a, regs in addresses.items() if not regs & written}
    return count


_WAIT_GROUPS = re.compile(r"SB0,\s*(0x[0-9a-f]+|\d+)")


def async_loads_in_flight(code: list[Instruction], head: int, end: int) -> int:
    """The 128-bit cp.async copies a thread has in flight in a pipelined loop: the distinct
    unpredicated LDGSTS of one iteration (one commit group, LDGDEPBAR) times the groups in
    flight at its wait (`DEPBAR.LE SB0, N` leaves N groups pending while it waits for the
    oldest: N + 1; the smallest N if it waits more than once). A copy writes no register, so
    no use can come between them; what serialises a pipeline is a shallower wait."""
    body = code[head:end + 1]
    addresses: dict[str, set[str]] = {}
    count = 0
    for ins in body:
        if ins.is_async_copy and ".128" in ins.opcode and ins.always_runs \
                and ins.address() not in addresses:
            count += 1
            addresses[ins.address()] = _registers_of(ins.address())
        written = ins.writes()
        addresses = {a: regs for a, regs in addresses.items() if not regs & written}
    pending = [int(m.group(1), 0) for ins in body if ins.opcode.startswith("DEPBAR")
               for m in [_WAIT_GROUPS.search(ins.operands)] if m]
    return count * (min(pending) + 1 if pending else 1)


def loop_loads(code: list[Instruction], head: int, end: int) -> int:
    """The 128-bit loads a thread keeps in flight in the hot loop (head, end): its cp.async
    copies across the pipeline's groups (async_loads_in_flight), or, for register loads, the
    distinct ones issued before the first use (loads_before_first_use)."""
    if any(ins.is_async_copy for ins in code[head:end + 1]):
        return async_loads_in_flight(code, head, end)
    return loads_before_first_use(code, head, end)


def pipeline_round_trips(code: list[Instruction], head: int, end: int) -> int:
    """Register loads of a cp.async pipeline loop (head, end) whose value the same iteration
    reads: each waits a round trip of its own beside the pipeline, whose wait covers only the
    copies issued iterations before (the SGMV expand's y vectors, loaded at the start of the
    item whose epilogue adds into them, were such loads). 0 for a loop without copies."""
    body = code[head:end + 1]
    if not any(ins.is_async_copy for ins in body):
        return 0
    pending: list[set[str]] = []  # the registers of each load not yet read
    count = 0
    for ins in body:
        read = ins.reads()
        count += sum(1 for loaded in pending if loaded & read)
        pending = [loaded for loaded in pending if not loaded & read]
        written = ins.writes()
        pending = [loaded - written for loaded in pending]
        if ins.is_global_load and not ins.is_async_copy:
            pending.append(written)
    return count


def _registers_of(operand: str) -> set[str]:
    return {f"{m.group(1)}{int(m.group(2)) + k}" for m in _REGISTER.finditer(operand)
            for k in range(2 if m.group(3) else 1)}


def _load_depths(code: Iterable[Instruction], depth: dict[str, int]) -> list[int]:
    """Walk `code` in order, the dependent-global-load depth of every register in `depth`
    (updated in place): a load's result is one deeper than the deepest register it reads; any
    other result as deep as its inputs. Returns each global load's depth, in order."""
    found = []
    for ins in code:
        level = max((depth.get(r, 0) for r in ins.reads()), default=0)
        if ins.is_global_load:
            level += 1
            found.append(level)
        for register in ins.writes():
            depth[register] = level
    return found


def _forward_targets(ins: Instruction, at: int, heads: dict[str, int]) -> list[int]:
    """Indices a branch at `at` may jump forward to: a BRA's label, or every label a BRX (an
    indirect branch: a switch's jump table) lists in nvdisasm's BRANCH_TARGETS note."""
    if ins.opcode.startswith("BRX"):
        names = _BRX_TARGETS.findall(ins.operands)
    elif ins.opcode.startswith("BRA"):
        names = _BRANCH_TARGET.findall(ins.operands)
    else:
        return []
    return [heads[n] for n in names if heads.get(n, -1) > at]


def _merge(a: dict[str, int] | None, b: dict[str, int] | None) -> dict[str, int] | None:
    if a is None or b is None:
        return b if a is None else a
    merged = dict(a)
    for register, level in b.items():
        merged[register] = max(level, merged.get(register, 0))
    return merged


def stream_depth(code: list[Instruction], copies_only: bool = False) -> int:
    """The deepest chain of dependent global loads that ends in a 128-bit (stream) load, along
    the control flow with loops run once (back edges not followed): 3 for slot -> table[slot]
    -> weights; with `copies_only`, chains that end in a cp.async copy (an SGMV pipeline's
    stream). Each instruction sees the register depths of the paths that reach it (the fall
    through and the forward branches to its label, merged), so the alternatives of a switch
    (one instantiation per case) do not chain into one another as they would in program order.
    Code reached only by a back edge, or by a jump whose targets are unknown, sees every path
    walked so far (an upper bound)."""
    heads = {ins.label: i for i, ins in enumerate(code) if ins.label}
    incoming: dict[int, dict[str, int]] = {}
    state: dict[str, int] | None = {}
    seen: dict[str, int] = {}
    deepest = 0
    for at, ins in enumerate(code):
        state = _merge(state, incoming.pop(at, None))
        if state is None:
            state = dict(seen)
        level = max((state.get(r, 0) for r in ins.reads()), default=0)
        if ins.is_global_load:
            level += 1
            if ins.is_vector_load and (ins.is_async_copy or not copies_only):
                deepest = max(deepest, level)
        for register in ins.writes():
            state[register] = level
            seen[register] = max(level, seen.get(register, 0))
        for target in _forward_targets(ins, at, heads):
            incoming[target] = _merge(incoming.get(target), dict(state))
        if ins.always_runs and ins.opcode.startswith(("BRA", "BRX", "EXIT", "RET")):
            state = None  # nothing falls through an unconditional jump
    return deepest


def chained_loops(code: list[Instruction]) -> list[tuple[int, int]]:
    """Innermost loops whose global loads depend on a load of an earlier iteration (a load
    chain carried around the loop, each iteration one round trip: a binary search)."""
    carried = []
    for head, end in loops(code):
        body = code[head:end + 1]
        if not any(ins.is_global_load for ins in body):
            continue
        depth: dict[str, int] = {}
        first = _load_depths(body, depth)
        second = _load_depths(body, depth)
        if any(b > a for a, b in zip(first, second, strict=True)):
            carried.append((head, end))
    return carried


def _successors(code: list[Instruction], at: int, heads: dict[str, int]) -> list[int]:
    """Where control may go after instruction `at`: the next one unless an unconditional jump
    or exit stops it, and every label a branch names (forward or back; ptxas also leaves a
    loop by a predicated `CALL.REL.NOINC` to a label)."""
    ins = code[at]
    found = [] if ins.always_runs and ins.opcode.startswith(("BRA", "BRX", "EXIT", "RET")) \
        else [at + 1]
    if ins.opcode.startswith("BRX"):
        found += [heads[n] for n in _BRX_TARGETS.findall(ins.operands) if n in heads]
    elif ins.opcode.startswith(("BRA", "CALL.REL")):
        found += [heads[n] for n in _BRANCH_TARGET.findall(ins.operands) if n in heads]
    return [i for i in found if i < len(code)]


def _reachable(code: list[Instruction], start: int) -> set[int]:
    heads = {ins.label: i for i, ins in enumerate(code) if ins.label}
    seen: set[int] = set()
    todo = [start]
    while todo:
        at = todo.pop()
        if at not in seen:
            seen.add(at)
            todo.extend(_successors(code, at, heads))
    return seen


def _is_gpu_fence(ins: Instruction) -> bool:
    return ins.opcode.startswith("MEMBAR") and ins.opcode.endswith((".GPU", ".SYS"))


def _is_ticket(ins: Instruction) -> bool:
    """A 32-bit integer atomic add on global memory (split_last's atomicAdd on a u32)."""
    parts = ins.opcode.split(".")
    return (parts[0] == "ATOMG" and "ADD" in parts
            and not any(p.startswith(("F", "64")) for p in parts[1:]))


def split_handoff(code: list[Instruction]) -> dict[str, Any] | None:
    """Split-K's hand-off as the machine code has it; None where the kernel takes no ticket.
    `release`: a GPU-scope fence lies between the last global store before each ticket and the
    ticket; `acquire`: one lies between each ticket and the first global load after it;
    `coherent_reads`: the L2-coherent (`.STRONG.GPU`/`.SYS`) loads the ticket reaches;
    `weak_reads`: the loads it reaches that are neither those nor of the read-only path
    (`.CONSTANT`), which a last CTA may answer from a stale L1 line."""
    tickets = [i for i, ins in enumerate(code) if _is_ticket(ins)]
    if not tickets:
        return None
    release = acquire = True
    reached: set[int] = set()
    for at in tickets:
        stores = [i for i in range(at) if code[i].opcode.startswith("STG")]
        if not stores or not any(_is_gpu_fence(code[i]) for i in range(stores[-1], at)):
            release = False
        after = sorted(i for i in _reachable(code, at) if i > at)
        reached.update(_reachable(code, at))
        loads = [i for i in after if code[i].is_global_load]
        if not loads or not any(_is_gpu_fence(code[i]) for i in range(at, loads[0])):
            acquire = False
    loads = [code[i].opcode for i in sorted(reached) if code[i].is_global_load]
    coherent = [op for op in loads if ".STRONG.GPU" in op or ".STRONG.SYS" in op]
    weak = [op for op in loads if op not in coherent and ".CONSTANT" not in op]
    return {"tickets": len(tickets), "release": release, "acquire": acquire,
            "coherent_reads": len(coherent), "weak_reads": len(weak)}


def handoff_ok(handoff: dict[str, Any] | None) -> bool:
    """Whether a kernel's split hand-off (split_handoff) is fenced both ways and reads the
    partials coherently; a kernel with no ticket has nothing to hand off."""
    return handoff is None or (handoff["release"] and handoff["acquire"]
                               and handoff["coherent_reads"] > 0
                               and handoff["weak_reads"] == 0)


def _is_coherent_load(ins: Instruction) -> bool:
    return ins.is_global_load and (".STRONG.GPU" in ins.opcode or ".STRONG.SYS" in ins.opcode)


def load_round_trips(code: list[Instruction], head: int, end: int) -> int:
    """The dependent round trips of the L2-coherent loads in code[head..end] run once: a run of
    loads issued back to back is one, and an instruction that reads a register one of them
    loads waits for it, so a load issued after that wait starts another (in-order issue)."""
    pending: set[str] = set()
    trips, issuing = 0, False
    for ins in code[head:end + 1]:
        if ins.reads() & pending:
            pending, issuing = set(), False
        if _is_coherent_load(ins):
            if not issuing:
                trips, issuing = trips + 1, True
            pending |= ins.writes()
        else:
            pending -= ins.writes()
    return trips


@dataclass(frozen=True)
class Read:
    """One read of split-K's partials by the last CTA, as the machine code has it: a loop
    (`repeats`) or a straight run, its L2-coherent loads per thread an iteration and the
    dependent round trips of an iteration (load_round_trips)."""
    loads: int
    trips: int
    repeats: bool
    at: int  # the index of its first instruction


def split_reads(code: list[Instruction]) -> list[list[Read]]:
    """The last CTA's reads of the partials (the L2-coherent loads its ticket reaches), grouped
    by shape class: the reads one path after the ticket can run (the loops, and the straight
    runs between labels and branches outside them), where a class's reads reach one another
    and no other class's (the SGMV shrink's narrow and wide tiles branch apart after the
    ticket and meet again only at the t stores). Each class in code order; [] without a ticket."""
    tickets = [i for i, ins in enumerate(code) if _is_ticket(ins)]
    if not tickets:
        return []
    after = {i for t in tickets for i in _reachable(code, t) if i > t}
    reads: list[Read] = []
    looped: set[int] = set()
    for head, end in loops(code):
        if head in after and any(_is_coherent_load(code[i]) for i in range(head, end + 1)):
            loads = sum(_is_coherent_load(code[i]) for i in range(head, end + 1))
            reads.append(Read(loads, load_round_trips(code, head, end), True, head))
            looped.update(range(head, end + 1))
    # The straight runs: consecutive instructions outside the loops, cut at labels and after
    # jumps.
    runs: list[list[int]] = []
    for i in sorted(after - looped):
        if (not runs or code[i].label is not None or i != runs[-1][-1] + 1
                or code[runs[-1][-1]].opcode.startswith(("BRA", "BRX", "CALL", "EXIT", "RET"))):
            runs.append([])
        runs[-1].append(i)
    for run in runs:
        loads = sum(_is_coherent_load(code[i]) for i in run)
        if loads:
            reads.append(Read(loads, load_round_trips(code, run[0], run[-1]), False, run[0]))
    reads.sort(key=lambda r: r.at)
    reach = {r.at: _reachable(code, r.at) for r in reads}
    classes: list[list[Read]] = []
    for read in reads:
        joined = [c for c in classes
                  if any(read.at in reach[r.at] or r.at in reach[read.at] for r in c)]
        merged = [read] + [r for c in joined for r in c]
        classes = [c for c in classes if c not in joined] + [sorted(merged, key=lambda r: r.at)]
    return sorted(classes, key=lambda c: c[0].at)


def kernel_report(code: list[Instruction]) -> dict[str, Any]:
    """What the checks read of one kernel's machine code."""
    return {
        "local_memory": sum(i.opcode.startswith(("LDL", "STL")) for i in code),
        "hot_loop_loads": [loop_loads(code, h, e) for h, e in hot_loops(code)],
        "stream_depth": stream_depth(code),
        "copy_depth": stream_depth(code, copies_only=True),
        "chained_loops": len(chained_loops(code)),
        "pipeline_round_trips": sum(pipeline_round_trips(code, h, e) for h, e in hot_loops(code)),
        "split_handoff": split_handoff(code),
        "instructions": len(code),
    }


def report(compiler: str, arch: str) -> dict[str, Any]:
    """kernel_report of every kernel, compiled by `compiler` for `arch`, with what
    lora_config.h promises (`wanted_loads`) and whether every hot loop keeps it."""
    kernels_out = {}
    for name, source in sorted(sources.KERNEL_SOURCES.items()):
        code = parse(listing(source, compiler, arch))[name]
        entry = kernel_report(code)
        entry["wanted_loads"] = sources.loads_in_flight(name)
        entry["ok"] = (entry["local_memory"] == 0 and bool(entry["hot_loop_loads"])
                       and min(entry["hot_loop_loads"]) >= entry["wanted_loads"]
                       and entry["pipeline_round_trips"] == 0
                       and handoff_ok(entry["split_handoff"]))
        kernels_out[name] = entry
    return {"compiler": compiler, "arch": arch, "kernels": kernels_out,
            "ok": all(k["ok"] for k in kernels_out.values())}


def device_arch() -> str:
    """sm_XX of the present GPU (through CuPy)."""
    from metrale_cli import compat

    cupy = compat.cupy_module()
    return f"sm_{cupy.cuda.Device().compute_capability}"


def main(argv: list[str]) -> int:
    """python -m metrale_cli.ops.sass [--nvrtc-device | --compiler nvcc|nvrtc --arch sm_XX]
    [--out FILE]: the report as JSON (on stdout, and into FILE); exit 1 when a kernel fails."""
    args = list(argv)
    out = None
    compiler, arch = "nvrtc", "sm_90"
    while args:
        flag = args.pop(0)
        if flag == "--nvrtc-device":
            compiler, arch = "nvrtc", device_arch()
        elif flag in ("--compiler", "--arch", "--out") and args:
            value = args.pop(0)
            if flag == "--compiler":
                compiler = value
            elif flag == "--arch":
                arch = value
            else:
                out = Path(value)
        else:
            print(f"usage: python -m metrale_cli.ops.sass {main.__doc__.split(':')[0]}",
                  file=sys.stderr)
            return 2
    result = report(compiler, arch)
    text = json.dumps(result, indent=1)
    if out is not None:
        out.write_text(text + "\n")
    print(text)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
