"""What the engine runners share (tests/support/vllm_runner.py, vllm_cache_runner.py,
sglang_runner.py): reading the job, saving the report atomically, and the exit status. Each runner
runs as a script under its engine's venv, so this directory is first on its path; stdlib only.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any, NoReturn


def save(report: dict[str, Any], path: str) -> None:
    """Write `report` to `path` as JSON, whole or not at all: the test reads the last report a
    runner saved, also when the engine ended the runner after it."""
    with open(path + ".tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(path + ".tmp", path)


def run(main: Callable[[dict[str, Any], str], int]) -> NoReturn:
    """`main(job, out_path)` on `RUNNER JOB.json OUT.json`; an error it raises is printed with its
    traceback (the test shows the tail of stderr) and exits 1."""
    try:
        with open(sys.argv[1]) as f:
            job = json.load(f)
        sys.exit(main(job, sys.argv[2]))
    except Exception:
        traceback.print_exc()
        sys.exit(1)
