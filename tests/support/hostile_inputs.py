"""What the hostile-input tests of every stage share: a tiny hybrid model with one synthesised
adapter (conftest's `tiny` fixture), a copy of an adapter with its config edited, a regex that
backtracks exponentially on a module path, and the checks of one error line and of strict JSON."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.support.cli_runner import Result, metrale

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


def copy_adapter(src: Path, dst: Path, **config: object) -> Path:
    """A copy of adapter directory `src` at `dst` (its parents made) whose config has `config`
    merged in."""
    shutil.copytree(src, dst)
    doc = json.loads((dst / "adapter_config.json").read_text())
    doc.update(config)
    (dst / "adapter_config.json").write_text(json.dumps(doc))
    return dst


def one_line_error(result: Result, code: int) -> None:
    assert result.code == code, (result.code, result.stdout, result.stderr)
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr


def strict_json(text: str) -> object:
    """JSON as the standard has it: NaN and Infinity are not JSON."""
    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def run_cli(*args: object, env_extra: dict[str, str] | None = None, cwd: Path | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """`python -m metrale_cli ARGS` in a process of its own (a terminal's encoding, COLUMNS, a
    FIFO that would block), the environment with `env_extra` over it."""
    environment = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "metrale_cli", *map(str, args)],
                          capture_output=True, text=True, env=environment, cwd=cwd,
                          timeout=timeout)
