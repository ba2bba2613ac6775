"""What every engine's rules read alike, in one place: the dtypes and their widths, the
config.json behind a model (read once, however many rules ask) and its widths that
ModelConfig does not keep (checked as it checks its own), the per-family table lookup
that refuses a family without a row, the TP split of a buffer and of the model, the name a
launch line gives the model, the bound on a plan's bytes, and the warning about an installed
engine of another version."""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from metrale_cli.errors import FormatError, UsageError
from metrale_cli.files.jsondoc import load_json
from metrale_cli.layout.slot_layout import refuse_past_plan_bytes
from metrale_cli.model.config import MAX_WIDTH, ModelConfig, find_preset

# The engines' --dtype choices and each dtype's width.
DTYPES = ("auto", "float16", "bfloat16", "float32")
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}

Row = TypeVar("Row")


def family_row(table: Mapping[str, Row], model: ModelConfig, who: str, where: str) -> Row:
    """The row of an engine's per-family `table` for `model`; a family without one is refused
    (`who`: the engine and version, `where`: the table's module and name), never guessed."""
    row = table.get(model.model_type)
    if row is None:
        raise UsageError(f"model type {model.model_type!r}: no {who} rules for it ({where})")
    return row


def divide(size: int, tp: int, what: str, who: str) -> int:
    """`size` on one of `tp` GPUs; a size TP does not divide is refused as `who`'s parallel
    layers refuse it."""
    if size % tp:
        raise UsageError(f"--tp {tp} does not divide {what} ({size}): {who} cannot shard it")
    return size // tp


def check_tp(model: ModelConfig, tp: int, fully_sharded: bool, who: str) -> None:
    """Refuse a TP degree `model` cannot be built at (the one TP rule every command and engine
    applies: layout/sharding.py), in `who`'s name."""
    from metrale_cli.layout.sharding import ShardSpec, check_model_split

    check_model_split(model, ShardSpec(tp, 0, 1, fully_sharded), who=who)


@functools.lru_cache(maxsize=8)
def _file_config(path: str, mtime_ns: int, size: int) -> Any:
    """One config file parsed, kept while the file is unchanged (its path, mtime and size):
    the rules ask for it per module and per flag, and a large file must be read once."""
    raw = Path(path).read_bytes()
    return load_json(Path(path), raw, "JSON config")


def raw_text_config(model: ModelConfig) -> dict[str, Any]:
    """The config.json behind `model` (its text part), for the keys ModelConfig does not keep
    (dtype, the GDN convolution width): the preset's, or the file's; {} for a hub id. Callers
    read it and never change it (it is one object for every caller)."""
    preset = find_preset(model.source) if model.source else None
    raw: Any = preset.config if preset is not None else {}
    path = Path(model.source) if model.source and preset is None else None
    if path is not None and path.is_file():
        stat = os.stat(path)
        raw = _file_config(str(path), stat.st_mtime_ns, stat.st_size)
    if not isinstance(raw, dict):
        return {}
    text = raw.get("text_config")
    return {**raw, **text} if isinstance(text, dict) else raw


def refuse_absurd(who: str, lora_bytes: int, host_bytes: int, host_flag: str) -> None:
    """Refuse an engine's plan whose LoRA buffers on one GPU, or host cache (sized by
    `host_flag`), pass MAX_PLAN_BYTES: UsageError naming the size and the flags that make it."""
    refuse_past_plan_bytes(f"{who}'s LoRA buffers", lora_bytes, "--max-rank and --max-loras",
                           " per GPU")
    refuse_past_plan_bytes(f"{who}'s host cache", host_bytes, host_flag, " per TP worker")


def config_width(model: ModelConfig, key: str, default: int) -> int:
    """A width of the config that ModelConfig does not keep (`linear_conv_kernel_dim`), checked
    as ModelConfig checks every width it reads: a positive integer no wider than MAX_WIDTH;
    `default` when the config leaves it out (or null)."""
    value = raw_text_config(model).get(key)
    if value is None:
        return default
    source = model.source or "config"
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise FormatError(f"{source}: {key!r} missing or not a positive integer")
    if value > MAX_WIDTH:
        raise FormatError(f"{source}: {key!r} is {value}, above the {MAX_WIDTH:,} that metrale "
                          "accepts; not a real model's config")
    return value


def model_id(model: ModelConfig, absolute: bool) -> str:
    """The model as a launch line names it: a preset's hub id, a config file's directory
    (`absolute`: resolved, for an engine that resolves paths against its own directory), else
    the source as given."""
    preset = find_preset(model.source) if model.source else None
    if preset is not None:
        return preset.hub_ids[0]
    path = Path(model.source) if model.source else None
    if path is not None and path.name == "config.json":
        return str(path.parent.resolve() if absolute else path.parent)
    return model.source or "MODEL"


def installed_warning(module: str, dists: tuple[str, ...], version: str,
                      line: str) -> str | None:
    """One warning where `module` is importable here from one of `dists` at a version other
    than `version` (read from its metadata, the package never imported): `line` with
    `{dist}` and `{installed}` filled in; None otherwise."""
    import importlib.metadata
    import importlib.util

    try:
        if importlib.util.find_spec(module) is None:
            return None
    except (ImportError, ValueError):
        return None
    for dist in dists:
        try:
            installed = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        if installed.split("+", 1)[0] != version:
            return line.format(dist=dist, installed=installed)
        return None
    return None
