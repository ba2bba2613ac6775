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
def stack_distances(adapter: Any, cold: int) -> Any:
    """Per request of `adapter` (ids >= 0), the distinct other adapters requested since its
    adapter's previous request (`cold` where there is none): a Fenwick tree marks each
    adapter's latest request; the distance is the marks after it. The latest request of each
    adapter is kept per id as the pass goes (no sort by adapter: at 1,000,000 requests that
    took longer than the tree)."""
    n = adapter.size
    out = np.full(n, cold, np.int64)
    tree = np.zeros(n + 1, np.int64)
    latest = np.full(adapter.max() + 1 if n else 0, -1, np.int64)
    distinct = 0
    for j in range(n):
        p, latest[adapter[j]] = latest[adapter[j]], j
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


@njit(cache=True, inline="always")
def _accumulate(s: float, error: float, x: float) -> tuple[float, float]:
    """s + x, and `error` with the sum's rounding error added (Neumaier): the sweep's summed
    load waits take and give back every load's wait once per change, so plain sums would
    drift."""
    t = s + x
    return t, error + ((s - t) + x if abs(s) >= abs(x) else (x - t) + s)


@njit(cache=True, inline="always")
def _wait_falls(j: int, old: float, new: float, hi: Any, lo: Any, above_hi: Any, members: Any,
                n_members: Any) -> None:
    """Load j's wait for a link fell from `old` to `new` (0: it waited for none, or is a hit
    now): past a window's top it leaves the count above the window, into the window it joins
    the window's members."""
    for g in range(hi.size):
        if old > hi[g] >= new:
            above_hi[g] -= 1
            if new > 0 and new >= lo[g]:
                members[g, n_members[g]] = j
                n_members[g] += 1


# The bucket of a positive wait for the percentile windows' histogram: its float64 bits
# shifted to keep the exponent and 7 bits of the mantissa (128 buckets an octave; monotone in
# the wait, since positive floats order as their bits do).
BUCKET_SHIFT = 45


@njit(cache=True, inline="always")
def _bits(x: float) -> int:
    """The float64 `x`'s bits as an int64."""
    return np.array([x]).view(np.int64)[0]


@njit(cache=True, inline="always")
def _from_bits(bits: int) -> float:
    """The float64 whose bits are the int64 `bits`."""
    return np.array([bits]).view(np.float64)[0]


@njit(cache=True, inline="always")
def _bucket(bits: int, base: int, hist: Any) -> int:
    """The histogram bucket of a positive wait's float64 `bits` (`base`: the bucket of one
    load time), clamped to the histogram: a wait below one load time falls in the first."""
    return min(max((bits >> BUCKET_SHIFT) - base, 0), hist.size - 1)


@njit(cache=True)
def _set_window(tops: Any, g: int, room: int, lag: Any, bits: Any, above: Any, hi: Any, lo: Any,
                above_hi: Any, members: Any, n_members: Any, queued: Any, n_queued: Any,
                hist: Any, base: int) -> None:
    """Set window g around the from-the-largest indices `tops` with `room` waits to spare
    below, from one histogram of the waits' buckets (no sort, no selection): its top is the
    last wait of the bucket holding index tops[0] (so none above it is sought), its bottom
    the first of the bucket holding index tops[-1] + room; then one pass gathers its members
    and counts the waits above it."""
    hist[:] = 0
    size = 0
    for i in range(n_queued[1]):
        j = queued[i]
        if lag[j] > 0:
            queued[size] = j
            size += 1
            hist[_bucket(bits[j], base, hist)] += 1
    n_queued[1] = size
    above_bits = above.view(np.int64)
    for i in range(above.size):
        hist[_bucket(above_bits[i], base, hist)] += 1
    b, count = hist.size - 1, 0
    while b > 0 and count + hist[b] <= tops[0]:
        count += hist[b]
        b -= 1
    # The last float of bucket b; the last bucket holds every larger wait.
    hi[g] = np.inf if b == hist.size - 1 else _from_bits(((b + 1 + base) << BUCKET_SHIFT) - 1)
    while b > 0 and count + hist[b] <= tops[-1] + room:
        count += hist[b]
        b -= 1
    lo[g] = -np.inf if b == 0 else _from_bits((b + base) << BUCKET_SHIFT)
    top, bottom, over, inside = hi[g], lo[g], 0, 0  # in locals: the stores could alias them
    for i in range(size):
        j = queued[i]
        v = lag[j]
        if v > top:
            over += 1
        elif v >= bottom:
            members[g, inside] = j
            inside += 1
    above_hi[g], n_members[g] = over, inside


@njit(cache=True)
def _largest(tops: Any, g: int, lag: Any, bits: Any, above: Any, hi: Any, lo: Any,
             above_hi: Any, members: Any, n_members: Any, drift: Any, values: Any, queued: Any,
             n_queued: Any, hist: Any, base: int) -> Any:
    """The values at from-the-largest indices `tops` (ascending) among the waits of the loads
    that waited for a link (`lag` > 0, float64 bits `bits`) and of the delayed hits `above`.
    Window g (waits in [lo[g], hi[g]], above_hi[g] of the loads' waits above it) answers where
    it holds every index sought; else it is set again around the indices (`_set_window`).
    Waits only fall from one size to the next, so the value at an index does too: after each
    answer the window's top comes down to it (the members above it join the count above), so
    the next read scans only the waits below the last answer, and the window stays valid
    until the indices sought fall below its bottom. `queued[:n_queued[1]]` holds every load
    that waits (and some that no longer do: a load that waits for no link never will again).
    Room below a window: about sqrt(waits x drift / 2), drift[g] the waits between the last
    two answers (-1: none yet), which balances the passes over the waits per set against the
    room each read gathers and selects from (at 1,000,000 requests, 2 in place of 1/2 cost
    5-8% more, 1/8 about as much)."""
    out = np.empty(tops.size)
    for attempt in range(2):
        top, bottom = hi[g], max(lo[g], 0.0)  # in locals: the stores below could alias them
        count = above_hi[g]
        for v in above:
            count += v > top
        size = 0
        for i in range(n_members[g]):
            j = members[g, i]
            v = lag[j]
            if v > 0 and v >= bottom:
                members[g, size] = j
                values[size] = v
                size += 1
        n_members[g] = size
        for v in above:
            if bottom <= v <= top:
                values[size] = v
                size += 1
        if (count <= tops[0] and tops[-1] < count + size) or attempt:
            break
        waits = n_queued[0] + above.size
        room = (max(tops[-1] // 4, waits // 32) if drift[g] < 0
                else int(np.sqrt(0.5 * waits * drift[g])))
        _set_window(tops, g, room + 256, lag, bits, above, hi, lo, above_hi, members, n_members,
                    queued, n_queued, hist, base)
    picks = size - 1 - (tops - count)
    part = np.partition(values[:size], np.unique(picks))
    for i in range(tops.size):
        out[i] = part[picks[i]]
    # The window's top down to the largest answer: members above it join the count above.
    kept = 0
    for i in range(n_members[g]):
        if values[i] > out[0]:
            above_hi[g] += 1
        else:
            members[g, kept] = members[g, i]
            kept += 1
    drift[g] = n_members[g] - kept
    n_members[g] = kept
    hi[g] = out[0]
    return out


# Inlined: the sweep replays about 487,000 runs at 1,000,000 requests, and a call passing
# twenty arrays cost 0.06 s of its 0.36 s there.
@njit(cache=True, inline="always")
def _replay_run(first: int, start: int, last: int, cache: int, fresh: bool, key: Any,
                asked: Any, seconds: float, links: int, ring: Any, end: Any, lag: Any,
                run_of: Any, run_last: Any, run_busy: Any, total: Any, n_queued: Any, hi: Any,
                lo: Any, above_hi: Any, members: Any, n_members: Any) -> None:
    """Replay the loads among requests start..last (those whose key is at least `cache`) of the
    run that begins at `first`, every link free there (LinkClock's rule for equal loads: load i
    takes the link load i - links held); the loads before `start` keep their ends. Set each
    load's end and, where it waited for a link, its end - ask (`lag`, else 0), and split them
    into runs: loads from one point where every link is free to the next, `run_of` a load's
    run (its first load), `run_last` its last load, `run_busy` whether one of its loads
    waited. Unless `fresh`, the loads' previous waits leave `total` and `n_queued` first; their
    new ones join them, and the windows of `_largest` hear of the waits that fell."""
    ring[:] = 0.0  # at or before the first ask: every end so far, or LinkClock's start
    at, latest, run, busy, previous = 0, 0.0, -1, False, -1
    if start > first:
        # The run goes on from the loads before `start`: the links hold the ends of the last
        # `links` of them (oldest first, where load `start` looks), the latest is the last's.
        held, j = links, start - 1
        while held > 0 and j >= first:
            if key[j] >= cache:
                held -= 1
                ring[held] = end[j]
                if previous < 0:
                    previous, latest = j, end[j]
            j -= 1
        run = first
        for j in range(first, start):
            if lag[j] > 0:
                busy = True
                break
    # The sums in locals: stores to the arrays below could alias them, so numba would
    # reload and store them at every load.
    summed, error, waiting = total[0], total[1], n_queued[0]
    for j in range(start, last + 1):
        if key[j] < cache:
            continue
        now, old = asked[j], lag[j]
        if not fresh:
            summed, error = _accumulate(summed, error, -(end[j] - now))
            waiting -= old > 0
        if run < 0 or latest <= now:  # every link free (ends never decrease): a new run
            if run >= 0:
                run_last[run], run_busy[run] = previous, busy
            run, busy = j, False
        free = ring[at]
        waits = free > now
        latest = (free if waits else now) + seconds
        ring[at] = latest
        at = at + 1 if at + 1 < links else 0
        end[j], lag[j], run_of[j] = latest, latest - now if waits else 0.0, run
        busy |= waits
        waiting += waits
        summed, error = _accumulate(summed, error, latest - now)
        if old > 0 and not fresh:
            _wait_falls(j, old, lag[j], hi, lo, above_hi, members, n_members)
        previous = j
    total[0], total[1], n_queued[0] = summed, error, waiting
    if run >= 0:
        run_last[run], run_busy[run] = previous, busy


@njit(cache=True)
def lru_sweep(adapter: Any, asked: Any, distance: Any, caches: Any, seconds: float,
              links: int, n_adapters: int, n: int, n_adapter: int) -> Any:
    """Per cache size of `caches` (ascending), the LRU paging replay of the requests `adapter`
    (ids >= 0, pinned ones left out) asked for at `asked` (non-decreasing), from their stack
    distances: a request misses where its distance is COLD or at least the size; each miss's
    load queues on `links` links (load i takes the link load i - links held: LinkClock's rule
    for equal loads), and a hit waits for its adapter's latest load. Rows of [size, 9]:
    misses, delayed hits, the loads' summed end - ask, added latency's sum, the latest load end
    (0: none), and added latency's p50 and p99 over `n` requests and over `n_adapter` (the
    added latency of the requests left out is 0).

    The smallest size is replayed once; each larger size is the one before it less the loads
    whose distance lies between the two, and only what those change is done again. The loads
    at a larger size are among those at a smaller one, so every load that stays ends no later
    (equal loads, first come first served) and every request's added latency can only fall:
    a point where every link is free stays one, so only the runs of loads between such points
    that lost a load and held one that waited are replayed; a load that did not wait never
    will; a hit can be delayed only where it was (or is a new hit), and by the latest load of
    its adapter, found through its previous request. The percentiles read most waits as one
    load time (the loads that waited for no link) and select the others from a window of
    waits around the rank sought (`_largest`), set again only when the waits fall past it."""
    m = adapter.size
    out = np.zeros((caches.size, 9))
    if m == 0:
        return out
    key = np.where(distance < 0, np.iinfo(np.int64).max, distance)  # a load at sizes <= key
    # The requests that become hits at each size, by index: the first size whose cache
    # exceeds a request's key (caches.size: none), counted, then placed in request order.
    step = np.empty(m, np.int32)  # int32 here and below: a trace holds at most 10,000,000
    for j in range(m):
        step[j] = np.searchsorted(caches, key[j], side="right")
    at = np.zeros(caches.size + 2, np.int64)
    for j in range(m):
        at[step[j] + 1] += 1
    at = np.cumsum(at)
    order = np.empty(m, np.int32)
    for j in range(m):
        order[at[step[j]]] = j
        at[step[j]] += 1
    hits = 0
    prev = np.empty(m, np.int32)  # the previous request for the same adapter, -1: none
    seen = np.full(n_adapters, -1, np.int32)
    for j in range(m):
        prev[j], seen[adapter[j]] = seen[adapter[j]], j
    ring = np.zeros(max(links, 1))
    end = np.zeros(m)
    lag = np.zeros(m)  # a load's end - ask where it waited for a link, else 0
    run_of = np.full(m, -1, np.int32)
    run_last = np.zeros(m, np.int32)
    run_busy = np.zeros(m, np.bool_)
    dirty = np.zeros(m, np.bool_)
    dirty_runs = np.empty(m, np.int32)
    dirty_from = np.empty(m, np.int32)
    total = np.zeros(2)  # the loads' summed end - ask, compensated
    n_queued = np.zeros(2, np.int64)  # the loads that wait; how many `queued` holds
    queued = np.empty(m, np.int32)  # the loads that wait, by index (and some that no longer do)
    delayed = np.empty(m, np.int32)  # the delayed hits, by index
    n_delayed = 0
    is_delayed = np.zeros(m, np.bool_)
    waits_on = np.zeros(m, np.int32)  # a delayed hit's load
    new_delayed = np.empty(m, np.int32)
    groups = 2 if n_adapter == n else 4  # percentile windows: p50, p99 over n (n_adapter)
    hi = np.full(groups, np.inf)  # no window yet: none holds an index sought
    lo = np.full(groups, np.inf)
    drift = np.full(groups, -1, np.int64)
    above_hi = np.zeros(groups, np.int64)
    members = np.empty((groups, m), np.int32)
    n_members = np.zeros(groups, np.int64)
    values = np.empty(m)
    bits = lag.view(np.int64)
    counts = np.array([n, n, n_adapter, n_adapter])
    qs = np.array([50.0, 99.0, 50.0, 99.0])
    last = m - 1
    for s in range(caches.size):
        cache = caches[s]
        was = hits
        hits = at[s]  # placed: the bucket of size s ends where bucket s + 1 began
        if s == 0:
            _replay_run(0, 0, m - 1, cache, True, key, asked, seconds, links, ring, end, lag,
                        run_of, run_last, run_busy, total, n_queued, hi, lo, above_hi, members,
                        n_members)
            longest = 0.0
            for j in range(m):
                if lag[j] > 0:
                    queued[n_queued[1]] = j
                    n_queued[1] += 1
                    longest = max(longest, lag[j])
            # The windows' histogram spans the waits from one load time to the longest now
            # (waits only fall; a delayed hit waits no longer than its load did).
            base = _bits(seconds) >> BUCKET_SHIFT
            hist = np.zeros(max((_bits(longest) >> BUCKET_SHIFT) - base + 1, 1), np.int64)
        else:
            n_dirty = 0
            for i in range(was, hits):
                j = order[i]
                total[0], total[1] = _accumulate(total[0], total[1], -(end[j] - asked[j]))
                n_queued[0] -= lag[j] > 0
                _wait_falls(j, lag[j], 0.0, hi, lo, above_hi, members, n_members)
                lag[j] = 0.0
                r = run_of[j]
                if run_busy[r] and not dirty[r]:  # its first lost load: new hits ascend
                    dirty[r] = True
                    dirty_runs[n_dirty], dirty_from[n_dirty] = r, j
                    n_dirty += 1
            for i in range(n_dirty):
                r = int(dirty_runs[i])
                dirty[r] = run_busy[r] = False
                # The loads before its first lost one keep their ends: replayed from there.
                _replay_run(r, int(dirty_from[i]), int(run_last[r]), cache, False, key, asked,
                            seconds, links, ring, end, lag, run_of, run_last, run_busy, total,
                            n_queued, hi, lo, above_hi, members, n_members)
        while last >= 0 and key[last] < cache:
            last -= 1
        # Delayed hits: the last size's and the new hits, by index, so a hit's previous
        # request (a load, or a hit delayed by its adapter's latest load) is settled first.
        new_hits = order[was:hits]
        i = k = n_new = 0
        delayed_s = 0.0
        while i < n_delayed or k < new_hits.size:
            if k >= new_hits.size or (i < n_delayed and delayed[i] < new_hits[k]):
                j = delayed[i]
                i += 1
            else:
                j = new_hits[k]
                k += 1
            p, q = prev[j], -1
            if p >= 0:
                q = p if key[p] >= cache else (waits_on[p] if is_delayed[p] else -1)
            is_delayed[j] = q >= 0 and end[q] > asked[j]
            if is_delayed[j]:
                waits_on[j] = q
                new_delayed[n_new] = j
                n_new += 1
                delayed_s += end[q] - asked[j]
        n_delayed = n_new
        delayed[:n_delayed] = new_delayed[:n_delayed]
        late = np.empty(n_delayed)
        for i in range(n_delayed):
            late[i] = end[waits_on[delayed[i]]] - asked[delayed[i]]
        below = np.sort(late[late < seconds])
        above = late[late > seconds]
        # Positive added latencies ascending: delayed hits below one load time, the loads that
        # waited for no link (one load time) and delayed hits at it, then the loads that waited
        # and the delayed hits above it ("top": read from the largest down).
        misses = m - hits
        ones = (misses - n_queued[0] if seconds > 0 else 0) + n_delayed - below.size - above.size
        n_top = n_queued[0] + above.size
        positive = below.size + ones + n_top
        ranks = np.empty(8, np.int64)
        weights = np.empty(4)
        for i in range(4):
            ranks[2 * i], ranks[2 * i + 1], weights[i] = _rank(counts[i], positive, qs[i])
        value = np.zeros(8)
        first = below.size + ones  # the first index of the top part
        for i in range(8):
            if 0 <= ranks[i] < below.size:
                value[i] = below[ranks[i]]
            elif below.size <= ranks[i] < first:
                value[i] = seconds
        for g in range(4):
            low, high = ranks[2 * g], ranks[2 * g + 1]  # low <= high
            if g >= groups:  # n_adapter == n: the same ranks
                value[2 * g], value[2 * g + 1] = value[2 * g - 4], value[2 * g - 3]
            elif high >= first:
                both = low >= first
                tops = np.full(2 if both else 1, positive - 1 - high)
                tops[-1] = positive - 1 - (low if both else high)
                got = _largest(tops, g, lag, bits, above, hi, lo, above_hi, members,
                               n_members, drift, values, queued, n_queued, hist, base)
                value[2 * g + 1] = got[0]
                if both:
                    value[2 * g] = got[1]
        out[s, 0], out[s, 1] = misses, n_delayed
        out[s, 2] = total[0] + total[1]
        out[s, 3] = out[s, 2] + delayed_s
        out[s, 4] = max(end[last], 0.0) if last >= 0 else 0.0
        for i in range(4):
            if counts[i]:
                low, high = value[2 * i], value[2 * i + 1]
                out[s, 5 + i] = low + (high - low) * weights[i]
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
    stack_distances(one, -1)
    lru_sweep(one, np.zeros(1), one, one, 1.0, 1, 1, 1, 1)
    concurrent(one, np.zeros(1), np.zeros(1), one, 0, 1, np.zeros(0, np.int64), 1, 2, False,
               np.zeros(1), one, 1, 0, np.zeros(1), np.zeros(1), np.zeros(1))
