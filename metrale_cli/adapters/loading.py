"""Adapters by argument, and the base model they name: the first step of every command that
takes adapters, and of `audit_adapters` / `plan_pool` (layout/pipeline.py) in the library."""

from __future__ import annotations

import json
from collections.abc import Sequence

from metrale_cli.adapters.adapter import Adapter, load_adapter, parse_adapter_args
from metrale_cli.errors import UsageError
from metrale_cli.model.config import ModelConfig
from metrale_cli.model.weights import resolve_checked


def load_adapters(args: Sequence[str], online: bool = False,
                  weights: bool = False) -> list[Adapter]:
    """Adapter directories or hub ids (`NAME=` either, named by `parse_adapter_args`'s rule);
    `weights`: the caller reads tensor data, so a hub adapter's weights are downloaded, not
    only their header read."""
    if not args:
        raise UsageError("no adapter given")
    return [load_adapter(path, name, online, weights)
            for name, path in parse_adapter_args(list(args))]


def model_for(spec: str | None, adapters: Sequence[Adapter], online: bool = False) -> ModelConfig:
    """The base model: `spec` (a `--model` value, see `resolve_model`; a local checkpoint's
    shapes checked against its headers, model/weights.py), else the adapters' common
    `base_model_name_or_path`."""
    if spec:
        return resolve_checked(spec, online)
    bases = {a.config.base_model_name_or_path for a in adapters}
    if None in bases or not bases:
        names = [a.name for a in adapters if a.config.base_model_name_or_path is None]
        raise UsageError(
            f"{', '.join(names) or 'no adapter'}: no base_model_name_or_path; pass --model "
            "(a preset from `metrale models`, a config.json, or a model directory)"
        )
    resolved = []
    for base in sorted(b for b in bases if b is not None):
        try:
            resolved.append(resolve_checked(base, online))
        except UsageError as exc:
            raise UsageError(
                f"base_model_name_or_path {base!r} resolves to nothing here ({exc}); pass "
                "--model (a preset from `metrale models`, a config.json, or a model directory)"
            ) from None
    # Different paths to the same model (copies of one config) are one base model.
    if len({json.dumps({**c.summary(), "source": ""}, sort_keys=True) for c in resolved}) > 1:
        raise UsageError(f"the adapters name different base models ({', '.join(sorted(bases))})"
                         "; pass --model")
    return resolved[0]
