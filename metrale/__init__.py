"""metrale: audit, lay out, pack and benchmark multi-LoRA adapter pools.

The library API under the name it installs as: `import metrale` (then `metrale.plan_pool`,
`from metrale import LoraPool`, ...) gives every name of `metrale_cli.__all__`, the same objects,
with the same argument checks (docs/library.md). The code lives in `metrale_cli`, the package of
the `metrale` command; each name is imported from its stage on first use, so `import metrale`
costs what `import metrale_cli` does.
"""

from __future__ import annotations

from typing import Any

import metrale_cli

__version__ = metrale_cli.__version__

__all__ = list(metrale_cli.__all__)


def __getattr__(name: str) -> Any:
    if name not in metrale_cli.__all__:
        raise AttributeError(f"module 'metrale' has no attribute {name!r}")
    value = getattr(metrale_cli, name)
    globals()[name] = value  # resolved once: later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
