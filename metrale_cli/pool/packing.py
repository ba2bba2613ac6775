"""Packing: audited adapters into pool slots, and `metrale pack` (a pool, timed, and written out
as a pool image).

One tensor at a time is read from the adapter's safetensors file with positional reads
(`TensorReader`), converted to BF16 and written through a `SlotWriter` (straight into the pool
on the host, through pinned staging buffers on a GPU). Before a byte is written every module and
expert pair is checked against its layout entry (`check_fits`); while the bytes pass through,
every BF16 value written is checked to be finite.
"""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from metrale_cli.adapters.audit import AdapterReport
from metrale_cli.adapters.experts import ExpertPair
from metrale_cli.adapters.overlays import Overlay, OverlayRaw
from metrale_cli.bf16 import RAW_DTYPES, bf16_to_f32, to_bf16
from metrale_cli.errors import FormatError, LayoutMismatch, NonFiniteWeights, UsageError
from metrale_cli.files.atomic import check_not_an_input
from metrale_cli.files.safetensors_header import TensorInfo
from metrale_cli.layout.expert_layout import ExpertLayout
from metrale_cli.layout.plan import max_rank_warnings
from metrale_cli.layout.sharding import RankExpertLayout, RankLayout
from metrale_cli.layout.slot_layout import BF16_BYTES, SlotLayout
from metrale_cli.pool.region import Region, SlotWriter, Staging

if TYPE_CHECKING:
    from metrale_cli.pool.pool import LoraPool, PackStats

# Rows of a fused expert B read at a time: bounds the packer's memory beside the pool.
B_CHUNK_BYTES = 32 << 20
# BF16 bits whose exponent is all ones: infinity or NaN; so is any magnitude (bits without the
# sign) at or above the exponent mask.
_BF16_EXPONENT = np.uint16(0x7F80)
_BF16_MAGNITUDE = np.uint16(0x7FFF)
# Elements checked at a time (512 KiB), so the masked copy stays in cache.
_CHECK_RUN = 1 << 18

Progress = Callable[[int], None]


class RawReader(Protocol):
    """Reads a tensor's raw elements, whole or a run of its rows."""

    def into(self, info: TensorInfo, dest: np.ndarray, row: int = 0) -> None: ...
    def read(self, info: TensorInfo, row: int = 0, rows: int | None = None) -> np.ndarray: ...


class TensorReader:
    """Reads one tensor (or a run of its rows) at a time from a safetensors file with positional
    reads: straight into its destination when no conversion is needed, else through a
    per-thread scratch buffer, so memory stays near the pool's size however large the adapter.
    (Per-tensor mmap measured half as fast; reader threads did not help on two cores.)"""

    def __init__(self, fd: int, name: str) -> None:
        self.fd = fd
        self.name = name
        self.local = threading.local()

    def into(self, info: TensorInfo, dest: np.ndarray, row: int = 0) -> None:
        """Fill `dest` with the tensor's bytes from row `row` on."""
        view = memoryview(dest).cast("B")
        start = row * _row_bytes(info)
        if start + view.nbytes > info.nbytes:
            raise FormatError(f"{self.name}: read past the end of tensor {info.name!r}")
        done = 0
        while done < view.nbytes:
            n = os.preadv(self.fd, [view[done:]], info.begin + start + done)
            if n <= 0:
                raise FormatError(f"{self.name}: file ended inside tensor {info.name!r}")
            done += n

    def read(self, info: TensorInfo, row: int = 0, rows: int | None = None) -> np.ndarray:
        """Rows `[row, row + rows)` (default: to the end) as raw elements, flat; valid until
        the next read on this thread."""
        row_bytes = _row_bytes(info)
        nbytes = info.nbytes - row * row_bytes if rows is None else rows * row_bytes
        raw = self._scratch(nbytes)
        self.into(info, raw, row)
        return raw.view(RAW_DTYPES[info.dtype])

    def read_block(self, info: TensorInfo, rows: tuple[int, int], cols: tuple[int, int],
                   out: np.ndarray | None = None) -> np.ndarray:
        """Rows `[r0, r1)` and columns `[c0, c1)` of a 2-D tensor as `[r1 - r0, c1 - c0]` raw
        elements, reading only those bytes (one read when the columns are whole rows, else one
        per row): into `out` (contiguous, the block's size) when given, else into the scratch
        buffer, valid until the next read on this thread. A tensor-parallel rank's slice."""
        n_rows, n_cols = info.shape
        (r0, r1), (c0, c1) = rows, cols
        if not (0 <= r0 <= r1 <= n_rows and 0 <= c0 <= c1 <= n_cols):
            raise FormatError(f"{self.name}: read past the end of tensor {info.name!r}")
        item = info.nbytes // max(1, info.numel)
        width = (c1 - c0) * item
        block = (self._scratch((r1 - r0) * width) if out is None
                 else out.reshape(-1).view(np.uint8))
        if (c0, c1) == (0, n_cols):
            self.into(info, block, r0)
        else:
            view, start = memoryview(block).cast("B"), info.begin + (r0 * n_cols + c0) * item
            for i in range(r1 - r0):
                done, at = 0, start + i * n_cols * item
                while done < width:
                    n = os.preadv(self.fd, [view[i * width + done:(i + 1) * width]], at + done)
                    if n <= 0:
                        raise FormatError(f"{self.name}: file ended inside tensor "
                                          f"{info.name!r}")
                    done += n
        return block.view(RAW_DTYPES[info.dtype]).reshape(r1 - r0, c1 - c0)

    def _scratch(self, nbytes: int) -> np.ndarray:
        scratch = getattr(self.local, "scratch", None)
        if scratch is None or scratch.size < nbytes:
            scratch = self.local.scratch = np.empty(nbytes, dtype=np.uint8)
        return scratch[:nbytes]


def _row_bytes(info: TensorInfo) -> int:
    rows = info.shape[0] if info.shape else 1
    return info.nbytes // rows if rows else 0


def _refuse_non_finite(bits: np.ndarray, adapter: str, tensor: str) -> None:
    """NonFiniteWeights when BF16 `bits` hold NaN or infinity (in the file, or a value too large
    for BF16 once scaled): every token routed to the slot would produce garbage."""
    # An AND and a max per cache-sized run: about one pass over the bits, a tenth of counting
    # (bench pack measures what is left); counted only when something is wrong.
    flat = bits.reshape(-1)
    magnitude = np.empty(min(flat.size, _CHECK_RUN), dtype=np.uint16)
    for start in range(0, flat.size, _CHECK_RUN):
        run = flat[start:start + _CHECK_RUN]
        np.bitwise_and(run, _BF16_MAGNITUDE, out=magnitude[:run.size])
        if magnitude[:run.size].max() >= _BF16_EXPONENT:
            break
    else:
        return
    bad = int(np.count_nonzero((flat & _BF16_EXPONENT) == _BF16_EXPONENT))
    if bad:
        raise NonFiniteWeights(f"{adapter}: tensor {tensor!r} has {bad:,} non-finite values "
                               "(NaN or infinity) as BF16; refusing to pack it")


# -- checks before a byte is written ------------------------------------------------------------


def check_fits(report: AdapterReport, layout: SlotLayout,
               expert_layout: ExpertLayout | None) -> None:
    """Everything `report` needs of the pool's layouts, checked before any byte is written:
    servable, every module and expert pair in its layout, within its max rank, and shaped as
    its layout entry (an adapter audited against another config is refused here)."""
    name = report.name
    if not report.servable:
        raise UsageError(f"{name}: not servable; `metrale inspect` says why")
    for m in report.modules:
        where = f"{name}: {m.module.peft_name} on layer {m.layer}"
        index = layout.index.get((m.layer, m.module))
        if index is None:
            raise UsageError(f"{where} is not in the pool's layout (its module set or max rank "
                             "is too small)")
        if m.r > layout.max_rank:
            raise UsageError(f"{name}: rank {m.r} above the pool's max rank {layout.max_rank}")
        out_dim, in_dim = layout.entries[index].full_dims  # a rank's entry holds a slice
        if m.a.shape != (m.r, in_dim) or m.b.shape != (out_dim, m.r):
            raise LayoutMismatch(
                f"{where}: A {list(m.a.shape)}, B {list(m.b.shape)} do not fit the pool's "
                f"layout, which has A [r, {in_dim}], B [{out_dim}, r] there")
    pairs = report.expert_pairs
    if not pairs:
        return
    if expert_layout is None:
        raise UsageError(f"{name}: carries routed-expert or router LoRA and the pool has no "
                         "expert pool (pack with --experts)")
    for p in pairs:
        where = f"{name}: {p.proj.value} of expert {p.expert} on layer {p.layer}"
        index = expert_layout.index.get(p.key)
        if index is None:
            raise UsageError(f"{where} is not in the pool's expert layout")
        if p.r > expert_layout.max_rank:
            raise UsageError(f"{name}: expert rank {p.r} above the expert pool's max rank "
                             f"{expert_layout.max_rank}")
        out_dim, in_dim = expert_layout.entries[index].full_dims
        a_rows, a_cols = p.a.shape if len(p.a.shape) == 2 else (0, 0)
        b_rows, b_cols = p.b.shape if len(p.b.shape) == 2 else (0, 0)
        if ((p.out_dim, p.in_dim) != (out_dim, in_dim) or a_cols != in_dim
                or p.a_row + p.r > a_rows or p.b_row + p.out_dim > b_rows
                or p.b_col + (p.r - 1) * p.b_col_step >= b_cols):
            raise LayoutMismatch(
                f"{where}: A {list(p.a.shape)}, B {list(p.b.shape)} do not fit the pool's "
                f"expert layout, which has A [r, {in_dim}], B [{out_dim}, r] there")


# -- the fills ----------------------------------------------------------------------------------


def fill_modules(reader: RawReader, report: AdapterReport, layout: SlotLayout,
                 writer: SlotWriter, check_finite: bool = True,
                 progress: Progress | None = None) -> int:
    """Write every module of `report` into a slot: A `[r, in]` as the first r rows of its
    `[max_rank, in]` region, B `[out, r]` as the first r columns of its `[out, max_rank]`
    region, BF16 round-to-nearest-even, each module's PEFT scaling relative to the slot's scale
    folded into its B, so that `scale * (x @ A^T) @ B^T` is PEFT's delta for every module.
    Returns the file bytes read."""
    read = 0
    max_rank = layout.max_rank
    for m in report.modules:
        e = layout.entries[layout.index[(m.layer, m.module)]]
        a = writer.span(e.a_offset, m.r * e.in_dim * BF16_BYTES).view(np.uint16)
        if m.a.dtype == "BF16":
            reader.into(m.a, a)
        else:
            a[:] = to_bf16(reader.read(m.a), m.a.dtype).reshape(-1)
        if check_finite:
            _refuse_non_finite(a, report.name, m.a.name)
        b = writer.span(e.b_offset, e.b_bytes).view(np.uint16)
        ratio = m.scaling / report.scaling
        if m.b.dtype == "BF16" and ratio == 1.0 and m.r == max_rank:
            reader.into(m.b, b)
        else:
            _fill_b(b, reader.read(m.b), m.b.dtype, ratio, m.r, max_rank)
        if check_finite:
            _refuse_non_finite(b, report.name, m.b.name)
        read += m.a.nbytes + m.b.nbytes
        if progress is not None:
            progress(m.a.nbytes + m.b.nbytes)
    return read


def fill_experts(reader: RawReader, report: AdapterReport, layout: ExpertLayout,
                 writer: SlotWriter, check_finite: bool = True,
                 progress: Progress | None = None) -> int:
    """Write `report`'s expert pairs into an expert slot, as `fill_modules` does for modules:
    A rows and B columns up to the pair's rank, the pair's PEFT scaling relative to the slot's
    scale folded into its B before the single rounding to BF16.

    A pair's A is a run of rows of the file's A, read on its own. A fused B `[out, E*r]` holds
    every expert's columns in each row, so it is read in runs of rows (`B_CHUNK_BYTES`) and
    each run scattered to every pair: memory beside the pool stays one run, however wide the
    adapter. Returns the file bytes read."""
    groups: dict[tuple[str, str], list[ExpertPair]] = defaultdict(list)
    for p in report.expert_pairs:
        groups[(p.a.name, p.b.name)].append(p)
    read = 0
    max_rank = layout.max_rank
    for group in groups.values():
        first = group[0]
        last: tuple[int, np.ndarray] | None = None  # gate and up share their A rows
        for p in group:
            e = layout.entries[layout.index[p.key]]
            a = writer.span(e.a_offset, p.r * p.in_dim * BF16_BYTES).view(np.uint16)
            if p.a.dtype == "BF16":
                reader.into(p.a, a, p.a_row)
            elif last is not None and last[0] == p.a_row:
                a[:] = last[1]
            else:
                a[:] = to_bf16(reader.read(p.a, p.a_row, p.r), p.a.dtype).reshape(-1)
                last = (p.a_row, a.copy())
            if check_finite:
                _refuse_non_finite(a, report.name, p.a.name)
        b_rows = first.b.shape[0]
        step = max(1, B_CHUNK_BYTES // max(1, _row_bytes(first.b)))
        for start in range(0, b_rows, step):
            stop = min(b_rows, start + step)
            raw = reader.read(first.b, start, stop - start).reshape(stop - start, -1)
            for p in group:
                lo, hi = max(start, p.b_row), min(stop, p.b_row + p.out_dim)
                if lo >= hi:
                    continue
                e = layout.entries[layout.index[p.key]]
                cols = raw[lo - start:hi - start,
                           p.b_col:p.b_col + p.r * p.b_col_step:p.b_col_step]
                b = writer.span(e.b_offset + (lo - p.b_row) * max_rank * BF16_BYTES,
                                (hi - lo) * max_rank * BF16_BYTES).view(np.uint16)
                _fill_b(b, cols, p.b.dtype, p.scaling / report.scaling, p.r, max_rank)
                if check_finite:
                    _refuse_non_finite(b, report.name, p.b.name)
        read += first.a.nbytes + first.b.nbytes
        if progress is not None:
            progress(first.a.nbytes + first.b.nbytes)
    return read


def fill_shard_modules(reader: TensorReader, report: AdapterReport, layout: RankLayout,
                       writer: SlotWriter, check_finite: bool = True,
                       progress: Progress | None = None) -> int:
    """`fill_modules` for a tensor-parallel rank: each module's slice (`entry.slice`) into its
    entry, converted exactly as the unsharded fill converts it: A's held rank rows below the
    adapter's rank and its held input columns, B's held output rows (its first r columns).
    Reads only those bytes of the file; returns how many."""
    read = 0
    max_rank = layout.max_rank
    for m in report.modules:
        e = layout.entries[layout.index[(m.layer, m.module)]]
        s = e.slice
        lo, hi = s.ranks if s.ranks is not None else (0, max_rank)
        done = 0
        if min(hi, m.r) > lo:
            rows = (lo, min(hi, m.r))
            a = writer.span(e.a_offset, (rows[1] - lo) * e.in_dim * BF16_BYTES).view(np.uint16)
            if m.a.dtype == "BF16":
                done += reader.read_block(m.a, rows, s.cols, a).nbytes
            else:
                block = reader.read_block(m.a, rows, s.cols)
                done += block.nbytes
                a[:] = to_bf16(block, m.a.dtype).reshape(-1)
            if check_finite:
                _refuse_non_finite(a, report.name, m.a.name)
        b = writer.span(e.b_offset, e.b_bytes).view(np.uint16)
        ratio = m.scaling / report.scaling
        if m.b.dtype == "BF16" and ratio == 1.0 and m.r == max_rank:
            done += reader.read_block(m.b, s.rows, (0, m.r), b).nbytes
        else:
            block = reader.read_block(m.b, s.rows, (0, m.r))
            done += block.nbytes
            _fill_b(b, block, m.b.dtype, ratio, m.r, max_rank)
        if check_finite:
            _refuse_non_finite(b, report.name, m.b.name)
        read += done
        if progress is not None:
            progress(done)
    return read


def fill_shard_experts(reader: TensorReader, report: AdapterReport, layout: RankExpertLayout,
                       writer: SlotWriter, check_finite: bool = True,
                       progress: Progress | None = None) -> int:
    """`fill_experts` for a tensor-parallel rank (`report` holds its EP group's pairs only):
    each pair's slice. The rows of a file's A that the rank's experts sharing it need are read
    once; a fused B interleaves the experts by column, so the rank reads its rows of B whole,
    once per row range. Returns the file bytes read."""
    groups: dict[tuple[str, str], list[ExpertPair]] = defaultdict(list)
    for p in report.expert_pairs:
        groups[(p.a.name, p.b.name)].append(p)
    read = 0
    for group in groups.values():
        first = group[0]
        entries = [layout.entries[layout.index[p.key]] for p in group]
        s = entries[0].slice  # the pairs sharing a file tensor share their slice
        lo, hi = s.ranks if s.ranks is not None else (0, layout.max_rank)
        spans = [(p.a_row + lo, p.a_row + min(hi, p.r)) for p in group]
        a_span = (min(a for a, _ in spans), max(b for _, b in spans))
        # Copies: the reader's scratch buffer holds one block at a time.
        a_all = (reader.read_block(first.a, a_span, s.cols).copy() if a_span[1] > a_span[0]
                 else None)
        b_blocks: dict[tuple[int, int], np.ndarray] = {}
        for p, e in zip(group, entries, strict=True):
            rows = (p.b_row + e.slice.rows[0], p.b_row + e.slice.rows[1])
            if rows not in b_blocks:
                b_blocks[rows] = reader.read_block(first.b, rows, (0, first.b.shape[1])).copy()
        done = (a_all.nbytes if a_all is not None else 0) + sum(
            b.nbytes for b in b_blocks.values())
        for p, e, (a_lo, a_hi) in zip(group, entries, spans, strict=True):
            if a_all is not None and a_hi > a_lo:
                a = writer.span(e.a_offset, (a_hi - a_lo) * e.in_dim * BF16_BYTES)
                a = a.view(np.uint16)
                a[:] = to_bf16(np.ascontiguousarray(a_all[a_lo - a_span[0]:a_hi - a_span[0]]),
                               p.a.dtype).reshape(-1)
                if check_finite:
                    _refuse_non_finite(a, report.name, p.a.name)
            b_all = b_blocks[(p.b_row + e.slice.rows[0], p.b_row + e.slice.rows[1])]
            b = writer.span(e.b_offset, e.b_bytes).view(np.uint16)
            _fill_b(b, b_all[:, p.b_col:p.b_col + p.r * p.b_col_step:p.b_col_step], p.b.dtype,
                    p.scaling / report.scaling, p.r, layout.max_rank)
            if check_finite:
                _refuse_non_finite(b, report.name, p.b.name)
        read += done
        if progress is not None:
            progress(done)
    return read


def _fill_b(b: np.ndarray, values: np.ndarray, dtype: str, ratio: float, r: int,
            max_rank: int) -> None:
    """Rows of a B region (`[n, max_rank]` BF16 bits): the first r columns are `values`
    (`[n, r]` raw elements, or flat) times `ratio` rounded once, the rest zero."""
    rows = b.reshape(-1, max_rank)
    rows[:, :r] = to_bf16(np.ascontiguousarray(values), dtype, ratio).reshape(-1, r)
    rows[:, r:] = 0


def fill_slot(report: AdapterReport, slot: int, layout: SlotLayout, region: Region,
              expert_layout: ExpertLayout | None = None, expert_region: Region | None = None,
              staging: Staging | None = None, check_finite: bool = True,
              progress: Progress | None = None) -> tuple[int, OverlayRaw | None]:
    """Write an adapter that `check_fits` into slot `slot` of `region` (and of `expert_region`),
    reading its file once; the tables are left for the caller to publish. Returns the file
    bytes read and the slot's overlays."""
    fd = os.open(report.adapter.weights_path, os.O_RDONLY)
    try:
        reader = TensorReader(fd, str(report.adapter.weights_path))
        writer = region.writer(slot, staging)
        if isinstance(layout, RankLayout):  # a tensor-parallel rank: its slices only
            read = fill_shard_modules(reader, report, layout, writer, check_finite, progress)
        else:
            read = fill_modules(reader, report, layout, writer, check_finite, progress)
        writer.finish()
        if expert_region is not None and expert_layout is not None:
            writer = expert_region.writer(slot, staging)
            if isinstance(expert_layout, RankExpertLayout):
                read += fill_shard_experts(reader, report, expert_layout, writer,
                                           check_finite, progress)
            else:
                read += fill_experts(reader, report, expert_layout, writer, check_finite,
                                     progress)
            writer.finish()
        return read, read_overlays(reader, report, check_finite)
    finally:
        os.close(fd)


def read_overlays(reader: RawReader, report: AdapterReport,
                  check_finite: bool = True) -> OverlayRaw | None:
    """The slot's raw overlay upload (the rows exactly as float32); None without overlays."""
    if not report.overlays:
        return None
    raw = OverlayRaw()
    for o in report.overlays:
        rows = _overlay_rows(reader, o)
        if check_finite and not np.isfinite(rows).all():
            bad = int(np.count_nonzero(~np.isfinite(rows)))
            raise NonFiniteWeights(f"{report.name}: tensor {o.rows.name!r} has {bad:,} "
                                   "non-finite values (NaN or infinity); refusing to pack it")
        raw.tables.append(o.table)
        raw.tokens.append(np.asarray(o.tokens, dtype=np.int64))
        raw.rows.append(rows)
        raw.tied_lm_head.append(o.tied_lm_head)
    return raw


def _overlay_rows(reader: RawReader, o: Overlay) -> np.ndarray:
    values = reader.read(o.rows)
    rows = bf16_to_f32(values) if o.rows.dtype == "BF16" else values.astype(np.float32)
    return np.array(rows, dtype=np.float32).reshape(o.rows.shape)


# -- `metrale pack` -----------------------------------------------------------------------------


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
        pool = self.pool
        layout = pool.layout
        ex = pool.expert_region
        return {
            "device": pool.device,
            "layout": {k: v for k, v in layout.record(pool.max_loras).items()
                       if k != "entries"},
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
    # The pool packs through this module: imported here, where the two meet.
    from metrale_cli.image.pool_image import write_image
    from metrale_cli.pool.pool import LoraPool, pick_device

    if out is not None:
        check_not_an_input(out, [p for r in reports for p in (r.adapter.weights_path,
                                                              r.adapter.config_path)])
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
