"""The pool image against PEFT's own forward pass: for adapters made by the real peft library
on tiny models of every supported model type, `scales[k] * (x @ A[:r].T) @ B[:, :r].T` read from
the image equals PEFT's forward delta of every adapted module within BF16 tolerance."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from metrale_cli.bf16 import bf16_to_f32
from metrale_cli.image.pool_image import PoolImage
from metrale_cli.model.modules import LoraModule
from tests.support.cli_runner import metrale
from tests.support.peft_factory import AdapterTruth

pytestmark = pytest.mark.slow
_LAYERED = re.compile(r"^model\.(?:language_model\.)?layers\.(\d+)\.(.+)$")
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
# Per model type, the pool modules its PEFT adapters can carry.
POOL_TARGETS = {
    "llama": ATTN + MLP, "mistral": ATTN + MLP, "qwen2": ATTN + MLP, "qwen3": ATTN + MLP,
    "qwen3_moe": ATTN, "mixtral": ATTN, "qwen3_next": ATTN + ["out_proj"],
    "qwen3_5": ATTN + ["out_proj"] + MLP, "qwen3_5_vl": ATTN + ["out_proj"] + MLP,
    "qwen3_5_text_on_vl": ATTN + ["out_proj"] + MLP, "qwen3_5_moe": ATTN + ["out_proj"],
    "qwen3_5_moe_vl": ATTN + ["out_proj"],
}


def image_delta(image: PoolImage, entry: int, slot: int, x: np.ndarray) -> np.ndarray:
    """The documented formula, reading only the image's tensors (docs/pool-format.md)."""
    e = image.layout.entries[entry]
    r, max_rank = int(image.ranks[slot]), image.layout.max_rank
    region = image.region
    a_off, b_off = int(region.a_offsets[entry, slot]), int(region.b_offsets[entry, slot])
    a = bf16_to_f32(region.memory[a_off:a_off + max_rank * e.in_dim * 2].view("<u2"))
    b = bf16_to_f32(region.memory[b_off:b_off + e.out_dim * max_rank * 2].view("<u2"))
    a = a.reshape(max_rank, e.in_dim)[:r]
    b = b.reshape(e.out_dim, max_rank)[:, :r]
    return float(image.scales[slot]) * (x @ a.T) @ b.T


def check_image(image: PoolImage, slot: int, truth: AdapterTruth) -> int:
    """Compare every adapted module of `truth` in `slot`; returns how many were compared."""
    rng = np.random.default_rng(slot)
    compared = 0
    for path, m in truth.modules.items():
        hit = _LAYERED.match(path)
        layer, sub = int(hit.group(1)), hit.group(2)
        module = next(mod for mod in LoraModule if mod.peft_path == sub)
        entry = image.layout.index[(layer, module)]
        x = rng.standard_normal((5, m.base_in)).astype(np.float32)
        want = truth.forward_delta(path, torch.from_numpy(x)).numpy()
        got = image_delta(image, entry, slot, x)
        scale = np.abs(want).max()
        np.testing.assert_allclose(got, want, rtol=0, atol=3e-2 * scale, err_msg=path)
        compared += 1
    return compared


@pytest.mark.parametrize("model", sorted(POOL_TARGETS))
def test_image_delta_equals_peft_forward(peft_zoo, model: str, tmp_path: Path) -> None:
    truth = peft_zoo.adapter(model, r=4, lora_alpha=8, target_modules=POOL_TARGETS[model])
    out = tmp_path / "pool.safetensors"
    result = metrale("pack", truth.path, "--max-loras", 2, "--out", out)
    assert result.code == 0, result.stderr
    image = PoolImage.open(out)
    assert check_image(image, 0, truth) == len(truth.modules)
    assert not image.region.adapted(1).any()  # the cache slot adapts nothing
    assert float(image.scales[1]) == 0.0


def test_several_ranks_patterns_and_dtypes_in_one_pool(peft_zoo, tmp_path: Path) -> None:
    """Different ranks, rsLoRA with rank/alpha patterns (folded into B), F32/BF16/F16 files."""
    adapters = [
        peft_zoo.adapter("qwen3_next", r=4, lora_alpha=8, target_modules=ATTN + ["out_proj"]),
        peft_zoo.adapter("qwen3_next", r=8, lora_alpha=16, use_rslora=True, dtype="bf16",
                         target_modules=["q_proj", "v_proj", "out_proj"],
                         rank_pattern={"v_proj": 2, "layers.2.linear_attn.out_proj": 6},
                         alpha_pattern={"q_proj": 5}),
        peft_zoo.adapter("qwen3_next", r=2, lora_alpha=3, dtype="f16", seed=7,
                         target_modules=["o_proj", "k_proj"]),
    ]
    out = tmp_path / "pool.safetensors"
    args = [f"n{i}={t.path}" for i, t in enumerate(adapters)]
    result = metrale("pack", *args, "--max-loras", 4, "--out", out, "--json")
    assert result.code == 0, result.stderr
    doc = result.json()
    assert doc["layout"]["max_rank"] == 8
    image = PoolImage.open(out)
    assert [int(r) for r in image.ranks] == [4, 8, 2, 0]
    for slot, truth in enumerate(adapters):
        assert check_image(image, slot, truth) == len(truth.modules)
    # The slot scale is the adapter's config scaling; per-module ratios live in B.
    assert float(image.scales[1]) == pytest.approx(16 / 8**0.5)
