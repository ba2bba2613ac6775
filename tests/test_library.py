"""The library API: every name of `metrale_cli.__all__` resolves, lazily, and docs/library.md's
examples run as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import metrale_cli

DOC = Path(__file__).resolve().parents[1] / "docs" / "library.md"


def test_every_name_resolves_and_is_listed() -> None:
    for name in metrale_cli.__all__:
        assert getattr(metrale_cli, name) is not None, name
    assert set(metrale_cli.__all__) <= set(dir(metrale_cli))
    assert metrale_cli.simulate.__module__ == "metrale_cli.sim.simulate"
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        metrale_cli.not_a_name  # noqa: B018


def test_import_is_lazy() -> None:
    """`import metrale_cli` loads no stage; the first use of a name loads its own."""
    code = ("import sys, metrale_cli\n"
            "before = sorted(m for m in sys.modules if m.startswith('metrale_cli.'))\n"
            "metrale_cli.SlotLayout\n"
            "print(before, 'numpy' in sys.modules, 'metrale_cli.layout.slot_layout' in "
            "sys.modules, 'metrale_cli.pool.pool' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    assert done.stdout.split() == ["[]", "False", "True", "False"]


def test_import_metrale_is_the_api_under_the_install_name() -> None:
    """The distribution is `metrale`: `import metrale` gives every name of the API, the same
    objects as `metrale_cli`'s, lazily (no stage, no NumPy on import)."""
    import metrale

    assert metrale.__all__ == metrale_cli.__all__ and metrale.__version__ == \
        metrale_cli.__version__
    for name in metrale.__all__:
        assert getattr(metrale, name) is getattr(metrale_cli, name), name
    assert set(metrale.__all__) <= set(dir(metrale))
    with pytest.raises(AttributeError, match="module 'metrale' has no attribute 'cli'"):
        metrale.cli  # noqa: B018
    with pytest.raises(metrale.UsageError, match="resolve_model: spec must be str, got None"):
        metrale.resolve_model(None)
    code = ("import sys, metrale\n"
            "print(sorted(m for m in sys.modules if m.startswith('metrale_cli.')), "
            "'numpy' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, cwd=DOC.parents[1])
    assert done.stdout.split() == ["[]", "False"]


def test_every_documented_name_is_in_the_api() -> None:
    """The recipes import from `metrale`, the name users install (they imported from
    `metrale_cli`, the command's package), and only names of its API."""
    text = DOC.read_text()
    imported = {name.strip() for line in re.findall(r"^from metrale import (.+)$", text, re.M)
                for name in line.split(",")}
    assert imported and imported <= set(metrale_cli.__all__)
    assert not re.findall(r"^from metrale_cli import", text, re.M)


def test_the_examples_run_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert len(blocks) >= 6
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for i, block in enumerate(blocks):
        exec(compile(block, f"{DOC.name} example {i + 1}", "exec"), namespace)
    out = capsys.readouterr().out
    # What the comments in the examples say they print.
    assert "1 of 2 adapter(s) not servable: chat" in out
    assert "chat: rank_above_max: " in out
    assert "[2, 3]" in out
    assert "code: naming it in --lora-paths stops the server from starting" in out
    assert "layer 0 has q_proj without v_proj" in out
    assert (tmp_path / "chat-again" / "adapter_config.json").is_file()


def test_help_imports_no_stage() -> None:
    """`metrale --help` loads the CLI and the root's leaves only: no stage of the library (each
    command imports its own), which keeps its start near a bare `import typer, rich`."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "metrale_cli", "--help"],
                          capture_output=True, text=True, check=True)
    loaded = {line.split("|")[-1].strip() for line in done.stderr.splitlines()
              if line.startswith("import time:")}
    ours = {m for m in loaded if m.startswith("metrale_cli.")}
    stages = {m for m in ours if not m.startswith("metrale_cli.cli")
              and m.split(".")[1] not in ("errors", "env", "compat", "bf16", "kernel_config")}
    assert ours and not stages, sorted(stages)
    from metrale_cli.layout.slot_layout import DEFAULT_ALIGN

    # The --align default is written in its help, not imported: the two must agree.
    assert f"default {DEFAULT_ALIGN}, the layout's" in " ".join(
        subprocess.run([sys.executable, "-m", "metrale_cli", "layout", "--help"],
                       capture_output=True, text=True, check=True).stdout.split())
