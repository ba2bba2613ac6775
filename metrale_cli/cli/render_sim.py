"""Rich views of `metrale simulate` and `metrale bench slots` records, as render.py's: nothing
here computes what it shows, and input-derived text is escaped."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from metrale_cli.cli.render import fields, human_bytes, whole
from metrale_cli.engines import get_engine


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
    head: list[tuple[str, str | Text]] = []  # fields: no figure is split from its unit
    made = (f"trace {w['path']}" if w["kind"] == "trace" else
            f"{w['kind']} generator, seed {w['seed']}, {w['rate']:g} req/s, cv {w['cv']:g}")
    head.append(("workload", f"{made}: {w['requests']:,} requests "
                 f"({w['adapter_requests']:,} to adapters) over {w['span_s']:,.1f} s, "
                 f"{w['distinct_adapters']:,} distinct adapters"))
    if record["mode"] == "paging":
        head.append(("mode", "exact paging: zero-length requests, served one at a time in order"))
    else:
        seats = record["max_concurrency"]
        head.append(("mode", "concurrent: requests hold their slot from admission to "
                     f"completion ({record['prefill_tok_s']:g} prefill / "
                     f"{record['decode_tok_s']:g} decode tok/s), "
                     + (f"at most {seats} in flight" if seats else "no concurrency cap")))
    if record.get("engine"):
        e = record["engine"]
        who = get_engine(f"{e['name']}=={e['version']}")
        tier = next(iter(e["tiers"].values()))
        # Named as inspect and layout name it: `vLLM 0.32.0 (GPU build)`, `SGLang 0.5.23`.
        head.append(("engine", f"{who.title}'s own cache: its GPU slots of its "
                     f"slot bytes (--max-loras), evicting {tier['gpu_eviction'].upper()}, its "
                     f"host cache ({who.host_flag}), evicting "
                     f"{tier['host_eviction'].upper()}, its scheduler's admission"))
    per_gpu = f" per GPU at --tp {lay['tp_size']}" if "tp_size" in lay else ""
    head.append(("slot", f"{human_bytes(swap['slot_bytes'])}{per_gpu} ({lay['model']}, "
                 f"{len(lay['modules'])} module{'s' if len(lay['modules']) != 1 else ''}, "
                 f"max rank {lay['max_rank']})"))
    links = swap["links"]
    head.append(("swap", f"{human_seconds(swap['swap_s'])} per load at {swap['bandwidth']} "
                 f"({swap['bytes_per_s'] / 1e9:g} GB/s + {1e6 * swap['latency_s']:g} us), "
                 + ("one load at a time per GPU" if links == 1 else f"{links} loads at a time "
                    "per GPU")))
    if record["host"]:
        host = record["host"]
        held = (f"{host['slots']:,} adapters" if host["slots"] is not None
                else "as many adapters as GPU slots")
        # No bytes where the engine sizes its host cache by adapter files the workload has
        # not got (SGLang's: its start-up adapters' files; a generated workload has none).
        bound = f", up to {human_bytes(host['host_bytes'])}" if host["host_bytes"] else ""
        head.append(("host", f"{held} in host memory (an LRU{bound}); a host miss reads over "
                     f"{host['bandwidth']} ({host['bytes_per_s'] / 1e9:g} GB/s + "
                     f"{1e6 * host['latency_s']:g} us)"))
    if record["admission"] == "skip":
        head.append(("admission", "skip: a request whose adapter cannot be placed waits while "
                     "later ones whose adapter is resident (or loading) go ahead"))
    if record["routing"]:
        routing = record["routing"]
        head.append(("replicas", f"{routing['replicas']}, {routing['route']} routing: each "
                     "replica has its own pool of each size below (pool GiB per replica); the "
                     "figures are totals"))
    if w.get("adapter_ranks"):
        head.append(("ranks", ", ".join(f"{n:,} at rank {r}" for r, n in
                                        w["adapter_ranks"].items())
                     + f": a load moves rank/{lay['max_rank']} of a slot"))
    if record["pinned"]:
        head.append(("pinned", f"{len(record['pinned'])}: {', '.join(record['pinned'][:8])}"
                     + (" ..." if len(record["pinned"]) > 8 else "")))
    # Headers wrap onto two lines; cells never do, so 80 columns hold every figure.
    with_min = "min" in record["policies"]
    if with_min:
        head.append((MIN_CELL, "Belady's offline bound (it knows every future request, so no "
                     "engine can run it): the fewest misses any policy could have, not an answer"))

    def row(r: dict[str, Any]) -> list[str]:
        gap = r["extra_misses_vs_min"]
        vs_min = ["-" if gap is None or r["policy"] == "min" else f"+{gap:,}"] if with_min else []
        pool = f"{r['pool_bytes'] / 2**30:,.2f}"
        if r["fits_budget"] is False:
            pool = f"[red]{pool}"
        return [_policy_cell(r), str(r["max_loras"]), f"{100 * r['hit_rate']:.2f}",
                f"{r['misses']:,}", f"{r['stalls']:,}",
                human_seconds(r["stall_p99_s"]) if r["stalls"] else "-",
                human_seconds(r["added_latency_p50_s"]), human_seconds(r["added_latency_p99_s"]),
                *vs_min, pool]

    table = _policy_table(record, ["policy", "slots", "hit %", "misses", "stalls", "stall\np99",
                                   "added\np50", "added\np99",
                                   *(["misses\nvs min"] if with_min else []), "pool\nGiB"], row)
    parts: list[Any] = [fields(head), table]
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
                line = (f"{_policy_name(s)}: no size in {record['sizes'][0]}..{record['sizes'][-1]}"
                        f" reaches {want}")
            else:
                line = (f"{_policy_name(s)}: {s['max_loras']} slots and every larger size reach "
                        f"{want}: {human_bytes(s['pool_bytes'])} of pool")
                budget = record["budget_bytes"]
                if s["fits_budget"]:
                    line += f", fits the {human_bytes(budget)} budget"
                elif s["fits_budget"] is not None:
                    # The slots alone may fit and their tables tip it over, which two equal
                    # GiB figures would hide: the bytes say by how much.
                    line += (f", does NOT fit the {human_bytes(budget)} budget "
                             f"({s['pool_bytes']:,} B with its tables, "
                             f"{s['pool_bytes'] - budget:,} B over)")
            parts.append(whole(line))  # the answer, one line to grep
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
    names = ["policy", "slots", "delayed\nhits", "GiB\nto GPU", "link\nwait"]
    if tiered:
        names += ["from\nhost", "from\ndisk", "GiB\nfrom disk"]
    if replicated:
        names += ["hit % by\nreplica"]

    def row(r: dict[str, Any]) -> list[str]:
        cells = [_policy_cell(r), str(r["max_loras"]), f"{r['delayed_hits']:,}",
                 f"{r['bytes_moved'] / 2**30:,.2f}", human_seconds(r["link_wait_s"])]
        if tiered:
            cells += [f"{r['host_hits']:,}", f"{r['host_misses']:,}",
                      f"{r['host_bytes_moved'] / 2**30:,.2f}"]
        if replicated:
            cells.append(" ".join(f"{100 * x['hit_rate']:.1f}" for x in r["replicas"]))
        return cells

    return _policy_table(record, names, row)


def _serving_table(record: dict[str, Any]) -> Table | None:
    """Concurrent mode: time to first token, adapter requests apart from base-model ones, and
    throughput per result; where skip admission let requests start before their all-resident
    start (a seat a stalled head did not hold), how many and the seconds they gained."""
    if record["mode"] != "concurrent":
        return None
    gains = any(r["moved_ahead"] for r in record["results"])

    def seconds(x: float | None) -> str:
        return "-" if x is None else human_seconds(x)

    def row(r: dict[str, Any]) -> list[str]:
        moved = [f"{r['moved_ahead']:,}",
                 human_seconds(r["gained_s"]) if r["moved_ahead"] else "-"] if gains else []
        return [_policy_cell(r), str(r["max_loras"]), seconds(r["ttft_adapter_p50_s"]),
                seconds(r["ttft_adapter_p99_s"]), seconds(r["ttft_base_p50_s"]),
                seconds(r["ttft_base_p99_s"]), f"{r['throughput_req_s']:,.2f}", *moved]

    return _policy_table(record, ["policy", "slots", "TTFT p50\nadapter", "TTFT p99\nadapter",
                                  "TTFT p50\nbase", "TTFT p99\nbase", "req/s",
                                  *(["moved\nahead", "gained\nin all"] if gains else [])], row)


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
    def row(r: dict[str, Any]) -> list[str]:
        spread = r["spread"]
        hit, miss, p99 = spread["hit_rate"], spread["misses"], spread["added_latency_p99_s"]
        return [_policy_cell(r), str(r["max_loras"]),
                "/".join(f"{100 * hit[k]:.2f}" for k in ("min", "median", "max")),
                "/".join(f"{miss[k]:,.0f}" for k in ("min", "median", "max")),
                "/".join(human_seconds(p99[k]) for k in ("min", "median", "max"))]

    return _policy_table(record, ["policy", "slots", "hit %", "misses", "added p99"], row,
                         f"over {len(seeds)} seeds ({seeds[0]}..{seeds[-1]}): min/median/max")


# Belady's `min` in a table's policy column: marked, and keyed in the head's `min*` line, as
# the offline bound it is; "min (offline bound)" there widened every table past 80 columns.
MIN_CELL = "min*"


def _policy_name(r: dict[str, Any]) -> str:
    """A policy as the lines outside tables name it: Belady's `min` marked as the offline
    bound it is, apart from the policies an engine runs."""
    return "min (offline bound)" if r["policy"] == "min" else r["policy"]


def _policy_cell(r: dict[str, Any]) -> str:
    """A policy as a table's policy column names it (`MIN_CELL` for `min`)."""
    return MIN_CELL if r["policy"] == "min" else r["policy"]


def _policy_table(record: dict[str, Any], columns: list[str],
                  row: Callable[[dict[str, Any]], list[str]], title: str | None = None) -> Table:
    """One row per result (`row` draws its cells), a section per policy; the policy column
    left, every figure right, no cell wrapped."""
    table = Table(padding=(0, 1), collapse_padding=True, pad_edge=False, box=box.SIMPLE_HEAD,
                  title=title, title_justify="left")
    for name in columns:
        table.add_column(name, justify="left" if name == "policy" else "right", no_wrap=True,
                         header_style="bold")
    previous = None
    for r in record["results"]:
        if previous is not None and r["policy"] != previous:
            table.add_section()
        previous = r["policy"]
        table.add_row(*row(r))
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
    for name in ("lru_sweep", "lru_sweep_overloaded"):
        sweep = record[name]
        lines.append(f"lru sweep, paging, {sweep['sizes']:,} sizes over {sweep['adapters']:,} "
                     f"adapters at {sweep['rate']:,.0f} req/s: {sweep['sweep_s']:.2f} s in one "
                     f"pass, {sweep['replay_s']:.2f} s per size replayed: "
                     f"x{sweep['speedup']:,.0f}, one pass = {sweep['over_one_replay']:.1f} "
                     "replays")
    theirs = record.get("libcachesim")
    if theirs is None:
        lines.append("libCacheSim: not installed (pip install 'metrale[libcachesim]')")
    else:
        lines.append(f"against libCacheSim: {theirs['requests']:,} zipf requests over "
                     f"{theirs['adapters']:,} adapters, {len(theirs['sizes'])} sizes, the "
                     "trace read from its file")
        for policy in ("fifo", "lru"):
            t = theirs[policy]
            lines.append(f"  {policy}, paging: metrale {t['metrale_s']:.2f} s, libCacheSim "
                         f"{t['libcachesim_s']:.2f} s: x{t['ratio']:.1f}, the same misses")
        c = theirs["concurrent_lru"]
        lines.append(f"  lru, concurrent (requests hold slots): metrale {c['metrale_s']:.2f} s:"
                     f" x{c['ratio']:.1f} libCacheSim's paging lru")
    for n, times in record["admission"].items():
        lines.append(f"admission, {int(n):,} requests on 4 slots: skip {times['skip_s']:.2f} s, "
                     f"fcfs {times['fcfs_s']:.2f} s: x{times['skip_over_fcfs']:.2f}")
    return Text("\n".join(lines))


def bench_slots_scale_view(record: dict[str, Any]) -> Text:
    """`metrale bench slots --scale N`: each side's seconds and peak memory, and the ratio."""
    mib = 1 << 20
    lines = [f"{record['requests']:,} zipf requests over {record['adapters']:,} adapters "
             f"({record['trace_bytes'] / mib:,.0f} MiB of CSV), {', '.join(record['policies'])}"
             f" at {len(record['sizes'])} sizes"]
    for side in ("metrale", "libcachesim"):
        if side not in record:
            lines.append("libCacheSim: not installed (pip install 'metrale[libcachesim]')")
            continue
        r = record[side]
        read = f"read {r['read_s']:.1f} s, " if "read_s" in r else ""
        each = ", ".join(f"{p} {s:.1f} s" for p, s in r["seconds"].items())
        lines.append(f"{side}: {r['total_s']:.1f} s ({read}{each}); peak RSS "
                     f"{r['peak_rss'] / mib:,.0f} MiB ({r['rss_after_imports'] / mib:,.0f} MiB "
                     "once imported)")
    if "ratio" in record:
        lines.append(f"metrale / libCacheSim: x{record['ratio']:.2f}, the same misses")
    return Text("\n".join(lines))
