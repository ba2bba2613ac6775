"""`simulate --engine vllm` caches as vLLM caches: the real vLLM 0.32.0 (CPU build, a tiny Llama,
eight PEFT adapters of two ranks, `max_loras` 2, `max_cpu_loras` 4) serves a fixed sequence of
48 requests one after another (tests/support/vllm_cache_runner.py under .venv-vllm), and after
each request the worker's own LoRA manager says which adapter each GPU slot holds and which are
loaded in its host cache, least recently used first. The replay `simulate --engine vllm` runs
(the engine's `SlotTiers` turned into a `Replay`) must hold the same adapters in the same slots
and the same host cache in the same order, request by request, in both of its modes. Where they
differ, the replay is wrong, not the test.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from metrale_cli.engines import get_engine
from metrale_cli.model.config import ModelConfig
from metrale_cli.sim.costs import HostTier, Link, SwapCost
from metrale_cli.sim.replay import Replay
from metrale_cli.sim.results import CacheState
from metrale_cli.sim.simulate import EngineCache
from metrale_cli.sim.workload import Workload
from tests.conftest import VLLM_PYTHON

pytestmark = [pytest.mark.vllm, pytest.mark.proc]

RUNNER = Path(__file__).parent / "support" / "vllm_cache_runner.py"
ADAPTERS = 8
MAX_LORAS, MAX_CPU_LORAS = 2, 4


def sequence() -> list[int]:
    """48 requests over 8 adapters and the base model (-1): a hot pair, a warm middle and a
    cold tail, so that both tiers evict, hit and miss."""
    rng = random.Random(7)
    weights = [6, 5, 2, 2, 2, 1, 1, 1]
    return [rng.choices([-1, *range(ADAPTERS)], weights=[2, *weights])[0] for _ in range(48)]


@pytest.fixture(scope="module")
def engine_states(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The engine's LoRA cache after each request of `sequence()` (and the base model's
    directory, beside each): one engine start."""
    if not VLLM_PYTHON.exists():
        pytest.skip(f"needs {VLLM_PYTHON}")
    from tests.support.engine_cases import PROMPT, make_case, run_job, write_model

    out = tmp_path_factory.mktemp("vllm_cache")
    base = write_model("llama", out / "base")
    paths = [str(make_case("llama", base, out, f"a{i}", r=4 if i % 2 else 8, lora_alpha=16,
                           target_modules=["q_proj", "v_proj"]).path)
             for i in range(ADAPTERS)]
    job = {"model": str(base), "prompt": PROMPT, "adapters": paths, "sequence": sequence(),
           "engine": {"max_lora_rank": 8, "max_loras": MAX_LORAS,
                      "max_cpu_loras": MAX_CPU_LORAS}}
    report, _ = run_job(VLLM_PYTHON, RUNNER, out, job, "vLLM cache runner")
    assert report["initial"] == {"slots": [None] * MAX_LORAS, "gpu_lru": [], "host_lru": []}
    return [{**state, "base": base} for state in report["states"]]


def replayed(mode: str, base: Path) -> list[CacheState]:
    """The replay's cache state after each request of `sequence()`, with vLLM's tiers."""
    seq = np.asarray(sequence(), dtype=np.int64)
    n = seq.size
    # One request at a time: paging (each takes no time), or concurrent with each request
    # ending before the next arrives, as the runner sends them.
    hold = np.zeros(n) if mode == "paging" else np.full(n, 1.0)
    workload = Workload(adapters=tuple(f"a{i}" for i in range(ADAPTERS)), adapter=seq,
                        arrival=np.arange(n, dtype=np.float64) * 10.0,
                        input_tokens=np.zeros(n, dtype=np.int64),
                        output_tokens=np.zeros(n, dtype=np.int64), duration=hold.copy())
    # The engine's tiers as `simulate --engine vllm` takes them (sim.EngineCache), for the
    # flags the engine ran with.
    cache = EngineCache(get_engine("vllm"), ModelConfig.from_hf(base), given=(
        ("--max-rank", 8), ("--max-cpu-loras", MAX_CPU_LORAS), ("--dtype", "float32")))
    tiers, _ = cache.at(MAX_LORAS)
    link = Link.preset("pcie4")
    replay = Replay(workload, hold, SwapCost(tiers.slot_bytes, link.bytes_per_s,
                                             link.latency_s, "pcie4"),
                    host=HostTier(tiers.host_slots, cache.host_link), admission=tiers.admission)
    states: dict[int, CacheState] = {}
    replay.run(tiers.gpu_eviction, tiers.gpu_slots,
               observe=lambda r, state: states.__setitem__(r, state))
    assert sorted(states) == list(range(n))
    return [states[r] for r in range(n)]


def as_names(indices: list[int | None]) -> list[str | None]:
    return [None if i is None else f"a{i}" for i in indices]


@pytest.mark.parametrize("mode", ["paging", "concurrent"])
def test_replay_caches_as_vllm(engine_states: list[dict[str, Any]], mode: str) -> None:
    ours = replayed(mode, engine_states[0]["base"])
    assert len(ours) == len(engine_states)
    for r, (state, engine) in enumerate(zip(ours, engine_states, strict=True)):
        expected = CacheState(tuple(as_names(engine["slots"])),
                              tuple(as_names(engine["host_lru"])))
        assert state == expected, (f"request {r} (adapter {sequence()[r]}): replay "
                                   f"{state} != vLLM {expected}")


def test_sequence_exercises_both_tiers(engine_states: list[dict[str, Any]]) -> None:
    """The sequence is worth checking: the engine evicted from both tiers and hit in the host
    cache after a GPU eviction (a load that skips the disk)."""
    gpu_evictions = host_evictions = host_only_hits = 0
    for before, after, a in zip([{"slots": [None] * MAX_LORAS, "host_lru": []},
                                 *engine_states], engine_states, sequence(), strict=False):
        gone_gpu = {x for x in before["slots"] if x is not None} - set(after["slots"])
        gpu_evictions += bool(gone_gpu)
        host_evictions += bool(set(before["host_lru"]) - set(after["host_lru"]))
        host_only_hits += a >= 0 and a in before["host_lru"] and a not in before["slots"]
    assert gpu_evictions >= 5 and host_evictions >= 3 and host_only_hits >= 3, (
        gpu_evictions, host_evictions, host_only_hits)
