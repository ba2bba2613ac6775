"""Request workloads for the slot-cache simulator: a trace read from CSV or JSONL, or one of the
seeded generators of the LoRA-serving literature, held as NumPy columns (a million requests are
a few tens of MiB).

A request asks for one adapter by name (or for the base model, which takes no slot) at a time in
seconds, and holds its slot for its `duration`, or for its tokens at a prefill and a decode rate.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from metrale_cli.errors import FormatError, UsageError
from metrale_cli.files.atomic import atomic_write

GENERATORS = ("zipf", "uniform", "distinct", "identical", "slora")
TRACE_COLUMNS = ("timestamp", "adapter", "input_tokens", "output_tokens", "duration")
# A request line is a few dozen characters; one this long is not a trace (a binary file, a
# file with no line breaks), refused before it is held in memory.
MAX_LINE_CHARS = 1 << 16
# Token counts are read as float64, which holds every whole number below this exactly.
MAX_TOKENS = 2**53


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

    @property
    def requests(self) -> int:
        return int(self.adapter.size)

    def hold_seconds(self, prefill_tok_s: float, decode_tok_s: float) -> np.ndarray:
        """[N] float64: how long each request holds its slot, from admission to completion."""
        if not (0 < prefill_tok_s < math.inf and 0 < decode_tok_s < math.inf):
            raise UsageError("--prefill-tok-s and --decode-tok-s must be positive and finite")
        from_tokens = self.input_tokens / prefill_tok_s + self.output_tokens / decode_tok_s
        return np.where(np.isnan(self.duration), from_tokens, self.duration)

    def next_use(self) -> np.ndarray:
        """[N] int64: the index of the next request for the same adapter, or -1 when none (and
        for base-model requests). Belady's rule reads it."""
        n = self.requests
        order = np.lexsort((np.arange(n), self.adapter))  # by adapter, then request order
        nxt_sorted = np.full(n, -1, dtype=np.int64)
        same = self.adapter[order[1:]] == self.adapter[order[:-1]]
        nxt_sorted[:-1] = np.where(same, order[1:], -1)
        nxt = np.empty(n, dtype=np.int64)
        nxt[order] = nxt_sorted
        nxt[self.adapter < 0] = -1
        return nxt

    def counts(self) -> np.ndarray:
        """[len(adapters)] int64: requests per adapter."""
        used = self.adapter[self.adapter >= 0]
        return np.bincount(used, minlength=len(self.adapters))

    def most_requested(self, k: int) -> list[str]:
        """The `k` most requested adapters (ties: the one named first), as at pool startup."""
        counts = self.counts()
        order = np.lexsort((np.arange(counts.size), -counts))
        return [self.adapters[i] for i in order[:k] if counts[i] > 0]

    def record(self) -> dict[str, Any]:
        used = self.adapter[self.adapter >= 0]
        return {
            **self.source,
            "requests": self.requests,
            "adapter_requests": int(used.size),
            "distinct_adapters": int(np.unique(used).size),
            "span_s": float(self.arrival[-1] - self.arrival[0]) if self.requests else 0.0,
        }

    def save(self, path: Path, force: bool) -> None:
        """Write the requests as a trace that `--trace` reads back exactly: CSV for `.csv`,
        JSON lines otherwise; atomically, never over a file without `force`."""
        has_duration = bool((~np.isnan(self.duration)).any())
        columns = list(TRACE_COLUMNS if has_duration else TRACE_COLUMNS[:-1])
        rows = zip(self.arrival.tolist(), self.adapter.tolist(), self.input_tokens.tolist(),
                   self.output_tokens.tolist(), self.duration.tolist(), strict=True)
        names = self.adapters

        def cells(row: tuple[float, int, int, int, float]) -> list[Any]:
            t, a, i, o, d = row
            out: list[Any] = [t, names[a] if a >= 0 else "", i, o]
            if has_duration:
                out.append(None if math.isnan(d) else d)
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


def read_trace(path: Path) -> Workload:
    """A CSV (with a header row) or JSON-lines trace: `timestamp` (seconds) and `adapter` (a
    name; empty or null = the base model) per request, optionally `input_tokens`,
    `output_tokens` and `duration`. Other columns are ignored. Rows are sorted by timestamp
    (stably). A malformed row is a FormatError naming its line."""
    path = Path(path)
    if not path.exists():
        raise UsageError(f"{path}: no such file")
    if not path.is_file():
        # A device (/dev/zero), a FIFO or a directory: never read, it might not end.
        raise UsageError(f"{path} is not a regular file; a trace is a CSV or JSON-lines file")
    columns = _csv_columns_fast(path) if path.suffix.lower() == ".csv" else None
    if columns is None:  # JSON lines, or a CSV row the fast path cannot vouch for
        with open(path, encoding="utf-8", newline="") as f:
            lines = _bounded_lines(path, f)
            rows = (_csv_rows(path, lines) if path.suffix.lower() == ".csv"
                    else _jsonl_rows(path, lines))
            parsed = [_parse_row(path, line, row) for line, row in rows]
        columns = (np.array([r[0] for r in parsed], dtype=np.float64), [r[1] for r in parsed],
                   np.array([r[2] for r in parsed], dtype=np.int64),
                   np.array([r[3] for r in parsed], dtype=np.int64),
                   np.array([r[4] for r in parsed], dtype=np.float64))
    arrival, names, inputs, outputs, duration = columns
    if not names:
        raise FormatError(f"{path}: no requests")
    index: dict[str, int] = {}
    adapter = np.array([index.setdefault(n, len(index)) if n else -1 for n in names],
                       dtype=np.int64)
    order = np.argsort(arrival, kind="stable")
    return Workload(
        adapters=tuple(index), adapter=adapter[order], arrival=arrival[order],
        input_tokens=inputs[order], output_tokens=outputs[order], duration=duration[order],
        source={"kind": "trace", "path": str(path)},
    )


Columns = tuple[np.ndarray, list[str], np.ndarray, np.ndarray, np.ndarray]


def _csv_columns_fast(path: Path) -> Columns | None:
    """A well-formed CSV trace read column by column (several times faster than row by row);
    None when any cell is out of the ordinary, so that the row-by-row reader names it."""
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.reader(_bounded_lines(path, f))
        try:
            header = next(reader, [])
            rows = list(reader)
        except csv.Error:
            return None  # the row-by-row reader names the line
    where = {name: i for i, name in enumerate(header)}
    if "timestamp" not in where or "adapter" not in where or len(where) != len(header):
        return None
    if any(len(r) != len(header) for r in rows):
        return None

    def numbers(key: str, empty: str | None) -> np.ndarray | None:
        if key not in where:
            return np.full(len(rows), np.nan if empty == "nan" else 0.0)
        i = where[key]
        cells = [r[i].strip() for r in rows]
        if empty is None and not all(cells):
            return None
        try:
            values = np.array([c or empty for c in cells], dtype=np.float64)
        except ValueError:
            return None
        given = np.array([bool(c) for c in cells], dtype=bool)  # bool even with no rows
        good = np.isfinite(values) & (values >= 0)
        return values if bool((good | ~given).all()) else None

    arrival = numbers("timestamp", None)
    inputs, outputs = numbers("input_tokens", "0"), numbers("output_tokens", "0")
    duration = numbers("duration", "nan")
    if arrival is None or inputs is None or outputs is None or duration is None:
        return None
    if any((t != np.floor(t)).any() or (t >= MAX_TOKENS).any() for t in (inputs, outputs)):
        return None
    i = where["adapter"]
    return (arrival, [r[i].strip() for r in rows], inputs.astype(np.int64),
            outputs.astype(np.int64), duration)


def _bounded_lines(path: Path, f: Any) -> Iterator[str]:
    """The lines of text file `f`, each read with a bound: a line past MAX_LINE_CHARS is a
    FormatError naming it, before more of it is read."""
    line_no = 0
    while line := f.readline(MAX_LINE_CHARS + 1):
        line_no += 1
        if len(line) > MAX_LINE_CHARS:
            raise FormatError(f"{path}:{line_no}: a line longer than {MAX_LINE_CHARS} "
                              "characters; not a trace")
        yield line


def _csv_rows(path: Path, f: Any) -> list[tuple[int, dict[str, Any]]]:
    reader = csv.DictReader(f)
    header = reader.fieldnames or []
    missing = [c for c in ("timestamp", "adapter") if c not in header]
    if missing:
        raise FormatError(f"{path}:1: the header has no {' or '.join(missing)} column "
                          f"(columns: {', '.join(TRACE_COLUMNS)})")
    rows = []
    try:
        for row in reader:
            if None in row:
                raise FormatError(f"{path}:{reader.line_num}: more cells than the header has")
            rows.append((reader.line_num, row))
    except csv.Error as exc:
        raise FormatError(f"{path}:{reader.line_num}: not CSV ({exc})") from None
    return rows


def _jsonl_rows(path: Path, f: Any) -> list[tuple[int, dict[str, Any]]]:
    rows = []
    for line_no, line in enumerate(f, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise FormatError(f"{path}:{line_no}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise FormatError(f"{path}:{line_no}: a request must be a JSON object")
        rows.append((line_no, row))
    return rows


def _parse_row(path: Path, line: int, row: dict[str, Any]) -> tuple[float, str, int, int, float]:
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
            math.nan if duration is None else duration)


# -- generators ---------------------------------------------------------------------------------


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

    def check(self) -> None:
        if self.kind not in GENERATORS:
            raise UsageError(f"--workload must be one of {', '.join(GENERATORS)}, "
                             f"got {self.kind!r}")
        for name, value in (("--requests", self.requests), ("--adapters", self.adapters),
                            ("--rate", self.rate), ("--cv", self.cv), ("--zipf-s", self.zipf_s),
                            ("--alpha", self.alpha)):
            if not (value > 0 and math.isfinite(value)):
                raise UsageError(f"{name} must be positive and finite, got {value}")
        if self.seed < 0:
            raise UsageError(f"--seed must be non-negative, got {self.seed}")
        for name, (lo, hi) in (("--input-tokens", self.input_range),
                               ("--output-tokens", self.output_range)):
            if lo < 0 or hi < lo:
                raise UsageError(f"{name}: need 0 <= LO <= HI, got {lo},{hi}")

    def record(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "seed": self.seed, "rate": self.rate,
                               "cv": self.cv, "input_range": list(self.input_range),
                               "output_range": list(self.output_range)}
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
    )


def _lengths(draw: Any, bounds: tuple[int, int], n: int) -> np.ndarray:
    lo, hi = bounds
    if lo == hi:
        return np.full(n, lo, dtype=np.int64)
    return np.asarray(draw(lo, hi, n), dtype=np.int64)

