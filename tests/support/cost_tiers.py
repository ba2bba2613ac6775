"""pytest plugin: a test without a cost marker must stay quick (pyproject.toml registers it).

The cost markers are `slow`, `proc` and `sweep`; `make quick` runs every test outside them. A test
outside them whose call takes longer than the ini option ``unmarked_limit_s`` fails, by name,
with the time pytest measured (its setup is not counted: a module or session fixture, the
first PEFT adapter's torch import among them, is paid by whichever test asks first): the
quick tier stays quick as tests are added, because the test that would slow it is sent to its
tier. The check reads the
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
        "seconds a test's call without a slow, proc or sweep marker may take",
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
        if report.duration > limit:
            report.outcome = "failed"
            report.longrepr = (
                f"{item.nodeid} took {report.duration:.1f} s (setup {setup:.1f} s, not "
                f"counted), over the {limit:g} s a test's call without a cost marker may take: "
                f"mark it {', '.join(COST_MARKERS)} (tests/README.md, Cost tiers)"
            )
    return report
