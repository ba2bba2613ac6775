"""`metrale bench kernels`: the LoRA delta kernels against the limit and against torch, as
records (one dict per kernel and shape, its setup embedded): `run` measures on the GPU the
shapes that the roofline model (roofline.py, `--model-only`, no GPU needed) predicts, and
records the model's figure beside each measured one.

Measurement method (docs/bench.md):
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
from metrale_cli.bench.roofline import (
    DECODE_TOKENS,
    DEFAULT_RANKS,
    PREFILL_TOKENS,
    ModelDevice,
    bench_shapes,
    decode_slots,
    footprint_bytes,
    model_record,
    rotation_groups,
)
from metrale_cli.errors import ToolMissing, UsageError
from metrale_cli.files.atomic import atomic_write
from metrale_cli.model.config import ModelConfig
from metrale_cli.model.modules import LoraModule
from metrale_cli.ops import costs, kernels, plans, reference

WARMUP_SECONDS = 0.025
# Baselines that materialise per-token weights (gather + bmm) are skipped above this many bytes,
# and the per-adapter loop above this many adapters (its graph would hold thousands of launches).
_GATHER_LIMIT_BYTES = 8 << 30
_LOOP_LIMIT_ADAPTERS = 512
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
            self.chunks = cupy.asarray(plans.segment_chunks(self.seg_starts, self.seg_slots,
                                                            tokens))
        else:
            # Decode: adapters interleaved over the batch, as requests arrive; the batch plan
            # the host would build picks the grouped or the per-token path.
            host_slots = decode_slots(tokens, adapters)
            self.slots = cupy.asarray(host_slots)
            plan = plans.plan_batch(host_slots, [rank] * adapters, rank)
            self.grouped = plan.grouped
            if plan.grouped:
                self.order = cupy.asarray(plan.order)
                self.chunks = cupy.asarray(plan.chunks)


def _ours(kind: str, group: _Group) -> Callable[[], None]:
    """The launch `plan_launch` models for this group's batch, ready to call (a split-K shrink
    through the backend's workspace: one kernel, no memset)."""
    tokens, out_dim = (int(d) for d in group.y.shape)
    sms = kernels.device_sm_count()
    workspace = None
    if kind == "shrink" and group.splits > 1:
        name = "sgmv_shrink" if group.grouped else "bgmv_shrink"
        rows = int(group.chunks.shape[0]) if group.grouped else tokens
        grid = plans.launch_grid(name, rows, 0, int(group.t.shape[1]), group.splits)
        workspace = kernels.CUPY.workspace(group.x,
                                           *plans.split_workspace(name, grid, group.splits))
    if kind == "shrink" and group.grouped:
        plan = plans.plan_sgmv_shrink(group.x, group.chunks, group.a_table, group.ranks,
                                      group.t, group.max_rank, token_order=group.order,
                                      splits=group.splits, workspace=workspace)
    elif kind == "shrink":
        plan = plans.plan_bgmv_shrink(group.x, group.slots, group.a_table, group.ranks, group.t,
                                        group.max_rank, group.splits, workspace)
    elif group.grouped and (group.order is None or costs.grouped_expand(
            tokens, out_dim, group.max_rank, int(group.chunks.shape[0]), sms)):
        plan = plans.plan_sgmv_expand(
            group.t, group.chunks, group.b_table, group.scales, group.ranks, group.y,
            group.max_rank, token_order=group.order, out_tiles=costs.expand_out_tiles(
                int(group.chunks.shape[0]), out_dim, int(group.t.shape[1]), sms))
    else:
        plan = plans.plan_bgmv_expand(group.t, group.slots, group.b_table, group.scales,
                                        group.ranks, group.y, group.max_rank)
    kernel = kernels.get_kernel(plan.kernel)
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
    """`(module_name, out_dim, in_dim)` of each shape a module has on `model`'s layers (a
    module whose widths differ by layer, one per width): the shapes `run` times, at the model's
    real size."""
    return [(m.peft_name, *shape) for m in modules for shape in m.shapes(model)]


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
    for module, out_dim, in_dim, rank, num_tokens, count in bench_shapes(
            model_shapes, ranks, tokens, adapters):
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
    plt = compat.pyplot()
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
