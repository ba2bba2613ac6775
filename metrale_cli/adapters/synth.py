"""Synthetic PEFT-format adapters of a real model size, streamed to disk so memory stays small.

They feed the demo, the tests and the benchmarks: random non-zero A and B, a config PEFT would
write, and `base_model_name_or_path` set to the model spec so `inspect` finds the model alone.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from metrale_cli.adapters.adapter import CONFIG_NAME, WEIGHTS_NAME
from metrale_cli.adapters.audit import MAX_SCALING, MIN_SCALING
from metrale_cli.bf16 import f32_to_bf16
from metrale_cli.errors import OutputExists, UsageError, did_you_mean
from metrale_cli.files.atomic import atomic_directory
from metrale_cli.files.pieces import PieceWriter
from metrale_cli.files.safetensors_header import adapter_header
from metrale_cli.model.config import ModelConfig
from metrale_cli.model.modules import LoraModule, in_slot_order

DTYPES = {"f32": ("F32", 4), "bf16": ("BF16", 2), "f16": ("F16", 2)}
# Rows generated at a time: bounds memory for the largest tensors.
CHUNK_ELEMENTS = 4 << 20


@dataclass(frozen=True)
class SynthResult:
    path: Path
    tensors: int
    bytes: int

    def record(self) -> dict[str, Any]:
        return {"path": str(self.path), "tensors": self.tensors, "bytes": self.bytes}


def synth_adapter(
    out_dir: str | Path,
    model: ModelConfig,
    model_spec: str,
    modules: list[LoraModule],
    rank: int,
    alpha: float | None = None,
    rslora: bool = False,
    dtype: str = "bf16",
    seed: int = 0,
    force: bool = False,
    expert_layers: int = 0,
) -> SynthResult:
    """`expert_layers` > 0 adds transformers-5 fused routed-expert LoRA (`mlp.experts`
    gate_up_proj and down_proj, `A [E*r, in]`, `B [out, E*r]`) on the model's first that many
    MoE layers, as PEFT's `target_parameters` saves it."""
    if rank <= 0:
        raise UsageError(f"--rank must be positive, got {rank}")
    if alpha is not None and not (math.isfinite(alpha) and alpha > 0):
        # json.dumps would write NaN or Infinity: a config no JSON reader takes.
        raise UsageError(f"--alpha must be a positive finite number, got {alpha}")
    if alpha is not None:
        scaling = alpha / (math.sqrt(rank) if rslora else rank)
        if not MIN_SCALING <= scaling <= MAX_SCALING:
            # An adapter pack and every engine check would refuse: none is written.
            raise UsageError(f"--alpha {alpha:g} with --rank {rank} gives a scaling of "
                             f"{scaling:g}, outside the 2^-60 to 2^60 a pool holds")
    if seed < 0:
        raise UsageError(f"--seed must be non-negative, got {seed}")
    if dtype not in DTYPES:
        raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}"
                         f"{did_you_mean(dtype, list(DTYPES))}")
    out = Path(out_dir)
    if out.is_dir() and not out.is_symlink() and any(out.iterdir()) and not force:
        raise OutputExists(f"{out} is not empty; pass --force to overwrite the adapter there")
    st_dtype, itemsize = DTYPES[dtype]

    # (name, rows, cols, std): A [r, in] and B [out, r] per applicable (layer, module).
    plan: list[tuple[str, int, int, float]] = []
    # The modules with tensors: `--modules all` names every module metrale knows, and
    # target_modules lists only those this model has (an `out_proj` there with no tensor is a
    # module the layout and the engines look for and do not find).
    written: set[LoraModule] = set()
    narrowest = math.inf  # the narrower side of the smallest weight adapted
    # PEFT's keys for the decoder layers (a vision-language wrapper's under its language model).
    prefix = f"base_model.model.{model.language_model}.layers"
    for layer in range(model.num_hidden_layers):
        for module in in_slot_order(model, modules):
            if not module.applies_to_layer(model, layer):
                continue
            out_dim, in_dim = module.dims(model, layer)
            written.add(module)
            narrowest = min(narrowest, out_dim, in_dim)
            key = f"{prefix}.{layer}.{module.path_in(model, layer)}"
            plan.append((f"{key}.lora_A.weight", rank, in_dim, 1 / math.sqrt(in_dim)))
            plan.append((f"{key}.lora_B.weight", out_dim, rank, 1 / math.sqrt(rank)))
    h, i, n_exp = model.hidden_size, model.expert_intermediate_size, model.num_experts
    for layer in model.moe_layers[:expert_layers]:
        key = f"{prefix}.{layer}.mlp.experts"
        # Two wrapped parameters: the inner one (gate_up_proj) sits under `.base_layer.`.
        for name, in_dim, out_dim in ((f"{key}.base_layer", h, 2 * i), (key, i, h)):
            narrowest = min(narrowest, in_dim, out_dim)
            plan.append((f"{name}.lora_A.weight", n_exp * rank, in_dim, 1 / math.sqrt(in_dim)))
            plan.append((f"{name}.lora_B.weight", out_dim, n_exp * rank, 1 / math.sqrt(rank)))
    if not plan:
        raise UsageError("none of the modules applies to any layer of this model")
    # Past the narrower side of a weight a LoRA pair holds more numbers than the weight itself:
    # no adapter is trained so, and --rank 10000000 would fill the disk.
    if rank > narrowest:
        raise UsageError(f"--rank {rank} is above {narrowest}, the narrower side of the "
                         "smallest weight it adapts; a LoRA rank is at most that")

    head = adapter_header((name, st_dtype, (rows, cols), rows * cols * itemsize)
                          for name, rows, cols, _ in plan)
    rng = np.random.default_rng(seed)

    def write_weights(f: Any) -> None:
        out = PieceWriter(f)  # large aligned writes: 2 MiB folios, which `pack` reads faster
        out.write(head)
        for _, rows, cols, std in plan:
            step = max(1, CHUNK_ELEMENTS // cols)
            for start in range(0, rows, step):
                n = min(step, rows - start)
                values = (rng.standard_normal((n, cols), dtype=np.float32) * np.float32(std))
                if dtype == "bf16":
                    out.write(f32_to_bf16(values).tobytes())
                else:
                    out.write(values.astype("<f4" if dtype == "f32" else "<f2").tobytes())
        out.finish()

    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": model_spec,
        "r": rank,
        "lora_alpha": alpha if alpha is not None else 2 * rank,
        "use_rslora": rslora,
        "target_modules": sorted(m.peft_name for m in written),
        "lora_dropout": 0.0,
        "bias": "none",
        "use_dora": False,
        "modules_to_save": None,
        "target_parameters": (["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
                              if expert_layers else None),
        "rank_pattern": {},
        "alpha_pattern": {},
        "inference_mode": True,
        "metrale_synthetic": {"seed": seed, "dtype": dtype},
    }
    def fill(tmp: Path) -> None:
        with (tmp / WEIGHTS_NAME).open("wb") as f:
            write_weights(f)
            f.flush()
            os.fsync(f.fileno())
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    # Built beside `out` and renamed into place, as unpack writes its adapter: a full disk or a
    # signal leaves no half-written (or empty) adapter directory. An empty directory there is
    # taken as the place to write, as `mkdir out && synth out` means.
    empty = out.is_dir() and not out.is_symlink() and not any(out.iterdir())
    # Missing parents are made (`mkdir -p`), and removed again when the write fails.
    made = [d for d in reversed(out.parents) if not d.exists()]
    try:
        for d in made:
            d.mkdir()
        atomic_directory(out, fill, force or empty, owned=[CONFIG_NAME, WEIGHTS_NAME])
    except BaseException:
        for d in reversed(made):
            with contextlib.suppress(OSError):
                d.rmdir()
        raise
    return SynthResult(out, len(plan),
                       len(head) + sum(rows * cols * itemsize for _, rows, cols, _ in plan))
