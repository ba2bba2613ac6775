"""Every kernel source compiles with nvcc for sm_80 and sm_90 with no error and no warning.

nvcc (not NVRTC) is the strict judge here: -Werror all-warnings turns every device-side warning
into an error and -Xcompiler -Wall,-Werror does the same for the host pass. Each (file, arch)
compile runs once, all of them in parallel, and the results are shared by the parametrized
tests below. Marked `nvcc`: skipped where nvcc is absent, a failure under --require-nvcc.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from metrale_cli.ops import sources

pytestmark = pytest.mark.nvcc

ARCHS = ("sm_80", "sm_90")
SOURCES = sorted(set(sources.KERNEL_SOURCES.values()))


def _nvcc() -> str:
    path = shutil.which("nvcc")
    assert path is not None, "the nvcc marker lets these tests run only where nvcc is on PATH"
    return path


def _command(source: str, arch: str) -> list[str]:
    directory = sources.find_kernel_dir()
    return [
        _nvcc(), f"-arch={arch}", "-std=c++17", "-Werror", "all-warnings",
        "-Xcompiler", "-Wall,-Werror", "-c", "-o", "/dev/null", str(directory / source),
    ]


@functools.cache
def _results() -> dict[tuple[str, str], subprocess.CompletedProcess[str]]:
    jobs = [(source, arch) for source in SOURCES for arch in ARCHS]
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        done = pool.map(
            lambda job: subprocess.run(_command(*job), capture_output=True, text=True,
                                       check=False),
            jobs,
        )
        return dict(zip(jobs, done, strict=True))


@pytest.mark.proc
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", SOURCES)
def test_kernel_compiles_cleanly(source: str, arch: str) -> None:
    result = _results()[source, arch]
    output = (result.stdout + result.stderr).strip()
    assert result.returncode == 0, f"nvcc failed on {source} for {arch}:\n{output}"
    assert not output, f"nvcc printed diagnostics for {source} for {arch}:\n{output}"


def test_every_kernel_is_defined_in_its_source() -> None:
    directory = sources.find_kernel_dir()
    for name, source in sources.KERNEL_SOURCES.items():
        assert f"\n{name}(" in (directory / source).read_text(), f"{name} not in {source}"


@pytest.mark.parametrize("source", SOURCES)
def test_header_names_its_compile_command(source: str) -> None:
    header = (sources.find_kernel_dir() / source).read_text().split("#include", 1)[0]
    assert "nvcc -arch=sm_90" in header and f"kernels/{source}" in header
    assert "Launch shape" in header
