"""The compiled helpers of `metrale_cli/_native.c` where the install built them, else None:
an install without a C compiler goes on without them (setup.py), and their callers read with
os.preadv and check with NumPy instead."""

from __future__ import annotations

from types import ModuleType

compiled: ModuleType | None
try:
    from metrale_cli import _native as compiled
except ImportError:
    compiled = None
