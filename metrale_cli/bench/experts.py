"""`metrale bench kernels --experts`: the expert LoRA kernels (kernels/expert.cu) on the MoE
shapes of Qwen3-Next-80B-A3B and Qwen3-30B-A3B, as records like bench_kernels' (one dict per
projection and shape, its setup embedded).

Per (model, rank, tokens, adapters), with each token's real top-k (distinct experts drawn at
random, as a router spreads them) and adapters interleaved over the tokens:
- `gate_up`, `down`: the align step's tiles, then shrink + expand (2 launches) of the delta;
- `router`: the router delta (1 launch).

Method as bench_kernels (its helpers are reused): validate a sample of pairs first, rotate
groups of buffers (each its own expert pool) past the L2, time CUDA-graph replays, report
compulsory bytes, % of peak HBM, % of an equal-bytes copy, and the speedup over the torch
baseline (gather the chosen experts' A and B per pair, then bmm). `model_records` is the
roofline model of the same launches, no GPU needed (`--model-only`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from metrale_cli import compat
from metrale_cli.bench.kernels import (
    _copy_us,
    _percentiles,
    _time_cupy,
    _time_torch,
    device_info,
    torch_on_device,
)
from metrale_cli.bench.roofline import (
    BANDWIDTH_REGIME_BYTES,
    COPY_RATIO_TARGET,
    DECODE_TOKENS,
    TARGET_PCT,
    TERMS,
    ModelDevice,
    rotation_groups,
    stream_model,
)
from metrale_cli.model.config import ModelConfig
from metrale_cli.ops import expert_kernels, kernels, plans, sources

EXPERT_MODELS = ("qwen3-next-80b-a3b", "qwen3-30b-a3b")
EXPERT_RANKS = (8, 16, 64)
EXPERT_TOKENS = (*DECODE_TOKENS, 4096)
EXPERT_ADAPTERS = (1, 8)
PROJECTIONS = ("gate_up", "down", "router")
_VALIDATE_PAIRS = 32


@dataclass(frozen=True)
class ExpertShape:
    model: str
    hidden: int
    inter: int
    experts: int
    top_k: int
    rank: int
    tokens: int
    adapters: int

    @property
    def pairs(self) -> int:
        return self.tokens * self.top_k

    def record(self) -> dict[str, Any]:
        return {"model": self.model, "hidden": self.hidden, "inter": self.inter,
                "experts": self.experts, "top_k": self.top_k, "rank": self.rank,
                "tokens": self.tokens, "adapters": self.adapters}


def expert_shapes(models: Sequence[str] = EXPERT_MODELS, ranks: Sequence[int] = EXPERT_RANKS,
                  tokens: Sequence[int] = EXPERT_TOKENS,
                  adapters: Sequence[int] = EXPERT_ADAPTERS) -> list[ExpertShape]:
    shapes = []
    for name in models:
        cfg = ModelConfig.preset(name)
        for rank in ranks:
            for count in tokens:
                for distinct in sorted({min(a, count) for a in adapters}):
                    shapes.append(ExpertShape(name, cfg.hidden_size,
                                              cfg.expert_intermediate_size, cfg.num_experts,
                                              cfg.num_experts_per_tok, rank, count, distinct))
    return shapes


def routing(shape: ExpertShape, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(topk_ids int32 [T, top_k]: distinct experts per token, uniformly drawn; slots int32
    [T]: adapters interleaved over the tokens)."""
    rng = np.random.default_rng(seed)
    draws = rng.random((shape.tokens, shape.experts))
    topk = np.argsort(draws, axis=1)[:, :shape.top_k].astype(np.int32)
    slots = (np.arange(shape.tokens) % shape.adapters).astype(np.int32)
    return topk, slots


def plan(shape: ExpertShape, seed: int = 0) -> expert_kernels.ExpertBatch:
    topk, slots = routing(shape, seed)
    return expert_kernels.plan_pairs(topk, slots, np.full(shape.adapters, shape.rank, np.int32),
                                     shape.rank, num_experts=shape.experts)


def compulsory_bytes(proj: str, shape: ExpertShape, groups: int) -> int:
    """Bytes the delta must move at least: each (slot, expert) group's A and B once, the
    inputs once, the BF16 output read and written (router: F32 logits), t written and read."""
    r, h, i, p = shape.rank, shape.hidden, shape.inter, shape.pairs
    if proj == "gate_up":
        return 2 * groups * 2 * (r * h + i * r) + 2 * shape.tokens * h + 2 * 2 * p * 2 * i \
            + 2 * 4 * 2 * p * r
    if proj == "down":
        return 2 * groups * (r * i + h * r) + 2 * p * i + 2 * 2 * p * h + 2 * 4 * p * r
    return 2 * shape.adapters * (r * h + shape.experts * r) + 2 * shape.tokens * h \
        + 2 * 4 * shape.tokens * shape.experts


def flops(proj: str, shape: ExpertShape) -> int:
    r, h, i, p = shape.rank, shape.hidden, shape.inter, shape.pairs
    if proj == "gate_up":
        return 2 * 2 * p * r * (h + i)
    if proj == "down":
        return 2 * p * r * (i + h)
    return 2 * shape.tokens * r * (h + shape.experts)


# The mma prefill kernels' passes (kernels/expert.cu): the shrink's warps each take kChunks
# 32-wide K chunks of the tile's x rows and of its m16 tiles of A rows, kChunks 6, 3 or 2 for
# the 1, 2 or 4 tiles the rank reaches in a 64-row CTA (3 are read as 4); the expand's warps
# take 16 / kChunks n8 tiles of B rows over kChunks 32-wide rank chunks (the power of two at or
# above ceil(r / 32)), or, at one or two vectors a row (rank 16 or below), every lane its own
# row's vector: one pass of the CTA's 1024 rows.
_SHRINK_CHUNKS = {1: 6, 2: 3, 4: 2}


def prefill_pass_bytes(kind: str, rank: int, pairs_per_tile: float) -> int:
    """Distinct bytes one pass of an mma prefill CTA (`kind` "shrink" or "expand") has in
    flight at `rank`: rows past the rank, rank chunks past it and pairs past a tile's end
    re-read loaded data and add nothing."""
    warps = sources.THREADS // 32
    if kind == "shrink":
        used = -(-min(64, rank) // 16)
        tiles = 1 if used == 1 else 2 if used == 2 else 4
        rows = min(16 * tiles, rank)
        return round(warps * _SHRINK_CHUNKS[tiles] * 32 * 2 * (min(8, pairs_per_tile) + rows))
    vecs = -(-rank // sources.VECTOR)
    if vecs <= 2:
        return sources.THREADS * sources.EXPAND_ROWS * 2 * sources.VECTOR * vecs
    chunks = 1 << (-(-rank // 32) - 1).bit_length()
    return warps * (16 // chunks) * 8 * 2 * min(32 * chunks, sources.VECTOR * vecs)


def _launches(proj: str, shape: ExpertShape, batch: expert_kernels.ExpertBatch
              ) -> list[tuple[str, tuple[int, int, int], int, int | None]]:
    """(kernel, grid, requested bytes, distinct bytes per CTA pass or None for the loads the
    SASS check holds) of the projection's launches, as planned."""
    tiles = int(batch.tiles.shape[0])
    r, cols = shape.rank, batch.t_cols
    path = "prefill" if batch.prefill else "decode"
    if proj == "router":
        requested = compulsory_bytes(proj, shape, 0) + 2 * shape.tokens * r * shape.hidden
        return [("router_lora_f32", (shape.tokens, 1, 1), requested, None)]
    slices, in_dim, out_dim = (2, shape.hidden, shape.inter) if proj == "gate_up" else (
        1, shape.inter, shape.hidden)
    rows = -(-cols // expert_kernels.shrink_rows(batch.tile))
    shrink_grid = (tiles, rows, slices)
    expand_grid = (tiles, -(-out_dim // (sources.THREADS * sources.EXPAND_ROWS)), slices)
    # Each tile reads its group's A (every x once per CTA of rank rows) and B (t once per CTA).
    shrink_req = slices * tiles * 2 * r * in_dim + rows * slices * 2 * shape.pairs * in_dim \
        + slices * 4 * shape.pairs * cols
    expand_req = slices * tiles * 2 * out_dim * r + 2 * 2 * shape.pairs * slices * out_dim \
        + expand_grid[1] * slices * 4 * shape.pairs * cols
    per_tile = shape.pairs / max(tiles, 1)
    shrink_pass, expand_pass = ((prefill_pass_bytes("shrink", r, per_tile),
                                 prefill_pass_bytes("expand", r, per_tile))
                                if batch.prefill else (None, None))
    return [(f"expert_shrink_{path}", shrink_grid, shrink_req, shrink_pass),
            (f"expert_expand_{path}_bf16", expand_grid, expand_req, expand_pass)]


def model_records(shapes: Sequence[ExpertShape], device: ModelDevice | None = None
                  ) -> list[dict[str, Any]]:
    """The roofline model per projection and shape: Little's law over each launch, the
    launches' times summed (no GPU needed)."""
    device = device or ModelDevice()
    records = []
    for shape in shapes:
        batch = plan(shape)
        for proj in PROJECTIONS:
            nbytes = compulsory_bytes(proj, shape, batch.groups)
            launches = _launches(proj, shape, batch)
            parts = [stream_model(kernel, grid, requested, nbytes * requested
                                  // sum(q for _, _, q, _ in launches), device, pass_bytes)
                     for kernel, grid, requested, pass_bytes in launches]
            expected_us = sum(p["expected_us"] for p in parts)
            # The launches run one after the other: each term adds up over them.
            terms = {name: sum(p["terms"][name] for p in parts) for name in TERMS}
            copy_us = 1e6 * max(device.launch_s, device.latency_s + nbytes / (
                device.copy_fraction * device.peak_bytes_per_s))
            pct = 100 * nbytes / (expected_us * 1e-6) / device.peak_bytes_per_s
            regime = "bandwidth" if nbytes >= BANDWIDTH_REGIME_BYTES else "latency"
            phase = "decode" if shape.tokens <= 256 else "prefill"
            target = TARGET_PCT[phase, "expand"]
            records.append({
                "projection": proj, **shape.record(), "path": "prefill" if batch.prefill
                else "decode", "tile": batch.tile, "groups": batch.groups,
                "tiles": int(batch.tiles.shape[0]), "bytes": nbytes,
                "l2_bytes": sum(p["l2_bytes"] for p in parts), "terms": terms,
                "binding": max(terms, key=terms.__getitem__),
                "kernels": [p | {"kernel": k} for p, (k, _, _, _) in zip(parts, launches,
                                                                       strict=True)],
                "expected_us": expected_us, "expected_pct_peak": pct, "copy_us": copy_us,
                "expected_copy_ratio": expected_us / copy_us, "regime": regime,
                "target_pct_peak": target, "meets_target": pct >= target if regime ==
                "bandwidth" else expected_us / copy_us <= COPY_RATIO_TARGET,
                "device": device.name,
            })
    return records


# --- the GPU run ------------------------------------------------------------------------------


def _bf16(xp: Any, rng: Any, shape: tuple[int, ...], std: float) -> Any:
    """Random BF16 bits (uint16), rounded to nearest even."""
    values = rng.standard_normal(shape, dtype=xp.float32) * np.float32(std)
    bits = values.view(xp.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(xp.uint16)


class ExpertGroup:
    """One rotation group: an expert pool of `adapters` slots for one MoE layer (per projection
    A [D, E, r, in] and B [D, E, out, r], BF16 bits), its tables and the batch's buffers.
    `xp` is cupy (the benchmark) or numpy (the host harness, in the tests)."""

    def __init__(self, xp: Any, rng: Any, shape: ExpertShape,
                 batch: expert_kernels.ExpertBatch, topk: np.ndarray, slots: np.ndarray,
                 backend: kernels.Backend) -> None:
        d, e, r, h, i = shape.adapters, shape.experts, shape.rank, shape.hidden, shape.inter
        self.shape, self.batch, self.backend, self.xp = shape, batch, backend, xp
        self.weights = {  # projection -> (A, B)
            "gate": (_bf16(xp, rng, (d, e, r, h), h ** -0.5),
                     _bf16(xp, rng, (d, e, i, r), r ** -0.5)),
            "up": (_bf16(xp, rng, (d, e, r, h), h ** -0.5),
                   _bf16(xp, rng, (d, e, i, r), r ** -0.5)),
            "down": (_bf16(xp, rng, (d, e, r, i), i ** -0.5),
                     _bf16(xp, rng, (d, e, h, r), r ** -0.5)),
            "router": (_bf16(xp, rng, (d, 1, r, h), h ** -0.5),
                       _bf16(xp, rng, (d, 1, e, r), r ** -0.5)),
        }
        # Expert entries: gate 0..E-1, up E..2E-1, down 2E..3E-1, the router 3E; u64
        # [3E + 1, D] tables of each (entry, slot)'s A and B address.
        a_rows, b_rows = [], []
        for name in ("gate", "up", "down", "router"):
            a, b = self.weights[name]
            for which, rows in ((a, a_rows), (b, b_rows)):
                per = which[0, 0].size * 2  # bytes of one (slot, expert) matrix
                base = plans.address(which)
                count = which.shape[1]
                rows.append(base + per * (np.arange(d)[None, :] * count
                                          + np.arange(count)[:, None]))
        self.tables = expert_kernels.ExpertTables(
            a_tables=xp.asarray(np.concatenate(a_rows).astype(np.uint64)),
            b_tables=xp.asarray(np.concatenate(b_rows).astype(np.uint64)),
            gate_up=xp.asarray(np.arange(2 * e, dtype=np.int32).reshape(2, e)),
            down=xp.asarray(np.arange(2 * e, 3 * e, dtype=np.int32).reshape(1, e)),
            router=3 * e, scale_table=xp.asarray(np.linspace(0.5, 2, d, dtype=np.float32)),
            ranks=xp.full(d, r, dtype=xp.int32), max_rank=r, num_experts=e)
        p = shape.pairs
        self.topk, self.slots_host = topk, slots
        self.slots = xp.asarray(slots)
        self.x = _bf16(xp, rng, (shape.tokens, h), 1.0)
        self.h = _bf16(xp, rng, (p, 2 * i), 1.0)
        self.act = _bf16(xp, rng, (p, i), 1.0)
        self.y = _bf16(xp, rng, (p, h), 1.0)
        self.logits = rng.standard_normal((shape.tokens, e), dtype=xp.float32)
        self.sorted_pairs = xp.asarray(batch.sorted_pairs)
        self.tiles = xp.asarray(batch.tiles)
        self.t_gate_up = xp.zeros((2, p, batch.t_cols), dtype=xp.float32)
        self.t_down = xp.zeros((1, p, batch.t_cols), dtype=xp.float32)

    def plans(self, proj: str) -> list[plans.KernelLaunch]:
        tables, batch = self.tables, self.batch
        if proj == "router":
            return [expert_kernels.plan_router_lora(self.x, self.logits, self.slots, tables)]
        if proj == "gate_up":
            inputs, x_div, entries, t, y = self.x, batch.top_k, tables.gate_up, self.t_gate_up, \
                self.h
        else:
            inputs, x_div, entries, t, y = self.act, 1, tables.down, self.t_down, self.y
        return [expert_kernels.plan_expert_shrink(inputs, x_div, self.sorted_pairs, self.tiles,
                                                  tables, entries, t, batch.tile),
                expert_kernels.plan_expert_expand(t, self.sorted_pairs, self.tiles, tables,
                                                  entries, y, batch.tile)]

    def call(self, proj: str) -> Callable[[], None]:
        """The projection's launches as one call (CuPy: the compiled kernels bound once)."""
        plans = self.plans(proj)
        if self.backend is kernels.CUPY:
            bound = [(kernels.get_kernel(p.kernel), p) for p in plans]

            def on_device() -> None:
                for kernel, p in bound:
                    kernel(p.grid, p.block, p.args)
            return on_device

        def elsewhere() -> None:
            for p in plans:
                self.backend.launch(p)
        return elsewhere

    def output(self, proj: str) -> Any:
        return {"gate_up": self.h, "down": self.y, "router": self.logits}[proj]

    def validate(self, proj: str) -> None:
        """Run the projection once and compare sampled rows with a float64 NumPy reference
        (per pair: scale * (input @ A^T) @ B^T); raises AssertionError on a mismatch. The
        output is restored afterwards."""
        shape = self.shape
        host = plans.host_values
        out = self.output(proj)
        before = out.copy()
        self.call(proj)()
        after = host(out).astype(np.float64) if proj == "router" else _f64(host(out))
        prior = host(before).astype(np.float64) if proj == "router" else _f64(host(before))
        out[...] = before
        scales = host(self.tables.scale_table)
        rows = np.unique(np.linspace(0, (shape.tokens if proj == "router" else shape.pairs) - 1,
                                     _VALIDATE_PAIRS).astype(np.int64))
        for row in rows:
            if proj == "router":
                slot, parts = int(self.slots_host[row]), [("router", 0, self.x, row, 0)]
            else:
                token, choice = divmod(int(row), shape.top_k)
                slot, expert = int(self.slots_host[token]), int(self.topk[token, choice])
                parts = ([("gate", expert, self.x, token, 0),
                          ("up", expert, self.x, token, shape.inter)] if proj == "gate_up"
                         else [("down", expert, self.act, row, 0)])
            want = prior[row].copy()
            for name, expert, inputs, index, offset in parts:
                a, b = (_f64(host(w[slot, expert])) for w in self.weights[name])
                delta = float(scales[slot]) * (b @ (a @ _f64(host(inputs[index]))))
                want[offset:offset + delta.size] += delta
            scale = max(float(np.abs(want).max()), 1.0)
            np.testing.assert_allclose(after[row], want, rtol=0, atol=2e-2 * scale,
                                       err_msg=f"{proj} row {row} of {shape}")


def _f64(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _torch_baseline(proj: str, groups: Sequence[ExpertGroup]) -> list[Callable[[], None]]:
    """Per group: gather the chosen experts' A and B per pair, then bmm (shrink and expand)."""
    import torch

    calls = []
    for g in groups:
        def view(array: Any) -> Any:
            return torch.from_dlpack(array).view(torch.bfloat16)

        slots = torch.from_dlpack(g.slots).long()
        topk = torch.as_tensor(g.topk, device=slots.device).long()
        pair_slot = slots.repeat_interleave(g.shape.top_k)
        pair_expert = topk.flatten()
        scales = torch.from_dlpack(g.tables.scale_table)
        if proj == "router":
            a, b = (view(w)[:, 0] for w in g.weights["router"])
            x, out = view(g.x), torch.from_dlpack(g.logits)
            token_scale = scales[slots][:, None]

            def call(a=a, b=b, x=x, out=out, slots=slots, s=token_scale) -> None:
                t = torch.bmm(x[:, None], a[slots].transpose(1, 2))
                out.add_((torch.bmm(t, b[slots].transpose(1, 2))[:, 0] * s).float())
        else:
            names = ("gate", "up") if proj == "gate_up" else ("down",)
            weights = [tuple(view(w) for w in g.weights[n]) for n in names]
            inputs, div = (view(g.x), g.shape.top_k) if proj == "gate_up" else (view(g.act), 1)
            rows = torch.arange(g.shape.pairs, device=slots.device) // div
            out = view(g.h if proj == "gate_up" else g.y)
            pair_scale = scales[pair_slot].to(torch.bfloat16)[:, None]

            def call(weights=weights, inputs=inputs, rows=rows, out=out, ps=pair_slot,
                     pe=pair_expert, s=pair_scale) -> None:
                width = out.shape[1] // len(weights)
                x = inputs[rows]  # each pair's input row, gathered as the baseline must
                for c, (a, b) in enumerate(weights):
                    t = torch.bmm(x[:, None], a[ps, pe].transpose(1, 2))
                    out[:, c * width:(c + 1) * width] += \
                        torch.bmm(t, b[ps, pe].transpose(1, 2))[:, 0] * s
        calls.append(call)
    return calls


def run(shapes: Sequence[ExpertShape], *, repeats: int = 30, l2_multiple: float = 3.0,
        with_torch: bool = True, seed: int = 0,
        progress: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Benchmark records per (shape, projection) on the GPU; NoDevice (exit 3) without one."""
    cupy = compat.cupy_module()
    device = device_info()
    torch_ok = with_torch and torch_on_device()
    rng = cupy.random.default_rng(seed)
    model_device = ModelDevice(name=device.name, sms=device.sms,
                               peak_bytes_per_s=device.peak_bytes_per_s,
                               l2_bytes=device.l2_bytes)
    records = []
    for shape in shapes:
        topk, slots = routing(shape, seed)
        batch = expert_kernels.plan_pairs(topk, slots, np.full(shape.adapters, shape.rank,
                                                               np.int32), shape.rank,
                                          num_experts=shape.experts)
        expected = {m["projection"]: m for m in model_records([shape], model_device)}
        d, e, r, h, i, p = (shape.adapters, shape.experts, shape.rank, shape.hidden, shape.inter,
                            shape.pairs)
        footprint = 2 * d * e * r * 3 * (h + i) + 2 * p * (3 * i + h) + 8 * p * r * 3
        smallest = min(compulsory_bytes(proj, shape, batch.groups) for proj in PROJECTIONS)
        count = rotation_groups(smallest, footprint, device.l2_bytes, l2_multiple)
        groups = [ExpertGroup(cupy, rng, shape, batch, topk, slots, kernels.CUPY)
                  for _ in range(count)]
        for proj in PROJECTIONS:
            groups[0].validate(proj)
            nbytes = compulsory_bytes(proj, shape, batch.groups)
            ours = _percentiles(_time_cupy([g.call(proj) for g in groups], repeats))
            copy_us = _copy_us(cupy, nbytes, count, repeats)
            torch_us = None
            if torch_ok:
                import torch

                torch_us = _percentiles(_time_torch(torch, _torch_baseline(proj, groups),
                                                    repeats))["p50_us"]
            p50_s = ours["p50_us"] * 1e-6
            record = {
                "kernel": f"expert_{proj}", "projection": proj, **shape.record(),
                "path": expected[proj]["path"], "tile": batch.tile, "groups": batch.groups,
                **ours, "repeats": repeats, "bytes": nbytes, "flops": flops(proj, shape),
                "tb_per_s": nbytes / p50_s / 1e12,
                "pct_peak": 100 * nbytes / p50_s / device.peak_bytes_per_s,
                "copy_us": copy_us, "pct_copy": 100 * copy_us / ours["p50_us"],
                "torch_us": {"gather_bmm": torch_us} if torch_us is not None else {},
                "torch_best": "gather_bmm" if torch_us is not None else None,
                "speedup_vs_torch": torch_us / ours["p50_us"] if torch_us is not None else None,
                "validated": True, "expected_us": expected[proj]["expected_us"],
                "expected_pct_peak": expected[proj]["expected_pct_peak"],
                "measured_vs_expected": expected[proj]["expected_us"] / ours["p50_us"],
                "device": device.name, "peak_tb_per_s": device.peak_bytes_per_s / 1e12,
                "terms": expected[proj]["terms"], "binding": expected[proj]["binding"],
                "device_l2_bytes": device.l2_bytes, "rotation_groups": count,
                # What the groups read fits in L2 together: the replays read L2, not HBM.
                "l2_resident": count * nbytes <= device.l2_bytes, "timing": "cuda-graph",
            }
            records.append(record)
            if progress is not None:
                progress(record)
        del groups
        cupy.get_default_memory_pool().free_all_blocks()
    return records
