"""The docs' code runs: the pool-format reader in docs/pool-format.md gives the same delta as
metrale's own reading of the image."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from metrale_cli.image import PoolImage
from tests.cli_runner import metrale

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_pool_format_reader(tmp_path: Path) -> None:
    text = (DOCS / "pool-format.md").read_text()
    code = re.search(r"```python\n(import json.*?)```", text, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, "pool-format.md", "exec"), namespace)
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen3_next", "hidden_size": 32, "num_hidden_layers": 4,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
        "intermediate_size": 48, "linear_num_value_heads": 3, "linear_value_head_dim": 8,
        "full_attention_interval": 2}))
    for name, rank in (("a", 4), ("b", 2)):
        assert metrale("synth", tmp_path / name, "--model", tmp_path, "--modules",
                       "q_proj,o_proj,out_proj", "--rank", rank).code == 0
    out = tmp_path / "pool.safetensors"
    packed = metrale("pack", tmp_path / "a", tmp_path / "b", "--max-loras", 3, "--out", out)
    assert packed.code == 0
    image = PoolImage.open(out)
    rng = np.random.default_rng(0)
    for entry, e in enumerate(image.layout.entries):
        x = rng.standard_normal((3, e.in_dim)).astype(np.float32)
        for slot in range(3):
            got = namespace["pool_delta"](str(out), entry, slot, x)
            factors = image.factors(entry, slot)
            if factors is None:
                assert got is None
                continue
            a, b = factors
            np.testing.assert_allclose(got, float(image.scales[slot]) * (x @ a.T) @ b.T,
                                       rtol=1e-5, atol=1e-6)


def test_every_finding_code_is_documented() -> None:
    """docs/inspect.md lists every stable finding code the audit can emit."""
    package = DOCS.parent / "metrale_cli"
    source = "".join((package / f"{name}.py").read_text()
                     for name in ("audit", "experts", "overlays", "findings"))
    emitted = set(re.findall(r'Severity\.[A-Z]+(?: if [^,]+ else Severity\.[A-Z]+)?, "([a-z_]+)"',
                             source))
    # The audit's tables: (tensor part, code, what) and (config check, code, message).
    part = r"lora_[A-Za-z_.]+|base_layer\.\w+|weight|bias"
    emitted |= set(re.findall(rf'\("(?:{part})", "([a-z_]+)", "', source))
    emitted |= set(re.findall(r'(?:\)\)|True|\(None, "none"\)), "([a-z_]+)",\s*\n', source))
    emitted |= {"missing_a", "missing_b"}  # built as f"missing_{a|b}"
    documented = set(re.findall(r"`([a-z_]+)`", (DOCS / "inspect.md").read_text()))
    assert len(emitted) > 30
    assert emitted - documented == set()


def test_every_environment_variable_is_documented() -> None:
    """docs/cli.md states every METRALE_* variable env.py reads, and the booleans' spellings."""
    source = (DOCS.parent / "metrale_cli" / "env.py").read_text()
    read = set(re.findall(r'"(METRALE_[A-Z_]+)"', source))
    text = (DOCS / "cli.md").read_text()
    documented = set(re.findall(r"^\| `(METRALE_[A-Z_]+)` \|", text, re.M))
    assert len(read) >= 4 and read == documented
    from metrale_cli.env import FALSE, TRUE

    assert all(f"`{word}`" in text for word in (*TRUE, *FALSE))
