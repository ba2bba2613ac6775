"""The replay core at compiled speed: a paging replay (`Replay.run` of a workload whose requests
hold no slot) as one numba function over integer columns, result for result the Python loop's
(`Replay._paging` driving `SlotManager`), which stays as the reference the tests hold it to.

Why numba: the Python loop costs 2-7 us a request (a string-keyed slot lookup, a lock taken per
call, objects per event); the same steps over int64 and float64 arrays cost about 0.05 us, and
numba ships as a wheel (no compiler on the user's machine). It is imported here only, and this
module only when a replay runs: `metrale --help`, `inspect` and `layout` never load it. Compiled
functions are cached on disk (`cache=True`), so a run after the first does not compile again.

The state mirrors `SlotManager`'s for paging, where a load begins and ends in one step: per slot
the adapter it holds (-1 empty), its victim key and a version; victim candidates in a binary
heap of (key, slot, version) with lazy deletion and the same keys (empty slots first, lowest
index; then lru's last-use tick, fifo's load order, or min's minus next use), so every victim is
the one `select_victim_slot` picks. Loads cross `links` links (a heap of busy-until times, as
`LinkClock`), and with a host tier an LRU of adapters (a linked list) read over one disk link.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

from metrale_cli.pool.slot_cache import EMPTY_KEY, NEVER

POLICY_CODES = {"lru": 0, "fifo": 1, "min": 2}


@njit(cache=True, inline="always")
def _less(keys: Any, slots: Any, vers: Any, i: int, j: int) -> bool:
    """Heap entry i before entry j: (key, slot, version) compared as Python compares tuples."""
    if keys[i] != keys[j]:
        return keys[i] < keys[j]
    if slots[i] != slots[j]:
        return slots[i] < slots[j]
    return vers[i] < vers[j]


@njit(cache=True)
def _sift_down(keys: Any, slots: Any, vers: Any, size: int, i: int) -> None:
    while True:
        child = 2 * i + 1
        if child >= size:
            return
        if child + 1 < size and _less(keys, slots, vers, child + 1, child):
            child += 1
        if not _less(keys, slots, vers, child, i):
            return
        keys[i], keys[child] = keys[child], keys[i]
        slots[i], slots[child] = slots[child], slots[i]
        vers[i], vers[child] = vers[child], vers[i]
        i = child


@njit(cache=True)
def _push(keys: Any, slots: Any, vers: Any, size: int, key: int, slot: int, ver: int) -> int:
    i = size
    keys[i], slots[i], vers[i] = key, slot, ver
    while i > 0:
        parent = (i - 1) // 2
        if not _less(keys, slots, vers, i, parent):
            break
        keys[i], keys[parent] = keys[parent], keys[i]
        slots[i], slots[parent] = slots[parent], slots[i]
        vers[i], vers[parent] = vers[parent], vers[i]
        i = parent
    return size + 1


@njit(cache=True)
def _pop(keys: Any, slots: Any, vers: Any, size: int) -> int:
    size -= 1
    keys[0], slots[0], vers[0] = keys[size], slots[size], vers[size]
    _sift_down(keys, slots, vers, size, 0)
    return size


@njit(cache=True)
def _link_load(free: Any, now: float, seconds: float) -> tuple[float, float]:
    """`LinkClock.load`: free[0] is the earliest-free link of a heap of busy-until times."""
    first = free[0]
    begin = first if first > now else now
    free[0] = begin + seconds
    n, i = free.size, 0
    while True:  # heapreplace's sift down (ties keep the parent, as heapq does)
        child = 2 * i + 1
        if child >= n:
            break
        if child + 1 < n and not free[child] < free[child + 1]:
            child += 1
        if free[child] < free[i]:
            free[i], free[child] = free[child], free[i]
            i = child
        else:
            break
    return begin + seconds, begin - now


@njit(cache=True)
def _new_slots(pinned: Any, n_adapters: int, max_loras: int) -> tuple[Any, ...]:
    """The slot tables both replays start from: the pinned adapters in the first slots
    (slot_of by adapter, held by slot), the victim keys (last use, load time, next use, the
    slot's version) and the victim heap holding every other slot empty, lowest index first.
    Returns (slot_of, held, last_used, loaded_at, next_use, version, heap keys, heap slots,
    heap versions, heap size)."""
    n_pinned = pinned.size
    slot_of = np.full(n_adapters, -1, np.int64)
    held = np.full(max_loras, -1, np.int64)
    for k in range(n_pinned):
        if pinned[k] >= 0:
            slot_of[pinned[k]] = k
        held[k] = pinned[k]
    version = np.zeros(max_loras, np.int64)
    cap = 2 * max_loras + 64 + 1
    hkey = np.empty(cap, np.int64)
    hslot = np.empty(cap, np.int64)
    hver = np.empty(cap, np.int64)
    size = 0
    for k in range(n_pinned, max_loras):
        version[k] += 1
        size = _push(hkey, hslot, hver, size, EMPTY_KEY, k, version[k])
    return (slot_of, held, np.zeros(max_loras, np.int64), np.zeros(max_loras, np.int64),
            np.full(max_loras, NEVER, np.int64), version, hkey, hslot, hver, size)


@njit(cache=True)
def paging(adapter: Any, arrival: Any, nxt: Any, policy: int, max_loras: int, pinned: Any,
           n_adapters: int, load_s: Any, load_bytes: Any, links: int, host_slots: int,
           read_s: Any, start: Any) -> tuple[Any, ...]:
    """Replay requests `adapter` (-1: the base model) arriving at `arrival` one at a time
    against `max_loras` slots, `pinned` adapters in the first ones (-1: one no request
    names), under `policy`
    (POLICY_CODES); `nxt[r]` is the position of request r's adapter's next request (NEVER:
    none). Writes each request's start into `start`. Returns (hits, delayed hits, misses, swaps,
    bytes moved, swap seconds, link wait seconds, host hits, host misses, host bytes moved)."""
    n_pinned = pinned.size
    (slot_of, held, last_used, loaded_at, next_use, version, hkey, hslot, hver,
     size) = _new_slots(pinned, n_adapters, max_loras)
    tick = 0
    load_seq = 0
    ready = np.zeros(n_adapters)
    free = np.zeros(links)
    disk = np.zeros(1)
    # The host tier: an LRU list of adapters (head the least recently used), -1 ends it.
    resident = np.zeros(n_adapters, np.bool_)
    before = np.full(n_adapters, -1, np.int64)
    after = np.full(n_adapters, -1, np.int64)
    head = -1
    tail = -1
    in_host = 0
    hits = delayed = misses = swaps = bytes_moved = 0
    host_hits = host_misses = host_bytes = 0
    swap_s = link_wait_s = 0.0
    for r in range(adapter.size):
        a = adapter[r]
        start[r] = arrival[r]
        if a < 0:
            continue
        if host_slots > 0 and resident[a] and a != tail:  # a use moves it up the host LRU
            b, f = before[a], after[a]
            if b >= 0:
                after[b] = f
            else:
                head = f
            before[f] = b
            before[a], after[a] = tail, -1
            after[tail] = a
            tail = a
        k = slot_of[a]
        loaded = k < 0
        if loaded:
            # The victim: the heap's live top (select_victim_slot).
            while True:
                top = hslot[0]
                if hver[0] == version[top]:
                    break
                size = _pop(hkey, hslot, hver, size)
            k = top
            if held[k] >= 0:
                swaps += 1
                slot_of[held[k]] = -1
            held[k] = a
            slot_of[a] = k
            load_seq += 1
            loaded_at[k] = load_seq
            misses += 1
            now = arrival[r]
            ready_at = now
            if host_slots > 0:
                if resident[a]:
                    host_hits += 1
                else:
                    host_misses += 1
                    host_bytes += load_bytes[a]
                    if in_host == host_slots:  # evict the least recently used
                        old = head
                        head = after[old]
                        if head >= 0:
                            before[head] = -1
                        else:
                            tail = -1
                        resident[old] = False
                        in_host -= 1
                    resident[a] = True
                    before[a], after[a] = tail, -1
                    if tail >= 0:
                        after[tail] = a
                    else:
                        head = a
                    tail = a
                    in_host += 1
                    ready_at, _ = _link_load(disk, now, read_s[a])
            end, wait = _link_load(free, ready_at, load_s[a])
            bytes_moved += load_bytes[a]
            swap_s += load_s[a]
            link_wait_s += wait
            start[r] = end
            ready[a] = end
        elif ready[a] > arrival[r]:  # its load is still under way: it waits
            delayed += 1
            start[r] = ready[a]
        else:
            hits += 1
        # Touch, then (min) the next use: a new key for a cache slot under lru and min, and
        # after a load under every policy.
        tick += 1
        last_used[k] = tick
        if policy == 2:
            next_use[k] = nxt[r]
        if k >= n_pinned and (policy != 1 or loaded):
            version[k] += 1
            if policy == 0:
                key = last_used[k]
            elif policy == 1:
                key = loaded_at[k]
            else:
                key = -next_use[k]
            if size > 2 * max_loras + 64:  # only live entries stay (SlotManager._requeue)
                live = 0
                for i in range(size):
                    if hver[i] == version[hslot[i]]:
                        hkey[live], hslot[live], hver[live] = hkey[i], hslot[i], hver[i]
                        live += 1
                size = live
                for i in range(size // 2 - 1, -1, -1):
                    _sift_down(hkey, hslot, hver, size, i)
            size = _push(hkey, hslot, hver, size, key, k, version[k])
    return (hits, delayed, misses, swaps, bytes_moved, swap_s, link_wait_s, host_hits,
            host_misses, host_bytes)


@njit(cache=True)
def stack_distances(prev: Any, cold: int) -> Any:
    """Per request, the distinct other adapters requested since its adapter's previous request
    at `prev[j]` (`cold` where there is none): a Fenwick tree marks each adapter's latest
    request; the distance is the marks after `prev[j]`."""
    n = prev.size
    out = np.full(n, cold, np.int64)
    tree = np.zeros(n + 1, np.int64)
    distinct = 0
    for j in range(n):
        p = prev[j]
        if p < 0:
            distinct += 1
        else:
            i, marks = p + 1, 0  # marks at positions <= p, then its mark moves to j
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
    return out


@njit(cache=True)
def _rank(count: int, m: int, q: float) -> tuple[int, int, float]:
    """np.percentile(q)'s two neighbours among `count` values, `count - m` zeros then `m`
    positive ones: their indices into the positive ones (-1: a zero) and the weight."""
    at = q / 100 * (count - 1)
    lo = int(np.floor(at))
    hi = min(lo + 1, count - 1)
    zeros = count - m
    return lo - zeros, hi - zeros, at - lo


@njit(cache=True)
def _order_statistics(ranks: Any, below: Any, equal: int, seconds: float,
                      above: Any) -> Any:
    """The values at `ranks` (-1: a zero) of the sorted positive values: those of `below`,
    `equal` times `seconds`, those of `above`; each part partitioned once, only when a rank
    falls in it (most waits are one load's `seconds`, so the parts are small)."""
    nb = below.size
    out = np.zeros(ranks.size)
    low = ranks[(ranks >= 0) & (ranks < nb)]
    high = ranks[ranks >= nb + equal] - nb - equal
    low_part = np.partition(below, np.unique(low)) if low.size else below
    high_part = np.partition(above, np.unique(high)) if high.size else above
    for i in range(ranks.size):
        k = ranks[i]
        if k < 0:
            continue
        if k < nb:
            out[i] = low_part[k]
        elif k < nb + equal:
            out[i] = seconds
        else:
            out[i] = high_part[k - nb - equal]
    return out


# A pivot whose per-size work passes 1/PIVOT_SPLIT of a pass over every request serves only the
# sizes below twice itself; the next pivot is prepared (a few passes and a sort) for the rest.
PIVOT_SPLIT = 16


@njit(cache=True)
def _pivot_loads(asked: Any, load: Any, seconds: float, links: int) -> tuple[Any, Any, Any]:
    """The requests `load` marks as misses (those of the pivot, the smallest size swept; at
    every larger size the misses are among them): per load its end, and the start of its run
    (loads from one point where every link is free to the next), and per run start whether a
    load of the run waits for a link. Loads of equal length on `links` links under LinkClock's
    rule: with fewer loads each link is free no later, so a load that waits for no link here
    waits for none at a larger size, it ends no later there, and a run's start frees every
    link at every larger size."""
    n = asked.size
    end = np.zeros(n)
    start = np.zeros(n, np.int64)
    busy = np.zeros(n, np.bool_)
    ring = np.zeros(max(links, 1))
    latest = 0.0
    k = run = 0
    for j in range(n):
        if not load[j]:
            continue
        now = asked[j]
        if k == 0 or latest <= now:
            run = j
        start[j] = run
        free = ring[k % links]
        if free > now:
            busy[run] = True
        end[j] = (free if free > now else now) + seconds
        ring[k % links] = end[j]
        latest = end[j]
        k += 1
    return end, start, busy


@njit(cache=True, inline="always")
def _tally(wait: float, seconds: float, below: Any, above: Any, nb: int,
           na: int) -> tuple[int, int, int]:
    """A positive wait counted where the added-latency order statistics read it: one load time
    exactly (how many), or kept below or above it. Returns (equal added, nb, na)."""
    if wait == seconds:
        return 1, nb, na
    if wait < seconds:
        below[nb] = wait
        return 0, nb + 1, na
    above[na] = wait
    return 0, nb, na + 1


@njit(cache=True)
def lru_sweep(adapter: Any, asked: Any, distance: Any, caches: Any, seconds: float,
              links: int, n_adapters: int, n: int, n_adapter: int) -> Any:
    """Per cache size of `caches` (ascending), the LRU paging replay of the requests `adapter`
    (ids >= 0, pinned ones left out) asked for at `asked` (non-decreasing), from their stack
    distances: a
    request misses where its distance is COLD or at least the size; each miss's load queues on
    `links` links (load i takes the link load i - links held: LinkClock's rule for equal loads),
    and a hit waits for its adapter's latest load. Rows of [size, 9]: misses, delayed hits, the
    loads' summed end - ask, added latency's sum, the latest load end (0: none), and added
    latency's p50 and p99 over `n` requests and over `n_adapter` (the added latency of the
    requests left out is 0).

    The per-request work is done once per pivot, the smallest size of a group of sizes: the
    misses at any size of the group are among the pivot's, so with the pivot's misses loaded,
    a load that waits for no link waits for none at a size of the group, and ends at its ask
    plus `seconds`: only runs holding a load that can wait ("busy" runs: loads between two
    points where every link is free) are replayed per size. Misses elsewhere are counted by
    distance (sorted once), and a hit can wait only where an earlier load of its adapter ends
    after it at the pivot: those few follow their adapter's loads back to its latest miss at
    each size. Where that work per size is small, the first pivot serves every size; where
    the links are crowded (`PIVOT_SPLIT`), a pivot serves the sizes below twice itself, and
    the next, with fewer misses, leaves fewer busy runs."""
    m = adapter.size
    out = np.zeros((caches.size, 9))
    if m == 0:
        return out
    big = np.iinfo(np.int64).max
    key = np.where(distance < 0, big, distance)  # a request misses at sizes <= its key
    latest = np.zeros(n_adapters)  # for a pass over every request: its adapter's latest load end
    sim_end = np.zeros(m)
    ring = np.zeros(max(links, 1))
    below = np.empty(m)
    above = np.empty(m)
    counts = np.array([n, n, n_adapter, n_adapter])
    qs = np.array([50.0, 99.0, 50.0, 99.0])
    prev = np.empty(m, np.int64)  # its adapter's previous load at the pivot, -1: none
    seen = np.full(n_adapters, -1, np.int64)
    first = 0  # the first size of the pivot's group
    while first < caches.size:
        pivot = caches[first]
        load = key >= pivot
        seen[:] = -1
        for j in range(m):
            prev[j] = seen[adapter[j]]
            if load[j]:
                seen[adapter[j]] = j
        all_end, run, busy = _pivot_loads(asked, load, seconds, links)
        replayed = np.flatnonzero(load & busy[run])
        # The other loads end at ask + seconds at every size of the group: by key, descending,
        # their counts, summed end - ask and latest end for every prefix.
        calm = np.flatnonzero(load & ~busy[run])
        by_key = calm[np.argsort(-key[calm], kind="mergesort")]
        calm_keys = -key[by_key]  # ascending, for searchsorted
        calm_wait = np.zeros(by_key.size + 1)
        calm_last = np.zeros(by_key.size + 1)
        calm_positive = np.zeros(by_key.size + 1, np.int64)  # waits > 0 (all, unless seconds 0)
        for i in range(by_key.size):
            j = by_key[i]
            end = asked[j] + seconds
            calm_wait[i + 1] = calm_wait[i] + (end - asked[j])
            calm_last[i + 1] = max(calm_last[i], end)
            calm_positive[i + 1] = calm_positive[i] + (end - asked[j] > 0)
        # Hits that can wait: an earlier load of their adapter ends after them at the pivot.
        can_wait = np.zeros(m, np.bool_)
        for j in range(m):
            can_wait[j] = prev[j] >= 0 and all_end[prev[j]] > asked[j]
        waiting = np.flatnonzero(can_wait)
        # The most steps per size: the busy runs and each waiting hit's uses back to where its
        # adapter's loads end before it. Past half a pass over every request (links crowded),
        # each size is one pass over every request instead.
        steps = replayed.size
        for i in range(waiting.size):
            j = waiting[i]
            q = prev[j]
            while q >= 0 and all_end[q] > asked[j] and steps <= m // 2:
                steps += 1
                q = prev[q]
        every = steps > m // 2
        # The group: every larger size where a size costs little; else the sizes below twice
        # the pivot, and the next group's pivot, with fewer loads, crowds the links less.
        last = caches.size
        if steps > m // PIVOT_SPLIT:
            last = first + 1
            while last < caches.size and caches[last] < 2 * pivot:
                last += 1
        for s in range(first, last):
            cache = caches[s]
            calm_misses = np.searchsorted(calm_keys, -cache, side="right")
            misses, equal = calm_misses, calm_positive[calm_misses]
            load_added = calm_wait[calm_misses]
            added, last_end = load_added, calm_last[calm_misses]
            delayed = nb = na = k = 0
            if every:
                misses = equal = 0
                load_added = added = last_end = 0.0
                ring[:] = 0.0
            for i in range(m if every else replayed.size):
                j = i if every else replayed[i]
                if every and key[j] < cache:
                    wait = latest[adapter[j]] - asked[j]
                    if wait > 0:
                        delayed += 1
                        added += wait
                        eq, nb, na = _tally(wait, seconds, below, above, nb, na)
                        equal += eq
                    continue
                if not every and run[j] == j:  # every link is free here at every size
                    ring[:] = 0.0 if j == 0 else -np.inf
                    k = 0
                if key[j] < cache:
                    continue
                now = asked[j]
                free = ring[k % links]
                end = (free if free > now else now) + seconds
                ring[k % links] = end
                k += 1
                sim_end[j] = end
                latest[adapter[j]] = end
                misses += 1
                load_added += end - now
                last_end = max(last_end, end)
                wait = end - now
                added += wait
                if wait > 0:
                    eq, nb, na = _tally(wait, seconds, below, above, nb, na)
                    equal += eq
            for i in range(0 if every else waiting.size):
                j = waiting[i]
                if key[j] >= cache:
                    continue
                q = prev[j]  # back to its adapter's latest miss at this size while it may end late
                while q >= 0 and all_end[q] > asked[j]:
                    if key[q] >= cache:
                        end = sim_end[q] if busy[run[q]] else asked[q] + seconds
                        wait = end - asked[j]
                        if wait > 0:
                            delayed += 1
                            added += wait
                            eq, nb, na = _tally(wait, seconds, below, above, nb, na)
                            equal += eq
                        break
                    q = prev[q]
            ranks = np.empty(8, np.int64)
            weights = np.empty(4)
            for i in range(4):
                ranks[2 * i], ranks[2 * i + 1], weights[i] = _rank(counts[i], nb + equal + na,
                                                                   qs[i])
            value = _order_statistics(ranks, below[:nb], equal, seconds, above[:na])
            out[s, 0], out[s, 1], out[s, 2], out[s, 3], out[s, 4] = (misses, delayed, load_added,
                                                                     added, last_end)
            for i in range(4):
                if counts[i]:
                    low, high = value[2 * i], value[2 * i + 1]
                    out[s, 5 + i] = low + (high - low) * weights[i]
        first = last
    return out


@njit(cache=True, inline="always")
def _event_before(t: Any, kind: Any, seq: Any, i: int, j: int) -> bool:
    """Event i before event j: by time, then kind (request ends before load ends), then the
    order they were made in."""
    if t[i] != t[j]:
        return t[i] < t[j]
    if kind[i] != kind[j]:
        return kind[i] < kind[j]
    return seq[i] < seq[j]


@njit(cache=True)
def _event_swap(t: Any, kind: Any, seq: Any, x: Any, y: Any, i: int, j: int) -> None:
    t[i], t[j] = t[j], t[i]
    kind[i], kind[j] = kind[j], kind[i]
    seq[i], seq[j] = seq[j], seq[i]
    x[i], x[j] = x[j], x[i]
    y[i], y[j] = y[j], y[i]


@njit(cache=True)
def _event_push(t: Any, kind: Any, seq: Any, x: Any, y: Any, size: int, when: float,
                what: int, order: int, at: int, who: int) -> int:
    i = size
    t[i], kind[i], seq[i], x[i], y[i] = when, what, order, at, who
    while i > 0:
        parent = (i - 1) // 2
        if not _event_before(t, kind, seq, i, parent):
            break
        _event_swap(t, kind, seq, x, y, i, parent)
        i = parent
    return size + 1


@njit(cache=True)
def _event_pop(t: Any, kind: Any, seq: Any, x: Any, y: Any, size: int) -> int:
    size -= 1
    _event_swap(t, kind, seq, x, y, 0, size)
    i = 0
    while True:
        child = 2 * i + 1
        if child >= size:
            return size
        if child + 1 < size and _event_before(t, kind, seq, child + 1, child):
            child += 1
        if not _event_before(t, kind, seq, child, i):
            return size
        _event_swap(t, kind, seq, x, y, i, child)
        i = child


@njit(cache=True)
def _host_touch(a: int, resident: Any, before: Any, after: Any, ends: Any) -> None:
    """A use of `a`: up to the host tier LRU's end if it is there (`ends`: its head, tail)."""
    if not resident[a] or a == ends[1]:
        return
    b, f = before[a], after[a]
    if b >= 0:
        after[b] = f
    else:
        ends[0] = f
    before[f] = b
    before[a], after[a] = ends[1], -1
    after[ends[1]] = a
    ends[1] = a


@njit(cache=True)
def _earliest(first: Any, next_same: Any, gone: Any, a1: int) -> int:
    """The earliest waiting request for adapter `a1 - 1` (-1: none), the gone ones dropped."""
    r = first[a1]
    while r >= 0 and gone[r]:
        r = next_same[r]
    first[a1] = r
    return r


@njit(cache=True)
def concurrent(adapter: Any, arrival: Any, hold: Any, nxt: Any, policy: int, max_loras: int,
               pinned: Any, n_adapters: int, seats: int, skip: bool, load_s: Any,
               load_bytes: Any, links: int, host_slots: int, read_s: Any, start: Any,
               waits: Any) -> Any:
    """Replay requests that hold their slot for `hold[r]` seconds (`Replay._concurrent`): at
    most `seats` in flight, each with a count on its adapter's slot; a miss loads into the
    policy's victim among idle slots, and its request (and any for the same adapter meanwhile,
    delayed hits) starts when the load ends; with no idle slot the head waits, stalled, until
    a request ends, and under `skip` admission later requests whose adapter is resident or
    loading go ahead (WaitingQueue's index: a heap of each startable adapter's earliest
    waiting request). Writes each request's start into `start` and each stall's wait into
    `waits`. Returns [hits, delayed hits, misses, swaps, stalls, bytes moved, host hits, host
    misses, host bytes moved, error] (error 1: a stall with nothing in flight) and [swap
    seconds, link wait seconds]."""
    n = adapter.size
    n_pinned = pinned.size
    (slot_of, held, last_used, loaded_at, next_use, version, hkey, hslot, hver,
     size) = _new_slots(pinned, n_adapters, max_loras)
    # A slot: 0 empty, 1 loading, 2 ready; its count of requests in flight.
    state = np.zeros(max_loras, np.int64)
    state[:n_pinned] = 2
    refs = np.zeros(max_loras, np.int64)
    tick = load_seq = 0
    # Events: request ends (kind 0: x its slot or -1, y the request) and load ends (kind 1:
    # x the slot, y the adapter).
    ecap = n + max_loras + 1
    et = np.empty(ecap)
    ekind = np.empty(ecap, np.int64)
    eseq = np.empty(ecap, np.int64)
    ex = np.empty(ecap, np.int64)
    ey = np.empty(ecap, np.int64)
    events = order = 0
    # Requests waiting on an adapter's load, in order: a list per adapter.
    loading = np.zeros(n_adapters, np.bool_)
    first_waiting = np.full(n_adapters, -1, np.int64)
    last_waiting = np.full(n_adapters, -1, np.int64)
    next_waiting = np.full(n, -1, np.int64)
    stalled = np.zeros(n, np.bool_)
    stalled_at = np.zeros(n)
    # The waiting queue: [head, i) less the requests gone; under skip, indexed by adapter
    # (index a + 1, the base model's 0): each adapter's waiting requests in arrival order and
    # a heap of (earliest waiting request, adapter) of the startable ones offered.
    gone = np.zeros(n, np.bool_)
    first_same = np.full(n_adapters + 1, -1, np.int64)
    last_same = np.full(n_adapters + 1, -1, np.int64)
    next_same = np.full(n, -1, np.int64)
    offered = np.zeros(n_adapters + 1, np.bool_)
    qcap = n_adapters + 2
    qr = np.empty(qcap, np.int64)
    qa = np.empty(qcap, np.int64)
    qzero = np.zeros(qcap, np.int64)
    queued = 0
    considered = 0
    went = np.full(n, -1, np.int64)  # the pass past a stalled head a request went in
    passes = 0
    free = np.zeros(links)
    disk = np.zeros(1)
    resident = np.zeros(n_adapters, np.bool_)
    before = np.full(n_adapters, -1, np.int64)
    after = np.full(n_adapters, -1, np.int64)
    ends = np.full(2, -1, np.int64)  # the host tier LRU's head and tail
    in_host = 0
    hits = delayed = misses = swaps = stalls = bytes_moved = 0
    host_hits = host_misses = host_bytes = 0
    swap_s = link_wait_s = 0.0
    running = 0
    i = 0  # the next arrival
    head = 0
    error = 0
    now = 0.0
    while i < n or events:
        if events and (i >= n or et[0] <= arrival[i]):
            now, kind, x, y = et[0], ekind[0], ex[0], ey[0]
            events = _event_pop(et, ekind, eseq, ex, ey, events)
            if kind == 0:
                if x >= 0:
                    # touch, then release: its key is its last use once no request holds it.
                    tick += 1
                    last_used[x] = tick
                    refs[x] -= 1
                    version[x] += 1
                    if refs[x] == 0 and x >= n_pinned:
                        if size > 2 * max_loras + 64:
                            size = _compact(hkey, hslot, hver, size, version)
                        key = (last_used[x] if policy == 0 else loaded_at[x] if policy == 1
                               else -next_use[x])
                        size = _push(hkey, hslot, hver, size, key, x, version[x])
                running -= 1
            else:
                state[x] = 2
                held[x] = y
                slot_of[y] = x
                load_seq += 1
                loaded_at[x] = load_seq
                loading[y] = False
                r = first_waiting[y]
                first_waiting[y] = -1
                while r >= 0:  # each waiting request starts on the slot
                    refs[x] += 1
                    tick += 1
                    last_used[x] = tick
                    if policy == 2:
                        next_use[x] = nxt[r]
                    version[x] += 1
                    start[r] = now
                    events = _event_push(et, ekind, eseq, ex, ey, events, now + hold[r], 0,
                                         order, x, r)
                    order += 1
                    r = next_waiting[r]
        else:
            now = arrival[i]
            if skip:
                a1 = adapter[i] + 1
                if first_same[a1] < 0:
                    first_same[a1] = i
                else:
                    next_same[last_same[a1]] = i
                last_same[a1] = i
                a = adapter[i]
                if (a < 0 or loading[a] or slot_of[a] >= 0) and not offered[a1]:
                    offered[a1] = True
                    queued = _push(qr, qa, qzero, queued, _earliest(first_same, next_same,
                                                                    gone, a1), a, 0)
            i += 1
        while running < seats:
            while head < i and gone[head]:
                head += 1
            if head >= i:
                break
            r = head
            a = adapter[r]
            k = -1
            if a >= 0:
                if host_slots > 0 and not stalled[r]:
                    _host_touch(a, resident, before, after, ends)
                k = slot_of[a]
                if k < 0:
                    if loading[a]:  # its load is under way: no second load
                        delayed += 1
                        next_waiting[r] = -1
                        next_waiting[last_waiting[a]] = r
                        last_waiting[a] = r
                        gone[r] = True
                        running += 1
                        continue
                    while size and hver[0] != version[hslot[0]]:
                        size = _pop(hkey, hslot, hver, size)
                    if size == 0:  # PoolFull
                        if not events:
                            error = 1
                            break
                        if not stalled[r]:
                            stalled[r] = True
                            stalled_at[r] = now
                        if not skip:
                            break
                        # Later requests that can start now go ahead, in order, while seats
                        # last; those that need a load wait behind the head, stalled from
                        # the first time they were passed over.
                        passes += 1
                        last = -1
                        while queued and running < seats:
                            e, b = qr[0], qa[0]
                            if not (b < 0 or loading[b] or slot_of[b] >= 0):
                                queued = _pop(qr, qa, qzero, queued)
                                offered[b + 1] = False
                                continue
                            earliest = _earliest(first_same, next_same, gone, b + 1)
                            if earliest < 0:
                                queued = _pop(qr, qa, qzero, queued)
                                offered[b + 1] = False
                                continue
                            if earliest != e:  # its earlier requests left: its place moves
                                queued = _pop(qr, qa, qzero, queued)
                                queued = _push(qr, qa, qzero, queued, earliest, b, 0)
                                continue
                            gone[e] = True
                            following = _earliest(first_same, next_same, gone, b + 1)
                            queued = _pop(qr, qa, qzero, queued)
                            if following < 0:
                                offered[b + 1] = False
                            else:
                                queued = _push(qr, qa, qzero, queued, following, b, 0)
                            went[e] = passes
                            last = e
                            running += 1
                            if b >= 0 and loading[b]:
                                delayed += 1
                                next_waiting[e] = -1
                                next_waiting[last_waiting[b]] = e
                                last_waiting[b] = e
                                continue
                            g = -1
                            if b >= 0:
                                hits += 1
                                g = slot_of[b]
                                refs[g] += 1
                                tick += 1
                                last_used[g] = tick
                                if policy == 2:
                                    next_use[g] = nxt[e]
                                version[g] += 1
                            start[e] = now
                            events = _event_push(et, ekind, eseq, ex, ey, events,
                                                 now + hold[e], 0, order, g, e)
                            order += 1
                        # The requests this pass looked at first: up to the one that took
                        # the last seat, or every one that has arrived.
                        upto = last + 1 if running >= seats else i
                        for c in range(considered, max(considered, upto)):
                            b = adapter[c]
                            if c == r or b < 0 or (gone[c] and went[c] != passes):
                                continue
                            if host_slots > 0 and not stalled[c]:
                                _host_touch(b, resident, before, after, ends)
                            if not gone[c] and not stalled[c]:
                                stalled[c] = True
                                stalled_at[c] = now
                        considered = max(considered, upto)
                        break
                    victim = hslot[0]
                    if state[victim] == 2:
                        swaps += 1
                        slot_of[held[victim]] = -1
                    held[victim] = -1
                    state[victim] = 1
                    version[victim] += 1  # loading: no longer a candidate
                    misses += 1
                    if stalled[r]:
                        waits[stalls] = now - stalled_at[r]
                        stalls += 1
                    loading[a] = True
                    first_waiting[a] = last_waiting[a] = r
                    next_waiting[r] = -1
                    gone[r] = True
                    if skip and not offered[a + 1]:  # its later requests can start
                        earliest = _earliest(first_same, next_same, gone, a + 1)
                        if earliest >= 0:
                            offered[a + 1] = True
                            queued = _push(qr, qa, qzero, queued, earliest, a, 0)
                    ready_at = now
                    if host_slots > 0:
                        if resident[a]:
                            host_hits += 1
                        else:
                            host_misses += 1
                            host_bytes += load_bytes[a]
                            if in_host == host_slots:
                                old = ends[0]
                                ends[0] = after[old]
                                if ends[0] >= 0:
                                    before[ends[0]] = -1
                                else:
                                    ends[1] = -1
                                resident[old] = False
                                in_host -= 1
                            resident[a] = True
                            before[a], after[a] = ends[1], -1
                            if ends[1] >= 0:
                                after[ends[1]] = a
                            else:
                                ends[0] = a
                            ends[1] = a
                            in_host += 1
                            ready_at, _ = _link_load(disk, now, read_s[a])
                    end, wait = _link_load(free, ready_at, load_s[a])
                    bytes_moved += load_bytes[a]
                    swap_s += load_s[a]
                    link_wait_s += wait
                    events = _event_push(et, ekind, eseq, ex, ey, events, end, 1, order,
                                         victim, a)
                    order += 1
                    running += 1
                    continue
                hits += 1
                refs[k] += 1
                tick += 1
                last_used[k] = tick
                if policy == 2:
                    next_use[k] = nxt[r]
                version[k] += 1
            start[r] = now
            events = _event_push(et, ekind, eseq, ex, ey, events, now + hold[r], 0, order, k, r)
            order += 1
            gone[r] = True
            running += 1
        if error:
            break
    counts = np.array([hits, delayed, misses, swaps, stalls, bytes_moved, host_hits,
                       host_misses, host_bytes, error], np.int64)
    return counts, np.array([swap_s, link_wait_s])


@njit(cache=True)
def _compact(keys: Any, slots: Any, vers: Any, size: int, version: Any) -> int:
    """Keep only the live entries of the victim heap (SlotManager._requeue's rebuild)."""
    live = 0
    for i in range(size):
        if vers[i] == version[slots[i]]:
            keys[live], slots[live], vers[live] = keys[i], slots[i], vers[i]
            live += 1
    for i in range(live // 2 - 1, -1, -1):
        _sift_down(keys, slots, vers, live, i)
    return live


def compile_now() -> None:
    """Compile (or load from the cache) every function of the core: `make` runs it once."""
    one = np.zeros(1, np.int64)
    paging(one, np.zeros(1), one, 0, 1, np.zeros(0, np.int64), 1, np.zeros(1), one, 1, 0,
           np.zeros(1), np.zeros(1))
    stack_distances(np.full(1, -1, np.int64), -1)
    lru_sweep(one, np.zeros(1), one, one, 1.0, 1, 1, 1, 1)
    concurrent(one, np.zeros(1), np.zeros(1), one, 0, 1, np.zeros(0, np.int64), 1, 2, False,
               np.zeros(1), one, 1, 0, np.zeros(1), np.zeros(1), np.zeros(1))
