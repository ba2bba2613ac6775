"""What an input path is when it is there but is not a regular file to read: a FIFO (reading it
would block), a device, a directory, a symbolic link loop. Said as such, where a bare
`is_file()` would make the message "no such file" about a name the user can see."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from metrale_cli.errors import UsageError

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


def not_regular(path: Path) -> str | None:
    """Why `path` cannot be read as a file, when it exists (as a name): `"a FIFO, not a regular
    file"`, `"a symbolic link loop, ..."`, `"not readable (Permission denied)"` (symbolic links
    followed); None for a regular file and for a name that is not there at all."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "a symbolic link to nothing" if os.path.islink(path) else None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "a symbolic link loop, not a regular file"
        return f"not readable ({exc.strerror})"
    if stat.S_ISREG(mode):
        return None
    kind = next((kind for is_kind, kind in _KINDS if is_kind(mode)), "something")
    return f"{kind}, not a regular file"


def refuse_not_regular(path: Path) -> None:
    """UsageError naming `path` and what it is, when it is there but cannot be read as a
    file; nothing when it is a regular file or not there (the caller says what is missing)."""
    why = not_regular(path)
    if why is not None:
        raise UsageError(f"{path}: {why}")
