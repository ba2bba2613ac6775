"""model/families.py is the one place a model family's facts live: a new family that fits the
pool's module set is a row there, and the parser, the layouts and the audit follow."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from metrale_cli.adapters.adapter import AdapterConfig
from metrale_cli.cli.render import model_line
from metrale_cli.engines.vllm.model import engine_modules as vllm_engine_modules
from metrale_cli.errors import FormatError, UnsupportedModel
from metrale_cli.layout.pipeline import plan_pool
from metrale_cli.model.config import PRESETS, LayerType, ModelConfig
from metrale_cli.model.families import FAMILIES, Family
from tests.support.cli_runner import metrale

QWEN3 = Path(__file__).parent / "data" / "model_configs" / "qwen3-8b.config.json"


def test_every_preset_is_of_a_known_family() -> None:
    assert {ModelConfig.from_dict(p.config).model_type for p in PRESETS} <= set(FAMILIES)


def test_a_new_family_is_one_row(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    raw = {**json.loads(QWEN3.read_text()), "model_type": "qwen9"}
    with pytest.raises(UnsupportedModel, match="'qwen9' is not supported"):
        ModelConfig.from_dict(raw)
    monkeypatch.setitem(FAMILIES, "qwen9", Family("qwen9", hybrid=True,
                                                  peft_default_targets=("o_proj",)))
    model = ModelConfig.from_dict(raw)
    # The row's facts reach the config (a hybrid's default layer stack and gated q_proj) ...
    assert model.attn_gated and model.layer_type(3) is LayerType.FULL_ATTENTION
    assert model.layer_type(0) is LayerType.LINEAR_ATTENTION
    # ... and the audit: an adapter without target_modules gets the family's PEFT default.
    config = AdapterConfig.from_dict({"peft_type": "LORA", "r": 8, "lora_alpha": 16,
                                      "target_modules": None})
    assert config.with_default_targets(model.family).target_modules == ["o_proj"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert metrale("synth", tmp_path / "a", "--model", tmp_path, "--modules", "q_proj,o_proj",
                   "--rank", 8).code == 0
    planned = plan_pool([tmp_path / "a"])
    assert planned.model.model_type == "qwen9"
    # q_proj on the full-attention layers only, twice as wide (its gate), o_proj likewise.
    assert {e.layer for e in planned.layout.entries} == {3, 7, 11, 15, 19, 23, 27, 31, 35}
    q = next(e for e in planned.layout.entries if e.module.peft_name == "q_proj")
    assert q.out_dim == 2 * model.num_attention_heads * model.head_dim


# -- every family's modules against transformers' own model ------------------------------------

# Tiny text configs, one per family: (transformers model_type, kwargs over _TINY). Widths are
# chosen apart (head_dim 24 != 64 / 4, intermediate 96) so a wrong width cannot pass by accident.
_TINY = {"vocab_size": 128, "hidden_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "num_hidden_layers": 4, "intermediate_size": 96,
         "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
_SLIDING = {"layer_types": ["sliding_attention", "full_attention"] * 2, "sliding_window": 8}
_GDN = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
        "linear_value_head_dim": 12, "head_dim": 16,
        "layer_types": ["linear_attention", "full_attention"] * 2}
_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 40}
# Multi-head latent attention, every width apart; layer 0 dense, layers 1-3 routed experts.
_MLA = {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 40,
        "n_shared_experts": 1, "first_k_dense_replace": 1, "kv_lora_rank": 16,
        "q_lora_rank": None, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 12,
        "n_group": 1, "topk_group": 1}
_NEMOTRON_H = {"layers_block_type": ["linear_attention", "full_attention", "mlp", "moe"],
               "mamba_num_heads": 4, "mamba_head_dim": 12, "n_groups": 1, "ssm_state_size": 8,
               "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 40,
               "moe_shared_expert_intermediate_size": 24}
# Gemma 4: sliding layers 0 and 2 (head_dim 24), full layers 1 and 3 (global_head_dim 40, one
# KV head, keys as values: no v_proj); layers 2 and 3 reuse layers 0's and 1's KV (no k_proj,
# v_proj) with an MLP twice as wide; every layer's per-layer-input gate and projection.
_GEMMA4 = {**_SLIDING, "head_dim": 24, "global_head_dim": 40, "attention_k_eq_v": True,
           "num_global_key_value_heads": 1, "num_kv_shared_layers": 2,
           "use_double_wide_mlp": True, "hidden_size_per_layer_input": 16,
           "vocab_size_per_layer_input": 128}
_QWEN_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2,
                "out_hidden_size": 64}
META_CASES: dict[str, tuple[str, dict[str, object]]] = {
    "llama": ("llama", {}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"head_dim": 24}),
    "qwen3_moe": ("qwen3_moe", {"head_dim": 24, **_MOE}),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_next": ("qwen3_next", {**_GDN, **_MOE, "shared_expert_intermediate_size": 24}),
    "qwen3_5": ("qwen3_5_text", _GDN),
    "qwen3_5_moe": ("qwen3_5_moe_text", {**_GDN, **_MOE,
                                         "shared_expert_intermediate_size": 24}),
    "gemma": ("gemma", {"head_dim": 24}),
    "gemma2": ("gemma2", {"head_dim": 24, **_SLIDING}),
    "gemma3": ("gemma3_text", {"head_dim": 24, **_SLIDING}),
    "gemma4": ("gemma4_text", _GEMMA4),
    "granite": ("granite", {}),
    "olmo2": ("olmo2", {}),
    "olmo3": ("olmo3", _SLIDING),
    "cohere": ("cohere", {}),
    "cohere2": ("cohere2", {"head_dim": 24, **_SLIDING}),
    "exaone4": ("exaone4", _SLIDING),
    "ernie4_5": ("ernie4_5", {"head_dim": 24}),
    "seed_oss": ("seed_oss", {"head_dim": 24}),
    "smollm3": ("smollm3", {}),
    "ministral": ("ministral", {"head_dim": 24, **_SLIDING}),
    "phi3": ("phi3", {}),
    "glm4": ("glm4", {"head_dim": 24}),
    "starcoder2": ("starcoder2", {}),
    "qwen2_moe": ("qwen2_moe", {**_MOE, "shared_expert_intermediate_size": 24,
                                "mlp_only_layers": [0]}),
    "olmoe": ("olmoe", {"num_experts": 4, "num_experts_per_tok": 2}),
    "glm4_moe": ("glm4_moe", {"n_routed_experts": 4, "num_experts_per_tok": 2,
                              "moe_intermediate_size": 40, "first_k_dense_replace": 1,
                              "n_group": 1, "topk_group": 1, "head_dim": 24}),
    "deepseek_v2": ("deepseek_v2", _MLA),
    "deepseek_v3": ("deepseek_v3", {**_MLA, "q_lora_rank": 24}),
    "gpt_oss": ("gpt_oss", {"head_dim": 24, "num_local_experts": 4, "num_experts_per_tok": 2,
                            **_SLIDING}),
    # One block a layer: Mamba-2, attention, MLP, MoE (its shared expert and non-gated experts).
    "nemotron_h": ("nemotron_h", {**_NEMOTRON_H, "head_dim": 24}),
    "phimoe": ("phimoe", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "granitemoe": ("granitemoe", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # MoE on odd layers (its shared expert and router), a dense MLP intermediate_size_mlp wide
    # on even ones; chunked attention on all but the last.
    "llama4": ("llama4_text", {"head_dim": 24, "intermediate_size": 40,
                               "intermediate_size_mlp": 96, "num_local_experts": 4,
                               "interleave_moe_layer_step": 2, "attention_chunk_size": 8}),
    # Vision-language wrappers: the text model under text_config (a tiny vision tower beside).
    "qwen2_vl": ("qwen2_vl", {"vision_config": {"depth": 1, "embed_dim": 32, "num_heads": 2,
                                                "hidden_size": 64, "mlp_ratio": 2}}),
    "qwen2_5_vl": ("qwen2_5_vl", {"vision_config": _QWEN_VISION}),
    "qwen3_vl": ("qwen3_vl", {"head_dim": 24, "vision_config": _QWEN_VISION}),
}
# mistral3's language model is a mistral, gemma3's a gemma3_text: families of their own.
VL_OF = {"mistral3": "mistral", "gemma3": "gemma3", "gemma4": "gemma4"}
_SIGLIP = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
           "num_attention_heads": 2, "image_size": 28, "patch_size": 14}
VL_CASES: dict[str, dict[str, object]] = {
    "mistral3": {"vision_config": {**_SIGLIP, "head_dim": 16}},
    "gemma3": {"vision_config": _SIGLIP, "text_config_type": "gemma3_text"},
    "gemma4": {**_GEMMA4, "text_config_type": "gemma4_text", "vision_config": {
        "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16}},
}
# Linear layers of a decoder layer that no family module declares, by family: what the audit
# names as not servable (Gated-DeltaNet input projections, the seed families' shared expert,
# qwen2_moe's shared-expert gate, llama4's router). Anything else undeclared fails the test: a
# module the family row forgot.
_GDN_IN = {"linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba"}
_GDN35_IN = {"linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_a",
             "linear_attn.in_proj_b"}
_SHARED = {"mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj",
           "mlp.shared_expert.down_proj", "mlp.shared_expert_gate"}
# nemotron_h's Mamba-2 projections (PEFT refuses its out_proj).
_NEMOTRON_H_OUT = {"mixer.in_proj", "mixer.out_proj"}
_LLAMA4_MOE = {"feed_forward.router"}
UNDECLARED = {"nemotron_h": _NEMOTRON_H_OUT, "llama4": _LLAMA4_MOE, "phimoe": {"mlp.router"},
              "qwen3_next": _GDN_IN | _SHARED, "qwen3_5": _GDN35_IN,
              "qwen3_5_moe": _GDN35_IN | _SHARED, "qwen2_moe": {"mlp.shared_expert_gate"},
              # gemma4's router beside the dense MLP, with enable_moe_block (its experts are
              # 3-D parameters, not Linears).
              "gemma4": {"router.proj"}}


@pytest.fixture(scope="module")
def transformers_models() -> None:
    """transformers' import and its shared modeling code, paid once in setup (seconds): one
    tiny llama built on the meta device."""
    from transformers import AutoConfig

    _meta_model(AutoConfig.for_model("llama", **_TINY))


def _meta_model(config: object) -> object:
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if hasattr(config, "vision_config") else (
        AutoModelForCausalLM)
    with torch.device("meta"):
        return auto.from_config(config)


def _tiny_config(model_type: str, kwargs: dict[str, object]) -> object:
    """transformers' config of one META_CASES entry: a composite one (vision_config given)
    takes the tiny text settings under text_config."""
    from transformers import AutoConfig

    kwargs = dict(kwargs)
    vision = kwargs.pop("vision_config", None)
    if vision is None:
        return AutoConfig.for_model(model_type, **{**_TINY, **kwargs})
    text_type = kwargs.pop("text_config_type", None)
    text = {**_TINY, **kwargs, **({"model_type": text_type} if text_type else {})}
    return AutoConfig.for_model(model_type, text_config=text, vision_config=vision)


def _differences(model: ModelConfig, hf_model: object, undeclared: set[str]) -> list[str]:
    """Every (layer, module) whose presence or `(out, in)` in transformers' decoder layers
    differs from the family's entry, and every Linear the family neither declares nor
    knowingly leaves out."""
    from torch import nn

    from metrale_cli.model.modules import family_modules

    modules = family_modules(model)
    paths = {spec.path for spec in model.family.modules}
    inner = hf_model.model  # type: ignore[attr-defined]
    layers = getattr(inner, "language_model", inner).layers
    assert len(layers) == model.num_hidden_layers
    out = []
    for i, layer in enumerate(layers):
        linears = {name: (m.out_features, m.in_features) for name, m in layer.named_modules()
                   if isinstance(m, nn.Linear)}
        for module in modules:
            # The module's entry on this layer, and its other entries' paths, absent here.
            spec = module.spec(model, i)
            if spec is not None and spec.path not in linears:
                out.append(f"layer {i} {spec.path}: metrale says present")
            elif spec is not None and module.dims(model, i) != linears[spec.path]:
                out.append(f"layer {i} {spec.path}: metrale {module.dims(model, i)}, "
                           f"transformers {linears[spec.path]}")
            elsewhere = {s.path for s in model.family.modules if s.name == module.value}
            elsewhere -= {spec.path} if spec is not None else set()
            out += [f"layer {i} {p}: metrale says absent" for p in sorted(elsewhere & set(linears))]
        out += [f"layer {i} {p}: no family module" for p in set(linears) - paths - undeclared]
    return out


@pytest.mark.parametrize("family", sorted(META_CASES))
def test_family_modules_match_transformers(family: str, tmp_path: Path,
                                          transformers_models: None) -> None:
    """The config.json transformers writes (its non-default values only, as checkpoints carry
    them) read by metrale, against the model transformers builds from it on the meta device."""
    model_type, kwargs = META_CASES[family]
    config = _tiny_config(model_type, kwargs)
    config.save_pretrained(tmp_path)
    model = ModelConfig.from_hf(tmp_path)
    assert model.model_type == family
    assert _differences(model, _meta_model(config), UNDECLARED.get(family, set())) == []


@pytest.mark.parametrize("wrapper", sorted(VL_CASES))
def test_vision_language_wrappers_match_transformers(wrapper: str, tmp_path: Path,
                                                     transformers_models: None) -> None:
    """A wrapper whose language model is another family's: that family's modules, on
    model.language_model.layers.N."""
    config = _tiny_config(wrapper, VL_CASES[wrapper])
    config.save_pretrained(tmp_path)
    model = ModelConfig.from_hf(tmp_path)
    assert model.model_type == VL_OF[wrapper] and model.composite
    assert _differences(model, _meta_model(config), set()) == []


def test_every_family_has_a_meta_case() -> None:
    assert set(META_CASES) == set(FAMILIES)


REAL_SIZES = {"qwen3-8b.config.json": "qwen3", "llama-3.1-8b.config.json": "llama",
              "olmo-3-7b.config.json": "olmo3", "gemma-3-27b-it.config.json": "gemma3",
              "gpt-oss-20b.config.json": "gpt_oss", "deepseek-v2-lite.config.json": "deepseek_v2",
              "deepseek-v3.config.json": "deepseek_v3"}


def _real_size_differences(raw: dict[str, object], source: str) -> list[str]:
    from transformers import AutoConfig

    model = ModelConfig.from_dict(raw, source=source)
    config = AutoConfig.for_model(**raw)
    if model.composite:
        config = config.get_text_config()
    return _differences(model, _meta_model(config), UNDECLARED.get(model.model_type, set()))


@pytest.mark.parametrize("file", sorted(REAL_SIZES))
def test_real_configs_match_transformers(file: str, transformers_models: None) -> None:
    """Published configs at full size, built by transformers on the meta device."""
    raw = json.loads((QWEN3.parent / file).read_text())
    assert ModelConfig.from_dict(raw).model_type == REAL_SIZES[file]
    assert _real_size_differences(raw, file) == []


@pytest.mark.parametrize("preset", [p.name for p in PRESETS])
def test_presets_match_transformers(preset: str, transformers_models: None) -> None:
    """Every preset at full size, built by transformers on the meta device from its values."""
    raw = next(p.config for p in PRESETS if p.name == preset)
    assert _real_size_differences(raw, preset) == []


# Nemotron-H 8B's widths (nvidia/Nemotron-H-8B-Base-8K) in the legacy form checkpoints carry:
# `hybrid_override_pattern`, one character a layer, and a num_hidden_layers transformers ignores.
_NEMOTRON_H_8B = {"model_type": "nemotron_h", "hidden_size": 4096, "num_attention_heads": 32,
                  "num_key_value_heads": 8, "intermediate_size": 21504, "mamba_num_heads": 128,
                  "mamba_head_dim": 64, "n_groups": 8, "num_hidden_layers": 99,
                  "hybrid_override_pattern": "M-M-M-M*-" * 4 + "M-E*"}


def test_nemotron_h_pattern_config_matches_transformers(transformers_models: None) -> None:
    """The pattern's blocks are the layers (its length, not num_hidden_layers); head_dim 128
    transformers' default; an MoE block counts its experts."""
    model = ModelConfig.from_dict(_NEMOTRON_H_8B)
    assert model.num_hidden_layers == 40 and model.head_dim == 128
    assert model.moe_layers == [38] and model.num_experts == 8
    assert model.attention_layers == [7, 16, 25, 34, 39]
    assert _real_size_differences(_NEMOTRON_H_8B, "nemotron-h-8b") == []
    # Every layer counted in the views' model line.
    assert "5 full-attention + 17 linear-attention + 18 MLP or MoE layers" in model_line(
        model.record())
    dense = {**_NEMOTRON_H_8B, "hybrid_override_pattern": "M-M*"}
    assert ModelConfig.from_dict(dense).num_experts == 0  # a config default, on no layer


@pytest.mark.parametrize("bad", [{"hybrid_override_pattern": "M-X*"},
                                 {"layers_block_type": ["mlp", "attention"]},
                                 {"layers_block_type": []}])
def test_nemotron_h_bad_block_types_are_one_line(bad: dict[str, object], tmp_path: Path) -> None:
    raw = {k: v for k, v in _NEMOTRON_H_8B.items() if k != "hybrid_override_pattern"}
    (tmp_path / "config.json").write_text(json.dumps({**raw, **bad}))
    done = metrale("layout", "-m", tmp_path, "--modules", "q_proj", "--max-rank", 8)
    assert done.code == 2 and "layers_block_type" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_block_kinds_are_nemotron_h_s_alone() -> None:
    raw = {**json.loads(QWEN3.read_text()), "layer_types": ["mlp"] * 36}
    with pytest.raises(FormatError, match="only a block-typed hybrid"):
        ModelConfig.from_dict(raw)


@pytest.fixture(scope="module")
def peft_targets() -> dict[str, list[str]]:
    """PEFT 0.21's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING (its import: seconds)."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

    return TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING


@pytest.mark.parametrize("family", sorted(META_CASES))
def test_peft_default_targets_are_peft_s(family: str, peft_targets: dict[str, list[str]]) -> None:
    """What a config without target_modules meant: PEFT's own table, by the model_type
    transformers writes (gemma3's text model: gemma3_text)."""
    model_type = META_CASES[family][0]
    assert FAMILIES[family].peft_default_targets == tuple(peft_targets.get(model_type) or ())


def test_every_family_lists_its_modules_in_vocabulary_order() -> None:
    """An adapter's module set (vocabulary order) is then its pool's slot order."""
    from metrale_cli.model.modules import ALL

    for family in FAMILIES.values():
        # A module declared again for other layers (a shared expert's gate_proj, gemma4's
        # full-attention q_proj) sits where its first entry does.
        names = list(dict.fromkeys(m.name for m in family.modules))
        assert names == [m.value for m in ALL if m.value in names], family.model_type


def test_vllm_sizes_deepseek_s_latent_attention_per_gpu() -> None:
    """MLA under --engine vllm, DeepSeek-V3 (61 layers, 128 heads, hidden 7168, q_lora_rank
    1536, kv_lora_rank 512, rope 64, nope 128, v 128) at TP 2, bf16: fused_qkv_a_proj is
    built unsharded, so every GPU holds its two slices whole; q_b_proj and kv_b_proj split
    their B rows, o_proj its A columns (deepseek_v2.py DeepseekV2MLAAttention; the CPU build
    allocates these shapes on a tiny model: tests/test_engine_vllm.py). DeepSeek's q_proj
    is not a module of V3's (its query is low-rank): refused, naming the ones it has."""
    args = ["-m", "deepseek-v3", "--max-rank", 16, "--max-loras", 4, "--engine", "vllm",
            "--tp", 2]
    done = metrale("layout", *args, "--modules", "q_a_proj,q_b_proj,kv_b_proj,o_proj", "--json")
    assert done.code == 0, done.stderr
    got = {m["module"]: (m["kind"], m["layers"], m["bytes"])
           for m in done.json()["engine"]["modules"]}
    L, R, layers, elem = 4, 16, 61, 2
    assert got == {
        "self_attn.fused_qkv_a_proj": ("replicated", layers,
                                       L * R * (2 * 7168 + 1536 + 576) * layers * elem),
        "self_attn.q_b_proj": ("column", layers,
                               L * R * (1536 + 128 * 192 // 2) * layers * elem),
        "self_attn.kv_b_proj": ("column", layers,
                                L * R * (512 + 128 * 256 // 2) * layers * elem),
        "self_attn.o_proj": ("row", layers, L * R * (128 * 128 // 2 + 7168) * layers * elem)}
    done = metrale("layout", *args, "--modules", "q_proj,o_proj")
    assert done.code == 2 and "fused_qkv_a_proj" in done.stderr and "q_a_proj" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_vllm_wraps_gpt_oss_under_its_own_names() -> None:
    """gpt_oss under --engine vllm: the attention as vLLM names it (`attn`), the router and the
    3-D fused experts on every layer (gpt-oss-20b: 24 layers, 32 experts of 2880), bf16."""
    done = metrale("layout", "-m", "gpt-oss-20b", "--modules", "q_proj,o_proj,router,experts",
                   "--max-rank", 16, "--max-loras", 4, "--engine", "vllm", "--json")
    assert done.code == 0, done.stderr
    got = {m["module"]: (m["kind"], m["layers"], m["bytes"])
           for m in done.json()["engine"]["modules"]}
    # Per expert and slot: gate|up A [16, 2880] and B [5760, 16], down A [16, 2880] and B
    # [2880, 16]; 4 slots, 32 experts, 24 layers, 2 bytes.
    experts = 4 * 32 * 16 * (2880 + 5760 + 2880 + 2880) * 24 * 2
    assert got["mlp.experts"] == ("experts_3d", 24, experts)
    assert got["mlp.router"][:2] == ("replicated", 24)
    assert {"attn.qkv_proj", "attn.o_proj"} <= got.keys()


_GEMMA4_SHARED = {"model_type": "gemma4_text", "architectures": ["Gemma4ForCausalLM"],
                  "vocab_size": 128, "hidden_size": 64,
                  "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
                  "num_hidden_layers": 4, "intermediate_size": 96, "sliding_window": 8,
                  "layer_types": ["sliding_attention", "full_attention"] * 2,
                  "global_head_dim": 64, "attention_k_eq_v": True,
                  "num_global_key_value_heads": 1, "num_kv_shared_layers": 2,
                  "use_double_wide_mlp": True, "hidden_size_per_layer_input": 16}


def test_vllm_wraps_gemma4_by_layer_kind(tmp_path: Path) -> None:
    """vLLM's Gemma4ForCausalLM: qkv_proj at each layer kind's width on the layers computing
    their own KV (the full ones' keys as values), q_proj alone on the KV-shared layers, their
    MLP twice as wide, the model's per_layer_model_projection; with routed experts beside the
    MLP, the router's `router.proj` and the 2-D fused experts on every layer
    (tests/test_engine_vllm.py runs the CPU build on both); expert sizes without
    enable_moe_block, where vLLM builds experts transformers does not, are refused in one
    line."""
    (tmp_path / "config.json").write_text(json.dumps(_GEMMA4_SHARED))
    on = {(m.path, m.layers): (m.out_sizes, m.keys_as_values) for m in vllm_engine_modules(
        ModelConfig.from_hf(tmp_path))}
    assert on[("self_attn.qkv_proj", (0,))] == ((64,), False)
    assert on[("self_attn.qkv_proj", (1,))] == ((128,), True)
    assert on[("self_attn.q_proj", (2,))] == ((64,), False)
    assert on[("self_attn.q_proj", (3,))] == ((128,), False)
    assert on[("mlp.gate_up_proj", (0, 1))] == ((96, 96), False)
    assert on[("mlp.gate_up_proj", (2, 3))] == ((192, 192), False)
    assert on[("per_layer_model_projection", ())] == ((64,), False)
    moe = tmp_path / "moe"
    moe.mkdir()
    (moe / "config.json").write_text(json.dumps({
        **_GEMMA4_SHARED, "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
        "moe_intermediate_size": 32}))
    on = {m.path: (m.kind.value, m.layers, m.out_sizes, m.experts) for m in vllm_engine_modules(
        ModelConfig.from_hf(moe))}
    assert on["router.proj"] == ("replicated", (0, 1, 2, 3), (4,), 0)
    assert on["experts"] == ("experts", (0, 1, 2, 3), (32,), 4)
    done = metrale("layout", "-m", moe, "--modules", "proj,experts", "--max-rank", 16,
                   "--max-loras", 4, "--engine", "vllm", "--json")
    assert done.code == 0, done.stderr
    assert {m["module"] for m in json.loads(done.stdout)["engine"]["modules"]} == {
        "router.proj", "experts"}
    # Expert sizes without enable_moe_block: vLLM builds experts transformers does not.
    (moe / "config.json").write_text(json.dumps({
        **_GEMMA4_SHARED, "enable_moe_block": False, "num_experts": 4, "top_k_experts": 2,
        "moe_intermediate_size": 32}))
    done = metrale("layout", "-m", moe, "--modules", "q_proj", "--max-rank", 16,
                   "--engine", "vllm")
    assert done.code == 2 and "num_experts without enable_moe_block" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    # The block with no experts: refused as such where the config is read (transformers builds
    # a block of none too), not as experts without the block, with or without an engine.
    (moe / "config.json").write_text(json.dumps({
        **_GEMMA4_SHARED, "enable_moe_block": True, "num_experts": 0, "top_k_experts": 2,
        "moe_intermediate_size": 32}))
    for engine in ((), ("--engine", "vllm")):
        done = metrale("layout", "-m", moe, "--modules", "q_proj", "--max-rank", 16, *engine)
        assert done.code == 2, done.stderr
        assert "'enable_moe_block' is set and 'num_experts' is 0 or missing" in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1


def test_vllm_wraps_nemotron_h_by_block(tmp_path: Path) -> None:
    """vLLM's NemotronHForCausalLM takes LoRA by block kind: the Mamba-2 mixers' in_proj (five
    slices), conv1d (three) and out_proj, attention's qkv_proj/o_proj, the MLP blocks' up/down,
    the MoE blocks' non-gated experts and shared experts; a TP that does not divide n_groups
    builds other Mamba layers, which metrale refuses in one line."""
    # With the class vLLM builds: without `architectures` it never starts.
    (tmp_path / "config.json").write_text(json.dumps(
        {**_NEMOTRON_H_8B, "architectures": ["NemotronHForCausalLM"]}))
    pattern = _NEMOTRON_H_8B["hybrid_override_pattern"]
    on = {m.path: (m.layers, m.out_sizes) for m in vllm_engine_modules(ModelConfig.from_hf(
        tmp_path))}
    mamba = tuple(i for i, c in enumerate(pattern) if c == "M")
    assert on["mixer.in_proj"] == (mamba, (8192, 8192, 1024, 1024, 128))
    assert on["mixer.conv1d"] == (mamba, (8192, 1024, 1024))
    assert on["mixer.qkv_proj"][0] == (7, 16, 25, 34, 39)
    assert on["mixer.up_proj"][0] == tuple(i for i, c in enumerate(pattern) if c == "-")
    assert on["mixer.experts"][0] == on["mixer.shared_experts.up_proj"][0] == (38,)
    done = metrale("layout", "-m", tmp_path, "--modules", "q_proj,o_proj", "--max-rank", 16,
                   "--max-loras", 4, "--engine", "vllm", "--json")
    assert done.code == 0, done.stderr
    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "config.json").write_text(json.dumps({**_NEMOTRON_H_8B,
                                                   "architectures": ["NemotronHForCausalLM"],
                                                   "hybrid_override_pattern": "M-M*"}))
    done = metrale("layout", "-m", dense, "--modules", "q_proj,o_proj", "--max-rank", 16,
                   "--max-loras", 4, "--engine", "vllm", "--tp", 16)
    assert done.code == 2 and "n_groups" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    plain = metrale("layout", "-m", tmp_path, "--modules", "all", "--max-rank", 16, "--json")
    assert plain.code == 0, plain.stderr
    # Attention modules on the 5 attention blocks, up/down on the 17 MLP blocks (21504 wide)
    # and on the MoE block's shared experts (7688, transformers' default), none elsewhere.
    entries = {(e["layer"], e["module"], e["out_dim"]) for e in plain.json()["entries"]}
    attention = {"q_proj": 4096, "k_proj": 1024, "v_proj": 1024, "o_proj": 4096}
    up = {"-": 21504, "E": 7688}
    assert entries == {(i, m, w) for i in (7, 16, 25, 34, 39) for m, w in attention.items()} | {
        (i, m, up[c] if m == "up_proj" else 4096)
        for i, c in enumerate(_NEMOTRON_H_8B["hybrid_override_pattern"]) if c in up
        for m in ("up_proj", "down_proj")}


def test_llama4_s_moe_layers_list_matches_transformers(tmp_path: Path,
                                                       transformers_models: None) -> None:
    """`moe_layers` names the MoE layers over the interleave step; the rest are dense. vLLM's
    Llama4ForCausalLM reads the step alone (llama4.py Llama4DecoderLayer), so under --engine
    vllm its experts sit on layers 1 and 3, its dense MLP on 0 and 2."""
    config = _tiny_config("llama4_text", {**META_CASES["llama4"][1], "moe_layers": [0, 3]})
    config.architectures = ["Llama4ForCausalLM"]  # the class vLLM builds: none, it never starts
    config.save_pretrained(tmp_path)
    model = ModelConfig.from_hf(tmp_path)
    assert model.moe_layers == [0, 3] and model.intermediate_size_mlp == 96
    assert _differences(model, _meta_model(config), _LLAMA4_MOE) == []
    on = {m.path: m.layers for m in vllm_engine_modules(model)}
    assert on["feed_forward.experts"] == (1, 3) and on["feed_forward.gate_up_proj"] == (0, 2)
    done = metrale("layout", "-m", tmp_path, "--modules", "q_proj", "--max-rank", 8,
                   "--engine", "vllm", "--json")
    assert done.code == 0, done.stderr


# Gemma 4's other shapes: routed experts beside the dense MLP on every layer (their router
# `router.proj` is a Linear no family module declares: UNDECLARED), the expert sizes without
# the flag that builds them, KV-shared layers whose MLP keeps its width, no per-layer input.
_GEMMA4_MOE = {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
               "moe_intermediate_size": 40}
GEMMA4_VARIANTS: dict[str, tuple[dict[str, object], int]] = {
    "moe": ({**_GEMMA4, **_GEMMA4_MOE}, 4),
    "moe sizes, no moe block": ({**_GEMMA4, **_GEMMA4_MOE, "enable_moe_block": False}, 0),
    "shared kv, single-wide mlp": ({**_GEMMA4, "use_double_wide_mlp": False,
                                    "attention_k_eq_v": False}, 0),
    "no per-layer input": ({**_SLIDING, "head_dim": 24, "global_head_dim": 40,
                            "hidden_size_per_layer_input": 0}, 0),
}


@pytest.mark.parametrize("variant", sorted(GEMMA4_VARIANTS))
def test_gemma4_variants_match_transformers(variant: str, tmp_path: Path,
                                            transformers_models: None) -> None:
    kwargs, experts = GEMMA4_VARIANTS[variant]
    config = _tiny_config("gemma4_text", kwargs)
    config.save_pretrained(tmp_path)
    model = ModelConfig.from_hf(tmp_path)
    assert model.num_experts == experts and model.moe_layers == ([0, 1, 2, 3] if experts else [])
    assert _differences(model, _meta_model(config), UNDECLARED["gemma4"]) == []


def test_gemma4_reads_the_global_widths_transformers_reads() -> None:
    """A config as Google's checkpoints write it (`global_head_dim`,
    `num_global_key_value_heads`, taken only with attention_k_eq_v) and without layer_types
    (five sliding layers to one full, the last layer forced full)."""
    raw = {"model_type": "gemma4_text", "num_hidden_layers": 8, "global_head_dim": 64,
           "num_global_key_value_heads": 1}
    model = ModelConfig.from_dict(raw)
    assert model.full_attention_layers == [5, 7]
    assert (model.global_head_dim, model.num_global_key_value_heads) == (64, 0)
    model = ModelConfig.from_dict({**raw, "attention_k_eq_v": True})
    assert model.global_kv_width == 64 and model.num_global_key_value_heads == 1


@pytest.mark.parametrize(("bad", "says"), [
    ({"per_layer_config": {"1": {"head_dim": 40}, "3": {"head_dim": 48}}}, "same head_dim"),
    ({"per_layer_config": {"0": {"head_dim": 40}}}, "no other layer"),
    ({"per_layer_config": {"1": {"head_dim": -4}}}, "positive integer"),
    ({"per_layer_config": [40]}, "map layer numbers"),
    ({"global_head_dim": "wide"}, "positive integers"),
    ({"num_kv_shared_layers": 5}, "more than the 4 layers"),
    ({"attention_k_eq_v": True, "num_global_key_value_heads": 3}, "do not divide"),
])
def test_gemma4_bad_widths_are_one_line(bad: dict[str, object], says: str,
                                        tmp_path: Path) -> None:
    raw = {"model_type": "gemma4_text", "hidden_size": 64, "num_hidden_layers": 4,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24,
           "layer_types": _SLIDING["layer_types"], **bad}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    done = metrale("layout", "-m", tmp_path, "--modules", "q_proj", "--max-rank", 8)
    assert done.code == 2 and says in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_gemma4_modules_its_layers_lack_are_named_by_why(tmp_path: Path) -> None:
    """An adapter made for Gemma 4 layers that all compute their own keys and values, against
    one whose last two layers reuse earlier ones' (no k_proj, v_proj) and whose full layers'
    keys are their values (no v_proj): each pair it cannot hold is named with the reason."""
    raw = {"model_type": "gemma4_text", "hidden_size": 64, "num_hidden_layers": 4,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24,
           "global_head_dim": 40, "layer_types": _SLIDING["layer_types"]}
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "config.json").write_text(json.dumps(raw))
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "config.json").write_text(json.dumps(
        {**raw, "num_kv_shared_layers": 2, "attention_k_eq_v": True}))
    assert metrale("synth", tmp_path / "a", "--model", tmp_path / "plain", "--modules",
                   "k_proj,v_proj", "--rank", 4).code == 0
    done = metrale("inspect", tmp_path / "a", "--model", tmp_path / "shared", "--json")
    assert done.code == 1
    messages = sorted(f["message"] for f in done.json()["adapters"][0]["findings"])
    shared = "layers reusing an earlier layer's keys and values"
    assert messages == [
        f"k_proj on layer 2: the module does not apply on sliding-attention {shared}",
        f"k_proj on layer 3: the module does not apply on full-attention {shared}",
        "v_proj on layer 1: the module does not apply on full-attention layers whose keys "
        "are their values (attention_k_eq_v)",
        f"v_proj on layer 2: the module does not apply on sliding-attention {shared}",
        f"v_proj on layer 3: the module does not apply on full-attention {shared}"], messages


def test_gemma4_at_full_size_with_every_option(transformers_models: None) -> None:
    """transformers' Gemma4TextConfig defaults (30 layers, full ones at global_head_dim 512)
    with every option on, as Google's configs write them (global_head_dim and
    num_global_key_value_heads, no per_layer_config): keys as values on the full layers,
    the last 10 layers reusing KV with a double-wide MLP, 128 routed experts beside the MLP."""
    raw = {"model_type": "gemma4_text", "attention_k_eq_v": True,
           "num_global_key_value_heads": 2, "num_kv_shared_layers": 10,
           "use_double_wide_mlp": True, "enable_moe_block": True, "num_experts": 128,
           "top_k_experts": 8, "moe_intermediate_size": 704}
    model = ModelConfig.from_dict(raw)
    assert (model.global_kv_width, model.kv_shared_mlp_width) == (1024, 18432)
    assert model.num_experts == 128 and model.num_experts_per_tok == 8
    assert _real_size_differences(raw, "gemma4 every option") == []


DEEPSEEK_V2_LITE = QWEN3.parent / "deepseek-v2-lite.config.json"


@pytest.mark.parametrize(("count", "width"), [(None, 0), (0, 0), ("absent", 2 * 1408),
                                              (2, 2 * 1408)])
def test_deepseek_s_shared_experts_width_is_their_count_of_expert_widths(count: object,
                                                                         width: int) -> None:
    """DeepSeek-V2-Lite's shared experts: one MLP `n_shared_experts * moe_intermediate_size`
    wide on each MoE layer (absent: transformers' default, 2; null or 0: none, as transformers
    builds no shared experts for null)."""
    from metrale_cli.model.modules import LoraModule

    raw = json.loads(DEEPSEEK_V2_LITE.read_text())
    raw.pop("n_shared_experts")
    cfg = ModelConfig.from_dict(raw if count == "absent" else {**raw, "n_shared_experts": count})
    assert cfg.shared_experts_width == width
    shapes = LoraModule.GATE_PROJ.shapes(cfg)
    assert shapes == (((10944, 2048), (width, 2048)) if width else ((10944, 2048),))


@pytest.mark.parametrize("count", [2980, 1 << 22])
def test_a_shared_experts_width_past_every_width_is_one_line(tmp_path: Path, count: int) -> None:
    """`n_shared_experts` times the expert width is the shared MLP's width: past the bound on
    every width it is a malformed config, one line and exit 2; it was planned (a 4 GiB slot,
    and at 2**22 experts a synth that wrote until the disk filled)."""
    raw = {**json.loads(DEEPSEEK_V2_LITE.read_text()), "n_shared_experts": count}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    done = metrale("layout", "-m", tmp_path, "--modules", "gate_proj", "--max-rank", 8)
    assert done.code == 2 and done.stdout == ""
    assert done.stderr == (f"error: {tmp_path / 'config.json'}: 'n_shared_experts' {count} x "
                           "'moe_intermediate_size' 1408 is above the 4,194,304 that metrale "
                           "accepts; not a real model's config\n")


def test_a_module_at_the_other_layers_path_is_named_with_this_layer_s(tmp_path: Path) -> None:
    """DeepSeek's gate_proj is the dense MLP's (`mlp.gate_proj`) on layer 0 and the shared
    experts' on the MoE layers: an adapter with them swapped is not applicable there, and the
    finding says where the layer has the module; it said the module does not apply on those
    layers at all."""
    from tests.support.image_edit import header_text, replace_header

    adapter = tmp_path / "swapped"
    assert metrale("synth", adapter, "-m", "deepseek-v2-lite", "--modules", "gate_proj",
                   "--rank", 1).code == 0
    weights = adapter / "adapter_model.safetensors"
    replace_header(weights, header_text(weights).replace(
        b"model.layers.0.mlp.gate_proj", b"model.layers.0.mlp.shared_experts.gate_proj").replace(
        b"model.layers.5.mlp.shared_experts.gate_proj", b"model.layers.5.mlp.gate_proj"))
    done = metrale("inspect", adapter, "-m", "deepseek-v2-lite", "--json")
    assert done.code == 1
    assert sorted(f["message"] for f in done.json()["adapters"][0]["findings"]
                  if f["code"] == "module_not_applicable") == [
        "gate_proj on layer 0: the layer's gate_proj is mlp.gate_proj, not "
        "mlp.shared_experts.gate_proj",
        "gate_proj on layer 5: the layer's gate_proj is mlp.shared_experts.gate_proj, not "
        "mlp.gate_proj"]


def test_where_peft_does_not_rewrite_gate_proj_the_warning_says_what_it_reaches(
        tmp_path: Path) -> None:
    """Qwen2-MoE with a dense layer (mlp_only_layers): PEFT 0.21 does not rewrite a plain
    gate_proj target, which then adapts the dense MLP and the shared expert (both pooled); the
    warning beside routed-expert target_parameters said it reached only the shared expert."""
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen2_moe", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
        "num_experts": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
        "mlp_only_layers": [0], "vocab_size": 128}))
    adapter = tmp_path / "adapter"
    assert metrale("synth", adapter, "-m", tmp_path, "--modules", "gate_proj", "-r", 4).code == 0
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps(
        {**config, "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}))
    report = metrale("inspect", adapter, "-m", tmp_path, "--json").json()["adapters"][0]
    assert {(m["layer"], m["module"]) for m in report["modules"]} == {(0, "gate_proj"),
                                                                      (1, "gate_proj")}
    [warning] = [f["message"] for f in report["findings"] if f["code"] == "moe_rewrite"]
    assert "reach the dense-MLP and shared-expert projections where it has them, never the " \
           "routed experts" in warning
