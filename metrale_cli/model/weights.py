"""Module shapes from a checkpoint's own headers (files/checkpoint.py): the config's checked
against them, or, for a `model_type` no family row knows, the family read from them.

A decoder layer's LoRA-able projection is a tensor `<stack>.N.<path>.weight` (the stack is
`model.layers`, `model.language_model.layers`, ...): 2-D, `[out, in]`, the module's name the
last part of its path. A checked config must put every module its family declares on every
layer the family says, at the config's `(out, in)`, and every routed expert stored one by one at
the config's expert width; a weight stored quantized (an integer dtype, or `qweight` and no
`weight`) holds a packed shape, so only its presence is checked. A family read from weights
takes each module metrale pools (the `--modules` vocabulary) that sits at one path on each layer
that carries it (routed experts, in a numbered list inside the layer, are not among them), one
entry per group of layers where its path and shape are one (a dense MLP's gate_proj and a shared
expert's, a width that differs by layer); a name outside the vocabulary, or a name at two paths
of one layer, is left out: no adapter on it can be pooled.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from metrale_cli.errors import FormatError
from metrale_cli.files.checkpoint import Checkpoint
from metrale_cli.files.safetensors_header import TensorInfo
from metrale_cli.model.config import SHAPES_CHECKED, SHAPES_WEIGHTS, ModelConfig
from metrale_cli.model.families import VOCABULARY, Family, Layers, ModuleSpec
from metrale_cli.model.modules import family_modules

# `<stack>.N.<path>.<leaf>`: the first `layers.N` of the name is the decoder stack's. N has at
# most 9 digits: a name is input, and int() refuses 4,300.
_IN_LAYER = re.compile(
    r"^(?P<stack>(?:[^.]+\.)*?layers)\.(?P<layer>0|[1-9]\d{0,8})\.(?P<rest>.+)$")
# Dtypes whose tensors hold the projection's logical shape (FP8 checkpoints keep it too); the
# integer ones hold packed quantized words.
_FLOAT = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E4M3FNUZ", "F8_E5M2",
                    "F8_E5M2FNUZ"})
_VOCABULARY = {spec.name: spec for spec in VOCABULARY}


@dataclass(frozen=True)
class DecoderStack:
    """The tensors of one stack of decoder layers: `(layer, path)` -> the module's tensors by
    their last name part (`weight`, `bias`, `qweight`, ...)."""

    name: str
    modules: dict[tuple[int, str], dict[str, TensorInfo]]

    @property
    def layers(self) -> set[int]:
        return {layer for layer, _ in self.modules}

    def weight(self, layer: int, path: str) -> str:
        return f"{self.name}.{layer}.{path}.weight"


def decoder_stacks(checkpoint: Checkpoint) -> list[DecoderStack]:
    """Every stack of numbered layers the checkpoint's names hold, in name order."""
    stacks: dict[str, dict[tuple[int, str], dict[str, TensorInfo]]] = {}
    for name, info in checkpoint.tensors.items():
        m = _IN_LAYER.match(name)
        if m is None or "." not in m.group("rest"):
            continue
        path, leaf = m.group("rest").rsplit(".", 1)
        module = stacks.setdefault(m.group("stack"), {}).setdefault(
            (int(m.group("layer")), path), {})
        module[leaf] = info
    return [DecoderStack(name, stacks[name]) for name in sorted(stacks)]


def check_shapes(cfg: ModelConfig, checkpoint: Checkpoint) -> ModelConfig:
    """`cfg` marked as checked against `checkpoint`: every module its family declares, on every
    layer it applies to, is in the weights at the config's `(out, in)`; FormatError names the
    first tensor that is missing or of another shape."""
    expected = [(layer, module, module.path_in(cfg, layer))
                for layer in range(cfg.num_hidden_layers) for module in family_modules(cfg)
                if module.applies_to_layer(cfg, layer)]
    # The stack that holds most of what the config expects: the language model's, not a
    # vision tower's.
    stacks = decoder_stacks(checkpoint)
    stack = max(stacks, default=DecoderStack("model.layers", {}), key=lambda s: (
        sum((layer, path) in s.modules for layer, _, path in expected),
        "language_model" in s.name))
    for layer, module, path in expected:
        tensors = stack.modules.get((layer, path))
        name = stack.weight(layer, path)
        if tensors is None:
            raise FormatError(f"{cfg.source}: {name} is not in the weights ({checkpoint.source}),"
                              f" where the config's {cfg.model_type} layers carry "
                              f"{module.value} on layer {layer}")
        weight = tensors.get("weight")
        if weight is None or weight.dtype not in _FLOAT:
            continue  # quantized: the header holds a packed shape
        if weight.shape != module.dims(cfg, layer):
            raise FormatError(f"{cfg.source}: {name} is {list(weight.shape)} in the weights "
                              f"({checkpoint.source}), the config gives "
                              f"{list(module.dims(cfg, layer))}")
    _check_experts(cfg, checkpoint, stack)
    return replace(cfg, shapes_from=SHAPES_CHECKED)


def _check_experts(cfg: ModelConfig, checkpoint: Checkpoint, stack: DecoderStack) -> None:
    """Routed experts stored one by one (`<block>.experts.E.<leaf>.weight`, as Mixtral, Qwen3-MoE
    and DeepSeek checkpoints are): on each MoE layer whose expert 0 is stored so, every one of
    the config's experts at `[expert width, hidden]` (`[hidden, expert width]` for down_proj),
    and none past them. Experts stored fused (3-D parameters) are left unchecked."""
    family, width, hidden = cfg.family, cfg.expert_intermediate_size, cfg.hidden_size
    for layer in cfg.moe_layers:
        for proj, leaf in family.expert_leaves:
            path = f"{family.moe_block}.experts.{{}}.{leaf}"
            if (layer, path.format(0)) not in stack.modules:
                continue
            shape = (hidden, width) if proj == "down_proj" else (width, hidden)
            for expert in range(cfg.num_experts + 1):
                tensors = stack.modules.get((layer, path.format(expert)))
                name = stack.weight(layer, path.format(expert))
                if expert == cfg.num_experts:
                    if tensors is not None:
                        raise FormatError(f"{cfg.source}: {name} is in the weights "
                                          f"({checkpoint.source}), past the config's "
                                          f"{cfg.num_experts} experts")
                    continue
                if tensors is None:
                    raise FormatError(f"{cfg.source}: {name} is not in the weights "
                                      f"({checkpoint.source}), where the config's layer {layer} "
                                      f"has {cfg.num_experts} experts")
                weight = tensors.get("weight")
                if weight is not None and weight.dtype in _FLOAT and weight.shape != shape:
                    raise FormatError(f"{cfg.source}: {name} is {list(weight.shape)} in the "
                                      f"weights ({checkpoint.source}), the config gives "
                                      f"{list(shape)}")


def family_from_weights(cfg: ModelConfig, checkpoint: Checkpoint) -> ModelConfig:
    """`cfg` (a `model_type` no family row knows, read with a family of no modules) with the
    family its checkpoint's decoder layers give; FormatError when they give no module metrale
    pools."""
    stack = _language_stack(cfg, checkpoint)
    shapes: dict[str, dict[int, tuple[int, ...]]] = {}
    for (layer, path), tensors in stack.modules.items():
        weight = tensors.get("weight")
        if (layer >= cfg.num_hidden_layers or weight is None or len(weight.shape) != 2
                or weight.dtype not in _FLOAT or any(p.isdigit() for p in path.split("."))):
            continue  # past the config's layers (an MTP layer), not a linear weight, an expert
        shapes.setdefault(path, {})[layer] = weight.shape
    paths: dict[str, list[str]] = {}
    for path in shapes:
        paths.setdefault(path.rsplit(".", 1)[-1], []).append(path)
    modules = []
    for known in VOCABULARY:
        found = paths.get(known.name, [])
        layers = [layer for path in found for layer in shapes[path]]
        if len(set(layers)) != len(layers):
            continue  # two paths on one layer: PEFT adapts both, a slot holds one
        # One entry per (path, shape), its layers in order: the groups of layers on which the
        # module sits at one path with one shape.
        groups: dict[tuple[str, tuple[int, ...]], list[int]] = {}
        for path in found:
            for layer, shape in sorted(shapes[path].items()):
                groups.setdefault((path, shape), []).append(layer)
        for (path, (out, in_)), on_layers in sorted(groups.items(), key=lambda g: g[1][0]):
            modules.append(ModuleSpec(known.name, path, _out(cfg, known, out),
                                      _in(cfg, known, in_), Layers.LISTED, known.split,
                                      on_layers=tuple(on_layers)))
    if not modules:
        raise FormatError(f"{cfg.source}: model type {cfg.model_type!r} is not one metrale knows, "
                          f"and its weights ({checkpoint.source}) hold no decoder-layer "
                          f"projection it pools ({stack.name}.N.<path>.weight, 2-D, named one "
                          f"of {', '.join(_VOCABULARY)})")
    family = Family(cfg.model_type, modules=tuple(modules))
    return replace(cfg, weights_family=family, shapes_from=SHAPES_WEIGHTS)


def _language_stack(cfg: ModelConfig, checkpoint: Checkpoint) -> DecoderStack:
    """The stack with every one of the config's layers (a vision tower has its own count); of
    several, the one named for the language model."""
    stacks = decoder_stacks(checkpoint)
    full = [s for s in stacks if s.layers >= set(range(cfg.num_hidden_layers))]
    if len(full) > 1:
        full = [s for s in full if "language_model" in s.name] or full
    if len(full) == 1:
        return full[0]
    counts = ", ".join(f"{s.name}: {len(s.layers)}" for s in stacks) or "none"
    which = "several decoder stacks" if full else "no decoder stack"
    raise FormatError(f"{cfg.source}: {which} in the weights ({checkpoint.source}) with the "
                      f"config's {cfg.num_hidden_layers} layers (layers per stack: {counts})")


def _out(cfg: ModelConfig, known: ModuleSpec, rows: int) -> tuple[str | int, ...]:
    """The module's output as the vocabulary names it where the config's widths give the
    weight's rows (so TP splits it by heads and fused slices, as for a known family), else in
    elements."""
    named = [getattr(cfg, w, None) if isinstance(w, str) else w for w in known.out]
    return known.out if sum(w or 0 for w in named) == rows and all(named) else (rows,)


def _in(cfg: ModelConfig, known: ModuleSpec, cols: int) -> str | int:
    width = getattr(cfg, known.in_, None) if isinstance(known.in_, str) else known.in_
    return known.in_ if width == cols else cols
