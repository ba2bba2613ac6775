"""`metrale bench pack|kernels|slots`: benchmarks, reported as ratios measured in one run."""

# No `from __future__ import annotations`: the options' annotations are evaluated once, here
# (cached in the .pyc), not compiled from strings by Typer each time the command tree is built,
# which was most of what `metrale --help` took beyond importing typer (scripts/bench_startup.py).

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

import typer

from metrale_cli.cli.console import emit, err, handles_errors, out
from metrale_cli.cli.options import (
    MODEL,
    POOL_MODULES,
    ForceOpt,
    JsonOpt,
    OnlineOpt,
    online_on,
    shard_spec,
)
from metrale_cli.cli.parsing import parse_modules, positive
from metrale_cli.errors import UsageError

if TYPE_CHECKING:
    from rich.text import Text

BENCH_MODEL = "qwen3-next-80b-a3b"
BENCH_MODULES = "q_proj,k_proj,v_proj,o_proj,out_proj"


@handles_errors
def bench_pack(
    model: Annotated[str, MODEL] = BENCH_MODEL,
    modules: Annotated[str, POOL_MODULES] = BENCH_MODULES,
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
    online: OnlineOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Packing throughput vs a plain copy of the same bytes, and peak RSS vs the pool size.

    Example: metrale bench pack -m qwen3-8b --modules q_proj,v_proj --rank 16 --repeats 1"""
    from metrale_cli.bench import pack as bench
    from metrale_cli.cli import render
    from metrale_cli.model.resolve import resolve_model

    spec = shard_spec(tp, None, False)
    positive("--rank", rank)
    positive("--adapters", adapters)
    positive("--repeats", repeats)
    if device not in ("cpu", "cuda"):
        raise UsageError(f"--device must be cpu or cuda, got {device!r}")
    record = bench.run(resolve_model(model, online_on(online)), model, parse_modules(modules),
                       rank, adapters, dtype, repeats, device=device, experts=experts, tp=spec)
    emit(record, json_out, render.bench_pack_view)


@handles_errors
def bench_kernels(
    model: Annotated[str, MODEL] = BENCH_MODEL,
    modules: Annotated[str, POOL_MODULES] = BENCH_MODULES,
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
    online: OnlineOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Benchmark the CUDA LoRA delta kernels against torch on a GPU (exit 3 without one).

    Shapes are the model's modules at real size. Each measurement's line is printed as it is
    measured (on stderr under --json, which prints the JSON record of the whole run at the end).

    Example: metrale bench kernels --rank 16 --tokens 1 --tokens 512"""
    from metrale_cli.bench import kernels as bench
    from metrale_cli.bench import roofline
    from metrale_cli.cli.render import kernel_line
    from metrale_cli.compat import cupy_module
    from metrale_cli.files.atomic import check_output, output_path
    from metrale_cli.model.resolve import resolve_model

    if not model_only:
        cupy_module()  # no GPU: exit 3 before anything else
    positive("--rank/--tokens/--adapters", *(rank or []), *(tokens or []), *(adapters or []))
    positive("--repeats", repeats)
    plot_path = None if plot_text is None else output_path(plot_text, "--plot")
    if plot_path is not None:
        check_output(plot_path, force)
    if experts:
        records = _bench_experts(rank, tokens, adapters, repeats, model_only, json_out)
    else:
        shapes = bench.module_shapes(resolve_model(model, online_on(online)),
                                     parse_modules(modules))
        kwargs: dict[str, Any] = {}
        if rank:
            kwargs["ranks"] = rank
        if tokens:
            kwargs["tokens"] = tokens
        records = (roofline.model(shapes, adapters=adapters, **kwargs) if model_only
                   else bench.run(shapes, adapters=adapters, repeats=repeats,
                                  progress=_measured(kernel_line, json_out), **kwargs))
    record = {"bench": "kernels", "experts": experts, "model_only": model_only,
              # What the model assumes; a measurement's record names its own device and peak.
              "assumed_device": dataclasses.asdict(roofline.ModelDevice()),
              "records": records}
    if model_only or json_out:
        from metrale_cli.cli import render

        emit(record, json_out, render.kernel_model_view)
    if plot_path is not None and not model_only:
        bench.plot(records, plot_path, force)


def _measured(line: Callable[[dict[str, Any]], "Text"], json_out: bool
              ) -> Callable[[dict[str, Any]], None]:
    """Each measurement's line as it is measured, after one naming the device and its peak:
    the view on stdout, progress on stderr under --json (stdout then holds one document)."""
    shown: list[str] = []

    def show(record: dict[str, Any]) -> None:
        console = err() if json_out else out()
        if not shown:
            shown.append(record["device"])
            source = f" ({record['peak_source']})" if "peak_source" in record else ""
            console.print(f"{record['device']}: nominal HBM peak {record['peak_tb_per_s']:.2f} "
                          f"TB/s{source}; % peak is of it", soft_wrap=True)
        console.print(line(record), soft_wrap=True)

    return show


def _bench_experts(rank: list[int] | None, tokens: list[int] | None,
                   adapters: list[int] | None, repeats: int, model_only: bool,
                   json_out: bool) -> list[dict[str, Any]]:
    """`bench kernels --experts`: the expert kernels' records (or their roofline model)."""
    from metrale_cli.bench import experts as bench_experts
    from metrale_cli.cli.render import expert_kernel_line

    shapes = bench_experts.expert_shapes(
        ranks=rank or bench_experts.EXPERT_RANKS, tokens=tokens or bench_experts.EXPERT_TOKENS,
        adapters=adapters or bench_experts.EXPERT_ADAPTERS)
    if model_only:
        return bench_experts.model_records(shapes)
    return bench_experts.run(shapes, repeats=repeats,
                             progress=_measured(expert_kernel_line, json_out))


@handles_errors
def bench_slots(
    requests: Annotated[int, typer.Option("--requests", help="Requests per simulator run.")]
    = 200_000,
    cycles: Annotated[int, typer.Option("--cycles", help="Victim choices per timing.")]
    = 100_000,
    repeats: Annotated[int, typer.Option("--repeats")] = 3,
    scale: Annotated[int | None, typer.Option(
        "--scale", help="Instead: a trace of this many requests (10000000: a real trace's "
        "size) through lru, fifo and min at 8 sizes, against libCacheSim, with each side's "
        "peak memory. Minutes.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Slot-manager victim choice and simulator requests/s at 64 vs 4096 slots, in one run.

    Example: metrale bench slots --requests 20000 --cycles 10000 --repeats 1"""
    from metrale_cli.bench import slots as bench
    from metrale_cli.cli import render_sim

    if scale is not None:
        emit(bench.at_scale(scale), json_out, render_sim.bench_slots_scale_view)
        return
    record = bench.run(requests, cycles, repeats)
    emit(record, json_out, render_sim.bench_slots_view)


# -- simulate -----------------------------------------------------------------------------------
