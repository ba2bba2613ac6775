"""vLLM 0.32.0's serve flags that change a verdict or the LoRA memory, validated as
`vllm serve` validates them (vllm/config/lora.py, vllm/config/model.py), and the same flags as
`vllm serve` arguments."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from metrale_cli.engines.shared import DTYPES, raw_text_config
from metrale_cli.errors import UsageError, did_you_mean

if TYPE_CHECKING:
    from metrale_cli.engines.vllm.model import EngineModule
    from metrale_cli.model.config import ModelConfig

# `--max-lora-rank` takes only these (vllm/config/lora.py MaxLoRARanks).
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
DEFAULT_MAX_LORA_RANK = 16
LORA_DTYPES = ("auto", "float16", "bfloat16")


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
    # metrale's --max-rank where `max_lora_rank` is the next value vLLM takes above it (None:
    # the same value, or none given).
    max_rank_given: int | None = None

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
            raise UsageError(f"--dtype {self.dtype!r}{did_you_mean(self.dtype, DTYPES)}: one of "
                             f"{', '.join(DTYPES)}")
        if self.lora_dtype not in LORA_DTYPES:
            raise UsageError(f"--lora-dtype {self.lora_dtype!r}"
                             f"{did_you_mean(self.lora_dtype, LORA_DTYPES)}: one of "
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
                "lora_dtype": self.resolved_lora_dtype(model),
                "max_rank_given": self.max_rank_given}

    def serve_args(self) -> list[str]:
        """These flags as `vllm serve` arguments (LoRA on), leaving out what equals vLLM's
        default where vLLM's default is metrale's too (`auto` dtypes, TP 1)."""
        args = ["--enable-lora", "--max-lora-rank", str(self.max_lora_rank), "--max-loras",
                str(self.max_loras), "--max-cpu-loras", str(self.cpu_loras)]
        if self.lora_dtype != "auto":
            args += ["--lora-dtype", self.lora_dtype]
        if self.dtype != "auto":
            args += ["--dtype", self.dtype]
        if self.target_modules:
            args += ["--lora-target-modules", *self.target_modules]
        if self.tp > 1:
            args += ["--tensor-parallel-size", str(self.tp)]
        if self.fully_sharded:
            args.append("--fully-sharded-loras")
        return args

    def wraps(self, module: EngineModule) -> bool:
        """vLLM's `is_in_target_modules`: a module is wrapped when its name, or one of the
        adapter names packed into it, is among --lora-target-modules."""
        if self.target_modules is None:
            return True
        chosen = set(self.target_modules)
        return module.name in chosen or any(n in chosen for n in module.adapter_names)
