"""What the hostile-input tests share: a tiny hybrid model with one synthesised adapter, and a
regex that backtracks exponentially on a module path."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.cli_runner import metrale

ATTN = "q_proj,k_proj,v_proj,o_proj,out_proj"
TINY = {
    "model_type": "qwen3_next", "hidden_size": 32, "num_hidden_layers": 4,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
    "intermediate_size": 48, "linear_num_value_heads": 2, "linear_value_head_dim": 8,
    "full_attention_interval": 2, "num_experts": 0,
}
# Backtracks exponentially in the length of a module path, in `re` and in `regex` alike.
CATASTROPHIC = r"([\w.]|[\w.][\w.])*!?\.$"


def tiny_model(root: Path) -> Path:
    """`root` holding the tiny model's config.json and adapter `a` (rank 2, attention modules)."""
    (root / "config.json").write_text(json.dumps(TINY))
    assert metrale("synth", root / "a", "--model", root, "--modules", ATTN, "--rank", 2).code == 0
    return root
