"""How long `--model` at a checkpoint takes to read its shapes: every shard's safetensors header,
and the config checked against them, for checkpoints of real sizes whose data is a sparse hole
(the headers say 30 GB and more; the disk holds a few hundred KB).

    .venv/bin/python scripts/bench_checkpoint_headers.py [--runs N] [--dir DIR]

Two checkpoints, written as `save_pretrained` shards them (5 GB shards and an index), every
tensor named and shaped as the model's own checkpoint names and shapes it:
- `qwen3-14b`: Qwen3-14B's published dims (40 layers, hidden 5120, BF16): 29.5 GB, 443 tensors;
- `qwen3-30b-a3b`: the preset (48 layers of 128 per-expert projections): 61 GB, 18,867 tensors.
Validates before it times (the layout from the weights equals the config's), then prints one
JSON record per checkpoint: the best and the first of N runs of `read_local` (the headers alone)
and of `resolve_model` (headers, config and the check of every module on every layer).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from metrale_cli.files.checkpoint import INDEX, read_local
from metrale_cli.model.config import ModelConfig, find_preset
from metrale_cli.model.resolve import resolve_model

SHARD_BYTES = 5 * 10**9  # save_pretrained's default max_shard_size, "5GB"
QWEN3_14B = {"model_type": "qwen3", "hidden_size": 5120, "num_hidden_layers": 40,
             "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
             "intermediate_size": 17408, "vocab_size": 151936, "tie_word_embeddings": False}


def tensors(config: dict[str, Any]) -> list[tuple[str, list[int]]]:
    """The names and shapes of a Qwen3 (or Qwen3-MoE, experts one by one) checkpoint."""
    cfg = ModelConfig.from_dict(config)
    h, d = cfg.hidden_size, cfg.head_dim
    out = [("model.embed_tokens.weight", [cfg.vocab_size, h])]
    for n in range(cfg.num_hidden_layers):
        layer = f"model.layers.{n}"
        out += [(f"{layer}.self_attn.q_proj.weight", [cfg.q_width, h]),
                (f"{layer}.self_attn.k_proj.weight", [cfg.kv_width, h]),
                (f"{layer}.self_attn.v_proj.weight", [cfg.kv_width, h]),
                (f"{layer}.self_attn.o_proj.weight", [h, cfg.attn_width]),
                (f"{layer}.self_attn.q_norm.weight", [d]),
                (f"{layer}.self_attn.k_norm.weight", [d]),
                (f"{layer}.input_layernorm.weight", [h]),
                (f"{layer}.post_attention_layernorm.weight", [h])]
        if cfg.is_moe_layer(n):
            i = cfg.expert_intermediate_size
            out.append((f"{layer}.mlp.gate.weight", [cfg.num_experts, h]))
            for e in range(cfg.num_experts):
                out += [(f"{layer}.mlp.experts.{e}.gate_proj.weight", [i, h]),
                        (f"{layer}.mlp.experts.{e}.up_proj.weight", [i, h]),
                        (f"{layer}.mlp.experts.{e}.down_proj.weight", [h, i])]
        else:
            i = cfg.intermediate_size
            out += [(f"{layer}.mlp.gate_proj.weight", [i, h]),
                    (f"{layer}.mlp.up_proj.weight", [i, h]),
                    (f"{layer}.mlp.down_proj.weight", [h, i])]
    out += [("model.norm.weight", [h]), ("lm_head.weight", [cfg.vocab_size, h])]
    return out


def write_checkpoint(folder: Path, config: dict[str, Any]) -> tuple[int, int]:
    """Shards of at most SHARD_BYTES and their index, the data a hole; (bytes, tensors)."""
    shards: list[list[tuple[str, list[int]]]] = [[]]
    size = 0
    for name, shape in tensors(config):
        nbytes = math.prod(shape) * 2
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    weight_map, total = {}, 0
    for k, shard in enumerate(shards, 1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        header, cursor = {}, 0
        for name, shape in shard:
            nbytes = math.prod(shape) * 2
            header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [cursor,
                                                                              cursor + nbytes]}
            cursor += nbytes
            weight_map[name] = file
        blob = json.dumps(header).encode()
        with open(folder / file, "wb") as f:
            f.write(len(blob).to_bytes(8, "little") + blob)
            f.truncate(8 + len(blob) + cursor)  # the data: a hole
        total += cursor
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                            "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(config))
    return total, len(weight_map)


def timed(runs: int, call: Any) -> tuple[float, float]:
    """(first, best) wall seconds of `runs` calls."""
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return times[0], min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--dir", type=Path, default=None,
                        help="where to write the sparse checkpoints (a temporary directory)")
    args = parser.parse_args()
    preset = find_preset("qwen3-30b-a3b")
    assert preset is not None
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        for name, config in (("qwen3-14b", QWEN3_14B), ("qwen3-30b-a3b", preset.config)):
            folder = Path(root) / name
            folder.mkdir()
            total, count = write_checkpoint(folder, config)
            on_disk = sum(p.stat().st_blocks * 512 for p in folder.iterdir())
            # Validate before timing: every module's shape checked, the config's own layout.
            model = resolve_model(str(folder))
            assert model.shapes_from == "config checked against weights", model.shapes_from
            assert model == ModelConfig.from_dict(config, source=str(folder / "config.json"))
            headers_first, headers_best = timed(args.runs, lambda f=folder: read_local(f))
            model_first, model_best = timed(args.runs, lambda f=folder: resolve_model(str(f)))
            print(json.dumps({
                "bench": "checkpoint_headers", "checkpoint": name, "tensor_bytes": total,
                "tensors": count, "files": len(list(folder.glob("*.safetensors"))),
                "on_disk_bytes": on_disk, "runs": args.runs, "cpus": os.cpu_count(),
                "read_headers_first_s": headers_first, "read_headers_best_s": headers_best,
                "resolve_model_first_s": model_first, "resolve_model_best_s": model_best,
            }))


if __name__ == "__main__":
    main()
