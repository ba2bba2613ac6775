"""Public request traces in their published layouts, read into a `Workload`:

- `azure-llm`: Azure LLM inference 2023 (Splitwise) and 2024 (DynamoLLM),
  `TIMESTAMP,ContextTokens,GeneratedTokens`; TIMESTAMP a wall-clock time (`2023-11-16
  18:15:46.6805900`, 100 ns ticks; 2024 adds `+00:00`). No adapter id.
- `burstgpt`: BurstGPT, `Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type`
  (later releases add `Session ID` and `Elapsed time`); Timestamp in seconds. No adapter id.
- `azure-functions`: Azure Functions invocations 2021, `app,func,end_timestamp,duration`, in
  seconds; a function is the adapter (`app/func`: a func id is unique only within its app), it
  starts at `end_timestamp - duration` and holds its slot for `duration`.

A trace without an adapter id gets one per request from a seeded popularity model (`Assign`).
Arrivals are made relative to the first request.
"""

from __future__ import annotations

import csv
import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from metrale_cli.errors import FormatError, UsageError, did_you_mean
from metrale_cli.sim.workload import (
    MAX_TOKENS,
    TRACE_CHUNK,
    BoundedLines,
    Columns,
    TraceColumns,
    Workload,
    intern_names,
    progress_teller,
)

FORMATS = ("metrale", "azure-llm", "burstgpt", "azure-functions")
# Per format: (the columns it must have, whether it names an adapter).
LAYOUTS: dict[str, tuple[tuple[str, ...], bool]] = {
    "azure-llm": (("TIMESTAMP", "ContextTokens", "GeneratedTokens"), False),
    "burstgpt": (("Timestamp", "Request tokens", "Response tokens"), False),
    "azure-functions": (("app", "func", "end_timestamp", "duration"), True),
}
ASSIGN_KINDS = ("zipf", "uniform")


@dataclass(frozen=True)
class Assign:
    """Adapters for a trace that names none: request i gets adapter k of `adapters` with
    probability proportional to 1/(k+1)^s (`zipf`, s = `zipf_s`) or equally (`uniform`),
    drawn with NumPy's default generator seeded by `seed`."""

    kind: str
    adapters: int
    seed: int = 0
    zipf_s: float = 1.5

    def __post_init__(self) -> None:
        if self.kind not in ASSIGN_KINDS:
            raise UsageError(f"--assign: {self.kind!r}{did_you_mean(self.kind, ASSIGN_KINDS)} is "
                             f"not one of {', '.join(ASSIGN_KINDS)}")
        if self.adapters <= 0:
            raise UsageError(f"--adapters must be positive, got {self.adapters}")
        if not (self.zipf_s > 0 and math.isfinite(self.zipf_s)):
            raise UsageError(f"--assign zipf:S needs S positive and finite, got {self.zipf_s}")

    def draw(self, n: int) -> np.ndarray:
        rng = np.random.default_rng(self.seed)
        if self.kind == "uniform":
            return rng.integers(0, self.adapters, size=n)
        weights = 1.0 / np.arange(1, self.adapters + 1, dtype=np.float64) ** self.zipf_s
        return rng.choice(self.adapters, size=n, p=weights / weights.sum())

    def record(self) -> dict[str, object]:
        return {"kind": self.kind, "adapters": self.adapters, "seed": self.seed,
                **({"zipf_s": self.zipf_s} if self.kind == "zipf" else {})}


def read_public_trace(path: Path, fmt: str, assign: Assign | None = None,
                      progress: Callable[[int, int], None] | None = None) -> Workload:
    """A trace in format `fmt` (one of LAYOUTS), `assign` attaching adapters where it names
    none (required there, refused where it names them)."""
    if fmt not in LAYOUTS:
        raise UsageError(f"--trace-format must be one of {', '.join(FORMATS)}, got {fmt!r}"
                         f"{did_you_mean(fmt, FORMATS)}")
    path = Path(path)
    if not path.exists():
        raise UsageError(f"{path}: no such file")
    if not path.is_file():
        raise UsageError(f"{path} is not a regular file; a trace is a CSV file")
    _, named = LAYOUTS[fmt]
    if not named and assign is None:
        raise UsageError(f"the {fmt} format names no adapter: give --assign zipf:1.5 (or "
                         "uniform) to attach one per request")
    if named and assign is not None:
        raise UsageError(f"the {fmt} format names its adapters; --assign is for formats that "
                         "do not")
    size = path.stat().st_size
    columns = TraceColumns(path, size)
    tell = progress_teller(progress, size)
    with open(path, encoding="utf-8-sig", newline="") as f:
        lines = BoundedLines(path, f)
        for chunk in _chunks(path, fmt, lines):
            columns.add(*chunk, blank=lines.blank, done=lines.done)
            tell(lines.done)
    tell(size)  # a byte-order mark is read but not counted
    workload = columns.workload()
    workload = _from_zero(workload)
    if assign is not None:
        ids = assign.draw(workload.requests)
        width = len(str(assign.adapters - 1))
        workload = Workload(
            adapters=tuple(f"lora-{i:0{width}d}" for i in range(assign.adapters)),
            adapter=ids.astype(np.int64), arrival=workload.arrival,
            input_tokens=workload.input_tokens, output_tokens=workload.output_tokens,
            duration=workload.duration, source=workload.source)
    return Workload(
        adapters=workload.adapters, adapter=workload.adapter, arrival=workload.arrival,
        input_tokens=workload.input_tokens, output_tokens=workload.output_tokens,
        duration=workload.duration,
        source={"kind": "trace", "path": str(path), "format": fmt,
                **({"assign": assign.record()} if assign is not None else {})})


def _from_zero(w: Workload) -> Workload:
    arrival = w.arrival - w.arrival[0]  # sorted: the first request at 0
    return Workload(adapters=w.adapters, adapter=w.adapter, arrival=arrival,
                    input_tokens=w.input_tokens, output_tokens=w.output_tokens,
                    duration=w.duration, source=w.source, adapter_rank=w.adapter_rank)


def _chunks(path: Path, fmt: str, lines: BoundedLines) -> Iterator[Columns]:
    reader = csv.reader(lines)
    try:
        header = [h.strip() for h in next(reader, [])]
    except csv.Error as exc:
        raise FormatError(f"{path}:{reader.line_num}: not CSV ({exc})") from None
    need, _ = LAYOUTS[fmt]
    missing = [c for c in need if c not in header]
    if missing:
        found = ", ".join(repr(h) for h in header) if header else "none"
        raise FormatError(f"{path}:1: not the {fmt} layout: no {', '.join(missing)} column "
                          f"(columns found: {found})")
    where = {name: i for i, name in enumerate(header)}
    # Wall-clock times are kept as seconds after the first one's whole second: as seconds since
    # 1970 a float64 keeps only about 0.2 us, where the Azure traces give 100 ns ticks.
    epoch: list[int] = []
    while True:
        first = reader.line_num + 1
        try:
            rows = list(itertools.islice(reader, TRACE_CHUNK))
        except csv.Error as exc:
            raise FormatError(f"{path}:{reader.line_num}: not CSV ({exc})") from None
        if not rows:
            return
        yield _columns(path, fmt, where, rows, first, epoch)


def _columns(path: Path, fmt: str, where: dict[str, int], rows: list[list[str]],
             first: int, epoch: list[int]) -> Columns:
    # A blank line is no request, but it is a line: number the rows before dropping them.
    numbered = [(first + k, row) for k, row in enumerate(rows) if row]
    n = len(numbered)

    def cell(row: list[str], line: int, key: str) -> str:
        i = where[key]
        if i >= len(row):
            raise FormatError(f"{path}:{line}: no {key}")
        return row[i].strip()

    def number(row: list[str], line: int, key: str, whole: bool = False) -> float:
        text = cell(row, line, key)
        try:
            x = float(text)
        except ValueError:
            raise FormatError(f"{path}:{line}: {key} {text!r} is not a number") from None
        if not math.isfinite(x) or x < 0 or (whole and x != int(x)):
            kind = "a whole number" if whole else "a number"
            raise FormatError(f"{path}:{line}: {key} {text!r} must be {kind} >= 0")
        if whole and x >= MAX_TOKENS:
            raise FormatError(f"{path}:{line}: {key} {text!r} is not below 2**53")
        return x

    arrival = np.empty(n)
    inputs = np.zeros(n, dtype=np.int64)
    outputs = np.zeros(n, dtype=np.int64)
    duration = np.full(n, np.nan)
    names = [""] * n
    for k, (line, row) in enumerate(numbered):
        if fmt == "azure-llm":
            whole, fraction = _wall_clock(path, line, cell(row, line, "TIMESTAMP"))
            if not epoch:
                epoch.append(whole)
            arrival[k] = (whole - epoch[0]) + fraction
            inputs[k] = number(row, line, "ContextTokens", whole=True)
            outputs[k] = number(row, line, "GeneratedTokens", whole=True)
        elif fmt == "burstgpt":
            arrival[k] = number(row, line, "Timestamp")
            inputs[k] = number(row, line, "Request tokens", whole=True)
            outputs[k] = number(row, line, "Response tokens", whole=True)
        else:
            end, held = number(row, line, "end_timestamp"), number(row, line, "duration")
            # A start before the trace's zero (a long first invocation) stays before the
            # others: `_from_zero` shifts every start by the earliest.
            arrival[k], duration[k] = end - held, held
            names[k] = f"{cell(row, line, 'app')}/{cell(row, line, 'func')}"
            if names[k] == "/":
                raise FormatError(f"{path}:{line}: no app or func")
    # Unnamed rows become base-model requests until Assign gives each one an adapter.
    return arrival, *intern_names(names), inputs, outputs, duration, np.zeros(n, dtype=np.int64)


def _wall_clock(path: Path, line: int, text: str) -> tuple[int, float]:
    """(whole seconds since 1970, the fraction) of `2023-11-16 18:15:46.6805900` (any number of
    fraction digits, which Python 3.10's fromisoformat refuses) or `... .009930+00:00`."""
    body, zone = text, ""
    for sign in ("+", "-"):
        cut = text.rfind(sign)
        if cut > 10:  # past the date's own dashes
            body, zone = text[:cut], text[cut:]
            break
    if body.endswith("Z"):
        body, zone = body[:-1], "+00:00"
    whole, _, fraction = body.partition(".")
    try:
        moment = datetime.fromisoformat(whole + zone)
        frac = float("0." + fraction) if fraction else 0.0
        if fraction and not fraction.isdigit():
            raise ValueError
    except ValueError:
        raise FormatError(f"{path}:{line}: TIMESTAMP {text!r} is not a time like "
                          "2023-11-16 18:15:46.6805900") from None
    if moment.tzinfo is None:  # the 2023 trace: no zone given; read as UTC
        moment = moment.replace(tzinfo=timezone.utc)
    return int(moment.timestamp()), frac
