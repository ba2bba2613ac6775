"""The expert pool's layout: `ExpertLayout` lays `ExpertPair`s out in one expert slot the way
`SlotLayout` lays out modules in a slot (pool/fill.py fills a slot, region.py holds the pool)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from metrale_cli.adapters.experts import ROUTER_EXPERT, ExpertPair, ExpertProj, entry_sort_key
from metrale_cli.layout.slot_layout import (
    DEFAULT_ALIGN,
    POINTER_BYTES,
    PaddedPair,
    check_rank_and_align,
    fingerprint_of,
    padded_end,
    place_pair,
)
from metrale_cli.model.config import ModelConfig

EXPERT_LAYOUT_FORMAT = "expert-layout/1"

# -- the layout ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExpertEntry(PaddedPair):
    """A pair of an expert slot (offsets within the expert slot)."""

    layer: int
    proj: ExpertProj
    expert: int

    def record(self) -> dict[str, Any]:
        return {"layer": self.layer, "proj": self.proj.value, "expert": self.expert,
                **super().record()}


@dataclass(frozen=True)
class ExpertLayout:
    """One expert slot: every (layer, projection, expert) in `keys`, each reserving A
    `[max_rank, in_dim]` then B `[out_dim, max_rank]`, row-major BF16 at aligned offsets, in
    `entry_sort_key` order (as `SlotLayout` does for modules)."""

    model: ModelConfig
    keys: tuple[tuple[int, ExpertProj, int], ...]
    max_rank: int
    align: int = DEFAULT_ALIGN

    def __post_init__(self) -> None:
        check_rank_and_align(self.max_rank, self.align)

    @classmethod
    def build(cls, model: ModelConfig, keys: Iterable[tuple[int, ExpertProj, int]],
              max_rank: int, align: int = DEFAULT_ALIGN) -> ExpertLayout:
        ordered = tuple(sorted(set(keys), key=lambda k: entry_sort_key(*k)))
        return cls(model, ordered, max_rank, align)

    @classmethod
    def for_model(cls, model: ModelConfig, max_rank: int,
                  align: int = DEFAULT_ALIGN) -> ExpertLayout:
        """Every routed expert's gate/up/down (and the router, where the family's is the
        pool's) on every MoE layer: what a pool must reserve to take any expert adapter of
        rank <= max_rank."""
        keys = []
        for layer in model.moe_layers:
            if model.family.expert_router:
                keys.append((layer, ExpertProj.ROUTER, ROUTER_EXPERT))
            keys.extend((layer, p, e) for e in range(model.num_experts)
                        for p in (ExpertProj.GATE_PROJ, ExpertProj.UP_PROJ, ExpertProj.DOWN_PROJ))
        return cls.build(model, keys, max_rank, align)

    @classmethod
    def for_pairs(cls, model: ModelConfig, pairs: Iterable[ExpertPair], max_rank: int | None,
                  align: int = DEFAULT_ALIGN) -> ExpertLayout | None:
        """The pairs' union, padded to `max_rank` (default: their largest rank); None when
        there are none."""
        pairs = list(pairs)
        if not pairs:
            return None
        rank = max_rank if max_rank is not None else max(p.r for p in pairs)
        return cls.build(model, (p.key for p in pairs), rank, align)

    @classmethod
    def from_record(cls, model: ModelConfig, record: dict[str, Any]) -> ExpertLayout:
        keys = [(int(e["layer"]), ExpertProj(e["proj"]), int(e["expert"]))
                for e in record["entries"]]
        return cls.build(model, keys, int(record["max_rank"]), int(record["align"]))

    def held_pairs(self, pairs: Iterable[ExpertPair]) -> list[ExpertPair]:
        """The pairs of an adapter's that a pool of this layout holds: every one (a pair
        outside the layout is refused when packed). A tensor-parallel rank's layout holds its
        expert-parallel group's only: this is where pack, verify and swap learn which."""
        return list(pairs)

    @cached_property
    def entries(self) -> tuple[ExpertEntry, ...]:
        entries = []
        offset = 0
        rank, align = self.max_rank, self.align
        for layer, proj, expert in self.keys:
            out_dim, in_dim = proj.dims(self.model)
            a_offset, b_offset, offset = place_pair(offset, out_dim, in_dim, rank, align)
            entries.append(ExpertEntry(layer, proj, expert, out_dim=out_dim, in_dim=in_dim,
                                       a_offset=a_offset, b_offset=b_offset, max_rank=rank))
        return tuple(entries)

    @cached_property
    def index(self) -> dict[tuple[int, ExpertProj, int], int]:
        return {k: i for i, k in enumerate(self.keys)}

    @cached_property
    def slot_bytes(self) -> int:
        """The bytes of one expert slot (the image's `expert_slot_bytes`)."""
        return padded_end(self.entries, self.align)

    @cached_property
    def fingerprint(self) -> str:
        canonical = {
            "format": EXPERT_LAYOUT_FORMAT, "dtype": "BF16", "align": self.align,
            "max_rank": self.max_rank, "expert_slot_bytes": self.slot_bytes,
            "entries": [[e.layer, e.proj.value, e.expert, e.out_dim, e.in_dim, e.a_offset,
                         e.b_offset] for e in self.entries],
        }
        return fingerprint_of(canonical)

    def table_bytes(self, max_loras: int) -> int:
        """The expert A and B pointer tables, `[n_entries, max_loras]` u64 each."""
        return max_loras * len(self.entries) * 2 * POINTER_BYTES

    def pool_bytes(self, max_loras: int) -> int:
        return max_loras * self.slot_bytes

    def shares(self) -> dict[str, int]:
        """Expert-slot bytes by projection (A + B, without alignment padding)."""
        by_proj: dict[str, int] = {}
        for e in self.entries:
            by_proj[e.proj.value] = by_proj.get(e.proj.value, 0) + e.a_bytes + e.b_bytes
        return by_proj

    def record(self, max_loras: int | None = None, entries: bool = True) -> dict[str, Any]:
        layers = sorted({e.layer for e in self.entries})
        record: dict[str, Any] = {
            "expert_slot_bytes": self.slot_bytes,
            "expert_pool_bytes": self.pool_bytes(max_loras) if max_loras is not None else None,
            "max_rank": self.max_rank,
            "align": self.align,
            "dtype": "BF16",
            "n_entries": len(self.entries),
            "layers": layers,
            "experts_per_layer": self.model.num_experts,
            "fingerprint": self.fingerprint,
        }
        if entries:
            record["entries"] = [e.record() for e in self.entries]
        return record
