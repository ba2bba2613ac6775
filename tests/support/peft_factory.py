"""Ground truth for tests: real PEFT LoRA adapters on tiny ``transformers`` models.

Everything here is built on the CPU from configs; nothing is downloaded. The numbers recorded
(per-module r/alpha/scaling, delta weights, forward deltas) are read from PEFT's own layer objects,
so a test comparing metrale against them compares against PEFT, not against a re-derivation of
the formulas that could share metrale's mistakes.

Entry points: :data:`TINY_MODELS`, :func:`write_base_config`, :func:`make_adapter`,
:func:`make_hand_v4_expert_adapter` and :func:`peft_v4_expert_deltas`.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

# The factory must never reach the Hub (tests run without network); PEFT's save path probes the Hub
# for the base config unless the name is a local directory. huggingface_hub reads this at import,
# so it only helps when this module is imported before transformers/peft.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402  (after the offline switch on purpose)

if TYPE_CHECKING:
    from torch import nn
    from transformers import PretrainedConfig

ADAPTER_PREFIX = "base_model.model."
# transformers-5 fused experts, spelled for `target_parameters` (suffix match, not regex).
EXPERT_TARGET_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
# Fused experts whose gate_up_proj interleaves gate and up columns (transformers' gpt_oss:
# `gate, up = gate_up[..., ::2], gate_up[..., 1::2]`).
INTERLEAVED_GATE_UP = frozenset({"gpt_oss"})
# Fused experts stored (E, in, out) (transformers' gpt_oss and llama4: `x @ gate_up_proj[e]`).
IN_OUT_EXPERTS = frozenset({"gpt_oss", "llama4"})
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
_SAFETENSORS_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


# --------------------------------------------------------------------------------------------
# Tiny models
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TinyModel:
    """A tiny random model of one supported architecture, described by its config kwargs.

    ``config_kwargs`` are the text-model kwargs. With ``vision_kwargs`` the config is the
    composite (``text_config`` + ``vision_config``) one that real Qwen3.5 checkpoints carry.
    ``checkpoint_class`` is what ``architectures`` in the written ``config.json`` says; it
    differs from ``model_class`` only for a text-only model loaded from a VL checkpoint.
    """

    name: str
    config_class: str
    model_class: str
    config_kwargs: Mapping[str, Any]
    vision_kwargs: Mapping[str, Any] | None = None
    checkpoint_class: str | None = None
    # The usual serving targets present in this model (what make_adapter uses when the caller
    # names no targets); MoE leaves are spelled as users write them, PEFT may rewrite them. A
    # regex where PEFT builds no adapter from names (gemma4's wrapper).
    targets: tuple[str, ...] | str = ()

    @property
    def is_composite(self) -> bool:
        return self.vision_kwargs is not None

    def build_config(self) -> PretrainedConfig:
        import transformers

        config_cls = getattr(transformers, self.config_class)
        if self.is_composite:
            config = config_cls(
                text_config=dict(self.config_kwargs), vision_config=dict(self.vision_kwargs or {})
            )
        else:
            config = config_cls(**self.config_kwargs)
        config.architectures = [self.checkpoint_class or self.model_class]
        return config

    def build_model(self, seed: int = 0) -> nn.Module:
        """Random float32 CPU model; the global torch RNG is left untouched."""
        import transformers

        config = self.build_config()
        model_cls = getattr(transformers, self.model_class)
        if self.is_composite and self.model_class.endswith("ForCausalLM"):
            # What AutoModelForCausalLM.from_config does with a VL config: text model only,
            # keys `model.layers.N...` although the checkpoint says `model.language_model.`.
            config = config.get_text_config()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = model_cls(config)
        return model.float().eval()


_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
_GDN_NEXT = ("in_proj_qkvz", "in_proj_ba", "out_proj")
_GDN_35 = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
# Full attention on odd layers: [linear, full, linear, full].
_HYBRID_4 = ["linear_attention", "full_attention", "linear_attention", "full_attention"]

_BASE = {"vocab_size": 128, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
# Gated DeltaNet dims chosen so value_dim = 4*12 = 48 != hidden 64 (out_proj is not square) and
# in_proj_qkv(z) out = 2*2*8 + 48 (+48) differs from every other width.
_GDN_DIMS = {
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 12,
    "linear_conv_kernel_dim": 4,
}
_QWEN35_TEXT = {**_BASE, **_GDN_DIMS, "num_hidden_layers": 4, "head_dim": 24,
                "intermediate_size": 96, "layer_types": _HYBRID_4}  # fmt: skip
_QWEN35_MOE_TEXT = {**_BASE, **_GDN_DIMS, "num_hidden_layers": 4, "head_dim": 16,
                    "moe_intermediate_size": 40, "shared_expert_intermediate_size": 24,
                    "num_experts": 4, "num_experts_per_tok": 2,
                    "layer_types": _HYBRID_4}  # fmt: skip
# Tiny vision tower: 1 block, its Linear names (attn.qkv, attn.proj, mlp.linear_fc1/2,
# merger.linear_fc1/2) are what all-linear picks up on a real VL checkpoint.
_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2,
           "out_hidden_size": 64, "patch_size": 4, "spatial_merge_size": 2,
           "temporal_patch_size": 2, "num_position_embeddings": 16}  # fmt: skip


# Dense families: 4 layers so that sliding and full attention alternate; token ids inside the
# tiny vocabulary (the configs' defaults are real vocabularies' ids).
_DENSE = {**_BASE, "num_hidden_layers": 4, "intermediate_size": 96, "pad_token_id": 0,
          "bos_token_id": 1, "eos_token_id": 2}
_SLIDING = {"layer_types": ["sliding_attention", "full_attention"] * 2, "sliding_window": 8}
DENSE_FAMILIES_KWARGS = (
    ("gemma", "GemmaConfig", "GemmaForCausalLM", {"head_dim": 24}),
    ("gemma2", "Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 24, **_SLIDING}),
    ("gemma3_text", "Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 24, **_SLIDING}),
    ("granite", "GraniteConfig", "GraniteForCausalLM", {}),
    ("olmo2", "Olmo2Config", "Olmo2ForCausalLM", {}),
    ("olmo3", "Olmo3Config", "Olmo3ForCausalLM", _SLIDING),
    ("cohere", "CohereConfig", "CohereForCausalLM", {}),
    ("cohere2", "Cohere2Config", "Cohere2ForCausalLM", {"head_dim": 24, **_SLIDING}),
    ("exaone4", "Exaone4Config", "Exaone4ForCausalLM", _SLIDING),
    ("ernie4_5", "Ernie4_5Config", "Ernie4_5ForCausalLM", {"head_dim": 24}),
    ("seed_oss", "SeedOssConfig", "SeedOssForCausalLM", {"head_dim": 24}),
    ("smollm3", "SmolLM3Config", "SmolLM3ForCausalLM", {}),
    ("ministral", "MinistralConfig", "MinistralForCausalLM", {"head_dim": 24, **_SLIDING}),
)


_MLA_DIMS = {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 40,
             "n_shared_experts": 1, "first_k_dense_replace": 1, "kv_lora_rank": 16,
             "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 12, "n_group": 1,
             "topk_group": 1}
_MLA_ATTN = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
# Tiny vision towers of the wrappers: SigLIP (gemma3; mistral3's Pixtral takes a head_dim) and
# Qwen-VL's `visual`.
_SIGLIP = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
           "num_attention_heads": 2, "image_size": 28, "patch_size": 14}
_QWEN_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2,
                "out_hidden_size": 64}


# Gemma 4's text model, every layer kind it has: sliding layers 0 and 2 (head_dim 24), full
# layers 1 and 3 (global_head_dim 40, one KV head, keys as values: no v_proj); layers 2 and 3
# reuse layers 0's and 1's KV (no k_proj, v_proj) and their MLP is twice as wide (192); every
# layer's per-layer-input gate (16, 64) and projection (64, 16).
_GEMMA4_TEXT = {**_DENSE, **_SLIDING, "head_dim": 24, "global_head_dim": 40,
                "attention_k_eq_v": True, "num_global_key_value_heads": 1,
                "num_kv_shared_layers": 2, "use_double_wide_mlp": True,
                "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": 128}
_GEMMA4_PLE = ("per_layer_input_gate", "per_layer_projection")
# Gemma 4's vision tower: its projections wrap their Linear (`q_proj.linear`).
_GEMMA4_VISION = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
                  "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
                  "patch_size": 4, "pooling_kernel_size": 1, "position_embedding_size": 64}


def _tiny(*models: TinyModel) -> dict[str, TinyModel]:
    return {m.name: m for m in models}


TINY_MODELS: dict[str, TinyModel] = _tiny(
    # d = H / n_q = 16 (no head_dim key), like Llama-3.1.
    TinyModel("llama", "LlamaConfig", "LlamaForCausalLM",
              {**_BASE, "num_hidden_layers": 2, "intermediate_size": 96}, targets=_ATTN + _MLP),
    TinyModel("mistral", "MistralConfig", "MistralForCausalLM",
              {**_BASE, "num_hidden_layers": 2, "intermediate_size": 112}, targets=_ATTN + _MLP),
    # Qwen2 has biases on q/k/v (base biases exist, LoRA is still bias-free).
    TinyModel("qwen2", "Qwen2Config", "Qwen2ForCausalLM",
              {**_BASE, "num_hidden_layers": 2, "intermediate_size": 80}, targets=_ATTN + _MLP),
    # head_dim 24 != 64/4: q_proj is (96, 64), o_proj (64, 96).
    TinyModel("qwen3", "Qwen3Config", "Qwen3ForCausalLM",
              {**_BASE, "num_hidden_layers": 2, "head_dim": 24, "intermediate_size": 96},
              targets=_ATTN + _MLP),
    # Layer 0 dense (mlp_only_layers), layer 1 MoE; experts gate_up (4, 80, 64), down (4, 64, 40).
    TinyModel("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
              {**_BASE, "num_hidden_layers": 2, "head_dim": 24, "intermediate_size": 96,
               "moe_intermediate_size": 40, "num_experts": 4, "num_experts_per_tok": 2,
               "mlp_only_layers": [0]},
              targets=_ATTN + _MLP),
    # Per-expert FFN = intermediate_size 48: gate_up (4, 96, 64) = [w1; w3], down (4, 64, 48).
    TinyModel("mixtral", "MixtralConfig", "MixtralForCausalLM",
              {**_BASE, "num_hidden_layers": 2, "intermediate_size": 48, "num_local_experts": 4,
               "num_experts_per_tok": 2},
              targets=(*_ATTN, "w1", "w2", "w3")),
    # 4 layers [linear, full, linear, full] (full_attention_interval 2), layer 0 dense MLP,
    # layers 1-3 MoE with shared expert; gated q_proj (2*4*16 = 128, 64). 4 linear key heads,
    # so that TP 4 splits them as vLLM's Gated-DeltaNet layer needs.
    TinyModel("qwen3_next", "Qwen3NextConfig", "Qwen3NextForCausalLM",
              {**_BASE, **_GDN_DIMS, "linear_num_key_heads": 4, "num_hidden_layers": 4,
               "head_dim": 16,
               "intermediate_size": 96, "moe_intermediate_size": 32,
               "shared_expert_intermediate_size": 24, "num_experts": 4, "num_experts_per_tok": 2,
               "mlp_only_layers": [0], "full_attention_interval": 2},
              targets=(*_ATTN, *_GDN_NEXT, *_MLP, "shared_expert_gate")),
    # Text-only class, text config on disk (model_type qwen3_5_text); keys `model.layers.N`.
    TinyModel("qwen3_5", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", _QWEN35_TEXT,
              targets=_ATTN + _GDN_35 + _MLP),
    # VL class, composite config; keys `model.language_model.layers.N` and `model.visual.`.
    TinyModel("qwen3_5_vl", "Qwen3_5Config", "Qwen3_5ForConditionalGeneration", _QWEN35_TEXT,
              vision_kwargs=_VISION, targets=_ATTN + _GDN_35 + _MLP),
    # The common real case: text-only class loaded from a VL checkpoint (Unsloth et al.):
    # composite config.json on disk, adapter keys `model.layers.N`.
    TinyModel("qwen3_5_text_on_vl", "Qwen3_5Config", "Qwen3_5ForCausalLM", _QWEN35_TEXT,
              vision_kwargs=_VISION, checkpoint_class="Qwen3_5ForConditionalGeneration",
              targets=_ATTN + _GDN_35 + _MLP),
    TinyModel("qwen3_5_moe", "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", _QWEN35_MOE_TEXT,
              targets=(*_ATTN, *_GDN_35, *_MLP, "shared_expert_gate")),
    TinyModel("qwen3_5_moe_vl", "Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration",
              _QWEN35_MOE_TEXT, vision_kwargs=_VISION,
              targets=(*_ATTN, *_GDN_35, *_MLP, "shared_expert_gate")),
    # The dense llama-like families (model/families.py), each as transformers builds it.
    *(TinyModel(name, config, causal, {**_DENSE, **extra}, targets=_ATTN + _MLP)
      for name, config, causal, extra in DENSE_FAMILIES_KWARGS),
    # Fused projections: one LoRA pair over q|k|v and over gate|up.
    TinyModel("phi3", "Phi3Config", "Phi3ForCausalLM", _DENSE,
              targets=("qkv_proj", "o_proj", "gate_up_proj", "down_proj")),
    TinyModel("glm4", "Glm4Config", "Glm4ForCausalLM", {**_DENSE, "head_dim": 24},
              targets=(*_ATTN, "gate_up_proj", "down_proj")),
    # Routed experts in transformers 5's fused layout: qwen2_moe's layer 0 dense (mlp_only_layers)
    # and a shared expert elsewhere (a plain gate/up/down target reaches both), olmoe's every
    # layer, glm4_moe's layer 0 dense (first_k_dense_replace) and shared experts after it
    # (PEFT rewrites gate/up/down targets there into expert LoRA).
    TinyModel("qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
              {**_DENSE, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 40,
               "shared_expert_intermediate_size": 24, "mlp_only_layers": [0]},
              targets=_ATTN + _MLP),
    TinyModel("olmoe", "OlmoeConfig", "OlmoeForCausalLM",
              {**_DENSE, "num_experts": 4, "num_experts_per_tok": 2}, targets=_ATTN),
    TinyModel("glm4_moe", "Glm4MoeConfig", "Glm4MoeForCausalLM",
              {**_DENSE, "n_routed_experts": 4, "num_experts_per_tok": 2,
               "moe_intermediate_size": 40, "first_k_dense_replace": 1, "n_group": 1,
               "topk_group": 1, "head_dim": 24}, targets=_ATTN),
    # Attention with biases, an MLP of c_fc and c_proj.
    TinyModel("starcoder2", "Starcoder2Config", "Starcoder2ForCausalLM", _DENSE,
              targets=(*_ATTN, "c_fc", "c_proj")),
    # Routed experts on every layer (fused, gate and up interleaved); attention with biases and
    # sinks; sliding and full attention alternating.
    TinyModel("gpt_oss", "GptOssConfig", "GptOssForCausalLM",
              {**_DENSE, "head_dim": 24, "num_local_experts": 4, "num_experts_per_tok": 2,
               **_SLIDING}, targets=_ATTN),
    # Multi-head latent attention (v2 without, v3 with the low-rank query); layer 0 dense MLP,
    # layers 1-3 routed experts beside a shared expert. PEFT rewrites gate/up/down targets into
    # expert LoRA here (and then adapts neither the dense MLP nor the shared expert), so the
    # usual targets are the attention's.
    TinyModel("deepseek_v2", "DeepseekV2Config", "DeepseekV2ForCausalLM",
              {**_DENSE, **_MLA_DIMS, "q_lora_rank": None, "n_shared_experts": 2},
              targets=_MLA_ATTN),
    TinyModel("deepseek_v3", "DeepseekV3Config", "DeepseekV3ForCausalLM",
              {**_DENSE, **_MLA_DIMS, "q_lora_rank": 24}, targets=_MLA_ATTN),
    # One block a layer: Mamba-2, attention, MLP (up, down: no gate), MoE (non-gated experts and
    # a shared expert). PEFT refuses the Mamba out_proj; up_proj and down_proj reach the MLP
    # block and the MoE block's shared expert.
    TinyModel("nemotron_h", "NemotronHConfig", "NemotronHForCausalLM",
              {**_DENSE, "head_dim": 24, "mamba_num_heads": 4, "mamba_head_dim": 12,
               "n_groups": 1, "ssm_state_size": 8, "n_routed_experts": 4,
               "num_experts_per_tok": 2, "moe_intermediate_size": 40,
               "moe_shared_expert_intermediate_size": 24,
               "layers_block_type": ["linear_attention", "full_attention", "mlp", "moe"]},
              targets=(*_ATTN, "up_proj", "down_proj")),
    # Granite 3 MoE: every layer routed experts, fused under `block_sparse_moe`.
    TinyModel("granitemoe", "GraniteMoeConfig", "GraniteMoeForCausalLM",
              {**_DENSE, "num_local_experts": 4, "num_experts_per_tok": 2}, targets=_ATTN),
    # Phi-3.5-MoE: every layer routed experts (fused under `mlp`), router `mlp.router`.
    TinyModel("phimoe", "PhimoeConfig", "PhimoeForCausalLM",
              {**_DENSE, "num_local_experts": 4, "num_experts_per_tok": 2}, targets=_ATTN),
    # Llama 4's text model: dense MLP (intermediate_size_mlp) on even layers, MoE on odd ones
    # (fused experts, a router, a shared expert intermediate_size wide); gate/up/down reach the
    # dense MLP and the shared expert.
    TinyModel("llama4", "Llama4TextConfig", "Llama4ForCausalLM",
              {**_DENSE, "head_dim": 24, "intermediate_size": 40, "intermediate_size_mlp": 96,
               "num_local_experts": 4, "interleave_moe_layer_step": 2,
               "attention_chunk_size": 8},
              targets=_ATTN + _MLP),
    TinyModel("gemma4", "Gemma4TextConfig", "Gemma4ForCausalLM", _GEMMA4_TEXT,
              targets=_ATTN + _MLP + _GEMMA4_PLE),
    # With routed experts on every layer beside the dense MLP (`experts`, `router.proj`): PEFT
    # adapts gate/up/down as the dense MLP's, no rewrite into expert LoRA.
    TinyModel("gemma4_moe", "Gemma4TextConfig", "Gemma4ForCausalLM",
              {**_GEMMA4_TEXT, "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
               "moe_intermediate_size": 40}, targets=_ATTN + _MLP + _GEMMA4_PLE),
    # Vision-language wrappers: keys `model.language_model.layers.N` and the tower's
    # (`model.vision_tower.`, `model.visual.`), which the same suffixes reach.
    TinyModel("gemma3_vl", "Gemma3Config", "Gemma3ForConditionalGeneration",
              {**_DENSE, "head_dim": 24, **_SLIDING}, vision_kwargs=_SIGLIP,
              targets=_ATTN + _MLP),
    TinyModel("mistral3_vl", "Mistral3Config", "Mistral3ForConditionalGeneration",
              {**_DENSE, "head_dim": 24}, vision_kwargs={**_SIGLIP, "head_dim": 16},
              targets=_ATTN + _MLP),
    # The vision tower's projections are Gemma4ClippableLinear (a Linear inside), which PEFT
    # refuses to adapt: a name the tower shares (q_proj) fails the whole adapter, so the
    # targets are a regex over the language model (PEFT's own default for gemma4 is one).
    TinyModel("gemma4_vl", "Gemma4Config", "Gemma4ForConditionalGeneration", _GEMMA4_TEXT,
              vision_kwargs=_GEMMA4_VISION,
              targets=rf".*language_model.*\.({'|'.join(_ATTN + _MLP + _GEMMA4_PLE)})"),
    # Llama 4's wrapper: transformers 5 keeps its text model at `language_model.model.layers.N`
    # and its vision tower at `vision_model` (whose q/k/v/o the same suffixes reach).
    TinyModel("llama4_vl", "Llama4Config", "Llama4ForConditionalGeneration",
              {**_DENSE, "head_dim": 24, "intermediate_size": 40, "intermediate_size_mlp": 96,
               "num_local_experts": 4, "interleave_moe_layer_step": 2,
               "attention_chunk_size": 8},
              vision_kwargs={**_SIGLIP, "vision_output_dim": 32, "projector_input_dim": 32,
                             "projector_output_dim": 32, "pixel_shuffle_ratio": 0.5},
              targets=_ATTN + _MLP),
    TinyModel("qwen2_5_vl", "Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", _DENSE,
              vision_kwargs=_QWEN_VISION, targets=_ATTN + _MLP),
    TinyModel("qwen3_vl", "Qwen3VLConfig", "Qwen3VLForConditionalGeneration",
              {**_DENSE, "head_dim": 24}, vision_kwargs=_QWEN_VISION, targets=_ATTN + _MLP),
)  # fmt: skip


# The tiny models of the dense llama-like families, by name.
DENSE_FAMILIES = tuple(name for name, *_ in DENSE_FAMILIES_KWARGS)


def _tiny_model(name: str) -> TinyModel:
    try:
        return TINY_MODELS[name]
    except KeyError:
        raise KeyError(f"unknown tiny model {name!r}; known: {sorted(TINY_MODELS)}") from None


def write_base_config(name: str, dir: str | Path) -> Path:
    """Write the tiny model's ``config.json`` (no weights) into ``dir``; return the directory."""
    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    _tiny_model(name).build_config().save_pretrained(out)
    return out


# --------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------


@dataclass
class ModuleTruth:
    """One adapted ``nn.Linear`` as PEFT built it (values read from the PEFT layer)."""

    path: str  # module path in the base model, e.g. model.layers.3.self_attn.q_proj
    layer: int | None  # decoder layer index; None outside `layers.N` (lm_head, vision tower)
    leaf: str
    r: int
    alpha: float
    scaling: float
    a_key: str  # tensor names in adapter_model.safetensors
    b_key: str
    a_shape: tuple[int, int]  # [r, in]
    b_shape: tuple[int, int]  # [out, r]
    base_in: int
    base_out: int
    delta_weight: torch.Tensor = field(repr=False)  # float32 [out, in] = scaling * B @ A


@dataclass
class ParamTruth:
    """One ``target_parameters`` wrapper (fused MoE experts or router) as PEFT built it."""

    path: str  # parameter path, e.g. model.layers.1.mlp.experts.gate_up_proj (rank_pattern key)
    module_path: str  # model.layers.1.mlp.experts
    param: str  # gate_up_proj | down_proj | weight (router)
    layer: int | None
    r: int
    alpha: float
    scaling: float
    num_experts: int  # 1 for a 2-D parameter such as the router weight
    in_features: int  # per expert, after PEFT's (E, out, in) swap
    out_features: int
    a_key: str  # the key does not name the parameter; the inner wrapper has `.base_layer.`
    b_key: str
    a_shape: tuple[int, int]  # [E*r, in]
    b_shape: tuple[int, int]  # [out, E*r], expert index fastest along the columns
    # float32: PEFT's get_delta_weight in the parameter's own layout, one delta per expert (E=1
    # for 2-D): [E, out, in], or [E, in, out] where `in_out`.
    expert_deltas: torch.Tensor = field(repr=False)
    # 3-D experts stored (E, in, out) (gpt_oss's, llama4's): the delta is each expert's weight
    # delta transposed, whether PEFT swapped in and out (llama4: A and B take each other's
    # roles) or not (gpt_oss, marked `is_transposed`: the delta is (B_e A_e)^T).
    in_out: bool = False


@dataclass
class AdapterTruth:
    path: Path  # directory with adapter_config.json + adapter_model.safetensors
    base_dir: Path  # directory with the base config.json
    model_name: str
    adapter_name: str
    dtype: str  # safetensors dtype of the saved A/B tensors: F32 | BF16 | F16
    config: dict[str, Any]  # the saved adapter_config.json
    tensors: dict[str, tuple[str, tuple[int, ...]]]  # safetensors header: name -> (dtype, shape)
    modules: dict[str, ModuleTruth]
    params: dict[str, ParamTruth]  # keyed by parameter path
    _peft_model: Any = field(default=None, repr=False, compare=False)

    def per_expert_deltas(self) -> dict[tuple[int, str, int], np.ndarray]:
        """PEFT's deltas keyed (layer, gate_proj|up_proj|down_proj|router, expert; the router's
        -1), each `[out, in]`: gate_up's rows split [gate; up], or even and odd rows for the
        families whose experts interleave them (transformers' `gate_up[..., ::2]`)."""
        found: dict[tuple[int, str, int], np.ndarray] = {}
        for p in self.params.values():
            assert p.layer is not None
            deltas = p.expert_deltas.numpy()
            if p.in_out:
                deltas = deltas.transpose(0, 2, 1)
            if p.param == "gate_up_proj":
                inter = deltas.shape[1] // 2
                gate, up = ((slice(0, None, 2), slice(1, None, 2))
                            if self.model_name in INTERLEAVED_GATE_UP
                            else (slice(0, inter), slice(inter, None)))
                for e in range(deltas.shape[0]):
                    found[(p.layer, "gate_proj", e)] = deltas[e, gate]
                    found[(p.layer, "up_proj", e)] = deltas[e, up]
            elif p.param == "down_proj":
                for e in range(deltas.shape[0]):
                    found[(p.layer, "down_proj", e)] = deltas[e]
            else:
                found[(p.layer, "router", -1)] = deltas[0]
        return found

    def forward_delta(self, module_path: str, x: torch.Tensor) -> torch.Tensor:
        """PEFT's own output delta of one adapted Linear: ``lora_layer(x) - base_layer(x)``."""
        if module_path not in self.modules:
            raise KeyError(f"{module_path!r} is not an adapted Linear of {self.model_name}")
        layer = self._peft_model.base_model.model.get_submodule(module_path)
        x = x.to(torch.float32)
        with torch.no_grad():
            return (layer(x) - layer.base_layer(x)).float()


# --------------------------------------------------------------------------------------------
# make_adapter
# --------------------------------------------------------------------------------------------


def read_safetensors_header(path: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape) from the header alone (what a serving auditor reads)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return {k: (v["dtype"], tuple(v["shape"])) for k, v in header.items()}


def _layer_of(path: str) -> int | None:
    m = _LAYER_RE.search(path)
    return int(m.group(1)) if m else None


def _strip_base_layers(name: str) -> str:
    # Nested ParamWrappers put the inner ones at `<module>.base_layer(.base_layer...)`.
    while name.endswith(".base_layer"):
        name = name[: -len(".base_layer")]
    return name


def _lora_parameters(peft_model: nn.Module) -> list[torch.nn.Parameter]:
    return [p for n, p in peft_model.named_parameters() if ".lora_A." in n or ".lora_B." in n]


def make_adapter(
    model_name: str,
    out_dir: str | Path,
    *,
    dtype: str = "f32",
    adapter_name: str | None = None,
    seed: int = 0,
    **lora_kwargs: Any,
) -> AdapterTruth:
    """Build a real PEFT LoRA adapter on a tiny model, save it, and record PEFT's numbers.

    ``lora_kwargs`` go to ``LoraConfig``. When neither ``target_modules`` nor
    ``target_parameters`` is given, the model's usual serving targets are used (pass
    ``target_modules=None`` to get PEFT's own per-architecture default instead).
    The base ``config.json`` goes to ``out_dir/base`` and ``base_model_name_or_path`` points
    there, so the adapter alone leads to its base. A and B are random (never PEFT's zero B).
    With ``dtype`` bf16/f16 the file holds that dtype and every recorded number is computed
    from the rounded values, so a packer reading the file can be compared exactly.
    """
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora.layer import Linear as LoraLinear
    from peft.tuners.lora.layer import ParamWrapper

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    tiny = _tiny_model(model_name)
    out = Path(out_dir)
    base_dir = write_base_config(model_name, out / "base").resolve()
    if "target_modules" not in lora_kwargs and "target_parameters" not in lora_kwargs:
        targets = tiny.targets
        lora_kwargs["target_modules"] = targets if isinstance(targets, str) else list(targets)
    adapter = adapter_name or "default"

    model = tiny.build_model(seed)
    lora_config = LoraConfig(**lora_kwargs)
    peft_model = get_peft_model(model, lora_config, adapter_name=adapter)
    # get_peft_model copies the model's (empty) name_or_path; point at the written base instead.
    peft_model.peft_config[adapter].base_model_name_or_path = str(base_dir)
    peft_model.eval()

    lora_params = _lora_parameters(peft_model)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in lora_params:
            # PEFT zero-inits B (every delta would be 0); fill A and B ourselves so the values
            # depend only on `seed`. 1/sqrt(fan_in) keeps deltas O(1) at any rank.
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
        for p in lora_params:
            p.data = p.data.to(_DTYPES[dtype])
    peft_model.save_pretrained(out, selected_adapters=[adapter])
    with torch.no_grad():
        # Back to float32 holding exactly the saved values: deltas and forward passes below are
        # then exact functions of the file's contents.
        for p in lora_params:
            p.data = p.data.to(torch.float32)

    # PEFT saves a non-default adapter into a sub-folder named after it.
    path = out if adapter == "default" else out / adapter
    config = json.loads((path / "adapter_config.json").read_text())
    tensors = read_safetensors_header(path / "adapter_model.safetensors")

    modules: dict[str, ModuleTruth] = {}
    params: dict[str, ParamTruth] = {}
    prefix = ADAPTER_PREFIX
    for name, mod in peft_model.named_modules():
        if isinstance(mod, LoraLinear | ParamWrapper) and adapter in mod.lora_A:
            a_key, b_key = f"{name}.lora_A.weight", f"{name}.lora_B.weight"
            if a_key not in tensors or b_key not in tensors:
                raise RuntimeError(f"factory bug: {a_key} / {b_key} not in the saved file")
            a_w = mod.lora_A[adapter].weight
            b_w = mod.lora_B[adapter].weight
            with torch.no_grad():
                delta = mod.get_delta_weight(adapter).detach().float().clone()
            common = {
                "r": int(mod.r[adapter]),
                "alpha": mod.lora_alpha[adapter],
                "scaling": float(mod.scaling[adapter]),
                "a_key": a_key,
                "b_key": b_key,
                "a_shape": tuple(a_w.shape),
                "b_shape": tuple(b_w.shape),
            }
            if isinstance(mod, ParamWrapper):
                module_path = _strip_base_layers(name)[len(prefix) :]
                param_path = f"{module_path}.{mod.parameter_name}"
                if mod.num_experts == 1:
                    delta = delta.unsqueeze(0)
                params[param_path] = ParamTruth(
                    path=param_path,
                    module_path=module_path,
                    param=mod.parameter_name,
                    layer=_layer_of(param_path),
                    num_experts=int(mod.num_experts),
                    in_features=int(mod.in_features),
                    out_features=int(mod.out_features),
                    expert_deltas=delta,
                    in_out=mod._param_ndim == 3 and model_name in IN_OUT_EXPERTS,
                    **common,
                )
            else:
                module_path = name[len(prefix) :]
                modules[module_path] = ModuleTruth(
                    path=module_path,
                    layer=_layer_of(module_path),
                    leaf=module_path.rsplit(".", 1)[-1],
                    base_in=int(mod.base_layer.in_features),
                    base_out=int(mod.base_layer.out_features),
                    delta_weight=delta,
                    **common,
                )

    return AdapterTruth(
        path=path,
        base_dir=base_dir,
        model_name=model_name,
        adapter_name=adapter,
        dtype=_SAFETENSORS_DTYPE[_DTYPES[dtype]],
        config=config,
        tensors=tensors,
        modules=modules,
        params=params,
        _peft_model=peft_model,
    )


# --------------------------------------------------------------------------------------------
# Hand-written transformers-4 per-expert adapters
# --------------------------------------------------------------------------------------------

# v4 spelling per model: (MoE block attribute, (gate, up, down) leaf names).
_V4_SPELLING = {"mixtral": ("block_sparse_moe", ("w1", "w3", "w2"))}
_V4_DEFAULT_SPELLING = ("mlp", ("gate_proj", "up_proj", "down_proj"))


@dataclass
class ExpertTruth:
    """One per-expert (or router) LoRA pair written by hand, with its ground-truth delta."""

    a_key: str
    b_key: str
    a: torch.Tensor = field(repr=False)  # float32 [r, in], exactly the saved values
    b: torch.Tensor = field(repr=False)  # float32 [out, r]
    delta_weight: torch.Tensor = field(repr=False)  # float32 [out, in] = scaling * B @ A


@dataclass
class HandV4Truth:
    path: Path
    base_dir: Path
    model_name: str
    r: int
    alpha: float
    scaling: float
    dtype: str
    moe_layers: list[int]
    num_experts: int
    hidden: int
    expert_intermediate: int
    config: dict[str, Any]
    tensors: dict[str, tuple[str, tuple[int, ...]]]
    # (layer, expert, leaf) -> pair; leaf as spelled in the file (gate_proj|up_proj|down_proj, or
    # Mixtral's w1|w3|w2).
    experts: dict[tuple[int, int, str], ExpertTruth]
    routers: dict[int, ExpertTruth]  # layer -> router pair (`mlp.gate` / `block_sparse_moe.gate`)


def _moe_layers(model: nn.Module) -> tuple[str, list[tuple[int, Any]]]:
    """(text-model prefix such as `model.` / `model.language_model.`, [(layer, experts)])."""
    found: list[tuple[int, Any]] = []
    prefix = ""
    for name, mod in model.named_modules():
        if name.endswith(".mlp.experts") and hasattr(mod, "gate_up_proj"):
            layer = _layer_of(name)
            assert layer is not None
            found.append((layer, mod))
            prefix = name[: name.index("layers.")]
    return prefix, found


def make_hand_v4_expert_adapter(
    model_name: str,
    out_dir: str | Path,
    r: int = 4,
    alpha: float = 8,
    *,
    use_rslora: bool = False,
    include_router: bool = False,
    dtype: str = "f32",
    seed: int = 0,
) -> HandV4Truth:
    """Write a transformers-4-era per-expert adapter by hand (safetensors + adapter_config.json).

    Keys: ``base_model.model.<prefix>layers.N.mlp.experts.E.{gate,up,down}_proj.lora_{A,B}.weight``
    (Mixtral: ``block_sparse_moe.experts.E.{w1,w3,w2}``), plus the router ``mlp.gate`` /
    ``block_sparse_moe.gate`` when ``include_router``. Dims come from the tiny v5 model.
    """
    from safetensors.torch import save_file

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    model = _tiny_model(model_name).build_model(seed)
    prefix, moe = _moe_layers(model)
    if not moe:
        raise ValueError(f"{model_name} has no MoE layers")
    block, (gate_leaf, up_leaf, down_leaf) = _V4_SPELLING.get(model_name, _V4_DEFAULT_SPELLING)
    num_experts, two_i, hidden = moe[0][1].gate_up_proj.shape
    inter = two_i // 2
    scaling = alpha / math.sqrt(r) if use_rslora else alpha / r

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base_dir = write_base_config(model_name, out / "base").resolve()
    gen = torch.Generator().manual_seed(seed + 1)
    save_dtype = _DTYPES[dtype]

    def pair(key: str, in_dim: int, out_dim: int) -> ExpertTruth:
        # Round to the file dtype first so the recorded truth is what the file holds.
        a = (torch.randn(r, in_dim, generator=gen) / math.sqrt(in_dim)).to(save_dtype)
        b = (torch.randn(out_dim, r, generator=gen) / math.sqrt(r)).to(save_dtype)
        state[f"{key}.lora_A.weight"] = a.contiguous()
        state[f"{key}.lora_B.weight"] = b.contiguous()
        a32, b32 = a.float(), b.float()
        return ExpertTruth(f"{key}.lora_A.weight", f"{key}.lora_B.weight", a32, b32,
                           scaling * (b32 @ a32))  # fmt: skip

    state: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, int, str], ExpertTruth] = {}
    routers: dict[int, ExpertTruth] = {}
    for layer, _ in moe:
        moe_key = f"{ADAPTER_PREFIX}{prefix}layers.{layer}.{block}"
        for e in range(num_experts):
            for leaf, in_dim, out_dim in (
                (gate_leaf, hidden, inter),
                (up_leaf, hidden, inter),
                (down_leaf, inter, hidden),
            ):
                experts[(layer, e, leaf)] = pair(f"{moe_key}.experts.{e}.{leaf}", in_dim, out_dim)
        if include_router:
            routers[layer] = pair(f"{moe_key}.gate", hidden, num_experts)
    save_file(state, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})

    targets = [gate_leaf, up_leaf, down_leaf] + (["gate"] if include_router else [])
    # A v4-era (PEFT 0.15-0.17) config: no target_parameters, per-expert Linear leaves targeted.
    config: dict[str, Any] = {
        "alpha_pattern": {},
        "base_model_name_or_path": str(base_dir),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "layers_pattern": None,
        "layers_to_transform": None,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": r,
        "rank_pattern": {},
        "revision": None,
        "target_modules": targets,
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": use_rslora,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return HandV4Truth(
        path=out,
        base_dir=base_dir,
        model_name=model_name,
        r=r,
        alpha=alpha,
        scaling=scaling,
        dtype=_SAFETENSORS_DTYPE[save_dtype],
        moe_layers=[layer for layer, _ in moe],
        num_experts=int(num_experts),
        hidden=int(hidden),
        expert_intermediate=int(inter),
        config=config,
        tensors=read_safetensors_header(out / "adapter_model.safetensors"),
        experts=experts,
        routers=routers,
    )


def peft_v4_expert_deltas(truth: HandV4Truth, seed: int = 0) -> dict[tuple[int, int, str], Any]:
    """Load a hand-written v4 adapter with ``PeftModel.from_pretrained`` and return PEFT's deltas.

    Keyed like ``truth.experts`` (float32 [out, in]) plus ``(layer, -1, "gate")`` for routers.
    PEFT converts the v4 per-expert keys into fused ``target_parameters`` wrappers; the fused
    gate_up delta [E, 2I, H] is split back into the gate rows (first I) and the up rows.
    Raises whatever PEFT raises when it cannot load the adapter for this model type.
    """
    from peft import PeftModel
    from peft.tuners.lora.layer import ParamWrapper

    model = _tiny_model(truth.model_name).build_model(seed)
    peft_model = PeftModel.from_pretrained(model, str(truth.path))
    _, (gate_leaf, up_leaf, down_leaf) = _V4_SPELLING.get(truth.model_name, _V4_DEFAULT_SPELLING)
    inter = truth.expert_intermediate
    result: dict[tuple[int, int, str], Any] = {}
    for name, mod in peft_model.named_modules():
        if not isinstance(mod, ParamWrapper) or "default" not in mod.lora_A:
            continue
        layer = _layer_of(name)
        assert layer is not None
        with torch.no_grad():
            delta = mod.get_delta_weight("default").detach().float()
        if mod.parameter_name == "gate_up_proj":
            for e in range(delta.shape[0]):
                result[(layer, e, gate_leaf)] = delta[e, :inter]
                result[(layer, e, up_leaf)] = delta[e, inter:]
        elif mod.parameter_name == "down_proj":
            for e in range(delta.shape[0]):
                result[(layer, e, down_leaf)] = delta[e]
        else:
            result[(layer, -1, "gate")] = delta
    return result
