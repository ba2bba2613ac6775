"""The command line: parse options, call the core, render. Errors become one line and an exit code.

Each command imports the core it calls inside itself, so `metrale --help` imports typer and
little else (no numpy), and `inspect` and `layout` import neither torch nor cupy.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

from metrale_cli import __version__, env
from metrale_cli.errors import MetraleError, NotServable, Terminated, UsageError
from metrale_cli.layout import DEFAULT_ALIGN
from metrale_cli.models import resolve_model
from metrale_cli.parsing import parse_modules, parse_size, positive

try:  # typer >= 0.29 carries its own copy of Click
    from typer._click.exceptions import ClickException, NoArgsIsHelpError
except ImportError:  # pragma: no cover - older typer on Click >= 8.2
    from click.exceptions import ClickException, NoArgsIsHelpError  # type: ignore[no-redef]

if TYPE_CHECKING:
    from rich.console import Console

    from metrale_cli.adapter import Adapter
    from metrale_cli.audit import AdapterReport
    from metrale_cli.expert_pool import ExpertLayout
    from metrale_cli.layout import SlotLayout
    from metrale_cli.models import ModelConfig
    from metrale_cli.sharding import ShardSpec


class OneLineUsageErrors(typer.core.TyperGroup):
    """Click's own usage errors (a value that is not an integer, a missing option) as one line
    on stderr and exit 2, like every other error, instead of Click's usage block."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except NoArgsIsHelpError as exc:
            exc.show()  # the help, as Click gives it for a bare `metrale` or `metrale bench`
            sys.exit(exc.exit_code)
        except ClickException as exc:
            say(f"error: {' '.join(exc.format_message().split())}")
            sys.exit(exc.exit_code)
        sys.exit(code if isinstance(code, int) else 0)


app = typer.Typer(
    name="metrale",
    cls=OneLineUsageErrors,
    help="Audit, lay out, pack and benchmark multi-LoRA adapter pools for LLM serving.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
bench_app = typer.Typer(help="Benchmarks, reported as ratios measured in one run.",
                        no_args_is_help=True)
app.add_typer(bench_app, name="bench")

F = TypeVar("F", bound=Callable[..., Any])


def _width() -> int | None:
    """The terminal width Rich should use: its own guess, except that COLUMNS=0 (or another
    number too small to hold a word) would make Rich print nothing at all."""
    columns = os.environ.get("COLUMNS", "").strip()
    return 80 if columns.isdigit() and int(columns) < 8 else None


@functools.cache
def out() -> Console:
    """stdout for views (rich is imported on first output, not by `--help`)."""
    from rich.console import Console

    return Console(highlight=False, soft_wrap=False, width=_width())


@functools.cache
def err() -> Console:
    """stderr for errors, warnings and progress."""
    from rich.console import Console

    return Console(stderr=True, highlight=False, soft_wrap=True, width=_width())


def say(line: str) -> None:
    """One line on stderr, whatever the input inside it holds: a control character (a newline
    in a path) is shown escaped, never as a line break; markup is not read."""
    err().print("".join(c if c.isprintable() else repr(c)[1:-1] for c in line), markup=False)


def escape(text: str) -> str:
    """Input-derived text made safe to put in Rich markup."""
    from rich.markup import escape as rich_escape

    return rich_escape(text)


def handles_errors(fn: F) -> F:
    """Map domain errors to one line on stderr and their exit code; a traceback only with
    METRALE_DEBUG=1."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            debug = env.debug()
        except UsageError as exc:
            say(f"error: {exc}")
            raise typer.Exit(exc.exit_code) from None
        try:
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except MetraleError as exc:
            if debug:
                raise
            say(f"error: {exc}")
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            say("interrupted")
            raise typer.Exit(130) from None
        except Terminated as exc:
            say(f"terminated ({exc}); nothing written")
            raise typer.Exit(128 + exc.signum) from None
        except OSError as exc:
            # A path the user gave that cannot be read or written (permissions, a full disk).
            if debug:
                raise
            where = f"{exc.filename}: " if exc.filename else ""
            say(f"error: {where}{exc.strerror or exc}")
            raise typer.Exit(2) from None
        except Exception as exc:
            if debug:
                raise
            say(f"internal error: {type(exc).__name__}: {exc} "
                "(METRALE_DEBUG=1 shows the traceback)")
            raise typer.Exit(70) from None

    return wrapper  # type: ignore[return-value]


def emit_json(record: Any) -> None:
    # allow_nan=False: a NaN or Infinity that got this far is a bug, never invalid JSON out.
    sys.stdout.write(json.dumps(record, indent=2, allow_nan=False) + "\n")


def emit(record: Any, json_out: bool, view: Callable[[Any], Any]) -> None:
    """One record, two views: with --json the record itself, else `view(record)`."""
    if json_out:
        emit_json(record)
    else:
        out().print(view(record))


def warn(warnings: list[str]) -> None:
    """Warnings the record carries, one line each on stderr (also under --json)."""
    for warning in warnings:
        say(f"warning: {warning}")


def refuse_unservable(reports: list[AdapterReport]) -> None:
    """What `pack` would refuse, `layout` refuses too: each error finding on its own line, then
    NotServable (exit 1)."""
    refused = [r for r in reports if not r.servable]
    if not refused:
        return
    for r in refused:
        for f in r.errors():
            say(f"{r.name}: {f.code}: {f.message}")
    raise NotServable(f"{len(refused)} adapter(s) not servable: "
                      f"{', '.join(r.name for r in refused)}")


def version_callback(value: bool) -> None:
    if value:
        typer.echo(f"metrale {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[bool, typer.Option("--version", callback=version_callback,
                                          is_eager=True, help="Print the version.")] = False,
) -> None:
    """metrale: answers about a LoRA adapter pool before anything runs, then does the work."""


# -- the shared options, declared once -----------------------------------------------------------
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
    from metrale_cli.sharding import ShardSpec

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
    from metrale_cli.adapter import load_adapter, parse_adapter_args

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


# -- models -------------------------------------------------------------------------------------


@app.command()
@handles_errors
def models(json_out: JsonOpt = False) -> None:
    """List the built-in base-model presets and their key dims."""
    from metrale_cli import render
    from metrale_cli.models import PRESETS

    records = [preset.record() for preset in PRESETS]
    emit(records, json_out, render.models_view)


# -- inspect ------------------------------------------------------------------------------------


@app.command()
@handles_errors
def inspect(
    adapters: Annotated[list[str], typer.Argument(
        help="Adapter directories or hub ids (org/name[@revision]), or NAME=either.",
        show_default=False)],
    model: ModelOpt = None,
    max_rank: MaxRankOpt = None,
    experts: ExpertsOpt = False,
    online: OnlineOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Audit PEFT LoRA adapters against a base model. Exit 0 when all are servable, 1 if not.

    The model defaults to the adapters' base_model_name_or_path."""
    from metrale_cli.audit import audit
    from metrale_cli.plan import Footprint, inspect_record, max_rank_warnings

    positive("--max-rank", max_rank)
    loaded = load_adapters(adapters, online_on(online))
    cfg = model_for(model, loaded, online_on(online))
    enabled = experts_on(experts)
    reports = [audit(a, cfg, max_rank, enabled) for a in loaded]
    footprints = [Footprint.of(cfg, r, max_rank) for r in reports]
    warnings = max_rank_warnings(max_rank)
    warn(warnings)
    if json_out:
        emit_json(inspect_record(cfg, reports, footprints, enabled, warnings))
    else:
        from metrale_cli.render import inspect_view

        out().print(inspect_view(cfg, reports, footprints))
    if not all(r.servable for r in reports):
        raise typer.Exit(1)


# -- layout -------------------------------------------------------------------------------------


@app.command()
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
    align: Annotated[int, typer.Option("--align", help="Byte alignment of every region.")]
    = DEFAULT_ALIGN,
    experts: ExpertsOpt = False,
    online: OnlineOpt = False,
    tp: TpOpt = None,
    ep: EpOpt = None,
    fully_sharded: FullyShardedOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """The byte-exact slot layout and capacity plan of a pool; with --tp, of every rank's pool,
    --budget per GPU.

    With --experts, the expert pool too: the adapters' routed-expert and router pairs, or
    without adapters every expert and router of every MoE layer at --max-rank."""
    from metrale_cli.audit import audit
    from metrale_cli.plan import PoolPlan, plan_layouts

    spec = shard_spec(tp, ep, fully_sharded)
    positive("--max-rank", max_rank)
    positive("--max-loras", max_loras)
    enabled = experts_on(experts)
    loaded = load_adapters(adapters, online_on(online)) if adapters else []
    if model is None and not loaded:
        raise UsageError("--model is required (or give startup adapters)")
    cfg = model_for(model, loaded, online_on(online))
    reports = [audit(a, cfg, max_rank, enabled) for a in loaded]
    refuse_unservable(reports)
    layouts = plan_layouts(cfg, reports, parse_modules(modules) if modules else None, max_rank,
                           align, enabled)
    budget_bytes = parse_size(budget) if budget is not None else None
    if spec is not None:
        from metrale_cli.sharding import ShardedPlan

        sharded = ShardedPlan.sized(*layouts, spec, max_loras, budget_bytes)
        warn(sharded.plan.warnings)
        if json_out:
            emit_json(sharded.record())
        else:
            from metrale_cli.render import sharded_layout_view

            out().print(sharded_layout_view(sharded))
        return
    plan = PoolPlan.sized(*layouts, max_loras, budget_bytes)
    warn(plan.warnings)
    if json_out:
        emit_json(plan.record())
    else:
        from metrale_cli.render import layout_view

        out().print(layout_view(plan))


# -- synth --------------------------------------------------------------------------------------


@app.command()
@handles_errors
def synth(
    out_dir: Annotated[str, typer.Argument(help="Directory to write the adapter into.",
                                           show_default=False)],
    model: Annotated[str, MODEL],
    modules: Annotated[str, MODULES],
    rank: Annotated[int, typer.Option("--rank", "-r")],
    alpha: Annotated[float | None, typer.Option("--alpha", help="Default: 2 * rank.")] = None,
    rslora: Annotated[bool, typer.Option("--rslora", help="Scale alpha/sqrt(r).")] = False,
    dtype: Annotated[str, typer.Option("--dtype", help="bf16, f16 or f32.")] = "bf16",
    seed: Annotated[int, typer.Option("--seed")] = 0,
    force: ForceOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Write a PEFT-format adapter with random non-zero A and B for a real model size."""
    from metrale_cli.synth import synth_adapter

    if not out_dir.strip():
        raise UsageError("the adapter directory is empty")
    module_list = parse_modules(modules)
    if alpha is not None and not (math.isfinite(alpha) and alpha > 0):
        raise UsageError(f"--alpha must be a positive finite number, got {alpha}")
    if seed < 0:
        raise UsageError(f"--seed must be non-negative, got {seed}")
    result = synth_adapter(Path(out_dir), resolve_model(model), model, module_list, rank, alpha,
                           rslora, dtype, seed, force)
    if json_out:
        emit_json(result.record())
    else:
        from metrale_cli.render import human_bytes

        out().print(f"wrote {escape(str(result.path))}: {result.tensors} tensors, "
                    f"{human_bytes(result.bytes)}")


# -- pack ---------------------------------------------------------------------------------------


@app.command()
@handles_errors
def pack(
    adapters: Annotated[list[str], typer.Argument(help="Adapter directories, or NAME=PATH; "
                                                  "they become the pinned startup slots.",
                                                  show_default=False)],
    max_loras: Annotated[int, MAX_LORAS],
    model: ModelOpt = None,
    max_rank: MaxRankOpt = None,
    modules: ModulesOpt = None,
    out_text: Annotated[str | None, typer.Option("--out", "-o", help="Write the pool image "
                                                 "here (safetensors, format pool/1); with --tp "
                                                 "a directory of rank images.")] = None,
    device: Annotated[str, typer.Option("--device", help="auto, cpu or cuda.")] = "auto",
    force: ForceOpt = False,
    experts: ExpertsOpt = False,
    online: OnlineOpt = False,
    tp: TpOpt = None,
    ep: EpOpt = None,
    fully_sharded: FullyShardedOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Pack adapters into a pool (GPU memory with CuPy, else host memory) and write its image;
    with --tp, one pool per rank and --out a directory of rank images (under torchrun, one
    process per rank).

    The model defaults to the adapters' base_model_name_or_path, the modules to the union of
    theirs."""
    from metrale_cli import render
    from metrale_cli.atomic import check_output, output_dir, output_path
    from metrale_cli.audit import audit
    from metrale_cli.packing import pack_pool
    from metrale_cli.plan import plan_layouts

    spec = shard_spec(tp, ep, fully_sharded)
    positive("--max-loras", max_loras)
    positive("--max-rank", max_rank)

    def prepare() -> tuple[SlotLayout, ExpertLayout | None, list[AdapterReport]]:
        """Audit the adapters (refusing any that is not servable) and plan the layouts."""
        loaded = load_adapters(adapters, online_on(online), weights=True)
        cfg = model_for(model, loaded, online_on(online))
        enabled = experts_on(experts)
        reports = [audit(a, cfg, max_rank, enabled) for a in loaded]
        refuse_unservable(reports)
        return (*plan_layouts(cfg, reports, parse_modules(modules) if modules else None,
                              max_rank, experts=enabled), reports)

    if spec is not None:
        from metrale_cli import distributed

        # --out names a directory of rank images here.
        out_dir = None if out_text is None else output_dir(out_text)
        if distributed.under_torchrun():
            # One process per rank: each writes its own image into the directory --out.
            sharded = distributed.pack_torchrun(prepare, max_loras, spec, device, out_dir,
                                                force)
        else:  # the images land in --out all at once (atomic_directory refuses it first)
            the_layout, expert_layout, reports = prepare()
            sharded = distributed.pack_shards(the_layout, expert_layout, max_loras, reports,
                                              spec, device, out_dir, force)
        if sharded is None:
            return  # a torchrun rank other than 0: rank 0 reports for all
        warn(sharded.warnings)
        emit(sharded.record(), json_out, render.sharded_pack_view)
        return
    out_path = None if out_text is None else output_path(out_text)
    if out_path is not None:
        check_output(out_path, force)  # before the work; the write checks again
    the_layout, expert_layout, reports = prepare()
    result = pack_pool(the_layout, max_loras, reports, device, out_path, force,
                       progress_console=err() if err().is_terminal and not json_out else None,
                       expert_layout=expert_layout)
    warn(result.warnings)
    if json_out:
        emit_json(result.record())
    else:
        out().print(render.pack_view(result))


# -- pool images --------------------------------------------------------------------------------

ImageArg = Annotated[Path, typer.Argument(help="A pool image (format pool/1).",
                                          show_default=False)]


@app.command()
@handles_errors
def show(image: ImageArg, json_out: JsonOpt = False) -> None:
    """What a pool image holds, checked without reading its pool bytes. Exit 1 if its metadata
    and tables contradict each other, 2 if it is not a pool image."""
    from metrale_cli import render
    from metrale_cli.image_check import show_image

    record = show_image(image).record()
    emit(record, json_out, render.show_view)


@app.command()
@handles_errors
def verify(
    image: ImageArg,
    adapters: Annotated[list[str], typer.Argument(
        help="Adapter directories or hub ids (matched to slots by name), or NAME=either.",
        show_default=False)],
    online: OnlineOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Recompute what pack writes for each adapter and compare it with the image's bytes. Exit
    1 on any difference."""
    from metrale_cli import render
    from metrale_cli.verify import Verifier

    verifier = Verifier.open(image, load_adapters(adapters, online_on(online), weights=True))
    if err().is_terminal and not json_out:
        from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

        with Progress("verifying", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                      console=err(), transient=True) as bar:
            task = bar.add_task("verify", total=verifier.total_bytes)
            result = verifier.run(lambda n: bar.advance(task, n))
    else:
        result = verifier.run()
    emit(result.record(), json_out, render.verify_view)
    if not result.ok:
        raise typer.Exit(1)


@app.command()
@handles_errors
def unpack(
    image: ImageArg,
    out_dir: Annotated[str, typer.Argument(help="The adapter directory to write.",
                                           show_default=False)],
    slot: Annotated[int | None, typer.Option("--slot", help="The slot to unpack.")] = None,
    name: Annotated[str | None, typer.Option("--name", help="The slot holding this adapter.")]
    = None,
    force: ForceOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Write one slot of a pool image back as a PEFT LoRA adapter directory."""
    from metrale_cli.unpack import unpack as unpack_slot

    result = unpack_slot(image, out_dir, slot, name, force)
    if json_out:
        emit_json(result.record())
    else:
        from metrale_cli.render import human_bytes

        overlays = f", trainable tokens for {', '.join(result.overlay_tables)}" \
            if result.overlay_tables else ""
        out().print(f"wrote {escape(str(result.path))}: slot {result.slot} "
                    f"({escape(result.name)}), {result.modules} modules at r={result.rank} "
                    f"lora_alpha={result.lora_alpha:g}{overlays}, {human_bytes(result.bytes)}")


# -- bench --------------------------------------------------------------------------------------

BENCH_MODEL = "qwen3-next-80b-a3b"
BENCH_MODULES = "q_proj,k_proj,v_proj,o_proj,out_proj"


@bench_app.command("pack")
@handles_errors
def bench_pack(
    model: Annotated[str, MODEL] = BENCH_MODEL,
    modules: Annotated[str, MODULES] = BENCH_MODULES,
    rank: Annotated[int, typer.Option("--rank", "-r")] = 64,
    adapters: Annotated[int, typer.Option("--adapters", help="Synthetic adapters to pack.")] = 4,
    dtype: Annotated[str, typer.Option("--dtype", help="Adapter file dtype.")] = "bf16",
    repeats: Annotated[int, typer.Option("--repeats")] = 3,
    device: Annotated[str, typer.Option("--device", help="cpu, or cuda: pack into GPU memory "
                                        "against a pinned-memory copy.")] = "cpu",
    experts: Annotated[bool, typer.Option("--experts", help="Also pack a fused F32 expert "
                                          "adapter at the model's real width and report its "
                                          "peak RSS.")] = False,
    tp: Annotated[int | None, typer.Option(
        "--tp", help="Also the packing throughput of each of N tensor-parallel ranks.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Packing throughput vs a plain copy of the same bytes, and peak RSS vs the pool size."""
    from metrale_cli import bench_pack as bench
    from metrale_cli import render

    spec = shard_spec(tp, None, False)
    positive("--rank", rank)
    positive("--adapters", adapters)
    positive("--repeats", repeats)
    if device not in ("cpu", "cuda"):
        raise UsageError(f"--device must be cpu or cuda, got {device!r}")
    record = bench.run(resolve_model(model), model, parse_modules(modules), rank, adapters,
                       dtype, repeats, device=device, experts=experts, tp=spec)
    emit(record, json_out, render.bench_pack_view)


@bench_app.command("kernels")
@handles_errors
def bench_kernels(
    model: Annotated[str, MODEL] = BENCH_MODEL,
    modules: Annotated[str, MODULES] = BENCH_MODULES,
    rank: Annotated[list[int] | None, typer.Option("--rank", "-r", help="Repeatable; "
                                                   "default 16, 64, 128.")] = None,
    tokens: Annotated[list[int] | None, typer.Option(
        "--tokens", help="Repeatable; <= 256 runs decode (BGMV), more runs prefill (SGMV). "
                         "Default 1..256 and 512..8192.")] = None,
    adapters: Annotated[list[int] | None, typer.Option(
        "--adapters", help="Distinct adapters per batch, repeatable; default 1, 8 and one per "
                           "token.")] = None,
    repeats: Annotated[int, typer.Option("--repeats")] = 30,
    plot_text: Annotated[str | None, typer.Option("--plot", help="Write a roofline chart "
                                                  "(PNG) here.")] = None,
    force: ForceOpt = False,
    model_only: Annotated[bool, typer.Option(
        "--model-only", help="No GPU: the roofline model's expected share of peak per shape.")
    ] = False,
    experts: Annotated[bool, typer.Option(
        "--experts", help="The expert kernels (router, gate_up, down) on Qwen3-Next-80B-A3B and "
                          "Qwen3-30B-A3B MoE shapes (ranks 8, 16, 64; 1..256 and 4096 tokens) "
                          "instead of the slot-pool kernels; --model and --modules are unused.")
    ] = False,
    json_out: JsonOpt = False,
) -> None:
    """Benchmark the CUDA LoRA delta kernels against torch on a GPU (exit 3 without one).

    Shapes are the model's modules at real size. --json prints one record per line as it is
    measured."""
    from metrale_cli import bench_kernels as bench
    from metrale_cli.atomic import check_output, output_path
    from metrale_cli.compat import cupy_module
    from metrale_cli.render import kernel_line, kernel_model_line

    if not model_only:
        cupy_module()  # no GPU: exit 3 before anything else
    if experts:
        _bench_experts(rank, tokens, adapters, repeats, plot_text, force, model_only, json_out)
        return
    shapes = bench.module_shapes(resolve_model(model), parse_modules(modules))
    positive("--rank/--tokens/--adapters", *(rank or []), *(tokens or []), *(adapters or []))
    positive("--repeats", repeats)
    plot_path = None if plot_text is None else output_path(plot_text, "--plot")
    if plot_path is not None:
        check_output(plot_path, force)

    def show(record: dict[str, Any]) -> None:
        if json_out:
            sys.stdout.write(json.dumps(record, allow_nan=False) + "\n")
            sys.stdout.flush()
        else:
            out().print(kernel_line(record))

    kwargs: dict[str, Any] = {}
    if rank:
        kwargs["ranks"] = rank
    if tokens:
        kwargs["tokens"] = tokens
    if model_only:
        for record in bench.model(shapes, adapters=adapters, **kwargs):
            if json_out:
                sys.stdout.write(json.dumps(record) + "\n")
            else:
                out().print(kernel_model_line(record), soft_wrap=True)
        return
    records = bench.run(shapes, adapters=adapters, repeats=repeats, progress=show, **kwargs)
    if plot_path is not None:
        bench.plot(records, plot_path, force)


def _bench_experts(rank: list[int] | None, tokens: list[int] | None,
                   adapters: list[int] | None, repeats: int, plot_text: str | None,
                   force: bool, model_only: bool, json_out: bool) -> None:
    """`bench kernels --experts`: the expert kernels' records (or their roofline model)."""
    from metrale_cli import bench_experts
    from metrale_cli import bench_kernels as bench
    from metrale_cli.atomic import check_output, output_path
    from metrale_cli.render import expert_kernel_line, expert_model_line

    positive("--rank/--tokens/--adapters", *(rank or []), *(tokens or []), *(adapters or []))
    positive("--repeats", repeats)
    plot_path = None if plot_text is None else output_path(plot_text, "--plot")
    if plot_path is not None:
        check_output(plot_path, force)
    shapes = bench_experts.expert_shapes(
        ranks=rank or bench_experts.EXPERT_RANKS, tokens=tokens or bench_experts.EXPERT_TOKENS,
        adapters=adapters or bench_experts.EXPERT_ADAPTERS)
    line = expert_model_line if model_only else expert_kernel_line

    def show(record: dict[str, Any]) -> None:
        if json_out:
            sys.stdout.write(json.dumps(record, allow_nan=False) + "\n")
            sys.stdout.flush()
        else:
            out().print(line(record), soft_wrap=True)

    if model_only:
        for record in bench_experts.model_records(shapes):
            show(record)
        return
    records = bench_experts.run(shapes, repeats=repeats, progress=show)
    if plot_path is not None:
        bench.plot(records, plot_path, force)


@bench_app.command("slots")
@handles_errors
def bench_slots(
    requests: Annotated[int, typer.Option("--requests", help="Requests per simulator run.")]
    = 200_000,
    cycles: Annotated[int, typer.Option("--cycles", help="Victim choices per timing.")]
    = 100_000,
    repeats: Annotated[int, typer.Option("--repeats")] = 3,
    json_out: JsonOpt = False,
) -> None:
    """Slot-manager victim choice and simulator requests/s at 64 vs 4096 slots, in one run."""
    from metrale_cli import bench_slots as bench
    from metrale_cli import render

    record = bench.run(requests, cycles, repeats)
    emit(record, json_out, render.bench_slots_view)


# -- simulate -----------------------------------------------------------------------------------


@app.command()
@handles_errors
def simulate(
    adapters: Annotated[list[str] | None, typer.Argument(
        help="Adapters whose modules and largest rank size a slot (else --modules and "
             "--max-rank).", show_default=False)] = None,
    model: ModelOpt = None,
    modules: ModulesOpt = None,
    max_rank: MaxRankOpt = None,
    experts: ExpertsOpt = False,
    trace: Annotated[Path | None, typer.Option(
        "--trace", help="CSV or JSONL requests: timestamp, adapter (empty = base model), "
        "optional input_tokens, output_tokens, duration.")] = None,
    workload: Annotated[str | None, typer.Option(
        "--workload", help="Generator when no --trace: zipf (default), uniform, distinct, "
        "identical or slora.")] = None,
    n_requests: Annotated[int, typer.Option("--requests", help="Requests to generate.")]
    = 10_000,
    n_adapters: Annotated[int, typer.Option("--adapters", help="Adapters to draw from.")] = 100,
    rate: Annotated[float, typer.Option("--rate", help="Requests per second.")] = 10.0,
    cv: Annotated[float, typer.Option("--cv", help="Coefficient of variation of the "
                                      "inter-arrival times (1 = Poisson).")] = 1.0,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    zipf_s: Annotated[float, typer.Option("--zipf-s", help="zipf exponent.")] = 1.5,
    alpha: Annotated[float, typer.Option("--alpha", help="slora power-law alpha (1 = "
                                         "uniform).")] = 1.0,
    input_tokens: Annotated[str, typer.Option(
        "--input-tokens", help="Generated input lengths: LO,HI (uniform, HI exclusive) or N.")]
    = "8,512",
    output_tokens: Annotated[str, typer.Option(
        "--output-tokens", help="Generated output lengths; 0 with --input-tokens 0 is exact "
        "paging.")] = "8,512",
    save_trace_text: Annotated[str | None, typer.Option(
        "--save-trace", help="Write the requests as a trace (.csv, else JSONL).")] = None,
    prefill_tok_s: Annotated[float, typer.Option(
        "--prefill-tok-s", help="Prefill tokens per second of one request.")] = 10_000.0,
    decode_tok_s: Annotated[float, typer.Option(
        "--decode-tok-s", help="Decode tokens per second of one request.")] = 50.0,
    max_concurrency: Annotated[int | None, typer.Option(
        "--max-concurrency", help="Requests in flight at most (a batch); default no cap.")]
    = None,
    policy: Annotated[str, typer.Option("--policy", help="Comma-separated: lru, fifo, min.")]
    = "lru,fifo,min",
    pin: Annotated[list[str] | None, typer.Option(
        "--pin", help="Pin this adapter in a startup slot (repeatable).")] = None,
    pinned: Annotated[int | None, typer.Option(
        "--pinned", help="Pin the K most requested adapters.")] = None,
    max_loras: Annotated[str | None, typer.Option(
        "--max-loras", help="Sizes: 8,16,32 or 8..64 or 8..64:8. Default: powers of two up to "
        "every adapter resident.")] = None,
    bandwidth: Annotated[str, typer.Option(
        "--bandwidth", help="pcie4, pcie5, nvlink, nvme, or a figure like 25GB/s.")] = "pcie4",
    swap_latency_ms: Annotated[float | None, typer.Option(
        "--swap-latency-ms", help="Per-swap latency; default the preset's (0 for a figure).")]
    = None,
    links: Annotated[int, typer.Option(
        "--links", help="Loads that run at once per GPU (default 1: loads queue on one link).")]
    = 1,
    target_hit_rate: Annotated[float | None, typer.Option(
        "--target-hit-rate", help="Report the smallest size with at least this hit rate.")]
    = None,
    target_p99_ms: Annotated[float | None, typer.Option(
        "--target-p99-ms", help="Report the smallest size with p99 added latency at most "
        "this.")] = None,
    budget: Annotated[str | None, typer.Option(
        "--budget", help="Memory for the pool, e.g. 40GiB: does each size fit?")] = None,
    plot_text: Annotated[str | None, typer.Option(
        "--plot", help="Write hit rate and p99 added latency against max_loras (PNG).")] = None,
    tp: TpOpt = None,
    ep: EpOpt = None,
    fully_sharded: FullyShardedOpt = False,
    force: ForceOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Size max_loras for real traffic: replay a trace or a generated workload against the
    pool's slot manager per policy and size; hit rate, bytes moved, stalls, added latency.
    With --tp, per GPU: each swap moves the largest rank's slot, --budget is per GPU."""
    from metrale_cli import render
    from metrale_cli import simulate as sim
    from metrale_cli import workload as wl
    from metrale_cli.atomic import check_output, output_path
    from metrale_cli.audit import audit
    from metrale_cli.parsing import parse_bandwidth, parse_size_list, parse_token_range
    from metrale_cli.plan import max_rank_warnings, plan_layouts

    spec = shard_spec(tp, ep, fully_sharded)
    positive("--max-rank", max_rank)
    plot_path = None if plot_text is None else output_path(plot_text, "--plot")
    save_trace = None if save_trace_text is None else output_path(save_trace_text,
                                                                 "--save-trace")
    for path in (plot_path, save_trace):
        if path is not None:
            check_output(path, force)  # before the work; the write checks again
    if target_hit_rate is not None and not 0 < target_hit_rate <= 1:
        raise UsageError(f"--target-hit-rate must be in (0, 1], got {target_hit_rate}")
    if target_p99_ms is not None and not 0 <= target_p99_ms < math.inf:
        raise UsageError(f"--target-p99-ms must be >= 0 and finite, got {target_p99_ms}")
    loaded = load_adapters(adapters) if adapters else []
    if model is None and not loaded:
        raise UsageError("--model is required (or give adapters)")
    cfg = model_for(model, loaded)
    enabled = experts_on(experts)
    reports = [audit(a, cfg, max_rank, enabled) for a in loaded]
    refuse_unservable(reports)  # a slot sized by an adapter pack would refuse sizes nothing
    layouts = plan_layouts(cfg, reports, parse_modules(modules) if modules else None, max_rank,
                           experts=enabled)
    warn(max_rank_warnings(layouts[0].max_rank))
    if trace is not None and workload is not None:
        raise UsageError("give --trace or --workload, not both")
    if trace is not None:
        if err().is_terminal and not json_out:
            from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

            with Progress("reading", BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                          console=err(), transient=True) as bar:
                task = bar.add_task("read", total=None)
                requested = wl.read_trace(trace, progress=lambda done, total: bar.update(
                    task, completed=done, total=total))
        else:
            requested = wl.read_trace(trace)
    else:
        requested = wl.generate(wl.GeneratorSpec(
            workload or "zipf", n_requests, n_adapters, rate, cv, seed, zipf_s, alpha,
            parse_token_range("--input-tokens", input_tokens),
            parse_token_range("--output-tokens", output_tokens)))
    if save_trace is not None:
        requested.save(save_trace, force)
    targets = (sim.Targets(target_hit_rate, target_p99_ms)
               if target_hit_rate is not None or target_p99_ms is not None else None)
    link = parse_bandwidth(bandwidth)
    if swap_latency_ms is not None:
        link = dataclasses.replace(link, latency_s=swap_latency_ms / 1e3)
    options: dict[str, Any] = dict(
        link=link, links=links, prefill_tok_s=prefill_tok_s, decode_tok_s=decode_tok_s,
        max_concurrency=max_concurrency, pin=pin or (), pinned=pinned,
        policies=[p.strip() for p in policy.split(",") if p.strip()],
        sizes=parse_size_list("--max-loras", max_loras) if max_loras is not None else None,
        targets=targets,
        budget_bytes=parse_size(budget) if budget is not None else None, shard=spec)
    if err().is_terminal and not json_out:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

        with Progress("simulating", BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                      console=err(), transient=True) as bar:
            task = bar.add_task("simulate", total=None)
            result = sim.run(requested, *layouts, **options,
                             progress=lambda n, total: bar.update(task, advance=n, total=total))
    else:
        result = sim.run(requested, *layouts, **options)
    if plot_path is not None:
        sim.plot(result, plot_path, force)
    emit(result.record(), json_out, render.simulate_view)


def main() -> None:
    for stream in (sys.stdout, sys.stderr):
        # PYTHONIOENCODING=ascii or a C locale: a '·' in a table must not end the run.
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="replace")
    app()


if __name__ == "__main__":
    main()
