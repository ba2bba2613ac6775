"""The byte-exact layout of one pool slot, and the capacity plan of a pool of such slots.

Every (layer, module) pair with the module in the set and `applies_to_layer` true is an entry, in
layer order then the family's module order (model/families.py). Each entry reserves A
`[max_rank, in_dim]` then B `[out_dim, max_rank]`, row-major BF16, each at an aligned offset;
`slot_bytes` is the total rounded up to the alignment. Nothing is reserved where a module does not
apply.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from metrale_cli.arguments import checked_as
from metrale_cli.errors import UsageError
from metrale_cli.model.config import ModelConfig
from metrale_cli.model.modules import LoraModule, in_slot_order

BF16_BYTES = 2
DEFAULT_ALIGN = 256
# The widest alignment taken: a GPU's 2 MiB large page. Every region pads to it, so past it a
# figure is a typo (a 1 TiB alignment made a 64 TiB slot of 32 regions, exit 0).
MAX_ALIGN = 1 << 21
LAYOUT_FORMAT = "slot-layout/1"
# Per slot and entry the pool keeps an A and a B pointer (u64); per slot a scale (f32) and a
# rank (i32).
POINTER_BYTES = 8
SCALE_BYTES = 4
RANK_BYTES = 4


# Bytes past which a slot, a pool or an engine's buffers are refused: a thousand times the
# largest GPU's memory (and any host's), so a plan past it is a typo in --max-rank, --max-loras
# or --budget, never a deployment.
MAX_PLAN_BYTES = 1 << 50


def refuse_past_plan_bytes(what: str, n: int, flags: str, per: str = "") -> None:
    """UsageError when `what` would take more than MAX_PLAN_BYTES (`per`: " per GPU" and the
    like), naming its size and the `flags` that make it."""
    if n > MAX_PLAN_BYTES:
        raise UsageError(f"{what} would take {n:,} B ({(n + (1 << 39)) >> 40:,} TiB){per}, past "
                         f"the {MAX_PLAN_BYTES >> 40:,} TiB no machine holds: check {flags}")


def align_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def place_pair(offset: int, out_dim: int, in_dim: int, max_rank: int,
               align: int, a_rows: int | None = None) -> tuple[int, int, int]:
    """Reserve A `[a_rows, in_dim]` (`a_rows` defaults to `max_rank`; a fully sharded
    column-parallel shard holds fewer) then B `[out_dim, max_rank]` (BF16) at aligned offsets
    from `offset`: returns (a_offset, b_offset, end)."""
    a_offset = align_up(offset, align)
    rows = max_rank if a_rows is None else a_rows
    b_offset = align_up(a_offset + rows * in_dim * BF16_BYTES, align)
    return a_offset, b_offset, b_offset + out_dim * max_rank * BF16_BYTES


def padded_end(entries: tuple[Any, ...], align: int) -> int:
    """The bytes of a slot holding `entries` (padded pairs in offset order), aligned; a slot
    past MAX_PLAN_BYTES (a max rank of 10**20) is refused."""
    if not entries:
        return 0
    last = entries[-1]
    end = align_up(last.b_offset + last.b_bytes, align)
    refuse_past_plan_bytes("a slot", end, "--max-rank")
    return end


def fingerprint_of(canonical: dict[str, Any]) -> str:
    """The 32-hex-digit hash of a layout's canonical description."""
    blob = json.dumps(canonical, separators=(",", ":"), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def check_rank_and_align(max_rank: int, align: int) -> None:
    """What every padded layout needs: a positive max rank, a power-of-two alignment."""
    if max_rank <= 0:
        raise UsageError(f"max rank must be positive, got {max_rank}")
    if align <= 0 or align & (align - 1):
        raise UsageError(f"alignment must be a power of two, got {align}")
    if align < 16:
        # Every region starts on `align`; the kernels read weights with 16-byte loads.
        raise UsageError(f"alignment must be at least 16 bytes (the kernels' loads), got {align}")
    if align > MAX_ALIGN:
        raise UsageError(f"alignment must be at most {MAX_ALIGN:,} bytes (a GPU's large page), "
                         f"got {align:,}")


# B's output rows `[lo, hi)` an entry holds, as runs in B's row order.
RowRuns = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Slice:
    """Which part of a `full` `[out, in]` weight's LoRA pair an entry holds: B's output `rows`
    (all R columns) as runs `[lo, hi)`, A's input `cols` `[lo, hi)`, and, fully sharded
    column-parallel, only A's padded rank rows `ranks` `[lo, hi)`. An unsharded entry holds the
    whole pair: one run of every row. A column-parallel rank of a fused projection (q|k|v,
    gate|up) holds one run per slice, end to end in its B, as the engines concatenate them."""

    full: tuple[int, int]
    rows: RowRuns
    cols: tuple[int, int]
    ranks: tuple[int, int] | None = None

    @classmethod
    def whole(cls, out_dim: int, in_dim: int) -> Slice:
        return cls((out_dim, in_dim), ((0, out_dim),), (0, in_dim))

    @property
    def out_rows(self) -> int:
        """How many of B's output rows the entry holds (its `out_dim`)."""
        return sum(hi - lo for lo, hi in self.rows)

    def a_rows(self, max_rank: int) -> int:
        return self.ranks[1] - self.ranks[0] if self.ranks is not None else max_rank

    def is_whole(self, max_rank: int) -> bool:
        """Whether the entry holds the whole pair (its bytes are the unsharded entry's)."""
        return (self.rows == ((0, self.full[0]),) and self.cols == (0, self.full[1])
                and self.ranks in (None, (0, max_rank)))

    def _rows_record(self) -> list[Any]:
        # One run is `[lo, hi]`, as every image before fused slices recorded it.
        return list(self.rows[0]) if len(self.rows) == 1 else [list(r) for r in self.rows]

    def flat(self) -> list[Any]:
        return [*self._rows_record(), *self.cols, *(self.ranks or ())]

    def record(self) -> dict[str, Any]:
        record: dict[str, Any] = {"full": list(self.full), "rows": self._rows_record(),
                                  "cols": list(self.cols)}
        if self.ranks is not None:
            record["ranks"] = list(self.ranks)
        return record


@dataclass(frozen=True, kw_only=True)
class PaddedPair:
    """The A `[max_rank, in_dim]` and B `[out_dim, max_rank]` BF16 regions of one projection at
    byte offsets `a_offset`, `b_offset` within a slot; the base of the slot layout's and the
    expert layout's entries, which name what the pair adapts before these fields."""

    out_dim: int
    in_dim: int
    a_offset: int
    b_offset: int
    max_rank: int

    @property
    def held(self) -> Slice:
        """The part of the whole weight's pair the entry holds: all of it here; a
        tensor-parallel rank's entry holds its slice. Packing fills every entry by it."""
        return Slice.whole(self.out_dim, self.in_dim)

    @property
    def a_rows(self) -> int:
        """The rank rows A reserves: `max_rank` (a fully sharded shard holds a part of them)."""
        return self.held.a_rows(self.max_rank)

    @property
    def full_dims(self) -> tuple[int, int]:
        """`(out_dim, in_dim)` of the whole weight the pair adapts (a shard holds a part)."""
        return self.held.full

    @property
    def a_bytes(self) -> int:
        return self.a_rows * self.in_dim * BF16_BYTES

    @property
    def b_bytes(self) -> int:
        return self.out_dim * self.max_rank * BF16_BYTES

    def record(self) -> dict[str, Any]:
        return {"out_dim": self.out_dim, "in_dim": self.in_dim, "a_offset": self.a_offset,
                "b_offset": self.b_offset}


@dataclass(frozen=True)
class LayoutEntry(PaddedPair):
    layer: int
    module: LoraModule

    def record(self) -> dict[str, Any]:
        return {"layer": self.layer, "module": self.module.peft_name, **super().record()}


@dataclass(frozen=True)
class SlotLayout:
    model: ModelConfig
    modules: tuple[LoraModule, ...]
    max_rank: int
    align: int = DEFAULT_ALIGN

    def __post_init__(self) -> None:
        check_rank_and_align(self.max_rank, self.align)
        self.slot_bytes  # noqa: B018  (a slot past MAX_PLAN_BYTES is refused as it is made)
        # An empty module set is a zero-byte slot: a pool that serves only expert LoRA or
        # token overlays (the CLI refuses an empty --modules itself).

    @classmethod
    @checked_as("SlotLayout.build")
    def build(
        cls, model: ModelConfig, modules: list[LoraModule] | tuple[LoraModule, ...],
        max_rank: int, align: int = DEFAULT_ALIGN,
    ) -> SlotLayout:
        return cls(model, in_slot_order(model, modules), max_rank, align)

    def applied(self) -> Iterator[tuple[int, LoraModule]]:
        """Every (layer, module) pair with the module in the set and applying to the layer, in
        layout order (layer, then module)."""
        for layer in range(self.model.num_hidden_layers):
            for module in self.modules:
                if module.applies_to_layer(self.model, layer):
                    yield layer, module

    @cached_property
    def entries(self) -> tuple[LayoutEntry, ...]:
        entries = []
        offset = 0
        for layer, module in self.applied():
            out_dim, in_dim = module.dims(self.model, layer)
            a_offset, b_offset, offset = place_pair(offset, out_dim, in_dim, self.max_rank,
                                                    self.align)
            entries.append(LayoutEntry(layer, module, out_dim=out_dim, in_dim=in_dim,
                                       a_offset=a_offset, b_offset=b_offset,
                                       max_rank=self.max_rank))
        return tuple(entries)

    @cached_property
    def index(self) -> dict[tuple[int, LoraModule], int]:
        """(layer, module) -> entry index."""
        return {(e.layer, e.module): i for i, e in enumerate(self.entries)}

    @cached_property
    def slot_bytes(self) -> int:
        return padded_end(self.entries, self.align)

    @cached_property
    def fingerprint(self) -> str:
        """A hash of everything that decides byte positions: two pools whose fingerprints match
        read a slot's bytes the same way."""
        canonical = {
            "format": LAYOUT_FORMAT,
            "dtype": "BF16",
            "align": self.align,
            "max_rank": self.max_rank,
            "slot_bytes": self.slot_bytes,
            "entries": [
                [e.layer, e.module.peft_name, e.out_dim, e.in_dim, e.a_offset, e.b_offset]
                for e in self.entries
            ],
        }
        return fingerprint_of(canonical)

    # -- capacity -------------------------------------------------------------------------------

    def table_bytes(self, max_loras: int) -> int:
        """Pointer tables (A and B per entry), the scale table and the rank table."""
        return max_loras * (len(self.entries) * 2 * POINTER_BYTES + SCALE_BYTES + RANK_BYTES)

    def pool_bytes(self, max_loras: int) -> int:
        return max_loras * self.slot_bytes

    def shares(self) -> dict[str, dict[str, int]]:
        """Slot bytes by module and by layer kind (A + B, without alignment padding)."""
        by_module: dict[str, int] = {}
        by_layer_kind: dict[str, int] = {}
        for e in self.entries:
            size = e.a_bytes + e.b_bytes
            by_module[e.module.peft_name] = by_module.get(e.module.peft_name, 0) + size
            kind = self.model.layer_type(e.layer).value
            by_layer_kind[kind] = by_layer_kind.get(kind, 0) + size
        return {"module": by_module, "layer_kind": by_layer_kind}

    def record(self, max_loras: int | None = None) -> dict[str, Any]:
        return {
            "slot_bytes": self.slot_bytes,
            "pool_bytes": self.pool_bytes(max_loras) if max_loras is not None else None,
            "max_rank": self.max_rank,
            "max_loras": max_loras,
            "align": self.align,
            "dtype": "BF16",
            "modules": [m.peft_name for m in self.modules],
            "fingerprint": self.fingerprint,
            "entries": [e.record() for e in self.entries],
        }

