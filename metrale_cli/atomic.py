"""Atomic output: temp file beside the target, fsync, rename. Nothing is overwritten without
`force`, and a kill at any moment leaves the old file or the new one, never a partial one."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from metrale_cli.errors import OutputExists, UsageError


def atomic_write(path: Path, write: Any, force: bool) -> None:
    """Write through `write(file)` into a temp file beside `path`, fsync, then rename over it:
    a kill at any moment leaves either the old file or the new one, never a partial one."""
    path = Path(path)
    parent = _parent(path, force, directory=False)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent)
    except OSError as exc:
        raise UsageError(f"{path}: cannot write there ({exc.strerror or exc})") from exc
    try:
        # mkstemp creates 0600; give the file the mode an ordinary open() would.
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(parent)


def atomic_directory(path: Path, fill: Any, force: bool) -> None:
    """Fill a temp directory beside `path` through `fill(dir)`, then rename it to `path`: a
    failure or a kill while filling leaves no `path` (nor anything in it). With `force` an
    existing directory is replaced, moved aside before the rename and removed after it."""
    path = Path(path)
    parent = _parent(path, force, directory=True)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent))
    except OSError as exc:
        raise UsageError(f"{path}: cannot write there ({exc.strerror or exc})") from exc
    try:
        fill(tmp)
        tmp.chmod(0o777 & ~_umask())
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=parent))
            os.replace(path, old / path.name)
            os.replace(tmp, path)
            shutil.rmtree(old)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(parent)


def _parent(path: Path, force: bool, directory: bool) -> Path:
    """The existing directory `path` goes in, after refusing an existing `path` without `force`
    or of the other kind (a file where a directory goes, or the reverse)."""
    if path.exists() and not force:
        raise OutputExists(f"{path} exists; pass --force to overwrite it")
    if path.exists() and path.is_dir() != directory:
        raise UsageError(f"{path} is {'not ' if directory else ''}a directory")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"{parent}: no such directory")
    return parent


def _fsync_dir(parent: Path) -> None:
    dir_fd = os.open(parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask
