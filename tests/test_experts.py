"""The expert pool against PEFT: for expert adapters made by the real peft library (transformers-5
fused `target_parameters`, and PEFT's own rewrite of gate/up/down targets) and for hand-made
transformers-4 per-expert adapters, each expert's delta weight read from the pool image
(`scales[k] * B @ A`, docs/pool-format.md) equals PEFT's `get_delta_weight` for that expert."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from metrale_cli.adapters.adapter import Adapter
from metrale_cli.adapters.audit import audit
from metrale_cli.adapters.experts import ExpertProj
from metrale_cli.image.pool_image import PoolImage
from metrale_cli.layout.expert_layout import ExpertLayout
from metrale_cli.layout.slot_layout import SlotLayout
from metrale_cli.model.config import ModelConfig
from metrale_cli.model.resolve import resolve_model
from metrale_cli.pool.pool import LoraPool
from tests.support.cli_runner import metrale
from tests.support.peft_factory import AdapterTruth, HandV4Truth, peft_v4_expert_deltas

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ROUTER = ["mlp.gate.weight"]


def image_expert_delta(image: PoolImage, slot: int, layer: int, proj: str,
                       expert: int) -> np.ndarray | None:
    """The documented formula over the image's tensors alone."""
    assert image.expert_layout is not None
    entry = image.expert_layout.index.get((layer, ExpertProj(proj), expert))
    if entry is None:
        return None
    assert image.expert_region is not None
    factors = image.expert_region.factors(entry, slot)
    if factors is None:
        return None
    a, b = factors
    return float(image.scales[slot]) * (b.astype(np.float64) @ a.astype(np.float64))


def assert_close(got: np.ndarray | None, want: np.ndarray, what: object) -> None:
    assert got is not None, what
    scale = float(np.abs(want).max()) or 1.0
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-2 * scale, err_msg=str(what))


def pack_image(tmp_path: Path, *paths: object, extra: tuple[object, ...] = ()) -> PoolImage:
    out = tmp_path / "pool.safetensors"
    args = [f"a{i}={p}" for i, p in enumerate(paths)]
    result = metrale("pack", *args, "--max-loras", len(paths) + 1, "--experts", "--out", out,
                     "--json", *extra)
    assert result.code == 0, result.stderr
    return PoolImage.open(out)


def check_truth(image: PoolImage, slot: int, truth: AdapterTruth) -> int:
    want = truth.per_expert_deltas()
    assert want, "the adapter has no expert parameters"
    for key, delta in want.items():
        assert_close(image_expert_delta(image, slot, *key), delta, key)
    # Nothing else in the slot's expert region is adapted.
    assert image.expert_region is not None
    assert int(image.expert_region.adapted(slot).sum()) == len(want)
    return len(want)


# -- transformers-5 fused adapters made by PEFT ------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("model", ["qwen3_moe", "qwen3_next", "qwen3_5_moe", "mixtral"])
def test_fused_experts_and_router_equal_peft(peft_zoo, model: str, tmp_path: Path) -> None:
    truth = peft_zoo.adapter(model, r=4, lora_alpha=8, target_modules=["q_proj"],
                             target_parameters=EXPERTS + ROUTER)
    assert {p.param for p in truth.params.values()} == {"gate_up_proj", "down_proj", "weight"}
    image = pack_image(tmp_path, truth.path)
    assert check_truth(image, 0, truth) > 0
    assert image.expert_region is not None
    assert not image.expert_region.adapted(1).any()  # the cache slot adapts nothing


@pytest.mark.slow
def test_gpt_oss_interleaved_in_out_experts_equal_peft(peft_zoo, tmp_path: Path) -> None:
    """gpt_oss's experts are `(E, in, out)` with gate and up interleaved along gate_up's
    columns (`gate_up[..., ::2]`, `[..., 1::2]`). Its experts are marked `is_transposed`, so
    PEFT keeps A `[E*r, in]`, B `[out, E*r]` and adds `(B_e A_e)^T` to each expert's
    `[in, out]`: read back from the pool as `[out, in]`, gate is the even rows of that, up the
    odd ones. The stacked reading (gate the first half) fails this."""
    truth = peft_zoo.adapter("gpt_oss", r=4, lora_alpha=8, target_modules=["q_proj"],
                             target_parameters=EXPERTS)
    model = json.loads((truth.base_dir / "config.json").read_text())
    hidden, inter = model["hidden_size"], model["intermediate_size"]
    gate_up = next(p for p in truth.params.values() if p.param == "gate_up_proj")
    assert gate_up.in_out and gate_up.expert_deltas.shape[1:] == (hidden, 2 * inter)
    assert gate_up.a_shape[1] == hidden and gate_up.b_shape[0] == 2 * inter
    image = pack_image(tmp_path, truth.path)
    assert check_truth(image, 0, truth) > 0
    stacked = gate_up.expert_deltas[0].numpy().T[:inter]  # expert 0's first half: not gate
    with pytest.raises(AssertionError):
        assert_close(image_expert_delta(image, 0, gate_up.layer, "gate_proj", 0), stacked, 0)


@pytest.mark.slow
def test_llama4_swapped_experts_equal_peft(peft_zoo, tmp_path: Path) -> None:
    """llama4's experts are `(E, in, out)` but not marked `is_transposed`, so PEFT swaps in and
    out: gate_up's A `[E*r, 2I]`, B `[H, E*r]`, and the delta on expert e's `[in, out]` is
    `B_e A_e`. The pool reads A's side as B and B's as A (read unswapped, the shapes fit
    neither parameter)."""
    params = [p.replace("mlp.", "feed_forward.") for p in EXPERTS]
    truth = peft_zoo.adapter("llama4", r=4, lora_alpha=8, target_modules=["q_proj"],
                             target_parameters=params)
    gate_up = next(p for p in truth.params.values() if p.param == "gate_up_proj")
    assert gate_up.a_shape == (4 * 4, 2 * 40) and gate_up.b_shape == (64, 4 * 4)
    image = pack_image(tmp_path, truth.path)
    assert check_truth(image, 0, truth) == 2 * 4 * 3


@pytest.mark.slow
@pytest.mark.parametrize("param", EXPERTS)
def test_one_fused_parameter_is_told_apart_by_shapes(peft_zoo, param: str,
                                                     tmp_path: Path) -> None:
    """With one parameter targeted the key has no `.base_layer.` for either: qwen3_next's
    H = 2 * I_e makes B's out-dim the same for both, so only A's in-dim tells them apart."""
    truth = peft_zoo.adapter("qwen3_next", r=4, lora_alpha=8, target_modules=["q_proj"],
                             target_parameters=[param], seed=3)
    assert not any(".base_layer." in k for k in truth.tensors)
    image = pack_image(tmp_path, truth.path)
    check_truth(image, 0, truth)


@pytest.mark.slow
def test_rewrite_rank_2r_with_rslora_and_patterns(peft_zoo, tmp_path: Path) -> None:
    """PEFT's transformers-5 rewrite of gate/up/down targets: gate_up at rank 2r and alpha
    2*alpha (rsLoRA makes its scaling sqrt(2) larger: what PEFT computes is the truth), the
    router through `gate`, in one pool with a second adapter of another rank and scale."""
    rewrite = peft_zoo.adapter("qwen3_moe", r=4, lora_alpha=8, use_rslora=True,
                               target_modules=["q_proj", "gate_proj", "up_proj", "down_proj",
                                               "gate"])
    gate_up = [p for p in rewrite.params.values() if p.param == "gate_up_proj"]
    assert gate_up and gate_up[0].r == 8 and rewrite.config["rank_pattern"]
    plain = peft_zoo.adapter("qwen3_moe", r=2, lora_alpha=3, dtype="bf16",
                             target_modules=["q_proj"], target_parameters=EXPERTS, seed=5)
    image = pack_image(tmp_path, rewrite.path, plain.path)
    assert image.expert_layout is not None and image.expert_layout.max_rank == 8
    check_truth(image, 0, rewrite)
    check_truth(image, 1, plain)


@pytest.mark.slow
def test_inspect_shows_expert_coverage_and_bytes(peft_zoo) -> None:
    truth = peft_zoo.adapter("qwen3_next", r=4, lora_alpha=8, target_modules=["q_proj"],
                             target_parameters=EXPERTS + ROUTER)
    result = metrale("inspect", truth.path, "--experts", "--json")
    assert result.code == 0, result.stdout
    report = result.json()["adapters"][0]
    assert report["servable"]
    # tiny qwen3_next: layer 0 is dense (mlp_only_layers), layers 1-3 have 4 experts each.
    assert [c["layer"] for c in report["expert_coverage"]] == [1, 2, 3]
    assert report["expert_coverage"][0]["experts"] == {"gate_proj": 4, "up_proj": 4,
                                                       "down_proj": 4}
    assert report["expert_coverage"][0]["router"]
    assert report["expert_pairs"] == 3 * (1 + 4 * 3)
    assert report["own_expert_slot_bytes"] > 0
    text = metrale("inspect", truth.path, "--experts")
    assert "expert coverage" in text.stdout and "expert slot" in text.stdout


@pytest.mark.slow
def test_without_the_opt_in_refused_with_how_to_enable(peft_zoo, monkeypatch) -> None:
    monkeypatch.delenv("METRALE_LORA_EXPERTS", raising=False)
    truth = peft_zoo.adapter("qwen3_moe", r=4, lora_alpha=8, target_modules=["q_proj"],
                             target_parameters=EXPERTS)
    result = metrale("inspect", truth.path, "--json")
    assert result.code == 1
    finding = next(f for f in result.json()["adapters"][0]["findings"]
                   if f["code"] == "expert_lora")
    assert "--experts" in finding["message"] and "METRALE_LORA_EXPERTS=1" in finding["message"]
    refused = metrale("pack", truth.path, "--max-loras", 1)
    assert refused.code == 1 and "expert_lora" in refused.stderr
    assert "Traceback" not in refused.stderr
    # The environment opt-in is the same switch.
    monkeypatch.setenv("METRALE_LORA_EXPERTS", "1")
    cfg = ModelConfig.from_hf(truth.base_dir)
    assert audit(Adapter.load(truth.path), cfg).servable


@pytest.mark.slow
def test_shared_expert_keys_are_refused_precisely(peft_zoo) -> None:
    """Qwen3.5-MoE: PEFT 0.21 does not rewrite there, so shared-expert targets get LoRA."""
    truth = peft_zoo.adapter("qwen3_5_moe", r=4, lora_alpha=8,
                             target_modules=["q_proj", "shared_expert.gate_proj",
                                             "shared_expert_gate"])
    assert any("shared_expert" in p for p in truth.modules)
    result = metrale("inspect", truth.path, "--experts", "--json")
    assert result.code == 1
    messages = [f["message"] for f in result.json()["adapters"][0]["findings"]
                if f["code"] == "unservable_module"]
    assert any("shared-expert projection" in m and "expert pool" in m for m in messages)
    assert any("shared-expert gate" in m for m in messages)


# -- hand-made transformers-4 per-expert adapters ----------------------------------------------


def check_v4(image: PoolImage, slot: int, truth: HandV4Truth) -> None:
    proj = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj",
            "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    for (layer, e, leaf), pair in truth.experts.items():
        got = image_expert_delta(image, slot, layer, proj[leaf], e)
        assert_close(got, pair.delta_weight.numpy(), (layer, e, leaf))
    for layer, pair in truth.routers.items():
        assert_close(image_expert_delta(image, slot, layer, "router", -1),
                     pair.delta_weight.numpy(), (layer, "router"))


@pytest.mark.slow
@pytest.mark.parametrize("model", ["qwen3_moe", "mixtral"])
def test_v4_per_expert_adapters_equal_peft(peft_zoo, model: str, tmp_path: Path) -> None:
    truth = peft_zoo.hand_v4(model, r=4, alpha=8, include_router=True)
    image = pack_image(tmp_path, truth.path)
    check_v4(image, 0, truth)
    # PEFT loading the v4 file (state-dict conversion to fused wrappers) agrees.
    peft = peft_v4_expert_deltas(truth)
    leaf_proj = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    for (layer, e, leaf), delta in peft.items():
        proj = "router" if leaf == "gate" else leaf_proj.get(leaf, leaf)
        assert_close(image_expert_delta(image, 0, layer, proj, e), delta.numpy(),
                     (layer, e, leaf))


@pytest.mark.slow
def test_v4_rslora_serves_the_trained_scaling(peft_zoo, tmp_path: Path) -> None:
    truth = peft_zoo.hand_v4("qwen3_moe", r=4, alpha=8, use_rslora=True, dtype="bf16", seed=2)
    result = metrale("inspect", truth.path, "--experts", "--json")
    codes = {f["code"] for f in result.json()["adapters"][0]["findings"]}
    assert "rslora_rewrite" in codes
    image = pack_image(tmp_path, truth.path)
    check_v4(image, 0, truth)


# -- the pool: clear, swap, land keep the expert pool consistent --------------------------------


@pytest.mark.slow
def test_pool_clear_swap_land_keep_experts_consistent(peft_zoo, tmp_path: Path) -> None:
    fused = peft_zoo.adapter("qwen3_moe", r=4, lora_alpha=8, target_modules=["q_proj"],
                             target_parameters=EXPERTS)
    attn = peft_zoo.adapter("qwen3_moe", r=4, lora_alpha=8, target_modules=["q_proj"], seed=9)
    cfg = ModelConfig.from_hf(fused.base_dir)
    reports = [audit(Adapter.load(p), cfg, experts_enabled=True)
               for p in (fused.path, attn.path)]
    layout = SlotLayout.build(cfg, reports[0].module_set, 4)
    ex = ExpertLayout.for_pairs(cfg, reports[0].expert_pairs, 4)
    pool, _ = LoraPool.load(layout, 3, reports[:1], expert_layout=ex)
    experts = pool.expert_region
    assert experts is not None
    size = ex.slot_bytes
    assert experts.memory[:size].any()
    pool.swap_in(2, reports[0])
    assert np.array_equal(experts.memory[2 * size:], experts.memory[:size])
    pool.swap_in(2, reports[1])  # no expert pairs: region and tables back to zero
    assert not experts.memory[2 * size:].any()
    assert not experts.a_tables[:, 2].any()
    pool.land_slot(1, pool, 0)
    a_offsets, _ = experts.offset_tables()
    a0, a1 = a_offsets[:, 0], a_offsets[:, 1]
    assert np.array_equal(a1[a1 >= 0] - size, a0[a0 >= 0])
    pool.clear_slot(1)
    assert not experts.memory[size:2 * size].any() and not experts.a_tables[:, 1].any()
    with pytest.raises(Exception, match="expert pool"):
        LoraPool.load(layout, 1, reports[:1])  # an expert adapter needs the expert pool


# -- layout --experts without adapters -----------------------------------------------------------


@pytest.mark.slow
def test_layout_experts_qwen3_next_80b_r16() -> None:
    """Every routed expert's gate/up/down and the router on all 48 MoE layers at r=16: per
    expert (16*2048 + 512*16) * 2 B * 2 (gate, up) + (16*512 + 2048*16) * 2 B (down) = 245,760 B;
    x 512 experts x 48 layers + 48 routers of (16*2048 + 512*16) * 2 B: about 6.04 GB a slot."""
    result = metrale("layout", "-m", "qwen3-next-80b-a3b", "--experts", "--max-rank", 16,
                     "--modules", "q_proj,k_proj,v_proj,o_proj,out_proj", "--max-loras", 4,
                     "--json")
    assert result.code == 0, result.stderr
    doc = result.json()
    ex = doc["experts"]
    assert ex["expert_slot_bytes"] == 48 * (512 * 245_760 + 81_920) == 6_043_729_920
    assert ex["n_entries"] == 48 * (1 + 512 * 3)
    assert doc["slot_bytes"] == 15_335_424  # ~15 MB of attention beside ~6 GB of experts
    assert doc["total_bytes"] == (4 * (doc["slot_bytes"] + ex["expert_slot_bytes"])
                                  + doc["table_bytes"] + ex["table_bytes"])
    budget = metrale("layout", "-m", "qwen3-next-80b-a3b", "--experts", "--max-rank", 16,
                     "--modules", "q_proj", "--budget", "40GiB", "--json").json()
    # 40 GiB = 42.9 GB over ~6.05 GB a slot (both pools and their tables): 7 slots.
    assert budget["max_loras"] == 7
    assert budget["total_bytes"] <= 40 * 2**30


def test_layout_experts_needs_a_moe_model() -> None:
    result = metrale("layout", "-m", "llama-3.1-8b", "--experts", "--max-rank", 8)
    assert result.code == 2 and "no routed experts" in result.stderr


def test_moe_layers_follow_transformers() -> None:
    assert resolve_model("qwen3-next-80b-a3b").moe_layers == list(range(48))
    cfg = ModelConfig.from_dict({"model_type": "qwen3_moe", "hidden_size": 64,
                                 "num_hidden_layers": 4, "num_attention_heads": 4,
                                 "num_experts": 4, "num_experts_per_tok": 2,
                                 "moe_intermediate_size": 8, "mlp_only_layers": [0],
                                 "decoder_sparse_step": 2})
    assert cfg.moe_layers == [1, 3]
