"""`metrale models`, `inspect` and `layout`: the answers before anything is loaded. None of
them imports torch or CuPy."""

# No `from __future__ import annotations`: the options' annotations are evaluated once, here
# (cached in the .pyc), not compiled from strings by Typer each time the command tree is built,
# which was most of what `metrale --help` took beyond importing typer (scripts/bench_startup.py).

from typing import TYPE_CHECKING, Annotated

import typer

from metrale_cli.cli.console import emit, handles_errors, warn
from metrale_cli.cli.options import (
    DtypeOpt,
    EngineOpt,
    EpOpt,
    EvictionPolicyOpt,
    ExpertsOpt,
    FullyShardedOpt,
    JsonOpt,
    LoraBackendOpt,
    LoraDtypeOpt,
    MaxCpuLorasOpt,
    MaxLoadedLorasOpt,
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
)
from metrale_cli.cli.parsing import parse_modules, parse_size, positive
from metrale_cli.errors import UsageError, refused_line

if TYPE_CHECKING:
    from metrale_cli.engines.engine import Engine
    from metrale_cli.layout.pipeline import AuditedAdapters


@handles_errors
def models(json_out: JsonOpt = False) -> None:
    """List the built-in base-model presets and their key dims.

    Example: metrale models --json"""
    from metrale_cli.cli import render
    from metrale_cli.model.config import PRESETS

    records = [preset.record() for preset in PRESETS]
    emit(records, json_out, render.models_view)


# -- inspect ------------------------------------------------------------------------------------


@handles_errors
def inspect(
    adapters: Annotated[list[str], typer.Argument(
        metavar="ADAPTER",
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
    confirm: Annotated[bool, typer.Option(
        "--confirm", help="With --engine vllm: then start the installed vLLM with those flags, "
        "load each adapter at runtime, prompt the base and each adapter, and report predicted "
        "vs observed; exit 1 on any disagreement, 0 when every prediction held.")] = False,
    engine_python: Annotated[str | None, typer.Option(
        "--engine-python", help="With --confirm: the python that runs vLLM (default: this one, "
        "if it can import vllm).", show_default=False)] = None,
    engine_args: Annotated[str | None, typer.Option(
        "--engine-args", help="With --confirm: more of vLLM's own arguments, as shell words "
        "(e.g. '--max-model-len 4096 --enforce-eager'); none that vLLM would read as one "
        "metrale sets or one that listens beyond 127.0.0.1.",
        show_default=False)] = None,
    confirm_timeout: Annotated[float | None, typer.Option(
        "--confirm-timeout", help="With --confirm: seconds for the whole check, the engine's "
        "start included (default 900, at most 604800); past it, exit 4.",
        show_default=False)] = None,
    max_loaded_loras: MaxLoadedLorasOpt = None,
    eviction_policy: EvictionPolicyOpt = None,
    lora_backend: LoraBackendOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Audit PEFT LoRA adapters against a base model. Exit 0 when all are servable, 1 if not.

    The model defaults to the adapters' base_model_name_or_path. With --engine vllm, what vLLM
    0.32.0 does with each adapter under the vLLM flags given (--max-rank, --max-loras, --tp,
    --fully-sharded, --modules, --dtype, --lora-dtype), or under the ones metrale recommends;
    exit 0 only when vLLM serves every adapter as PEFT does. With --engine sglang, the same
    for SGLang 0.5.23 (--max-rank, --modules, --max-loras, --max-loaded-loras,
    --eviction-policy, --lora-backend, --tp, --dtype as its launch_server flags), per load
    path: start-up --lora-paths and runtime /load_lora_adapter. With --confirm, the vLLM
    prediction is checked against the installed vLLM running (docs/engines.md).

    Example: metrale inspect chat code --engine vllm"""
    from metrale_cli.cli import render
    from metrale_cli.engines import refuse_other_options
    from metrale_cli.layout.pipeline import audit_adapters

    chosen = engine_name(engine)
    given = {"--max-rank": max_rank, "--experts": experts, "--max-loras": max_loras,
             "--max-cpu-loras": max_cpu_loras, "--tp": tp, "--fully-sharded": fully_sharded,
             "--modules": modules, "--dtype": dtype, "--lora-dtype": lora_dtype,
             "--confirm": confirm, "--engine-python": engine_python,
             "--engine-args": engine_args, "--confirm-timeout": confirm_timeout,
             "--max-loaded-loras": max_loaded_loras, "--eviction-policy": eviction_policy,
             "--lora-backend": lora_backend}
    refuse_other_options(chosen.name if chosen else "metrale", "inspect", given)
    positive("--max-rank", max_rank)
    positive("--max-loras", max_loras)
    positive("--tp", tp)
    if not confirm:
        unused = [n for n in ("--engine-python", "--engine-args", "--confirm-timeout")
                  if given[n] is not None]
        if unused:
            raise UsageError(f"{', '.join(unused)} need{'s' if len(unused) == 1 else ''} "
                             "--confirm")
    if chosen is not None:
        from metrale_cli.cli import render_engine
        from metrale_cli.engines.answers import engine_inspect

        warn([w for w in (chosen.installed_warning(),) if w])
        # The engine checks ranks itself: the audit reads the files without the pool's max.
        audited = audit_adapters(adapters, model, experts=experts_on(experts),
                                 online=online_on(online))
        if confirm:
            _confirm(audited, chosen, given, engine_python, engine_args, confirm_timeout,
                     json_out)
            return
        inspection = engine_inspect(audited, chosen, given)
        emit(inspection.record, json_out, render_engine.engine_inspect_view)
        if not inspection.all_serve:
            _exit_1([f"{r.name} ({v.verdict.value})" for r, v in zip(
                audited.reports, inspection.verdicts, strict=True) if not v.serves],
                len(audited.reports), f"not served as PEFT serves them by {chosen.label} "
                f"{chosen.version}")
        return
    audited = audit_adapters(adapters, model, max_rank=max_rank, experts=experts_on(experts),
                             online=online_on(online))
    record = audited.record()  # a slot no machine holds is refused before any warning
    warn(audited.warnings)
    emit(record, json_out, render.inspect_view)
    if not audited.servable:
        _exit_1([r.name for r in audited.reports if not r.servable], len(audited.reports),
                "not servable")


def _exit_1(refused: list[str], total: int, what: str) -> None:
    """End `inspect` with exit 1 and one line on stderr saying why: how many adapters are
    `what`, and which (a long inspection's reader sees the end first)."""
    from metrale_cli.cli.console import say

    say(f"error: {refused_line(refused, total, what)}")
    raise typer.Exit(1)


def _confirm(audited: "AuditedAdapters", engine: "Engine", given: dict[str, object],
             python: str | None, args: str | None, timeout: float | None,
             json_out: bool) -> None:
    """`inspect --engine E --confirm`: the prediction, then the engine's word on it, the
    disagreements first; exit 1 on any."""
    from metrale_cli.cli import render_engine
    from metrale_cli.cli.console import say

    done = engine.confirm(audited, given, python=python, engine_args=args, timeout_s=timeout,
                          progress=say)
    emit(done.record, json_out, render_engine.engine_confirm_view)
    if not done.agrees:
        check = done.record["confirm"]
        _exit_1(check["disagreements"], len(check["adapters"]),
                f"did otherwise in the installed {engine.label} than predicted")


# -- layout -------------------------------------------------------------------------------------


@handles_errors
def layout(
    adapters: Annotated[list[str] | None, typer.Argument(
        metavar="ADAPTER", help="Startup adapters: their modules and largest rank when "
        "--modules/--max-rank are not given.", show_default=False)] = None,
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
    max_loaded_loras: MaxLoadedLorasOpt = None,
    eviction_policy: EvictionPolicyOpt = None,
    lora_backend: LoraBackendOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """The byte-exact slot layout and capacity plan of a pool; with --tp, of every rank's pool,
    --budget per GPU.

    With --experts, the expert pool too: the adapters' routed-expert and router pairs, or
    without adapters every expert and router of every MoE layer at --max-rank. With --engine
    vllm, the bytes vLLM 0.32.0's LoRA buffers take on each GPU, reading --max-loras,
    --max-rank, --tp, --fully-sharded and --modules as vLLM's --max-loras, --max-lora-rank,
    --tensor-parallel-size, --fully-sharded-loras and --lora-target-modules. With --engine
    sglang, the bytes of SGLang 0.5.23's LoRA pool on each GPU (--max-loras is its
    --max-loras-per-batch, --tp its --tp-size; dense families).

    Example: metrale layout chat code --budget 40GiB --tp 4"""
    from metrale_cli.cli import render
    from metrale_cli.engines import refuse_other_options
    from metrale_cli.layout.pipeline import audit_adapters, plan_pool
    from metrale_cli.layout.slot_layout import DEFAULT_ALIGN

    chosen = engine_name(engine)
    given = {"--modules": modules, "--max-rank": max_rank, "--max-loras": max_loras,
             "--budget": budget, "--align": align, "--experts": experts_on(experts),
             "--tp": tp, "--ep": ep, "--fully-sharded": fully_sharded,
             "--max-cpu-loras": max_cpu_loras, "--dtype": dtype, "--lora-dtype": lora_dtype,
             "--max-loaded-loras": max_loaded_loras, "--eviction-policy": eviction_policy,
             "--lora-backend": lora_backend}
    refuse_other_options(chosen.name if chosen else "metrale", "layout", given)
    positive("--max-rank", max_rank)
    positive("--max-loras", max_loras)
    positive("--tp", tp)
    if model is None and not adapters:
        raise UsageError("--model is required (or give startup adapters)")
    budget_bytes = parse_size(budget) if budget is not None else None
    if chosen is not None:
        from metrale_cli.cli import render_engine
        from metrale_cli.engines.answers import engine_layout

        warn([w for w in (chosen.installed_warning(),) if w])
        record = engine_layout(audit_adapters(adapters or [], model, experts=False,
                                              online=online_on(online)), chosen, given,
                               budget_bytes)
        if record["engine"].get("max_loras_fit") == 0:
            raise _nothing_fits(budget or "", record["engine"]["slot_bytes"], " per GPU",
                                f"one slot of {chosen.label} {chosen.version}'s LoRA buffers")
        emit(record, json_out, render_engine.engine_layout_view)
        not_served = record["engine"]["not_served"]
        if not_served:
            _exit_1([f"{n['adapter']} ({n['verdict']})" for n in not_served],
                    len(adapters or []), f"not served as PEFT serves them by {chosen.label} "
                    f"{chosen.version}, though it allocates these buffers")
        return
    spec = shard_spec(tp, ep, fully_sharded)
    module_list = parse_modules(modules) if modules else None
    planned = plan_pool(adapters or [], model, modules=module_list, max_rank=max_rank,
                        align=DEFAULT_ALIGN if align is None else align,
                        experts=experts_on(experts), online=online_on(online))
    if spec is not None:
        sharded = planned.sharded(spec, max_loras, budget_bytes)
        if budget is not None and not sharded.plan.max_loras:
            raise _nothing_fits(budget, max(r.bytes_per_slot for r in sharded.ranks), " per GPU")
        warn(sharded.plan.warnings)
        emit(sharded.record(), json_out, render.sharded_layout_view)
        return
    plan = planned.sized(max_loras, budget_bytes)
    if budget is not None and not plan.max_loras:
        raise _nothing_fits(budget, plan.bytes_per_slot)
    warn(plan.warnings)
    emit(plan.record(), json_out, render.layout_view)


def _nothing_fits(budget: str, slot_bytes: int, where: str = "",
                  slot: str = "one slot with its share of the tables") -> UsageError:
    """`layout --budget` below one slot (metrale's, or an engine's): what one slot takes, and
    what a bare number meant."""
    from metrale_cli.cli.render import human_bytes

    size = parse_size(budget)
    bare = budget.strip().replace("_", "").replace(".", "", 1).isdigit()
    unit = f" (a number without a unit is bytes; for gibibytes write {budget.strip()}GiB)"
    said = f"{size:,} B{unit if bare else ''}"
    return UsageError(f"--budget {budget}: nothing fits in {said}{where}; {slot} takes "
                      f"{slot_bytes:,} B ({human_bytes(slot_bytes)}){where}")

