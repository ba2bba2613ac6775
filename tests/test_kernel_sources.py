"""A new kernel touches its .cu, one launcher and the reference only: the kernel list, its
figures and the host harness's table are read from the sources (metrale_cli/ops/sources.py).

Each test copies kernels/ to a temporary directory, adds or breaks a kernel there and imports
metrale_cli in a fresh process pointed at it (tests/support/mutated_kernels.py; the sources are
read once, at import)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from metrale_cli.ops import sources
from tests.support.mutated_kernels import kernel_copy, run_on

# Its quick tests run scripts on the preloaded server: started in a setup, not a call.
pytestmark = pytest.mark.usefixtures("preloaded_server")

# A kernel that no Python list names: it defines its own figures in its .cu.
SCALE_CU = """// scale.cu: y[i] *= scale, one thread per element (a test kernel).
#include "lora_config.h"
#define SCALE_ROWS_MIN_CTAS 2
#define SCALE_ROWS_LOADS 3

extern "C" __global__ void __launch_bounds__(METRALE_THREADS, SCALE_ROWS_MIN_CTAS)
scale_rows(float* __restrict__ y, float scale, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] *= scale;
}
"""

LAUNCH_IT = """
import json, numpy as np
from metrale_cli.ops import host_harness, sources
from metrale_cli.ops.plans import KernelLaunch
y = np.arange(200, dtype=np.float32)
host_harness.launch(KernelLaunch("scale_rows", (2, 1, 1), (sources.THREADS, 1, 1),
                                 (y, np.float32(3.0), np.int32(200))))
print(json.dumps({"source": sources.KERNEL_SOURCES["scale_rows"],
                  "min_ctas": sources.min_ctas_per_sm("scale_rows"),
                  "loads": sources.loads_in_flight("scale_rows"),
                  "kernels": sorted(sources.KERNEL_SOURCES), "y": y.tolist()}))
"""


@pytest.mark.proc
def test_a_new_kernel_needs_only_its_source(tmp_path: Path) -> None:
    result = run_on(kernel_copy(tmp_path, files={"scale.cu": SCALE_CU}), tmp_path, LAUNCH_IT)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    assert (found["source"], found["min_ctas"], found["loads"]) == ("scale.cu", 2, 3)
    # The host build's table holds it beside every existing kernel.
    assert set(found["kernels"]) == {*sources.KERNEL_SOURCES, "scale_rows"}
    assert found["y"] == [3.0 * i for i in range(200)]


@pytest.mark.parametrize("declaration", [
    'extern "C" __global__ void\nscale_rows(',  # no launch bounds
    'extern "C" __global__ void __launch_bounds__(256) scale_rows(',  # not METRALE_THREADS
    'extern "C" __launch_bounds__(METRALE_THREADS, SCALE_ROWS_MIN_CTAS) __global__ void\n'
    "scale_rows(",  # another order: once skipped unseen
])
def test_a_kernel_declared_otherwise_is_refused_with_its_line(tmp_path: Path,
                                                              declaration: str) -> None:
    source = SCALE_CU.replace('extern "C" __global__ void __launch_bounds__(METRALE_THREADS, '
                              "SCALE_ROWS_MIN_CTAS)\nscale_rows(", declaration)
    assert source != SCALE_CU
    result = run_on(kernel_copy(tmp_path, files={"scale.cu": source}), tmp_path,
                  "import metrale_cli.ops.sources")
    assert result.returncode != 0
    assert "scale.cu:" in result.stderr and "__launch_bounds__(METRALE_THREADS" in result.stderr


def test_a_global_in_a_comment_is_no_kernel(tmp_path: Path) -> None:
    commented = "// extern \"C\" __global__ void old_kernel(float* y) {}\n" + SCALE_CU
    directory = kernel_copy(tmp_path, files={"scale.cu": commented})
    result = run_on(directory, tmp_path,
                  "from metrale_cli.ops import sources; print(sorted(sources.KERNEL_SOURCES))")
    assert result.returncode == 0, result.stderr
    assert "scale_rows" in result.stdout and "old_kernel" not in result.stdout


def test_a_figure_the_header_and_a_source_disagree_on_is_refused(tmp_path: Path) -> None:
    directory = kernel_copy(tmp_path, files={"scale.cu": SCALE_CU})
    header = directory / sources.CONFIG_HEADER
    header.write_text(header.read_text() + "#define SCALE_ROWS_LOADS 4\n")
    result = run_on(directory, tmp_path, "import metrale_cli.ops.sources")
    assert result.returncode != 0
    assert "SCALE_ROWS_LOADS is defined twice" in result.stderr


def test_a_kernel_without_its_figures_is_told_what_to_define(tmp_path: Path) -> None:
    bare = SCALE_CU.replace("#define SCALE_ROWS_LOADS 3\n", "")
    result = run_on(kernel_copy(tmp_path, files={"scale.cu": bare}), tmp_path,
                  "from metrale_cli.ops import sources; sources.loads_in_flight('scale_rows')")
    assert result.returncode != 0
    assert "#define SCALE_ROWS_LOADS <integer>" in result.stderr


def test_the_host_build_lists_the_kernels_of_the_directory_it_builds(tmp_path: Path) -> None:
    from metrale_cli.ops import host_harness

    command = " ".join(host_harness.build_command(
        kernel_copy(tmp_path, files={"scale.cu": SCALE_CU}), "lib.so", "g++"))
    assert "METRALE_HOST_KERNEL(scale_rows)," in command and "scale.cu" in command
    assert "scale_rows" not in " ".join(host_harness.build_command(
        sources.find_kernel_dir(), "lib.so", "g++"))



# What the split-K shrinks used to do (F32 atomics into a t zeroed by a memset node), as the
# comments described it; the kernels now reduce through a workspace and a ticket per tile.
_STALE_SPLIT_K = ("(+)=", "F32 atomics", "by atomics", "must be zero before",
                  "zeroed before such a launch")


def test_the_kernels_and_their_figures_describe_split_k_as_it_runs() -> None:
    """No comment of the kernels says that split-K adds into a zeroed t with atomics, and
    docs/benchmarks.md's account of the split-K design says what replaced them."""
    root = Path(__file__).resolve().parents[1]
    for name in ("bgmv.cu", "sgmv.cu"):
        text = (root / "kernels" / name).read_text()
        assert [p for p in _STALE_SPLIT_K if p in text] == [], name
        assert "last ticket" in text, name
    figures = (root / "docs" / "benchmarks.md").read_text()
    assert "(atomics into one t" not in figures
    assert "the shrink stays `launch`-bound at 4 µs (a split shrink's\n  memset" not in figures
