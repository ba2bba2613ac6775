"""The adapter pool: the slot pool (a `Region` of `max_loras` slots laid out by a `SlotLayout`)
and, when the pool serves expert LoRA, the expert pool (a second `Region`, laid out by an
`ExpertLayout`); the scale and rank tables; per slot the raw token overlays; and a
`SlotManager` that owns every slot's state (identity, ref counts, LRU, generations, loading).

The pool owns bytes, the manager owns state. A swap marks the slot loading under the pool's lock
(its old identity is gone, its tables point nowhere), packs outside it, and publishes; a failed
load leaves the slot cleared with identity 0. Sequences acquire and release through the manager
alone and never wait behind a pack.

The same code runs on a GPU (CuPy device memory) and on the host (NumPy); pointer tables then
hold device or host addresses.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from metrale_cli.adapters.audit import AdapterReport
from metrale_cli.adapters.overlays import OverlayRaw
from metrale_cli.arguments import checked_as
from metrale_cli.compat import cupy_module, has_gpu
from metrale_cli.errors import FormatError, LayoutMismatch, PoolTooLarge, UsageError
from metrale_cli.layout.expert_layout import ExpertLayout
from metrale_cli.layout.plan import PoolPlan
from metrale_cli.layout.slot_layout import SlotLayout
from metrale_cli.pool.fill import check_fits, fill_slot, held_report
from metrale_cli.pool.region import Region, Staging
from metrale_cli.pool.slots import AdapterSlot, SlotManager


@dataclass(frozen=True)
class PackStats:
    bytes_read: int
    bytes_written: int
    seconds: float


@dataclass
class SlotContents:
    """One slot as another pool lands it: who lives there, the slot's bytes (`[slot_bytes]`
    u8, host memory) and which entries it adapts (`[n_entries]` bool), the same for its expert
    slot (None without an expert pool), and its token overlays."""

    info: AdapterSlot
    data: np.ndarray
    adapted: np.ndarray
    expert_data: np.ndarray | None = None
    expert_adapted: np.ndarray | None = None
    overlay: OverlayRaw | None = None
    # The slot's widest expert-pair rank; None where the source does not record it (an image).
    expert_rank: int | None = None


class SlotSource(Protocol):
    """What `LoraPool.land_slot` copies a slot from: a pool, a pool image (and, later, a peer
    process). Its layouts' fingerprints must match the landing pool's."""

    @property
    def layout(self) -> SlotLayout: ...
    @property
    def expert_layout(self) -> ExpertLayout | None: ...
    @property
    def max_loras(self) -> int: ...
    def slot_contents(self, slot: int) -> SlotContents: ...


class LoraPool:
    """`max_loras` slots of `layout.slot_bytes` each in one allocation (and as many expert
    slots of `expert_layout.slot_bytes` in another), with their tables and slot manager."""

    @checked_as("LoraPool")
    def __init__(
        self, layout: SlotLayout, max_loras: int, device: str = "cpu",
        expert_layout: ExpertLayout | None = None,
    ) -> None:
        if max_loras <= 0:
            raise UsageError(f"max_loras must be positive, got {max_loras}")
        if device not in ("cpu", "cuda"):
            raise UsageError(f"device must be cpu or cuda, got {device!r}")
        self.layout = layout
        self.expert_layout = expert_layout
        self.max_loras = max_loras
        self.device = device
        self.xp: Any = cupy_module() if device == "cuda" else np
        need = PoolPlan(layout, expert_layout, max_loras).total_bytes or 0
        _check_memory(need, device, self.xp)
        self.region = Region(layout, max_loras, device, self.xp)
        self.expert_region = (Region(expert_layout, max_loras, device, self.xp)
                              if expert_layout is not None else None)
        # [max_loras] f32: slot k's PEFT scaling, 0.0 for an empty slot.
        self.scale_table = self.xp.zeros(max_loras, dtype=np.float32)
        # [max_loras] i32: slot k's rank (kernels bound their rank loops by it).
        self.rank_table = self.xp.zeros(max_loras, dtype=np.int32)
        # [max_loras] i32: slot k's widest expert-pair rank (the expert kernels bound their rank
        # loops by it; a slot's expert pairs may be ranked apart from its modules).
        self.expert_rank_table = self.xp.zeros(max_loras, dtype=np.int32)
        # Per slot, its token-overlay rows as uploaded (host memory; the served tables are
        # built from them by the model), None without overlays.
        self.overlay_raw: list[OverlayRaw | None] = [None] * max_loras
        self.manager = SlotManager(max_loras)
        # Serialises changes of which bytes a slot holds (begin a load, clear, publish); never
        # held while a pack reads the disk.
        self._lock = threading.Lock()
        # Pinned staging for GPU packs, allocated once, used by one pack at a time.
        self._staging: Staging | None = None
        self._staging_lock = threading.Lock()

    # -- the slot pool's memory, as kernels launch on it --------------------------------------

    @property
    def pool(self) -> Any:
        """The slot pool: `[max_loras * slot_bytes]` u8."""
        return self.region.memory

    @property
    def a_tables(self) -> Any:
        """`[n_entries, max_loras]` u64: row i is entry i's table of A addresses (0 = the slot
        does not adapt the entry)."""
        return self.region.a_tables

    @property
    def b_tables(self) -> Any:
        return self.region.b_tables

    @checked_as("LoraPool.table_address")
    def table_address(self, entry: int, which: str = "a") -> int:
        """Address of entry `entry`'s `[max_loras]` u64 table (for a kernel launch)."""
        return self.region.table_address(entry, which)

    def to_host(self, array: Any) -> np.ndarray:
        return self.region.to_host(array)

    def regions(self) -> list[Region]:
        return [self.region] + ([self.expert_region] if self.expert_region else [])

    # -- filling slots ------------------------------------------------------------------------

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
        reports = [held_report(r, expert_layout) for r in reports]
        for r in reports:
            check_fits(r, layout, expert_layout)
        pool = cls(layout, max_loras, device, expert_layout)
        stats = [pool._pack(k, r, progress) for k, r in enumerate(reports)]
        pool.manager.load_pinned([_slot_info(r) for r in reports])
        return pool, stats

    @checked_as("LoraPool.swap_in")
    def swap_in(self, slot: int, report: AdapterReport) -> int:
        """Replace `slot`'s contents with an adapter from disk; refused (SlotBusy) while the
        slot has in-flight sequences or is loading. From the start the slot has no identity
        and is neither acquirable nor a victim; the pack runs outside the pool's lock; a failed
        pack leaves the slot cleared (identity 0). Returns the new generation."""
        report = held_report(report, self.expert_layout)
        check_fits(report, self.layout, self.expert_layout)
        slot = self.manager.resolve(slot)  # -1: the active slot, for the bytes and tables too
        generation = self._begin(slot)
        try:
            self._pack(slot, report)
        except BaseException:
            self._abort(slot)
            raise
        self.manager.finish_load(slot, _slot_info(report))
        return generation

    @checked_as("LoraPool.land_slot")
    def land_slot(self, slot: int, source: SlotSource, source_slot: int) -> int:
        """Copy one slot from another pool or a pool image whose layouts have the same
        fingerprints (the peer-swap path); every pointer is derived from this pool's layout.
        Returns the new generation."""
        if source.layout.fingerprint != self.layout.fingerprint:
            raise LayoutMismatch(
                f"layout fingerprint {source.layout.fingerprint} does not match this pool's "
                f"{self.layout.fingerprint}")
        src_ex, ex = source.expert_layout, self.expert_layout
        if src_ex is not None and ex is not None and src_ex.fingerprint != ex.fingerprint:
            raise LayoutMismatch(f"expert layout fingerprint {src_ex.fingerprint} does not "
                                 f"match this pool's {ex.fingerprint}")
        slot = self.manager.resolve(slot)  # -1: the active slot, for the bytes and tables too
        if not 0 <= source_slot < source.max_loras:
            raise UsageError(f"source slot {source_slot} is out of range "
                             f"[0, {source.max_loras})")
        contents = source.slot_contents(source_slot)
        if not contents.info.filled:
            raise UsageError(f"source slot {source_slot} holds no adapter")
        _check_contents(self.region, contents.data, contents.adapted)
        expert_src: tuple[np.ndarray, np.ndarray] | None = None
        if contents.expert_adapted is not None and contents.expert_adapted.any():
            if self.expert_region is None or contents.expert_data is None:
                raise LayoutMismatch(f"source slot {source_slot} holds expert LoRA and this "
                                     "pool has no expert pool")
            expert_src = (contents.expert_data, contents.expert_adapted)
            _check_contents(self.expert_region, *expert_src)
        generation = self._begin(slot)
        try:
            self.region.land(slot, contents.data, contents.adapted)
            if self.expert_region is not None and expert_src is not None:
                self.expert_region.land(slot, *expert_src)
            elif self.expert_region is not None:
                self.expert_region.clear(slot)
            self.overlay_raw[slot] = contents.overlay
            self.scale_table[slot] = contents.info.scaling
            self.rank_table[slot] = contents.info.rank
            self.expert_rank_table[slot] = _expert_rank(contents, ex)
        except BaseException:
            self._abort(slot)
            raise
        self.manager.finish_load(slot, contents.info)
        return generation

    def clear_slot(self, slot: int) -> None:
        """Zero a slot's bytes, tables, scale and rank (and its expert slot and overlays); it
        becomes a placeholder with identity 0. Refused (SlotBusy) while it has in-flight
        sequences or is loading."""
        with self._lock:
            k = self.manager.resolve(slot)  # once: a rotation meanwhile must not move it
            self.manager.clear_slot(k)
            self._clear_bytes(k)

    def _begin(self, k: int) -> int:
        """Start loading slot `k` (already resolved: -1 means nothing here)."""
        with self._lock:
            generation = self.manager.begin_load(k)
            for region in self.regions():
                region.unpublish(k)
            self.scale_table[k] = 0.0
            self.rank_table[k] = 0
            self.expert_rank_table[k] = 0
            self.overlay_raw[k] = None
            return generation

    def _abort(self, k: int) -> None:
        """Clear slot `k` (already resolved) after a failed load."""
        with self._lock:
            self._clear_bytes(k)
            self.manager.abort_load(k)

    def _clear_bytes(self, k: int) -> None:
        for region in self.regions():
            region.clear(k)
        self.overlay_raw[k] = None
        self.scale_table[k] = 0.0
        self.rank_table[k] = 0
        self.expert_rank_table[k] = 0

    def _pack(self, slot: int, report: AdapterReport,
              progress: Callable[[int], None] | None = None) -> PackStats:
        """Write an audited adapter that `check_fits` into `slot` and publish its tables (the
        caller owns the slot: startup, or a load begun)."""
        started = time.perf_counter()
        if self.device == "cuda":
            with self._staging_lock:
                read, overlay = self._fill(slot, report, self.staging(), progress)
        else:
            read, overlay = self._fill(slot, report, None, progress)
        self.overlay_raw[slot] = overlay
        self.scale_table[slot] = report.scaling
        self.rank_table[slot] = report.rank
        self.expert_rank_table[slot] = max((p.r for p in report.expert_pairs), default=0)
        written = sum(r.slot_bytes for r in self.regions())
        return PackStats(read, written, time.perf_counter() - started)

    def _fill(self, slot: int, report: AdapterReport, staging: Staging | None,
              progress: Callable[[int], None] | None) -> tuple[int, OverlayRaw | None]:
        read, overlay = fill_slot(report, slot, self.layout, self.region, self.expert_layout,
                                  self.expert_region, staging, progress=progress)
        index = self.layout.index
        self.region.publish(slot, _adapted(len(index),
                                           [index[(m.layer, m.module)] for m in report.modules]))
        if self.expert_region is not None and self.expert_layout is not None:
            index_e = self.expert_layout.index
            self.expert_region.publish(slot, _adapted(len(index_e), [index_e[p.key] for p in
                                                                     report.expert_pairs]))
        return read, overlay

    def staging(self) -> Staging:
        """The pinned staging buffers GPU packs go through, allocated on first use, sized to
        the largest A or B region of the pool's layouts."""
        if self._staging is None:
            largest = max((max(e.a_bytes, e.b_bytes) for r in self.regions()
                           for e in r.layout.entries), default=0)
            self._staging = Staging(self.xp, max(largest, 1))
        return self._staging

    # -- a slot as a land_slot source --------------------------------------------------------

    def slot_contents(self, slot: int) -> SlotContents:
        k = self.manager.resolve(slot)
        ex = self.expert_region
        return SlotContents(
            info=self.manager.slot_info(k),
            data=self.region.host_bytes(k), adapted=self.region.adapted(k),
            expert_data=ex.host_bytes(k) if ex is not None else None,
            expert_adapted=ex.adapted(k) if ex is not None else None,
            overlay=self.overlay_raw[k],
            expert_rank=int(self.to_host(self.expert_rank_table)[k]))

    def slot_records(self) -> list[dict[str, Any]]:
        return self.manager.records()


def _slot_info(report: AdapterReport) -> AdapterSlot:
    cfg = report.adapter.config
    return AdapterSlot(name=report.name, rank=report.rank, alpha=cfg.lora_alpha,
                       scaling=report.scaling, source=str(report.adapter.path),
                       config=dict(cfg.raw))


def _expert_rank(contents: SlotContents, layout: ExpertLayout | None) -> int:
    """The expert rank a landed slot gets: the source's, else (a pool image records none) the
    layout's max rank where it adapts any expert: the padding is zero, so that bound costs
    work, never correctness."""
    if contents.expert_rank is not None:
        return contents.expert_rank
    adapted = contents.expert_adapted is not None and bool(contents.expert_adapted.any())
    return layout.max_rank if adapted and layout is not None else 0


def _adapted(n_entries: int, entries: list[int]) -> np.ndarray:
    adapted = np.zeros(n_entries, dtype=bool)
    adapted[entries] = True
    return adapted


def _check_contents(region: Region, data: np.ndarray, adapted: np.ndarray) -> None:
    if data.shape != (region.slot_bytes,) or adapted.shape != (len(region.layout.entries),):
        raise FormatError(f"a landed slot must be {region.slot_bytes} bytes over "
                          f"{len(region.layout.entries)} entries, got {data.shape[0]} bytes "
                          f"over {adapted.shape[0]}")


def available_memory(device: str, xp: Any) -> tuple[int, str]:
    """Bytes free to hold a pool, and where: the device's free memory on a GPU, else the
    host's available memory (MemAvailable where the kernel reports it, else free pages)."""
    if device == "cuda":
        return int(xp.cuda.runtime.memGetInfo()[0]), "free device memory"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "available host memory"
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free host memory"


def _check_memory(need: int, device: str, xp: Any) -> None:
    have, what = available_memory(device, xp)
    if need > have:
        raise PoolTooLarge(f"the pool needs {need:,} B ({need / 2**30:,.1f} GiB) and there is "
                           f"{have:,} B ({have / 2**30:,.1f} GiB) of {what}; lower --max-loras")


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
