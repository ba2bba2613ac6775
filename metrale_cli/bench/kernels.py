"""`metrale bench kernels`: the LoRA delta kernels against the limit and against torch, as
records (one dict per kernel and shape, its setup embedded). Two things:

- `model`: a roofline model that needs no GPU (`metrale bench kernels --model-only`). For every
  benchmark shape it takes the launch plan the kernels would get (path, grid, splits), counts
  what each CTA does (bytes, streaming passes, dependent loads) and charges every cost as a term
  (cost_terms: launch, HBM, L2, bytes in flight, serial chains, critical path); the expected
  time is never below the largest.
- `run`: the GPU measurement of the same shapes, which records the model's figure beside the
  measured one.

Measurement method (docs/bench.md, after the research notes on kernel benchmarking that the
kernels issue cites):
- Validate first: every shape's kernels are checked against reference.py (on a sample of rows)
  before anything is timed; a mismatch raises.
- Defeat the L2: G rotation groups, each with its own x, y, t, weights and pointer tables, with
  G x (compulsory bytes of one call) >= l2_multiple x the L2 size read from the device.
- Time CUDA-graph replays: the G calls are captured once (CuPy stream capture; torch baselines
  with torch.cuda.graph), replayed `repeats` times between CUDA events after >= 25 ms of warm-up;
  one sample = replay time / G. Host launch cost is thereby out of the number.
- Report against the limit: compulsory bytes (compulsory_bytes), achieved TB/s, % of the
  nominal peak (memoryClockRate x busWidth from the device), % of an equal-bytes
  device-to-device copy timed the same way in the same run, the speedup over the best torch
  baseline in the same run, and the roofline model's expected time beside the measured one.

`run` needs CuPy and a device (NoDevice otherwise); torch baselines need a CUDA build of torch
and are recorded as absent without one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from metrale_cli import compat
from metrale_cli.errors import ToolMissing, UsageError
from metrale_cli.files.atomic import atomic_write
from metrale_cli.model.config import ModelConfig
from metrale_cli.model.modules import LoraModule
from metrale_cli.ops import kernels, reference

DECODE_TOKENS = (1, 8, 32, 64, 128, 256)
PREFILL_TOKENS = (512, 2048, 4096, 8192)
DEFAULT_RANKS = (16, 64, 128)
WARMUP_SECONDS = 0.025
# Baselines that materialise per-token weights (gather + bmm) are skipped above this many bytes,
# and the per-adapter loop above this many adapters (its graph would hold thousands of launches).
_GATHER_LIMIT_BYTES = 8 << 30
_LOOP_LIMIT_ADAPTERS = 512
# Device memory the rotation groups may take in all.
_ROTATION_BUDGET_BYTES = 40 << 30
_VALIDATE_ROWS = 64


@dataclass(frozen=True)
class Device:
    name: str
    sms: int
    l2_bytes: int
    peak_bytes_per_s: float  # nominal: 2 (DDR) x memory clock x bus width
    peak_source: str = "memory clock x bus width"


# Nominal HBM bandwidth by device name, for when the memory clock cannot be read.
_KNOWN_PEAKS = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.04e12}


def memory_clock_khz(attributes: Any, query: Callable[[], int] | None) -> int | None:
    """The memory clock in kHz, or None where the device does not report it. CUDA 13 dropped
    cudaDeviceProp.memoryClockRate, and CuPy's attribute table may lack the entry or hold 0;
    `query` asks the runtime for cudaDevAttrMemoryClockRate directly."""
    try:
        value = int(attributes["MemoryClockRate"])
    except (KeyError, TypeError, ValueError):
        value = 0
    if value <= 0 and query is not None:
        try:
            value = int(query())
        except Exception:  # noqa: BLE001 - any runtime refusal means "not reported"
            value = 0
    return value if value > 0 else None


def peak_bandwidth(name: str, clock_khz: int | None, bus_bits: int | None) -> tuple[float, str]:
    """Nominal peak HBM bytes/s and where it came from: 2 (DDR) x clock x bus width when both
    are known, else the known figure for the device's name; ToolMissing when neither."""
    if clock_khz and bus_bits:
        return 2 * clock_khz * 1e3 * bus_bits / 8, "memory clock x bus width"
    for key, peak in _KNOWN_PEAKS.items():
        if key in name:
            return peak, f"the nominal figure for {key} (the device reports no memory clock)"
    raise ToolMissing(f"{name} reports no memory clock or bus width, so its peak bandwidth is "
                      "unknown")


_ATTRIBUTE_MEMORY_CLOCK = 36  # cudaDevAttrMemoryClockRate


def device_info() -> Device:
    cupy = compat.cupy_module()
    device = cupy.cuda.Device()
    attributes = device.attributes
    name = cupy.cuda.runtime.getDeviceProperties(device.id)["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    clock = memory_clock_khz(attributes, lambda: cupy.cuda.runtime.deviceGetAttribute(
        _ATTRIBUTE_MEMORY_CLOCK, device.id))
    bus = attributes.get("GlobalMemoryBusWidth") if hasattr(attributes, "get") else None
    peak, source = peak_bandwidth(name, clock, bus)
    return Device(name, attributes["MultiProcessorCount"], attributes["L2CacheSize"], peak,
                  source)


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


# The kernels issue's targets: share of nominal peak in the bandwidth regime (compulsory traffic
# of at least 64 MB), and at most 1.3x an equal-bytes copy below it, where a fixed latency
# dominates whatever the kernel does.
TARGET_PCT = {("decode", "shrink"): 80.0, ("decode", "expand"): 75.0,
              ("prefill", "shrink"): 70.0, ("prefill", "expand"): 70.0}
BANDWIDTH_REGIME_BYTES = 64 << 20
COPY_RATIO_TARGET = 1.3
_LOAD_BYTES = 16
# The cost terms of a record (microseconds each), in the order the binding one is reported.
TERMS = ("launch", "hbm", "l2", "in_flight", "serial", "critical_path")


@dataclass(frozen=True)
class LaunchWork:
    """What one planned launch asks of the memory system, counted from its grid and its CTAs'
    work (the model's inputs; tests/test_kernels_model.py ties them to kernels.plan_*):

    - `l2_bytes`: the distinct bytes its loads and stores ask for (L2 hits included; clamped
      duplicates and predicated-off loads not counted, as they move nothing new);
    - `passes`: streaming round trips summed over the CTAs: each is one DRAM latency in which
      a CTA has one pass of loads in flight (a double-buffered K tile, a pass of B vectors);
    - `chains`: dependent scalar round trips summed over the CTAs, each an L2 latency: the
      slot -> table[slot] -> ranks[slot] chain, SGMV's binary search and per-segment metadata,
      the split-K partials that the expand adds one split at a time;
    - `cta_passes`, `cta_chains`: the heaviest CTA's (the critical path);
    - `launches`: graph nodes it takes (a split-K shrink: the memset of t, then the kernel).
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


def _decode_slots(tokens: int, adapters: int) -> np.ndarray:
    """The benchmark's decode batch: adapters interleaved over the tokens, as requests arrive."""
    return (np.arange(tokens) % adapters).astype(np.int32)


def _prefill_starts(tokens: int, adapters: int) -> np.ndarray:
    """The benchmark's prefill segments: `adapters` equal runs of sorted tokens."""
    return (np.arange(adapters + 1, dtype=np.int64) * tokens // adapters).astype(np.int32)


@dataclass(frozen=True)
class TileSegments:
    """How SGMV's fixed 64-token tiles meet the segments: one entry per (tile, segment) pair
    with tokens in both (`tile`, `rows`), and the segment count S."""

    tile: np.ndarray
    rows: np.ndarray
    num_segments: int
    num_tiles: int

    @classmethod
    def of(cls, seg_starts: np.ndarray, tokens: int) -> TileSegments:
        starts = np.asarray(seg_starts, dtype=np.int64)
        lo, hi = starts[:-1], starts[1:]
        size = kernels.SGMV_TILE
        keep = hi > lo
        lo, hi = lo[keep], hi[keep]
        first, last = lo // size, (hi - 1) // size
        counts = last - first + 1
        seg = np.repeat(np.arange(lo.size), counts)
        tile = np.repeat(first, counts) + np.arange(int(counts.sum())) - np.repeat(
            np.cumsum(counts) - counts, counts)
        rows = np.minimum(hi[seg], (tile + 1) * size) - np.maximum(lo[seg], tile * size)
        return cls(tile, rows, int(starts.size - 1), -(-tokens // size))

    def per_tile(self, values: np.ndarray) -> np.ndarray:
        return np.bincount(self.tile, weights=values, minlength=self.num_tiles)


def _split_lengths(in_dim: int, splits: int, multiple: int) -> np.ndarray:
    """K elements of each split, as kernels._k_chunk cuts them (trailing splits may be empty)."""
    chunk = kernels._k_chunk(in_dim, splits, multiple)
    return np.clip(in_dim - chunk * np.arange(splits), 0, chunk)


def plan_launch(kind: str, tokens: int, adapters: int, rank: int, in_dim: int, out_dim: int,
                sms: int, y_bytes: int = 2) -> LaunchWork:
    """The launch a benchmark shape gets, and its work: decode (<= 256 tokens) through
    kernels.plan_batch (grouped or per-token), prefill through SGMV over sorted segments; t as
    wide as the rank, max_rank the rank (the benchmark's pools)."""
    y_kind = "bf16" if y_bytes == 2 else "f32"
    if tokens > 256:
        grouped, path = True, "segments"
        seg_starts = _prefill_starts(tokens, adapters)
    else:
        plan = kernels.plan_batch(_decode_slots(tokens, adapters), [rank] * adapters, rank)
        grouped, path = plan.grouped, "grouped" if plan.grouped else "per-token"
        seg_starts = plan.seg_starts
    family = "sgmv" if grouped else "bgmv"
    splits = kernels.shrink_splits(family, tokens, in_dim, rank, sms)
    if kind == "expand" and path == "grouped" and not kernels.grouped_expand(
            tokens, out_dim, rank, len(seg_starts) - 1, sms):
        family, path = "bgmv", "grouped+per-token"
    kernel = f"{family}_shrink" if kind == "shrink" else f"{family}_expand_{y_kind}"
    grid = kernels.launch_grid(kernel, tokens, in_dim if kind == "shrink" else out_dim, rank,
                               splits if kind == "shrink" else 1)
    if family == "bgmv":
        work = _bgmv_work(kind, grid, tokens, rank, in_dim, out_dim, splits, y_bytes)
    else:
        work = _sgmv_work(kind, grid, TileSegments.of(seg_starts, tokens), tokens, rank, in_dim,
                          out_dim, splits, y_bytes)
    # Split-K adds its partials into one t, zeroed by a memset node first; the expand reads it.
    launches = 2 if kind == "shrink" and splits > 1 else 1
    return LaunchWork(kernel, path, grid, splits, *work, launches=launches)


def _bgmv_work(kind: str, grid: tuple[int, int, int], tokens: int, rank: int, in_dim: int,
               out_dim: int, splits: int, y_bytes: int) -> tuple[int, int, int, int, int]:
    """(l2_bytes, passes, chains, cta_passes, cta_chains) of a BGMV launch, every token adapted
    at `rank` (kernels/bgmv.cu). The shrink's splits add into t (atomics at L2)."""
    if kind == "shrink":
        # A CTA: 4 rank rows of one token over one split; a pass is 2 K steps of 128 x 8
        # elements (x and 4 A rows); slot -> table, ranks first.
        step = 2 * kernels.THREADS * kernels.VECTOR
        lengths = _split_lengths(in_dim, splits, kernels.VECTOR)
        per_token_rows = grid[1]
        passes = tokens * per_token_rows * int((-(-lengths // step)).sum())
        l2 = tokens * per_token_rows * (2 * (1 + kernels.SHRINK_ROWS) * in_dim
                                        + 4 * kernels.SHRINK_ROWS * splits)
        ctas = tokens * per_token_rows * splits
        return l2, passes, 2 * ctas, int(-(-lengths.max() // step)), 2
    # expand: a CTA is 1024 output rows of one token; slot -> table, ranks, then its t row (one
    # L2 round trip), then passes of 8 rows x 2 rank vectors of B per thread.
    vecs = rank // kernels.VECTOR
    cta_passes = -(-vecs // 2)
    blocks = grid[1]
    l2 = tokens * (2 * out_dim * rank + 2 * y_bytes * out_dim + blocks * 4 * rank)
    ctas = tokens * blocks
    return l2, ctas * cta_passes, ctas * 3, cta_passes, 3


def _sgmv_work(kind: str, grid: tuple[int, int, int], segs: TileSegments, tokens: int,
               rank: int, in_dim: int, out_dim: int, splits: int, y_bytes: int
               ) -> tuple[int, int, int, int, int]:
    """(l2_bytes, passes, chains, cta_passes, cta_chains) of an SGMV launch (kernels/sgmv.cu):
    a CTA walks the segments meeting its 64-token tile one after another, each pass loading
    only that segment's rows."""
    tile = kernels.SGMV_TILE
    search = max(1, math.ceil(math.log2(segs.num_segments + 1)))  # first_segment's probes
    per_tile_segs = np.bincount(segs.tile, minlength=segs.num_tiles)
    tile_rows = np.minimum(tile, tokens - tile * np.arange(segs.num_tiles))
    # slot -> table, ranks per segment; the search before the first.
    tile_chain = search + 2 * per_tile_segs
    if kind == "shrink":
        lengths = _split_lengths(in_dim, splits, tile)
        n_valid = np.minimum(tile, rank - tile * np.arange(grid[0]))  # rank rows per column tile
        k_tiles = -(-lengths // tile)
        live = lengths > 0  # an empty trailing split only writes zeros
        pairs = segs.rows.size
        passes = grid[0] * pairs * int(k_tiles.sum())
        l2 = int(2 * in_dim * (grid[0] * segs.rows.sum() + pairs * n_valid.sum())
                 + 4 * splits * tokens * rank)
        chains = grid[0] * int(live.sum()) * int(tile_chain.sum())
        cta_passes = int(per_tile_segs.max()) * int(k_tiles.max())
        return l2, passes, chains, cta_passes, int(tile_chain.max())
    # expand: per segment and 64-wide rank chunk, one pass of the B tile with the t tile (t
    # holds the reduced split-K sum); the y epilogue is one more pass.
    chunks = -(-rank // tile)
    out_tiles = grid[0]
    pairs = segs.rows.size
    passes = out_tiles * (pairs * chunks + segs.num_tiles)
    chains = out_tiles * int(tile_chain.sum())
    l2 = int(2 * out_dim * rank * pairs + out_tiles * 4 * rank * segs.rows.sum()
             + 2 * y_bytes * out_dim * tile_rows.sum())
    cta_passes = int(per_tile_segs.max()) * chunks + 1
    return l2, passes, chains, cta_passes, int(tile_chain.max())


def rotation_groups(nbytes: int, footprint: int, l2_bytes: int, l2_multiple: float = 3.0) -> int:
    """How many rotation groups the benchmark cycles through for a shape (each with its own
    buffers) so that G x compulsory bytes >= l2_multiple x the L2: at most 64, and within the
    rotation memory budget."""
    groups = max(1, math.ceil(l2_multiple * l2_bytes / nbytes))
    return min(groups, 64, max(1, _ROTATION_BUDGET_BYTES // footprint))


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
# use (the SASS check's count, kernels.loads_in_flight); fewer, and the pass takes
# ceil(these / that) round trips.
PASS_LOADS = {
    "bgmv_shrink": kernels.CONFIG["BGMV_SHRINK_STEPS"] * (1 + kernels.SHRINK_ROWS),
    "bgmv_expand": kernels.CONFIG["BGMV_EXPAND_STEPS"],
    "sgmv_shrink": 2 * 4,  # the next K tile: 4 x vectors and 4 A vectors per thread
    "sgmv_expand": 4 + 8,  # a rank chunk's pass: 4 B vectors and 8 t vectors per thread
}


def pass_round_trips(kernel: str) -> int:
    """DRAM round trips one streaming pass of `kernel` takes as its machine code issues it."""
    family = kernel.removesuffix("_bf16").removesuffix("_f32")
    if family not in PASS_LOADS:
        return 1
    return -(-PASS_LOADS[family] // kernels.loads_in_flight(kernel))


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
    - `critical_path`: the heaviest CTA alone, its passes and its chains back to back.

    expected_us = max(launch, latency + max(hbm, l2), in_flight + serial, critical_path):
    never below any term. `binding` names the largest (`serial` where in_flight + serial binds
    and the chains are the larger part). The copy of the same bytes takes
    max(launch, latency + bytes at copy bandwidth)."""
    resident = min(work.ctas, device.sms * kernels.min_ctas_per_sm(work.kernel))
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
    streamed = terms["in_flight"] + terms["serial"]
    # A stream of bytes also waits one DRAM latency for its first load, as the copy does.
    expected_s = max(terms["launch"], device.latency_s + max(terms["hbm"], terms["l2"]),
                     streamed, terms["critical_path"])
    binding = max(TERMS, key=lambda name: streamed if name == "in_flight" else terms[name])
    if binding == "in_flight" and terms["serial"] > terms["in_flight"]:
        binding = "serial"
    copy_s = max(device.launch_s, device.latency_s + nbytes / copy_bw)
    per_pass = work.l2_bytes / max(trips * work.passes, 1)
    return {
        "ctas": work.ctas, "ctas_per_sm": kernels.min_ctas_per_sm(work.kernel),
        "waves": work.ctas / (device.sms * kernels.min_ctas_per_sm(work.kernel)),
        "loads_per_thread": kernels.loads_in_flight(work.kernel),
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
                 device: ModelDevice) -> dict[str, Any]:
    """cost_terms for a launch known only by its grid and the bytes its loads ask for (the
    expert kernels): each CTA streams its share of `requested_bytes` in passes of the loads
    per thread that the SASS check holds (lora_config.h), after the slot -> table chain."""
    ctas = grid[0] * grid[1] * grid[2]
    per_pass = kernels.loads_in_flight(kernel) * _LOAD_BYTES * kernels.THREADS
    cta_passes = max(1, math.ceil(requested_bytes / ctas / per_pass))
    work = LaunchWork(kernel, "", grid, 1, requested_bytes, ctas * cta_passes, 2 * ctas,
                      cta_passes, 2)
    return cost_terms(work, nbytes, device, rmw=kernel.startswith(("expert_expand", "router")))


def _shapes(model_shapes: Sequence[tuple[str, int, int]], ranks: Sequence[int],
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
# its qkv_proj and gate_up_proj (kernels.bgmv_fused).
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


def fused_work(kind: str, slices: Sequence[int], tokens: int, rank: int, in_dim: int, sms: int,
               y_bytes: int = 2) -> LaunchWork:
    """The one launch kernels.bgmv_fused makes for `kind` over slices of these out_dims (the
    per-token path): the shrink's grid.z is (slice, split), split as the planner splits S
    slices' CTAs; the expand's grid.y covers the widest slice, and a narrower slice's spare
    CTAs read their metadata and t row, then exit."""
    count = len(slices)
    splits = kernels.shrink_splits("bgmv", count * tokens, in_dim, rank, sms)
    if kind == "shrink":
        grid = kernels.launch_grid("bgmv_shrink", tokens, in_dim, rank, splits)
        l2, passes, chains, cta_passes, cta_chains = _bgmv_work(
            kind, grid, tokens, rank, in_dim, slices[0], splits, y_bytes)
        return LaunchWork("bgmv_shrink", "per-token (fused)", (grid[0], grid[1], count * splits),
                          splits, count * l2, count * passes, count * chains, cta_passes,
                          cta_chains, launches=2 if splits > 1 else 1)
    kernel = "bgmv_expand_bf16" if y_bytes == 2 else "bgmv_expand_f32"
    widest = kernels.launch_grid(kernel, tokens, max(slices), rank)
    l2 = passes = chains = 0
    for out_dim in slices:
        grid = kernels.launch_grid(kernel, tokens, out_dim, rank)
        work = _bgmv_work(kind, grid, tokens, rank, in_dim, out_dim, 1, y_bytes)
        spare = tokens * (widest[1] - grid[1])
        l2 += work[0] + spare * 4 * rank
        passes += work[1]
        chains += work[2] + 3 * spare
    cta_passes = -(-(rank // kernels.VECTOR) // 2)
    return LaunchWork(kernel, "per-token (fused)", (widest[0], widest[1], count), 1, l2, passes,
                      chains, cta_passes, 3)


def fused_record(slices: Sequence[tuple[str, int]], in_dim: int, rank: int, tokens: int,
                 adapters: int, kind: str, device: ModelDevice | None = None
                 ) -> dict[str, Any] | None:
    """The model's record for a fused group's one `kind` launch (fused_work), beside
    `unfused_us`, what its slices' separate launches take together; None where the batch takes
    the grouped or prefill path, on which bgmv_fused runs the slices one by one."""
    device = device or ModelDevice()
    if tokens > 256 or kernels.plan_batch(_decode_slots(tokens, adapters), [rank] * adapters,
                                          rank).grouped:
        return None
    work = fused_work(kind, [out for _, out in slices], tokens, rank, in_dim, device.sms)
    nbytes = sum(compulsory_bytes(kind, tokens, adapters, rank, in_dim, out)
                 for _, out in slices)
    cost = cost_terms(work, nbytes, device, rmw=kind == "expand")
    separate = [model_record(name, out, in_dim, rank, tokens, adapters, kind, device)
                for name, out in slices]
    target = TARGET_PCT["decode", kind]
    meets = (cost["expected_pct_peak"] >= target if cost["regime"] == "bandwidth"
             else cost["expected_copy_ratio"] <= COPY_RATIO_TARGET)
    footprint = sum(footprint_bytes(tokens, adapters, rank, in_dim, out) for _, out in slices)
    groups = rotation_groups(nbytes, footprint, device.l2_bytes)
    return {
        "kernel": work.kernel, "path": work.path, "module": "+".join(n for n, _ in slices),
        "out_dim": sum(out for _, out in slices), "slice_out_dims": [out for _, out in slices],
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
    those of each fused group (fused_groups) on the shapes where it fuses (fused_record)."""
    records = [model_record(module, out_dim, in_dim, rank, num_tokens, count, kind, device)
               for module, out_dim, in_dim, rank, num_tokens, count in _shapes(
                   model_shapes, ranks, tokens, adapters)
               for kind in ("shrink", "expand")]
    for slices, in_dim in fused_groups(model_shapes):
        for _, _, _, rank, num_tokens, count in _shapes([("", 0, in_dim)], ranks, tokens,
                                                        adapters):
            pair = [fused_record(slices, in_dim, rank, num_tokens, count, kind, device)
                    for kind in ("shrink", "expand")]
            records.extend(r for r in pair if r is not None)
    return records



class _Group:
    """One rotation group's buffers: a pool of `adapters` slots (A [D, r, in], B [D, out, r],
    contiguous BF16 as uint16), tables, x, y, t and the token -> slot assignment."""

    def __init__(self, cupy: Any, rng: Any, tokens: int, adapters: int, rank: int, in_dim: int,
                 out_dim: int, prefill: bool, num_splits: int) -> None:
        def bf16(shape: tuple[int, ...], std: float) -> Any:
            values = rng.standard_normal(shape, dtype=cupy.float32) * std
            # Round to nearest even into BF16 bits (NaN-free inputs).
            bits = values.view(cupy.uint32)
            return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(cupy.uint16)

        self.a = bf16((adapters, rank, in_dim), 1 / math.sqrt(in_dim))
        self.b = bf16((adapters, out_dim, rank), 1 / math.sqrt(rank))
        slot_index = cupy.arange(adapters, dtype=cupy.uint64)
        # u64 [adapters]: slot k's A at a + k * r * in_dim elements (2 bytes each); B likewise.
        self.a_table = cupy.uint64(self.a.data.ptr) + cupy.uint64(2 * rank * in_dim) * slot_index
        self.b_table = cupy.uint64(self.b.data.ptr) + cupy.uint64(2 * out_dim * rank) * slot_index
        self.ranks = cupy.full(adapters, rank, dtype=cupy.int32)
        self.max_rank = rank  # the pool's: A rows and B's row stride
        self.scales = cupy.linspace(0.5, 2.0, adapters, dtype=cupy.float32)
        self.x = bf16((tokens, in_dim), 1.0)
        self.y = bf16((tokens, out_dim), 1.0)
        self.t = cupy.zeros((tokens, rank), dtype=cupy.float32)
        self.splits = num_splits
        self.order = None
        self.grouped = prefill
        if prefill:
            # Sorted runs: adapter d serves tokens [starts[d], starts[d + 1]).
            self.seg_starts = (cupy.arange(adapters + 1, dtype=cupy.int64) * tokens // adapters
                               ).astype(cupy.int32)
            self.seg_slots = cupy.arange(adapters, dtype=cupy.int32)
            self.slots = cupy.repeat(self.seg_slots, cupy.diff(self.seg_starts).get().tolist())
        else:
            # Decode: adapters interleaved over the batch, as requests arrive; the batch plan
            # the host would build picks the grouped or the per-token path.
            host_slots = _decode_slots(tokens, adapters)
            self.slots = cupy.asarray(host_slots)
            plan = kernels.plan_batch(host_slots, [rank] * adapters, rank)
            self.grouped = plan.grouped
            if plan.grouped:
                self.order = cupy.asarray(plan.order)
                self.seg_starts = cupy.asarray(plan.seg_starts)
                self.seg_slots = cupy.asarray(plan.seg_slots)


def _ours(kind: str, group: _Group) -> Callable[[], None]:
    """The launch `plan_launch` models for this group's batch, ready to call (a split-K shrink:
    the memset of t, then the kernel, both timed)."""
    tokens, out_dim = (int(d) for d in group.y.shape)
    sms = kernels.device_sm_count()
    if kind == "shrink" and group.grouped:
        plan = kernels.plan_sgmv_shrink(group.x, group.seg_starts, group.seg_slots, group.a_table,
                                        group.ranks, group.t, group.max_rank,
                                        token_order=group.order, splits=group.splits)
    elif kind == "shrink":
        plan = kernels.plan_bgmv_shrink(group.x, group.slots, group.a_table, group.ranks, group.t,
                                        group.max_rank, group.splits)
    elif group.grouped and (group.order is None or kernels.grouped_expand(
            tokens, out_dim, group.max_rank, int(group.seg_slots.shape[0]), sms)):
        plan = kernels.plan_sgmv_expand(group.t, group.seg_starts, group.seg_slots, group.b_table,
                                        group.scales, group.ranks, group.y, group.max_rank,
                                        token_order=group.order)
    else:
        plan = kernels.plan_bgmv_expand(group.t, group.slots, group.b_table, group.scales,
                                        group.ranks, group.y, group.max_rank)
    kernel = kernels.get_kernel(plan.kernel)
    if kind == "shrink" and group.splits > 1:
        def split_shrink() -> None:
            group.t.fill(0)
            kernel(plan.grid, plan.block, plan.args)

        return split_shrink
    return lambda: kernel(plan.grid, plan.block, plan.args)


def _time_cupy(calls: Sequence[Callable[[], None]], repeats: int) -> list[float]:
    """µs per call over `repeats` graph replays of all `calls`."""
    cupy = compat.cupy_module()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for call in calls:  # compile and touch everything before capture
            call()
        stream.synchronize()
        stream.begin_capture()
        for call in calls:
            call()
        graph = stream.end_capture()
    graph.upload(stream)
    return _replay(lambda: graph.launch(stream), len(calls), repeats,
                   lambda: cupy.cuda.Event(), lambda e: e.record(stream),
                   lambda s, e: cupy.cuda.get_elapsed_time(s, e), stream.synchronize)


def _time_torch(torch: Any, calls: Sequence[Callable[[], None]], repeats: int) -> list[float]:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture, as torch.cuda.graph requires
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return _replay(graph.replay, len(calls), repeats,
                   lambda: torch.cuda.Event(enable_timing=True), lambda e: e.record(),
                   lambda s, e: s.elapsed_time(e), torch.cuda.synchronize)


def _replay(launch: Callable[[], None], calls: int, repeats: int, new_event: Callable[[], Any],
            record: Callable[[Any], None], elapsed_ms: Callable[[Any, Any], float],
            synchronize: Callable[[], None]) -> list[float]:
    start, end = new_event(), new_event()
    # Warm-up: replay until clocks and TLBs settle (>= WARMUP_SECONDS of device time).
    spent = 0.0
    while spent < WARMUP_SECONDS * 1e3:
        record(start)
        launch()
        record(end)
        synchronize()
        spent += elapsed_ms(start, end)
    samples = []
    for _ in range(repeats):
        record(start)
        launch()
        record(end)
        synchronize()
        samples.append(elapsed_ms(start, end) * 1e3 / calls)
    return samples


def _validate(kind: str, group: _Group, rank: int) -> None:
    """Run our kernel once and compare a sample of rows with reference.py (raises on mismatch)."""
    import torch

    cupy = compat.cupy_module()
    y_before = group.y.copy()
    if kind == "expand":  # expand reads t: give it a real one
        _ours("shrink", group)()
    _ours(kind, group)()
    cupy.cuda.Device().synchronize()

    def host(array: Any, bf16: bool = False) -> torch.Tensor:
        tensor = torch.from_numpy(cupy.asnumpy(array))
        return tensor.view(torch.int16).view(torch.bfloat16) if bf16 else tensor

    tokens = int(group.x.shape[0])
    rows = np.unique(np.linspace(0, tokens - 1, min(tokens, _VALIDATE_ROWS)).astype(np.int64))
    slots = host(group.slots)[rows]
    used = sorted(set(slots.tolist()))
    a_weights: list[torch.Tensor | None] = [None] * int(group.a.shape[0])
    b_weights: list[torch.Tensor | None] = [None] * int(group.a.shape[0])
    for slot in used:
        a_weights[slot] = host(group.a[slot], bf16=True)
        b_weights[slot] = host(group.b[slot], bf16=True)
    ranks, scales = host(group.ranks), host(group.scales)
    x = host(group.x[cupy.asarray(rows)], bf16=True)
    t = host(group.t)[rows]
    expected_t = reference.shrink(x, slots, a_weights, ranks, rank)
    rtol, atol = reference.T_TOLERANCE
    torch.testing.assert_close(t, expected_t, rtol=rtol, atol=atol)
    if kind == "expand":
        y0 = host(y_before[cupy.asarray(rows)], bf16=True)
        expected_y = reference.expand(y0, expected_t, slots, b_weights, scales, ranks)
        y = host(group.y[cupy.asarray(rows)], bf16=True)
        rtol, atol = reference.TOLERANCES["sgmv" if group.grouped else "bgmv", torch.bfloat16]
        torch.testing.assert_close(y.float(), expected_y.float(), rtol=rtol, atol=atol)
    group.y[...] = y_before


def _torch_baselines(kind: str, groups: Sequence[_Group], adapters: int,
                     rank: int) -> dict[str, Callable[[], None]]:
    """Each torch implementation a user would pick, as per-group call lists."""
    import torch

    per_impl: dict[str, list[Callable[[], None]]] = {"loop": [], "gather_bmm": [], "mm": []}
    for group in groups:
        x = torch.from_dlpack(group.x).view(torch.bfloat16)
        y = torch.from_dlpack(group.y).view(torch.bfloat16)
        a = torch.from_dlpack(group.a).view(torch.bfloat16)
        b = torch.from_dlpack(group.b).view(torch.bfloat16)
        slots = torch.from_dlpack(group.slots).long()
        scales = torch.from_dlpack(group.scales)
        t = torch.zeros(x.shape[0], rank, dtype=torch.bfloat16, device=x.device)
        token_scales = scales[slots].to(torch.bfloat16)[:, None]
        # Index lists built outside the timed region (the loop's host syncs are not timed).
        loop_ok = adapters <= _LOOP_LIMIT_ADAPTERS
        index = [(slots == d).nonzero().flatten() for d in range(adapters)] if loop_ok else []
        # Python floats now: reading a device scalar inside graph capture would sync.
        scale_values = scales.tolist()
        if kind == "shrink":
            def loop(x=x, a=a, t=t, index=index) -> None:
                for d, idx in enumerate(index):
                    t.index_copy_(0, idx, x[idx] @ a[d].T)

            def gather(x=x, a=a, t=t, slots=slots) -> None:
                t.copy_(torch.bmm(x[:, None], a[slots].transpose(1, 2))[:, 0])

            def mm(x=x, a=a, t=t) -> None:
                torch.mm(x, a[0].T, out=t)
        else:
            def loop(y=y, b=b, t=t, index=index, scale_values=scale_values) -> None:
                for d, idx in enumerate(index):
                    y.index_add_(0, idx, t[idx] @ b[d].T, alpha=scale_values[d])

            def gather(y=y, b=b, t=t, slots=slots, token_scales=token_scales) -> None:
                y.add_(torch.bmm(t[:, None], b[slots].transpose(1, 2))[:, 0] * token_scales)

            def mm(y=y, b=b, t=t, scale=scale_values[0]) -> None:
                y.addmm_(t, b[0].T, alpha=scale)
        per_impl["loop"].append(loop)
        per_impl["gather_bmm"].append(gather)
        per_impl["mm"].append(mm)
    tokens = int(groups[0].x.shape[0])
    dim = int(groups[0].a.shape[2] if kind == "shrink" else groups[0].b.shape[1])
    chosen = {}
    if adapters <= _LOOP_LIMIT_ADAPTERS:
        chosen["loop"] = per_impl["loop"]
    if 2 * tokens * rank * dim <= _GATHER_LIMIT_BYTES:
        chosen["gather_bmm"] = per_impl["gather_bmm"]
    if adapters == 1:
        chosen["mm"] = per_impl["mm"]
    return chosen


def torch_on_device() -> bool:
    """Whether torch is installed with CUDA and sees a device (the torch baselines need it)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _percentiles(samples: Sequence[float]) -> dict[str, float]:
    p10, p50, p90 = np.percentile(np.asarray(samples), [10, 50, 90])
    return {"p10_us": float(p10), "p50_us": float(p50), "p90_us": float(p90)}


def _copy_us(cupy: Any, nbytes: int, groups: int, repeats: int) -> float:
    """p50 µs of a device-to-device copy that moves `nbytes` in all (nbytes / 2 read, written)."""
    half = max(nbytes // 2, 16)
    buffers = [(cupy.empty(half, dtype=cupy.uint8), cupy.empty(half, dtype=cupy.uint8))
               for _ in range(groups)]
    calls = [lambda src=src, dst=dst: dst.__setitem__(Ellipsis, src) for src, dst in buffers]
    return _percentiles(_time_cupy(calls, repeats))["p50_us"]


def module_shapes(model: ModelConfig, modules: Sequence[LoraModule]) -> list[tuple[str, int, int]]:
    """`(module_name, out_dim, in_dim)` of each module that applies on some layer of `model`:
    the shapes `run` times, at the model's real size."""
    return [(m.peft_name, *m.dims(model)) for m in modules
            if any(m.applies_to_layer(model, i) for i in range(model.num_hidden_layers))]


def run(
    model_shapes: Sequence[tuple[str, int, int]],
    ranks: Sequence[int] = DEFAULT_RANKS,
    tokens: Sequence[int] = DECODE_TOKENS + PREFILL_TOKENS,
    adapters: Sequence[int] | None = None,
    *,
    repeats: int = 30,
    l2_multiple: float = 3.0,
    with_torch: bool = True,
    seed: int = 0,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Benchmark records for every (module shape, rank, token count, adapter count, kernel).

    model_shapes: (module_name, out_dim, in_dim) per module. Token counts <= 256 run the decode
    path the batch plan picks (BGMV per token, or grouped by slot), larger ones the prefill
    kernels (SGMV). adapters: distinct adapters per
    batch, capped at the token count (default: 1, 8 and one per token). `progress` gets each
    record as it is made. NoDevice (exit 3) without a GPU.
    """
    cupy = compat.cupy_module()
    device = device_info()
    torch_ok = with_torch and torch_on_device()
    rng = cupy.random.default_rng(seed)
    records: list[dict[str, Any]] = []
    for module, out_dim, in_dim, rank, num_tokens, count in _shapes(model_shapes, ranks, tokens,
                                                                  adapters):
        for kind in ("shrink", "expand"):
            record = _measure(cupy, device, rng, module, out_dim, in_dim, rank, num_tokens,
                              count, kind, num_tokens > 256, repeats, l2_multiple, torch_ok)
            records.append(record)
            if progress is not None:
                progress(record)
    return records


def _measure(cupy: Any, device: Device, rng: Any, module: str, out_dim: int, in_dim: int,
             rank: int, num_tokens: int, num_adapters: int, kind: str, prefill: bool,
             repeats: int, l2_multiple: float, torch_ok: bool) -> dict[str, Any]:
    expected = model_record(module, out_dim, in_dim, rank, num_tokens, num_adapters, kind,
                            ModelDevice(name=device.name, sms=device.sms,
                                        peak_bytes_per_s=device.peak_bytes_per_s,
                                        l2_bytes=device.l2_bytes))
    nbytes = expected["bytes"]
    splits = expected["splits"]
    footprint = footprint_bytes(num_tokens, num_adapters, rank, in_dim, out_dim)
    groups = rotation_groups(nbytes, footprint, device.l2_bytes, l2_multiple)
    buffers = [_Group(cupy, rng, num_tokens, num_adapters, rank, in_dim, out_dim, prefill, splits)
               for _ in range(groups)]
    _validate(kind, buffers[0], rank)
    if kind == "expand":  # give every group a real t
        for group in buffers:
            _ours("shrink", group)()

    ours = _percentiles(_time_cupy([_ours(kind, g) for g in buffers], repeats))
    copy_us = _copy_us(cupy, nbytes, groups, repeats)
    baselines: dict[str, float] = {}
    if torch_ok:
        import torch

        for name, calls in _torch_baselines(kind, buffers, num_adapters, rank).items():
            baselines[name] = _percentiles(_time_torch(torch, calls, repeats))["p50_us"]
    best = min(baselines.items(), key=lambda item: item[1]) if baselines else None
    p50_s = ours["p50_us"] * 1e-6
    record: dict[str, Any] = {
        "kernel": expected["kernel"], "path": expected["path"],
        "module": module, "out_dim": out_dim, "in_dim": in_dim, "rank": rank,
        "tokens": num_tokens, "adapters": num_adapters, "y_dtype": "bf16", "splits": splits,
        **ours,
        "repeats": repeats,
        "bytes": nbytes,
        # Useful FLOPs: every token carries an adapter in these batches.
        "flops": 2 * num_tokens * rank * (in_dim if kind == "shrink" else out_dim),
        "tb_per_s": nbytes / p50_s / 1e12,
        "pct_peak": 100 * nbytes / p50_s / device.peak_bytes_per_s,
        "copy_us": copy_us,
        "pct_copy": 100 * copy_us / ours["p50_us"],
        "torch_us": baselines,
        "torch_best": best[0] if best else None,
        "speedup_vs_torch": best[1] / ours["p50_us"] if best else None,
        "validated": True,
        # The roofline model's figures for this shape on this device (model_record).
        "expected_us": expected["expected_us"],
        "expected_pct_peak": expected["expected_pct_peak"],
        "measured_vs_expected": expected["expected_us"] / ours["p50_us"],
        "device": device.name, "peak_tb_per_s": device.peak_bytes_per_s / 1e12,
        "peak_source": device.peak_source,
        "terms": expected["terms"], "binding": expected["binding"],
        "l2_bytes": expected["l2_bytes"],
        "device_l2_bytes": device.l2_bytes, "rotation_groups": groups,
        # What the groups read fits in L2 together: the replays read L2, not HBM.
        "l2_resident": groups * nbytes <= device.l2_bytes, "timing": "cuda-graph",
    }
    del buffers
    cupy.get_default_memory_pool().free_all_blocks()
    return record


def plot(records: Sequence[dict[str, Any]], path: str | Path, force: bool = False) -> None:
    """A roofline chart (PNG) of `records`: achieved FLOP/s against arithmetic intensity, under
    the device's nominal and measured-copy bandwidth roofs. Needs matplotlib (metrale[plot])."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ToolMissing("--plot needs matplotlib: pip install 'metrale[plot]'") from None
    if not records:
        raise UsageError("no measurements to plot")
    fig, ax = plt.subplots(figsize=(9, 6), dpi=120)
    intensity = [r["flops"] / r["bytes"] for r in records]
    lo, hi = min(intensity) / 2, max(intensity) * 2
    peak = records[0]["peak_tb_per_s"] * 1e12
    copy_bw = max(r["bytes"] / (r["copy_us"] * 1e-6) for r in records)
    for bw, label, style in ((peak, f"HBM nominal {peak / 1e12:.1f} TB/s", "-"),
                             (copy_bw, f"device copy {copy_bw / 1e12:.1f} TB/s", "--")):
        ax.plot([lo, hi], [bw * lo / 1e12, bw * hi / 1e12], style, color="gray", label=label)
    for kernel in sorted({r["kernel"] for r in records}):
        mine = [r for r in records if r["kernel"] == kernel]
        ax.scatter([r["flops"] / r["bytes"] for r in mine],
                   [r["flops"] / (r["p50_us"] * 1e-6) / 1e12 for r in mine], label=kernel, s=14)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / compulsory byte)")
    ax.set_ylabel("achieved TFLOP/s (p50)")
    ax.set_title(f"metrale LoRA kernels on {records[0]['device']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_write(Path(path), lambda f: fig.savefig(f, format="png"), force)
    plt.close(fig)


def device_report() -> dict[str, Any]:
    """What the benchmark reads of the device (device_info), with the CUDA runtime, driver and
    CuPy versions: the `device` step of scripts/gpu_check.sh."""
    import dataclasses

    cupy = compat.cupy_module()
    runtime = cupy.cuda.runtime
    return {**dataclasses.asdict(device_info()), "cupy": cupy.__version__,
            "cuda_runtime": runtime.runtimeGetVersion(), "cuda_driver": runtime.driverGetVersion()}


if __name__ == "__main__":
    import json
    import sys

    if len(sys.argv) != 3 or sys.argv[1] != "--device-report":
        sys.exit("usage: python -m metrale_cli.bench.kernels --device-report FILE")
    report = device_report()
    atomic_write(Path(sys.argv[2]), lambda f: f.write(json.dumps(report, indent=1).encode()),
                 force=True)
    print(json.dumps(report))
