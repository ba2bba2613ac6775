"""`metrale simulate`: size max_loras for a workload on the pool's own slot manager."""

# No `from __future__ import annotations`: the options' annotations are evaluated once, here
# (cached in the .pyc), not compiled from strings by Typer each time the command tree is built,
# which was most of what `metrale --help` took beyond importing typer (scripts/bench_startup.py).

import dataclasses
from pathlib import Path
from typing import Annotated

import typer

from metrale_cli.cli.console import emit, handles_errors, progress, warn
from metrale_cli.cli.options import (
    ENGINE_PANEL,
    Command,
    DtypeOpt,
    EngineOpt,
    EpOpt,
    EvictionPolicyOpt,
    ExpertsOpt,
    ForceOpt,
    FullyShardedOpt,
    JsonOpt,
    LoraBackendOpt,
    LoraDtypeOpt,
    MaxCpuLorasOpt,
    MaxLoadedLorasOpt,
    MaxRankOpt,
    ModelOpt,
    ModulesOpt,
    TpOpt,
    experts_on,
)


class SimulateCommand(Command):
    """`metrale simulate`'s help: its options in panels by what they set."""

    panels = {
        "Pool": ("--model", "--modules", "--max-rank", "--experts", "--max-loras", "--pin",
                 "--pinned", "--tp", "--ep", "--fully-sharded", "--budget"),
        "Workload: a trace": ("--trace", "--trace-format", "--assign"),
        "Workload: generated": ("--workload", "--requests", "--adapters", "--rate", "--cv",
                                "--seed", "--seeds", "--zipf-s", "--alpha", "--input-tokens",
                                "--output-tokens", "--ranks", "--save-trace"),
        "Serving": ("--policy", "--admission", "--max-concurrency", "--prefill-tok-s",
                    "--decode-tok-s", "--replicas", "--route"),
        "Loads": ("--bandwidth", "--swap-latency-ms", "--links", "--host-slots",
                  "--host-bandwidth"),
        **ENGINE_PANEL,
        "Answer and output": ("--target-hit-rate", "--target-p99-ms", "--plot", "--json",
                              "--force"),
    }


@handles_errors
def simulate(
    adapters: Annotated[list[str] | None, typer.Argument(
        metavar="ADAPTER", help="Adapters whose modules and largest rank size a slot (else "
        "--modules and --max-rank).", show_default=False)] = None,
    model: ModelOpt = None,
    modules: ModulesOpt = None,
    max_rank: MaxRankOpt = None,
    experts: ExpertsOpt = False,
    trace: Annotated[Path | None, typer.Option(
        "--trace", help="CSV or JSONL requests: timestamp, adapter (empty = base model), "
        "optional input_tokens, output_tokens, duration.")] = None,
    trace_format: Annotated[str, typer.Option(
        "--trace-format", help="metrale (default: the columns above), azure-llm (2023/2024), "
        "burstgpt or azure-functions (2021).")] = "metrale",
    assign: Annotated[str | None, typer.Option(
        "--assign", help="Adapters for a trace that names none: zipf:1.5 or uniform over "
        "--adapters, seeded by --seed.")] = None,
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
    seeds: Annotated[int, typer.Option(
        "--seeds", help="Run K seeds (--seed, --seed + 1, ...) and report each figure's "
        "min/median/max.")] = 1,
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
    policy: Annotated[str | None, typer.Option(
        "--policy", help="Comma-separated: lru, fifo, min (default all three; an engine's "
        "own with --engine).")] = None,
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
    host_slots: Annotated[int | None, typer.Option(
        "--host-slots", help="A host tier of N adapters (an LRU, vLLM's --max-cpu-loras) in "
        "front of the GPU slots; default none.")] = None,
    host_bandwidth: Annotated[str, typer.Option(
        "--host-bandwidth", help="What a host miss reads over: nvme (default), pcie4, ..., "
        "or a figure.")] = "nvme",
    admission: Annotated[str | None, typer.Option(
        "--admission", help="fcfs (default: the head waits, all behind it too) or skip (later "
        "requests whose adapter is resident go ahead, as vLLM's scheduler; an engine's own "
        "with --engine).")] = None,
    replicas: Annotated[int, typer.Option(
        "--replicas", help="Data-parallel replicas, each its own pool of each size.")] = 1,
    route: Annotated[str, typer.Option(
        "--route", help="How requests reach replicas: affinity (default), round-robin or "
        "random (seeded by --seed).")] = "affinity",
    ranks: Annotated[str | None, typer.Option(
        "--ranks", help="Generated adapters' own ranks, cycled by adapter index: 64,32,16,8 "
        "or an S-LoRA setting slora:S1..S4; default every adapter a full slot.")] = None,
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
    engine: EngineOpt = "metrale",
    max_cpu_loras: MaxCpuLorasOpt = None,
    dtype: DtypeOpt = None,
    lora_dtype: LoraDtypeOpt = None,
    max_loaded_loras: MaxLoadedLorasOpt = None,
    eviction_policy: EvictionPolicyOpt = None,
    lora_backend: LoraBackendOpt = None,
    force: ForceOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Size max_loras for real traffic: replay a trace or a generated workload against the
    pool's slot manager per policy and size; hit rate, bytes moved, stalls, added latency.
    With --tp, per GPU: each swap moves the largest rank's slot, --budget is per GPU. With
    --engine vllm, the engine's own cache: --max-loras GPU slots of vLLM's slot bytes, an LRU
    host cache of --max-cpu-loras adapters read from disk (--host-bandwidth) on a miss,
    vLLM's scheduler admission, --budget in vLLM's LoRA bytes. With --engine sglang, SGLang's:
    --max-loras GPU slots (--max-loras-per-batch) evicted by --eviction-policy, an LRU of
    --max-loaded-loras adapters in CPU memory, its scheduler's admission.

    Example: metrale simulate chat code --adapters 100 --requests 5000 --max-loras 4,8,16"""
    from metrale_cli import compat
    from metrale_cli.cli import render_sim
    from metrale_cli.cli.parsing import (
        parse_assign,
        parse_bandwidth,
        parse_ranks,
        parse_size,
        parse_size_list,
        parse_token_range,
    )
    from metrale_cli.files.atomic import check_output, output_path
    from metrale_cli.sim.request import SimulateRequest
    from metrale_cli.sim.simulate import plot

    link = parse_bandwidth(bandwidth)
    if swap_latency_ms is not None:
        link = dataclasses.replace(link, latency_s=swap_latency_ms / 1e3)
    request = SimulateRequest(
        adapters=tuple(adapters or ()), model=model, modules=modules, max_rank=max_rank,
        experts=experts_on(experts), trace=trace, trace_format=trace_format,
        assign=parse_assign(assign, n_adapters, seed) if assign is not None else None,
        workload=workload, requests=n_requests, adapter_count=n_adapters, rate=rate, cv=cv,
        seed=seed, seeds=seeds, zipf_s=zipf_s, alpha=alpha,
        input_tokens=parse_token_range("--input-tokens", input_tokens),
        output_tokens=parse_token_range("--output-tokens", output_tokens),
        ranks=parse_ranks(ranks) if ranks is not None else None,
        prefill_tok_s=prefill_tok_s, decode_tok_s=decode_tok_s,
        max_concurrency=max_concurrency,
        policies=(tuple(p.strip() for p in policy.split(",") if p.strip())
                  if policy is not None else None),
        pin=tuple(pin or ()), pinned=pinned,
        sizes=(tuple(parse_size_list("--max-loras", max_loras)) if max_loras is not None
               else None),
        bandwidth=link, links=links, host_slots=host_slots,
        host_bandwidth=parse_bandwidth(host_bandwidth, "--host-bandwidth"),
        admission=admission, replicas=replicas, route=route,
        target_hit_rate=target_hit_rate, target_p99_ms=target_p99_ms,
        budget_bytes=parse_size(budget) if budget is not None else None,
        tp=tp, ep=ep, fully_sharded=fully_sharded, engine=engine,
        max_cpu_loras=max_cpu_loras, dtype=dtype, lora_dtype=lora_dtype,
        max_loaded_loras=max_loaded_loras, eviction_policy=eviction_policy,
        lora_backend=lora_backend)
    plot_path = None if plot_text is None else output_path(plot_text, "--plot")
    save_trace = None if save_trace_text is None else output_path(save_trace_text,
                                                                 "--save-trace")
    for path in (plot_path, save_trace):
        if path is not None:
            check_output(path, force)  # before the work; the write checks again
    if plot_path is not None:
        compat.pyplot()  # no matplotlib: say so before the work, not after it
    planned = request.plan()
    warn(list(planned.warnings))
    with progress("reading", None, trace is not None and not json_out) as shown:
        first = request.read(progress=None if shown is None else
                             lambda done, total: shown.advance(done - shown.done, total))
    request.check_work_of(first)  # a trace's work, or the default sizes': before it is saved
    if save_trace is not None:
        first.save(save_trace, force)
    with progress("simulating", None, not json_out, unit="request replays") as shown:
        result = request.run(None if shown is None else shown.advance, planned=planned,
                             first=first)
    # The table first: a plot that cannot be written loses no result.
    emit(result.record(), json_out, render_sim.simulate_view)
    if plot_path is not None:
        plot(result, plot_path, force)
