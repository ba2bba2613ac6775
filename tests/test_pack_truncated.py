"""An adapter file cut short while `pack` reads it: the memory-mapped reader died of SIGBUS;
now one line naming the file, exit 2, no image written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.hostile_inputs import tiny_model

# Runs `metrale pack` with the adapter file truncated to 100 bytes right after the reader opened
# it (after the audit and every size check): a real process, so that a fault would kill it.
CUT_WHILE_PACKING = """
import os, sys
from metrale_cli.pool import fill

class Cut(fill.TensorReader):
    def __init__(self, fd, name):
        super().__init__(fd, name)
        os.truncate(name, 100)

fill.TensorReader = Cut
sys.argv = ["metrale", *sys.argv[1:]]
from metrale_cli.cli.app import main
main()
"""


@pytest.mark.proc
def test_an_adapter_cut_short_while_packed_is_one_line(tmp_path: Path) -> None:
    root = tiny_model(tmp_path)
    weights = root / "a" / "adapter_model.safetensors"
    out = tmp_path / "pool.safetensors"
    done = subprocess.run(
        [sys.executable, "-c", CUT_WHILE_PACKING, "pack", str(root / "a"), "--model", str(root),
         "--max-loras", "2", "--device", "cpu", "--out", str(out)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert weights.stat().st_size == 100  # the cut happened
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert done.stderr.startswith(f"error: {weights}: file ended inside tensor "), done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".pool")]
