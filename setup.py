"""The package list, found rather than kept by hand, and the one compiled module; everything
else is in pyproject.toml.

pyproject.toml can either list packages or find them, not both, and the kernel sources need
both: every package under metrale_cli/ is found, and metrale_cli.kernel_src, which lives in the
checkout's kernels/ (pyproject's package-dir maps it), is added by name. `metrale` is the library
API under the install name (`import metrale`), a package of its own beside metrale_cli.

`metrale_cli._native` (`metrale_cli/_native.c`: the pack's reads checked while in cache) is
optional: an install without a C compiler goes on without it, and the pack falls back to
os.preadv and NumPy (`metrale_cli/native.py`; `metrale bench pack` reports which ran).
"""

from setuptools import Extension, find_packages, setup

setup(packages=["metrale", *find_packages(include=["metrale_cli", "metrale_cli.*"]),
                "metrale_cli.kernel_src"],
      ext_modules=[Extension("metrale_cli._native", ["metrale_cli/_native.c"],
                             extra_compile_args=["-O3"], optional=True)])
