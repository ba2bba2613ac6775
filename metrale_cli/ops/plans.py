"""Launch planning for the CUDA kernels: for each kernel, from its buffers, the grid, block and
argument tuple that CuPy's RawKernel call and the host harness both take (`plan_*`), the
checks every buffer gets before a launch, and the batch plan of a decode batch (`plan_batch`).
The choices a plan makes by modelled cost (split counts, output tiles per CTA, the grouped
expand's path) are costs.py's.

All of it is plain Python over array shapes and addresses (NumPy, torch or CuPy arrays), so the
CPU tests run exactly the grid, block and arguments that a GPU gets. The launchers
(kernels.py, expert_kernels.py) run these plans on a backend.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from metrale_cli.ops.costs import MAX_OUT_TILES, PARTIAL_FLOATS, k_chunk
from metrale_cli.ops.sources import (
    EXPAND_ROWS,
    MAX_RANK,
    MAX_SPLITS,
    SGMV_TILE,
    SHRINK_ROWS,
    THREADS,
    VECTOR,
)

# A decode batch takes the grouped (segment plan) path when its adapted tokens average at least
# this many per distinct slot: each adapter's weights are then read once per chunk of up to 64
# tokens rather than once per token, which outweighs the mma a chunk's CTA spends on its rows.
GROUP_MIN_TOKENS = 4

# CUDA's grid limits: x up to 2^31 - 1, y and z up to 65,535 (cudaDevAttrMaxGridDimY/Z on every
# device since sm_30). A launch past them fails on the GPU while the host harness would run it.
MAX_GRID = (2**31 - 1, 65_535, 65_535)

# The SGMV expand keeps each thread's t rows as unsigned 32-bit element offsets into a slice's
# plane (kernels/sgmv.cu: 64-bit pointers would spill the F32 expand's registers), so a plane
# holds fewer than 2^32 elements: T x t_cols below this.
SGMV_EXPAND_T_OFFSETS = 2**32


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
                    f"{axis}; split the batch (SGMV: at most {MAX_GRID[1]:,} chunks per "
                    f"launch, a segment taking one per {SGMV_TILE} tokens)")


def dtype_name(array: Any) -> str:
    return str(array.dtype).removeprefix("torch.")


def address(array: Any) -> int:
    if hasattr(array, "data_ptr"):  # torch
        return int(array.data_ptr())
    if hasattr(array, "data") and hasattr(array.data, "ptr"):  # cupy
        return int(array.data.ptr)
    return int(array.ctypes.data)  # numpy


def element_strides(array: Any) -> tuple[int, ...]:
    """Strides in elements."""
    if callable(getattr(array, "stride", None)):  # torch
        return tuple(array.stride())
    return tuple(s // array.itemsize for s in array.strides)


def host_values(array: Any) -> np.ndarray:
    """A NumPy copy (or view) of a NumPy, torch or CuPy array."""
    if hasattr(array, "get") and not isinstance(array, np.ndarray):  # cupy
        return np.asarray(array.get())
    if hasattr(array, "numpy"):  # torch
        return array.detach().cpu().numpy()
    return np.asarray(array)


def _dense(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether an array of `shape` with `strides` (elements) is C-contiguous; dims of size 1
    take any stride, as no index ever steps along them, and so does an empty array (NumPy and
    torch give one of T = 0 rows strides of their own), which no index reads at all."""
    if 0 in shape:
        return True
    expected = 1
    for size, stride in zip(reversed(shape), reversed(strides), strict=True):
        if size > 1 and stride != expected:
            return False
        expected *= size
    return True


def check_buffer(array: Any, what: str, dtypes: Sequence[str], shape: Sequence[int | None],
           *, rows: bool = False) -> None:
    """dtype, shape, layout and alignment of a buffer a kernel reads or writes. The kernels
    index every buffer as a dense row-major array, except those passed with their own row
    stride (`rows`: x, y, logits, emb), which need only contiguous rows."""
    name = dtype_name(array)
    if name not in dtypes:
        raise ValueError(f"{what} must be {' or '.join(dtypes)}, got {name}")
    actual = tuple(array.shape)
    if len(actual) != len(shape) or any(
        want is not None and want != got for want, got in zip(shape, actual, strict=False)
    ):
        wanted = tuple("?" if s is None else s for s in shape)
        raise ValueError(f"{what} must have shape {wanted}, got {actual}")
    strides = element_strides(array)
    if rows and actual and actual[-1] > 1 and strides[-1] != 1:
        raise ValueError(f"{what} must be contiguous along its last dimension")
    if not rows and not _dense(actual, strides):
        raise ValueError(f"{what} must be contiguous (the kernels index it as a dense array); "
                         f"got strides {strides} for shape {actual}")
    if address(array) % 16:
        raise ValueError(f"{what} must start at a 16-byte aligned address")


def row_stride(array: Any, what: str) -> int:
    stride = element_strides(array)[0]
    if stride % VECTOR:
        raise ValueError(f"{what} row stride ({stride} elements) must be a multiple of {VECTOR}")
    rows, width = int(array.shape[0]), int(array.shape[-1])
    if rows > 1 and stride < width:
        raise ValueError(f"{what}'s rows overlap (row stride {stride} < width {width})")
    return stride


BF16 = ("uint16", "bfloat16")
_TABLES = ("uint64", "int64")


def check_table_alignment(table: Any, what: str) -> None:
    """Every weight address in a pointer table is 0 (no weights) or 16-byte aligned.

    The kernels read weights with 128-bit loads: on a GPU a misaligned one faults and poisons
    the CUDA context, while the host build would split it and pass. A CuPy table is copied to
    the host for this (max_loras x 8 bytes)."""
    addresses = host_values(table).view(np.uint64).ravel()
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
        shape = (max_loras,) if len(table.shape) == 1 else (slices, max_loras)
        check_buffer(table, what, _TABLES, shape)
        check_table_alignment(table, what)
    check_buffer(ranks, "ranks", ("int32",), (max_loras,))
    if scale_table is not None:
        check_buffer(scale_table, "scale_table", ("float32",), (max_loras,))


def check_max_rank(max_rank: int) -> int:
    """The pool's max rank as the kernels take it: a multiple of VECTOR in 1..MAX_RANK."""
    if not 0 < max_rank <= MAX_RANK or max_rank % VECTOR:
        raise ValueError(f"max_rank must be a multiple of {VECTOR} in {VECTOR}..{MAX_RANK}, "
                         f"got {max_rank}")
    return int(max_rank)


def _check_dims(in_or_out: int, max_rank: int, t_cols: int, what: str) -> None:
    check_max_rank(max_rank)
    if in_or_out % VECTOR or t_cols % VECTOR:
        raise ValueError(
            f"{what} ({in_or_out}) and t's width ({t_cols}) must be multiples of {VECTOR}"
        )
    if not 0 < t_cols <= max_rank:
        raise ValueError(f"t's width ({t_cols}) must be in 1..max_rank ({max_rank})")


def launch_grid(kernel: str, rows: int, dim: int, t_cols: int, splits: int = 1,
                out_tiles: int = 1, slices: int = 1) -> tuple[int, int, int]:
    """The grid of `kernel` (a KERNEL_SOURCES name) over `rows` (BGMV: the T tokens; SGMV: the
    chunks of segment_chunks), its output dim (expand: the widest slice's) or input dim
    (shrink: unused), t's width, the shrink's split count, the SGMV expand's 64-output tiles
    per CTA and the fused slices: on grid.z, except in the SGMV shrink, whose 64-column tiles
    run over the slices' rank columns side by side (kernels/sgmv.cu)."""
    if kernel == "bgmv_shrink":
        return (rows, -(-t_cols // SHRINK_ROWS), slices * splits)
    if kernel.startswith("bgmv_expand"):
        return (rows, -(-dim // (THREADS * EXPAND_ROWS)), slices)
    if kernel == "sgmv_shrink":
        return (-(-slices * t_cols // SGMV_TILE), rows, splits)
    if kernel.startswith("sgmv_expand"):
        tiles = -(-dim // SGMV_TILE)
        return (-(-tiles // out_tiles), rows, slices)
    raise ValueError(f"unknown kernel {kernel!r}")




def split_workspace(kernel: str, grid: tuple[int, int, int], splits: int) -> tuple[int, int]:
    """(partial floats, tickets) that a split-K `kernel` ("bgmv_shrink" or "sgmv_shrink") of
    this grid (launch_grid's) needs in its workspace: one partial tile per split and output
    tile, one ticket counter per output tile (kernels/lora_common.cuh, split_last)."""
    gx, gy, gz = grid
    tiles = gx * gy * (gz // splits if kernel == "bgmv_shrink" else 1)
    return splits * tiles * PARTIAL_FLOATS[kernel], tiles


def _workspace_args(kernel: str, grid: tuple[int, int, int], splits: int,
                    workspace: tuple[Any, Any] | None) -> tuple[Any, Any]:
    """The kernel's (partials, tickets) arguments: null pointers for one split, else the
    workspace's buffers, F32 and u32, dense and at least split_workspace's sizes."""
    if splits == 1:
        return np.uint64(0), np.uint64(0)
    if workspace is None:
        raise ValueError(f"a split-K {kernel} needs a workspace (partials, tickets)")
    needs = split_workspace(kernel, grid, splits)
    for buffer, what, dtype, need in zip(workspace, ("partials", "tickets"),
                                         ("float32", "uint32"), needs, strict=True):
        check_buffer(buffer, what, (dtype,), (None,))
        if int(buffer.shape[0]) < need:
            raise ValueError(f"the split-K workspace's {what} hold {int(buffer.shape[0])} "
                             f"elements; this launch needs {need}")
    return workspace



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


def check_splits(splits: int) -> int:
    """The split-K count of a shrink launch, an int in 1..MAX_SPLITS."""
    if isinstance(splits, bool) or not isinstance(splits, int | np.integer):
        raise ValueError(f"splits must be an int in 1..{MAX_SPLITS}, got {splits!r}")
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"splits must be in 1..{MAX_SPLITS}, got {splits}")
    return int(splits)


def _order_arg(token_order: Any | None, num_tokens: int) -> Any:
    """The token order argument: a null pointer (identity order), or a permutation of the T
    token indices. The kernels index x and y rows with it, so a value outside [0, T) reads and
    writes out of bounds, and a repeated one has two CTAs write one row. A CuPy order is
    copied to the host for the check (T x 4 bytes)."""
    if token_order is None:
        return np.uint64(0)
    check_buffer(token_order, "token_order", ("int32",), (num_tokens,))
    order = host_values(token_order).astype(np.int64).ravel()
    if not np.array_equal(np.sort(order), np.arange(num_tokens)):
        outside = np.flatnonzero((order < 0) | (order >= num_tokens))
        what = (f"token_order[{int(outside[0])}] = {int(order[outside[0]])} is outside "
                f"[0, {num_tokens})" if outside.size else "token_order repeats a token")
        raise ValueError(f"{what}: it must be a permutation of the {num_tokens} token indices")
    return token_order


def _slices(table: Any, t: Any, what: str) -> tuple[int, int, Any]:
    """(slices, max_loras, t as one plane's shape) of a launch: one (layer, module) entry
    (`what` u64 [max_loras], t F32 [T, t_cols]) or fused slices sharing x (`what` u64
    [S, max_loras], t F32 [S, T, t_cols])."""
    if len(table.shape) == 1:
        return 1, int(table.shape[0]), t
    if len(table.shape) != 2 or len(t.shape) != 3 or int(t.shape[0]) != int(table.shape[0]):
        raise ValueError(f"fused slices take {what} [S, max_loras] and t [S, T, t_cols]; got "
                         f"{what} {tuple(table.shape)} and t {tuple(t.shape)}")
    return int(table.shape[0]), int(table.shape[1]), t[0]


def _check_shrink(x: Any, a_table: Any, ranks: Any, t: Any, max_rank: int,
                  splits: int) -> tuple[int, int, int, int, int, int, int]:
    """(slices, max_loras, T, t_cols, max_rank, in_dim, splits) of a shrink launch, after the
    checks both shrinks' buffers get: x BF16 [T, in_dim] by rows, t F32 ([S,] T, t_cols), the
    A tables and ranks, the dims and the split count."""
    slices, max_loras, plane = _slices(a_table, t, "a_table")
    num_tokens, t_cols, max_rank = _t_shape(plane, max_rank)
    in_dim = int(x.shape[1])
    check_buffer(x, "x", BF16, (num_tokens, in_dim), rows=True)
    check_buffer(t, "t", ("float32",), tuple(t.shape[:-2]) + (num_tokens, t_cols))
    _check_tables(max_loras, ranks, None, {"a_table": a_table}, slices)
    _check_dims(in_dim, max_rank, t_cols, "in_dim")
    return slices, max_loras, num_tokens, t_cols, max_rank, in_dim, check_splits(splits)


def plan_bgmv_shrink(
    x: Any, slots: Any, a_table: Any, ranks: Any, t: Any, max_rank: int, splits: int = 1,
    workspace: tuple[Any, Any] | None = None,
) -> KernelLaunch:
    """t[b, :] = x[b] @ A_slot[b]^T (see kernels/bgmv.cu), K cut into `splits` whose partials
    the last split's CTA sums in order through `workspace` (partials, tickets: split_workspace's
    sizes at least; the tickets zero, as the kernel leaves them). t's width may be below
    max_rank (the batch's widest rank): the grid covers only it. With a_table [S, max_loras] and t
    [S, T, t_cols], the S slices that share x (q, k, v) are one launch."""
    slices, max_loras, num_tokens, t_cols, max_rank, in_dim, num_splits = _check_shrink(
        x, a_table, ranks, t, max_rank, splits)
    check_buffer(slots, "slots", ("int32",), (num_tokens,))
    grid = launch_grid("bgmv_shrink", num_tokens, in_dim, t_cols, num_splits, slices=slices)
    args = (
        x, np.int64(row_stride(x, "x")), slots, a_table, ranks, np.int32(max_loras),
        t, np.int32(num_tokens), np.int32(in_dim), np.int32(max_rank), np.int32(t_cols),
        np.int32(k_chunk(in_dim, num_splits, VECTOR)), np.int32(slices),
        *_workspace_args("bgmv_shrink", grid, num_splits, workspace),
    )
    return KernelLaunch("bgmv_shrink", grid, (THREADS, 1, 1), args)


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
    y_kind = "bf16" if dtype_name(y) in BF16 else "f32"
    check_buffer(t, "t", ("float32",), tuple(t.shape[:-2]) + (num_tokens, t_cols))
    check_buffer(slots, "slots", ("int32",), (num_tokens,))
    out_dim, cols_arg = _expand_columns(y, num_tokens, slices, slice_cols)
    _check_tables(max_loras, ranks, scale_table, {"b_table": b_table}, slices)
    _check_dims(out_dim, max_rank, t_cols, "out_dim")
    grid = launch_grid(f"bgmv_expand_{y_kind}", num_tokens, out_dim, t_cols, slices=slices)
    args = (
        t, slots, b_table, scale_table, ranks, np.int32(max_loras),
        y, np.int64(row_stride(y, "y")), np.int32(num_tokens), np.int32(out_dim),
        np.int32(max_rank), np.int32(t_cols), cols_arg,
    )
    return KernelLaunch(f"bgmv_expand_{y_kind}", grid, (THREADS, 1, 1), args)


def _expand_columns(y: Any, num_tokens: int, slices: int, slice_cols: Any | None
                    ) -> tuple[int, Any]:
    """(the widest slice's width, the kernel's slice_cols argument) of an expand into y: one
    slice takes all of y (a null slice_cols); fused slices need their column bounds."""
    check_buffer(y, "y", (*BF16, "float32"), (num_tokens, int(y.shape[1])), rows=True)
    if slice_cols is None:
        if slices > 1:
            raise ValueError("fused slices need slice_cols, their column bounds in y")
        return int(y.shape[1]), np.uint64(0)  # a null pointer: all of y
    check_buffer(slice_cols, "slice_cols", ("int32",), (slices + 1,))
    cols = check_slice_cols(host_values(slice_cols).tolist(), slices, int(y.shape[1]))
    return max(b - a for a, b in zip(cols, cols[1:], strict=False)), slice_cols


def check_segments(seg_starts: Any, seg_slots: Any, num_tokens: int) -> tuple[np.ndarray,
                                                                               np.ndarray]:
    """The segments as host arrays (starts int64 [S + 1], slots int64 [S]), after checking what
    segment_chunks assumes of them: starts non-decreasing, within [0, T], the last one T (starts
    that go backwards would give rows to the wrong slot). CuPy segments are copied to the host
    for this ((2 S + 1) x 4 bytes)."""
    num_segments = int(seg_slots.shape[0])
    check_buffer(seg_slots, "seg_slots", ("int32",), (num_segments,))
    check_buffer(seg_starts, "seg_starts", ("int32",), (num_segments + 1,))
    starts = host_values(seg_starts).astype(np.int64).ravel()
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
    return starts, host_values(seg_slots).astype(np.int64).ravel()


def segment_chunks(seg_starts: Any, seg_slots: Any, num_tokens: int) -> np.ndarray:
    """The SGMV kernels' work list, int32 [C, 4]: each segment cut into chunks of at most
    SGMV_TILE consecutive positions, one row (begin, end, slot, 0) per chunk, in segment order;
    the positions before the first segment (the only ones outside every segment) as chunks of
    slot -1, so that the shrink still writes their t rows; empty segments have none. Each chunk
    is one CTA row of the grid: no CTA walks segments, and a CTA learns its rows and slot from
    one 16-byte load. Built on the host in O(S) array operations from the checked segments
    (check_segments, which already copies them there); work_list checks it there and moves it
    to the device once for every launch over the same segments (a BatchPlan keeps that)."""
    starts, slots = check_segments(seg_starts, seg_slots, num_tokens)
    begins = np.concatenate(([0], starts[:-1]))
    ends = starts
    owners = np.concatenate(([-1], slots))
    counts = -(-(ends - begins) // SGMV_TILE)
    chunk_of = np.repeat(np.arange(begins.size), counts)
    first = np.cumsum(counts) - counts
    chunk_begin = begins[chunk_of] + SGMV_TILE * (np.arange(chunk_of.size) - first[chunk_of])
    chunks = np.zeros((chunk_of.size, 4), dtype=np.int32)
    chunks[:, 0] = chunk_begin
    chunks[:, 1] = np.minimum(chunk_begin + SGMV_TILE, ends[chunk_of])
    chunks[:, 2] = owners[chunk_of]
    return chunks


def check_chunks(chunks: Any, num_tokens: int) -> int:
    """The chunk count of an SGMV work list (segment_chunks' int32 [C, 4]), after checking what
    the kernels index with it: 0 <= begin < end <= min(begin + 64, T), and the chunks covering
    every position once, in order (the first from 0, each starting where the one before ends,
    the last ending at T): the shrink writes t only where a chunk is, so a gap would leave t
    rows unwritten for the expand to read. A CuPy list is copied to the host for this (C x 16
    bytes)."""
    count = int(chunks.shape[0]) if len(chunks.shape) == 2 else -1
    check_buffer(chunks, "chunks", ("int32",), (count, 4))
    rows = host_values(chunks).astype(np.int64).reshape(count, 4)
    begin, end = rows[:, 0], rows[:, 1]
    bad = np.flatnonzero((begin < 0) | (end <= begin) | (end > np.minimum(begin + SGMV_TILE,
                                                                            num_tokens)))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"chunks[{i}] = positions [{int(begin[i])}, {int(end[i])}) is not 1 to "
                         f"{SGMV_TILE} positions within [0, {num_tokens})")
    # Each chunk is one CTA row writing its positions' t and y rows without atomics: two
    # chunks over one position would race on a GPU.
    overlap = np.flatnonzero(begin[1:] < end[:-1])
    if overlap.size:
        i = int(overlap[0])
        raise ValueError(f"chunks[{i + 1}] starts at position {int(begin[i + 1])}, before "
                         f"chunks[{i}] ends at {int(end[i])}: chunks must be in order and must "
                         "not overlap (two CTAs would write the same rows)")
    gap = np.flatnonzero(begin[1:] > end[:-1])
    if gap.size:
        i = int(gap[0])
        raise ValueError(f"chunks[{i + 1}] starts at position {int(begin[i + 1])}, after "
                         f"chunks[{i}] ends at {int(end[i])}: positions {int(end[i])} to "
                         f"{int(begin[i + 1]) - 1} are in no chunk, and their t rows would "
                         "never be written; the chunks must cover every position once")
    first, last = (int(begin[0]), int(end[-1])) if count else (0, 0)
    if first != 0 or last != num_tokens:
        raise ValueError(f"the chunks cover positions [{first}, {last}) of [0, {num_tokens}): "
                         "they must cover every position once (t rows outside them would "
                         "never be written)")
    return count


@dataclass(frozen=True)
class WorkList:
    """An SGMV work list and its token order where the kernels read them (`chunks`, `order`:
    device arrays on a GPU; None for the identity order), checked on the host once, when made
    (work_list). plan_sgmv_* take it as it is: a raw `chunks` array (and `token_order`) is
    copied back to the host and checked at every launch, a synchronising transfer that also
    rules out capturing the launches in a CUDA graph."""

    chunks: Any
    order: Any | None
    num_tokens: int
    count: int


def work_list(chunks: np.ndarray, order: np.ndarray | None, num_tokens: int,
              place: Callable[[np.ndarray], Any]) -> WorkList:
    """The WorkList of host arrays `chunks` (segment_chunks) and `order` (a permutation of the
    num_tokens token indices, or None), checked here, where they are (check_chunks,
    _order_arg), then moved by `place` to where the kernels read them."""
    count = check_chunks(chunks, num_tokens)
    if order is not None:
        _order_arg(order, num_tokens)
    return WorkList(place(chunks), None if order is None else place(order), num_tokens, count)


def chunk_count(chunks: Any) -> int:
    """The chunks of a work list: a WorkList, or a raw int32 [C, 4] array."""
    return chunks.count if isinstance(chunks, WorkList) else int(chunks.shape[0])


def _work_args(chunks: Any, token_order: Any | None, num_tokens: int) -> tuple[Any, Any, int]:
    """(chunks, token order argument, chunk count) of an SGMV launch: a WorkList as checked
    when it was made (its shape and dtype only, which reads no element), or a raw work list and
    order, checked now (check_chunks, _order_arg: each a copy to the host)."""
    if not isinstance(chunks, WorkList):
        count = check_chunks(chunks, num_tokens)
        return chunks, _order_arg(token_order, num_tokens), count
    if token_order is not None:
        raise ValueError("a WorkList carries its token order: give no token_order beside it")
    if chunks.num_tokens != num_tokens:
        raise ValueError(f"the work list was checked for {chunks.num_tokens} tokens, the launch "
                         f"has {num_tokens}")
    check_buffer(chunks.chunks, "chunks", ("int32",), (chunks.count, 4))
    if chunks.order is None:
        return chunks.chunks, np.uint64(0), chunks.count
    check_buffer(chunks.order, "token_order", ("int32",), (num_tokens,))
    return chunks.chunks, chunks.order, chunks.count


def plan_sgmv_shrink(
    x: Any, chunks: Any, a_table: Any, ranks: Any, t: Any, max_rank: int,
    token_order: Any | None = None, splits: int = 1, workspace: tuple[Any, Any] | None = None,
) -> KernelLaunch:
    """t[b, :] = x[b] @ A_seg^T (see kernels/sgmv.cu) over the work list `chunks`
    (segment_chunks where the kernel reads it, or a WorkList with its order), K cut into
    `splits` reduced through `workspace` as in plan_bgmv_shrink. With `token_order`, the
    chunks index sorted positions (the grouped decode path). Fused slices as in
    plan_bgmv_shrink (a_table [S, max_loras], t [S, T, t_cols]): the CTAs' 64-column tiles run
    over the slices' rank columns side by side."""
    slices, max_loras, num_tokens, t_cols, max_rank, in_dim, num_splits = _check_shrink(
        x, a_table, ranks, t, max_rank, splits)
    chunks, order_arg, num_chunks = _work_args(chunks, token_order, num_tokens)
    grid = launch_grid("sgmv_shrink", num_chunks, in_dim, t_cols, num_splits, slices=slices)
    args = (
        x, np.int64(row_stride(x, "x")), chunks, order_arg, a_table,
        ranks, np.int32(max_loras), t, np.int32(num_tokens), np.int32(in_dim),
        np.int32(max_rank), np.int32(t_cols), np.int32(k_chunk(in_dim, num_splits, SGMV_TILE)),
        np.int32(slices), *_workspace_args("sgmv_shrink", grid, num_splits, workspace),
    )
    return KernelLaunch("sgmv_shrink", grid, (THREADS, 1, 1), args)


def plan_sgmv_expand(
    t: Any, chunks: Any, b_table: Any, scale_table: Any, ranks: Any, y: Any, max_rank: int,
    token_order: Any | None = None, out_tiles: int = 1, slice_cols: Any | None = None,
) -> KernelLaunch:
    """y[b] += scale * t[b] @ B_seg^T (see kernels/sgmv.cu) over the work list `chunks`, each
    CTA `out_tiles` 64-output tiles of one chunk (expand_out_tiles picks it); B rows are the
    pool's max_rank long. Fused slices as in plan_bgmv_expand (b_table [S, max_loras], t
    [S, T, t_cols], `slice_cols`), on grid.z."""
    slices, max_loras, plane = _slices(b_table, t, "b_table")
    num_tokens, t_cols, max_rank = _t_shape(plane, max_rank)
    if num_tokens * t_cols >= SGMV_EXPAND_T_OFFSETS:
        raise ValueError(
            f"sgmv_expand keeps t offsets (token x t_cols) in 32 bits: {num_tokens:,} tokens x "
            f"{t_cols} columns is {num_tokens * t_cols:,}, past {SGMV_EXPAND_T_OFFSETS:,}; "
            "split the batch")
    chunks, order_arg, num_chunks = _work_args(chunks, token_order, num_tokens)
    y_kind = "bf16" if dtype_name(y) in BF16 else "f32"
    check_buffer(t, "t", ("float32",), tuple(t.shape[:-2]) + (num_tokens, t_cols))
    out_dim, cols_arg = _expand_columns(y, num_tokens, slices, slice_cols)
    _check_tables(max_loras, ranks, scale_table, {"b_table": b_table}, slices)
    _check_dims(out_dim, max_rank, t_cols, "out_dim")
    if not 1 <= out_tiles <= MAX_OUT_TILES:
        raise ValueError(f"out_tiles must be in 1..{MAX_OUT_TILES}, got {out_tiles}")
    grid = launch_grid(f"sgmv_expand_{y_kind}", num_chunks, out_dim, t_cols,
                       out_tiles=out_tiles, slices=slices)
    args = (
        t, chunks, order_arg, b_table, scale_table, ranks,
        np.int32(max_loras), y, np.int64(row_stride(y, "y")), np.int32(num_tokens),
        np.int32(out_dim), np.int32(max_rank), np.int32(t_cols), np.int32(out_tiles), cols_arg,
    )
    return KernelLaunch(f"sgmv_expand_{y_kind}", grid, (THREADS, 1, 1), args)


# --- the batch plan: what the host knows when it builds a batch --------------------------------


@dataclass(frozen=True)
class BatchPlan:
    """A decode batch as the host builds it (once per forward, reused by every layer):

    - `t_cols`: the widest rank among the batch's adapted tokens (rounded up to VECTOR), so
      grids and t cover the ranks present rather than the pool's max_rank;
    - a segment plan: `order` (int32 [T], token indices stably sorted by slot), segments over
      those sorted positions (`seg_starts` int32 [S + 1], `seg_slots` int32 [S]) and the SGMV
      work list over them (`chunks`, segment_chunks), built once for every layer's launches;
    - `grouped`: whether decode takes the grouped path (SGMV over the sorted tokens, each
      adapter's weights read once per chunk of up to 64 tokens) rather than the per-token path,
      chosen from the batch's distinct slots (GROUP_MIN_TOKENS);
    - the order and work list where the kernels read them (`placed`): moved and checked once
      per placement, kept with the plan, so a layer's launches upload and check nothing.
    """

    num_tokens: int
    t_cols: int
    distinct_slots: int
    adapted_tokens: int
    grouped: bool
    order: np.ndarray
    seg_starts: np.ndarray
    seg_slots: np.ndarray
    chunks: np.ndarray
    _placed: dict[Hashable, WorkList] = field(default_factory=dict, init=False, repr=False,
                                              compare=False)

    def placed(self, key: Hashable, place: Callable[[np.ndarray], Any]) -> WorkList:
        """The plan's order and work list where `place` moves host arrays (a backend's device,
        named by `key`): checked and moved on the first call for `key`, the same WorkList for
        every later one (every layer's and module's launches of the batch)."""
        found = self._placed.get(key)
        if found is None:
            found = work_list(self.chunks, self.order, self.num_tokens, place)
            self._placed[key] = found
        return found


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
                     seg_starts, seg_slots, segment_chunks(seg_starts, seg_slots, slot_ids.size))

