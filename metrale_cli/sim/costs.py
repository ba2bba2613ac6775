"""What a load costs: the named links a slot's bytes cross (`BANDWIDTHS`, `Link`), one load's
bytes and seconds (`SwapCost`), the busy-until clock of a GPU's copy links (`LinkClock`), the host
tier in front of the GPU slots (`HostTier`), and every load of one run with what it moved
(`Loads`)."""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from metrale_cli.errors import UsageError

# Named links a slot's bytes cross on a swap: (bytes per second, per-swap latency in seconds,
# what it is). PCIe figures are typical achieved pinned host-to-device copies, not the raw link.
BANDWIDTHS: dict[str, tuple[float, float, str]] = {
    "pcie4": (25e9, 10e-6, "PCIe 4.0 x16 host to GPU, pinned (32 GB/s raw)"),
    "pcie5": (50e9, 10e-6, "PCIe 5.0 x16 host to GPU, pinned (64 GB/s raw)"),
    "nvlink": (450e9, 10e-6, "NVLink 4 GPU to GPU, one direction (H100/H200, nominal)"),
    "nvme": (7e9, 100e-6, "PCIe 4.0 NVMe SSD sequential read"),
}
# The longest per-load latency taken: past a day a figure is a typo, and a replay's sums of
# latencies overflow floating point (1e308 ms printed inf, and --json exited 70).
MAX_LATENCY_S = 86400.0
# Copy links per GPU: a GPU has a few copy engines; past this a figure is a typo, and the
# link clock would allocate one entry per link.
MAX_LINKS = 1024


@dataclass(frozen=True)
class Link:
    """A link a slot's bytes cross on a load: a preset of BANDWIDTHS or a figure."""

    name: str
    bytes_per_s: float
    latency_s: float

    def __post_init__(self) -> None:
        if not 0 < self.bytes_per_s < math.inf:
            raise UsageError(f"a link's bandwidth must be positive and finite, got "
                             f"{self.bytes_per_s:g} B/s")
        if not 0 <= self.latency_s <= MAX_LATENCY_S:
            raise UsageError(f"--swap-latency-ms must be between 0 and {1e3 * MAX_LATENCY_S:,.0f} "
                             f"(a day), got {1e3 * self.latency_s:g}")

    @classmethod
    def preset(cls, name: str) -> Link:
        bytes_per_s, latency_s, _ = BANDWIDTHS[name]
        return cls(name, bytes_per_s, latency_s)


@dataclass(frozen=True)
class SwapCost:
    """What one load moves and how long it takes, and how many loads run at once: a GPU has
    `links` copy links (1: the engine loads one adapter at a time), and a load waits for one."""

    slot_bytes: int           # one slot (and its expert slot): the bytes a load writes
    bytes_per_s: float
    latency_s: float
    bandwidth: str            # a preset name or the figure as given
    links: int = 1

    def __post_init__(self) -> None:
        if not 0 < self.links <= MAX_LINKS:
            raise UsageError(f"--links must be between 1 and {MAX_LINKS:,}, got "
                             f"{self.links:,}")

    @property
    def seconds(self) -> float:
        return self.load_seconds(self.slot_bytes)

    def load_seconds(self, load_bytes: int) -> float:
        """How long a load of `load_bytes` takes once it has its link."""
        return load_bytes / self.bytes_per_s + self.latency_s

    def record(self) -> dict[str, Any]:
        return {**asdict(self), "swap_s": self.seconds}


class LinkClock:
    """When each of a GPU's links is free: a load begins when the earliest-free link is (or at
    once) and holds it for its duration, so loads asked for together queue, never overlap."""

    def __init__(self, links: int) -> None:
        self._free = [0.0] * links  # a heap of busy-until times

    def load(self, now: float, seconds: float) -> tuple[float, float]:
        """A load asked for at `now`: (when it ends, how long it waited for a link)."""
        free = self._free[0]
        begin = free if free > now else now
        heapq.heapreplace(self._free, begin + seconds)
        return begin + seconds, begin - now


@dataclass(frozen=True)
class HostTier:
    """Host memory in front of the GPU slots (vLLM's `--max-cpu-loras`): an LRU of `slots`
    adapters. A GPU miss whose adapter is there copies it to the GPU; one that is not first
    reads it over `link` (disk or hub) into the tier, evicting the tier's least recently used."""

    slots: int
    link: Link

    def __post_init__(self) -> None:
        if self.slots <= 0:
            raise UsageError(f"--host-slots must be positive, got {self.slots}")


class Loads:
    """Every load of one run: its bytes and time by adapter (an adapter of rank r in a pool of
    max rank R moves r/R of a slot), the GPU link's queue, and the host tier when there is one,
    with what each moved."""

    def __init__(self, cost: SwapCost, load_bytes: Sequence[int], host: HostTier | None) -> None:
        self.cost, self.host = cost, host
        self.load_bytes = load_bytes
        # `cost.load_seconds` of each, in one pass (a loop over 10,000,000 adapters took 0.5 s
        # a run); the same float64 arithmetic.
        loaded = np.asarray(load_bytes, dtype=np.float64)
        self.load_s = (loaded / cost.bytes_per_s + cost.latency_s).tolist()
        self.gpu = LinkClock(cost.links)
        self.bytes_moved = 0
        self.swap_s = self.link_wait_s = 0.0
        self.host_hits = self.host_misses = self.host_bytes_moved = 0
        if host is not None:
            self.read_s = (loaded / host.link.bytes_per_s + host.link.latency_s).tolist()
            self.disk = LinkClock(1)
            self.resident: OrderedDict[int, None] = OrderedDict()

    def touch(self, adapter: int) -> None:
        """A request used `adapter`: the host tier's LRU moves it up, as vLLM's registered
        adapters are touched on each use."""
        if adapter in self.resident:
            self.resident.move_to_end(adapter)

    def load(self, adapter: int, now: float) -> float:
        """Load `adapter` onto the GPU, asked for at `now`: when the copy ends."""
        ready = now
        if self.host is not None:
            if adapter in self.resident:
                self.host_hits += 1
            else:
                self.host_misses += 1
                self.host_bytes_moved += self.load_bytes[adapter]
                if len(self.resident) == self.host.slots:
                    self.resident.popitem(last=False)
                self.resident[adapter] = None
                ready, _ = self.disk.load(now, self.read_s[adapter])
        seconds = self.load_s[adapter]
        end, wait = self.gpu.load(ready, seconds)
        self.bytes_moved += self.load_bytes[adapter]
        self.swap_s += seconds
        self.link_wait_s += wait
        return end
