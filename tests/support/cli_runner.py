"""Running `metrale` in-process, as a user would from a shell."""

from __future__ import annotations

import functools
import json
import sys
from dataclasses import dataclass
from typing import Any

import typer
from typer.testing import CliRunner

from metrale_cli.cli import console
from metrale_cli.cli.app import app


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str
    output: str  # stdout and stderr interleaved, as a terminal shows them

    def json(self) -> Any:
        return json.loads(self.stdout)


@functools.cache
def command_tree() -> Any:
    """The command tree, built once a process as a shell's `metrale` builds it once (typer's
    `CliRunner.invoke` builds it anew on every call: every command's signature and type hints,
    about a tenth of a second, most of what a quick CLI test costs)."""
    return typer.main.get_command(app)


def metrale(*args: object, columns: int = 100) -> Result:
    """`metrale ARGS` in a terminal `columns` wide; an exception other than SystemExit (a bug
    that would print a traceback) is raised."""
    # The consoles read COLUMNS when made, once per process as in a shell: make them anew.
    console.out.cache_clear()
    console.err.cache_clear()
    cli = command_tree()
    code: Any = 0
    with CliRunner().isolation(env={"COLUMNS": str(columns)}) as streams:
        try:
            cli.main(args=[str(a) for a in args], prog_name=cli.name)
        except SystemExit as exc:
            code = 0 if exc.code is None else exc.code
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
        stdout, stderr, output = (s.getvalue().decode("utf-8", "replace").replace("\r\n", "\n")
                                  for s in streams)
    if not isinstance(code, int):  # sys.exit("text"): reported as typer's runner reports it
        stdout, output, code = stdout + f"{code}\n", output + f"{code}\n", 1
    return Result(code, stdout, stderr, output)
