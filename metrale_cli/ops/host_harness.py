"""Run the CUDA kernels of kernels/*.cu on the CPU, unchanged, to test them without a GPU.

The sources are compiled by g++ as C++ with kernels/host_shim.h force-included (CUDA's built-ins
emulated: CTAs interleaved in a seeded schedule, every buffer between guard regions, threads
as fibers that switch at barriers, a warp at a
time; shared memory poisoned, cp.async and warp collectives checked as strictly as the
hardware defines them, kernels/README.md's "The host shim") into a shared
library cached under METRALE_CACHE_DIR, keyed by a hash of the sources, the flags and the
compiler. Launches go through the very `plan_*` functions that the CuPy launchers use
(kernels.py), so the harness runs the same grids, blocks and argument lists as a GPU; table
addresses are then host addresses (of torch CPU tensors or NumPy arrays).

Buffers: torch CPU tensors or NumPy arrays; BF16 as torch.bfloat16 or uint16 bits. The harness
is slow (every thread is a fiber) and meant for small shapes. Launches are serialised by one
lock: the emulation keeps its launch state and every `__shared__` array in process globals, and
ctypes releases the GIL during a call, so two threads launching at once would share them.

`build_command` is the one place the g++ command is written; kernels/README.md shows it with
`python -m metrale_cli.ops.host_harness`.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import itertools
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Hashable, Iterator
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import numpy as np

from metrale_cli import env
from metrale_cli.errors import ToolMissing
from metrale_cli.ops import kernels, plans, sources

# -fno-strict-aliasing: the kernels read BF16 buffers through uint4 / unsigned pointers, which
# CUDA allows and ISO C++ does not. -Wno-unknown-pragmas: g++ does not know `#pragma unroll`.
# -fno-weak: the shim puts every `__shared__` array into one section that it poisons at each
# CTA's start, and g++ refuses to mix an inline function's (otherwise comdat) statics with the
# others' in one section; the build is one translation unit, so nothing needs weak symbols.
# -O1: the kernels run as fast as at -O2 on the host (the host-harness test files: 54 against
# 56 CPU-s) and a build takes a third less (2.9 against 4.6 s for the three sources); -O0
# runs them a quarter slower. The warnings only -O2's analyses find are checked on the same
# command at -O2 (tests/test_kernels_host.py).
CXX_FLAGS = (
    "-std=c++17", "-O1", "-shared", "-fPIC", "-fvisibility=hidden", "-fno-strict-aliasing",
    "-fno-weak", "-Wall", "-Werror", "-Wno-unknown-pragmas",
)
# g++ ignores the section attribute on a template's function-static arrays (a template kernel's
# `__shared__`), and under -fno-weak emits them as common symbols; nothing else in the build is
# common (the shim's own globals are plain statics). This addition to the linker's default
# script (INSERT: the rest of the default script stands) places the common symbols with the
# other `__shared__` arrays in the one section the shim poisons at each CTA's start and copies
# in and out at a CTA switch; it comes before .bss, whose own rule would otherwise take them first.
# tests/test_host_shim.py checks that every function-static array of the build lies in it.
SHARED_SECTION_SCRIPT = """SECTIONS
{
  metrale_shared (NOLOAD) : ALIGN(64)
  {
    PROVIDE_HIDDEN(__start_metrale_shared = .);
    *(metrale_shared)
    *(COMMON)
    PROVIDE_HIDDEN(__stop_metrale_shared = .);
  }
}
INSERT BEFORE .bss;
"""
P = ParamSpec("P")
R = TypeVar("R")
_ENTRY = "host_launch.h"
_SHIM = "host_shim.h"


def compiler() -> str:
    """The C++ compiler's path; ToolMissing when there is none."""
    for name in ("g++", "c++"):
        path = shutil.which(name)
        if path:
            return path
    raise ToolMissing("the host kernel harness needs g++ (or c++) on PATH; none was found")


@functools.cache
def _compiler_version(cxx: str) -> str:
    # Asked once a process: every launch looks its build up (library_path).
    return subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout


def library_path(directory: Path | None = None) -> Path:
    """Where the build of the sources in `directory` is (or would be) cached."""
    directory = directory or sources.find_kernel_dir()
    cxx = compiler()
    digest = hashlib.sha256()
    for part in (sources.sources_digest(directory), " ".join(CXX_FLAGS), SHARED_SECTION_SCRIPT,
                 cxx, _compiler_version(cxx)):
        digest.update(part.encode())
    return env.cache_dir() / "host" / f"libmetrale_host-{digest.hexdigest()[:16]}.so"


def build_command(directory: Path, output: str, cxx: str | None = None) -> list[str]:
    """The g++ command that builds the host library of the sources in `directory`: the shim and
    every kernel source force-included before host_launch.h, whose table of launchable kernels
    is METRALE_HOST_KERNELS, the kernels those sources declare (sources.kernels_in); linked
    with SHARED_SECTION_SCRIPT, which it reads from `output` + ".ld" (build writes it)."""
    declared, _ = sources.kernels_in(directory)
    includes = [arg for name in (_SHIM, *dict.fromkeys(declared.values()))
                for arg in ("-include", str(directory / name))]
    table = "".join(f"METRALE_HOST_KERNEL({name})," for name in declared)
    return [
        cxx or compiler(), *CXX_FLAGS, "-x", "c++", *includes,
        f"-DMETRALE_HOST_KERNELS={table}", str(directory / _ENTRY), f"-Wl,-T,{output}.ld",
        "-o", output,
    ]


def build(directory: Path | None = None) -> Path:
    """Compile the host library unless a build of these exact sources is cached; its path."""
    directory = directory or sources.find_kernel_dir()
    target = library_path(directory)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build next to the target and rename, so concurrent test processes never load half a file.
    fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    command = build_command(directory, partial)
    Path(partial + ".ld").write_text(SHARED_SECTION_SCRIPT)
    try:
        result = subprocess.run(command, capture_output=True, text=True, check=False)
    finally:
        os.unlink(partial + ".ld")
    if result.returncode != 0:
        os.unlink(partial)
        raise RuntimeError(
            "host build of the kernels failed:\n" + " ".join(command) + "\n" + result.stderr
        )
    os.replace(partial, target)
    return target


@functools.cache
def _library(path: str) -> ctypes.CDLL:
    library = ctypes.CDLL(path)
    library.metrale_host_launch.argtypes = [
        ctypes.c_char_p, ctypes.POINTER(ctypes.c_uint), ctypes.POINTER(ctypes.c_void_p),
        ctypes.c_int, ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_ulonglong),
        ctypes.POINTER(ctypes.c_ulonglong), ctypes.POINTER(ctypes.c_ubyte), ctypes.c_ulonglong,
        ctypes.c_char_p, ctypes.c_int,
    ]
    library.metrale_host_launch.restype = ctypes.c_int
    return library


def _param(value: Any) -> ctypes._SimpleCData:
    if isinstance(value, np.uint64):  # a pointer passed by value (0: null)
        return ctypes.c_uint64(int(value))
    if isinstance(value, np.int32):
        return ctypes.c_int32(int(value))
    if isinstance(value, np.int64):
        return ctypes.c_int64(int(value))
    if isinstance(value, np.float32):
        return ctypes.c_float(float(value))
    if hasattr(value, "shape"):  # an array: the kernel takes its address
        return ctypes.c_void_p(plans.address(value))
    raise TypeError(f"no host kernel parameter for {type(value).__name__}")


@functools.cache
def parameter_names(kernel: str, directory: Path | None = None) -> tuple[str, ...]:
    """The names of `kernel`'s parameters, as its declaration in the sources spells them: the
    host shim names the buffer an out-of-bounds access reaches past."""
    directory = directory or sources.find_kernel_dir()
    declared, _ = sources.kernels_in(directory)
    text = (directory / declared[kernel]).read_text(encoding="utf-8")
    start = re.search(rf"\b{re.escape(kernel)}\s*\(", text)
    if start is None:
        raise RuntimeError(f"no declaration of {kernel} in {declared[kernel]}")
    depth, at = 1, start.end()
    while depth:
        depth += {"(": 1, ")": -1}.get(text[at], 0)
        at += 1
    declaration = text[start.end(): at - 1]
    # A parameter list written as a macro (`EXPERT_EXPAND_PARAMS(OutT)`): its definition's.
    for name in re.findall(r"\b([A-Z][A-Z0-9_]*)\b", declaration):
        body = re.search(rf"#define {name}\b(?:\([^)]*\))?((?:[^\n]*\\\n)*[^\n]*)", text)
        if body:
            declaration = re.sub(rf"\b{name}\b(?:\s*\([^)]*\))?", body.group(1), declaration)
    declaration = declaration.replace("\\\n", " ").replace("\n", " ")
    return tuple(re.findall(r"(\w+)\s*(?:,|$)", declaration.strip()))


def _buffer(value: Any) -> tuple[int, int]:
    """(bytes, element size) of an array argument, from its first element to the end of its
    last (a row-strided view spans its gaps); (0, 0) for a value, an empty array, or one with a
    negative stride (left unguarded)."""
    if isinstance(value, np.generic) or not hasattr(value, "shape"):
        return 0, 0
    if hasattr(value, "element_size"):  # torch: strides in elements
        itemsize = value.element_size()
        strides = [s * itemsize for s in value.stride()]
    else:
        itemsize, strides = value.itemsize, list(value.strides)
    if 0 in value.shape or min(strides, default=0) < 0:
        return 0, 0
    return itemsize + sum((n - 1) * s for n, s in zip(value.shape, strides, strict=True)), itemsize


# The kernel parameters that several CTAs of one launch write: split-K's workspace (the partials
# and the ticket counters, lora_common.cuh's split_last). The shim seals them while a CTA runs,
# so that a plain load or store of them is a point where another CTA may run (host_shim.h,
# contended_access): a ticket drawn by a plain read and write loses updates, as on a GPU.
CONTENDED = frozenset({"partials", "tickets"})

_LAUNCH_LOCK = threading.Lock()
# Each launch's CTA schedule and cp.async landing (host_shim.h: seed % 4 picks round-robin,
# reversed, random or depth-first, seed % 3 copies landing at their wait, at issue or at random
# points, and the seed the random draws): the next of this count, unless METRALE_HOST_SEED
# fixes it.
_SEEDS = itertools.count()


def launch_seed() -> int:
    """The CTA schedule seed of the next host launch."""
    fixed = env.host_seed()
    return next(_SEEDS) if fixed is None else fixed


def launch(plan: plans.KernelLaunch) -> None:
    """Run one planned launch on the host; RuntimeError carries the shim's message."""
    if 0 in plan.grid:
        return  # an empty batch: a GPU launch would be invalid, and there is nothing to do
    library = _library(str(build()))
    values = [_param(arg) for arg in plan.args]
    params = (ctypes.c_void_p * len(values))(
        *[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values]
    )
    dims = (ctypes.c_uint * 6)(*plan.grid, *plan.block)
    names = parameter_names(plan.kernel, sources.find_kernel_dir())
    if len(names) != len(values):
        raise RuntimeError(f"{plan.kernel}: {len(values)} arguments for parameters {names}")
    buffers = [_buffer(arg) for arg in plan.args]
    name_array = (ctypes.c_char_p * len(values))(*(n.encode() for n in names))
    sizes = (ctypes.c_ulonglong * len(values))(*(b[0] for b in buffers))
    itemsizes = (ctypes.c_ulonglong * len(values))(*(b[1] for b in buffers))
    contended = (ctypes.c_ubyte * len(values))(*(name in CONTENDED for name in names))
    error = ctypes.create_string_buffer(512)
    with _LAUNCH_LOCK:
        status = library.metrale_host_launch(
            plan.kernel.encode(), dims, params, len(values), name_array, sizes, itemsizes,
            contended, launch_seed(), error, len(error)
        )
    if status != 0:
        raise RuntimeError(f"{plan.kernel} on the host: {error.value.decode()}")


class HostBackend:
    """kernels.Backend for the host harness: NaN-filled t (an element a kernel fails to write
    shows up in any comparison), a persistent split-K workspace, arrays of x's kind (torch or
    NumPy), an H200's SM count unless told otherwise."""

    def launch(self, plan: plans.KernelLaunch) -> None:
        launch(plan)

    def new_t(self, like: Any, shape: tuple[int, ...]) -> Any:
        if hasattr(like, "data_ptr"):
            import torch

            return torch.full(shape, float("nan"), dtype=torch.float32)
        return np.full(shape, np.nan, dtype=np.float32)

    # The tests' backend: every split-K launch's ticket counters are checked afterwards.
    checks_tickets = True

    def __init__(self) -> None:
        self._workspaces = kernels.SplitWorkspaces(
            lambda partials, tickets: (np.full(partials, np.nan, np.float32),
                                       np.zeros(tickets, np.uint32)))
        self._stream: Hashable = 0
        self._capturing = False

    def workspace(self, like: Any, partials: int, tickets: int) -> tuple[Any, Any]:
        """Split-K's workspace of the current stream (`on_stream`), kept as
        kernels.CupyBackend keeps it (kernels.SplitWorkspaces); new partials are NaN, so a
        reduction that reads a split never written shows up in any comparison."""
        return self._workspaces.get(self._stream, partials, tickets, self._capturing)

    def release_workspace(self) -> None:
        self._workspaces.release(self._stream)

    def capturing(self) -> bool:
        return self._capturing

    @contextlib.contextmanager
    def on_stream(self, stream: Hashable) -> Iterator[None]:
        """Launch on `stream` (a name standing for a CUDA stream) until the block ends."""
        outer, self._stream = self._stream, stream
        try:
            yield
        finally:
            self._stream = outer

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Launches as inside a CUDA graph capture of the current stream
        (cudaStreamIsCapturing true): what the workspaces allow and refuse there."""
        self._capturing = True
        try:
            yield
        finally:
            self._capturing = False

    def array(self, like: Any, values: np.ndarray) -> Any:
        if hasattr(like, "data_ptr"):
            import torch

            return torch.from_numpy(np.ascontiguousarray(values))
        return np.ascontiguousarray(values)

    def placement(self, like: Any) -> Hashable:
        """Where `array` puts its arrays: torch tensors for torch inputs, else NumPy arrays."""
        return "torch" if hasattr(like, "data_ptr") else "numpy"

    def num_sms(self, requested: int | None) -> int:
        return sources.H200_SMS if requested is None else requested


HOST = HostBackend()


def on_host(launcher: Callable[P, R]) -> Callable[P, R]:
    """`launcher` (any launcher of kernels.py or expert_kernels.py) run by the host harness:
    the same signature, with backend=HOST unless the caller passes one. A new launcher needs
    nothing here."""

    @functools.wraps(launcher)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        kwargs.setdefault("backend", HOST)
        return launcher(*args, **kwargs)

    return run


# The slot-pool launchers on the host (the tests' shorthand), split as an H200 would split them.
bgmv_shrink = on_host(kernels.bgmv_shrink)
bgmv_expand = on_host(kernels.bgmv_expand)
sgmv_shrink = on_host(kernels.sgmv_shrink)
sgmv_expand = on_host(kernels.sgmv_expand)
bgmv = on_host(kernels.bgmv)
bgmv_fused = on_host(kernels.bgmv_fused)
sgmv = on_host(kernels.sgmv)
sgmv_fused = on_host(kernels.sgmv_fused)


if __name__ == "__main__":
    source_dir = sources.find_kernel_dir()
    print(shlex.join(build_command(source_dir, "libmetrale_host.so")))
    print(f"# libmetrale_host.so.ld:\n{SHARED_SECTION_SCRIPT}", end="")
