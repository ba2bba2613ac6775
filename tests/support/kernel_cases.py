"""Pools and batches shared by the host-harness and GPU kernel tests.

A case is small but covers what the kernels must get right: tokens with slot -1, a slot whose
pointer is 0 (absent), a slot of rank 0, a slot id past the table, ranks below max_rank and not
multiples of 8, and dims that are not multiples of any tile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from metrale_cli.ops import reference


@dataclass
class Pool:
    """One BF16 allocation holding every present slot's A [max_rank, in_dim] and B
    [out_dim, max_rank], with the per-entry tables the kernels read."""

    pool: torch.Tensor  # BF16 [elements], one allocation
    a_offsets: list[int | None]  # element offset of slot k's A, None = absent
    b_offsets: list[int | None]
    ranks: torch.Tensor  # i32 [max_loras]
    scales: torch.Tensor  # f32 [max_loras]
    in_dim: int
    out_dim: int
    max_rank: int

    def tables(self, base_address: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """a_table, b_table (int64 holding u64 addresses) for a pool at `base_address`."""
        base = self.pool.data_ptr() if base_address is None else base_address

        def table(offsets: list[int | None]) -> torch.Tensor:
            return torch.tensor([0 if o is None else base + 2 * o for o in offsets],
                                dtype=torch.int64)

        return table(self.a_offsets), table(self.b_offsets)

    def weights(self) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """Per-slot A and B views, read back through the tables as the reference does."""
        a_table, b_table = self.tables()
        return (
            reference.weights_from_table(self.pool, a_table, (self.max_rank, self.in_dim)),
            reference.weights_from_table(self.pool, b_table, (self.out_dim, self.max_rank)),
        )


def make_pool(in_dim: int, out_dim: int, max_rank: int, ranks: list[int], absent: set[int],
              seed: int) -> Pool:
    generator = torch.Generator().manual_seed(seed)
    a_size, b_size = max_rank * in_dim, out_dim * max_rank
    pool = torch.zeros(len(ranks) * (a_size + b_size), dtype=torch.bfloat16)
    a_offsets: list[int | None] = []
    b_offsets: list[int | None] = []
    cursor = 0
    for slot, rank in enumerate(ranks):
        if slot in absent:
            a_offsets.append(None)
            b_offsets.append(None)
            continue
        a = pool[cursor : cursor + a_size].view(max_rank, in_dim)
        b = pool[cursor + a_size : cursor + a_size + b_size].view(out_dim, max_rank)
        a[:rank] = torch.randn(rank, in_dim, generator=generator) / math.sqrt(in_dim)
        b[:, :rank] = torch.randn(out_dim, rank, generator=generator) / math.sqrt(max(rank, 1))
        # Finite junk in the padding rows of A and columns of B: the pool promises zeros
        # there, but the kernels must not depend on it (they never load A rows >= r; only
        # BGMV's last B vector reaches past r, its columns there multiplied by exact zeros).
        # A rank loop that runs one row or column too far reads junk, not zeros.
        a[rank:] = 5.0
        b[:, rank:] = 7.0
        a_offsets.append(cursor)
        b_offsets.append(cursor + a_size)
        cursor += a_size + b_size
    scales = torch.linspace(0.5, 2.0, len(ranks), dtype=torch.float32)
    return Pool(pool, a_offsets, b_offsets, torch.tensor(ranks, dtype=torch.int32), scales,
                in_dim, out_dim, max_rank)


@dataclass
class Inputs:
    """One case's buffers, as the host tests use them."""

    pool: Pool
    a_table: torch.Tensor
    b_table: torch.Tensor
    a_weights: list[torch.Tensor | None]
    b_weights: list[torch.Tensor | None]
    x: torch.Tensor
    y: torch.Tensor
    y0: torch.Tensor  # y before the kernels ran
    slots: torch.Tensor


@dataclass
class Case:
    name: str
    num_tokens: int
    in_dim: int
    out_dim: int
    max_rank: int
    ranks: list[int]
    absent: set[int] = field(default_factory=set)
    slots: list[int] | None = None  # BGMV: per-token slots
    seg_starts: list[int] | None = None  # SGMV
    seg_slots: list[int] | None = None
    num_splits: int | None = None  # an explicit split-K count (None: what the planner picks)
    num_sms: int = 132

    def pool(self, seed: int = 0) -> Pool:
        return make_pool(self.in_dim, self.out_dim, self.max_rank, self.ranks, self.absent, seed)

    def x(self, seed: int = 1) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        return torch.randn(self.num_tokens, self.in_dim, generator=generator).bfloat16()

    def y(self, dtype: torch.dtype, seed: int = 2) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        return torch.randn(self.num_tokens, self.out_dim, generator=generator).to(dtype)

    def token_slots(self) -> torch.Tensor:
        if self.slots is not None:
            return torch.tensor(self.slots, dtype=torch.int32)
        return reference.segments_to_slots(
            torch.tensor(self.seg_starts), torch.tensor(self.seg_slots), self.num_tokens
        )

    def inputs(self, y_dtype: torch.dtype) -> Inputs:
        """The pool, its tables and per-slot weights, x, y (and a copy of it) and the slots."""
        pool = self.pool()
        a_table, b_table = pool.tables()
        a_weights, b_weights = pool.weights()
        y = self.y(y_dtype)
        return Inputs(pool, a_table, b_table, a_weights, b_weights, self.x(), y, y.clone(),
                      self.token_slots())

    def segments(self) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.tensor(self.seg_starts, dtype=torch.int32),
                torch.tensor(self.seg_slots, dtype=torch.int32))


BGMV_CASES = [
    # slot 2 absent, slot 4 rank 0, slot 9 past the table; dims off every tile.
    Case("mixed", 11, 200, 72, 16, [12, 16, 8, 16, 0], absent={2},
         slots=[0, 1, -1, 2, 3, 0, 1, 3, 4, 9, 3]),
    # Explicit split-K (3 splits) on a K that is not a multiple of the split; few SMs, so the
    # expand packs 4 row passes per CTA.
    Case("split_k", 5, 2056, 136, 24, [24, 5, 17], slots=[2, 0, 1, 1, -1], num_splits=3,
         num_sms=2),
    # The largest max_rank, with a rank just past a vector boundary.
    Case("wide_rank", 3, 64, 64, 256, [256, 131], slots=[1, 0, 1]),
    # One adapter for the whole batch (the D = 1 decode case).
    Case("one_adapter", 16, 128, 200, 32, [32], slots=[0] * 16),
    # The expand's lane groups of 16 (9..16 rank vectors: ranks 128, 72 and 100) and 8 (40),
    # rank prefixes shorter than B's row pitch, two CTAs of outputs (1096 = 1024 + 72) and
    # several passes per CTA.
    Case("lane_groups", 5, 64, 1096, 128, [128, 72, 40, 100], slots=[0, 1, 2, 3, 1]),
]

SGMV_CASES = [
    # Uncovered tokens 0..2, an empty segment, slot -1, an absent slot (5), a rank-0 slot (3),
    # ranks across the 64-column tile edge (72) and below it; 150 tokens = 2 full tiles + 22.
    Case("segments", 150, 200, 136, 80, [72, 12, 80, 0, 33, 16], absent={5},
         seg_starts=[3, 5, 70, 70, 71, 100, 120, 140, 150],
         seg_slots=[0, 1, 4, -1, 2, 5, 3, 4]),
    # Every token its own segment (SGMV used as BGMV: one mma pass per row).
    Case("one_token_segments", 20, 72, 64, 16, [16, 9, 3], seg_starts=list(range(21)),
         seg_slots=[i % 4 - 1 for i in range(20)]),
    # Split-K with an empty trailing split (4 splits of 192 over K = 584).
    Case("split_k", 70, 584, 64, 32, [32, 20], seg_starts=[0, 40, 70], seg_slots=[1, 0],
         num_splits=4),
    # Segments that straddle the 64-token chunks.
    Case("straddle", 130, 128, 128, 64, [64, 40], seg_starts=[0, 63, 65, 129, 130],
         seg_slots=[0, 1, 0, 1]),
    # Skewed segments: 1-token segments beside one of 150 (three chunks), K deep enough that
    # the shrink's 3-stage pipeline refills its stages (10 K tiles) and a rank deep enough that
    # the expand's 2 stages do (rank 200: 4 rank chunks), ranks off the 8-column vectors.
    Case("skewed", 160, 584, 136, 200, [200, 129, 7], seg_starts=[2, 3, 4, 5, 155, 160],
         seg_slots=[0, 1, 2, 0, 1], num_splits=1),
]

# Decode batches run with a batch plan (plans.plan_batch), on both the grouped and the
# per-token path.
DECODE_BATCHES = [
    # Slots shared by many tokens (grouped), rank 12 and 33 in a max-rank-48 pool (t narrows to
    # 40), with slot -1, an absent slot, a rank-0 slot and one past the table; 42 tokens, so
    # that on one SM the per-token expand's waves cost more than the SGMV tile's segments.
    Case("shared_slots", 42, 200, 72, 48, [12, 33, 8, 0], absent={2},
         slots=[0, 1, 0, -1, 1, 0, 2, 0, 1, 3, 0, 1, 9, 0, 1, 0, 1, 0, 1, 0, 0] * 2),
    # One adapter for the whole batch, over three 64-token chunks.
    Case("one_slot", 150, 64, 64, 64, [20], slots=[0] * 150),
    # A wide output (16 SGMV output tiles) over 8 tokens of 2 slots: the per-token expand's.
    Case("wide_output", 8, 64, 1024, 24, [8, 12], slots=[0, 1, 0, 1, 1, 0, 0, 1]),
]


# Fused slices of one x (q, k, v at different widths, kernels.bgmv_fused): the mixed case's
# skips, and a long K over two tokens that the planner splits, so that the fused shrink's atomics
# add each slice into its own t plane.
FUSED_CASES = [(BGMV_CASES[0], (72, 16, 40)),
               (Case("split_k", 2, 16384, 64, 16, [16, 9], slots=[1, 0]), (64, 24))]


# The SGMV fused slices' widths (kernels.sgmv_fused, and bgmv_fused on a grouped batch: q, k, v
# as in a GQA layer, off the 64-output tiles), each over a pool of its own, and the slot that
# only slice 1 does not adapt (its table entry 0 there, present in the others).
FUSED_WIDTHS = (72, 16, 40)
ABSENT_IN_SLICE_1 = 0


def fused_pools(case: Case, widths: tuple[int, ...] = FUSED_WIDTHS) -> list[Pool]:
    """One pool per slice of these widths, with finite junk in every A row past a slot's rank
    (the kernels must never load it) and ABSENT_IN_SLICE_1 absent in slice 1 only."""
    pools = []
    for z, width in enumerate(widths):
        absent = case.absent | ({ABSENT_IN_SLICE_1} if z == 1 else set())
        pool = make_pool(case.in_dim, width, case.max_rank, case.ranks, absent, seed=10 + z)
        for offset, rank in zip(pool.a_offsets, case.ranks, strict=True):
            if offset is not None:
                pool.pool[offset + rank * case.in_dim: offset + case.max_rank * case.in_dim] = 5.0
        pools.append(pool)
    return pools


def fused_tables(pools: list[Pool]) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.stack([p.tables()[0] for p in pools]),
            torch.stack([p.tables()[1] for p in pools]))


def check_slices(case: Case, pools: list[Pool], x: torch.Tensor, y: torch.Tensor,
                  y0: torch.Tensor, slots: torch.Tensor, family: str) -> None:
    """Each slice's columns of y (side by side, as wide as its pool's out_dim) against the
    reference over its own pool; a token its slice skips (slot -1, past the table, absent
    there, rank 0) keeps its row bit for bit."""
    cols = [0, *np.cumsum([pool.out_dim for pool in pools]).tolist()]
    scales, ranks = pools[0].scales, pools[0].ranks
    for z, pool in enumerate(pools):
        a_weights, b_weights = pool.weights()
        part, before = y[:, cols[z]:cols[z + 1]], y0[:, cols[z]:cols[z + 1]]
        expected = reference.lora_delta(x, before, slots, a_weights, b_weights, scales, ranks,
                                        case.max_rank)
        for b, slot in enumerate(slots.tolist()):
            if not 0 <= slot < len(case.ranks) or a_weights[slot] is None or not case.ranks[slot]:
                assert torch.equal(part[b].view(torch.uint8), before[b].view(torch.uint8)), (
                    f"slice {z}: token {b} (slot {slot}) is skipped, yet its y row changed")
        rtol, atol = reference.TOLERANCES[family, y.dtype]
        torch.testing.assert_close(part.float(), expected.float(), rtol=rtol, atol=atol)


def check_t(t: torch.Tensor, expected: torch.Tensor) -> None:
    """t (its split-K partials added into it) against the reference t; every element must have
    been written."""
    assert not torch.isnan(t).any(), "the shrink left t elements unwritten"
    rtol, atol = reference.T_TOLERANCE
    torch.testing.assert_close(t, expected, rtol=rtol, atol=atol)


def check_y(y: torch.Tensor, y0: torch.Tensor, expected: torch.Tensor, case: Case,
             family: str) -> None:
    """y against the reference within the family's tolerance; skipped rows bit for bit."""
    slots = case.token_slots()
    pool = case.pool()
    a_weights, _ = pool.weights()
    for b, slot in enumerate(slots.tolist()):
        skipped = (slot < 0 or slot >= len(case.ranks) or a_weights[slot] is None
                   or case.ranks[slot] == 0)
        if skipped:
            assert torch.equal(y[b].view(torch.uint8), y0[b].view(torch.uint8)), (
                f"token {b} (slot {slot}) has no adapter, yet its y row changed"
            )
    rtol, atol = reference.TOLERANCES[family, y.dtype]
    torch.testing.assert_close(y.float(), expected.float(), rtol=rtol, atol=atol)


# --- float64 references and error bounds ---------------------------------------------------
# The kernels add exact BF16 products (and, in the BGMV expand, F32 t times BF16 B) in F32 in
# an order of their own; whatever the order, n additions of terms whose magnitudes sum to m
# err by at most gamma(n) * m (Higham, "Accuracy and Stability of Numerical Algorithms", 3.1).
# The unit is 2^-23, twice F32's, so the bound also holds for an accumulation that truncates
# (the tensor cores' may). A BF16 output is then rounded once, to nearest even: half a BF16 ulp
# more. So an output off by a BF16 ulp, or a reduction that drops a term, fails the bound,
# where a blanket relative tolerance of 1e-2 would accept both.
ACCUMULATION_UNIT = 2.0**-23


def gamma(n: int | np.ndarray) -> np.ndarray:
    """gamma(n) = n u / (1 - n u): the relative bound on n roundings of a sum."""
    nu = np.asarray(n, dtype=np.float64) * ACCUMULATION_UNIT
    return nu / (1.0 - nu)


def bf16_spacing(values: np.ndarray) -> np.ndarray:
    """The spacing of BF16 numbers at each |value| (its ulp: 2^(e - 8) for |value| in
    [2^(e-1), 2^e)); 0 at 0."""
    mantissa, exponent = np.frexp(np.abs(np.asarray(values, dtype=np.float64)))
    return np.where(mantissa == 0, 0.0, np.ldexp(1.0, exponent - 8))


def active_rank(slot: int, weights: list[torch.Tensor | None], ranks: torch.Tensor,
                cols: int) -> int:
    """The rank rows a token of `slot` uses: 0 where the kernels skip it (slot -1, past the
    table, a 0 pointer, rank 0), else min(ranks[slot], cols)."""
    if slot < 0 or slot >= len(weights) or weights[slot] is None:
        return 0
    return max(0, min(int(ranks[slot]), cols))


def shrink64(x: torch.Tensor, slots: list[int], a_weights: list[torch.Tensor | None],
             ranks: torch.Tensor, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """t = x A^T in float64 [T, cols] (zero past each token's rank, and for skipped tokens),
    and the sum of the magnitudes of each element's terms (its error bound's scale)."""
    xs = x.double().numpy()
    t = np.zeros((xs.shape[0], cols))
    magnitude = np.zeros_like(t)
    for b, slot in enumerate(slots):
        r = active_rank(slot, a_weights, ranks, cols)
        if r:
            a = a_weights[slot][:r].double().numpy()
            t[b, :r] = a @ xs[b]
            magnitude[b, :r] = np.abs(a) @ np.abs(xs[b])
    return t, magnitude


def expand64(t: np.ndarray, y0: torch.Tensor, slots: list[int],
             b_weights: list[torch.Tensor | None], scales: torch.Tensor, ranks: torch.Tensor,
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """y0 + scale t B^T in float64 from the t the expand read (the kernel's own, as its
    products see it); with the magnitudes of each output's terms and their count."""
    y = y0.double().numpy().copy()
    magnitude = np.abs(y)
    terms = np.ones(y.shape[0])
    for b, slot in enumerate(slots):
        r = active_rank(slot, b_weights, ranks, t.shape[1])
        if r:
            w = b_weights[slot][:, :r].double().numpy()
            scale = float(scales[slot])
            y[b] += scale * (w @ t[b, :r])
            magnitude[b] += abs(scale) * (np.abs(w) @ np.abs(t[b, :r]))
            terms[b] = r + 3  # r products, r - 1 additions, the scale, y's addition
    return y, magnitude, terms


def check_bound(what: str, got: torch.Tensor, exact: np.ndarray, magnitude: np.ndarray,
                terms: np.ndarray | int, rounded_to_bf16: bool,
                inherited: np.ndarray | float = 0.0) -> None:
    """Every element of `got` within gamma(terms) * magnitude of the float64 `exact`, plus the
    error `inherited` from inputs that were not exact (plus half a BF16 ulp where the output is
    BF16, rounded once to nearest even)."""
    values = got.double().numpy()
    # terms: one count, or one a row (an output row's terms), or one an element.
    bound = gamma(np.asarray(terms)[:, None] if np.ndim(terms) == 1 else terms) * magnitude
    bound = bound + inherited
    if rounded_to_bf16:
        bound = bound + bf16_spacing(np.abs(exact) + bound) / 2
    error = np.abs(values - exact)
    bad = np.argwhere(~(error <= bound))
    if bad.size:
        at = tuple(int(i) for i in bad[0])
        raise AssertionError(
            f"{what}: {len(bad)} of {error.size} elements outside their error bound; first "
            f"{what}{list(at)} = {values[at]!r}, exact {exact[at]!r}, off by {error[at]:.3g} "
            f"> bound {bound[at]:.3g}")


# The mean signed error of correctly rounded outputs, in ulps, is about 0 (their errors are
# spread over [-1/2, 1/2] with a standard deviation of at most 1/2); a rounding that truncates,
# or that breaks ties one way, moves it by up to half an ulp on every output.
BIAS_SIGMAS = 6.0


def check_unbiased(what: str, got: torch.Tensor, exact: np.ndarray, rows: list[int]) -> None:
    """The BF16 outputs of `rows` (those the kernel wrote) err by a mean of about 0 ulps, both
    signed and towards zero: within BIAS_SIGMAS standard errors (of 1/2 ulp each)."""
    values = got.double().numpy()[rows].ravel()
    want = exact[rows].ravel()
    spacing = bf16_spacing(want)
    keep = spacing > 0
    if keep.sum() < 64:
        return  # too few outputs for a mean to mean anything
    error = (values[keep] - want[keep]) / spacing[keep]
    limit = BIAS_SIGMAS * 0.5 / math.sqrt(error.size)
    for kind, mean in (("signed", error.mean()),
                       ("towards zero", (error * np.sign(want[keep])).mean())):
        assert abs(mean) <= limit, (
            f"{what}: the mean {kind} error of {error.size} BF16 outputs is {mean:+.3f} ulp, "
            f"more than {limit:.3f}: a biased rounding")
