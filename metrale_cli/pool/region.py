"""One pool allocation: `count` equal slots laid out by a padded layout, the per-entry A/B
pointer tables into them, and how a slot's bytes are written, published, cleared and landed.
The slot pool (`SlotLayout`) and the expert pool (`ExpertLayout`) are two instances.

On a GPU the memory and tables are CuPy arrays and the pointers device addresses; on the host
they are NumPy arrays and host addresses. Every pointer is derived from the region's own layout
(`base + slot * slot_bytes + entry offset`), never from numbers a caller hands in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from metrale_cli.errors import UsageError


class PaddedEntry(Protocol):
    """One entry of a padded layout: A `[max_rank, in_dim]` at `a_offset`, B
    `[out_dim, max_rank]` at `b_offset`, both BF16 and within a slot."""

    @property
    def a_offset(self) -> int: ...
    @property
    def b_offset(self) -> int: ...
    @property
    def a_bytes(self) -> int: ...
    @property
    def b_bytes(self) -> int: ...


class PaddedLayout(Protocol):
    """What a region needs of a layout: `SlotLayout` and `ExpertLayout` both are one."""

    @property
    def entries(self) -> Sequence[PaddedEntry]: ...
    @property
    def slot_bytes(self) -> int: ...
    @property
    def fingerprint(self) -> str: ...


class Staging:
    """Two pinned host buffers alternating on one CUDA stream, allocated once per pool: the
    packer fills one (disk read, BF16 conversion) while the other's copy to the device runs.
    Each buffer is `nbytes` u8, the largest A or B region of the pool's layouts."""

    def __init__(self, xp: Any, nbytes: int) -> None:
        self.xp = xp
        self.nbytes = nbytes
        self.stream = xp.cuda.Stream(non_blocking=True)
        self.buffers = [np.frombuffer(xp.cuda.alloc_pinned_memory(nbytes), np.uint8, nbytes)
                        for _ in range(2)]
        # Event i is recorded after buffer i's copy is enqueued; refilling it waits for it.
        self.events = [xp.cuda.Event(disable_timing=True) for _ in range(2)]
        self.recorded = [False, False]
        self.turn = 0

    def take(self) -> tuple[int, np.ndarray]:
        """The next free buffer (waiting for its previous copy to finish)."""
        self.turn ^= 1
        if self.recorded[self.turn]:
            self.events[self.turn].synchronize()
        return self.turn, self.buffers[self.turn]

    def copy_out(self, turn: int, dest: Any, nbytes: int) -> None:
        """Enqueue buffer `turn`'s first `nbytes` into device array `dest` on the stream."""
        dest.set(self.buffers[turn][:nbytes], stream=self.stream)
        self.events[turn].record(self.stream)
        self.recorded[turn] = True


class SlotWriter:
    """Fills one slot span by span. `span(offset, nbytes)` gives a host array for the bytes
    `[offset, offset + nbytes)` of the slot, to be filled before the next call; `finish()`
    zeroes what no span covered (only if the slot held stale bytes) and, on a GPU, waits for the
    copies. Spans must not overlap."""

    def __init__(self, region: Region, slot: int, staging: Staging | None) -> None:
        self.region = region
        self.slot = slot
        self.staging = staging
        self.covered: list[tuple[int, int]] = []
        # Whether the slot held only zeros before this fill; from now on it may not.
        self.was_zeroed = region.zeroed[slot]
        region.zeroed[slot] = False
        self.pending: tuple[int, int, int] | None = None  # (turn, offset, nbytes) on a GPU

    def cover(self, offset: int, nbytes: int) -> None:
        """The bytes `[offset, offset + nbytes)` will be filled on the host by the time of
        `finish()`, through `filled` (not zeroed there)."""
        self.covered.append((offset, offset + nbytes))

    def span(self, offset: int, nbytes: int) -> np.ndarray:
        self._flush()
        self.cover(offset, nbytes)
        if self.staging is None:
            return self.filled(offset, nbytes)
        turn, buffer = self.staging.take()
        self.pending = (turn, offset, nbytes)
        return buffer[:nbytes]

    def filled(self, offset: int, nbytes: int) -> np.ndarray:
        """On the host, the slot's bytes `[offset, offset + nbytes)`, covered already (`cover`,
        or `span`: end to end, in spans that the fill reads and checks as one), as one array."""
        if self.staging is not None:
            raise RuntimeError("SlotWriter.filled is for a host pool's writer")
        start = self.slot * self.region.slot_bytes + offset
        return self.region.memory[start:start + nbytes]

    def _flush(self) -> None:
        if self.pending is None or self.staging is None:
            return
        turn, offset, nbytes = self.pending
        start = self.slot * self.region.slot_bytes + offset
        self.staging.copy_out(turn, self.region.memory[start:start + nbytes], nbytes)
        self.pending = None

    def finish(self) -> None:
        self._flush()
        region, slot = self.region, self.slot
        if not self.was_zeroed:
            base = slot * region.slot_bytes
            gaps = uncovered(self.covered, region.slot_bytes)
            if self.staging is None:
                for start, end in gaps:
                    region.memory[base + start:base + end] = 0
            else:
                with self.staging.stream:  # device memsets, ordered with the copies
                    for start, end in gaps:
                        region.memory[base + start:base + end] = 0
        if self.staging is not None:
            self.staging.stream.synchronize()
        region.zeroed[slot] = not self.covered


def uncovered(spans: list[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """The gaps of `[0, size)` that no `[start, end)` span covers."""
    gaps, cursor = [], 0
    for start, end in sorted(spans):
        if start > cursor:
            gaps.append((cursor, start))
        cursor = max(cursor, end)
    if cursor < size:
        gaps.append((cursor, size))
    return gaps


class Region:
    """`count` slots of `layout.slot_bytes` each in one allocation, with per-entry A/B pointer
    tables."""

    def __init__(self, layout: PaddedLayout, count: int, device: str, xp: Any) -> None:
        self.layout = layout
        self.count = count
        self.device = device
        self.xp = xp
        n = len(layout.entries)
        # [count * slot_bytes] u8; slot k occupies [k * slot_bytes, (k + 1) * slot_bytes).
        self.memory = xp.zeros(count * layout.slot_bytes, dtype=np.uint8)
        # Row i is entry i's [count] u64 table of A (B) addresses; 0 = slot does not adapt it.
        self.a_tables = xp.zeros((n, count), dtype=np.uint64)
        self.b_tables = xp.zeros((n, count), dtype=np.uint64)
        # A slot's bytes are all zero (fresh, or cleared): filling it then zeroes nothing,
        # which would otherwise touch every page of a new pool twice.
        self.zeroed = [True] * count
        # [n] u64: entry i's A (B) offset within a slot, the source of every pointer.
        self._a_offsets = np.array([e.a_offset for e in layout.entries], dtype=np.uint64)
        self._b_offsets = np.array([e.b_offset for e in layout.entries], dtype=np.uint64)

    @property
    def slot_bytes(self) -> int:
        return self.layout.slot_bytes

    @property
    def base_address(self) -> int:
        return _address(self.memory, self.device)

    def table_address(self, entry: int, which: str = "a") -> int:
        """Address of entry `entry`'s `[count]` u64 table (for a kernel launch): `entry` in
        `[0, entries)` (a negative one is not read from the end), `which` "a" or "b"."""
        if which not in ("a", "b"):
            raise UsageError(f"which must be 'a' or 'b', got {which!r}")
        count = len(self.a_tables)
        if not 0 <= entry < count:
            raise UsageError(f"entry {entry} is out of range [0, {count})")
        tables = self.a_tables if which == "a" else self.b_tables
        return _address(tables[entry], self.device)

    def to_host(self, array: Any) -> np.ndarray:
        return self.xp.asnumpy(array) if self.device == "cuda" else np.asarray(array)

    def host_bytes(self, slot: int) -> np.ndarray:
        """A host copy (on the host: a view) of slot `slot`'s bytes."""
        size = self.slot_bytes
        return self.to_host(self.memory[slot * size:(slot + 1) * size])

    def adapted(self, slot: int) -> np.ndarray:
        """[n_entries] bool: the entries slot `slot` adapts."""
        return self.to_host(self.a_tables[:, slot]) != 0

    def offset_tables(self) -> tuple[np.ndarray, np.ndarray]:
        """[n_entries, count] i64 byte offsets into `memory` of every A and B, -1 where the slot
        does not adapt the entry (the image's `a_offsets`/`b_offsets`)."""
        base = self.base_address
        out = []
        for tables in (self.a_tables, self.b_tables):
            t = self.to_host(tables).astype(np.int64)
            out.append(np.where(t == 0, -1, t - base))
        return out[0], out[1]

    def writer(self, slot: int, staging: Staging | None) -> SlotWriter:
        """Unpublish slot `slot` (its tables point nowhere while its bytes change) and return
        the writer that fills it; `publish` once it is whole."""
        self.unpublish(slot)
        return SlotWriter(self, slot, staging)

    def unpublish(self, slot: int) -> None:
        self.a_tables[:, slot] = 0
        self.b_tables[:, slot] = 0

    def publish(self, slot: int, adapted: np.ndarray) -> None:
        """Point the tables of the `adapted` entries ([n_entries] bool) at slot `slot`."""
        base = np.uint64(self.base_address + slot * self.slot_bytes)
        zero = np.uint64(0)
        self.a_tables[:, slot] = self.xp.asarray(np.where(adapted, base + self._a_offsets, zero))
        self.b_tables[:, slot] = self.xp.asarray(np.where(adapted, base + self._b_offsets, zero))

    def clear(self, slot: int) -> None:
        """Zero slot `slot`'s tables and bytes."""
        self.unpublish(slot)
        if not self.zeroed[slot]:
            size = self.slot_bytes
            self.memory[slot * size:(slot + 1) * size] = 0
            self.zeroed[slot] = True

    def land(self, slot: int, data: np.ndarray, adapted: np.ndarray) -> None:
        """Copy a whole slot's bytes (`[slot_bytes]` u8 on the host, laid out by a layout with
        this one's fingerprint) into slot `slot` and publish its `adapted` entries."""
        self.unpublish(slot)
        region = self.memory[slot * self.slot_bytes:(slot + 1) * self.slot_bytes]
        if self.device == "cuda":
            region.set(np.ascontiguousarray(data))
        else:
            region[:] = data
        self.zeroed[slot] = False
        self.publish(slot, adapted)


def _address(array: Any, device: str) -> int:
    return int(array.data.ptr) if device == "cuda" else int(array.ctypes.data)
