"""Filling a pool slot from an audited adapter. One fill serves every pool: each entry is
filled with the part of the whole weight's pair it holds (`entry.held`), which is all of it in
an unsharded pool and a tensor-parallel rank's slice in a rank's pool.

Before a byte is written every module and expert pair is checked against its layout entry
(`check_fits`). Each block is then filled through a `SlotWriter` (straight into the pool on the
host, through pinned staging buffers on a GPU) a cache-sized chunk at a time: the chunk's rows
are read from the adapter file (`TensorReader`) and converted to BF16, or, where the file's
bytes are the slot's, read straight into the slot, and the chunk is checked finite while its
bytes are still in cache. On the host those tensors are read last, in pieces of tensors end
to end in the file, one compiled call a piece that reads and checks 256 KiB at a time without
the GIL (`TensorReader.into_checked`; without the compiled module, one positional read a piece
checked a stretch end to end in the slot at a time), shared by two threads where the bytes
warrant it and a core is idle (`_read_pieces`, `_each`). Conversions go straight into the
slot through buffers reused chunk after chunk (`Scratch`).
"""

from __future__ import annotations

import os
import threading
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple

import numpy as np

from metrale_cli import native
from metrale_cli.adapters.audit import AdapterReport
from metrale_cli.adapters.experts import ExpertPair
from metrale_cli.adapters.overlays import Overlay, OverlayRaw
from metrale_cli.bf16 import Scratch, bf16_to_f32, non_finite, to_bf16_into
from metrale_cli.errors import LayoutMismatch, NonFiniteWeights, UsageError
from metrale_cli.files.safetensors_header import TensorInfo
from metrale_cli.layout.expert_layout import ExpertEntry, ExpertLayout
from metrale_cli.layout.slot_layout import BF16_BYTES, SlotLayout
from metrale_cli.pool.reader import IOV_MAX, RawReader, TensorReader
from metrale_cli.pool.region import Region, SlotWriter, Staging

# Destination bytes written, then checked, at a time: small enough to be checked from cache
# (each core has 1 MiB of L2 here), large enough that the per-chunk calls cost nothing.
CHUNK_BYTES = 1 << 20
# File bytes read straight into the slot at a time (`_read_pieces`): what one thread takes
# from the other. The compiled reader checks them as they land, in a call that does not hold
# the GIL; without it a piece is one read and a check (two NumPy reductions) per stretch, each
# call handing the GIL to the other thread and back: larger pieces cost fewer calls and
# hand-offs, and a piece is still checked from the shared L3 (32 MiB here). Measured on the
# 2-core VM, `bench pack`'s adapters packed eight times in each of eight processes, sizes
# alternating (median of the processes' best ratio to `numpy.copyto`), NumPy's check: 1 MiB
# 0.66, 2 MiB 0.72, 4 MiB 0.78-0.84, 8 MiB 0.75, 16 MiB 0.71; the compiled reader (best of 8
# passes, sizes alternating in one process, six rounds): 1 MiB 0.91-1.02, 2 MiB 0.85-1.06,
# 4 MiB 0.90-1.08, 8 MiB 0.93-1.07, 16 MiB 0.90-1.07, alike within the noise.
READ_BYTES = 4 << 20
# Rows of a fused expert B read at a time: bounds the packer's memory beside the pool.
B_CHUNK_BYTES = 32 << 20
# Slot bytes of one fill's reads or conversions from which a second thread shares its chunks
# (`_each`): below, the thread's start costs more than it saves; a small pack stays on one.
SHARED_BYTES = 16 << 20
# Of the fills large enough to share (`SHARED_BYTES`), how many ran on 1 and on 2 threads in
# this process: `bench pack` reports whether its second reader ran.
SHARED_FILLS: Counter[int] = Counter()
Progress = Callable[[int], None]


def held_report(report: AdapterReport, expert_layout: ExpertLayout | None) -> AdapterReport:
    """`report` as a pool of these layouts holds it: only the expert pairs the expert layout
    holds (`ExpertLayout.held_pairs`: a rank's expert-parallel group's, else all). Every pack,
    swap and verify goes through here."""
    if expert_layout is None or not report.expert_pairs:
        return report
    held = expert_layout.held_pairs(report.expert_pairs)
    return report if len(held) == len(report.expert_pairs) else replace(report,
                                                                         expert_pairs=held)


# -- checks before a byte is written ------------------------------------------------------------


def check_fits(report: AdapterReport, layout: SlotLayout,
               expert_layout: ExpertLayout | None) -> None:
    """Everything `report` (as `held_report` gives it) needs of the pool's layouts, checked
    before any byte is written: servable, every module and expert pair in its layout, within
    its max rank, and shaped as its layout entry's whole weight (an adapter audited against
    another config is refused here)."""
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
        out_dim, in_dim = layout.entries[index].full_dims
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
        # A swapped pair's in side is the file B's rows, its out side the file A's columns.
        in_side, out_side = (b_rows, a_cols) if p.swapped else (a_cols, b_rows)
        if ((p.out_dim, p.in_dim) != (out_dim, in_dim) or in_side != in_dim
                or p.a_row + p.r > a_rows
                or p.b_row + (p.out_dim - 1) * p.b_row_step >= out_side
                or p.b_col + (p.r - 1) * p.b_col_step >= b_cols):
            raise LayoutMismatch(
                f"{where}: A {list(p.a.shape)}, B {list(p.b.shape)} do not fit the pool's "
                f"expert layout, which has A [r, {in_dim}], B [{out_dim}, r] there")


# -- writing a block ----------------------------------------------------------------------------


def _refuse(bad: int, adapter: str, tensor: str) -> None:
    """NaN or infinity in a slot (in the file, or a value too large for BF16 once scaled):
    every token routed to it would produce garbage."""
    if bad:
        raise NonFiniteWeights(f"{adapter}: tensor {tensor!r} has {bad:,} non-finite values "
                               "(NaN or infinity) as BF16; refusing to pack it")


def _convert(dest: np.ndarray, values: np.ndarray, dtype: str, ratio: float,
             scratch: Scratch) -> None:
    """`dest` (`[n, width]` BF16 bits): its first columns are `values` (`[n, k]` raw elements,
    strided or not) times `ratio` rounded once, the rest zero (a B region's columns past the
    adapter's rank). Converted straight into `dest`, the temporaries in `scratch`."""
    k = values.shape[1]
    to_bf16_into(dest[:, :k], values, dtype, ratio, scratch)
    if k < dest.shape[1]:
        dest[:, k:] = 0


def _put(reader: RawReader, info: TensorInfo, rows: tuple[int, int], cols: tuple[int, int],
         dest: np.ndarray, ratio: float, adapter: str, check_finite: bool,
         scratch: Scratch) -> int:
    """Rows `rows` and columns `cols` of the file's tensor `info` into `dest` as `_convert`
    writes them (unscaled BF16 copied bit for bit), fused per `CHUNK_BYTES` of `dest`: a chunk's
    rows are read, converted and checked finite while they are in cache. Where the file's
    bytes are the slot's (BF16, unscaled, whole rows, no padding) they are read straight into
    the slot: one copy, as `numpy.copyto` makes. Returns the file bytes read."""
    direct = _direct(info, cols, dest.shape[1], ratio)
    bad = read = 0
    for lo, hi in _chunks(dest):
        done, count = _put_chunk(reader, info, (rows[0] + lo, rows[0] + hi), cols, dest[lo:hi],
                                 ratio, direct, check_finite, scratch)
        read += done
        bad += count
    _refuse(bad, adapter, info.name)
    return read


def _chunks(dest: np.ndarray) -> list[tuple[int, int]]:
    """The rows `[lo, hi)` of `dest` (`[n, width]` BF16 bits) a chunk at a time: at most
    `CHUNK_BYTES` of it, or one row."""
    n, width = dest.shape
    step = max(1, CHUNK_BYTES // max(1, width * BF16_BYTES))
    return [(lo, min(n, lo + step)) for lo in range(0, n, step)]


def _put_chunk(reader: RawReader, info: TensorInfo, rows: tuple[int, int],
               cols: tuple[int, int], chunk: np.ndarray, ratio: float, direct: bool,
               check_finite: bool, scratch: Scratch) -> tuple[int, int]:
    """One chunk of `_put`: the file rows `rows` (columns `cols`) of `info` read straight into
    `chunk` (`direct`) or into `scratch` and converted into it, then checked. Returns the file
    bytes read and the chunk's non-finite count."""
    if direct:
        reader.rows_into(info, rows, chunk)
        read = chunk.nbytes
    else:
        values = reader.block(info, rows, cols, scratch)
        _convert(chunk, values, info.dtype, ratio, scratch)
        read = values.nbytes
    return read, non_finite(chunk) if check_finite else 0


# A block of a tensor converted into the pool on the host: (tensor, its file rows, its file
# columns, the slot's `[n, width]` BF16 bits it fills, the scaling ratio).
Convert = tuple[TensorInfo, tuple[int, int], tuple[int, int], np.ndarray, float]


def _convert_all(reader: RawReader, converts: list[Convert], adapter: str, check_finite: bool,
                 progress: Progress | None) -> int:
    """Each of `converts` filled as `_put` fills it, a chunk at a time, the chunks shared by two
    threads where the bytes warrant it (`_each`; each thread its own buffers). A short file is
    the first failing chunk's error; a non-finite value is refused once every chunk is written,
    naming the first such tensor of `converts` with its whole count. Returns the bytes read."""
    jobs = [(t, lo, hi) for t, (_, _, _, dest, _) in enumerate(converts)
            for lo, hi in _chunks(dest)]
    scratches = (Scratch(), Scratch())  # one a thread
    found = [0] * len(jobs)  # each chunk's non-finite count, summed per tensor once all are in

    def convert(index: int, thread: int) -> int:
        t, lo, hi = jobs[index]
        info, rows, cols, dest, ratio = converts[t]
        read, found[index] = _put_chunk(reader, info, (rows[0] + lo, rows[0] + hi), cols,
                                        dest[lo:hi], ratio, False, check_finite,
                                        scratches[thread])
        return read

    read = _each(len(jobs), convert, sum(c[3].nbytes for c in converts), progress)
    bad = [0] * len(converts)
    for (t, _, _), count in zip(jobs, found, strict=True):
        bad[t] += count
    for (info, *_), count in zip(converts, bad, strict=True):
        _refuse(count, adapter, info.name)
    return read


def _direct(info: TensorInfo, cols: tuple[int, int], width: int, ratio: float) -> bool:
    """Whether the file's bytes of a block of `info`'s rows are the slot's, as they are: BF16,
    unscaled, whole rows, as wide as the slot's rows."""
    return (info.dtype == "BF16" and ratio == 1.0 and cols == (0, info.shape[1])
            and width == info.shape[1])


# A tensor's rows whose file bytes are the slot's: (file offset, tensor, slot offset, bytes).
Part = tuple[int, TensorInfo, int, int]


class Piece(NamedTuple):
    """One read: the file's bytes from `start` on into `spans` of the slot, each of one tensor,
    end to end in the file (`parts`: where each lies)."""

    spans: list[tuple[TensorInfo, np.ndarray]]
    parts: list[Part]

    @property
    def start(self) -> int:
        """The file offset the read begins at: its first part's."""
        return self.parts[0][0]


def _pieces(parts: list[Part], writer: SlotWriter) -> list[Piece]:
    """`parts` as pieces of at most `READ_BYTES` end to end in the file (a part larger than a
    piece split), in file order."""
    step = max(BF16_BYTES, READ_BYTES - READ_BYTES % BF16_BYTES)
    cuts: list[list[Part]] = []
    size = 0
    for start, info, offset, nbytes in sorted(parts, key=lambda part: part[0]):
        for lo in range(0, nbytes, step):
            n = min(step, nbytes - lo)
            cut = cuts[-1] if cuts else []
            if (not cut or start + lo != cut[-1][0] + cut[-1][3] or size + n > step
                    or len(cut) == IOV_MAX):
                cut = []
                cuts.append(cut)
                size = 0
            cut.append((start + lo, info, offset + lo, n))
            size += n
    return [Piece([(info, writer.filled(offset, n)) for _, info, offset, n in cut], cut)
            for cut in cuts]


def _stretches(piece: Piece, writer: SlotWriter) -> list[np.ndarray]:
    """The slot's bytes of `piece` as arrays each of its spans that lie end to end in the slot
    too (a module's A and B, or a whole piece where the file's order is the slot's): what
    NumPy's check takes as one."""
    cut, stretches = piece.parts, []
    i = 0
    while i < len(cut):
        j = i + 1
        while j < len(cut) and cut[j][2] == cut[j - 1][2] + cut[j - 1][3]:
            j += 1
        end = cut[j - 1][2] + cut[j - 1][3]
        stretches.append(writer.filled(cut[i][2], end - cut[i][2]))
        i = j
    return stretches


def _read_pieces(reader: RawReader, writer: SlotWriter, parts: list[Part], adapter: str,
                 check_finite: bool, progress: Progress | None) -> int:
    """Read `parts` straight into the slot a piece (`_pieces`) at a time, checked finite while
    in cache: by the compiled reader as each 256 KiB lands (`into_checked`), else one
    positional read a piece and a NumPy check a stretch (one check for spans end to end in the
    slot: a check is two NumPy calls, which cost per call); the pieces shared by two threads
    where the bytes warrant it (`_each`). A short file is the failing piece's
    error, in file order; a non-finite value is refused once every piece is read, naming the
    first such tensor in the file with its whole count. Returns the bytes read."""
    pieces = _pieces(parts, writer)
    # Each piece's (tensor, non-finite count) pairs, merged in file order once all are read.
    found: list[list[tuple[str, int]]] = [[] for _ in pieces]

    def read_piece(index: int, thread: int) -> int:
        piece = pieces[index]
        if check_finite and native.compiled is not None:
            seen = reader.into_checked(piece.start, piece.spans)
        else:
            reader.into(piece.start, piece.spans)
            seen = check_finite and any(non_finite(stretch.view(np.uint16))
                                        for stretch in _stretches(piece, writer))
        if seen:  # which of its tensors, how many
            found[index] = [(info.name, non_finite(span.view(np.uint16)))
                            for info, span in piece.spans]
        return sum(span.nbytes for _, span in piece.spans)

    read = _each(len(pieces), read_piece, sum(part[3] for part in parts), progress)
    bad: Counter[str] = Counter()
    for pairs in found:
        for name, count in pairs:
            if count:
                bad[name] += count
    for name, count in bad.items():
        _refuse(count, adapter, name)
    return read


def _threads(nbytes: int) -> int:
    """How many threads fill `nbytes` of a slot: two where they warrant a second thread, this
    process may run on two cores (`usable_cores`) and one of them is idle (`_core_idle`), else
    one. On a busy machine a second thread only waits: for a core, and for the GIL behind the
    first whenever the kernel preempts it holding it (`bench pack` under load 11: 0.47-0.53 of
    `numpy.copyto` in the median pass against 0.56-0.61 on one thread)."""
    if nbytes < SHARED_BYTES:
        return 1
    cores = usable_cores()
    return 2 if cores >= 2 and _core_idle(cores) else 1


def usable_cores() -> int:
    """The cores this process may run on (its affinity, not the machine's count)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _core_idle(cores: int) -> bool:
    """Whether one of `cores` is idle for a second thread: the threads runnable at this moment
    (this one included) leave one, or the last minute's load average does. The moment alone
    misread an idle machine: a kernel thread runnable just then kept half the fills of `bench
    pack` on one thread (24 of 48 on the idle VM: 0.64-0.66 of `numpy.copyto`); the average
    alone lags a load that has just begun or ended."""
    runnable, average = _load()
    return runnable <= cores - 1 or average <= cores - 0.5


def _load() -> tuple[int, float]:
    """The threads runnable on the machine at this moment, this one included (the fourth field
    of /proc/loadavg, `running/total`) and the one-minute load average (its first); where they
    are unknown, as if every core were busy."""
    try:
        with open("/proc/loadavg") as f:
            fields = f.read().split()
        return int(fields[3].split("/")[0]), float(fields[0])
    except (OSError, ValueError, IndexError):
        busy = os.cpu_count() or 1
        return busy, float(busy)


def _each(count: int, work: Callable[[int, int], int], nbytes: int,
          progress: Progress | None) -> int:
    """`work(i, thread)` for every i in `range(count)`, the indices taken in order by this
    thread (0) and, where `_threads(nbytes)` (the slot bytes the work fills) says two, by a
    helper thread (1): `os.preadv` and NumPy's copies, conversions and reductions release the
    GIL, so one thread reads or converts a chunk while the other checks its own. Each call
    returns the file bytes it read; their sum is told to `progress` on this thread (a Rich bar
    is this thread's) and returned. A failure stops both threads taking more; once both have
    stopped, the failure of the lowest index is raised: every lower index was taken before it
    and finished, so it is the error one thread meets."""
    lock = threading.Lock()
    indices = iter(range(count))
    failed: dict[int, Exception] = {}
    stopped = False
    done = [0, 0]  # bytes read by this thread, by the helper
    told = 0  # bytes told to `progress`

    def tell() -> None:
        nonlocal told
        now = sum(done)  # the helper may add to it meanwhile
        if progress is not None and now > told:
            progress(now - told)
            told = now

    def take() -> int | None:
        with lock:
            return None if failed or stopped else next(indices, None)

    def run(who: int) -> None:
        while (index := take()) is not None:
            try:
                done[who] += work(index, who)
            except Exception as error:  # raised on this thread once both have stopped
                with lock:
                    failed[index] = error
                return
            if who == 0:
                tell()

    threads = _threads(nbytes)
    if nbytes >= SHARED_BYTES:
        SHARED_FILLS[threads] += 1
    helper = (threading.Thread(target=run, args=(1,), name="metrale-fill", daemon=True)
              if threads > 1 else None)
    if helper is not None:
        helper.start()
    try:
        run(0)
    finally:
        stopped = True  # an interrupt of this thread stops the helper at its next index
        if helper is not None:
            helper.join()
    if failed:
        raise failed[min(failed)]
    tell()  # the helper's bytes read after this thread's last report
    return sum(done)


def _bits(span: np.ndarray, width: int) -> np.ndarray:
    """A slot span (u8) as `[n, width]` BF16 bits."""
    return span.view(np.uint16).reshape(-1, width)


# -- the fills ----------------------------------------------------------------------------------


def fill_modules(reader: RawReader, report: AdapterReport, layout: SlotLayout,
                 writer: SlotWriter, check_finite: bool = True,
                 progress: Progress | None = None) -> int:
    """Write every module of `report` into a slot, each entry's held part: A `[r, in]` as the
    first r rows of its `[max_rank, in]` region (a fully sharded rank: its rank rows below r;
    a row-parallel rank: its input columns), B `[out, r]` as the first r columns of its
    `[out, max_rank]` region (a column-parallel rank: its output rows, a run per slice of a
    fused projection), BF16 round-to-nearest-even, each module's PEFT scaling relative to the
    slot's scale folded into its B, so that `scale * (x @ A^T) @ B^T` is PEFT's delta (a
    rank's part of it) for every module. Reads only the held bytes of the file; returns how many."""
    # On the host the blocks are filled once every span is known: those to convert
    # (`_convert_all`), then the tensors whose file bytes are the slot's, in pieces end to end
    # in the file (`_read_pieces`); both shared by two threads where that pays.
    # On a GPU, block by block through the staging buffers.
    converts: list[Convert] = []
    parts: list[Part] = []
    scratch = Scratch()  # the GPU path's conversion buffers, shared by every chunk

    def put(info: TensorInfo, rows: tuple[int, int], cols: tuple[int, int], offset: int,
            nbytes: int, width: int, ratio: float) -> int:
        if writer.staging is not None:
            return _put(reader, info, rows, cols, _bits(writer.span(offset, nbytes), width),
                        ratio, report.name, check_finite, scratch)
        if _direct(info, cols, width, ratio):  # its span is given out when its piece is read
            writer.cover(offset, nbytes)
            parts.append((info.begin + rows[0] * width * BF16_BYTES, info, offset, nbytes))
        else:
            converts.append((info, rows, cols, _bits(writer.span(offset, nbytes), width),
                             ratio))
        return 0

    read = 0
    for m in report.modules:
        e = layout.entries[layout.index[(m.layer, m.module)]]
        s = e.held
        lo, hi = s.ranks if s.ranks is not None else (0, e.max_rank)
        top = min(hi, m.r)
        done = 0
        if top > lo:
            done += put(m.a, (lo, top), s.cols, e.a_offset,
                        (top - lo) * e.in_dim * BF16_BYTES, e.in_dim, 1.0)
        # B's held rows, run after run (a fused projection's rank holds one per slice).
        b_offset = e.b_offset
        for rows in s.rows:
            size = (rows[1] - rows[0]) * e.max_rank * BF16_BYTES
            done += put(m.b, rows, (0, m.r), b_offset, size, e.max_rank,
                        m.scaling / report.scaling)
            b_offset += size
        read += done
        if progress is not None and done:
            progress(done)
    read += _convert_all(reader, converts, report.name, check_finite, progress)
    return read + _read_pieces(reader, writer, parts, report.name, check_finite, progress)


def fill_experts(reader: RawReader, report: AdapterReport, layout: ExpertLayout,
                 writer: SlotWriter, check_finite: bool = True,
                 progress: Progress | None = None) -> int:
    """Write `report`'s expert pairs into an expert slot, as `fill_modules` does for modules:
    each entry's held part, A rows and B columns up to the pair's rank, the pair's PEFT scaling
    relative to the slot's scale folded into its B before the single rounding to BF16.

    Pairs are filled by the file tensors they share. A pair's A is a block of rows of the
    file's A, read once however many pairs take it (gate and up do). A fused B `[out, E*r]`
    holds every expert's columns in each row, so the rows the pairs hold are read in runs
    (`B_CHUNK_BYTES`) and each run scattered to every pair: memory beside the pool stays one
    run, however wide the adapter. Returns the file bytes read."""
    groups: dict[tuple[str, str], list[tuple[ExpertPair, ExpertEntry]]] = defaultdict(list)
    scratch = Scratch()
    read = 0
    for p in report.expert_pairs:
        e = layout.entries[layout.index[p.key]]
        if p.swapped:
            done = _fill_swapped(reader, report, p, e, writer, check_finite, scratch)
            read += done
            if progress is not None:
                progress(done)
        else:
            groups[(p.a.name, p.b.name)].append((p, e))
    for group in groups.values():
        done = _fill_expert_a(reader, report, group, writer, check_finite, scratch)
        done += _fill_expert_b(reader, report, group, writer, check_finite, scratch)
        read += done
        if progress is not None:
            progress(done)
    return read


def _fill_swapped(reader: RawReader, report: AdapterReport, p: ExpertPair, e: ExpertEntry,
                  writer: SlotWriter, check_finite: bool, scratch: Scratch) -> int:
    """A pair whose file tensors PEFT swapped (llama4's experts): its A rows are the file B's
    columns of the expert (the held input rows of B, transposed), its B rows the file A's
    columns (the expert's rows of A, transposed, the scaling folded in)."""
    s = e.held
    lo, hi = s.ranks if s.ranks is not None else (0, e.max_rank)
    top = min(hi, p.r)
    read = bad = 0
    if top > lo:
        raw = reader.block(p.b, s.cols, (0, p.b.shape[1]))
        read += raw.nbytes
        cols = raw[:, p.b_col + lo * p.b_col_step:p.b_col + top * p.b_col_step:p.b_col_step]
        a = _bits(writer.span(e.a_offset, (top - lo) * e.in_dim * BF16_BYTES), e.in_dim)
        _convert(a, np.ascontiguousarray(cols.T), p.b.dtype, 1.0, scratch)
        if check_finite:
            bad += non_finite(a)
    _refuse(bad, report.name, p.b.name)
    held_lo, held_hi = s.rows[0]
    raw = reader.block(p.a, (p.a_row, p.a_row + p.r), (p.b_row + held_lo, p.b_row + held_hi))
    read += raw.nbytes
    b = _bits(writer.span(e.b_offset, (held_hi - held_lo) * e.max_rank * BF16_BYTES),
              e.max_rank)
    _convert(b, np.ascontiguousarray(raw.T), p.a.dtype, p.scaling / report.scaling, scratch)
    _refuse(non_finite(b) if check_finite else 0, report.name, p.a.name)
    return read


def _fill_expert_a(reader: RawReader, report: AdapterReport,
                   group: list[tuple[ExpertPair, ExpertEntry]], writer: SlotWriter,
                   check_finite: bool, scratch: Scratch) -> int:
    blocks = []
    for p, e in group:
        s = e.held
        lo, hi = s.ranks if s.ranks is not None else (0, e.max_rank)
        top = min(hi, p.r)
        blocks.append(((p.a_row + lo, p.a_row + top), s.cols) if top > lo else None)
    takers = Counter(blocks)
    # A host copy of each block more than one pair takes: a GPU span is a staging buffer,
    # gone once the next span is asked for.
    shared: dict[tuple[tuple[int, int], tuple[int, int]], np.ndarray] = {}
    read = 0
    for (p, e), block in zip(group, blocks, strict=True):
        if block is None:
            continue
        rows, cols = block
        a = _bits(writer.span(e.a_offset, (rows[1] - rows[0]) * e.in_dim * BF16_BYTES),
                  e.in_dim)
        if block in shared:
            a[:] = shared[block]
            continue
        read += _put(reader, p.a, rows, cols, a, 1.0, report.name, check_finite, scratch)
        if takers[block] > 1:
            shared[block] = a.copy()
    return read


def _fill_expert_b(reader: RawReader, report: AdapterReport,
                   group: list[tuple[ExpertPair, ExpertEntry]], writer: SlotWriter,
                   check_finite: bool, scratch: Scratch) -> int:
    info = group[0][0].b
    # The file rows of B each pair holds: its entry's held output rows k (one run: an expert's
    # projection is not fused) are the file's rows `b_row + k * b_row_step`.
    held = [e.held.rows[0] for _, e in group]
    spans = [(p.b_row + lo * p.b_row_step, p.b_row + (hi - 1) * p.b_row_step + 1)
             for (p, _), (lo, hi) in zip(group, held, strict=True)]
    row_bytes = info.nbytes // max(1, info.shape[0])
    step = max(1, B_CHUNK_BYTES // max(1, row_bytes))
    read = bad = 0
    for first, last in _merged(spans):
        for start in range(first, last, step):
            stop = min(last, start + step)
            raw = reader.block(info, (start, stop), (0, info.shape[1]), scratch)
            read += raw.nbytes
            for (p, e), (held_lo, held_hi) in zip(group, held, strict=True):
                # The pair's held rows k whose file row falls in [start, stop).
                lo = max(held_lo, -(-(start - p.b_row) // p.b_row_step))
                hi = min(held_hi, -(-(stop - p.b_row) // p.b_row_step))
                if lo >= hi:
                    continue
                b = _bits(writer.span(e.b_offset + (lo - held_lo) * e.max_rank * BF16_BYTES,
                                      (hi - lo) * e.max_rank * BF16_BYTES), e.max_rank)
                first_row = p.b_row + lo * p.b_row_step - start
                cols = raw[first_row:first_row + (hi - lo - 1) * p.b_row_step + 1:p.b_row_step,
                           p.b_col:p.b_col + p.r * p.b_col_step:p.b_col_step]
                _convert(b, cols, info.dtype, p.scaling / report.scaling, scratch)
                if check_finite:
                    bad += non_finite(b)
    _refuse(bad, report.name, info.name)
    return read


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The union of `[lo, hi)` spans as sorted disjoint spans (touching ones joined)."""
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(spans):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


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
    finally:
        os.close(fd)  # the reader holds its own duplicate
    try:
        writer = region.writer(slot, staging)
        read = fill_modules(reader, report, layout, writer, check_finite, progress)
        writer.finish()
        if expert_region is not None and expert_layout is not None:
            writer = expert_region.writer(slot, staging)
            read += fill_experts(reader, report, expert_layout, writer, check_finite, progress)
            writer.finish()
        return read, read_overlays(reader, report, check_finite)
    finally:
        reader.close()


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
