"""`layout --engine sglang` on the MoE families against SGLang 0.5.23's own `LoRAMemoryPool`
built over SGLang's own model class for each (tests/support/sglang_runner.py `own_class`: its
FusedMoE experts, shared experts and dense layers on CPU tensors): per pool key (a routed
expert's `gate_up_proj_moe` / `down_proj_moe`, a shared expert's or dense layer's 3-D
`gate_up_proj` / `down_proj`, attention) layer 0's A and B shapes and the bytes over every
layer, and the total, at TP 1 and 2; and where SGLang's start raises for a pool, its error in
metrale's refusal.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import SGLANG_PYTHON
from tests.support.cli_runner import metrale
from tests.support.engine_cases import run_job
from tests.support.peft_factory import write_base_config

RUNNER = Path(__file__).parent / "support" / "sglang_runner.py"

pytestmark = [pytest.mark.sglang, pytest.mark.proc, pytest.mark.slow]

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
LINEAR = [*ATTN, "gate_proj", "up_proj", "down_proj"]

MLA = ["q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]

# job: (config, --lora-target-modules, --max-lora-rank, --max-loras-per-batch, TP, dtype)
JOBS: dict[str, tuple[str, list[str], int, int, int, str]] = {
    # No shared expert: routed experts' buffers alone (SGLang makes every layer sparse).
    "qwen3_moe": ("qwen3_moe", LINEAR, 8, 2, 1, "float32"),
    "qwen3_moe_tp2": ("qwen3_moe", LINEAR, 8, 2, 2, "bfloat16"),
    "olmoe": ("olmoe", LINEAR, 4, 3, 1, "float32"),
    "granitemoe": ("granitemoe", LINEAR, 8, 2, 1, "float32"),
    "gpt_oss": ("gpt_oss", LINEAR, 8, 2, 1, "float32"),
    "phimoe": ("phimoe", LINEAR, 8, 2, 1, "float32"),
    # A shared expert beside the routed ones: a 3-D buffer at its width too.
    "qwen2_moe": ("qwen2_moe", LINEAR, 8, 2, 1, "float32"),
    "qwen2_moe_tp2": ("qwen2_moe", LINEAR, 8, 2, 2, "float32"),
    # A dense first layer, shared experts after it: the 3-D buffers' widths differ by layer.
    "glm4_moe": ("glm4_moe", LINEAR, 8, 2, 1, "float32"),
    "glm4_moe_tp2": ("glm4_moe", [*LINEAR, "lm_head"], 4, 2, 2, "float32"),
    # Multi-head latent attention: the fused q_a / kv_a down-projection (replicated), q_b_proj
    # and kv_b_proj (column), o_proj at v_head_dim; a dense first layer, then shared experts.
    # q_proj takes a qkv_proj buffer SGLang's DeepSeek class never reads.
    "deepseek_v3": ("deepseek_v3", [*MLA, *MLP], 8, 2, 1, "float32"),
    "deepseek_v3_tp2": ("deepseek_v3", [*MLA, *MLP], 4, 3, 2, "bfloat16"),
    "deepseek_v2": ("deepseek_v2", ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", *MLP],
                    8, 2, 1, "float32"),
    # Without a head_dim in the config (as V2's checkpoints): the config class's is
    # qk_rope_head_dim, not hidden / heads.
    "deepseek_v2_head_dim": ("deepseek_v2_head_dim", ["q_proj", "kv_b_proj"], 8, 2, 1,
                             "float32"),
    # Mixtral's experts alone (its attention's pool raises: below); Llama 4's attention alone
    # (its MLP targets' pool raises).
    "mixtral_experts": ("mixtral", ["gate_proj", "up_proj", "down_proj"], 8, 2, 1, "float32"),
    "llama4_attention": ("llama4", ATTN, 8, 2, 1, "float32"),
    # SGLang's start raises.
    "mixtral": ("mixtral", LINEAR, 8, 2, 1, "float32"),
    "llama4": ("llama4", LINEAR, 8, 2, 1, "float32"),
    # DeepSeek-V2 without the query's low rank: q_b_proj has no input width.
    "deepseek_v2_q_b": ("deepseek_v2", ["q_b_proj", "kv_b_proj"], 8, 2, 1, "float32"),
}
RAISES = {"mixtral": "TypeError", "llama4": "KeyError", "deepseek_v2_q_b": "TypeError"}
# config: (tiny model, keys as the published checkpoints write them where transformers 5's
# differ). Phi-3.5-MoE's class name (transformers spells it PhimoeForCausalLM, which SGLang
# does not register: its Transformers backend); DeepSeek's MoE keys, which SGLang's class reads
# (transformers 5's config drops them); DeepSeek-V2's config without a head_dim.
_DEEPSEEK = {"moe_layer_freq": 1, "scoring_func": "softmax", "topk_method": "greedy"}
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "phimoe": ("phimoe", {"architectures": ["PhiMoEForCausalLM"]}),
    "deepseek_v2": ("deepseek_v2", _DEEPSEEK),
    "deepseek_v2_head_dim": ("deepseek_v2", {**_DEEPSEEK, "head_dim": None}),
    "deepseek_v3": ("deepseek_v3", {**_DEEPSEEK, "scoring_func": "sigmoid",
                                    "topk_method": "noaux_tc"}),
}


def _flags(name: str) -> list[Any]:
    _, targets, rank, slots, tp, dtype = JOBS[name]
    return ["--max-rank", rank, "--modules", ",".join(targets), "--max-loras", slots, "--tp",
            tp, "--dtype", dtype]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Every job's pool from SGLang's code in one runner process (no start-up adapters: the
    flags give the pool), and the config each ran on."""
    tmp = tmp_path_factory.mktemp("sglang_moe")
    configs = {}
    for model, *_ in JOBS.values():
        tiny, keys = CONFIGS.get(model, (model, {}))
        configs[model] = write_base_config(tiny, tmp / model)
        path = configs[model] / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **keys}))
    jobs = [{"model": str(configs[model]), "own_class": True, "lora_target_modules": targets,
             "max_lora_rank": rank, "max_loras_per_batch": slots, "tp_size": tp, "dtype": dtype}
            for model, targets, rank, slots, tp, dtype in JOBS.values()]
    report, _ = run_job(SGLANG_PYTHON, RUNNER, tmp, {"jobs": jobs}, "SGLang runner")
    return {name: {**out, "config": configs[JOBS[name][0]] / "config.json"}
            for name, out in zip(JOBS, report["jobs"], strict=True)}


@pytest.mark.parametrize("name", [n for n in JOBS if n not in RAISES])
def test_moe_pool_buffers_are_the_ones_sglang_allocates(runs: dict[str, dict], name: str) -> None:
    """Per pool key, layer 0's A and B shapes and the bytes over every layer, and the total,
    equal the buffers of SGLang's own LoRAMemoryPool over its own model class."""
    run = runs[name]
    assert run["started"], run.get("start_error")
    done = metrale("layout", "--model", run["config"], "--engine", "sglang", *_flags(name),
                   "--json")
    assert done.code == 0, done.stderr
    engine = done.json()["engine"]
    shapes: dict[str, dict[str, list[int]]] = {}
    allocated: dict[str, int] = {}
    for kind, module, layer, shape, size in run["pool"]["buffers"]:
        allocated[module] = allocated.get(module, 0) + size
        if layer in (0, None):
            shapes.setdefault(module, {})[kind.rsplit("_", 1)[-1]] = shape
    predicted = {m["module"]: m for m in engine["modules"]}
    assert set(predicted) == set(shapes)
    for module, m in predicted.items():
        assert dict(m["buffers"]) == shapes[module], module
        assert m["bytes"] == allocated[module], module
    assert engine["lora_bytes"] == run["pool"]["bytes"]
    assert engine["pool"] == {"max_lora_rank": run["max_lora_rank"],
                              "target_modules": run["target_modules"]}


@pytest.mark.parametrize("name", list(RAISES))
def test_a_pool_sglang_cannot_start_is_refused_in_its_words(runs: dict[str, dict],
                                                            name: str) -> None:
    """Mixtral's qkv_proj / o_proj (the config's head_dim None under SGLang's
    transformers), DeepSeek-V2's q_b_proj (no q_lora_rank) and Llama 4's gate_up_proj /
    down_proj (dense and shared-expert linears with no buffer): SGLang's start raises, and
    `layout` refuses the pool with that error, one line, exit 2."""
    run = runs[name]
    assert not run["started"]
    error = run["start_error"]
    assert error["type"] == RAISES[name]
    done = metrale("layout", "--model", run["config"], "--engine", "sglang", *_flags(name))
    assert done.code == 2
    said = f"{error['type']}: {error['text']}".replace("'", "")
    assert said in done.stderr.replace("'", ""), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
