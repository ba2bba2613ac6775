"""The package list, found rather than kept by hand; everything else is in pyproject.toml.

pyproject.toml can either list packages or find them, not both, and the kernel sources need
both: every package under metrale_cli/ is found, and metrale_cli.kernel_src, which lives in the
checkout's kernels/ (pyproject's package-dir maps it), is added by name. `metrale` is the library
API under the install name (`import metrale`), a package of its own beside metrale_cli.
"""

from setuptools import find_packages, setup

setup(packages=["metrale", *find_packages(include=["metrale_cli", "metrale_cli.*"]),
                "metrale_cli.kernel_src"])
