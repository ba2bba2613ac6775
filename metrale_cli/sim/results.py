"""What a replay reports: `RunResult` (one policy at one size, its record), the cache state an
observer hears after each request (`CacheState`), and the statistics computed from the start
times: added latency against the all-resident baseline, time to first token, throughput."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np


@dataclass(frozen=True)
class CacheState:
    """Where the adapters are after a request (paging: once it is placed; concurrent: when it
    ends): the adapter each GPU slot holds (None: empty or
    loading), in slot order, and the host tier's adapters, least recently used first (empty
    without a host tier). What tests/test_engine_vllm_cache.py compares with vLLM's own."""

    slots: tuple[str | None, ...]
    host: tuple[str, ...]


# Called after each request has been placed: (request index, the cache state then).
Observer = Callable[[int, CacheState], None]


@dataclass
class RunResult:
    """One policy at one pool size. `start` (when each request started, in seconds),
    `served`, `ref_counts_at_end` and `waits` (each stall's wait) are for tests and the replica
    totals, and are not part of the record; `lru_sweep` leaves them empty (a list of every
    slot's zero count per size cost more than the sweep itself at 1,000 sizes)."""

    policy: str
    max_loras: int
    pinned: int
    requests: int
    adapter_requests: int
    hits: int
    delayed_hits: int
    misses: int
    swaps: int
    bytes_moved: int
    swap_s: float
    link_wait_s: float
    host_hits: int
    host_misses: int
    host_bytes_moved: int
    stalls: int
    stall_total_s: float
    stall_p50_s: float
    stall_p99_s: float
    added_latency_p50_s: float
    added_latency_p99_s: float
    added_latency_mean_s: float
    # Under --admission skip a request can start before its all-resident baseline (it took a
    # seat a stalled head did not hold): how many did, and the seconds they gained in all.
    # Their added latency is 0: added latency is how much later loads made a request start.
    moved_ahead: int
    gained_s: float
    # Time to first token (admission wait, loads, stalls, then the prefill), adapter requests
    # apart from base-model ones (None where there are none), and completed requests per second
    # from the first arrival to the last completion.
    ttft_adapter_p50_s: float | None
    ttft_adapter_p99_s: float | None
    ttft_base_p50_s: float | None
    ttft_base_p99_s: float | None
    throughput_req_s: float
    pool_bytes: int
    fits_budget: bool | None = None
    extra_misses_vs_min: int | None = None
    hit_rate_gap_vs_min: float | None = None
    # With --replicas, a summary per replica (the other figures are their totals).
    replicas: list[dict[str, Any]] | None = None
    # With --seeds K, each figure's min, median and max over the K seeds.
    spread: dict[str, dict[str, float] | None] | None = None
    start: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    waits: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    served: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64), repr=False)
    ref_counts_at_end: list[int] = field(default_factory=list, repr=False)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.adapter_requests if self.adapter_requests else 1.0

    def record(self) -> dict[str, Any]:
        skip = {"start", "served", "ref_counts_at_end", "waits"}
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}
        for optional in ("replicas", "spread"):
            if out[optional] is None:
                del out[optional]
        out["hit_rate"] = self.hit_rate
        # Belady's `min` evicts the adapter wanted furthest ahead: it needs the future, so no
        # engine can run it; it is the floor the others' misses are measured against.
        out["offline_bound"] = self.policy == "min"
        return out


def serving_stats(start: np.ndarray, arrival: np.ndarray, hold: np.ndarray,
                  first_token: np.ndarray, adapter: np.ndarray) -> dict[str, Any]:
    """TTFT percentiles (adapter requests apart from base-model ones) and throughput of requests
    that started at `start`; `adapter` marks the adapter requests."""
    ttft = start - arrival + first_token
    out: dict[str, Any] = {}
    for name, mask in (("adapter", adapter), ("base", ~adapter)):
        mine = ttft[mask]
        for q in (50, 99):
            out[f"ttft_{name}_p{q}_s"] = float(np.percentile(mine, q)) if mine.size else None
    n = int(start.size)
    out["throughput_req_s"] = throughput(n, float(arrival.min()) if n else 0.0,
                                          float((start + hold).max()) if n else 0.0)
    return out


def added_latency(start: np.ndarray, baseline: np.ndarray) -> dict[str, Any]:
    """Added latency (how much later than its all-resident baseline each request started, 0
    for one that started earlier) as its p50, p99 and mean, and apart from it the requests that
    started earlier (`moved_ahead`) and the seconds they gained (`gained_s`)."""
    late = start - baseline
    ahead = late < 0
    added = np.where(ahead, 0.0, late)
    n = int(start.size)
    return {"added_latency_p50_s": float(np.percentile(added, 50)) if n else 0.0,
            "added_latency_p99_s": float(np.percentile(added, 99)) if n else 0.0,
            "added_latency_mean_s": float(added.mean()) if n else 0.0,
            "moved_ahead": int(ahead.sum()), "gained_s": float((baseline - start)[ahead].sum())}


def throughput(n: int, first: float, last: float) -> float:
    return n / (last - first) if last > first else 0.0
