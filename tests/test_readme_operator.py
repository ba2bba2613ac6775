"""The README's first screen, the operator's three questions: each command runs as written and
prints the lines the README shows (the adapters' directory masked)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tests.support.cli_runner import metrale

README = Path(__file__).resolve().parents[1] / "README.md"
SHOWN_DIR = "/tmp/op"


def _transcripts() -> list[tuple[list[str], list[str]]]:
    head = README.read_text().split("## Two commands", 1)[0]
    found = []
    for block in re.findall(r"```\n(\$ metrale .*?)```", head, re.S):
        command, *lines = block.strip("\n").splitlines()
        found.append((shlex.split(command.removeprefix("$ metrale ")),
                      [line for line in lines if line != "..."]))
    return found


def test_the_first_screen_answers_three_questions() -> None:
    commands = [args[0] for args, _ in _transcripts()]
    assert commands == ["inspect", "layout", "simulate"]


@pytest.mark.parametrize(("args", "lines"), _transcripts(),
                         ids=lambda v: v[0] if isinstance(v, list) and v else None)
def test_readme_transcript(args: list[str], lines: list[str], tmp_path: Path,
                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert metrale("synth", "chat", "-m", "qwen3-8b", "--modules", "q_proj,v_proj",
                   "--rank", 16).code == 0
    assert metrale("synth", "code", "-m", "qwen3-8b", "--modules",
                   "q_proj,k_proj,v_proj,o_proj", "--rank", 64, "--seed", 1).code == 0
    # Wide: the temporary directory is longer than the README's, and its lines are not folded.
    done = metrale(*args, columns=400)
    assert done.code == 0, done.stderr
    printed = [line.rstrip() for line in done.stdout.replace(str(tmp_path), SHOWN_DIR)
               .splitlines()]
    for line in lines:
        assert line in printed, (line, done.stdout)
