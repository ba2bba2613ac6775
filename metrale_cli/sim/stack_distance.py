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

COLD = -1  # the distance of a first request: a miss at every size


def stack_distances(adapter: np.ndarray,
                    progress: Callable[[int], None] | None = None) -> np.ndarray:
    """[N] int64: per request, how many distinct other adapters were requested since its own
    adapter's previous request (COLD for a first request). `adapter` holds adapter ids >= 0.

    Positions of each adapter's latest request carry a mark in a Fenwick tree; the distance of
    request `j` whose previous request was at `p` is the marks after `p`: the distinct adapters
    seen so far less the marks up to `p`. O(N log N), one pass, in the compiled core."""
    from metrale_cli.sim import core

    out = core.stack_distances(adapter, COLD)
    if progress is not None:
        progress(int(adapter.size))
    return out
