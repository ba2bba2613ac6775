"""The options several commands share, declared once, and the steps of reading them: the shard
spec and the opt-ins. Adapters and the base model are read by the library's plan pipeline
(layout/pipeline.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from metrale_cli import env
from metrale_cli.errors import UsageError

if TYPE_CHECKING:
    from metrale_cli.engines.engine import Engine
    from metrale_cli.layout.sharding import ShardSpec


# Each option is one typer.Option, used through its alias; a command that requires it or gives
# it another default annotates its own type with the same option (typer copies it per use).

MODEL = typer.Option(
    "--model", "-m", help="Base model: a preset (`metrale models`), a config.json, a model "
    "directory, or a hub id (org/name[@revision]) in the local HF cache (--online: the hub).")
MODULES = typer.Option(
    "--modules", help="Comma-separated modules. metrale's pool: q_proj, k_proj, v_proj, "
    "o_proj, gate_proj, up_proj, down_proj, out_proj, or 'all'. --engine vllm: vLLM's "
    "--lora-target-modules, its module names (qkv_proj, o_proj, gate_up_proj, down_proj, "
    "lm_head, embed_tokens, ...) or the adapter names packed into them (q_proj); no 'all'. "
    "--engine sglang: SGLang's --lora-target-modules (q_proj, ..., qkv_proj, gate_up_proj, "
    "embed_tokens, lm_head, or all).")
MAX_LORAS = typer.Option("--max-loras", help="Slots in the pool.")
ModelOpt = Annotated[str | None, MODEL]
ModulesOpt = Annotated[str | None, MODULES]
MaxLorasOpt = Annotated[int | None, MAX_LORAS]
MaxRankOpt = Annotated[int | None, typer.Option(
    "--max-rank", help="The pool's max rank: every slot pads to it; higher ranks are not "
    "servable. Default: the adapters' largest rank rounded up to a multiple of 8, as the CUDA "
    "kernels need.")]
ExpertsOpt = Annotated[bool, typer.Option(
    "--experts", help="Serve routed-expert and router LoRA from the expert pool, a second "
    "allocation beside the slot pool (also METRALE_LORA_EXPERTS=1).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the JSON record instead.")]
ForceOpt = Annotated[bool, typer.Option("--force", help="Overwrite an existing output.")]
TP = typer.Option("--tp", help="Tensor-parallel degree: one pool per rank, each holding its "
                  "shard of every LoRA weight (docs/tensor-parallel.md).")
TpOpt = Annotated[int | None, TP]
EpOpt = Annotated[int | None, typer.Option(
    "--ep", help="With --tp: expert-parallel degree; experts split over it contiguously, each "
    "sharded over tp / ep ranks. Default 1.")]
FullyShardedOpt = Annotated[bool, typer.Option(
    "--fully-sharded", help="With --tp: also slice column layers' A by rank and row layers' B "
    "by output row (vLLM fully_sharded_loras).")]


def shard_spec(tp: int | None, ep: int | None, fully_sharded: bool) -> ShardSpec | None:
    """Rank 0 of the deployment --tp/--ep/--fully-sharded name, or None without --tp."""
    from metrale_cli.layout.sharding import ShardSpec

    if tp is None:
        if ep is not None or fully_sharded:
            raise UsageError("--ep and --fully-sharded need --tp")
        return None
    return ShardSpec(tp, 0, 1 if ep is None else ep, fully_sharded)


def experts_on(flag: bool) -> bool:
    """The expert-pool opt-in: --experts or METRALE_LORA_EXPERTS=1."""
    return flag or env.experts_enabled()


OnlineOpt = Annotated[bool, typer.Option(
    "--online", help="Hub ids (org/name[@revision]) not in the local Hugging Face cache are "
    "fetched from the hub (also METRALE_ONLINE=1).")]


def online_on(flag: bool) -> bool:
    """The hub opt-in: --online or METRALE_ONLINE=1."""
    return flag or env.online()


ENGINE = typer.Option(
    "--engine", help="Whose answer: metrale (its own pool, the default), vllm (what vLLM "
    "0.32.0 does with the adapters, its flags and LoRA memory; vllm==0.32.0 names the "
    "version) or sglang (SGLang 0.5.23; sglang==0.5.23); docs/engines.md. Each engine takes "
    "its own options.")
EngineOpt = Annotated[str, ENGINE]
DtypeOpt = Annotated[str | None, typer.Option(
    "--dtype", help="With --engine vllm or sglang: the engine's --dtype (auto, float16, "
    "bfloat16, float32); auto reads the model's config.")]
LoraDtypeOpt = Annotated[str | None, typer.Option(
    "--lora-dtype", help="With --engine vllm: vLLM's --lora-dtype (auto, float16, bfloat16); "
    "auto is the model's dtype.")]
MaxCpuLorasOpt = Annotated[int | None, typer.Option(
    "--max-cpu-loras", help="With --engine vllm: vLLM's --max-cpu-loras, the host cache of "
    "adapters (default: --max-loras).")]

MaxLoadedLorasOpt = Annotated[int | None, typer.Option(
    "--max-loaded-loras", help="With --engine sglang: SGLang's --max-loaded-loras, the "
    "adapters held in CPU memory (default: no limit).")]
EvictionPolicyOpt = Annotated[str | None, typer.Option(
    "--eviction-policy", help="With --engine sglang: SGLang's --lora-eviction-policy of its "
    "GPU slots, lru (default) or fifo.")]
LoraBackendOpt = Annotated[str | None, typer.Option(
    "--lora-backend", help="With --engine sglang: SGLang's --lora-backend (csgmv, the "
    "default, triton, ascend, torch_native, triton_v2).")]


def engine_name(engine: str) -> Engine | None:
    """--engine: None for metrale's own pool, else the registered engine it names (`vllm`,
    `vllm==0.32.0`); an unknown name or version is a usage error listing the known ones."""
    from metrale_cli.engines import get_engine

    return None if engine.strip() == "metrale" else get_engine(engine)
