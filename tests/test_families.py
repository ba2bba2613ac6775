"""model/families.py is the one place a model family's facts live: a new family that fits the
pool's module set is a row there, and the parser, the layouts and the audit follow."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from metrale_cli.adapters.adapter import AdapterConfig
from metrale_cli.errors import UnsupportedModel
from metrale_cli.layout.pipeline import plan_pool
from metrale_cli.model.config import PRESETS, LayerType, ModelConfig
from metrale_cli.model.families import FAMILIES, Family
from tests.support.cli_runner import metrale

QWEN3 = Path(__file__).parent / "data" / "model_configs" / "qwen3-8b.config.json"


def test_every_preset_is_of_a_known_family() -> None:
    assert {ModelConfig.from_dict(p.config).model_type for p in PRESETS} <= set(FAMILIES)


def test_a_new_family_is_one_row(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    raw = {**json.loads(QWEN3.read_text()), "model_type": "qwen9"}
    with pytest.raises(UnsupportedModel, match="'qwen9' is not supported"):
        ModelConfig.from_dict(raw)
    monkeypatch.setitem(FAMILIES, "qwen9", Family("qwen9", hybrid=True,
                                                  peft_default_targets=("o_proj",)))
    model = ModelConfig.from_dict(raw)
    # The row's facts reach the config (a hybrid's default layer stack and gated q_proj) ...
    assert model.attn_gated and model.layer_type(3) is LayerType.FULL_ATTENTION
    assert model.layer_type(0) is LayerType.LINEAR_ATTENTION
    # ... and the audit: an adapter without target_modules gets the family's PEFT default.
    config = AdapterConfig.from_dict({"peft_type": "LORA", "r": 8, "lora_alpha": 16,
                                      "target_modules": None})
    assert config.with_default_targets(model.family).target_modules == ["o_proj"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert metrale("synth", tmp_path / "a", "--model", tmp_path, "--modules", "q_proj,o_proj",
                   "--rank", 8).code == 0
    planned = plan_pool([tmp_path / "a"])
    assert planned.model.model_type == "qwen9"
    # q_proj on the full-attention layers only, twice as wide (its gate), o_proj likewise.
    assert {e.layer for e in planned.layout.entries} == {3, 7, 11, 15, 19, 23, 27, 31, 35}
    q = next(e for e in planned.layout.entries if e.module.peft_name == "q_proj")
    assert q.out_dim == 2 * model.num_attention_heads * model.head_dim
