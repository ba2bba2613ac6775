"""SGLang 0.5.23's model as its LoRA code sees it: the per-family table, the server flags it
reads (as `python -m sglang.launch_server` spells them, validated as its start-up validates
them), the pool a server builds from its start-up adapters, and the bytes of that pool's A and
B buffers per GPU. From configs only; read from SGLang 0.5.23's installed source
(`sglang/srt/lora/`, `sglang/srt/arg_groups/`) and checked against its own `LoRAMemoryPool`
running on CPU tensors (tests/test_engine_sglang_memory.py). `sglang.py` holds the rules
that judge one adapter's config; this module turns them into the engine seam's answers
(`SglangEngine`, `ENGINE`): a verdict per load path, the launch line, the pool's bytes and what
`simulate` replays.

How SGLang takes adapters, in order (lora_manager.py init_state, tokenizer_control_mixin.py),
each answered by `sglang.judge_report` (`judgements`), never decided here:
1. `--lora-paths`: each through `_load_lora_adapter`; the first failure is
   `init_lora_adapters`' RuntimeError and the server never starts (`path="startup"`).
2. init_lora_shapes: the pool's targets (`--lora-target-modules`, else the start-up adapters'
   union) and max rank (`--max-lora-rank`, else their largest `r`): `sglang.startup_pool`; a
   start-up adapter outside given targets stops the start.
3. Runtime `POST /load_lora_adapter`: against that pool (its `can_support`, then the load); a
   refusal is HTTP 400 with SGLang's text and the server keeps serving (`path="runtime"`).
4. Either path's first batch naming it: a pool-slot copy that raises takes the server down.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from metrale_cli.engines import sglang
from metrale_cli.engines.engine import SlotTiers
from metrale_cli.engines.sglang import VERSION, Judgement
from metrale_cli.engines.verdict import EngineVerdict, Verdict
from metrale_cli.errors import UsageError
from metrale_cli.model.config import ModelConfig, find_preset

if TYPE_CHECKING:
    from metrale_cli.adapters.audit import AdapterReport

NAME = "sglang"


@dataclass(frozen=True)
class SglangFamily:
    """What SGLang 0.5.23 does for one `model_type` that changes its LoRA: one row per row of
    model/families.py FAMILIES (tests/test_engine_seam.py holds every engine's table to the
    same keys)."""

    model_type: str
    # The class SGLang's registry builds (sglang/srt/models/*.py `EntryClass`).
    architectures: tuple[str, ...]
    # "dense": the class defines no `get_hidden_dim`, so the pool takes SGLang's default dims
    # and stacking (lora/utils.py get_default_hidden_dim, get_stacked_multiply), which metrale
    # sizes. "moe" / "hybrid": per-expert 4-D buffers (mem_pool.py init_buffers, `*_moe`) or
    # the class's own `get_hidden_dim` (models/qwen3_5.py): sized from the model object, which
    # does not build on a CPU, so metrale gives no bytes for them.
    pool: str
    # "run": SGLang's own LoRA code was run on this family's PEFT adapters (tests); "source":
    # the answer comes from reading the source only.
    checked: str
    note: str = ""


FAMILIES: dict[str, SglangFamily] = {f.model_type: f for f in (
    SglangFamily("llama", ("LlamaForCausalLM",), "dense", "run"),
    SglangFamily("mistral", ("MistralForCausalLM",), "dense", "run",
                 "models/mistral.py subclasses the Llama class"),
    SglangFamily("qwen2", ("Qwen2ForCausalLM",), "dense", "run"),
    SglangFamily("qwen3", ("Qwen3ForCausalLM",), "dense", "run"),
    SglangFamily("qwen3_moe", ("Qwen3MoeForCausalLM",), "moe", "source",
                 "routed experts take gate_up_proj_moe / down_proj_moe buffers per expert"),
    SglangFamily("mixtral", ("MixtralForCausalLM",), "moe", "source",
                 "routed experts take gate_up_proj_moe / down_proj_moe buffers per expert"),
    SglangFamily("qwen3_next", ("Qwen3NextForCausalLM",), "hybrid", "source",
                 "Gated-DeltaNet in_proj_qkvz stacks 4 ranks (get_stacked_multiply); MoE "
                 "experts as qwen3_moe"),
    SglangFamily("qwen3_5", ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"),
                 "hybrid", "source",
                 "the class defines its own get_hidden_dim and should_apply_lora"),
    SglangFamily("qwen3_5_moe", ("Qwen3_5MoeForCausalLM",
                                 "Qwen3_5MoeForConditionalGeneration"), "hybrid", "source",
                 "the class defines its own get_hidden_dim and should_apply_lora"),
)}


def family(model: ModelConfig) -> SglangFamily:
    """The row for `model`'s family; a family without one is refused, never guessed."""
    row = FAMILIES.get(model.model_type)
    if row is None:
        raise UsageError(f"model type {model.model_type!r}: no SGLang {VERSION} rules for it "
                         "(engines/sglang_model.py FAMILIES)")
    return row


# utils/common.py SUPPORTED_LORA_TARGET_MODULES (the `--lora-target-modules` choices), and
# LORA_TARGET_ALL_MODULES, which must stand alone (arg_groups/lora_hook.py).
SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "kv_a_proj_with_mqa",
                     "q_b_proj", "kv_b_proj", "wq_b", "wk", "weights_proj", "gate_proj",
                     "up_proj", "down_proj", "qkv_proj", "gate_up_proj", "embed_tokens",
                     "lm_head", "qkvr", "wo_ud")
ALL = "all"
# arg_groups/fields/lora.py: the choices and defaults of the LoRA flags.
LORA_BACKENDS = ("triton", "csgmv", "ascend", "torch_native", "triton_v2")
EVICTION_POLICIES = ("lru", "fifo")
DEFAULT_MAX_LORAS_PER_BATCH = 8
DEFAULT_LORA_BACKEND = "csgmv"
DTYPES = ("auto", "float16", "bfloat16", "float32")
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
# lora/utils.py EMBEDDING_NAMES, in the order init_buffers allocates their pairs.
EMBEDDINGS = ("embed_tokens", "lm_head")
# lora/utils.py ROW_PARALLELISM_LINEAR_LORA_NAMES (the dense ones): A's input split over TP.
_ROW_PARALLEL = ("o_proj", "down_proj")
# How each module's buffers split over TP (the view's "kind").
_KINDS = {"qkv_proj": "column (qkv)", "gate_up_proj": "column", "o_proj": "row",
          "down_proj": "row", "embed_tokens": "embedding", "lm_head": "lm_head"}
# layers/vocab_parallel_embedding.py DEFAULT_VOCAB_PADDING_SIZE.
_VOCAB_PADDING = 64


@dataclass(frozen=True)
class Flags:
    """The `sglang.launch_server` LoRA flags that change a verdict or the pool."""

    # --max-lora-rank; None: the largest `r` of the start-up adapters (init_lora_shapes).
    max_lora_rank: int | None = None
    # --lora-target-modules as given; None: the union of the start-up adapters' targets.
    target_modules: tuple[str, ...] | None = None
    max_loras_per_batch: int = DEFAULT_MAX_LORAS_PER_BATCH
    # --max-loaded-loras; None: no limit on the adapters held in CPU memory.
    max_loaded_loras: int | None = None
    lora_backend: str = DEFAULT_LORA_BACKEND
    eviction_policy: str = "lru"
    tp: int = 1
    dtype: str = "auto"
    # The pool the server builds from its start-up adapters (SglangEngine.startup); None
    # before they are known.
    pool: Pool | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        # arg_groups/lora_hook.py check_lora_server_args, in its words where it has them.
        if self.max_loras_per_batch < 1:
            raise UsageError("--max-loras (SGLang's --max-loras-per-batch): "
                             "max_loras_per_batch must be positive")
        if self.max_loaded_loras is not None and self.max_loaded_loras < self.max_loras_per_batch:
            raise UsageError(
                "--max-loaded-loras: max_loaded_loras should be greater than or equal to "
                f"max_loras_per_batch. max_loaded_loras={self.max_loaded_loras}, "
                f"max_loras_per_batch={self.max_loras_per_batch}")
        if self.max_lora_rank is not None and self.max_lora_rank < 1:
            raise UsageError(f"--max-rank {self.max_lora_rank}: must be at least 1")
        if self.tp < 1:
            raise UsageError("--tp must be at least 1")
        if self.target_modules is not None:
            bad = [m for m in self.target_modules if m not in (*SUPPORTED_TARGETS, ALL)]
            if bad or not self.target_modules:
                raise UsageError(f"--modules: SGLang's --lora-target-modules takes "
                                 f"{', '.join(SUPPORTED_TARGETS)} or {ALL} (not "
                                 f"{', '.join(bad) or 'nothing'})")
            if ALL in self.target_modules and len(self.target_modules) > 1:
                raise UsageError("--modules: If 'all' is specified in --lora-target-modules, "
                                 "it should be the only module specified.")
        for flag, value, choices in (("--lora-backend", self.lora_backend, LORA_BACKENDS),
                                     ("--eviction-policy", self.eviction_policy,
                                      EVICTION_POLICIES), ("--dtype", self.dtype, DTYPES)):
            if value not in choices:
                raise UsageError(f"{flag} {value!r}: one of {', '.join(choices)}")

    def model_dtype(self, model: ModelConfig) -> str:
        """`--dtype auto` (configs/model_config.py _get_and_verify_dtype): the config's dtype,
        float32 (or none stated) cast to float16; the LoRA pool takes the model's dtype
        (lora_manager.py: the model runner's dtype)."""
        if self.dtype != "auto":
            return self.dtype
        from metrale_cli.engines.vllm_model import raw_text_config

        raw = raw_text_config(model)
        stated = raw.get("dtype") or raw.get("torch_dtype")
        if stated is None and model.source and find_preset(model.source) is not None:
            # A preset keeps no dtype; every preset's hub config states bfloat16.
            stated = "bfloat16"
        return stated if stated in ("float16", "bfloat16") else "float16"

    def record(self, model: ModelConfig) -> dict[str, Any]:
        return {"max_lora_rank": self.max_lora_rank,
                "lora_target_modules": list(self.target_modules) if self.target_modules
                else None, "max_loras_per_batch": self.max_loras_per_batch,
                "max_loaded_loras": self.max_loaded_loras, "lora_backend": self.lora_backend,
                "lora_eviction_policy": self.eviction_policy, "tp_size": self.tp,
                "dtype": self.model_dtype(model)}


def target_modules(text: str) -> tuple[str, ...]:
    """`--modules` as SGLang's --lora-target-modules (Flags validates the names)."""
    return tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))


@dataclass(frozen=True)
class Pool:
    """The pool a server builds (lora_manager.py init_lora_shapes): its max rank and its
    normalised target modules."""

    max_rank: int
    targets: frozenset[str]

    @classmethod
    def at_startup(cls, flags: Flags, model: ModelConfig,
                   configs: Iterable[Mapping[str, Any]]) -> Pool:
        """`sglang.startup_pool` for the start-up adapters' configs under `flags`."""
        rank, targets = sglang.startup_pool(configs, flags.max_lora_rank, flags.target_modules,
                                            tie_word_embeddings=model.tie_word_embeddings)
        return cls(rank, frozenset(targets))

    def rules(self) -> tuple[int, set[str]]:
        """As `sglang.judge` takes a pool."""
        return self.max_rank, set(self.targets)

    def record(self) -> dict[str, Any]:
        return {"max_lora_rank": self.max_rank, "target_modules": sorted(self.targets)}


# -- memory ----------------------------------------------------------------------------------


def _divide(size: int, tp: int, what: str) -> int:
    if size % tp:
        raise UsageError(f"--tp {tp} does not divide {what} ({size}): SGLang cannot shard it")
    return size // tp


def buffer_shapes(model: ModelConfig, module: str, rank: int, slots: int, tp: int,
                  ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The A and B buffers one GPU (TP rank 0) allocates for `module` on one layer, as
    mem_pool.py shapes them: get_lora_A_shape (N, r * c, in; a row-parallel module's `in`
    split over TP), get_lora_B_shape (N, out, r; a column-parallel module's `out` split over
    TP, `qkv_proj` keeping whole KV heads when TP exceeds them:
    _column_parallel_lora_b_per_rank_dim), and for the embedding and output head
    get_embedding_lora_A_shape / get_embedding_lora_B_shape (A (N, r, vocab or hidden),
    unsharded; the head's B (N, vocab rows, r): get_lm_head_lora_b_shard_size,
    `_lm_head_rows`). Dims are lora/utils.py get_default_hidden_dim's."""
    H, hd = model.hidden_size, model.head_dim
    heads, kv, inter, vocab = (model.num_attention_heads, model.num_key_value_heads,
                               model.intermediate_size, model.vocab_size)
    if module == "embed_tokens":
        return (slots, rank, vocab), (slots, H, rank)
    if module == "lm_head":
        return (slots, rank, H), (slots, _lm_head_rows(model, tp), rank)
    dims = {"qkv_proj": (H, hd * (heads + 2 * kv)), "o_proj": (hd * heads, H),
            "gate_up_proj": (H, 2 * inter), "down_proj": (inter, H)}
    if module not in dims:
        raise UsageError(f"SGLang {VERSION}: no dense pool rule for {module!r}")
    d_in, d_out = dims[module]
    c = sglang.STACKED.get(module, 1)
    if module in _ROW_PARALLEL:
        d_in = _divide(d_in, tp, module)
    elif module == "qkv_proj" and kv < tp:
        d_out = _divide(hd * heads, tp, module) + 2 * hd
    else:
        d_out = _divide(d_out, tp, module)
    return (slots, rank * c, d_in), (slots, d_out, rank)


def _lm_head_rows(model: ModelConfig, tp: int) -> int:
    """The output head's rows on TP rank 0, as its LoRA B takes them: the base ParallelLMHead's
    `shard_indices.num_org_elements` (layers/vocab_parallel_embedding.py: the vocabulary padded
    to 64, or to 64 * tp when that does not split over tp, rank 0's share of it, padding
    removed). Under TP 1, or with tied embeddings (the head is then the embedding module, no
    ParallelLMHead for mem_pool.py to find), the whole vocabulary."""
    vocab = model.vocab_size
    if tp == 1 or model.tie_word_embeddings:
        return vocab
    pad = _VOCAB_PADDING if (-(-vocab // _VOCAB_PADDING) * _VOCAB_PADDING) % tp == 0 \
        else _VOCAB_PADDING * tp
    return min(-(-vocab // pad) * pad // tp, vocab)


@dataclass(frozen=True)
class Memory:
    """SGLang's LoRA pool on one GPU for a model, flags and the pool they make."""

    model: ModelConfig
    flags: Flags
    pool: Pool
    # (module, layers, copies of each layer's pair, A shape, B shape, bytes in all), per
    # target module.
    per_module: list[tuple[str, int, int, tuple[int, ...], tuple[int, ...], int]]
    # Adapters held in CPU memory (--max-loaded-loras of them, else every start-up one).
    host_bytes: int
    budget_bytes: int | None = None

    @classmethod
    def of(cls, model: ModelConfig, flags: Flags, pool: Pool,
           adapters: list[AdapterReport] | None = None,
           budget_bytes: int | None = None) -> Memory:
        row = family(model)
        if row.pool != "dense":
            raise UsageError(
                f"--engine sglang: SGLang {VERSION} sizes the LoRA pool of a {row.model_type} "
                f"model ({row.pool}) from its model class ({row.note}); metrale sizes dense "
                f"families only ({', '.join(f for f, r in FAMILIES.items() if r.pool == 'dense')})")
        elem = DTYPE_BYTES[flags.model_dtype(model)]
        per_module = []
        # mem_pool.py init_buffers: the embedding and head pairs, then every other target's
        # A and B per layer.
        order = [m for m in EMBEDDINGS if m in pool.targets] + sorted(
            m for m in pool.targets if m not in EMBEDDINGS)
        # With both targeted, each of init_buffers' two embedding tables (embedding_A/B_buffer
        # and lm_head_A/B_buffer) takes a pair for every one of embed_tokens and lm_head
        # (init_embedding_buffer allocates `target_modules & EMBEDDING_NAMES` into each), and
        # only one pair of each is ever read (get_embedding_tensor): both pairs twice over.
        copies = 2 if set(EMBEDDINGS) <= pool.targets else 1
        for module in order:
            a, b = buffer_shapes(model, module, pool.max_rank, flags.max_loras_per_batch,
                                 flags.tp)
            layers, n = (1, copies) if module in EMBEDDINGS else (model.num_hidden_layers, 1)
            per_module.append((module, layers, n, a, b,
                               (math.prod(a) + math.prod(b)) * elem * layers * n))
        sizes = sorted((_file_bytes(r) for r in adapters or []), reverse=True)
        held = sizes if flags.max_loaded_loras is None else sizes[:flags.max_loaded_loras]
        return cls(model, flags, pool, per_module, sum(held), budget_bytes)

    @property
    def lora_bytes(self) -> int:
        return sum(b for *_, b in self.per_module)

    @property
    def slot_bytes(self) -> int:
        """One slot: every buffer's leading dimension is --max-loras-per-batch."""
        return self.lora_bytes // self.flags.max_loras_per_batch

    @property
    def max_loras_fit(self) -> int | None:
        if self.budget_bytes is None or not self.slot_bytes:
            return None
        return self.budget_bytes // self.slot_bytes

    def record(self) -> dict[str, Any]:
        rec: dict[str, Any] = {
            "name": NAME, "version": VERSION, "flags": self.flags.record(self.model),
            "pool": self.pool.record(), "lora_bytes": self.lora_bytes,
            "slot_bytes": self.slot_bytes, "host_cache_bytes": self.host_bytes,
            "per_gpu": True, "checked": family(self.model).checked,
            "modules": [{"module": m, "kind": _KINDS[m], "layers": n, "copies": c,
                         "bytes": b, "buffers": [["A", list(a)], ["B", list(bb)]]}
                        for m, n, c, a, bb, b in self.per_module],
        }
        if self.budget_bytes is not None:
            rec["budget_bytes"] = self.budget_bytes
            rec["max_loras_fit"] = self.max_loras_fit
            rec["budget_left_bytes"] = self.budget_bytes - self.lora_bytes
        return rec


def _file_bytes(report: AdapterReport) -> int:
    """What an adapter holds in CPU memory once loaded: every tensor of its file as stored
    (lora.py LoRAAdapter.initialize_weights keeps `loaded_weight.cpu()`, no cast)."""
    return sum(t.end - t.begin for t in report.adapter.header.tensors.values())


# -- verdicts per load path --------------------------------------------------------------------


def judgements(report: AdapterReport, model: ModelConfig, flags: Flags,
               ) -> dict[str, Judgement]:
    """The rules' judgement (`sglang.judge_report`) of the adapter on each load path: at
    start-up against the pool a start-up naming it builds under `flags` (the other start-up
    adapters can only widen a pool the flags do not fix, which changes none of its checks), at
    runtime against the running pool (`flags.pool`, else the one it builds alone)."""
    alone = Pool.at_startup(flags, model, [report.adapter.config.raw])
    return {"startup": sglang.judge_report(report, model, pool=alone.rules(), path="startup"),
            "runtime": sglang.judge_report(report, model, pool=(flags.pool or alone).rules(),
                                           path="runtime")}


def reason(got: Judgement) -> str:
    """A judgement in words: what the server does, and SGLang's own text where it raises."""
    v = got.verdict
    if v is Verdict.FAILS_STARTUP:
        return (f"naming it in --lora-paths stops the server from starting ({got.error_type}: "
                f"{got.error})")
    if v is Verdict.REFUSES:
        return (f"POST /load_lora_adapter answers HTTP 400 ({got.error}); the server keeps "
                "serving the base model and every other adapter")
    if v is Verdict.CRASHES:
        loads = ("named in --lora-paths it loads" if got.path == "startup"
                 else "POST /load_lora_adapter loads it")
        return (f"{loads}, and the first batch naming it fails copying it into a pool slot "
                f"(mem_pool.py load_lora_weight_to_buffer raises {got.batch_error_type}: "
                f"{got.batch_error}), taking the scheduler and the server down")
    if v is Verdict.DIFFERS:
        return "loads and serves otherwise than PEFT: " + "; ".join(got.differs)
    return "loads and applies every module at PEFT's scale (lora_alpha / r)"


def starts(got: Judgement) -> bool:
    """Whether a start-up judgement leaves the adapter on the launch line: the server starts
    with it and its first batch does not take it down."""
    return got.verdict in (Verdict.SERVES, Verdict.DIFFERS)


def verdict_of(report: AdapterReport, model: ModelConfig, flags: Flags,
               flags_source: str = "given") -> EngineVerdict:
    """The adapter on both of SGLang's load paths under `flags` (whose `pool` is the one its
    start-up adapters build), each the rules' judgement; `verdict` is the runtime path's. The
    rules were run against SGLang's own code for the families marked `checked: run`."""
    judged = judgements(report, model, flags)
    checked = family(model).checked
    paths = {path: {"verdict": got.verdict.value, "reason": reason(got), "checked": checked}
             for path, got in judged.items()}
    runtime = judged["runtime"]
    pool = flags.pool or Pool.at_startup(flags, model, [report.adapter.config.raw])
    return EngineVerdict(NAME, VERSION, runtime.verdict, paths["runtime"]["reason"],
                         runtime.reason_class, {**flags.record(model), "pool": pool.record()},
                         flags_source, [], {}, paths)


# -- the launch line metrale recommends --------------------------------------------------------


def _model_path(model: ModelConfig) -> str:
    preset = find_preset(model.source) if model.source else None
    if preset is not None:
        return preset.hub_ids[0]
    path = Path(model.source) if model.source else None
    if path is not None and path.name == "config.json":
        return str(path.parent.resolve())
    return model.source or "MODEL"


@dataclass(frozen=True)
class Recommendation:
    """The launch flags for a set of adapters: every one SGLang starts with named in
    `--lora-paths` (by absolute path), the others left out with the reason."""

    flags: Flags
    model: ModelConfig
    lora_paths: list[tuple[str, str]]
    memory: Memory | None
    memory_note: str = ""
    shut_out: list[str] = field(default_factory=list)

    def serve_line(self) -> str | None:
        f = self.flags
        if not self.lora_paths and (f.max_lora_rank is None or f.target_modules is None):
            return None  # SGLang refuses a LoRA server with nothing to size its pool from
        parts = ["python -m sglang.launch_server", "--model-path", _model_path(self.model),
                 "--enable-lora"]
        if self.lora_paths:
            parts.append("--lora-paths " + " ".join(f"{n}={p}" for n, p in self.lora_paths))
        if f.max_lora_rank is not None:
            parts.append(f"--max-lora-rank {f.max_lora_rank}")
        if f.target_modules is not None:
            parts.append("--lora-target-modules " + " ".join(f.target_modules))
        parts.append(f"--max-loras-per-batch {f.max_loras_per_batch}")
        if f.max_loaded_loras is not None:
            parts.append(f"--max-loaded-loras {f.max_loaded_loras}")
        if f.lora_backend != DEFAULT_LORA_BACKEND:
            parts.append(f"--lora-backend {f.lora_backend}")
        if f.eviction_policy != "lru":
            parts.append(f"--lora-eviction-policy {f.eviction_policy}")
        if f.tp > 1:
            parts.append(f"--tp-size {f.tp}")
        if f.dtype != "auto":
            parts.append(f"--dtype {f.dtype}")
        return " ".join(parts)

    def record(self) -> dict[str, Any]:
        return {
            "flags": self.flags.record(self.model),
            "pool": self.flags.pool.record() if self.flags.pool else None,
            "serve": self.serve_line(),
            "lora_paths": [{"name": n, "path": p} for n, p in self.lora_paths],
            "lora_bytes": self.memory.lora_bytes if self.memory else None,
            "slot_bytes": self.memory.slot_bytes if self.memory else None,
            "host_cache_bytes": self.memory.host_bytes if self.memory else None,
            "memory_note": self.memory_note,
            # Adapters the launch line leaves out, each with SGLang's reason.
            "shut_out": self.shut_out,
        }


# -- the engine behind the seam (engines/engine.py) --------------------------------------------

_FLAG_OPTIONS = ("--max-rank", "--modules", "--max-loras", "--max-loaded-loras",
                 "--lora-backend", "--eviction-policy", "--tp", "--dtype")


def _flags_from(given: Mapping[str, object], default_loras: int | None = None) -> Flags:
    g = {k: given.get(k) for k in _FLAG_OPTIONS}
    modules = g["--modules"]
    return Flags(
        max_lora_rank=g["--max-rank"],  # type: ignore[arg-type]
        target_modules=target_modules(str(modules)) if modules else None,
        max_loras_per_batch=g["--max-loras"] or default_loras or  # type: ignore[arg-type]
        DEFAULT_MAX_LORAS_PER_BATCH,
        max_loaded_loras=g["--max-loaded-loras"],  # type: ignore[arg-type]
        # `is None`, not `or`: an empty value is the user's, refused as any unknown one.
        lora_backend=DEFAULT_LORA_BACKEND if g["--lora-backend"] is None  # type: ignore[arg-type]
        else g["--lora-backend"],
        eviction_policy="lru" if g["--eviction-policy"] is None  # type: ignore[arg-type]
        else g["--eviction-policy"],
        tp=g["--tp"] or 1, dtype=g["--dtype"] or "auto")  # type: ignore[arg-type]


class SglangEngine:
    """SGLang 0.5.23 as an `Engine`: its options, verdicts per load path, launch line, pool
    bytes and cache."""

    name = NAME
    version = VERSION
    versions = (VERSION,)
    families = FAMILIES
    options = {"inspect": frozenset(_FLAG_OPTIONS),
               "layout": frozenset({*_FLAG_OPTIONS, "--budget"}),
               "simulate": frozenset({*_FLAG_OPTIONS, "--budget"})}

    def installed_warning(self) -> str | None:
        """SGLang's installed version where `sglang` is importable here, read from its
        metadata without importing it."""
        import importlib.metadata
        import importlib.util

        try:
            if importlib.util.find_spec("sglang") is None:
                return None
            installed = importlib.metadata.version("sglang")
        except (ImportError, ValueError, importlib.metadata.PackageNotFoundError):
            return None
        if installed.split("+", 1)[0] != VERSION:
            return f"the installed sglang is {installed}; these are SGLang {VERSION}'s rules"
        return None

    def check_tp(self, model: ModelConfig, tp: int, fully_sharded: bool) -> None:
        from metrale_cli.layout.sharding import ShardSpec, check_model_split

        check_model_split(model, ShardSpec(tp, 0, 1, False), who="SGLang")

    def flags(self, model: ModelConfig, given: Mapping[str, object]) -> Flags | None:
        if all(given.get(k) in (None, False) for k in _FLAG_OPTIONS):
            return None
        flags = _flags_from(given)
        if flags.tp > 1:
            self.check_tp(model, flags.tp, False)
        return flags

    def startup(self, model: ModelConfig, flags: Flags,
                reports: list[AdapterReport]) -> Flags:
        """`flags` with the pool a server builds when every adapter that can start it is in
        `--lora-paths` (the others are left out of the launch line); SGLang's start-up checks
        of the set (arg_groups/lora_hook.py) refuse it as SGLang would."""
        family(model)
        kept = [r for r in reports if starts(judgements(r, model, flags)["startup"])]
        if flags.max_loaded_loras is not None and len(kept) > flags.max_loaded_loras:
            raise UsageError("--max-loaded-loras: The number of LoRA paths should not exceed "
                             f"max_loaded_loras. max_loaded_loras={flags.max_loaded_loras}, "
                             f"lora_paths={len(kept)}")
        return replace(flags, pool=Pool.at_startup(flags, model,
                                                   [r.adapter.config.raw for r in kept]))

    def layout_flags(self, model: ModelConfig, reports: list[AdapterReport],
                     given: Mapping[str, object]) -> Flags:
        flags = _flags_from(given)
        if not reports and (flags.max_lora_rank is None or flags.target_modules is None):
            raise UsageError("--engine sglang without adapters needs --max-rank and --modules: "
                             "When no initial --lora-paths is provided, you need to specify "
                             "both --max-lora-rank and --lora-target-modules for LoRA "
                             "initialization.")
        if flags.tp > 1:
            self.check_tp(model, flags.tp, False)
        return self.startup(model, flags, reports)

    def judge(self, report: AdapterReport, model: ModelConfig, flags: Flags,
              flags_source: str = "given") -> EngineVerdict:
        return verdict_of(report, model, flags, flags_source)

    def recommend(self, reports: list[AdapterReport], model: ModelConfig,
                  given: Mapping[str, object]) -> Recommendation:
        """The given flags, and without `--max-loras` a batch that holds every start-up
        adapter and the base model (SGLang counts a base-only request as one of
        --max-loras-per-batch: arg_groups/fields/lora.py), two at least (the base model and
        one adapter loaded at runtime)."""
        probe = _flags_from(given)
        if probe.tp > 1:
            self.check_tp(model, probe.tp, False)
        at_startup = [(r, judgements(r, model, probe)["startup"]) for r in reports]
        kept = [r for r, got in at_startup if starts(got)]
        shut_out = [f"{r.name}: {reason(got)}" for r, got in at_startup if not starts(got)]
        flags = self.startup(model, _flags_from(given, max(2, len(kept) + 1)), kept)
        memory, note = None, ""
        try:
            memory = Memory.of(model, flags, flags.pool or Pool.at_startup(flags, model, []),
                               kept)
        except UsageError as exc:
            note = str(exc)
        paths = [(r.name, str(Path(r.adapter.path).resolve())) for r in kept]
        return Recommendation(flags, model, paths, memory, note, shut_out)

    def memory(self, model: ModelConfig, flags: Flags, reports: list[AdapterReport] | None,
               budget_bytes: int | None) -> Memory:
        return Memory.of(model, flags, flags.pool or Pool.at_startup(flags, model, []), reports,
                         budget_bytes)

    def tiers(self, memory: Memory) -> SlotTiers:
        f = memory.flags
        # The base model holds a slot of its own: init_memory_pool loads it (fetch_new_loras
        # ({None})) and prepare_lora_batch evicts it only when no adapter outside the batch
        # can go (mem_pool.py get_available_buffer_slot: "Prefer evicting LoRA adapters over
        # the base model"), so with two slots or more adapters get one fewer. One slot is
        # shared with the base model, which the replay does not model.
        slots = f.max_loras_per_batch - 1 if f.max_loras_per_batch > 1 else 1
        return SlotTiers(
            gpu_slots=slots, host_slots=f.max_loaded_loras,
            slot_bytes=memory.slot_bytes, host_bytes=memory.host_bytes,
            max_rank=memory.pool.max_rank, gpu_eviction=f.eviction_policy,
            host_eviction="lru", admission="skip",
            source="sglang/srt/managers/scheduler.py get_new_batch_prefill / "
                   "can_schedule_lora_req (a waiting request whose adapter does not fit the "
                   "batch is skipped: lora/lora_manager.py validate_lora_batch); "
                   "lora/mem_pool.py prepare_lora_batch and lora/eviction_policy.py (GPU "
                   "slots, --lora-eviction-policy); managers/tokenizer_control_mixin.py "
                   "load_lora_adapter and lora/lora_registry.py lru_lora_name (after a load, "
                   "the least recently used unpinned adapter over --max-loaded-loras is "
                   "unloaded; a later request reloads it from disk: tokenizer_manager.py "
                   "_resolve_lora_path)")

    def inspect_record(self, model: ModelConfig, verdicts: list[EngineVerdict],
                       recommendation: Recommendation, flags: Flags, source: str,
                       reports: list[AdapterReport]) -> dict[str, Any]:
        fails = [r.name for r, v in zip(reports, verdicts, strict=True)
                 if v.paths["startup"]["verdict"] != Verdict.SERVES.value
                 and v.paths["startup"]["verdict"] != Verdict.DIFFERS.value]
        return {"name": NAME, "version": VERSION, "flags": flags.record(model),
                "pool": flags.pool.record() if flags.pool else None, "flags_source": source,
                "all_serve": all(v.serves for v in verdicts), "startup_fails": bool(fails),
                "checked": family(model).checked, "recommended": recommendation.record()}


ENGINE = SglangEngine()
