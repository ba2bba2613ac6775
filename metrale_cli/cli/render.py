"""Rich views of the core's records. `--json` prints the records themselves; these are the other
view. Nothing here computes what it shows.

Every string that comes from input (a path, an adapter or tensor name, a finding that quotes one)
is escaped before Rich reads it as markup: `[/]` in a directory name must not crash a view, and
`[bold red]evil` must show as typed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Group
from rich.markup import escape
from rich.measure import Measurement
from rich.panel import Panel
from rich.segment import Segment
from rich.table import Table
from rich.text import Text

from metrale_cli.adapters.findings import Severity, layer_ranges

SEVERITY_STYLE = {Severity.ERROR.value: "bold red", Severity.WARNING.value: "yellow",
                  Severity.INFO.value: "cyan"}


def whole(line: str, style: str = "") -> Text:
    """A line that is never folded at the terminal's width (console.print_view prints it
    uncropped): a fingerprint, a path or a number with its unit stays on the line a user
    greps for. Plain text: input in it is never read as markup."""
    return Text(line, style=style, no_wrap=True, overflow="ignore")


class Fields:
    """`key  value` lines, keys dim and aligned, each value wrapped to the terminal's width onto
    lines indented to its column: after a `; ` in the line's second half or a `, ` in its last
    quarter, else at a space, never inside a word nor between a number and what follows it
    (`6,656 B`); a word longer than the line stays whole. A value that is a `whole` Text (a
    command to paste, a path) stays on one line, which the terminal wraps. A value is plain text
    (no markup: input-derived text needs no escaping), or a styled Text."""

    def __init__(self, rows: list[tuple[str, str | Text]], style: str = "",
                 hang: int = 0) -> None:
        self.rows = rows
        self.style = style
        self.hang = hang  # continuation lines' indent beyond the value's column

    def __rich_console__(self, console: Any, options: Any) -> Any:
        width = max((len(key) for key, _ in self.rows), default=0)
        indent = (width + 2 if width else 0) + self.hang
        for key, value in self.rows:
            text = value if isinstance(value, Text) else Text(value)
            line = Text(no_wrap=True, overflow="ignore", style=self.style)
            if width:
                line.append(key.ljust(width) + "  ", style="dim")
            if text.no_wrap:
                yield line.append_text(text)
                continue
            first = max(20, options.max_width - indent + self.hang)
            pieces = [piece for part in text.split("\n")  # a value's own lines, each wrapped
                      for piece in part.divide(_breaks(part.plain, first, first - self.hang))]
            for i, piece in enumerate(pieces):
                piece.rstrip()
                yield (line if i == 0 else Text(" " * indent, no_wrap=True, overflow="ignore",
                                                style=self.style)).append_text(piece)


def _breaks(plain: str, first: int, width: int) -> list[int]:
    """Where `Fields` breaks `plain` into a line of at most `first` characters, then lines of
    at most `width`."""
    breaks, start, limit = [], 0, first
    while len(plain) - start > limit:
        window = plain[start:start + limit + 1]
        # Between clauses, or list items, unless that leaves the line short.
        cut = max(window.rfind("; ") if window.rfind("; ") >= limit // 2 else -1,
                  window.rfind(", ") if window.rfind(", ") >= limit * 3 // 4 else -1)
        if cut >= 0:
            cut += 2
        else:  # the last space not after a digit (`6,656 B` stays together)
            cut = next((i + 1 for i in range(len(window) - 1, 0, -1)
                        if window[i] == " " and not window[i - 1].isdigit()), 0)
        if cut <= 0:  # no place to break within the line: after the word it starts with
            cut = plain.find(" ", start + limit + 1) + 1 - start
            if cut <= 0:
                break
        start += cut
        breaks.append(start)
        limit = width
    return breaks


class Fitted:
    """`wide` (a table) where the terminal holds `least` (that table with its folding cells
    blank: the narrowest it reads at with every column and every other cell whole) and every
    line of `wide` as Rich lays it out, else `narrow(width)`, the same cells as lines that fit
    `width` columns. Rich fits a table to a narrow width by dropping the columns that do not
    fit, or runs past it where its cells cannot fold: a figure was lost or ran wide."""

    def __init__(self, wide: Any, least: Any, narrow: Callable[[int], Any]) -> None:
        self.wide, self.least, self.narrow = wide, least, narrow

    def __rich_console__(self, console: Any, options: Any) -> Any:
        width = options.max_width
        fits = (Measurement.get(console, options.update(width=10**6), self.least).minimum
                <= width and all(Segment.get_line_length(line) <= width for line in
                                 Segment.split_lines(console.render(self.wide, options))))
        yield self.wide if fits else self.narrow(width)


def fields(rows: list[tuple[str, str | Text]]) -> Fields:
    """`key  value` lines, wrapped as `Fields` wraps them."""
    return Fields(rows)


def wrapped(line: str, style: str = "") -> Fields:
    """One line of text, wrapped as a `Fields` value is, its continuation lines indented."""
    return Fields([("", line)], style, hang=2)


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
    # nemotron_h's blocks without attention (mlp, moe) beside its Mamba-2 and attention ones.
    blocks = sum(t in ("mlp", "moe") for t in model["layer_types"])
    kinds = (
        f"{model['full_attention_layers']} full-attention + "
        f"{model['linear_attention_layers']} linear-attention "
        + (f"+ {blocks} MLP or MoE " if blocks else "") + "layers"
        if model["linear_attention_layers"]
        else f"{model['num_hidden_layers']} layers"
    )
    experts = f", {model['num_experts']} routed experts" if model["num_experts"] else ""
    # Said where weights were read; the config alone (every preset) keeps the line it had.
    shapes = (f"; shapes from the {model['shapes_from']}"
              if model["shapes_from"] != "config" else "")
    return (f"{model['source'] or model['model_type']} ({model['model_type']}): "
            f"{kinds}{experts}{shapes}")


def inspect_view(record: dict[str, Any]) -> Group:
    """`metrale inspect`: the audit's record (`AuditedAdapters.record`), a panel per adapter."""
    parts: list[Any] = [wrapped(model_line(record["model"]), style="bold")]
    pool = record.get("pool_slot")
    if pool is not None:
        # The one answer to "how big is a slot": layout, pack and show give the same figure.
        parts.append(fields([
            ("slot size", f"{pool['slot_bytes']:,} B ({human_bytes(pool['slot_bytes'])}) in a "
                          "pool of these adapters, as layout, pack and show say"),
            ("", f"{', '.join(pool['modules'])} at max rank {pool['max_rank']}")]))
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
    if a["own_slot_max_rank"] is not None:
        # The slot of a pool of this adapter alone; the pool's slot is the line above the panels.
        summary.add_row(
            "own slot",
            f"{human_bytes(a['own_slot_bytes'])} ({a['own_slot_bytes']:,} B) at rank "
            f"{a['own_slot_max_rank']}: {a['own_slot_rank_reason']}",
        )
    if a["expert_pairs"]:
        summary.add_row("experts", f"{a['expert_pairs']} (layer, projection, expert) "
                        f"pairs on layers {layer_set(a['expert_layers'])}, ranks "
                        f"{', '.join(map(str, a['expert_ranks']))}")
    if a["own_expert_slot_max_rank"] is not None:
        summary.add_row(
            "own expert slot",
            f"{human_bytes(a['own_expert_slot_bytes'])} "
            f"({a['own_expert_slot_bytes']:,} B) at rank {a['own_expert_slot_max_rank']}: "
            f"{a['own_expert_slot_rank_reason']}; in the expert pool beside the slot pool")
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
    # `--modules all` names every module metrale knows: list those with an entry in this model,
    # and name the rest as absent rather than as if the slot held them.
    present = {e["module"] for e in record["entries"]}
    absent = [m for m in record["modules"] if m not in present]
    modules = ", ".join(m for m in record["modules"] if m in present) or "-"
    if absent:
        modules += f" ({', '.join(absent)}: not in this model)"
    # Under --tp a GPU holds a shard of this slot (its size is below): say which this is.
    whole_slot = ", unsharded (each GPU's shard below)" if per_gpu else ""
    rows = [
        ("model", model_line(record["model"])),
        ("modules", modules),
        ("max rank", str(record["max_rank"])),
        ("entries", f"{len(record['entries'])} (layer, module) pairs"),
        ("slot", f"{record['slot_bytes']:,} B ({human_bytes(record['slot_bytes'])}), "
                 f"{record['align']}-byte aligned {record['dtype']}{whole_slot}"),
    ]
    if ex is not None:
        rows.append(("expert slot", f"{ex['expert_slot_bytes']:,} B "
                     f"({human_bytes(ex['expert_slot_bytes'])}), {ex['n_entries']:,} (layer, "
                     f"projection, expert) entries on {len(ex['layers'])} "
                     f"layers at rank {ex['max_rank']}, a separate allocation{whole_slot}"))
    if record["budget_bytes"] is not None and max_loras is not None:
        what = "both pools" if ex is not None else "slots"
        rows.append(("budget", f"{human_bytes(record['budget_bytes'])} holds {max_loras:,} "
                     f"slots ({what} with their tables)"))
    if max_loras is not None:
        rows.append(("pool", f"{max_loras:,} slots: {record['pool_bytes']:,} B "
                     f"({human_bytes(record['pool_bytes'])})"))
        rows.append(("tables", f"{record['table_bytes']:,} B (A/B pointers, scales, ranks)"))
        if ex is not None:
            rows.append(("expert pool", f"{ex['expert_pool_bytes']:,} B "
                         f"({human_bytes(ex['expert_pool_bytes'])}) + "
                         f"{ex['table_bytes']:,} B expert tables"))
        if record["total_bytes"] is not None:
            rows.append(("total", f"{record['total_bytes']:,} B "
                         f"({human_bytes(record['total_bytes'])})"))
    rows.append(("fingerprint", record["fingerprint"]))
    if ex is not None:
        rows.append(("expert fingerprint", ex["fingerprint"]))
    table = fields(rows)

    shares = record["shares"]
    parts: list[Any] = [table]
    if record["entries"]:
        # The modules make the slot; each kind of layer's part of it is shown after them.
        parts.append(_share_table("share of a slot", shares["module"], {
            f"[dim]{kind} layers": size for kind, size in shares["layer_kind"].items()}))
    if ex is not None and ex["n_entries"]:
        parts.append(_share_table("share of an expert slot", ex["shares"]))
    return Group(*parts)


def _share_table(title: str, shares: dict[str, int],
                 also: dict[str, int] | None = None) -> Table:
    """Bytes and percent of the whole per part: `shares` make the whole, `also` (other cuts
    of the same bytes) follow as rows of their own."""
    total = sum(shares.values()) or 1
    table = Table(header_style="bold", padding=(0, 1), box=box.SIMPLE_HEAD)
    table.add_column(title)
    table.add_column("bytes", justify="right")
    table.add_column("%", justify="right")
    for name, size in {**shares, **(also or {})}.items():
        table.add_row(name, f"{size:,}", f"{100 * size / total:.1f}")
    return table


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
    two, large = record["shared_fills"]
    readers = (f"; a second reader on {two} of {large} large fills (only where a core is idle)"
               if setup["device"] == "cpu" else "")
    checker = ("" if setup["device"] != "cpu" else " (compiled, as the reads land)"
               if setup["compiled_reader"] else " (NumPy after each read: metrale_cli._native "
               "was not built, no C compiler at install)")
    text = Text(
        f"{setup['adapters']} x {setup['model']} r={setup['rank']} {setup['dtype']} adapters, "
        f"{human_bytes(record['tensor_bytes'])} of tensors, into {setup['device']} memory\n"
        f"cores     {setup['cpus_usable']} usable, load average {setup['load_average_1m']:.1f}"
        f"{readers}\n"
        f"pack      {record['pack_gb_per_s']:.2f} GB/s = {100 * record['pack_vs_memcpy']:.0f}% "
        f"of {copy} ({record['memcpy_gb_per_s']:.2f} GB/s), same bytes, same run\n"
        f"          {record['pack_tensor_writes_gb_per_s']:.2f} GB/s = "
        f"{100 * record['pack_tensor_writes_vs_memcpy']:.0f}% with files written per tensor "
        "(as PEFT saves)\n"
        f"NaN/Inf check{checker}: the pack takes {record['finite_check_cost']:.2f}x as long "
        f"as without it ({record['pack_unchecked_gb_per_s']:.2f} GB/s)\n"
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


def kernel_model_view(record: dict[str, Any]) -> Group:
    """`bench kernels --model-only` (with `--experts` too): the device the model assumes, a
    table per module (per model with `--experts`) with a row per kernel (projection) and shape,
    and what the columns mean."""
    d = record["assumed_device"]
    experts = record["experts"]
    group_key = "model" if experts else "module"
    first = "projection" if experts else "kernel"
    sizes = ("MiB", "us") if experts else ("CTAs", "KiB/SM")
    peak = f"{d['peak_bytes_per_s'] / 1e12:.1f} TB/s"
    tables: dict[str, Table] = {}
    for r in record["records"]:
        table = tables.get(r[group_key])
        if table is None:
            table = tables[r[group_key]] = Table(
                title=r[group_key], title_justify="left", title_style="bold",
                header_style="bold", padding=0, show_edge=False,
                box=box.SIMPLE_HEAD)
            for col in (first, "path", "r", "T", "D", *sizes, "%peak", "xcopy", "target"):
                table.add_column(col, justify="left" if col in (first, "path", "target")
                                 else "right", no_wrap=col != "path")
        table.add_row(
            r[first], r["path"], str(r["rank"]), str(r["tokens"]), str(r["adapters"]),
            f"{r['bytes'] / 2**20:.2f}" if experts else str(r["ctas"]),
            f"{r['expected_us']:.2f}" if experts else f"{r['in_flight_per_sm_bytes'] / 1024:.1f}",
            f"{r['expected_pct_peak']:.1f}", f"{r['expected_copy_ratio']:.2f}",
            "meets" if r["meets_target"] else "MISSES")
    what = ("MiB: compulsory bytes; us: the expected time of the projection's launches"
            if experts else "CTAs: the launch's thread blocks; KiB/SM: the bytes each SM has "
            "in flight per pass")
    return Group(
        Text(f"Roofline model (no GPU is used) of an {d['name']}: {d['sms']} SMs, "
             f"{human_bytes(d['l2_bytes'])} L2, nominal HBM peak {peak}."),
        *tables.values(),
        Text(f"r: rank; T: tokens in the batch; D: distinct adapters among them; {what}; "
             f"%peak: the expected share of the {peak} peak; xcopy: the expected time over an "
             "equal-bytes device copy; target: meets or MISSES the kernels' target (at least "
             "80 / 75 / 70 % of peak for decode shrink / decode expand / prefill from 64 MiB "
             "of traffic, at most 1.3x a copy below)."))


def pack_view(record: dict[str, Any]) -> Group:
    """`metrale pack`: the pool's slots and sizes; with --tp a line per rank image."""
    if "ranks" in record:
        return _ranks_view(record)
    lay, ex, slots = record["layout"], record["experts"], record["slots"]
    max_loras = lay["max_loras"]
    table = Table(header_style="bold", padding=(0, 1), box=box.SIMPLE_HEAD)
    for col in ("slot", "name", "rank", "alpha", "scale", "pinned", "source"):
        table.add_column(col)
    for s in slots:
        if s["name"]:
            table.add_row(str(s["slot"]), escape(s["name"]), str(s["rank"]), _fmt(s["alpha"]),
                          f"{s['scaling']:.6g}", "yes" if s["pinned"] else "",
                          escape(s["source"]))
    empty = max_loras - sum(1 for s in slots if s["name"])
    lines = [
        f"pool: {max_loras} slots x {lay['slot_bytes']:,} B = {human_bytes(lay['pool_bytes'])} "
        f"on {record['device']}, max rank {lay['max_rank']}, {record['entries']} entries, "
        f"{empty} empty cache slots",
        f"packed {human_bytes(record['bytes_read'])} of adapter tensors in "
        f"{record['pack_seconds']:.3f} s ({record['pack_gb_per_s'] or 0.0:.2f} GB/s)",
    ]
    if ex is not None:
        lines.insert(1, f"expert pool: {max_loras} expert slots x {ex['expert_slot_bytes']:,} B "
                     f"= {human_bytes(ex['expert_pool_bytes'])}, {ex['n_entries']:,} "
                     f"(layer, projection, expert) entries, max rank {ex['max_rank']}")
    overlays = sum(o["tokens"] for s in slots for o in s["overlays"])
    if overlays:
        lines.insert(1, f"token overlays: {overlays} rows")
    if record["image"] is not None:
        lines.append(f"wrote {record['image']} ({human_bytes(record['image_bytes'])}) in "
                     f"{record['write_seconds']:.3f} s; layout fingerprint {lay['fingerprint']}")
    # Wrapped as key/value lines are, a path or fingerprint kept whole as a word.
    return Group(table, *(wrapped(line) for line in lines))


def _rank_span(ranks: list[int]) -> str:
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 1:
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def sharded_layout_view(record: dict[str, Any]) -> Group:
    """`metrale layout --tp N`: the unsharded slot, then per GPU each distinct rank layout
    (`ShardedPlan.record`)."""
    unsharded = layout_view(record, per_gpu=True)
    mode = (f"tp {record['tp_size']}, ep {record['ep_size']} (MoE TP "
            f"{record['tp_size'] // record['ep_size']})"
            + (", fully sharded" if record["fully_sharded"] else ""))
    rows = [("deployment", mode)]
    slot, max_loras = record["slot_bytes"], record["max_loras"]
    if record["budget_bytes"] is not None and max_loras is not None:
        rows.append(("budget", f"{human_bytes(record['budget_bytes'])} per GPU holds "
                     f"{max_loras:,} slots on every rank"))
    for group in record["rank_layouts"]:
        share = f", {100 * group['slot_bytes'] / slot:.0f}% of the unsharded slot" if slot else ""
        rows.append((_rank_span(group["ranks"]),
                     f"slot {group['slot_bytes']:,} B ({human_bytes(group['slot_bytes'])}) "
                     f"per GPU{share}"))
        if group["expert_slot_bytes"] is not None:
            rows.append(("", f"expert slot {group['expert_slot_bytes']:,} B "
                         f"({human_bytes(group['expert_slot_bytes'])}) per GPU"))
        if max_loras is not None and group["total_bytes"] is not None:
            rows.append(("", f"{max_loras:,} slots: {group['total_bytes']:,} B "
                         f"({human_bytes(group['total_bytes'])}) per GPU with tables"))
        for k, fingerprint in zip(group["ranks"], group["fingerprints"], strict=True):
            rows.append(("", f"rank {k} fingerprint {fingerprint}"))
    return Group(unsharded, Text(""), fields(rows))


def _ranks_view(record: dict[str, Any]) -> Group:
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


_DIGEST_LINES = {"checked": "sha256 per tensor, every tensor checked",
                 "tables": "sha256 per tensor, the tables checked (--check reads the pool)",
                 "none": "none (written before pool/1 carried them)"}


def show_view(record: dict[str, Any]) -> Group:
    """`metrale show`: the image's record (see image.show.ImageShow)."""
    lay, ex = record["layout"], record["experts"]
    rows = [
        ("image", whole(f"{record['path']} ({record['format']}, consistent)")),
        ("model", model_line(record["model"])),
        # The sizes first: at 80 columns they stay on the key's line, the module list wraps.
        ("layout", f"slot {lay['slot_bytes']:,} B, {lay['max_loras']:,} slots; max rank "
                   f"{lay['max_rank']}, {lay['entries']} entries "
                   f"({', '.join(lay['modules']) or 'no modules'})"),
        ("fingerprint", lay["fingerprint"]),
    ]
    if ex is not None:
        rows.append(("experts", f"max rank {ex['max_rank']}, {ex['entries']:,} entries on "
                     f"layers {layer_set(ex['layers'])}, expert slot "
                     f"{ex['expert_slot_bytes']:,} B"))
        rows.append(("expert fingerprint", ex["fingerprint"]))
    rows.append(("active", f"slot {record['active']}"))
    rows.append(("digests", _DIGEST_LINES[record["digests"]]))
    free = record["free_slots"]
    rows.append(("free slots", ", ".join(map(str, free)) if free else "none"))
    sources, cells = [], []
    for s in record["slots"]:
        if not s["name"]:
            continue
        overlays = ", ".join(f"{o['table']} {o['tokens']}" for o in s["overlays"])
        cells.append((str(s["slot"]), s["name"], str(s["generation"]), str(s["rank"]),
                      _fmt(s["alpha"]), f"{s['scale']:.6g}", "yes" if s["pinned"] else "",
                      str(s["entries"]), str(s["expert_entries"] or "·"), overlays or "·"))
        sources.append((f"slot {s['slot']} source", whole(s["source"])))  # a path, whole
    sizes = Table(header_style="bold", padding=(0, 1), box=box.SIMPLE_HEAD)
    sizes.add_column("part")
    sizes.add_column("bytes", justify="right")
    sizes.add_column("", justify="right")
    for part, n in record["bytes"].items():
        if n or part in ("pool", "total"):
            sizes.add_row(part, f"{n:,}", human_bytes(n))
    slots = Fitted(_slot_table(cells), _slot_table([(c[0], "", *c[2:]) for c in cells]),
                   lambda width: _slot_lines(cells, width))
    return Group(fields(rows), Text(), slots, Text(), fields(sources), sizes)


_SLOT_COLUMNS = ("slot", "name", "gen", "rank", "alpha", "scale", "pinned", "entries", "experts",
                 "overlays")


def _slot_table(cells: list[tuple[str, ...]]) -> Table:
    """`show`'s slot table. Figures never wrap; a long name or overlay list folds onto more
    lines, so every header and cell reads whole at 80 columns (the headers alone take 63).
    Narrower, each slot is key/value lines of the same cells (_slot_lines)."""
    table = Table(header_style="bold", padding=(0, 1, 0, 0), box=box.SIMPLE_HEAD,
                  show_edge=False)
    for col in _SLOT_COLUMNS:
        table.add_column(col, no_wrap=col not in ("name", "overlays"),
                         overflow="fold" if col == "name" else "ellipsis",
                         min_width=len(col))
    for row in cells:
        table.add_row(*map(Text, row))  # a name or an overlay's table as typed, not markup
    return table


def _slot_lines(cells: list[tuple[str, ...]], width: int) -> Fields:
    """`show`'s slot table as key/value lines in `width` columns: per slot, its name (folded
    where longer than the line, as the table's column folds it), then each other column's header
    and cell (`pinned no` for the table's empty cell)."""
    indent = max((len(f"slot {c[0]}") for c in cells), default=0) + 2
    room = max(20, width - indent)  # as Fields' narrowest line
    rows: list[tuple[str, str | Text]] = []
    for slot, name, *rest in cells:
        figures = "; ".join(f"{col} {cell or 'no'}"
                            for col, cell in zip(_SLOT_COLUMNS[2:], rest, strict=True))
        folded = [name[i:i + room] for i in range(0, len(name), room)]
        rows.append((f"slot {slot}", "\n".join([*folded, figures])))
    return Fields(rows)


def synth_view(record: dict[str, Any]) -> Text:
    """`metrale synth`: what was written (`SynthResult.record`)."""
    return whole(f"wrote {record['path']}: {record['tensors']} tensors, "
                 f"{human_bytes(record['bytes'])}")


def unpack_view(record: dict[str, Any]) -> Text:
    """`metrale unpack`: the adapter written from a slot (`UnpackResult.record`)."""
    overlays = (f", trainable tokens for {', '.join(record['overlays'])}"
                if record["overlays"] else "")
    return whole(f"wrote {record['path']}: slot {record['slot']} ({record['name']}), "
                 f"{record['modules']} modules at r={record['r']} "
                 f"lora_alpha={record['lora_alpha']:g}{overlays}, "
                 f"{human_bytes(record['bytes'])}")


# Differing regions listed per adapter; --json has them all.
VERIFY_ROWS = 20


def verify_view(record: dict[str, Any]) -> Group:
    """`metrale verify`: per adapter ok or what differs (see verify.VerifyResult)."""
    lines: list[Any] = []
    for a in record["adapters"]:
        # Wrapped to the terminal as a Fields value is, `slot N NAME: ok` whole on its line.
        head = Text(f"slot {a['slot']} {a['name']}: ", style="bold")
        if a["ok"]:
            head.append("ok", style="bold green")
            head.append(f" ({a['entries']} entries"
                        + (f", {a['expert_entries']} expert entries" if a["expert_entries"]
                           else "") + f", {human_bytes(a['bytes_compared'])} of its entries "
                           "compared)")
            lines.append(Fields([("", head)], hang=2))
            continue
        head.append("DIFFERS", style="bold red")
        lines.append(Fields([("", head)], hang=2))
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
        lines.append(wrapped(f"slot {u['slot']} {u['name']}: unchecked (not given)",
                             style="dim"))
    for line in record["digest_differences"]:
        lines.append(Text(f"DIFFERS: {line}", style="bold red"))
    rate = record["gb_per_s"]
    lines.append(wrapped(f"compared {human_bytes(record['bytes_compared'])} of the image in "
                         f"{record['seconds']:.3f} s"
                         + (f" ({rate:.2f} GB/s)" if rate is not None else "")))
    return Group(*lines)
