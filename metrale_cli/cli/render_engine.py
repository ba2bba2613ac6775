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

from metrale_cli.cli.render import human_bytes, model_line

VERDICT_STYLE = {"serves": "bold green", "differs": "bold yellow", "ignores": "bold yellow",
                 "refuses": "bold red", "crashes": "bold red", "fails_startup": "bold red",
                 "unsupported_model": "bold red"}


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
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="dim")
    grid.add_column()
    if engine["offline_batch"]:
        grid.add_row("offline batch", escape(engine["offline_batch"]["reason"]))
    grid.add_row("recommended", _flag_line(rec["flags"]))
    grid.add_row("serve", escape(rec["serve"]))
    if rec["shut_out"]:
        grid.add_row("", "the serve line names no adapter vLLM refuses (see left out)")
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
