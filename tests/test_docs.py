"""The docs hold: the pool-format reader in docs/pool-format.md gives the same delta as
metrale's own reading of the image, docs/inspect.md documents exactly the finding codes, and every
file the docs name by path exists."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from metrale_cli.adapters.findings import Code, Collector, Severity
from metrale_cli.errors import UsageError
from metrale_cli.image.pool_image import PoolImage
from tests.support.cli_runner import metrale

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
            factors = image.region.factors(entry, slot)
            if factors is None:
                assert got is None
                continue
            a, b = factors
            np.testing.assert_allclose(got, float(image.scales[slot]) * (x @ a.T) @ b.T,
                                       rtol=1e-5, atol=1e-6)


def test_every_finding_code_is_documented() -> None:
    """docs/inspect.md's findings table lists every code of `Code`, and documents none that
    `Code` lacks (the audit cannot emit a code outside `Code`: the collector converts)."""
    text = (DOCS / "inspect.md").read_text()
    table = text[text.index("| code | severity | when |"):]
    documented = {code for row in table.splitlines() if row.startswith("| `")
                  for code in re.findall(r"`([a-z_]+)`", row.split("|")[1])}
    assert {c.value for c in Code} - documented == set()
    assert documented - {c.value for c in Code} == set()


def test_a_code_outside_the_enum_is_refused() -> None:
    with pytest.raises(ValueError, match="not_a_code"):
        Collector().add(Severity.ERROR, "not_a_code", "x")  # type: ignore[arg-type]


def test_every_environment_variable_is_documented() -> None:
    """docs/cli.md states every METRALE_* variable env.py reads, and the booleans' spellings."""
    source = (DOCS.parent / "metrale_cli" / "env.py").read_text()
    read = set(re.findall(r'"(METRALE_[A-Z_]+)"', source))
    text = (DOCS / "cli.md").read_text()
    documented = set(re.findall(r"^\| `(METRALE_[A-Z_]+)` \|", text, re.M))
    assert len(read) >= 4 and read == documented
    from metrale_cli.env import FALSE, TRUE

    assert all(f"`{word}`" in text for word in (*TRUE, *FALSE))


def test_the_readme_bit_flip_recipe_uses_public_names_and_flips_the_bit(tmp_path: Path) -> None:
    """README's recipe for a `bad.safetensors` imports only from `metrale` (deep paths are
    unstable, docs/library.md) and makes the image `verify` then names: slot 1, layer 7,
    v_proj, B."""
    text = (DOCS.parent / "README.md").read_text()
    code = re.search(r"\$ python - <<'EOF'\n(.*?)\nEOF\n", text, re.S).group(1)
    assert re.findall(r"^(?:from|import) (\S+)", code, re.M) == ["metrale"]
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 32, "num_hidden_layers": 8,
        "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 48}))
    for name, rank in (("chat", 4), ("code", 2)):
        assert metrale("synth", tmp_path / name, "--model", tmp_path, "--modules",
                       "q_proj,v_proj", "--rank", rank).code == 0
    image = tmp_path / "bad.safetensors"
    assert metrale("pack", tmp_path / "chat", tmp_path / "code", "--max-loras", 2,
                   "--device", "cpu", "--out", image).code == 0
    before = image.read_bytes()
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        exec(compile(code, "README.md", "exec"), {})
    after = image.read_bytes()
    assert sum(bin(x ^ y).count("1") for x, y in zip(before, after, strict=True)) == 1
    verdict = metrale("verify", image, tmp_path / "chat", tmp_path / "code", "--json")
    assert verdict.code == 1
    differing = [(a["slot"], d["layer"], d["module"], d["part"])
                 for a in verdict.json()["adapters"] for d in a["differences"]]
    assert differing == [(1, 7, "v_proj", "B")]
    (tmp_path / "good.safetensors").write_bytes(before)  # the flipped one fails its digest
    with pytest.raises(UsageError, match="part must be 'A' or 'B'"):
        PoolImage.open(tmp_path / "good.safetensors").region.file_offset(0, 0, "b")


# -- the files the docs name ----------------------------------------------------------------------

# A path in the checkout as the docs write one: `tests/test_show.py`, scripts/gpu_check.sh.
CHECKOUT_PATH = re.compile(r"(?<![\w./-])((?:tests|docs|scripts|kernels|metrale_cli)/[\w./-]*\w"
                           r"\.(?:py|md|sh|cu|cuh|h|json))\b")


def test_every_file_the_docs_name_exists() -> None:
    """README.md, tests/README.md (the suite's map), kernels/README.md and docs/*.md name test
    files, scripts and modules by path: a renamed or split file leaves none of them stale."""
    root = DOCS.parent
    documents = [root / "README.md", root / "tests" / "README.md", root / "kernels" / "README.md",
                 *sorted(DOCS.glob("*.md"))]
    named = {(doc.relative_to(root), found) for doc in documents
             for found in CHECKOUT_PATH.findall(doc.read_text())}
    assert len(named) > 100  # the pattern finds what the docs name
    assert [(str(doc), path) for doc, path in sorted(named) if not (root / path).exists()] == []
