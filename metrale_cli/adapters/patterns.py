"""The regular expressions an adapter config carries, bounded in size and matched with a time
bound.

An adapter file is untrusted input. Its patterns are first held to size bounds (`size_errors`),
before anything is compiled: compiling a 200,000-alternative regex takes minutes, and no timeout
covers compiling, so a verdict by time would depend on the machine's load. Within the bounds,
a pattern like `(.*.*)*z` still backtracks for minutes on a module path: every user-supplied
pattern is matched here, through the `regex` package (its V0 flavour is Python's `re`, which
PEFT uses) with a timeout: inside `time_bound(seconds)` all the matches of one audit share one
deadline, and the pattern that runs past it raises `PatternTimeout`, which the audit reports as
an error finding naming the field.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import re
import time
from collections.abc import Iterator

import regex

from metrale_cli.errors import PatternTimeout

# Time one audit may spend matching an adapter's patterns. An honest match takes about 5 us, and
# a per-expert adapter of a 512-expert model with a few pattern keys makes some 300,000 of them:
# 10 s leaves that a wide margin on a loaded machine and still ends a hostile pattern's hang.
AUDIT_SECONDS = 10.0
_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar("deadline", default=None)
# Size bounds on a config's patterns, checked before any is compiled. Real configs stay far
# below them (a regex naming every module of a 94-layer model by path is about 20,000
# characters); at them, compiling takes well under a second and matching a module path a few
# tens of microseconds, so the time bound is left for backtracking alone.
MAX_PATTERN_CHARS = 65_536  # characters of all of a config's regexes together
MAX_PATTERNS = 1_024  # regexes in a config: each is compiled once and kept (`_compiled`)
MAX_NAMES = 65_536  # names in a target_modules or exclude_modules list


@contextlib.contextmanager
def time_bound(seconds: float | None = None) -> Iterator[None]:
    """Every match inside shares one deadline `seconds` (AUDIT_SECONDS) from now."""
    token = _deadline.set(time.monotonic() + (AUDIT_SECONDS if seconds is None else seconds))
    try:
        yield
    finally:
        _deadline.reset(token)


def size_errors(regexes: list[tuple[str, list[str]]],
                name_lists: list[tuple[str, list[str]]]) -> list[str]:
    """Each size bound that a config's `regexes` and `name_lists` (field, values) pass, one line
    naming the fields and the bound; nothing is compiled."""
    found = []
    count = sum(len(values) for _, values in regexes)
    chars = sum(len(v) for _, values in regexes for v in values)
    fields = ", ".join(name for name, values in regexes if values)
    if chars > MAX_PATTERN_CHARS:
        found.append(f"the config's regexes ({fields}) hold {chars:,} characters; metrale "
                     f"reads at most {MAX_PATTERN_CHARS:,}")
    if count > MAX_PATTERNS:
        found.append(f"the config holds {count:,} regexes ({fields}); metrale reads at most "
                     f"{MAX_PATTERNS:,}")
    for name, values in name_lists:
        if len(values) > MAX_NAMES:
            found.append(f"{name} lists {len(values):,} names; metrale reads at most "
                         f"{MAX_NAMES:,}")
    return found


def compile_error(pattern: str) -> str | None:
    """Why `pattern` is not a valid Python regex (PEFT compiles it with `re`), or None."""
    try:
        re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as exc:
        return str(exc) or type(exc).__name__
    return None


@functools.lru_cache(maxsize=1024)
def _compiled(pattern: str) -> regex.Pattern[str] | None:
    if compile_error(pattern) is not None:
        return None
    try:
        return regex.compile(pattern, flags=regex.V0)
    except (regex.error, RecursionError, OverflowError):
        return None


def _timeout(field: str, pattern: str) -> float:
    """What is left of the deadline (AUDIT_SECONDS per match outside `time_bound`)."""
    deadline = _deadline.get()
    if deadline is None:
        return AUDIT_SECONDS
    left = deadline - time.monotonic()
    if left <= 0:
        raise PatternTimeout(field, pattern, AUDIT_SECONDS)
    return left


def match(field: str, pattern: str, text: str, *, full: bool = False,
          shown: str | None = None) -> regex.Match[str] | None:
    """`re.match` (or `re.fullmatch`) of `pattern` on `text`, time-bounded; an invalid pattern
    matches nothing (the audit reports it once, as a `bad_pattern` finding). `shown` is the
    user's own pattern when `pattern` wraps it."""
    compiled = _compiled(pattern)
    if compiled is None:
        return None
    try:
        return (compiled.fullmatch if full else compiled.match)(
            text, timeout=_timeout(field, shown or pattern))
    except TimeoutError:
        raise PatternTimeout(field, shown or pattern, AUDIT_SECONDS) from None
