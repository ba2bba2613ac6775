"""kernels/expert.cu on a real device (CuPy): the benchmark's validation on real MoE shapes, and
the whole MoE block against PEFT with the pool on the device. Skipped without a GPU; run with
--require-gpu on a GPU machine."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from metrale_cli import compat
from metrale_cli.bench import experts as be
from metrale_cli.ops import expert_kernels, kernels
from metrale_cli.pool.pool import LoraPool
from tests.test_expert_kernels import (
    Served,
    _served,
    block_with_kernels,
    check_block,
    check_overlay_gather,
    mixed_batch,
    peft_block_outputs,
)

pytestmark = pytest.mark.gpu

SHAPES = [
    be.ExpertShape("tiny", hidden=64, inter=32, experts=8, top_k=2, rank=8, tokens=5, adapters=2),
    *be.expert_shapes(("qwen3-30b-a3b",), (16,), (8,), (8,)),
    *be.expert_shapes(("qwen3-next-80b-a3b",), (64,), (256,), (1,)),
    *be.expert_shapes(("qwen3-30b-a3b",), (8,), (4096,), (1,)),
    # The prefill tiles' 4-tile shrink and 2-chunk expand (mma) on the device.
    *be.expert_shapes(("qwen3-30b-a3b",), (64,), (4096,), (8,)),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s.model}-r{s.rank}-T{s.tokens}")
def test_expert_kernels_validate_on_device(shape: be.ExpertShape) -> None:
    cupy = compat.cupy_module()
    topk, slots = be.routing(shape)
    batch = expert_kernels.plan_pairs(topk, slots, np.full(shape.adapters, shape.rank,
                                                           np.int32), shape.rank,
                                      num_experts=shape.experts)
    group = be.ExpertGroup(cupy, cupy.random.default_rng(0), shape, batch, topk, slots,
                           kernels.CUPY)
    for proj in be.PROJECTIONS:
        group.validate(proj)


def _put(tensor: torch.Tensor) -> Any:
    cupy = compat.cupy_module()
    if tensor.dtype == torch.bfloat16:
        return cupy.asarray(tensor.view(torch.int16).numpy().view(np.uint16))
    return cupy.asarray(tensor.numpy())


def _get(array: Any, dtype: torch.dtype) -> torch.Tensor:
    host = compat.cupy_module().asnumpy(array)
    if dtype == torch.bfloat16:  # uint16 bits
        return torch.from_numpy(host.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(host)


@pytest.mark.slow
@pytest.mark.parametrize("model_name", ["qwen3_moe", "qwen3_next"])
def test_moe_block_on_device_equals_peft(peft_zoo: Any, model_name: str) -> None:
    served: Served = _served(peft_zoo, model_name)
    host = served.pool
    device_pool = LoraPool(host.layout, host.max_loras, "cuda", host.expert_layout)
    for slot in (0, 1):  # slot 2 stays empty
        device_pool.land_slot(slot, host, slot)
    x, slots = mixed_batch(served.cfg)
    for layer in served.cfg.moe_layers:
        want, base, base_block, shared = peft_block_outputs(served, layer, x, slots)
        with torch.no_grad():
            got = block_with_kernels(base_block, x, slots, device_pool, layer,
                                     served.cfg.num_experts_per_tok, shared,
                                     backend=kernels.CUPY, put=_put, get=_get, align=True)
        check_block(got, want, base, slots)


@pytest.mark.slow
def test_overlay_gather_on_device(peft_zoo: Any) -> None:
    check_overlay_gather(peft_zoo, kernels.CUPY, _put, _get)
