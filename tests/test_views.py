"""One record, two views: each command's table is its view of the very dict `--json` prints, so
the view rendered from the parsed JSON is the command's output, byte for byte."""

from __future__ import annotations

import io
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from metrale_cli.cli import render
from tests.support.cli_runner import metrale

MODEL = "qwen3-next-80b-a3b"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("views")
    assert metrale("synth", root / "chat", "--model", MODEL, "--modules",
                   "q_proj,k_proj,v_proj,o_proj,out_proj", "--rank", 16).code == 0
    assert metrale("synth", root / "code", "--model", MODEL, "--modules", "q_proj,out_proj",
                   "--rank", 8, "--rslora", "--seed", 1).code == 0
    return root / "chat", root / "code"


def rendered(view: Callable[[Any], Any], record: Any) -> str:
    console = Console(width=100, highlight=False, soft_wrap=False, file=io.StringIO())
    console.print(view(record), crop=False)  # as console.print_view: whole lines stay whole
    return console.file.getvalue()


@pytest.mark.parametrize("args, view", [
    (["inspect", "{chat}", "{code}"], render.inspect_view),
    (["inspect", "{code}", "--max-rank", "4"], render.inspect_view),
    (["layout", "{chat}", "{code}", "--budget", "40GiB"], render.layout_view),
    pytest.param(["layout", "-m", MODEL, "--experts", "--max-rank", "16", "--modules",
                  "q_proj,out_proj", "--max-loras", "4"], render.layout_view,
                 marks=pytest.mark.slow),  # the expert pool's whole layout: 2 to 3 s
    (["layout", "{chat}", "{code}", "--budget", "40GiB", "--tp", "4"],
     render.sharded_layout_view),
    (["models"], render.models_view),
])
def test_the_view_of_the_json_record_is_the_output(
        adapters: tuple[Path, Path], args: list[str], view: Callable[[Any], Any]) -> None:
    chat, code = adapters
    argv = [a.format(chat=chat, code=code) for a in args]
    shown, as_json = metrale(*argv), metrale(*argv, "--json")
    assert shown.code == as_json.code
    assert shown.stdout == rendered(view, json.loads(as_json.stdout))


def test_show_view_of_the_json_record(adapters: tuple[Path, Path], tmp_path: Path) -> None:
    image = tmp_path / "pool.safetensors"
    assert metrale("pack", *adapters, "--max-loras", 4, "--out", image).code == 0
    shown, as_json = metrale("show", image), metrale("show", image, "--json")
    assert shown.stdout == rendered(render.show_view, json.loads(as_json.stdout))


def test_one_json_writer_refuses_nan(capsys: pytest.CaptureFixture[str]) -> None:
    """Every record goes through one writer: a NaN that got this far is a bug, never invalid
    JSON on stdout."""
    from metrale_cli.cli.console import emit_json

    emit_json({"p50_us": 1.5})
    assert json.loads(capsys.readouterr().out) == {"p50_us": 1.5}
    with pytest.raises(ValueError, match="JSON compliant"):
        emit_json({"p50_us": float("nan")})


@pytest.fixture(scope="module")
def bench_imported() -> None:
    """`bench kernels` imports torch (its reference kernels) once per process: setup's cost."""
    import metrale_cli.bench.kernels  # noqa: F401


@pytest.mark.usefixtures("bench_imported")
def test_bench_kernels_json_is_one_document() -> None:
    """`bench kernels --json` prints one JSON document, as every command does (it printed JSON
    lines): the model's device, then every record."""
    shown = metrale("bench", "kernels", "--model-only", "--tokens", "1", "--rank", "16",
                    "--adapters", "1", "--json")
    assert shown.code == 0, shown.stderr
    doc = json.loads(shown.stdout)
    assert doc["bench"] == "kernels" and doc["model_only"] and not doc["experts"]
    assert doc["assumed_device"]["peak_bytes_per_s"] == 4.8e12
    assert doc["records"] and all(r["kernel"] for r in doc["records"])


@pytest.mark.usefixtures("bench_imported")
def test_bench_kernels_model_view_explains_itself() -> None:
    """The model's table: the GPU whose peak it assumes, a header over every table, and a
    legend for T, D and meets / MISSES; at 80 columns no cell is cut short."""
    shown = metrale("bench", "kernels", "--model-only", "--tokens", "1", "--tokens", "4096",
                    "--rank", "16", "--modules", "q_proj,k_proj,v_proj", columns=80)
    assert shown.code == 0, shown.stderr
    text = shown.stdout
    assert text.startswith("Roofline model (no GPU is used) of an H200")
    assert "nominal HBM peak 4.8 TB/s" in text
    header = ["kernel", "path", "r", "T", "D", "CTAs", "KiB/SM", "%peak", "xcopy", "target"]
    lines = text.splitlines()
    titles = [lines[i - 1].strip() for i, line in enumerate(lines) if line.split() == header]
    assert titles == ["q_proj", "k_proj", "v_proj", "q_proj+k_proj+v_proj"]
    legend = " ".join(text.split("\n\n")[-1].split())
    for words in ("T: tokens in the batch", "D: distinct adapters among them",
                  "meets or MISSES the kernels' target"):
        assert words in legend
    assert "…" not in text and all(len(line) <= 80 for line in text.splitlines())


def test_synth_and_unpack_views_of_their_records(adapters: tuple[Path, Path],
                                                 tmp_path: Path) -> None:
    # A directory name Rich would read as markup, shown as typed.
    made = tmp_path / "[bold]x"
    written = metrale("synth", made, "--model", "qwen3-8b", "--modules", "q_proj", "--rank", 8)
    assert written.stdout.startswith(f"wrote {made}: ")
    again = metrale("synth", tmp_path / "y", "--model", "qwen3-8b", "--modules", "q_proj",
                    "--rank", 8, "--json")
    assert again.code == 0
    # The view of the record with the first path, so that both lines wrap alike however long
    # the temporary directory's name is (xdist's are longer).
    assert rendered(render.synth_view, {**again.json(), "path": str(made)}) == written.stdout
    image = tmp_path / "pool.safetensors"
    assert metrale("pack", *adapters, "--max-loras", 2, "--out", image).code == 0
    shown = metrale("unpack", image, tmp_path / "out", "--slot", 1)
    as_json = metrale("unpack", image, tmp_path / "out2", "--slot", 1, "--json").json()
    assert shown.stdout == rendered(render.unpack_view, {**as_json,
                                                         "path": str(tmp_path / "out")})
    assert shown.stdout.startswith(f"wrote {tmp_path / 'out'}: slot 1 (code), ")


@pytest.mark.parametrize("args", [
    ["simulate", "-m", MODEL, "--modules", "q_proj,v_proj", "--max-rank", "16", "--requests",
     "200", "--max-loras", "4,8", "--target-hit-rate", "0.5", "--budget", "1GiB"],
    ["simulate", "-m", MODEL, "--modules", "q_proj,v_proj", "--max-rank", "16", "--requests",
     "200", "--input-tokens", "0", "--output-tokens", "0", "--max-loras", "4"],
    ["inspect", "{chat}", "{code}"],
    ["inspect", "{chat}", "{code}", "--engine", "vllm"],
    ["layout", "{chat}", "{code}", "--budget", "40GiB"],
    ["layout", "{chat}", "{code}", "--budget", "40GiB", "--tp", "4"],
    ["layout", "--engine", "vllm", "-m", "qwen3-8b", "--modules", "q_proj", "--max-rank", "16",
     "--max-loras", "4"],
    ["inspect", "{chat}", "{code}", "--engine", "sglang"],
    ["layout", "--engine", "sglang", "-m", "qwen3-8b", "--modules", "all", "--max-rank", "16",
     "--max-loras", "4", "--budget", "1GiB"],
    ["show", "{image}"],
    ["verify", "{image}", "{chat}", "{code}"],
])
@pytest.mark.parametrize("columns", [60, 80])
def test_key_value_lines_wrap_and_pasted_lines_stay_whole(
        adapters: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory,
        args: list[str], columns: int) -> None:
    """docs/cli.md: outside tables, a view's `key  value` lines and its headers wrap to the
    terminal at word boundaries, onto lines indented to the value (they ran to 170 columns at
    80), losing and splitting no word; only a line to paste or grep (`serve`, the model line, a
    path) stays whole. Every word of a 1,000-column run is in the narrow one, in order."""
    chat, code = adapters
    image = tmp_path_factory.getbasetemp() / "views-fold.safetensors"
    if not image.exists():
        assert metrale("pack", chat, code, "--max-loras", 4, "--out", image).code == 0
    argv = [a.format(chat=chat, code=code, image=image) for a in args]
    wide = metrale(*argv, columns=1000)
    narrow = metrale(*argv, columns=columns)
    assert wide.code == narrow.code

    def lines(out: str) -> list[str]:
        """Its lines outside tables and panels, the timings masked (two runs differ). A table
        opens with its blank top edge, or on its first line: a block's lines from there to its
        end are the table's. `show`'s slot table, narrower than it, is lines of its cells
        (tests/test_show.py checks them cell by cell)."""
        kept = []
        for block in (block.splitlines() for block in out.split("\n\n")):
            if block and re.match(r"slot \d+  \S", block[0]):
                continue
            rule = next((k for k, line in enumerate(block)
                         if line.lstrip().startswith("─")), len(block))
            top = max((k for k in range(rule) if not block[k].strip()), default=0)
            kept += [re.sub(r"in \S+ s \(\S+ GB/s\)", "in T", line.rstrip())
                     for line in block[:top if rule < len(block) else rule]
                     if line.strip() and line[:1] not in ("╭", "│", "╰")]
        return kept

    whole, shown = lines(wide.stdout), lines(narrow.stdout)
    assert whole
    assert " ".join(shown).split() == " ".join(whole).split()
    # Past the width: a whole line (the model line opens a view; `serve` is pasted; `wrote`,
    # `image` and a slot's `source` name a path; simulate's answer per policy is grepped), or
    # a word too long to break (a path), after its key or alone.
    kept = [line for line in shown if len(line) > columns]
    assert all((line in whole and (line.startswith(("serve ", "wrote ", "image ", "slot "))
                                   or re.match(r"[\w ()]+: (\d+ slots|no size)", line)
                                   or line == whole[0]))
               or len(line.split()) <= 2 for line in kept), kept


# -- hostile input: narrow terminals and NO_COLOR --------------------------------------------------


def test_at_80_columns_no_value_is_split_across_lines(tiny: Path, tmp_path: Path) -> None:
    image = tmp_path / "pool.safetensors"
    pack = metrale("pack", tiny / "a", "--model", tiny, "--max-loras", 2, "--out", image,
                   columns=80)
    assert pack.code == 0, pack.stderr
    fingerprint = metrale("show", image, "--json").json()["layout"]["fingerprint"]
    lines = pack.stdout.splitlines()
    assert any(line.endswith(f"layout fingerprint {fingerprint}") for line in lines), lines
    assert any(line.endswith("1 empty cache slots") for line in lines), lines
    record = metrale("layout", tiny / "a", "--model", tiny, "--max-loras", 2800, "--json").json()
    slot, pool = record["slot_bytes"], record["pool_bytes"]
    show = metrale("show", image, columns=80).stdout.splitlines()
    assert f"fingerprint  {fingerprint}" in show
    assert any(line.startswith("layout ") and f"slot {slot:,} B, 2 slots" in line
               for line in show), show
    layout = metrale("layout", tiny / "a", "--model", tiny, "--max-loras", 2800,
                     columns=80).stdout.splitlines()
    # One separator for every count of slots, as the budget line has.
    assert any(line.startswith("pool ") and f"2,800 slots: {pool:,} B (" in line
               for line in layout), layout
    assert any(line.startswith("slot ") and f"{slot:,} B (" in line for line in layout), layout


@pytest.mark.parametrize("columns", [60, 80])
def test_pack_s_summary_fits_the_terminal(tiny: Path, tmp_path: Path, columns: int) -> None:
    """`pack`'s summary lines (the pool, what was read, what was written) wrap as key/value
    lines do: its `pool: ...` line ran to 94 columns at 80. Only a path longer than the line
    may pass the width, on a line of its own."""
    image = tmp_path / "pool.safetensors"
    done = metrale("pack", tiny / "a", "--model", tiny, "--max-loras", 2, "--out", image,
                   columns=columns)
    assert done.code == 0, done.stderr
    lines = done.stdout.splitlines()
    assert all(len(line) <= columns or line.split() == [str(image)] for line in lines), lines
    text = " ".join(done.stdout.split())
    assert "2 slots x" in text and "1 empty cache slots" in text and str(image) in text


@pytest.mark.parametrize("command", ["show", "layout", "inspect"])
def test_no_color_on_a_terminal_sends_no_styles(tiny: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch,
                                                command: str) -> None:
    image = tmp_path / "pool.safetensors"
    assert metrale("pack", tiny / "a", "--model", tiny, "--max-loras", 2, "--out", image).code == 0
    args = [image] if command == "show" else [tiny / "a", "--model", tiny]
    monkeypatch.setenv("FORCE_COLOR", "1")  # Rich takes stdout for a terminal
    styled = metrale(command, *args)
    assert styled.code == 0 and "\x1b[" in styled.stdout
    monkeypatch.setenv("NO_COLOR", "1")
    plain = metrale(command, *args)
    assert plain.code == 0 and "\x1b" not in plain.stdout + plain.stderr, plain.stdout


@pytest.mark.parametrize("engine", ["metrale", "vllm", "sglang"])
def test_inspect_s_model_line_wraps_at_80_columns(tmp_path: Path, engine: str) -> None:
    """The line that opens `inspect`'s view wraps as `layout`'s model line does: Qwen3-Next's
    (its layer kinds and experts) ran to 99 columns at 80."""
    adapter = tmp_path / "a"
    assert metrale("synth", adapter, "-m", "qwen3-next-80b-a3b", "--modules", "q_proj", "-r",
                   4).code == 0
    shown = metrale("inspect", adapter, "--engine", engine, columns=80).stdout.splitlines()
    assert shown[0].startswith("qwen3-next-80b-a3b (qwen3_next): 12 full-attention")
    assert all(len(line) <= 80 for line in shown if not line.startswith("serve ")), [
        line for line in shown if len(line) > 80]
    assert shown[1].strip() == "512 routed experts"
