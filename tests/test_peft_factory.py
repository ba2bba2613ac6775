"""Self-tests of the PEFT ground-truth factory: it must record what PEFT really does."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from tests.support.peft_factory import (
    EXPERT_TARGET_PARAMETERS,
    TINY_MODELS,
    AdapterTruth,
    peft_v4_expert_deltas,
    write_base_config,
)
from tests.support.peft_fixtures import PeftZoo


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> PeftZoo:
    # A module-local zoo, so this file runs whether or not conftest registers peft_fixtures.
    return PeftZoo(tmp_path_factory.mktemp("factory_zoo"))


def _file_tensors(truth: AdapterTruth) -> dict[str, torch.Tensor]:
    return load_file(str(truth.path / "adapter_model.safetensors"))


# ---- tiny configs (no PEFT) ------------------------------------------------------------------


@pytest.fixture(scope="module")
def transformers_imported() -> None:
    """write_base_config builds each config with its transformers class: the import (about
    3.5 s) is paid here, in setup, which the cost tiers do not count, not in the test's call."""
    import transformers  # noqa: F401


@pytest.mark.slow  # every family's config class (27 models): over 3 s
def test_base_configs_are_what_the_tool_reads(tmp_path, transformers_imported):
    for name in TINY_MODELS:
        cfg = json.loads((write_base_config(name, tmp_path / name) / "config.json").read_text())
        text = cfg.get("text_config", cfg)
        assert text["hidden_size"] == 64, name
        if "linear_num_key_heads" in text:  # hybrid: both attention kinds must be exercised
            assert set(text["layer_types"]) == {"linear_attention", "full_attention"}, name
    vl_dir = write_base_config("qwen3_5_text_on_vl", tmp_path / "x")
    vl = json.loads((vl_dir / "config.json").read_text())
    assert vl["model_type"] == "qwen3_5"
    assert vl["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert "vision_config" in vl
    qwen3 = TINY_MODELS["qwen3"].config_kwargs
    assert qwen3["head_dim"] != qwen3["hidden_size"] // qwen3["num_attention_heads"]


# ---- make_adapter ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("model_name", sorted(TINY_MODELS))
def test_records_cover_exactly_the_saved_tensors(zoo, model_name):
    truth = zoo.adapter(model_name, r=4, lora_alpha=8)
    recorded = {k for rec in [*truth.modules.values(), *truth.params.values()]
                for k in (rec.a_key, rec.b_key)}  # fmt: skip
    assert recorded == set(truth.tensors)
    assert (truth.base_dir / "config.json").is_file()
    assert truth.config["base_model_name_or_path"] == str(truth.base_dir)
    for rec in truth.modules.values():
        assert truth.tensors[rec.a_key] == ("F32", (rec.r, rec.base_in))
        assert truth.tensors[rec.b_key] == ("F32", (rec.base_out, rec.r))
        assert rec.delta_weight.shape == (rec.base_out, rec.base_in)
        assert rec.delta_weight.abs().max() > 0  # B was randomized


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model_name", "modules"),
    [
        ("llama", ["model.layers.1.self_attn.k_proj", "model.layers.0.mlp.down_proj"]),
        ("qwen3_next", ["model.layers.0.linear_attn.in_proj_qkvz",
                        "model.layers.2.linear_attn.out_proj", "model.layers.3.self_attn.q_proj"]),
        ("qwen3_5_vl", ["model.language_model.layers.0.linear_attn.in_proj_qkv",
                        "model.language_model.layers.1.self_attn.o_proj"]),
    ],
)  # fmt: skip
def test_delta_weight_agrees_with_peft_forward(zoo, model_name, modules):
    truth = zoo.adapter(model_name, r=4, lora_alpha=8)
    gen = torch.Generator().manual_seed(0)
    for path in modules:
        rec = truth.modules[path]
        x = torch.randn(5, rec.base_in, generator=gen)
        torch.testing.assert_close(x @ rec.delta_weight.T, truth.forward_delta(path, x))


@pytest.mark.slow
def test_rank_alpha_patterns_and_rslora_as_in_reference_table(zoo):
    # docs/peft_format.md §1.4: the table checked with PEFT 0.21.2 on a tiny Llama.
    truth = zoo.adapter(
        "llama",
        r=8,
        lora_alpha=16,
        use_rslora=True,
        target_modules=["q_proj", "v_proj", "down_proj"],
        rank_pattern={"v_proj": 4, r"^model\.layers\.1\.self_attn\.q_proj": 2,
                      "layers.0.mlp.down_proj": 16},
        alpha_pattern={"down_proj": 32},
    )  # fmt: skip
    expected = {
        "layers.0.self_attn.q_proj": (8, 16),
        "layers.0.self_attn.v_proj": (4, 16),
        "layers.0.mlp.down_proj": (16, 32),
        "layers.1.self_attn.q_proj": (2, 16),
        "layers.1.self_attn.v_proj": (4, 16),
        "layers.1.mlp.down_proj": (8, 32),
    }
    for suffix, (r, alpha) in expected.items():
        rec = truth.modules[f"model.{suffix}"]
        assert (rec.r, rec.alpha) == (r, alpha), suffix
        assert rec.scaling == pytest.approx(alpha / math.sqrt(r))
        assert rec.a_shape[0] == rec.b_shape[1] == r


@pytest.mark.slow
@pytest.mark.parametrize(("dtype", "st_dtype"), [("bf16", "BF16"), ("f16", "F16")])
def test_low_precision_file_and_exact_truth(zoo, dtype, st_dtype):
    truth = zoo.adapter("qwen3_moe", dtype=dtype, r=4, lora_alpha=8)
    assert truth.dtype == st_dtype
    assert {dt for dt, _ in truth.tensors.values()} == {st_dtype}
    # The recorded delta is a function of the rounded file values, not of float32 originals.
    sd = _file_tensors(truth)
    rec = truth.modules["model.layers.1.self_attn.o_proj"]
    a, b = sd[rec.a_key].float(), sd[rec.b_key].float()
    torch.testing.assert_close(rec.delta_weight, rec.scaling * (b @ a), rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_moe_targets_rewritten_and_expert_deltas_strided(zoo):
    truth = zoo.adapter("qwen3_moe", r=4, lora_alpha=8)
    # PEFT >= 0.19 on transformers 5 moved gate/up/down into target_parameters (§4.4)...
    assert sorted(truth.config["target_parameters"]) == ["down_proj", "gate_up_proj"]
    assert truth.config["rank_pattern"] == {r".*\.gate_up_proj": 8}
    # ...and so the dense layer-0 MLP (mlp_only_layers) lost its LoRA: the upstream bug, recorded.
    assert not any(rec.layer == 0 and ".mlp." in path for path, rec in truth.modules.items())

    sd = _file_tensors(truth)
    for rec in truth.params.values():
        a, b = sd[rec.a_key].float(), sd[rec.b_key].float()
        num_e, r = rec.num_experts, rec.r
        for e in range(num_e):
            # §1.7: A rows expert-major, B columns expert-fastest (column j*E + e).
            a_e = a.reshape(num_e, r, rec.in_features)[e]
            b_e = b.reshape(rec.out_features, r, num_e)[:, :, e]
            torch.testing.assert_close(rec.expert_deltas[e], rec.scaling * (b_e @ a_e))
    gate_up = truth.params["model.layers.1.mlp.experts.gate_up_proj"]
    assert (gate_up.r, gate_up.alpha, gate_up.scaling) == (8, 16, 2.0)
    assert gate_up.expert_deltas.shape == (4, 80, 64)
    assert ".base_layer.lora_A" in gate_up.a_key


@pytest.mark.slow
def test_named_adapter_goes_to_subfolder(zoo):
    truth = zoo.adapter("qwen3", adapter_name="foo", target_modules=["q_proj"])
    assert truth.path.name == "foo"
    assert (truth.path / "adapter_config.json").is_file()
    assert set(truth.modules) == {f"model.layers.{i}.self_attn.q_proj" for i in (0, 1)}
    rec = truth.modules["model.layers.0.self_attn.q_proj"]
    x = torch.randn(2, 64)
    torch.testing.assert_close(truth.forward_delta(rec.path, x), x @ rec.delta_weight.T)


# ---- hand-written transformers-4 expert adapters ----------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("model_name", ["qwen3_moe", "mixtral", "qwen3_next"])
def test_hand_v4_adapter_matches_peft_conversion(zoo, model_name):
    truth = zoo.hand_v4(model_name, r=4, alpha=8, include_router=True, dtype="bf16")
    block = "block_sparse_moe" if model_name == "mixtral" else "mlp"
    assert any(f".{block}.experts.0." in k for k in truth.tensors)
    got = peft_v4_expert_deltas(truth)
    for key, rec in truth.experts.items():
        torch.testing.assert_close(got[key], rec.delta_weight, rtol=1e-6, atol=1e-6)
    for layer, rec in truth.routers.items():
        torch.testing.assert_close(got[(layer, -1, "gate")], rec.delta_weight, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_hand_v4_qwen3_5_moe_is_not_converted_by_peft(zoo):
    # PEFT 0.21.2 maps qwen3_5_moe to no MoE conversion: per-expert v4 keys load as nothing.
    # If this starts failing, PEFT learned the conversion; move the model to the test above.
    truth = zoo.hand_v4("qwen3_5_moe", r=4, alpha=8)
    got = peft_v4_expert_deltas(truth)
    assert not any(key in got for key in truth.experts)


@pytest.mark.slow
def test_rslora_v4_conversion_scales_gate_up_by_sqrt2(zoo):
    # A PEFT 0.21.2 bug the factory exposes: the v4->v5 rewrite doubles r and alpha of the fused
    # gate_up, which keeps alpha/r but not alpha/sqrt(r); down_proj is untouched.
    truth = zoo.hand_v4("qwen3_moe", r=4, alpha=8, use_rslora=True)
    got = peft_v4_expert_deltas(truth)
    gate, down = (1, 0, "gate_proj"), (1, 0, "down_proj")
    torch.testing.assert_close(got[gate], math.sqrt(2) * truth.experts[gate].delta_weight)
    torch.testing.assert_close(got[down], truth.experts[down].delta_weight)


@pytest.mark.slow
def test_explicit_expert_target_parameters_on_qwen3_5_moe(zoo):
    truth = zoo.adapter("qwen3_5_moe", r=4, lora_alpha=8, target_modules=["q_proj"],
                        target_parameters=list(EXPERT_TARGET_PARAMETERS))  # fmt: skip
    # No rewrite for qwen3_5_moe, so no rank doubling: A [E*r, H], B [2*I_e, E*r].
    rec = truth.params["model.layers.0.mlp.experts.gate_up_proj"]
    assert (rec.r, rec.num_experts, rec.a_shape, rec.b_shape) == (4, 4, (16, 64), (80, 16))
