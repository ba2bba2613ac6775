"""pytest plugin: a test without a cost marker must stay quick (pyproject.toml registers it).

The cost markers are `slow`, `proc` and `sweep`; `make quick` runs every test outside them. A test
outside them whose setup and call together take longer than the ini option
``unmarked_limit_s`` fails, by name, with the time pytest measured: the quick tier stays quick as
tests are added, because the test that would slow it is sent to its tier. The check reads the
durations pytest reports for every test (on an xdist worker too); it asserts the marker, not a
speed, and a marked test is never timed.
"""

from __future__ import annotations

from collections.abc import Generator

import pytest

COST_MARKERS = ("slow", "proc", "sweep")
_SETUP_S = pytest.StashKey[float]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        "unmarked_limit_s",
        "seconds (setup + call) a test without a slow, proc or sweep marker may take",
        default="3",
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if any(item.get_closest_marker(name) for name in COST_MARKERS):
        return report
    if report.when == "setup":
        item.stash[_SETUP_S] = report.duration
    elif report.when == "call" and report.passed:
        setup = item.stash.get(_SETUP_S, 0.0)
        limit = float(item.config.getini("unmarked_limit_s"))
        if setup + report.duration > limit:
            report.outcome = "failed"
            report.longrepr = (
                f"{item.nodeid} took {setup + report.duration:.1f} s (setup {setup:.1f} s, call "
                f"{report.duration:.1f} s), over the {limit:g} s a test without a cost marker "
                f"may take: mark it {', '.join(COST_MARKERS)} (README, Tests)"
            )
    return report
