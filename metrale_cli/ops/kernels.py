"""The CUDA LoRA delta kernels' launchers (kernels/bgmv.cu, kernels/sgmv.cu) and the backends
they run on: CuPy arrays on the GPU by default, or the host harness's (`host_harness.HOST`).

Each launcher plans its launch with plans.py (the same grid, block and arguments on either
backend) and hands it to the backend. CuPy compiles each source once per process with its
RawModule (NVRTC; CuPy also keeps its own on-disk cache), keyed by a digest of the sources.
BF16 buffers are uint16 arrays of raw BF16 bits (CuPy has no bfloat16 dtype).

cupy is imported only inside functions, through compat.cupy_module().
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from metrale_cli import compat, env
from metrale_cli.ops.costs import expand_out_tiles, grouped_expand, shrink_splits
from metrale_cli.ops.plans import (
    BatchPlan,
    KernelLaunch,
    WorkList,
    check_slice_cols,
    check_splits,
    chunk_count,
    host_values,
    launch_grid,
    plan_bgmv_expand,
    plan_bgmv_shrink,
    plan_sgmv_expand,
    plan_sgmv_shrink,
    segment_chunks,
    split_workspace,
    work_list,
)
from metrale_cli.ops.sources import KERNEL_SOURCES, find_kernel_dir, read_source, sources_digest

# --- backends: CuPy on a GPU, the host harness on a CPU ----------------------------------------


class Backend(Protocol):
    """Where launches run: CuPy here, the host harness in host_harness.py."""

    def launch(self, plan: KernelLaunch) -> None: ...

    def new_t(self, like: Any, shape: tuple[int, ...]) -> Any: ...

    def workspace(self, like: Any, partials: int, tickets: int) -> tuple[Any, Any]: ...

    def capturing(self) -> bool: ...

    # Whether every split-K launch's ticket counters are checked afterwards (check_tickets),
    # as they are in debug mode (METRALE_DEBUG=1) on any backend.
    checks_tickets: bool

    def array(self, like: Any, values: np.ndarray) -> Any: ...

    def placement(self, like: Any) -> Hashable: ...

    def release_workspace(self) -> None: ...

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


class SplitWorkspaces:
    """Split-K's persistent workspaces, one per stream (`key`: a backend's (device, stream)):
    (partials F32, tickets u32) of at least a launch's sizes, kept and grown when too small. The
    tickets are zeroed only when allocated: every split-K launch leaves them zero (its last CTA
    per tile resets its counter), so no memset precedes a launch and a CUDA graph may capture
    one. Two streams never share one (their launches would draw each other's tickets and sum
    each other's partials). A capture bakes the workspace's addresses into its graph: inside
    one nothing may be allocated (warm the shapes up first), and a workspace a capture has used
    is never grown (growth would free memory the graph still writes) until `release`d."""

    def __init__(self, allocate: Callable[[int, int], tuple[Any, Any]]) -> None:
        self._allocate = allocate
        self._held: dict[Hashable, tuple[Any, Any]] = {}
        self._captured: set[Hashable] = set()

    def get(self, key: Hashable, partials: int, tickets: int, capturing: bool
            ) -> tuple[Any, Any]:
        """The workspace of stream `key` for a launch needing these sizes (`capturing`: the
        stream is being captured into a CUDA graph)."""
        held = self._held.get(key)
        if held is None or held[0].size < partials or held[1].size < tickets:
            if capturing:
                raise RuntimeError(
                    f"a split-K launch needs a workspace of {partials:,} partials and "
                    f"{tickets:,} tickets on stream {key}, which is being captured into a CUDA "
                    "graph, where nothing may be allocated: run the shape once before the "
                    "capture (warm it up) so that its workspace exists")
            if key in self._captured:
                raise RuntimeError(
                    f"the split-K workspace of stream {key} was captured into a CUDA graph, "
                    f"whose launches write its addresses: growing it to {partials:,} partials "
                    f"and {tickets:,} tickets would free memory the graph still writes; warm "
                    "the largest shape up before capturing, or release the workspace once the "
                    "graph is gone")
            floats = max(partials, held[0].size if held else 0)
            counters = max(tickets, held[1].size if held else 0)
            held = self._allocate(floats, counters)
            self._held[key] = held
        if capturing:
            self._captured.add(key)
        return held

    def release(self, key: Hashable) -> None:
        """Forget stream `key`'s workspace (one with stray counts, or one whose graphs are
        gone): its next split-K launch allocates a fresh one, counters zero."""
        self._held.pop(key, None)
        self._captured.discard(key)


def check_tickets(backend: Backend, kernel: str, workspace: tuple[Any, Any] | None) -> None:
    """After a split-K launch, where the backend checks them or in debug mode (METRALE_DEBUG=1)
    and never inside a graph capture (the check copies the counters to the host): every
    ticket counter is back at zero. A stray count would make a later launch's last CTA reduce
    before every split has stored, wrong rows in every later launch over that tile, so the
    workspace is released (the next launch gets fresh counters) and the launch refused."""
    if workspace is None or backend.capturing() or not (backend.checks_tickets or env.debug()):
        return
    counters = host_values(workspace[1]).ravel()
    stray = np.flatnonzero(counters)
    if stray.size:
        backend.release_workspace()
        tile = int(stray[0])
        raise RuntimeError(
            f"{kernel} left {stray.size} split-K ticket counter(s) non-zero (tile {tile}: "
            f"{int(counters[tile])}): a launch's splits did not draw exactly one ticket each "
            "(a stray count, or another launch on the same workspace); the workspace is "
            "released and this launch's t is not to be trusted")


class CupyBackend:
    """Launches on the current CUDA device through CuPy."""

    checks_tickets = False

    def launch(self, plan: KernelLaunch) -> None:
        """Launch a planned kernel on CuPy's current stream."""
        if 0 in plan.grid:
            return  # an empty batch: nothing to do, and a zero grid is an invalid launch
        get_kernel(plan.kernel)(plan.grid, plan.block, plan.args)

    def new_t(self, like: Any, shape: tuple[int, ...]) -> Any:
        cupy = compat.cupy_module()
        return cupy.empty(shape, dtype=cupy.float32)

    def __init__(self) -> None:
        self._workspaces = SplitWorkspaces(self._allocate)

    @staticmethod
    def _allocate(partials: int, tickets: int) -> tuple[Any, Any]:
        cupy = compat.cupy_module()
        return cupy.empty(partials, dtype=cupy.float32), cupy.zeros(tickets, dtype=cupy.uint32)

    def _stream(self) -> Hashable:
        cupy = compat.cupy_module()
        return (cupy.cuda.Device().id, cupy.cuda.get_current_stream().ptr)

    def workspace(self, like: Any, partials: int, tickets: int) -> tuple[Any, Any]:
        """Split-K's workspace of the current device and stream (SplitWorkspaces)."""
        return self._workspaces.get(self._stream(), partials, tickets, self.capturing())

    def release_workspace(self) -> None:
        """Free the current stream's split-K workspace (once the graphs that captured it are
        destroyed): its next split launch allocates afresh."""
        self._workspaces.release(self._stream())

    def capturing(self) -> bool:
        """Whether the current stream is being captured into a CUDA graph
        (cudaStreamIsCapturing)."""
        return bool(compat.cupy_module().cuda.get_current_stream().is_capturing())

    def array(self, like: Any, values: np.ndarray) -> Any:
        return compat.cupy_module().asarray(values)

    def placement(self, like: Any) -> Hashable:
        """Where `array` puts its arrays: the current device (a batch plan's copies are kept
        per device, so a plan used on two GPUs has a copy on each)."""
        return ("cupy", compat.cupy_module().cuda.Device().id)

    def num_sms(self, requested: int | None) -> int:
        if requested is not None:
            return requested
        cupy = compat.cupy_module()
        return device_sm_count(cupy.cuda.Device().id)


CUPY = CupyBackend()


def _shrink_t(backend: Backend, kind: str, x: Any, t: Any | None, t_cols: int,
              splits: int | None, num_sms: int | None, slices: int = 1,
              chunks: int | None = None) -> tuple[Any, int, tuple[Any, Any] | None]:
    """(t, splits, workspace) for a shrink of x: t F32 [T, t_cols] (allocated when not given;
    [S, T, t_cols] for S fused slices), split as the planner splits it (over all the slices'
    CTAs: BGMV's S x T token rows, SGMV's `chunks` x the slices' rank columns side by side)
    unless `splits` says; when split, the backend's split-K workspace (sized for the launch),
    through which the last split of each tile writes t: no memset of t."""
    num_tokens, in_dim = (int(d) for d in x.shape)
    if t is not None:
        t_cols = int(t.shape[-1])
    if splits is not None:
        splits = check_splits(splits)
    else:
        rows, columns = ((num_tokens, slices * t_cols) if kind == "sgmv"
                         else (slices * num_tokens, t_cols))
        splits = shrink_splits(kind, rows, in_dim, columns, backend.num_sms(num_sms), chunks)
    if t is None:
        t = backend.new_t(x, (num_tokens, t_cols) if slices == 1 else
                          (slices, num_tokens, t_cols))
    if splits == 1:
        return t, splits, None
    kernel = f"{kind}_shrink"
    grid = launch_grid(kernel, num_tokens if kind == "bgmv" else int(chunks or 0), in_dim,
                       t_cols, splits, slices=slices)
    return t, splits, backend.workspace(x, *split_workspace(kernel, grid, splits))


def _launch_shrink(backend: Backend, plan: KernelLaunch,
                   workspace: tuple[Any, Any] | None) -> None:
    """Launch a shrink, then check_tickets of its split-K workspace."""
    backend.launch(plan)
    check_tickets(backend, plan.kernel, workspace)


def bgmv_shrink(
    x: Any, slots: Any, a_table: Any, ranks: Any, max_rank: int, t: Any | None = None,
    *, splits: int | None = None, num_sms: int | None = None, batch: BatchPlan | None = None,
    backend: Backend = CUPY,
) -> Any:
    """Decode shrink. x BF16 (uint16) [T, in_dim]; slots i32 [T]; a_table u64, ranks i32
    [max_loras]. Returns t F32 [T, t_cols] (allocated when not given), t_cols being max_rank,
    or the batch's widest rank when its `batch` plan is given. `splits`: the K splits (default:
    the planner's, shrink_splits); a split shrink reduces through the backend's workspace."""
    t, splits, workspace = _shrink_t(backend, "bgmv", x, t, batch.t_cols if batch else max_rank,
                                     splits, num_sms)
    _launch_shrink(backend, plan_bgmv_shrink(x, slots, a_table, ranks, t, max_rank, splits,
                                             workspace), workspace)
    return t


def bgmv_expand(
    t: Any, slots: Any, b_table: Any, scale_table: Any, ranks: Any, y: Any, max_rank: int,
    *, backend: Backend = CUPY,
) -> Any:
    """Decode expand: y (BF16 as uint16, or F32) [T, out_dim] += ...; returns y. B rows are
    the pool's max_rank long (t may be narrower: the batch's widest rank)."""
    backend.launch(plan_bgmv_expand(t, slots, b_table, scale_table, ranks, y, max_rank))
    return y


def _chunks(backend: Backend, like: Any, seg_starts: Any, seg_slots: Any, num_tokens: int,
            chunks: Any | None, token_order: Any | None = None) -> Any:
    """The SGMV work list of these segments where the kernels read it: `chunks` when the
    caller has it (a WorkList: a BatchPlan's, or one shared by a shrink and its expand; or a
    raw array, which the launch checks), else built on the host (plans.segment_chunks) and
    moved there, checked there once as a WorkList (a caller's `token_order` stays beside it,
    checked by the launch)."""
    if chunks is not None:
        return chunks
    host = segment_chunks(seg_starts, seg_slots, num_tokens)
    if token_order is not None:
        return backend.array(like, host)
    return work_list(host, None, num_tokens, lambda a: backend.array(like, a))


def _placed(backend: Backend, like: Any, batch: BatchPlan) -> WorkList:
    """The batch plan's order and work list on `backend`, moved and checked once per plan and
    placement (BatchPlan.placed), not per launch."""
    return batch.placed(backend.placement(like), lambda a: backend.array(like, a))


def sgmv_shrink(
    x: Any, seg_starts: Any, seg_slots: Any, a_table: Any, ranks: Any, max_rank: int,
    t: Any | None = None, *, splits: int | None = None, num_sms: int | None = None,
    t_cols: int | None = None, token_order: Any | None = None, chunks: Any | None = None,
    backend: Backend = CUPY,
) -> Any:
    """Prefill shrink over segments (seg_starts i32 [S+1], seg_slots i32 [S]). Returns t F32
    [T, t_cols] (allocated when not given; t_cols defaults to max_rank); `splits` as in
    bgmv_shrink; `chunks`: the segments' work list (plans.segment_chunks) already on the
    backend (a WorkList, or a raw array checked here), else built here."""
    work = _chunks(backend, x, seg_starts, seg_slots, int(x.shape[0]), chunks, token_order)
    t, splits, workspace = _shrink_t(backend, "sgmv", x, t, t_cols or max_rank, splits, num_sms,
                                     chunks=chunk_count(work))
    _launch_shrink(backend, plan_sgmv_shrink(x, work, a_table, ranks, t, max_rank, token_order,
                                             splits, workspace), workspace)
    return t


def sgmv_expand(
    t: Any, seg_starts: Any, seg_slots: Any, b_table: Any, scale_table: Any, ranks: Any, y: Any,
    max_rank: int, *, token_order: Any | None = None, chunks: Any | None = None,
    num_sms: int | None = None, backend: Backend = CUPY,
) -> Any:
    """Prefill expand: y (BF16 as uint16, or F32) [T, out_dim] += ...; returns y. `chunks` as
    in sgmv_shrink; each CTA takes the 64-output tiles of one chunk that expand_out_tiles plans
    for the device's SMs."""
    work = _chunks(backend, y, seg_starts, seg_slots, int(y.shape[0]), chunks, token_order)
    out_tiles = expand_out_tiles(chunk_count(work), int(y.shape[1]), int(t.shape[-1]),
                                 backend.num_sms(num_sms))
    backend.launch(plan_sgmv_expand(t, work, b_table, scale_table, ranks, y, max_rank,
                                    token_order, out_tiles))
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
        work = _placed(backend, x, batch)
        t = sgmv_shrink(x, batch.seg_starts, batch.seg_slots, a_table, ranks, max_rank,
                        num_sms=num_sms, t_cols=batch.t_cols, chunks=work, backend=backend)
        # t is in token order either way, so the expand may take the per-token path.
        if grouped_expand(batch.num_tokens, int(y.shape[1]), batch.t_cols,
                          int(batch.chunks.shape[0]), backend.num_sms(num_sms)):
            return sgmv_expand(t, batch.seg_starts, batch.seg_slots, b_table, scale_table, ranks,
                               y, max_rank, chunks=work, num_sms=num_sms, backend=backend)
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
    2 (S - 1) of them. A grouped batch (`batch.grouped`) takes the SGMV kernels over its
    sorted tokens, fused the same way (its expand per token where grouped_expand, over the
    slices' outputs together, says so)."""
    slices = int(a_tables.shape[0])
    cols = check_slice_cols(slice_cols, slices, int(y.shape[1]))
    bounds = backend.array(x, np.asarray(cols, dtype=np.int32))
    if batch is not None and batch.grouped:
        work = _placed(backend, x, batch)
        t = _sgmv_fused_shrink(x, work, a_tables, ranks, max_rank, batch.t_cols, num_sms,
                               backend)
        if grouped_expand(batch.num_tokens, cols[-1], batch.t_cols,
                          int(batch.chunks.shape[0]), backend.num_sms(num_sms)):
            return _sgmv_fused_expand(t, work, b_tables, scale_table, ranks, y, max_rank,
                                      cols, bounds, num_sms, backend)
    else:
        t, splits, workspace = _shrink_t(backend, "bgmv", x, None,
                                         batch.t_cols if batch else max_rank, None, num_sms,
                                         slices)
        _launch_shrink(backend, plan_bgmv_shrink(x, slots, a_tables, ranks, t, max_rank,
                                                 splits, workspace), workspace)
    backend.launch(plan_bgmv_expand(t, slots, b_tables, scale_table, ranks, y, max_rank,
                                    bounds))
    return y


def _sgmv_fused_shrink(x: Any, work: WorkList, a_tables: Any, ranks: Any, max_rank: int,
                       t_cols: int, num_sms: int | None, backend: Backend) -> Any:
    """The one SGMV shrink of fused slices over the work list `work` (with its order): t F32
    [S, T, t_cols], split for the launch's CTAs (the chunks times the slices' rank columns
    side by side)."""
    t, splits, workspace = _shrink_t(backend, "sgmv", x, None, t_cols, None, num_sms,
                                     int(a_tables.shape[0]), work.count)
    _launch_shrink(backend, plan_sgmv_shrink(x, work, a_tables, ranks, t, max_rank,
                                             splits=splits, workspace=workspace), workspace)
    return t


def _sgmv_fused_expand(t: Any, work: WorkList, b_tables: Any, scale_table: Any, ranks: Any,
                       y: Any, max_rank: int, cols: list[int], bounds: Any,
                       num_sms: int | None, backend: Backend) -> Any:
    """The one SGMV expand of fused slices (on grid.z): each CTA takes the 64-output tiles of
    one chunk of one slice that expand_out_tiles plans for the launch's chunks x slices over
    the widest slice."""
    widest = max(b - a for a, b in zip(cols, cols[1:], strict=False))
    out_tiles = expand_out_tiles(work.count * int(b_tables.shape[0]), widest,
                                 int(t.shape[-1]), backend.num_sms(num_sms))
    backend.launch(plan_sgmv_expand(t, work, b_tables, scale_table, ranks, y, max_rank,
                                    out_tiles=out_tiles, slice_cols=bounds))
    return y


def sgmv(
    x: Any, y: Any, seg_starts: Any, seg_slots: Any, a_table: Any, b_table: Any,
    scale_table: Any, ranks: Any, max_rank: int, *, num_sms: int | None = None,
    t_cols: int | None = None, backend: Backend = CUPY,
) -> Any:
    """The whole prefill LoRA delta for one entry over segments of tokens sharing a slot;
    `t_cols` (the widest rank of the batch, a multiple of 8) narrows t and the shrink grid. The
    two launches share one work list (plans.segment_chunks)."""
    chunks = _chunks(backend, x, seg_starts, seg_slots, int(x.shape[0]), None)
    t = sgmv_shrink(x, seg_starts, seg_slots, a_table, ranks, max_rank, num_sms=num_sms,
                    t_cols=t_cols, chunks=chunks, backend=backend)
    return sgmv_expand(t, seg_starts, seg_slots, b_table, scale_table, ranks, y, max_rank,
                       chunks=chunks, num_sms=num_sms, backend=backend)


def sgmv_fused(
    x: Any, y: Any, slice_cols: Sequence[int], seg_starts: Any, seg_slots: Any, a_tables: Any,
    b_tables: Any, scale_table: Any, ranks: Any, max_rank: int, *, num_sms: int | None = None,
    t_cols: int | None = None, backend: Backend = CUPY,
) -> Any:
    """The prefill LoRA delta of a layer's projections that share x (q, k and v; gate and up)
    over segments of tokens sharing a slot, in one shrink and one expand launch: y, slice_cols,
    a_tables and b_tables as in bgmv_fused, segments and `t_cols` as in sgmv. The shrink's
    64-column tiles run over the slices' rank columns side by side, so where the slices' ranks
    fit in one tile (rank 16 for q, k and v) each chunk's x is read once for all of them."""
    slices = int(a_tables.shape[0])
    cols = check_slice_cols(slice_cols, slices, int(y.shape[1]))
    chunks = _chunks(backend, x, seg_starts, seg_slots, int(x.shape[0]), None)
    t = _sgmv_fused_shrink(x, chunks, a_tables, ranks, max_rank, t_cols or max_rank, num_sms,
                           backend)
    return _sgmv_fused_expand(t, chunks, b_tables, scale_table, ranks, y, max_rank, cols,
                              backend.array(x, np.asarray(cols, dtype=np.int32)), num_sms,
                              backend)
