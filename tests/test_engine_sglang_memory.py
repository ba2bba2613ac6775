"""`layout --engine sglang` and `inspect --engine sglang` against SGLang 0.5.23's own LoRA code
running on CPU tensors (tests/support/sglang_runner.py under .venv-sglang): the pool's A and B
buffers, per module and in all, from a real `LoRAMemoryPool` at TP 1, 2 and 4, embedding and
output-head pairs included, for dense Llama, Qwen3, Qwen2 and Mistral; the pool a start-up
infers from its adapters; the runtime path's verdict and text against that pool; and the GPU
slots `simulate --engine sglang` replays against the pool's own `prepare_lora_batch`, request by
request, under LRU and FIFO.

Under TP the runner's process is TP rank 0 and the pool is shaped by SGLang's own shape
functions with its TP size; the stand-in base carries a real `ParallelLMHead` built at that TP
size, which the pool reads its vocabulary shard from as a server's does.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from metrale_cli.engines import get_engine
from metrale_cli.model.config import ModelConfig
from metrale_cli.sim.costs import Link, SwapCost
from metrale_cli.sim.replay import Replay
from metrale_cli.sim.results import CacheState
from metrale_cli.sim.simulate import EngineCache
from metrale_cli.sim.workload import Workload
from tests.conftest import SGLANG_PYTHON
from tests.support.cli_runner import metrale
from tests.support.engine_cases import assert_sglang_pool, run_job
from tests.support.peft_factory import make_adapter

RUNNER = Path(__file__).parent / "support" / "sglang_runner.py"

pytestmark = [pytest.mark.sglang, pytest.mark.proc, pytest.mark.slow]

LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# job: (model, {adapter: make_adapter kwargs}, start-up adapters, runtime adapters,
#       runner settings, metrale's flags for them)
JOBS = {
    "llama_tp1": ("llama", {"linear": {"r": 4, "lora_alpha": 8},
                            "heads": {"r": 8, "lora_alpha": 16, "target_modules": [
                                "q_proj", "v_proj", "embed_tokens", "lm_head"]}},
                  ["linear", "heads"], [], {"max_loras_per_batch": 3, "dtype": "float32"},
                  ["--max-loras", 3, "--dtype", "float32"]),
    "llama_tp2": ("llama", {"linear": {"r": 4, "lora_alpha": 8},
                            "heads": {"r": 8, "lora_alpha": 16, "target_modules": [
                                "q_proj", "v_proj", "embed_tokens", "lm_head"]}},
                  ["linear", "heads"], [], {"max_loras_per_batch": 3, "dtype": "float32",
                                            "tp_size": 2, "parallel_lm_head": True},
                  ["--max-loras", 3, "--dtype", "float32", "--tp", 2]),
    # 2 KV heads under TP 4: each rank keeps one whole KV head (qkv_proj's B). (k_proj and
    # v_proj without q_proj are left unstacked, and their first batch fails:
    # engines/sglang/rules.py.)
    "qwen3_tp4": ("qwen3", {"linear": {"r": 8, "lora_alpha": 16},
                            "head": {"r": 4, "lora_alpha": 4, "target_modules": [
                                "q_proj", "k_proj", "v_proj", "lm_head"]}},
                  ["linear", "head"], [], {"max_loras_per_batch": 2, "dtype": "bfloat16",
                                           "tp_size": 4, "parallel_lm_head": True},
                  ["--max-loras", 2, "--dtype", "bfloat16", "--tp", 4]),
    # Given --max-lora-rank and --lora-target-modules: the pool is theirs, and later adapters
    # outside it are refused at runtime.
    "qwen2_given": ("qwen2", {"qv": {"r": 4, "lora_alpha": 8, "target_modules": [
                                  "q_proj", "v_proj"]},
                              "wide": {"r": 32, "lora_alpha": 8, "target_modules": [
                                  "q_proj", "v_proj"]},
                              "mlp": {"r": 4, "lora_alpha": 8, "target_modules": [
                                  "gate_proj", "down_proj"]},
                              "attn": {"r": 16, "lora_alpha": 8, "target_modules": [
                                  "q_proj", "k_proj", "v_proj", "o_proj"]}},
                    ["qv"], ["wide", "mlp", "attn"],
                    {"max_loras_per_batch": 4, "dtype": "float32", "max_lora_rank": 16,
                     "lora_target_modules": ["q_proj", "v_proj", "o_proj", "down_proj"]},
                    ["--max-loras", 4, "--dtype", "float32", "--max-rank", 16,
                     "--modules", "q_proj,v_proj,o_proj,down_proj"]),
    "mistral_tp2": ("mistral", {"linear": {"r": 4, "lora_alpha": 8}}, ["linear"], [],
                    {"max_loras_per_batch": 2, "dtype": "float32", "tp_size": 2},
                    ["--max-loras", 2, "--dtype", "float32", "--tp", 2]),
    # Phi-3's checkpoint-fused qkv_proj and gate_up_proj: the same stacked buffers as PEFT's
    # q/k/v and gate/up would take, split over TP 2.
    "phi3_tp2": ("phi3", {"fused": {"r": 4, "lora_alpha": 8, "target_modules": [
                              "qkv_proj", "o_proj", "gate_up_proj", "down_proj"]},
                          "heads": {"r": 8, "lora_alpha": 16, "target_modules": [
                              "qkv_proj", "embed_tokens", "lm_head"]}},
                 ["fused", "heads"], [], {"max_loras_per_batch": 2, "dtype": "float32",
                                          "tp_size": 2, "parallel_lm_head": True},
                 ["--max-loras", 2, "--dtype", "float32", "--tp", 2]),
}


@pytest.fixture(scope="module")
def sglang_out(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every job below made by PEFT and run through SGLang's code in one runner process (one
    SGLang import, each job published as its own server): JOBS' pools, then the eviction
    replay of `sequence()` under each policy."""
    tmp = tmp_path_factory.mktemp("sglang_memory")
    jobs: dict[str, dict[str, Any]] = {}
    dirs: dict[str, dict[str, Path]] = {}
    for name, (model, adapters, startup, runtime, settings, _) in JOBS.items():
        dirs[name] = {}
        for seed, (adapter, kwargs) in enumerate(adapters.items()):
            dirs[name][adapter] = tmp / name / adapter
            make_adapter(model, dirs[name][adapter], seed=seed,
                         **{"target_modules": LINEAR, **kwargs})
        jobs[name] = {"model": str(dirs[name][startup[0]] / "base"), **settings,
                      "startup": [{"name": n, "path": str(dirs[name][n])} for n in startup],
                      "runtime": [{"name": n, "path": str(dirs[name][n])} for n in runtime]}
    cache = tmp / "cache"
    for i in range(CACHE_ADAPTERS):
        make_adapter("llama", cache / f"a{i}", seed=i, r=4 if i % 2 else 2, lora_alpha=8,
                     target_modules=["q_proj", "v_proj"])
    batches = [[None] if a < 0 else [f"a{a}"] for a in sequence()]
    for policy in POLICIES:
        jobs[f"cache_{policy}"] = {
            "model": str(cache / "a0" / "base"), "dtype": "float32",
            "max_loras_per_batch": CACHE_SLOTS, "eviction_policy": policy,
            "startup": [{"name": f"a{i}", "path": str(cache / f"a{i}")} for i in range(2)],
            "runtime": [{"name": f"a{i}", "path": str(cache / f"a{i}")}
                        for i in range(2, CACHE_ADAPTERS)], "batches": batches}
    report, _ = run_job(SGLANG_PYTHON, RUNNER, tmp, {"jobs": list(jobs.values())},
                        "SGLang runner")
    return {"jobs": dict(zip(jobs, report["jobs"], strict=True)), "dirs": dirs, "cache": cache}


@pytest.fixture(scope="module")
def runs(sglang_out: dict[str, Any]) -> dict[str, dict]:
    """Per job of JOBS, what SGLang did, and its adapters' directories."""
    return {name: {**sglang_out["jobs"][name], "dirs": sglang_out["dirs"][name]}
            for name in JOBS}


def _layout(run: dict, name: str) -> dict:
    _, _, startup, _, _, flags = JOBS[name]
    done = metrale("layout", *(f"{n}={run['dirs'][n]}" for n in startup), "--engine", "sglang",
                   *flags, "--json")
    assert done.code == 0, done.stderr
    return done.json()["engine"]


@pytest.mark.parametrize("name", list(JOBS))
def test_pool_buffers_are_the_ones_sglang_allocates(runs: dict[str, dict], name: str) -> None:
    """Per module, layer 0's A and B shapes and the bytes over every layer, and the total,
    equal the buffers of SGLang's own LoRAMemoryPool."""
    run = runs[name]
    assert run["started"], run.get("start_error")
    engine = _layout(run, name)
    assert_sglang_pool(run, engine)
    assert engine["slot_bytes"] * JOBS[name][4]["max_loras_per_batch"] == run["pool"]["bytes"]


@pytest.mark.parametrize("name", list(JOBS))
def test_the_pool_is_the_one_the_start_up_infers(runs: dict[str, dict], name: str) -> None:
    """Without --max-lora-rank and --lora-target-modules, the start-up adapters' largest rank
    and the union of their normalised targets; with them, theirs."""
    run = runs[name]
    pool = _layout(run, name)["pool"]
    assert pool == {"max_lora_rank": run["max_lora_rank"],
                    "target_modules": run["target_modules"]}


def test_runtime_loads_are_judged_against_the_start_up_pool(runs: dict[str, dict]) -> None:
    """`inspect --engine sglang` with the job's flags: each runtime adapter's runtime verdict
    and SGLang's text, as `_load_lora_adapter` answered against the running pool."""
    run = runs["qwen2_given"]
    _, _, startup, runtime, _, flags = JOBS["qwen2_given"]
    done = metrale("inspect", *(f"{n}={run['dirs'][n]}" for n in [*startup, *runtime]),
                   "--engine", "sglang", *flags, "--json")
    paths = {a["name"]: a["engine"]["paths"] for a in done.json()["adapters"]}
    assert [e["accepted"] for e in run["runtime"]] == [False, False, True]
    for entry in run["runtime"]:
        got = paths[entry["name"]]["runtime"]
        assert (got["verdict"] == "serves") == entry["accepted"], entry
        if not entry["accepted"]:
            assert got["verdict"] == "refuses"
            assert f"HTTP 400 ({entry['error']['text']})" in got["reason"]
    # At start-up the rank-32 adapter would load (start-up adapters meet no rank check) and
    # the gate/down one stops the start (outside the given targets); the launch line names
    # neither.
    assert paths["wide"]["startup"]["verdict"] == "crashes"
    assert paths["mlp"]["startup"]["verdict"] == "fails_startup"
    assert "not included in the specified --lora-target-modules" in \
        paths["mlp"]["startup"]["reason"]
    serve = done.json()["engine"]["recommended"]["serve"]
    assert "qv=" in serve and "attn=" in serve and "wide=" not in serve and "mlp=" not in serve
    assert done.code == 1


# -- the GPU slots simulate replays, against the pool's own eviction ----------------------------

CACHE_ADAPTERS = 6
CACHE_SLOTS = 3  # --max-loras-per-batch: the base model keeps one
POLICIES = ("lru", "fifo")


def sequence() -> list[int]:
    """40 requests over 6 adapters and the base model (-1): a hot pair and a cold tail, so
    that the slots evict."""
    rng = random.Random(7)
    return [rng.choices([-1, *range(CACHE_ADAPTERS)], weights=[2, 6, 5, 2, 2, 1, 1])[0]
            for _ in range(40)]


@pytest.fixture(scope="module")
def pool_states(sglang_out: dict[str, Any]) -> dict[str, list[list[str | None]]]:
    """Per eviction policy, the adapter each slot of SGLang's own LoRAMemoryPool holds after
    each request of `sequence()` goes through `prepare_lora_batch` alone (one request at a
    time), the adapters loaded at start-up and at runtime first."""
    states = {}
    for policy in POLICIES:
        out = sglang_out["jobs"][f"cache_{policy}"]
        assert all(e["accepted"] for e in out["runtime"]), out["runtime"]
        states[policy] = out["batches"]
    states["base"] = [[str(sglang_out["cache"] / "a0" / "base")]]
    return states


def _replayed(policy: str, base: str) -> list[CacheState]:
    """The replay's slots after each request of `sequence()` (paging: one at a time), with the
    tiers `simulate --engine sglang` takes (sim.EngineCache) for the runner's flags."""
    seq = np.asarray(sequence(), dtype=np.int64)
    n = seq.size
    hold = np.zeros(n)
    workload = Workload(adapters=tuple(f"a{i}" for i in range(CACHE_ADAPTERS)), adapter=seq,
                        arrival=np.arange(n, dtype=np.float64) * 10.0,
                        input_tokens=np.zeros(n, dtype=np.int64),
                        output_tokens=np.zeros(n, dtype=np.int64), duration=hold.copy())
    cache = EngineCache(get_engine("sglang"), ModelConfig.from_hf(Path(base)), given=(
        ("--max-rank", 4), ("--modules", "q_proj,v_proj"), ("--eviction-policy", policy),
        ("--dtype", "float32")))
    tiers, _ = cache.at(CACHE_SLOTS)
    assert (tiers.gpu_slots, tiers.gpu_eviction) == (CACHE_SLOTS - 1, policy)
    link = Link.preset("pcie4")
    replay = Replay(workload, hold, SwapCost(tiers.slot_bytes, link.bytes_per_s,
                                             link.latency_s, "pcie4"),
                    admission=tiers.admission)
    states: dict[int, CacheState] = {}
    replay.run(tiers.gpu_eviction, tiers.gpu_slots,
               observe=lambda r, state: states.__setitem__(r, state))
    return [states[r] for r in range(n)]


@pytest.mark.parametrize("policy", POLICIES)
def test_gpu_slots_evict_as_sglangs_pool(pool_states: dict[str, list], policy: str) -> None:
    """After every request, the adapters in the replay's GPU slots are those in SGLang's pool
    beside the base model, which keeps a slot of its own throughout (so adapters get one slot
    fewer than --max-loras-per-batch), under LRU and FIFO eviction."""
    engine = pool_states[policy]
    ours = _replayed(policy, pool_states["base"][0][0])
    assert len(ours) == len(engine)
    evicted = 0
    for r, (state, slots) in enumerate(zip(ours, engine, strict=True)):
        assert None in slots, (r, slots)
        theirs = {s for s in slots if s}
        assert {s for s in state.slots if s} == theirs, (
            f"request {r} (adapter {sequence()[r]}): replay {state.slots} != SGLang {slots}")
        evicted += r > 0 and bool({s for s in engine[r - 1] if s} - theirs)
    assert evicted >= 5  # the sequence is worth checking: the slots turned over

