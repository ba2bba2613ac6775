"""Rich views of the core's records. `--json` prints the records themselves; these are the other
view. Nothing here computes what it shows.

Every string that comes from input (a path, an adapter or tensor name, a finding that quotes one)
is escaped before Rich reads it as markup: `[/]` in a directory name must not crash a view, and
`[bold red]evil` must show as typed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich import box
from rich.console import Group
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from metrale_cli.adapters.findings import Severity, layer_ranges

SEVERITY_STYLE = {Severity.ERROR.value: "bold red", Severity.WARNING.value: "yellow",
                  Severity.INFO.value: "cyan"}


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    return f"{n} B"  # unreachable


def _fmt(x: float) -> str:
    return f"{x:g}" if float(x) != int(x) else str(int(x))


def model_line(model: dict[str, Any]) -> str:
    """A model record (`ModelConfig.record`) in one line."""
    kinds = (
        f"{model['full_attention_layers']} full-attention + "
        f"{model['linear_attention_layers']} linear-attention layers"
        if model["linear_attention_layers"]
        else f"{model['num_hidden_layers']} layers"
    )
    experts = f", {model['num_experts']} routed experts" if model["num_experts"] else ""
    return f"{model['source'] or model['model_type']} ({model['model_type']}): {kinds}{experts}"


def inspect_view(record: dict[str, Any]) -> Group:
    """`metrale inspect`: the audit's record (`AuditedAdapters.record`), a panel per adapter."""
    parts: list[Any] = [Text(model_line(record["model"]), style="bold")]
    for adapter in record["adapters"]:
        parts.append(_adapter_panel(record["model"], adapter))
    return Group(*parts)


def _adapter_panel(model: dict[str, Any], a: dict[str, Any]) -> Panel:
    summary = Table.grid(padding=(0, 2))
    summary.add_column(style="dim")
    summary.add_column()
    verdict = Text("servable", style="bold green") if a["servable"] else Text(
        "NOT servable", style="bold red")
    summary.add_row("verdict", verdict)
    summary.add_row("path", escape(a["path"]))
    ranks = sorted({m["r"] for m in a["modules"]})
    summary.add_row(
        "rank / alpha",
        "not usable (bad_config_value below)" if a["rank"] is None else
        f"r={a['config_rank']} alpha={_fmt(a['alpha'])}"
        + (" rsLoRA" if a["use_rslora"] else "")
        + f"  scaling={a['scaling']:.6g}"
        + (f"  (module ranks {', '.join(map(str, ranks))})" if len(ranks) > 1 else ""),
    )
    dtypes = sorted({m["dtype"] for m in a["modules"]})
    summary.add_row("modules", ", ".join(a["module_set"]) or "-")
    summary.add_row("pairs", f"{len(a['modules'])} (layer, module) pairs"
                    + (f", {'/'.join(dtypes)}" if dtypes else ""))
    if a["slot_max_rank"] is not None:
        summary.add_row(
            "slot",
            f"{human_bytes(a['slot_bytes'])} ({a['slot_bytes']:,} B) padded to rank "
            f"{a['slot_max_rank']} for its modules",
        )
    if a["expert_pairs"]:
        summary.add_row("experts", f"{a['expert_pairs']} (layer, projection, expert) "
                        f"pairs on layers {layer_set(a['expert_layers'])}, ranks "
                        f"{', '.join(map(str, a['expert_ranks']))}")
    if a["expert_slot_max_rank"] is not None:
        summary.add_row(
            "expert slot",
            f"{human_bytes(a['expert_slot_bytes'])} "
            f"({a['expert_slot_bytes']:,} B) padded to rank {a['expert_slot_max_rank']}, "
            "in the expert pool beside the slot pool")
    if a["overlays"]:
        summary.add_row("overlays", ", ".join(
            f"{o['tokens']} tokens replace {o['table']} rows"
            + (" (and lm_head, tied)" if o["tied_lm_head"] else "") for o in a["overlays"]))

    body: list[Any] = [summary]
    if a["modules"]:
        body.append(_layer_table(a))
    if a["expert_pairs"]:
        body.append(_expert_table(model, a["expert_coverage"]))
    if a["findings"]:
        findings = Table(show_header=False, box=None, padding=(0, 1))
        findings.add_column(no_wrap=True)
        findings.add_column(no_wrap=True, style="dim")
        findings.add_column()
        for f in a["findings"]:
            findings.add_row(Text(f["severity"], style=SEVERITY_STYLE[f["severity"]]),
                             f["code"], escape(f["message"]))
        body.append(findings)
    return Panel(Group(*body), title=Text(a["name"], style="bold"), title_align="left")


def layer_set(layers: list[int], all_of_kind: bool = False) -> str:
    """A short name for a set of layers: `all 36` (every layer of its kind), `3, 7, ..., 47`
    (a stride), `0-2, 4-6, ..., 44-46 (36)`."""
    n = len(layers)
    if all_of_kind and n > 3:
        return f"all {n}"
    steps = {b - a for a, b in zip(layers, layers[1:], strict=False)}
    if n > 3 and len(steps) == 1 and steps != {1}:
        return f"{layers[0]}, {layers[1]}, ..., {layers[-1]} ({n})"
    text = layer_ranges(layers)
    if len(text) > 24:
        spans = text.split(", ")
        text = f"{', '.join(spans[:2])}, ..., {spans[-1]} ({n})"
    return text


def _layer_table(a: dict[str, Any]) -> Group:
    """The audit's layer rows (`layer_rows`): a few rows for 48+ layers at 100 columns."""
    table = Table(header_style="bold", padding=(0, 1), box=box.SIMPLE_HEAD)
    table.add_column("layers", no_wrap=True)
    table.add_column("kind", no_wrap=True)
    for name in a["module_set"]:
        table.add_column(name.removesuffix("_proj"), no_wrap=True)
    for row in a["layer_rows"]:
        shown = ["n/a" if c is None else c or "·" for c in row["cells"].values()]
        table.add_row(layer_set(row["layers"], row["all_of_kind"]), row["kind"], *shown)
    legend = Text("per layer: rank (x scaling where a pattern changes it); · not adapted; "
                  "n/a does not apply", style="dim")
    return Group(legend, table)


def _expert_table(model: dict[str, Any], rows: list[dict[str, Any]]) -> Table:
    """Per-layer expert coverage (`experts.coverage`): how many of the model's experts each
    projection adapts, layers alike on one row."""
    table = Table(title=f"expert coverage (experts adapted of {model['num_experts']}; rank)",
                  title_justify="left", header_style="bold", padding=(0, 1), box=box.SIMPLE_HEAD)
    for col in ("layers", "gate_proj", "up_proj", "down_proj", "router", "ranks", "format"):
        table.add_column(col)
    groups: dict[tuple[Any, ...], list[int]] = {}
    for row in rows:
        sig = (row["experts"].get("gate_proj", 0), row["experts"].get("up_proj", 0),
               row["experts"].get("down_proj", 0), row["router"], tuple(row["ranks"]),
               row["source"])
        groups.setdefault(sig, []).append(row["layer"])
    for (gate, up, down, router, ranks, source), layers in groups.items():
        table.add_row(layer_set(layers), str(gate or "·"), str(up or "·"), str(down or "·"),
                      "yes" if router else "·", ", ".join(map(str, ranks)),
                      "fused (v5)" if source == "v5" else "per-expert (v4)")
    return table


def layout_view(record: dict[str, Any], per_gpu: bool = False) -> Group:
    """`metrale layout`: the plan's record (`PoolPlan.record`); `per_gpu`: the unsharded slot
    above the per-rank pools of `--tp`, without the unsharded pool's size."""
    ex = record["experts"]
    max_loras = None if per_gpu else record["max_loras"]
    table = Table.grid(padding=(0, 2))
    table.add_column(style="dim")
    table.add_column()
    table.add_row("model", escape(model_line(record["model"])))
    table.add_row("modules", ", ".join(record["modules"]))
    table.add_row("max rank", str(record["max_rank"]))
    table.add_row("entries", f"{len(record['entries'])} (layer, module) pairs")
    table.add_row("slot", f"{record['slot_bytes']:,} B ({human_bytes(record['slot_bytes'])}), "
                  f"{record['align']}-byte aligned {record['dtype']}")
    if ex is not None:
        table.add_row("expert slot", f"{ex['expert_slot_bytes']:,} B "
                      f"({human_bytes(ex['expert_slot_bytes'])}), {ex['n_entries']:,} (layer, "
                      f"projection, expert) entries on {len(ex['layers'])} "
                      f"layers at rank {ex['max_rank']}, a separate allocation")
    if record["budget_bytes"] is not None and max_loras is not None:
        what = "both pools" if ex is not None else "slots"
        table.add_row("budget", f"{human_bytes(record['budget_bytes'])} holds {max_loras:,} "
                      f"slots ({what} with their tables)")
    if max_loras is not None:
        table.add_row("pool", f"{max_loras} slots: {record['pool_bytes']:,} B "
                      f"({human_bytes(record['pool_bytes'])})")
        table.add_row("tables", f"{record['table_bytes']:,} B (A/B pointers, scales, ranks)")
        if ex is not None:
            table.add_row("expert pool", f"{ex['expert_pool_bytes']:,} B "
                          f"({human_bytes(ex['expert_pool_bytes'])}) + "
                          f"{ex['table_bytes']:,} B expert tables")
        if record["total_bytes"] is not None:
            table.add_row("total", f"{record['total_bytes']:,} B "
                          f"({human_bytes(record['total_bytes'])})")
    table.add_row("fingerprint", record["fingerprint"])
    if ex is not None:
        table.add_row("expert fingerprint", ex["fingerprint"])

    shares = record["shares"]
    total = sum(shares["module"].values()) or 1
    share_table = Table(header_style="bold", padding=(0, 1), box=box.SIMPLE_HEAD)
    share_table.add_column("share of a slot")
    share_table.add_column("bytes", justify="right")
    share_table.add_column("%", justify="right")
    for name, size in shares["module"].items():
        share_table.add_row(name, f"{size:,}", f"{100 * size / total:.1f}")
    for kind, size in shares["layer_kind"].items():
        share_table.add_row(f"[dim]{kind} layers", f"{size:,}", f"{100 * size / total:.1f}")
    parts: list[Any] = [table]
    if record["entries"]:
        parts.append(share_table)
    if ex is not None and ex["n_entries"]:
        ex_total = sum(ex["shares"].values()) or 1
        ex_table = Table(header_style="bold", padding=(0, 1), box=box.SIMPLE_HEAD)
        ex_table.add_column("share of an expert slot")
        ex_table.add_column("bytes", justify="right")
        ex_table.add_column("%", justify="right")
        for name, size in ex["shares"].items():
            ex_table.add_row(name, f"{size:,}", f"{100 * size / ex_total:.1f}")
        parts.append(ex_table)
    return Group(*parts)


def models_view(records: list[dict[str, Any]]) -> Table:
    """The presets, one row each, in 75 columns so every cell reads whole at 80."""
    table = Table(header_style="bold", padding=(0, 1, 0, 0), box=box.SIMPLE_HEAD,
                  show_edge=False, caption_justify="left",
                  caption="layers: full + linear attention; heads: query / key-value x head "
                          "dim; gated: q_proj holds the output gate (twice as wide); ffn: "
                          "dense width, or routed experts x expert width")
    for col in ("preset", "type", "layers", "hidden", "heads", "gated", "ffn"):
        table.add_column(col, no_wrap=True)
    for r in records:
        table.add_row(
            r["name"], r["model_type"],
            f"{r['full_attention_layers']}+{r['linear_attention_layers']}"
            if r["linear_attention_layers"] else str(r["num_hidden_layers"]),
            str(r["hidden_size"]),
            f"{r['num_attention_heads']}/{r['num_key_value_heads']}x{r['head_dim']}",
            "yes" if r["attn_gated"] else "no",
            f"{r['num_experts']}x{r['expert_intermediate_size']}" if r["num_experts"]
            else str(r["intermediate_size"]),
        )
    return table


def bench_pack_view(record: dict[str, Any]) -> Text:
    setup = record["setup"]
    within = "within" if record["rss_within_pool_plus_256mib"] else "OVER"
    copy = "a pinned host-to-device copy" if setup["device"] == "cuda" else "numpy.copyto"
    text = Text(
        f"{setup['adapters']} x {setup['model']} r={setup['rank']} {setup['dtype']} adapters, "
        f"{human_bytes(record['tensor_bytes'])} of tensors, into {setup['device']} memory\n"
        f"pack      {record['pack_gb_per_s']:.2f} GB/s = {100 * record['pack_vs_memcpy']:.0f}% "
        f"of {copy} ({record['memcpy_gb_per_s']:.2f} GB/s), same bytes, same run\n"
        f"NaN/Inf check: the pack takes {record['finite_check_cost']:.2f}x as long as "
        f"without it ({record['pack_unchecked_gb_per_s']:.2f} GB/s)\n"
        f"end to end `metrale pack`: {record['end_to_end_pack_gb_per_s']:.2f} GB/s "
        f"(fresh pool pages included), {record['end_to_end_wall_s']:.2f} s wall\n"
        f"peak RSS  {human_bytes(record['peak_rss_bytes'])} = pool "
        f"{human_bytes(record['pool_bytes'])} + "
        f"{human_bytes(record['peak_rss_minus_pool_bytes'])} ({within} pool + 256 MiB)")
    ex = record["experts"]
    if ex is not None:
        ex_within = "within" if ex["rss_within_pool_plus_256mib"] else "OVER"
        text.append(
            f"\nexperts   {ex['experts']} experts r={ex['rank']} F32 on one layer, "
            f"{human_bytes(ex['tensor_bytes'])} of tensors: peak RSS "
            f"{human_bytes(ex['peak_rss_bytes'])} = pools {human_bytes(ex['pool_bytes'])} + "
            f"{human_bytes(ex['peak_rss_minus_pool_bytes'])} ({ex_within} pool + 256 MiB)")
    for r in (record["tp"] or {}).get("ranks", []):
        text.append(f"\ntp rank {r['tp_rank']}: read {human_bytes(r['bytes_read'])} (its "
                    f"slices), pack {r['pack_gb_per_s']:.2f} GB/s = "
                    f"{100 * r['pack_vs_memcpy']:.0f}% of {copy}")
    return text


def kernel_line(record: dict[str, Any]) -> Text:
    """One `bench kernels` measurement on one line."""
    speedup = record["speedup_vs_torch"]
    return Text(
        f"{record['kernel']:<12} {record['module']:<9} r={record['rank']:<4} "
        f"T={record['tokens']:<5} D={record['adapters']:<5} "
        f"p50 {record['p50_us']:8.2f} us  {record['tb_per_s']:5.2f} TB/s "
        f"{record['pct_peak']:5.1f}% peak  {record['pct_copy']:5.1f}% of copy  "
        + (f"{speedup:5.2f}x {record['torch_best']}" if speedup else "no torch"))


def kernel_model_line(record: dict[str, Any]) -> Text:
    """One shape of the `bench kernels --model-only` roofline model on one line."""
    return Text(
        f"{record['kernel']:<16} {record['path']:<17} {record['module']:<8} "
        f"r{record['rank']:<3} T{record['tokens']:<4} D{record['adapters']:<4} "
        f"{record['ctas']:>5} CTAs {record['in_flight_per_sm_bytes'] / 1024:5.1f} KiB/SM "
        f"{record['expected_pct_peak']:5.1f}% peak {record['expected_copy_ratio']:4.2f}x copy "
        f"{'meets' if record['meets_target'] else 'MISSES'}")


def _expert_head(record: dict[str, Any]) -> str:
    return (f"{record['projection']:<8} {record['model']:<19} r{record['rank']:<3} "
            f"T{record['tokens']:<5} D{record['adapters']:<2} {record['path']:<7} ")


def expert_kernel_line(record: dict[str, Any]) -> Text:
    """One `bench kernels --experts` measurement on one line."""
    speedup = record["speedup_vs_torch"]
    return Text(
        _expert_head(record) + f"p50 {record['p50_us']:8.2f} us {record['tb_per_s']:5.2f} TB/s "
        f"{record['pct_peak']:5.1f}% peak {record['pct_copy']:5.1f}% of copy "
        + (f"{speedup:5.2f}x gather_bmm" if speedup else "no torch"))


def expert_model_line(record: dict[str, Any]) -> Text:
    """One shape and projection of the `bench kernels --experts --model-only` model."""
    return Text(
        _expert_head(record) + f"{record['bytes'] / 1e6:9.2f} MB {record['expected_us']:8.2f} us "
        f"{record['expected_pct_peak']:5.1f}% peak {record['expected_copy_ratio']:4.2f}x copy "
        f"{'meets' if record['meets_target'] else 'MISSES'}")


def pack_view(result: Any) -> Group:
    layout = result.pool.layout
    table = Table(header_style="bold", padding=(0, 1), box=box.SIMPLE_HEAD)
    for col in ("slot", "name", "rank", "alpha", "scale", "pinned", "source"):
        table.add_column(col)
    for s in result.pool.slot_records():
        if s["name"]:
            table.add_row(str(s["slot"]), escape(s["name"]), str(s["rank"]), _fmt(s["alpha"]),
                          f"{s['scaling']:.6g}", "yes" if s["pinned"] else "",
                          escape(s["source"]))
    empty = result.pool.max_loras - len(result.pool.manager.adapter_names())
    rate = result.bytes_read / result.pack_seconds / 1e9 if result.pack_seconds else 0.0
    lines = [
        f"pool: {result.pool.max_loras} slots x {layout.slot_bytes:,} B = "
        f"{human_bytes(layout.pool_bytes(result.pool.max_loras))} on {result.pool.device}, "
        f"max rank {layout.max_rank}, {len(layout.entries)} entries, {empty} empty cache slots",
        f"packed {human_bytes(result.bytes_read)} of adapter tensors in "
        f"{result.pack_seconds:.3f} s ({rate:.2f} GB/s)",
    ]
    ex = result.pool.expert_layout
    if ex is not None:
        ex_bytes = human_bytes(ex.pool_bytes(result.pool.max_loras))
        lines.insert(1, f"expert pool: {result.pool.max_loras} expert slots x "
                     f"{ex.slot_bytes:,} B = {ex_bytes}, {len(ex.entries):,} "
                     f"(layer, projection, expert) entries, max rank {ex.max_rank}")
    overlays = sum(raw.count for raw in result.pool.overlay_raw if raw is not None)
    if overlays:
        lines.insert(1, f"token overlays: {overlays} rows")
    if result.image is not None:
        lines.append(f"wrote {result.image} ({human_bytes(result.image_bytes)}) in "
                     f"{result.write_seconds:.3f} s; layout fingerprint {layout.fingerprint}")
    return Group(table, *(Text(line) for line in lines))


def _rank_span(ranks: list[int]) -> str:
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 1:
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def sharded_layout_view(record: dict[str, Any]) -> Group:
    """`metrale layout --tp N`: the unsharded slot, then per GPU each distinct rank layout
    (`ShardedPlan.record`)."""
    unsharded = layout_view(record, per_gpu=True)
    table = Table.grid(padding=(0, 2))
    table.add_column(style="dim")
    table.add_column()
    mode = (f"tp {record['tp_size']}, ep {record['ep_size']} (MoE TP "
            f"{record['tp_size'] // record['ep_size']})"
            + (", fully sharded" if record["fully_sharded"] else ""))
    table.add_row("deployment", mode)
    slot, max_loras = record["slot_bytes"], record["max_loras"]
    if record["budget_bytes"] is not None and max_loras is not None:
        table.add_row("budget", f"{human_bytes(record['budget_bytes'])} per GPU holds "
                      f"{max_loras:,} slots on every rank")
    for group in record["rank_layouts"]:
        share = f", {100 * group['slot_bytes'] / slot:.0f}% of the unsharded slot" if slot else ""
        table.add_row(_rank_span(group["ranks"]),
                      f"slot {group['slot_bytes']:,} B ({human_bytes(group['slot_bytes'])}) "
                      f"per GPU{share}")
        if group["expert_slot_bytes"] is not None:
            table.add_row("", f"expert slot {group['expert_slot_bytes']:,} B "
                          f"({human_bytes(group['expert_slot_bytes'])}) per GPU")
        if max_loras is not None and group["total_bytes"] is not None:
            table.add_row("", f"{max_loras} slots: {group['total_bytes']:,} B "
                          f"({human_bytes(group['total_bytes'])}) per GPU with tables")
        for k, fingerprint in zip(group["ranks"], group["fingerprints"], strict=True):
            table.add_row("", f"rank {k} fingerprint {fingerprint}")
    return Group(unsharded, Text(""), table)


def sharded_pack_view(record: dict[str, Any]) -> Group:
    """`metrale pack --tp N`: one line per rank image."""
    mode = f"tp {record['tp_size']}, ep {record['ep_size']}" + (
        ", fully sharded" if record["fully_sharded"] else "")
    table = Table(header_style="bold", padding=(0, 1), box=box.SIMPLE_HEAD)
    for col in ("rank", "slot bytes", "read", "GB/s", "layout fingerprint"):
        table.add_column(col, justify="right" if col in ("slot bytes", "read", "GB/s") else "left",
                         no_wrap=True)
    for r in record["ranks"]:
        rate = r["pack_gb_per_s"]
        table.add_row(str(r["shard"]["tp_rank"]), f"{r['layout']['slot_bytes']:,}",
                      human_bytes(r["bytes_read"]), f"{rate:.2f}" if rate else "-",
                      r["layout"]["fingerprint"])
    n = len(record["ranks"])
    where = (f", written to {Path(record['out']) / f'rank-{{k}}-of-{n}.safetensors'}"
             if record["out"] else "")
    return Group(Text(f"{mode}: {n} rank pools{where}"), table)


def human_seconds(seconds: float) -> str:
    """A duration with its unit, at most 8 characters: 0.62 ms, 5.2 s, 2.5 h."""
    if seconds == 0:
        return "0"
    for limit, scale, unit in ((1e-3, 1e6, "us"), (1.0, 1e3, "ms"), (120.0, 1.0, "s"),
                               (7200.0, 1 / 60, "min")):
        if seconds < limit:
            value = seconds * scale
            return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"
    return f"{seconds / 3600:,.1f} h"


def simulate_view(record: dict[str, Any]) -> Group:
    """`metrale simulate`: the setup, a row per (policy, size), and the sizing answer."""
    w, swap, lay = record["workload"], record["swap"], record["layout"]
    head = Table.grid(padding=(0, 2))
    head.add_column(style="dim")
    head.add_column()
    made = (f"trace {w['path']}" if w["kind"] == "trace" else
            f"{w['kind']} generator, seed {w['seed']}, {w['rate']:g} req/s, cv {w['cv']:g}")
    head.add_row("workload", f"{made}: {w['requests']:,} requests "
                 f"({w['adapter_requests']:,} to adapters) over {w['span_s']:,.1f} s, "
                 f"{w['distinct_adapters']:,} distinct adapters")
    if record["mode"] == "paging":
        head.add_row("mode", "exact paging: zero-length requests, served one at a time in order")
    else:
        seats = record["max_concurrency"]
        head.add_row("mode", "concurrent: requests hold their slot from admission to "
                     f"completion ({record['prefill_tok_s']:g} prefill / "
                     f"{record['decode_tok_s']:g} decode tok/s), "
                     + (f"at most {seats} in flight" if seats else "no concurrency cap"))
    per_gpu = f" per GPU at --tp {lay['tp_size']}" if "tp_size" in lay else ""
    head.add_row("slot", f"{human_bytes(swap['slot_bytes'])}{per_gpu} ({lay['model']}, "
                 f"{len(lay['modules'])} module{'s' if len(lay['modules']) != 1 else ''}, "
                 f"max rank {lay['max_rank']})")
    links = swap["links"]
    head.add_row("swap", f"{human_seconds(swap['swap_s'])} per load at {swap['bandwidth']} "
                 f"({swap['bytes_per_s'] / 1e9:g} GB/s + {1e6 * swap['latency_s']:g} us), "
                 + ("one load at a time per GPU" if links == 1 else f"{links} loads at a time "
                    "per GPU"))
    if record["host"]:
        host = record["host"]
        head.add_row("host", f"{host['slots']:,} adapters in host memory (an LRU, up to "
                     f"{human_bytes(host['host_bytes'])}); a host miss reads over "
                     f"{host['bandwidth']} ({host['bytes_per_s'] / 1e9:g} GB/s + "
                     f"{1e6 * host['latency_s']:g} us)")
    if record["admission"] == "skip":
        head.add_row("admission", "skip: a request whose adapter cannot be placed waits while "
                     "later ones whose adapter is resident (or loading) go ahead")
    if record["routing"]:
        routing = record["routing"]
        head.add_row("replicas", f"{routing['replicas']}, {routing['route']} routing: each "
                     "replica has its own pool of each size below (pool GiB per replica); the "
                     "figures are totals")
    if w.get("adapter_ranks"):
        head.add_row("ranks", ", ".join(f"{n:,} at rank {r}" for r, n in
                                        w["adapter_ranks"].items())
                     + f": a load moves rank/{lay['max_rank']} of a slot")
    if record["pinned"]:
        head.add_row("pinned", f"{len(record['pinned'])}: {', '.join(record['pinned'][:8])}"
                     + (" ..." if len(record["pinned"]) > 8 else ""))
    # Headers wrap onto two lines; cells never do, so 80 columns hold every figure.
    table = Table(padding=(0, 1), collapse_padding=True, pad_edge=False, box=box.SIMPLE_HEAD)
    with_min = "min" in record["policies"]
    for name in ("policy", "slots", "hit %", "misses", "stalls", "stall\np99", "added\np50",
                 "added\np99", *(["misses\nvs min"] if with_min else []), "pool\nGiB"):
        table.add_column(name, justify="left" if name == "policy" else "right", no_wrap=True,
                         header_style="bold")
    previous = None
    for r in record["results"]:
        if previous is not None and r["policy"] != previous:
            table.add_section()
        previous = r["policy"]
        gap = r["extra_misses_vs_min"]
        vs_min = ["-" if gap is None or r["policy"] == "min" else f"+{gap:,}"] if with_min else []
        pool = f"{r['pool_bytes'] / 2**30:,.2f}"
        if r["fits_budget"] is False:
            pool = f"[red]{pool}"
        table.add_row(
            r["policy"], str(r["max_loras"]), f"{100 * r['hit_rate']:.2f}", f"{r['misses']:,}",
            f"{r['stalls']:,}", human_seconds(r["stall_p99_s"]) if r["stalls"] else "-",
            human_seconds(r["added_latency_p50_s"]), human_seconds(r["added_latency_p99_s"]),
            *vs_min, pool)
    parts: list[Any] = [head, table]
    for extra in (_loads_table(record), _serving_table(record), _spread_table(record),
                  _max_rank_table(record)):
        if extra is not None:
            parts.append(extra)
    if record["targets"]:
        t = record["targets"]
        want = " and ".join(x for x in (
            f"hit rate >= {100 * t['hit_rate']:g}%" if t["hit_rate"] is not None else "",
            f"p99 added latency <= {t['p99_ms']:g} ms" if t["p99_ms"] is not None else "") if x)
        for s in record["smallest_meeting"]:
            if s["max_loras"] is None:
                line = (f"{s['policy']}: no size in {record['sizes'][0]}..{record['sizes'][-1]}"
                        f" reaches {want}")
            else:
                line = (f"{s['policy']}: {s['max_loras']} slots and every larger size reach "
                        f"{want}: {human_bytes(s['pool_bytes'])} of pool")
                if s["fits_budget"] is not None:
                    fits = "fits" if s["fits_budget"] else "does NOT fit"
                    line += f", {fits} the {human_bytes(record['budget_bytes'])} budget"
            parts.append(Text(line))
            if s["first_meeting"] is not None and s["first_meeting"] != s["max_loras"]:
                parts.append(Text(f"  not monotonic: {s['first_meeting']} slots meet it, a "
                                  "larger size does not"))
            elif not s["monotonic"]:
                parts.append(Text("  not monotonic: more slots do worse somewhere"))
    return Group(*parts)


def _loads_table(record: dict[str, Any]) -> Table | None:
    """Where loads came from, beside the main table (which 80 columns must hold): delayed hits
    (requests that waited for another's load), and with a host tier its hits and disk reads."""
    delayed = any(r["delayed_hits"] for r in record["results"])
    tiered = record["host"] is not None
    replicated = record["routing"] is not None
    if not delayed and not tiered and not replicated:
        return None
    table = Table(padding=(0, 1), collapse_padding=True, pad_edge=False, box=box.SIMPLE_HEAD)
    names = ["policy", "slots", "delayed\nhits", "GiB\nto GPU", "link\nwait"]
    if tiered:
        names += ["from\nhost", "from\ndisk", "GiB\nfrom disk"]
    if replicated:
        names += ["hit % by\nreplica"]
    for name in names:
        table.add_column(name, justify="left" if name == "policy" else "right", no_wrap=True,
                         header_style="bold")
    previous = None
    for r in record["results"]:
        if previous is not None and r["policy"] != previous:
            table.add_section()
        previous = r["policy"]
        row = [r["policy"], str(r["max_loras"]), f"{r['delayed_hits']:,}",
               f"{r['bytes_moved'] / 2**30:,.2f}", human_seconds(r["link_wait_s"])]
        if tiered:
            row += [f"{r['host_hits']:,}", f"{r['host_misses']:,}",
                    f"{r['host_bytes_moved'] / 2**30:,.2f}"]
        if replicated:
            row.append(" ".join(f"{100 * x['hit_rate']:.1f}" for x in r["replicas"]))
        table.add_row(*row)
    return table


def _serving_table(record: dict[str, Any]) -> Table | None:
    """Concurrent mode: time to first token, adapter requests apart from base-model ones, and
    throughput per result."""
    if record["mode"] != "concurrent":
        return None
    table = Table(padding=(0, 1), collapse_padding=True, pad_edge=False, box=box.SIMPLE_HEAD)
    for name in ("policy", "slots", "TTFT p50\nadapter", "TTFT p99\nadapter", "TTFT p50\nbase",
                 "TTFT p99\nbase", "req/s"):
        table.add_column(name, justify="left" if name == "policy" else "right", no_wrap=True,
                         header_style="bold")

    def seconds(x: float | None) -> str:
        return "-" if x is None else human_seconds(x)

    previous = None
    for r in record["results"]:
        if previous is not None and r["policy"] != previous:
            table.add_section()
        previous = r["policy"]
        table.add_row(r["policy"], str(r["max_loras"]), seconds(r["ttft_adapter_p50_s"]),
                      seconds(r["ttft_adapter_p99_s"]), seconds(r["ttft_base_p50_s"]),
                      seconds(r["ttft_base_p99_s"]), f"{r['throughput_req_s']:,.2f}")
    return table


def _max_rank_table(record: dict[str, Any]) -> Table | None:
    """Adapters of their own ranks: per lower max rank, the slot, the slots a --budget holds,
    and who is shut out."""
    options = record["max_rank_options"]
    if not options:
        return None
    budget = record["budget_bytes"]
    table = Table(padding=(0, 1), collapse_padding=True, pad_edge=False, box=box.SIMPLE_HEAD,
                  title="a lower max rank: smaller slots, and the adapters above it shut out",
                  title_justify="left")
    names = ["max rank", "slot", *(["slots in\nbudget"] if budget is not None else []),
             "adapters\nshut out", "requests\nshut out"]
    for name in names:
        table.add_column(name, justify="right", no_wrap=True, header_style="bold")
    requests = record["workload"]["adapter_requests"] or 1
    for o in options:
        out = o["requests_shut_out"]
        table.add_row(str(o["max_rank"]), human_bytes(o["slot_bytes"] + o["expert_slot_bytes"]),
                      *([f"{o['slots_in_budget']:,}"] if budget is not None else []),
                      f"{o['adapters_shut_out']:,}", f"{out:,} ({100 * out / requests:.1f}%)")
    return table


def _spread_table(record: dict[str, Any]) -> Table | None:
    """With --seeds: each result's hit rate, misses and p99 added latency as min/median/max over
    the seeds."""
    if not record["seeds"]:
        return None
    seeds = record["seeds"]
    table = Table(padding=(0, 1), collapse_padding=True, pad_edge=False, box=box.SIMPLE_HEAD,
                  title=f"over {len(seeds)} seeds ({seeds[0]}..{seeds[-1]}): min/median/max",
                  title_justify="left")
    for name in ("policy", "slots", "hit %", "misses", "added p99"):
        table.add_column(name, justify="left" if name == "policy" else "right", no_wrap=True,
                         header_style="bold")
    previous = None
    for r in record["results"]:
        if previous is not None and r["policy"] != previous:
            table.add_section()
        previous = r["policy"]
        spread = r["spread"]
        hit, miss, p99 = spread["hit_rate"], spread["misses"], spread["added_latency_p99_s"]
        table.add_row(
            r["policy"], str(r["max_loras"]),
            "/".join(f"{100 * hit[k]:.2f}" for k in ("min", "median", "max")),
            "/".join(f"{miss[k]:,.0f}" for k in ("min", "median", "max")),
            "/".join(human_seconds(p99[k]) for k in ("min", "median", "max")))
    return table


def bench_slots_view(record: dict[str, Any]) -> Text:
    """`metrale bench slots`: per-size figures and the 4096/64 ratios (1.0 = flat)."""
    lo, hi = (str(n) for n in record["setup"]["sizes"])
    victim, scan = record["victim_cycle_ns"], record["scan_ns"]
    lines = [
        f"victim choice + reload, lru: {victim[lo] / 1e3:.2f} us at {lo} slots, "
        f"{victim[hi] / 1e3:.2f} us at {hi}: x{record['victim_cycle_ratio']:.2f}",
        f"  full scan (the former pool): {scan[lo] / 1e3:.2f} us at {lo}, "
        f"{scan[hi] / 1e3:.2f} us at {hi}: x{record['scan_ratio']:.1f}",
    ]
    for mode in ("paging", "concurrent"):
        rps, ratio = record[f"simulate_{mode}_req_per_s"], record[f"simulate_{mode}_cost_ratio"]
        lines.append(
            f"simulate, {mode}, every request a miss: {rps[lo]:,.0f} req/s at {lo} slots, "
            f"{rps[hi]:,.0f} at {hi}: cost per request x{ratio:.2f}")
    sweep = record["lru_sweep"]
    lines.append(f"lru sweep, paging, {sweep['sizes']:,} sizes over {sweep['adapters']:,} "
                 f"adapters: {sweep['sweep_s']:.2f} s in one pass, {sweep['replay_s']:.2f} s "
                 f"per size replayed: x{sweep['speedup']:,.0f}")
    return Text("\n".join(lines))


def show_view(record: dict[str, Any]) -> Group:
    """`metrale show`: the image's record (see image.show.ImageShow)."""
    lay, ex = record["layout"], record["experts"]
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="dim")
    grid.add_column(overflow="fold")  # a long path folds rather than losing its end
    grid.add_row("image", f"{record['path']} ({record['format']}, consistent)")
    grid.add_row("model", model_line(record["model"]))
    grid.add_row("layout", f"max rank {lay['max_rank']}, {lay['entries']} entries "
                 f"({', '.join(lay['modules']) or 'no modules'}), slot {lay['slot_bytes']:,} B, "
                 f"{lay['max_loras']} slots")
    grid.add_row("fingerprint", lay["fingerprint"])
    if ex is not None:
        grid.add_row("experts", f"max rank {ex['max_rank']}, {ex['entries']:,} entries on "
                     f"layers {layer_set(ex['layers'])}, expert slot {ex['expert_slot_bytes']:,} B")
        grid.add_row("expert fingerprint", ex["fingerprint"])
    grid.add_row("active", f"slot {record['active']}")
    free = record["free_slots"]
    grid.add_row("free slots", ", ".join(map(str, free)) if free else "none")
    # Figures never wrap; a long name or overlay list folds onto more lines, so every header and
    # cell reads whole at 80 columns (the headers alone take 63).
    table = Table(header_style="bold", padding=(0, 1, 0, 0), box=box.SIMPLE_HEAD,
                  show_edge=False)
    for col in ("slot", "name", "gen", "rank", "alpha", "scale", "pinned", "entries", "experts",
                "overlays"):
        table.add_column(col, no_wrap=col not in ("name", "overlays"),
                         overflow="fold" if col == "name" else "ellipsis",
                         min_width=len(col))
    sources = Table.grid(padding=(0, 2))
    sources.add_column(style="dim")
    sources.add_column(overflow="fold")
    for s in record["slots"]:
        if not s["name"]:
            continue
        overlays = ", ".join(f"{o['table']} {o['tokens']}" for o in s["overlays"])
        table.add_row(str(s["slot"]), s["name"], str(s["generation"]), str(s["rank"]),
                      _fmt(s["alpha"]), f"{s['scale']:.6g}", "yes" if s["pinned"] else "",
                      str(s["entries"]), str(s["expert_entries"] or "·"), overlays or "·")
        sources.add_row(f"slot {s['slot']} source", s["source"])
    sizes = Table(header_style="bold", padding=(0, 1), box=box.SIMPLE_HEAD)
    sizes.add_column("part")
    sizes.add_column("bytes", justify="right")
    sizes.add_column("", justify="right")
    for part, n in record["bytes"].items():
        if n or part in ("pool", "total"):
            sizes.add_row(part, f"{n:,}", human_bytes(n))
    return Group(grid, Text(), table, Text(), sources, sizes)


def synth_view(record: dict[str, Any]) -> Text:
    """`metrale synth`: what was written (`SynthResult.record`)."""
    return Text(f"wrote {record['path']}: {record['tensors']} tensors, "
                f"{human_bytes(record['bytes'])}")


def unpack_view(record: dict[str, Any]) -> Text:
    """`metrale unpack`: the adapter written from a slot (`UnpackResult.record`)."""
    overlays = (f", trainable tokens for {', '.join(record['overlays'])}"
                if record["overlays"] else "")
    return Text(f"wrote {record['path']}: slot {record['slot']} ({record['name']}), "
                f"{record['modules']} modules at r={record['r']} "
                f"lora_alpha={record['lora_alpha']:g}{overlays}, {human_bytes(record['bytes'])}")


# Differing regions listed per adapter; --json has them all.
VERIFY_ROWS = 20


def verify_view(record: dict[str, Any]) -> Group:
    """`metrale verify`: per adapter ok or what differs (see verify.VerifyResult)."""
    lines: list[Any] = []
    for a in record["adapters"]:
        head = Text(f"slot {a['slot']} {a['name']}: ", style="bold")
        if a["ok"]:
            head.append("ok", style="bold green")
            head.append(f" ({a['entries']} entries"
                        + (f", {a['expert_entries']} expert entries" if a["expert_entries"]
                           else "") + f", {human_bytes(a['bytes_compared'])} compared)")
            lines.append(head)
            continue
        head.append("DIFFERS", style="bold red")
        lines.append(head)
        for line in a["slot_differences"]:
            lines.append(Text(f"  {line}"))
        if a["differences"]:
            table = Table(header_style="bold", padding=(0, 1), box=box.SIMPLE_HEAD)
            for col in ("layer", "module", "part", "bytes differing", "max |dW diff|", "note"):
                table.add_column(col, no_wrap=col != "note")
            shown = a["differences"][:VERIFY_ROWS]
            for d in shown:
                diff = d["max_delta_difference"]
                table.add_row(str(d["layer"]), d["module"], d["part"],
                              f"{d['bytes_differing']:,}",
                              f"{diff:.4g}" if diff is not None else "-", d["note"])
            lines.append(table)
            if len(a["differences"]) > len(shown):
                lines.append(Text(f"  ... and {len(a['differences']) - len(shown)} more "
                                  "(--json lists every one)", style="dim"))
    for u in record["unchecked"]:
        lines.append(Text(f"slot {u['slot']} {u['name']}: unchecked (not given)", style="dim"))
    rate = record["gb_per_s"]
    lines.append(Text(f"compared {human_bytes(record['bytes_compared'])} of the image in "
                      f"{record['seconds']:.3f} s"
                      + (f" ({rate:.2f} GB/s)" if rate is not None else "")))
    return Group(*lines)


# -- --engine vllm ------------------------------------------------------------------------------

VERDICT_STYLE = {"serves": "bold green", "differs": "bold yellow", "ignores": "bold yellow",
                 "refuses": "bold red", "crashes": "bold red", "unsupported_model": "bold red"}


def engine_inspect_view(record: dict[str, Any]) -> Group:
    """`metrale inspect --engine vllm`: its record, a panel per adapter with vLLM's verdict and
    modules, then the recommended flags and a ready `vllm serve`."""
    engine = record["engine"]
    parts: list[Any] = [Text(model_line(record["model"]), style="bold"),
                        Text(f"vLLM {engine['version']} (GPU build), flags "
                             f"{engine['flags_source']}: {_flag_line(engine['flags'])}",
                             style="dim")]
    for adapter in record["adapters"]:
        v = adapter["engine"]
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="dim")
        grid.add_column()
        grid.add_row("verdict", Text(v["verdict"], style=VERDICT_STYLE[v["verdict"]]))
        grid.add_row("reason", escape(v["reason"]))
        for where, other in v["elsewhere"].items():
            label = {"offline": "offline LLM", "cpu_build": "CPU build"}.get(where, where)
            grid.add_row(label, escape(f"{other['verdict']}: {other['reason']}"))
        body: list[Any] = [grid]
        if v["modules"]:
            table = Table(header_style="bold", padding=(0, 1), box=box.SIMPLE_HEAD)
            for column in ("module", "vLLM module", "layers", "served"):
                table.add_column(column)
            for m in v["modules"]:
                table.add_row(m["module"], m["engine_module"] or "-",
                              m["layer_ranges"] if m["layers"] else "-",
                              "yes" if m["served"] else escape(f"no: {m['why']}"))
            body.append(table)
        parts.append(Panel(Group(*body), title=escape(adapter["name"]), title_align="left"))
    rec = engine["recommended"]
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="dim")
    grid.add_column()
    grid.add_row("recommended", _flag_line(rec["flags"]))
    grid.add_row("serve", escape(rec["serve"]))
    grid.add_row("LoRA memory", f"{rec['lora_bytes']:,} B ({human_bytes(rec['lora_bytes'])}) "
                 f"per GPU, {rec['slot_bytes']:,} B a slot; host cache "
                 f"{human_bytes(rec['host_cache_bytes'])}")
    for pad in rec["padding"]:
        grid.add_row("padding", f"{escape(pad['adapter'])} leaves {pad['unused_bytes']:,} B "
                     f"({pad['unused_share']:.1%}) of its slot unused")
    lower = rec["lower_max_rank"]
    if lower is not None:
        grid.add_row("lower rank", f"--max-lora-rank {lower['max_lora_rank']} frees "
                     f"{human_bytes(lower['frees_bytes'])} and shuts out "
                     f"{escape(', '.join(lower['shuts_out'])) or 'no adapter'}")
    if rec["fully_sharded_saves_bytes"]:
        grid.add_row("fully sharded", f"--fully-sharded-loras saves "
                     f"{human_bytes(rec['fully_sharded_saves_bytes'])} per GPU")
    for line in rec["shut_out"]:
        grid.add_row("left out", escape(line))
    parts.append(grid)
    return Group(*parts)


def _flag_line(flags: dict[str, Any]) -> str:
    targets = flags.get("lora_target_modules")
    return (f"max_lora_rank {flags['max_lora_rank']}, max_loras {flags['max_loras']}, "
            f"max_cpu_loras {flags['max_cpu_loras']}, tp {flags['tensor_parallel_size']}"
            f"{', fully sharded' if flags['fully_sharded_loras'] else ''}, "
            f"lora_dtype {flags['lora_dtype']}, target modules "
            f"{', '.join(targets) if targets else 'all'}")


def engine_layout_view(record: dict[str, Any]) -> Group:
    """`metrale layout --engine vllm`: one GPU's vLLM LoRA buffers, as `layout` shows the
    pool, from its record."""
    rec = record["engine"]
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="dim")
    grid.add_column()
    grid.add_row("model", escape(model_line(record["model"])))
    grid.add_row("engine", f"vLLM {rec['version']} (GPU build)")
    grid.add_row("flags", _flag_line(rec["flags"]))
    grid.add_row("LoRA buffers", f"{rec['lora_bytes']:,} B ({human_bytes(rec['lora_bytes'])}) "
                 "per GPU")
    grid.add_row("slot", f"{rec['slot_bytes']:,} B ({human_bytes(rec['slot_bytes'])}) per "
                 "adapter slot")
    grid.add_row("host cache", f"{rec['host_cache_bytes']:,} B "
                 f"({human_bytes(rec['host_cache_bytes'])}) for "
                 f"{rec['flags']['max_cpu_loras']} adapters, per TP worker")
    if "budget_bytes" in rec:
        grid.add_row("budget", f"{human_bytes(rec['budget_bytes'])} holds "
                     f"{rec['max_loras_fit']:,} --max-loras")
    table = Table(header_style="bold", padding=(0, 1), box=box.SIMPLE_HEAD)
    for column, justify in (("module", "left"), ("kind", "left"), ("layers", "right"),
                            ("bytes", "right"), ("%", "right")):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    total = rec["lora_bytes"] or 1
    for m in rec["modules"]:
        table.add_row(m["module"], m["kind"], str(m["layers"] or "-"), f"{m['bytes']:,}",
                      f"{100 * m['bytes'] / total:.1f}")
    return Group(grid, Text(""), table)
