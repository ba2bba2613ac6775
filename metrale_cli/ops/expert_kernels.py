"""Launchers of kernels/expert.cu: the router and routed-expert LoRA deltas of one MoE layer,
straight from the expert pool, and the token-overlay gather.

A layer's expert LoRA is described by `ExpertTables` (the pool's expert pointer tables, which
entries a layer's gate/up/down/router are, the slot scales and the slots' expert ranks). A batch
of routed tokens becomes an `ExpertBatch` (`plan_pairs`, the align step): its (token, expert)
pairs sorted by (slot, expert) and cut into tiles of one group each, so every tile's CTA reads
the group's A and B once for all of the tile's pairs. The align step runs on the host in NumPy
(plan_pairs), or where the arrays live (align_pairs: CuPy ops on a GPU, nothing crosses to the
host, so it can sit in a CUDA graph).

Launch planning (`plan_*`) is plain Python shared by CuPy (`kernels.CUPY`) and the host harness
(`host_harness.HOST`), as in kernels.py. BF16 buffers are uint16 arrays of raw BF16 bits, or
torch.bfloat16 tensors on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from metrale_cli import compat
from metrale_cli.adapters.experts import ROUTER_EXPERT, ExpertProj
from metrale_cli.layout.expert_layout import ExpertLayout
from metrale_cli.ops import kernels, plans, sources
from metrale_cli.ops.kernels import Backend
from metrale_cli.ops.plans import (
    BF16,
    KernelLaunch,
    check_buffer,
    check_table_alignment,
    dtype_name,
    row_stride,
)
from metrale_cli.ops.sources import VECTOR

DECODE_TILE = sources.CONFIG["EXPERT_DECODE_TILE"]
PREFILL_TILE = sources.CONFIG["EXPERT_PREFILL_TILE"]
# Rank rows per expert_shrink_prefill CTA (its mma tiles); the decode shrink takes SHRINK_ROWS.
PREFILL_SHRINK_ROWS = sources.CONFIG["EXPERT_SHRINK_PREFILL_ROWS"]
# gate_up is two slices (gate columns, then up columns); down is one.
GATE_UP = (ExpertProj.GATE_PROJ, ExpertProj.UP_PROJ)
DOWN = (ExpertProj.DOWN_PROJ,)


def expert_entries(layout: ExpertLayout, layer: int,
                   projs: tuple[ExpertProj, ...]) -> np.ndarray:
    """int32 [len(projs), num_experts]: the expert-table row of each (projection, expert) of
    `layer` in `layout`, -1 where the layout has none."""
    num_experts = layout.model.num_experts
    entries = np.full((len(projs), num_experts), -1, dtype=np.int32)
    for c, proj in enumerate(projs):
        for e in range(num_experts):
            entries[c, e] = layout.index.get((layer, proj, e), -1)
    return entries


@dataclass(frozen=True)
class ExpertTables:
    """What the expert kernels read for one MoE layer (arrays of the backend's kind):

    - `a_tables`, `b_tables`: the pool's expert pointer tables, u64 [n_entries, max_loras];
    - `gate_up`, `down`: int32 [2, E] / [1, E] entry rows (`expert_entries`);
    - `router`: the router's entry row, or -1;
    - `scale_table` f32 and `ranks` i32 [max_loras] (each slot's widest expert rank);
    - `max_rank`: the expert pool's rank (A rows, B columns).
    """

    a_tables: Any
    b_tables: Any
    gate_up: Any
    down: Any
    router: int
    scale_table: Any
    ranks: Any
    max_rank: int
    num_experts: int

    def __post_init__(self) -> None:
        """The entry rows and the router entry index the pointer tables' rows (the kernels
        read table[entry * max_loras + slot] for any entry >= 0): each -1 or a row of both
        tables. Checked here, where a caller's values become the kernels' (the entry rows are
        copied to the host for it: a few E x 4 bytes, once per layer)."""
        rows = min(int(self.a_tables.shape[0]), int(self.b_tables.shape[0]))
        for what, entries in (("gate_up", self.gate_up), ("down", self.down)):
            values = plans.host_values(entries).astype(np.int64).ravel()
            bad = np.flatnonzero((values < -1) | (values >= rows))
            if bad.size:
                raise ValueError(f"{what} entry {int(values[bad[0]])} (at {int(bad[0])}) is "
                                 f"not -1 or a row of the {rows}-row expert tables")
        if isinstance(self.router, bool) or not -1 <= int(self.router) < rows:
            raise ValueError(f"router entry {self.router!r} is not -1 or a row of the "
                             f"{rows}-row expert tables")

    @property
    def max_loras(self) -> int:
        return int(self.a_tables.shape[1])


def tables_from_pool(pool: Any, layer: int, backend: Backend = kernels.CUPY,
                     like: Any = None) -> ExpertTables:
    """The ExpertTables of `layer` of a LoraPool with an expert pool (`like`: an array of the
    kind the backend should make, for the host harness)."""
    layout, region = pool.expert_layout, pool.expert_region
    if layout is None or region is None:
        raise ValueError("the pool has no expert pool (pack with --experts)")
    router = layout.index.get((layer, ExpertProj.ROUTER, ROUTER_EXPERT), -1)
    ref = region.a_tables if like is None else like
    return ExpertTables(
        a_tables=region.a_tables, b_tables=region.b_tables,
        gate_up=backend.array(ref, expert_entries(layout, layer, GATE_UP)),
        down=backend.array(ref, expert_entries(layout, layer, DOWN)),
        router=router, scale_table=pool.scale_table, ranks=pool.expert_rank_table,
        max_rank=layout.max_rank, num_experts=layout.model.num_experts,
    )


# --- the align step -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ExpertBatch:
    """A routed batch's pairs grouped by (slot, expert) (host arrays):

    - `sorted_pairs` int32 [A]: the adapted pairs (p = token * top_k + choice) by group;
    - `tiles` int32 [num_tiles, 4]: (begin, end, slot, expert) over sorted positions, at most
      `tile` pairs each and never two groups in one;
    - `tile`: DECODE_TILE, or PREFILL_TILE when groups average that many pairs (prefill);
    - `t_cols`: the widest expert rank among the adapted pairs, rounded up to VECTOR;
    - `groups`: the number of (slot, expert) groups (-1 where align_pairs did not count them).

    plan_pairs builds it on the host; align_pairs on the device (its arrays then CuPy's).
    """

    num_tokens: int
    top_k: int
    sorted_pairs: Any
    tiles: Any
    tile: int
    t_cols: int
    groups: int

    def __post_init__(self) -> None:
        """Where the tiles and pairs are host arrays (plan_pairs', or a caller's), what the
        kernels index with them: each tile's [begin, end) within sorted_pairs and at most
        `tile` pairs (an empty tile, begin = end, is a spare one whose CTA exits), every sorted
        pair an index of the P = T x top_k pairs (rows of t and y). align_pairs' device arrays
        are its own and are not copied back for this (nothing may stop on a device value
        without a device-to-host copy)."""
        # The prefill kernels take PREFILL_TILE pairs a CTA, the decode ones (any other tile)
        # DECODE_TILE.
        if not (1 <= self.tile <= DECODE_TILE or self.tile == PREFILL_TILE):
            raise ValueError(f"tile must be 1..{DECODE_TILE} (the decode kernels) or "
                             f"{PREFILL_TILE} (the prefill kernels), got {self.tile}")
        if type(self.tiles).__module__.startswith("cupy"):
            return
        pairs = plans.host_values(self.sorted_pairs).astype(np.int64).ravel()
        outside = np.flatnonzero((pairs < 0) | (pairs >= self.num_pairs))
        if outside.size:
            i = int(outside[0])
            raise ValueError(f"sorted_pairs[{i}] = {int(pairs[i])} is outside the "
                             f"{self.num_pairs} pairs [0, {self.num_pairs})")
        tiles = plans.host_values(self.tiles).astype(np.int64)
        if tiles.ndim != 2 or tiles.shape[1] != 4:
            raise ValueError(f"tiles must be [num_tiles, 4], got shape {tiles.shape}")
        begin, end = tiles[:, 0], tiles[:, 1]
        bad = np.flatnonzero((begin < 0) | (end < begin) | (end > pairs.size)
                             | (end - begin > self.tile))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"tiles[{i}] = pairs [{int(begin[i])}, {int(end[i])}) is not 0 to "
                             f"{self.tile} of the {pairs.size} sorted pairs")

    @property
    def num_pairs(self) -> int:
        return self.num_tokens * self.top_k

    @property
    def prefill(self) -> bool:
        return self.tile == PREFILL_TILE


# The expert id of a pair whose expert lives on another rank (expert parallelism): the pair is
# in no tile, so its rows of h and y are left untouched.
OFF_RANK = -1


def plan_pairs(topk_ids: Any, slots: Any, ranks: Any, max_rank: int,
               tile: int | None = None, *, num_experts: int) -> ExpertBatch:
    """The align step (vLLM's moe_align_block_size, per slot): pairs of tokens with slot -1 (or
    a slot outside the rank table, or rank 0) and pairs whose expert is OFF_RANK (-1: not on
    this rank) are left out, the rest sorted by (slot, expert, pair) and tiled. Any other id
    outside [0, num_experts) is refused (ValueError). `tile` forces a tile size (default:
    chosen by the average group size)."""
    ids = plans.host_values(topk_ids).astype(np.int64)
    if ids.ndim != 2:
        raise ValueError(f"topk_ids must be [T, top_k], got shape {ids.shape}")
    bad = np.flatnonzero(((ids < 0) | (ids >= num_experts)) & (ids != OFF_RANK))
    if bad.size:
        raise ValueError(
            f"topk_ids holds expert {int(ids.ravel()[bad[0]])} (pair {int(bad[0])}), outside "
            f"[0, {num_experts}) and not {OFF_RANK} (an expert on another rank)")
    num_tokens, top_k = ids.shape
    slot_ids = plans.host_values(slots).astype(np.int64).ravel()
    if slot_ids.size != num_tokens:
        raise ValueError(f"slots has {slot_ids.size} entries for {num_tokens} tokens")
    rank_table = plans.host_values(ranks).astype(np.int64).ravel()
    pair_slot = np.repeat(slot_ids, top_k)
    pair_expert = ids.ravel()
    inside = (pair_slot >= 0) & (pair_slot < rank_table.size)
    pair_rank = np.zeros(pair_slot.size, dtype=np.int64)
    pair_rank[inside] = np.minimum(rank_table[pair_slot[inside]], max_rank)
    pair_rank[pair_expert == OFF_RANK] = 0
    adapted = np.flatnonzero(pair_rank > 0)
    order = adapted[np.lexsort((adapted, pair_expert[adapted], pair_slot[adapted]))]
    keys = np.stack((pair_slot[order], pair_expert[order]), axis=1)
    cuts = np.flatnonzero((np.diff(keys, axis=0) != 0).any(axis=1)) + 1
    starts = np.concatenate(([0], cuts)).astype(np.int64) if order.size else np.zeros(0, int)
    ends = np.concatenate((cuts, [order.size])).astype(np.int64) if order.size else starts
    groups = int(starts.size)
    if tile is None:
        tile = choose_tile(int(order.size), groups)
    counts = -(-(ends - starts) // tile)
    group_of = np.repeat(np.arange(groups), counts)
    within = np.arange(group_of.size) - np.repeat(np.cumsum(counts) - counts, counts)
    begin = starts[group_of] + within * tile
    tiles = np.stack((begin, np.minimum(begin + tile, ends[group_of]),
                      keys[starts[group_of], 0], keys[starts[group_of], 1]),
                     axis=1).astype(np.int32).reshape(-1, 4)
    widest = int(pair_rank.max()) if pair_rank.size else 0
    t_cols = min(max(VECTOR, -(-widest // VECTOR) * VECTOR), max_rank)
    return ExpertBatch(num_tokens, top_k, order.astype(np.int32), tiles, tile, t_cols, groups)


def choose_tile(num_pairs: int, groups: int) -> int:
    """The tile size: PREFILL_TILE when the (slot, expert) groups average that many pairs."""
    return PREFILL_TILE if groups and num_pairs >= PREFILL_TILE * groups else DECODE_TILE


def align_pairs(topk_ids: Any, slots: Any, ranks: Any, num_experts: int, *, tile: int,
                t_cols: int) -> ExpertBatch:
    """The align step where the arrays live (CuPy arrays on a GPU; NumPy arrays or torch CPU
    tensors give the same result on the host): on a GPU no value crosses to the host, so it
    can sit in a CUDA graph.

    The caller picks `tile` (choose_tile over the host-known number of pairs and a bound on
    the groups: distinct slots x experts) and `t_cols` (the batch's widest expert rank,
    rounded up to VECTOR). `tiles` has room for every tile that could exist,
    min(P, ceil(P / tile) + max_loras x E) rows; rows past the last tile are (0, 0, 0, 0) and
    their CTAs exit at once. `sorted_pairs` holds all P pairs, the adapted ones first in
    (slot, expert, pair) order; `groups` is unknown (-1).

    An expert id outside [0, num_experts) (OFF_RANK, -1, for an expert on another rank) puts
    its pair in no tile, as a token without adapter: nothing here may stop on a bad value
    without a device-to-host copy, so such ids are not refused (plan_pairs refuses those other
    than OFF_RANK)."""
    if type(topk_ids).__module__.startswith("cupy"):
        xp = compat.cupy_module()
    else:  # NumPy, or torch CPU tensors (the host harness): the same ops in NumPy
        xp = np
        topk_ids, slots, ranks = (plans.host_values(a) for a in (topk_ids, slots, ranks))
    num_tokens, top_k = (int(d) for d in topk_ids.shape)
    pairs, max_loras = num_tokens * top_k, int(ranks.shape[0])
    none = max_loras * num_experts  # the key of pairs without adapter: sorted last
    pair_slot = xp.repeat(slots.astype(xp.int64), top_k)
    pair_expert = topk_ids.reshape(-1).astype(xp.int64)
    inside = (pair_slot >= 0) & (pair_slot < max_loras)
    rank = xp.where(inside, ranks[xp.clip(pair_slot, 0, max_loras - 1)], 0)
    # Keys are slot * E + expert for in-range experts only: an off-rank id (-1) would collide
    # with the previous slot's last expert and be computed with that slot's adapter.
    on_rank = (pair_expert >= 0) & (pair_expert < num_experts)
    key = xp.where((rank > 0) & on_rank, pair_slot * num_experts + pair_expert, none)
    position = xp.arange(pairs, dtype=xp.int64)
    order = xp.argsort(key * pairs + position)  # unique keys: stable whatever the sort
    sorted_key = key[order]
    begin = xp.searchsorted(sorted_key, sorted_key, side="left")
    end = xp.searchsorted(sorted_key, sorted_key, side="right")
    first = ((position - begin) % tile == 0) & (sorted_key < none)
    bound = min(pairs, -(-pairs // tile) + none)
    row = xp.where(first, xp.cumsum(first) - 1, bound)  # non-first positions: a spare row
    tiles = xp.zeros((bound + 1, 4), dtype=xp.int32)
    tiles[row, 0] = position
    tiles[row, 1] = xp.minimum(position + tile, end)
    tiles[row, 2] = sorted_key // num_experts
    tiles[row, 3] = sorted_key % num_experts
    return ExpertBatch(num_tokens, top_k, order.astype(xp.int32), tiles[:bound], tile, t_cols,
                       -1)


# --- planning ---------------------------------------------------------------------------------


def _check_expert_tables(tables: ExpertTables, entries: Any, slices: int) -> None:
    max_loras = tables.max_loras
    for what, table in (("a_tables", tables.a_tables), ("b_tables", tables.b_tables)):
        check_buffer(table, what, ("uint64", "int64"), (None, max_loras))
        check_table_alignment(table, what)
    check_buffer(entries, "entries", ("int32",), (slices, tables.num_experts))
    check_buffer(tables.ranks, "ranks", ("int32",), (max_loras,))
    check_buffer(tables.scale_table, "scale_table", ("float32",), (max_loras,))
    if tables.max_rank % VECTOR or not 0 < tables.max_rank <= sources.MAX_RANK:
        raise ValueError(f"max_rank must be a multiple of {VECTOR} in 1..{sources.MAX_RANK}")


def plan_router_lora(x: Any, logits: Any, slots: Any, tables: ExpertTables) -> KernelLaunch:
    """logits[b] += scale * (x[b] @ A_s^T) @ B_s^T over the router entry of the tables."""
    num_tokens, in_dim = (int(d) for d in x.shape)
    num_experts = int(logits.shape[1])
    check_buffer(x, "x", BF16, (num_tokens, in_dim), rows=True)
    check_buffer(slots, "slots", ("int32",), (num_tokens,))
    check_buffer(logits, "logits", (*BF16, "float32"), (num_tokens, num_experts), rows=True)
    _check_expert_tables(tables, tables.down, 1)
    if in_dim % VECTOR:
        raise ValueError(f"in_dim ({in_dim}) must be a multiple of {VECTOR}")
    kind = "bf16" if dtype_name(logits) in BF16 else "f32"
    logits_stride = plans.element_strides(logits)[0]
    args = (x, np.int64(row_stride(x, "x")), slots, tables.a_tables, tables.b_tables,
            np.int32(tables.router), tables.scale_table, tables.ranks,
            np.int32(tables.max_loras), logits, np.int64(logits_stride), np.int32(in_dim),
            np.int32(num_experts), np.int32(tables.max_rank))
    return KernelLaunch(f"router_lora_{kind}", (num_tokens, 1, 1), (sources.THREADS, 1, 1), args)


def shrink_rows(tile: int) -> int:
    """Rank rows per CTA of the expert shrink for tiles of `tile` pairs (its grid.y divides
    t's width by it)."""
    return PREFILL_SHRINK_ROWS if tile == PREFILL_TILE else sources.SHRINK_ROWS


def plan_expert_shrink(x: Any, x_div: int, sorted_pairs: Any, tiles: Any, tables: ExpertTables,
                       entries: Any, t: Any, tile: int) -> KernelLaunch:
    """t[c, p, :] = x[p // x_div] @ A(c, e_p, s_p)^T for the tiles' pairs."""
    slices, num_pairs, t_cols = (int(d) for d in t.shape)
    in_dim = int(x.shape[1])
    num_tiles = int(tiles.shape[0])
    check_buffer(x, "x", BF16, (-(-num_pairs // x_div), in_dim), rows=True)
    check_buffer(t, "t", ("float32",), (slices, num_pairs, t_cols))
    check_buffer(tiles, "tiles", ("int32",), (num_tiles, 4))
    check_buffer(sorted_pairs, "sorted_pairs", ("int32",), (None,))
    _check_expert_tables(tables, entries, slices)
    if in_dim % VECTOR or t_cols % VECTOR or not 0 < t_cols <= tables.max_rank:
        raise ValueError(f"in_dim ({in_dim}) and t's width ({t_cols}) must be multiples of "
                         f"{VECTOR}, t's width at most max_rank ({tables.max_rank})")
    name = "expert_shrink_prefill" if tile == PREFILL_TILE else "expert_shrink_decode"
    grid = (num_tiles, -(-t_cols // shrink_rows(tile)), slices)
    args = (x, np.int64(row_stride(x, "x")), np.int32(x_div), sorted_pairs, tiles,
            tables.a_tables, entries, np.int32(tables.num_experts), tables.ranks,
            np.int32(tables.max_loras), t, np.int32(num_pairs), np.int32(in_dim),
            np.int32(tables.max_rank), np.int32(t_cols))
    return KernelLaunch(name, grid, (sources.THREADS, 1, 1), args)


def plan_expert_expand(t: Any, sorted_pairs: Any, tiles: Any, tables: ExpertTables, entries: Any,
                       y: Any, tile: int) -> KernelLaunch:
    """y[p, c*out_dim:(c+1)*out_dim] += scale * t[c, p] @ B(c, e_p, s_p)^T for the tiles'
    pairs; out_dim = y's width / slices."""
    slices, num_pairs, t_cols = (int(d) for d in t.shape)
    width = int(y.shape[1])
    out_dim = width // slices
    num_tiles = int(tiles.shape[0])
    check_buffer(t, "t", ("float32",), (slices, num_pairs, t_cols))
    check_buffer(y, "y", (*BF16, "float32"), (num_pairs, width), rows=True)
    check_buffer(tiles, "tiles", ("int32",), (num_tiles, 4))
    _check_expert_tables(tables, entries, slices)
    if out_dim * slices != width or out_dim % VECTOR:
        raise ValueError(f"y's width ({width}) must be {slices} x a multiple of {VECTOR}")
    kind = "bf16" if dtype_name(y) in BF16 else "f32"
    path = "prefill" if tile == PREFILL_TILE else "decode"
    grid = (num_tiles, -(-out_dim // (sources.THREADS * sources.EXPAND_ROWS)), slices)
    args = (t, sorted_pairs, tiles, tables.b_tables, entries, np.int32(tables.num_experts),
            tables.scale_table, tables.ranks, np.int32(tables.max_loras), y,
            np.int64(row_stride(y, "y")), np.int32(num_pairs), np.int32(out_dim),
            np.int32(tables.max_rank), np.int32(t_cols))
    return KernelLaunch(f"expert_expand_{path}_{kind}", grid, (sources.THREADS, 1, 1), args)


# --- launchers ----------------------------------------------------------------------------------


def router_lora(x: Any, logits: Any, slots: Any, tables: ExpertTables,
                *, backend: Backend = kernels.CUPY) -> Any:
    """Router LoRA delta, added to the router's logits in place.

    Semantics: logits[b, :] += scale_table[s] * (x[b] @ A_router(s)^T) @ B_router(s)^T with
    s = slots[b], over the slot's first min(ranks[s], max_rank) rank rows; rows of tokens with
    slot -1, or of slots without router LoRA, untouched.

    Shape: x [T, H]; logits [T, E]; slots [T].
    DType: x BF16 (uint16 bits or torch.bfloat16); logits BF16 or F32; slots int32.
    Returns logits."""
    if tables.router < 0:
        return logits  # the layout has no router entry on this layer: nothing adapts it
    backend.launch(plan_router_lora(x, logits, slots, tables))
    return logits


def _experts_delta(inputs: Any, x_div: int, y: Any, batch: ExpertBatch, tables: ExpertTables,
                   entries: Any, backend: Backend) -> Any:
    slices = int(entries.shape[0])
    sorted_pairs = backend.array(inputs, batch.sorted_pairs)
    tiles = backend.array(inputs, batch.tiles)
    t = backend.new_t(inputs, (slices, batch.num_pairs, batch.t_cols))
    backend.launch(plan_expert_shrink(inputs, x_div, sorted_pairs, tiles, tables, entries, t,
                                      batch.tile))
    backend.launch(plan_expert_expand(t, sorted_pairs, tiles, tables, entries, y, batch.tile))
    return y


def expert_gate_up(x: Any, h: Any, batch: ExpertBatch, tables: ExpertTables,
                   *, backend: Backend = kernels.CUPY) -> Any:
    """Routed experts' gate_up LoRA delta, added to the intermediate in place.

    Semantics: for pair p = b * top_k + j with expert e = topk_ids[b, j] and slot s = slots[b],
    h[p, :I] += scale[s] * (x[b] @ A_gate(e, s)^T) @ B_gate(e, s)^T and h[p, I:] likewise with
    up (gate rows then up rows, as the pool and transformers' gate_up_proj store them); rows of
    pairs without adapter, and the columns of a projection the slot does not adapt, untouched.

    Shape: x [T, H]; h [T * top_k, 2 I]; `batch` from plan_pairs(topk_ids [T, top_k], slots).
    DType: x BF16; h BF16 or F32.
    Returns h."""
    return _experts_delta(x, batch.top_k, h, batch, tables, tables.gate_up, backend)


def expert_down(act: Any, y: Any, batch: ExpertBatch, tables: ExpertTables,
                *, backend: Backend = kernels.CUPY) -> Any:
    """Routed experts' down LoRA delta, added to the per-pair outputs before the weighted top-k
    sum, in place.

    Semantics: y[p] += scale[s] * (act[p] @ A_down(e, s)^T) @ B_down(e, s)^T for each adapted
    pair p (as in expert_gate_up); other rows untouched.

    Shape: act [T * top_k, I]; y [T * top_k, H].
    DType: act BF16; y BF16 or F32.
    Returns y."""
    return _experts_delta(act, 1, y, batch, tables, tables.down, backend)


# --- token overlays ---------------------------------------------------------------------------


@dataclass(frozen=True)
class OverlayTables:
    """Every slot's overlaid token ids (int32 [max_loras, max_tokens], ascending, the first
    counts[s] valid, the rest anything: the kernel searches only those; from_pool writes a
    sentinel) and rows (BF16 bits uint16 [max_loras, max_tokens,
    hidden]) of one table (embed_tokens)."""

    ids: np.ndarray
    counts: np.ndarray
    rows: np.ndarray

    @classmethod
    def from_pool(cls, pool: Any, hidden: int, table: str = "embed_tokens") -> OverlayTables:
        from metrale_cli.bf16 import to_bf16

        per_slot = []
        for raw in pool.overlay_raw:
            found = None
            if raw is not None and table in raw.tables:
                i = raw.tables.index(table)
                found = (raw.tokens[i], raw.rows[i])
            per_slot.append(found)
        width = max([len(f[0]) for f in per_slot if f is not None] + [1])
        ids = np.full((len(per_slot), width), np.iinfo(np.int32).max, dtype=np.int32)
        counts = np.zeros(len(per_slot), dtype=np.int32)
        rows = np.zeros((len(per_slot), width, hidden), dtype=np.uint16)
        for s, found in enumerate(per_slot):
            if found is None:
                continue
            tokens, values = found
            order = np.argsort(tokens, kind="stable")
            ids[s, :len(tokens)] = tokens[order]
            counts[s] = len(tokens)
            rows[s, :len(tokens)] = to_bf16(values[order], "F32").reshape(len(tokens), hidden)
        return cls(ids, counts, rows)


def plan_overlay_gather(token_ids: Any, slots: Any, ids: Any, counts: Any, rows: Any,
                        emb: Any) -> KernelLaunch:
    """emb[b] = rows[s, i] where ids[s, i] == token_ids[b] (s = slots[b]); other rows kept."""
    num_tokens, hidden = (int(d) for d in emb.shape)
    max_loras, max_tokens = (int(d) for d in ids.shape)
    check_buffer(token_ids, "token_ids", ("int32",), (num_tokens,))
    check_buffer(slots, "slots", ("int32",), (num_tokens,))
    check_buffer(ids, "overlay ids", ("int32",), (max_loras, max_tokens))
    check_buffer(counts, "overlay counts", ("int32",), (max_loras,))
    check_buffer(rows, "overlay rows", BF16, (max_loras, max_tokens, hidden))
    check_buffer(emb, "emb", BF16, (num_tokens, hidden), rows=True)
    if hidden % VECTOR:
        raise ValueError(f"hidden ({hidden}) must be a multiple of {VECTOR}")
    args = (token_ids, slots, ids, counts, rows, np.int32(max_loras), np.int32(max_tokens),
            np.int32(hidden), emb, np.int64(row_stride(emb, "emb")))
    return KernelLaunch("overlay_gather", (num_tokens, 1, 1), (sources.THREADS, 1, 1), args)


def overlay_gather(token_ids: Any, slots: Any, overlays: OverlayTables, emb: Any,
                   *, backend: Backend = kernels.CUPY) -> Any:
    """Token overlays (PEFT's trainable tokens) on the looked-up embeddings, in place.

    Semantics: emb[b] = the row slot s = slots[b] keeps for token token_ids[b], where the slot
    overlays that token; every other row (slot -1, token not overlaid) untouched, bit for bit.

    Shape: token_ids, slots [T]; emb [T, H].
    DType: token_ids, slots int32; emb BF16.
    Returns emb."""
    ids, counts, rows = (backend.array(emb, a) for a in (overlays.ids, overlays.counts,
                                                        overlays.rows))
    if dtype_name(emb) == "bfloat16":
        rows = rows.view(emb.dtype)
    backend.launch(plan_overlay_gather(token_ids, slots, ids, counts, rows, emb))
    return emb
