"""One (A, B) pair's defects get one code and one wording wherever the pair sits: a pool
module, a per-expert Linear, the router, fused experts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from metrale_cli.adapters.adapter import Adapter
from metrale_cli.adapters.audit import audit
from metrale_cli.adapters.findings import Code, Severity
from metrale_cli.model.config import ModelConfig
from tests.support.header_only import write_header_only

H, I_EXPERT, E, R = 32, 16, 4, 4
MODEL = ModelConfig.from_dict({
    "model_type": "qwen3_moe", "hidden_size": H, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
    "intermediate_size": 48, "moe_intermediate_size": I_EXPERT, "num_experts": E,
    "num_experts_per_tok": 2})
PREFIX = "base_model.model.model.layers.0."
# Each site: the module path, A's and B's shapes for rank r, and how messages name it.
SITES = {
    "pool module": ("self_attn.q_proj", lambda r: [r, H], lambda r: [32, r], "q_proj"),
    "per-expert": ("mlp.experts.1.gate_proj", lambda r: [r, H], lambda r: [I_EXPERT, r],
                   "expert 1 gate_proj"),
    "router": ("mlp.gate", lambda r: [r, H], lambda r: [E, r], "router mlp.gate"),
    "fused": ("mlp.experts", lambda r: [E * r, H], lambda r: [2 * I_EXPERT, E * r],
              "fused experts"),
}
# Each defect: the tensors written (from the site's A and B shapes), the code, the wording.
DEFECTS = {
    "missing B": (lambda a, b: [("lora_A.weight", "F32", a(R))], Code.MISSING_B,
                  "lora_A without lora_B"),
    "missing A": (lambda a, b: [("lora_B.weight", "F32", b(R))], Code.MISSING_A,
                  "lora_B without lora_A"),
    "bad dtype": (lambda a, b: [("lora_A.weight", "F64", a(R)), ("lora_B.weight", "F32", b(R))],
                  Code.BAD_DTYPE, "dtype F64; LoRA tensors must be"),
    "ranks differ": (lambda a, b: [("lora_A.weight", "F32", a(R)),
                                   ("lora_B.weight", "F32", b(R // 2))],
                     Code.RANK_AB_MISMATCH, "disagree on the rank"),
    "not 2-D": (lambda a, b: [("lora_A.weight", "F32", [*a(R), 1]),
                              ("lora_B.weight", "F32", b(R))],
                Code.SHAPE_MISMATCH, "must be two-dimensional"),
    "rank 0": (lambda a, b: [("lora_A.weight", "F32", a(0)), ("lora_B.weight", "F32", b(0))],
               Code.SHAPE_MISMATCH, "rank 0"),
}


@pytest.mark.parametrize("defect", sorted(DEFECTS))
@pytest.mark.parametrize("site", sorted(SITES))
def test_a_pair_defect_reads_the_same_everywhere(tmp_path: Path, site: str,
                                                 defect: str) -> None:
    path, a_shape, b_shape, what = SITES[site]
    tensors, code, wording = DEFECTS[defect]
    (tmp_path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": R, "lora_alpha": 8, "target_modules": ["q_proj"],
        "target_parameters": ["mlp.experts.gate_up_proj"]}))
    write_header_only(tmp_path / "adapter_model.safetensors",
                      [(f"{PREFIX}{path}.{part}", dtype, shape)
                       for part, dtype, shape in tensors(a_shape, b_shape)])
    report = audit(Adapter.load(tmp_path), MODEL, experts_enabled=True)
    hits = [f for f in report.findings if f.code is code]
    assert [f.message.split(": ", 1)[0] for f in hits] == [f"{what} on layer 0"], \
        report.findings
    assert wording in hits[0].message and hits[0].severity is Severity.ERROR
    assert not report.servable
