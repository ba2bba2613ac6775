"""pytest plugin: shared, lazily built PEFT ground truth (see ``tests/support/peft_factory.py``).

Register with ``pytest_plugins = ["tests.support.peft_fixtures"]`` in ``tests/conftest.py``. Records
handed out are cached for the whole session and shared between test files: treat them as
read-only (clone a tensor before modifying it).

The factory (and with it torch, transformers and peft) is imported on the first adapter a test
asks for, not when pytest loads this plugin: a test file that needs no ground truth starts in the
time pytest itself takes.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from tests.support.peft_factory import AdapterTruth, HandV4Truth


def _cache_key(*parts: Any, **kwargs: Any) -> str:
    # JSON with sorted keys: the same LoraConfig kwargs in any order (lists or tuples alike) share
    # one adapter; repr covers the odd non-JSON value.
    return json.dumps([parts, kwargs], sort_keys=True, default=repr)


class PeftZoo:
    """Builds each distinct adapter once, on first request, under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._adapters: dict[str, AdapterTruth] = {}
        self._hand_v4: dict[str, HandV4Truth] = {}
        self._bases: dict[str, Path] = {}
        self._serial = itertools.count()

    def _fresh_dir(self, stem: str) -> Path:
        # A serial number, not the cache size: a failed build must not leave its half-written
        # directory to the next one.
        return self.root / f"{stem}-{next(self._serial)}"

    def adapter(
        self,
        model_name: str,
        *,
        dtype: str = "f32",
        adapter_name: str | None = None,
        seed: int = 0,
        **lora_kwargs: Any,
    ) -> AdapterTruth:
        """``make_adapter`` with the same arguments, cached by value."""
        key = _cache_key(model_name, dtype, adapter_name, seed, **lora_kwargs)
        if key not in self._adapters:
            from tests.support.peft_factory import make_adapter

            self._adapters[key] = make_adapter(
                model_name,
                self._fresh_dir(model_name),
                dtype=dtype,
                adapter_name=adapter_name,
                seed=seed,
                **lora_kwargs,
            )
        return self._adapters[key]

    def hand_v4(self, model_name: str, r: int = 4, alpha: float = 8, **kwargs: Any) -> HandV4Truth:
        """``make_hand_v4_expert_adapter`` with the same arguments, cached by value."""
        key = _cache_key(model_name, r, alpha, **kwargs)
        if key not in self._hand_v4:
            from tests.support.peft_factory import make_hand_v4_expert_adapter

            self._hand_v4[key] = make_hand_v4_expert_adapter(
                model_name, self._fresh_dir(f"{model_name}-v4"), r, alpha, **kwargs
            )
        return self._hand_v4[key]

    def base_dir(self, model_name: str) -> Path:
        """A directory holding only the tiny model's ``config.json``."""
        if model_name not in self._bases:
            from tests.support.peft_factory import write_base_config

            base = write_base_config(model_name, self.root / f"base-{model_name}")
            self._bases[model_name] = base
        return self._bases[model_name]


@pytest.fixture(scope="session")
def peft_zoo(tmp_path_factory: pytest.TempPathFactory) -> PeftZoo:
    """Session-wide :class:`PeftZoo`; adapters are built lazily and shared across test files."""
    return PeftZoo(tmp_path_factory.mktemp("peft_zoo"))
