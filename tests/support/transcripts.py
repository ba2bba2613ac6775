"""The `$ metrale ...` transcripts of README.md and docs/*.md: found, run as written and compared
with what the tool prints (tests/test_transcripts.py), or rewritten from it:

    python -m tests.support.transcripts            # check every transcript, list the mismatches
    python -m tests.support.transcripts --update   # rewrite each block's output from the tool
    python -m tests.support.transcripts --list     # the sessions, their blocks and skips

(`--session NAME` limits any of them to one session.)

A transcript is a fenced block (any info string) holding a line that starts `$ metrale `.
Its lines starting `$ ` are commands (a trailing backslash continues one, a heredoc runs to its
terminator); the lines after a command, up to the next, are what it prints: stdout and stderr
as a terminal shows them, COLUMNS=100. A line `...` stands for any number of lines the text
leaves out. `metrale` commands run in this process (tests/support/cli_runner.py), `python -
<<'EOF'` recipes are executed in it too (as tests/test_docs.py executes the docs' code), any
other command runs under bash.

The blocks run in sessions, each in a fresh directory, in order: README.md first, then docs/*.md
by name. A document's blocks are one session unless HTML comments on the lines above a block
(blank lines between them and the fence allowed) say otherwise:

    <!-- transcript: session NAME -->   this block and the document's later ones run in session
                                        NAME; a NAME another document opened continues there
                                        (its directory, after that document's blocks)
    <!-- transcript: setup              commands run before the block, in its directory; their
    $ metrale synth chat ...            output is not shown, and each must exit 0
    -->
    <!-- transcript: skip REASON -->    the block is not run (it needs a GPU or an engine
                                        process); the test keeps these few, each with a reason

Before comparing, each side's lines lose trailing spaces and trailing blank lines, and MASKS
replace what differs from run to run: the session's directory is shown as /tmp/op, and wall
times and throughputs become `<t>`; in a line a mask changed, runs of spaces count as one (a
table column may widen). Lines of PROGRESS (stderr's progress off a terminal) are dropped: a
terminal's bar vanishes.

`--update` writes what the tool prints now, keeping a line as written when it equals the new one
under the masks (the docs' timings do not churn). An excerpt keeps its elisions: each stretch it
shows becomes the printed lines it stands for now (its lines paired in order with the printed
lines most alike, a folded value counting as one line, and its last value's continuation lines
taken along); a stretch with no counterpart is reported, to be rewritten by hand. Review the
diff: a change it shows is a change in what the tool prints.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import os
import re
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COLUMNS = 100
SHOWN_DIR = "/tmp/op"
ELISION = "..."
MAX_SKIPS = 3  # blocks that cannot run here (GPU, engine processes); each carries its reason

# Wall-clock figures: the same command prints others on every run.
MASKS = (
    re.compile(r"(?<= in )\d[\d,]*(?:\.\d+)? (?:s|ms)\b"),  # "packed ... in 0.129 s"
    re.compile(r"\d[\d,]*(?:\.\d+)?(?= [GMK]B/s\b)"),         # "(0.21 GB/s)"
)
# A column of throughputs under a `GB/s` header (pack --tp's rank table).
RATE_HEADER = "GB/s"
PROGRESS = re.compile(r"^(?:packing|writing the image|verifying|reading|simulating): \d+% of "
                      r"[\d,]+(?:\.\d)? (?:MiB|request replays)$")
DIRECTIVE = re.compile(r"<!--\s*transcript:\s*(\w+)\s*(.*?)\s*-->", re.S)


@dataclass
class Command:
    text: str               # as written, without the `$ ` (continuation lines kept)
    shown: list[str]        # the lines the text shows it printing
    out_start: int = 0      # the doc's line index of its first output line
    out_end: int = 0        # one past its last

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.text.replace("\\\n", " "))


@dataclass
class Block:
    doc: Path
    line: int               # 1-based line of the opening fence
    session: str
    commands: list[Command]
    setup: list[Command] = field(default_factory=list)
    skip: str | None = None

    @property
    def where(self) -> str:
        return f"{_name(self.doc)}:{self.line}"


@dataclass
class Outcome:
    block: Block
    command: Command
    code: int
    printed: list[str]       # masked for the directory, progress dropped; timings as printed


def _name(doc: Path) -> str:
    """A document as the messages name it: its path in the checkout."""
    return str(doc.relative_to(ROOT)) if doc.is_relative_to(ROOT) else str(doc)


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def parse_commands(lines: list[str], base: int, where: str) -> list[Command]:
    """A block's lines (the doc's lines from index `base`) as commands with their output."""
    commands: list[Command] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("$ "):
            text = [line[2:]]
            while text[-1].endswith("\\") and i + 1 < len(lines):
                i += 1
                text.append(lines[i])
            heredoc = re.search(r"<<-?\s*'?\"?(\w+)", line)
            if heredoc:
                while i + 1 < len(lines) and lines[i].strip() != heredoc.group(1):
                    i += 1
                    text.append(lines[i])
            commands.append(Command("\n".join(text), [], base + i + 1, base + i + 1))
        elif not commands:
            raise ValueError(f"{where}: a transcript line before its first `$` command: {line!r}")
        else:
            commands[-1].shown.append(line)
            commands[-1].out_end = base + i + 1
        i += 1
    return commands


def _directives(block: Block, directives: list[tuple[str, str, str]]) -> None:
    """Apply the directives written above a block (each (word, rest, where))."""
    for word, rest, where in directives:
        if word == "session" and rest:
            block.session = rest
        elif word == "setup":
            block.setup = parse_commands(rest.splitlines(), 0, where)
            if any(command.shown for command in block.setup):
                raise ValueError(f"{where}: a setup shows no output: each line a `$ ` command")
        elif word == "skip" and rest:
            block.skip = rest
        elif word in ("session", "skip"):
            what = "NAME" if word == "session" else "reason"
            raise ValueError(f"{where}: `{word}` needs its {what}")
        else:
            raise ValueError(f"{where}: unknown transcript directive {word!r} (session, setup, "
                             "skip)")


def parse(doc: Path) -> list[Block]:
    """The transcripts of one document, with their directives."""
    lines = doc.read_text().splitlines()
    blocks: list[Block] = []
    session = _name(doc)
    pending: list[tuple[str, str, str]] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if re.match(r"<!--\s*transcript:", line):  # at a line's start: prose may quote one
            start = i
            while "-->" not in lines[i]:
                i += 1
            found = DIRECTIVE.search("\n".join(lines[start:i + 1]))
            if found is None:
                raise ValueError(f"{_name(doc)}:{start + 1}: a transcript comment is "
                                 "`<!-- transcript: WORD ... -->`")
            pending.append((found.group(1), found.group(2), f"{_name(doc)}:{start + 1}"))
        elif line.startswith("```"):
            end = i + 1
            while not lines[end].startswith("```"):
                end += 1
            body = lines[i + 1:end]
            if any(b.startswith("$ metrale ") for b in body):  # whatever the info string
                block = Block(doc, i + 1, session,
                              parse_commands(body, i + 1, f"{_name(doc)}:{i + 1}"))
                _directives(block, pending)
                session = block.session  # a session directive holds for the later blocks
                blocks.append(block)
            elif pending:
                raise ValueError(f"{pending[0][2]}: a transcript directive above a block that "
                                 "is no `$ metrale` transcript")
            pending = []
            i = end
        elif line.strip() and pending:
            break
        i += 1
    if pending:
        raise ValueError(f"{pending[0][2]}: a transcript directive not followed by its block")
    return blocks


def sessions(docs: list[Path] | None = None) -> dict[str, list[Block]]:
    """Every transcript block, by session, in the order they run."""
    found: dict[str, list[Block]] = {}
    for doc in documents() if docs is None else docs:
        for block in parse(doc):
            found.setdefault(block.session, []).append(block)
    return found


# -- running ------------------------------------------------------------------------------------


def _run(command: Command, workdir: Path) -> tuple[int, str]:
    """Run one command in `workdir` (the current directory): its exit code and what it printed."""
    if command.text.split(None, 1)[0] == "metrale":
        from tests.support.cli_runner import metrale

        result = metrale(*command.argv[1:], columns=COLUMNS)
        return result.code, result.output
    heredoc = re.fullmatch(r"python3? - <<'?(\w+)'?\n(.*)\n\1", command.text, re.S)
    if heredoc:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            try:
                exec(compile(heredoc.group(2), "<transcript>", "exec"), {"__name__": "__main__"})
            except SystemExit as exc:
                return exc.code if isinstance(exc.code, int) else 1, printed.getvalue()
        return 0, printed.getvalue()
    bindir = str(Path(sys.executable).parent)
    done = subprocess.run(["bash", "-c", command.text], cwd=workdir, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600,
                          env={**os.environ, "PATH": f"{bindir}:{os.environ.get('PATH', '')}",
                               "PYTHONPATH": str(ROOT), "COLUMNS": str(COLUMNS)})
    return done.returncode, done.stdout


def _printed(text: str, workdir: Path) -> list[str]:
    """What a command printed as the docs show it: the directory as SHOWN_DIR, no progress."""
    for path in sorted({str(workdir.resolve()), str(workdir)}, key=len, reverse=True):
        text = text.replace(path, SHOWN_DIR)
    lines = [line.rstrip() for line in text.splitlines() if not PROGRESS.match(line.strip())]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def run_session(blocks: list[Block], workdir: Path) -> Iterator[Outcome]:
    """Run a session's blocks in `workdir`, yielding each command's outcome; a failing setup
    command raises, naming its block."""
    before = os.getcwd()
    os.chdir(workdir)  # contextlib.chdir is Python 3.11's; metrale takes 3.10
    try:
        for block in blocks:
            if block.skip is not None:
                continue
            for command in block.setup:
                code, text = _run(command, workdir)
                if code != 0:
                    raise RuntimeError(f"{block.where}: setup `{command.text}` exited {code}:\n"
                                       f"{text}")
            for command in block.commands:
                code, text = _run(command, workdir)
                yield Outcome(block, command, code, _printed(text, workdir))
    finally:
        os.chdir(before)


# -- comparing ----------------------------------------------------------------------------------


def _rate_columns(lines: list[str]) -> list[int | None]:
    """Per line, the end of the RATE_HEADER column it sits in: a table row below a header
    that has a `GB/s` column (not a `(... GB/s)` figure), up to the table's end (a blank
    line)."""
    columns: list[int | None] = []
    column = None
    for line in lines:
        at = line.find(f" {RATE_HEADER}")
        if at >= 0 and not re.search(rf"\d {re.escape(RATE_HEADER)}", line):
            column = at + 1 + len(RATE_HEADER)
            columns.append(None)
            continue
        if not line.strip():
            column = None
        columns.append(column)
    return columns


def masked(lines: list[str]) -> list[str]:
    """Each line with its wall-clock figures as `<t>` (runs of spaces as one where one was)."""
    result = []
    for line, column in zip(lines, _rate_columns(lines), strict=True):
        new = line
        if column is not None:
            new = re.sub(r"\d+(?:\.\d+)?$", "<t>", new[:column]) + new[column:]
        for mask in MASKS:
            new = mask.sub("<t>", new)
        result.append(" ".join(new.split()) if new != line else new)
    return result


def _segments(shown: list[str]) -> tuple[list[list[str]], bool, bool]:
    """The shown lines split at elisions, and whether the text elides its head and its tail."""
    lines = [line.rstrip() for line in shown]
    while lines and not lines[-1]:
        lines.pop()
    parts: list[list[str]] = [[]]
    for line in lines:
        if line.strip() == ELISION:
            parts.append([])
        else:
            parts[-1].append(line)
    open_head = len(parts) > 1 and not parts[0]
    open_tail = len(parts) > 1 and not parts[-1]
    return parts[open_head:len(parts) - open_tail], open_head, open_tail


def _find(segment: list[str], lines: list[str], start: int) -> int:
    for at in range(start, len(lines) - len(segment) + 1):
        if lines[at:at + len(segment)] == segment:
            return at
    return -1


def matches(shown: list[str], printed: list[str]) -> bool:
    """Whether the printed lines are the shown ones, elisions standing for any lines."""
    segments, open_head, open_tail = _segments(shown)
    got = masked(printed)
    if len(segments) == 1 and not (open_head or open_tail):
        return masked(segments[0]) == got
    at = 0
    for n, segment in enumerate(segments):
        want = masked(segment)
        if n == 0 and not open_head:
            if got[:len(want)] != want:
                return False
            at = len(want)
            continue
        if n == len(segments) - 1 and not open_tail:
            return len(got) - len(want) >= at and got[len(got) - len(want):] == want
        found = _find(want, got, at)
        if found < 0:
            return False
        at = found + len(want)
    return True


def difference(shown: list[str], printed: list[str]) -> str:
    return "\n".join(difflib.unified_diff(shown, printed, "shown", "printed", lineterm=""))


# -- rewriting ----------------------------------------------------------------------------------


def _inner(line: str) -> str:
    """A line without a panel's left border (`│ `), whose rows fold as fields do."""
    return line[2:] if line.startswith("│ ") else line


def _continues(line: str, previous: str) -> bool:
    """Whether `line` continues the value of `previous`, a `label   value` line
    (render.fields' layout: the value folded onto lines indented to its column)."""
    line, previous = _inner(line), _inner(previous)
    found = re.match(r"^(\S+(?: \S+)*\s{2,})\S", previous) or re.match(r"^(\s+)\S", previous)
    if found is None:
        return False
    column = len(found.group(1))
    return len(line) > column and not line[:column].strip() and line[column] != " "


def _unfolded(segment: list[str]) -> list[list[str]]:
    """A segment's lines grouped as values: a label line with the lines that continue it."""
    groups: list[list[str]] = []
    for line in segment:
        if groups and groups[-1][-1].strip() and _continues(line, groups[-1][0]):
            groups[-1].append(line)
        else:
            groups.append([line])
    return groups


def _similarity(group: list[str], line: str) -> float:
    """How alike a shown value (its folded lines joined) and a printed line are, 0 to 1."""
    if not group[0].strip():
        return 1.0 if not line.strip() else 0.0
    value = " ".join(" ".join(_inner(g).split()) for g in group)
    return difflib.SequenceMatcher(None, value, " ".join(_inner(line).split())).ratio()


def _place(segment: list[str], printed: list[str], start: int) -> tuple[int, int] | None:
    """The span of `printed` (from `start`) that a shown segment stands for now: an exact
    match under the masks, else the in-order pairing of each shown value (a value folded over
    lines counts as one) with a printed line that is most alike in all, every pair at least
    0.6 alike, extended over the continuation lines of the last. None if there is none."""
    want, got = masked(segment), masked(printed)
    exact = _find(want, got, start)
    if exact >= 0:
        return exact, exact + len(want)
    groups, lines = _unfolded(want), got[start:]
    score = [[_similarity(g, line) for line in lines] for g in groups]
    # best[i][j]: the most alike pairing of the first i values with the first j lines.
    none = float("-inf")
    best = [[0.0] * (len(lines) + 1)] + [[none] * (len(lines) + 1) for _ in groups]
    for i in range(1, len(groups) + 1):
        for j in range(1, len(lines) + 1):
            paired = score[i - 1][j - 1]
            best[i][j] = max(best[i][j - 1],
                             best[i - 1][j - 1] + paired if paired >= 0.6 else none)
    if best[len(groups)][len(lines)] == none:
        return None
    placed, j = [], len(lines)
    for i in range(len(groups), 0, -1):
        while best[i][j] == best[i][j - 1]:
            j -= 1
        placed.append(start + j - 1)
        j -= 1
    first, last = placed[-1], placed[0]
    head = last
    while last + 1 < len(printed) and _continues(printed[last + 1], printed[head]):
        last += 1
    return first, last + 1


def rewritten(shown: list[str], printed: list[str]) -> list[str] | None:
    """The block's new output lines: `printed` where nothing is elided, else each shown segment
    replaced by the printed lines it stands for now; lines equal under the masks stay as
    written. None if a segment cannot be placed."""
    segments, open_head, open_tail = _segments(shown)
    if len(segments) == 1 and not (open_head or open_tail):
        spans = [(0, len(printed))]
    else:
        spans, at = [], 0
        for n, segment in enumerate(segments):
            if n == 0 and not open_head:
                span = _place(segment, printed, 0)
                if span is not None:
                    span = (0, span[1])
            elif n == len(segments) - 1 and not open_tail:
                span = _place(segment, printed, at)
                if span is not None:
                    span = (span[0], len(printed))
            else:
                span = _place(segment, printed, at)
            if span is None:
                return None
            spans.append(span)
            at = span[1]
    old = [line for seg in segments for line in seg]
    old_masked = dict(zip(masked(old), old, strict=True))
    result: list[str] = []
    for n, (start, end) in enumerate(spans):
        if n or open_head:
            result.append(ELISION)
        new = printed[start:end]
        result.extend(old_masked.get(m, line) for m, line in zip(masked(new), new, strict=True))
    if open_tail:
        result.append(ELISION)
    return result


def update(blocks_run: list[Outcome]) -> list[str]:
    """Rewrite each run command's output in its document; the problems, one line each."""
    problems: list[str] = []
    edits: dict[Path, list[tuple[int, int, list[str]]]] = {}
    for outcome in blocks_run:
        new = rewritten(outcome.command.shown, outcome.printed)
        if new is None:
            problems.append(f"{outcome.block.where}: `{outcome.command.text}`: a shown line no "
                            "longer has a counterpart; rewrite the block by hand:\n"
                            + difference(outcome.command.shown, outcome.printed))
            continue
        if new != outcome.command.shown:
            edits.setdefault(outcome.block.doc, []).append(
                (outcome.command.out_start, outcome.command.out_end, new))
    for doc, changes in edits.items():
        lines = doc.read_text().splitlines()
        for start, end, new in sorted(changes, reverse=True):
            lines[start:end] = new
        temporary = doc.with_name(f".{doc.name}.transcripts")
        temporary.write_text("\n".join(lines) + "\n")
        os.replace(temporary, doc)
        print(f"rewrote {len(changes)} transcript(s) in {_name(doc)}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.transcripts",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--update", action="store_true",
                        help="rewrite each block's output from the tool")
    parser.add_argument("--list", action="store_true", help="list the sessions and skips")
    parser.add_argument("--session", action="append", help="only this session (repeatable)")
    args = parser.parse_args(argv)
    found = sessions()
    if args.session:
        unknown = set(args.session) - set(found)
        if unknown:
            parser.error(f"no session {', '.join(sorted(unknown))}; there are "
                         f"{', '.join(found)}")
        found = {name: found[name] for name in args.session}
    if args.list:
        for name, blocks in found.items():
            print(f"{name}: {sum(len(b.commands) for b in blocks)} commands in "
                  f"{len(blocks)} blocks")
            for block in blocks:
                if block.skip:
                    print(f"  {block.where} skipped: {block.skip}")
        return 0
    os.environ["COLUMNS"] = str(COLUMNS)
    outcomes: list[Outcome] = []
    for name, blocks in found.items():
        print(f"session {name}", flush=True)
        with tempfile.TemporaryDirectory(prefix="metrale-transcripts-") as workdir:
            outcomes += run_session(blocks, Path(workdir))
    if args.update:  # once, at the end: a document's line numbers hold until then
        problems = update(outcomes)
    else:
        problems = [f"{o.block.where}: `{o.command.text}`:\n"
                    + difference(o.command.shown, o.printed)
                    for o in outcomes if not matches(o.command.shown, o.printed)]
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
