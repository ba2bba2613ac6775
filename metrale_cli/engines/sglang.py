"""What SGLang 0.5.23 does with a PEFT adapter's config, and its LoRA pool's bytes for dense
models, read from SGLang 0.5.23's installed source (`sglang/srt/lora/`); each rule names the
file and function it comes from. Checked against SGLang's own code running on CPU tensors
(tests/test_engine_sglang.py, through tests/support/sglang_runner.py).

This is the rule layer only: the CLI's `--engine sglang` and the engine seam are not wired yet.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

VERSION = "0.5.23"

# srt/lora/utils.py get_normalized_target_modules: params_mapping (the dense entries).
_NORMALISED = {
    "q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj",
    "embed_tokens": "embed_tokens", "vocab_emb": "embed_tokens", "embeddings": "embed_tokens",
    "word_embeddings": "embed_tokens", "lm_head": "lm_head", "output": "lm_head",
    "unembed_tokens": "lm_head",
}

# srt/lora/utils.py get_stacked_multiply: the A buffer holds c ranks for a fused module.
_STACKED = {"qkv_proj": 3, "gate_up_proj": 2}


class SGLangConfigError(ValueError):
    """A `target_modules` SGLang does not accept, in SGLang's words."""


def normalised_targets(target_modules: str | Iterable[str]) -> set[str]:
    """srt/lora/utils.py get_normalized_target_modules: a string is only 'all'/'all-linear'
    ({"all"}); a list maps each name's last dotted part through params_mapping."""
    if isinstance(target_modules, str):
        if target_modules not in ("all", "all-linear"):
            raise SGLangConfigError(
                "Only 'all' or 'all-linear' can be used as the string for target module")
        return {"all"}
    out = set()
    for name in target_modules:
        leaf = name.split(".")[-1]
        out.add(_NORMALISED.get(leaf, leaf))
    return out


def scaling(config: Mapping[str, Any]) -> float:
    """srt/lora/lora.py LoRAAdapter.__init__: `self.scaling = lora_alpha / r`, whatever
    `use_rslora`, `rank_pattern` or `alpha_pattern` say."""
    return config["lora_alpha"] / config["r"]


def peft_scaling(config: Mapping[str, Any]) -> float:
    """PEFT's scale for the same config's default rank: alpha/sqrt(r) under rsLoRA."""
    r, alpha = config["r"], config["lora_alpha"]
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


@dataclass(frozen=True)
class Judgement:
    """One adapter through one path: accepted, or SGLang's error class and text."""

    accepted: bool
    error_type: str = ""
    error: str = ""
    differs: tuple[str, ...] = ()


def judge(name: str, config: Mapping[str, Any], weight_names: Iterable[str], *,
          pool: tuple[int, set[str]] | None = None, added_tokens: int = 0) -> Judgement:
    """Whether `_load_lora_adapter` accepts the adapter (srt/lora/lora_manager.py), in its
    order: `validate_new_adapter` (added tokens, DoRA, then, once a pool exists, its
    `can_support`: rank and targets, srt/lora/mem_pool.py), then `LoRAAdapter.
    initialize_weights` (srt/lora/lora.py normalize_qkv_proj: q_proj without v_proj is a
    KeyError on the missing v_proj key). `pool` is (max rank, target set) for the runtime
    path; None at start-up, where no pool exists yet."""
    if added_tokens > 0:
        return Judgement(False, "ValueError", f"Failed to load {name} because LoRA serving "
                         "currently doesn't support adapters that add tokens to the vocabulary")
    if config.get("use_dora"):
        return Judgement(False, "ValueError", f"Failed to load {name} because LoRA serving "
                         "currently doesn't support DoRA adapters")
    if pool is not None:
        max_rank, targets = pool
        wanted = normalised_targets(config["target_modules"])
        if config["r"] > max_rank or ("all" not in wanted and not wanted <= targets):
            return Judgement(False, "ValueError", (
                f"LoRA adapter {name} with rank {config['r']} is incompatible with the current "
                "LoRA memory pool configuration. Please ensure that the LoRA adapter's rank is "
                "within the configured `--max-lora-rank` and that the target modules are "
                "included in `--lora-target-modules`."))
    names = list(weight_names)
    for w in names:
        if "q_proj" in w and "qkv_proj" not in w:
            v = w.replace("q_proj", "v_proj")
            if v not in names:
                return Judgement(False, "KeyError", repr(v))
    differs = []
    if scaling(config) != peft_scaling(config):
        differs.append(f"scale {scaling(config):g} (lora_alpha / r) where PEFT applies "
                       f"{peft_scaling(config):g} (rsLoRA)")
    if config.get("modules_to_save"):
        # srt/lora/lora.py LoRAAdapter._process_weight: a key without a layer id that is not
        # an embedding or lm_head LoRA is dropped without a word.
        differs.append(f"modules_to_save {sorted(config['modules_to_save'])} not loaded")
    return Judgement(True, differs=tuple(differs))


def pool_bytes(model: Mapping[str, Any], targets: Iterable[str], max_rank: int,
               max_loras_per_batch: int, dtype_bytes: int) -> int:
    """The bytes `LoRAMemoryPool.init_buffers` allocates for a dense model at TP 1
    (srt/lora/mem_pool.py get_lora_A_shape / get_lora_B_shape: A (N, r * c, in), B (N, out,
    r) per layer and module), with the dims of srt/lora/utils.py get_default_hidden_dim."""
    hidden = model["hidden_size"]
    heads = model["num_attention_heads"]
    head_dim = model.get("head_dim") or hidden // heads
    kv = model.get("num_key_value_heads", heads)
    inter = model["intermediate_size"]
    dims = {"qkv_proj": (hidden, head_dim * (heads + 2 * kv)),
            "o_proj": (head_dim * heads, hidden),
            "gate_up_proj": (hidden, 2 * inter),
            "down_proj": (inter, hidden)}
    per_layer = 0
    for module in targets:
        if module not in dims:
            raise SGLangConfigError(f"no dense pool rule for {module!r}")
        d_in, d_out = dims[module]
        per_layer += max_rank * _STACKED.get(module, 1) * d_in + d_out * max_rank
    return per_layer * model["num_hidden_layers"] * max_loras_per_batch * dtype_bytes
