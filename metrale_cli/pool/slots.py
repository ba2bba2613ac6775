"""The slot manager: per-slot state of a pool of `max_loras` equal slots, with no bytes,
thread-safe.

The state machine itself (states, ref counts, the victim heap) is `SlotCache`
(pool/slot_cache.py), over integer slots and adapter keys, which the simulator's reference replay
drives as it is; the manager wraps it behind one lock and adds what the pool needs: per slot an
`AdapterSlot` (who lives there, its generation), adapter names, the active slot and the slot-id
rule. The pool drives it around its bytes (begin a load, pack outside the lock, publish).

The one slot-id rule (`resolve`): -1 is the active slot, `[0, max_loras)` is that slot, anything
else is a `UsageError`. The one exception is `adapter_id_for_slot`, which follows the seed: any
negative slot is the active one, and a slot past the end means the base model (identity 0), as
the serving side expects.
"""

from __future__ import annotations

import hashlib
import numbers
import threading
from dataclasses import dataclass, field
from typing import Any

from metrale_cli.arguments import checked_as, describe_argument
from metrale_cli.errors import SlotBusy, UsageError
from metrale_cli.pool.slot_cache import SlotCache, SlotState

U64_MASK = (1 << 64) - 1


def adapter_id_hash(name: str, generation: int) -> int:
    """A 64-bit cache identity of an adapter name and its generation; never 0 (0 is the base
    model). Generation 0 folds to nothing, so an adapter keeps its identity at load."""
    h = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
    if generation:
        blob = h.to_bytes(8, "little") + (generation & U64_MASK).to_bytes(8, "little")
        h = int.from_bytes(hashlib.blake2b(blob, digest_size=8).digest(), "little")
    return h or 1


def _integer(what: str, value: object) -> None:
    """A slot id is an integer (a NumPy one too, never a bool): else a UsageError."""
    if type(value) is not int and (isinstance(value, bool)
                                   or not isinstance(value, numbers.Integral)):
        raise UsageError(f"{what} must be int, got {describe_argument(value)}")


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


class SlotManager:
    """Slot state of a pool of `max_loras` slots (a `SlotCache`), thread-safe behind one
    internal lock, with each slot's `AdapterSlot` and the active slot.

    `policy` picks the victim among idle READY cache slots once no cache slot is empty:
    `lru` (the pool's own: least recently acquired or touched), `fifo` (loaded longest ago) or
    `min` (Belady: the caller gives each slot's next use with `set_next_use`; the one used again
    farthest ahead goes).
    """

    @checked_as("SlotManager")
    def __init__(self, max_loras: int, pinned: int = 0, policy: str = "lru") -> None:
        self._cache = SlotCache(max_loras, pinned, policy)
        self._max_loras = max_loras
        self._active = 0
        self._slots = [AdapterSlot() for _ in range(max_loras)]
        self._keys: dict[str, int] = {}  # adapter name -> the cache's integer key
        self._lock = threading.Lock()

    # -- read-only views ------------------------------------------------------------------------

    @property
    def max_loras(self) -> int:
        return self._max_loras

    @property
    def pinned(self) -> int:
        return self._cache.pinned

    @property
    def policy(self) -> str:
        return self._cache.policy

    @property
    def active(self) -> int:
        return self._active

    @property
    def lru_tick(self) -> int:
        """The last tick handed out by an acquire or a touch."""
        return self._cache.tick

    def resolve(self, slot: int) -> int:
        """The one slot-id rule: -1 is the active slot, `[0, max_loras)` is that slot; anything
        but an integer is a UsageError."""
        _integer("slot", slot)
        if slot == -1:
            return self._active
        if not 0 <= slot < self._max_loras:
            raise UsageError(f"slot {slot} is out of range [0, {self._max_loras}) "
                             "(-1 is the active slot)")
        return slot

    def _fast(self, slot: int) -> int:
        """`resolve` for the hot calls: a plain in-range int skips the checks."""
        return slot if type(slot) is int and 0 <= slot < self._max_loras else self.resolve(slot)

    def slot_info(self, slot: int) -> AdapterSlot:
        with self._lock:
            info = self._slots[self.resolve(slot)]
            return _copy(info, info.generation)

    def state(self, slot: int) -> SlotState:
        with self._lock:
            return self._cache.state[self.resolve(slot)]

    def ref_count(self, slot: int) -> int:
        with self._lock:
            return self._cache.refs[self.resolve(slot)]

    def last_used(self, slot: int) -> int:
        with self._lock:
            return self._cache.last_used[self.resolve(slot)]

    def slots(self) -> list[AdapterSlot]:
        """A snapshot copy of every slot, in slot order."""
        with self._lock:
            return [_copy(s, s.generation) for s in self._slots]

    def slot_of(self, name: str) -> int | None:
        """The READY slot holding adapter `name` (the lowest if several); placeholders and
        loading slots never match."""
        if not isinstance(name, str):
            raise UsageError(f"name must be str, got {describe_argument(name)}")
        with self._lock:
            key = self._keys.get(name)
            return None if key is None else self._cache.slot_of(key)

    def adapter_names(self) -> list[str]:
        """Names of the READY adapters, in slot order."""
        with self._lock:
            return [s.name for s, st in zip(self._slots, self._cache.state, strict=True)
                    if st is SlotState.READY]

    def adapter_id_for_slot(self, slot: int) -> int:
        """Cache identity of a request's `adapter_slot`: any negative slot is the active one (the
        seed's `if slot >= 0 { slot } else { active }`); `[0, max_loras)` that slot. This is the
        one method where a slot out of range is not an error but the base model (0), as for a
        placeholder or a loading slot."""
        _integer("slot", slot)
        with self._lock:
            resolved = self._active if slot < 0 else slot
            if (not 0 <= resolved < self._max_loras
                    or self._cache.state[resolved] is not SlotState.READY):
                return 0
            s = self._slots[resolved]
            return adapter_id_hash(s.name, s.generation)

    def routed_prefill_slot(self, adapter_slot: int) -> int | None:
        _integer("adapter_slot", adapter_slot)
        with self._lock:
            return routed_prefill_slot_of(adapter_slot, self._active, self._max_loras)

    def records(self) -> list[dict[str, Any]]:
        with self._lock:
            pinned = self._cache.pinned
            return [s.record(k, k < pinned) for k, s in enumerate(self._slots)]

    # -- sequences ------------------------------------------------------------------------------

    def acquire_slot(self, slot: int) -> int:
        """A sequence takes a count on the resolved slot (a new LRU tick); returns that slot.
        An empty slot is refused (UsageError), a loading one is busy (SlotBusy)."""
        with self._lock:
            k = self._fast(slot)
            self._cache.acquire(k)
            return k

    def release_slot(self, slot: int) -> None:
        with self._lock:
            self._cache.release(self._fast(slot))

    def touch_slot(self, slot: int) -> None:
        with self._lock:
            self._cache.touch(self._fast(slot))

    def set_next_use(self, slot: int, position: int) -> None:
        """For the `min` policy: the position of this slot's adapter's next request
        (`NEVER` when there is none)."""
        with self._lock:
            self._cache.set_next_use(self.resolve(slot), position)

    # -- victims and loads ----------------------------------------------------------------------

    def select_victim_slot(self) -> int:
        """The cache slot to load into: an empty idle one first (lowest index), else the idle
        READY one the policy picks (lru: least recently used). Loading slots never;
        pinned slots never. PoolFull when no cache slot qualifies."""
        with self._lock:
            return self._cache.select_victim()

    def begin_load(self, slot: int) -> int:
        """Start replacing a slot's contents: refused (SlotBusy) while it has in-flight
        sequences or is already loading. Its old identity is gone at once. Returns the new
        generation, (old + 1) mod 2**64."""
        with self._lock:
            k = self.resolve(slot)
            self._cache.begin_load(k)
            generation = (self._slots[k].generation + 1) & U64_MASK
            self._slots[k] = AdapterSlot(generation=generation)
            return generation

    def finish_load(self, slot: int, info: AdapterSlot) -> None:
        """Publish a loaded slot: READY with `info`, under the generation `begin_load` gave."""
        with self._lock:
            k = self.resolve(slot)
            if self._cache.state[k] is not SlotState.LOADING:
                raise UsageError(f"slot {k} is not loading")
            if not info.filled:
                raise UsageError(f"slot {k}: a loaded adapter needs a name")
            self._cache.finish_load(k, self._key(info.name))
            self._slots[k] = _copy(info, self._slots[k].generation)

    def abort_load(self, slot: int) -> None:
        """A load that failed: the slot becomes an empty placeholder, keeping the generation
        `begin_load` gave (identity 0)."""
        with self._lock:
            self._cache.abort_load(self.resolve(slot))

    @checked_as("SlotManager.load_pinned")
    def load_pinned(self, infos: list[AdapterSlot]) -> None:
        """Startup: the adapters go READY into slots `[0, n)`, which become the pinned ones."""
        with self._lock:
            for k, info in enumerate(infos[:self._max_loras]):
                if not info.filled:
                    raise UsageError(f"pinned slot {k}: an adapter needs a name")
            self._cache.load_pinned([self._key(info.name) for info in infos])
            for k, info in enumerate(infos):
                self._slots[k] = _copy(info, info.generation)

    def clear_slot(self, slot: int) -> None:
        """The slot becomes an empty placeholder (identity 0, generation kept); refused while
        it has in-flight sequences or is loading."""
        with self._lock:
            k = self.resolve(slot)
            self._cache.clear(k)
            self._slots[k] = AdapterSlot(generation=self._slots[k].generation)

    def rotate(self, slot: int) -> None:
        """Make `slot` the active adapter; refused while the active slot is busy."""
        with self._lock:
            k = self.resolve(slot)
            state, refs = self._cache.state, self._cache.refs
            if state[k] is SlotState.LOADING:
                raise SlotBusy(f"slot {k} is loading")
            if state[k] is SlotState.EMPTY:
                raise UsageError(f"slot {k} holds no adapter")
            if k != self._active and refs[self._active] > 0:
                raise SlotBusy(f"active slot {self._active} has {refs[self._active]} "
                               "in-flight sequences")
            self._active = k

    def _key(self, name: str) -> int:
        """The cache's key of adapter `name` (the lock is held)."""
        return self._keys.setdefault(name, len(self._keys))
