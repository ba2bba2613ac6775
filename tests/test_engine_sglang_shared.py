"""Shared experts under SGLang 0.5.23's own LoRA code on CPU tensors (tests/support/
sglang_runner.py): qwen2_moe's `mlp.shared_expert` and glm4_moe's `mlp.shared_experts`, a dense
MLP (MergedColumnParallelLinear gate_up_proj, RowParallelLinear down_proj) on each MoE layer,
as SGLang's qwen2_moe.py and glm4_moe.py build it while the shared experts are not fused into
the routed ones. The routed experts are not built (FusedMoE needs a GPU kernel): the pool's
dense buffers are SGLang's, its `_moe` buffers are not there. nemotron_h's shared experts (its
MoE blocks' up_proj and down_proj), whose class does not build here, are held to its source."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import pytest

from metrale_cli.engines.sglang import rules as sglang
from metrale_cli.engines.sglang.model import FAMILIES
from metrale_cli.engines.verdict import Verdict
from tests.conftest import SGLANG_PYTHON
from tests.support.cli_runner import metrale
from tests.support.engine_cases import run_job

RUNNER = Path(__file__).parent / "support" / "sglang_runner.py"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# The tiny models (tests/support/peft_factory.py): hidden 64, layer 0 dense (96 wide), layers
# 1-3 MoE; qwen2_moe's shared expert 24 wide, glm4_moe's one shared expert of
# moe_intermediate_size 40.
SHARED = {"qwen2_moe": ("mlp.shared_expert", 24), "glm4_moe": ("mlp.shared_experts", 40)}
MOE_LAYERS = (1, 2, 3)
SGLANG_SRC = SGLANG_PYTHON.parent.parent / "lib" / "python3.11" / "site-packages" / "sglang" / "srt"


def _runs(test: Any) -> Any:
    for mark in (pytest.mark.sglang, pytest.mark.proc, pytest.mark.slow):
        test = mark(test)
    return test


@pytest.fixture(scope="module")
def shared_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A PEFT adapter on each family's gate/up/down (glm4_moe's made with PEFT's MoE rewrite
    off, as under transformers 4: with it, PEFT adapts no shared expert), through start-up,
    its first batch and one decode step."""
    import peft.utils.transformers_weight_conversion as conversion

    from tests.support.peft_factory import make_adapter

    tmp = tmp_path_factory.mktemp("sglang_shared")
    made = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(conversion, "_convert_peft_config_moe", lambda *args: None)
        for family in SHARED:
            made[family] = make_adapter(family, tmp / family, r=4, lora_alpha=8,
                                        target_modules=TARGETS)
    jobs = [{"model": str(made[f].base_dir), "dtype": "float32", "max_loras_per_batch": 2,
             "shared_experts": {"path": path, "width": width, "layers": list(MOE_LAYERS)},
             "startup": [{"name": f, "path": str(made[f].path)}]}
            for f, (path, width) in SHARED.items()]
    report, _ = run_job(SGLANG_PYTHON, RUNNER, tmp, {"jobs": jobs}, "SGLang runner")
    return {"made": made, "jobs": dict(zip(SHARED, report["jobs"], strict=True))}


@_runs
@pytest.mark.parametrize("family", sorted(SHARED))
def test_sglang_serves_a_shared_expert_as_peft_does(shared_run: dict[str, Any],
                                                    family: str) -> None:
    """SGLang wraps the shared expert's gate_up_proj and down_proj (their leaf names are
    targets: lora_manager.py `init_lora_modules`), stacks the adapter's `<shared>.gate_proj`
    and `.up_proj` into gate_up_proj, starts, copies the adapter into a slot and applies PEFT's
    delta through the shared expert; metrale's verdict is SGLang's."""
    import torch

    truth, report = shared_run["made"][family], shared_run["jobs"][family]
    path, _ = SHARED[family]
    assert report["started"], report.get("start_error")
    [entry] = report["startup"]
    assert entry["accepted"] and entry["batch"]["ok"], entry
    config = json.loads((truth.path / "adapter_config.json").read_text())
    shapes = {n: tuple(s) for n, (_, s) in truth.tensors.items()}
    judged = sglang.judge(family, config, shapes, pool=sglang.startup_pool([config]),
                          path="startup", num_hidden_layers=4)
    assert judged.verdict is Verdict.SERVES, judged
    deltas = entry["batch"]["deltas"]
    for layer in MOE_LAYERS:
        prefix = f"model.layers.{layer}.{path}"
        seen = deltas[f"{prefix}.gate_up_proj"]
        x = torch.tensor([seen["x"]])
        want = torch.cat([truth.forward_delta(f"{prefix}.{leaf}", x)[0]
                          for leaf in ("gate_proj", "up_proj")])
        assert torch.allclose(torch.tensor(seen["delta"]), want, rtol=1e-4, atol=1e-5), prefix
        seen = deltas[f"{prefix}.down_proj"]
        want = truth.forward_delta(f"{prefix}.down_proj", torch.tensor([seen["x"]]))[0]
        assert torch.allclose(torch.tensor(seen["delta"]), want, rtol=1e-4, atol=1e-5), prefix


@_runs
@pytest.mark.parametrize("family", sorted(SHARED))
def test_the_pool_sizes_a_moe_layer_s_mlp_buffers_at_the_shared_width(
        shared_run: dict[str, Any], family: str) -> None:
    """mem_pool.py `_dense_local_dim` reads each layer's own gate_up_proj and down_proj: on
    the MoE layers the shared expert's width S, on the dense layer intermediate_size; by hand,
    gate_up A [L, 2R, H] and B [L, 2S, R], down A [L, R, S] and B [L, H, R]."""
    _, width = SHARED[family]
    L, R, H = 2, 4, 64
    got = {(side, module, layer): tuple(shape) for side, module, layer, shape, _ in
           shared_run["jobs"][family]["pool"]["buffers"] if module in ("gate_up_proj",
                                                                       "down_proj")}
    for layer, S in ((0, 96), *((i, width) for i in MOE_LAYERS)):
        assert got[("A", "gate_up_proj", layer)] == (L, 2 * R, H)
        assert got[("B", "gate_up_proj", layer)] == (L, 2 * S, R)
        assert got[("A", "down_proj", layer)] == (L, R, S)
        assert got[("B", "down_proj", layer)] == (L, H, R)


def _literal(file: str, owner: str | None, name: str) -> Any:
    """The literal SGLang assigns to `name` (a class attribute of `owner`, or at module level),
    `frozenset(...)` and `... | OTHER` unwrapped to the literal they start with."""
    tree = ast.parse((SGLANG_SRC / file).read_text())
    body = tree.body if owner is None else next(
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == owner).body
    node = next(n for n in body if isinstance(n, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == name for t in n.targets)).value
    if isinstance(node, ast.Call):
        node = node.args[0]
    if isinstance(node, ast.BinOp):
        node = node.left
    return ast.literal_eval(node)


@pytest.mark.sglang
def test_nemotron_h_all_targets_are_its_supported_lora_modules() -> None:
    """lora/utils.py auto_detect_lora_target_modules adds the class's `supported_lora_modules`
    that are known targets (`_KNOWN_LORA_TARGET_MODULES`) to the normalised leaves it finds;
    nemotron_h.py's list holds every leaf the class has (in_proj, out_proj, up_proj, down_proj,
    qkv_proj, o_proj) and FusedMoE's gate_up_proj, so `all` is that list."""
    supported = set(_literal("models/nemotron_h.py", "NemotronHForCausalLM",
                             "supported_lora_modules"))
    known = _literal("lora/utils.py", None, "_KNOWN_LORA_TARGET_MODULES")
    assert FAMILIES["nemotron_h"].all_targets == supported & known
    assert "up_proj" in supported and sglang.normalised_targets(["up_proj"]) == {"gate_up_proj"}


@pytest.mark.slow  # builds a PEFT hybrid model in its call
def test_nemotron_h_shared_experts_serve_only_under_all(peft_zoo) -> None:  # type: ignore[no-untyped-def]
    """A PEFT up_proj/down_proj adapter on nemotron_h (its MLP block and its MoE block's shared
    experts): named targets normalise up_proj to gate_up_proj, a buffer neither module takes,
    so the first batch cannot place `mixer.up_proj` (mem_pool.py load_lora_weight_to_buffer);
    under `--lora-target-modules all` the pool has an up_proj buffer (per block kind,
    nemotron_h.py get_hidden_dim) and serves it."""
    truth = peft_zoo.adapter("nemotron_h", r=8, lora_alpha=16)
    assert any(".mixer.shared_experts.up_proj" in m for m in truth.modules)
    base = ["inspect", truth.path, "--engine", "sglang", "--max-rank", 8, "--json"]
    served = metrale(*base, "--modules", "all")
    assert served.code == 0, served.stderr
    assert served.json()["adapters"][0]["engine"]["verdict"] == "serves"
    named = metrale(*base, "--modules", "q_proj,k_proj,v_proj,o_proj,up_proj,down_proj")
    verdict = named.json()["adapters"][0]["engine"]
    assert named.code == 1 and verdict["verdict"] == "crashes", verdict
    assert "Cannot find target module name for" in verdict["reason"]
