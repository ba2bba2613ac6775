"""The modelled costs the launch planner chooses by: split-K counts (`shrink_splits`), the SGMV
expand's output tiles per CTA (`expand_out_tiles`) and the grouped decode's expand path
(`grouped_expand`). They are the roofline model's costs (metrale_cli/bench/roofline.py) in
small: a streaming pass is one DRAM latency, a dependent load one L2 latency, bytes that L2
serves at L2 bandwidth, resident CTAs in waves. Plain arithmetic over launch shapes; plans.py
asks, the kernels do not depend on it.
"""

from __future__ import annotations

from metrale_cli.ops.sources import (
    CONFIG,
    EXPAND_ROWS,
    MAX_SPLITS,
    SGMV_EXPAND_STAGES,
    SGMV_SHRINK_STAGES,
    SGMV_SPLITS_PER_TRIP,
    SGMV_TILE,
    SGMV_WIDE_SPLITS_PER_TRIP,
    SHRINK_ROWS,
    THREADS,
    VECTOR,
    min_ctas_per_sm,
)

EXPAND_STEPS = CONFIG["BGMV_EXPAND_STEPS"]  # B rows per bgmv_expand thread per pass


def k_chunk(in_dim: int, splits: int, multiple: int) -> int:
    """The K elements of one split: ceil(K / splits) rounded up to `multiple`."""
    # Splits past the end of K are harmless: their CTAs return and take no ticket.
    chunk = -(-in_dim // splits)
    return -(-chunk // multiple) * multiple


# Each split's partial of one output tile in the split-K workspace: BGMV's 4 rank rows of a
# token, SGMV's 64 x 64 tile.
PARTIAL_FLOATS = {"bgmv_shrink": SHRINK_ROWS, "sgmv_shrink": SGMV_TILE * SGMV_TILE}


# Split-K keeps at least this many K elements per split: one full step of 128 threads x 8 for
# BGMV, one 64-wide tile for SGMV. A pass of a CTA streams 2 such steps (BGMV) or, SGMV's
# pipeline keeping SGMV_SHRINK_STAGES tiles in flight, that many tiles.
_BGMV_MIN_K_CHUNK = THREADS * VECTOR
_SGMV_MIN_K_CHUNK = SGMV_TILE
_PASS_K = {"bgmv": 2 * _BGMV_MIN_K_CHUNK, "sgmv": SGMV_SHRINK_STAGES * SGMV_TILE}
# The split planner's costs, those of the roofline model (metrale_cli/bench/roofline.py): a
# streaming pass is one DRAM latency, a dependent load one L2 latency. Split-K's serial
# reduction (kernels/lora_common.cuh, split_last) writes each split's partial tile and has the
# last CTA read them back, at L2; its ticket is a fence and an atomic round trip, and the last
# CTA's reads are one round trip (BGMV: a partial a thread) or about one per split (SGMV: each
# thread's values a split, summed in order; split_reduction_round_trips). No memset: t is
# written once, by that CTA.
_DRAM_LATENCY_US = 0.6
_L2_LATENCY_US = 0.3
_L2_BYTES_PER_US = 10e6
TICKET_ROUND_TRIPS = 2


def split_reduction_round_trips(kind: str, splits: int, columns: int = SGMV_TILE) -> int:
    """The dependent L2 round trips split-K adds to the last CTA of a tile: its fence and
    ticket, then its reads of the partials (kernels/bgmv.cu, sgmv.cu): BGMV's in one; SGMV's
    SGMV_WIDE_SPLITS_PER_TRIP splits a round trip, or SGMV_SPLITS_PER_TRIP where the tile's
    rank columns (`columns`: the slices' side by side) fit in its first 16, and the splits left
    over one a round trip."""
    if splits == 1:
        return 0
    if kind == "bgmv":
        return TICKET_ROUND_TRIPS + 1
    per_trip = SGMV_SPLITS_PER_TRIP if columns <= 2 * VECTOR else SGMV_WIDE_SPLITS_PER_TRIP
    return TICKET_ROUND_TRIPS + splits // per_trip + splits % per_trip


def split_partial_bytes(kind: str, tiles: int, splits: int, columns: int | None = None) -> int:
    """Bytes split-K's partials move at L2 over `tiles` output tiles: each split's F32 tile
    written once and read once by the last CTA. SGMV with `columns` (its rank columns, the
    slices' side by side) within the first 16 of a tile (rank 16): only those 2 of the tile's 8
    column groups are stored and read (kernels/sgmv.cu)."""
    if splits == 1:
        return 0
    floats = PARTIAL_FLOATS[f"{kind}_shrink"]
    if kind == "sgmv" and columns is not None and columns <= 2 * VECTOR:
        floats //= 4
    return 2 * 4 * floats * tiles * splits


def shrink_cost_us(kind: str, num_tokens: int, in_dim: int, t_cols: int, splits: int,
                   num_sms: int, chunks: int | None = None) -> float:
    """The modelled time of a `kind` ("bgmv" or "sgmv") shrink cut into `splits` K splits: CTAs
    resident together (the launch bounds' per SM) run in waves, each CTA 2 metadata round trips
    and then ceil(split's K / a pass's K) streaming passes (the tail wave priced whole); split-K
    adds its reduction's round trips (split_reduction_round_trips, over the splits that have K)
    to the last wave and its partials' bytes at L2.
    `chunks`: SGMV's chunk count (segment_chunks; default one segment's, ceil(T / 64))."""
    if kind == "bgmv":
        base, kernel = num_tokens * -(-t_cols // SHRINK_ROWS), "bgmv_shrink"
        chunk = k_chunk(in_dim, splits, VECTOR)
    elif kind == "sgmv":
        rows = -(-num_tokens // SGMV_TILE) if chunks is None else chunks
        base = rows * -(-t_cols // SGMV_TILE)
        kernel, chunk = "sgmv_shrink", k_chunk(in_dim, splits, SGMV_TILE)
    else:
        raise ValueError(f"unknown shrink kind {kind!r}")
    ctas = max(base, 1) * splits
    resident = min(ctas, num_sms * min_ctas_per_sm(kernel))
    waves = -(-ctas // resident)
    stream = waves * (-(-chunk // _PASS_K[kind]) * _DRAM_LATENCY_US + 2 * _L2_LATENCY_US)
    # The splits that run: k_chunk may leave the last ones without K (they take no ticket).
    active = -(-in_dim // chunk)
    return (stream + split_reduction_round_trips(kind, active, t_cols) * _L2_LATENCY_US
            + split_partial_bytes(kind, max(base, 1), active, t_cols) / _L2_BYTES_PER_US)


def shrink_splits(kind: str, num_tokens: int, in_dim: int, t_cols: int, num_sms: int,
                  chunks: int | None = None) -> int:
    """The split-K count the `kind` ("bgmv" or "sgmv") shrink uses: the one of least modelled
    cost (shrink_cost_us), the fewest splits among equals, at most METRALE_MAX_SPLITS and never
    below one pass's K per split. `t_cols` is t's width: the batch's widest rank (or max_rank
    when that is unknown); `chunks` SGMV's chunk count."""
    least = _BGMV_MIN_K_CHUNK if kind == "bgmv" else _SGMV_MIN_K_CHUNK
    candidates = range(1, max(1, min(MAX_SPLITS, in_dim // least)) + 1)
    return min(candidates, key=lambda s: (round(shrink_cost_us(kind, num_tokens, in_dim, t_cols,
                                                               s, num_sms, chunks), 6), s))


# The SGMV expand's 64-output tiles per CTA are planned among 1..MAX_OUT_TILES.
MAX_OUT_TILES = 32


def sgmv_expand_stream_us(num_chunks: int, out_dim: int, t_cols: int, out_tiles: int,
                          num_sms: int) -> float:
    """The modelled streaming time of an SGMV expand whose CTAs take `out_tiles` 64-output
    tiles of one chunk each: waves of resident CTAs, each its 2 metadata round trips and then
    its (output tile, rank chunk) items, SGMV_EXPAND_STAGES in flight a pass (a tile's y
    loads are issued a tile ahead, behind its first item's copies: no round trip of their
    own)."""
    tiles = -(-out_dim // SGMV_TILE)
    per_cta = min(out_tiles, tiles) * -(-t_cols // SGMV_TILE)
    ctas = max(1, -(-tiles // out_tiles) * num_chunks)
    resident = min(ctas, num_sms * min_ctas_per_sm("sgmv_expand_bf16"))
    waves = -(-ctas // resident)
    return waves * (-(-per_cta // SGMV_EXPAND_STAGES) * _DRAM_LATENCY_US + 2 * _L2_LATENCY_US)


def expand_out_tiles(num_chunks: int, out_dim: int, t_cols: int, num_sms: int) -> int:
    """The 64-output tiles per CTA of an SGMV expand: the count of least modelled streaming
    time (sgmv_expand_stream_us), the fewest among equals. A CTA per (chunk, 64 outputs) is
    best where the chunks fill the device; small chunks (a segment per token) leave a CTA one
    small B tile after its metadata, and more tiles a CTA keep more of it in flight."""
    candidates = range(1, min(MAX_OUT_TILES, -(-out_dim // SGMV_TILE)) + 1)
    return min(candidates, key=lambda n: (round(sgmv_expand_stream_us(
        num_chunks, out_dim, t_cols, n, num_sms), 6), n))


# bgmv_expand's thread-to-data mapping (kernels/bgmv.cu, expand_rows): a CTA owns this many
# output rows; each B row's rank prefix (ceil(r / 8) 16-byte vectors) is read by a group of
# lanes_per_row(r) consecutive lanes, one vector each, so a warp load covers 32 / lanes rows and
# a pass (BGMV_EXPAND_STEPS loads per thread, one row each) covers STEPS x THREADS / lanes rows.
EXPAND_CTA_ROWS = THREADS * EXPAND_ROWS


def lanes_per_row(rank: int) -> int:
    """The lanes of a bgmv_expand group: the power of two at or above the rank's vectors."""
    vecs = max(1, -(-rank // VECTOR))
    return 1 << (vecs - 1).bit_length()


def expand_cta_passes(rows: int, rank: int) -> int:
    """Streaming passes of a bgmv_expand CTA over `rows` output rows at `rank`."""
    per_pass = EXPAND_STEPS * THREADS // lanes_per_row(rank)
    return max(1, -(-rows // per_pass))


def expand_cost_us(family: str, num_tokens: int, out_dim: int, t_cols: int,
                   num_chunks: int, num_sms: int) -> float:
    """The modelled time of a grouped decode batch's expand through `family`: "sgmv" (a CTA
    per chunk of the batch's `num_chunks` chunks of tokens sorted by slot and its
    expand_out_tiles 64-output tiles) or "bgmv" (a
    CTA per token and 1024 outputs, B read once per token). The larger of its streaming
    (waves of resident CTAs, each its passes and metadata round trips) and its L2 traffic at
    L2 bandwidth: the per-token expand re-reads B per token, which L2 must serve."""
    if family == "sgmv":
        stream = sgmv_expand_stream_us(num_chunks, out_dim, t_cols, expand_out_tiles(
            num_chunks, out_dim, t_cols, num_sms), num_sms)
        tiles = -(-out_dim // SGMV_TILE)
        l2 = 2 * out_dim * t_cols * num_chunks + 4 * t_cols * num_tokens * tiles
        return max(stream, l2 / _L2_BYTES_PER_US)
    if family != "bgmv":
        raise ValueError(f"unknown expand family {family!r}")
    ctas = max(1, num_tokens * -(-out_dim // EXPAND_CTA_ROWS))
    resident = min(ctas, num_sms * min_ctas_per_sm("bgmv_expand_bf16"))
    waves = -(-ctas // resident)
    # slot -> table beside ranks: 2 round trips; then the CTA's passes of its lane groups.
    passes = expand_cta_passes(min(EXPAND_CTA_ROWS, out_dim), t_cols)
    stream = waves * (passes * _DRAM_LATENCY_US + 2 * _L2_LATENCY_US)
    return max(stream, 2 * out_dim * t_cols * num_tokens / _L2_BYTES_PER_US)


def grouped_expand(num_tokens: int, out_dim: int, t_cols: int, num_chunks: int,
                   num_sms: int) -> bool:
    """Whether a grouped decode batch expands through SGMV too (else per token), whichever is
    modelled cheaper (expand_cost_us): SGMV reads each adapter's B once per chunk of up to 64
    tokens but a narrow output (k_proj, v_proj) over a few chunks leaves most SMs idle; the
    per-token expand fills the device but reads B once per token from L2."""
    return (expand_cost_us("sgmv", num_tokens, out_dim, t_cols, num_chunks, num_sms)
            <= expand_cost_us("bgmv", num_tokens, out_dim, t_cols, num_chunks, num_sms))
