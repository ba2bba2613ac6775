"""`metrale unpack`: a slot back as a PEFT adapter that PEFT itself loads onto the tiny model, with
forward deltas equal to the original adapter's within BF16 tolerance; atomic, no overwrite."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.cli_runner import metrale
from tests.peft_factory import TINY_MODELS, AdapterTruth

pytestmark = pytest.mark.slow
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


def _load_unpacked(truth: AdapterTruth, path: Path, seed: int = 0) -> object:
    from peft import PeftModel

    model = TINY_MODELS[truth.model_name].build_model(seed)
    return PeftModel.from_pretrained(model, str(path)).eval()


def _assert_deltas_equal(truth: AdapterTruth, unpacked: object) -> int:
    rng = np.random.default_rng(0)
    compared = 0
    for path, m in truth.modules.items():
        layer = unpacked.base_model.model.get_submodule(path)  # type: ignore[attr-defined]
        x = torch.from_numpy(rng.standard_normal((5, m.base_in)).astype(np.float32))
        want = truth.forward_delta(path, x).numpy()
        with torch.no_grad():
            got = (layer(x) - layer.base_layer(x)).float().numpy()
        np.testing.assert_allclose(got, want, rtol=0, atol=3e-2 * np.abs(want).max(),
                                   err_msg=path)
        compared += 1
    return compared


CASES = {
    "dense": ("llama", {"r": 4, "lora_alpha": 8, "target_modules": ATTN + MLP}),
    "hybrid": ("qwen3_next", {"r": 8, "lora_alpha": 16, "use_rslora": True, "dtype": "bf16",
                              "target_modules": ["q_proj", "v_proj", "out_proj"],
                              "rank_pattern": {"v_proj": 2, "layers.2.linear_attn.out_proj": 6},
                              "alpha_pattern": {"q_proj": 5}}),
    "moe attention": ("qwen3_moe", {"r": 4, "lora_alpha": 8, "target_modules": ATTN}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_peft_loads_the_unpacked_slot(peft_zoo, tmp_path: Path, case: str) -> None:
    model, kwargs = CASES[case]
    truth = peft_zoo.adapter(model, **kwargs)
    image = tmp_path / "pool.safetensors"
    assert metrale("pack", f"x={truth.path}", "--max-loras", 2, "--out", image).code == 0
    out = tmp_path / "back"
    result = metrale("unpack", image, "--name", "x", out, "--json")
    assert result.code == 0, result.stderr
    assert result.json()["modules"] == len(truth.modules)
    assert _assert_deltas_equal(truth, _load_unpacked(truth, out)) == len(truth.modules)
    # Repacked, the unpacked adapter is byte for byte the slot it came from.
    assert metrale("verify", image, f"x={out}").code == 0


def test_overlays_come_back_as_trainable_tokens(peft_zoo, tmp_path: Path) -> None:
    ids = [0, 5, 7, 127]
    truth = peft_zoo.adapter("llama", r=4, lora_alpha=8, target_modules=["q_proj"],
                             trainable_token_indices=ids)
    image = tmp_path / "pool.safetensors"
    assert metrale("pack", f"t={truth.path}", "--max-loras", 1, "--out", image).code == 0
    out = tmp_path / "back"
    assert metrale("unpack", image, "--slot", 0, out).code == 0
    assert json.loads((out / "adapter_config.json").read_text())[
        "trainable_token_indices"] == {"embed_tokens": ids}
    unpacked = _load_unpacked(truth, out)
    embed = unpacked.base_model.model.model.embed_tokens  # type: ignore[attr-defined]
    want = truth._peft_model.base_model.model.model.embed_tokens
    with torch.no_grad():
        np.testing.assert_array_equal(embed(torch.tensor([ids])).numpy(),
                                      want(torch.tensor([ids])).numpy())
    assert _assert_deltas_equal(truth, unpacked) == len(truth.modules)


def test_no_overwrite_and_bad_slots(peft_zoo, tmp_path: Path) -> None:
    truth = peft_zoo.adapter("llama", r=4, lora_alpha=8, target_modules=["q_proj"])
    image = tmp_path / "pool.safetensors"
    assert metrale("pack", f"x={truth.path}", "--max-loras", 2, "--out", image).code == 0
    out = tmp_path / "back"
    out.mkdir()
    (out / "keep").write_text("mine")
    refused = metrale("unpack", image, "--slot", 0, out)
    assert refused.code == 2 and "--force" in refused.stderr
    assert (out / "keep").read_text() == "mine"
    assert metrale("unpack", image, "--slot", 0, out, "--force").code == 0
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json",
                                                     "adapter_model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".back")]
    for args, message in ((["--slot", 1], "holds no adapter"), (["--slot", 2], "outside"),
                          (["--name", "y"], "(it holds: x)"), ([], "exactly one of")):
        result = metrale("unpack", image, tmp_path / "other", *args)
        assert result.code == 2 and message in result.stderr, result.stderr
        assert result.stderr.count("\n") == 1
