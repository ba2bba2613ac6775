"""LRU at every cache size from one pass over a paging workload: Mattson's stack distances.

LRU is a stack algorithm: a cache of `c` slots holds exactly the `c` most recently used
adapters, so a request hits at size `c` iff fewer than `c` other adapters were used since its
adapter's previous request (its stack distance). One pass computes every request's distance;
each size's hits, misses and the times its loads end follow from them without a replay. This is
exact for the slot manager in paging mode (no request holds a slot, so no victim is ever busy,
and empty slots fill before any eviction), pinned adapters aside: they hold their slots and
always hit, and the cache is the rest.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

# Requests between progress callbacks (the replay's figure, so a bar moves alike).
PROGRESS_EVERY = 1 << 16
COLD = -1  # the distance of a first request: a miss at every size


def stack_distances(adapter: np.ndarray,
                    progress: Callable[[int], None] | None = None) -> np.ndarray:
    """[N] int64: per request, how many distinct other adapters were requested since its own
    adapter's previous request (COLD for a first request). `adapter` holds adapter ids >= 0.

    Positions of each adapter's latest request carry a mark in a Fenwick tree; the distance of
    request `j` whose previous request was at `p` is the marks after `p`: the distinct adapters
    seen so far less the marks up to `p`. O(N log N), one pass."""
    n = int(adapter.size)
    prev = previous_use(adapter)
    out = np.full(n, COLD, dtype=np.int64)
    tree = [0] * (n + 1)
    distinct = 0
    prev_list = prev.tolist()
    for j in range(n):
        if progress is not None and j % PROGRESS_EVERY == PROGRESS_EVERY - 1:
            progress(PROGRESS_EVERY)
        p = prev_list[j]
        if p < 0:
            distinct += 1
        else:
            # Marks at positions <= p (1-based p + 1), then move this adapter's mark to j.
            i, marks = p + 1, 0
            while i:
                marks += tree[i]
                i &= i - 1
            out[j] = distinct - marks
            i = p + 1
            while i <= n:
                tree[i] -= 1
                i += i & -i
        i = j + 1
        while i <= n:
            tree[i] += 1
            i += i & -i
    if progress is not None:
        progress(n % PROGRESS_EVERY)
    return out


def previous_use(adapter: np.ndarray) -> np.ndarray:
    """[N] int64: the index of the previous request for the same adapter, or -1."""
    n = int(adapter.size)
    order = np.lexsort((np.arange(n), adapter))  # by adapter, then request order
    prev_sorted = np.full(n, -1, dtype=np.int64)
    same = adapter[order[1:]] == adapter[order[:-1]]
    prev_sorted[1:] = np.where(same, order[:-1], -1)
    prev = np.empty(n, dtype=np.int64)
    prev[order] = prev_sorted
    return prev


def load_ends(asked: np.ndarray, seconds: float, links: int) -> np.ndarray:
    """When each of a sequence of equal loads ends, asked for at the non-decreasing times
    `asked`, on `links` links, each load taking the link that frees first (LinkClock's rule).
    With equal loads in order, load k takes the link load k - links held, so each residue
    class mod `links` is one link's queue: end_i = max(asked_i, end_{i-1}) + seconds. Each end
    is computed as LinkClock computes it, one addition after the other: a closed form rounds
    differently, and a request that arrives as its adapter's load ends would be a delayed hit
    in the replay and a hit in the sweep, or the other way round."""
    ends = np.empty_like(asked)
    for link in range(links):
        free, mine = 0.0, []
        for now in asked[link::links].tolist():
            free = (free if free > now else now) + seconds
            mine.append(free)
        ends[link::links] = mine
    return ends
