"""Every `$ metrale ...` transcript in README.md and docs/*.md prints what the tool prints, session
by session (tests/support/transcripts.py: how blocks are found, run and masked; `python -m
tests.support.transcripts --update` rewrites them), and the machinery itself holds."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import transcripts
from tests.support.transcripts import Block, masked, matches, parse, rewritten

SESSIONS = transcripts.sessions()


def _cost(blocks: list[Block]) -> list[pytest.MarkDecorator]:
    """A session's cost markers: every one runs real-size commands (a layout of Qwen3-Next's
    73,776 expert entries takes seconds), simulate sweeps, and some a shell command."""
    words = [c.text.split()[:2] for b in blocks if b.skip is None
             for c in (*b.setup, *b.commands)]
    marks = [pytest.mark.slow]
    if ["metrale", "simulate"] in words:
        marks.append(pytest.mark.sweep)
    if any(w[0] not in ("metrale", "python", "python3") for w in words):
        marks.append(pytest.mark.proc)
    return marks


@pytest.mark.parametrize("name", [pytest.param(name, marks=_cost(blocks), id=name)
                                  for name, blocks in SESSIONS.items()])
def test_transcripts_print_what_the_tool_prints(name: str, tmp_path: Path) -> None:
    stale = [f"{o.block.where}: `{o.command.text}`\n"
             f"{transcripts.difference(o.command.shown, o.printed)}"
             for o in transcripts.run_session(SESSIONS[name], tmp_path)
             if not matches(o.command.shown, o.printed)]
    assert not stale, ("stale transcripts (`python -m tests.support.transcripts --update "
                       f"--session {name}` rewrites them):\n" + "\n".join(stale))


def test_every_document_with_a_transcript_is_read() -> None:
    """README.md and the docs both hold transcripts, and every block has a command."""
    docs = {block.doc.name for blocks in SESSIONS.values() for block in blocks}
    assert {"README.md", "layout.md", "verify.md", "tensor-parallel.md"} <= docs
    assert all(block.commands for blocks in SESSIONS.values() for block in blocks)


def test_skipped_blocks_are_few_and_say_why() -> None:
    skipped = [block for blocks in SESSIONS.values() for block in blocks if block.skip]
    assert len(skipped) <= transcripts.MAX_SKIPS, [b.where for b in skipped]
    assert all(len(block.skip.split()) >= 3 for block in skipped), [b.skip for b in skipped]


def test_the_readme_opens_with_two_commands_install_and_a_quickstart() -> None:
    """README's first sections: the two commands, install, then a vLLM operator's three
    questions (inspect, layout, simulate, in that order), then the worked example."""
    head = transcripts.ROOT / "README.md"
    sections = [(n, line.split(":")[0]) for n, line in
                enumerate(head.read_text().splitlines(), 1) if line.startswith("## ")]
    assert [name for _, name in sections[:4]] == ["## Two commands", "## Install",
                                                  "## Quickstart", "## Worked example"]
    start, end = sections[2][0], sections[3][0]
    commands = [c.argv[1] for block in SESSIONS["operator"] if block.doc == head
                and start < block.line < end for c in block.commands]
    assert commands == ["inspect", "layout", "simulate"]


# -- the machinery ------------------------------------------------------------------------------


def test_an_elision_stands_for_any_lines_and_nothing_else() -> None:
    printed = ["a", "b", "c", "d"]
    assert matches(["a", "b", "c", "d"], printed)
    assert matches(["...", "b", "c", "..."], printed)
    assert matches(["a", "...", "d"], printed)
    assert matches(["a", "...", "c", "d"], printed)
    assert not matches(["a", "b", "c"], printed)      # no elision at the tail
    assert not matches(["...", "b", "d"], printed)    # b and d are not adjacent
    assert not matches(["a", "...", "c", "b"], printed)
    assert not matches(["a", "b", "x", "d"], printed)
    assert matches(["a  ", "b", "c", "d", ""], printed)  # trailing spaces and blank lines


def test_masks_hide_wall_times_only() -> None:
    line = "packed 26.06 MiB of adapter tensors in 0.129 s (0.21 GB/s)"
    assert masked([line]) == masked(["packed 26.06 MiB of adapter tensors in 12.5 s (0.02 GB/s)"])
    assert masked([line]) != masked(["packed 26.07 MiB of adapter tensors in 0.129 s (0.21 GB/s)"])
    simulated = "lru  16  67.31  12,794  9,153  1.81 s  1.71 s  53.6 s  1.63"
    assert masked([simulated]) == [simulated]  # simulated seconds are results, not wall time
    table = ["  rank   slot bytes        read   GB/s   layout fingerprint",
             "  0       8,060,928   13.41 MiB   0.23   d0b7417a95f7bab2a2ccd977b07e271f", ""]
    faster = [table[0], table[1].replace("   0.23", "  10.51"), ""]
    assert masked(table) == masked(faster)
    assert masked(table) != masked([table[0], table[1].replace("d0b7", "d0b8"), ""])


def test_rewriting_keeps_the_elisions_and_the_written_timings() -> None:
    printed = ["model  m: a value that no longer folds", "slot   1 B", "wrote x in 0.9 s", "tail"]
    shown = ["...", "model  m: a value that no", "       longer folds", "slot   2 B",
             "wrote x in 0.1 s", "..."]
    assert rewritten(shown, printed) == ["...", *printed[:2], "wrote x in 0.1 s", "..."]
    assert rewritten(["x"], printed) == printed
    assert rewritten(["...", "nothing like it", "..."], printed) is None


@pytest.mark.proc  # the setup's mkdir runs under bash
def test_update_rewrites_a_stale_block_and_its_directives_hold(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text("Prose quoting `<!-- transcript: skip -->`.\n\n<!-- transcript: setup\n"
                   "$ mkdir sub\n-->\n```\n$ metrale models\n"
                   "an old table\n```\n\n<!-- transcript: skip needs a GPU to run -->\n```\n"
                   "$ metrale bench kernels\nanything\n```\n")
    blocks = parse(doc)
    assert [b.skip for b in blocks] == [None, "needs a GPU to run"]
    assert [c.text for c in blocks[0].setup] == ["mkdir sub"]
    outcomes = list(transcripts.run_session(blocks, tmp_path))
    assert (tmp_path / "sub").is_dir() and len(outcomes) == 1
    assert not matches(outcomes[0].command.shown, outcomes[0].printed)
    assert transcripts.update(outcomes) == []
    again = parse(doc)
    assert matches(again[0].commands[0].shown, outcomes[0].printed)
    text = doc.read_text()
    assert "qwen3-8b" in text and "$ metrale bench kernels\nanything\n" in text  # skipped: kept


@pytest.mark.parametrize(("text", "message"), [
    ("<!-- transcript: skip -->\n```\n$ metrale models\n```\n", "needs its reason"),
    ("<!-- transcript: sesion x -->\n```\n$ metrale models\n```\n", "unknown transcript"),
    ("<!-- transcript: skip a reason here -->\n```json\n{}\n```\n", "is no `. metrale`"),
    ("```console\n$ metrale models\n```\n<!-- transcript: skip x y z -->\n", "not followed"),
    ("<!-- transcript: skip a reason here -->\nprose\n```\n$ metrale models\n```\n",
     "not followed"),
    ("```\noutput\n$ metrale models\n```\n", "before its first"),
], ids=["skip-without-reason", "unknown", "not-a-transcript", "at-the-end", "not-followed",
     "output-first"])
def test_a_malformed_transcript_is_named(text: str, message: str, tmp_path: Path) -> None:
    (tmp_path / "doc.md").write_text(text)
    with pytest.raises(ValueError, match=message):
        parse(tmp_path / "doc.md")
