"""The CUDA LoRA delta kernels (kernels/*.cu): where the sources are, how each is launched, and
the CuPy launchers.

One loader finds the kernel directory (METRALE_KERNEL_DIR, then the installed package data,
then the checkout's kernels/), inlines its local includes and compiles each source once per
process with CuPy's RawModule (NVRTC; CuPy also keeps its own on-disk cache). When no
directory holds the sources, the error names every path tried.

Launch planning (`plan_*`) is plain Python over array shapes and addresses, shared with the host
harness (host_harness.py), so the CPU tests run exactly the grid, block and arguments that a GPU
gets. The `bgmv_*` / `sgmv_*` launchers take CuPy arrays; BF16 buffers are uint16 arrays of raw
BF16 bits (CuPy has no bfloat16 dtype).

cupy is imported only inside functions, through compat.cupy_module().
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from metrale_cli import compat, env
from metrale_cli.errors import ToolMissing

# Every kernel's source file; the extern "C" names are the kernel names.
KERNEL_SOURCES: dict[str, str] = {
    "bgmv_shrink": "bgmv.cu",
    "bgmv_expand_bf16": "bgmv.cu",
    "bgmv_expand_f32": "bgmv.cu",
    "sgmv_shrink": "sgmv.cu",
    "sgmv_expand_bf16": "sgmv.cu",
    "sgmv_expand_f32": "sgmv.cu",
}

THREADS = 128  # METRALE_THREADS in lora_common.cuh: every kernel's block
SHRINK_ROWS = 4  # BGMV_SHRINK_ROWS in bgmv.cu: rank rows per shrink CTA
MAX_RANK = 256  # BGMV_MAX_RANK in bgmv.cu: the expand's shared t row
SGMV_TILE = 64  # SG_M = SG_N = SG_K in sgmv.cu
VECTOR = 8  # BF16 elements per 16-byte load: dims and strides must be multiples of it
H200_SMS = 132  # the host harness plans for an H200 unless told otherwise

# Split-K keeps at least this many K elements per split: one full pass of 128 threads x 8 for
# BGMV, four 64-wide tiles for SGMV, so a split never degenerates into launch overhead.
_BGMV_MIN_K_CHUNK = THREADS * VECTOR
_SGMV_MIN_K_CHUNK = 4 * SGMV_TILE
# Below this many CTAs the grid does not cover the device twice over and split-K pays.
_CTAS_PER_SM = 2

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)


# --- finding and reading the sources ---------------------------------------------------------


def kernel_dir_candidates() -> list[Path]:
    """Where the kernel sources may be, in search order.

    A wheel ships the sources as metrale_cli/kernel_src/ (pyproject maps the checkout's kernels/
    there); a checkout or an editable install has them in kernels/ beside the package.
    """
    package = Path(__file__).resolve().parent
    candidates = [package / "kernel_src", package.parent / "kernels"]
    override = env.kernel_dir()
    if override is not None:
        candidates.insert(0, override)
    return candidates


def find_kernel_dir() -> Path:
    """The first candidate directory holding every kernel source; ToolMissing names all tried."""
    needed = sorted(set(KERNEL_SOURCES.values()))
    tried = []
    for directory in kernel_dir_candidates():
        if all((directory / name).is_file() for name in needed):
            return directory
        tried.append(str(directory))
    raise ToolMissing(
        f"the CUDA kernel sources ({', '.join(needed)}) were not found; tried: {'; '.join(tried)}"
        " (set METRALE_KERNEL_DIR to a directory holding them)"
    )


def read_source(name: str, directory: Path | None = None) -> str:
    """The source of kernels/<name> with its local `#include "..."` files inlined (once each).

    Inlining makes the text CuPy compiles, and the text its cache is keyed on, the whole
    translation unit: NVRTC then needs no include path, and editing a header recompiles.
    """
    directory = directory or find_kernel_dir()
    seen: set[str] = set()

    def expand(file_name: str) -> str:
        if file_name in seen:
            return ""
        seen.add(file_name)
        path = directory / file_name
        if not path.is_file():
            raise ToolMissing(f"kernel source {path} (included by a kernel) does not exist")
        return _INCLUDE.sub(lambda m: expand(m.group(1)), path.read_text(encoding="utf-8"))

    return expand(name)


def sources_digest(directory: Path) -> str:
    """A hash of every kernel source and header in `directory` (sha256 hex)."""
    digest = hashlib.sha256()
    for path in sorted(directory.iterdir()):
        if path.suffix in (".cu", ".cuh", ".h") and path.is_file():
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


# --- launch planning (shared with the host harness) ------------------------------------------


@dataclass(frozen=True)
class KernelLaunch:
    """One kernel launch: what CuPy's RawKernel call and the host harness both take."""

    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    # Arrays (CuPy, NumPy or torch) and NumPy scalars, in the kernel's parameter order.
    args: tuple[Any, ...]


def _dtype_name(array: Any) -> str:
    return str(array.dtype).removeprefix("torch.")


def _address(array: Any) -> int:
    if hasattr(array, "data_ptr"):  # torch
        return int(array.data_ptr())
    if hasattr(array, "data") and hasattr(array.data, "ptr"):  # cupy
        return int(array.data.ptr)
    return int(array.ctypes.data)  # numpy


def _strides(array: Any) -> tuple[int, ...]:
    """Strides in elements."""
    if callable(getattr(array, "stride", None)):  # torch
        return tuple(array.stride())
    return tuple(s // array.itemsize for s in array.strides)


def _check(array: Any, what: str, dtypes: Sequence[str], shape: Sequence[int | None]) -> None:
    name = _dtype_name(array)
    if name not in dtypes:
        raise ValueError(f"{what} must be {' or '.join(dtypes)}, got {name}")
    actual = tuple(array.shape)
    if len(actual) != len(shape) or any(
        want is not None and want != got for want, got in zip(shape, actual, strict=False)
    ):
        wanted = tuple("?" if s is None else s for s in shape)
        raise ValueError(f"{what} must have shape {wanted}, got {actual}")
    strides = _strides(array)
    if actual and actual[-1] > 1 and strides[-1] != 1:
        raise ValueError(f"{what} must be contiguous along its last dimension")
    if _address(array) % 16:
        raise ValueError(f"{what} must start at a 16-byte aligned address")


def _row_stride(array: Any, what: str) -> int:
    stride = _strides(array)[0]
    if stride % VECTOR:
        raise ValueError(f"{what} row stride ({stride} elements) must be a multiple of {VECTOR}")
    return stride


_BF16 = ("uint16", "bfloat16")
_TABLES = ("uint64", "int64")


def _check_tables(
    max_loras: int, ranks: Any, scale_table: Any | None, tables: dict[str, Any]
) -> None:
    for what, table in tables.items():
        _check(table, what, _TABLES, (max_loras,))
    _check(ranks, "ranks", ("int32",), (max_loras,))
    if scale_table is not None:
        _check(scale_table, "scale_table", ("float32",), (max_loras,))


def _check_dims(in_or_out: int, max_rank: int, what: str) -> None:
    if in_or_out % VECTOR or max_rank % VECTOR:
        raise ValueError(
            f"{what} ({in_or_out}) and max_rank ({max_rank}) must be multiples of {VECTOR}"
        )
    if not 0 < max_rank <= MAX_RANK:
        raise ValueError(f"max_rank must be in 1..{MAX_RANK}, got {max_rank}")


def choose_splits(base_ctas: int, k_dim: int, min_chunk: int, num_sms: int) -> int:
    """How many K splits to give a shrink whose grid has `base_ctas` CTAs without splitting."""
    if base_ctas >= _CTAS_PER_SM * num_sms:
        return 1
    wanted = -(-_CTAS_PER_SM * num_sms // max(base_ctas, 1))
    return max(1, min(wanted, k_dim // min_chunk))


def shrink_splits(kind: str, num_tokens: int, in_dim: int, max_rank: int, num_sms: int) -> int:
    """The split-K count the `kind` ("bgmv" or "sgmv") shrink uses: t's leading dimension."""
    if kind == "bgmv":
        base = num_tokens * -(-max_rank // SHRINK_ROWS)
        return choose_splits(base, in_dim, _BGMV_MIN_K_CHUNK, num_sms)
    if kind == "sgmv":
        base = -(-num_tokens // SGMV_TILE) * -(-max_rank // SGMV_TILE)
        return choose_splits(base, in_dim, _SGMV_MIN_K_CHUNK, num_sms)
    raise ValueError(f"unknown shrink kind {kind!r}")


def _k_chunk(in_dim: int, splits: int, multiple: int) -> int:
    # Splits past the end of K are harmless: their CTAs write zero partials.
    chunk = -(-in_dim // splits)
    return -(-chunk // multiple) * multiple


def plan_bgmv_shrink(x: Any, slots: Any, a_table: Any, ranks: Any, t: Any) -> KernelLaunch:
    """t[z, b, :] = partial of x[b] @ A_slot[b]^T over K split z (see kernels/bgmv.cu)."""
    num_splits, num_tokens, max_rank = (int(d) for d in t.shape)
    in_dim = int(x.shape[1])
    max_loras = int(a_table.shape[0])
    _check(x, "x", _BF16, (num_tokens, in_dim))
    _check(slots, "slots", ("int32",), (num_tokens,))
    _check(t, "t", ("float32",), (num_splits, num_tokens, max_rank))
    _check_tables(max_loras, ranks, None, {"a_table": a_table})
    _check_dims(in_dim, max_rank, "in_dim")
    grid = (num_tokens, -(-max_rank // SHRINK_ROWS), num_splits)
    args = (
        x, np.int64(_row_stride(x, "x")), slots, a_table, ranks, np.int32(max_loras),
        t, np.int32(num_tokens), np.int32(in_dim), np.int32(max_rank),
        np.int32(_k_chunk(in_dim, num_splits, VECTOR)),
    )
    return KernelLaunch("bgmv_shrink", grid, (THREADS, 1, 1), args)


def plan_bgmv_expand(
    t: Any, slots: Any, b_table: Any, scale_table: Any, ranks: Any, y: Any, *, num_sms: int
) -> KernelLaunch:
    """y[b] += scale * t[:, b].sum(0) @ B_slot[b]^T (see kernels/bgmv.cu)."""
    num_splits, num_tokens, max_rank = (int(d) for d in t.shape)
    out_dim = int(y.shape[1])
    max_loras = int(b_table.shape[0])
    y_kind = "bf16" if _dtype_name(y) in _BF16 else "f32"
    _check(t, "t", ("float32",), (num_splits, num_tokens, max_rank))
    _check(slots, "slots", ("int32",), (num_tokens,))
    _check(y, "y", (*_BF16, "float32"), (num_tokens, out_dim))
    _check_tables(max_loras, ranks, scale_table, {"b_table": b_table})
    _check_dims(out_dim, max_rank, "out_dim")
    # Rows per CTA: 64 (one pass of 64 lane pairs) when that is what it takes to cover the device
    # twice, else up to 4 passes per CTA so each CTA amortises its t-row load and setup.
    row_blocks = -(-out_dim // (THREADS // 2))
    passes = 4
    while passes > 1 and num_tokens * -(-row_blocks // passes) < _CTAS_PER_SM * num_sms:
        passes //= 2
    rows_per_cta = passes * (THREADS // 2)
    grid = (num_tokens, -(-out_dim // rows_per_cta), 1)
    args = (
        t, np.int32(num_splits), slots, b_table, scale_table, ranks, np.int32(max_loras),
        y, np.int64(_row_stride(y, "y")), np.int32(num_tokens), np.int32(out_dim),
        np.int32(max_rank), np.int32(rows_per_cta),
    )
    return KernelLaunch(f"bgmv_expand_{y_kind}", grid, (THREADS, 1, 1), args)


def _check_segments(seg_starts: Any, seg_slots: Any) -> int:
    num_segments = int(seg_slots.shape[0])
    _check(seg_slots, "seg_slots", ("int32",), (num_segments,))
    _check(seg_starts, "seg_starts", ("int32",), (num_segments + 1,))
    return num_segments


def plan_sgmv_shrink(
    x: Any, seg_starts: Any, seg_slots: Any, a_table: Any, ranks: Any, t: Any
) -> KernelLaunch:
    """t[z, b, :] = partial of x[b] @ A_seg^T over K split z (see kernels/sgmv.cu)."""
    num_splits, num_tokens, max_rank = (int(d) for d in t.shape)
    in_dim = int(x.shape[1])
    max_loras = int(a_table.shape[0])
    num_segments = _check_segments(seg_starts, seg_slots)
    _check(x, "x", _BF16, (num_tokens, in_dim))
    _check(t, "t", ("float32",), (num_splits, num_tokens, max_rank))
    _check_tables(max_loras, ranks, None, {"a_table": a_table})
    _check_dims(in_dim, max_rank, "in_dim")
    grid = (-(-max_rank // SGMV_TILE), -(-num_tokens // SGMV_TILE), num_splits)
    args = (
        x, np.int64(_row_stride(x, "x")), seg_starts, seg_slots, np.int32(num_segments),
        a_table, ranks, np.int32(max_loras), t, np.int32(num_tokens), np.int32(in_dim),
        np.int32(max_rank), np.int32(_k_chunk(in_dim, num_splits, SGMV_TILE)),
    )
    return KernelLaunch("sgmv_shrink", grid, (THREADS, 1, 1), args)


def plan_sgmv_expand(
    t: Any, seg_starts: Any, seg_slots: Any, b_table: Any, scale_table: Any, ranks: Any, y: Any
) -> KernelLaunch:
    """y[b] += scale * t[:, b].sum(0) @ B_seg^T (see kernels/sgmv.cu)."""
    num_splits, num_tokens, max_rank = (int(d) for d in t.shape)
    out_dim = int(y.shape[1])
    max_loras = int(b_table.shape[0])
    num_segments = _check_segments(seg_starts, seg_slots)
    y_kind = "bf16" if _dtype_name(y) in _BF16 else "f32"
    _check(t, "t", ("float32",), (num_splits, num_tokens, max_rank))
    _check(y, "y", (*_BF16, "float32"), (num_tokens, out_dim))
    _check_tables(max_loras, ranks, scale_table, {"b_table": b_table})
    _check_dims(out_dim, max_rank, "out_dim")
    grid = (-(-out_dim // SGMV_TILE), -(-num_tokens // SGMV_TILE), 1)
    args = (
        t, np.int32(num_splits), seg_starts, seg_slots, np.int32(num_segments), b_table,
        scale_table, ranks, np.int32(max_loras), y, np.int64(_row_stride(y, "y")),
        np.int32(num_tokens), np.int32(out_dim), np.int32(max_rank),
    )
    return KernelLaunch(f"sgmv_expand_{y_kind}", grid, (THREADS, 1, 1), args)


# --- CuPy: compile and launch ----------------------------------------------------------------


@functools.cache
def _module(directory: str, source: str, digest: str) -> Any:
    # `digest` is part of the cache key only: an edited source compiles afresh in-process too.
    cupy = compat.cupy_module()
    code = read_source(source, Path(directory))
    return cupy.RawModule(code=code, options=("-std=c++17",))


def get_kernel(name: str) -> Any:
    """The compiled cupy.RawKernel `name` (one of KERNEL_SOURCES); NoDevice without a GPU."""
    if name not in KERNEL_SOURCES:
        raise ValueError(f"unknown kernel {name!r}; known: {', '.join(KERNEL_SOURCES)}")
    compat.cupy_module()
    directory = find_kernel_dir()
    module = _module(str(directory), KERNEL_SOURCES[name], sources_digest(directory))
    return module.get_function(name)


@functools.cache
def device_sm_count(device_id: int = 0) -> int:
    cupy = compat.cupy_module()
    return int(cupy.cuda.Device(device_id).attributes["MultiProcessorCount"])


def launch(plan: KernelLaunch) -> None:
    """Launch a planned kernel on CuPy's current stream."""
    if 0 in plan.grid:
        return  # an empty batch: nothing to do, and a zero grid is an invalid launch
    get_kernel(plan.kernel)(plan.grid, plan.block, plan.args)


def _num_sms(num_sms: int | None) -> int:
    if num_sms is not None:
        return num_sms
    cupy = compat.cupy_module()
    return device_sm_count(cupy.cuda.Device().id)


def _new_t(kind: str, x: Any, max_rank: int, num_sms: int | None) -> Any:
    """t F32 [num_splits, T, max_rank] for a shrink of x, split as the planner splits it."""
    cupy = compat.cupy_module()
    num_tokens, in_dim = (int(d) for d in x.shape)
    splits = shrink_splits(kind, num_tokens, in_dim, max_rank, _num_sms(num_sms))
    return cupy.empty((splits, num_tokens, max_rank), dtype=cupy.float32)


def bgmv_shrink(
    x: Any, slots: Any, a_table: Any, ranks: Any, max_rank: int, t: Any | None = None,
    *, num_sms: int | None = None,
) -> Any:
    """Decode shrink on the GPU. x BF16 (uint16) [T, in_dim]; slots i32 [T]; a_table u64,
    ranks i32 [max_loras]. Returns t F32 [num_splits, T, max_rank] (allocated when not given)."""
    if t is None:
        t = _new_t("bgmv", x, max_rank, num_sms)
    launch(plan_bgmv_shrink(x, slots, a_table, ranks, t))
    return t


def bgmv_expand(
    t: Any, slots: Any, b_table: Any, scale_table: Any, ranks: Any, y: Any,
    *, num_sms: int | None = None,
) -> Any:
    """Decode expand on the GPU: y (BF16 as uint16, or F32) [T, out_dim] += ...; returns y."""
    launch(plan_bgmv_expand(t, slots, b_table, scale_table, ranks, y, num_sms=_num_sms(num_sms)))
    return y


def sgmv_shrink(
    x: Any, seg_starts: Any, seg_slots: Any, a_table: Any, ranks: Any, max_rank: int,
    t: Any | None = None, *, num_sms: int | None = None,
) -> Any:
    """Prefill shrink on the GPU over segments (seg_starts i32 [S+1], seg_slots i32 [S]).
    Returns t F32 [num_splits, T, max_rank] (allocated when not given)."""
    if t is None:
        t = _new_t("sgmv", x, max_rank, num_sms)
    launch(plan_sgmv_shrink(x, seg_starts, seg_slots, a_table, ranks, t))
    return t


def sgmv_expand(
    t: Any, seg_starts: Any, seg_slots: Any, b_table: Any, scale_table: Any, ranks: Any, y: Any
) -> Any:
    """Prefill expand on the GPU: y (BF16 as uint16, or F32) [T, out_dim] += ...; returns y."""
    launch(plan_sgmv_expand(t, seg_starts, seg_slots, b_table, scale_table, ranks, y))
    return y


def bgmv(
    x: Any, y: Any, slots: Any, a_table: Any, b_table: Any, scale_table: Any, ranks: Any,
    max_rank: int, *, num_sms: int | None = None,
) -> Any:
    """The whole decode LoRA delta for one entry: y += scale * (x @ A^T) @ B^T per token."""
    t = bgmv_shrink(x, slots, a_table, ranks, max_rank, num_sms=num_sms)
    return bgmv_expand(t, slots, b_table, scale_table, ranks, y, num_sms=num_sms)


def sgmv(
    x: Any, y: Any, seg_starts: Any, seg_slots: Any, a_table: Any, b_table: Any,
    scale_table: Any, ranks: Any, max_rank: int, *, num_sms: int | None = None,
) -> Any:
    """The whole prefill LoRA delta for one entry over segments of tokens sharing a slot."""
    t = sgmv_shrink(x, seg_starts, seg_slots, a_table, ranks, max_rank, num_sms=num_sms)
    return sgmv_expand(t, seg_starts, seg_slots, b_table, scale_table, ranks, y)
