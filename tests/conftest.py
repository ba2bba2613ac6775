"""Shared pytest wiring. The GPU pieces: `gpu`-marked tests skip without a usable device, and
--require-gpu turns that skip into a failure so a GPU run cannot pass by skipping everything.
The hypothesis profile every property test runs under."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

# Property tests: bounded examples so the whole fuzzing stays within a minute of `make test` on
# two cores; no per-example deadline (a shared machine's timing is noise), each CLI fuzz case
# bounds its own time instead. HYPOTHESIS_PROFILE=thorough runs five times more examples.
settings.register_profile(
    "metrale", max_examples=80, deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
settings.register_profile("thorough", settings.get_profile("metrale"), max_examples=400)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "metrale"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--require-gpu",
        action="store_true",
        default=False,
        help="fail, rather than skip, tests marked gpu when no usable CUDA device is present",
    )


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is None:
        return
    from metrale_cli import compat

    usable, reason = compat.gpu_status()
    if usable:
        return
    if item.config.getoption("--require-gpu"):
        pytest.fail(f"--require-gpu was given but no GPU is usable: {reason}", pytrace=False)
    pytest.skip(f"needs a GPU: {reason}")
