"""The pool image: its bytes are pinned (a refactor of the pool must not move one), and an
image is validated at open, so that landing one never yields a pointer outside the pool."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from metrale_cli.image import PoolImage
from metrale_cli.models import ModelConfig
from metrale_cli.modules import LoraModule
from metrale_cli.synth import synth_adapter
from tests.cli_runner import metrale

DENSE = {
    "model_type": "qwen3_next", "hidden_size": 32, "num_hidden_layers": 4,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
    "intermediate_size": 48, "linear_num_value_heads": 3, "linear_value_head_dim": 8,
    "full_attention_interval": 2,
}
MOE = {
    "model_type": "qwen3_moe", "hidden_size": 32, "num_hidden_layers": 3,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
    "intermediate_size": 48, "num_experts": 4, "moe_intermediate_size": 8,
    "mlp_only_layers": [0], "vocab_size": 64,
}
# sha256 of the images `pinned_images` packs, written before the pool's region refactor: the
# image format and bytes must not change.
PINNED = {
    "dense": "5faa2a9e97fbcf82b53e3ad1fee4182bb2e9d8b99d8a1f9c2e7c2251a071cf87",
    "experts": "9266f9dc6eb6cf9d21fe7949fef4124c31d2a810a5fd3c3b959a6ee29c1eed67",
}


def pinned_images(root: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """Pack deterministic synthetic adapters (relative paths, so `source` is stable)."""
    monkeypatch.chdir(root)
    for name, config in (("dense", DENSE), ("moe", MOE)):
        Path(name).mkdir()
        Path(name, "config.json").write_text(json.dumps(config))
    made = {
        "a": ("dense", "q_proj,k_proj,v_proj,o_proj,out_proj", 4, "bf16", []),
        "b": ("dense", "q_proj,v_proj,out_proj", 2, "f32", ["--rslora", "--seed", "1"]),
        "c": ("dense", "q_proj,out_proj", 3, "f16", ["--seed", "2"]),
    }
    for name, (model, modules, rank, dtype, extra) in made.items():
        result = metrale("synth", name, "--model", model, "--modules", modules, "--rank", rank,
                         "--dtype", dtype, *extra)
        assert result.code == 0, result.stderr
    moe = ModelConfig.from_hf("moe")
    synth_adapter("e", moe, "moe", [LoraModule.Q_PROJ, LoraModule.O_PROJ], 4, dtype="f32",
                  seed=3, expert_layers=2)
    synth_adapter("f", moe, "moe", [LoraModule.Q_PROJ], 2, dtype="bf16", seed=4,
                  expert_layers=1)
    out = {"dense": Path("dense.safetensors"), "experts": Path("experts.safetensors")}
    packed = metrale("pack", "a", "b", "c", "--model", "dense", "--max-loras", 5,
                     "--max-rank", 8, "--device", "cpu", "--out", out["dense"])
    assert packed.code == 0, packed.stderr
    packed = metrale("pack", "e", "f", "--model", "moe", "--max-loras", 3, "--experts",
                     "--device", "cpu", "--out", out["experts"])
    assert packed.code == 0, packed.stderr
    return out


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_image_bytes_are_pinned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    images = pinned_images(tmp_path, monkeypatch)
    assert {name: sha256(path) for name, path in images.items()} == PINNED
    experts = PoolImage.open(images["experts"])
    assert experts.expert_region is not None and experts.expert_region.memory.any()
