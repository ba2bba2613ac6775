"""Admission in a concurrent replay: the orders a waiting request can start in (`ADMISSIONS`) and
the queue of requests waiting for a seat (`WaitingQueue`)."""

from __future__ import annotations

import array
import heapq
from collections import deque
from collections.abc import Callable, Iterator

ADMISSIONS = ("fcfs", "skip")


class WaitingQueue:
    """The requests waiting for admission in a concurrent replay, in arrival order, each
    leaving when it starts or joins a load. `indexed` (skip admission) adds an index by
    adapter, so that a pass past a stalled head visits the requests that can start, in arrival
    order, and not the whole queue at every event: a heap of each startable adapter's earliest
    waiting request, checked when taken (an adapter evicted since is dropped, and offered
    again when it next loads). Base-model requests are adapter -1, always startable."""

    def __init__(self, n: int, adapter: array.array[int], indexed: bool) -> None:
        self._order: deque[int] = deque()
        self._gone = bytearray(n)
        self._adapter, self._indexed = adapter, indexed
        self._by_adapter: dict[int, deque[int]] = {}
        self._heap: list[tuple[int, int]] = []  # (earliest waiting request, adapter)
        self._offered: set[int] = set()
        self.considered = 0  # requests below this were looked at by a pass past the head

    def arrive(self, r: int, startable: Callable[[int], bool]) -> None:
        self._order.append(r)
        if self._indexed:
            a = self._adapter[r]
            self._by_adapter.setdefault(a, deque()).append(r)
            if startable(a):
                self.offer(a)

    def head(self) -> int | None:
        order, gone = self._order, self._gone
        while order and gone[order[0]]:
            order.popleft()
        return order[0] if order else None

    def gone(self, r: int) -> bool:
        return bool(self._gone[r])

    def leave(self, r: int) -> None:
        self._gone[r] = 1

    def _earliest(self, a: int) -> int | None:
        waiting = self._by_adapter.get(a)
        while waiting and self._gone[waiting[0]]:
            waiting.popleft()
        if not waiting:
            self._by_adapter.pop(a, None)
            return None
        return waiting[0]

    def offer(self, a: int) -> None:
        """Adapter `a` became startable (it arrived so, or its load began)."""
        if self._indexed and a not in self._offered:
            r = self._earliest(a)
            if r is not None:
                self._offered.add(a)
                heapq.heappush(self._heap, (r, a))

    def startable_in_order(self, startable: Callable[[int], bool]) -> Iterator[int]:
        """The waiting requests whose adapter is `startable`, earliest first, each leaving as
        it is yielded (the caller stops taking them when seats run out)."""
        heap, offered = self._heap, self._offered
        while heap:
            r, a = heap[0]
            if not startable(a):
                heapq.heappop(heap)
                offered.discard(a)
                continue
            earliest = self._earliest(a)
            if earliest is None:
                heapq.heappop(heap)
                offered.discard(a)
                continue
            if earliest != r:  # its earlier requests left: its place in the heap moves
                heapq.heapreplace(heap, (earliest, a))
                continue
            self._gone[r] = 1
            following = self._earliest(a)
            if following is None:
                heapq.heappop(heap)
                offered.discard(a)
            else:
                heapq.heapreplace(heap, (following, a))
            yield r

    def consider(self, upto: int) -> range:
        """Requests first looked at by this pass: from the last pass's end to `upto`."""
        first = self.considered
        self.considered = max(first, upto)
        return range(first, self.considered)
