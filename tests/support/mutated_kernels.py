"""The host harness run on a copy of kernels/ with a bug put in: the shim's strictness tests
break a kernel the way a plausible edit would and check that the host run fails."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from metrale_cli.ops import sources

ROOT = Path(__file__).resolve().parent.parent.parent


def run_mutated(tmp_path: Path, edits: list[tuple[str, str, str, int]],
                script: str) -> subprocess.CompletedProcess[str]:
    """`script` run by a fresh interpreter (its own host build, cached under tmp_path) on a
    copy of kernels/ where each (file, pattern, replacement, count) edit replaced exactly
    `count` matches of the regular expression `pattern`."""
    directory = tmp_path / "kernels"
    shutil.copytree(sources.find_kernel_dir(), directory)
    for name, pattern, replacement, count in edits:
        path = directory / name
        text, made = re.subn(pattern, replacement, path.read_text())
        assert made == count, f"{name}: {pattern!r} matched {made} times, not {count}"
        path.write_text(text)
    environment = {**os.environ, "METRALE_KERNEL_DIR": str(directory),
                   "METRALE_CACHE_DIR": str(tmp_path / "cache")}
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=environment, check=False, timeout=600, cwd=ROOT)
