"""Domain errors, in one place. The CLI edge maps each to one line on stderr and its exit code.

Exit codes: 1 = the input was read and judged (not servable, refused), 2 = usage (bad path,
bad option, unreadable or malformed file), 3 = the environment lacks something (no GPU, no
compiler, an engine that would not start), 4 = an engine did not answer within its time bound.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from typing import Any


class MetraleError(Exception):
    """Base of every error the CLI turns into one line and an exit code."""

    exit_code = 2
    # Lines that explain the error, each printed on its own line before it (a refusal's findings).
    details: tuple[str, ...] = ()
    # What a command under --json prints as it refuses (cli/console.refusal_record), if not
    # its kind and line.
    record: dict[str, Any] | None = None


class UsageError(MetraleError):
    """A bad argument, a missing path, an unknown model."""


def did_you_mean(wanted: str, known: Sequence[str]) -> str:
    """` (did you mean 'x'?)` for the known name closest to a mistyped one, else nothing: the
    tail of a usage error's line."""
    import difflib

    close = difflib.get_close_matches(wanted.strip().lower(), known, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def refused_line(refused: Sequence[str], total: int, what: str) -> str:
    """`2 of 20 adapter(s) not servable: ad10, ad12`: the line every command that refuses some
    of the adapters it was given ends with, whichever command and engine judged them."""
    return f"{len(refused)} of {total} adapter(s) {what}: {', '.join(refused)}"


class FormatError(MetraleError):
    """A file that is not what it claims to be (bad safetensors header, bad JSON, ...)."""


class UnsupportedModel(UsageError):
    """A base-model config of a type metrale does not know."""


class NotServable(MetraleError):
    """Adapters the audit refused: the message names them, `details` holds one line per error
    finding (`NAME: code: message`), `record` the audit's record (`inspect --json`'s), which a
    command under --json prints as it refuses."""

    exit_code = 1

    def __init__(self, message: str, details: Sequence[str] = (),
                 record: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.details = tuple(details)
        self.record = record


class OutputExists(UsageError):
    """Refusing to overwrite an existing output without --force."""


class NoDevice(MetraleError):
    """A GPU (or CuPy) was asked for and is not usable here."""

    exit_code = 3


class EngineFailed(MetraleError):
    """A serving engine started to check a prediction (`inspect --confirm`) exited before it
    was ready, or could not answer the base model: the environment's, not a verdict."""

    exit_code = 3


class EngineTimeout(EngineFailed):
    """That engine did not get ready, or did not answer, within its time bound."""

    exit_code = 4


class ToolMissing(MetraleError):
    """A compiler or other external tool the command needs is not installed."""

    exit_code = 3


class PoolFull(MetraleError):
    """Every cache slot has in-flight sequences; the caller may retry. A busy slot is never
    chosen."""

    exit_code = 1


class SlotBusy(MetraleError):
    """A swap into, or a rotation away from, a slot whose ref count is above 0."""

    exit_code = 1


class LayoutMismatch(MetraleError):
    """Landing a slot from a pool whose layout fingerprint differs, or packing an adapter whose
    tensor shapes do not fit the pool's layout (it was audited against another model)."""

    exit_code = 1


class RankFailed(MetraleError):
    """A process of a distributed run (torchrun) failed, or did not answer within the timeout;
    every process reports the failing rank's message."""

    exit_code = 1


class RankSilent(RankFailed):
    """A process of a distributed run did not answer an exchange (it died, or hangs past the
    timeout): the others cannot know what it left behind."""


class NonFiniteWeights(MetraleError):
    """An adapter whose weights hold NaN or infinity (or values too large for BF16): refused
    at pack time, since every token routed to its slot would produce garbage."""

    exit_code = 1


class PoolTooLarge(UsageError):
    """A pool (and its tables) larger than the memory available to hold it; said before any
    allocation is tried."""


class ImageInconsistent(FormatError):
    """A pool image whose metadata, tables and layout contradict each other. A FormatError (a
    caller opening an image refuses both alike) that is judged, so exit 1 where a file that is
    not an image at all is exit 2."""

    exit_code = 1


class PatternTimeout(NotServable):
    """A regex from an adapter config ran past its time bound (catastrophic backtracking)."""

    def __init__(self, field: str, pattern: str, seconds: float) -> None:
        super().__init__(f"{field} pattern {pattern!r} ran past the {seconds:g} s time bound "
                         "for matching module paths (catastrophic backtracking)")
        self.field = field
        self.pattern = pattern


class Terminated(BaseException):
    """SIGTERM or SIGHUP arrived while an output was being written. Like KeyboardInterrupt, not
    an Exception, so nothing on the way swallows it before the temp file is removed."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
