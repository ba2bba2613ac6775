"""The cost tiers (tests/support/cost_tiers.py): an unmarked test over the limit fails by name.

Each case runs pytest in-process (pytester) on made-up tests under a limit of a tenth of a second,
so a sleep just past it stands for a test that would slow `make quick`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.support.cost_tiers import COST_MARKERS

ROOT = Path(__file__).resolve().parent.parent
PLUGIN = ["-p", "tests.support.cost_tiers", "-o", "unmarked_limit_s=0.1"]
CASES = f"""
import time
import pytest

@pytest.fixture
def slow_setup():
    time.sleep(0.08)

def test_quick():
    pass

def test_sleeps():
    time.sleep(0.15)

def test_slow_setup_and_call(slow_setup):
    time.sleep(0.05)

def test_fails_on_its_own():
    time.sleep(0.15)
    assert False, "its own failure"

{"".join(f'''
@pytest.mark.{name}
def test_marked_{name}():
    time.sleep(0.15)
''' for name in COST_MARKERS)}
@pytest.mark.skip(reason="never runs")
def test_skipped():
    pass
"""


def test_unmarked_test_over_the_limit_fails_by_name(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_cases=CASES)
    result = pytester.runpytest(*PLUGIN, "-p", "no:cacheprovider", "-rf")
    result.assert_outcomes(passed=2 + len(COST_MARKERS), failed=2, skipped=1)
    result.stdout.fnmatch_lines([
        "*test_cases.py::test_sleeps took 0.* s (setup 0.0 s, not counted), over the 0.1 s a "
        "test's call without a cost marker may take: mark it slow, proc, sweep*",
    ])
    # The call alone counts: a shared fixture's cost falls on whichever test asks first.
    assert "test_slow_setup_and_call took" not in result.stdout.str()
    # A test that fails on its own keeps its own failure.
    result.stdout.fnmatch_lines(["*its own failure*"])
    assert "test_fails_on_its_own took" not in result.stdout.str()
    assert "test_quick took" not in result.stdout.str()


def test_every_cost_marker_is_declared(pytester: pytest.Pytester) -> None:
    # An undeclared marker only warns: `-m "not slow"` would still run a test marked `slwo`.
    declared = pytester.parseconfig(f"--rootdir={ROOT}", "-c", str(ROOT / "pyproject.toml"))
    names = {line.split(":")[0] for line in declared.getini("markers")}
    assert set(COST_MARKERS) <= names
    assert float(declared.getini("unmarked_limit_s")) > 0


def test_plugins_import_no_torch() -> None:
    # Every pytest run loads conftest.py and the plugins of `addopts`; torch (8-9 s on two cores)
    # waits for the first fixture that needs it.
    import subprocess

    code = ("import sys; import tests.conftest, tests.support.peft_fixtures, "
            "tests.support.cost_tiers; print(sorted({'torch', 'transformers', 'peft'} & "
            "set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"
