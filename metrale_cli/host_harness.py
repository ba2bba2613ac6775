"""Run the CUDA kernels of kernels/*.cu on the CPU, unchanged, to test them without a GPU.

The sources are compiled by g++ as C++ with kernels/host_shim.h force-included (CUDA's built-ins
emulated: CTAs run one at a time, their threads as fibers that switch at barriers) into a shared
library cached under METRALE_CACHE_DIR, keyed by a hash of the sources, the flags and the
compiler. Launches go through the very `plan_*` functions that the CuPy launchers use
(kernels.py), so the harness runs the same grids, blocks and argument lists as a GPU; table
addresses are then host addresses (of torch CPU tensors or NumPy arrays).

Buffers: torch CPU tensors or NumPy arrays; BF16 as torch.bfloat16 or uint16 bits. The harness
is slow (every thread is a fiber) and meant for small shapes.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from metrale_cli import env, kernels
from metrale_cli.errors import ToolMissing

# -fno-strict-aliasing: the kernels read BF16 buffers through uint4 / unsigned pointers, which
# CUDA allows and ISO C++ does not. -Wno-unknown-pragmas: g++ does not know `#pragma unroll`.
CXX_FLAGS = (
    "-std=c++17", "-O2", "-shared", "-fPIC", "-fvisibility=hidden", "-fno-strict-aliasing",
    "-Wall", "-Werror", "-Wno-unknown-pragmas",
)
_ENTRY = "host_launch.h"
_SHIM = "host_shim.h"


def compiler() -> str:
    """The C++ compiler's path; ToolMissing when there is none."""
    for name in ("g++", "c++"):
        path = shutil.which(name)
        if path:
            return path
    raise ToolMissing("the host kernel harness needs g++ (or c++) on PATH; none was found")


def library_path(directory: Path | None = None) -> Path:
    """Where the build of the sources in `directory` is (or would be) cached."""
    directory = directory or kernels.find_kernel_dir()
    cxx = compiler()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout
    digest = hashlib.sha256()
    for part in (kernels.sources_digest(directory), " ".join(CXX_FLAGS), cxx, version):
        digest.update(part.encode())
    return env.cache_dir() / "host" / f"libmetrale_host-{digest.hexdigest()[:16]}.so"


def build(directory: Path | None = None) -> Path:
    """Compile the host library unless a build of these exact sources is cached; its path."""
    directory = directory or kernels.find_kernel_dir()
    target = library_path(directory)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build next to the target and rename, so concurrent test processes never load half a file.
    fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    command = [
        compiler(), *CXX_FLAGS, "-x", "c++", "-include", str(directory / _SHIM),
        str(directory / _ENTRY), "-o", partial,
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
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
        ctypes.c_int, ctypes.c_char_p, ctypes.c_int,
    ]
    library.metrale_host_launch.restype = ctypes.c_int
    return library


def _param(value: Any) -> ctypes._SimpleCData:
    if isinstance(value, np.int32):
        return ctypes.c_int32(int(value))
    if isinstance(value, np.int64):
        return ctypes.c_int64(int(value))
    if isinstance(value, np.float32):
        return ctypes.c_float(float(value))
    if hasattr(value, "shape"):  # an array: the kernel takes its address
        return ctypes.c_void_p(kernels._address(value))
    raise TypeError(f"no host kernel parameter for {type(value).__name__}")


def launch(plan: kernels.KernelLaunch) -> None:
    """Run one planned launch on the host; RuntimeError carries the shim's message."""
    if 0 in plan.grid:
        return  # an empty batch: a GPU launch would be invalid, and there is nothing to do
    library = _library(str(build()))
    values = [_param(arg) for arg in plan.args]
    params = (ctypes.c_void_p * len(values))(
        *[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values]
    )
    dims = (ctypes.c_uint * 6)(*plan.grid, *plan.block)
    error = ctypes.create_string_buffer(512)
    status = library.metrale_host_launch(
        plan.kernel.encode(), dims, params, len(values), error, len(error)
    )
    if status != 0:
        raise RuntimeError(f"{plan.kernel} on the host: {error.value.decode()}")


def _new_t(like: Any, splits: int, num_tokens: int, max_rank: int) -> Any:
    # NaN-filled, so an element the kernel fails to write shows up in any comparison.
    if hasattr(like, "data_ptr"):
        import torch

        return torch.full((splits, num_tokens, max_rank), float("nan"), dtype=torch.float32)
    return np.full((splits, num_tokens, max_rank), np.nan, dtype=np.float32)


def bgmv_shrink(
    x: Any, slots: Any, a_table: Any, ranks: Any, max_rank: int, t: Any | None = None,
    *, num_sms: int = kernels.H200_SMS,
) -> Any:
    """kernels.bgmv_shrink on the host; t F32 [num_splits, T, max_rank] (allocated if None),
    split as an H200 (or a device with `num_sms` SMs) would split it."""
    if t is None:
        num_tokens, in_dim = (int(d) for d in x.shape)
        splits = kernels.shrink_splits("bgmv", num_tokens, in_dim, max_rank, num_sms)
        t = _new_t(x, splits, num_tokens, max_rank)
    launch(kernels.plan_bgmv_shrink(x, slots, a_table, ranks, t))
    return t


def bgmv_expand(
    t: Any, slots: Any, b_table: Any, scale_table: Any, ranks: Any, y: Any,
    *, num_sms: int = kernels.H200_SMS,
) -> Any:
    """kernels.bgmv_expand on the host; updates y in place and returns it."""
    launch(kernels.plan_bgmv_expand(t, slots, b_table, scale_table, ranks, y, num_sms=num_sms))
    return y


def sgmv_shrink(
    x: Any, seg_starts: Any, seg_slots: Any, a_table: Any, ranks: Any, max_rank: int,
    t: Any | None = None, *, num_sms: int = kernels.H200_SMS,
) -> Any:
    """kernels.sgmv_shrink on the host; t as in bgmv_shrink."""
    if t is None:
        num_tokens, in_dim = (int(d) for d in x.shape)
        splits = kernels.shrink_splits("sgmv", num_tokens, in_dim, max_rank, num_sms)
        t = _new_t(x, splits, num_tokens, max_rank)
    launch(kernels.plan_sgmv_shrink(x, seg_starts, seg_slots, a_table, ranks, t))
    return t


def sgmv_expand(
    t: Any, seg_starts: Any, seg_slots: Any, b_table: Any, scale_table: Any, ranks: Any, y: Any
) -> Any:
    """kernels.sgmv_expand on the host; updates y in place and returns it."""
    launch(kernels.plan_sgmv_expand(t, seg_starts, seg_slots, b_table, scale_table, ranks, y))
    return y
