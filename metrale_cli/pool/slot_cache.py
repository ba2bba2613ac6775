"""The slot cache: the state machine of a pool of `max_loras` equal slots, over integer slots
and integer adapter keys, with no lock, no names and no bytes. Per slot a state (EMPTY /
LOADING / READY), the adapter key it holds, a ref count of in-flight sequences and the policy's
victim key; pool-wide the pinned count and the LRU tick. Slots `[0, pinned)` hold the startup
adapters and are never victims; `[pinned, max_loras)` are the cache.

Two callers share it: `SlotManager` (pool/slots.py), the pool's thread-safe face, which keeps
the names, generations and the active slot and takes its lock around every call, and the
simulator's reference replay (sim/reference.py), which drives it millions of times with adapter
indices, so victim choice is a heap with lazy deletion (O(log n) amortised), never a scan.
"""

from __future__ import annotations

import bisect
import enum
import heapq

from metrale_cli.errors import PoolFull, SlotBusy, UsageError

POLICIES = ("lru", "fifo", "min")
# The most slots one cache holds (its state is about 350 B of Python objects a slot): far past
# any pool a device holds (a slot is KiB to MiB), and refused before it takes seconds and GiB.
MAX_SLOTS = 1 << 20
# A slot whose adapter is not requested again (the `min` policy's "farthest ahead").
NEVER = 1 << 62
# Heap key of an empty cache slot: below every READY key (ticks, load order, -next use), so
# empty slots go first, lowest index first.
EMPTY_KEY = -2 * NEVER
NO_ADAPTER = -1  # the key of a slot that holds none (EMPTY or LOADING)


class SlotState(enum.Enum):
    EMPTY = "empty"      # a placeholder: no adapter, identity 0
    LOADING = "loading"  # bytes being written: no identity, never acquired, never a victim
    READY = "ready"      # an adapter is published in the slot


class SlotCache:
    """Slot state of `max_loras` slots, every slot argument an index in `[0, max_loras)` (the
    caller resolves ids) and every adapter an integer key (the caller maps names to keys).

    `policy` picks the victim among idle READY cache slots once no cache slot is empty:
    `lru` (least recently acquired or touched), `fifo` (loaded longest ago) or `min` (Belady:
    the caller gives each slot's next use with `set_next_use`; the one used again farthest
    ahead goes)."""

    def __init__(self, max_loras: int, pinned: int = 0, policy: str = "lru") -> None:
        if max_loras <= 0:
            raise UsageError(f"max_loras must be positive, got {max_loras}")
        if max_loras > MAX_SLOTS:
            raise UsageError(f"max_loras {max_loras:,} is more slots than a slot manager holds "
                             f"(at most {MAX_SLOTS:,})")
        if not 0 <= pinned <= max_loras:
            raise UsageError(f"pinned must be in [0, {max_loras}], got {pinned}")
        if policy not in POLICIES:
            raise UsageError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.max_loras = max_loras
        self.pinned = pinned
        self.policy = policy
        self.state = [SlotState.EMPTY] * max_loras
        self.adapter = [NO_ADAPTER] * max_loras
        self.refs = [0] * max_loras
        self.last_used = [0] * max_loras
        self.tick = 0  # the last tick handed out by an acquire or a touch
        self._loading = 0  # cache slots in LOADING, for PoolFull's message
        # fifo: the order in which slots were published; min: each slot's next use.
        self._loaded_at = [0] * max_loras
        self._load_seq = 0
        self._next_use = [NEVER] * max_loras
        # READY slots by adapter; an adapter may live in several slots (slot_of: the lowest).
        self._holders: dict[int, list[int]] = {}
        # Victim candidates: (key, slot, version), smallest key first. A slot's version moves
        # whenever its candidacy or key does, so an entry is live only while its version is
        # current.
        self.heap: list[tuple[int, int, int]] = []
        self._version = [0] * max_loras
        for k in range(pinned, max_loras):
            self._requeue(k)

    def slot_of(self, adapter: int) -> int | None:
        """The READY slot holding `adapter` (the lowest if several)."""
        holders = self._holders.get(adapter)
        return holders[0] if holders else None

    # -- sequences ------------------------------------------------------------------------------

    def acquire(self, k: int) -> None:
        """A sequence takes a count on slot `k` (a new LRU tick). An empty slot is refused
        (UsageError), a loading one is busy (SlotBusy)."""
        if self.state[k] is not SlotState.READY:
            if self.state[k] is SlotState.LOADING:
                raise SlotBusy(f"slot {k} is loading")
            raise UsageError(f"slot {k} holds no adapter")
        refs = self.refs[k] = self.refs[k] + 1
        self.tick += 1
        self.last_used[k] = self.tick
        if refs == 1:
            self._version[k] += 1  # no longer a victim candidate: its entry is stale

    def release(self, k: int) -> None:
        refs = self.refs[k]
        if refs == 0:
            raise UsageError(f"slot {k} released more often than acquired")
        self.refs[k] = refs - 1
        if refs == 1:
            self._requeue(k)

    def touch(self, k: int) -> None:
        self.tick += 1
        self.last_used[k] = self.tick
        if self.policy == "lru":
            self._requeue(k)

    def set_next_use(self, k: int, position: int) -> None:
        """For the `min` policy: the position of this slot's adapter's next request
        (`NEVER` when there is none)."""
        self._next_use[k] = position
        if self.policy == "min":
            self._requeue(k)

    # -- victims and loads ----------------------------------------------------------------------

    def select_victim(self) -> int:
        """The cache slot to load into: an empty idle one first (lowest index), else the idle
        READY one the policy picks. Loading slots never; pinned slots never. PoolFull when no
        cache slot qualifies."""
        heap, version = self.heap, self._version
        while heap:
            _, k, v = heap[0]
            if v == version[k]:
                return k
            heapq.heappop(heap)
        cache = self.max_loras - self.pinned
        if cache == 0:
            raise PoolFull(f"no cache slots: all {self.max_loras} slots are pinned")
        if self._loading:
            raise PoolFull(f"all {cache} cache slots have in-flight sequences or are "
                           f"loading ({self._loading} loading)")
        raise PoolFull(f"all {cache} cache slots have in-flight sequences")

    def begin_load(self, k: int) -> None:
        """Start replacing slot `k`'s contents: refused (SlotBusy) while it has in-flight
        sequences or is already loading. Its old adapter is gone at once."""
        self._check_idle(k)
        self._unindex(k)
        self.state[k] = SlotState.LOADING
        self._loading += k >= self.pinned
        self._requeue(k)

    def finish_load(self, k: int, adapter: int) -> None:
        """Publish a loaded slot: READY holding `adapter`."""
        if self.state[k] is not SlotState.LOADING:
            raise UsageError(f"slot {k} is not loading")
        self._publish(k, adapter)

    def abort_load(self, k: int) -> None:
        """A load that failed: the slot becomes empty."""
        if self.state[k] is not SlotState.LOADING:
            raise UsageError(f"slot {k} is not loading")
        self.state[k] = SlotState.EMPTY
        self._loading -= k >= self.pinned
        self._requeue(k)

    def load_pinned(self, adapters: list[int]) -> None:
        """Startup: the adapters go READY into slots `[0, n)`, which become the pinned ones."""
        n = len(adapters)
        if n > self.max_loras:
            raise UsageError(f"{n} adapters do not fit in --max-loras {self.max_loras}")
        busy = [k for k in range(n) if self.refs[k] or self.state[k] is SlotState.LOADING]
        if busy:
            raise SlotBusy(f"slot {busy[0]} is in use; pinned adapters load at startup")
        for k, adapter in enumerate(adapters):
            self._unindex(k)
            self._publish(k, adapter)
        self.pinned = n
        self._loading = self.state[n:].count(SlotState.LOADING)
        for k in range(self.max_loras):
            self._requeue(k)

    def clear(self, k: int) -> None:
        """Slot `k` becomes empty; refused while it has in-flight sequences or is loading."""
        self._check_idle(k)
        self._unindex(k)
        self.state[k] = SlotState.EMPTY
        self._requeue(k)

    # -- internals ------------------------------------------------------------------------------

    def _check_idle(self, k: int) -> None:
        if self.refs[k] > 0:
            raise SlotBusy(f"slot {k} has {self.refs[k]} in-flight sequences")
        if self.state[k] is SlotState.LOADING:
            raise SlotBusy(f"slot {k} is loading")

    def _publish(self, k: int, adapter: int) -> None:
        if self.state[k] is SlotState.LOADING:
            self._loading -= k >= self.pinned
        self.state[k] = SlotState.READY
        self.adapter[k] = adapter
        self._load_seq += 1
        self._loaded_at[k] = self._load_seq
        bisect.insort(self._holders.setdefault(adapter, []), k)
        self._requeue(k)

    def _unindex(self, k: int) -> None:
        if self.state[k] is not SlotState.READY:
            return
        adapter = self.adapter[k]
        self.adapter[k] = NO_ADAPTER
        holders = self._holders[adapter]
        holders.remove(k)
        if not holders:
            del self._holders[adapter]

    def _requeue(self, k: int) -> None:
        """Slot `k`'s candidacy or key changed: retire its heap entry, push a new one if it is
        a victim candidate now."""
        self._version[k] += 1
        if k < self.pinned:
            return
        state = self.state[k]
        if state is SlotState.EMPTY:
            key = EMPTY_KEY
        elif state is SlotState.READY and self.refs[k] == 0:
            if self.policy == "lru":
                key = self.last_used[k]
            elif self.policy == "fifo":
                key = self._loaded_at[k]
            else:
                key = -self._next_use[k]
        else:
            return
        heap = self.heap
        # Stale entries leave only when they reach the top; rebuilding once they outnumber
        # the slots keeps the heap O(max_loras) at O(1) amortised cost per push.
        if len(heap) > 2 * self.max_loras + 64:
            version = self._version
            self.heap = heap = [e for e in heap if e[2] == version[e[1]]]
            heapq.heapify(heap)
        heapq.heappush(heap, (key, k, self._version[k]))
