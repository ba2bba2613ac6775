"""The options several commands share, declared once, and the steps of reading them: adapters
by argument, the base model, the shard spec, the opt-ins."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

import typer

from metrale_cli import env
from metrale_cli.cli.console import emit_json, say
from metrale_cli.errors import NotServable, UsageError
from metrale_cli.model.config import resolve_model

if TYPE_CHECKING:
    from metrale_cli.adapters.adapter import Adapter
    from metrale_cli.adapters.audit import AdapterReport
    from metrale_cli.layout.sharding import ShardSpec
    from metrale_cli.model.config import ModelConfig


def refuse_unservable(reports: list[AdapterReport],
                      json_record: Callable[[], Any] | None = None) -> None:
    """What `pack` would refuse, `layout` refuses too: each error finding on its own line, then
    NotServable (exit 1). Under --json, `json_record()` goes to stdout first, as inspect's
    record does when it judges an adapter not servable."""
    refused = [r for r in reports if not r.servable]
    if not refused:
        return
    if json_record is not None:
        emit_json(json_record())
    for r in refused:
        for f in r.errors():
            say(f"{r.name}: {f.code}: {f.message}")
    raise NotServable(f"{len(refused)} adapter(s) not servable: "
                      f"{', '.join(r.name for r in refused)}")



# Each option is one typer.Option, used through its alias; a command that requires it or gives
# it another default annotates its own type with the same option (typer copies it per use).

MODEL = typer.Option(
    "--model", "-m", help="Base model: a preset (`metrale models`), a config.json, a model "
    "directory, or a hub id (org/name[@revision]) in the local HF cache (--online: the hub).")
MODULES = typer.Option(
    "--modules", help="Comma-separated pool modules (q_proj, k_proj, v_proj, o_proj, gate_proj, "
    "up_proj, down_proj, out_proj), or 'all'.")
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


def load_adapters(args: list[str], online: bool = False, weights: bool = False) -> list[Adapter]:
    """Adapter directories or hub ids (`NAME=` either); `weights`: the command reads tensor
    data, so a hub adapter's weights are downloaded, not only their header read."""
    from metrale_cli.adapters.adapter import load_adapter, parse_adapter_args

    if not args:
        raise UsageError("no adapter given")
    return [load_adapter(path, name, online, weights) for name, path in parse_adapter_args(args)]


def model_for(spec: str | None, adapters: list[Adapter], online: bool = False) -> ModelConfig:
    """`--model`, else the adapters' common `base_model_name_or_path`."""
    if spec:
        return resolve_model(spec, online)
    bases = {a.config.base_model_name_or_path for a in adapters}
    if None in bases or not bases:
        names = [a.name for a in adapters if a.config.base_model_name_or_path is None]
        raise UsageError(
            f"{', '.join(names) or 'no adapter'}: no base_model_name_or_path; pass --model "
            "(a preset from `metrale models`, a config.json, or a model directory)"
        )
    resolved = []
    for base in sorted(b for b in bases if b is not None):
        try:
            resolved.append(resolve_model(base, online))
        except UsageError as exc:
            raise UsageError(
                f"base_model_name_or_path {base!r} resolves to nothing here ({exc}); pass "
                "--model (a preset from `metrale models`, a config.json, or a model directory)"
            ) from None
    # Different paths to the same model (copies of one config) are one base model.
    if len({json.dumps({**c.summary(), "source": ""}, sort_keys=True) for c in resolved}) > 1:
        raise UsageError(f"the adapters name different base models ({', '.join(sorted(bases))})"
                         "; pass --model")
    return resolved[0]

