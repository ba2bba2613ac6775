"""`metrale synth` and `pack`: writing adapters and pool images."""

# No `from __future__ import annotations`: the options' annotations are evaluated once, here
# (cached in the .pyc), not compiled from strings by Typer each time the command tree is built,
# which was most of what `metrale --help` took beyond importing typer (scripts/bench_startup.py).

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from metrale_cli.cli.console import (
    emit,
    handles_errors,
    progress,
    said_details,
    say,
    warn,
)
from metrale_cli.cli.options import (
    MAX_LORAS,
    MODEL,
    POOL_MODULES,
    EpOpt,
    ExpertsOpt,
    ForceOpt,
    FullyShardedOpt,
    JsonOpt,
    MaxRankOpt,
    ModelOpt,
    OnlineOpt,
    PoolModulesOpt,
    TpOpt,
    experts_on,
    online_on,
    shard_spec,
)
from metrale_cli.cli.parsing import parse_modules, positive
from metrale_cli.errors import UsageError

if TYPE_CHECKING:
    from metrale_cli.adapters.audit import AdapterReport
    from metrale_cli.layout.expert_layout import ExpertLayout
    from metrale_cli.layout.slot_layout import SlotLayout


@handles_errors
def synth(
    out_dir: Annotated[str, typer.Argument(help="Directory to write the adapter into.",
                                           show_default=False)],
    model: Annotated[str, MODEL],
    modules: Annotated[str, POOL_MODULES],
    rank: Annotated[int, typer.Option("--rank", "-r")],
    alpha: Annotated[float | None, typer.Option("--alpha", help="Default: 2 * rank.")] = None,
    rslora: Annotated[bool, typer.Option("--rslora", help="Scale alpha/sqrt(r).")] = False,
    dtype: Annotated[str, typer.Option("--dtype", help="bf16, f16 or f32.")] = "bf16",
    seed: Annotated[int, typer.Option("--seed")] = 0,
    online: OnlineOpt = False,
    force: ForceOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Write a PEFT-format adapter with random non-zero A and B for a real model size.

    Example: metrale synth math -m qwen3-8b --modules q_proj,v_proj --rank 16"""
    from metrale_cli.adapters.synth import synth_adapter
    from metrale_cli.model.resolve import resolve_model

    if not out_dir.strip():
        raise UsageError("the adapter directory is empty")
    module_list = parse_modules(modules)
    result = synth_adapter(Path(out_dir), resolve_model(model, online_on(online)), model,
                           module_list, rank, alpha, rslora, dtype, seed, force)
    from metrale_cli.cli import render

    emit(result.record(), json_out, render.synth_view)


# -- pack ---------------------------------------------------------------------------------------


@handles_errors
def pack(
    adapters: Annotated[list[str], typer.Argument(metavar="ADAPTER",
                                                  help="Adapter directories, or NAME=PATH; "
                                                  "they become the pinned startup slots.",
                                                  show_default=False)],
    max_loras: Annotated[int, MAX_LORAS],
    model: ModelOpt = None,
    max_rank: MaxRankOpt = None,
    modules: PoolModulesOpt = None,
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
    theirs.

    Example: metrale pack chat code --max-loras 4 --out pool.safetensors"""
    from metrale_cli.cli import render
    from metrale_cli.dist.torchrun import pack_torchrun, under_torchrun
    from metrale_cli.files.atomic import check_output, check_output_dir, output_dir, output_path
    from metrale_cli.image.pack import OWNED_GLOBS, pack_pool, tensor_bytes
    from metrale_cli.layout.pipeline import plan_pool

    spec = shard_spec(tp, ep, fully_sharded)
    positive("--max-loras", max_loras)
    positive("--max-rank", max_rank)

    module_list = parse_modules(modules) if modules else None

    def prepare() -> "tuple[SlotLayout, ExpertLayout | None, list[AdapterReport]]":
        """Audit the adapters (refusing any that is not servable) and plan the layouts."""
        planned = plan_pool(adapters, model, modules=module_list, max_rank=max_rank,
                            experts=experts_on(experts), online=online_on(online),
                            weights=True)
        return planned.layout, planned.expert_layout, planned.reports

    target: Path | None = None
    if out_text is not None and spec is not None:
        target = output_dir(out_text)  # with --tp, a directory of rank images
    elif out_text is not None:
        target = output_path(out_text)
        check_output(target, force)  # before the work; the write checks again
    if spec is not None and under_torchrun():
        # One process per rank: each writes its own image into the directory --out.
        result = pack_torchrun(said_details(prepare), max_loras, spec, device, target, force)
    else:  # in this process; with --tp every rank in turn, the images landing all at once
        if spec is not None and target is not None:  # before the audit, as a file --out is
            check_output_dir(target, force, owned=OWNED_GLOBS)
        the_layout, expert_layout, reports = prepare()
        # Progress for the one pool (a rank's share of the bytes is not known ahead): reading
        # the adapters, then writing the image.
        with progress("packing", tensor_bytes(reports), spec is None and not json_out) as shown:
            result = pack_pool(the_layout, max_loras, reports, device, target, force,
                               None if shown is None else shown.advance, expert_layout, spec,
                               None if shown is None else shown.next_stage("writing the image"))
    if result is None:
        return  # a torchrun rank other than 0: rank 0 reports for all
    warn(result.warnings)
    emit(result.record(), json_out, render.pack_view)
    if target is None and not json_out:  # the record says it: its image is null
        say("note: no --out, so nothing was written: the pool was packed in memory and let go")
