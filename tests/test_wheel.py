"""The wheel a user builds: `pip wheel --no-deps .` holds every package and every kernel source,
and installed into a fresh venv (no editable path, no checkout on sys.path) it runs the commands.

An editable install finds modules in the checkout, so a package the build leaves out is only seen
from a wheel: these tests build one. The build runs without isolation (no network): setuptools
comes from the test venv, as `.[test]` installs it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "metrale_cli"
API = ROOT / "metrale"  # `import metrale`: the library API under the install name
KERNELS = ROOT / "kernels"
KERNEL_SUFFIXES = (".cu", ".cuh", ".h")
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)

pytestmark = pytest.mark.proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from a copy of what the build reads (a build in the checkout would leave
    build/ and an egg-info there)."""
    return _build(tmp_path_factory, {})


def _build(tmp_path_factory: pytest.TempPathFactory, env: dict[str, str]) -> Path:
    """`pip wheel` of a copy of the checkout's build inputs, with `env` over this one's."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so")
    shutil.copytree(PACKAGE, src / "metrale_cli", ignore=ignore)
    shutil.copytree(API, src / "metrale", ignore=ignore)
    shutil.copytree(KERNELS, src / "kernels", ignore=ignore)
    out = tmp_path_factory.mktemp("wheel")
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(src)], capture_output=True, text=True, timeout=300,
        env={**os.environ, **env})
    assert built.returncode == 0, built.stderr
    (path,) = out.glob("metrale-*.whl")
    return path


def _kernel_sources_needed() -> set[str]:
    """Every .cu/.cuh/.h in kernels/, and every file their local includes name."""
    needed = {p.name for p in KERNELS.iterdir() if p.suffix in KERNEL_SUFFIXES}
    assert {"lora_config.h"} < needed and any(n.endswith(".cu") for n in needed)
    for name in list(needed):
        needed |= set(_INCLUDE.findall((KERNELS / name).read_text()))
    return needed


def test_the_wheel_holds_every_package_and_kernel_source(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    packages = {str(p.parent.relative_to(ROOT)) for p in PACKAGE.rglob("__init__.py")}
    assert "metrale_cli/engines" in packages  # the package a hand-kept list left out
    in_wheel = {n.rsplit("/", 1)[0] for n in names if n.endswith("/__init__.py")}
    assert packages - in_wheel == set()
    modules = {str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py")}
    assert modules - set(names) == set()
    assert {"metrale_cli/py.typed", "metrale/__init__.py", "metrale/py.typed"} <= set(names)
    shipped = {n.removeprefix("metrale_cli/kernel_src/") for n in names
               if n.startswith("metrale_cli/kernel_src/")}
    assert _kernel_sources_needed() - shipped == set()
    # The compiled reader, built for this Python (`setup.py`; `make test`'s machine has a C
    # compiler): the pack's checked reads.
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    assert f"metrale_cli/_native{suffix}" in names


def _fresh_venv(root: Path, wheel: Path) -> tuple[Path, dict[str, str]]:
    """A venv with only the wheel installed; the dependencies come from this venv's
    site-packages on PYTHONPATH, where .pth files (the editable finder among them) are not
    read, so metrale_cli can only be the installed copy."""
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    installed = subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith(("METRALE_", "PYTHON"))}
    env |= {"PYTHONPATH": sysconfig.get_paths()["purelib"], "COLUMNS": "100"}
    return venv, env


def test_the_installed_wheel_runs_the_commands(wheel: Path, tmp_path: Path) -> None:
    venv, env = _fresh_venv(tmp_path, wheel)
    work = tmp_path / "work"  # no checkout in the working directory either
    work.mkdir()

    def run(*args: object) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([venv / "bin" / "metrale", *map(str, args)], cwd=work, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"metrale {' '.join(map(str, args))}: {done.stderr}"
        return done

    where = subprocess.run([venv / "bin" / "python", "-c",
                            "import metrale, metrale_cli, metrale_cli.ops.sources as s; "
                            "from metrale_cli.native import compiled; "
                            "print(metrale_cli.__file__); print(s.find_kernel_dir()); "
                            "print(metrale.__file__, metrale.plan_pool.__name__); "
                            "print(compiled.__file__)"],
                           cwd=work, env=env, capture_output=True, text=True, check=True)
    package_file, kernel_dir, api_file, plan_pool, native_file = where.stdout.split()
    assert Path(package_file).is_relative_to(venv) and Path(api_file).is_relative_to(venv)
    assert Path(native_file).parent == Path(package_file).parent
    assert plan_pool == "plan_pool"
    assert Path(kernel_dir) == Path(package_file).parent / "kernel_src"

    (work / "model").mkdir()
    (work / "model" / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128}))
    run("synth", work / "a", "--model", work / "model", "--modules", "q_proj,v_proj",
        "--rank", 4)
    assert json.loads(run("inspect", work / "a", "--json").stdout)["adapters"]
    run("layout", "-m", "qwen3-8b", "--modules", "q_proj", "--max-rank", 16)
    run("pack", work / "a", "--max-loras", 2, "--device", "cpu", "--out", work / "pool.st")
    assert "slot" in run("show", work / "pool.st").stdout
    records = json.loads(run("bench", "kernels", "--model-only", "--tokens", 16, "--rank", 16,
                             "--modules", "q_proj", "--json").stdout)["records"]
    assert records and all("binding" in r for r in records)


def test_without_a_c_compiler_the_wheel_builds_and_packs_with_numpy(
        tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    """A machine with no C compiler (`CC` a command that fails): the build goes on without
    metrale_cli._native, and the installed wheel packs with os.preadv and NumPy's check,
    refusing a NaN as the compiled reader does."""
    built = _build(tmp_path_factory, {"CC": "/bin/false"})
    assert not [n for n in zipfile.ZipFile(built).namelist() if n.endswith(".so")]
    venv, env = _fresh_venv(tmp_path, built)
    work = tmp_path / "work"
    work.mkdir()

    def run(*args: object) -> subprocess.CompletedProcess[str]:
        return subprocess.run([venv / "bin" / "python", *map(str, args)], cwd=work, env=env,
                              capture_output=True, text=True, timeout=300)

    assert run("-c", "from metrale_cli.native import compiled; print(compiled)").stdout == (
        "None\n")
    assert run("-m", "metrale_cli", "synth", work / "a", "--model", "qwen3-8b", "--modules",
               "q_proj", "--rank", 8).returncode == 0
    packed = run("-m", "metrale_cli", "pack", work / "a", "--max-loras", 1, "--json")
    assert packed.returncode == 0, packed.stderr
    weights = work / "a" / "adapter_model.safetensors"
    with open(weights, "r+b") as f:  # the first tensor's first value: a BF16 NaN
        f.seek(8 + int.from_bytes(f.read(8), "little"))
        f.write(b"\xc0\x7f")
    refused = run("-m", "metrale_cli", "pack", work / "a", "--max-loras", 1)
    assert refused.returncode == 1 and "1 non-finite values" in refused.stderr, refused.stderr
