"""The adapter pool: one fixed-address allocation of `max_loras` equal slots laid out by a
`SlotLayout`, per-entry pointer tables, a scale table, and the seed's slot manager (ref counts,
pinned startup slots, LRU victim selection, generations in the cache identity). Beside it, when
the pool serves expert LoRA, the expert pool: a second allocation of `max_loras` expert slots
laid out by an `ExpertLayout` with its own pointer tables; and per slot the raw token overlays.

The same code runs on a GPU (CuPy device memory) and on the host (NumPy); pointer tables then
hold device or host addresses. Packing converts on the host, one tensor at a time.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from metrale_cli.audit import AdapterReport, ModuleRecord
from metrale_cli.bf16 import RAW_DTYPES, to_bf16
from metrale_cli.compat import cupy_module, has_gpu
from metrale_cli.errors import FormatError, LayoutMismatch, PoolFull, SlotBusy, UsageError
from metrale_cli.expert_pool import ExpertLayout, pack_expert_slot
from metrale_cli.layout import SlotLayout
from metrale_cli.overlays import OverlayRaw, read_overlays
from metrale_cli.safetensors_header import TensorInfo

U64_MASK = (1 << 64) - 1


def adapter_id_hash(name: str, generation: int) -> int:
    """A 64-bit cache identity of an adapter name and its generation; never 0 (0 is the base
    model). Generation 0 folds to nothing, so an adapter keeps its identity at load."""
    h = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
    if generation:
        blob = h.to_bytes(8, "little") + (generation & U64_MASK).to_bytes(8, "little")
        h = int.from_bytes(hashlib.blake2b(blob, digest_size=8).digest(), "little")
    return h or 1


def routed_prefill_slot_of(adapter_slot: int, active: int, num_slots: int) -> int | None:
    """Resolve a request's `adapter_slot` (`>= 0` that slot, `-1` the active one) and return it
    only when it is an in-range slot other than the active one."""
    resolved = active if adapter_slot == -1 else adapter_slot
    if adapter_slot < -1 or not 0 <= resolved < num_slots or resolved == active:
        return None
    return resolved


@dataclass
class AdapterSlot:
    """One pool slot's resident adapter. An empty `name` marks a placeholder."""

    name: str = ""
    rank: int = 0
    alpha: float = 0.0
    scaling: float = 0.0
    source: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    # Incremented (wrapping) each time a disk or peer swap replaces the contents; 0 at load.
    generation: int = 0

    @property
    def filled(self) -> bool:
        return bool(self.name)

    def record(self, slot: int, pinned: bool) -> dict[str, Any]:
        return {
            "slot": slot, "name": self.name, "generation": self.generation, "rank": self.rank,
            "alpha": self.alpha, "scaling": self.scaling, "pinned": pinned,
            "source": self.source,
        }


@dataclass(frozen=True)
class SlotView:
    """A cache slot's state as victim selection reads it."""

    slot: int
    filled: bool
    ref_count: int
    last_used: int


@dataclass(frozen=True)
class PackStats:
    bytes_read: int
    bytes_written: int
    seconds: float


class LoraPool:
    """`max_loras` slots of `layout.slot_bytes` each, in one allocation."""

    def __init__(
        self, layout: SlotLayout, max_loras: int, device: str = "cpu",
        expert_layout: ExpertLayout | None = None,
    ) -> None:
        if max_loras <= 0:
            raise UsageError(f"max_loras must be positive, got {max_loras}")
        if device not in ("cpu", "cuda"):
            raise UsageError(f"device must be cpu or cuda, got {device!r}")
        self.layout = layout
        self.max_loras = max_loras
        self.device = device
        self.xp: Any = cupy_module() if device == "cuda" else np
        n = len(layout.entries)
        # The pool: [max_loras * slot_bytes] u8; slot k starts at byte k * slot_bytes.
        self.pool = self.xp.zeros(max_loras * layout.slot_bytes, dtype=np.uint8)
        # Row i is entry i's [max_loras] u64 table of A (B) addresses; 0 = slot does not adapt.
        self.a_tables = self.xp.zeros((n, max_loras), dtype=np.uint64)
        self.b_tables = self.xp.zeros((n, max_loras), dtype=np.uint64)
        # [max_loras] f32: slot k's PEFT scaling, 0.0 for an empty slot.
        self.scale_table = self.xp.zeros(max_loras, dtype=np.float32)
        # [max_loras] i32: slot k's rank (kernels bound their rank loops by it).
        self.rank_table = self.xp.zeros(max_loras, dtype=np.int32)
        self.expert_layout = expert_layout
        n_e = len(expert_layout.entries) if expert_layout is not None else 0
        expert_slot_bytes = expert_layout.expert_slot_bytes if expert_layout is not None else 0
        # The expert pool: [max_loras * expert_slot_bytes] u8, expert slot k from byte
        # k * expert_slot_bytes; a separate allocation so the slot pool keeps its size.
        self.expert_pool = self.xp.zeros(max_loras * expert_slot_bytes, dtype=np.uint8)
        # Row i is expert entry i's [max_loras] u64 table of A (B) addresses; 0 = not adapted.
        self.expert_a_tables = self.xp.zeros((n_e, max_loras), dtype=np.uint64)
        self.expert_b_tables = self.xp.zeros((n_e, max_loras), dtype=np.uint64)
        self._expert_zeroed = [True] * max_loras
        # [max_loras] i32: slot k's widest expert-pair rank (the expert kernels bound their rank
        # loops by it; a slot's expert pairs may be ranked apart from its modules).
        self.expert_rank_table = self.xp.zeros(max_loras, dtype=np.int32)
        # The seed's `overlay_raw`: per slot, its token-overlay rows as uploaded (host memory;
        # the served tables are built from them by the model), None without overlays.
        self.overlay_raw: list[OverlayRaw | None] = [None] * max_loras
        self.slots = [AdapterSlot() for _ in range(max_loras)]
        # A slot's bytes are all zero (fresh, or cleared): packing it needs no zero pass, which
        # would otherwise touch every page of a new pool twice.
        self._zeroed = [True] * max_loras
        self.ref_counts = [0] * max_loras
        self.last_used = [0] * max_loras
        self.lru_tick = 0
        self.pinned = 0
        self.active = 0
        self._lock = threading.RLock()

    # -- addresses ------------------------------------------------------------------------------

    @property
    def base_address(self) -> int:
        return int(self.pool.data.ptr) if self.device == "cuda" else self.pool.ctypes.data

    def table_address(self, entry: int, which: str = "a") -> int:
        """Address of entry `entry`'s `[max_loras]` u64 table (for a kernel launch)."""
        tables = self.a_tables if which == "a" else self.b_tables
        row = tables[entry]
        return int(row.data.ptr) if self.device == "cuda" else row.ctypes.data

    def slot_offsets(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """Per entry, byte offsets into `pool` of this slot's A and B, -1 where not adapted."""
        a = self.to_host(self.a_tables[:, slot]).astype(np.int64)
        b = self.to_host(self.b_tables[:, slot]).astype(np.int64)
        base = self.base_address
        return (np.where(a == 0, -1, a - base), np.where(b == 0, -1, b - base))

    @property
    def expert_base_address(self) -> int:
        if self.device == "cuda":
            return int(self.expert_pool.data.ptr)
        return self.expert_pool.ctypes.data

    def expert_table_address(self, entry: int, which: str = "a") -> int:
        """Address of expert entry `entry`'s `[max_loras]` u64 table."""
        tables = self.expert_a_tables if which == "a" else self.expert_b_tables
        row = tables[entry]
        return int(row.data.ptr) if self.device == "cuda" else row.ctypes.data

    def expert_slot_offsets(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """Per expert entry, byte offsets into `expert_pool` of this slot's A and B, -1 where
        not adapted."""
        a = self.to_host(self.expert_a_tables[:, slot]).astype(np.int64)
        b = self.to_host(self.expert_b_tables[:, slot]).astype(np.int64)
        base = self.expert_base_address
        return (np.where(a == 0, -1, a - base), np.where(b == 0, -1, b - base))

    def expert_slot_bytes_host(self, slot: int) -> np.ndarray:
        size = self.expert_layout.expert_slot_bytes if self.expert_layout is not None else 0
        return self.to_host(self.expert_pool[slot * size:(slot + 1) * size])

    def to_host(self, array: Any) -> np.ndarray:
        return self.xp.asnumpy(array) if self.device == "cuda" else np.asarray(array)

    # -- packing --------------------------------------------------------------------------------

    def pack_slot(
        self, slot: int, report: AdapterReport, progress: Callable[[int], None] | None = None
    ) -> PackStats:
        """Write an audited adapter into `slot`: BF16 with round-to-nearest-even, zero beyond
        its rank, each module's PEFT scaling relative to the slot's scale folded into its B, so
        that `scale_table[k] * (x @ A^T) @ B^T` is PEFT's delta for every module."""
        if not report.servable:
            raise UsageError(f"{report.name}: not servable; `metrale inspect` says why")
        self._check_slot(slot)
        missing = [m for m in report.modules if (m.layer, m.module) not in self.layout.index]
        if missing:
            m = missing[0]
            raise UsageError(f"{report.name}: {m.module.peft_name} on layer {m.layer} is not in "
                             "the pool's layout (its module set or max rank is too small)")
        over = [m for m in report.modules if m.r > self.layout.max_rank]
        if over:
            raise UsageError(f"{report.name}: rank {over[0].r} above the pool's max rank "
                             f"{self.layout.max_rank}")
        pairs = report.expert_pairs
        if pairs:
            ex = self.expert_layout
            if ex is None:
                raise UsageError(f"{report.name}: carries routed-expert or router LoRA and the "
                                 "pool has no expert pool (pack with --experts)")
            absent = [p for p in pairs if p.key not in ex.index]
            if absent:
                p = absent[0]
                raise UsageError(f"{report.name}: {p.proj.value} of expert {p.expert} on layer "
                                 f"{p.layer} is not in the pool's expert layout")
            over_pairs = [p for p in pairs if p.r > ex.max_rank]
            if over_pairs:
                raise UsageError(f"{report.name}: expert rank {over_pairs[0].r} above the "
                                 f"expert pool's max rank {ex.max_rank}")
        started = time.perf_counter()
        slot_bytes = self.layout.slot_bytes
        # Build the slot on the host (on a GPU this staging buffer is copied up once).
        if self.device == "cuda":
            staging = np.zeros(slot_bytes, dtype=np.uint8)
        else:
            staging = self.pool[slot * slot_bytes:(slot + 1) * slot_bytes]
            if not self._zeroed[slot]:
                staging.fill(0)  # stale modules and padding of the previous adapter
        self._zeroed[slot] = False
        scale = report.scaling
        read = 0
        fd = os.open(report.adapter.weights_path, os.O_RDONLY)
        try:
            reader = _TensorReader(fd, str(report.adapter.weights_path))

            for module in report.modules:
                entry = self.layout.entries[self.layout.index[(module.layer, module.module)]]
                done = _pack_module(reader, module, entry.a_offset, entry.b_offset,
                                    self.layout, staging, module.scaling / scale)
                read += done
                if progress is not None:
                    progress(done)
            expert_staging = self._expert_staging(slot, bool(pairs))
            if pairs and expert_staging is not None and self.expert_layout is not None:
                read += pack_expert_slot(reader, pairs, self.expert_layout, expert_staging,
                                         scale, progress)
            overlay = read_overlays(reader, report.overlays)
        finally:
            os.close(fd)
        base = self.base_address + slot * slot_bytes
        a_col = np.zeros(len(self.layout.entries), dtype=np.uint64)
        b_col = np.zeros(len(self.layout.entries), dtype=np.uint64)
        for module in report.modules:
            i = self.layout.index[(module.layer, module.module)]
            a_col[i] = base + self.layout.entries[i].a_offset
            b_col[i] = base + self.layout.entries[i].b_offset
        if self.device == "cuda":
            self.pool[slot * slot_bytes:(slot + 1) * slot_bytes].set(staging)
        self.a_tables[:, slot] = self.xp.asarray(a_col)
        self.b_tables[:, slot] = self.xp.asarray(b_col)
        if self.expert_layout is not None:
            ex = self.expert_layout
            ea_col = np.zeros(len(ex.entries), dtype=np.uint64)
            eb_col = np.zeros(len(ex.entries), dtype=np.uint64)
            ebase = self.expert_base_address + slot * ex.expert_slot_bytes
            for p in pairs:
                i = ex.index[p.key]
                ea_col[i] = ebase + ex.entries[i].a_offset
                eb_col[i] = ebase + ex.entries[i].b_offset
            if self.device == "cuda" and expert_staging is not None:
                self.expert_pool[slot * ex.expert_slot_bytes:
                                 (slot + 1) * ex.expert_slot_bytes].set(expert_staging)
            self.expert_a_tables[:, slot] = self.xp.asarray(ea_col)
            self.expert_b_tables[:, slot] = self.xp.asarray(eb_col)
        self.overlay_raw[slot] = overlay
        self.expert_rank_table[slot] = max((p.r for p in pairs), default=0)
        self.scale_table[slot] = scale
        self.rank_table[slot] = report.rank
        cfg = report.adapter.config
        self.slots[slot] = AdapterSlot(
            name=report.name, rank=report.rank, alpha=cfg.lora_alpha, scaling=scale,
            source=str(report.adapter.path), config=dict(cfg.raw),
            generation=self.slots[slot].generation,
        )
        written = slot_bytes + (self.expert_layout.expert_slot_bytes
                                if self.expert_layout is not None else 0)
        return PackStats(read, written, time.perf_counter() - started)

    def _expert_staging(self, slot: int, filled: bool) -> np.ndarray | None:
        """The host buffer an expert slot is built in: the region itself on the host (zeroed
        only if stale), a fresh buffer on a GPU (copied up once); None without an expert
        pool."""
        if self.expert_layout is None:
            return None
        size = self.expert_layout.expert_slot_bytes
        if self.device == "cuda":
            if not filled and self._expert_zeroed[slot]:
                return None
            staging = np.zeros(size, dtype=np.uint8)
        else:
            staging = self.expert_pool[slot * size:(slot + 1) * size]
            if not self._expert_zeroed[slot]:
                staging.fill(0)
        self._expert_zeroed[slot] = not filled
        return staging

    def clear_slot(self, slot: int) -> None:
        """Zero a slot's bytes, tables, scale and rank (and its expert slot and overlays); it
        becomes a placeholder."""
        slot_bytes = self.layout.slot_bytes
        self.pool[slot * slot_bytes:(slot + 1) * slot_bytes] = 0
        self.a_tables[:, slot] = 0
        self.b_tables[:, slot] = 0
        if self.expert_layout is not None:
            size = self.expert_layout.expert_slot_bytes
            self.expert_pool[slot * size:(slot + 1) * size] = 0
            self.expert_a_tables[:, slot] = 0
            self.expert_b_tables[:, slot] = 0
            self._expert_zeroed[slot] = True
        self.expert_rank_table[slot] = 0
        self.overlay_raw[slot] = None
        self.scale_table[slot] = 0.0
        self.rank_table[slot] = 0
        self._zeroed[slot] = True

    @classmethod
    def load(
        cls,
        layout: SlotLayout,
        max_loras: int,
        reports: list[AdapterReport],
        device: str = "cpu",
        progress: Callable[[int], None] | None = None,
        expert_layout: ExpertLayout | None = None,
    ) -> tuple[LoraPool, list[PackStats]]:
        """A pool with the startup adapters packed into slots [0, n), which are pinned."""
        if len(reports) > max_loras:
            raise UsageError(f"{len(reports)} adapters do not fit in --max-loras {max_loras}")
        pool = cls(layout, max_loras, device, expert_layout)
        stats = [pool.pack_slot(k, r, progress) for k, r in enumerate(reports)]
        pool.pinned = len(reports)
        return pool, stats

    # -- the slot manager -----------------------------------------------------------------------

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_loras:
            raise UsageError(f"slot {slot} is out of range [0, {self.max_loras})")

    def _resolve(self, slot: int) -> int:
        resolved = self.active if slot == -1 else slot
        self._check_slot(resolved)
        return resolved

    def slot_of(self, name: str) -> int | None:
        """The slot holding adapter `name`; placeholders never match."""
        return next((k for k, s in enumerate(self.slots) if s.filled and s.name == name), None)

    def adapter_names(self) -> list[str]:
        return [s.name for s in self.slots if s.filled]

    def adapter_id_for_slot(self, slot: int) -> int:
        """Cache identity of a request's `adapter_slot` (`>= 0` that slot, `-1` the active one),
        or 0 (the base model) when out of range or a placeholder."""
        resolved = self.active if slot < 0 else slot
        if not 0 <= resolved < self.max_loras:
            return 0
        s = self.slots[resolved]
        return adapter_id_hash(s.name, s.generation) if s.filled else 0

    def routed_prefill_slot(self, adapter_slot: int) -> int | None:
        return routed_prefill_slot_of(adapter_slot, self.active, self.max_loras)

    def acquire_slot(self, slot: int) -> int:
        """A sequence takes a count on the resolved slot; returns that slot."""
        with self._lock:
            resolved = self._resolve(slot)
            self.ref_counts[resolved] += 1
            self.lru_tick += 1
            self.last_used[resolved] = self.lru_tick
            return resolved

    def release_slot(self, slot: int) -> None:
        with self._lock:
            resolved = self._resolve(slot)
            if self.ref_counts[resolved] == 0:
                raise UsageError(f"slot {resolved} released more often than acquired")
            self.ref_counts[resolved] -= 1

    def touch_slot(self, slot: int) -> None:
        with self._lock:
            resolved = self._resolve(slot)
            self.lru_tick += 1
            self.last_used[resolved] = self.lru_tick

    def cache_slot_views(self) -> list[SlotView]:
        with self._lock:
            return [
                SlotView(k, self.slots[k].filled, self.ref_counts[k], self.last_used[k])
                for k in range(self.pinned, self.max_loras)
            ]

    def select_victim_slot(self) -> int:
        """An empty cache slot first, else the least recently used one with no in-flight
        sequences; PoolFull when every cache slot is busy. A pinned slot is never chosen."""
        views = self.cache_slot_views()
        empty = [v for v in views if not v.filled and v.ref_count == 0]
        if empty:
            return empty[0].slot
        idle = [v for v in views if v.ref_count == 0]
        if not idle:
            raise PoolFull(f"all {len(views)} cache slots have in-flight sequences")
        return min(idle, key=lambda v: v.last_used).slot

    def swap_in(self, slot: int, report: AdapterReport) -> int:
        """Replace `slot`'s contents with an adapter from disk; refused while the slot has
        in-flight sequences. Returns the new generation."""
        with self._lock:
            self._check_slot(slot)
            if self.ref_counts[slot] > 0:
                raise SlotBusy(f"slot {slot} has {self.ref_counts[slot]} in-flight sequences")
            generation = (self.slots[slot].generation + 1) & U64_MASK
            self.pack_slot(slot, report)
            self.slots[slot].generation = generation
            return generation

    def rotate(self, slot: int) -> None:
        """Make `slot` the active adapter; refused while the active slot is busy."""
        with self._lock:
            self._check_slot(slot)
            if not self.slots[slot].filled:
                raise UsageError(f"slot {slot} holds no adapter")
            if slot != self.active and self.ref_counts[self.active] > 0:
                raise SlotBusy(f"active slot {self.active} has {self.ref_counts[self.active]} "
                               "in-flight sequences")
            self.active = slot

    def land_slot(self, slot: int, source: Any, source_slot: int) -> int:
        """Copy one slot's bytes from another pool or a pool image with the same layout
        fingerprint (the peer-swap path). Returns the new generation."""
        if source.layout.fingerprint != self.layout.fingerprint:
            raise LayoutMismatch(
                f"layout fingerprint {source.layout.fingerprint} does not match this pool's "
                f"{self.layout.fingerprint}"
            )
        if not 0 <= source_slot < source.max_loras:
            raise UsageError(f"source slot {source_slot} is out of range")
        src_ex: ExpertLayout | None = getattr(source, "expert_layout", None)
        if src_ex is not None and self.expert_layout is not None:
            if src_ex.fingerprint != self.expert_layout.fingerprint:
                raise LayoutMismatch(
                    f"expert layout fingerprint {src_ex.fingerprint} does not match this "
                    f"pool's {self.expert_layout.fingerprint}")
        elif src_ex is not None and (source.expert_slot_offsets(source_slot)[0] >= 0).any():
            raise LayoutMismatch(f"source slot {source_slot} holds expert LoRA and this pool "
                                 "has no expert pool")
        with self._lock:
            self._check_slot(slot)
            if self.ref_counts[slot] > 0:
                raise SlotBusy(f"slot {slot} has {self.ref_counts[slot]} in-flight sequences")
            info: AdapterSlot = source.slots[source_slot]
            self._land_region(self.pool, self.a_tables, self.b_tables, self.base_address,
                              self.layout.slot_bytes, slot, source.slot_bytes_host(source_slot),
                              source.slot_offsets(source_slot), source_slot)
            self._zeroed[slot] = False
            self._land_experts(slot, source, source_slot, src_ex)
            raw = getattr(source, "overlay_raw", None)
            self.overlay_raw[slot] = raw[source_slot] if raw is not None else None
            self.scale_table[slot] = info.scaling
            self.rank_table[slot] = info.rank
            generation = (self.slots[slot].generation + 1) & U64_MASK
            self.slots[slot] = AdapterSlot(info.name, info.rank, info.alpha, info.scaling,
                                           info.source, dict(info.config), generation)
            return generation

    def _land_experts(self, slot: int, source: Any, source_slot: int,
                      src_ex: ExpertLayout | None) -> None:
        """The expert half of `land_slot`: the source's expert slot and tables, or zeros when
        the source has no expert pool."""
        ex = self.expert_layout
        if ex is None:
            return
        size = ex.expert_slot_bytes
        region = self.expert_pool[slot * size:(slot + 1) * size]
        if src_ex is None:
            region[...] = 0
            self.expert_a_tables[:, slot] = 0
            self.expert_b_tables[:, slot] = 0
            self._expert_zeroed[slot] = True
            self.expert_rank_table[slot] = 0
            return
        self._land_region(self.expert_pool, self.expert_a_tables, self.expert_b_tables,
                          self.expert_base_address, size, slot,
                          source.expert_slot_bytes_host(source_slot),
                          source.expert_slot_offsets(source_slot), source_slot)
        self._expert_zeroed[slot] = False
        # A pool image records no expert ranks: its pairs are bounded by the layout's max rank
        # (their padding is zero, so the bound costs work, never correctness).
        ranks = getattr(source, "expert_rank_table", None)
        adapted = bool((source.expert_slot_offsets(source_slot)[0] >= 0).any())
        self.expert_rank_table[slot] = (int(source.to_host(ranks)[source_slot])
                                        if ranks is not None else ex.max_rank if adapted else 0)

    def _land_region(self, pool: Any, a_tables: Any, b_tables: Any, base_address: int,
                     size: int, slot: int, data: np.ndarray,
                     offsets: tuple[np.ndarray, np.ndarray], source_slot: int) -> None:
        """Copy a source slot's bytes into `slot` of `pool` and point its A/B tables there:
        the source's offsets (-1 = not adapted) rebased from its slot to ours."""
        region = pool[slot * size:(slot + 1) * size]
        if self.device == "cuda":
            region.set(data)
        else:
            region[:] = data
        base, src_base = base_address + slot * size, source_slot * size
        for tables, offs in zip((a_tables, b_tables), offsets, strict=True):
            tables[:, slot] = self.xp.asarray(
                np.where(offs < 0, 0, offs - src_base + base).astype(np.uint64))

    def slot_bytes_host(self, slot: int) -> np.ndarray:
        slot_bytes = self.layout.slot_bytes
        return self.to_host(self.pool[slot * slot_bytes:(slot + 1) * slot_bytes])

    def slot_records(self) -> list[dict[str, Any]]:
        return [s.record(k, k < self.pinned) for k, s in enumerate(self.slots)]


class _TensorReader:
    """Reads one tensor at a time from a safetensors file with positional reads: straight into
    its destination when no conversion is needed, else through a per-thread scratch buffer, so
    memory stays near the pool's size however large the adapter. (Per-tensor mmap measured half
    as fast; reader threads did not help on two cores.)"""

    def __init__(self, fd: int, name: str) -> None:
        self.fd = fd
        self.name = name
        self.local = threading.local()

    def into(self, info: TensorInfo, dest: np.ndarray) -> None:
        view = memoryview(dest).cast("B")
        done = 0
        while done < info.nbytes:
            n = os.preadv(self.fd, [view[done:]], info.begin + done)
            if n <= 0:
                raise FormatError(f"{self.name}: file ended inside tensor {info.name!r}")
            done += n

    def read(self, info: TensorInfo) -> np.ndarray:
        scratch = getattr(self.local, "scratch", None)
        if scratch is None or scratch.size < info.nbytes:
            scratch = self.local.scratch = np.empty(info.nbytes, dtype=np.uint8)
        raw = scratch[:info.nbytes]
        self.into(info, raw)
        return raw.view(RAW_DTYPES[info.dtype])


def _pack_module(
    reader: _TensorReader, module: ModuleRecord, a_offset: int, b_offset: int,
    layout: SlotLayout, staging: np.ndarray, b_ratio: float,
) -> int:
    """Read one module's A and B into the slot's regions."""
    r, max_rank = module.r, layout.max_rank
    in_dim = module.a.shape[1]
    out_dim = module.b.shape[0]
    # A [r, in] fills the first r rows of the [max_rank, in] region; the rest stays zero.
    a_region = staging[a_offset:a_offset + r * in_dim * 2].view(np.uint16)
    if module.a.dtype == "BF16":
        reader.into(module.a, a_region)
    else:
        a_region[:] = to_bf16(reader.read(module.a), module.a.dtype).reshape(-1)
    # B [out, r] fills the first r columns of each row of the [out, max_rank] region.
    b_region = staging[b_offset:b_offset + out_dim * max_rank * 2].view(np.uint16)
    if module.b.dtype == "BF16" and b_ratio == 1.0 and r == max_rank:
        reader.into(module.b, b_region)
    else:
        b = to_bf16(reader.read(module.b), module.b.dtype, b_ratio)
        b_region.reshape(out_dim, max_rank)[:, :r] = b.reshape(out_dim, r)
    return module.a.nbytes + module.b.nbytes


def pick_device(device: str) -> str:
    """`auto` picks the GPU when there is one; `cuda` without one is NoDevice (exit 3)."""
    if device == "auto":
        return "cuda" if has_gpu() else "cpu"
    if device == "cuda":
        cupy_module()
        return "cuda"
    if device == "cpu":
        return "cpu"
    raise UsageError(f"--device must be auto, cpu or cuda, got {device!r}")
