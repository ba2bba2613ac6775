"""Pools for a tensor-parallel deployment: one pool image per rank, packed in one process
(`metrale pack --tp N`), each rank reading from the adapter files only its shard's bytes.

Rank k's image is `DIR/rank-{k}-of-{N}.safetensors`, a `pool/1` image of the rank's layout
(`sharding.RankLayout`) with `metrale.shard` metadata (docs/tensor-parallel.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from metrale_cli.atomic import atomic_directory
from metrale_cli.audit import AdapterReport
from metrale_cli.expert_pool import ExpertLayout
from metrale_cli.layout import SlotLayout
from metrale_cli.packing import pack_pool
from metrale_cli.sharding import ShardSpec, rank_layouts, rank_report


def image_name(spec: ShardSpec) -> str:
    return f"rank-{spec.tp_rank}-of-{spec.tp_size}.safetensors"


@dataclass
class ShardedPackResult:
    """What `pack --tp` did: each rank's pack record, rank 0 first."""

    spec: ShardSpec
    out: Path | None
    ranks: list[dict[str, Any]]

    def record(self) -> dict[str, Any]:
        return {"tp_size": self.spec.tp_size, "ep_size": self.spec.ep_size,
                "fully_sharded": self.spec.fully_sharded,
                "out": str(self.out) if self.out is not None else None,
                "bytes_read": sum(r["bytes_read"] for r in self.ranks),
                "ranks": self.ranks}


def pack_rank(layout: SlotLayout, expert_layout: ExpertLayout | None, max_loras: int,
              reports: list[AdapterReport], spec: ShardSpec, device: str = "auto",
              out: Path | None = None) -> dict[str, Any]:
    """Pack rank `spec.tp_rank`'s pool (its slices of every adapter) and write its image into
    the directory `out` if given; returns the rank's pack record with its `shard`."""
    ranked, ranked_experts = rank_layouts(layout, expert_layout, spec)
    path = out / image_name(spec) if out is not None else None
    result = pack_pool(ranked, max_loras, [rank_report(r, ranked_experts) for r in reports],
                       device, path, expert_layout=ranked_experts)
    return {"shard": spec.record(), **result.record()}


def pack_shards(layout: SlotLayout, expert_layout: ExpertLayout | None, max_loras: int,
                reports: list[AdapterReport], spec: ShardSpec, device: str = "auto",
                out: Path | None = None, force: bool = False) -> ShardedPackResult:
    """Every rank of `spec`'s deployment, one after another in this process (one rank's pool
    in memory at a time). With `out`, the images land in that directory all at once: a failure
    leaves no directory."""
    specs = spec.all_ranks()
    for s in specs:
        rank_layouts(layout, expert_layout, s)  # every rank's rules hold before any byte moves
    records: list[dict[str, Any]] = []
    if out is None:
        records = [pack_rank(layout, expert_layout, max_loras, reports, s, device)
                   for s in specs]
        return ShardedPackResult(spec, None, records)

    def fill(tmp: Path) -> None:
        for s in specs:
            record = pack_rank(layout, expert_layout, max_loras, reports, s, device, tmp)
            record["image"] = str(out / image_name(s))
            records.append(record)

    atomic_directory(out, fill, force)
    return ShardedPackResult(spec, out, records)
