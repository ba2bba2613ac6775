"""scripts/gpu_check.sh, the one run a lent GPU gets, checked on the CPU: its --dry-run lists
the steps and their budgets and runs the CPU part (the roofline model), and every module it
runs exists."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from importlib.util import find_spec
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.sh"
ORDER = ["device", "correctness", "pack", "bench", "sass", "memcheck", "model"]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHON": sys.executable}, timeout=300,
                          check=False)


# What a lent device returns from its output folder (docs of the device tool).
DEVICE_FILES, DEVICE_FILE_BYTES, DEVICE_TOTAL_BYTES, DEVICE_DEPTH = 8, 16 * 2**20, 64 * 2**20, 2


def _returned(out: Path) -> tuple[dict, dict[str, bytes]]:
    """(summary.json, the archive's files by name) of a run into `out`, after checking that
    everything in `out` is within what a lent device returns."""
    files = [p for p in out.rglob("*") if p.is_file()]
    assert sorted(p.name for p in files) == ["gpu-check.tar.gz", "summary.json"]
    assert len(files) <= DEVICE_FILES
    assert all(len(p.relative_to(out).parts) <= DEVICE_DEPTH for p in files)
    assert all(p.stat().st_size <= DEVICE_FILE_BYTES for p in files)
    assert sum(p.stat().st_size for p in files) <= DEVICE_TOTAL_BYTES
    with tarfile.open(out / "gpu-check.tar.gz") as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    return json.loads((out / "summary.json").read_text()), members


# A lent device gives 15 minutes, its start included: one run must fit this, to leave time to
# run it again.
FIT_S = 420


@pytest.mark.parametrize("flags", [(), ("--quick",)], ids=["full", "quick"])
def test_the_budgets_fit_a_run_and_a_rerun(flags: tuple[str, ...]) -> None:
    """The steps' budgets, as the script declares them, sum to its total, and the total with
    the script's own work between steps (its records and archive) fits 420 s (465 s once)."""
    text = SCRIPT.read_text()
    table = text[text.index("STEPS=("):text.index(")", text.index("STEPS=("))]
    declared = {name: int(quick if flags else full)
                for name, full, quick in re.findall(r'"(\w+) (\d+) (\d+)"', table)}
    assert list(declared) == ORDER
    overhead = int(re.search(r"^OVERHEAD_S=(\d+)$", text, re.M).group(1))
    assert int(re.search(r"^FIT_S=(\d+)$", text, re.M).group(1)) == FIT_S
    assert overhead >= 2 * len(ORDER)  # a second or more per step for its record and archive
    assert sum(declared.values()) + overhead <= FIT_S, declared


@pytest.mark.proc
@pytest.mark.parametrize(("flags", "total"), [((), 400), (("--quick",), 180)],
                         ids=["full", "quick"])
def test_dry_run_lists_the_steps_within_budget_and_runs_the_model(
        tmp_path: Path, flags: tuple[str, ...], total: int) -> None:
    result = run(*flags, "--dry-run", "--json", str(tmp_path))
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert [s["name"] for s in plan["steps"]] == ORDER
    assert all(s["budget_s"] > 0 for s in plan["steps"])
    assert plan["total_budget_s"] == sum(s["budget_s"] for s in plan["steps"]) == total
    assert plan["fit_s"] == FIT_S and total + plan["overhead_s"] <= FIT_S
    # What the run returns: two files, every step's files in the archive.
    assert plan["returns"]["files"] == ["gpu-check.tar.gz", "summary.json"]
    listed = plan["returns"]["archive"]
    assert {f"{name}.{kind}" for name in ORDER for kind in ("log", "json")} <= set(listed)
    # The CPU part ran: the model's records for the bench's shapes, as JSON, in the archive.
    summary, members = _returned(tmp_path)
    assert set(members) == {"model.log", "model.json", "model-records.json"} <= set(listed)
    model = json.loads(members["model.json"])
    assert model["rc"] == 0 and not model["timed_out"]
    assert model["records"] and all("terms" in r and "binding" in r for r in model["records"])
    assert summary["dry_run"] and [s["name"] for s in summary["steps"]] == ["model"]
    step = summary["steps"][0]
    # The dry run's model gets 60 s (any CPU machine, loaded), the device run's 15.
    assert step["status"] == "passed" and step["budget_s"] == 60
    assert next(s["budget_s"] for s in plan["steps"] if s["name"] == "model") == 15
    assert step["figures"]["records"] == len(model["records"])
    assert step["figures"]["missing_target"] == sum(not r["meets_target"]
                                                    for r in model["records"])


@pytest.mark.proc
def test_a_whole_run_returns_every_step_in_two_files(tmp_path: Path) -> None:
    """Every step of a --quick run (those needing a GPU fail at once on a CPU machine, each
    still leaving its files) comes back within the device's limits: the archive holds what the
    dry run lists for the steps that wrote them, summary.json every step's status."""
    result = run("--quick", str(tmp_path))
    listed = json.loads(run("--quick", "--dry-run", "--json", str(tmp_path / "dry")).stdout)
    (tmp_path / "dry" / "gpu-check.tar.gz").unlink()
    (tmp_path / "dry" / "summary.json").unlink()
    (tmp_path / "dry").rmdir()
    summary, members = _returned(tmp_path)
    assert [s["name"] for s in summary["steps"]] == ORDER
    assert set(members) <= set(listed["returns"]["archive"])
    assert {f"{name}.{kind}" for name in ORDER for kind in ("log", "json")} <= set(members)
    passed = [s["name"] for s in summary["steps"] if s["status"] == "passed"]
    assert result.returncode == (0 if passed == ORDER else 1)
    assert all(s["status"] in ("passed", "failed", "timed_out") for s in summary["steps"])


def test_every_module_the_script_runs_exists() -> None:
    text = SCRIPT.read_text()
    modules = set(re.findall(r"-m (metrale_cli[\w.]*)", text))
    assert {"metrale_cli", "metrale_cli.ops.sass", "metrale_cli.bench.kernels"} <= modules
    for module in modules:
        assert find_spec(module) is not None, module
    assert "pip install" not in text.split("set -uo pipefail")[1]  # installs nothing
    assert "cupy.cuda.set_allocator(None)" in text


def test_the_script_refuses_a_run_without_an_output_directory(tmp_path: Path) -> None:
    assert run("--dry-run").returncode == 2
    assert run("--bogus", str(tmp_path)).returncode == 2


def test_the_device_query_survives_cuda_13_s_missing_memory_clock() -> None:
    from metrale_cli.bench import kernels as bench_kernels
    from metrale_cli.errors import ToolMissing

    # CUDA 13 dropped the memory clock from the device properties: CuPy's table may lack it.
    assert bench_kernels.memory_clock_khz({}, lambda: 3_201_000) == 3_201_000
    assert bench_kernels.memory_clock_khz({"MemoryClockRate": 0}, None) is None

    def refuses() -> int:
        raise RuntimeError("cudaErrorInvalidValue")

    assert bench_kernels.memory_clock_khz({}, refuses) is None
    peak, source = bench_kernels.peak_bandwidth("NVIDIA H200", None, 6144)
    assert peak == 4.8e12 and "H200" in source
    assert bench_kernels.peak_bandwidth("X", 3_201_000, 6144)[0] == pytest.approx(4.917e12,
                                                                                 rel=1e-3)
    with pytest.raises(ToolMissing):
        bench_kernels.peak_bandwidth("Unknown GPU", None, None)
