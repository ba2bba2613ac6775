"""The one place that probes for the optional extras: CuPy and a usable CUDA device
(`cupy_module()`), and matplotlib for the --plot options (`pyplot()`). Nothing else imports
cupy or matplotlib."""

from __future__ import annotations

import functools
from typing import Any

from metrale_cli.errors import NoDevice, ToolMissing


@functools.cache
def gpu_status() -> tuple[bool, str]:
    """(usable, reason): whether CuPy imports and a CUDA device answers. Probed once."""
    try:
        import cupy  # noqa: F401
    except Exception as exc:  # ImportError, or a CUDA library that fails to load
        return False, f"CuPy is not installed or does not load ({type(exc).__name__}); " \
            "install metrale[cuda12] or metrale[cuda13]"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return False, f"no usable CUDA device ({exc})"
    if count < 1:
        return False, "no CUDA device found"
    return True, f"{count} CUDA device(s)"


def has_gpu() -> bool:
    return gpu_status()[0]


def cupy_module() -> Any:
    """CuPy, or NoDevice with the reason when it is not usable here."""
    usable, reason = gpu_status()
    if not usable:
        raise NoDevice(f"a GPU is needed: {reason}")
    import cupy

    return cupy


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (PNG, no display), or ToolMissing naming the
    install; the --plot options call it before their work, so a missing matplotlib costs no
    run."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ToolMissing("--plot needs matplotlib: pip install -e '.[plot]' from a checkout "
                          "(pip install 'metrale[plot]' from an index)") from None
    return plt
