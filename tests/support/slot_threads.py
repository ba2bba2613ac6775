"""Driving one SlotManager from many threads at once (the slot manager's tests and the pool's)."""

from __future__ import annotations

import threading
from collections.abc import Callable

from metrale_cli.pool.slots import SlotManager


def run_threads(worker: Callable[[int], None], count: int = 8) -> None:
    """`worker(seed)` for seeds 0..count-1, each on its own thread, all at once; fails naming
    every exception a worker raised (an assert inside a worker included)."""
    errors: list[BaseException] = []

    def guarded(seed: int) -> None:
        try:
            worker(seed)
        except BaseException as exc:  # surfaced below, on the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(s,)) for s in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def assert_all_released(m: SlotManager, held: list[int]) -> None:
    """After every worker released what it acquired: each ref count is 0, as the workers' own
    count `held` says, and the LRU clock is the last tick any slot was used at."""
    n = m.max_loras
    assert [m.ref_count(k) for k in range(n)] == [0] * n == held
    assert m.lru_tick == max(m.last_used(k) for k in range(n))
