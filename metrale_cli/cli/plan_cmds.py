"""`metrale models`, `inspect` and `layout`: the answers before anything is loaded. None of
them imports torch or CuPy."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from metrale_cli.cli.console import emit, handles_errors, warn
from metrale_cli.cli.options import (
    DtypeOpt,
    EngineOpt,
    EpOpt,
    ExpertsOpt,
    FullyShardedOpt,
    JsonOpt,
    LoraDtypeOpt,
    MaxCpuLorasOpt,
    MaxLorasOpt,
    MaxRankOpt,
    ModelOpt,
    ModulesOpt,
    OnlineOpt,
    TpOpt,
    engine_name,
    experts_on,
    online_on,
    shard_spec,
    vllm_only,
)
from metrale_cli.cli.parsing import parse_modules, parse_size, positive
from metrale_cli.errors import UsageError

if TYPE_CHECKING:
    from metrale_cli.layout.pipeline import AuditedAdapters


@handles_errors
def models(json_out: JsonOpt = False) -> None:
    """List the built-in base-model presets and their key dims."""
    from metrale_cli.cli import render
    from metrale_cli.model.config import PRESETS

    records = [preset.record() for preset in PRESETS]
    emit(records, json_out, render.models_view)


# -- inspect ------------------------------------------------------------------------------------


@handles_errors
def inspect(
    adapters: Annotated[list[str], typer.Argument(
        help="Adapter directories or hub ids (org/name[@revision]), or NAME=either.",
        show_default=False)],
    model: ModelOpt = None,
    max_rank: MaxRankOpt = None,
    experts: ExpertsOpt = False,
    online: OnlineOpt = False,
    engine: EngineOpt = "metrale",
    max_loras: MaxLorasOpt = None,
    max_cpu_loras: MaxCpuLorasOpt = None,
    tp: TpOpt = None,
    fully_sharded: FullyShardedOpt = False,
    modules: ModulesOpt = None,
    dtype: DtypeOpt = None,
    lora_dtype: LoraDtypeOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Audit PEFT LoRA adapters against a base model. Exit 0 when all are servable, 1 if not.

    The model defaults to the adapters' base_model_name_or_path. With --engine vllm, what vLLM
    0.32.0 does with each adapter under the vLLM flags given (--max-rank, --max-loras, --tp,
    --fully-sharded, --modules, --dtype, --lora-dtype), or under the ones metrale recommends;
    exit 0 only when vLLM serves every adapter as PEFT does."""
    from metrale_cli.cli import render
    from metrale_cli.layout.pipeline import audit_adapters

    engine = engine_name(engine)
    vllm_only(engine, **{"--max-loras": max_loras, "--max-cpu-loras": max_cpu_loras,
                         "--tp": tp, "--fully-sharded": fully_sharded, "--modules": modules,
                         "--dtype": dtype, "--lora-dtype": lora_dtype})
    positive("--max-rank", max_rank)
    positive("--max-loras", max_loras)
    positive("--tp", tp)
    if engine == "vllm":
        # vLLM checks ranks itself: the audit reads the files without the pool's max rank.
        _inspect_vllm(audit_adapters(adapters, model, experts=experts_on(experts),
                                     online=online_on(online)), json_out,
                      max_rank=max_rank, max_loras=max_loras, max_cpu_loras=max_cpu_loras,
                      tp=tp, fully_sharded=fully_sharded, modules=modules, dtype=dtype,
                      lora_dtype=lora_dtype)
        return
    audited = audit_adapters(adapters, model, max_rank=max_rank, experts=experts_on(experts),
                             online=online_on(online))
    warn(audited.warnings)
    emit(audited.record(), json_out, render.inspect_view)
    if not audited.servable:
        raise typer.Exit(1)


def _inspect_vllm(audited: AuditedAdapters, json_out: bool, **given: object) -> None:
    """`inspect --engine vllm`: the audit's record with each adapter's vLLM verdict under the
    given flags (else the recommended ones) in `adapters[i].engine`, the recommendation in
    `engine`; exit 1 unless vLLM serves every adapter."""
    from metrale_cli.cli import render
    from metrale_cli.engines import vllm

    cfg, reports = audited.model, audited.reports
    recommendation = vllm.recommend(reports, cfg, tp=given["tp"] or 1,  # type: ignore[arg-type]
                                    dtype=given["dtype"] or "auto",  # type: ignore[arg-type]
                                    lora_dtype=given["lora_dtype"] or "auto")  # type: ignore
    flags = vllm.flags_for(cfg, **given)  # type: ignore[arg-type]
    source = "given" if flags is not None else "recommended"
    flags = flags or recommendation.flags
    verdicts = [vllm.judge(r, cfg, flags, source) for r in reports]
    record = audited.record()
    for adapter, verdict in zip(record["adapters"], verdicts, strict=True):
        adapter["engine"] = verdict.record()
    record["engine"] = vllm.inspect_record(cfg, verdicts, recommendation, flags, source)
    emit(record, json_out, render.engine_inspect_view)
    if not all(v.serves for v in verdicts):
        raise typer.Exit(1)


# -- layout -------------------------------------------------------------------------------------


@handles_errors
def layout(
    adapters: Annotated[list[str] | None, typer.Argument(
        help="Startup adapters: their modules and largest rank when --modules/--max-rank are "
             "not given.", show_default=False)] = None,
    model: ModelOpt = None,
    modules: ModulesOpt = None,
    max_rank: MaxRankOpt = None,
    max_loras: MaxLorasOpt = None,
    budget: Annotated[str | None, typer.Option(
        "--budget", help="Memory for the pool and its tables, e.g. 40GiB: how many slots fit.")]
    = None,
    # No default written here: the layout's (256) would import the layout into `--help`.
    align: Annotated[int | None, typer.Option(
        "--align", help="Byte alignment of every region (default 256, the layout's).",
        show_default=False)] = None,
    experts: ExpertsOpt = False,
    online: OnlineOpt = False,
    tp: TpOpt = None,
    ep: EpOpt = None,
    fully_sharded: FullyShardedOpt = False,
    engine: EngineOpt = "metrale",
    max_cpu_loras: MaxCpuLorasOpt = None,
    dtype: DtypeOpt = None,
    lora_dtype: LoraDtypeOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """The byte-exact slot layout and capacity plan of a pool; with --tp, of every rank's pool,
    --budget per GPU.

    With --experts, the expert pool too: the adapters' routed-expert and router pairs, or
    without adapters every expert and router of every MoE layer at --max-rank. With --engine
    vllm, the bytes vLLM 0.32.0's LoRA buffers take on each GPU, reading --max-loras,
    --max-rank, --tp, --fully-sharded and --modules as vLLM's --max-loras, --max-lora-rank,
    --tensor-parallel-size, --fully-sharded-loras and --lora-target-modules."""
    from metrale_cli.cli import render
    from metrale_cli.layout.pipeline import audit_adapters, plan_pool
    from metrale_cli.layout.slot_layout import DEFAULT_ALIGN

    engine = engine_name(engine)
    vllm_only(engine, **{"--max-cpu-loras": max_cpu_loras, "--dtype": dtype,
                         "--lora-dtype": lora_dtype})
    positive("--max-rank", max_rank)
    positive("--max-loras", max_loras)
    if model is None and not adapters:
        raise UsageError("--model is required (or give startup adapters)")
    if engine == "vllm":
        if ep is not None or experts_on(experts):
            raise UsageError("--ep and --experts are the metrale pool's; vLLM wraps experts "
                             "itself (--engine vllm)")
        positive("--tp", tp)
        _layout_vllm(audit_adapters(adapters or [], model, experts=False,
                                    online=online_on(online)), json_out,
                     budget=budget, max_rank=max_rank, max_loras=max_loras,
                     max_cpu_loras=max_cpu_loras, tp=tp, fully_sharded=fully_sharded,
                     modules=modules, dtype=dtype, lora_dtype=lora_dtype)
        return
    spec = shard_spec(tp, ep, fully_sharded)
    module_list = parse_modules(modules) if modules else None
    budget_bytes = parse_size(budget) if budget is not None else None
    planned = plan_pool(adapters or [], model, modules=module_list, max_rank=max_rank,
                        align=DEFAULT_ALIGN if align is None else align,
                        experts=experts_on(experts), online=online_on(online))
    if spec is not None:
        sharded = planned.sharded(spec, max_loras, budget_bytes)
        warn(sharded.plan.warnings)
        emit(sharded.record(), json_out, render.sharded_layout_view)
        return
    plan = planned.sized(max_loras, budget_bytes)
    warn(plan.warnings)
    emit(plan.record(), json_out, render.layout_view)


def _layout_vllm(audited: AuditedAdapters, json_out: bool, budget: str | None,
                 **given: object) -> None:
    """`layout --engine vllm`: one GPU's LoRA bytes and the host cache; with adapters, their
    rank, count and modules fill in what the flags leave out, and an adapter vLLM would not
    serve as PEFT does is refused as `layout` refuses one the pool cannot serve."""
    from metrale_cli.cli import render
    from metrale_cli.engines import vllm
    from metrale_cli.errors import NotServable

    cfg, reports = audited.model, audited.reports
    if reports and given["max_rank"] is None:
        rank = max(vllm.config_rank(r) for r in reports)
        given["max_rank"] = vllm.allowed_rank(rank) or vllm.MAX_LORA_RANKS[-1]
    if reports and given["max_loras"] is None:
        given["max_loras"] = len(reports)
    if reports and given["modules"] is None:
        # As `layout` sizes the pool for its startup adapters: their modules, not every one.
        targets = vllm.recommend(reports, cfg).flags.target_modules
        given["modules"] = ",".join(targets) if targets else None
    flags = vllm.flags_for(cfg, **given) or vllm.Flags()  # type: ignore[arg-type]
    refused = [(r, v) for r, v in ((r, vllm.judge(r, cfg, flags)) for r in reports)
               if not v.serves]
    if refused:
        raise NotServable(f"{len(refused)} adapter(s) not served as PEFT serves them by vLLM "
                          f"{vllm.VERSION} under these flags",
                          [f"{r.name}: vllm {v.verdict.value}: {v.reason}" for r, v in refused])
    memory = vllm.Memory.of(cfg, flags, reports or None,
                            parse_size(budget) if budget is not None else None)
    record = {"model": cfg.record(), "engine": memory.record()}
    emit(record, json_out, render.engine_layout_view)
