"""SGLang 0.5.23's LoRA server flags as `python -m sglang.launch_server` spells them,
validated as its start-up validates them (arg_groups/lora_hook.py, arg_groups/fields/lora.py),
and read from the CLI's option names (`flags_from`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from metrale_cli.engines.shared import DTYPES, raw_text_config
from metrale_cli.errors import UsageError, did_you_mean
from metrale_cli.model.config import ModelConfig, find_preset

if TYPE_CHECKING:
    from metrale_cli.engines.sglang.model import Pool

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
                hint = did_you_mean(bad[0], SUPPORTED_TARGETS) if len(bad) == 1 else ""
                raise UsageError(f"--modules: SGLang's --lora-target-modules takes "
                                 f"{', '.join(SUPPORTED_TARGETS)} or {ALL} (not "
                                 f"{', '.join(bad) or 'nothing'}){hint}")
            if ALL in self.target_modules and len(self.target_modules) > 1:
                raise UsageError("--modules: If 'all' is specified in --lora-target-modules, "
                                 "it should be the only module specified.")
        for flag, value, choices in (("--lora-backend", self.lora_backend, LORA_BACKENDS),
                                     ("--eviction-policy", self.eviction_policy,
                                      EVICTION_POLICIES), ("--dtype", self.dtype, DTYPES)):
            if value not in choices:
                raise UsageError(f"{flag} {value!r}{did_you_mean(str(value), choices)}: one of "
                                 f"{', '.join(choices)}")

    def model_dtype(self, model: ModelConfig) -> str:
        """`--dtype auto` (configs/model_config.py _get_and_verify_dtype): the config's dtype,
        float32 (or none stated) cast to float16; the LoRA pool takes the model's dtype
        (lora_manager.py: the model runner's dtype)."""
        if self.dtype != "auto":
            return self.dtype
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


# The CLI's options that are SGLang's flags.
FLAG_OPTIONS = ("--max-rank", "--modules", "--max-loras", "--max-loaded-loras",
                 "--lora-backend", "--eviction-policy", "--tp", "--dtype")


def flags_from(given: Mapping[str, object], default_loras: int | None = None) -> Flags:
    """The flags `given` (the CLI's option names) sets, SGLang's defaults for the rest
    (`default_loras`, where given, for --max-loras-per-batch)."""
    g = {k: given.get(k) for k in FLAG_OPTIONS}
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
