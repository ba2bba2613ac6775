"""Request workloads for the slot-cache simulator: a trace read from CSV or JSONL, or one of the
seeded generators of the LoRA-serving literature, held as NumPy columns (a million requests are
a few tens of MiB).

A request asks for one adapter by name (or for the base model, which takes no slot) at a time in
seconds, and holds its slot for its `duration`, or for its tokens at a prefill and a decode rate.
"""

from __future__ import annotations

import codecs
import csv
import io
import itertools
import json
import math
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from metrale_cli.arguments import checked_fields
from metrale_cli.errors import FormatError, UsageError, did_you_mean
from metrale_cli.files.atomic import atomic_write
from metrale_cli.files.jsondoc import load_json

GENERATORS = ("zipf", "uniform", "distinct", "identical", "slora")
# S-LoRA's model settings (benchmarks/exp_suite.py LORA_DIR): the ranks of the adapter
# directories the server registers, cycled by adapter index (`{dir}-{i}` for each i, each dir),
# so that adapter k of a suite has the rank of directory k % len(dirs).
SLORA_RANKS = {"S1": (8,), "S2": (64, 32, 16, 8), "S3": (16,), "S4": (64, 32, 16)}
TRACE_COLUMNS = ("timestamp", "adapter", "input_tokens", "output_tokens", "duration")
# An optional column: the adapter's own LoRA rank (0 or empty: not known, a whole slot moves).
RANK_COLUMN = "rank"
# A request line is a few dozen characters; one this long is not a trace (a binary file, a
# file with no line breaks), refused before it is held in memory.
MAX_LINE_CHARS = 1 << 16
# Token counts are read as float64, which holds every whole number below this exactly.
MAX_TOKENS = 2**53
# Requests in one workload, generated or read: a replay holds a few columns of 8 bytes per
# request per policy and size, and 10 million take minutes; 10**9 would exhaust memory first.
MAX_REQUESTS = 10_000_000
# Trace rows parsed and turned into columns at a time: row objects never outnumber it.
TRACE_CHUNK = 1 << 16


@dataclass(frozen=True)
class Workload:
    """Requests in arrival order. Column `adapter` indexes `adapters`; -1 is the base model."""

    adapters: tuple[str, ...]
    adapter: np.ndarray        # [N] int64, -1 = the base model
    arrival: np.ndarray        # [N] float64 seconds, non-decreasing
    input_tokens: np.ndarray   # [N] int64, 0 when unknown
    output_tokens: np.ndarray  # [N] int64, 0 when unknown
    duration: np.ndarray       # [N] float64 seconds, NaN = from the tokens
    source: dict[str, Any] = field(default_factory=dict)
    # [len(adapters)] int64: each adapter's own LoRA rank, 0 = unknown (a whole slot is moved).
    adapter_rank: np.ndarray | None = None

    @property
    def requests(self) -> int:
        return int(self.adapter.size)

    def hold_seconds(self, prefill_tok_s: float, decode_tok_s: float) -> np.ndarray:
        """[N] float64: how long each request holds its slot, from admission to completion."""
        if not (0 < prefill_tok_s < math.inf and 0 < decode_tok_s < math.inf):
            raise UsageError("--prefill-tok-s and --decode-tok-s must be positive and finite")
        with np.errstate(over="ignore"):  # refused below
            from_tokens = self.input_tokens / prefill_tok_s + self.output_tokens / decode_tok_s
            hold = np.where(np.isnan(self.duration), from_tokens, self.duration)
            # A request waits at most the holds' sum past the last arrival, and the replay adds
            # up every request's wait: requests times that must be a number.
            total = (float(hold.sum()) + (float(self.arrival[-1]) if self.requests else 0.0)
                     ) * max(1, self.requests)
            given = float(np.nansum(self.duration))
        if not math.isfinite(given):
            raise FormatError(f"{self.source.get('path', 'the trace')}: its durations add up "
                              "beyond floating point")
        if not math.isfinite(total):
            raise UsageError(f"--prefill-tok-s {prefill_tok_s:g} and --decode-tok-s "
                             f"{decode_tok_s:g} give request times beyond floating point; "
                             "choose larger ones")
        return hold

    def next_use(self) -> np.ndarray:
        """[N] int64: the index of the next request for the same adapter, or -1 when none (and
        for base-model requests). Belady's rule reads it."""
        n = self.requests
        order = np.argsort(self.adapter, kind="stable")  # by adapter, then request order
        nxt_sorted = np.full(n, -1, dtype=np.int64)
        nxt_sorted[:-1] = order[1:]
        nxt_sorted[:-1][self.adapter[order[1:]] != self.adapter[order[:-1]]] = -1
        nxt = np.empty(n, dtype=np.int64)
        nxt[order] = nxt_sorted
        nxt[self.adapter < 0] = -1
        return nxt

    def counts(self) -> np.ndarray:
        """[len(adapters)] int64: requests per adapter."""
        used = self.adapter[self.adapter >= 0]
        return np.bincount(used, minlength=len(self.adapters))

    def requested_among(self, names: Iterable[str]) -> set[str]:
        """Which of `names` some request asks for: one pass over the adapters' names where
        there are names to look for, none where there are not (a set of every requested name
        took seconds at millions of adapters)."""
        wanted = set(names)
        if not wanted:
            return set()
        counts = self.counts()
        return {name for a, name in enumerate(self.adapters) if name in wanted and counts[a]}

    def unpinned(self, pinned: Iterable[str]) -> int:
        """How many adapters some request asks for beside `pinned`: those that need a cache
        slot."""
        return int(np.count_nonzero(self.counts())) - len(self.requested_among(pinned))

    def most_requested(self, k: int) -> list[str]:
        """The `k` most requested adapters (ties: the one named first), as at pool startup."""
        if k == 0:  # no sort of every adapter for none
            return []
        counts = self.counts()
        order = np.lexsort((np.arange(counts.size), -counts))
        return [self.adapters[i] for i in order[:k] if counts[i] > 0]

    def record(self) -> dict[str, Any]:
        used = self.adapter[self.adapter >= 0]
        out = {
            **self.source,
            "requests": self.requests,
            "adapter_requests": int(used.size),
            "distinct_adapters": int(np.unique(used).size),
            "span_s": float(self.arrival[-1] - self.arrival[0]) if self.requests else 0.0,
        }
        if self.adapter_rank is not None:
            ranks, counts = np.unique(self.adapter_rank[np.unique(used)], return_counts=True)
            out["adapter_ranks"] = {str(r): int(c) for r, c in zip(ranks, counts, strict=True)}
        return out

    def save(self, path: Path, force: bool) -> None:
        """Write the requests as a trace that `--trace` reads back exactly: CSV for `.csv`,
        JSON lines otherwise; atomically, never over a file without `force`."""
        has_duration = bool((~np.isnan(self.duration)).any())
        ranks = self.adapter_rank
        columns = list(TRACE_COLUMNS if has_duration else TRACE_COLUMNS[:-1])
        if ranks is not None:
            columns.append(RANK_COLUMN)
        rows = zip(self.arrival.tolist(), self.adapter.tolist(), self.input_tokens.tolist(),
                   self.output_tokens.tolist(), self.duration.tolist(), strict=True)
        names = self.adapters

        def cells(row: tuple[float, int, int, int, float]) -> list[Any]:
            t, a, i, o, d = row
            out: list[Any] = [t, names[a] if a >= 0 else "", i, o]
            if has_duration:
                out.append(None if math.isnan(d) else d)
            if ranks is not None:
                out.append(int(ranks[a]) if a >= 0 else 0)
            return out

        def write(f: Any) -> None:
            text = io.TextIOWrapper(f, encoding="utf-8", newline="")
            if Path(path).suffix.lower() == ".csv":
                w = csv.writer(text)
                w.writerow(columns)
                w.writerows(["" if c is None else repr(c) if isinstance(c, float) else c
                             for c in cells(r)] for r in rows)
            else:
                for r in rows:
                    text.write(json.dumps(dict(zip(columns, cells(r), strict=True))) + "\n")
            text.flush()
            text.detach()

        atomic_write(Path(path), write, force)


# -- traces -------------------------------------------------------------------------------------


def read_trace(path: Path, progress: Callable[[int, int], None] | None = None) -> Workload:
    """A CSV (with a header row; a UTF-8 byte-order mark is allowed) or JSON-lines trace:
    `timestamp` (seconds) and `adapter` (a name; empty or null = the base model) per request,
    optionally `input_tokens`, `output_tokens` and `duration`. Other columns are ignored. Rows
    are sorted by timestamp (stably). A malformed row is a FormatError naming its line; more than
    MAX_REQUESTS rows is a UsageError. Read `TRACE_CHUNK` rows at a time into columns, so memory
    follows the columns, never the rows; `progress(bytes read, file size)` after each, the
    count never going back and ending at the file size."""
    path = Path(path)
    if not path.exists():
        raise UsageError(f"{path}: no such file")
    if not path.is_file():
        # A device (/dev/zero), a FIFO or a directory: never read, it might not end.
        raise UsageError(f"{path} is not a regular file; a trace is a CSV or JSON-lines file")
    size = path.stat().st_size
    is_csv = path.suffix.lower() == ".csv"
    # A block the block readers leave to the line reader has the file read again from its
    # start: the count waits where it had got to until the line reader passes it.
    tell = progress_teller(progress, size)
    columns = TraceColumns(path, size)
    try:
        for chunk, blank, done in (_plain_csv_chunks if is_csv else _plain_jsonl_chunks)(path):
            columns.add(*chunk, blank=blank, done=done)
            tell(done)
        plain = True
    except _NotPlain:
        plain = False  # quoted cells, bad bytes or a long line: the line reader below names them
    if not plain:
        columns = TraceColumns(path, size)
        # utf-8-sig: a spreadsheet's CSV export starts with a byte-order mark, which would
        # otherwise become part of the first column's name.
        with open(path, encoding="utf-8-sig", newline="") as f:
            lines = BoundedLines(path, f)
            chunks = _csv_chunks(path, lines) if is_csv else _jsonl_chunks(path, lines)
            for chunk in chunks:
                columns.add(*chunk, blank=lines.blank, done=lines.done)
                tell(lines.done)
    # The end: past blank last lines (no chunk of rows), or a byte-order mark the line reader
    # reads but does not count.
    tell(size)
    return columns.workload()


# A chunk of rows: arrival, the adapter names in order of first use, each row's adapter (an
# index of those names, -1 the base model), input and output tokens, duration and rank.
Columns = tuple[np.ndarray, list[str], np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                np.ndarray]


def intern_names(names: list[str]) -> tuple[list[str], np.ndarray]:
    """Per-row adapter names (empty: the base model) as (the names in order of first use, each
    row's index of them, -1 for the base model), as `Columns` carries them."""
    index = {name: k for k, name in enumerate(name for name in dict.fromkeys(names) if name)}
    ids = np.fromiter(map({**index, "": -1}.__getitem__, names), np.int64, len(names))
    return list(index), ids


class TraceColumns:
    """A trace's columns as they are read: NumPy chunks, adapter names interned to ids."""

    def __init__(self, path: Path, size: int = 0) -> None:
        self.path = path
        self.size = size  # the file's bytes, from which the columns are sized
        self.index: dict[str, int] = {}
        self.rows = 0
        # arrival, adapter, input and output tokens, duration: `rows` filled of each. They are
        # sized for the whole file (its bytes over those of the rows read so far), so a trace
        # is read into them in place, with no chunks to join: chunks that were joined left
        # their memory to the allocator (10,000,000 requests: 976 MiB resident for columns of
        # 400 MB). Pages past `rows` are never touched, so they take no memory.
        self.columns = [np.empty(0), np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64),
                        np.empty(0, dtype=np.int64), np.empty(0)]
        # (adapter, rank) of only the rows that give a rank: most traces have none.
        self.ranked: list[tuple[np.ndarray, np.ndarray]] = []

    def add(self, arrival: np.ndarray, names: list[str], adapter: np.ndarray,
            inputs: np.ndarray, outputs: np.ndarray, duration: np.ndarray, rank: np.ndarray,
            blank: int = 0, done: int = 0) -> None:
        """One chunk of rows (`Columns`), `blank` the blank lines read so far: they count
        toward the bound too (a 2 GB file of blank lines took 17 minutes to say it held no
        request); `done` the bytes (or characters) read so far."""
        first, count = self.rows, len(adapter)
        self.rows += count
        if self.rows + blank > MAX_REQUESTS:
            raise UsageError(f"{self.path}: more than {MAX_REQUESTS:,} requests"
                             f"{' and blank lines' if blank else ''}, the most a simulation "
                             "takes; cut the trace")
        index = self.index
        # The chunk's names in their order of first use, so the trace's are too; -1 stays -1.
        to_trace = np.array([index.setdefault(name, len(index)) for name in names] + [-1],
                            dtype=np.int64)
        ids = to_trace[adapter]
        given = (ids >= 0) & (rank > 0)
        if given.any():
            self.ranked.append((ids[given], rank[given]))
        capacity = self.columns[0].size
        if self.rows > capacity:
            # The rows the whole file holds at the bytes per row so far, and some; at least a
            # quarter more than now (twice, without a size), so a file whose rows grow longer
            # is copied a few times, not once a chunk.
            whole = int(self.rows * self.size / done * 1.05) + 1 if done else 0
            more = capacity * 5 // 4 if done else capacity * 2
            capacity = min(MAX_REQUESTS, max(self.rows, whole, more))
            self.columns = [_grown(c, first, capacity) for c in self.columns]
        for column, values in zip(self.columns, (arrival, ids, inputs, outputs, duration),
                                  strict=True):
            column[first:self.rows] = values

    def workload(self) -> Workload:
        if not self.rows:
            raise FormatError(f"{self.path}: no requests")
        columns = [c[:self.rows] for c in self.columns]
        self.columns = []
        if (columns[0][1:] < columns[0][:-1]).any():  # not in time order: sorted, stably
            order = np.argsort(columns[0], kind="stable")
            for c in range(len(columns)):
                columns[c] = columns[c][order]
        arrival, adapter, inputs, outputs, duration = columns
        return Workload(
            adapters=tuple(self.index), adapter=adapter, arrival=arrival, input_tokens=inputs,
            output_tokens=outputs, duration=duration,
            source={"kind": "trace", "path": str(self.path)}, adapter_rank=self._ranks())

    def _ranks(self) -> np.ndarray | None:
        """Each adapter's rank from the `rank` column (None without one): the rows that give
        it must agree."""
        if not self.ranked:
            return None
        adapter, rank = (np.concatenate(c) for c in zip(*self.ranked, strict=True))
        count = len(self.index)
        high, low = np.zeros(count, dtype=np.int64), np.full(count, MAX_TOKENS, dtype=np.int64)
        np.maximum.at(high, adapter, rank)
        np.minimum.at(low, adapter, rank)
        bad = np.flatnonzero((high > 0) & (low != high))
        if bad.size:
            a = int(bad[0])
            raise FormatError(f"{self.path}: adapter {list(self.index)[a]!r} is given rank "
                              f"{low[a]} and rank {high[a]}; an adapter has one rank")
        return high


def _grown(column: np.ndarray, rows: int, capacity: int) -> np.ndarray:
    """`column`'s first `rows` values in a column of `capacity`."""
    out = np.empty(capacity, dtype=column.dtype)
    out[:rows] = column[:rows]
    return out


def progress_teller(progress: Callable[[int, int], None] | None,
                    size: int) -> Callable[[int], None]:
    """`tell(done)`: `progress(done, size)` for a reading that has got `done` bytes into a file
    of `size`, told only where it passes what was told before, and at most `size`: the count
    never goes back and ends at the size once `tell(size)` closes the reading. Nothing without
    `progress`."""
    told = 0

    def tell(done: int) -> None:
        nonlocal told
        if progress is not None and min(done, size) > told:
            told = min(done, size)
            progress(told, size)

    return tell


class BoundedLines:
    """The lines of text file `f`, each read with a bound: a line past MAX_LINE_CHARS is a
    FormatError naming it, before more of it is read. Counts the bytes read (`done`, as UTF-8:
    a progress count of the file's size) and the blank lines."""

    def __init__(self, path: Path, f: Any) -> None:
        self.path, self.f, self.done = path, f, 0
        self.blank = 0  # lines of only white space

    def __iter__(self) -> Iterator[str]:
        line_no = 0
        while line := self._readline(line_no):
            line_no += 1
            if len(line) > MAX_LINE_CHARS:
                raise FormatError(f"{self.path}:{line_no}: a line longer than "
                                  f"{MAX_LINE_CHARS} characters; not a trace")
            self.done += len(line) if line.isascii() else len(line.encode("utf-8"))
            if line.isspace():
                self.blank += 1
            yield line

    def _readline(self, read: int) -> str:
        try:
            line: str = self.f.readline(MAX_LINE_CHARS + 1)
        except UnicodeDecodeError:
            # The text layer decodes a block ahead of the line it returns: find the line.
            raise FormatError(f"{self.path}:{first_undecodable_line(self.path, read)}: not "
                              "UTF-8 text; a trace is UTF-8") from None
        return line


def first_undecodable_line(path: Path, after: int) -> int:
    """The number of the first line past line `after` of `path` that is not UTF-8 (a line ends
    at a newline byte, which no multi-byte character contains)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            if number <= after:
                continue
            try:
                decoder.decode(line)
            except UnicodeDecodeError:
                return number
    return after + 1


class _NotPlain(Exception):
    """A trace file the block readers leave to the line reader."""


def _plain_blocks(path: Path) -> Iterator[tuple[bytes, str, int]]:
    """(the bytes, their text, bytes read so far) per block of TRACE_CHUNK lines of a plain
    text file (the last block may be shorter; none for an empty file): UTF-8, no line past
    MAX_LINE_CHARS, line ends `\n` or `\r\n`, which is what the line reader (BoundedLines)
    splits it into. Anything else raises _NotPlain before the block is yielded."""
    done = 0
    with open(path, "rb") as f:
        rest, more = b"", True
        while True:
            while more and rest.count(b"\n") < TRACE_CHUNK:
                if len(rest) - rest.rfind(b"\n") > MAX_LINE_CHARS + 1:
                    raise _NotPlain  # a line too long: read no more of it here
                data = f.read(max(TRACE_CHUNK * 64, MAX_LINE_CHARS))
                more = bool(data)
                rest += data
            cut = (int(np.flatnonzero(np.frombuffer(rest, np.uint8) == 10)[TRACE_CHUNK - 1]) + 1
                   if more else len(rest))
            block, rest = rest[:cut], rest[cut:]
            if not block:
                return
            done += len(block)
            # A lone carriage return ends a line for the line reader (universal newlines).
            if b"\r" in block and b"\r" in block.replace(b"\r\n", b"\n"):
                raise _NotPlain
            ends = np.flatnonzero(np.frombuffer(block, dtype=np.uint8) == 10)
            longest = int(np.diff(ends, prepend=-1).max()) if ends.size else 0
            if max(longest, len(block) - 1 - (int(ends[-1]) if ends.size else -1)) > (
                    MAX_LINE_CHARS):
                raise _NotPlain
            try:
                text = block.decode("utf-8")
            except UnicodeDecodeError:
                raise _NotPlain from None
            yield block, text, done


def _plain_csv_chunks(path: Path) -> Iterator[tuple[Columns, int, int]]:
    """(columns, blank lines so far, bytes read) per block of TRACE_CHUNK lines of a plain CSV
    file (`_plain_blocks`) with no quote character. Such a file is what csv.reader reads as
    each line split at its commas, so a block is read with no reader per line: by one compiled
    scan (`trace_scan`) where it takes every line, else split at C speed; rows are numbered by
    their lines, and a bad cell is named as the line reader names it (`_csv_columns`).
    Anything else raises _NotPlain before a row of it is used, and the caller reads the file
    again line by line."""
    from metrale_cli.sim import trace_scan

    blank = 0
    first = 1  # the line number of the block's first line
    header: list[str] | None = None
    for block, text, done in _plain_blocks(path):
        if b'"' in block:
            raise _NotPlain
        if header is None:
            head, _, block = block.partition(b"\n")
            text = text.partition("\n")[2]
            header = head.decode("utf-8").removeprefix("\ufeff").removesuffix("\r").split(",")
            missing = [c for c in ("timestamp", "adapter") if c not in header]
            if missing:
                raise _NotPlain  # the line reader names what the header lacks
            first = 2
        width = len(header)
        scan = trace_scan.Scan(block, header if len(set(header)) == width else [], json=False)
        if scan.taken.size and scan.taken.all() and np.isfinite(scan.arrival).all() and (
                not np.isinf(scan.duration).any()):
            yield (scan.arrival, scan.names, scan.adapter, scan.inputs, scan.outputs,
                   scan.duration, scan.rank), blank, done
            first += scan.taken.size
            continue
        raw = np.frombuffer(block, dtype=np.uint8)
        ends = np.flatnonzero(raw == 10)
        lines = text.replace("\r\n", "\n").split("\n")
        if lines[-1] == "":
            lines.pop()  # the block ends at a line end
        # Commas per line, from the bytes: where every line has the header's count (no
        # blank line), the columns are slices of one split of the whole block. A line's
        # commas are those before its end: a last line with no line end ends past the block.
        bounds = ends if block.endswith(b"\n") else np.append(ends, len(block))
        commas = np.diff(np.searchsorted(np.flatnonzero(raw == 44), bounds),
                         prepend=0)[len(bounds) - len(lines):]
        fast = None
        if lines and len(set(header)) == width and bool((commas == width - 1).all()):
            flat = ",".join(lines).split(",")
            fast = _cell_columns(header, lambda i, f=flat, w=width: f[i::w], len(lines))
        else:
            blank += sum(1 for line in lines if not line or line.isspace())
        if fast is None and lines:
            rows = [line.split(",") if line else [] for line in lines]
            fast = _csv_columns(path, header, rows, range(first, first + len(lines)))
        if fast is not None:
            yield fast, blank, done
        first += len(lines)
    if header is None:
        raise _NotPlain  # an empty file: the line reader says what it lacks


def _csv_chunks(path: Path, lines: BoundedLines) -> Iterator[Columns]:
    reader = csv.reader(lines)
    try:
        header = next(reader, [])
    except csv.Error as exc:
        raise FormatError(f"{path}:{reader.line_num}: not CSV ({exc})") from None
    missing = [c for c in ("timestamp", "adapter") if c not in header]
    if missing:
        found = ", ".join(repr(h) for h in header) if header else "none"
        raise FormatError(f"{path}:1: the header has no {' or '.join(missing)} column "
                          f"(columns found: {found})")
    done = 1  # rows read, the header's included
    while True:
        first = reader.line_num + 1
        try:
            rows = list(itertools.islice(reader, TRACE_CHUNK))  # at C speed, no line numbers
        except csv.Error as exc:
            raise FormatError(f"{path}:{reader.line_num}: not CSV ({exc})") from None
        if not rows:
            return
        # Row k is on line first + k unless a quoted cell spans lines; then they are counted
        # again, row by row, only if a row needs naming.
        lines = (range(first, first + len(rows)) if reader.line_num - first + 1 == len(rows)
                 else None)
        yield _csv_columns(path, header, rows, lines or (done, len(rows)))
        done += len(rows)


def _csv_columns(path: Path, header: list[str], rows: list[list[str]],
                 lines: range | tuple[int, int]) -> Columns:
    """CSV rows as columns: column by column (several times faster) when every cell is
    ordinary, else row by row, which names the first bad line. `lines` are the rows' line
    numbers, or (rows before them, how many) when quoted cells span lines and the file must be
    read again to number them."""
    fast = _csv_columns_fast(header, rows)
    if fast is not None:
        return fast
    numbers = lines if isinstance(lines, range) else _csv_line_numbers(path, *lines)
    parsed = []
    for line, row in zip(numbers, rows, strict=True):
        if not row:
            continue  # a blank line is no request (as csv.DictReader skips it)
        if len(row) > len(header):
            raise FormatError(f"{path}:{line}: more cells than the header has")
        # Missing cells are None and a repeated column keeps its last cell, as in DictReader.
        cells = dict(zip(header, row + [None] * (len(header) - len(row)), strict=True))
        parsed.append(_parse_row(path, line, cells))
    return _parsed_columns(parsed)


def _csv_line_numbers(path: Path, skip: int, count: int) -> list[int]:
    """The lines rows `[skip, skip + count)` of a CSV file start on (the header is row 0): the
    file read again row by row, only for a chunk that has a bad row and quoted line breaks."""
    with open(path, encoding="utf-8-sig", newline="") as f:
        reader = csv.reader(BoundedLines(path, f))
        starts, last = [], 0
        for k, _ in enumerate(reader):
            if k >= skip:
                starts.append(last + 1)
                if len(starts) == count:
                    break
            last = reader.line_num
    return starts


def _parsed_columns(parsed: list[tuple[float, str, int, int, float, int]]) -> Columns:
    return (np.array([r[0] for r in parsed], dtype=np.float64),
            *intern_names([r[1] for r in parsed]),
            np.array([r[2] for r in parsed], dtype=np.int64),
            np.array([r[3] for r in parsed], dtype=np.int64),
            np.array([r[4] for r in parsed], dtype=np.float64),
            np.array([r[5] for r in parsed], dtype=np.int64))


def _csv_columns_fast(header: list[str], rows: list[list[str]]) -> Columns | None:
    """Well-formed CSV rows read column by column; None when any cell is out of the ordinary,
    so that the row-by-row reader names it."""
    if len(set(header)) != len(header) or any(len(r) != len(header) for r in rows):
        return None
    return _cell_columns(header, lambda i: [r[i] for r in rows], len(rows))


def _cell_columns(header: list[str], column: Callable[[int], list[str]],
                  n: int) -> Columns | None:
    """The columns of `n` rows whose cells in column i are `column(i)` (as read, unstripped),
    under `header` (no name twice); None when a cell is out of the ordinary."""
    where = {name: i for i, name in enumerate(header)}

    def numbers(key: str, empty: str | None) -> np.ndarray | None:
        if key not in where:
            return np.full(n, np.nan if empty == "nan" else 0.0)
        cells = column(where[key])
        try:  # float() reads surrounding white space as its strip would
            values = np.array(cells, dtype=np.float64)
            given = None
        except ValueError:  # an empty cell, or not a number
            cells = [c.strip() for c in cells]
            if empty is None and not all(cells):
                return None
            try:
                values = np.array([c or empty for c in cells], dtype=np.float64)
            except ValueError:
                return None
            given = np.array([bool(c) for c in cells], dtype=bool)  # bool even with no rows
        good = np.isfinite(values) & (values >= 0)
        return values if bool((good if given is None else good | ~given).all()) else None

    arrival = numbers("timestamp", None)
    inputs, outputs = numbers("input_tokens", "0"), numbers("output_tokens", "0")
    duration, rank = numbers("duration", "nan"), numbers(RANK_COLUMN, "0")
    if arrival is None or inputs is None or outputs is None or duration is None or rank is None:
        return None
    if any((t != np.floor(t)).any() or (t >= MAX_TOKENS).any() for t in (inputs, outputs, rank)):
        return None
    return (arrival, *intern_names([c.strip() for c in column(where["adapter"])]),
            inputs.astype(np.int64), outputs.astype(np.int64), duration, rank.astype(np.int64))


def _jsonl_chunks(path: Path, lines: BoundedLines) -> Iterator[Columns]:
    parsed = []
    for line_no, line in enumerate(lines, start=1):
        row = _jsonl_row(path, line_no, line)
        if row is not None:
            parsed.append(row)
        if line_no % TRACE_CHUNK == 0:  # by lines: blank ones count toward the bound too
            yield _parsed_columns(parsed)
            parsed = []
    if parsed:
        yield _parsed_columns(parsed)


def _jsonl_row(path: Path, line_no: int,
               line: str) -> tuple[float, str, int, int, float, int] | None:
    """The request on JSON-lines line `line_no` (its text with its line end), None for a
    blank line."""
    if not line.strip():
        return None
    row = load_json(f"{path}:{line_no}", line, "JSON request")
    if not isinstance(row, dict):
        raise FormatError(f"{path}:{line_no}: a request must be a JSON object")
    return _parse_row(path, line_no, row)


def _block_keys(path: Path, text: str, first: int) -> list[str] | None:
    """The keys, in order, of the block's first request line, where the scan can take lines
    of that shape (`trace_scan`): they name the timestamp and the adapter, each written plain
    by `json`; None where they do not, or where the line reader reads that line with an error
    (it names the error)."""
    for k, line in enumerate(text.split("\n", 64)):
        if line.strip():
            try:
                row = load_json(f"{path}:{first + k}", line, "JSON request")
            except FormatError:
                return None
            if not isinstance(row, dict) or "timestamp" not in row or "adapter" not in row:
                return None
            if any(json.dumps(key, ensure_ascii=False) != f'"{key}"' for key in row):
                return None  # a key JSON writes with escapes: not its text in the line
            return list(row)
    return None


def _plain_jsonl_chunks(path: Path) -> Iterator[tuple[Columns, int, int]]:
    """(columns, blank lines so far, bytes read) per block of TRACE_CHUNK lines of a plain
    JSON-lines file (`_plain_blocks`): the lines of the shape of the block's first request
    (`_block_keys`) are read by one compiled scan of the block (`trace_scan`); every other
    line, and a line whose values are out of bounds, is read as the line reader reads it
    (`_jsonl_row`), in line order, so a bad line is named with the same error. A block of only
    blank lines counts toward the bound as the line reader's chunks do (one of TRACE_CHUNK
    lines, not the file's last)."""
    blank = 0
    first = 1  # the line number of the block's first line
    for block, text, done in _plain_blocks(path):
        if first == 1 and text.startswith("\ufeff"):  # as the line reader's utf-8-sig
            block, text = block[3:], text[1:]
        columns, lines, blanks = _jsonl_columns(path, block, text, first)
        blank += blanks
        if lines > blanks or lines == TRACE_CHUNK:
            yield columns, blank, done
        first += lines


def _jsonl_columns(path: Path, block: bytes, text: str, first: int) -> tuple[Columns, int, int]:
    """(columns, lines, blank lines) of the JSON-lines block `block` (`text` decoded), its
    first line on line `first`: the lines the scan takes by it, the others by `_jsonl_row`."""
    from metrale_cli.sim import trace_scan

    scan = trace_scan.Scan(block, _block_keys(path, text, first) or [], json=True)
    arrival, duration, adapter = scan.arrival, scan.duration, scan.adapter
    inputs, outputs, rank = scan.inputs, scan.outputs, scan.rank
    n = scan.taken.size
    # Past float64, as `json` reads it too: inf, refused by the line reader.
    rest = np.flatnonzero(~(scan.taken & ~np.isinf(arrival) & ~np.isinf(duration)))
    names = scan.names
    blank = np.zeros(n, dtype=bool)
    if rest.size:
        lines = text.split("\n")  # past a last line end, one more empty string
        # The names in order of first use: the scan's, each at its first line, and those of
        # the lines read by `json`, at theirs.
        uses = list(zip(scan.first_line.tolist(), names, strict=True))
        for k in rest.tolist():
            row = _jsonl_row(path, first + k, lines[k] + ("\n" if k < len(lines) - 1 else ""))
            if row is None:
                blank[k] = True
                continue
            arrival[k], name, inputs[k], outputs[k], duration[k], rank[k] = row
            adapter[k] = len(uses)
            uses.append((k, name))
        names = intern_names([name for _, name in sorted(uses)])[0]
        where = {name: k for k, name in enumerate(names)}
        where[""] = -1
        adapter = np.array([where[name] for _, name in uses] + [-1], dtype=np.int64)[adapter]
    if blank.any():
        keep = ~blank
        arrival, adapter, inputs, outputs, duration, rank = (
            c[keep] for c in (arrival, adapter, inputs, outputs, duration, rank))
    return (arrival, names, adapter, inputs, outputs, duration, rank), n, int(blank.sum())


def _parse_row(path: Path, line: int,
               row: dict[str, Any]) -> tuple[float, str, int, int, float, int]:
    where = f"{path}:{line}"

    def number(key: str, required: bool = False) -> float | None:
        value = row.get(key)
        if value is None or value == "":
            if required:
                raise FormatError(f"{where}: no {key}")
            return None
        if isinstance(value, bool):
            raise FormatError(f"{where}: {key} {value!r} is not a number")
        try:
            x = float(value)
        except (TypeError, ValueError):
            raise FormatError(f"{where}: {key} {value!r} is not a number") from None
        except OverflowError:  # an integer past float64 (JSON reads up to 4,300 digits)
            x = math.inf
        if not math.isfinite(x) or x < 0:
            raise FormatError(f"{where}: {key} {value!r} must be a finite number >= 0")
        return x

    def tokens(key: str) -> int:
        x = number(key)
        if x is None:
            return 0
        if x != int(x):
            raise FormatError(f"{where}: {key} {row[key]!r} is not a whole number")
        if x >= MAX_TOKENS:
            raise FormatError(f"{where}: {key} {row[key]!r} is not below 2**53")
        return int(x)

    timestamp = number("timestamp", required=True)
    assert timestamp is not None  # required above
    if "adapter" not in row:
        raise FormatError(f"{where}: no adapter (empty means the base model)")
    name = row["adapter"]
    if name is None:
        name = ""
    if not isinstance(name, str):
        raise FormatError(f"{where}: adapter {name!r} is not a name")
    duration = number("duration")
    return (timestamp, name.strip(), tokens("input_tokens"), tokens("output_tokens"),
            math.nan if duration is None else duration, tokens(RANK_COLUMN))


# -- generators ---------------------------------------------------------------------------------


@checked_fields("GeneratorSpec")
@dataclass(frozen=True)
class GeneratorSpec:
    """A seeded workload: `kind` picks the adapter of each request over `adapters` adapters;
    arrivals are Gamma inter-arrival times with coefficient of variation `cv` at `rate` requests
    per second (cv = 1 is Poisson); input and output lengths are uniform in `[lo, hi)` (S-LoRA's
    `randint`), or exactly `lo` when `lo == hi`."""

    kind: str
    requests: int
    adapters: int = 100
    rate: float = 10.0
    cv: float = 1.0
    seed: int = 0
    zipf_s: float = 1.5
    alpha: float = 1.0
    input_range: tuple[int, int] = (8, 512)
    output_range: tuple[int, int] = (8, 512)
    ranks: tuple[int, ...] = ()  # adapter i has rank ranks[i % len(ranks)]; () = unknown

    def check(self) -> None:
        if self.kind not in GENERATORS:
            raise UsageError(f"--workload must be one of {', '.join(GENERATORS)}, "
                             f"got {self.kind!r}{did_you_mean(self.kind, GENERATORS)}")
        for name, value in (("--requests", self.requests), ("--adapters", self.adapters),
                            ("--rate", self.rate), ("--cv", self.cv), ("--zipf-s", self.zipf_s),
                            ("--alpha", self.alpha)):
            if not (value > 0 and math.isfinite(value)):
                raise UsageError(f"{name} must be positive and finite, got {value}")
        if self.cv * self.cv < sys.float_info.min:  # the gamma's shape is 1 / cv**2
            raise UsageError(f"--cv {self.cv:g} is too small: its square underflows floating "
                             "point")
        if any(r <= 0 for r in self.ranks):
            raise UsageError(f"--ranks must be positive, got {','.join(map(str, self.ranks))}")
        if any(r >= MAX_TOKENS for r in self.ranks):  # as a trace's rank column
            raise UsageError(f"--ranks must be below 2**53, got {max(self.ranks):,}")
        for name, value in (("--requests", self.requests), ("--adapters", self.adapters)):
            if value > MAX_REQUESTS:  # refused before a column is allocated
                raise UsageError(f"{name} {value:,} is more than a simulation takes "
                                 f"({MAX_REQUESTS:,})")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise UsageError(f"--seed must be non-negative, an integer, got {self.seed!r}")
        for name, (lo, hi) in (("--input-tokens", self.input_range),
                               ("--output-tokens", self.output_range)):
            if lo < 0 or hi < lo:
                raise UsageError(f"{name}: need 0 <= LO <= HI, got {lo},{hi}")

    def record(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "seed": self.seed, "rate": self.rate,
                               "cv": self.cv, "input_range": list(self.input_range),
                               "output_range": list(self.output_range)}
        if self.ranks:
            out["ranks"] = list(self.ranks)
        if self.kind != "distinct":
            out["adapters"] = self.adapters
        if self.kind == "zipf":
            out["zipf_s"] = self.zipf_s
        if self.kind == "slora":
            out["alpha"] = self.alpha
        return out


def generate(spec: GeneratorSpec) -> Workload:
    spec.check()
    n, count = spec.requests, spec.adapters
    shape, scale = 1.0 / (spec.cv * spec.cv), spec.cv * spec.cv / spec.rate
    if spec.kind == "slora":
        # S-LoRA benchmarks/trace.py, draw for draw: np.random.seed(seed), then power, randint,
        # randint, gamma, in this order, on the legacy global stream.
        rs = np.random.RandomState(spec.seed)
        adapter = (rs.power(spec.alpha, n) * count).astype(np.int64)
        np.minimum(adapter, count - 1, out=adapter)  # a draw of exactly 1.0 (S-LoRA would fail)
        inputs = _lengths(rs.randint, spec.input_range, n)
        outputs = _lengths(rs.randint, spec.output_range, n)
        intervals = rs.gamma(shape, scale, n)
    else:
        rng = np.random.default_rng(spec.seed)
        if spec.kind == "zipf":
            with np.errstate(over="ignore"):  # a large --zipf-s: every weight but the first 0
                weights = 1.0 / np.arange(1, count + 1, dtype=np.float64) ** spec.zipf_s
            adapter = rng.choice(count, size=n, p=weights / weights.sum())
        elif spec.kind == "uniform":
            adapter = rng.integers(0, count, size=n)
        elif spec.kind == "distinct":
            adapter, count = np.arange(n), n
        else:
            adapter = np.zeros(n, dtype=np.int64)
        inputs = _lengths(rng.integers, spec.input_range, n)
        outputs = _lengths(rng.integers, spec.output_range, n)
        intervals = rng.gamma(shape, scale, n)
    arrival = np.cumsum(intervals)
    if not np.isfinite(arrival).all():
        # Gamma(1 / cv**2, cv**2 / rate) past float64's range: NaN or infinite times.
        raise UsageError(f"--rate {spec.rate:g} with --cv {spec.cv:g} gives arrival times "
                         "beyond floating point; choose a smaller --cv or a larger --rate")
    width = len(str(count - 1))
    return Workload(
        adapters=tuple(f"lora-{i:0{width}d}" for i in range(count)),
        adapter=adapter.astype(np.int64), arrival=arrival,
        input_tokens=inputs, output_tokens=outputs,
        duration=np.full(n, np.nan), source=spec.record(),
        adapter_rank=(np.resize(np.array(spec.ranks, dtype=np.int64), count) if spec.ranks
                      else None),
    )


def _lengths(draw: Any, bounds: tuple[int, int], n: int) -> np.ndarray:
    lo, hi = bounds
    if lo == hi:
        return np.full(n, lo, dtype=np.int64)
    return np.asarray(draw(lo, hi, n), dtype=np.int64)

