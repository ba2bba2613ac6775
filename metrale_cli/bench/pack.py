"""`metrale bench pack`: packing throughput against a plain copy of the same bytes (numpy.copyto
on the host, a pinned-memory host-to-device copy on a GPU), what the non-finite check costs
(the same pack with and without it), and the peak memory of real `metrale pack` runs against the
pool's size (a dense one, and with `--experts` a fused F32 expert adapter at the model's real
width), measured in one run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from metrale_cli import native
from metrale_cli.adapters.adapter import CONFIG_NAME, WEIGHTS_NAME, Adapter
from metrale_cli.adapters.audit import AdapterReport, audit
from metrale_cli.adapters.synth import synth_adapter
from metrale_cli.files.safetensors_header import adapter_header, read_header
from metrale_cli.layout.expert_layout import ExpertLayout
from metrale_cli.layout.sharding import ShardSpec, all_rank_layouts
from metrale_cli.layout.slot_layout import SlotLayout
from metrale_cli.model.config import ModelConfig
from metrale_cli.model.modules import LoraModule
from metrale_cli.pool.fill import SHARED_FILLS, fill_slot, usable_cores
from metrale_cli.pool.pool import LoraPool
from metrale_cli.pool.region import Region

RSS_ALLOWANCE = 256 << 20


def _copy_rate(nbytes: int, repeats: int, device: str) -> float:
    """Best-of-`repeats` bandwidth (bytes/s) of a plain copy of `nbytes` between pre-touched
    buffers: numpy.copyto on the host; on a GPU a pinned host buffer to device memory."""
    best = float("inf")
    if device == "cuda":
        from metrale_cli.compat import cupy_module

        cp = cupy_module()
        src = np.frombuffer(cp.cuda.alloc_pinned_memory(nbytes), np.uint8, nbytes)
        src.fill(1)
        dst = cp.empty(nbytes, dtype=np.uint8)
        stream = cp.cuda.Stream(non_blocking=True)
        for _ in range(repeats + 1):  # the first warms the path up
            started = time.perf_counter()
            dst.set(src, stream=stream)
            stream.synchronize()
            best = min(best, time.perf_counter() - started)
        return nbytes / best
    host_src = np.ones(nbytes, dtype=np.uint8)
    host_dst = np.ones(nbytes, dtype=np.uint8)
    for _ in range(repeats):
        started = time.perf_counter()
        np.copyto(host_dst, host_src)
        best = min(best, time.perf_counter() - started)
    return nbytes / best


def _tensor_written(path: Path, out: Path) -> Path:
    """The adapter at `path` copied to `out` as safetensors' `save_file` writes a file (as PEFT
    saves an adapter): its tensors in name order (`layers.10` before `layers.2`, where `synth`
    writes the slot's order), the header, then one write a tensor. The page cache holds such a
    file in small folios, where `synth`'s large aligned writes leave 2 MiB ones
    (`metrale_cli/files/pieces.py`), and the kernel's reads out of small folios are the slower;
    and fewer of its tensors lie end to end in the slot, so the pack checks more, smaller
    stretches (`metrale_cli/pool/fill.py`)."""
    out.mkdir()
    shutil.copyfile(path / CONFIG_NAME, out / CONFIG_NAME)
    tensors = sorted(read_header(path / WEIGHTS_NAME).tensors.values(), key=lambda t: t.name)
    with (path / WEIGHTS_NAME).open("rb", buffering=0) as src, \
            (out / WEIGHTS_NAME).open("wb", buffering=0) as f:
        f.write(adapter_header((t.name, t.dtype, t.shape, t.nbytes) for t in tensors))
        for info in tensors:  # a tensor in memory at a time, not the file
            f.write(os.pread(src.fileno(), info.nbytes, info.begin))
    return out


def _warm_page_cache(paths: list[Path]) -> None:
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.read(64 << 20):
                pass


def _pack_rate(reports: list[AdapterReport], layout: SlotLayout, device: str, repeats: int,
               check_finite: bool) -> float:
    """Best-of-`repeats` file bytes/s packing every adapter into a pool region whose pages are
    faulted in first (as a serving engine's pool is, long before adapters swap in)."""
    return _pack_run(reports, layout, device, repeats, check_finite)[1]


def _pack_run(reports: list[AdapterReport], layout: SlotLayout, device: str, repeats: int,
              check_finite: bool) -> tuple[int, float]:
    """`_pack_rate`, with the file bytes one pass reads (a TP rank reads its slices only)."""
    pool = LoraPool(layout, len(reports), device)
    pool.region.memory.fill(0)
    region: Region = pool.region
    staging = pool.staging() if device == "cuda" else None
    best, read = float("inf"), 0
    for _ in range(repeats):
        started = time.perf_counter()
        read = sum(fill_slot(r, k, layout, region, staging=staging,
                             check_finite=check_finite)[0] for k, r in enumerate(reports))
        best = min(best, time.perf_counter() - started)
        for k in range(len(reports)):
            region.clear(k)
    return read, read / best


def _pack_child(args: list[str]) -> tuple[dict[str, Any], int, float]:
    """`metrale pack ARGS --json` in a child process: its record, its own peak RSS (bytes, from
    wait4, so each child is measured alone) and its wall time."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        started = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "metrale_cli", "pack", *args, "--json"],
                                stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - started
        out.seek(0)
        err.seek(0)
        if proc.returncode != 0:
            raise RuntimeError(f"metrale pack failed: {err.read().decode().strip()}")
        return json.loads(out.read()), usage.ru_maxrss * 1024, wall


def _expert_run(root: Path, model: ModelConfig, model_spec: str, modules: list[LoraModule],
                rank: int) -> dict[str, Any]:
    """A fused F32 expert adapter on one MoE layer at the model's real width, packed with
    `--experts` in a child: peak RSS against the slot pool plus the expert pool."""
    if not model.moe_layers:
        raise RuntimeError(f"{model_spec} has no routed experts to bench")
    path = root / "experts"
    synth_adapter(path, model, model_spec, modules, rank, dtype="f32", seed=99,
                  expert_layers=1)
    _warm_page_cache([path / "adapter_model.safetensors"])
    report = audit(Adapter.load(path), model, experts_enabled=True)
    expert_layout = ExpertLayout.for_pairs(model, report.expert_pairs, rank)
    assert expert_layout is not None
    pool_bytes = (SlotLayout.build(model, modules, rank).pool_bytes(1)
                  + expert_layout.pool_bytes(1))
    _, peak_rss, wall = _pack_child([str(path), "--model", model_spec, "--max-loras", "1",
                                     "--device", "cpu", "--experts"])
    tensor_bytes = sum(m.a.nbytes + m.b.nbytes for m in report.modules) + sum(
        a.nbytes + b.nbytes for a, b in {(p.a, p.b) for p in report.expert_pairs})
    return {
        "experts": model.num_experts, "rank": rank, "dtype": "f32", "layers": 1,
        "tensor_bytes": tensor_bytes, "pool_bytes": pool_bytes,
        "expert_pool_bytes": expert_layout.pool_bytes(1), "wall_s": wall,
        "peak_rss_bytes": peak_rss, "peak_rss_minus_pool_bytes": peak_rss - pool_bytes,
        "rss_within_pool_plus_256mib": peak_rss <= pool_bytes + RSS_ALLOWANCE,
    }


def run(
    model: ModelConfig,
    model_spec: str,
    modules: list[LoraModule],
    rank: int,
    adapters: int,
    dtype: str = "bf16",
    repeats: int = 3,
    workdir: Path | None = None,
    device: str = "cpu",
    experts: bool = False,
    tp: ShardSpec | None = None,
) -> dict[str, Any]:
    if device == "cuda":
        from metrale_cli.compat import cupy_module

        cupy_module()  # no GPU: exit 3 before any work
    # What the host pack had to run on: its second reader runs only where a core is idle.
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        root = Path(tmp)
        paths = []
        for i in range(adapters):
            synth_adapter(root / f"a{i}", model, model_spec, modules, rank, dtype=dtype, seed=i)
            paths.append(root / f"a{i}")
        written = [_tensor_written(p, root / f"t{i}") for i, p in enumerate(paths)]
        _warm_page_cache([p / WEIGHTS_NAME for p in paths + written])
        reports = [audit(Adapter.load(p), model) for p in paths]
        layout = SlotLayout.build(model, modules, rank)
        tensor_bytes = sum(m.a.nbytes + m.b.nbytes for r in reports for m in r.modules)

        # End to end, as a user runs it, in a child process so its peak RSS is its own (first,
        # before this process holds large buffers).
        packed, peak_rss, wall = _pack_child([*map(str, paths), "--model", model_spec,
                                              "--max-loras", str(adapters), "--device", device])
        expert_record = (_expert_run(root, model, model_spec, modules, rank)
                         if experts else None)

        copy_rate = _copy_rate(tensor_bytes, repeats, device)
        before = SHARED_FILLS.copy()
        pack_rate = _pack_rate(reports, layout, device, repeats, check_finite=True)
        shared = SHARED_FILLS - before
        unchecked_rate = _pack_rate(reports, layout, device, repeats, check_finite=False)
        written_rate = _pack_rate([audit(Adapter.load(p), model) for p in written], layout,
                                  device, repeats, check_finite=True)
        ranks = []
        for ranked, _ in all_rank_layouts(layout, None, tp) if tp is not None else []:
            # One TP rank: the bytes it reads (its slices) into a pool of its layout.
            spec = ranked.shard
            read, rate = _pack_run(reports, ranked, device, repeats, check_finite=True)
            ranks.append({"tp_rank": spec.tp_rank, "slot_bytes": ranked.slot_bytes,
                          "bytes_read": read, "pack_gb_per_s": rate / 1e9,
                          "pack_vs_memcpy": rate / copy_rate})

    pool_bytes = layout.pool_bytes(adapters)
    return {
        "bench": "pack",
        "setup": {"model": model_spec, "modules": [m.peft_name for m in modules], "rank": rank,
                  "adapters": adapters, "dtype": dtype, "repeats": repeats, "device": device,
                  "cpus": os.cpu_count(), "cpus_usable": usable_cores(),
                  "load_average_1m": load,
                  # Whether the host fill read and checked with metrale_cli/_native.c (an
                  # install without a C compiler reads with os.preadv and checks with NumPy).
                  "compiled_reader": native.compiled is not None},
        "tensor_bytes": tensor_bytes,
        "pool_bytes": pool_bytes,
        # The plain copy: numpy.copyto on the host, pinned host to device memory on a GPU.
        "memcpy_gb_per_s": copy_rate / 1e9,
        "pack_gb_per_s": pack_rate / 1e9,
        "pack_vs_memcpy": pack_rate / copy_rate,
        # The same checked pack of the adapters written a tensor at a time (`_tensor_written`).
        "pack_tensor_writes_gb_per_s": written_rate / 1e9,
        "pack_tensor_writes_vs_memcpy": written_rate / copy_rate,
        # The checked passes' host fills large enough to share their reads: on two threads, of all.
        "shared_fills": [shared[2], shared[1] + shared[2]],
        "pack_unchecked_gb_per_s": unchecked_rate / 1e9,
        # > 1: how much longer the pack takes with the NaN/Inf check than without.
        "finite_check_cost": unchecked_rate / pack_rate,
        "end_to_end_pack_gb_per_s": packed["pack_gb_per_s"],
        "end_to_end_wall_s": wall,
        "peak_rss_bytes": peak_rss,
        "peak_rss_minus_pool_bytes": peak_rss - pool_bytes,
        "rss_within_pool_plus_256mib": peak_rss <= pool_bytes + RSS_ALLOWANCE,
        "experts": expert_record,
        "tp": None if tp is None else {"tp_size": tp.tp_size, "ep_size": tp.ep_size,
                                       "fully_sharded": tp.fully_sharded, "ranks": ranks},
    }
