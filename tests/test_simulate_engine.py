"""`simulate --engine vllm`: the engine's own cache at each --max-loras (its slot bytes, GPU
slots, host cache of --max-cpu-loras, LRU, its scheduler's admission), the bytes `layout
--engine vllm` gives, and the options the engine does not take refused by name. That the
replay caches as vLLM caches is held against the engine running in
tests/test_engine_vllm_cache.py."""

from __future__ import annotations

import numpy as np
import pytest

from metrale_cli.engines import get_engine
from metrale_cli.model.config import ModelConfig
from metrale_cli.sim.costs import HostTier, Link, SwapCost
from metrale_cli.sim.replay import Replay
from metrale_cli.sim.simulate import EngineCache
from metrale_cli.sim.workload import GeneratorSpec, generate
from tests.support.cli_runner import metrale

BASE = ["simulate", "--engine", "vllm", "--model", "llama-3.1-8b", "--modules", "q_proj,v_proj",
        "--max-rank", "16", "--workload", "zipf", "--adapters", "40", "--requests", "2000",
        "--input-tokens", "0", "--output-tokens", "0", "--ranks", "16,8", "--json"]


def test_engine_sizes_use_the_engines_bytes_and_tiers() -> None:
    got = metrale(*BASE, "--max-loras", "4,8", "--max-cpu-loras", "12", "--budget", "100MiB")
    assert got.code == 0, got.stderr
    record = got.json()
    assert record["policies"] == ["lru"] and record["admission"] == "skip"
    assert record["engine"]["name"] == "vllm" and record["engine"]["version"] == "0.32.0"
    for n in (4, 8):
        layout = metrale("layout", "--engine", "vllm", "--model", "llama-3.1-8b", "--modules",
                         "q_proj,v_proj", "--max-rank", "16", "--max-loras", n,
                         "--max-cpu-loras", "12", "--json").json()["engine"]
        tiers = record["engine"]["tiers"][str(n)]
        assert tiers == layout["tiers"]
        assert (tiers["gpu_slots"], tiers["host_slots"]) == (n, 12)
        result = next(r for r in record["results"] if r["max_loras"] == n)
        assert result["pool_bytes"] == layout["lora_bytes"]
        assert result["fits_budget"] == (layout["lora_bytes"] <= 100 * 2**20)
        # Every GPU miss is a host-cache hit or a read from disk.
        assert result["host_hits"] + result["host_misses"] == result["misses"]
    assert record["swap"]["slot_bytes"] == record["engine"]["tiers"]["4"]["slot_bytes"]
    assert record["host"]["slots"] == 12


def test_host_cache_follows_max_loras_without_max_cpu_loras() -> None:
    """vLLM's --max-cpu-loras defaults to --max-loras: the host cache then holds what the GPU
    holds, so every GPU miss reads the adapter from disk."""
    record = metrale(*BASE, "--max-loras", "4,8").json()
    assert record["host"]["slots"] is None
    for r in record["results"]:
        assert record["engine"]["tiers"][str(r["max_loras"])]["host_slots"] == r["max_loras"]
        assert r["host_hits"] == 0 and r["host_misses"] == r["misses"]


def test_each_size_is_a_replay_of_the_engines_tiers() -> None:
    """Every figure of a size equals a Replay built from that size's tiers by hand."""
    record = metrale(*BASE, "--max-loras", "4,8", "--max-cpu-loras", "10").json()
    workload = generate(GeneratorSpec("zipf", 2000, 40, 10.0, 1.0, 0, 1.5, 1.0, (0, 0),
                                      (0, 0), (16, 8)))
    cache = EngineCache(get_engine("vllm"), ModelConfig.preset("llama-3.1-8b"), given=(
        ("--max-rank", 16), ("--max-cpu-loras", 10), ("--modules", "q_proj,v_proj")))
    link = Link.preset("pcie4")
    for r in record["results"]:
        tiers, _ = cache.at(r["max_loras"])
        ranks = workload.adapter_rank
        loads = [tiers.slot_bytes * int(k) // tiers.max_rank for k in ranks]
        replay = Replay(workload, np.zeros(workload.requests),
                        SwapCost(tiers.slot_bytes, link.bytes_per_s, link.latency_s, "pcie4"),
                        load_bytes=loads, host=HostTier(tiers.host_slots, cache.host_link),
                        admission=tiers.admission)
        mine = replay.run(tiers.gpu_eviction, tiers.gpu_slots).record()
        for key in ("hits", "misses", "host_hits", "host_misses", "bytes_moved",
                    "host_bytes_moved"):
            assert mine[key] == r[key], key


@pytest.mark.parametrize(("extra", "says"), [
    (["--policy", "fifo"], "--policy: --engine vllm evicts and admits as the engine does"),
    (["--admission", "fcfs"], "--admission: --engine vllm"),
    (["--host-slots", "8"], "--host-slots needs --engine metrale"),
    (["--pinned", "2"], "--pinned needs --engine metrale"),
    (["--max-loras", "8", "--max-cpu-loras", "4"], "--max-cpu-loras 4 is below --max-loras 8"),
    (["--max-rank", "513"], "--max-rank 513: past 512, the largest --max-lora-rank"),
])
def test_what_the_engine_does_not_take_is_refused(extra: list[str], says: str) -> None:
    args = [a for a in BASE if a != "--json"]
    if "--max-rank" in extra:
        i = args.index("--max-rank")
        del args[i:i + 2]
    got = metrale(*args, *extra)
    assert got.code == 2 and says in got.stderr, got.stderr
    assert len(got.stderr.strip().splitlines()) == 1, got.stderr


def test_max_cpu_loras_needs_an_engine() -> None:
    got = metrale("simulate", "--model", "llama-3.1-8b", "--modules", "q_proj", "--max-rank",
                  "16", "--max-cpu-loras", "4")
    assert got.code == 2 and "--max-cpu-loras needs --engine vllm" in got.stderr, got.stderr


@pytest.mark.slow  # two PEFT adapters built with torch
def test_the_engine_judges_the_adapters_not_the_pool(peft_zoo) -> None:  # type: ignore[no-untyped-def]
    """Under an engine its judgement decides, not the pool's audit. An adapter on q_proj and
    lm_head: vLLM 0.32 serves it (the `lm_head` case of tests/test_engine_vllm.py loads in the
    real engine and matches PEFT), the pool refuses lm_head, and `simulate --engine vllm`
    refused it with the pool's audit; its slot is now vLLM's, the bytes `layout --engine vllm`
    gives. The other way round, trainable tokens (the pool serves them as overlays, vLLM
    refuses their weight) were replayed through vLLM's cache; now refused with vLLM's reason."""
    head = peft_zoo.adapter("qwen3", r=8, lora_alpha=16, target_modules=["q_proj", "lm_head"])
    tokens = peft_zoo.adapter("qwen3", r=8, lora_alpha=16, target_modules=["q_proj"],
                              trainable_token_indices=[3, 4])
    setup = ["--model", head.base_dir, "--workload", "zipf", "--adapters", "10", "--requests",
             "200", "--input-tokens", "0", "--output-tokens", "0", "--max-loras", "2,4", "--json"]
    pool = metrale("simulate", head.path, *setup)
    assert pool.code == 1 and "lm_head" in pool.stderr and "pool cannot serve" in pool.stderr
    served = metrale("simulate", "--engine", "vllm", head.path, *setup)
    assert served.code == 0, served.stderr
    layout = metrale("layout", "--engine", "vllm", head.path, "--model", head.base_dir,
                     "--max-loras", "2", "--json")
    assert layout.code == 0, layout.stderr
    assert "lm_head" in {m["module"] for m in layout.json()["engine"]["modules"]}
    slot = layout.json()["engine"]["tiers"]["slot_bytes"]
    assert served.json()["swap"]["slot_bytes"] == slot
    assert metrale("simulate", tokens.path, *setup).code == 0  # the pool serves the overlay
    refused = metrale("simulate", "--engine", "vllm", tokens.path, *setup[:-1])
    assert refused.code == 1 and refused.stdout == ""
    assert "vLLM refuses" in refused.stderr and "unsupported LoRA weight" in refused.stderr


def test_sglang_takes_tp_as_every_command_does() -> None:
    """--tp 0 ran as --tp 1 (exit 0) and --tp 2 was never mentioned: refused as everywhere
    else, and the slot said per GPU at that --tp."""
    args = ["simulate", "--engine", "sglang", "--model", "llama-3.1-8b", "--modules",
            "q_proj,v_proj", "--max-rank", "16", "--adapters", "20", "--requests", "200",
            "--max-loras", "4"]
    got = metrale(*args, "--tp", "0")
    assert got.code == 2 and got.stderr == "error: --tp must be positive, got 0\n", got.stderr
    got = metrale(*args, "--tp", "2", columns=200)
    assert got.code == 0, got.stderr
    assert "per GPU at --tp 2" in got.stdout, got.stdout
    record = metrale(*args, "--tp", "2", "--json").json()
    assert record["layout"]["tp_size"] == 2
    one = metrale(*args, "--json").json()
    assert "tp_size" not in one["layout"]
    assert record["swap"]["slot_bytes"] < one["swap"]["slot_bytes"]


def test_a_host_cache_without_adapter_files_states_no_bound() -> None:
    """SGLang sizes its host cache by its start-up adapters' files; a generated workload has
    none, and the host line said "up to 0 B" beside 20 adapters held. It says no bound then."""
    got = metrale("simulate", "--engine", "sglang", "--model", "llama-3.1-8b", "--modules",
                  "q_proj,v_proj", "--max-rank", "16", "--adapters", "20", "--requests", "200",
                  "--max-loras", "4", columns=200)
    assert got.code == 0, got.stderr
    [host] = [line for line in got.stdout.splitlines() if line.startswith("host ")]
    assert "20 adapters in host memory (an LRU);" in host and "0 B" not in host, host


def test_a_flag_conflict_at_any_size_is_refused_before_the_work(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """--max-cpu-loras below the largest swept --max-loras: refused before the first size's
    replay, not after it."""
    replayed: list[int] = []
    real = Replay.run

    def spy(self: Replay, policy: str, size: int, *args: object, **kw: object) -> object:
        replayed.append(size)
        return real(self, policy, size, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(Replay, "run", spy)
    got = metrale(*[a for a in BASE if a != "--json"], "--max-loras", "4,8,16",
                  "--max-cpu-loras", "12")
    assert got.code == 2 and "--max-cpu-loras 12 is below --max-loras 16" in got.stderr, \
        got.stderr
    assert replayed == []
