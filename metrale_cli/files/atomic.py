"""Atomic output: temp file (or directory) beside the target, fsync, then publish it under the
final name.

Nothing is overwritten without `force`, even by a concurrent writer: without it the final name is
created only if absent (a hard link of the temp file, or `renameat2(RENAME_NOREPLACE)`), so of two
writers exactly one wins. A kill at any moment leaves the old file or the new one, never a partial
one: SIGINT, SIGTERM and SIGHUP remove the temp file, and a temp file left by a process that died
harder (SIGKILL, a crash) carries its pid in its name and is removed by the next writer.
A directory (`unpack`'s adapter) follows the same rules: `temp_dir`, then `publish_dir`; `force`
replaces a directory only if it holds nothing but what metrale writes there.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fnmatch
import hashlib
import os
import re
import shutil
import signal
import stat
import tempfile
import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from metrale_cli.errors import OutputExists, Terminated, UsageError

# `.NAME.PID.RANDOM.tmp` beside NAME: the pid says whether the writer is still alive.
_TEMP = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)\.[A-Za-z0-9_]+\.tmp$")
RENAME_NOREPLACE = 1  # linux/fs.h
RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_NAME_MAX = 255  # bytes in one path component (Linux; every file system metrale writes to)
_CLEANUP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def output_path(text: str, option: str = "--out") -> Path:
    """A file path the user gave for an output: never empty, never a directory name."""
    if not text.strip():
        raise UsageError(f"{option} is empty")
    if text.endswith("/"):
        raise UsageError(f"{option} {text!r} names a directory; give a file name")
    return Path(text)


def output_dir(text: str, option: str = "--out") -> Path:
    """A directory path the user gave for outputs (`pack --tp`'s rank images): never empty."""
    if not text.strip():
        raise UsageError(f"{option} is empty")
    return Path(text)


def check_output(path: Path, force: bool) -> None:
    """Refuse an output path that exists and is not a regular file (a device, a FIFO, a directory:
    even with `force`), or that exists at all without `force`."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise UsageError(f"{path}: cannot write there ({exc.strerror or exc})") from exc
    if stat.S_ISDIR(st.st_mode):
        raise UsageError(f"{path} is a directory")
    if not stat.S_ISREG(st.st_mode):
        raise UsageError(f"{path} exists and is not a regular file; metrale never replaces one")
    if not force:
        raise OutputExists(f"{path} exists; pass --force to overwrite it")


def check_not_an_input(path: Path, inputs: Iterable[Path]) -> None:
    """Refuse an output `path` that is one of the command's `inputs`, by any name (a symlink, a
    hard link, `./x`): `--force` replaces an earlier output, never a file the command reads."""
    try:
        st = os.stat(path)
    except OSError:
        return  # not there yet: it cannot be an input
    for source in inputs:
        try:
            other = os.stat(source)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (other.st_dev, other.st_ino):
            raise UsageError(f"{path} is {source}, an input of this command; write the output "
                             "elsewhere")


def atomic_write(path: Path, write: Any, force: bool) -> None:
    """Write through `write(file)` into a temp file beside `path`, fsync, then publish it: replace
    `path` with `force`, else create it only if absent (OutputExists when another got there)."""
    path = Path(path)
    check_output(path, force)
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"{parent}: no such directory")
    remove_stale_temps(parent, path.name)
    with cleanup_on_signals():
        try:
            fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(path), suffix=".tmp", dir=parent)
        except OSError as exc:
            raise UsageError(f"{path}: cannot write there ({exc.strerror or exc})") from exc
        try:
            # mkstemp creates 0600; give the file the mode an ordinary open() would.
            umask = os.umask(0)
            os.umask(umask)
            os.fchmod(fd, 0o666 & ~umask)
            with os.fdopen(fd, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            if force:
                check_output(path, force)
                os.replace(tmp, path)
            else:
                publish_new(tmp, path)
        finally:
            Path(tmp).unlink(missing_ok=True)
    dir_fd = os.open(parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _temp_prefix(path: Path) -> str:
    """`.NAME.PID.`: with mkstemp's random part and `.tmp`, a name `_TEMP` matches."""
    return f".{_temp_stem(path.name)}.{os.getpid()}."


def _temp_stem(name: str) -> str:
    """`name` as its temp files carry it: whole when the temp name fits in NAME_MAX (255 bytes),
    else cut, with a digest of the whole name so that two long names sharing a start differ."""
    # The dots, a pid (at most 7 digits), mkstemp's 8 random characters and `.tmp`.
    room = _NAME_MAX - 22
    encoded = name.encode("utf-8", "surrogateescape")
    if len(encoded) <= room:
        return name
    digest = hashlib.sha256(encoded).hexdigest()[:16]
    cut = encoded[: room - len(digest) - 1].decode("utf-8", "ignore")
    return f"{cut}~{digest}"


def publish_new(tmp: str | Path, path: Path) -> None:
    """Give `tmp` the name `path` only if no file has it: of concurrent writers, one wins.
    `tmp` may keep its name too (a hard link): the caller removes it."""
    try:
        os.link(tmp, path)
        return
    except FileExistsError:
        raise OutputExists(f"{path} exists (written meanwhile by another process); pass "
                           "--force to overwrite it") from None
    except OSError as exc:
        # File systems without hard links (FAT, some FUSE mounts): rename without replacing.
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
            raise
    _renameat2(tmp, path, RENAME_NOREPLACE)


def _renameat2(src: str | Path, dst: Path, flags: int) -> None:
    """renameat2(2) with `flags`: RENAME_NOREPLACE (OutputExists when `dst` exists) or
    RENAME_EXCHANGE (both names must exist; they swap in one step)."""
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        raise UsageError(f"{dst}: the file system cannot create a file without replacing "
                         "one (no hard links, no renameat2); pass --force")
    if renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags):
        code = ctypes.get_errno()
        if code == errno.EEXIST or (code == errno.ENOTEMPTY and flags == RENAME_NOREPLACE):
            raise OutputExists(f"{dst} exists (written meanwhile by another process); pass "
                               "--force to overwrite it")
        raise OSError(code, os.strerror(code), str(dst))


def temp_dir(path: Path) -> Path:
    """A new empty directory beside `path` to build it in, named like the temp files (so a
    SIGKILLed writer's is swept by the next), after sweeping dead writers' ones."""
    parent = path.parent if str(path.parent) else Path(".")
    remove_stale_temps(parent, path.name)
    try:
        return Path(tempfile.mkdtemp(prefix=_temp_prefix(path), suffix=".tmp", dir=parent))
    except OSError as exc:
        raise UsageError(f"{path}: cannot write there ({exc.strerror or exc})") from exc


def check_replaceable(path: Path, owned: Sequence[str]) -> None:
    """Refuse to replace the directory `path` unless each entry in it is a regular file whose
    name matches one of the glob patterns `owned` (what metrale writes there): `--force`
    replaces an earlier output, never deletes the user's other files."""
    try:
        entries = sorted(os.scandir(path), key=lambda e: e.name)
    except OSError as exc:
        raise UsageError(f"{path}: cannot read it ({exc.strerror or exc})") from exc
    for entry in entries:
        if not (entry.is_file(follow_symlinks=False)
                and any(fnmatch.fnmatchcase(entry.name, p) for p in owned)):
            raise UsageError(f"{path} holds {entry.name}, which metrale does not write there; "
                             "--force replaces only a directory of metrale's own outputs")


def publish_dir(tmp: Path, path: Path, force: bool, owned: Sequence[str]) -> None:
    """Give the built directory `tmp` the name `path`. Without `force` only if nothing has the
    name (OutputExists when a concurrent writer got there first); with it, an existing
    directory that holds only files named like `owned` (`check_replaceable`) is swapped out in
    one step (RENAME_EXCHANGE: `path` is always the old directory or the new one, never
    missing) and removed. `tmp` is gone after, whatever happens."""
    try:
        if force and path.is_dir() and not path.is_symlink():
            check_replaceable(path, owned)
            _renameat2(tmp, path, RENAME_EXCHANGE)  # tmp now holds the old directory
        else:
            _renameat2(tmp, path, RENAME_NOREPLACE)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    parent = path.parent if str(path.parent) else Path(".")
    dir_fd = os.open(parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def check_output_dir(path: Path, force: bool, owned: Sequence[str]) -> None:
    """Refuse an output directory `atomic_directory` would refuse, before any work: a path that
    exists and is not a directory, an existing one without `force`, one holding anything but
    files named like `owned` with it, a missing parent."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        raise UsageError(f"{path} exists and is not a directory; metrale never replaces one")
    if path.exists() and not force:
        raise OutputExists(f"{path} exists; pass --force to overwrite it")
    if path.exists():
        check_replaceable(path, owned)
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"{parent}: no such directory")


def atomic_directory(path: Path, fill: Any, force: bool, owned: Sequence[str]) -> None:
    """Build the directory `path` through `fill(dir)` in a temp directory beside it, then
    publish it (`publish_dir`): a failure, SIGINT, SIGTERM or SIGHUP while filling leaves no
    `path` and no temp directory. An existing `path` is refused without `force`, and anything
    but a directory of files named like `owned` (glob patterns: what `fill` writes) even with
    it."""
    path = Path(path)
    check_output_dir(path, force, owned)  # before the work; publish_dir checks again
    with cleanup_on_signals():
        tmp = temp_dir(path)
        try:
            fill(tmp)
            # mkdtemp creates 0700; give the directory the mode an ordinary mkdir would.
            umask = os.umask(0)
            os.umask(umask)
            tmp.chmod(0o777 & ~umask)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        publish_dir(tmp, path, force, owned)


def remove_stale_temps(parent: Path, name: str) -> list[Path]:
    """Remove this writer's temp files (and directories) for `name` whose owning process is
    gone; returns them."""
    removed = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for entry in entries:
        m = _TEMP.match(entry.name)
        if m is None or m.group("name") != _temp_stem(name):
            continue
        with contextlib.suppress(OSError):
            if entry.stat(follow_symlinks=False).st_uid != os.getuid() or _alive(
                int(m.group("pid"))
            ):
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            elif entry.is_file(follow_symlinks=False):
                os.unlink(entry.path)
            else:
                continue
            removed.append(Path(entry.path))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


@contextlib.contextmanager
def cleanup_on_signals() -> Iterator[None]:
    """Turn SIGTERM and SIGHUP into `Terminated` for the duration, so the temp file's cleanup
    runs; the previous handlers come back after. A signal that is ignored (SIGHUP under
    `nohup`) or handled by the embedding program stays as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_terminated(signum: int, _frame: Any) -> None:
        raise Terminated(signum)

    previous = {s: signal.signal(s, raise_terminated) for s in _CLEANUP_SIGNALS
                if signal.getsignal(s) is signal.SIG_DFL}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
