"""Every command's `--help`, the whole command tree: values named INT, FLOAT, TEXT or PATH and
arguments by their metavar (`ADAPTER...`), never by a Python type (typer's `<list[str]>`,
`<int>`), and an example at the end, on one line; every example parses with its command's own
parser, and runs."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from metrale_cli.cli.options import EXAMPLE
from tests.support.cli_runner import command_tree, metrale


def _tree() -> list[tuple[list[str], Any]]:
    """(path, click command) of the root, every group and every command, in the help's order."""
    found: list[tuple[list[str], Any]] = []

    def walk(path: list[str], command: Any) -> None:
        found.append((path, command))
        for name, sub in getattr(command, "commands", {}).items():
            walk([*path, name], sub)

    walk([], command_tree())
    return found


TREE = _tree()
EXAMPLES = [(path, example) for path, command in TREE for example in command.examples]
PYTHON_TYPE = re.compile(r"<[A-Za-z_]+(?:\[[A-Za-z_, |]+\])?>")


def _ids(path: list[str]) -> str:
    return " ".join(path) or "metrale"


@pytest.mark.parametrize(("path", "command"), TREE, ids=lambda v: _ids(v) if isinstance(v, list)
                         else "")
def test_help_names_its_values_and_ends_with_an_example(path: list[str], command: Any) -> None:
    done = metrale(*path, "--help", columns=80)
    assert done.code == 0, done.output
    assert PYTHON_TYPE.findall(done.stdout) == [], done.stdout
    assert not re.search(r"\{\w+\}", done.stdout.split("\n", 1)[0])  # typer's `{adapters}`
    lines = done.stdout.splitlines()
    examples = [line.strip() for line in lines[lines.index(EXAMPLE) + 1:]] \
        if EXAMPLE in lines else []
    assert examples and all(e.startswith("metrale ") for e in examples), done.stdout
    # Each on one line, whole, though wider than the help's text: a pasted example runs.
    assert examples == command.examples


def test_values_and_arguments_are_named_as_the_brief_says() -> None:
    inspect = metrale("inspect", "--help", columns=80).stdout
    assert "inspect [OPTIONS] ADAPTER..." in inspect and "  ADAPTER...  " in inspect
    assert "--max-rank INT " in inspect and "--model TEXT " in inspect
    assert "simulate [OPTIONS] [ADAPTER...]" in metrale("simulate", "--help").stdout
    assert "show [OPTIONS] IMAGE" in metrale("show", "--help").stdout
    assert "--alpha FLOAT " in metrale("synth", "--help").stdout
    assert "--trace PATH " in metrale("simulate", "--help").stdout
    assert "-r, --rank INT " in metrale("bench", "kernels", "--help").stdout


def _resolve(words: list[str]) -> tuple[list[str], Any, list[str]]:
    """The command an example's words name, and the arguments left for it."""
    path: list[str] = []
    command = command_tree()
    rest = list(words)
    while rest and rest[0] in getattr(command, "commands", {}):
        path.append(rest[0])
        command = command.commands[rest.pop(0)]
    return path, command, rest


@pytest.mark.parametrize(("path", "example"), EXAMPLES, ids=lambda v: v if isinstance(v, str)
                         else None)
def test_every_example_parses(path: list[str], example: str) -> None:
    """The example's command takes its options and arguments (a typo, a type that does not
    convert, a missing required option would fail here without running anything)."""
    words = shlex.split(example)
    assert words[0] == "metrale"
    target, command, rest = _resolve(words[1:])
    assert target[:len(path)] == path or not path, (path, target)
    assert not hasattr(command, "commands"), f"{example}: names a group, not a command"
    context = command.make_context(" ".join(["metrale", *target]), rest)
    assert context.params


@pytest.fixture(scope="module")
def examples_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The adapters the examples name: `chat` and `code`, two small Qwen3-8B adapters."""
    here = tmp_path_factory.mktemp("examples")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(here)
        for name, rank, seed in (("chat", 16, 0), ("code", 8, 1)):
            made = metrale("synth", name, "-m", "qwen3-8b", "--modules", "q_proj,v_proj",
                           "--rank", rank, "--seed", seed)
            assert made.code == 0, made.output
    return here


@pytest.mark.slow
def test_every_example_runs(examples_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each example, in the help's order, in one directory (pack's image is what show, verify
    and unpack read); exit 0, or 3 (no GPU) for a benchmark of the CUDA kernels where no GPU is
    usable."""
    from metrale_cli import compat

    monkeypatch.chdir(examples_dir)
    gpu, _ = compat.gpu_status()
    failed = []
    for _, example in EXAMPLES:
        done = metrale(*shlex.split(example)[1:])
        allowed = {0} if gpu or "bench kernels" not in example or "--model-only" in example \
            else {3}
        if done.code not in allowed or not done.output.strip():
            failed.append(f"{example}: exit {done.code}\n{done.output}")
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize(("path", "command"), TREE, ids=lambda v: _ids(v) if isinstance(v, list)
                         else "")
def test_dash_h_is_help_everywhere(path: list[str], command: Any) -> None:
    short = metrale(*path, "-h", columns=80)
    assert short.code == 0, short.output
    assert short.stdout == metrale(*path, "--help", columns=80).stdout
    assert "-h, --help" in short.stdout


@pytest.mark.parametrize(("path", "command"), TREE, ids=lambda v: _ids(v) if isinstance(v, list)
                         else "")
def test_a_command_s_help_names_only_options_it_takes(path: list[str], command: Any) -> None:
    """`synth`, `bench pack` and `bench kernels` said --model reads the hub with `--online`,
    an option they did not take. A command that answers for an engine also names the engine's
    own flags (vLLM's `--max-lora-rank`), which this leaves out."""
    params = getattr(command, "params", [])
    own = {o for p in params for o in getattr(p, "opts", [])} | {"--help", "-h"}
    if "--engine" in own or hasattr(command, "commands"):  # a group's example is a command's
        return
    out = metrale(*path, "--help", columns=80).stdout
    named = set(re.findall(r"(?<![\w-])--[a-z][\w-]*", out))
    assert named <= own, named - own


# More options than this in one list, and a command's help groups them in panels.
MANY_OPTIONS = 16


@pytest.mark.parametrize(("path", "command"), TREE, ids=lambda v: _ids(v) if isinstance(v, list)
                         else "")
def test_a_command_with_many_options_groups_them_in_panels(path: list[str],
                                                           command: Any) -> None:
    """`inspect` (24 options) and `layout` (25) were one list each, as `simulate`'s 56 were:
    every option but --json and --help is in the panel of what it sets, each panel's options
    in the panel's order, --json and --help last under Options."""
    flags = [p.opts[0] for p in getattr(command, "params", []) if p.param_type_name == "option"]
    if len(flags) <= MANY_OPTIONS:
        return
    panels = command.panels
    paneled = [f for panel in panels.values() for f in panel]
    assert len(paneled) == len(set(paneled))
    assert set(paneled) - {"--json"} == set(flags) - {"--json"}, set(flags) ^ set(paneled)
    out = metrale(*path, "--help", columns=80).stdout
    headings = [line for line in out.splitlines() if line.endswith(":") and line[0] != " "]
    assert headings == ["Arguments:", *(f"{t}:" for t in panels), "Options:", "Example:"]
    first = next(iter(panels))
    shown = re.findall(r"^  (?:-\w, )?(--[\w-]+)", out[out.index(f"\n{first}:"):],
                       flags=re.MULTILINE)
    assert shown == [*paneled, *(f for f in ("--json", "--help") if f not in paneled)]


def test_shell_completion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Typer's completion: the script to show or install for the shell it runs in (found from
    the processes above it: bash here, whatever runs the tests), and the completions it asks
    for."""
    import shellingham

    monkeypatch.setattr(shellingham, "detect_shell", lambda: ("bash", "/bin/bash"))
    shown = metrale("--show-completion")
    assert shown.code == 0 and "_METRALE_COMPLETE=complete_bash" in shown.stdout, shown.output
    monkeypatch.setenv("HOME", str(tmp_path))
    installed = metrale("--install-completion")
    assert installed.code == 0, installed.output
    assert "_METRALE_COMPLETE=complete_bash" in (tmp_path / ".bash_completions"
                                                 / "metrale.sh").read_text()
    monkeypatch.setenv("_METRALE_COMPLETE", "complete_bash")
    monkeypatch.setenv("COMP_WORDS", "metrale inspect --eng")
    monkeypatch.setenv("COMP_CWORD", "2")
    assert metrale().stdout.split() == ["--engine", "--engine-python", "--engine-args"]


def test_a_missing_argument_shows_the_usage_on_its_line() -> None:
    done = metrale("inspect")
    assert done.code == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr == ("error: Missing argument 'ADAPTER...'. Usage: metrale inspect "
                           "[OPTIONS] ADAPTER... (metrale inspect -h for help)\n")


@pytest.mark.parametrize("path", [["synth"], ["pack"], ["bench", "pack"], ["bench", "kernels"]])
def test_modules_help_names_only_the_values_the_command_takes(path: list[str]) -> None:
    """These commands build metrale's own pool: every module a family may declare (the help
    named the seed's eight only), no --engine, so no engine's module names."""
    from metrale_cli.model.modules import LoraModule

    shown = " ".join(metrale(*path, "--help", columns=200).stdout.split())
    said = shown[shown.index("--modules TEXT"):]
    said = said[:said.index(" --", len("--modules TEXT"))]
    assert {m.value for m in LoraModule} <= set(re.findall(r"\w+", said)) and "or 'all'" in said
    assert "engine" not in said.lower() and "--engine" not in shown


def test_the_command_tree_is_built_without_compiling_an_annotation() -> None:
    """`metrale --help` builds every command's options from its function's annotations: each
    one a string (`from __future__ import annotations`) is compiled anew at every start, most of
    what --help took beyond importing typer and rich (1.66x of that import, now about 1.4x:
    scripts/bench_startup.py)."""
    from metrale_cli.cli.app import app

    callbacks = [app.registered_callback.callback] if app.registered_callback else []
    for typer_app in (app, *(g.typer_instance for g in app.registered_groups)):
        callbacks += [c.callback for c in typer_app.registered_commands]
    assert len(callbacks) >= 12
    strings = {f"{fn.__module__}.{fn.__name__}({name})" for fn in callbacks
               for name, hint in fn.__annotations__.items() if isinstance(hint, str)}
    assert not strings
