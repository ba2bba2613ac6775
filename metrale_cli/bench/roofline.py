"""The roofline model of the LoRA delta kernels (`metrale bench kernels --model-only`), which needs
no GPU. For every benchmark shape it takes the launch plan the kernels would get (path, grid,
splits; the very planner of ops/plans.py), counts what each CTA does (bytes, streaming passes,
dependent loads) and charges every cost as a term (cost_terms: launch, HBM, L2, bytes in
flight, serial chains, critical path); the expected time is never below the largest. `run`
(bench/kernels.py) records the model's figure beside each measured one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from metrale_cli.ops import costs, plans, sources

DECODE_TOKENS = (1, 8, 32, 64, 128, 256)
PREFILL_TOKENS = (512, 2048, 4096, 8192)
DEFAULT_RANKS = (16, 64, 128)
# Device memory the rotation groups may take in all.
ROTATION_BUDGET_BYTES = 40 << 30


def compulsory_bytes(kind: str, tokens: int, adapters: int, rank: int, in_dim: int,
                     out_dim: int, y_bytes: int = 2) -> int:
    """Bytes a kernel must move at least (t is F32, every token adapted): distinct weights
    once, activations once, y read and written."""
    if kind == "shrink":
        return 2 * adapters * rank * in_dim + 2 * tokens * in_dim + 4 * tokens * rank
    if kind == "expand":
        return 2 * adapters * out_dim * rank + 4 * tokens * rank + 2 * y_bytes * tokens * out_dim
    raise ValueError(f"unknown kernel kind {kind!r}")


# --- the roofline model (no GPU needed) --------------------------------------------------------


@dataclass(frozen=True)
class ModelDevice:
    """What the model assumes of the device: an H200 by default."""

    name: str = "H200 (model)"
    sms: int = 132
    peak_bytes_per_s: float = 4.8e12  # nominal HBM bandwidth
    copy_fraction: float = 4.3 / 4.8  # a device-to-device copy's share of it, measured on an H200
    latency_s: float = 0.6e-6  # loaded DRAM latency: what one streaming round trip costs
    l2_latency_s: float = 0.3e-6  # a dependent load that hits L2 (metadata, split partials)
    l2_bytes_per_s: float = 10e12  # what the L2 serves, hits and misses together
    l2_bytes: int = 50 << 20  # L2 size: the benchmark's rotation groups are sized against it
    launch_s: float = 2.0e-6  # a kernel node's launch and drain, even inside a CUDA graph
    # A kernel that reads and writes y streams at this share of the copy at best (the copy's
    # reads and writes are one pass each; y's read-modify-write waits on its loads).
    rmw_fraction: float = 0.88


# The kernels' targets: share of nominal peak in the bandwidth regime (compulsory traffic
# of at least 64 MB), and at most 1.3x an equal-bytes copy below it, where a fixed latency
# dominates whatever the kernel does.
TARGET_PCT = {("decode", "shrink"): 80.0, ("decode", "expand"): 75.0,
              ("prefill", "shrink"): 70.0, ("prefill", "expand"): 70.0}
BANDWIDTH_REGIME_BYTES = 64 << 20
COPY_RATIO_TARGET = 1.3
_LOAD_BYTES = 16
# The cost terms of a record (microseconds each), in the order the binding one is reported.
TERMS = ("launch", "hbm", "l2", "in_flight", "serial", "critical_path", "tail")


@dataclass(frozen=True)
class LaunchWork:
    """What one planned launch asks of the memory system, counted from its grid and its CTAs'
    work (the model's inputs; tests/test_kernels_model.py ties them to kernels.plan_*):

    - `l2_bytes`: the distinct bytes its loads and stores ask for (L2 hits included; clamped
      duplicates and predicated-off loads not counted, as they move nothing new);
    - `passes`: streaming round trips summed over the CTAs: each is one DRAM latency in which
      a CTA has one pass of loads in flight (an SGMV pipeline's stages, a pass of B vectors);
    - `chains`: dependent scalar round trips summed over the CTAs, each an L2 latency: the
      slot -> table[slot] chain beside ranks[slot], an SGMV CTA's chunk -> table[slot];
    - `cta_passes`, `cta_chains`: the heaviest CTA's (the critical path);
    - `launches`: graph nodes it takes (one: split-K needs no memset of t).
    """

    kernel: str
    path: str
    grid: tuple[int, int, int]
    splits: int
    l2_bytes: int
    passes: int
    chains: int
    cta_passes: int
    cta_chains: int
    launches: int = 1

    @property
    def ctas(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]


def decode_slots(tokens: int, adapters: int) -> np.ndarray:
    """The benchmark's decode batch: adapters interleaved over the tokens, as requests arrive."""
    return (np.arange(tokens) % adapters).astype(np.int32)


def prefill_starts(tokens: int, adapters: int) -> np.ndarray:
    """The benchmark's prefill segments: `adapters` equal runs of sorted tokens."""
    return (np.arange(adapters + 1, dtype=np.int64) * tokens // adapters).astype(np.int32)


def _split_lengths(in_dim: int, splits: int, multiple: int) -> np.ndarray:
    """K elements of each split, as costs.k_chunk cuts them (trailing splits may be empty)."""
    chunk = costs.k_chunk(in_dim, splits, multiple)
    return np.clip(in_dim - chunk * np.arange(splits), 0, chunk)


def plan_launch(kind: str, tokens: int, adapters: int, rank: int, in_dim: int, out_dim: int,
                sms: int, y_bytes: int = 2) -> LaunchWork:
    """The launch a benchmark shape gets, and its work: decode (<= 256 tokens) through
    plans.plan_batch (grouped or per-token), prefill through SGMV over sorted segments; t as
    wide as the rank, max_rank the rank (the benchmark's pools)."""
    y_kind = "bf16" if y_bytes == 2 else "f32"
    if tokens > 256:
        grouped, path = True, "segments"
        chunks = plans.segment_chunks(prefill_starts(tokens, adapters),
                                      np.arange(adapters, dtype=np.int32), tokens)
    else:
        plan = plans.plan_batch(decode_slots(tokens, adapters), [rank] * adapters, rank)
        grouped, path = plan.grouped, "grouped" if plan.grouped else "per-token"
        chunks = plan.chunks
    family = "sgmv" if grouped else "bgmv"
    splits = costs.shrink_splits(family, tokens, in_dim, rank, sms,
                                 len(chunks) if grouped else None)
    if kind == "expand" and path == "grouped" and not costs.grouped_expand(
            tokens, out_dim, rank, len(chunks), sms):
        family, path = "bgmv", "grouped+per-token"
    kernel = f"{family}_shrink" if kind == "shrink" else f"{family}_expand_{y_kind}"
    out_tiles = costs.expand_out_tiles(len(chunks), out_dim, rank, sms) if (
        kernel.startswith("sgmv_expand")) else 1
    grid = plans.launch_grid(kernel, tokens if family == "bgmv" else len(chunks),
                             in_dim if kind == "shrink" else out_dim, rank,
                             splits if kind == "shrink" else 1, out_tiles)
    if family == "bgmv":
        work = _bgmv_work(kind, grid, tokens, rank, in_dim, out_dim, splits, y_bytes)
    else:
        work = _sgmv_work(kind, grid, chunks, tokens, rank, in_dim, out_dim, splits, y_bytes,
                          out_tiles)
    return LaunchWork(kernel, path, grid, splits, *work)


def _bgmv_work(kind: str, grid: tuple[int, int, int], tokens: int, rank: int, in_dim: int,
               out_dim: int, splits: int, y_bytes: int) -> tuple[int, int, int, int, int]:
    """(l2_bytes, passes, chains, cta_passes, cta_chains) of a BGMV launch, every token adapted
    at `rank` (kernels/bgmv.cu). The shrink's splits reduce through the workspace: their
    partials written and read back at L2, and the last CTA of a tile waits for its ticket and
    its reads (costs.split_reduction_round_trips)."""
    if kind == "shrink":
        # A CTA: 4 rank rows of one token over one split; a pass is 2 K steps of 128 x 8
        # elements (x and 4 A rows); slot -> table, ranks first.
        step = 2 * sources.THREADS * sources.VECTOR
        lengths = _split_lengths(in_dim, splits, sources.VECTOR)
        per_token_rows = grid[1]
        passes = tokens * per_token_rows * int((-(-lengths // step)).sum())
        tiles = tokens * per_token_rows
        l2 = (tiles * (2 * (1 + sources.SHRINK_ROWS) * in_dim + 4 * sources.SHRINK_ROWS)
              + costs.split_partial_bytes("bgmv", tiles, splits))
        # The splits that run: k_chunk can leave the last ones without K (they return and take
        # no ticket), so the last CTA waits for and reads the active ones only.
        active = int((lengths > 0).sum())
        l2 += costs.split_partial_bytes("bgmv", tiles, active) - costs.split_partial_bytes(
            "bgmv", tiles, splits)
        reduction = costs.split_reduction_round_trips("bgmv", active)
        chains = 2 * tiles * splits + tiles * reduction
        return l2, passes, chains, int(-(-lengths.max() // step)), 2 + reduction
    # expand: a CTA is 1024 output rows of one token; slot -> table beside ranks (2 round
    # trips), then passes of BGMV_EXPAND_STEPS rows per thread, its t values loaded beside the
    # first; L2 serves the sectors its B loads touch, its t vectors and y read and written.
    blocks = grid[1]
    rows = np.minimum(costs.EXPAND_CTA_ROWS, out_dim - costs.EXPAND_CTA_ROWS * np.arange(blocks))
    per_cta = [costs.expand_cta_passes(int(r), rank) for r in rows]
    vecs = -(-rank // sources.VECTOR)
    l2 = tokens * (_SECTOR * expand_b_sectors(out_dim, rank, rank) + 2 * y_bytes * out_dim
                   + blocks * 4 * sources.VECTOR * vecs)
    ctas = tokens * blocks
    return l2, tokens * sum(per_cta), ctas * 2, max(per_cta), 2


_SECTOR = 32  # bytes: the unit L2 and HBM move


def expand_b_sectors(out_dim: int, rank: int, max_rank: int) -> int:
    """32-byte sectors that bgmv_expand's B loads touch over `out_dim` rows: each warp load's
    rows (32 / lanes_per_row consecutive ones) read their rank prefixes (ceil(r / 8) vectors)
    at B's row pitch of max_rank x 2 bytes; a sector two rows of one load share is one, while
    the same sector met by two loads counts twice (each asks L2 for it). Below the pitch the
    prefixes leave gaps: what the rows' padding columns cost is only the sectors they share."""
    prefix = sources.VECTOR * 2 * -(-rank // sources.VECTOR)
    pitch = 2 * max_rank
    start = np.arange(out_dim, dtype=np.int64) * pitch
    first, last = start // _SECTOR, (start + prefix - 1) // _SECTOR
    sectors = int((last - first + 1).sum())
    per_load = 32 // costs.lanes_per_row(rank)
    shared = (first[1:] == last[:-1]) & (np.arange(1, out_dim) % per_load != 0)
    return sectors - int(shared.sum())


def _sgmv_work(kind: str, grid: tuple[int, int, int], chunks: np.ndarray, tokens: int,
               rank: int, in_dim: int, out_dim: int, splits: int, y_bytes: int,
               out_tiles: int = 1, slices: int = 1) -> tuple[int, int, int, int, int]:
    """(l2_bytes, passes, chains, cta_passes, cta_chains) of an SGMV launch (kernels/sgmv.cu):
    a CTA per (chunk, column tile) of the work list `chunks` (plans.segment_chunks; the
    expand's CTA takes `out_tiles` 64-output tiles), its K tiles (shrink) or (output tile, rank
    chunk) items (expand) streamed SGMV_*_STAGES at a time, so a pass is that many tiles; rows
    outside the chunk are zero-filled, not loaded. Before its stream a CTA waits for 2 round
    trips: its chunk, then its slot's table entry (beside the rank, the scale and the token
    order). Fused `slices` (the shrink only; kernels/sgmv.cu): the column tiles run over the
    slices' rank columns side by side, t is a plane a slice."""
    tile = sources.SGMV_TILE
    rows = (chunks[:, 1] - chunks[:, 0]).astype(np.int64)
    ctas = grid[0] * grid[1] * grid[2]
    if kind == "shrink":
        lengths = _split_lengths(in_dim, splits, tile)
        # Rank rows per column tile (t as wide as the rank: every column of every slice).
        n_valid = np.minimum(tile, slices * rank - tile * np.arange(grid[0]))
        # An empty trailing split returns after its metadata, streaming nothing.
        k_tiles = -(-lengths // tile)
        split_passes = -(-k_tiles // sources.SGMV_SHRINK_STAGES)
        passes = grid[0] * grid[1] * int(split_passes.sum())
        # x once per column tile (each chunk's rows), A once per chunk, t once; split-K's
        # partials written and read back, and the last CTA's ticket and reads as chains.
        tiles = grid[0] * grid[1]
        active = int((lengths > 0).sum())  # the splits that run (as in _bgmv_work)
        partials = costs.split_partial_bytes("sgmv", tiles, active, slices * rank)
        l2 = int(2 * in_dim * (grid[0] * rows.sum() + grid[1] * n_valid.sum())
                 + 4 * tokens * slices * rank + partials)
        reduction = costs.split_reduction_round_trips("sgmv", active, slices * rank)
        return (l2, passes, 2 * ctas + tiles * reduction, int(split_passes.max()),
                2 + reduction)
    # expand: the items (an output tile's B tile with its rank chunk's t tile; t is copied
    # again for every output tile), SGMV_EXPAND_STAGES a pass; an output tile's y vectors are
    # loaded a tile ahead (the first tile's with the prologue), right behind the copies of its
    # first item, so they add no round trip (the SASS check's pipeline_round_trips is 0), and
    # their stores wait for nothing.
    rank_chunks = -(-rank // tile)
    tiles = -(-out_dim // tile)
    per_column = np.minimum(out_tiles, tiles - out_tiles * np.arange(grid[0])) * rank_chunks
    column_passes = -(-per_column // sources.SGMV_EXPAND_STAGES)
    l2 = int(2 * out_dim * rank * grid[1] + tiles * 4 * rank * rows.sum()
             + 2 * y_bytes * out_dim * rows.sum())
    return (l2, grid[1] * int(column_passes.sum()), 2 * ctas, int(column_passes.max()), 2)


def rotation_groups(nbytes: int, footprint: int, l2_bytes: int, l2_multiple: float = 3.0) -> int:
    """How many rotation groups the benchmark cycles through for a shape (each with its own
    buffers) so that G x compulsory bytes >= l2_multiple x the L2: at most 64, and within the
    rotation memory budget."""
    groups = max(1, math.ceil(l2_multiple * l2_bytes / nbytes))
    return min(groups, 64, max(1, ROTATION_BUDGET_BYTES // footprint))


def footprint_bytes(tokens: int, adapters: int, rank: int, in_dim: int, out_dim: int) -> int:
    """Device bytes one rotation group holds: the pool's A and B, x, y and t."""
    return (2 * adapters * rank * (in_dim + out_dim) + 2 * tokens * (in_dim + out_dim)
            + 4 * tokens * rank)


def model_record(module: str, out_dim: int, in_dim: int, rank: int, tokens: int, adapters: int,
                 kind: str, device: ModelDevice | None = None) -> dict[str, Any]:
    """The roofline model's record for one kernel and shape: its launch plan (plan_launch),
    each cost term in microseconds (`terms`, cost_terms explains them), the term that binds,
    and the expected time against an equal-bytes copy."""
    device = device or ModelDevice()
    phase = "decode" if tokens <= 256 else "prefill"
    work = plan_launch(kind, tokens, adapters, rank, in_dim, out_dim, device.sms)
    nbytes = compulsory_bytes(kind, tokens, adapters, rank, in_dim, out_dim)
    cost = cost_terms(work, nbytes, device, rmw=kind == "expand")
    target = TARGET_PCT[phase, kind]
    meets = (cost["expected_pct_peak"] >= target if cost["regime"] == "bandwidth"
             else cost["expected_copy_ratio"] <= COPY_RATIO_TARGET)
    footprint = footprint_bytes(tokens, adapters, rank, in_dim, out_dim)
    groups = rotation_groups(nbytes, footprint, device.l2_bytes)
    return {
        "kernel": work.kernel, "path": work.path, "module": module, "out_dim": out_dim,
        "in_dim": in_dim, "rank": rank, "tokens": tokens, "adapters": adapters,
        "splits": work.splits, "grid": list(work.grid), **cost,
        "target_pct_peak": target, "target_copy_ratio": COPY_RATIO_TARGET,
        "meets_target": meets,
        # What the benchmark's rotation groups read, all together, fits in L2: a measurement
        # then reads L2, not HBM.
        "rotation_groups": groups, "l2_resident": groups * nbytes <= device.l2_bytes,
    }


# The 16-byte loads per thread one streaming pass of each dense kernel issues in its source: a
# pass costs one latency only while the machine code keeps them all in flight before the first
# use (the SASS check's count, sources.loads_in_flight); fewer, and the pass takes
# ceil(these / that) round trips.
PASS_LOADS = {
    "bgmv_shrink": sources.CONFIG["BGMV_SHRINK_STEPS"] * (1 + sources.SHRINK_ROWS),
    "bgmv_expand": sources.CONFIG["BGMV_EXPAND_STEPS"],
    # The pipelines' stages, each tile 4 x and 4 A vectors per thread (shrink) or 8 t and 4 B
    # vectors (expand), all in flight at each wait (cp.async: tests/test_kernels_sass.py).
    "sgmv_shrink": sources.SGMV_SHRINK_STAGES * (4 + 4),
    "sgmv_expand": sources.SGMV_EXPAND_STAGES * (8 + 4),
}


def pass_round_trips(kernel: str) -> int:
    """DRAM round trips one streaming pass of `kernel` takes as its machine code issues it."""
    family = kernel.removesuffix("_bf16").removesuffix("_f32")
    if family not in PASS_LOADS:
        return 1
    return -(-PASS_LOADS[family] // sources.loads_in_flight(kernel))


def cost_terms(work: LaunchWork, nbytes: int, device: ModelDevice,
               rmw: bool = False) -> dict[str, Any]:
    """Every cost of one launch that moves `nbytes` compulsory bytes, in microseconds:

    - `launch`: a kernel node's launch and drain (the floor of any kernel), per graph node;
    - `hbm`: the compulsory bytes at the copy's bandwidth (`rmw`: at rmw_fraction of it, for a
      kernel that reads and writes y);
    - `l2`: every byte the loads and stores ask for (`l2_bytes`) at L2 bandwidth;
    - `in_flight`: Little's law over the distinct bytes in flight: each streaming pass of a
      CTA costs a DRAM latency, CTAs resident together (at most the launch bounds' per SM)
      overlapping;
    - `serial`: the dependent scalar loads (L2 round trips), overlapped the same way;
    - `critical_path`: the heaviest CTA alone, its passes and its chains back to back;
    - `tail`: where the CTAs are uniform (every one the heaviest's passes), ceil(waves) of them
      back to back: a grid of 1.3 waves runs two, the last one part full, which `in_flight`
      (the passes spread over the resident slots) prices as 1.3; 0 where CTAs differ.

    expected_us = max(launch, latency + max(hbm, l2), in_flight + serial, critical_path, tail):
    never below any term. `binding` names the largest (`serial` where in_flight + serial binds
    and the chains are the larger part). The copy of the same bytes takes
    max(launch, latency + bytes at copy bandwidth)."""
    resident = min(work.ctas, device.sms * sources.min_ctas_per_sm(work.kernel))
    trips = pass_round_trips(work.kernel)
    copy_bw = device.copy_fraction * device.peak_bytes_per_s
    terms = {
        "launch": device.launch_s * work.launches,
        "hbm": nbytes / (copy_bw * (device.rmw_fraction if rmw else 1.0)),
        "l2": work.l2_bytes / device.l2_bytes_per_s,
        "in_flight": device.latency_s * trips * work.passes / max(resident, 1),
        "serial": device.l2_latency_s * work.chains / max(resident, 1),
        "critical_path": (device.latency_s * trips * work.cta_passes
                          + device.l2_latency_s * work.cta_chains),
    }
    uniform = work.passes == work.ctas * work.cta_passes
    terms["tail"] = (-(-work.ctas // max(resident, 1)) * terms["critical_path"] if uniform
                     else 0.0)
    streamed = terms["in_flight"] + terms["serial"]
    # A stream of bytes also waits one DRAM latency for its first load, as the copy does.
    expected_s = max(terms["launch"], device.latency_s + max(terms["hbm"], terms["l2"]),
                     streamed, terms["critical_path"], terms["tail"])
    binding = max(TERMS, key=lambda name: streamed if name == "in_flight" else terms[name])
    if binding == "in_flight" and terms["serial"] > terms["in_flight"]:
        binding = "serial"
    copy_s = max(device.launch_s, device.latency_s + nbytes / copy_bw)
    per_pass = work.l2_bytes / max(trips * work.passes, 1)
    return {
        "ctas": work.ctas, "ctas_per_sm": sources.min_ctas_per_sm(work.kernel),
        "waves": work.ctas / (device.sms * sources.min_ctas_per_sm(work.kernel)),
        "loads_per_thread": sources.loads_in_flight(work.kernel),
        # Distinct bytes a resident CTA has in flight per pass, times the CTAs per SM.
        "in_flight_per_sm_bytes": round(per_pass * resident / device.sms),
        "needed_in_flight_per_sm_bytes": round(copy_bw * device.latency_s / device.sms),
        "bytes": nbytes, "l2_bytes": work.l2_bytes, "passes": work.passes,
        "chains": work.chains,
        "terms": {name: value * 1e6 for name, value in terms.items()},
        "binding": binding,
        "expected_us": expected_s * 1e6,
        "expected_pct_peak": 100 * nbytes / expected_s / device.peak_bytes_per_s,
        "copy_us": copy_s * 1e6, "expected_copy_ratio": expected_s / copy_s,
        "regime": "bandwidth" if nbytes >= BANDWIDTH_REGIME_BYTES else "latency",
        "device": device.name,
        "peak_tb_per_s": device.peak_bytes_per_s / 1e12, "latency_us": device.latency_s * 1e6,
    }


def stream_model(kernel: str, grid: tuple[int, int, int], requested_bytes: int, nbytes: int,
                 device: ModelDevice, pass_bytes: int | None = None) -> dict[str, Any]:
    """cost_terms for a launch known only by its grid and the bytes its loads ask for (the
    expert kernels): each CTA streams its share of `requested_bytes` in passes of
    `pass_bytes` distinct bytes (default: the loads per thread that the SASS check holds,
    lora_config.h, all distinct), after the slot -> table chain."""
    ctas = grid[0] * grid[1] * grid[2]
    per_pass = pass_bytes or sources.loads_in_flight(kernel) * _LOAD_BYTES * sources.THREADS
    cta_passes = max(1, math.ceil(requested_bytes / ctas / per_pass))
    work = LaunchWork(kernel, "", grid, 1, requested_bytes, ctas * cta_passes, 2 * ctas,
                      cta_passes, 2)
    return cost_terms(work, nbytes, device, rmw=kernel.startswith(("expert_expand", "router")))


def bench_shapes(model_shapes: Sequence[tuple[str, int, int]], ranks: Sequence[int],
            tokens: Sequence[int], adapters: Sequence[int] | None,
            ) -> list[tuple[str, int, int, int, int, int]]:
    """(module, out_dim, in_dim, rank, tokens, adapters) of every benchmark shape."""
    shapes = []
    for module, out_dim, in_dim in model_shapes:
        for rank in ranks:
            for num_tokens in tokens:
                counts = sorted({min(a, num_tokens) for a in (adapters or (1, 8, num_tokens))})
                shapes.extend((module, out_dim, in_dim, rank, num_tokens, count)
                              for count in counts)
    return shapes


# The projections a layer fuses into one launch because they read the same x, as vLLM serves
# its qkv_proj and gate_up_proj (kernels.bgmv_fused, kernels.sgmv_fused).
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def fused_groups(model_shapes: Sequence[tuple[str, int, int]]
                 ) -> list[tuple[tuple[tuple[str, int], ...], int]]:
    """The FUSED_GROUPS whose modules are all among `model_shapes` with one in_dim: each as its
    ((module, out_dim) per slice, in_dim)."""
    by_name = {name: (out_dim, in_dim) for name, out_dim, in_dim in model_shapes}
    groups = []
    for names in FUSED_GROUPS:
        if all(n in by_name for n in names) and len({by_name[n][1] for n in names}) == 1:
            groups.append((tuple((n, by_name[n][0]) for n in names), by_name[names[0]][1]))
    return groups


def fused_work(kind: str, slices: Sequence[int], tokens: int, adapters: int, rank: int,
               in_dim: int, sms: int, y_bytes: int = 2) -> LaunchWork:
    """The one `kind` launch the fused launchers make over slices of these out_dims, on the
    path plan_launch gives the shape: per token (kernels.bgmv_fused: the shrink's grid.z is
    (slice, split)), grouped decode (bgmv_fused on a grouped batch) or prefill
    (kernels.sgmv_fused), where the SGMV shrink's column tiles run over the slices' rank
    columns side by side and the expand takes the slice on grid.z; split as the planner splits
    the launch's CTAs. The expand's grid covers the widest slice, and a narrower slice's spare
    CTAs read their metadata (BGMV: slot, then table entry and rank; SGMV: the slice's column
    bounds alone), then exit."""
    count, widest_out, total_out = len(slices), max(slices), sum(slices)
    y_kind = "bf16" if y_bytes == 2 else "f32"
    if tokens > 256:
        path, chunks = "segments", plans.segment_chunks(
            prefill_starts(tokens, adapters), np.arange(adapters, dtype=np.int32), tokens)
    else:
        plan = plans.plan_batch(decode_slots(tokens, adapters), [rank] * adapters, rank)
        path, chunks = ("grouped", plan.chunks) if plan.grouped else ("per-token", None)
    if chunks is not None and kind == "shrink":
        splits = costs.shrink_splits("sgmv", tokens, in_dim, count * rank, sms, len(chunks))
        grid = plans.launch_grid("sgmv_shrink", len(chunks), in_dim, rank, splits,
                                 slices=count)
        work = _sgmv_work(kind, grid, chunks, tokens, rank, in_dim, 0, splits, y_bytes,
                          slices=count)
        return LaunchWork("sgmv_shrink", f"{path} (fused)", grid, splits, *work)
    if chunks is not None and (path == "segments" or costs.grouped_expand(
            tokens, total_out, rank, len(chunks), sms)):
        kernel = f"sgmv_expand_{y_kind}"
        out_tiles = costs.expand_out_tiles(count * len(chunks), widest_out, rank, sms)
        widest = plans.launch_grid(kernel, len(chunks), widest_out, rank, out_tiles=out_tiles,
                                   slices=count)
        l2 = passes = chains = cta_passes = 0
        for out_dim in slices:
            grid = plans.launch_grid(kernel, len(chunks), out_dim, rank, out_tiles=out_tiles)
            work = _sgmv_work(kind, grid, chunks, tokens, rank, in_dim, out_dim, 1, y_bytes,
                              out_tiles)
            # A spare CTA reads its slice's column bounds (8 bytes), then exits.
            spare = len(chunks) * (widest[0] - grid[0])
            l2 += work[0] + spare * 8
            passes += work[1]
            chains += work[2] + spare
            cta_passes = max(cta_passes, work[3])
        return LaunchWork(kernel, f"{path} (fused)", widest, 1, l2, passes, chains, cta_passes,
                          2)
    if kind == "shrink":
        splits = costs.shrink_splits("bgmv", count * tokens, in_dim, rank, sms)
        grid = plans.launch_grid("bgmv_shrink", tokens, in_dim, rank, splits)
        l2, passes, chains, cta_passes, cta_chains = _bgmv_work(
            kind, grid, tokens, rank, in_dim, slices[0], splits, y_bytes)
        return LaunchWork("bgmv_shrink", "per-token (fused)", (grid[0], grid[1], count * splits),
                          splits, count * l2, count * passes, count * chains, cta_passes,
                          cta_chains)
    kernel = f"bgmv_expand_{y_kind}"
    widest = plans.launch_grid(kernel, tokens, widest_out, rank, slices=count)
    l2 = passes = chains = 0
    for out_dim in slices:
        grid = plans.launch_grid(kernel, tokens, out_dim, rank)
        work = _bgmv_work(kind, grid, tokens, rank, in_dim, out_dim, 1, y_bytes)
        spare = tokens * (widest[1] - grid[1])
        l2 += work[0]
        passes += work[1]
        chains += work[2] + 2 * spare
    cta_passes = costs.expand_cta_passes(min(costs.EXPAND_CTA_ROWS, widest_out), rank)
    path = "per-token (fused)" if path == "per-token" else "grouped+per-token (fused)"
    return LaunchWork(kernel, path, widest, 1, l2, passes, chains, cta_passes, 2)


def fused_bytes(kind: str, slices: Sequence[int], tokens: int, adapters: int, rank: int,
                in_dim: int) -> int:
    """The compulsory bytes of a fused group's `kind` launch: its slices' own, but x once
    (the slices share it: a fused shrink needs it from HBM once, whatever L2 re-serves)."""
    total = sum(compulsory_bytes(kind, tokens, adapters, rank, in_dim, out) for out in slices)
    return total - (len(slices) - 1) * 2 * tokens * in_dim if kind == "shrink" else total


def fused_record(slices: Sequence[tuple[str, int]], in_dim: int, rank: int, tokens: int,
                 adapters: int, kind: str, device: ModelDevice | None = None
                 ) -> dict[str, Any]:
    """The model's record for a fused group's one `kind` launch (fused_work) on the shape's
    path (per token, grouped decode or prefill), beside `unfused_us`, what its slices'
    separate launches take together."""
    device = device or ModelDevice()
    phase = "decode" if tokens <= 256 else "prefill"
    outs = [out for _, out in slices]
    work = fused_work(kind, outs, tokens, adapters, rank, in_dim, device.sms)
    nbytes = fused_bytes(kind, outs, tokens, adapters, rank, in_dim)
    cost = cost_terms(work, nbytes, device, rmw=kind == "expand")
    separate = [model_record(name, out, in_dim, rank, tokens, adapters, kind, device)
                for name, out in slices]
    target = TARGET_PCT[phase, kind]
    meets = (cost["expected_pct_peak"] >= target if cost["regime"] == "bandwidth"
             else cost["expected_copy_ratio"] <= COPY_RATIO_TARGET)
    footprint = sum(footprint_bytes(tokens, adapters, rank, in_dim, out) for out in outs)
    groups = rotation_groups(nbytes, footprint, device.l2_bytes)
    return {
        "kernel": work.kernel, "path": work.path, "module": "+".join(n for n, _ in slices),
        "out_dim": sum(outs), "slice_out_dims": outs,
        "in_dim": in_dim, "rank": rank, "tokens": tokens, "adapters": adapters,
        "splits": work.splits, "grid": list(work.grid), **cost,
        "target_pct_peak": target, "target_copy_ratio": COPY_RATIO_TARGET,
        "meets_target": meets, "rotation_groups": groups,
        "l2_resident": groups * nbytes <= device.l2_bytes,
        "unfused_us": sum(r["expected_us"] for r in separate),
    }


def model(
    model_shapes: Sequence[tuple[str, int, int]],
    ranks: Sequence[int] = DEFAULT_RANKS,
    tokens: Sequence[int] = DECODE_TOKENS + PREFILL_TOKENS,
    adapters: Sequence[int] | None = None,
    device: ModelDevice | None = None,
) -> list[dict[str, Any]]:
    """The roofline model's records for the shapes `run` would measure (no GPU needed), then
    those of each fused group (fused_groups) on every shape (fused_record)."""
    records = [model_record(module, out_dim, in_dim, rank, num_tokens, count, kind, device)
               for module, out_dim, in_dim, rank, num_tokens, count in bench_shapes(
                   model_shapes, ranks, tokens, adapters)
               for kind in ("shrink", "expand")]
    for slices, in_dim in fused_groups(model_shapes):
        for _, _, _, rank, num_tokens, count in bench_shapes([("", 0, in_dim)], ranks, tokens,
                                                        adapters):
            records.extend(fused_record(slices, in_dim, rank, num_tokens, count, kind, device)
                           for kind in ("shrink", "expand"))
    return records
