"""The CUDA LoRA delta kernels (kernels/*.cu): where the sources are, how each is launched, and
the CuPy launchers.

One loader finds the kernel directory (METRALE_KERNEL_DIR, then the installed package data,
then the checkout's kernels/), inlines its local includes and compiles each source once per
process with CuPy's RawModule (NVRTC; CuPy also keeps its own on-disk cache). When no
directory holds the sources, the error names every path tried.

The numbers the kernels and this planner share (threads, tiles, ranks, loads in flight) are read
from kernels/lora_config.h, written once there.

Launch planning (`plan_*`, `plan_batch`) is plain Python over array shapes and addresses, shared
with the host harness (host_harness.py), so the CPU tests run exactly the grid, block and
arguments that a GPU gets. The `bgmv*` / `sgmv*` launchers run on a backend: CuPy arrays on the
GPU by default, or the host harness's (`host_harness.HOST`); BF16 buffers are uint16 arrays of
raw BF16 bits (CuPy has no bfloat16 dtype).

cupy is imported only inside functions, through compat.cupy_module().
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

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
    "router_lora_f32": "expert.cu",
    "router_lora_bf16": "expert.cu",
    "expert_shrink_decode": "expert.cu",
    "expert_shrink_prefill": "expert.cu",
    "expert_expand_decode_bf16": "expert.cu",
    "expert_expand_decode_f32": "expert.cu",
    "expert_expand_prefill_bf16": "expert.cu",
    "expert_expand_prefill_f32": "expert.cu",
    "overlay_gather": "expert.cu",
}

CONFIG_HEADER = "lora_config.h"
_DEFINE = re.compile(r"^#define\s+([A-Z0-9_]+)\s+(\d+)\s*$", re.MULTILINE)
H200_SMS = 132  # the host harness plans for an H200 unless told otherwise
# The per-kernel figures of lora_config.h, by the prefix of their #define names.
_CONFIG_PREFIX = {
    "bgmv_shrink": "BGMV_SHRINK", "bgmv_expand_bf16": "BGMV_EXPAND",
    "bgmv_expand_f32": "BGMV_EXPAND", "sgmv_shrink": "SGMV_SHRINK",
    "sgmv_expand_bf16": "SGMV_EXPAND", "sgmv_expand_f32": "SGMV_EXPAND",
    "router_lora_f32": "ROUTER_LORA", "router_lora_bf16": "ROUTER_LORA",
    "expert_shrink_decode": "EXPERT_SHRINK_DECODE",
    "expert_shrink_prefill": "EXPERT_SHRINK_PREFILL",
    "expert_expand_decode_bf16": "EXPERT_EXPAND_DECODE",
    "expert_expand_decode_f32": "EXPERT_EXPAND_DECODE",
    "expert_expand_prefill_bf16": "EXPERT_EXPAND_PREFILL",
    "expert_expand_prefill_f32": "EXPERT_EXPAND_PREFILL", "overlay_gather": "OVERLAY_GATHER",
}


def _read_config(directory: Path) -> dict[str, int]:
    path = directory / CONFIG_HEADER
    return {name: int(value) for name, value in _DEFINE.findall(path.read_text(encoding="utf-8"))}


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)


# --- finding and reading the sources ---------------------------------------------------------


def kernel_dir_candidates() -> list[Path]:
    """Where the kernel sources may be, in search order.

    A wheel ships the sources as metrale_cli/kernel_src/ (pyproject maps the checkout's kernels/
    there); a checkout or an editable install has them in kernels/ beside the package.
    """
    package = Path(__file__).resolve().parent.parent  # metrale_cli/, above ops/
    candidates = [package / "kernel_src", package.parent / "kernels"]
    override = env.kernel_dir()
    if override is not None:
        candidates.insert(0, override)
    return candidates


def find_kernel_dir() -> Path:
    """The first candidate directory holding every kernel source; ToolMissing names all tried."""
    needed = sorted({*KERNEL_SOURCES.values(), CONFIG_HEADER})
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


# --- the shared constants (kernels/lora_config.h) ---------------------------------------------

CONFIG: dict[str, int] = _read_config(find_kernel_dir())
THREADS = CONFIG["METRALE_THREADS"]  # every kernel's block
VECTOR = CONFIG["METRALE_VECTOR"]  # BF16 per 16-byte load: dims, ranks and strides are multiples
MAX_RANK = CONFIG["METRALE_MAX_RANK"]  # the largest max_rank the kernels serve
MAX_SPLITS = CONFIG["METRALE_MAX_SPLITS"]  # split-K partials at most
SHRINK_ROWS = CONFIG["BGMV_SHRINK_ROWS"]  # rank rows per bgmv_shrink CTA
EXPAND_ROWS = CONFIG["BGMV_EXPAND_ROWS"]  # output rows per bgmv_expand thread
SGMV_TILE = CONFIG["SGMV_TILE"]  # SGMV tokens x columns x K per tile
# A decode batch takes the grouped (segment plan) path when its adapted tokens average at least
# this many per distinct slot: each adapter's weights are then read once per 64-token tile
# rather than once per token, which outweighs the mma passes a tile spends per segment.
GROUP_MIN_TOKENS = 4


def min_ctas_per_sm(kernel: str) -> int:
    """The CTAs per SM that `kernel`'s __launch_bounds__ guarantees (lora_config.h)."""
    return CONFIG[f"{_CONFIG_PREFIX[kernel]}_MIN_CTAS"]


def loads_in_flight(kernel: str) -> int:
    """Independent 16-byte loads per thread that each hot loop of `kernel` issues before their
    first use (lora_config.h; tests/test_kernels_sass.py checks it in the sm_90 SASS)."""
    return CONFIG[f"{_CONFIG_PREFIX[kernel]}_LOADS"]


# --- launch planning (shared with the host harness) ------------------------------------------


# CUDA's grid limits: x up to 2^31 - 1, y and z up to 65,535 (cudaDevAttrMaxGridDimY/Z on every
# device since sm_30). A launch past them fails on the GPU while the host harness would run it.
MAX_GRID = (2**31 - 1, 65_535, 65_535)


@dataclass(frozen=True)
class KernelLaunch:
    """One kernel launch: what CuPy's RawKernel call and the host harness both take. A grid
    past CUDA's limits (MAX_GRID) is refused here, for every kernel, on every backend."""

    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    # Arrays (CuPy, NumPy or torch) and NumPy scalars, in the kernel's parameter order.
    args: tuple[Any, ...]

    def __post_init__(self) -> None:
        for axis, size, limit in zip("xyz", self.grid, MAX_GRID, strict=True):
            if size > limit:
                raise ValueError(
                    f"{self.kernel}'s grid {self.grid} passes CUDA's limit of {limit:,} on "
                    f"{axis}; split the batch (SGMV: at most {MAX_GRID[1] * SGMV_TILE:,} "
                    "tokens per launch)")


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


def _host_values(array: Any) -> np.ndarray:
    """A NumPy copy (or view) of a NumPy, torch or CuPy array."""
    if hasattr(array, "get") and not isinstance(array, np.ndarray):  # cupy
        return np.asarray(array.get())
    if hasattr(array, "numpy"):  # torch
        return array.detach().cpu().numpy()
    return np.asarray(array)


def _dense(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether an array of `shape` with `strides` (elements) is C-contiguous; dims of size 1
    take any stride, as no index ever steps along them."""
    expected = 1
    for size, stride in zip(reversed(shape), reversed(strides), strict=True):
        if size > 1 and stride != expected:
            return False
        expected *= size
    return True


def _check(array: Any, what: str, dtypes: Sequence[str], shape: Sequence[int | None],
           *, rows: bool = False) -> None:
    """dtype, shape, layout and alignment of a buffer a kernel reads or writes. The kernels
    index every buffer as a dense row-major array, except those passed with their own row
    stride (`rows`: x, y, logits, emb), which need only contiguous rows."""
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
    if rows and actual and actual[-1] > 1 and strides[-1] != 1:
        raise ValueError(f"{what} must be contiguous along its last dimension")
    if not rows and not _dense(actual, strides):
        raise ValueError(f"{what} must be contiguous (the kernels index it as a dense array); "
                         f"got strides {strides} for shape {actual}")
    if _address(array) % 16:
        raise ValueError(f"{what} must start at a 16-byte aligned address")


def _row_stride(array: Any, what: str) -> int:
    stride = _strides(array)[0]
    if stride % VECTOR:
        raise ValueError(f"{what} row stride ({stride} elements) must be a multiple of {VECTOR}")
    rows, width = int(array.shape[0]), int(array.shape[-1])
    if rows > 1 and stride < width:
        raise ValueError(f"{what}'s rows overlap (row stride {stride} < width {width})")
    return stride


_BF16 = ("uint16", "bfloat16")
_TABLES = ("uint64", "int64")


def check_table_alignment(table: Any, what: str) -> None:
    """Every weight address in a pointer table is 0 (no weights) or 16-byte aligned.

    The kernels read weights with 128-bit loads: on a GPU a misaligned one faults and poisons
    the CUDA context, while the host build would split it and pass. A CuPy table is copied to
    the host for this (max_loras x 8 bytes)."""
    addresses = _host_values(table).view(np.uint64).ravel()
    bad = np.flatnonzero(addresses % np.uint64(16))
    if bad.size:
        slot = int(bad[0])
        raise ValueError(
            f"{what}[{slot}] = {int(addresses[slot]):#x} is not 16-byte aligned "
            f"({bad.size} misaligned slot(s)); the kernels' 128-bit loads need aligned weights"
        )


def _check_tables(
    max_loras: int, ranks: Any, scale_table: Any | None, tables: dict[str, Any],
    slices: int = 1,
) -> None:
    """The pointer tables ([max_loras], or [slices, max_loras] for a fused BGMV launch), the
    pool's ranks and scales ([max_loras], shared by the slices: a slot has one rank)."""
    for what, table in tables.items():
        _check(table, what, _TABLES, (max_loras,) if len(table.shape) == 1 else (slices, max_loras))
        check_table_alignment(table, what)
    _check(ranks, "ranks", ("int32",), (max_loras,))
    if scale_table is not None:
        _check(scale_table, "scale_table", ("float32",), (max_loras,))


def _check_dims(in_or_out: int, max_rank: int, t_cols: int, what: str) -> None:
    if in_or_out % VECTOR or max_rank % VECTOR or t_cols % VECTOR:
        raise ValueError(
            f"{what} ({in_or_out}), max_rank ({max_rank}) and t's width ({t_cols}) must be "
            f"multiples of {VECTOR}"
        )
    if not 0 < max_rank <= MAX_RANK:
        raise ValueError(f"max_rank must be in 1..{MAX_RANK}, got {max_rank}")
    if not 0 < t_cols <= max_rank:
        raise ValueError(f"t's width ({t_cols}) must be in 1..max_rank ({max_rank})")


# Split-K keeps at least this many K elements per split: one full step of 128 threads x 8 for
# BGMV, one 64-wide tile for SGMV. A pass of a CTA streams 2 such steps (BGMV) or one tile (SGMV).
_BGMV_MIN_K_CHUNK = THREADS * VECTOR
_SGMV_MIN_K_CHUNK = SGMV_TILE
_PASS_K = {"bgmv": 2 * _BGMV_MIN_K_CHUNK, "sgmv": SGMV_TILE}
# The split planner's costs, those of the roofline model (metrale_cli/bench/kernels.py): a
# streaming pass is one DRAM latency, a dependent metadata load one L2 latency, and split-K
# adds its partials into t by atomics at L2 after a memset of t (one more graph node).
_DRAM_LATENCY_US = 0.6
_L2_LATENCY_US = 0.3
_L2_BYTES_PER_US = 10e6
MEMSET_US = 2.0


def shrink_cost_us(kind: str, num_tokens: int, in_dim: int, t_cols: int, splits: int,
                   num_sms: int) -> float:
    """The modelled time of a `kind` ("bgmv" or "sgmv") shrink cut into `splits` K splits: CTAs
    resident together (the launch bounds' per SM) run in waves, each CTA 2 metadata round trips
    and then ceil(split's K / a pass's K) streaming passes; split-K adds the memset of t and
    its partials' atomics."""
    if kind == "bgmv":
        base, kernel = num_tokens * -(-t_cols // SHRINK_ROWS), "bgmv_shrink"
        chunk = _k_chunk(in_dim, splits, VECTOR)
    elif kind == "sgmv":
        base = -(-num_tokens // SGMV_TILE) * -(-t_cols // SGMV_TILE)
        kernel, chunk = "sgmv_shrink", _k_chunk(in_dim, splits, SGMV_TILE)
    else:
        raise ValueError(f"unknown shrink kind {kind!r}")
    ctas = max(base, 1) * splits
    resident = min(ctas, num_sms * min_ctas_per_sm(kernel))
    waves = -(-ctas // resident)
    stream = waves * (-(-chunk // _PASS_K[kind]) * _DRAM_LATENCY_US + 2 * _L2_LATENCY_US)
    if splits == 1:
        return stream
    return stream + MEMSET_US + 4 * num_tokens * t_cols * splits / _L2_BYTES_PER_US


def shrink_splits(kind: str, num_tokens: int, in_dim: int, t_cols: int, num_sms: int) -> int:
    """The split-K count the `kind` ("bgmv" or "sgmv") shrink uses: the one of least modelled
    cost (shrink_cost_us), the fewest splits among equals, at most METRALE_MAX_SPLITS and never
    below one pass's K per split. `t_cols` is t's width: the batch's widest rank (or max_rank
    when that is unknown)."""
    least = _BGMV_MIN_K_CHUNK if kind == "bgmv" else _SGMV_MIN_K_CHUNK
    candidates = range(1, max(1, min(MAX_SPLITS, in_dim // least)) + 1)
    return min(candidates, key=lambda s: (round(shrink_cost_us(kind, num_tokens, in_dim, t_cols,
                                                               s, num_sms), 6), s))


def launch_grid(kernel: str, num_tokens: int, dim: int, t_cols: int,
                splits: int = 1) -> tuple[int, int, int]:
    """The grid of `kernel` (a KERNEL_SOURCES name) over T tokens, its output dim (expand) or
    input dim (shrink: unused), t's width and the shrink's split count."""
    if kernel == "bgmv_shrink":
        return (num_tokens, -(-t_cols // SHRINK_ROWS), splits)
    if kernel.startswith("bgmv_expand"):
        return (num_tokens, -(-dim // (THREADS * EXPAND_ROWS)), 1)
    if kernel == "sgmv_shrink":
        return (-(-t_cols // SGMV_TILE), -(-num_tokens // SGMV_TILE), splits)
    if kernel.startswith("sgmv_expand"):
        return (-(-dim // SGMV_TILE), -(-num_tokens // SGMV_TILE), 1)
    raise ValueError(f"unknown kernel {kernel!r}")


def _k_chunk(in_dim: int, splits: int, multiple: int) -> int:
    # Splits past the end of K are harmless: their CTAs write zero partials.
    chunk = -(-in_dim // splits)
    return -(-chunk // multiple) * multiple


def _t_shape(t: Any, max_rank: int) -> tuple[int, int, int]:
    """(T, t_cols, max_rank) of a t buffer (F32 [T, t_cols]). max_rank is the pool's (A rows,
    B's row stride) and comes from the pool or the plan: t's width is the batch's widest rank,
    which may be narrower, so it is never taken for max_rank."""
    if len(t.shape) != 2:
        raise ValueError(f"t must be F32 [T, t_cols], got shape {tuple(t.shape)}")
    num_tokens, t_cols = (int(d) for d in t.shape)
    if isinstance(max_rank, bool) or not isinstance(max_rank, int | np.integer):
        raise TypeError(f"max_rank must be the pool's max rank (an int), got {max_rank!r}")
    return num_tokens, t_cols, int(max_rank)


def _check_splits(splits: int) -> int:
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"splits must be in 1..{MAX_SPLITS}, got {splits}")
    return int(splits)


def _order_arg(token_order: Any | None, num_tokens: int) -> Any:
    if token_order is None:
        return np.uint64(0)  # a null pointer: identity order
    _check(token_order, "token_order", ("int32",), (num_tokens,))
    return token_order


def _slices(table: Any, t: Any, what: str) -> tuple[int, int, Any]:
    """(slices, max_loras, t as one plane's shape) of a BGMV launch: one (layer, module) entry
    (`what` u64 [max_loras], t F32 [T, t_cols]) or fused slices sharing x (`what` u64
    [S, max_loras], t F32 [S, T, t_cols])."""
    if len(table.shape) == 1:
        return 1, int(table.shape[0]), t
    if len(table.shape) != 2 or len(t.shape) != 3 or int(t.shape[0]) != int(table.shape[0]):
        raise ValueError(f"fused slices take {what} [S, max_loras] and t [S, T, t_cols]; got "
                         f"{what} {tuple(table.shape)} and t {tuple(t.shape)}")
    return int(table.shape[0]), int(table.shape[1]), t[0]


def plan_bgmv_shrink(
    x: Any, slots: Any, a_table: Any, ranks: Any, t: Any, max_rank: int, splits: int = 1,
) -> KernelLaunch:
    """t[b, :] = x[b] @ A_slot[b]^T (see kernels/bgmv.cu), K cut into `splits` whose partials
    are added into t by atomics (t must then be zero). t's width may be below max_rank (the
    batch's widest rank): the grid covers only it. With a_table [S, max_loras] and t
    [S, T, t_cols], the S slices that share x (q, k, v) are one launch."""
    slices, max_loras, plane = _slices(a_table, t, "a_table")
    num_tokens, t_cols, max_rank = _t_shape(plane, max_rank)
    in_dim = int(x.shape[1])
    _check(x, "x", _BF16, (num_tokens, in_dim), rows=True)
    _check(slots, "slots", ("int32",), (num_tokens,))
    _check(t, "t", ("float32",), tuple(t.shape[:-2]) + (num_tokens, t_cols))
    _check_tables(max_loras, ranks, None, {"a_table": a_table}, slices)
    _check_dims(in_dim, max_rank, t_cols, "in_dim")
    num_splits = _check_splits(splits)
    x_, rows, z = launch_grid("bgmv_shrink", num_tokens, in_dim, t_cols, num_splits)
    args = (
        x, np.int64(_row_stride(x, "x")), slots, a_table, ranks, np.int32(max_loras),
        t, np.int32(num_tokens), np.int32(in_dim), np.int32(max_rank), np.int32(t_cols),
        np.int32(_k_chunk(in_dim, num_splits, VECTOR)), np.int32(slices),
    )
    return KernelLaunch("bgmv_shrink", (x_, rows, z * slices), (THREADS, 1, 1), args)


def check_slice_cols(slice_cols: Sequence[int], slices: int, width: int) -> list[int]:
    """The column bounds of fused slices in one y (slice z: slice_cols[z] up to
    slice_cols[z + 1]): S + 1 of them, from 0, increasing, multiples of 8, within y's width."""
    cols = [int(c) for c in slice_cols]
    if len(cols) != slices + 1 or cols[0] != 0:
        raise ValueError(f"slice_cols must be {slices + 1} column bounds from 0, got {cols}")
    if any(b <= a for a, b in zip(cols, cols[1:], strict=False)) or any(c % VECTOR for c in cols):
        raise ValueError(f"slice_cols must increase in multiples of {VECTOR}, got {cols}")
    if cols[-1] > width:
        raise ValueError(f"slice_cols end at {cols[-1]}, past y's {width} columns")
    return cols


def plan_bgmv_expand(
    t: Any, slots: Any, b_table: Any, scale_table: Any, ranks: Any, y: Any, max_rank: int,
    slice_cols: Any | None = None,
) -> KernelLaunch:
    """y[b] += scale * t[b] @ B_slot[b]^T (see kernels/bgmv.cu). B rows are the pool's
    max_rank long. Fused slices: b_table [S, max_loras], t [S, T, t_cols] and `slice_cols`
    (i32 [S + 1], where the kernel reads it; a CuPy array is copied to the host for the
    check): slice z adds into y's columns slice_cols[z] up to slice_cols[z + 1]."""
    slices, max_loras, plane = _slices(b_table, t, "b_table")
    num_tokens, t_cols, max_rank = _t_shape(plane, max_rank)
    y_kind = "bf16" if _dtype_name(y) in _BF16 else "f32"
    _check(t, "t", ("float32",), tuple(t.shape[:-2]) + (num_tokens, t_cols))
    _check(slots, "slots", ("int32",), (num_tokens,))
    _check(y, "y", (*_BF16, "float32"), (num_tokens, int(y.shape[1])), rows=True)
    _check_tables(max_loras, ranks, scale_table, {"b_table": b_table}, slices)
    if slice_cols is None:
        if slices > 1:
            raise ValueError("fused slices need slice_cols, their column bounds in y")
        out_dim, cols_arg = int(y.shape[1]), np.uint64(0)  # a null pointer: all of y
    else:
        _check(slice_cols, "slice_cols", ("int32",), (slices + 1,))
        cols = check_slice_cols(_host_values(slice_cols).tolist(), slices, int(y.shape[1]))
        out_dim, cols_arg = max(b - a for a, b in zip(cols, cols[1:], strict=False)), slice_cols
    _check_dims(out_dim, max_rank, t_cols, "out_dim")
    x_, blocks, _ = launch_grid(f"bgmv_expand_{y_kind}", num_tokens, out_dim, t_cols)
    args = (
        t, slots, b_table, scale_table, ranks, np.int32(max_loras),
        y, np.int64(_row_stride(y, "y")), np.int32(num_tokens), np.int32(out_dim),
        np.int32(max_rank), np.int32(t_cols), cols_arg,
    )
    return KernelLaunch(f"bgmv_expand_{y_kind}", (x_, blocks, slices), (THREADS, 1, 1), args)


def check_segments(seg_starts: Any, seg_slots: Any, num_tokens: int) -> int:
    """The segment count, after checking what the SGMV kernels assume of the segments: starts
    non-decreasing, within [0, T], the last one T (a binary search over them finds each tile's
    first segment; starts that go backwards give wrong rows everywhere). A CuPy seg_starts is
    copied to the host for this ((S + 1) x 4 bytes)."""
    num_segments = int(seg_slots.shape[0])
    _check(seg_slots, "seg_slots", ("int32",), (num_segments,))
    _check(seg_starts, "seg_starts", ("int32",), (num_segments + 1,))
    starts = _host_values(seg_starts).astype(np.int64).ravel()
    if starts[-1] != num_tokens:
        raise ValueError(f"seg_starts must end at the token count ({num_tokens}), "
                         f"got {int(starts[-1])}")
    if starts[0] < 0:
        raise ValueError(f"seg_starts must lie within [0, {num_tokens}], got {int(starts[0])}")
    back = np.flatnonzero(np.diff(starts) < 0)
    if back.size:
        i = int(back[0])
        raise ValueError(f"seg_starts must be non-decreasing: seg_starts[{i + 1}] = "
                         f"{int(starts[i + 1])} < seg_starts[{i}] = {int(starts[i])}")
    return num_segments


def plan_sgmv_shrink(
    x: Any, seg_starts: Any, seg_slots: Any, a_table: Any, ranks: Any, t: Any,
    max_rank: int, token_order: Any | None = None, splits: int = 1,
) -> KernelLaunch:
    """t[b, :] = x[b] @ A_seg^T (see kernels/sgmv.cu), K cut into `splits` added into t by
    atomics (t must then be zero). With `token_order`, segments index sorted positions (the
    grouped decode path)."""
    num_tokens, t_cols, max_rank = _t_shape(t, max_rank)
    in_dim = int(x.shape[1])
    max_loras = int(a_table.shape[0])
    num_segments = check_segments(seg_starts, seg_slots, num_tokens)
    _check(x, "x", _BF16, (num_tokens, in_dim), rows=True)
    _check(t, "t", ("float32",), (num_tokens, t_cols))
    _check_tables(max_loras, ranks, None, {"a_table": a_table})
    _check_dims(in_dim, max_rank, t_cols, "in_dim")
    num_splits = _check_splits(splits)
    grid = launch_grid("sgmv_shrink", num_tokens, in_dim, t_cols, num_splits)
    args = (
        x, np.int64(_row_stride(x, "x")), seg_starts, seg_slots, np.int32(num_segments),
        _order_arg(token_order, num_tokens), a_table, ranks, np.int32(max_loras), t,
        np.int32(num_tokens), np.int32(in_dim), np.int32(max_rank), np.int32(t_cols),
        np.int32(_k_chunk(in_dim, num_splits, SGMV_TILE)),
    )
    return KernelLaunch("sgmv_shrink", grid, (THREADS, 1, 1), args)


def plan_sgmv_expand(
    t: Any, seg_starts: Any, seg_slots: Any, b_table: Any, scale_table: Any, ranks: Any, y: Any,
    max_rank: int, token_order: Any | None = None,
) -> KernelLaunch:
    """y[b] += scale * t[b] @ B_seg^T (see kernels/sgmv.cu); B rows are the pool's max_rank
    long."""
    num_tokens, t_cols, max_rank = _t_shape(t, max_rank)
    out_dim = int(y.shape[1])
    max_loras = int(b_table.shape[0])
    num_segments = check_segments(seg_starts, seg_slots, num_tokens)
    y_kind = "bf16" if _dtype_name(y) in _BF16 else "f32"
    _check(t, "t", ("float32",), (num_tokens, t_cols))
    _check(y, "y", (*_BF16, "float32"), (num_tokens, out_dim), rows=True)
    _check_tables(max_loras, ranks, scale_table, {"b_table": b_table})
    _check_dims(out_dim, max_rank, t_cols, "out_dim")
    grid = launch_grid(f"sgmv_expand_{y_kind}", num_tokens, out_dim, t_cols)
    args = (
        t, seg_starts, seg_slots, np.int32(num_segments),
        _order_arg(token_order, num_tokens), b_table, scale_table, ranks, np.int32(max_loras),
        y, np.int64(_row_stride(y, "y")), np.int32(num_tokens), np.int32(out_dim),
        np.int32(max_rank), np.int32(t_cols),
    )
    return KernelLaunch(f"sgmv_expand_{y_kind}", grid, (THREADS, 1, 1), args)


# --- the batch plan: what the host knows when it builds a batch --------------------------------


@dataclass(frozen=True)
class BatchPlan:
    """A decode batch as the host builds it (once per forward, reused by every layer):

    - `t_cols`: the widest rank among the batch's adapted tokens (rounded up to VECTOR), so
      grids and t cover the ranks present rather than the pool's max_rank;
    - a segment plan: `order` (int32 [T], token indices stably sorted by slot) and segments over
      those sorted positions (`seg_starts` int32 [S + 1], `seg_slots` int32 [S]);
    - `grouped`: whether decode takes the grouped path (SGMV over the sorted tokens, each
      adapter's weights read once per 64-token tile) rather than the per-token BGMV path,
      chosen from the batch's distinct slots (GROUP_MIN_TOKENS).
    """

    num_tokens: int
    t_cols: int
    distinct_slots: int
    adapted_tokens: int
    grouped: bool
    order: np.ndarray
    seg_starts: np.ndarray
    seg_slots: np.ndarray


def plan_batch(slots: Sequence[int] | np.ndarray, ranks: Sequence[int] | np.ndarray,
               max_rank: int, *, group_min_tokens: int = GROUP_MIN_TOKENS) -> BatchPlan:
    """The batch plan of a decode batch from its host-side slot ids and the pool's rank table
    (slot -1, or one outside the table, is a token without adapter)."""
    slot_ids = np.asarray(slots, dtype=np.int64).ravel()
    rank_table = np.asarray(ranks, dtype=np.int64).ravel()
    inside = (slot_ids >= 0) & (slot_ids < rank_table.size)
    token_rank = np.zeros(slot_ids.size, dtype=np.int64)
    token_rank[inside] = np.minimum(rank_table[slot_ids[inside]], max_rank)
    adapted = token_rank > 0
    widest = int(token_rank.max()) if slot_ids.size else 0
    t_cols = min(max(VECTOR, -(-widest // VECTOR) * VECTOR), max_rank)
    distinct = int(np.unique(slot_ids[adapted]).size)
    adapted_tokens = int(adapted.sum())
    order = np.argsort(slot_ids, kind="stable").astype(np.int32)
    sorted_slots = slot_ids[order]
    cuts = np.flatnonzero(np.diff(sorted_slots)) + 1
    seg_starts = np.concatenate(([0], cuts, [slot_ids.size])).astype(np.int32)
    if slot_ids.size == 0:
        seg_starts = np.zeros(1, dtype=np.int32)
    seg_slots = sorted_slots[seg_starts[:-1]].astype(np.int32)
    grouped = distinct > 0 and adapted_tokens >= group_min_tokens * distinct
    return BatchPlan(int(slot_ids.size), t_cols, distinct, adapted_tokens, grouped, order,
                     seg_starts, seg_slots)


def expand_cost_us(family: str, num_tokens: int, out_dim: int, t_cols: int,
                   num_segments: int, num_sms: int) -> float:
    """The modelled time of a grouped decode batch's expand through `family`: "sgmv" (64 x 64
    output tiles over the tokens sorted by slot, each tile walking its segments) or "bgmv" (a
    CTA per token and 1024 outputs, B read once per token). The larger of its streaming
    (waves of resident CTAs, each its passes and metadata round trips) and its L2 traffic at
    L2 bandwidth: the per-token expand re-reads B per token, which L2 must serve."""
    vecs = -(-t_cols // VECTOR)
    if family == "sgmv":
        tiles = -(-num_tokens // SGMV_TILE)
        ctas = -(-out_dim // SGMV_TILE) * tiles
        per_tile = -(-num_segments // tiles) + 1  # segments meeting a tile, at most
        passes = per_tile * -(-t_cols // SGMV_TILE) + 1
        chains = 2 * per_tile + max(1, num_segments).bit_length()
        kernel = "sgmv_expand_bf16"
        l2 = 2 * out_dim * t_cols * (num_segments + tiles) + 4 * t_cols * num_tokens * (
            -(-out_dim // SGMV_TILE))
    elif family == "bgmv":
        ctas = num_tokens * -(-out_dim // (THREADS * EXPAND_ROWS))
        passes, chains, kernel = -(-vecs // 2), 3, "bgmv_expand_bf16"
        l2 = 2 * out_dim * t_cols * num_tokens
    else:
        raise ValueError(f"unknown expand family {family!r}")
    resident = min(max(ctas, 1), num_sms * min_ctas_per_sm(kernel))
    waves = -(-max(ctas, 1) // resident)
    stream = waves * (passes * _DRAM_LATENCY_US + chains * _L2_LATENCY_US)
    return max(stream, l2 / _L2_BYTES_PER_US)


def grouped_expand(num_tokens: int, out_dim: int, t_cols: int, num_segments: int,
                   num_sms: int) -> bool:
    """Whether a grouped decode batch expands through SGMV too (else per token), whichever is
    modelled cheaper (expand_cost_us): SGMV reads each adapter's B once per 64-token tile but a
    narrow output (k_proj, v_proj) over a few token tiles leaves most SMs idle; the per-token
    expand fills the device but reads B once per token from L2."""
    return (expand_cost_us("sgmv", num_tokens, out_dim, t_cols, num_segments, num_sms)
            <= expand_cost_us("bgmv", num_tokens, out_dim, t_cols, num_segments, num_sms))


# --- backends: CuPy on a GPU, the host harness on a CPU ----------------------------------------


class Backend(Protocol):
    """Where launches run: CuPy here, the host harness in host_harness.py."""

    def launch(self, plan: KernelLaunch) -> None: ...

    def new_t(self, like: Any, shape: tuple[int, ...]) -> Any: ...

    def zero(self, t: Any) -> None: ...

    def array(self, like: Any, values: np.ndarray) -> Any: ...

    def num_sms(self, requested: int | None) -> int: ...


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


class CupyBackend:
    """Launches on the current CUDA device through CuPy."""

    def launch(self, plan: KernelLaunch) -> None:
        launch(plan)

    def new_t(self, like: Any, shape: tuple[int, ...]) -> Any:
        cupy = compat.cupy_module()
        return cupy.empty(shape, dtype=cupy.float32)

    def zero(self, t: Any) -> None:
        t.fill(0)  # a memset on the current stream, before the split-K shrink adds into t

    def array(self, like: Any, values: np.ndarray) -> Any:
        return compat.cupy_module().asarray(values)

    def num_sms(self, requested: int | None) -> int:
        if requested is not None:
            return requested
        cupy = compat.cupy_module()
        return device_sm_count(cupy.cuda.Device().id)


CUPY = CupyBackend()


def _shrink_t(backend: Backend, kind: str, x: Any, t: Any | None, t_cols: int,
              splits: int | None, num_sms: int | None, slices: int = 1) -> tuple[Any, int]:
    """(t, splits) for a shrink of x: t F32 [T, t_cols] (allocated when not given; [S, T,
    t_cols] for S fused slices), split as the planner splits it (over all the slices' CTAs)
    unless `splits` says; zeroed when split, as the atomics add into it."""
    num_tokens, in_dim = (int(d) for d in x.shape)
    if t is not None:
        t_cols = int(t.shape[-1])
    if splits is None:
        splits = shrink_splits(kind, slices * num_tokens, in_dim, t_cols,
                               backend.num_sms(num_sms))
    if t is None:
        t = backend.new_t(x, (num_tokens, t_cols) if slices == 1 else
                          (slices, num_tokens, t_cols))
    if splits > 1:
        backend.zero(t)
    return t, splits


def bgmv_shrink(
    x: Any, slots: Any, a_table: Any, ranks: Any, max_rank: int, t: Any | None = None,
    *, splits: int | None = None, num_sms: int | None = None, batch: BatchPlan | None = None,
    backend: Backend = CUPY,
) -> Any:
    """Decode shrink. x BF16 (uint16) [T, in_dim]; slots i32 [T]; a_table u64, ranks i32
    [max_loras]. Returns t F32 [T, t_cols] (allocated when not given), t_cols being max_rank,
    or the batch's widest rank when its `batch` plan is given. `splits`: the K splits (default:
    the planner's, shrink_splits); a split shrink zeroes t first."""
    t, splits = _shrink_t(backend, "bgmv", x, t, batch.t_cols if batch else max_rank, splits,
                          num_sms)
    backend.launch(plan_bgmv_shrink(x, slots, a_table, ranks, t, max_rank, splits))
    return t


def bgmv_expand(
    t: Any, slots: Any, b_table: Any, scale_table: Any, ranks: Any, y: Any, max_rank: int,
    *, backend: Backend = CUPY,
) -> Any:
    """Decode expand: y (BF16 as uint16, or F32) [T, out_dim] += ...; returns y. B rows are
    the pool's max_rank long (t may be narrower: the batch's widest rank)."""
    backend.launch(plan_bgmv_expand(t, slots, b_table, scale_table, ranks, y, max_rank))
    return y


def sgmv_shrink(
    x: Any, seg_starts: Any, seg_slots: Any, a_table: Any, ranks: Any, max_rank: int,
    t: Any | None = None, *, splits: int | None = None, num_sms: int | None = None,
    t_cols: int | None = None, token_order: Any | None = None, backend: Backend = CUPY,
) -> Any:
    """Prefill shrink over segments (seg_starts i32 [S+1], seg_slots i32 [S]). Returns t F32
    [T, t_cols] (allocated when not given; t_cols defaults to max_rank); `splits` as in
    bgmv_shrink."""
    t, splits = _shrink_t(backend, "sgmv", x, t, t_cols or max_rank, splits, num_sms)
    backend.launch(plan_sgmv_shrink(x, seg_starts, seg_slots, a_table, ranks, t, max_rank,
                                    token_order, splits))
    return t


def sgmv_expand(
    t: Any, seg_starts: Any, seg_slots: Any, b_table: Any, scale_table: Any, ranks: Any, y: Any,
    max_rank: int, *, token_order: Any | None = None, backend: Backend = CUPY,
) -> Any:
    """Prefill expand: y (BF16 as uint16, or F32) [T, out_dim] += ...; returns y."""
    backend.launch(plan_sgmv_expand(t, seg_starts, seg_slots, b_table, scale_table, ranks, y,
                                    max_rank, token_order))
    return y


def bgmv(
    x: Any, y: Any, slots: Any, a_table: Any, b_table: Any, scale_table: Any, ranks: Any,
    max_rank: int, *, num_sms: int | None = None, batch: BatchPlan | None = None,
    backend: Backend = CUPY,
) -> Any:
    """The whole decode LoRA delta for one entry: y += scale * (x @ A^T) @ B^T per token.

    With the batch's `batch` plan (plan_batch), t and the grids cover only the ranks present,
    and a batch whose tokens share few slots takes the grouped path (SGMV over the tokens
    sorted by slot); without it, the per-token path over max_rank."""
    if batch is not None and batch.grouped:
        order, starts, seg_slots = (backend.array(x, a)
                                    for a in (batch.order, batch.seg_starts, batch.seg_slots))
        t = sgmv_shrink(x, starts, seg_slots, a_table, ranks, max_rank, num_sms=num_sms,
                        t_cols=batch.t_cols, token_order=order, backend=backend)
        # t is in token order either way, so the expand may take the per-token path.
        if grouped_expand(batch.num_tokens, int(y.shape[1]), batch.t_cols,
                          int(batch.seg_slots.size), backend.num_sms(num_sms)):
            return sgmv_expand(t, starts, seg_slots, b_table, scale_table, ranks, y, max_rank,
                               token_order=order, backend=backend)
        return bgmv_expand(t, slots, b_table, scale_table, ranks, y, max_rank, backend=backend)
    t = bgmv_shrink(x, slots, a_table, ranks, max_rank, num_sms=num_sms, batch=batch,
                    backend=backend)
    return bgmv_expand(t, slots, b_table, scale_table, ranks, y, max_rank, backend=backend)


def bgmv_fused(
    x: Any, y: Any, slice_cols: Sequence[int], slots: Any, a_tables: Any, b_tables: Any,
    scale_table: Any, ranks: Any, max_rank: int, *, num_sms: int | None = None,
    batch: BatchPlan | None = None, backend: Backend = CUPY,
) -> Any:
    """The decode LoRA delta of a layer's projections that share x (q, k and v; gate and up)
    in one shrink and one expand launch, as vLLM fuses its qkv and gate_up slices: y [T,
    slice_cols[-1]] holds the slices side by side (slice z in columns slice_cols[z] up to
    slice_cols[z + 1]), a_tables and b_tables are u64 [S, max_loras], one row per slice's
    (layer, module) entry. At decode sizes each launch costs a fixed floor, so S slices save
    2 (S - 1) of them. A grouped batch (`batch.grouped`) runs each slice through `bgmv`, on the
    SGMV kernels, which do not fuse."""
    slices = int(a_tables.shape[0])
    cols = check_slice_cols(slice_cols, slices, int(y.shape[1]))
    if batch is not None and batch.grouped:
        for z in range(slices):
            bgmv(x, y[:, cols[z]:cols[z + 1]], slots, a_tables[z], b_tables[z], scale_table,
                 ranks, max_rank, num_sms=num_sms, batch=batch, backend=backend)
        return y
    t, splits = _shrink_t(backend, "bgmv", x, None, batch.t_cols if batch else max_rank, None,
                          num_sms, slices)
    backend.launch(plan_bgmv_shrink(x, slots, a_tables, ranks, t, max_rank, splits))
    bounds = backend.array(x, np.asarray(cols, dtype=np.int32))
    backend.launch(plan_bgmv_expand(t, slots, b_tables, scale_table, ranks, y, max_rank,
                                    bounds))
    return y


def sgmv(
    x: Any, y: Any, seg_starts: Any, seg_slots: Any, a_table: Any, b_table: Any,
    scale_table: Any, ranks: Any, max_rank: int, *, num_sms: int | None = None,
    t_cols: int | None = None, backend: Backend = CUPY,
) -> Any:
    """The whole prefill LoRA delta for one entry over segments of tokens sharing a slot;
    `t_cols` (the widest rank of the batch, a multiple of 8) narrows t and the shrink grid."""
    t = sgmv_shrink(x, seg_starts, seg_slots, a_table, ranks, max_rank, num_sms=num_sms,
                    t_cols=t_cols, backend=backend)
    return sgmv_expand(t, seg_starts, seg_slots, b_table, scale_table, ranks, y, max_rank,
                       backend=backend)
