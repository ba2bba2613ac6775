"""What the kernels' speed rests on, checked in their sm_90 machine code without a GPU.

Each kernel source is compiled for sm_90 (nvcc -cubin) and disassembled (nvdisasm, from the
`nvidia-cuda-nvdisasm` wheel in the test extra, or the CUDA toolkit's). Then, per kernel:

- no local memory: no LDL/STL instruction (a register spill would put local-memory round trips
  inside the streaming loops);
- memory-level parallelism: in every hot loop (an innermost loop that issues 128-bit global
  loads), at least the number of independent LDG.E.128 that kernels/lora_config.h states
  (`<KERNEL>_LOADS`) are issued before the first instruction that reads a register one of them
  loads. A loop that branches around each load, or uses each load before issuing the next, has
  a count of 1 or 2 and fails.

Skipped, with the reason, where nvcc or nvdisasm is absent; --require-nvcc makes that a failure.
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from metrale_cli.ops import kernels

pytestmark = pytest.mark.nvcc

ARCH = "sm_90"
_REGISTER = re.compile(r"(?<![A-Z_])R(\d+)(\.64)?\b")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*(.*?)\s*;")
_BRANCH_TARGET = re.compile(r"`\((\.L_x_\d+)\)")


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


@pytest.fixture(autouse=True)
def _disassembler(request: pytest.FixtureRequest) -> None:
    """Skip where nvdisasm is absent, with the reason (a failure under --require-nvcc, as in
    CI, which installs it with the test extra)."""
    if nvdisasm() is not None or request.node.name.startswith("test_the_counter"):
        return
    reason = "nvdisasm is absent (pip install nvidia-cuda-nvdisasm; it is in the test extra)"
    if request.config.getoption("--require-nvcc"):
        pytest.fail(f"--require-nvcc was given but {reason}", pytrace=False)
    pytest.skip(reason)


@dataclass(frozen=True)
class Instruction:
    opcode: str
    operands: str
    label: str | None  # the label just above it, if any

    def writes(self) -> set[int]:
        """Registers an LDG writes (its vector width)."""
        match = _REGISTER.search(self.operands)
        if match is None:
            return set()
        width = 4 if ".128" in self.opcode else 2 if ".64" in self.opcode else 1
        return set(range(int(match.group(1)), int(match.group(1)) + width))

    def reads(self) -> set[int]:
        """Registers read, widened conservatively: a vector or matrix operand names only its
        first register, so a 128-bit or mma operand counts as four."""
        no_destination = self.opcode.split(".")[0] in {"ST", "STG", "STS", "STL", "RED", "BRA",
                                                       "EXIT", "BAR", "RET", "CALL", "BSYNC"}
        registers = list(_REGISTER.finditer(self.operands))
        if not no_destination and registers:
            # The first operand is the destination, unless it is inside an address.
            first = registers[0]
            if "[" not in self.operands[: first.start()]:
                registers = registers[1:]
        wide = 4 if (".128" in self.opcode or self.opcode.startswith("HMMA")) else 1
        read: set[int] = set()
        for match in registers:
            base = int(match.group(1))
            in_address = self.operands[: match.start()].count("[") > \
                self.operands[: match.start()].count("]")
            width = 2 if match.group(2) else (1 if in_address else wide)
            read.update(range(base, base + width))
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
            current.append(Instruction(found.group(2), found.group(3), label))
            label = None
    return functions


def _is_vector_load(instruction: Instruction) -> bool:
    return instruction.opcode.startswith("LDG.E.128")


def hot_loops(code: list[Instruction]) -> list[tuple[int, int]]:
    """(head, end) index ranges of innermost loops that issue 128-bit global loads."""
    heads = {ins.label: i for i, ins in enumerate(code) if ins.label}
    loops = []
    for end, ins in enumerate(code):
        if not ins.opcode.startswith("BRA"):
            continue
        target = _BRANCH_TARGET.search(ins.operands)
        if target and heads.get(target.group(1), end + 1) <= end:
            loops.append((heads[target.group(1)], end))
    innermost = [(h, e) for h, e in loops
                 if not any(h <= h2 and e2 <= e and (h2, e2) != (h, e) for h2, e2 in loops)]
    return [(h, e) for h, e in innermost if any(_is_vector_load(code[i]) for i in range(h, e))]


def loads_before_first_use(code: list[Instruction], head: int, end: int) -> int:
    """LDG.E.128 issued from the loop head before the first instruction reading one of them."""
    loaded: set[int] = set()
    count = 0
    for ins in code[head:end + 1]:
        if ins.reads() & loaded:
            break
        if _is_vector_load(ins):
            count += 1
            loaded |= ins.writes()
    return count


@functools.cache
def disassembly(source: str) -> str:
    """sm_90 SASS of kernels/<source> (nvcc -cubin, then nvdisasm)."""
    nvcc, disassembler = shutil.which("nvcc"), nvdisasm()
    assert nvcc and disassembler, "the nvcc marker and the fixture above check both tools"
    directory = kernels.find_kernel_dir()
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        subprocess.run([nvcc, f"-arch={ARCH}", "-std=c++17", "-cubin", "-o", str(cubin),
                        str(directory / source)], check=True, capture_output=True, text=True)
        return subprocess.run([disassembler, "-c", str(cubin)], check=True,
                              capture_output=True, text=True).stdout


def kernel_code(name: str) -> list[Instruction]:
    return parse(disassembly(kernels.KERNEL_SOURCES[name]))[name]


@pytest.mark.parametrize("name", sorted(kernels.KERNEL_SOURCES))
def test_no_local_memory(name: str) -> None:
    local = [f"{i.opcode} {i.operands}" for i in kernel_code(name)
             if i.opcode.startswith(("LDL", "STL"))]
    assert not local, f"{name} spills to local memory: {local[:4]}"


@pytest.mark.parametrize("name", sorted(kernels.KERNEL_SOURCES))
def test_hot_loops_keep_the_documented_loads_in_flight(name: str) -> None:
    code = kernel_code(name)
    loops = hot_loops(code)
    assert loops, f"{name} has no loop issuing 128-bit global loads"
    wanted = kernels.loads_in_flight(name)
    counts = [loads_before_first_use(code, head, end) for head, end in loops]
    assert min(counts) >= wanted, (
        f"{name}: a hot loop issues only {min(counts)} independent LDG.E.128 before the first use "
        f"(per loop: {counts}); kernels/lora_config.h promises {wanted}"
    )


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
