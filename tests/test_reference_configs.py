"""The real adapter_config.json files of PEFT's method comparison suite (Llama-3.2-3B), with
header-only adapter files of their shapes: rsLoRA scaling, PEFT's default targets, DoRA refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.cli_runner import metrale
from tests.support.header_only import write_header_only

# Real files copied into the project (tests/data/PROVENANCE.md says from where).
REFERENCE = Path(__file__).resolve().parent / "data" / "adapter_configs"
PREFIX = "huggingface-peft_method-comparison_llama-3.2-3B-"
# meta-llama/Llama-3.2-3B's text stack.
LLAMA_32_3B = {"model_type": "llama", "hidden_size": 3072, "num_hidden_layers": 28,
               "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128,
               "intermediate_size": 8192, "vocab_size": 128256}
DIMS = {"q_proj": (3072, 3072), "k_proj": (1024, 3072), "v_proj": (1024, 3072),
        "o_proj": (3072, 3072), "gate_proj": (8192, 3072), "up_proj": (8192, 3072),
        "down_proj": (3072, 8192)}
PATH = {m: ("mlp." if m in ("gate_proj", "up_proj", "down_proj") else "self_attn.") + m
        for m in DIMS}


def adapter_from(tmp_path: Path, name: str, modules: list[str], extra: list[str]) -> Path:
    config = json.loads((REFERENCE / f"{PREFIX}{name}.adapter_config.json").read_text())
    out = tmp_path / name
    out.mkdir()
    (out / "adapter_config.json").write_text(json.dumps(config))
    r = config["r"]
    tensors = []
    for layer in range(28):
        for module in modules:
            out_dim, in_dim = DIMS[module]
            key = f"base_model.model.model.layers.{layer}.{PATH[module]}"
            parts = [("lora_A.weight", [r, in_dim]), ("lora_B.weight", [out_dim, r])]
            parts += [(part, [out_dim]) for part in extra]
            tensors += [(f"{key}.{part}", "F32", shape) for part, shape in parts]
    write_header_only(out / "adapter_model.safetensors", tensors)
    return out


@pytest.fixture()
def model(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_32_3B))
    return tmp_path / "config.json"


def test_rslora_r64(tmp_path: Path, model: Path) -> None:
    adapter = adapter_from(tmp_path, "rank64-rslora", ["q_proj", "v_proj"], [])
    result = metrale("inspect", adapter, "--model", model, "--json")
    assert result.code == 0, result.stdout
    report = result.json()["adapters"][0]
    assert report["scaling"] == 8.0  # 64 / sqrt(64), not 1.0
    assert {m["scaling"] for m in report["modules"]} == {8.0}
    # target_modules is null: PEFT's llama default (q_proj, v_proj) explains the keys.
    assert not [f for f in report["findings"] if f["code"] == "unexplained_key"]


def test_mlp_r10(tmp_path: Path, model: Path) -> None:
    adapter = adapter_from(tmp_path, "rank10-target-mlp", ["gate_proj", "up_proj", "down_proj"],
                           [])
    report = metrale("inspect", adapter, "--model", model, "--json").json()["adapters"][0]
    assert report["servable"] and report["rank"] == 10 and report["scaling"] == 2.0
    assert len(report["modules"]) == 28 * 3
    # A rank of 10 pads to the pool's max rank: 16 here.
    padded = metrale("inspect", adapter, "--model", model, "--max-rank", 16, "--json").json()
    assert padded["adapters"][0]["own_slot_bytes"] == 28 * 16 * 2 * 3 * (8192 + 3072)


def test_dora_r32_is_refused(tmp_path: Path, model: Path) -> None:
    adapter = adapter_from(tmp_path, "rank32-dora", ["q_proj", "v_proj"],
                           ["lora_magnitude_vector"])
    result = metrale("inspect", adapter, "--model", model, "--json")
    assert result.code == 1
    report = result.json()["adapters"][0]
    dora = [f for f in report["findings"] if f["code"] == "dora"]
    assert dora and all(f["severity"] == "error" for f in dora)
    refused = metrale("pack", adapter, "--model", model, "--max-loras", 1)
    assert refused.code == 1 and "dora" in refused.stderr
