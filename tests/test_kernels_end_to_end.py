"""The pool-to-kernel seam, end to end, against PEFT's own models.

Adapters made by the real peft library on a tiny transformers model (different ranks, rsLoRA,
rank and alpha patterns, F32/BF16/F16 files, one adapting only a few modules) are audited and
packed into one pool as `metrale pack` packs them. A mixed batch (sequences of each adapter, a
base-model sequence with slot -1 and one routed to a slot that holds no adapter) then runs
through the plain base model with a forward hook on every Linear of the pool's layout that adds
the delta the kernels compute from the pool's own tables (`a_tables`, `b_tables`,
`scale_table`, `rank_table`): SGMV over the prefill (one segment per run of sequences sharing a
slot), then BGMV over one decode step (one token per sequence) on the prefill's cache. The logits
must equal PEFT's model run per adapter (and the base model for the sequences no adapter serves)
within BF16 tolerance, and visibly fail to when the scale is dropped or a slot index is shifted.

The kernels run on the CPU through the host-execution harness; the same test runs them on a GPU
through CuPy (marked `gpu`), the pool then packed into device memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from metrale_cli.adapters.adapter import Adapter
from metrale_cli.adapters.audit import audit
from metrale_cli.layout.plan import plan_layouts
from metrale_cli.model.resolve import resolve_model
from metrale_cli.ops import host_harness, kernels, reference
from metrale_cli.pool.pool import LoraPool
from tests.support.peft_factory import TINY_MODELS, AdapterTruth

pytestmark = pytest.mark.slow

BASE_SEED = 0  # every PEFT model and the hooked model share this base model's weights
MAX_LORAS = 4  # slots 0..2 hold the adapters, slot 3 is an empty cache slot
PREFILL_TOKENS = 5
# One slot per sequence: adapter slots 0..2, -1 (the base model), and 3 (a slot holding no
# adapter). The two adjacent slot-0 sequences make one SGMV segment of 2 * PREFILL_TOKENS.
SEQUENCE_SLOTS = (1, 0, 0, -1, 2, 3)
# The token ids. Qwen3-Next routes each token to 2 of 4 experts: a router decision within a
# BF16 rounding of a tie would flip under any correct pool and make no test of the seam. These
# ids have none (the F32 reference on the pool's bytes, whose rounding differs from the kernels',
# agrees with PEFT as closely as the kernels do); ids seeds 0 to 3 all behave alike.
IDS_SEED = 0

# Logit error allowed, relative to how far the adapter moves the logits from the base model's
# (the largest |PEFT - base| of the sequence, 0.2 to 0.8 here). The pool holds A and B in BF16
# (the F32 and F16 files are rounded at pack time, B also where a module's scaling ratio is
# folded into it) and the kernels read x in BF16 (SGMV also rounds t for the tensor cores): each
# rounding is at most 2^-9 relative. Measured on both models, ids seeds 0 to 3: the kernels off
# by at most 0.64% of the effect, reference.py's F32 arithmetic on the same BF16 bytes by 0.60%,
# so the error is the pool's BF16 format, not the kernels. A dropped scale, a shifted slot or a
# per-module scaling ratio left out of B is off by 39% or more (tests below, and tried).
ADAPTED_RTOL = 2e-2
# A sequence no adapter serves must not be touched at all: its logits differ from the plain base
# model's only where the batch changes float32 summation order (measured: 0 to 9e-8).
BASE_ATOL = 1e-5


@dataclass(frozen=True)
class SeamAdapter:
    """One adapter of a seam pool: its name and the `make_adapter` arguments."""

    name: str
    seed: int
    dtype: str
    lora: dict[str, Any]


ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
# Per model, the pool's adapters in slot order. Ranks 8, 16 and 4: max rank 16 (what the
# kernels serve), with per-module ranks below it (4, 12) from rank patterns. Scalings of 0.06
# to 0.4 keep each delta about the size of the base projection's output, where the logits
# respond to it about linearly (with scalings of 2 the deltas swamp the base model and, through
# the RMSNorms, a dropped scale moved the logits by only 10% of the effect).
SEAM_ADAPTERS: dict[str, list[SeamAdapter]] = {
    # Dense: Qwen3 with head_dim 24, so q_proj (96 x 64) and o_proj (64 x 96) are not square.
    "qwen3": [
        SeamAdapter("plain", 11, "f32", {"r": 8, "lora_alpha": 1, "target_modules": ATTN + MLP}),
        SeamAdapter("rs", 12, "bf16", {
            "r": 16, "lora_alpha": 0.5, "use_rslora": True,
            "target_modules": ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
            "rank_pattern": {"v_proj": 4, "layers.1.mlp.down_proj": 12},
            "alpha_pattern": {"q_proj": 1.5, "up_proj": 0.25}}),
        SeamAdapter("narrow", 13, "f16", {"r": 4, "lora_alpha": 0.75,
                                          "target_modules": ["k_proj", "o_proj", "gate_proj"]}),
    ],
    # Hybrid: gated q_proj (128 x 64) on the full-attention layers 1 and 3, linear_attn.out_proj
    # (64 x 48) on the Gated DeltaNet layers 0 and 2, MoE feed-forward outside the pool.
    "qwen3_next": [
        SeamAdapter("plain", 11, "f32",
                    {"r": 8, "lora_alpha": 1, "target_modules": ATTN + ["out_proj"]}),
        SeamAdapter("rs", 12, "bf16", {
            "r": 16, "lora_alpha": 0.5, "use_rslora": True,
            "target_modules": ["q_proj", "v_proj", "out_proj"],
            "rank_pattern": {"v_proj": 4, "layers.2.linear_attn.out_proj": 12},
            "alpha_pattern": {"q_proj": 1.5}}),
        SeamAdapter("narrow", 13, "f16",
                    {"r": 4, "lora_alpha": 0.75, "target_modules": ["k_proj", "out_proj"]}),
    ],
}  # fmt: skip


# --- where the deltas are computed ------------------------------------------------------------


@dataclass(frozen=True)
class Backend:
    """Where a pool's deltas are computed: how a torch CPU tensor gets there and back, and the
    whole-delta launchers with `kernels.bgmv` / `kernels.sgmv`'s signatures."""

    to_device: Callable[[torch.Tensor], Any]
    to_host: Callable[[Any], torch.Tensor]
    bgmv: Callable[..., Any]
    sgmv: Callable[..., Any]


def _same(tensor: Any) -> Any:
    return tensor


def host_backend(_pool: LoraPool) -> Backend:
    """The kernels, unchanged, on the CPU through the host-execution harness."""

    def bgmv(x: Any, y: Any, slots: Any, a_table: Any, b_table: Any, scale_table: Any,
             ranks: Any, max_rank: int) -> None:
        t = host_harness.bgmv_shrink(x, slots, a_table, ranks, max_rank)
        host_harness.bgmv_expand(t, slots, b_table, scale_table, ranks, y, max_rank)

    def sgmv(x: Any, y: Any, seg_starts: Any, seg_slots: Any, a_table: Any, b_table: Any,
             scale_table: Any, ranks: Any, max_rank: int) -> None:
        t = host_harness.sgmv_shrink(x, seg_starts, seg_slots, a_table, ranks, max_rank)
        host_harness.sgmv_expand(t, seg_starts, seg_slots, b_table, scale_table, ranks, y, max_rank)

    return Backend(_same, _same, bgmv, sgmv)


def reference_backend(pool: LoraPool) -> Backend:
    """reference.py on the same tables: F32 arithmetic on the pool's BF16 bytes and BF16 x. Where
    the kernels disagree with PEFT and this agrees, the kernels are wrong; where both disagree,
    the pool or the seam is."""
    pool_bf16 = torch.from_numpy(pool.pool).view(torch.bfloat16)

    def bgmv(x: Any, y: Any, slots: Any, a_table: Any, b_table: Any, scale_table: Any,
             ranks: Any, max_rank: int) -> None:
        a = reference.weights_from_table(pool_bf16, a_table.tolist(), (max_rank, x.shape[1]))
        b = reference.weights_from_table(pool_bf16, b_table.tolist(), (y.shape[1], max_rank))
        y.copy_(reference.lora_delta(x, y, slots, a, b, torch.from_numpy(scale_table),
                                     torch.from_numpy(ranks), max_rank))

    def sgmv(x: Any, y: Any, seg_starts: Any, seg_slots: Any, *tables: Any) -> None:
        bgmv(x, y, reference.segments_to_slots(seg_starts, seg_slots, x.shape[0]), *tables)

    return Backend(_same, _same, bgmv, sgmv)


def cupy_backend(_pool: LoraPool) -> Backend:
    """The kernels on a GPU through CuPy, on a pool packed into device memory."""
    from metrale_cli import compat

    cupy = compat.cupy_module()

    def to_device(tensor: torch.Tensor) -> Any:
        if tensor.dtype == torch.bfloat16:  # CuPy has no bfloat16: the raw bits as uint16
            return cupy.asarray(tensor.view(torch.int16).numpy().view(np.uint16))
        return cupy.asarray(tensor.numpy())

    def to_host(array: Any) -> torch.Tensor:
        return torch.from_numpy(cupy.asnumpy(array))

    return Backend(to_device, to_host, kernels.bgmv, kernels.sgmv)


# name -> (the pool's device, the backend for a pool packed there)
BACKENDS: dict[str, tuple[str, Callable[[LoraPool], Backend]]] = {
    "reference": ("cpu", reference_backend),
    "host": ("cpu", host_backend),
    "cupy": ("cuda", cupy_backend),
}


# --- packing, as `metrale pack` does -----------------------------------------------------------


def pack_adapters(truths: list[tuple[str, AdapterTruth]], device: str) -> LoraPool:
    """Audit the adapters against their base config and pack them into slots 0.. of one pool."""
    config = resolve_model(str(truths[0][1].base_dir))
    reports = [audit(Adapter.load(t.path, name), config, experts_enabled=False)
               for name, t in truths]
    assert [r.name for r in reports if not r.servable] == []
    layout, _ = plan_layouts(config, reports)
    return LoraPool.load(layout, MAX_LORAS, reports, device)[0]


# --- the base model with the kernels' deltas hooked in -----------------------------------------


def segments(token_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SGMV segments (seg_starts i32 [S+1], seg_slots i32 [S]): one per run of equal slots."""
    change = (token_slots[1:] != token_slots[:-1]).nonzero().flatten() + 1
    starts = torch.cat([torch.tensor([0]), change, torch.tensor([len(token_slots)])])
    return starts.to(torch.int32), token_slots[starts[:-1]].to(torch.int32)


@contextmanager
def kernel_deltas(model: torch.nn.Module, pool: LoraPool, backend: Backend, kind: str,
                  token_slots: torch.Tensor) -> Iterator[None]:
    """Hook every Linear of the pool's layout: its output (F32) plus the delta the `kind`
    ("bgmv" or "sgmv") kernels compute from the pool for tokens routed by `token_slots`
    (i32 [T], one slot per token of the flattened batch, -1 = the base model)."""
    max_rank = pool.layout.max_rank
    if kind == "bgmv":
        routing = (backend.to_device(token_slots.to(torch.int32)),)
    else:
        routing = tuple(backend.to_device(s) for s in segments(token_slots))

    def hook_for(entry: int) -> Callable[..., torch.Tensor]:
        def hook(_module: torch.nn.Module, args: tuple[torch.Tensor, ...],
                 output: torch.Tensor) -> torch.Tensor:
            x = args[0].reshape(-1, args[0].shape[-1]).to(torch.bfloat16).contiguous()
            y = backend.to_device(output.reshape(-1, output.shape[-1]).contiguous())
            launcher = backend.bgmv if kind == "bgmv" else backend.sgmv
            launcher(backend.to_device(x), y, *routing, pool.a_tables[entry],
                     pool.b_tables[entry], pool.scale_table, pool.rank_table, max_rank)
            return backend.to_host(y).reshape(output.shape)

        return hook

    handles = [
        model.get_submodule(f"model.layers.{e.layer}.{e.module.peft_path}")
        .register_forward_hook(hook_for(i))
        for i, e in enumerate(pool.layout.entries)
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def run_kernels(model: torch.nn.Module, pool: LoraPool, backend: Backend, ids: torch.Tensor,
                sequence_slots: tuple[int, ...]) -> torch.Tensor:
    """Logits [B, L, V] of `ids` [B, L]: an SGMV prefill of ids[:, :-1], then one BGMV decode
    step of ids[:, -1] on its cache, sequence b served by slot sequence_slots[b]."""
    slots = torch.tensor(sequence_slots, dtype=torch.int32)
    prompt = ids[:, :-1]
    with torch.no_grad():
        with kernel_deltas(model, pool, backend, "sgmv",
                           slots.repeat_interleave(prompt.shape[1])):
            prefill = model(prompt, use_cache=True)
        with kernel_deltas(model, pool, backend, "bgmv", slots):
            decode = model(ids[:, -1:], cache=prefill.cache, use_cache=True)
    return torch.cat([prefill.logits, decode.logits], dim=1)


# --- PEFT's own models ---------------------------------------------------------------------------


@dataclass
class Seam:
    """One model's pool inputs and PEFT's answers, built once per model."""

    model_name: str
    truths: list[tuple[str, AdapterTruth]]
    ids: torch.Tensor  # [B, PREFILL_TOKENS + 1] token ids
    expected: torch.Tensor  # [B, L, V] PEFT's logits per sequence (the base model's for -1)
    base: torch.Tensor  # [B, L, V] the base model's logits

    def base_model(self) -> torch.nn.Module:
        return TINY_MODELS[self.model_name].build_model(BASE_SEED)


def peft_logits(model_name: str, truth: AdapterTruth, ids: torch.Tensor) -> torch.Tensor:
    """PEFT's model for the adapter as saved (PeftModel.from_pretrained on the shared base)."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(TINY_MODELS[model_name].build_model(BASE_SEED),
                                      str(truth.path))
    with torch.no_grad():
        return model(ids).logits


def build_seam(peft_zoo: Any, model_name: str, ids_seed: int = IDS_SEED) -> Seam:
    truths = [(a.name, peft_zoo.adapter(model_name, dtype=a.dtype, seed=a.seed, **a.lora))
              for a in SEAM_ADAPTERS[model_name]]
    generator = torch.Generator().manual_seed(ids_seed)
    vocab = TINY_MODELS[model_name].config_kwargs["vocab_size"]
    ids = torch.randint(vocab, (len(SEQUENCE_SLOTS), PREFILL_TOKENS + 1), generator=generator)
    with torch.no_grad():
        base = TINY_MODELS[model_name].build_model(BASE_SEED)(ids).logits
    expected = base.clone()
    for slot, (_, truth) in enumerate(truths):
        rows = [b for b, s in enumerate(SEQUENCE_SLOTS) if s == slot]
        expected[rows] = peft_logits(model_name, truth, ids[rows])
    return Seam(model_name, truths, ids, expected, base)


@pytest.fixture(scope="module", params=sorted(SEAM_ADAPTERS))
def seam(request: pytest.FixtureRequest, peft_zoo: Any) -> Seam:
    return build_seam(peft_zoo, request.param)


# --- the comparison ------------------------------------------------------------------------------


def check_logits(got: torch.Tensor, seam: Seam) -> None:
    """Every sequence's logits (prefill and decode positions) against PEFT's, one line each."""
    failures = []
    for b, slot in enumerate(SEQUENCE_SLOTS):
        error = float((got[b] - seam.expected[b]).abs().max())
        if 0 <= slot < len(seam.truths):
            effect = float((seam.expected[b] - seam.base[b]).abs().max())
            allowed = ADAPTED_RTOL * effect
        else:
            effect, allowed = 0.0, BASE_ATOL
        if not error <= allowed:
            failures.append(f"sequence {b} (slot {slot}): max |logit error| {error:.3g} > "
                            f"{allowed:.3g} (the adapter moves the logits by {effect:.3g})")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize(
    "backend_name", ["reference", "host", pytest.param("cupy", marks=pytest.mark.gpu)])
def test_deltas_from_a_packed_pool_match_peft(seam: Seam, backend_name: str) -> None:
    device, backend_for = BACKENDS[backend_name]
    pool = pack_adapters(seam.truths, device)
    assert pool.layout.max_rank == 16
    assert pool.rank_table.tolist() == [8, 16, 4, 0]
    got = run_kernels(seam.base_model(), pool, backend_for(pool), seam.ids, SEQUENCE_SLOTS)
    check_logits(got, seam)


@pytest.mark.parametrize("seam", ["qwen3"], indirect=True)
def test_a_dropped_scale_or_a_shifted_slot_fails_the_comparison(seam: Seam) -> None:
    """The comparison has the power to see the seam's likely mistakes, in every adapter's
    sequences (measured: off by 100% to 174% of the adapter's effect, against at most 0.64%
    for the kernels)."""
    pool = pack_adapters(seam.truths, "cpu")
    model, backend = seam.base_model(), host_backend(pool)
    adapted = [b for b, slot in enumerate(SEQUENCE_SLOTS) if 0 <= slot < len(seam.truths)]
    shifted = tuple(s + 1 if s >= 0 else s for s in SEQUENCE_SLOTS)
    with pytest.raises(AssertionError) as shift:
        check_logits(run_kernels(model, pool, backend, seam.ids, shifted), seam)
    pool.scale_table[:] = 1.0
    with pytest.raises(AssertionError) as unscaled:
        check_logits(run_kernels(model, pool, backend, seam.ids, SEQUENCE_SLOTS), seam)
    for error in (shift, unscaled):
        assert [b for b in adapted if f"sequence {b} (" not in str(error.value)] == []
