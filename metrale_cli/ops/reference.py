"""Torch reference of every LoRA delta kernel in kernels/*.cu, for tests and the benchmark.

The references take the pool's meaning rather than its pointers: per-slot weight tensors
(`a_weights[k]` is slot k's A, BF16 [max_rank, in_dim], or None where the slot does not adapt
the entry; `b_weights[k]` is its B, BF16 [out_dim, max_rank]), plus the scale and rank tables.
`weights_from_table` turns a pool allocation and an address table into that list.

Everything is computed in F32 from the BF16 inputs, one slot at a time, and written in the
kernels' output conventions: t is F32 with zero rows for skipped tokens and zero columns at and
past each rank; y rows of skipped tokens are returned unchanged (bit for bit).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# (rtol, atol) for comparing a kernel's y with these references, keyed by kernel family and y
# dtype, for inputs at the scale of `randn / sqrt(dim)`. BF16 y keeps 8 significant bits
# (S-LoRA's bf16 test tolerance). F32 y is exact up to summation order for BGMV; SGMV's expand
# feeds t to the tensor cores as BF16 (relative 2^-9 per element), which dominates its error.
TOLERANCES: dict[tuple[str, torch.dtype], tuple[float, float]] = {
    ("bgmv", torch.bfloat16): (3e-2, 2e-2),
    ("bgmv", torch.float32): (1e-4, 1e-4),
    ("sgmv", torch.bfloat16): (3e-2, 2e-2),
    ("sgmv", torch.float32): (1e-2, 2e-2),
}
# The shrink output t is F32 and computed from exact BF16 products.
T_TOLERANCE = (1e-4, 1e-4)


def _active(slot: int, weights: Sequence[torch.Tensor | None], ranks: torch.Tensor) -> int:
    """The rank the kernels use for `slot`, or 0 when its tokens are skipped."""
    if slot < 0 or slot >= len(weights) or weights[slot] is None:
        return 0
    return max(int(ranks[slot]), 0)


def shrink(
    x: torch.Tensor,
    slots: torch.Tensor,
    a_weights: Sequence[torch.Tensor | None],
    ranks: torch.Tensor,
    max_rank: int,
) -> torch.Tensor:
    """t[b, j] = x[b] @ A_s[j] for j < rank[s]; F32 [T, max_rank] (BGMV and SGMV shrink)."""
    t = torch.zeros(x.shape[0], max_rank, dtype=torch.float32)
    slots = slots.to(torch.int64).cpu()
    for slot in sorted({int(s) for s in slots.tolist()}):
        rank = min(_active(slot, a_weights, ranks), max_rank)
        if rank == 0:
            continue
        rows = (slots == slot).nonzero().flatten()
        a = a_weights[slot][:rank].float().cpu()
        t[rows, :rank] = x[rows].float().cpu() @ a.T
    return t


def expand(
    y: torch.Tensor,
    t: torch.Tensor,
    slots: torch.Tensor,
    b_weights: Sequence[torch.Tensor | None],
    scales: torch.Tensor,
    ranks: torch.Tensor,
) -> torch.Tensor:
    """A new y with y[b] += scale[s] * t[b, :r] @ B_s[:, :r]^T (BGMV and SGMV expand).

    t is [T, max_rank] or the kernels' split-K layout [splits, T, max_rank] (summed here).
    """
    if t.dim() == 3:
        t = t.sum(0)
    out = y.clone().cpu()
    slots = slots.to(torch.int64).cpu()
    for slot in sorted({int(s) for s in slots.tolist()}):
        rank = min(_active(slot, b_weights, ranks), t.shape[1])
        if rank == 0:
            continue
        rows = (slots == slot).nonzero().flatten()
        b = b_weights[slot][:, :rank].float().cpu()
        delta = float(scales[slot]) * (t[rows, :rank].float().cpu() @ b.T)
        out[rows] = (out[rows].float() + delta).to(y.dtype)
    return out


def lora_delta(
    x: torch.Tensor,
    y: torch.Tensor,
    slots: torch.Tensor,
    a_weights: Sequence[torch.Tensor | None],
    b_weights: Sequence[torch.Tensor | None],
    scales: torch.Tensor,
    ranks: torch.Tensor,
    max_rank: int,
) -> torch.Tensor:
    """Shrink then expand: the whole LoRA delta added to a copy of y."""
    t = shrink(x, slots, a_weights, ranks, max_rank)
    return expand(y, t, slots, b_weights, scales, ranks)


def segments_to_slots(
    seg_starts: torch.Tensor, seg_slots: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """Per-token slot ids (int32 [T]) from SGMV segments; tokens outside every segment get -1.

    With it, the SGMV kernels check against `shrink` / `expand` above.
    """
    slots = torch.full((num_tokens,), -1, dtype=torch.int32)
    starts = seg_starts.tolist()
    for i, slot in enumerate(seg_slots.tolist()):
        lo, hi = max(starts[i], 0), min(starts[i + 1], num_tokens)
        if lo < hi:
            slots[lo:hi] = slot
    return slots


def weights_from_table(
    pool: torch.Tensor,
    table: Sequence[int] | torch.Tensor,
    shape: tuple[int, int],
    base_address: int | None = None,
) -> list[torch.Tensor | None]:
    """Per-slot views into a BF16 pool allocation from an address table (0 = no weights).

    `shape` is each slot's matrix shape ([max_rank, in_dim] for A, [out_dim, max_rank] for B);
    `base_address` is the address the table's entries are relative to (default: the pool's own
    data pointer, as on the host or when the pool tensor is the device allocation itself).
    """
    flat = pool.reshape(-1)
    if flat.dtype != torch.bfloat16:
        flat = flat.view(torch.bfloat16)
    base = pool.data_ptr() if base_address is None else base_address
    count = shape[0] * shape[1]
    views: list[torch.Tensor | None] = []
    for address in [int(a) for a in (table.tolist() if torch.is_tensor(table) else table)]:
        if address == 0:
            views.append(None)
            continue
        offset_bytes = address - base
        if offset_bytes < 0 or offset_bytes % 2 or offset_bytes // 2 + count > flat.numel():
            raise ValueError(f"table address {address:#x} is outside the pool")
        start = offset_bytes // 2
        views.append(flat[start : start + count].view(shape))
    return views


# --- expert.cu ------------------------------------------------------------------------------------
# The router delta is `lora_delta` over the router entry's per-slot weights (out_dim = E).


def expert_weights(
    pool: torch.Tensor,
    tables: torch.Tensor,
    entries: Sequence[Sequence[int]] | torch.Tensor,
    shapes: Sequence[tuple[int, int]],
    base_address: int | None = None,
) -> list[list[list[torch.Tensor | None]]]:
    """Per (slice, expert), the per-slot weight views of one expert pool's table rows
    (`tables` u64 [n_entries, max_loras], `entries` [slices, E] rows or -1, `shapes[c]` each
    slot's matrix shape for slice c); an expert without an entry has no weights in any slot."""
    rows = entries.tolist() if torch.is_tensor(entries) else [list(r) for r in entries]
    max_loras = int(tables.shape[1])
    return [[weights_from_table(pool, tables[n], shapes[c], base_address) if n >= 0
             else [None] * max_loras for n in row] for c, row in enumerate(rows)]


def routed_expert_delta(
    inputs: torch.Tensor,
    x_div: int,
    y: torch.Tensor,
    pair_slots: torch.Tensor,
    pair_experts: torch.Tensor,
    a_weights: Sequence[Sequence[Sequence[torch.Tensor | None]]],
    b_weights: Sequence[Sequence[Sequence[torch.Tensor | None]]],
    scales: torch.Tensor,
    ranks: torch.Tensor,
    max_rank: int,
) -> torch.Tensor:
    """A new y [P, slices * out_dim] with, for each pair p (its slot pair_slots[p] and expert
    pair_experts[p]), slice c's columns += scale * (inputs[p // x_div] @ A_c^T) @ B_c^T
    (expert_gate_up with x_div = top_k and slices gate, up; expert_down with x_div = 1)."""
    out = y.clone().cpu()
    slices = len(a_weights)
    width = y.shape[1] // slices
    pair_experts = pair_experts.to(torch.int64).cpu().flatten()
    pair_slots = pair_slots.to(torch.int64).cpu().flatten()
    for e in sorted({int(v) for v in pair_experts.tolist()}):
        rows = (pair_experts == e).nonzero().flatten()
        x = inputs.cpu()[rows // x_div]
        for c in range(slices):
            cols = slice(c * width, (c + 1) * width)
            out[rows, cols] = lora_delta(x, out[rows, cols], pair_slots[rows], a_weights[c][e],
                                         b_weights[c][e], scales, ranks, max_rank)
    return out


def overlay_gather(
    token_ids: torch.Tensor,
    slots: torch.Tensor,
    overlays: Sequence[dict[int, torch.Tensor] | None],
    emb: torch.Tensor,
) -> torch.Tensor:
    """A new emb [T, H]: row b replaced by overlays[s][token_ids[b]] (s = slots[b]) where the
    slot overlays that token, every other row as it was."""
    out = emb.clone()
    for b, (token, slot) in enumerate(zip(token_ids.tolist(), slots.tolist(), strict=True)):
        rows = overlays[slot] if 0 <= slot < len(overlays) else None
        if rows is not None and token in rows:
            out[b] = rows[token].to(emb.dtype)
    return out
