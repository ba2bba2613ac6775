"""The kernels on the host harness over what a caller may vary, drawn by hypothesis.

Each launcher's legal input space, not a handful of fixed cases: row-strided views of x, y and
the embeddings (a slice of a wider buffer, as engines pass them, with junk in the gap), a pool
whose max rank lies above the batch's ranks, ranks off every vector and tile size, slots of
different ranks in one launch, t narrowed to the batch's widest rank, split-K counts, token
orders, segments anywhere; overlay tables with several overlaying slots, ids above a slot's
last and junk past each slot's count. Outputs are held to a float64 reference within an error
bound (kernel_cases.check_bound), skipped rows and the strided gaps bit for bit.

A drawn case carries its `seed` (the pool's and inputs' values, and the host harness's CTA
schedule and cp.async landing for every launch of the example: METRALE_HOST_SEED), so a
failure's falsifying example names everything needed to rerun it. The quick tier runs a few
examples of each; the tests marked `slow` many more.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from metrale_cli.ops import expert_kernels as ek
from metrale_cli.ops import host_harness, plans, reference
from tests.support.kernel_cases import (
    active_rank,
    check_bound,
    check_unbiased,
    expand64,
    gamma,
    make_pool,
    shrink64,
)
from tests.support.mutated_kernels import run_mutated

# The host harness is built before the first test (conftest.host_library).
pytestmark = pytest.mark.usefixtures("host_library")

QUICK = settings(max_examples=8, print_blob=True)
# The overlay gather costs a few ms an example: the quick tier affords more of them.
QUICK_CHEAP = settings(max_examples=24, print_blob=True)
MANY = settings(max_examples=60, print_blob=True)
Y_DTYPES = st.sampled_from([torch.bfloat16, torch.float32])
# Finite junk in a strided view's gap: a kernel that steps rows by their width reads it.
GAP_JUNK = 4096.0


@contextlib.contextmanager
def host_seed(seed: int) -> Iterator[None]:
    """Every host launch in the block under schedule `seed` (METRALE_HOST_SEED)."""
    before = os.environ.get("METRALE_HOST_SEED")
    os.environ["METRALE_HOST_SEED"] = str(seed)
    try:
        yield
    finally:
        if before is None:
            del os.environ["METRALE_HOST_SEED"]
        else:
            os.environ["METRALE_HOST_SEED"] = before


def strided(rows: int, width: int, pad: int, dtype: torch.dtype, seed: int,
            scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(view, whole): a [rows, width] view into a [rows, width + pad] buffer of random values
    whose last `pad` columns hold GAP_JUNK."""
    generator = torch.Generator().manual_seed(seed)
    whole = torch.full((rows, width + pad), GAP_JUNK)
    whole[:, :width] = torch.randn(rows, width, generator=generator) * scale
    whole = whole.to(dtype)
    return whole[:, :width], whole


def bits(values: torch.Tensor) -> torch.Tensor:
    """The raw bits of a BF16 or F32 tensor, as integers of its width."""
    return values.view(torch.int16 if values.element_size() == 2 else torch.int32)


def check_kept(what: str, after: torch.Tensor, before: torch.Tensor, written: list[int],
               width: int) -> None:
    """Everything outside the written rows' first `width` columns (skipped rows, the strided
    gap) unchanged, bit for bit."""
    mask = torch.ones(after.shape, dtype=torch.bool)
    mask[written, :width] = False
    changed = bits(after) != bits(before)
    bad = (changed & mask).nonzero()
    assert not bad.numel(), (f"{what}{bad[0].tolist()} changed, outside the rows and columns "
                             f"the kernel adds to ({len(bad)} elements)")


@dataclass(frozen=True)
class Pooled:
    """A pool's legal shape: dims, its max rank and the slots' ranks and absences."""

    seed: int
    in_dim: int
    out_dim: int
    max_rank: int
    ranks: tuple[int, ...]
    absent: frozenset[int]
    x_pad: int
    y_pad: int
    splits: int | None
    num_sms: int


@st.composite
def pooled(draw: st.DrawFn, max_dim: int) -> Pooled:
    max_rank = 8 * draw(st.integers(1, 12))
    slots = draw(st.integers(1, 4))
    # Any rank up to the pool's: off the 8-column vectors and the 16- and 64-column tiles.
    ranks = tuple(draw(st.lists(st.integers(0, max_rank), min_size=slots, max_size=slots)))
    absent = frozenset(draw(st.sets(st.integers(0, slots - 1), max_size=slots - 1)))
    return Pooled(
        seed=draw(st.integers(0, 2**20)),
        in_dim=8 * draw(st.integers(1, max_dim // 8)),
        out_dim=8 * draw(st.integers(1, max_dim // 8)),
        max_rank=max_rank, ranks=ranks, absent=absent,
        x_pad=8 * draw(st.integers(0, 2)), y_pad=8 * draw(st.integers(0, 2)),
        splits=draw(st.sampled_from([None, 1, 2, 3])),
        num_sms=draw(st.sampled_from([1, 2, 132])))


@dataclass(frozen=True)
class Decode:
    pool: Pooled
    slots: tuple[int, ...]  # per token; -1, or past the table, skip it
    narrow: bool  # t as wide as the batch's widest rank (plans.plan_batch), not max_rank


@st.composite
def decodes(draw: st.DrawFn) -> Decode:
    p = draw(pooled(max_dim=264))
    slots = tuple(draw(st.lists(st.integers(-1, len(p.ranks)), min_size=1, max_size=9)))
    return Decode(p, slots, draw(st.booleans()))


@dataclass(frozen=True)
class Prefill:
    pool: Pooled
    seg_starts: tuple[int, ...]
    seg_slots: tuple[int, ...]
    order: tuple[int, ...] | None  # token_order: position p holds token order[p]
    narrow: bool  # t as wide as the widest rank among the segments' slots

    def token_slots(self) -> list[int]:
        by_position = reference.segments_to_slots(
            torch.tensor(self.seg_starts), torch.tensor(self.seg_slots),
            self.seg_starts[-1]).tolist()
        if self.order is None:
            return by_position
        slots = [0] * len(by_position)
        for position, token in enumerate(self.order):
            slots[token] = by_position[position]
        return slots


@st.composite
def prefills(draw: st.DrawFn) -> Prefill:
    p = draw(pooled(max_dim=200))
    tokens = draw(st.integers(1, 80))
    cuts = sorted(draw(st.lists(st.integers(0, tokens), min_size=1, max_size=6)))
    seg_starts = (*cuts, tokens)  # positions before the first cut lie in no segment
    seg_slots = tuple(draw(st.lists(st.integers(-1, len(p.ranks)), min_size=len(cuts),
                                    max_size=len(cuts))))
    order = draw(st.none() | st.permutations(range(tokens)).map(tuple))
    return Prefill(p, seg_starts, seg_slots, order, draw(st.booleans()))


def _pool_inputs(p: Pooled, tokens: int, y_dtype: torch.dtype):
    pool = make_pool(p.in_dim, p.out_dim, p.max_rank, list(p.ranks), set(p.absent), p.seed)
    x, _ = strided(tokens, p.in_dim, p.x_pad, torch.bfloat16, p.seed + 1)
    y, y_whole = strided(tokens, p.out_dim, p.y_pad, y_dtype, p.seed + 2)
    return pool, x, y, y_whole


def run_decode(case: Decode, y_dtype: torch.dtype) -> None:
    p = case.pool
    pool, x, y, y_whole = _pool_inputs(p, len(case.slots), y_dtype)
    a_table, b_table = pool.tables()
    a_weights, b_weights = pool.weights()
    slots = torch.tensor(case.slots, dtype=torch.int32)
    batch = plans.plan_batch(case.slots, pool.ranks.numpy(), p.max_rank) if case.narrow else None
    before, y0 = y_whole.clone(), y.clone()
    with host_seed(p.seed):
        t = host_harness.bgmv_shrink(x, slots, a_table, pool.ranks, p.max_rank, splits=p.splits,
                                     num_sms=p.num_sms, batch=batch)
        exact_t, magnitude = shrink64(x, list(case.slots), a_weights, pool.ranks, t.shape[1])
        check_bound("t", t, exact_t, magnitude, p.in_dim, rounded_to_bf16=False)
        host_harness.bgmv_expand(t, slots, b_table, pool.scales, pool.ranks, y, p.max_rank)
    _check_y(y, y_whole, before, y0, t.double().numpy(), list(case.slots), b_weights, pool,
             p.out_dim)


def _check_y(y: torch.Tensor, y_whole: torch.Tensor, before: torch.Tensor, y0: torch.Tensor,
             t_read: np.ndarray, slots: list[int], b_weights: list, pool, out_dim: int) -> None:
    exact, magnitude, terms = expand64(t_read, y0, slots, b_weights, pool.scales, pool.ranks)
    written = [b for b, n in enumerate(terms.tolist()) if n > 1]
    check_kept("y", y_whole, before, written, out_dim)
    bf16 = y.dtype == torch.bfloat16
    check_bound("y", y, exact, magnitude, terms, rounded_to_bf16=bf16)
    if bf16:
        check_unbiased("y", y, exact, written)


def run_prefill(case: Prefill, y_dtype: torch.dtype) -> None:
    p = case.pool
    tokens = case.seg_starts[-1]
    pool, x, y, y_whole = _pool_inputs(p, tokens, y_dtype)
    a_table, b_table = pool.tables()
    a_weights, b_weights = pool.weights()
    slots = case.token_slots()
    starts = torch.tensor(case.seg_starts, dtype=torch.int32)
    seg_slots = torch.tensor(case.seg_slots, dtype=torch.int32)
    order = None if case.order is None else torch.tensor(case.order, dtype=torch.int32)
    t_cols = None
    if case.narrow:
        widest = max([min(p.ranks[s], p.max_rank) for s in case.seg_slots
                      if 0 <= s < len(p.ranks)] + [1])
        t_cols = min(p.max_rank, -(-widest // 8) * 8)
    before, y0 = y_whole.clone(), y.clone()
    with host_seed(p.seed):
        t = host_harness.sgmv_shrink(x, starts, seg_slots, a_table, pool.ranks, p.max_rank,
                                     splits=p.splits, num_sms=p.num_sms, t_cols=t_cols,
                                     token_order=order)
        exact_t, magnitude = shrink64(x, slots, a_weights, pool.ranks, t.shape[1])
        check_bound("t", t, exact_t, magnitude, p.in_dim, rounded_to_bf16=False)
        host_harness.sgmv_expand(t, starts, seg_slots, b_table, pool.scales, pool.ranks, y,
                                 p.max_rank, token_order=order, num_sms=p.num_sms)
    # The expand feeds t to the tensor cores as BF16 (rounded to nearest even).
    t_read = t.to(torch.bfloat16).double().numpy()
    _check_y(y, y_whole, before, y0, t_read, slots, b_weights, pool, p.out_dim)


# Fixed cases of the drawn kinds, run as explicit examples of the quick tests (and by the
# planted bugs' tests at the end).
STRIDED_DECODE = Decode(Pooled(seed=1, in_dim=64, out_dim=64, max_rank=32, ranks=(20, 32),
                               absent=frozenset(), x_pad=16, y_pad=8, splits=1, num_sms=132),
                        slots=(0, 1, -1, 1), narrow=False)
# A pool max rank (64) above the batch's widest rank (20): t is 24 columns wide.
NARROW_DECODE = Decode(Pooled(seed=2, in_dim=72, out_dim=48, max_rank=64, ranks=(12, 20),
                              absent=frozenset(), x_pad=0, y_pad=0, splits=None, num_sms=132),
                       slots=(1, 0, 1, -1, 0), narrow=True)
STRIDED_PREFILL = Prefill(Pooled(seed=3, in_dim=64, out_dim=72, max_rank=24, ranks=(17, 24),
                                 absent=frozenset(), x_pad=8, y_pad=16, splits=1, num_sms=132),
                          seg_starts=(2, 30, 40), seg_slots=(1, 0), order=None, narrow=False)


@QUICK
@example(case=STRIDED_DECODE, y_dtype=torch.bfloat16)
@example(case=NARROW_DECODE, y_dtype=torch.float32)
@given(case=decodes(), y_dtype=Y_DTYPES)
def test_bgmv_holds_its_error_bound_on_legal_batches(case: Decode, y_dtype: torch.dtype) -> None:
    run_decode(case, y_dtype)


@pytest.mark.slow
@MANY
@given(case=decodes(), y_dtype=Y_DTYPES)
def test_bgmv_holds_its_error_bound_on_many_legal_batches(case: Decode,
                                                          y_dtype: torch.dtype) -> None:
    run_decode(case, y_dtype)


@QUICK
@example(case=STRIDED_PREFILL, y_dtype=torch.bfloat16)
@given(case=prefills(), y_dtype=Y_DTYPES)
def test_sgmv_holds_its_error_bound_on_legal_batches(case: Prefill,
                                                     y_dtype: torch.dtype) -> None:
    run_prefill(case, y_dtype)


@pytest.mark.slow
@MANY
@given(case=prefills(), y_dtype=Y_DTYPES)
def test_sgmv_holds_its_error_bound_on_many_legal_batches(case: Prefill,
                                                          y_dtype: torch.dtype) -> None:
    run_prefill(case, y_dtype)


# --- routed experts ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Experts:
    """A legal expert batch: each (slice, expert)'s table row or -1 (an expert no slot adapts),
    slots absent from a row (pointer 0), ranks below the pool's max rank, experts off this rank
    (-1) and tokens without adapter."""

    pool: Pooled
    gate_up: bool  # two slices (gate, up) over x rows shared by top_k pairs; else down
    num_experts: int
    entries: tuple[tuple[int, ...], ...]  # [slices][experts]: a table row, or -1
    row_absent: tuple[frozenset[int], ...]  # per table row: the slots it does not adapt
    slots: tuple[int, ...]  # per token
    topk: tuple[tuple[int, ...], ...]  # per token: its experts (-1: on another rank)
    prefill: bool  # forced PREFILL_TILE tiles (tensor cores), else the planner's


@st.composite
def expert_cases(draw: st.DrawFn) -> Experts:
    p = draw(pooled(max_dim=136))
    experts = draw(st.integers(1, 5))
    gate_up = draw(st.booleans())
    slices = 2 if gate_up else 1
    rows = iter(range(slices * experts))
    entries = tuple(tuple(next(rows) if draw(st.integers(0, 4)) else -1 for _ in range(experts))
                    for _ in range(slices))
    row_absent = tuple(frozenset(draw(st.sets(st.integers(0, len(p.ranks) - 1))))
                       for _ in range(slices * experts))
    tokens = draw(st.integers(1, 10))
    top_k = draw(st.integers(1, experts))
    slots = tuple(draw(st.lists(st.integers(-1, len(p.ranks)), min_size=tokens,
                                max_size=tokens)))
    topk = tuple(tuple(draw(st.lists(st.integers(-1, experts - 1), min_size=top_k,
                                     max_size=top_k))) for _ in range(tokens))
    return Experts(p, gate_up, experts, entries, row_absent, slots, topk, draw(st.booleans()))


def run_experts(case: Experts, y_dtype: torch.dtype) -> None:
    p = case.pool
    slices = len(case.entries)
    top_k = len(case.topk[0])
    pairs = len(case.slots) * top_k
    x_div = top_k if case.gate_up else 1
    pools = [make_pool(p.in_dim, p.out_dim, p.max_rank, list(p.ranks),
                       set(p.absent) | set(absent), p.seed + n)
             for n, absent in enumerate(case.row_absent)]
    tables = ek.ExpertTables(
        torch.stack([pool.tables()[0] for pool in pools]),
        torch.stack([pool.tables()[1] for pool in pools]),
        torch.tensor(case.entries[:2] if case.gate_up else [[-1] * case.num_experts] * 2,
                     dtype=torch.int32),
        torch.tensor(case.entries[:1], dtype=torch.int32),
        -1, pools[0].scales, pools[0].ranks, p.max_rank, case.num_experts)
    x, _ = strided(-(-pairs // x_div), p.in_dim, p.x_pad, torch.bfloat16, p.seed + 1)
    y, y_whole = strided(pairs, slices * p.out_dim, p.y_pad, y_dtype, p.seed + 2)
    topk = torch.tensor(case.topk, dtype=torch.int32)
    batch = ek.plan_pairs(topk, torch.tensor(case.slots, dtype=torch.int32), tables.ranks,
                          p.max_rank, ek.PREFILL_TILE if case.prefill else None,
                          num_experts=case.num_experts)
    before, y0 = y_whole.clone(), y.clone()
    with host_seed(p.seed):
        launcher = ek.expert_gate_up if case.gate_up else ek.expert_down
        launcher(x, y, batch, tables, backend=host_harness.HOST)
    # Per (slice, expert): its pairs through that expert's table row, in float64; t as wide as
    # the batch's widest rank, which the prefill expand feeds to the tensor cores as BF16.
    exact = y0.double().numpy().copy()
    magnitude, terms = np.abs(exact), np.ones_like(exact)
    inherited = np.zeros_like(exact)
    written = np.zeros(exact.shape, dtype=bool)
    pair_slots = np.repeat(case.slots, top_k).tolist()
    pair_experts = topk.flatten().tolist()
    for c, row in enumerate(case.entries):
        cols = slice(c * p.out_dim, (c + 1) * p.out_dim)
        for e, n in enumerate(row):
            rows = [q for q in range(pairs) if pair_experts[q] == e]
            if n < 0 or not rows:
                continue
            a_weights, b_weights = pools[n].weights()
            slots = [pair_slots[q] for q in rows]
            t, t_magnitude = shrink64(x[[q // x_div for q in rows]], slots, a_weights,
                                      tables.ranks, batch.t_cols)
            t_error = gamma(p.in_dim) * t_magnitude + (2.0**-8 * np.abs(t) if case.prefill
                                                      else 0.0)
            part, part_magnitude, part_terms = expand64(t, y0[rows][:, cols], slots, b_weights,
                                                        tables.scale_table, tables.ranks)
            exact[rows, cols], magnitude[rows, cols] = part, part_magnitude
            terms[rows, cols] = part_terms[:, None]
            for i, (q, slot) in enumerate(zip(rows, slots, strict=True)):
                r = active_rank(slot, b_weights, tables.ranks, batch.t_cols)
                if r:
                    written[q, cols] = True
                    b = b_weights[slot][:, :r].double().numpy()
                    inherited[q, cols] = (abs(float(tables.scale_table[slot]))
                                          * (np.abs(b) @ t_error[i, :r]))
    kept = np.ones(before.shape, dtype=bool)
    kept[:, :slices * p.out_dim] = ~written
    changed = (bits(y_whole) != bits(before)).numpy() & kept
    assert not changed.any(), (f"y{np.argwhere(changed)[0].tolist()} changed, outside the pairs "
                               "and slices the kernels add to")
    check_bound("y", y, exact, magnitude, terms, y_dtype == torch.bfloat16, inherited)


# gate_up over three experts: the third no slot adapts, slot 1 absent from the first's gate
# row; ranks 12 and 20 in a max-rank-48 pool (t 24 wide), a pair on another rank, x strided;
# on the decode tiles and on the prefill (tensor-core) ones.
EXPERTS = Experts(Pooled(seed=5, in_dim=64, out_dim=48, max_rank=48, ranks=(12, 20),
                         absent=frozenset(), x_pad=8, y_pad=8, splits=None, num_sms=132),
                  gate_up=True, num_experts=3, entries=((0, 1, -1), (2, 3, -1)),
                  row_absent=(frozenset({1}), frozenset(), frozenset(), frozenset(),
                              frozenset(), frozenset()),
                  slots=(0, 1, -1, 1), topk=((0, 1), (1, 2), (0, 2), (2, -1)), prefill=False)
EXPERTS_PREFILL = dataclasses.replace(EXPERTS, prefill=True)


@QUICK
@example(case=EXPERTS, y_dtype=torch.float32)
@example(case=EXPERTS_PREFILL, y_dtype=torch.bfloat16)
@given(case=expert_cases(), y_dtype=Y_DTYPES)
def test_routed_experts_hold_their_error_bound_on_legal_tables(case: Experts,
                                                               y_dtype: torch.dtype) -> None:
    run_experts(case, y_dtype)


@pytest.mark.slow
@MANY
@given(case=expert_cases(), y_dtype=Y_DTYPES)
def test_routed_experts_hold_their_error_bound_on_many_legal_tables(
        case: Experts, y_dtype: torch.dtype) -> None:
    run_experts(case, y_dtype)


# --- token overlays ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Overlays:
    seed: int
    hidden: int
    emb_pad: int
    per_slot: tuple[tuple[int, ...] | None, ...]  # each slot's overlaid ids (None: no table)
    spare: int  # columns past the widest slot's count, junk ids and rows
    tokens: tuple[int, ...]
    slots: tuple[int, ...]


@st.composite
def overlay_cases(draw: st.DrawFn) -> Overlays:
    slots = draw(st.integers(1, 4))
    # Several overlaying slots, in any order, each with its own ids (some above every token,
    # some between them) or none at all.
    per_slot = tuple(draw(st.none() | st.sets(st.integers(0, 40), max_size=7)
                          .map(lambda ids: tuple(sorted(ids)))) for _ in range(slots))
    # Each token's slot (-1, or past the table, keep its row), and mostly a token its slot
    # overlays (its first, last or any id), else any id.
    token_slots = draw(st.lists(st.integers(-1, slots), min_size=1, max_size=10))
    tokens = []
    for slot in token_slots:
        ids = per_slot[slot] if 0 <= slot < slots else None
        tokens.append(draw(st.sampled_from(ids) if ids and draw(st.booleans())
                           else st.integers(0, 45)))
    return Overlays(
        seed=draw(st.integers(0, 2**20)),
        hidden=draw(st.sampled_from([8, 72, 1024, 4104])),
        emb_pad=8 * draw(st.integers(0, 2)),
        per_slot=per_slot, spare=draw(st.integers(0, 3)), tokens=tuple(tokens),
        slots=tuple(token_slots))


def run_overlays(case: Overlays) -> None:
    generator = torch.Generator().manual_seed(case.seed)
    rng = np.random.default_rng(case.seed)
    width = max([len(ids) for ids in case.per_slot if ids] + [1]) + case.spare
    max_loras = len(case.per_slot)
    # Past each slot's count: junk ids (unsorted, some of them tokens of the batch) and junk
    # rows; the kernel must search only the first counts[s].
    ids = rng.integers(0, 46, size=(max_loras, width)).astype(np.int32)
    counts = np.zeros(max_loras, dtype=np.int32)
    rows = torch.randn(max_loras, width, case.hidden, generator=generator).to(torch.bfloat16)
    overlays: list[dict[int, torch.Tensor] | None] = []
    for s, slot_ids in enumerate(case.per_slot):
        if slot_ids is None:
            overlays.append(None)
            continue
        ids[s, :len(slot_ids)] = slot_ids
        counts[s] = len(slot_ids)
        overlays.append({token: rows[s, i] for i, token in enumerate(slot_ids)})
    tables = ek.OverlayTables(ids, counts, rows.view(torch.uint16).numpy())
    emb, whole = strided(len(case.tokens), case.hidden, case.emb_pad, torch.bfloat16,
                         case.seed + 1)
    before = whole.clone()
    token_ids = torch.tensor(case.tokens, dtype=torch.int32)
    slots = torch.tensor(case.slots, dtype=torch.int32)
    want = reference.overlay_gather(token_ids, slots, overlays, emb)
    with host_seed(case.seed):
        ek.overlay_gather(token_ids, slots, tables, emb, backend=host_harness.HOST)
    assert torch.equal(bits(emb), bits(want)), (
        f"emb rows {sorted(set((emb != want).nonzero()[:, 0].tolist()))} differ from the "
        "reference")
    check_kept("emb", whole, before, list(range(len(case.tokens))), case.hidden)


# Two overlaying slots, the wider one first, junk past the narrower's count.
OVERLAYS = Overlays(seed=4, hidden=72, emb_pad=8, per_slot=((3, 9, 17, 30), (5, 40)), spare=1,
                    tokens=(40, 5, 17, 9, 30, 6), slots=(1, 1, 0, 0, 0, 1))


@QUICK_CHEAP
@example(case=OVERLAYS)
@given(case=overlay_cases())
def test_overlay_gather_equals_the_reference_on_legal_tables(case: Overlays) -> None:
    run_overlays(case)


@pytest.mark.slow
@MANY
@given(case=overlay_cases())
def test_overlay_gather_equals_the_reference_on_many_legal_tables(case: Overlays) -> None:
    run_overlays(case)


# --- rounding, bit for bit ---------------------------------------------------------------------
# Small integers make every F32 step exact: x in {-1, 0, 1}, A in [-2, 2] (|t| <= 2 in_dim =
# 128, so t is exact in BF16 too), B in [-8, 8], power-of-two scales and integer y: y0 + scale t
# B^T stays below 2^24, exact in F32 whatever the order of the sums, so the one rounding left
# is the kernel's F32 -> BF16 of y, to nearest even. Its results reach 2^17 with up to 17
# significant bits, so most outputs round and many are ties: the BF16 outputs must equal the
# exact value rounded to nearest even (torch's cast) bit for bit, and F32 ones the exact value.
EXACT_SCALES = (1.0, 0.5, 2.0, 0.25)


def exact_inputs(tokens: int, in_dim: int, out_dim: int, max_rank: int, ranks: list[int],
                 y_dtype: torch.dtype, seed: int):
    pool = make_pool(in_dim, out_dim, max_rank, ranks, set(), seed)
    generator = torch.Generator().manual_seed(seed)
    a_size, b_size = max_rank * in_dim, out_dim * max_rank
    for offset, rank in zip(pool.a_offsets, ranks, strict=True):
        a = pool.pool[offset: offset + a_size].view(max_rank, in_dim)
        b = pool.pool[offset + a_size: offset + a_size + b_size].view(out_dim, max_rank)
        a[:rank] = torch.randint(-2, 3, (rank, in_dim), generator=generator).bfloat16()
        b[:, :rank] = torch.randint(-8, 9, (out_dim, rank), generator=generator).bfloat16()
    pool.scales = torch.tensor(EXACT_SCALES[:len(ranks)], dtype=torch.float32)
    x = torch.randint(-1, 2, (tokens, in_dim), generator=generator).bfloat16()
    y = torch.randint(-4096, 4097, (tokens, out_dim), generator=generator).to(y_dtype)
    return pool, x, y


@pytest.mark.parametrize("y_dtype", [torch.bfloat16, torch.float32], ids=["y_bf16", "y_f32"])
@pytest.mark.parametrize("kind", ["bgmv", "sgmv"])
def test_outputs_are_the_exact_value_rounded_to_nearest_even(kind: str,
                                                             y_dtype: torch.dtype) -> None:
    ranks = [33, 64, 17]
    tokens, in_dim, out_dim, max_rank = 24, 64, 136, 72  # max rank above the batch's widest
    pool, x, y = exact_inputs(tokens, in_dim, out_dim, max_rank, ranks, y_dtype, seed=5)
    a_table, b_table = pool.tables()
    a_weights, b_weights = pool.weights()
    slot_list = [(b * 7) % 4 - 1 for b in range(tokens)]  # -1 and slots 0..2, interleaved
    slots = torch.tensor(slot_list, dtype=torch.int32)
    y0 = y.clone()
    if kind == "bgmv":
        t = host_harness.bgmv_shrink(x, slots, a_table, pool.ranks, max_rank, splits=2)
        host_harness.bgmv_expand(t, slots, b_table, pool.scales, pool.ranks, y, max_rank)
    else:
        batch = plans.plan_batch(slot_list, pool.ranks.numpy(), max_rank)
        starts, seg_slots, order = (torch.from_numpy(a) for a in
                                    (batch.seg_starts, batch.seg_slots, batch.order))
        t = host_harness.sgmv_shrink(x, starts, seg_slots, a_table, pool.ranks, max_rank,
                                     splits=2, token_order=order)
        host_harness.sgmv_expand(t, starts, seg_slots, b_table, pool.scales, pool.ranks, y,
                                 max_rank, token_order=order)
    exact_t, _ = shrink64(x, slot_list, a_weights, pool.ranks, max_rank)
    assert np.array_equal(t.double().numpy(), exact_t), "t is not the exact x A^T"
    exact_y, _, _ = expand64(exact_t, y0, slot_list, b_weights, pool.scales, pool.ranks)
    want = torch.from_numpy(exact_y).to(y_dtype)
    differ = (bits(y) != bits(want)).nonzero()
    assert len(differ) == 0, (
        f"{len(differ)} of {y.numel()} outputs are not the exact value rounded to nearest even; "
        f"first y{differ[0].tolist()} = {y[tuple(differ[0])].item()!r}, exact "
        f"{exact_y[tuple(differ[0])]!r}, rounded {want[tuple(differ[0])].item()!r}")


# --- the bugs these tests were built to catch, planted -------------------------------------------
# Each edit put into a copy of kernels/ (tests/support/mutated_kernels.py), and the fixed example
# that the quick tests run on the unbroken kernels run on it in a process of its own: the check
# fails with its message.
PLANTED_PROBE = """
import torch
from tests.test_kernels_properties import *
try:
    {call}
except (AssertionError, RuntimeError) as error:
    print("failed: " + str(error).splitlines()[0])
else:
    print("passed")
"""
EXACT_BGMV = 'test_outputs_are_the_exact_value_rounded_to_nearest_even("bgmv", torch.bfloat16)'
PLANTED = [
    # x stepped through by its width, not its row stride.
    pytest.param("bgmv.cu", r"x \+ static_cast<long long>\(b\) \* x_stride",
                 "x + static_cast<long long>(b) * in_dim", 1,
                 "run_decode(STRIDED_DECODE, torch.bfloat16)", "t: ", id="bgmv_x_by_width"),
    # y stepped through by its width: rows land in the gap of the rows before.
    pytest.param("sgmv.cu", r"y \+ static_cast<long long>\(y_token\[i\]\) \* y_stride",
                 "y + static_cast<long long>(y_token[i]) * out_dim", 1,
                 "run_prefill(STRIDED_PREFILL, torch.bfloat16)", "y[", id="sgmv_y_by_width"),
    # B's row pitch taken from t's width (the batch's widest rank), not the pool's max rank.
    pytest.param("bgmv.cu",
                 r"(  const int rank = b_addr \? imin\(imin\(listed, max_rank\), t_cols\) : 0;)",
                 r"  max_rank = t_cols;\n\1", 1,
                 "run_decode(NARROW_DECODE, torch.float32)", "y: ", id="bgmv_b_pitch_of_t"),
    # The same in both expert expands (decode and prefill tiles).
    pytest.param("expert.cu",
                 r"(  const int rank = b_addr \? imin\(imin\(ranks\[tile.slot\], max_rank\), "
                 r"t_cols\) : 0;)", r"  max_rank = t_cols;\n\1", 2,
                 "run_experts(EXPERTS_PREFILL, torch.bfloat16)", "y: ",
                 id="expert_b_pitch_of_t"),
    # The expert decode shrink steps x by its width.
    pytest.param("expert.cu", r"(x_row\[m\] = x \+ static_cast<long long>\(pair\[m\] / x_div\) "
                 r"\* )x_stride;", r"\1in_dim;", 1, "run_experts(EXPERTS, torch.float32)", "y: ",
                 id="expert_x_by_width"),
    # The overlay search over the whole row, not the slot's count.
    pytest.param("expert.cu", r"int lo = 0, hi = overlay_counts\[slot\];",
                 "int lo = 0, hi = max_tokens;", 1, "run_overlays(OVERLAYS)", "emb rows",
                 id="overlay_search_past_count"),
    # BF16 rounding that truncates, or that breaks ties away from zero.
    pytest.param("lora_common.cuh", r"u \+= 0x7fffu \+ \(\(u >> 16\) & 1u\);", "u += 0u;", 1,
                 EXACT_BGMV, "1006 of 3264 outputs are not the exact value", id="bf16_truncated"),
    pytest.param("lora_common.cuh", r"u \+= 0x7fffu \+ \(\(u >> 16\) & 1u\);",
                 "u += 0x8000u;", 1, EXACT_BGMV, "168 of 3264 outputs are not the exact value",
                 id="bf16_ties_away"),
]


@pytest.mark.proc  # a process of its own builds the mutated kernels
@pytest.mark.parametrize(("source", "pattern", "replacement", "count", "call", "message"),
                         PLANTED)
def test_a_planted_bug_fails_its_check(tmp_path: Path, source: str, pattern: str,
                                       replacement: str, count: int, call: str,
                                       message: str) -> None:
    keep = {"lora_common.cuh": "bgmv.cu"}.get(source, source)
    result = run_mutated(tmp_path, [(source, pattern, replacement, count)],
                         PLANTED_PROBE.format(call=call), keep=(keep,))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"failed: {message}"), result.stdout
