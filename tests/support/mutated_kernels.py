"""The host harness run on a copy of kernels/ with a bug put in, or a kernel added: the shim's
strictness tests break a kernel the way a plausible edit would and check that the host run
fails; the source-reading tests add a kernel no list names. The sources are read once per
process, so each run is a process of its own pointed at the copy (forked with torch already
imported: tests/support/preloaded.py)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from metrale_cli.ops import sources
from tests.support import preloaded

ROOT = Path(__file__).resolve().parent.parent.parent


def kernel_copy(tmp_path: Path, edits: list[tuple[str, str, str, int]] | None = None,
                files: dict[str, str] | None = None,
                keep: tuple[str, ...] | None = None) -> Path:
    """A copy of kernels/ under tmp_path where each (file, pattern, replacement, count) edit
    replaced exactly `count` matches of the regular expression `pattern`, and each of `files`
    (name: text) is written beside the sources. With `keep`, the copy holds only those kernel
    sources (.cu; the headers stay): its host build compiles and can launch only their kernels,
    in about 5 CPU-seconds where the whole library takes 7-8."""
    directory = tmp_path / "kernels"
    shutil.copytree(sources.find_kernel_dir(), directory)
    if keep is not None:
        assert all((directory / name).is_file() for name in keep), keep
        for path in directory.glob("*.cu"):
            if path.name not in keep:
                path.unlink()
    for name, pattern, replacement, count in edits or []:
        path = directory / name
        text, made = re.subn(pattern, replacement, path.read_text())
        assert made == count, f"{name}: {pattern!r} matched {made} times, not {count}"
        path.write_text(text)
    for name, text in (files or {}).items():
        (directory / name).write_text(text)
    return directory


def run_on(directory: Path, tmp_path: Path, script: str) -> subprocess.CompletedProcess[str]:
    """`script` run by a process of its own on the kernel sources in `directory` (its own host
    build, cached under tmp_path)."""
    environment = {**os.environ, "METRALE_KERNEL_DIR": str(directory),
                   "METRALE_CACHE_DIR": str(tmp_path / "cache")}
    return preloaded.run(script, environment, cwd=ROOT, timeout=600)


def run_mutated(tmp_path: Path, edits: list[tuple[str, str, str, int]], script: str,
                keep: tuple[str, ...] | None = None) -> subprocess.CompletedProcess[str]:
    """`script` run on a copy of kernels/ with `edits` made, holding only the kernel sources
    `keep` when given (kernel_copy)."""
    return run_on(kernel_copy(tmp_path, edits, keep=keep), tmp_path, script)


def sgmv_stage_probe(case: str) -> str:
    """A script that runs the SGMV shrink, and the expand from the reference's t, of `case` (an
    import line binding `case` to a kernel_cases.Case; the expand planned for its num_sms) and
    prints, for t and y, the launch's
    error, else "nan" where the result holds NaN, else "ok". A stage read before its copies
    land, or refilled while read, gives results that depend on when the copies land: the host
    launch (which runs a launch that issues copies under every landing) fails naming the
    first element that differs."""
    return f"""
import json, torch
from metrale_cli.ops import host_harness, reference
{case}
i = case.inputs(torch.float32)
starts, slots = case.segments()
good_t = reference.shrink(i.x, i.slots, i.a_weights, i.pool.ranks, case.max_rank)
def outcome(launch):
    try:
        result = launch()
    except RuntimeError as error:
        return str(error)
    return "nan" if bool(torch.isnan(result).any()) else "ok"
print(json.dumps({{
    "t": outcome(lambda: host_harness.sgmv_shrink(i.x, starts, slots, i.a_table, i.pool.ranks,
                                                  case.max_rank, splits=1)),
    "y": outcome(lambda: host_harness.sgmv_expand(good_t, starts, slots, i.b_table,
                                                  i.pool.scales, i.pool.ranks, i.y,
                                                  case.max_rank, num_sms=case.num_sms)),
}}))
"""


def stage_race(outcome: str, kernel: str) -> bool:
    """Whether a host launch's error (an sgmv_stage_probe outcome) is `kernel`'s race on a
    pipeline stage: its result differing between cp.async landings, or a store to a copy's
    destination while the copy was in flight."""
    return (outcome.startswith(f"{kernel} on the host: ")
            and ("when the copies land changed the result" in outcome
                 or "while that copy was in flight" in outcome))
