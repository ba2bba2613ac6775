"""The package metadata a build reads: what `pip install` prints nothing about."""

from __future__ import annotations

import sys
from pathlib import Path

from packaging.licenses import canonicalize_license_expression
from packaging.requirements import Requirement

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def test_the_license_is_an_spdx_expression() -> None:
    doc = tomllib.loads(PYPROJECT.read_text())
    license = doc["project"]["license"]
    # A table ({text = ...}) makes setuptools print its deprecation block on every install.
    assert isinstance(license, str)
    assert canonicalize_license_expression(license) == license
    assert not any(c.startswith("License ::") for c in doc["project"].get("classifiers", []))
    # setuptools reads an SPDX string from 77 on.
    setuptools = next(Requirement(r) for r in doc["build-system"]["requires"]
                      if Requirement(r).name == "setuptools")
    assert not setuptools.specifier.contains("76.9")
