"""The regular expressions an adapter config carries, matched with a time bound.

An adapter file is untrusted input, and a pattern like `(.*.*)*z` backtracks for minutes on a
module path. Every user-supplied pattern is matched here, through the `regex` package (its V0
flavour is Python's `re`, which PEFT uses) with a timeout: inside `time_bound(seconds)` all the
matches of one audit share one deadline, and the pattern that runs past it raises
`PatternTimeout`, which the audit reports as an error finding naming the field.
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


@contextlib.contextmanager
def time_bound(seconds: float | None = None) -> Iterator[None]:
    """Every match inside shares one deadline `seconds` (AUDIT_SECONDS) from now."""
    token = _deadline.set(time.monotonic() + (AUDIT_SECONDS if seconds is None else seconds))
    try:
        yield
    finally:
        _deadline.reset(token)


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
