"""kernels/expert.cu through the host harness against the torch reference and against PEFT.

Adapters come from the real peft library on tiny Qwen3-MoE and Qwen3-Next models (fused
transformers-5 `target_parameters`) and hand-written in the per-expert transformers-4 form; they
are packed into one LoraPool with an expert pool. Then:

- each kernel (router, gate_up, down, overlay gather) equals reference.py over the pool's
  tables, skipped rows bit for bit, on the decode and the grouped prefill tiles;
- a whole MoE block (router, top-k, experts, weighted sum) whose LoRA deltas all come from the
  kernels equals PEFT's own block output for a batch mixing two adapters and base tokens.

The same checks run on CuPy in test_expert_kernels_gpu (marker `gpu`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pytest
import torch

from metrale_cli.adapters.adapter import Adapter
from metrale_cli.adapters.audit import audit
from metrale_cli.layout.expert_layout import ExpertLayout
from metrale_cli.layout.slot_layout import SlotLayout
from metrale_cli.model.config import ModelConfig
from metrale_cli.ops import expert_kernels as ek
from metrale_cli.ops import host_harness, reference, sources
from metrale_cli.pool.pool import LoraPool
from tests.support.peft_factory import _tiny_model

# The host harness is built before the first test (conftest.host_library).
pytestmark = pytest.mark.usefixtures("host_library")

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"]
MAX_RANK = 8
HOST = host_harness.HOST


@dataclass
class Served:
    """A pool holding a PEFT-made fused adapter (slot 0) and a hand-written v4 one (slot 1),
    with PEFT models of each for the ground truth."""

    model_name: str
    pool: LoraPool
    cfg: ModelConfig
    peft_models: list[Any]  # per slot
    base_model: Any  # the same tiny model without PEFT's wrappers (its base weights)


def _served(peft_zoo: Any, model_name: str) -> Served:
    from peft import PeftModel

    fused = peft_zoo.adapter(model_name, r=4, lora_alpha=8, dtype="bf16",
                             target_modules=["q_proj"], target_parameters=EXPERTS)
    v4 = peft_zoo.hand_v4(model_name, r=8, alpha=4, include_router=True, dtype="bf16", seed=3)
    cfg = ModelConfig.from_hf(fused.base_dir)
    reports = [audit(Adapter.load(p), cfg, experts_enabled=True) for p in (fused.path, v4.path)]
    assert all(r.servable for r in reports)
    layout = SlotLayout.build(cfg, reports[0].module_set, MAX_RANK)
    pairs = [p for r in reports for p in r.expert_pairs]
    ex = ExpertLayout.for_pairs(cfg, pairs, MAX_RANK)
    pool, _ = LoraPool.load(layout, 3, reports, expert_layout=ex)
    v4_model = PeftModel.from_pretrained(_tiny_model(model_name).build_model(0), str(v4.path))
    return Served(model_name, pool, cfg, [fused._peft_model, v4_model.eval()],
                  _tiny_model(model_name).build_model(0))


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_next"])
def served(request: pytest.FixtureRequest, peft_zoo: Any) -> Served:
    return _served(peft_zoo, request.param)


def _bf16(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.bfloat16)


def _pool_weights(pool: LoraPool, tables: ek.ExpertTables, entries: np.ndarray,
                  shapes: list[tuple[int, int]]) -> list[list[list[torch.Tensor | None]]]:
    return reference.expert_weights(torch.from_numpy(pool.expert_region.memory),
                                    torch.from_numpy(pool.expert_region.a_tables.view(np.int64)),
                                    entries, shapes)


def _b_weights(pool: LoraPool, entries: np.ndarray,
               shapes: list[tuple[int, int]]) -> list[list[list[torch.Tensor | None]]]:
    return reference.expert_weights(torch.from_numpy(pool.expert_region.memory),
                                    torch.from_numpy(pool.expert_region.b_tables.view(np.int64)),
                                    entries, shapes)


def _batch(num_tokens: int, num_experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Slots mixing adapter 0, adapter 1, an empty slot (2) and base tokens (-1); distinct
    experts per token."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.tensor([(0, 1, -1, 2, 0, 1)[i % 6] for i in range(num_tokens)],
                         dtype=torch.int32)
    topk = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k]
                        for _ in range(num_tokens)]).to(torch.int32)
    return slots, topk


CASES = [  # (tokens, forced tile: None = the planner's choice)
    pytest.param(6, None, id="decode"),
    pytest.param(40, ek.PREFILL_TILE, id="prefill"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("num_tokens", "tile"), CASES)
def test_routed_experts_equal_the_reference(served: Served, num_tokens: int,
                                            tile: int | None) -> None:
    pool, cfg = served.pool, served.cfg
    hidden, inter, num_experts = cfg.hidden_size, cfg.expert_intermediate_size, cfg.num_experts
    top_k = 2
    gen = torch.Generator().manual_seed(num_tokens)
    for layer in cfg.moe_layers:
        tables = ek.tables_from_pool(pool, layer, HOST, like=torch.empty(0))
        slots, topk = _batch(num_tokens, num_experts, top_k, seed=layer)
        batch = ek.plan_pairs(topk, slots, pool.expert_rank_table, tables.max_rank, tile,
                              num_experts=num_experts)
        assert batch.tile == (tile or ek.DECODE_TILE)
        x = _bf16(torch.randn(num_tokens, hidden, generator=gen))
        h = torch.randn(num_tokens * top_k, 2 * inter, generator=gen)
        pair_slots = slots.repeat_interleave(top_k)
        gu = ek.expert_gate_up(x, h.clone(), batch, tables, backend=HOST)
        shapes = [(MAX_RANK, hidden)] * 2
        want = reference.routed_expert_delta(
            x, top_k, h, pair_slots, topk.flatten(),
            _pool_weights(pool, tables, tables.gate_up.numpy(), shapes),
            _b_weights(pool, tables.gate_up.numpy(), [(inter, MAX_RANK)] * 2),
            torch.from_numpy(pool.scale_table), torch.from_numpy(pool.expert_rank_table),
            MAX_RANK)
        torch.testing.assert_close(gu, want, rtol=1e-4, atol=1e-4)
        base_rows = ((pair_slots < 0) | (pair_slots == 2)).nonzero().flatten()
        assert base_rows.numel() and torch.equal(gu[base_rows], h[base_rows])  # bit for bit
        assert not torch.equal(gu, h)

        act = _bf16(torch.randn(num_tokens * top_k, inter, generator=gen))
        y = _bf16(torch.randn(num_tokens * top_k, hidden, generator=gen))
        down = ek.expert_down(act, y.clone(), batch, tables, backend=HOST)
        want = reference.routed_expert_delta(
            act, 1, y, pair_slots, topk.flatten(),
            _pool_weights(pool, tables, tables.down.numpy(), [(MAX_RANK, inter)]),
            _b_weights(pool, tables.down.numpy(), [(hidden, MAX_RANK)]),
            torch.from_numpy(pool.scale_table), torch.from_numpy(pool.expert_rank_table),
            MAX_RANK)
        torch.testing.assert_close(down.float(), want.float(), rtol=3e-2, atol=2e-2)
        assert torch.equal(down[base_rows], y[base_rows])


@pytest.mark.slow
def test_router_lora_equals_the_reference(served: Served) -> None:
    pool, cfg = served.pool, served.cfg
    gen = torch.Generator().manual_seed(7)
    num_tokens = 12
    for layer in cfg.moe_layers:
        tables = ek.tables_from_pool(pool, layer, HOST, like=torch.empty(0))
        assert tables.router >= 0
        slots, _ = _batch(num_tokens, cfg.num_experts, 1, seed=layer)
        x = _bf16(torch.randn(num_tokens, cfg.hidden_size, generator=gen))
        logits = torch.randn(num_tokens, cfg.num_experts, generator=gen)
        got = ek.router_lora(x, logits.clone(), slots, tables, backend=HOST)
        pool_bytes = torch.from_numpy(pool.expert_region.memory)
        a = reference.weights_from_table(
            pool_bytes, torch.from_numpy(pool.expert_region.a_tables[tables.router].view(np.int64)),
            (MAX_RANK, cfg.hidden_size))
        b = reference.weights_from_table(
            pool_bytes, torch.from_numpy(pool.expert_region.b_tables[tables.router].view(np.int64)),
            (cfg.num_experts, MAX_RANK))
        want = reference.lora_delta(x, logits, slots, a, b, torch.from_numpy(pool.scale_table),
                                    torch.from_numpy(pool.expert_rank_table), MAX_RANK)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        skipped = ((slots < 0) | (slots == 2)).nonzero().flatten()
        assert torch.equal(got[skipped], logits[skipped])
        assert not torch.equal(got, logits)


@pytest.mark.slow
def test_zero_pointers_and_padding_are_never_read(served: Served) -> None:
    """An expert whose pointer is 0 for a slot leaves that slot's pairs' columns untouched, bit
    for bit, while the other projection still adds; A rows past a slot's expert rank are never
    read (NaN there changes nothing)."""
    pool, cfg = served.pool, served.cfg
    layer, top_k, num_tokens = cfg.moe_layers[0], 2, 6
    inter = cfg.expert_intermediate_size
    tables = ek.tables_from_pool(pool, layer, HOST, like=torch.empty(0))
    slots, topk = _batch(num_tokens, cfg.num_experts, top_k, seed=3)
    batch = ek.plan_pairs(topk, slots, pool.expert_rank_table, tables.max_rank,
                          num_experts=cfg.num_experts)
    gen = torch.Generator().manual_seed(5)
    x = _bf16(torch.randn(num_tokens, cfg.hidden_size, generator=gen))
    h = torch.randn(num_tokens * top_k, 2 * inter, generator=gen)
    want = ek.expert_gate_up(x, h.clone(), batch, tables, backend=HOST)

    expert = int(topk[0, 0])  # token 0 has slot 0 (rank 4 in a max-rank-8 pool)
    gate_entry = int(tables.gate_up[0, expert])
    a_tables, b_tables = pool.expert_region.a_tables.copy(), pool.expert_region.b_tables.copy()
    a_tables[gate_entry, 0] = b_tables[gate_entry, 0] = 0
    saved = pool.expert_region.memory.copy()
    try:
        for c in range(2):  # NaN in slot 0's A rows 4..7 of every gate and up entry
            for entry in tables.gate_up[c].tolist():
                start = int(pool.expert_region.a_tables[entry, 0]) - pool.expert_region.base_address
                rows = pool.expert_region.memory[start:start + MAX_RANK * cfg.hidden_size * 2]
                rows.view(np.uint16).reshape(MAX_RANK, -1)[4:] = 0x7FC0
        cut = replace(tables, a_tables=a_tables, b_tables=b_tables)
        got = ek.expert_gate_up(x, h.clone(), batch, cut, backend=HOST)
        t = HOST.new_t(x, (2, num_tokens * top_k, batch.t_cols))
        order, tiles = torch.from_numpy(batch.sorted_pairs), torch.from_numpy(batch.tiles)
        HOST.launch(ek.plan_expert_shrink(x, top_k, order, tiles, tables, tables.gate_up, t,
                                          batch.tile))
    finally:
        pool.expert_region.memory[:] = saved
    pairs = ((slots.repeat_interleave(top_k) == 0) & (topk.flatten() == expert)).nonzero()
    pairs = pairs.flatten()
    assert pairs.numel()
    assert torch.equal(got[pairs, :inter], h[pairs, :inter])  # the 0 pointer: untouched
    torch.testing.assert_close(got[pairs, inter:], want[pairs, inter:], rtol=0, atol=0)
    slot0 = (slots.repeat_interleave(top_k) == 0).nonzero().flatten()
    assert batch.t_cols == MAX_RANK and torch.equal(t[:, slot0, 4:], torch.zeros_like(
        t[:, slot0, 4:]))  # t is zero past slot 0's rank 4: the NaN rows were not read
    others = torch.ones(len(got), dtype=torch.bool)
    others[pairs] = False
    assert torch.equal(got[others], want[others])


@pytest.mark.parametrize(("tokens", "tile"), [(4, 2), (50, 8), (7, 1), (0, 2)])
def test_align_on_the_arrays_gives_the_host_plan(tokens: int, tile: int) -> None:
    """align_pairs (array ops only, as CuPy runs them on a GPU) makes plan_pairs' tiles, then
    idle rows."""
    gen = np.random.default_rng(tokens)
    experts, top_k = 8, 3
    topk = np.array([gen.permutation(experts)[:top_k] for _ in range(tokens)],
                    dtype=np.int32).reshape(tokens, top_k)
    slots = gen.integers(-1, 4, tokens).astype(np.int32)
    ranks = np.array([4, 8, 0, 16], dtype=np.int32)
    host = ek.plan_pairs(topk, slots, ranks, 16, tile, num_experts=experts)
    aligned = ek.align_pairs(topk, slots, ranks, experts, tile=tile, t_cols=host.t_cols)
    count = len(host.tiles)
    assert np.array_equal(aligned.tiles[:count], host.tiles)
    assert not aligned.tiles[count:].any()
    assert np.array_equal(aligned.sorted_pairs[:len(host.sorted_pairs)], host.sorted_pairs)
    assert aligned.num_pairs == tokens * top_k


def test_plan_pairs_groups_and_tiles() -> None:
    topk = torch.tensor([[1, 0], [1, 2], [0, 1], [1, 3]], dtype=torch.int32)
    slots = torch.tensor([0, -1, 0, 1], dtype=torch.int32)
    ranks = np.array([4, 8, 0], dtype=np.int32)
    batch = ek.plan_pairs(topk, slots, ranks, 8, tile=2, num_experts=4)
    # Token 1 (slot -1) has no pairs; slot 0: expert 0 pairs 1, 4, expert 1 pairs 0, 5;
    # slot 1: expert 1 pair 6, expert 3 pair 7.
    assert batch.sorted_pairs.tolist() == [1, 4, 0, 5, 6, 7]
    assert batch.tiles.tolist() == [[0, 2, 0, 0], [2, 4, 0, 1], [4, 5, 1, 1], [5, 6, 1, 3]]
    assert batch.t_cols == 8 and batch.groups == 4
    one = ek.plan_pairs(topk, slots, ranks, 8, tile=1, num_experts=4)
    assert one.tiles.shape == (6, 4)
    assert ek.plan_pairs(topk, torch.full((4,), 2, dtype=torch.int32), ranks, 8,
                         num_experts=4).tiles.size == 0


def _identity(tensor: torch.Tensor) -> Any:
    return tensor


def block_with_kernels(block: Any, x: torch.Tensor, slots: torch.Tensor, pool: LoraPool,
                       layer: int, top_k: int,
                       shared: Callable[[torch.Tensor], torch.Tensor] | None,
                       backend: Any = HOST, put: Callable[[torch.Tensor], Any] = _identity,
                       get: Callable[[Any, torch.dtype], torch.Tensor] = lambda a, _: a,
                       align: bool = False) -> torch.Tensor:
    """The MoE block of transformers (Qwen3MoeSparseMoeBlock / Qwen3NextSparseMoeBlock) on
    its base weights, every LoRA delta from the kernels (router, gate_up, down) on `backend`
    (`put` / `get` move tensors to and from its arrays; `align`: the align step on them)."""
    tables = ek.tables_from_pool(pool, layer, backend, like=put(torch.empty(0)))
    gate, experts = block.gate, block.experts
    xb = put(_bf16(x))
    dev_slots = put(slots)
    logits = get(ek.router_lora(xb, put(x @ gate.weight.detach().T), dev_slots, tables,
                                backend=backend), torch.float32)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights, topk = torch.topk(probs, top_k, dim=-1)
    if gate.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    topk = topk.to(torch.int32)
    batch = ek.plan_pairs(topk, slots, pool.to_host(pool.expert_rank_table), tables.max_rank,
                          num_experts=tables.num_experts)
    if align:  # the same tiles from the align step where the arrays live
        batch = ek.align_pairs(put(topk), dev_slots, tables.ranks, tables.num_experts,
                               tile=batch.tile, t_cols=batch.t_cols)
    pair_e = topk.flatten().long()
    w_gu = experts.gate_up_proj.detach()[pair_e]  # [P, 2I, H]
    h = torch.einsum("ph,poh->po", x.repeat_interleave(top_k, 0), w_gu).contiguous()
    h = get(ek.expert_gate_up(xb, put(h), batch, tables, backend=backend), torch.float32)
    g, u = h.chunk(2, dim=-1)
    act = experts.act_fn(g) * u
    y = torch.einsum("pi,phi->ph", act, experts.down_proj.detach()[pair_e]).contiguous()
    y = get(ek.expert_down(put(_bf16(act)), put(y), batch, tables, backend=backend),
            torch.float32)
    out = (y.view(-1, top_k, x.shape[1]) * weights[..., None]).sum(1)
    return out + shared(x) if shared is not None else out


def peft_block_outputs(served: Served, layer: int, x: torch.Tensor, slots: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, Any, Any]:
    """PEFT's block output per row (each adapter's rows through its PEFT model, base rows with
    the adapter disabled), the base block's output, the base block and its shared expert."""
    blocks = [m.base_model.model.model.layers[layer].mlp for m in served.peft_models]
    base_block = served.base_model.model.layers[layer].mlp
    shared = None
    if hasattr(base_block, "shared_expert"):
        def shared(v: torch.Tensor, b: Any = base_block) -> torch.Tensor:
            return torch.sigmoid(b.shared_expert_gate(v)) * b.shared_expert(v)
    want = torch.empty_like(x)
    with torch.no_grad():
        for s, block in enumerate(blocks):
            rows = slots == s
            want[rows] = block(x[rows][None])[0]
        with served.peft_models[0].disable_adapter():
            want[slots < 0] = blocks[0](x[slots < 0][None])[0]
        base = base_block(x[None])[0]
    return want, base, base_block, shared


def mixed_batch(cfg: ModelConfig, num_tokens: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    x = _bf16(torch.randn(num_tokens, cfg.hidden_size, generator=gen)).float()
    slots = torch.tensor([(0, 1, -1)[i % 3] for i in range(num_tokens)], dtype=torch.int32)
    return x, slots


def check_block(got: torch.Tensor, want: torch.Tensor, base: torch.Tensor,
                slots: torch.Tensor) -> None:
    scale = float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=0, atol=2e-2 * scale)
    # The adapters change the adapted rows well beyond the tolerance: the check can fail.
    adapted = slots >= 0
    assert float((want[adapted] - base[adapted]).abs().max()) > 0.2 * scale


@pytest.mark.slow
def test_moe_block_with_the_kernels_equals_peft(served: Served) -> None:
    cfg = served.cfg
    x, slots = mixed_batch(cfg)
    for layer in cfg.moe_layers:
        want, base, base_block, shared = peft_block_outputs(served, layer, x, slots)
        with torch.no_grad():
            got = block_with_kernels(base_block, x, slots, served.pool, layer,
                                     cfg.num_experts_per_tok, shared)
            aligned = block_with_kernels(base_block, x, slots, served.pool, layer,
                                         cfg.num_experts_per_tok, shared, align=True)
        check_block(got, want, base, slots)
        assert torch.equal(aligned, got)


@pytest.mark.slow
def test_overlay_gather_equals_the_reference(peft_zoo: Any) -> None:
    check_overlay_gather(peft_zoo)


def check_overlay_gather(peft_zoo: Any, backend: Any = HOST,
                         put: Callable[[torch.Tensor], Any] = _identity,
                         get: Callable[[Any, torch.dtype], torch.Tensor] = lambda a, _: a) -> None:
    """The gather on `backend` equals the reference, and its rows are PEFT's trainable-token
    rows; the other rows are untouched, bit for bit."""
    truth = peft_zoo.adapter("qwen3_moe", r=4, lora_alpha=8, target_modules=["q_proj"],
                             trainable_token_indices=[3, 17, 40], dtype="bf16")
    cfg = ModelConfig.from_hf(truth.base_dir)
    report = audit(Adapter.load(truth.path), cfg)
    layout = SlotLayout.build(cfg, report.module_set, MAX_RANK)
    pool, _ = LoraPool.load(layout, 2, [report])
    overlays = ek.OverlayTables.from_pool(pool, cfg.hidden_size)
    tokens = torch.tensor([3, 5, 17, 40, 3, 17, 9, 40], dtype=torch.int32)
    slots = torch.tensor([0, 0, 0, -1, 1, 0, 0, 0], dtype=torch.int32)
    emb = _bf16(torch.randn(len(tokens), cfg.hidden_size))
    got = get(ek.overlay_gather(put(tokens), put(slots), overlays, put(emb.clone()),
                                backend=backend), torch.bfloat16)
    raw = pool.overlay_raw[0]
    assert raw is not None
    rows0 = {int(t): torch.from_numpy(r) for t, r in zip(raw.tokens[0], raw.rows[0], strict=True)}
    want = reference.overlay_gather(tokens, slots, [rows0, None], emb)
    assert torch.equal(got, want)
    # PEFT's own embedding: the overlaid rows are the adapter's, as BF16.
    peft_emb = truth._peft_model.get_input_embeddings()
    with torch.no_grad():
        peft_rows = peft_emb(tokens[None].long())[0]
    for b in (0, 2, 5, 7):
        assert torch.equal(got[b], _bf16(peft_rows[b]))
    for b in (1, 3, 4, 6):
        assert torch.equal(got[b], emb[b])


def test_kernels_are_registered_with_their_config() -> None:
    for name in ("router_lora_f32", "expert_shrink_decode", "expert_expand_prefill_bf16",
                 "overlay_gather"):
        assert sources.KERNEL_SOURCES[name] == "expert.cu"
        assert sources.loads_in_flight(name) >= 1 and sources.min_ctas_per_sm(name) >= 1


# --- expert ids outside [0, E) --------------------------------------------------------------------


def test_off_rank_expert_ids_get_no_tile_and_others_are_refused() -> None:
    # (slot 0, expert 3) and (slot 1, expert -1) shared the align key slot * E + expert = 3, so
    # slot 1's pair was computed with slot 0's adapter.
    topk = np.array([[3], [ek.OFF_RANK], [1]], dtype=np.int32)
    slots = np.array([0, 1, 1], dtype=np.int32)
    ranks = np.array([8, 8], dtype=np.int32)
    host = ek.plan_pairs(topk, slots, ranks, 8, tile=2, num_experts=4)
    assert host.tiles.tolist() == [[0, 1, 0, 3], [1, 2, 1, 1]]
    assert host.sorted_pairs.tolist() == [0, 2]
    aligned = ek.align_pairs(topk, slots, ranks, 4, tile=2, t_cols=8)
    assert aligned.tiles[:2].tolist() == host.tiles.tolist()
    assert not aligned.tiles[2:].any()
    for bad in (4, -2):
        with pytest.raises(ValueError, match=f"expert {bad} \\(pair 1\\), outside \\[0, 4\\)"):
            ek.plan_pairs(np.array([[0], [bad]], dtype=np.int32), slots[:2], ranks, 8,
                          num_experts=4)


@pytest.mark.slow
def test_off_rank_experts_leave_their_rows_untouched(served: Served) -> None:
    """Expert parallelism: a pair whose expert is on another rank (-1) is in no tile; its rows
    stay bit for bit, the other pairs get their delta. A tile naming an expert outside [0, E)
    (built by hand, past the planner) reads no entry and leaves y alone too."""
    pool, cfg = served.pool, served.cfg
    layer, top_k, num_tokens = cfg.moe_layers[0], 2, 6
    hidden, inter = cfg.hidden_size, cfg.expert_intermediate_size
    tables = ek.tables_from_pool(pool, layer, HOST, like=torch.empty(0))
    slots, topk = _batch(num_tokens, cfg.num_experts, top_k, seed=4)
    off = torch.zeros_like(topk, dtype=torch.bool)
    off[::2, 0] = True
    topk = torch.where(off, ek.OFF_RANK, topk).to(torch.int32)
    batch = ek.plan_pairs(topk, slots, pool.expert_rank_table, tables.max_rank,
                          num_experts=cfg.num_experts)
    gen = torch.Generator().manual_seed(9)
    act = _bf16(torch.randn(num_tokens * top_k, inter, generator=gen))
    y = torch.randn(num_tokens * top_k, hidden, generator=gen)
    got = ek.expert_down(act, y.clone(), batch, tables, backend=HOST)
    pair_slots = torch.where(off.flatten(), -1, slots.repeat_interleave(top_k))
    want = reference.routed_expert_delta(
        act, 1, y, pair_slots, topk.flatten().clamp(min=0),
        _pool_weights(pool, tables, tables.down.numpy(), [(MAX_RANK, inter)]),
        _b_weights(pool, tables.down.numpy(), [(hidden, MAX_RANK)]),
        torch.from_numpy(pool.scale_table), torch.from_numpy(pool.expert_rank_table), MAX_RANK)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    off_rows = off.flatten().nonzero().flatten()
    assert torch.equal(got[off_rows], y[off_rows])
    assert not torch.equal(got, y)

    for expert in (ek.OFF_RANK, cfg.num_experts):
        tiles = torch.tensor([[0, 1, 0, expert]], dtype=torch.int32)
        pairs = torch.zeros(1, dtype=torch.int32)
        t = torch.ones(1, num_tokens * top_k, batch.t_cols)
        out = y.clone()
        HOST.launch(ek.plan_expert_expand(t, pairs, tiles, tables, tables.down, out, 2))
        assert torch.equal(out, y)
    # Tiles, like every buffer the kernels index as a dense array, must be contiguous.
    strided = torch.zeros(2, 8, dtype=torch.int32)[:, :4]
    with pytest.raises(ValueError, match="tiles must be contiguous"):
        ek.plan_expert_expand(t, pairs, strided, tables, tables.down, out, 2)


# --- the prefill tiles on tensor cores ------------------------------------------------------------

# Slot ranks that reach every shape of the mma prefill kernels in a max-rank-256 pool: the
# shrink's 1, 2 and 4 m16 tiles per 64-row CTA (5, 13, 24; 40 and 100 past 64: 3 tiles, read
# as 4; 72: 4 then 1) and its four 64-row CTAs (256); the expand's narrow tiles at one and two
# vectors a row (5, 13) and 1, 2, 4 and 8 rank chunks of 32 (24; 40; 72 and 100; 256). Slot 6
# is rank 0.
MMA_RANKS = [256, 72, 40, 13, 100, 24, 0, 5]


def _mma_tables(in_dim: int, out_dim: int, slices: int, experts: int,
                absent: dict[tuple[int, int], set[int]], seed: int
                ) -> tuple[ek.ExpertTables, list[list[list[torch.Tensor | None]]],
                           list[list[list[torch.Tensor | None]]], list[Any]]:
    """Hand-made expert tables: one kernel_cases pool per (slice, expert) entry (slot rows at
    the MMA_RANKS, finite junk in B's padding columns), entries row-major; `absent` names the
    slots whose pointer is 0 in an entry."""
    from tests.support.kernel_cases import make_pool

    pools, a_rows, b_rows = [], [], []
    a_weights: list[list[list[torch.Tensor | None]]] = []
    b_weights: list[list[list[torch.Tensor | None]]] = []
    for c in range(slices):
        a_weights.append([])
        b_weights.append([])
        for e in range(experts):
            pool = make_pool(in_dim, out_dim, 256, MMA_RANKS, absent.get((c, e), set()),
                             seed + 10 * c + e)
            a_table, b_table = pool.tables()
            a_rows.append(a_table)
            b_rows.append(b_table)
            a_w, b_w = pool.weights()
            a_weights[c].append(a_w)
            b_weights[c].append(b_w)
            pools.append(pool)
    entries = torch.arange(slices * experts, dtype=torch.int32).reshape(slices, experts)
    ranks = torch.tensor(MMA_RANKS, dtype=torch.int32)
    tables = ek.ExpertTables(
        a_tables=torch.stack(a_rows), b_tables=torch.stack(b_rows),
        gate_up=entries if slices == 2 else torch.zeros(2, experts, dtype=torch.int32) - 1,
        down=entries if slices == 1 else torch.zeros(1, experts, dtype=torch.int32) - 1,
        router=-1, scale_table=torch.linspace(0.5, 2.0, len(MMA_RANKS)), ranks=ranks,
        max_rank=256, num_experts=experts)
    return tables, a_weights, b_weights, pools


@pytest.mark.slow  # every rank shape through the host harness: up to 3 s
@pytest.mark.parametrize("proj", ["gate_up", "down"])
def test_the_prefill_mma_tiles_equal_the_reference_at_every_rank_shape(proj: str) -> None:
    """expert_shrink_prefill and expert_expand_prefill_* (mma.sync through the shim's
    emulation) against the torch reference: ranks reaching each instantiation, K with a
    partial 32-wide chunk (200 = 6 x 32 + 8, 1096 = 34 x 32 + 8), outputs over two CTAs and a
    partial n8 tile (1096), tiles of fewer than 8 pairs, a 0 pointer in one entry (its columns
    untouched, bit for bit) and unadapted pairs (rows untouched). gate_up writes F32 h: the
    expand's t split into BF16 hi + lo keeps it within 1e-4 of the reference."""
    hidden, inter, experts, top_k, tokens = 200, 1096, 3, 2, 35
    slices, in_dim, out_dim = (2, hidden, inter) if proj == "gate_up" else (1, inter, hidden)
    absent = {(0, 1): {2}}
    tables, a_w, b_w, _pools = _mma_tables(in_dim, out_dim, slices, experts, absent, seed=7)
    gen = torch.Generator().manual_seed(3)
    slots = torch.tensor([(0, 1, 2, 3, 4, 5, 6, -1, 7)[i % 9] for i in range(tokens)],
                         dtype=torch.int32)
    topk = torch.stack([torch.randperm(experts, generator=gen)[:top_k]
                        for _ in range(tokens)]).to(torch.int32)
    batch = ek.plan_pairs(topk, slots, tables.ranks.numpy(), 256, ek.PREFILL_TILE,
                          num_experts=experts)
    assert batch.t_cols == 256 and (batch.tiles[:, 1] - batch.tiles[:, 0] < 8).any()
    pair_slots = slots.repeat_interleave(top_k)
    if proj == "gate_up":
        inputs = _bf16(torch.randn(tokens, hidden, generator=gen))
        y = torch.randn(tokens * top_k, 2 * inter, generator=gen)
        got = ek.expert_gate_up(inputs, y.clone(), batch, tables, backend=HOST)
        rtol, atol = 1e-4, 1e-4
    else:
        inputs = _bf16(torch.randn(tokens * top_k, inter, generator=gen))
        y = _bf16(torch.randn(tokens * top_k, hidden, generator=gen))
        got = ek.expert_down(inputs, y.clone(), batch, tables, backend=HOST)
        rtol, atol = reference.TOLERANCES["bgmv", torch.bfloat16]
    want = reference.routed_expert_delta(inputs, top_k if proj == "gate_up" else 1, y,
                                         pair_slots, topk.flatten(), a_w, b_w,
                                         tables.scale_table, tables.ranks, 256)
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)
    skipped = ((pair_slots < 0) | (pair_slots == 6)).nonzero().flatten()
    assert skipped.numel() and torch.equal(got[skipped], y[skipped])
    if proj == "gate_up":  # slot 2's gate entry of expert 1 is 0: its gate columns untouched
        cut = ((pair_slots == 2) & (topk.flatten() == 1)).nonzero().flatten()
        assert cut.numel() and torch.equal(got[cut, :inter], y[cut, :inter])
        assert not torch.equal(got[cut, inter:], y[cut, inter:])
