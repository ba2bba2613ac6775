"""The one plan pipeline (layout/pipeline.py): the library call every planning command makes,
giving the same answers and the same refusal lines through the CLI as in Python."""

from __future__ import annotations

from pathlib import Path

import pytest

from metrale_cli.adapters.adapter import Adapter
from metrale_cli.errors import NotServable, UsageError
from metrale_cli.layout.pipeline import audit_adapters, plan_pool
from metrale_cli.model.modules import LoraModule
from metrale_cli.model.resolve import resolve_model
from tests.support.cli_runner import metrale
from tests.support.hostile_inputs import copy_adapter

MODEL = "qwen3-8b"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("pipeline")
    for name, modules, rank in (("chat", "q_proj,v_proj", 8), ("code", "q_proj,o_proj", 16)):
        assert metrale("synth", root / name, "--model", MODEL, "--modules", modules,
                       "--rank", rank).code == 0
    return root / "chat", root / "code"


def test_plan_pool_is_what_layout_prints(adapters: tuple[Path, Path]) -> None:
    chat, code = adapters
    planned = plan_pool([str(chat), f"other={code}"])
    assert [r.name for r in planned.reports] == ["chat", "other"]
    assert planned.model.source == resolve_model(MODEL).source
    assert planned.layout.modules == (LoraModule.Q_PROJ, LoraModule.V_PROJ, LoraModule.O_PROJ)
    assert planned.layout.max_rank == 16  # the largest rank, a multiple of 8 already
    plan = planned.sized(budget_bytes=1 << 30)
    shown = metrale("layout", chat, f"other={code}", "--budget", "1GiB", "--json")
    assert shown.code == 0
    assert shown.json() == plan.record()


def test_loaded_adapters_and_a_model_config_go_in_as_they_are(
        adapters: tuple[Path, Path]) -> None:
    chat, code = adapters
    cfg = resolve_model(MODEL)
    audited = audit_adapters([Adapter.load(chat), str(code)], cfg, max_rank=16)
    assert audited.model is cfg
    assert [r.name for r in audited.reports] == ["chat", "code"]
    assert audited.servable
    assert [f.slot_bytes for f in audited.footprints()] == [
        r["own_slot_bytes"] for r in metrale("inspect", chat, code, "--max-rank", 16,
                                         "--json").json()["adapters"]]


def test_refusal_carries_its_findings(adapters: tuple[Path, Path]) -> None:
    chat, code = adapters
    with pytest.raises(NotServable) as refused:
        plan_pool([chat, code], max_rank=8)
    assert str(refused.value) == "1 of 2 adapter(s) not servable: code"
    assert len(refused.value.details) == 1
    assert refused.value.details[0].startswith("code: rank_above_max: ")
    # The CLI prints the same lines, the detail first, and exits 1; so does `pack`.
    for command in (["layout"], ["pack", "--max-loras", 2]):
        shown = metrale(*command, chat, code, "--max-rank", 8)
        assert shown.code == 1
        assert shown.stderr.splitlines() == [*refused.value.details, f"error: {refused.value}"]


def test_no_adapter_and_no_model_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="no base_model_name_or_path"):
        plan_pool([], modules=[LoraModule.Q_PROJ], max_rank=8)
    planned = plan_pool([], MODEL, modules=[LoraModule.Q_PROJ], max_rank=8)
    assert planned.reports == [] and planned.layout.max_rank == 8


# -- hostile input: a refusal under --json ---------------------------------------------------------


@pytest.mark.parametrize("command", ["layout", "pack"])
def test_a_json_refusal_prints_its_record(tiny: Path, tmp_path: Path, command: str) -> None:
    bad = copy_adapter(tiny / "a", tmp_path / "bad", use_dora=True)
    args = ["--max-loras", 2, "--out", tmp_path / "pool.safetensors"] if command == "pack" else []
    result = metrale(command, tiny / "a", bad, "--model", tiny, *args, "--json")
    assert result.code == 1, result.stderr
    adapters = {a["name"]: a for a in result.json()["adapters"]}
    assert adapters["a"]["servable"] and not adapters["bad"]["servable"]
    assert [f["code"] for f in adapters["bad"]["findings"] if f["severity"] == "error"] == ["dora"]
    # stderr: one line per error finding, then the summary.
    lines = result.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith("bad: dora: ")
    assert lines[1] == "error: 1 of 2 adapter(s) not servable: bad"
    assert not (tmp_path / "pool.safetensors").exists()
