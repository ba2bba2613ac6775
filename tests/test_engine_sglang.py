"""metrale's SGLang 0.5.23 rules (metrale_cli/engines/sglang.py) against SGLang's own LoRA code
running on CPU tensors (tests/support/sglang_runner.py under .venv-sglang) on PEFT-made
adapters: acceptance and SGLang's error class and text per path, the scaling its adapter object
holds, its normalised targets, and the bytes of the pool it allocates."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from safetensors import safe_open

from metrale_cli.engines import sglang
from tests.conftest import SGLANG_PYTHON
from tests.support.peft_factory import make_adapter

RUNNER = Path(__file__).parent / "support" / "sglang_runner.py"

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

# name: (model, make_adapter kwargs, path). One start-up set per model, the rest at runtime.
CASES = {
    "plain": ("llama", {"r": 4, "lora_alpha": 8}, "startup"),
    "rslora": ("llama", {"r": 4, "lora_alpha": 8, "use_rslora": True}, "startup"),
    "dora": ("llama", {"r": 4, "lora_alpha": 8, "use_dora": True}, "runtime"),
    "q_no_v": ("llama", {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}, "runtime"),
    "rank_above": ("llama", {"r": 8, "lora_alpha": 8}, "runtime"),
    "outside_targets": ("llama", {"r": 4, "lora_alpha": 8,
                                  "target_modules": ["q_proj", "v_proj", "lm_head"]}, "runtime"),
    "attn_only": ("llama", {"r": 2, "lora_alpha": 4,
                            "target_modules": ["q_proj", "k_proj", "v_proj"]}, "runtime"),
    "q3_plain": ("qwen3", {"r": 4, "lora_alpha": 16}, "startup"),
    "q3_alpha": ("qwen3", {"r": 2, "lora_alpha": 3}, "runtime"),
}


def _run(tmp: Path, model: str, max_loras: int) -> dict:
    adapters = {n: tmp / n for n, (m, _, _) in CASES.items() if m == model}
    for name, path in adapters.items():
        make_adapter(model, path, seed=len(name), **CASES[name][1])
    job = {"model": str(adapters[next(iter(adapters))] / "base"), "dtype": "float32",
           "max_loras_per_batch": max_loras,
           "startup": [{"name": n, "path": str(p)} for n, p in adapters.items()
                       if CASES[n][2] == "startup"],
           "runtime": [{"name": n, "path": str(p)} for n, p in adapters.items()
                       if CASES[n][2] == "runtime"]}
    (tmp / "job.json").write_text(json.dumps(job))
    subprocess.run([str(SGLANG_PYTHON), str(RUNNER), str(tmp / "job.json"),
                    str(tmp / "out.json")], check=True, timeout=600, capture_output=True)
    out = json.loads((tmp / "out.json").read_text())
    out["dirs"] = {n: str(p) for n, p in adapters.items()}
    out["max_loras"] = max_loras
    return out


@pytest.fixture(scope="module", params=[("llama", 3), ("qwen3", 2)], ids=["llama", "qwen3"])
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    model, max_loras = request.param
    return _run(tmp_path_factory.mktemp(model), model, max_loras)


def _config(path: str) -> dict:
    return json.loads((Path(path) / "adapter_config.json").read_text())


def _weights(path: str) -> list[str]:
    with safe_open(str(Path(path) / "adapter_model.safetensors"), "pt") as f:
        return list(f.keys())


def test_every_adapter_judged_as_sglang_judges_it(engine: dict) -> None:
    assert engine["started"], engine.get("start_error")
    pool = (engine["max_lora_rank"], set(engine["target_modules"]))
    for path_name in ("startup", "runtime"):
        for entry in engine[path_name]:
            d = engine["dirs"][entry["name"]]
            got = sglang.judge(entry["name"], _config(d), _weights(d),
                               pool=pool if path_name == "runtime" else None)
            assert got.accepted == entry["accepted"], entry
            if not entry["accepted"]:
                assert (got.error_type, got.error) == (entry["error"]["type"],
                                                       entry["error"]["text"])


def test_scaling_and_targets_are_sglangs(engine: dict) -> None:
    for entry in engine["startup"] + engine["runtime"]:
        if not entry["accepted"]:
            continue
        config = _config(engine["dirs"][entry["name"]])
        assert sglang.scaling(config) == entry["scaling"]
        assert sorted(sglang.normalised_targets(config["target_modules"])) == \
            entry["target_modules"]
    rs = [e for e in engine["startup"] if e["name"] == "rslora"]
    for entry in rs:  # rsLoRA: SGLang holds alpha / r where PEFT applies alpha / sqrt(r)
        config = _config(engine["dirs"]["rslora"])
        assert entry["scaling"] != sglang.peft_scaling(config)
        assert sglang.judge("rslora", config, []).differs


def test_pool_bytes_are_the_buffers_sglang_allocates(engine: dict) -> None:
    model = json.loads((Path(next(iter(engine["dirs"].values()))) / "base" /
                        "config.json").read_text())
    predicted = sglang.pool_bytes(model, engine["target_modules"], engine["max_lora_rank"],
                                  engine["max_loras"], 4)
    assert predicted == engine["pool"]["bytes"]
    assert engine["pool"]["bytes"] == sum(b[-1] for b in engine["pool"]["buffers"])
