"""The CUDA kernel sources (kernels/*.cu): where they are, which kernels they hold, and the
numbers the kernels and their Python planner share.

One loader finds the kernel directory (METRALE_KERNEL_DIR, then the installed package data,
then the checkout's kernels/) and inlines a source's local includes, so that CuPy (NVRTC), the
host harness and the SASS check compile the same translation unit. When no directory holds the
sources, the error names every path tried.

The kernels are read from the sources themselves: every `extern "C" __global__` function of a
.cu file is a kernel, declared as

    extern "C" __global__ void __launch_bounds__(METRALE_THREADS, <PREFIX>_MIN_CTAS) <name>(...)

and <PREFIX>_MIN_CTAS and <PREFIX>_LOADS are its figures (CTAs per SM, 16-byte loads in flight
per thread). The figures are `#define NAME <integer>` lines: every one of kernels/lora_config.h
(CONFIG), and a kernel's MIN_CTAS and LOADS may instead sit in its own .cu. A new kernel therefore
needs no list kept here, nor in the host harness (which builds its table from KERNEL_SOURCES).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from metrale_cli import env
from metrale_cli.errors import ToolMissing

CONFIG_HEADER = "lora_config.h"
H200_SMS = 132  # the host harness plans for an H200 unless told otherwise

_DEFINE = re.compile(r"^#define\s+([A-Z0-9_]+)\s+(\d+)\s*$", re.MULTILINE)
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)
_GLOBAL = re.compile(
    r'extern\s+"C"\s+__global__\s+void\s+(__launch_bounds__\([^)]*\)\s*)?(\w+)\s*\(')
_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.DOTALL)
_BOUNDS = re.compile(r"__launch_bounds__\(\s*METRALE_THREADS\s*,\s*([A-Z0-9_]+)_MIN_CTAS\s*\)")


# --- finding and reading the sources ---------------------------------------------------------


def kernel_dir_candidates() -> list[Path]:
    """Where the kernel sources may be, in search order.

    A wheel ships the sources as metrale_cli/kernel_src/ (pyproject maps the checkout's kernels/
    there); a checkout or an editable install has them in kernels/ beside the package.
    """
    package = Path(__file__).resolve().parent.parent  # metrale_cli/, above ops/
    candidates = [package / "kernel_src", package.parent / "kernels"]
    override = env.kernel_dir()
    if override is not None:
        candidates.insert(0, override)
    return candidates


def find_kernel_dir() -> Path:
    """The first candidate directory holding lora_config.h and kernel sources (.cu);
    ToolMissing names every directory tried."""
    tried = []
    for directory in kernel_dir_candidates():
        if (directory / CONFIG_HEADER).is_file() and any(directory.glob("*.cu")):
            return directory
        tried.append(str(directory))
    raise ToolMissing(
        f"the CUDA kernel sources ({CONFIG_HEADER} and *.cu) were not found; tried: "
        f"{'; '.join(tried)} (set METRALE_KERNEL_DIR to a directory holding them)"
    )


def read_source(name: str, directory: Path | None = None) -> str:
    """The source of kernels/<name> with its local `#include "..."` files inlined (once each).

    Inlining makes the text CuPy compiles, and the text its cache is keyed on, the whole
    translation unit: NVRTC then needs no include path, and editing a header recompiles.
    """
    directory = directory or find_kernel_dir()
    seen: set[str] = set()

    def expand(file_name: str) -> str:
        if file_name in seen:
            return ""
        seen.add(file_name)
        path = directory / file_name
        if not path.is_file():
            raise ToolMissing(f"kernel source {path} (included by a kernel) does not exist")
        return _INCLUDE.sub(lambda m: expand(m.group(1)), path.read_text(encoding="utf-8"))

    return expand(name)


def sources_digest(directory: Path) -> str:
    """A hash of every kernel source and header in `directory` (sha256 hex)."""
    digest = hashlib.sha256()
    for path in sorted(directory.iterdir()):
        if path.suffix in (".cu", ".cuh", ".h") and path.is_file():
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


# --- the kernels and their figures, read from the sources -------------------------------------


def kernels_in(directory: Path) -> tuple[dict[str, str], dict[str, str]]:
    """({kernel: its .cu file}, {kernel: its figures' prefix}) of the sources in `directory`.
    Every `__global__` outside a comment must be a declaration of the one form this module
    reads; any other is refused (a kernel left out would be neither built nor tested)."""
    found: dict[str, str] = {}
    prefixes: dict[str, str] = {}
    for path in sorted(directory.glob("*.cu")):
        text = _COMMENT.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)),
                            path.read_text(encoding="utf-8"))
        declared = {m.start(): m for m in _GLOBAL.finditer(text)}
        for use in re.finditer(r"\b__global__\b", text):
            line = text.count("\n", 0, use.start()) + 1
            match = next((m for m in declared.values() if m.start() <= use.start() < m.end()),
                         None)
            bounds = _BOUNDS.search(match.group(0)) if match else None
            if match is None or bounds is None:
                raise ToolMissing(
                    f"{path}:{line}: declare every kernel as extern \"C\" __global__ void "
                    "__launch_bounds__(METRALE_THREADS, <PREFIX>_MIN_CTAS) name(...): its "
                    "name and figures are read from that form")
            name = match.group(2)
            if name in found:
                raise ToolMissing(f"kernel {name} is defined in both {found[name]} and "
                                  f"{path.name}")
            found[name], prefixes[name] = path.name, bounds.group(1)
    return found, prefixes


def _read_config(directory: Path, sources: dict[str, str],
                 prefixes: dict[str, str]) -> dict[str, int]:
    """Every `#define NAME <integer>` of lora_config.h, and the figures (<PREFIX>_MIN_CTAS,
    <PREFIX>_LOADS) that a kernel's own .cu defines. A figure defined in both with two values
    is refused: the kernels would not agree with the planner."""
    config = {name: int(value) for name, value in
              _DEFINE.findall((directory / CONFIG_HEADER).read_text(encoding="utf-8"))}
    for kernel, file_name in sources.items():
        figures = {f"{prefixes[kernel]}_{what}" for what in ("MIN_CTAS", "LOADS")}
        for name, value in _DEFINE.findall((directory / file_name).read_text(encoding="utf-8")):
            if name in figures and config.setdefault(name, int(value)) != int(value):
                raise ToolMissing(f"{name} is defined twice with different values "
                                  f"({config[name]} and {value}, in {file_name})")
    return config


_DIRECTORY = find_kernel_dir()
# Every kernel's source file; the extern "C" names are the kernel names.
KERNEL_SOURCES, _PREFIX = kernels_in(_DIRECTORY)
CONFIG: dict[str, int] = _read_config(_DIRECTORY, KERNEL_SOURCES, _PREFIX)
THREADS = CONFIG["METRALE_THREADS"]  # every kernel's block
VECTOR = CONFIG["METRALE_VECTOR"]  # BF16 per 16-byte load: dims, ranks and strides are multiples
MAX_RANK = CONFIG["METRALE_MAX_RANK"]  # the largest max_rank the kernels serve
MAX_SPLITS = CONFIG["METRALE_MAX_SPLITS"]  # split-K partials at most
SHRINK_ROWS = CONFIG["BGMV_SHRINK_ROWS"]  # rank rows per bgmv_shrink CTA
EXPAND_ROWS = CONFIG["BGMV_EXPAND_ROWS"]  # output rows per bgmv_expand thread
SGMV_TILE = CONFIG["SGMV_TILE"]  # SGMV tokens x columns x K per tile
SGMV_SHRINK_STAGES = CONFIG["SGMV_SHRINK_STAGES"]  # K tiles in flight per sgmv_shrink CTA
# Split-K partials a rank-16 sgmv_shrink reduction reads at once
SGMV_SPLITS_PER_TRIP = CONFIG["SGMV_SPLITS_PER_TRIP"]
SGMV_WIDE_SPLITS_PER_TRIP = CONFIG["SGMV_WIDE_SPLITS_PER_TRIP"]  # the same, any other tile
SGMV_EXPAND_STAGES = CONFIG["SGMV_EXPAND_STAGES"]  # rank chunks in flight per sgmv_expand CTA


def _figure(kernel: str, what: str) -> int:
    name = f"{_PREFIX[kernel]}_{what}"
    if name not in CONFIG:
        raise ToolMissing(f"kernel {kernel} needs `#define {name} <integer>` in "
                          f"{CONFIG_HEADER} or {KERNEL_SOURCES[kernel]}")
    return CONFIG[name]


def min_ctas_per_sm(kernel: str) -> int:
    """The CTAs per SM that `kernel`'s __launch_bounds__ guarantees (<PREFIX>_MIN_CTAS)."""
    return _figure(kernel, "MIN_CTAS")


def loads_in_flight(kernel: str) -> int:
    """Independent 16-byte loads per thread that each hot loop of `kernel` issues before their
    first use (<PREFIX>_LOADS; tests/test_kernels_sass.py checks it in the sm_90 SASS)."""
    return _figure(kernel, "LOADS")
