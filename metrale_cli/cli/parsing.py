"""What users type, read into values: module lists, sizes, positive counts. Each raises
`UsageError` naming the option, so the CLI edge turns it into one line and exit 2."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from metrale_cli.errors import UsageError

if TYPE_CHECKING:
    from metrale_cli.model.modules import LoraModule
    from metrale_cli.sim.costs import Link
    from metrale_cli.sim.trace_formats import Assign

_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}


def parse_size(text: str) -> int:
    """`40GiB`, `512MiB`, `1.5TB`, `1000000` -> bytes."""
    s = text.strip().lower().replace(" ", "").replace("_", "")
    number = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(number):]
    try:
        value = float(number)
    except ValueError:
        raise UsageError(f"not a size: {text!r} (try 40GiB, 512MiB)") from None
    if unit not in _SIZE_UNITS or not math.isfinite(value) or value < 0:
        raise UsageError(f"not a size: {text!r} (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
    size = value * _SIZE_UNITS[unit]
    if not math.isfinite(size):  # 1e300TiB: int() of infinity was an internal error
        raise UsageError(f"not a size: {text!r} (more bytes than floating point holds)")
    return int(size)


def parse_modules(text: str, option: str = "--modules") -> list[LoraModule]:
    """`q_proj,k_proj,...` or `all` -> pool modules in their fixed order; never empty."""
    from metrale_cli.model.modules import LoraModule  # the model stage: not at --help

    return LoraModule.parse_option(text, option)


def positive(option: str, *values: int | None) -> None:
    """Refuse a count or rank below 1 (None: not given, nothing to check)."""
    for value in values:
        if value is not None and value <= 0:
            raise UsageError(f"{option} must be positive, got {value}")


# Each size is a whole replay of the workload per policy: `1..100000000` would never finish.
MAX_SIZES = 1_000


def parse_size_list(option: str, text: str) -> list[int]:
    """Pool sizes: `8,16,32`, a range `8..64` (every size) or `8..64:8` (a step), or a mix,
    as sorted distinct positive sizes, at most `MAX_SIZES` of them."""
    sizes: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        try:
            if ".." in part:
                lo_text, _, rest = part.partition("..")
                hi_text, _, step_text = rest.partition(":")
                lo, hi, step = int(lo_text), int(hi_text), int(step_text or 1)
                if step <= 0 or hi < lo:
                    raise ValueError
                _bound_sizes(option, part, (hi - lo) // step + 1)  # before building the range
                sizes.update(range(lo, hi + 1, step))
            else:
                sizes.add(int(part))
        except ValueError:
            raise UsageError(f"{option}: {part!r} is not a size, a list like 8,16,32 or a "
                             "range like 8..64 or 8..64:8") from None
    _bound_sizes(option, text, len(sizes))
    if not sizes or min(sizes) <= 0:
        raise UsageError(f"{option}: sizes must be positive, got {text!r}")
    return sorted(sizes)


def _bound_sizes(option: str, text: str, count: int) -> None:
    if count > MAX_SIZES:
        raise UsageError(f"{option}: {text!r} is {count:,} sizes, more than a sweep takes "
                         f"({MAX_SIZES:,}); give a step, like 8..4096:8")


def parse_token_range(option: str, text: str) -> tuple[int, int]:
    """Token lengths: `8,512` -> (8, 512); `0` -> (0, 0)."""
    parts = [p.strip() for p in text.split(",")]
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise UsageError(f"{option}: expected LO,HI or N, got {text!r}") from None
    if len(values) == 1:
        values *= 2
    if len(values) != 2:
        raise UsageError(f"{option}: expected LO,HI or N, got {text!r}")
    return values[0], values[1]


def parse_assign(text: str, adapters: int, seed: int) -> Assign:
    """`zipf:1.5`, `zipf` (s = 1.5) or `uniform`: adapters for a trace that names none."""
    from metrale_cli.sim.trace_formats import Assign  # NumPy: not at --help

    kind, _, s = text.strip().lower().partition(":")
    if kind == "zipf":
        try:
            zipf_s = float(s) if s else 1.5
        except ValueError:
            raise UsageError(f"--assign: {text!r}: zipf:S needs a number S, like zipf:1.5") \
                from None
        return Assign("zipf", adapters, seed, zipf_s)
    if s:
        raise UsageError(f"--assign: {text!r}: only zipf takes a parameter")
    return Assign(kind, adapters, seed)


def parse_ranks(text: str) -> tuple[int, ...]:
    """`64,32,16,8` (cycled by adapter index) or an S-LoRA setting `slora:S2`."""
    from metrale_cli.sim.workload import SLORA_RANKS  # NumPy: not at --help

    key = text.strip()
    if key.lower().startswith("slora:"):
        setting = key[6:].strip().upper()
        if setting not in SLORA_RANKS:
            raise UsageError(f"--ranks: S-LoRA settings are {', '.join(SLORA_RANKS)}, got "
                             f"{key[6:]!r}")
        return SLORA_RANKS[setting]
    try:
        ranks = tuple(int(p) for p in key.split(","))
    except ValueError:
        raise UsageError(f"--ranks: expected ranks like 64,32,16,8 or slora:S2, got "
                         f"{text!r}") from None
    positive("--ranks", *ranks)
    return ranks


def parse_bandwidth(text: str, option: str = "--bandwidth") -> Link:
    """A preset (`pcie4`, `pcie5`, `nvlink`, `nvme`) or a figure like `25GB/s` or `800MiB/s`:
    the link, with the preset's per-swap latency (0 for a figure)."""
    from metrale_cli.sim.costs import BANDWIDTHS, Link  # the simulator stage: not at --help

    key = text.strip().lower()
    if key in BANDWIDTHS:
        return Link.preset(key)
    if not key.endswith("/s"):
        raise UsageError(f"{option}: {text!r} is neither a preset "
                         f"({', '.join(BANDWIDTHS)}) nor a figure like 25GB/s")
    try:
        bytes_per_s = parse_size(key[:-2])
    except UsageError as exc:
        raise UsageError(f"{option}: {exc}") from None
    if bytes_per_s <= 0:
        raise UsageError(f"{option} must be positive, got {text!r}")
    return Link(text.strip(), float(bytes_per_s), 0.0)
