"""The slot manager alone: the pool's semantics, the loading state, the one slot-id rule, eight
threads, and victim choice against a naive scan (hypothesis)."""

from __future__ import annotations

import random
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale_cli.errors import PoolFull, SlotBusy, UsageError
from metrale_cli.pool.slot_cache import NEVER
from metrale_cli.pool.slots import (
    AdapterSlot,
    SlotManager,
    SlotState,
    adapter_id_hash,
    routed_prefill_slot_of,
)
from tests.support.slot_threads import assert_all_released, run_threads


def info(name: str, generation: int = 0) -> AdapterSlot:
    return AdapterSlot(name=name, rank=8, alpha=16.0, scaling=2.0, source=f"/a/{name}",
                       config={"r": 8}, generation=generation)


def load(m: SlotManager, slot: int, name: str) -> int:
    generation = m.begin_load(slot)
    m.finish_load(slot, info(name))
    return generation


def test_pool_semantics() -> None:
    """The pool's slot manager as it behaved inside LoraPool (tests/test_pool.py's walk)."""
    m = SlotManager(4)
    m.load_pinned([info("a")])
    assert m.pinned == 1 and m.active == 0
    assert m.select_victim_slot() == 1  # an empty cache slot first
    assert load(m, 1, "b") == 1 and load(m, 2, "c") == 1 and load(m, 3, "d") == 1
    assert m.slot_of("c") == 2 and m.slot_of("") is None and m.slot_of("zz") is None
    assert m.adapter_names() == ["a", "b", "c", "d"]
    # Least recently used among idle cache slots; pinned slot 0 is never a victim.
    for s in (2, 3, 1):
        m.touch_slot(s)
    assert m.acquire_slot(0) == 0
    assert m.select_victim_slot() == 2
    m.acquire_slot(2)
    assert m.select_victim_slot() == 3
    m.acquire_slot(3)
    m.acquire_slot(1)
    with pytest.raises(PoolFull, match=r"^all 3 cache slots have in-flight sequences$"):
        m.select_victim_slot()
    with pytest.raises(SlotBusy):
        m.begin_load(2)
    with pytest.raises(SlotBusy):
        m.rotate(1)  # the active slot 0 is busy
    assert m.ref_count(2) == 1 and m.lru_tick == m.last_used(1) == 7
    for s in (0, 1, 2, 3):
        m.release_slot(s)
    with pytest.raises(UsageError, match="released more often than acquired"):
        m.release_slot(0)
    # Generations: in the identity, wrapping, untouched by a rotation.
    before = m.adapter_id_for_slot(2)
    assert before == adapter_id_hash("c", 1) != adapter_id_hash("c", 0)
    assert load(m, 2, "a") == 2
    assert m.slot_info(2).generation == 2 and m.adapter_id_for_slot(2) == adapter_id_hash("a", 2)
    assert m.slot_of("a") == 0  # the lowest of the slots holding it
    m.rotate(3)
    assert m.active == 3 and m.slot_info(3).generation == 1 and m.slot_info(-1).name == "d"
    assert m.adapter_id_for_slot(-1) == adapter_id_hash("d", 1)
    assert m.records()[3] == info("d", 1).record(3, False)
    copy = m.slot_info(3)  # snapshots: changing them changes nothing in the manager
    copy.name, copy.generation = "zz", 9
    m.slots()[3].name = "zz"
    assert m.slot_info(3) == info("d", 1) and m.slot_of("zz") is None
    assert m.records()[0]["pinned"] and not m.records()[1]["pinned"]
    wrap = SlotManager(2)
    wrap.load_pinned([info("b", 2**64 - 1)])
    assert wrap.begin_load(0) == 0
    wrap.finish_load(0, info("b", 123))  # the generation is the one begin_load gave
    assert wrap.slot_info(0).generation == 0
    assert wrap.adapter_id_for_slot(0) == adapter_id_hash("b", 0)


def test_adapter_id_hash_values_unchanged() -> None:
    """The identities the pool has always handed out (prefix caches are keyed by them)."""
    assert adapter_id_hash("a", 0) == 0x2F42665B399EF840
    assert adapter_id_hash("a", 1) == 0x65637F7DFF21290F
    assert adapter_id_hash("c", 1) == 0xA56C001521185135
    assert adapter_id_hash("adapter-7", 3) == 0x6E59DF50B273EAE8
    assert adapter_id_hash("x", 2**64 - 1) == 0x99CDC1A6DAB1538D
    assert adapter_id_hash("x", 2**64 + 5) == adapter_id_hash("x", 5)  # wraps at 2**64


def test_routed_prefill() -> None:
    assert routed_prefill_slot_of(-1, 0, 4) is None
    assert routed_prefill_slot_of(0, 0, 4) is None
    assert routed_prefill_slot_of(2, 0, 4) == 2
    assert routed_prefill_slot_of(4, 0, 4) is None
    assert routed_prefill_slot_of(-2, 0, 4) is None
    m = SlotManager(4)
    m.load_pinned([info("a"), info("b"), info("c")])
    assert m.routed_prefill_slot(1) == 1 and m.routed_prefill_slot(0) is None
    m.rotate(2)
    assert m.routed_prefill_slot(0) == 0 and m.routed_prefill_slot(2) is None
    assert m.routed_prefill_slot(-1) is None and m.routed_prefill_slot(9) is None


SLOT_METHODS = {
    "resolve": lambda m, s: m.resolve(s),
    "slot_info": lambda m, s: m.slot_info(s),
    "state": lambda m, s: m.state(s),
    "ref_count": lambda m, s: m.ref_count(s),
    "last_used": lambda m, s: m.last_used(s),
    "acquire_slot": lambda m, s: m.acquire_slot(s),
    "release_slot": lambda m, s: m.release_slot(s),
    "touch_slot": lambda m, s: m.touch_slot(s),
    "set_next_use": lambda m, s: m.set_next_use(s, 5),
    "begin_load": lambda m, s: m.begin_load(s),
    "finish_load": lambda m, s: m.finish_load(s, info("z")),
    "abort_load": lambda m, s: m.abort_load(s),
    "clear_slot": lambda m, s: m.clear_slot(s),
    "rotate": lambda m, s: m.rotate(s),
}


@pytest.mark.parametrize("method", sorted(SLOT_METHODS))
@pytest.mark.parametrize("slot", [-2, 4, 99])
def test_one_slot_id_rule(method: str, slot: int) -> None:
    m = SlotManager(4)
    m.load_pinned([info("a"), info("b")])
    with pytest.raises(UsageError, match=rf"^slot {slot} is out of range \[0, 4\) "
                                         r"\(-1 is the active slot\)$"):
        SLOT_METHODS[method](m, slot)


def test_minus_one_is_the_active_slot() -> None:
    m = SlotManager(4)
    m.load_pinned([info("a"), info("b")])
    m.rotate(1)
    assert m.resolve(-1) == 1 and m.acquire_slot(-1) == 1 and m.ref_count(1) == 1
    assert m.ref_count(-1) == 1 and m.slot_info(-1).name == "b"
    m.release_slot(-1)
    assert m.ref_count(1) == 0
    # adapter_id_for_slot follows the seed: any negative slot is the active one, and a slot
    # past the end is the base model, not an error (the serving rule).
    for negative in (-1, -2, -(2**31)):
        assert m.adapter_id_for_slot(negative) == adapter_id_hash("b", 0)
    assert m.adapter_id_for_slot(4) == m.adapter_id_for_slot(99) == 0
    assert m.adapter_id_for_slot(2) == 0  # a placeholder


def test_loading_state() -> None:
    m = SlotManager(4)
    m.load_pinned([info("p")])
    load(m, 1, "x")
    load(m, 2, "y")
    m.touch_slot(1)
    m.touch_slot(2)
    assert m.select_victim_slot() == 3
    m.acquire_slot(1)
    with pytest.raises(SlotBusy, match="slot 1 has 1 in-flight sequences"):
        m.begin_load(1)
    m.release_slot(1)
    # The old identity is gone the moment loading starts.
    assert m.begin_load(2) == 2
    assert m.state(2) is SlotState.LOADING
    assert m.slot_of("y") is None and m.adapter_id_for_slot(2) == 0 and "y" not in m.adapter_names()
    with pytest.raises(SlotBusy, match="slot 2 is loading"):
        m.acquire_slot(2)
    with pytest.raises(SlotBusy, match="slot 2 is loading"):
        m.begin_load(2)
    with pytest.raises(SlotBusy, match="slot 2 is loading"):
        m.clear_slot(2)
    with pytest.raises(SlotBusy, match="slot 2 is loading"):
        m.rotate(2)
    # A loading slot is never a victim, even when it is the oldest or the only candidate.
    assert m.select_victim_slot() == 3
    load(m, 3, "z")
    m.touch_slot(3)
    assert m.select_victim_slot() == 1
    m.acquire_slot(1)
    m.acquire_slot(3)
    with pytest.raises(PoolFull, match=r"^all 3 cache slots have in-flight sequences or are "
                                       r"loading \(1 loading\)$"):
        m.select_victim_slot()
    m.finish_load(2, info("y2"))
    assert m.state(2) is SlotState.READY and m.slot_of("y2") == 2
    assert m.adapter_id_for_slot(2) == adapter_id_hash("y2", 2)
    assert m.select_victim_slot() == 2
    # An aborted load leaves an empty placeholder that keeps its generation.
    assert m.begin_load(2) == 3
    m.abort_load(2)
    assert m.state(2) is SlotState.EMPTY and m.slot_info(2) == AdapterSlot(generation=3)
    assert m.adapter_id_for_slot(2) == 0 and m.select_victim_slot() == 2
    with pytest.raises(UsageError, match="slot 2 holds no adapter"):
        m.acquire_slot(2)
    with pytest.raises(UsageError, match="not loading"):
        m.finish_load(2, info("q"))
    with pytest.raises(UsageError, match="not loading"):
        m.abort_load(2)
    assert m.begin_load(2) == 4
    with pytest.raises(UsageError, match="needs a name"):
        m.finish_load(2, AdapterSlot())


def test_clear_slot() -> None:
    m = SlotManager(3)
    load(m, 1, "x")
    m.acquire_slot(1)
    with pytest.raises(SlotBusy, match="in-flight"):
        m.clear_slot(1)
    m.release_slot(1)
    m.clear_slot(1)
    assert m.slot_of("x") is None and m.adapter_id_for_slot(1) == 0
    assert m.slot_info(1) == AdapterSlot(generation=1) and m.state(1) is SlotState.EMPTY
    with pytest.raises(UsageError, match="holds no adapter"):
        m.rotate(1)
    assert load(m, 1, "x") == 2  # the next load moves the generation on


def test_no_cache_slots() -> None:
    m = SlotManager(2)
    m.load_pinned([info("a"), info("b")])
    with pytest.raises(PoolFull, match=r"^no cache slots: all 2 slots are pinned$"):
        m.select_victim_slot()
    with pytest.raises(PoolFull, match=r"^no cache slots: all 3 slots are pinned$"):
        SlotManager(3, pinned=3).select_victim_slot()


def test_bad_construction_and_startup() -> None:
    with pytest.raises(UsageError, match="max_loras must be positive"):
        SlotManager(0)
    with pytest.raises(UsageError, match="pinned must be in"):
        SlotManager(2, pinned=3)
    with pytest.raises(UsageError, match="policy must be one of lru, fifo, min"):
        SlotManager(2, policy="random")
    with pytest.raises(UsageError, match="3 adapters do not fit in --max-loras 2"):
        SlotManager(2).load_pinned([info("a"), info("b"), info("c")])


def test_fifo_and_min_policies() -> None:
    fifo = SlotManager(4, policy="fifo")
    for k, name in ((2, "c"), (0, "a"), (3, "d"), (1, "b")):
        load(fifo, k, name)
    for k in (2, 0, 3, 1, 2):
        fifo.touch_slot(k)  # recency does not matter to fifo
    assert fifo.select_victim_slot() == 2
    fifo.acquire_slot(2)
    assert fifo.select_victim_slot() == 0
    load(fifo, 0, "e")  # reloaded: now the youngest
    assert fifo.select_victim_slot() == 3

    least = SlotManager(4, pinned=1, policy="min")
    least.load_pinned([info("p")])
    for k, name in ((1, "a"), (2, "b"), (3, "c")):
        load(least, k, name)
    for k, pos in ((1, 10), (2, 30), (3, 20)):
        least.set_next_use(k, pos)
    assert least.select_victim_slot() == 2
    least.set_next_use(1, NEVER)
    assert least.select_victim_slot() == 1
    least.acquire_slot(1)
    assert least.select_victim_slot() == 2
    least.set_next_use(0, NEVER)  # pinned: never a victim whatever its next use
    assert least.select_victim_slot() == 2


def test_heap_stays_bounded() -> None:
    """Lazy deletion leaves stale entries behind; they never outgrow the slots."""
    m = SlotManager(8)
    for k in range(8):
        load(m, k, f"a{k}")
    for i in range(20_000):
        m.touch_slot(1 + i % 7)  # slot 0 stays the least recently used, at the heap's top
        assert m.select_victim_slot() == 0
    assert len(m._cache.heap) <= 2 * 8 + 65


def test_load_runs_outside_the_lock() -> None:
    """Between begin_load and finish_load (where the pool packs bytes), other slots' acquires
    and releases go through from other threads."""
    m = SlotManager(4)
    m.load_pinned([info("a"), info("b")])
    m.begin_load(3)
    done = threading.Event()

    def other() -> None:
        for _ in range(100):
            m.release_slot(m.acquire_slot(1))
        done.set()

    t = threading.Thread(target=other)
    t.start()
    t.join(timeout=30)
    assert done.is_set() and m.state(3) is SlotState.LOADING and m.ref_count(1) == 0
    m.finish_load(3, info("c"))
    assert m.slot_of("c") == 3


def test_eight_threads_keep_the_invariants() -> None:
    n, names = 6, ["c", "d", "e", "f"]
    m = SlotManager(n)
    m.load_pinned([info("a"), info("b")])
    guard = threading.Lock()
    held = [0] * n  # what the threads believe they hold
    loaders: dict[int, int] = {}  # slot -> the thread loading it

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        mine: list[tuple[int, int]] = []  # (slot, identity when acquired)
        for _ in range(400):
            op = rng.random()
            if op < 0.4:
                try:
                    slot = m.acquire_slot(rng.randrange(-1, n))
                except (UsageError, SlotBusy):  # empty or loading
                    continue
                with guard:
                    held[slot] += 1
                mine.append((slot, m.adapter_id_for_slot(slot)))
            elif op < 0.75 and mine:
                slot, identity = mine.pop(rng.randrange(len(mine)))
                # Nobody replaced the adapter under an in-flight sequence.
                assert m.adapter_id_for_slot(slot) == identity != 0
                with guard:
                    held[slot] -= 1
                m.release_slot(slot)
            elif op < 0.85:
                m.touch_slot(rng.randrange(n))
            else:
                try:
                    victim = m.select_victim_slot()
                    m.begin_load(victim)
                except (PoolFull, SlotBusy):
                    continue
                with guard:
                    assert victim not in loaders and victim >= m.pinned
                    loaders[victim] = seed
                assert m.ref_count(victim) == 0 and m.adapter_id_for_slot(victim) == 0
                with guard:
                    del loaders[victim]
                if rng.random() < 0.2:
                    m.abort_load(victim)
                else:
                    m.finish_load(victim, info(rng.choice(names)))
        for slot, _ in mine:
            with guard:
                held[slot] -= 1
            m.release_slot(slot)

    run_threads(worker)
    assert_all_released(m, held)
    assert not any(m.state(k) is SlotState.LOADING for k in range(n))
    assert m.slot_info(0).name == "a" and m.slot_info(1).name == "b"  # pinned never evicted
    assert m.slot_info(0).generation == m.slot_info(1).generation == 0


class NaiveSlots:
    """A reference model: plain lists, victim choice by a full scan."""

    def __init__(self, max_loras: int, pinned: int, policy: str) -> None:
        self.n, self.pinned, self.policy = max_loras, pinned, policy
        self.state = ["empty"] * max_loras
        self.refs = [0] * max_loras
        self.last_used = [0] * max_loras
        self.loaded_at = [0] * max_loras
        self.next_use = [NEVER] * max_loras
        self.tick = self.seq = 0

    def victim(self) -> int | None:
        cache = range(self.pinned, self.n)
        empty = [k for k in cache if self.state[k] == "empty"]
        if empty:
            return empty[0]
        idle = [k for k in cache if self.state[k] == "ready" and self.refs[k] == 0]
        if not idle:
            return None
        key = {"lru": lambda k: (self.last_used[k], k), "fifo": lambda k: (self.loaded_at[k], k),
               "min": lambda k: (-self.next_use[k], k)}[self.policy]
        return min(idle, key=key)

    def apply(self, op: str, k: int, pos: int) -> bool:
        """Apply an op; False when the manager must refuse it."""
        st_, refs = self.state[k], self.refs[k]
        if op == "acquire":
            if st_ != "ready":
                return False
            self.refs[k] += 1
            self.tick += 1
            self.last_used[k] = self.tick
        elif op == "release":
            if refs == 0:
                return False
            self.refs[k] -= 1
        elif op == "touch":
            self.tick += 1
            self.last_used[k] = self.tick
        elif op == "next_use":
            self.next_use[k] = pos
        elif op == "begin":
            if refs or st_ == "loading":
                return False
            self.state[k] = "loading"
        elif op in ("finish", "abort"):
            if st_ != "loading":
                return False
            self.state[k] = "ready" if op == "finish" else "empty"
            if op == "finish":
                self.seq += 1
                self.loaded_at[k] = self.seq
        elif op == "clear":
            if refs or st_ == "loading":
                return False
            self.state[k] = "empty"
        return True


OPS = ["acquire", "release", "touch", "next_use", "begin", "finish", "abort", "clear"]


@settings(max_examples=300, deadline=None)
@given(
    policy=st.sampled_from(["lru", "fifo", "min"]),
    max_loras=st.integers(1, 7),
    pinned=st.integers(0, 3),
    ops=st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 6), st.integers(0, 40)),
                 max_size=80),
)
def test_victim_choice_matches_a_naive_scan(
    policy: str, max_loras: int, pinned: int, ops: list[tuple[str, int, int]]
) -> None:
    pinned = min(pinned, max_loras)
    m = SlotManager(max_loras, policy=policy)
    model = NaiveSlots(max_loras, pinned, policy)
    m.load_pinned([info(f"p{k}") for k in range(pinned)])
    for k in range(pinned):
        model.state[k] = "ready"
        model.seq += 1
        model.loaded_at[k] = model.seq
    for op, slot, pos in ops:
        k = slot % max_loras
        allowed = model.apply(op, k, pos)
        call = {
            "acquire": lambda k=k: m.acquire_slot(k), "release": lambda k=k: m.release_slot(k),
            "touch": lambda k=k: m.touch_slot(k),
            "next_use": lambda k=k, pos=pos: m.set_next_use(k, pos),
            "begin": lambda k=k: m.begin_load(k),
            "finish": lambda k=k: m.finish_load(k, info(f"n{k}")),
            "abort": lambda k=k: m.abort_load(k), "clear": lambda k=k: m.clear_slot(k),
        }[op]
        if allowed:
            call()
        else:
            with pytest.raises((UsageError, SlotBusy)):
                call()
        want = model.victim()
        if want is None:
            with pytest.raises(PoolFull):
                m.select_victim_slot()
        else:
            assert m.select_victim_slot() == want
        assert [m.ref_count(j) for j in range(max_loras)] == model.refs
        assert [m.state(j).value for j in range(max_loras)] == model.state
