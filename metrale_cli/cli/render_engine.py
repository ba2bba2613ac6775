"""Rich views of `metrale inspect --engine vllm` and `layout --engine vllm` records, as
render.py's: nothing here computes what it shows, and input-derived text is escaped."""

from __future__ import annotations

from typing import Any

from rich import box
from rich.console import Group
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from metrale_cli.cli.render import fields, human_bytes, model_line, whole

VERDICT_STYLE = {"serves": "bold green", "differs": "bold yellow", "ignores": "bold yellow",
                 "refuses": "bold red", "crashes": "bold red", "fails_startup": "bold red",
                 "unsupported_model": "bold red"}


def engine_inspect_view(record: dict[str, Any]) -> Group:
    """`metrale inspect --engine vllm`: its record, a panel per adapter with vLLM's verdict and
    modules, then the recommended flags and a ready `vllm serve`."""
    engine = record["engine"]
    parts: list[Any] = [whole(model_line(record["model"]), style="bold"),
                        whole(f"vLLM {engine['version']} (GPU build), flags "
                              f"{engine['flags_source']}: {_flag_line(engine['flags'])}",
                              style="dim")]
    for adapter in record["adapters"]:
        v = adapter["engine"]
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="dim")
        grid.add_column()
        grid.add_row("verdict", Text(v["verdict"], style=VERDICT_STYLE[v["verdict"]]))
        grid.add_row("reason", escape(v["reason"]))
        if v["verdict"] == "refuses":
            for path, label in (("startup", "--lora-modules"), ("offline", "offline LLM")):
                other = v["paths"][path]
                grid.add_row(label, escape(f"{other['verdict']}: {other['reason']}"))
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
    # fields, not a grid: the serve line is pasted into a shell, and a fold would cut it.
    rows: list[tuple[str, str | Text]] = []
    if engine["offline_batch"]:
        rows.append(("offline batch", engine["offline_batch"]["reason"]))
    rows += [("recommended", _flag_line(rec["flags"])), ("serve", rec["serve"])]
    if rec["shut_out"]:
        rows.append(("", "the serve line names no adapter vLLM refuses (see left out)"))
    rows.append(("LoRA memory", f"{rec['lora_bytes']:,} B ({human_bytes(rec['lora_bytes'])}) "
                 f"per GPU, {rec['slot_bytes']:,} B a slot; host cache "
                 f"{human_bytes(rec['host_cache_bytes'])}"))
    for pad in rec["padding"]:
        rows.append(("padding", f"{pad['adapter']} leaves {pad['unused_bytes']:,} B "
                     f"({pad['unused_share']:.1%}) of its slot unused"))
    lower = rec["lower_max_rank"]
    if lower is not None:
        rows.append(("lower rank", f"--max-lora-rank {lower['max_lora_rank']} frees "
                     f"{human_bytes(lower['frees_bytes'])} and shuts out "
                     f"{', '.join(lower['shuts_out']) or 'no adapter'}"))
    if rec["fully_sharded_saves_bytes"]:
        rows.append(("fully sharded", f"--fully-sharded-loras saves "
                     f"{human_bytes(rec['fully_sharded_saves_bytes'])} per GPU"))
    for line in rec["shut_out"]:
        rows.append(("left out", line))
    parts.append(fields(rows))
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
    rows: list[tuple[str, str | Text]] = [
        ("model", model_line(record["model"])),
        ("engine", f"vLLM {rec['version']} (GPU build)"),
        ("flags", _flag_line(rec["flags"])),
        ("LoRA buffers", f"{rec['lora_bytes']:,} B ({human_bytes(rec['lora_bytes'])}) per GPU"),
        ("slot", f"{rec['slot_bytes']:,} B ({human_bytes(rec['slot_bytes'])}) per adapter slot"),
        ("host cache", f"{rec['host_cache_bytes']:,} B ({human_bytes(rec['host_cache_bytes'])}) "
         f"for {rec['flags']['max_cpu_loras']} adapter"
         f"{'s' if rec['flags']['max_cpu_loras'] != 1 else ''}, per TP worker")]
    if "budget_bytes" in rec:
        rows.append(("budget", f"{human_bytes(rec['budget_bytes'])} holds "
                     f"{rec['max_loras_fit']:,} --max-loras"))
    table = Table(header_style="bold", padding=(0, 1), box=box.SIMPLE_HEAD)
    for column, justify in (("module", "left"), ("kind", "left"), ("layers", "right"),
                            ("bytes", "right"), ("%", "right")):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    total = rec["lora_bytes"] or 1
    for m in rec["modules"]:
        table.add_row(m["module"], m["kind"], str(m["layers"] or "-"), f"{m['bytes']:,}",
                      f"{100 * m['bytes'] / total:.1f}")
    return Group(fields(rows), Text(""), table)


def engine_confirm_view(record: dict[str, Any]) -> Group:
    """`metrale inspect --engine vllm --confirm`: the disagreements first, then the prediction
    (engine_inspect_view), then per adapter what the running engine did."""
    check = record["confirm"]
    engine = check["engine"]
    by_name = {a["name"]: a for a in check["adapters"]}
    parts: list[Any] = []
    for name in check["disagreements"]:
        a = by_name[name]
        parts.append(whole(f"DISAGREES {name}: predicted {a['predicted']}, observed "
                           f"{a['observed']['summary']}: {a['why']}", style="bold red"))
    if parts:
        parts.append(Text(""))
    parts += [engine_inspect_view(record), Text("")]
    table = Table(header_style="bold", padding=(0, 1), box=box.SIMPLE_HEAD,
                  title=escape(f"confirmed against vLLM {engine['version'] or '?'} running"),
                  title_justify="left")
    for column in ("adapter", "predicted", "observed", "agrees"):
        table.add_column(column)
    for a in check["adapters"]:
        table.add_row(escape(a["name"]), Text(a["predicted"], style=VERDICT_STYLE[
            a["predicted"]]), escape(a["observed"]["summary"]),
            Text("yes", style="green") if a["agrees"] else Text("NO", style="bold red"))
    parts.append(table)
    rows: list[tuple[str, str | Text]] = []
    for a in check["adapters"]:
        if a["note"]:
            rows.append(("note", f"{a['name']}: {a['note']}"))
    ready = engine["ready_s"]
    rows += [("engine", f"vLLM {engine['version'] or '?'}, "
              f"{'ready after ' + format(ready, '.0f') + ' s, ' if ready is not None else ''}"
              f"{engine['seconds']:.0f} s in all"),
             ("flags", " ".join(engine["flags"])), ("log", engine["log"]),
             ("verdict", "every prediction held" if check["agrees"] else
              f"{len(check['disagreements'])} disagreement(s): "
              f"{', '.join(check['disagreements'])}")]
    parts.append(fields(rows))
    return Group(*parts)
