"""Rich views of `metrale inspect --engine E` and `layout --engine E` records (any registered
engine), as render.py's: nothing here computes what it shows, and input-derived text is
escaped. What differs by engine (its title, its flags in words, the names of its load paths)
is the engine's own (engines/engine.py `Engine`), found by the record's engine name."""

from __future__ import annotations

from typing import Any

from rich import box
from rich.console import Group
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from metrale_cli.cli.render import fields, human_bytes, model_line, whole, wrapped
from metrale_cli.engines import get_engine

VERDICT_STYLE = {"serves": "bold green", "differs": "bold yellow", "ignores": "bold yellow",
                 "refuses": "bold red", "crashes": "bold red", "fails_startup": "bold red",
                 "unsupported_model": "bold red"}


def engine_inspect_view(record: dict[str, Any]) -> Group:
    """`metrale inspect --engine E`: its record, a panel per adapter with the engine's verdict
    (and its other load paths' where they differ) and modules, then the recommended flags and
    a ready line that starts the server."""
    engine = record["engine"]
    who = get_engine(f"{engine['name']}=={engine['version']}")
    given = engine.get("given") or []
    # Which flags are the user's: those given; the rest of the line is the recommended ones.
    source = (f"flags judged ({', '.join(given)} given, the rest recommended)" if given
              else f"flags {engine['flags_source']}")
    parts: list[Any] = [wrapped(model_line(record["model"]), style="bold"),
                        wrapped(f"{who.title}, {source}: "
                                f"{who.flag_line(engine['flags'], engine.get('pool'))}",
                                style="dim")]
    if engine.get("checked") == "source":
        parts.append(wrapped(f"{who.title}'s answers for this family come from reading its "
                             "source: its LoRA code was not run on it", style="dim"))
    for adapter in record["adapters"]:
        v = adapter["engine"]
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="dim")
        grid.add_column()
        grid.add_row("verdict", Text(v["verdict"], style=VERDICT_STYLE[v["verdict"]]))
        grid.add_row("reason", escape(v["reason"]))
        for path, label in who.other_paths:
            other = v["paths"][path]
            if other["verdict"] != v["verdict"] or other["reason"] != v["reason"]:
                grid.add_row(label, escape(f"{other['verdict']}: {other['reason']}"))
        for where, other in v["elsewhere"].items():
            label = {"offline": "offline LLM", "cpu_build": "CPU build"}.get(where, where)
            grid.add_row(label, escape(f"{other['verdict']}: {other['reason']}"))
        body: list[Any] = [grid]
        if v["modules"]:
            table = Table(header_style="bold", padding=(0, 1), box=box.SIMPLE_HEAD)
            for column in ("module", who.module_column, "layers", "served"):
                table.add_column(column)
            for m in v["modules"]:
                table.add_row(m["module"], m["engine_module"] or "-",
                              m["layer_ranges"] if m["layers"] else "-",
                              "yes" if m["served"] else escape(f"no: {m['why']}"))
            body.append(table)
        parts.append(Panel(Group(*body), title=escape(adapter["name"]), title_align="left"))
    rec = engine["recommended"]
    # The serve line whole: it is pasted into a shell, and a fold would cut it.
    rows: list[tuple[str, str | Text]] = []
    if engine.get("offline_batch"):
        rows.append(("offline batch", engine["offline_batch"]["reason"]))
    if rec["serve"]:
        serve: str | Text = whole(rec["serve"])
    elif rec.get("never_starts"):
        serve = f"none: {who.title} never starts on this model (below)"
    else:
        serve = "none: no adapter can start the server, and without one it needs --max-rank " \
                "and --modules"
    rows += [("recommended", who.flag_line(rec["flags"], rec.get("pool"))), ("serve", serve)]
    if rec["shut_out"] and not rec.get("never_starts"):
        rows.append(("", f"the serve line names no adapter {who.title} would not start "
                         "with (see left out)"))
    judged = engine.get("memory")
    if rec["lora_bytes"] is not None:
        rows.append(("LoRA memory", _memory(rec) + (", with the serve line's flags"
                                                    if judged else "")))
    elif rec.get("memory_note"):
        rows.append(("LoRA memory", rec["memory_note"]))
    if judged:
        rows.append(("", _memory(judged) + ", with the flags judged above (as `layout` gives "
                     "them)"))
    for pad in rec.get("padding", []):
        rows.append(("padding", f"{pad['adapter']} leaves {pad['unused_bytes']:,} B "
                     f"({pad['unused_share']:.1%}) of its slot unused"))
    lower = rec.get("lower_max_rank")
    if lower is not None:
        rows.append(("lower rank", f"--max-lora-rank {lower['max_lora_rank']} frees "
                     f"{human_bytes(lower['frees_bytes'])} and shuts out "
                     f"{', '.join(lower['shuts_out']) or 'no adapter'}"))
    if rec.get("fully_sharded_saves_bytes"):
        rows.append(("fully sharded", f"--fully-sharded-loras (--fully-sharded) would save "
                     f"{human_bytes(rec['fully_sharded_saves_bytes'])} per GPU"))
    for line in rec["shut_out"]:
        rows.append(("left out", line))
    parts.append(fields(rows))
    return Group(*parts)


def _memory(rec: dict[str, Any]) -> str:
    """`N B (X MiB) per GPU, S B a slot; host cache H` of a record's LoRA bytes."""
    return (f"{rec['lora_bytes']:,} B ({human_bytes(rec['lora_bytes'])}) per GPU, "
            f"{rec['slot_bytes']:,} B a slot; host cache {human_bytes(rec['host_cache_bytes'])}")


def _host_held(rec: dict[str, Any], host_flag: str) -> str:
    """Which adapters the host cache's bytes are: the host tier's slots (`host_flag`; no
    limit: every start-up adapter)."""
    held = rec["tiers"]["host_slots"]
    if held is None:
        return f"every start-up adapter (no {host_flag})"
    return f"{held} adapter{'s' if held != 1 else ''}"


def engine_layout_view(record: dict[str, Any]) -> Group:
    """`metrale layout --engine E`: one GPU's LoRA buffers of the engine, as `layout` shows
    the pool, from its record."""
    rec = record["engine"]
    who = get_engine(f"{rec['name']}=={rec['version']}")
    rows: list[tuple[str, str | Text]] = [
        ("model", model_line(record["model"])),
        ("engine", who.title),
        ("flags", who.flag_line(rec["flags"], rec.get("pool"))),
        ("LoRA buffers", f"{rec['lora_bytes']:,} B ({human_bytes(rec['lora_bytes'])}) per GPU"),
        ("slot", f"{rec['slot_bytes']:,} B ({human_bytes(rec['slot_bytes'])}) per adapter slot"),
        ("host cache", f"{rec['host_cache_bytes']:,} B ({human_bytes(rec['host_cache_bytes'])}) "
         f"for {_host_held(rec, who.host_flag)}, per TP worker")]
    if "budget_bytes" in rec:
        fit = rec["max_loras_fit"]
        rows.append(("budget", f"{human_bytes(rec['budget_bytes'])} holds "
                     f"{fit:,} {who.slots_flag}" if fit is not None else
                     f"{human_bytes(rec['budget_bytes'])}: the pool has no slot bytes"))
    for n in rec["not_served"]:
        rows.append(("not served", f"{n['adapter']}: {n['verdict']}: {n['reason']}"))
    table = Table(header_style="bold", padding=(0, 1), box=box.SIMPLE_HEAD)
    for column, justify in (("module", "left"), ("kind", "left"), ("layers", "right"),
                            ("bytes", "right"), ("%", "right")):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    total = rec["lora_bytes"] or 1
    for m in rec["modules"]:
        # SGLang allocates both embedding pairs twice when both are targeted.
        copies = f" (x{m['copies']})" if m.get("copies", 1) > 1 else ""
        table.add_row(m["module"] + copies, m["kind"], str(m["layers"] or "-"),
                      f"{m['bytes']:,}",
                      f"{100 * m['bytes'] / total:.1f}")
    return Group(fields(rows), Text(""), table)


def engine_confirm_view(record: dict[str, Any]) -> Group:
    """`metrale inspect --engine E --confirm`: the disagreements first, then the prediction
    (engine_inspect_view), then per adapter what the running engine did."""
    check = record["confirm"]
    engine = check["engine"]
    label = get_engine(record["engine"]["name"]).label
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
                  title=escape(f"confirmed against {label} {engine['version'] or '?'} running"),
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
    rows += [("engine", f"{label} {engine['version'] or '?'}, "
              f"{'ready after ' + format(ready, '.0f') + ' s, ' if ready is not None else ''}"
              f"{engine['seconds']:.0f} s in all"),
             ("flags", " ".join(engine["flags"])), ("log", engine["log"]),
             ("verdict", "every prediction held" if check["agrees"] else
              f"{len(check['disagreements'])} disagreement(s): "
              f"{', '.join(check['disagreements'])}")]
    parts.append(fields(rows))
    return Group(*parts)
