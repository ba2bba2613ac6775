"""The reference replay: the two event loops, paging and concurrent, that drive the pool's own
slot state machine (`SlotCache`, the core `SlotManager` wraps in its lock) request by request,
with adapter indices for keys. The compiled core (sim/core.py) runs the same replay and is
tested against these (tests/test_replay_core.py); they also run whenever an observer wants the
cache state after each request (tests/test_engine_vllm_cache.py).

**Paging** (every request holds its slot for zero time): the requests are served one at a time
in order, the classic paging problem, where `min` (Belady) is the optimum; a request that
arrives before its adapter's load ends is a delayed hit and starts when the load does.
**Concurrent**: a request takes a seat (at most `max_concurrency`) and a ref count on its
adapter's slot from admission to completion; a miss loads the adapter into the victim slot and
the request starts when the load ends; when every cache slot has in-flight sequences the slot
cache says `PoolFull` and the request waits at the head of the queue (`WaitingQueue`), never
evicting an adapter in flight.
"""

from __future__ import annotations

import array
import heapq
import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from metrale_cli.errors import PoolFull, UsageError
from metrale_cli.pool.slot_cache import SlotCache, SlotState
from metrale_cli.sim.admission import WaitingQueue
from metrale_cli.sim.costs import Loads
from metrale_cli.sim.results import CacheState, Observer
from metrale_cli.sim.workload import Workload

if TYPE_CHECKING:
    from metrale_cli.sim.replay import Replay

PROGRESS_EVERY = 1 << 16  # requests between progress callbacks
# What a replay loop counts: hits, delayed hits, misses, swaps, stall waits (s); `Loads` counts
# what the loads moved.
Counts = tuple[int, int, int, int, list[float]]


class Columns(NamedTuple):
    """The per-request columns the loops index: arrays of 8-byte values, not lists of Python
    objects (four of those took 250 MB at 2,000,000 requests), and as fast to index."""

    adapter: array.array[int]      # adapter index, -1 the base model
    arrival: array.array[float]    # seconds
    hold: array.array[float]       # seconds a request holds its seat; all 0 in paging mode
    next_use: array.array[int]     # the next request for the same adapter, NEVER if none

    @classmethod
    def of(cls, workload: Workload, hold: np.ndarray, next_use: np.ndarray) -> Columns:
        return cls(_column("q", workload.adapter), _column("d", workload.arrival),
                   _column("d", hold), _column("q", next_use))


def _column(code: str, values: np.ndarray) -> array.array[Any]:
    column = array.array(code)
    # The array's own bytes (a view, no copy between).
    column.frombytes(np.ascontiguousarray(values, dtype=np.float64 if code == "d"
                                          else np.int64).view(np.uint8))
    return column


def observer(replay: Replay, cache: SlotCache, loads: Loads,
             observe: Observer) -> Callable[[int], None]:
    """`observe` fed the state of `cache` and `loads` after request r."""
    names = replay.workload.adapters

    def told(r: int) -> None:
        slots = tuple(replay.adapter_name(a) if state is SlotState.READY else None
                      for a, state in zip(cache.adapter, cache.state, strict=True))
        host = (tuple(names[a] for a in loads.resident) if replay.host is not None
                else ())
        observe(r, CacheState(slots, host))
    return told


def _load(cache: SlotCache) -> tuple[int, bool]:
    """Pick a victim and begin loading into it: (slot, whether it evicted an adapter)."""
    victim = cache.select_victim()
    evicts = cache.state[victim] is SlotState.READY
    cache.begin_load(victim)
    return victim, evicts


def paging(replay: Replay, cache: SlotCache, loads: Loads, start: np.ndarray,
           served: np.ndarray, progress: Callable[[int], None] | None,
           observe: Callable[[int], None] | None) -> Counts:
    """Every request in order, one at a time, each placed at once."""
    columns = replay.columns
    adapter, arrival, nxt = columns.adapter, columns.arrival, columns.next_use
    use_next, tiered = cache.policy == "min", replay.host is not None
    # A zero-length request takes and returns its count at once: a touch, one call.
    slot_of, touch, set_next_use = cache.slot_of, cache.touch, cache.set_next_use
    hits = delayed = misses = swaps = 0
    ready: dict[int, float] = {}  # adapter -> when its latest load ends
    start[:] = replay.workload.arrival
    for r, a in enumerate(adapter):
        served[r] += 1
        if progress is not None and r % PROGRESS_EVERY == PROGRESS_EVERY - 1:
            progress(PROGRESS_EVERY)
        if a < 0:
            if observe is not None:
                observe(r)
            continue
        if tiered:
            loads.touch(a)
        slot = slot_of(a)
        if slot is None:
            slot, evicts = _load(cache)
            cache.finish_load(slot, a)
            misses += 1
            swaps += evicts
            start[r] = ready[a] = loads.load(a, arrival[r])
        elif ready.get(a, 0.0) > arrival[r]:  # its load is still under way: it waits
            delayed += 1
            start[r] = ready[a]
        else:
            hits += 1
        touch(slot)
        if use_next:
            set_next_use(slot, nxt[r])
        if observe is not None:
            observe(r)
    if progress is not None:
        progress(len(adapter) % PROGRESS_EVERY)
    return hits, delayed, misses, swaps, []


def concurrent(replay: Replay, cache: SlotCache, loads: Loads, start: np.ndarray,
               served: np.ndarray, progress: Callable[[int], None] | None,
               observe: Callable[[int], None] | None) -> Counts:
    """Arrivals, request ends and load ends as events in time order, each request holding a
    seat and its slot from its start to its end."""
    columns = replay.columns
    adapter, arrival, hold, nxt = columns.adapter, columns.arrival, columns.hold, columns.next_use
    use_next, tiered = cache.policy == "min", replay.host is not None
    slot_of, acquire, release = cache.slot_of, cache.acquire, cache.release
    set_next_use, touch = cache.set_next_use, cache.touch
    n = len(adapter)
    seats = replay.max_concurrency or n + 1
    # Events: (time, kind, seq, x, y); kind 0 = a request ends (x = its slot or -1, y = the
    # request), kind 1 = a load ends (x = the slot, y = the adapter). At equal times, ends come
    # before arrivals so that what they free is there for the next admission.
    events: list[tuple[float, int, int, int, int]] = []
    seq = itertools.count()  # ties in time and kind keep the order things happened in
    loading: dict[int, list[int]] = {}  # adapter -> requests waiting for its load
    skip = replay.admission == "skip"
    queue = WaitingQueue(n, adapter, indexed=skip)
    stalled_since: dict[int, float] = {}
    waits: list[float] = []
    running = hits = delayed = misses = swaps = 0
    i = 0

    def startable(a: int) -> bool:
        """A request for `a` can start now: the base model, or resident, or loading."""
        return a < 0 or a in loading or slot_of(a) is not None

    def skip_ahead(head: int, now: float, running: int) -> int:
        """The head cannot be placed: later requests whose adapter is resident or loading
        (or that need none) start now, in order, while seats last, as vLLM's scheduler
        lets them; those that need a load wait behind the head, stalled from the first
        time they were passed over with a seat free. Returns `running`."""
        nonlocal hits, delayed
        went: list[int] = []
        for r in queue.startable_in_order(startable):
            a = adapter[r]
            went.append(r)
            running += 1
            if a < 0:
                serve(r, -1, now)
            elif a in loading:
                delayed += 1
                loading[a].append(r)
            else:
                hits += 1
                serve(r, slot_of(a), now)
            if running >= seats:
                break
        # The requests this pass looked at for the first time: up to the one that took
        # the last seat, or every one that has arrived. Each is touched once in the host
        # tier (a use), and waits stalled if it is still waiting.
        upto = went[-1] + 1 if running >= seats else i
        left = set(went)
        for r in queue.consider(upto):
            a = adapter[r]
            if r == head or a < 0 or (queue.gone(r) and r not in left):
                continue
            if tiered and r not in stalled_since:
                loads.touch(a)
            if not queue.gone(r):
                stalled_since.setdefault(r, now)
        return running

    def serve(r: int, slot: int, now: float) -> None:
        """Request `r` starts now on `slot` (-1: the base model, no slot)."""
        if slot >= 0:
            acquire(slot)
            if use_next:
                set_next_use(slot, nxt[r])
        start[r] = now
        served[r] += 1
        heapq.heappush(events, (now + hold[r], 0, next(seq), slot, r))

    while i < n or events:
        if events and (i >= n or events[0][0] <= arrival[i]):
            now, kind, _, x, y = heapq.heappop(events)
            if kind == 0:
                if x >= 0:
                    # The engine touches every adapter in the batch each step, so a slot
                    # was last used when its last sequence ended, not when it began.
                    touch(x)
                    release(x)
                running -= 1
                if observe is not None:
                    observe(y)
            else:
                cache.finish_load(x, y)
                for r in loading.pop(y):
                    serve(r, x, now)
        else:
            now = arrival[i]
            queue.arrive(i, startable)
            i += 1
            if progress is not None and i % PROGRESS_EVERY == 0:
                progress(PROGRESS_EVERY)
        while running < seats and (r := queue.head()) is not None:
            a = adapter[r]
            slot = -1
            if a >= 0:
                if tiered and r not in stalled_since:  # one use, however long it waits
                    loads.touch(a)
                slot = slot_of(a)
                if slot is None:
                    if a in loading:  # its load is under way: no second load
                        delayed += 1
                        loading[a].append(r)
                        queue.leave(r)
                        running += 1
                        continue
                    try:
                        victim, evicts = _load(cache)
                    except PoolFull:
                        if not events:
                            raise UsageError("the slot cache can never free a slot "
                                             "(no request in flight)") from None
                        stalled_since.setdefault(r, now)
                        if skip:
                            running = skip_ahead(r, now, running)
                        break
                    misses += 1
                    swaps += evicts
                    if r in stalled_since:
                        waits.append(now - stalled_since.pop(r))
                    loading[a] = [r]
                    queue.leave(r)
                    queue.offer(a)  # its later requests can start: a delayed hit each
                    heapq.heappush(events, (loads.load(a, now), 1, next(seq), victim, a))
                    running += 1
                    continue
                hits += 1
            serve(r, slot, now)
            queue.leave(r)
            running += 1
    if progress is not None:
        progress(n % PROGRESS_EVERY)
    return hits, delayed, misses, swaps, waits
