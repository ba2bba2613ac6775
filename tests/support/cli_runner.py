"""Running `metrale` in-process, as a user would from a shell."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

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


def metrale(*args: object, columns: int = 100) -> Result:
    """`metrale ARGS` in a terminal `columns` wide."""
    # The consoles read COLUMNS when made, once per process as in a shell: make them anew.
    console.out.cache_clear()
    console.err.cache_clear()
    result = CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": str(columns)})
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return Result(result.exit_code, result.stdout, result.stderr, result.output)
