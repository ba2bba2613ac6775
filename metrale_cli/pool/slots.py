"""The slot manager: per-slot state of a pool of `max_loras` equal slots, with no bytes.

Per slot an `AdapterSlot` (who lives there), a state (EMPTY / LOADING / READY), a ref count of
in-flight sequences and a last-used tick; pool-wide the active slot, the pinned count and the LRU
tick. Slots `[0, pinned)` hold the startup adapters and are never victims; `[pinned, max_loras)`
are the cache. The pool drives it around its bytes (begin a load, pack outside the lock, publish)
and `metrale simulate` drives the very same class millions of times, so victim choice is a heap
with lazy deletion (O(log n) amortised), never a scan.

The one slot-id rule (`resolve`): -1 is the active slot, `[0, max_loras)` is that slot, anything
else is a `UsageError`. The one exception is `adapter_id_for_slot`, which follows the seed: any
negative slot is the active one, and a slot past the end means the base model (identity 0), as
the serving side expects.
"""

from __future__ import annotations

import bisect
import enum
import hashlib
import heapq
import numbers
import threading
from dataclasses import dataclass, field
from typing import Any

from metrale_cli.arguments import checked_as, describe_argument
from metrale_cli.errors import PoolFull, SlotBusy, UsageError

U64_MASK = (1 << 64) - 1
POLICIES = ("lru", "fifo", "min")
# The most slots one manager holds (its state is about 350 B of Python objects a slot): far past
# any pool a device holds (a slot is KiB to MiB), and refused before it takes seconds and GiB.
MAX_SLOTS = 1 << 20
# A slot whose adapter is not requested again (the `min` policy's "farthest ahead").
NEVER = 1 << 62
# Heap key of an empty cache slot: below every READY key (ticks, load order, -next use), so
# empty slots go first, lowest index first.
EMPTY_KEY = -2 * NEVER


def adapter_id_hash(name: str, generation: int) -> int:
    """A 64-bit cache identity of an adapter name and its generation; never 0 (0 is the base
    model). Generation 0 folds to nothing, so an adapter keeps its identity at load."""
    h = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
    if generation:
        blob = h.to_bytes(8, "little") + (generation & U64_MASK).to_bytes(8, "little")
        h = int.from_bytes(hashlib.blake2b(blob, digest_size=8).digest(), "little")
    return h or 1


def routed_prefill_slot_of(adapter_slot: int, active: int, num_slots: int) -> int | None:
    """Resolve a request's `adapter_slot` (`>= 0` that slot, `-1` the active one) and return it
    only when it is an in-range slot other than the active one."""
    resolved = active if adapter_slot == -1 else adapter_slot
    if adapter_slot < -1 or not 0 <= resolved < num_slots or resolved == active:
        return None
    return resolved


@dataclass
class AdapterSlot:
    """One pool slot's resident adapter. An empty `name` marks a placeholder."""

    name: str = ""
    rank: int = 0
    alpha: float = 0.0
    scaling: float = 0.0
    source: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    # Incremented (wrapping) each time a disk or peer swap replaces the contents; 0 at load.
    generation: int = 0

    @property
    def filled(self) -> bool:
        return bool(self.name)

    def record(self, slot: int, pinned: bool) -> dict[str, Any]:
        return {
            "slot": slot, "name": self.name, "generation": self.generation, "rank": self.rank,
            "alpha": self.alpha, "scaling": self.scaling, "pinned": pinned,
            "source": self.source,
        }


def _copy(info: AdapterSlot, generation: int) -> AdapterSlot:
    """A copy of `info` (its config shared) under `generation`; spelled out because
    `dataclasses.replace` costs ten times as much, and the simulator loads millions of times."""
    return AdapterSlot(info.name, info.rank, info.alpha, info.scaling, info.source, info.config,
                       generation)


class SlotState(enum.Enum):
    EMPTY = "empty"      # a placeholder: no adapter, identity 0
    LOADING = "loading"  # bytes being written: no identity, never acquired, never a victim
    READY = "ready"      # an adapter is published in the slot


class SlotManager:
    """Slot state of a pool of `max_loras` slots, thread-safe behind one internal lock.

    `policy` picks the victim among idle READY cache slots once no cache slot is empty:
    `lru` (the pool's own: least recently acquired or touched), `fifo` (loaded longest ago) or
    `min` (Belady: the caller gives each slot's next use with `set_next_use`; the one used again
    farthest ahead goes).
    """

    @checked_as("SlotManager")
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
        self._max_loras = max_loras
        self._pinned = pinned
        self._policy = policy
        self._active = 0
        self._slots = [AdapterSlot() for _ in range(max_loras)]
        self._state = [SlotState.EMPTY] * max_loras
        self._refs = [0] * max_loras
        self._last_used = [0] * max_loras
        self._tick = 0
        self._loading = 0  # cache slots in LOADING, for PoolFull's message
        # fifo: the order in which slots were published; min: each slot's next use.
        self._loaded_at = [0] * max_loras
        self._load_seq = 0
        self._next_use = [NEVER] * max_loras
        # READY slots by name; a name may live in several slots (slot_of gives the lowest).
        self._by_name: dict[str, list[int]] = {}
        # Victim candidates: (key, slot, version), smallest key first. A slot's version moves
        # whenever its candidacy or key does, so an entry is live only while its version is
        # current.
        self._heap: list[tuple[int, int, int]] = []
        self._version = [0] * max_loras
        self._lock = threading.Lock()
        for k in range(pinned, max_loras):
            self._requeue(k)

    # -- read-only views ------------------------------------------------------------------------

    @property
    def max_loras(self) -> int:
        return self._max_loras

    @property
    def pinned(self) -> int:
        return self._pinned

    @property
    def policy(self) -> str:
        return self._policy

    @property
    def active(self) -> int:
        return self._active

    @property
    def lru_tick(self) -> int:
        """The last tick handed out by an acquire or a touch."""
        return self._tick

    def resolve(self, slot: int) -> int:
        """The one slot-id rule: -1 is the active slot, `[0, max_loras)` is that slot; anything
        but an integer is a UsageError."""
        if isinstance(slot, bool) or not isinstance(slot, numbers.Integral):
            raise UsageError(f"slot must be int, got {describe_argument(slot)}")
        if slot == -1:
            return self._active
        if not 0 <= slot < self._max_loras:
            raise UsageError(f"slot {slot} is out of range [0, {self._max_loras}) "
                             "(-1 is the active slot)")
        return slot

    def slot_info(self, slot: int) -> AdapterSlot:
        with self._lock:
            info = self._slots[self.resolve(slot)]
            return _copy(info, info.generation)

    def state(self, slot: int) -> SlotState:
        with self._lock:
            return self._state[self.resolve(slot)]

    def ref_count(self, slot: int) -> int:
        with self._lock:
            return self._refs[self.resolve(slot)]

    def last_used(self, slot: int) -> int:
        with self._lock:
            return self._last_used[self.resolve(slot)]

    def slots(self) -> list[AdapterSlot]:
        """A snapshot copy of every slot, in slot order."""
        with self._lock:
            return [_copy(s, s.generation) for s in self._slots]

    def slot_of(self, name: str) -> int | None:
        """The READY slot holding adapter `name` (the lowest if several); placeholders and
        loading slots never match."""
        with self._lock:
            holders = self._by_name.get(name)
            return holders[0] if holders else None

    def adapter_names(self) -> list[str]:
        """Names of the READY adapters, in slot order."""
        with self._lock:
            return [s.name for s, st in zip(self._slots, self._state, strict=True)
                    if st is SlotState.READY]

    def adapter_id_for_slot(self, slot: int) -> int:
        """Cache identity of a request's `adapter_slot`: any negative slot is the active one (the
        seed's `if slot >= 0 { slot } else { active }`); `[0, max_loras)` that slot. This is the
        one method where a slot out of range is not an error but the base model (0), as for a
        placeholder or a loading slot."""
        with self._lock:
            resolved = self._active if slot < 0 else slot
            if not 0 <= resolved < self._max_loras or self._state[resolved] is not SlotState.READY:
                return 0
            s = self._slots[resolved]
            return adapter_id_hash(s.name, s.generation)

    def routed_prefill_slot(self, adapter_slot: int) -> int | None:
        with self._lock:
            return routed_prefill_slot_of(adapter_slot, self._active, self._max_loras)

    def records(self) -> list[dict[str, Any]]:
        with self._lock:
            return [s.record(k, k < self._pinned) for k, s in enumerate(self._slots)]

    # -- sequences ------------------------------------------------------------------------------

    def acquire_slot(self, slot: int) -> int:
        """A sequence takes a count on the resolved slot (a new LRU tick); returns that slot.
        An empty slot is refused (UsageError), a loading one is busy (SlotBusy)."""
        with self._lock:
            k = slot if type(slot) is int and 0 <= slot < self._max_loras else self.resolve(slot)
            if self._state[k] is not SlotState.READY:
                if self._state[k] is SlotState.LOADING:
                    raise SlotBusy(f"slot {k} is loading")
                raise UsageError(f"slot {k} holds no adapter")
            refs = self._refs[k] = self._refs[k] + 1
            self._tick += 1
            self._last_used[k] = self._tick
            if refs == 1:
                self._version[k] += 1  # no longer a victim candidate: its entry is stale
            return k

    def release_slot(self, slot: int) -> None:
        with self._lock:
            k = slot if type(slot) is int and 0 <= slot < self._max_loras else self.resolve(slot)
            refs = self._refs[k]
            if refs == 0:
                raise UsageError(f"slot {k} released more often than acquired")
            self._refs[k] = refs - 1
            if refs == 1:
                self._requeue(k)

    def touch_slot(self, slot: int) -> None:
        with self._lock:
            k = slot if type(slot) is int and 0 <= slot < self._max_loras else self.resolve(slot)
            self._tick += 1
            self._last_used[k] = self._tick
            if self._policy == "lru":
                self._requeue(k)

    def set_next_use(self, slot: int, position: int) -> None:
        """For the `min` policy: the position of this slot's adapter's next request
        (`NEVER` when there is none)."""
        with self._lock:
            k = self.resolve(slot)
            self._next_use[k] = position
            if self._policy == "min":
                self._requeue(k)

    # -- victims and loads ----------------------------------------------------------------------

    def select_victim_slot(self) -> int:
        """The cache slot to load into: an empty idle one first (lowest index), else the idle
        READY one the policy picks (lru: least recently used). Loading slots never;
        pinned slots never. PoolFull when no cache slot qualifies."""
        with self._lock:
            heap, version = self._heap, self._version
            while heap:
                _, k, v = heap[0]
                if v == version[k]:
                    return k
                heapq.heappop(heap)
            cache = self._max_loras - self._pinned
            if cache == 0:
                raise PoolFull(f"no cache slots: all {self._max_loras} slots are pinned")
            if self._loading:
                raise PoolFull(f"all {cache} cache slots have in-flight sequences or are "
                               f"loading ({self._loading} loading)")
            raise PoolFull(f"all {cache} cache slots have in-flight sequences")

    def begin_load(self, slot: int) -> int:
        """Start replacing a slot's contents: refused (SlotBusy) while it has in-flight
        sequences or is already loading. Its old identity is gone at once. Returns the new
        generation, (old + 1) mod 2**64."""
        with self._lock:
            k = self.resolve(slot)
            if self._refs[k] > 0:
                raise SlotBusy(f"slot {k} has {self._refs[k]} in-flight sequences")
            if self._state[k] is SlotState.LOADING:
                raise SlotBusy(f"slot {k} is loading")
            self._unindex(k)
            generation = (self._slots[k].generation + 1) & U64_MASK
            self._slots[k] = AdapterSlot(generation=generation)
            self._state[k] = SlotState.LOADING
            self._loading += k >= self._pinned
            self._requeue(k)
            return generation

    def finish_load(self, slot: int, info: AdapterSlot) -> None:
        """Publish a loaded slot: READY with `info`, under the generation `begin_load` gave."""
        with self._lock:
            k = self.resolve(slot)
            if self._state[k] is not SlotState.LOADING:
                raise UsageError(f"slot {k} is not loading")
            if not info.filled:
                raise UsageError(f"slot {k}: a loaded adapter needs a name")
            self._publish(k, _copy(info, self._slots[k].generation))

    def abort_load(self, slot: int) -> None:
        """A load that failed: the slot becomes an empty placeholder, keeping the generation
        `begin_load` gave (identity 0)."""
        with self._lock:
            k = self.resolve(slot)
            if self._state[k] is not SlotState.LOADING:
                raise UsageError(f"slot {k} is not loading")
            self._state[k] = SlotState.EMPTY
            self._loading -= k >= self._pinned
            self._requeue(k)

    def load_pinned(self, infos: list[AdapterSlot]) -> None:
        """Startup: the adapters go READY into slots `[0, n)`, which become the pinned ones."""
        with self._lock:
            n = len(infos)
            if n > self._max_loras:
                raise UsageError(f"{n} adapters do not fit in --max-loras {self._max_loras}")
            busy = [k for k in range(n)
                    if self._refs[k] or self._state[k] is SlotState.LOADING]
            if busy:
                raise SlotBusy(f"slot {busy[0]} is in use; pinned adapters load at startup")
            for k, info in enumerate(infos):
                if not info.filled:
                    raise UsageError(f"pinned slot {k}: an adapter needs a name")
                self._unindex(k)
                self._publish(k, _copy(info, info.generation))
            self._pinned = n
            self._loading = self._state[n:].count(SlotState.LOADING)
            for k in range(self._max_loras):
                self._requeue(k)

    def clear_slot(self, slot: int) -> None:
        """The slot becomes an empty placeholder (identity 0, generation kept); refused while
        it has in-flight sequences or is loading."""
        with self._lock:
            k = self.resolve(slot)
            if self._refs[k] > 0:
                raise SlotBusy(f"slot {k} has {self._refs[k]} in-flight sequences")
            if self._state[k] is SlotState.LOADING:
                raise SlotBusy(f"slot {k} is loading")
            self._unindex(k)
            self._slots[k] = AdapterSlot(generation=self._slots[k].generation)
            self._state[k] = SlotState.EMPTY
            self._requeue(k)

    def rotate(self, slot: int) -> None:
        """Make `slot` the active adapter; refused while the active slot is busy."""
        with self._lock:
            k = self.resolve(slot)
            if self._state[k] is SlotState.LOADING:
                raise SlotBusy(f"slot {k} is loading")
            if self._state[k] is SlotState.EMPTY:
                raise UsageError(f"slot {k} holds no adapter")
            if k != self._active and self._refs[self._active] > 0:
                raise SlotBusy(f"active slot {self._active} has {self._refs[self._active]} "
                               "in-flight sequences")
            self._active = k

    # -- internals (the lock is held) -----------------------------------------------------------

    def _publish(self, k: int, info: AdapterSlot) -> None:
        if self._state[k] is SlotState.LOADING:
            self._loading -= k >= self._pinned
        self._slots[k] = info
        self._state[k] = SlotState.READY
        self._load_seq += 1
        self._loaded_at[k] = self._load_seq
        bisect.insort(self._by_name.setdefault(info.name, []), k)
        self._requeue(k)

    def _unindex(self, k: int) -> None:
        if self._state[k] is not SlotState.READY:
            return
        name = self._slots[k].name
        holders = self._by_name[name]
        holders.remove(k)
        if not holders:
            del self._by_name[name]

    def _requeue(self, k: int) -> None:
        """Slot `k`'s candidacy or key changed: retire its heap entry, push a new one if it is
        a victim candidate now."""
        self._version[k] += 1
        if k < self._pinned:
            return
        state = self._state[k]
        if state is SlotState.EMPTY:
            key = EMPTY_KEY
        elif state is SlotState.READY and self._refs[k] == 0:
            if self._policy == "lru":
                key = self._last_used[k]
            elif self._policy == "fifo":
                key = self._loaded_at[k]
            else:
                key = -self._next_use[k]
        else:
            return
        heap = self._heap
        # Stale entries leave only when they reach the top; rebuilding once they outnumber
        # the slots keeps the heap O(max_loras) at O(1) amortised cost per push.
        if len(heap) > 2 * self._max_loras + 64:
            version = self._version
            self._heap = heap = [e for e in heap if e[2] == version[e[1]]]
            heapq.heapify(heap)
        heapq.heappush(heap, (key, k, self._version[k]))
