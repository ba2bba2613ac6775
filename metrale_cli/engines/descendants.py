"""Every process an engine metrale starts leaves behind, ended with it (Linux).

`--confirm` starts the user's python (the vLLM probe) and the vLLM server each in a session of
its own and stops them by killing that process group; a descendant that calls setsid() leaves
the group, outlives the kill, and is re-parented to init, out of metrale's reach. Inside
`reaping()` this process is a child subreaper (prctl PR_SET_CHILD_SUBREAPER): a descendant
orphaned there becomes this process's child instead of init's, whatever its session. On the way
out every process below a child started in the block in a session of its own (children are read
from /proc/PID/task/TID/children) is killed with SIGKILL, and each child reaped, until none is
left: what a killed process had forked comes to this process and is ended in the next round.
Children this process had before the block, children in its own session (no engine's: a child
another thread of a library caller started meanwhile), and what is below them, are left alone;
blocks open at once in several threads end together, when the last one ends.

Where prctl or the children files are missing (not Linux, or a seccomp filter forbids the
setting), the process-group kill is all there is. A process killed with SIGKILL cannot end its
descendants: metrale SIGKILLed mid-check leaves what it started, as any process does.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

# linux/prctl.h
PR_SET_CHILD_SUBREAPER = 36
PR_GET_CHILD_SUBREAPER = 37

# One process-wide setting under any number of blocks at once (threads): the first to enter
# sets it and notes the children there were; the last to leave ends what came since and puts
# the setting back, so that no block ends an engine another block still checks.
_lock = threading.Lock()
_holders = 0
_was_subreaper = False
_before: set[int] = set()


def children(pid: int) -> set[int]:
    """`pid`'s children, those of every thread of it (none once it is gone)."""
    found: set[int] = set()
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                found.update(int(w) for w in (task / "children").read_text().split())
    return found


def _prctl() -> Callable[..., int] | None:
    """libc's prctl where this is Linux with /proc's children files and the subreaper
    setting can be read (a seccomp filter may forbid it), else None."""
    if not sys.platform.startswith("linux") or not Path(
            f"/proc/{os.getpid()}/task/{threading.get_native_id()}/children").exists():
        return None
    try:
        prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
        _subreaper(prctl, PR_GET_CHILD_SUBREAPER, ctypes.byref(ctypes.c_int(0)))
    except (OSError, AttributeError):
        return None
    return prctl


def _subreaper(prctl: Callable[..., int], option: int, arg: object) -> None:
    if prctl(option, arg, ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}): {os.strerror(ctypes.get_errno())}")


@contextlib.contextmanager
def reaping() -> Iterator[None]:
    """While the block runs, orphaned descendants come to this process; when it ends, however
    it ends, every process below a child started in it in a session of its own is killed and
    reaped."""
    global _holders, _was_subreaper, _before
    prctl = _prctl()
    if prctl is not None:
        with _lock:
            if _holders == 0:
                was = ctypes.c_int(0)
                try:
                    _subreaper(prctl, PR_GET_CHILD_SUBREAPER, ctypes.byref(was))
                    _subreaper(prctl, PR_SET_CHILD_SUBREAPER, ctypes.c_ulong(1))
                except OSError:  # a filter that lets the setting be read, not set
                    prctl = None
                else:
                    _was_subreaper, _before = bool(was.value), children(os.getpid())
            if prctl is not None:
                _holders += 1
    if prctl is None:
        yield
        return
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0:
                try:
                    end_below(_before)
                finally:
                    if not _was_subreaper:
                        _subreaper(prctl, PR_SET_CHILD_SUBREAPER, ctypes.c_ulong(0))


def end_below(before: set[int]) -> None:
    """SIGKILL every process below this one but those of the children in `before` and of the
    children in this process's own session, and reap this process's children among them; again
    until none is left (a process that forks or setsid()s meanwhile has its orphans re-parented
    here, to the next round). The engines run in sessions of their own, and so does every
    process below them: a child in this session is one another thread started (a library
    caller's), whose exit status is its own to read."""
    me, session = os.getpid(), os.getsid(0)
    spared = set(before)  # and a child this process may not signal (another user's), unwaited
    while True:
        mine = children(me) - spared
        for pid in mine:
            with contextlib.suppress(OSError):  # gone: reaped by whoever started it
                if os.getsid(pid) == session:
                    spared.add(pid)
        mine -= spared
        if not mine:
            return
        tree, todo = set(mine), list(mine)
        while todo:
            below = children(todo.pop()) - tree
            tree |= below
            todo.extend(below)
        for pid in tree:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            except PermissionError:
                spared.add(pid)
        for pid in mine - spared:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
