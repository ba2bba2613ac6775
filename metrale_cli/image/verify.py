"""`metrale verify`: does a pool image hold exactly what `pack` writes for these adapters?

For each adapter the expected slot is produced by the packer itself (`LoraPool.load` into a
one-slot host pool: the same BF16 rounding, scale folding and padding, the expert pool and the
overlays included), then compared with the image: the slot's rank and scale, the entries it
adapts, and their bytes (what a server would read), streamed entry by entry with positional
reads. The image is checked first as `show` and `PoolImage.open` check it (image/check.py): one
they refuse verifies against nothing, and its offsets are then the layout's own or -1.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from metrale_cli.adapters.adapter import Adapter
from metrale_cli.adapters.audit import audit
from metrale_cli.bf16 import bf16_to_f32
from metrale_cli.errors import FormatError, NotServable, UsageError
from metrale_cli.image.check import check, digest_state
from metrale_cli.image.digest import content_problems
from metrale_cli.image.format import ImageTables, read_tables
from metrale_cli.layout.slot_layout import PaddedPair
from metrale_cli.pool.pool import LoraPool


@dataclass(frozen=True)
class RegionDiff:
    """One A or B region (or its offset) of one entry that differs from what pack writes."""

    layer: int
    module: str  # `q_proj`, `gate_proj expert 3`, `router`
    part: str  # `A` or `B`
    bytes_differing: int
    # max |dW_image - dW_expected| over the entry, dW = scale * B @ A; None where not comparable.
    max_delta_difference: float | None
    note: str = ""

    def record(self) -> dict[str, Any]:
        return {"layer": self.layer, "module": self.module, "part": self.part,
                "bytes_differing": self.bytes_differing,
                "max_delta_difference": self.max_delta_difference, "note": self.note}


@dataclass
class AdapterVerdict:
    name: str
    slot: int
    source: str
    entries: int = 0
    expert_entries: int = 0
    bytes_compared: int = 0
    # Slot-wide differences: rank, scale, overlays.
    slot_diffs: list[str] = field(default_factory=list)
    diffs: list[RegionDiff] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.slot_diffs and not self.diffs

    def record(self) -> dict[str, Any]:
        return {"name": self.name, "slot": self.slot, "source": self.source, "ok": self.ok,
                "entries": self.entries, "expert_entries": self.expert_entries,
                "bytes_compared": self.bytes_compared, "slot_differences": self.slot_diffs,
                "differences": [d.record() for d in self.diffs]}


@dataclass
class VerifyResult:
    path: Path
    verdicts: list[AdapterVerdict]
    unchecked: list[dict[str, Any]]
    seconds: float
    digests: str = "none"  # check.digest_state
    # Tensors whose bytes do not match their digests (image/digest.py): changed after pack,
    # in a slot given or not.
    digest_differences: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(v.ok for v in self.verdicts) and not self.digest_differences

    @property
    def bytes_compared(self) -> int:
        return sum(v.bytes_compared for v in self.verdicts)

    def record(self) -> dict[str, Any]:
        return {"path": str(self.path), "ok": self.ok,
                "adapters": [v.record() for v in self.verdicts], "unchecked": self.unchecked,
                "digests": self.digests, "digest_differences": self.digest_differences,
                "bytes_compared": self.bytes_compared, "seconds": self.seconds,
                "gb_per_s": self.bytes_compared / self.seconds / 1e9 if self.seconds else None}


@dataclass
class Verifier:
    """An image and the adapters to check against it, each matched to its slot by name."""

    tables: ImageTables
    adapters: list[tuple[int, Adapter]]

    @classmethod
    def open(cls, image: str | Path, adapters: list[Adapter]) -> Verifier:
        tables = read_tables(image)
        # Every check show and PoolImage.open make: an image they refuse is not one pack
        # wrote, whatever its bytes. Every offset is then its entry's own or -1.
        check(tables)
        slots = {s.get("name"): k for k, s in enumerate(tables.slots_doc) if s.get("name")}
        matched = []
        for a in adapters:
            if a.name not in slots:
                held = ", ".join(sorted(slots)) or "none"
                raise UsageError(f"{a.name}: no slot of {tables.path} holds an adapter of that "
                                 f"name (it holds: {held}); name it with NAME=PATH")
            matched.append((slots[a.name], a))
        return cls(tables, matched)

    @property
    def total_bytes(self) -> int:
        """Image bytes the comparison reads: each given slot's regions."""
        t = self.tables
        per_slot = sum(e.a_bytes + e.b_bytes for e in t.layout.entries)
        if t.expert_layout is not None:
            per_slot += sum(e.a_bytes + e.b_bytes for e in t.expert_layout.entries)
        return per_slot * len(self.adapters)

    def run(self, progress: Callable[[int], None] | None = None) -> VerifyResult:
        started = time.perf_counter()
        fd = os.open(self.tables.path, os.O_RDONLY)
        try:
            verdicts = [self._verify(fd, slot, a, progress) for slot, a in self.adapters]
        finally:
            os.close(fd)
        given = {slot for slot, _ in self.adapters}
        unchecked = [{"slot": k, "name": s["name"]} for k, s in enumerate(self.tables.slots_doc)
                     if s.get("name") and k not in given]
        t = self.tables
        differences = content_problems(t.path, t.header, t.digests)
        return VerifyResult(t.path, verdicts, unchecked, time.perf_counter() - started,
                            digest_state(t, checked=True), differences)

    def _verify(self, fd: int, slot: int, adapter: Adapter,
                progress: Callable[[int], None] | None) -> AdapterVerdict:
        t = self.tables
        report = audit(adapter, t.model, t.layout.max_rank, t.expert_layout is not None)
        if not report.servable:
            first = report.errors()[0]
            raise NotServable(f"{adapter.name}: not servable ({first.code}: {first.message}), "
                              "so no pool holds it")
        # What pack writes, by the packer itself: a one-slot host pool.
        pool, _ = LoraPool.load(t.layout, 1, [report], "cpu", expert_layout=t.expert_layout)
        want = pool.slot_contents(0)
        verdict = AdapterVerdict(adapter.name, slot, str(adapter.path))
        rank, scale = int(t.ranks[slot]), float(t.scales[slot])
        want_scale = float(np.float32(want.info.scaling))
        if rank != want.info.rank:
            verdict.slot_diffs.append(f"rank {rank} in the image; the adapter's is "
                                      f"{want.info.rank}")
        if np.float32(scale) != np.float32(want_scale):
            verdict.slot_diffs.append(f"scale {scale:.9g} in the image; the adapter's is "
                                      f"{want_scale:.9g}")
        regions = [("pool", t.layout.entries, t.layout.slot_bytes, t.a_offsets, want.adapted,
                    want.data)]
        if t.expert_layout is not None:
            assert t.expert_a_offsets is not None
            regions.append(("expert_pool", t.expert_layout.entries,
                            t.expert_layout.slot_bytes, t.expert_a_offsets,
                            want.expert_adapted, want.expert_data))
        for name, entries, size, a_offs, adapted, want_bytes in regions:
            begin = t.tensor(name).begin
            for i, e in enumerate(entries):
                # check() has held every offset to the layout's own or -1 (both A and B).
                self._entry(fd, verdict, name, i, e, begin + slot * size,
                            int(a_offs[i, slot]) >= 0, bool(adapted[i]), want_bytes, scale,
                            want_scale, progress)
        verdict.slot_diffs += self._overlays(fd, slot, want.overlay)
        return verdict

    def _entry(self, fd: int, verdict: AdapterVerdict, pool: str, i: int, e: PaddedPair,
               slot_begin: int, in_image: bool, in_pack: bool, want_bytes: np.ndarray,
               scale: float, want_scale: float, progress: Callable[[int], None] | None) -> None:
        """Entry `i` of the slot at file offset `slot_begin` against the packed slot's bytes
        `want_bytes`: where both adapt it, its A and B byte by byte."""
        t = self.tables
        layer, module = t.entry_label(pool, i)
        if not (in_image or in_pack):
            return
        if pool == "pool":
            verdict.entries += 1
        else:
            verdict.expert_entries += 1
        if not (in_image and in_pack):
            note = "only in the image" if in_image else "not in the image"
            verdict.diffs.append(RegionDiff(layer, module, "A+B", e.a_bytes + e.b_bytes, None,
                                            note))
            return
        regions: list[np.ndarray] = []
        differing: list[tuple[str, int]] = []
        for part, off, nbytes in (("A", e.a_offset, e.a_bytes), ("B", e.b_offset, e.b_bytes)):
            data = os.pread(fd, nbytes, slot_begin + off)
            if len(data) != nbytes:
                raise FormatError(f"{t.path}: file ended inside {pool}")
            image = np.frombuffer(data, dtype=np.uint8)
            regions.append(image)
            verdict.bytes_compared += nbytes
            if progress is not None:
                progress(nbytes)
            expected = want_bytes[off:off + nbytes]
            # memcmp-speed equality first; counting the differing bytes only where they differ.
            if not np.array_equal(image, expected):
                differing.append((part, int((image != expected).sum())))
        if not differing:
            return
        a_want = want_bytes[e.a_offset:e.a_offset + e.a_bytes]
        b_want = want_bytes[e.b_offset:e.b_offset + e.b_bytes]
        diff = _max_delta_difference(e, (regions[0], regions[1], scale),
                                     (a_want, b_want, want_scale))
        for part, n in differing:
            verdict.diffs.append(RegionDiff(layer, module, part, n, diff))

    def _overlays(self, fd: int, slot: int, want: Any) -> list[str]:
        """The slot's overlay runs against the rows the adapter's overlays pack to."""
        t = self.tables
        runs = t.overlay_runs(slot)
        want_tables = list(want.tables) if want is not None else []
        if [r["table"] for r in runs] != want_tables:
            return [f"overlays: the image replaces rows of {[r['table'] for r in runs]}; the "
                    f"adapter of {want_tables}"]
        found = []
        rows_info = t.header.tensors.get("overlay_rows")
        for j, run in enumerate(runs):
            start, count = int(run["start"]), int(run["count"])
            assert t.overlay_tokens is not None and rows_info is not None
            tokens = np.asarray(t.overlay_tokens[start:start + count])
            hidden = rows_info.shape[1]
            data = os.pread(fd, count * hidden * 4, rows_info.begin + start * hidden * 4)
            rows = np.frombuffer(data, dtype="<f4").reshape(count, hidden)
            if not np.array_equal(tokens, want.tokens[j]):
                found.append(f"overlays: {run['table']} token ids differ")
            elif not np.array_equal(rows, want.rows[j]):
                n = int((rows != want.rows[j]).any(axis=1).sum())
                found.append(f"overlays: {n} {run['table']} rows differ")
            if bool(run["tied_lm_head"]) != want.tied_lm_head[j]:
                found.append(f"overlays: {run['table']} tied_lm_head differs")
        return found


def _max_delta_difference(e: PaddedPair, got: tuple[np.ndarray, np.ndarray, float],
                          want: tuple[np.ndarray, np.ndarray, float]) -> float:
    """max |dW_got - dW_want| over the entry, dW = scale * B @ A from its padded BF16 (A, B,
    scale), without holding the `[out, in]` float32 difference whole. Where one side's A (or B)
    is the other's, the difference is (s B_got - s' B_want) @ A (or B @ (s A_got - s' A_want))
    over only the rows (columns) that differ: a few flipped bytes cost a few rows, not the
    whole product. Otherwise it is [s B_got, -s' B_want] @ [A_got; A_want], a block of output
    rows at a time."""
    def f32(region: np.ndarray, rows: int, cols: int) -> np.ndarray:
        return bf16_to_f32(np.ascontiguousarray(region).view("<u2")).reshape(rows, cols)

    (a_got, b_got, s_got), (a_want, b_want, s_want) = got, want
    a_shape, b_shape = (e.max_rank, e.in_dim), (e.out_dim, e.max_rank)
    if np.array_equal(a_got, a_want):
        d_b = np.float32(s_got) * f32(b_got, *b_shape) - np.float32(s_want) * f32(b_want, *b_shape)
        rows = d_b[d_b.any(axis=1)]
        return float(np.abs(rows @ f32(a_got, *a_shape)).max()) if len(rows) else 0.0
    if np.array_equal(b_got, b_want):
        d_a = np.float32(s_got) * f32(a_got, *a_shape) - np.float32(s_want) * f32(a_want, *a_shape)
        cols = d_a[:, d_a.any(axis=0)]
        return float(np.abs(f32(b_got, *b_shape) @ cols).max()) if cols.shape[1] else 0.0
    a = np.concatenate([f32(a_got, *a_shape), f32(a_want, *a_shape)])
    b = np.concatenate([np.float32(s_got) * f32(b_got, *b_shape),
                        np.float32(-s_want) * f32(b_want, *b_shape)], axis=1)
    block = max(1, _DIFF_BLOCK_ELEMENTS // e.in_dim)
    return max(float(np.abs(b[i:i + block] @ a).max()) for i in range(0, e.out_dim, block))


# Output elements per block of the difference product: 32 MiB of float32. Smaller blocks lose
# to each matmul call's cost (2 MiB blocks ran 3x slower than one whole product here).
_DIFF_BLOCK_ELEMENTS = 1 << 23
