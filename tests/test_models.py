"""Base-model configs: presets against the real config files, dims against what transformers
builds from them (docs/peft_format.md §3)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from metrale_cli.errors import FormatError, UnsupportedModel, UsageError
from metrale_cli.model.config import PRESETS, LayerType, ModelConfig
from metrale_cli.model.families import FAMILIES
from metrale_cli.model.modules import ALL, LoraModule, family_modules
from metrale_cli.model.resolve import resolve_model
from tests.support.cli_runner import metrale
from tests.support.hostile_inputs import TINY, one_line_error
from tests.test_families import (  # noqa: F401  transformers_models: their fixture
    _TINY,
    META_CASES,
    UNDECLARED,
    _differences,
    _meta_model,
    transformers_models,
)

# Real files copied into the project (tests/data/PROVENANCE.md says from where).
REFERENCE = Path(__file__).resolve().parent / "data" / "model_configs"
REAL = {
    "qwen3-next-80b-a3b": "qwen3-next-80b-a3b-instruct.config.json",
    "qwen3.5-35b-a3b": "qwen3.5-35b-a3b.config.json",
    "qwen3.5-122b-a10b": "qwen3.5-122b-a10b.config.json",
    "qwen3-8b": "qwen3-8b.config.json",
    "qwen3-30b-a3b": "qwen3-30b-a3b.config.json",
    "llama-3.1-8b": "llama-3.1-8b.config.json",
    "mixtral-8x7b": "mixtral-8x7b-v0.1.config.json",
    "gemma-3-27b": "gemma-3-27b-it.config.json",
    "olmo-3-7b": "olmo-3-7b.config.json",
    "gpt-oss-20b": "gpt-oss-20b.config.json",
    "deepseek-v2-lite": "deepseek-v2-lite.config.json",
    "deepseek-v3": "deepseek-v3.config.json",
}


@pytest.mark.parametrize("preset,file", sorted(REAL.items()))
def test_preset_matches_the_real_config(preset: str, file: str) -> None:
    real = ModelConfig.from_hf(REFERENCE / file)
    mine = ModelConfig.preset(preset)
    assert {**real.summary(), "source": ""} == {**mine.summary(), "source": ""}


# (out_dim, in_dim) per module, as transformers instantiates the real configs (on the meta
# device); docs/peft_format.md §3.
DIMS = {
    "qwen3-next-80b-a3b": {"q_proj": (8192, 2048), "k_proj": (512, 2048), "v_proj": (512, 2048),
                           "o_proj": (2048, 4096), "out_proj": (2048, 4096)},
    "qwen3.5-35b-a3b": {"q_proj": (8192, 2048), "k_proj": (512, 2048), "o_proj": (2048, 4096),
                        "out_proj": (2048, 4096)},
    "qwen3.5-122b-a10b": {"q_proj": (16384, 3072), "k_proj": (512, 3072),
                          "o_proj": (3072, 8192), "out_proj": (3072, 8192)},
    "qwen3-8b": {"q_proj": (4096, 4096), "k_proj": (1024, 4096), "o_proj": (4096, 4096),
                 "gate_proj": (12288, 4096), "down_proj": (4096, 12288)},
    "qwen3-30b-a3b": {"q_proj": (4096, 2048), "k_proj": (512, 2048), "o_proj": (2048, 4096)},
    "llama-3.1-8b": {"q_proj": (4096, 4096), "v_proj": (1024, 4096),
                     "up_proj": (14336, 4096), "down_proj": (4096, 14336)},
}
# Gemma 4 (transformers' defaults): sliding layers' widths, then the full layers'.
GEMMA4_SHAPES = {"q_proj": ((2048, 2304), (4096, 2304)), "k_proj": ((1024, 2304), (2048, 2304)),
                 "o_proj": ((2304, 2048), (2304, 4096)), "down_proj": ((2304, 9216),),
                 "per_layer_input_gate": ((256, 2304),), "per_layer_projection": ((2304, 256),)}


@pytest.mark.parametrize("preset", sorted(DIMS))
def test_module_dims(preset: str) -> None:
    cfg = ModelConfig.preset(preset)
    for name, dims in DIMS[preset].items():
        assert LoraModule(name).shapes(cfg) == (dims,), name


def test_gemma4_shapes_by_layer_kind() -> None:
    cfg = ModelConfig.preset("gemma-4-defaults")
    assert cfg.full_attention_layers == [5, 11, 17, 23, 29]
    for name, shapes in GEMMA4_SHAPES.items():
        assert LoraModule(name).shapes(cfg) == shapes, name


def test_hybrid_layer_types_and_applicability() -> None:
    cfg = ModelConfig.preset("qwen3-next-80b-a3b")
    assert cfg.full_attention_layers == list(range(3, 48, 4))
    assert cfg.attn_gated and cfg.num_experts == 512
    q, out, gate = LoraModule.Q_PROJ, LoraModule.OUT_PROJ, LoraModule.GATE_PROJ
    assert q.applies_to_layer(cfg, 3) and not q.applies_to_layer(cfg, 0)
    assert out.applies_to_layer(cfg, 0) and not out.applies_to_layer(cfg, 3)
    assert not any(gate.applies_to_layer(cfg, i) for i in range(48))
    dense = ModelConfig.preset("qwen3.5-9b")
    assert all(gate.applies_to_layer(dense, i) for i in range(32))
    # The seed's eight in their slot order, in the vocabulary and as every seed family's set.
    seed = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
            "out_proj"]
    assert [m.peft_name for m in ALL if m.peft_name in seed] == seed
    for model in (cfg, dense, ModelConfig.preset("llama-3.1-8b")):
        assert [m.peft_name for m in family_modules(model)] == seed


def test_config_rules(tmp_path: Path) -> None:
    base = {"model_type": "qwen3_next", "hidden_size": 64, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96}
    cfg = ModelConfig.from_dict(base)
    assert cfg.head_dim == 16 and cfg.attn_gated
    assert cfg.layer_types[3] is LayerType.FULL_ATTENTION  # transformers' default interval 4
    assert not ModelConfig.from_dict({**base, "attn_output_gate": False}).attn_gated
    llama = ModelConfig.from_dict({**base, "model_type": "llama"})
    assert not llama.attn_gated and set(llama.layer_types) == {LayerType.FULL_ATTENTION}
    gated = ModelConfig.from_dict({**base, "model_type": "llama", "attn_output_gate": True})
    assert gated.attn_gated
    kinds = ["full_attention", "linear_attention"] * 2
    typed = ModelConfig.from_dict({**base, "layer_types": kinds})
    assert typed.linear_attention_layers == [1, 3]
    composite = ModelConfig.from_dict({"model_type": "qwen3_5", "text_config": {
        **base, "model_type": "qwen3_5_text", "full_attention_interval": 2}})
    assert composite.model_type == "qwen3_5" and composite.composite
    assert composite.full_attention_layers == [1, 3]
    with pytest.raises(UnsupportedModel, match="gpt2.*supported: llama"):
        ModelConfig.from_dict({**base, "model_type": "gpt2"})
    with pytest.raises(FormatError, match="layer_types"):
        ModelConfig.from_dict({**base, "layer_types": ["full_attention"]})
    with pytest.raises(FormatError, match="hidden_size"):
        ModelConfig.from_dict({**base, "hidden_size": "big"})


def test_a_mistyped_preset_gets_the_nearest_name() -> None:
    done = metrale("layout", "-m", "llama3.1-8b", "--modules", "q_proj", "--max-rank", 8)
    assert done.code == 2 and done.stderr.count("\n") == 1
    assert done.stderr.startswith("error: --model 'llama3.1-8b': not a preset (did you mean "
                                  "'llama-3.1-8b'?), not a path")
    with pytest.raises(UsageError, match=r"not a preset, not a path"):  # nothing near: no guess
        resolve_model("zzzz")


def test_resolve_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_model("Qwen3-8B").source == "qwen3-8b"
    assert resolve_model("Qwen/Qwen3-Next-80B-A3B-Instruct").model_type == "qwen3_next"
    cfg_dir = tmp_path / "m"
    cfg_dir.mkdir()
    (cfg_dir / "config.json").write_text(json.dumps(PRESETS[4].config))
    assert resolve_model(str(cfg_dir)).hidden_size == 4096
    assert resolve_model(str(cfg_dir / "config.json")).hidden_size == 4096
    # A hub id in the local cache, found offline through refs/main.
    hub = tmp_path / "hub" / "models--acme--tiny"
    snap = hub / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (hub / "refs").mkdir()
    (hub / "refs" / "main").write_text("abc123")
    (snap / "config.json").write_text(json.dumps({**PRESETS[4].config, "num_hidden_layers": 3}))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    found = resolve_model("acme/tiny")
    assert found.num_hidden_layers == 3 and found.source == "acme/tiny"
    with pytest.raises(UsageError, match="not in the local Hugging Face cache"):
        resolve_model("acme/absent")


# -- hostile input: --model resolution and base-model configs that cannot be built -----------------


def test_an_adapter_directory_named_like_a_preset_does_not_hide_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert metrale("synth", "qwen3-8b", "--model", "qwen3-8b", "--modules", "q_proj",
                   "--rank", 8).code == 0
    result = metrale("inspect", "qwen3-8b", "--json")
    assert result.code == 0, result.stderr
    assert result.json()["model"]["source"] == "qwen3-8b"
    # A directory that is no preset and holds no config.json says so.
    (tmp_path / "plain").mkdir()
    missing = metrale("layout", "--model", "plain", "--modules", "q_proj", "--max-rank", 8)
    one_line_error(missing, 2)
    assert "without config.json" in missing.stderr


@pytest.mark.parametrize("edit,says", [
    ({"head_dim": 0}, "'head_dim' missing or not a positive integer"),
    ({"num_key_value_heads": 7}, "'num_key_value_heads' 7 does not divide 'num_attention_heads' 2"),
    ({"num_key_value_heads": 0}, "'num_key_value_heads' missing or not a positive integer"),
    ({"head_dim": None, "hidden_size": 1}, "no 'head_dim', and 'hidden_size' 1 is smaller"),
    # true read as an interval of 1: every layer full attention, exit 0.
    ({"full_attention_interval": True}, "full_attention_interval must be a positive int"),
])
def test_base_model_configs_that_cannot_be_built_are_refused(
    tmp_path: Path, edit: dict[str, object], says: str
) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**TINY, **edit}))
    result = metrale("layout", "--model", tmp_path, "--modules", "q_proj", "--max-rank", 8)
    one_line_error(result, 2)
    assert says in result.stderr


@pytest.mark.parametrize("edit", [{"kv_lora_rank": 0}, {"kv_lora_rank": None},
                                  {"v_head_dim": 0}, {"v_head_dim": None}])
def test_latent_attention_at_width_0_is_refused(tmp_path: Path, edit: dict[str, object]) -> None:
    """DeepSeek's kv_b_proj reads the compressed KV (kv_lora_rank) and o_proj the heads' values
    (v_head_dim): at 0 (or null) `synth` divided by zero (exit 70) and `layout` planned
    zero-width layers; now one line naming the key, exit 2."""
    config = json.loads((REFERENCE / "deepseek-v2-lite.config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **edit}))
    key = next(iter(edit))
    for args in (("synth", tmp_path / "out", "--model", tmp_path, "--modules", "kv_b_proj",
                  "--rank", 4),
                 ("layout", "--model", tmp_path, "--modules", "kv_b_proj", "--max-rank", 8)):
        result = metrale(*args)
        one_line_error(result, 2)
        assert f"{key!r} missing or not a positive integer" in result.stderr


def test_a_null_head_dim_is_derived(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**TINY, "head_dim": None,
                                                      "num_key_value_heads": None}))
    result = metrale("layout", "--model", tmp_path, "--modules", "q_proj", "--max-rank", 8,
                     "--json")
    assert result.code == 0, result.stderr


# -- routed experts: what transformers builds, per family ----------------------------------------

_MIXTRAL = "mixtral-8x7b-v0.1.config.json"
_QWEN3_MOE = "qwen3-30b-a3b.config.json"
_DEEPSEEK = "deepseek-v2-lite.config.json"
_GPT_OSS = "gpt-oss-20b.config.json"
_QWEN35_MOE = "qwen3.5-35b-a3b.config.json"
_GEMMA4_MOE = {"model_type": "gemma4_text", "hidden_size": 32, "num_hidden_layers": 2,
               "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
               "intermediate_size": 48, "layer_types": ["sliding_attention", "full_attention"],
               "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
               "moe_intermediate_size": 8}
_NEMOTRON_MOE = {"model_type": "nemotron_h", "hidden_size": 32, "num_attention_heads": 2,
                 "num_key_value_heads": 1, "head_dim": 16, "hybrid_override_pattern": "M*E-"}


def _config(base: str | dict[str, object], edit: dict[str, object]) -> dict[str, object]:
    """A reference config (by file name) or a dict, `edit` merged into its text config."""
    config = json.loads((REFERENCE / base).read_text()) if isinstance(base, str) else dict(base)
    if isinstance(config.get("text_config"), dict):
        config["text_config"] = {**config["text_config"], **edit}
        return config
    return {**config, **edit}


@pytest.mark.parametrize("base,edit,says", [
    # The repro: experts 0 wide were planned at intermediate_size, a top-k of 0 routed nothing.
    (_QWEN3_MOE, {"moe_intermediate_size": 0}, "'moe_intermediate_size' is 0 or missing"),
    (_QWEN3_MOE, {"moe_intermediate_size": None}, "'moe_intermediate_size' is 0 or missing"),
    (_QWEN3_MOE, {"num_experts_per_tok": 0}, "'num_experts_per_tok' is 0: each token goes to "
                                             "no routed expert"),
    (_QWEN3_MOE, {"num_experts_per_tok": 129}, "'num_experts_per_tok' is 129, more than the "
                                               "128 routed experts"),
    (_QWEN3_MOE, {"decoder_sparse_step": 0}, "'decoder_sparse_step' is 0"),
    # DeepseekV2Config has no default top-k: its router's topk of None fails.
    (_DEEPSEEK, {"num_experts_per_tok": None}, "'num_experts_per_tok' is missing or null: "
                                               "transformers' deepseek_v2 class has no "
                                               "default"),
    # Families whose MoE block transformers builds whatever the count: 0 experts is no model
    # (it was planned as a dense one, with a dense MLP these models do not have).
    (_MIXTRAL, {"num_local_experts": 0}, "'num_local_experts' is 0 or missing: every mixtral"),
    (_MIXTRAL, {"intermediate_size": 0}, "'intermediate_size' is 0 or missing: it is one "
                                         "routed expert's FFN width"),
    (_GPT_OSS, {"num_local_experts": 0}, "'num_local_experts' is 0 or missing"),
    (_QWEN35_MOE, {"num_experts": 0}, "'num_experts' is 0 or missing: every qwen3_5_moe"),
    (_DEEPSEEK, {"n_routed_experts": 0}, "'n_routed_experts' is 0 or missing"),
    (_DEEPSEEK, {"moe_intermediate_size": 0}, "'moe_intermediate_size' is 0 or missing"),
    (_NEMOTRON_MOE, {"n_routed_experts": 0}, "'n_routed_experts' is 0 or missing: every "
                                              "nemotron_h MoE layer"),
    (_GEMMA4_MOE, {"num_experts": 0}, "'enable_moe_block' is set and 'num_experts' is 0"),
    (_GEMMA4_MOE, {"top_k_experts": 0}, "'top_k_experts' is 0"),
    (_GEMMA4_MOE, {"top_k_experts": None}, "'top_k_experts' is missing or null: transformers' "
                                           "gemma4 class has no default"),
    (_GEMMA4_MOE, {"moe_intermediate_size": None}, "'moe_intermediate_size' is 0 or missing"),
])
def test_routed_experts_transformers_cannot_build_are_refused(
        tmp_path: Path, base: str | dict[str, object], edit: dict[str, object], says: str) -> None:
    """A config whose routed experts are not a model (transformers builds experts 0 wide, a
    block of no experts, a top-k of none or of more than there are) was planned with exit 0:
    now one line naming the key and the file, exit 2, on every command that reads it."""
    good, bad = tmp_path / "good", tmp_path / "bad"
    for root, config in ((good, _config(base, {})), (bad, _config(base, edit))):
        root.mkdir()
        (root / "config.json").write_text(json.dumps(config))
    adapter = tmp_path / "a"
    assert metrale("synth", adapter, "--model", good, "--modules", "q_proj", "--rank", 1).code == 0
    file = bad / "config.json"
    for args in (("layout", "--model", bad, "--modules", "q_proj", "--max-rank", 8),
                 ("inspect", adapter, "--model", bad),
                 ("pack", adapter, "--model", bad, "--max-loras", 1, "--device", "cpu",
                  "--out", tmp_path / "pool.safetensors"),
                 ("simulate", "--model", bad, "--modules", "q_proj", "--max-rank", 8,
                  "--requests", 10, "--adapters", 2, "--max-loras", 2)):
        result = metrale(*args)
        one_line_error(result, 2)
        assert f"{file}: {says}" in result.stderr, (args, result.stderr)


def test_routed_experts_are_read_as_transformers_reads_them() -> None:
    """Absent keys are transformers' defaults (an expert's width was the dense MLP's, an
    absent count a dense model of a family that has no dense MLP); a 0 that means none where a
    family (or an engine) documents it stays accepted."""
    def read(base: str | dict[str, object], edit: dict[str, object],
             drop: tuple[str, ...] = ()) -> ModelConfig:
        config = _config(base, edit)
        for key in drop:
            config.pop(key)
        return ModelConfig.from_dict(config, source="config.json")

    assert read(_QWEN3_MOE, {}, ("moe_intermediate_size",)).expert_intermediate_size == 768
    # The shared expert transformers builds beside the routed ones whatever the config says:
    # 512 wide where it leaves the width out (Qwen3NextConfig's, Qwen3_5MoeTextConfig's).
    next_moe = {"model_type": "qwen3_next", "hidden_size": 64, "num_hidden_layers": 4,
                "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 8,
                "num_experts_per_tok": 2}
    for base in (next_moe, _QWEN35_MOE):
        config = _config(base, {})
        text = config.get("text_config", config)
        text.pop("shared_expert_intermediate_size", None)
        assert ModelConfig.from_dict(config).shared_expert_intermediate_size == 512, base
    assert read(_MIXTRAL, {}, ("num_local_experts",)).num_experts == 8
    # A dense family's class never reads an expert count: its MLP is on every layer (a llama
    # config with `num_local_experts` was planned with routed experts and no gate_proj).
    llama = read("llama-3.1-8b.config.json", {"num_local_experts": 8, "num_experts_per_tok": 2})
    assert llama.num_experts == 0 and LoraModule.GATE_PROJ.applies_to_layer(llama, 0)
    # Nor does a family without shared experts read their keys (Qwen3-MoE has none; SGLang's
    # plan of it gained a shared gate_up_proj from a stray n_shared_experts).
    qwen = read(_QWEN3_MOE, {"n_shared_experts": 2, "shared_expert_intermediate_size": 64})
    assert qwen.shared_experts_width == 0 and qwen.shared_expert_intermediate_size == 0
    # 0 experts is a dense model where transformers builds them only with `num_experts > 0`.
    dense = read(_QWEN3_MOE, {"num_experts": 0})
    assert dense.num_experts == 0 and not dense.moe_layers
    # No layer builds the block (every layer in mlp_only_layers, or the step past the last
    # layer): transformers never reads the step, the experts' width or the top-k, and runs it.
    layers = _config(_QWEN3_MOE, {})["num_hidden_layers"]
    for edit in ({"mlp_only_layers": list(range(layers)), "decoder_sparse_step": 0},
                 {"decoder_sparse_step": layers + 1}):
        for top_k in (200, 0):  # a top-k of 0 too: no router reads it
            unrouted = read(_QWEN3_MOE, {**edit, "num_experts_per_tok": top_k,
                                         "moe_intermediate_size": 0})
            assert unrouted.num_experts == 128 and not unrouted.moe_layers, edit
    # No shared experts (SGLang's `n_shared_experts > 0`): the routed ones alone.
    unshared = read(_DEEPSEEK, {"n_shared_experts": 0})
    assert unshared.num_experts == 64 and unshared.shared_experts_width == 0
    # A top-k a config leaves out is its class's default.
    assert read(_MIXTRAL, {}, ("num_experts_per_tok",)).num_experts_per_tok == 2
    assert read(_QWEN3_MOE, {}, ("num_experts_per_tok",)).num_experts_per_tok == 8
    # gemma4's experts only with its flag; nemotron_h's only on its MoE blocks.
    assert read(_GEMMA4_MOE, {"enable_moe_block": False, "num_experts": 0}).num_experts == 0
    assert read(_NEMOTRON_MOE, {"hybrid_override_pattern": "M*-",
                                "n_routed_experts": 0}).num_experts == 0


@pytest.mark.parametrize("field,value,says", [
    ("moe_intermediate_size", 0, "'moe_intermediate_size' is 0 or missing"),
    ("num_experts_per_tok", 5, "'num_experts_per_tok' is 5, more than the 4 routed experts"),
    # The bounds a config file meets, each count and width: a header claiming 10**12 experts
    # was shown, exit 0, and one 10**9 wide too.
    ("num_experts", 10**12, "model num_experts 1000000000000 is above the 8,192"),
    ("hidden_size", 10**9, "model hidden_size 1000000000 is above the 4,194,304"),
    ("moe_intermediate_size", 1 << 23, "model moe_intermediate_size 8388608 is above the "
                                       "4,194,304"),
    ("vocab_size", 1 << 27, "model vocab_size 134217728 is above the 67,108,864"),
])
def test_an_image_header_whose_experts_are_no_model_is_refused(
        tmp_path: Path, field: str, value: int, says: str) -> None:
    """The header reader meets the rules and bounds a config file does: its model summary is a
    config (`show`, `verify` and `unpack` read it there)."""
    from metrale_cli.image.format import read_tables
    from tests.support.image_edit import header_text, replace_header

    config = {"model_type": "qwen3_moe", "hidden_size": 32, "num_hidden_layers": 2,
              "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
              "intermediate_size": 48, "num_experts": 4, "num_experts_per_tok": 2,
              "moe_intermediate_size": 8}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert metrale("synth", tmp_path / "a", "--model", tmp_path, "--modules", "q_proj",
                   "--rank", 2).code == 0
    image = tmp_path / "pool.safetensors"
    packed = metrale("pack", tmp_path / "a", "--model", tmp_path, "--max-loras", 2,
                     "--max-rank", 2, "--device", "cpu", "--out", image)
    assert packed.code == 0, packed.stderr
    assert metrale("show", image).code == 0
    header = json.loads(header_text(image))
    summary = json.loads(read_tables(image).header.metadata["metrale.model"])
    header["__metadata__"]["metrale.model"] = json.dumps(summary | {field: value})
    replace_header(image, json.dumps(header).encode())
    for args in (("show", image), ("verify", image, tmp_path / "a"),
                 ("unpack", image, tmp_path / "out")):
        result = metrale(*args)
        one_line_error(result, 2)
        assert f"{image}: metadata does not describe a layout (" in result.stderr, args
        assert says in result.stderr, result.stderr


# -- keys a config leaves out or names its own way: what transformers builds ---------------------

# Each MoE family's tiny case (test_families) with the keys sizing its experts left out: the
# count (under every name its class reads), an expert's width, the top-k, the shared experts',
# the MoE layers' step, list and dense first layers, and the dense MLP's width. gemma4's class
# has no defaults for its experts (None: refused), nor deepseek_v2's for the top-k (kept here).
_LEFT_OUT = ("num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok",
             "moe_intermediate_size", "shared_expert_intermediate_size",
             "moe_shared_expert_intermediate_size", "n_shared_experts", "decoder_sparse_step",
             "mlp_only_layers", "first_k_dense_replace", "interleave_moe_layer_step",
             "moe_layers", "intermediate_size")
_MOE_FAMILIES = sorted(f.model_type for f in FAMILIES.values()
                       if f.experts_key and not f.moe_flag)


def _experts_by_layer(hf_model: Any, hidden: int) -> list[tuple[int, int, int] | None]:
    """Per decoder layer transformers built: (routed experts, one expert's width, top-k), None
    on a layer without routed experts. The width is the fused down projection's side that is
    not `hidden` ((E, H, I), or (E, I, H) for gpt_oss and llama4)."""
    out: list[tuple[int, int, int] | None] = []
    for layer in hf_model.model.layers:
        down = next((p for n, p in layer.named_parameters() if n.endswith("experts.down_proj")),
                    None)
        if down is None:
            out.append(None)
            continue
        experts, a, b = down.shape
        top_k = next(m.top_k for m in layer.modules() if isinstance(getattr(m, "top_k", None),
                                                                    int))
        out.append((experts, a if b == hidden else b, top_k))
    return out


def _build_both(tmp_path: Path, raw: dict[str, Any]) -> tuple[ModelConfig, Any]:
    """`raw` as metrale reads it from a config.json, and as transformers builds it on the meta
    device from the same keys."""
    from transformers import AutoConfig

    (tmp_path / "config.json").write_text(json.dumps(raw))
    return ModelConfig.from_hf(tmp_path), _meta_model(AutoConfig.for_model(**raw))


def _check_against_transformers(model: ModelConfig, hf_model: Any) -> None:
    assert [(model.num_experts, model.expert_intermediate_size, model.num_experts_per_tok)
            if model.is_moe_layer(i) else None for i in range(model.num_hidden_layers)] == (
        _experts_by_layer(hf_model, model.hidden_size))
    assert _differences(model, hf_model, UNDECLARED.get(model.model_type, set())) == []


@pytest.mark.usefixtures("transformers_models")
@pytest.mark.parametrize("family", _MOE_FAMILIES)
def test_absent_expert_keys_are_transformers_defaults(family: str, tmp_path: Path) -> None:
    """A qwen3_moe or qwen3_next config without an expert count was read as dense while
    transformers builds 128 or 512 experts; a missing top-k read as 0. Every MoE family's
    absent keys against the model transformers builds from the same file."""
    model_type, kwargs = META_CASES[family]
    keep = ("num_experts_per_tok",) if family == "deepseek_v2" else ()
    raw = {"model_type": model_type, **{k: v for k, v in {**_TINY, **kwargs}.items()
                                        if k not in _LEFT_OUT or k in keep}}
    model, hf_model = _build_both(tmp_path, raw)
    assert model.moe_layers, "no layer with experts: nothing compared"
    _check_against_transformers(model, hf_model)


# The expert count under each name transformers' classes read (attribute_map), and under one a
# class does not (qwen3_next's num_local_experts: its 512); given both, the alias wins, in
# either order.
_COUNT_NAMES = [(f.model_type, {alias: 3}) for f in FAMILIES.values()
                for alias in f.experts_aliases] + [
    ("qwen3_next", {"num_local_experts": 3}), ("qwen3_moe", {"num_local_experts": 0}),
    ("olmoe", {"num_experts": 5, "num_local_experts": 3}),
    ("glm4_moe", {"num_local_experts": 5, "n_routed_experts": 3}),
    ("glm4_moe", {"n_routed_experts": 3, "num_local_experts": 5})]


@pytest.mark.usefixtures("transformers_models")
@pytest.mark.parametrize("family,names", _COUNT_NAMES, ids=str)
def test_expert_count_names_are_read_as_transformers_reads_them(
        family: str, names: dict[str, int], tmp_path: Path) -> None:
    model_type, kwargs = META_CASES[family]
    raw = {"model_type": model_type, **{k: v for k, v in {**_TINY, **kwargs}.items()
                                        if k not in ("num_experts", "num_local_experts",
                                                     "n_routed_experts")}, **names}
    model, hf_model = _build_both(tmp_path, raw)
    _check_against_transformers(model, hf_model)


@pytest.mark.parametrize("family,key", [(f.model_type, alias) for f in FAMILIES.values()
                                        for alias in f.experts_aliases
                                        if not f.experts_optional])
def test_no_experts_under_another_name_is_refused_naming_it(family: str, key: str,
                                                            tmp_path: Path) -> None:
    """glm4_moe's, deepseek_v3's and nemotron_h's `num_local_experts: 0` fell through to the
    default count, and a 0 refused named the family's key, not the file's."""
    model_type, kwargs = META_CASES[family]
    raw = {"model_type": model_type, **{k: v for k, v in {**_TINY, **kwargs}.items()
                                        if k not in ("num_experts", "num_local_experts",
                                                     "n_routed_experts")}, key: 0}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    result = metrale("layout", "--model", tmp_path, "--modules", "q_proj", "--max-rank", 8)
    one_line_error(result, 2)
    assert f"config.json: {key!r} is 0 or missing: every" in result.stderr
