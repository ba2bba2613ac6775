"""Shared pytest wiring for the tests that need more than the CPU, and for property tests.

- `gpu`-marked tests skip without a usable device; --require-gpu turns that skip into a failure
  so a GPU run cannot pass by skipping everything.
- `nvcc`-marked tests (the kernels' nvcc compiles and their SASS checks) skip where the CUDA
  compiler is absent; --require-nvcc turns that into a failure, as .ci/run does, so CI compiles
  every kernel. A test that needs more (nvdisasm) skips itself with the reason.
- `vllm`-marked tests (the engine verdicts against the real vLLM) skip where the vLLM venv
  (`.venv-vllm`, `make vllm`) is absent; --require-vllm turns that into a failure, as .ci/run
  does, so CI runs the real engine.
- `sglang`-marked tests (the engine verdicts against SGLang's own LoRA code) skip where the
  SGLang venv (`.venv-sglang`, `make sglang`) is absent; --require-sglang turns that into a
  failure, as .ci/run does.
- The hypothesis profile every property test runs under (fixed examples under CI).
- The order of the files: those with engine tests first (see pytest_collection_modifyitems).
- The objects alive when a test module starts are frozen out of the garbage collector's reach
  (see pytest_runtest_setup), and the host harness is built in a fixture (`host_library`).
- With an xdist worker a core, torch runs one thread in each (see pytest_configure).
- The compiled replay core is loaded in a session setup (`replay_core`).
"""

from __future__ import annotations

import gc
import os
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from tests.support.cost_tiers import COST_MARKERS

# Property tests: bounded examples so the whole fuzzing stays within a minute of `make test` on
# two cores; no per-example deadline (a shared machine's timing is noise), each CLI fuzz case
# bounds its own time instead. HYPOTHESIS_PROFILE=thorough runs five times more examples.
settings.register_profile(
    "metrale", max_examples=80, deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
settings.register_profile("thorough", settings.get_profile("metrale"), max_examples=400)
# CI (CI=true) runs the same examples every time, so a run lands or fails on the code alone; a
# developer's run draws new ones and so keeps searching.
settings.register_profile("ci", settings.get_profile("metrale"), derandomize=True,
                          database=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI")
                                     else "metrale"))


# The vLLM venv `make test` builds beside .venv (Makefile VLLM_VENV).
VLLM_PYTHON = Path(__file__).resolve().parent.parent / ".venv-vllm" / "bin" / "python"
# vLLM's own cache, where the runners' engines keep it: above all its model-class inspections,
# each a vLLM import in a subprocess (about 13 s) where missing. The tests that give a server a
# HOME of its own point it here.
VLLM_CACHE_ROOT = Path(os.environ.get("VLLM_CACHE_ROOT") or Path(
    os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vllm")
# The SGLang venv beside it (Makefile SGLANG_VENV).
SGLANG_PYTHON = Path(__file__).resolve().parent.parent / ".venv-sglang" / "bin" / "python"


def pytest_configure(config: pytest.Config) -> None:
    """In an xdist worker, when there are as many workers as cores: one OpenMP thread for torch
    (here and in the processes the tests start), unless the environment says otherwise. Each
    core already runs a worker; torch's other threads only spun waiting on it (the torch-heavy
    files took a tenth more CPU). Before any test module imports torch, which reads it once."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers is not None and int(workers) >= len(os.sched_getaffinity(0)):
        os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--require-gpu",
        action="store_true",
        default=False,
        help="fail, rather than skip, tests marked gpu when no usable CUDA device is present",
    )
    parser.addoption(
        "--require-nvcc",
        action="store_true",
        default=False,
        help="fail, rather than skip, tests marked nvcc (or their tools) when nvcc is absent",
    )
    parser.addoption(
        "--require-vllm",
        action="store_true",
        default=False,
        help="fail, rather than skip, tests marked vllm when the vLLM venv (.venv-vllm) is "
        "absent",
    )
    parser.addoption(
        "--require-sglang",
        action="store_true",
        default=False,
        help="fail, rather than skip, tests marked sglang when the SGLang venv (.venv-sglang) "
        "is absent",
    )


# Files holding tests with these markers start the engines, the longest fixtures of the suite
# behind few tests.
ENGINE_MARKERS = ("vllm", "sglang")


@pytest.hookimpl(trylast=True)  # after -m has deselected: the tests that will run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files with engine tests first, then those with tests of a cost tier (slow, proc, sweep)
    by their number of such tests, then the rest by their number of tests, most first (each
    file's tests in their own order): the quick files come last and fill the run's end on
    both workers (in `make quick`, which runs no tier, the order is by number of tests).
    xdist's own order (most tests first, which `make test` turns off with
    --no-loadscope-reorder to keep this one) would hand out the engine files last, and one
    worker would run their engines alone at the end of the run; a few-test file that starts
    processes (the wheel, gpu_check.sh) would come last too."""
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)

    def cost(tests: list[pytest.Item]) -> tuple[bool, int, int]:
        engines = any(t.get_closest_marker(m) for t in tests for m in ENGINE_MARKERS)
        tiered = sum(any(t.get_closest_marker(m) for m in COST_MARKERS) for t in tests)
        return not engines, -tiered, -len(tests)

    items[:] = [item for tests in sorted(files.values(), key=cost) for item in tests]


_FROZEN = pytest.StashKey[set[str]]()


def pytest_runtest_setup(item: pytest.Item) -> None:
    # The first test of each module freezes what is alive (the libraries imported so far, torch's
    # and the session fixtures' objects): none of it is garbage, and without this every full
    # collection walks it again, about a tenth of a host-harness or simulate test's time.
    frozen = item.config.stash.setdefault(_FROZEN, set())
    if item.module is not None and item.module.__name__ not in frozen:
        frozen.add(item.module.__name__)
        gc.freeze()
    if item.get_closest_marker("nvcc") is not None and shutil.which("nvcc") is None:
        if item.config.getoption("--require-nvcc"):
            pytest.fail("--require-nvcc was given but nvcc is not on PATH", pytrace=False)
        pytest.skip("needs nvcc (the CUDA toolkit) on PATH")
    if item.get_closest_marker("vllm") is not None and not VLLM_PYTHON.exists():
        if item.config.getoption("--require-vllm"):
            pytest.fail(f"--require-vllm was given but {VLLM_PYTHON} is absent (make vllm)",
                        pytrace=False)
        pytest.skip(f"needs the vLLM venv: {VLLM_PYTHON} (make vllm)")
    if item.get_closest_marker("sglang") is not None and not SGLANG_PYTHON.exists():
        if item.config.getoption("--require-sglang"):
            pytest.fail(f"--require-sglang was given but {SGLANG_PYTHON} is absent "
                        "(make sglang)", pytrace=False)
        pytest.skip(f"needs the SGLang venv: {SGLANG_PYTHON} (make sglang)")
    if item.get_closest_marker("gpu") is None:
        return
    from metrale_cli import compat

    usable, reason = compat.gpu_status()
    if usable:
        return
    if item.config.getoption("--require-gpu"):
        pytest.fail(f"--require-gpu was given but no GPU is usable: {reason}", pytrace=False)
    pytest.skip(f"needs a GPU: {reason}")


@pytest.fixture(scope="session")
def preloaded_server() -> None:
    """The preloaded server (tests/support/preloaded.py) started in a setup, which the cost
    tiers do not count: the modules whose quick tests run scripts on it use it, so that none
    of them pays its torch import in its call."""
    from tests.support import preloaded

    preloaded.warm()


@pytest.fixture(scope="session")
def host_library() -> Path:
    """The host harness's build of kernels/ (g++, several seconds where it is not cached), made
    in the setup of the first test that asks, which the cost tiers do not count; the modules that
    launch kernels on the host use it."""
    from metrale_cli.ops import host_harness

    return host_harness.build()


@pytest.fixture(params=["compiled", "numpy"])
def host_reads(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each way a host fill reads and checks what it reads: the compiled reader
    (metrale_cli/_native.c, which `make test`'s install builds) and the os.preadv and NumPy
    fallback of an install without a C compiler."""
    from metrale_cli import native

    if request.param == "numpy":
        monkeypatch.setattr(native, "compiled", None)
    else:
        assert native.compiled is not None, "the install did not build metrale_cli._native"
    return str(request.param)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-Next model directory (tests/support/hostile_inputs.py, TINY) holding adapter
    `a` (rank 2 on the attention modules): what the hostile-input tests of every stage copy and
    edit (`copy_adapter`). Shared by the session: never written to."""
    from tests.support.hostile_inputs import tiny_model

    return tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session", autouse=True)
def replay_core() -> None:
    """The compiled replay core (metrale_cli/sim/core.py) and trace scan (sim/trace_scan.py)
    imported and loaded from numba's cache in a setup, which the cost tiers do not count: about
    a second a process (numba's import), paid once and not in the call of whichever test first
    replays a workload or reads a trace."""
    from metrale_cli.sim import core, trace_scan

    core.compile_now()
    trace_scan.compile_now()
