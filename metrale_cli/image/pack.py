"""`metrale pack`: audited adapters packed into a pool, timed, and written out as a pool image.

Without tensor parallelism that is one pool of the whole weights; with a `ShardSpec`, one pool
per rank (its slices of every adapter, `sharding.RankLayout`), packed here one after another
(one rank's pool in memory at a time) or one per process under torchrun (`dist/torchrun.py`,
which calls `pack_rank` too). Rank k's image is `DIR/rank-{k}-of-{N}.safetensors`, a `pool/1`
image of the rank's layout with `metrale.shard` metadata (docs/tensor-parallel.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from metrale_cli.adapters.audit import AdapterReport
from metrale_cli.files.atomic import atomic_directory, check_not_an_input
from metrale_cli.image.pool_image import write_image
from metrale_cli.layout.expert_layout import ExpertLayout
from metrale_cli.layout.plan import max_rank_warnings
from metrale_cli.layout.sharding import (
    ShardSpec,
    all_rank_layouts,
    rank_layouts,
    refuse_unshardable,
)
from metrale_cli.layout.slot_layout import SlotLayout
from metrale_cli.pool.pool import LoraPool, PackStats, pick_device

# Every rank image's name matches it: `--force` replaces a DIR that holds only such files.
IMAGE_GLOB = "rank-*-of-*.safetensors"
# What metrale writes into a --tp DIR: the images, and what a torchrun rank killed before it
# finished leaves there (its staged image, the atomic write's temp file of it, the image --force
# moved aside): `--force` replaces a DIR that holds only such files.
OWNED_GLOBS = (IMAGE_GLOB, ".rank-*-of-*.safetensors.staged", ".rank-*-of-*.safetensors.replaced",
               "..rank-*-of-*.safetensors.staged.*.tmp")


def image_name(spec: ShardSpec) -> str:
    return f"rank-{spec.tp_rank}-of-{spec.tp_size}.safetensors"


def tensor_bytes(reports: list[AdapterReport]) -> int:
    """The adapter file bytes a pack of the whole weights reads (a progress bar's total):
    every module's A and B, and each expert file tensor once, however many experts share it."""
    total = sum(m.a.nbytes + m.b.nbytes for r in reports for m in r.modules)
    return total + sum(a.nbytes + b.nbytes for r in reports
                       for a, b in {(p.a, p.b) for p in r.expert_pairs})


def pool_record(pool: LoraPool, stats: list[PackStats], pack_seconds: float,
                image: Path | None, image_bytes: int, write_seconds: float) -> dict[str, Any]:
    """One packed pool as `metrale pack --json` reports it."""
    layout, ex = pool.layout, pool.expert_region
    read = sum(s.bytes_read for s in stats)
    return {
        "device": pool.device,
        "layout": {k: v for k, v in layout.record(pool.max_loras).items() if k != "entries"},
        "entries": len(layout.entries),
        "table_bytes": layout.table_bytes(pool.max_loras),
        "experts": ({**pool.expert_layout.record(pool.max_loras, entries=False),
                     "table_bytes": pool.expert_layout.table_bytes(pool.max_loras)}
                    if pool.expert_layout is not None else None),
        "slots": [
            {**s, "expert_pairs": int(ex.adapted(s["slot"]).sum()) if ex else 0,
             "overlays": raw.record() if raw is not None else []}
            for s, raw in zip(pool.slot_records(), pool.overlay_raw, strict=True)
        ],
        "bytes_read": read,
        "bytes_packed": sum(s.bytes_written for s in stats),
        "pack_seconds": pack_seconds,
        "pack_gb_per_s": read / pack_seconds / 1e9 if pack_seconds else None,
        "image": str(image) if image else None,
        "image_bytes": image_bytes,
        "write_seconds": write_seconds,
        # What the pool holds that the kernels would refuse.
        "warnings": max_rank_warnings(layout.max_rank),
    }


def pack_rank(layout: SlotLayout, expert_layout: ExpertLayout | None, max_loras: int,
              reports: list[AdapterReport], spec: ShardSpec | None = None,
              device: str = "auto", path: Path | None = None, force: bool = False,
              progress: Callable[[int], None] | None = None,
              written: Callable[[int, int], None] | None = None
              ) -> tuple[LoraPool, dict[str, Any]]:
    """One pool, of rank `spec`'s layouts (the whole weights' without `spec`), with `reports`
    packed into slots [0, n); its image written to `path` if given. Returns the pool and its
    pack record, with the rank's `shard` under tensor parallelism. `progress` gets the file
    bytes read, `written` the image's bytes as they are written (`write_image`)."""
    if path is not None:  # the image never replaces one of the files it is packed from
        check_not_an_input(path, [p for r in reports for p in (r.adapter.weights_path,
                                                               r.adapter.config_path)])
    if spec is not None:
        layout, expert_layout = rank_layouts(layout, expert_layout, spec)
    started = time.perf_counter()
    pool, stats = LoraPool.load(layout, max_loras, reports, pick_device(device),
                                progress=progress, expert_layout=expert_layout)
    pack_seconds = time.perf_counter() - started
    image_bytes, write_seconds = 0, 0.0
    if path is not None:
        started = time.perf_counter()
        image_bytes = write_image(pool, path, force, written)
        write_seconds = time.perf_counter() - started
    record = pool_record(pool, stats, pack_seconds, path, image_bytes, write_seconds)
    return pool, record if spec is None else {"shard": spec.record(), **record}


@dataclass
class PackResult:
    """What `metrale pack` did: each pool's pack record (`pool_record`), rank 0 first; one
    pool, of the whole weights, where `spec` is None, and then the pool itself (under tensor
    parallelism each rank's pool is let go once packed: one in memory at a time)."""

    spec: ShardSpec | None
    out: Path | None
    ranks: list[dict[str, Any]]
    pool: LoraPool | None = None

    @property
    def bytes_read(self) -> int:
        return sum(r["bytes_read"] for r in self.ranks)

    @property
    def warnings(self) -> list[str]:
        """What the pools hold that the kernels would refuse (the same for every rank)."""
        return list(self.ranks[0]["warnings"]) if self.ranks else []

    def record(self) -> dict[str, Any]:
        """The one pool's record; under tensor parallelism the deployment and every rank's."""
        if self.spec is None:
            return self.ranks[0]
        return {"tp_size": self.spec.tp_size, "ep_size": self.spec.ep_size,
                "fully_sharded": self.spec.fully_sharded,
                "out": str(self.out) if self.out is not None else None,
                "bytes_read": self.bytes_read,
                "ranks": self.ranks}


def pack_pool(layout: SlotLayout, max_loras: int, reports: list[AdapterReport],
              device: str = "auto", out: Path | None = None, force: bool = False,
              progress: Callable[[int], None] | None = None,
              expert_layout: ExpertLayout | None = None,
              spec: ShardSpec | None = None,
              written: Callable[[int, int], None] | None = None) -> PackResult:
    """Pack `reports` into slots [0, n) of a new pool (with an expert pool laid out by
    `expert_layout` when given), or with `spec` into every rank's pool one after another in
    this process, and write the image to `out` if given. With `spec`, `out` is a directory
    where the rank images land all at once: a failure leaves no directory. `progress` and
    `written` as `pack_rank` takes them (`written` for the one pool's image)."""
    if spec is None:
        pool, record = pack_rank(layout, expert_layout, max_loras, reports, None, device, out,
                                 force, progress, written)
        return PackResult(None, out, [record], pool)
    refuse_unshardable(reports, spec)
    all_rank_layouts(layout, expert_layout, spec)  # every rank's rules hold before any byte moves
    specs = spec.all_ranks()
    records: list[dict[str, Any]] = []
    if out is None:
        records = [pack_rank(layout, expert_layout, max_loras, reports, s, device,
                             progress=progress)[1] for s in specs]
        return PackResult(spec, None, records)

    def fill(tmp: Path) -> None:
        for s in specs:
            _, record = pack_rank(layout, expert_layout, max_loras, reports, s, device,
                                  tmp / image_name(s), progress=progress)
            record["image"] = str(out / image_name(s))
            records.append(record)

    atomic_directory(out, fill, force, owned=OWNED_GLOBS)
    return PackResult(spec, out, records)
