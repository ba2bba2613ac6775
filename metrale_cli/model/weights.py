"""A checkpoint's own tensor shapes, read from its safetensors headers alone, against the shapes
its config gives every module of its family (docs/models.md).

`--model` naming a local model directory (or its `config.json`) whose folder also holds
`model.safetensors`, or `model.safetensors.index.json` and its shards, is checked: every
(layer, module) the family says a layer carries must be a tensor of the `(out, in)` the config
gives, else the command exits 2 naming the tensor. No tensor data is read: a header is a few
kilobytes at the front of each shard.
"""

from __future__ import annotations

from pathlib import Path

from metrale_cli.errors import FormatError
from metrale_cli.files.jsondoc import load_json
from metrale_cli.files.regular import refuse_not_regular
from metrale_cli.files.safetensors_header import read_header
from metrale_cli.model.config import ModelConfig, resolve_model
from metrale_cli.model.modules import family_modules

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Where transformers' checkpoints put the decoder layers: a text model's, a vision-language
# wrapper's (transformers 5, then 4).
_LAYER_PREFIXES = ("model.layers.", "model.language_model.layers.", "language_model.model.layers.")
# Weights of these dtypes hold one element per base weight entry, so their shape is `(out, in)`;
# packed integer formats (4-bit GPTQ, MXFP4 blocks) store other shapes and are not compared.
_PLAIN_DTYPES = ("F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ")


def weight_shapes(folder: Path) -> dict[str, tuple[str, tuple[int, ...]]] | None:
    """`name -> (dtype, shape)` of every tensor of the checkpoint in `folder`, from the headers
    alone; None when the folder holds none. FormatError for an index that names a shard or a
    tensor its shards do not hold, or a tensor two shards both hold."""
    index, single = folder / INDEX_FILE, folder / SINGLE_FILE
    if index.is_file():
        refuse_not_regular(index)
        doc = load_json(index, index.read_bytes(), "safetensors index")
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict) or not all(
                isinstance(v, str) and "/" not in v for v in weight_map.values()):
            raise FormatError(f"{index}: no weight_map of tensor names to shard file names")
        shards = sorted(set(weight_map.values()))
    elif single.is_file():
        weight_map, shards = None, [SINGLE_FILE]
    else:
        return None
    shapes: dict[str, tuple[str, tuple[int, ...]]] = {}
    for shard in shards:
        header = read_header(folder / shard)
        for name, info in header.tensors.items():
            if name in shapes:
                raise FormatError(f"{folder / shard}: tensor {name!r} is in another shard too")
            shapes[name] = (info.dtype, info.shape)
    if weight_map is not None:
        missing = next((n for n, s in weight_map.items() if n not in shapes), None)
        if missing is not None:
            raise FormatError(f"{index}: names tensor {missing!r} in {weight_map[missing]}, "
                              "which does not hold it")
    return shapes


def check_against_weights(model: ModelConfig,
                          shapes: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """FormatError naming the first tensor whose shape differs from what the config gives its
    module, or a module the family's layers carry that the checkpoint lacks."""
    prefix = next((p for p in _LAYER_PREFIXES if any(n.startswith(p) for n in shapes)), None)
    if prefix is None:
        raise FormatError(f"{model.source}: the checkpoint beside it has no decoder layers "
                          f"({', '.join(p + 'N' for p in _LAYER_PREFIXES)})")
    modules = family_modules(model)
    for layer in range(model.num_hidden_layers):
        for module in modules:
            if not module.applies_to_layer(model, layer):
                continue
            name = f"{prefix}{layer}.{module.path_in(model)}.weight"
            found = shapes.get(name)
            if found is None:
                raise FormatError(f"{model.source}: the config gives layer {layer} a "
                                  f"{module.value}, but the weights hold no {name}")
            dtype, shape = found
            if dtype in _PLAIN_DTYPES and shape != module.dims(model):
                raise FormatError(f"{model.source}: tensor {name} is {list(shape)} in the "
                                  f"weights, but the config gives {list(module.dims(model))}")


def resolve_checked(spec: str, online: bool = False) -> ModelConfig:
    """`resolve_model`, then, for a local model directory or config.json whose folder holds a
    safetensors checkpoint, its config's shapes checked against the checkpoint's headers."""
    model = resolve_model(spec, online)
    path = Path(spec.strip()).expanduser()
    folder = path if path.is_dir() else path.parent
    if (path.is_dir() or path.name == "config.json") and (folder / "config.json").is_file():
        shapes = weight_shapes(folder)
        if shapes is not None:
            check_against_weights(model, shapes)
    return model
