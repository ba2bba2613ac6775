"""`metrale bench pack`: packing throughput against a plain memory copy of the same bytes, and
the peak memory of a real `metrale pack` run against the pool's size, measured in one run."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from metrale_cli.adapter import Adapter
from metrale_cli.audit import audit
from metrale_cli.layout import SlotLayout
from metrale_cli.models import ModelConfig
from metrale_cli.modules import LoraModule
from metrale_cli.pool import LoraPool
from metrale_cli.sharding import ShardSpec, rank_layouts
from metrale_cli.synth import synth_adapter

RSS_ALLOWANCE = 256 << 20


def _copy_rate(nbytes: int, repeats: int) -> float:
    """Best-of-`repeats` numpy.copyto bandwidth (bytes/s) between two pre-touched buffers."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.ones(nbytes, dtype=np.uint8)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - started)
    return nbytes / best


def _warm_page_cache(paths: list[Path]) -> None:
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.read(64 << 20):
                pass


def run(
    model: ModelConfig,
    model_spec: str,
    modules: list[LoraModule],
    rank: int,
    adapters: int,
    dtype: str = "bf16",
    repeats: int = 3,
    workdir: Path | None = None,
    tp: ShardSpec | None = None,
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        root = Path(tmp)
        paths = []
        for i in range(adapters):
            synth_adapter(root / f"a{i}", model, model_spec, modules, rank, dtype=dtype, seed=i)
            paths.append(root / f"a{i}")
        _warm_page_cache([p / "adapter_model.safetensors" for p in paths])
        reports = [audit(Adapter.load(p), model) for p in paths]
        layout = SlotLayout.build(model, modules, rank)
        tensor_bytes = sum(m.a.nbytes + m.b.nbytes for r in reports for m in r.modules)

        # End to end, as a user runs it, in a child process so its peak RSS is its own (first,
        # before this process holds large buffers a forked child would count).
        cmd = [sys.executable, "-m", "metrale_cli", "pack", *map(str, paths), "--model",
               model_spec, "--max-loras", str(adapters), "--device", "cpu", "--json"]
        started = time.perf_counter()
        child = subprocess.run(cmd, capture_output=True, text=True, check=False)
        wall = time.perf_counter() - started
        if child.returncode != 0:
            raise RuntimeError(f"metrale pack failed: {child.stderr.strip()}")
        peak_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        packed = json.loads(child.stdout)

        copy_rate = _copy_rate(tensor_bytes, repeats)
        # The packing work itself: the pool is allocated and its pages faulted in first, as a
        # serving engine's pool is long before adapters swap in.
        pool = LoraPool(layout, adapters)
        pool.pool.fill(0)
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            for slot, report in enumerate(reports):
                pool.pack_slot(slot, report)
            best = min(best, time.perf_counter() - started)
            for slot in range(adapters):
                pool.clear_slot(slot)
        pack_rate = tensor_bytes / best
        del pool
        ranks = [_rank_rate(layout, reports, s, repeats, copy_rate) for s in tp.all_ranks()] \
            if tp is not None else None

    pool_bytes = layout.pool_bytes(adapters)
    return {
        "bench": "pack",
        "setup": {"model": model_spec, "modules": [m.peft_name for m in modules], "rank": rank,
                  "adapters": adapters, "dtype": dtype, "repeats": repeats,
                  "cpus": os.cpu_count()},
        "tensor_bytes": tensor_bytes,
        "pool_bytes": pool_bytes,
        "memcpy_gb_per_s": copy_rate / 1e9,
        "pack_gb_per_s": pack_rate / 1e9,
        "pack_vs_memcpy": pack_rate / copy_rate,
        "end_to_end_pack_gb_per_s": packed["pack_gb_per_s"],
        "end_to_end_wall_s": wall,
        "peak_rss_bytes": peak_rss,
        "peak_rss_minus_pool_bytes": peak_rss - pool_bytes,
        "rss_within_pool_plus_256mib": peak_rss <= pool_bytes + RSS_ALLOWANCE,
        "tp": None if tp is None else {**{k: v for k, v in tp.record().items()
                                          if k in ("tp_size", "ep_size", "fully_sharded")},
                                       "ranks": ranks},
    }


def _rank_rate(layout: SlotLayout, reports: list[Any], spec: ShardSpec, repeats: int,
               copy_rate: float) -> dict[str, Any]:
    """One TP rank's packing throughput: the bytes it reads (its slices) per second, best of
    `repeats`, into a pre-faulted pool of its layout, as the unsharded rate is measured."""
    ranked, _ = rank_layouts(layout, None, spec)
    pool = LoraPool(ranked, len(reports))
    pool.pool.fill(0)
    best, read = float("inf"), 0
    for _ in range(repeats):
        started = time.perf_counter()
        read = sum(pool.pack_slot(slot, r).bytes_read for slot, r in enumerate(reports))
        best = min(best, time.perf_counter() - started)
        for slot in range(len(reports)):
            pool.clear_slot(slot)
    return {"tp_rank": spec.tp_rank, "slot_bytes": ranked.slot_bytes, "bytes_read": read,
            "pack_gb_per_s": read / best / 1e9, "pack_vs_memcpy": read / best / copy_rate}
