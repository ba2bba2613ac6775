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
# CTA's reads are one round trip (BGMV: a partial a thread) or a few splits a round trip (SGMV:
# each thread's values a split, summed in order), as the machine code runs them (SPLIT_READS,
# split_reduction_round_trips). No memset: t is written once, by that CTA.
_DRAM_LATENCY_US = 0.6
_L2_LATENCY_US = 0.3
_L2_BYTES_PER_US = 10e6
TICKET_ROUND_TRIPS = 2

# The machine the model prices: an H200 (the roofline model's device, bench/roofline.py).
MODEL_ARCH = "sm_90"

# The last CTA's reads of the partials as ptxas (CUDA 13) compiles them, per arch and shape
# class: its reads in code order, each (splits an iteration, dependent L2 round trips an
# iteration, whether it loops). tests/test_kernels_sass.py reads them from each split kernel's
# machine code (sass.split_reads) for sm_80 and sm_90 and holds this table to it.
# - bgmv: one read, a partial a thread (every split in one round trip).
# - sgmv_narrow (the tile's rank rows in its first 16 columns, rank 16: 8 values a thread a
#   split): SGMV_SPLITS_PER_TRIP splits a round trip; the loop over the splits left after
#   them is unrolled by two, the odd split read on its own first, then two a round trip.
# - sgmv_wide (32 values a thread a split): SGMV_WIDE_SPLITS_PER_TRIP splits an iteration,
#   then one a round trip; on sm_90 that iteration's 64 loads a thread do not fit its
#   registers beside the sums (the launch bounds' 168): 54 are issued before the first add and
#   the other 10 after it, 2 round trips for the 2 splits.
SPLIT_READS: dict[str, dict[str, tuple[tuple[int, int, bool], ...]]] = {
    arch: {
        "bgmv": ((MAX_SPLITS, 1, False),),
        "sgmv_narrow": ((SGMV_SPLITS_PER_TRIP, 1, True), (1, 1, False), (2, 1, True)),
        "sgmv_wide": ((SGMV_WIDE_SPLITS_PER_TRIP, wide_trips, True), (1, 1, True)),
    }
    for arch, wide_trips in (("sm_80", 1), ("sm_90", 2))
}
# The partial values a thread of the last CTA reads a split (kernels/sgmv.cu: 4 of a column
# group's mma fragment values, 2 column groups at rank 16, all 8 otherwise).
SPLIT_READ_VALUES = {"sgmv_narrow": 2 * 4, "sgmv_wide": SGMV_TILE // 8 * 4}


def split_read_class(kind: str, columns: int = SGMV_TILE) -> str:
    """The shape class of a split tile's reads (SPLIT_READS): BGMV's; SGMV's narrow where its
    rank columns (the slices' side by side) lie in the first 16 of a tile, else wide."""
    if kind == "bgmv":
        return "bgmv"
    return "sgmv_narrow" if columns <= 2 * VECTOR else "sgmv_wide"


def read_round_trips(reads: tuple[tuple[int, int, bool], ...], splits: int) -> int:
    """The dependent round trips the reads (SPLIT_READS' form) take over `splits` partials: the
    kernels' loops take whole iterations, the largest first (each stops where fewer splits are
    left than an iteration reads), a straight read what is left of its size, once."""
    left, trips = splits, 0
    for size, per, repeats in sorted(reads, key=lambda r: -r[0]):
        if repeats:
            times = left // size
            trips, left = trips + times * per, left - times * size
        elif left:
            trips, left = trips + per, left - min(left, size)
    if left:
        raise ValueError(f"the reads {reads} leave {left} of {splits} splits unread")
    return trips


def split_reduction_round_trips(kind: str, splits: int, columns: int = SGMV_TILE,
                                arch: str = MODEL_ARCH) -> int:
    """The dependent L2 round trips split-K adds to the last CTA of a tile: its fence and
    ticket, then its reads of the partials as the machine code for `arch` runs them
    (SPLIT_READS; `columns`: SGMV's rank columns, the slices' side by side)."""
    if splits == 1:
        return 0
    reads = SPLIT_READS[arch][split_read_class(kind, columns)]
    return TICKET_ROUND_TRIPS + read_round_trips(reads, splits)


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
