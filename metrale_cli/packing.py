"""`metrale pack`: audited adapters into a pool, timed, and written out as a pool image."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from metrale_cli.audit import AdapterReport
from metrale_cli.expert_pool import ExpertLayout
from metrale_cli.image import write_image
from metrale_cli.layout import SlotLayout
from metrale_cli.plan import max_rank_warnings
from metrale_cli.pool import LoraPool, PackStats, pick_device


@dataclass
class PackResult:
    pool: LoraPool
    stats: list[PackStats]
    pack_seconds: float
    image: Path | None
    image_bytes: int
    write_seconds: float

    @property
    def bytes_read(self) -> int:
        return sum(s.bytes_read for s in self.stats)

    @property
    def bytes_packed(self) -> int:
        return sum(s.bytes_written for s in self.stats)

    @property
    def warnings(self) -> list[str]:
        """What the pool holds that the kernels would refuse."""
        return max_rank_warnings(self.pool.layout.max_rank)

    def record(self) -> dict[str, Any]:
        layout = self.pool.layout
        return {
            "device": self.pool.device,
            "layout": {k: v for k, v in layout.record(self.pool.max_loras).items()
                       if k != "entries"},
            "entries": len(layout.entries),
            "table_bytes": layout.table_bytes(self.pool.max_loras),
            "experts": ({**self.pool.expert_layout.record(self.pool.max_loras, entries=False),
                         "table_bytes": self.pool.expert_layout.table_bytes(self.pool.max_loras)}
                        if self.pool.expert_layout is not None else None),
            "slots": [
                {**s, "expert_pairs": int((self.pool.expert_slot_offsets(s["slot"])[0] >= 0)
                                          .sum()) if self.pool.expert_layout else 0,
                 "overlays": raw.record() if raw is not None else []}
                for s, raw in zip(self.pool.slot_records(), self.pool.overlay_raw, strict=True)
            ],
            "bytes_read": self.bytes_read,
            "bytes_packed": self.bytes_packed,
            "pack_seconds": self.pack_seconds,
            "pack_gb_per_s": self.bytes_read / self.pack_seconds / 1e9 if self.pack_seconds
            else None,
            "image": str(self.image) if self.image else None,
            "image_bytes": self.image_bytes,
            "write_seconds": self.write_seconds,
            "warnings": self.warnings,
        }


def pack_pool(
    layout: SlotLayout,
    max_loras: int,
    reports: list[AdapterReport],
    device: str = "auto",
    out: Path | None = None,
    force: bool = False,
    progress_console: Any = None,
    expert_layout: ExpertLayout | None = None,
) -> PackResult:
    """Pack `reports` into slots [0, n) of a new pool (with an expert pool laid out by
    `expert_layout` when given); write the image to `out` if given."""
    total = sum(m.a.nbytes + m.b.nbytes for r in reports for m in r.modules)
    # Expert tensors are read once per file tensor, however many experts share it.
    total += sum(a.nbytes + b.nbytes for r in reports
                 for a, b in {(p.a, p.b) for p in r.expert_pairs})
    started = time.perf_counter()
    if progress_console is not None:
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        with Progress("packing", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                      TimeRemainingColumn(), console=progress_console, transient=True) as bar:
            task = bar.add_task("pack", total=total)
            pool, stats = LoraPool.load(layout, max_loras, reports, pick_device(device),
                                        progress=lambda n: bar.advance(task, n),
                                        expert_layout=expert_layout)
    else:
        pool, stats = LoraPool.load(layout, max_loras, reports, pick_device(device),
                                    expert_layout=expert_layout)
    pack_seconds = time.perf_counter() - started
    image_bytes, write_seconds = 0, 0.0
    if out is not None:
        started = time.perf_counter()
        image_bytes = write_image(pool, out, force)
        write_seconds = time.perf_counter() - started
    return PackResult(pool, stats, pack_seconds, out, image_bytes, write_seconds)
