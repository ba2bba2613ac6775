"""What `--model` names, resolved to one `ModelConfig`.

`--model` (or an adapter's `base_model_name_or_path`) is resolved in this order (docs/cli.md):
1. a path to a `config.json` file, or to a directory that holds one (with the weights in its
   folder, when that holds `model.safetensors` or an index and its shards);
2. a hub id (`org/name[@revision]`) whose `config.json` is in the local Hugging Face cache (with
   the weights the cache holds), or with `--online` on the hub (the weights' headers by ranged
   reads);
3. a built-in preset, by its name or one of its hub ids;
4. anything else is an error (a path that exists without a `config.json` says so). A directory
   without `config.json` (an adapter directory named like a preset, say) never hides a preset.
The network is used only with `--online`. Where there are weights, only their headers are read
(model/weights.py): the config's shapes are checked against them, and a `model_type` no family
row knows is served from them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from metrale_cli import env
from metrale_cli.errors import UnsupportedModel, UsageError, did_you_mean
from metrale_cli.files.checkpoint import Checkpoint, read_hub, read_local
from metrale_cli.files.hub import cached, fetch, parse_hub_id
from metrale_cli.files.regular import refuse_not_regular
from metrale_cli.model.config import PRESETS, ModelConfig, find_preset
from metrale_cli.model.families import Family
from metrale_cli.model.weights import check_shapes, family_from_weights


def resolve_model(spec: str, online: bool = False) -> ModelConfig:
    """`--model`, in the order the module docstring gives: a config.json or a directory holding
    one; a hub id (`org/name[@revision]`) from the local Hugging Face cache, or with `online`
    from the hub; a preset (by name or hub id: a hub id that is not in the local cache but
    names a preset's model gives that preset when offline)."""
    spec = spec.strip()
    if not spec:
        raise UsageError("--model is empty")
    path = Path(spec).expanduser()
    refuse_not_regular(path / "config.json" if path.is_dir() else path)
    if path.is_file() and path.name != "config.json":
        return ModelConfig.from_hf(path)  # a config file by another name: no model directory
    folder = path.parent if path.is_file() else path
    if (folder / "config.json").is_file():
        return with_weights(folder / "config.json", lambda: read_local(folder))
    ref = parse_hub_id(spec)
    if ref is not None:
        config = fetch(ref, "config.json", online=True) if online else cached(ref, "config.json")
        if config is not None:
            cfg = with_weights(config, lambda: read_hub(ref, config.parent, online))
            return replace(cfg, source=spec)
    preset = find_preset(spec)
    if preset is not None:
        return ModelConfig.preset(preset.name)
    if path.exists():
        raise UsageError(f"--model {spec!r}: neither a config.json nor a directory holding one "
                         "(a directory without config.json), and not a preset (`metrale models`)")
    hint = did_you_mean(spec, [p.name for p in PRESETS])
    raise UsageError(
        f"--model {spec!r}: not a preset{hint}, not a path, and not in the local Hugging Face "
        f"cache ({env.hf_hub_cache()}); pass a preset (`metrale models`), a config.json, a model "
        "directory, or --online to fetch a hub id"
    )


def with_weights(config: Path, read: Callable[[], Checkpoint | None]) -> ModelConfig:
    """The config at `config` with the checkpoint `read` finds beside it: checked against it
    (a known family), or its family read from it (a `model_type` no row knows); the config
    alone where there is no checkpoint."""
    try:
        cfg = ModelConfig.from_hf(config)
    except UnsupportedModel:
        checkpoint = read()
        if checkpoint is None:
            raise
        # Read with a family of no modules first: the weights name the modules.
        cfg = ModelConfig.from_hf(config, family=Family("", modules=()))
        return family_from_weights(cfg, checkpoint)
    checkpoint = read()
    return cfg if checkpoint is None else check_shapes(cfg, checkpoint)
