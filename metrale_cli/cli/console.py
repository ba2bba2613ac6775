"""The CLI's consoles and its one error edge: views go to stdout, errors, warnings and progress
to stderr; every domain error becomes one line and its exit code (docs/cli.md)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import typer

from metrale_cli import env
from metrale_cli.errors import MetraleError, Terminated, UsageError

if TYPE_CHECKING:
    from rich.console import Console

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")


def _width() -> int | None:
    """The terminal width Rich should use: its own guess, except that COLUMNS=0 (or another
    number too small to hold a word) would make Rich print nothing at all."""
    columns = os.environ.get("COLUMNS", "").strip()
    return 80 if columns.isdigit() and int(columns) < 8 else None


@functools.cache
def out() -> Console:
    """stdout for views (rich is imported on first output, not by `--help`)."""
    from rich.console import Console

    return Console(highlight=False, soft_wrap=False, width=_width(),
                   color_system=None if env.no_color() else "auto")


@functools.cache
def err() -> Console:
    """stderr for errors, warnings and progress."""
    from rich.console import Console

    return Console(stderr=True, highlight=False, soft_wrap=True, width=_width(),
                   color_system=None if env.no_color() else "auto")


def print_view(view: Any) -> None:
    """A view on stdout. Its whole lines (render.whole: a command to paste, a path) pass the
    terminal's width uncropped and unfolded, so the terminal wraps them and a line a user greps
    for stays one line; key/value lines (render.fields) and tables fit the width themselves."""
    out().print(view, crop=False)


# Off a terminal, progress is told only for work that runs at least this long: a line at each
# tenth of it reached from then on.
QUIET_S = 1.0


class Progress:
    """A command's progress on stderr, stage by stage (pack: reading the adapters, then writing
    the image), in bytes (counted in MiB, as the summaries) or in `unit`s. On a terminal, a
    transient bar per stage; off one (piped, logged), a line at each tenth of a stage
    (`packing: 40% of 1,234.5 MiB`) once the command has run `QUIET_S`: short work prints
    nothing, long work is not silent. The core takes `advance` as its callback; only the CLI
    draws."""

    def __init__(self, unit: str | None, bar: Any) -> None:
        self.unit = unit  # None: bytes
        self.bar = bar  # a rich Progress on a terminal, else None
        self.task: Any = None
        self.started = time.monotonic()
        self.what, self.done, self.total, self.said = "", 0, None, 0

    def stage(self, what: str, total: int | None) -> None:
        self.what, self.done, self.total, self.said = what, 0, total, 0
        if self.bar is not None:
            if self.task is not None:
                self.bar.remove_task(self.task)
            self.task = self.bar.add_task(what, total=total)

    def next_stage(self, what: str) -> Callable[[int, int], None]:
        """A callback `(n, total)` that starts stage `what` of `total` on its first call, then
        advances it (the core learns the total only as the stage begins)."""

        def advance(n: int, total: int) -> None:
            if self.what != what:
                self.stage(what, total)
            self.advance(n)

        return advance

    def advance(self, n: int, total: int | None = None) -> None:
        """`n` more done; `total` when it is learnt on the way (a trace's requests)."""
        self.done += n
        if total is not None:
            self.total = total
        if self.bar is not None:
            self.bar.update(self.task, advance=n, total=self.total)
            return
        tenth = 10 * self.done // self.total if self.total else 0
        if (0 < tenth < 10 and tenth > self.said
                and time.monotonic() - self.started >= QUIET_S):
            self.said = tenth
            whole = (f"{self.total / 2**20:,.1f} MiB" if self.unit is None
                     else f"{self.total:,} {self.unit}")
            say(f"{self.what}: {10 * tenth}% of {whole}")


@contextlib.contextmanager
def progress(what: str, total: int | None, shown: bool,
             unit: str | None = None) -> Iterator[Progress | None]:
    """`Progress` on stderr while the block runs, its first stage `what` of `total` (None: not
    known yet); None, and nothing shown, unless `shown` (not under --json)."""
    if not shown:
        yield None
        return
    if not err().is_terminal:
        report = Progress(unit, None)
        report.stage(what, total)
        yield report
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )
    from rich.progress import Progress as Bar

    amount = ((DownloadColumn(binary_units=True), TransferSpeedColumn()) if unit is None
              else (MofNCompleteColumn(), TextColumn(unit)))
    with Bar(TextColumn("{task.description}"), BarColumn(), *amount, TimeRemainingColumn(),
             console=err(), transient=True) as bar:
        report = Progress(unit, bar)
        report.stage(what, total)
        yield report


def say(line: str) -> None:
    """One line on stderr, whatever the input inside it holds: a control character (a newline
    in a path) is shown escaped, never as a line break; markup is not read."""
    err().print("".join(c if c.isprintable() else repr(c)[1:-1] for c in line), markup=False)


def escape(text: str) -> str:
    """Input-derived text made safe to put in Rich markup."""
    from rich.markup import escape as rich_escape

    return rich_escape(text)


def handles_errors(fn: F) -> F:
    """Map domain errors to one line on stderr and their exit code; a traceback only with
    METRALE_DEBUG=1."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            debug = env.debug()
        except UsageError as exc:
            say(f"error: {exc}")
            raise typer.Exit(exc.exit_code) from None
        try:
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except MetraleError as exc:
            if debug:
                raise
            record = refusal_record(exc)
            if kwargs.get("json_out") and record is not None:
                emit_json(record)  # a judged refusal's record, as inspect --json prints it
            for line in exc.details:
                say(line)
            say(f"error: {exc}")
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            say("interrupted")
            raise typer.Exit(130) from None
        except Terminated as exc:
            say(f"terminated ({exc}); nothing written")
            raise typer.Exit(128 + exc.signum) from None
        except OSError as exc:
            # A path the user gave that cannot be read or written (permissions, a full disk).
            if debug:
                raise
            where = f"{exc.filename}: " if exc.filename else ""
            say(f"error: {where}{exc.strerror or exc}")
            raise typer.Exit(2) from None
        except Exception as exc:
            if debug:
                raise
            say(f"internal error: {type(exc).__name__}: {exc} "
                "(METRALE_DEBUG=1 shows the traceback)")
            raise typer.Exit(70) from None

    return wrapper  # type: ignore[return-value]


def said_details(fn: Callable[[], T]) -> Callable[[], T]:
    """`fn`, saying a domain error's detail lines where it is raised: under torchrun a rank's
    error reaches the edge as `RankFailed`, which carries only its one line."""

    def run() -> T:
        try:
            return fn()
        except MetraleError as exc:
            for line in exc.details:
                say(line)
            raise

    return run


def refusal_record(exc: MetraleError) -> dict[str, Any] | None:
    """What a command under --json prints as it refuses: the error's own record where it
    carries one (the audit's, show's), else for a judged refusal (exit 1) its kind and line;
    None for a usage or format error (exit 2), whose line alone says what to change."""
    if exc.record is not None or exc.exit_code != 1:
        return exc.record
    kind = "".join(f"_{c.lower()}" if c.isupper() else c for c in type(exc).__name__)
    return {"refused": kind.lstrip("_"), "error": str(exc)}


def emit_json(record: Any) -> None:
    """The one JSON writer of every command: one document, indented."""
    # allow_nan=False: a NaN or Infinity that got this far is a bug, never invalid JSON out.
    sys.stdout.write(json.dumps(record, indent=2, allow_nan=False) + "\n")


def emit(record: Any, json_out: bool, view: Callable[[Any], Any]) -> None:
    """One record, two views: with --json the record itself, else `view(record)`."""
    if json_out:
        emit_json(record)
    else:
        print_view(view(record))



def warn(warnings: list[str]) -> None:
    """Warnings the record carries, one line each on stderr (also under --json)."""
    for warning in warnings:
        say(f"warning: {warning}")

