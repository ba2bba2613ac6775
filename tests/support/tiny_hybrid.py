"""A tiny hybrid (Qwen3-Next) or fused (Phi-3) base config with synthetic adapters, and a free
local port: what the multi-process tests (torchrun, peer landing) start from."""

from __future__ import annotations

import json
import socket
from pathlib import Path

from tests.support.cli_runner import metrale

HYBRID = {"model_type": "qwen3_next", "hidden_size": 64, "num_hidden_layers": 4,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "intermediate_size": 96, "linear_num_value_heads": 4, "linear_value_head_dim": 8,
          "full_attention_interval": 2}
# Phi-3's fused qkv_proj and gate_up_proj, 4 query heads and 2 KV heads of 16.
FUSED = {"model_type": "phi3", "hidden_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
         "vocab_size": 128}


def tiny_hybrid_adapters(root: Path, specs: list[tuple[str, int, str]],
                         config: dict[str, object] = HYBRID) -> list[Path]:
    """Write a tiny base `config.json` (by default a 4-layer Qwen3-Next: gated q_proj,
    out_proj, 2 KV heads) into `root` and one synthetic F32 adapter per (name, rank, modules)
    beside it."""
    (root / "config.json").write_text(json.dumps(config))
    for name, rank, modules in specs:
        done = metrale("synth", root / name, "--model", root, "--modules", modules, "--rank",
                       rank, "--dtype", "f32", "--seed", rank)
        assert done.code == 0, done.stderr
    return [root / name for name, _, _ in specs]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
