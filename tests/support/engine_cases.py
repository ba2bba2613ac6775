"""Tiny models with weights, and real PEFT adapters on them, for the engine tests: what the
real vLLM loads (tests/support/vllm_runner.py) and what metrale judges offline.

vLLM's CPU build needs more than the audit's tiny models: weights on disk, a head width of
at least 32 (its CPU attention refuses 16), and BF16 for the Gated-DeltaNet layers. Every
adapter's next-token log-probabilities are PEFT's own forward pass, in float32.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

PROMPT = [1, 5, 9, 17, 33, 2]
_BASE = {"vocab_size": 128, "hidden_size": 64, "num_attention_heads": 2,
         "num_key_value_heads": 1, "head_dim": 32, "max_position_embeddings": 128}
_GDN = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4}
_HYBRID = ["linear_attention", "full_attention"]
# Token ids inside the tiny vocabulary (the families' config defaults are real vocabularies').
_DENSE = {**_BASE, "num_hidden_layers": 2, "intermediate_size": 96, "pad_token_id": 0,
          "bos_token_id": 1, "eos_token_id": 2}

_NEMOTRON_H = {**_DENSE, "mamba_num_heads": 4, "mamba_head_dim": 16, "n_groups": 1,
               "ssm_state_size": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
               "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 32,
               "n_group": 1, "topk_group": 1}

# Multi-head latent attention at the one latent width vLLM's CPU MLA backend takes
# (cpu_mla.py CPUMLABackend.get_supported_head_sizes: kv_lora_rank 512 + qk_rope_head_dim 64),
# with as many query heads as KV heads (transformers' DeepSeek-V2 repeats KV by their ratio);
# routed experts (and a shared one) from layer `first_k_dense_replace` on: the dense jobs set it
# to the layer count, so no MoE layer is built. noaux_tc: vLLM then builds the router's
# correction bias that transformers' DeepSeek-V3 saves.
_MLA = {**{k: v for k, v in _DENSE.items() if k != "head_dim"}, "num_key_value_heads": 2,
        "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 32, "v_head_dim": 32,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc"}

# The vision-language text models' rotary embedding: three mRoPE sections (time, height,
# width) over the head width's 16 frequencies.
_MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]}
_VL_TOKENS = {"image_token_id": 120, "video_token_id": 121, "vision_start_token_id": 122,
              "vision_end_token_id": 123}
_QWEN3_VISION = {"depth": 1, "hidden_size": 64, "intermediate_size": 96, "num_heads": 2,
                 "out_hidden_size": 64, "patch_size": 16, "num_position_embeddings": 16}
# Qwen3.5's text model. The CPU build's GDN kernel (chunk_gated_delta_rule_cpu) takes the real
# models' head width, 128 (it refuses 16 and 32).
_QWEN35_TEXT = {**_BASE, **_GDN, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                "num_hidden_layers": 2, "intermediate_size": 96, "layer_types": _HYBRID}

# One sliding-window layer, then a full one.
_SLIDING = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8}

# family -> (config class, model class, config kwargs)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              {**_BASE, "num_hidden_layers": 2, "intermediate_size": 96}),
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              {**_BASE, "num_hidden_layers": 2, "intermediate_size": 96}),
    # Layer 0 dense, layer 1 routed experts.
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {**_BASE, "num_hidden_layers": 2, "intermediate_size": 96,
                   "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
                   "mlp_only_layers": [0]}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                {**_BASE, "num_hidden_layers": 2, "intermediate_size": 48,
                 "num_local_experts": 4, "num_experts_per_tok": 2}),
    # Layer 0 linear attention with a dense MLP, layer 1 full attention with routed and shared
    # experts (vLLM's Qwen3-Next refuses a model without an MoE layer).
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   {**_BASE, **_GDN, "num_hidden_layers": 2, "intermediate_size": 96,
                    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
                    "num_experts": 4, "num_experts_per_tok": 2, "mlp_only_layers": [0],
                    "layer_types": _HYBRID}),
    # The vision-language wrappers: the dense text model above (its rotary embedding in
    # mRoPE sections over the head width of 32) beside a one-block vision tower whose linear
    # layers are the checkpoint's own (Qwen2-VL: attn.qkv, attn.proj, mlp.fc1, mlp.fc2;
    # Qwen2.5-VL: attn.qkv, attn.proj, mlp.gate_proj/up_proj/down_proj; Qwen3-VL: attn.qkv,
    # attn.proj, mlp.linear_fc1/2), and the merger into the language model; the image and video
    # token ids inside the tiny vocabulary.
    "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration", {
        "text_config": {**_DENSE, "rope_parameters": _MROPE}, **_VL_TOKENS,
        "vision_config": {"depth": 1, "embed_dim": 64, "hidden_size": 64, "num_heads": 2,
                          "mlp_ratio": 2, "patch_size": 14}}),
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", {
        "text_config": {**_DENSE, "rope_parameters": _MROPE}, **_VL_TOKENS,
        "vision_config": {"depth": 1, "hidden_size": 64, "intermediate_size": 96,
                          "num_heads": 2, "out_hidden_size": 64, "patch_size": 14,
                          "fullatt_block_indexes": [0]}}),
    "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration", {
        "text_config": {**_DENSE, "rope_parameters": {**_MROPE, "mrope_interleaved": True}},
        **_VL_TOKENS, "vision_config": {**_QWEN3_VISION, "deepstack_visual_indexes": [0]}}),
    # Qwen3.5's wrapper: the text model above (rotary over a quarter of the head width, 4
    # frequencies in mRoPE sections) beside Qwen3-VL's tower.
    "qwen3_5_vl": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", {
        "text_config": {**_QWEN35_TEXT, "rope_parameters": {
            "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1], "mrope_interleaved": True}},
        **_VL_TOKENS, "vision_config": _QWEN3_VISION}),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", _QWEN35_TEXT),
    # The families' dense classes (model/families.py): one of each way vLLM's class differs
    # (its embedding_modules, its packed_modules_mapping, the transformers backend).
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", {**_DENSE, **_SLIDING}),
    # Gemma 4: a sliding layer (head width 32) and a full one (64) whose one KV head's keys
    # are its values (no v_proj); each layer's per-layer-input projections.
    "gemma4_text": ("Gemma4TextConfig", "Gemma4ForCausalLM",
                    {**_DENSE, "layer_types": ["sliding_attention", "full_attention"],
                     "sliding_window": 8, "global_head_dim": 64, "attention_k_eq_v": True,
                     "num_global_key_value_heads": 1, "hidden_size_per_layer_input": 16,
                     "vocab_size_per_layer_input": 128}),
    # The same with routed experts beside each layer's MLP (its router's `router.proj`).
    "gemma4_moe": ("Gemma4TextConfig", "Gemma4ForCausalLM",
                   {**_DENSE, "layer_types": ["sliding_attention", "full_attention"],
                    "sliding_window": 8, "global_head_dim": 64, "attention_k_eq_v": True,
                    "num_global_key_value_heads": 1, "hidden_size_per_layer_input": 16,
                    "vocab_size_per_layer_input": 128, "enable_moe_block": True,
                    "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32}),
    "cohere": ("CohereConfig", "CohereForCausalLM", _DENSE),
    **{family: (f"{cls}Config", f"{cls}ForCausalLM", {**_DENSE, **extra})
       for family, cls, extra in (
           ("mistral", "Mistral", {}), ("qwen2", "Qwen2", {}), ("gemma", "Gemma", {}),
           ("gemma2", "Gemma2", _SLIDING), ("granite", "Granite", {}), ("olmo3", "Olmo3", _SLIDING),
           ("cohere2", "Cohere2", _SLIDING), ("exaone4", "Exaone4", _SLIDING),
           ("ernie4_5", "Ernie4_5", {}), ("seed_oss", "SeedOss", {}), ("smollm3", "SmolLM3", {}),
           ("ministral", "Ministral", _SLIDING))},
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", _DENSE),
    # Attention with biases; a non-gated MLP of c_fc and c_proj (on vLLM's transformers backend).
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", _DENSE),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", _DENSE),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", _DENSE),
    # Layer 0 a dense MLP, layer 1 routed experts beside a shared expert (the interleave step);
    # one attention chunk spans the whole context (vLLM's chunked attention takes a chunk that
    # is a multiple of its 128-token block).
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM",
               {**_DENSE, "intermediate_size": 32, "intermediate_size_mlp": 96,
                "num_local_experts": 4, "num_experts_per_tok": 1, "interleave_moe_layer_step": 2,
                "attention_chunk_size": 128, "no_rope_layers": [1, 0],
                "layer_types": ["chunked_attention", "full_attention"]}),
    # Routed experts on every layer (3-D, gate and up interleaved) beside the router; attention
    # with sinks, sliding then full.
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                {**_DENSE, "num_local_experts": 4, "num_experts_per_tok": 2,
                 "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8}),
    # The other MoE families: qwen2_moe's and glm4_moe's layer 0 dense, layer 1 routed experts
    # beside a shared expert (qwen2_moe's with its gate); routed experts on every layer of the
    # rest.
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  {**_DENSE, "num_experts": 4, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
                   "mlp_only_layers": [0]}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              {**_DENSE, "intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2}),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                 {**_DENSE, "n_routed_experts": 4, "n_shared_experts": 1,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}),
    **{family: (f"{cls}Config", f"{cls}ForCausalLM",
                {**_DENSE, "intermediate_size": 32, "num_local_experts": 4,
                 "num_experts_per_tok": 2})
       for family, cls in (("granitemoe", "GraniteMoe"), ("phimoe", "Phimoe"))},
    # DeepSeek's classes: V3's low-rank query (q_a_proj, q_b_proj), V2's one q_proj; every
    # layer dense, or (the MoE variant) layer 1 routed experts beside a shared expert.
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    {**_MLA, "q_lora_rank": 32, "first_k_dense_replace": 2}),
    "deepseek_v3_moe": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                        {**_MLA, "q_lora_rank": 32, "first_k_dense_replace": 1}),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                    {**_MLA, "q_lora_rank": None, "first_k_dense_replace": 2}),
    # One block a layer: Mamba-2, attention, MLP; the MoE variant adds a non-gated MoE block.
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM", {
        **_NEMOTRON_H, "num_hidden_layers": 3, "layers_block_type": ["mamba", "attention", "mlp"]}),
    "nemotron_h_moe": ("NemotronHConfig", "NemotronHForCausalLM", {
        **_NEMOTRON_H, "num_hidden_layers": 4,
        "layers_block_type": ["mamba", "attention", "mlp", "moe"]}),
}


@dataclass(frozen=True)
class Case:
    """One PEFT adapter on disk with PEFT's next-token log-probs for PROMPT."""

    name: str
    family: str
    path: Path
    logprobs: list[float]


def write_model(family: str, out: Path) -> Path:
    """A random float32 model of `family` with its weights, saved under `out`."""
    import transformers

    config_cls, model_cls, kwargs = FAMILIES[family]
    config = getattr(transformers, config_cls)(**kwargs)
    config.architectures = [model_cls]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = getattr(transformers, model_cls)(config).float().eval()
    model.save_pretrained(out)
    if "vision_config" in kwargs:
        _write_processor(config, out)
    return out


# The processor class each wrapper's checkpoints name (Qwen3.5's is Qwen3-VL's).
PROCESSORS = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor",
              "qwen3_vl": "Qwen3VLProcessor", "qwen3_5": "Qwen3VLProcessor"}


def _write_processor(config: Any, out: Path) -> None:
    """A Qwen vision-language wrapper's tokenizer and image processor, which vLLM's multimodal
    processor loads as the engine starts: one word per token id (the wrapper's image and
    video tokens at the config's ids) and images of one size."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    special = {"<|image_pad|>": config.image_token_id, "<|video_pad|>": config.video_token_id,
               "<|vision_start|>": config.vision_start_token_id,
               "<|vision_end|>": config.vision_end_token_id}
    vocab = {f"t{i}": i for i in range(config.text_config.vocab_size)
             if i not in special.values()} | special
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t3"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(list(special))
    tokenizer.save(str(out / "tokenizer.json"))
    processor = PROCESSORS[config.model_type]
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "processor_class": processor,
        "unk_token": "t3", "pad_token": "t0", "bos_token": "t1", "eos_token": "t2",
        "image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
        "vision_start_token": "<|vision_start|>", "vision_end_token": "<|vision_end|>"}))
    patch = config.vision_config.patch_size
    # Square images of 2 x 2 tokens, each 2 x 2 patches merged (one token is too few for
    # vLLM's dummy video: a division by zero).
    pixels = (patch * 2 * 2) ** 2
    (out / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": processor,
        "min_pixels": pixels, "max_pixels": pixels,
        "size": {"shortest_edge": pixels, "longest_edge": pixels}, "patch_size": patch,
        "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5] * 3,
        "image_std": [0.5] * 3}))


def make_case(family: str, base: Path, out: Path, name: str, moe_rewrite: bool = True,
              **lora_kwargs: Any) -> Case:
    """A PEFT adapter with random A and B (never PEFT's zero B) on the model at `base`; without
    `moe_rewrite`, made as before PEFT's MoE rewrite (transformers 4), which on DeepSeek turns
    gate/up/down targets into expert parameters and so adapts no dense MLP."""
    from unittest import mock

    import peft.utils.transformers_weight_conversion as conversion
    import transformers
    from peft import LoraConfig, get_peft_model

    model = getattr(transformers, FAMILIES[family][1]).from_pretrained(base).float().eval()
    with torch.random.fork_rng(devices=[]), mock.patch.object(
            conversion, "_convert_peft_config_moe",
            conversion._convert_peft_config_moe if moe_rewrite else lambda *args: None):
        torch.manual_seed(0)
        peft_model = get_peft_model(model, LoraConfig(**lora_kwargs))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param_name, p in peft_model.named_parameters():
            if "lora_" in param_name or "trainable_tokens" in param_name:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    peft_model.peft_config["default"].base_model_name_or_path = str(base)
    path = out / name
    peft_model.save_pretrained(path)
    with torch.no_grad():
        logits = peft_model(torch.tensor([PROMPT])).logits[0, -1].float()
    logprobs = torch.log_softmax(logits, -1).tolist()
    (path / "peft_logprobs.json").write_text(json.dumps(logprobs))
    return Case(name, family, path, logprobs)


def run_job(python: Path, runner: Path, out: Path, job: dict[str, Any], what: str,
            env: dict[str, str] | None = None) -> tuple[dict[str, Any], str]:
    """`runner` under the engine's `python` on `job` (written to `out`/job.json), in `env` (or
    this process's): the report it writes to `out`/report.json and its output, stdout and
    stderr in the order written (the engine's log). The test fails, naming `what` and the
    output's end, when it fails, runs past its limit (300 s and 150 s per job: on a loaded
    machine one vLLM engine takes minutes to start) or writes no report."""
    limit = 300 + 150 * len(job.get("jobs", [job]))
    import subprocess

    import pytest

    (out / "job.json").write_text(json.dumps(job))
    try:
        proc = subprocess.run([str(python), str(runner), str(out / "job.json"),
                               str(out / "report.json")], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=limit, env=env)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the {what} failed: no end after {exc.timeout} s")
    if proc.returncode or not (out / "report.json").exists():
        pytest.fail(f"the {what} failed: {proc.stdout[-3000:]}")
    return json.loads((out / "report.json").read_text()), proc.stdout


def assert_sglang_pool(run: dict[str, Any], engine: dict[str, Any]) -> None:
    """metrale's SGLang record (`engine`, from `layout --engine sglang --json`) against the
    buffers SGLang's own LoRAMemoryPool allocated in `run`: per module, layer 0's A and B
    shapes and the bytes over every layer, and the total."""
    shapes: dict[str, dict[str, list[int]]] = {}
    allocated: dict[str, int] = {}
    for kind, module, layer, shape, size in run["pool"]["buffers"]:
        allocated[module] = allocated.get(module, 0) + size
        if layer in (0, None):
            shapes.setdefault(module, {})[kind.rsplit("_", 1)[-1]] = shape
    predicted = {m["module"]: m for m in engine["modules"]}
    assert set(predicted) == set(shapes)
    for module, m in predicted.items():
        assert dict(m["buffers"]) == shapes[module], module
        assert m["bytes"] == allocated[module], module
    assert engine["lora_bytes"] == run["pool"]["bytes"]
