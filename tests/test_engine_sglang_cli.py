"""`inspect`, `layout` and `simulate` with `--engine sglang` as users run them: records, the two
load paths, the launch line, exit codes, one-line refusals, no torch. What SGLang's own code
does with the same adapters and flags is tests/test_engine_sglang.py's and
tests/test_engine_sglang_memory.py's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cli_runner import metrale

LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def adapters(peft_zoo) -> dict[str, Path]:  # type: ignore[no-untyped-def]
    """Real PEFT adapters on the tiny Llama: plain, rsLoRA (SGLang scales it otherwise), DoRA
    (refused), q_proj without v_proj (SGLang's loader fails on the missing key)."""
    plain = peft_zoo.adapter("llama", r=4, lora_alpha=8, target_modules=LINEAR)
    rs = peft_zoo.adapter("llama", r=8, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                          use_rslora=True, seed=1)
    dora = peft_zoo.adapter("llama", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                            use_dora=True, seed=2)
    q_only = peft_zoo.adapter("llama", r=4, lora_alpha=8, target_modules=["q_proj"], seed=3)
    bias = peft_zoo.adapter("llama", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                            lora_bias=True, seed=4)
    return {"plain": plain.path, "rs": rs.path, "dora": dora.path, "q_only": q_only.path,
            "bias": bias.path}


def _named(adapters: dict[str, Path], *names: str) -> list[str]:
    return [f"{n}={adapters[n]}" for n in names]


def test_inspect_ends_with_why_it_exits_1(adapters: dict[str, Path]) -> None:
    """An adapter SGLang serves otherwise than PEFT (`differs`) makes exit 1 as a refusal
    does: the last line names each with its verdict."""
    done = metrale("inspect", *_named(adapters, "plain", "rs", "dora"), "--engine", "sglang")
    assert done.code == 1
    assert done.stderr == ("error: 2 of 3 adapter(s) not served as PEFT serves them by "
                           "SGLang 0.5.23: rs (differs), dora (refuses)\n")
    assert done.output.endswith(done.stderr)
    served = metrale("inspect", *_named(adapters, "plain"), "--engine", "sglang")
    assert served.code == 0 and served.stderr == ""


def test_inspect_gives_each_load_path_and_a_launch_line(adapters: dict[str, Path]) -> None:
    done = metrale("inspect", *_named(adapters, "plain", "rs", "dora", "q_only"), "--engine",
                   "sglang", "--json")
    assert done.code == 1  # not every adapter is served as PEFT serves it
    record = done.json()
    by = {a["name"]: a["engine"] for a in record["adapters"]}
    assert {e["name"] for e in by.values()} == {"sglang"}
    assert {e["version"] for e in by.values()} == {"0.5.23"}
    assert by["plain"]["verdict"] == "serves"
    assert by["rs"]["verdict"] == "differs" and "rsLoRA" in by["rs"]["reason"]
    assert by["rs"]["paths"]["startup"]["verdict"] == "differs"
    for name in ("dora", "q_only"):
        paths = by[name]["paths"]
        assert by[name]["verdict"] == paths["runtime"]["verdict"] == "refuses"
        assert "HTTP 400" in paths["runtime"]["reason"]
        assert paths["startup"]["verdict"] == "fails_startup"
        assert "Failed to load LoRA adapter" in paths["startup"]["reason"]
        assert {p["checked"] for p in paths.values()} == {"run"}
    assert "doesn't support DoRA adapters" in by["dora"]["reason"]
    # SGLang's KeyError names a tensor; the reason says what is missing, on both paths.
    words = ("layer 0 has q_proj without v_proj, and SGLang stacks each layer's q_proj, "
             "k_proj and v_proj into one qkv_proj, which needs v_proj beside q_proj")
    assert all(words in p["reason"] for p in by["q_only"]["paths"].values())
    assert "q_only: naming it in --lora-paths stops the server" in "\n".join(
        record["engine"]["recommended"]["shut_out"])
    engine = record["engine"]
    assert engine["startup_fails"] and engine["flags_source"] == "recommended"
    # The pool the start-up infers: the largest rank and the union of the targets of the
    # adapters that start it.
    assert engine["pool"] == {"max_lora_rank": 8, "target_modules": [
        "down_proj", "gate_up_proj", "o_proj", "qkv_proj"]}
    rec = engine["recommended"]
    assert rec["serve"].startswith("python -m sglang.launch_server --model-path ")
    assert f"plain={adapters['plain'].resolve()}" in rec["serve"]
    assert f"rs={adapters['rs'].resolve()}" in rec["serve"]
    assert "dora=" not in rec["serve"] and "q_only=" not in rec["serve"]
    # Every start-up adapter and the base model in one batch.
    assert "--max-loras-per-batch 3" in rec["serve"]
    assert [line.split(":")[0] for line in rec["shut_out"]] == ["dora", "q_only"]
    assert rec["lora_bytes"] == rec["slot_bytes"] * 3


def test_given_flags_judge_the_runtime_path_against_their_pool(
        adapters: dict[str, Path]) -> None:
    done = metrale("inspect", *_named(adapters, "plain", "rs"), "--engine", "sglang",
                   "--max-rank", 4, "--modules", "q_proj,v_proj", "--json")
    assert done.code == 1
    plain, rs = (a["engine"] for a in done.json()["adapters"])
    assert plain["flags_source"] == "given"
    # plain trains o/gate/up/down too: outside the given targets, at start-up and at runtime.
    assert plain["paths"]["startup"]["verdict"] == "fails_startup"
    assert "not included in the specified --lora-target-modules" in \
        plain["paths"]["startup"]["reason"]
    assert plain["verdict"] == "refuses" and "is incompatible with the current LoRA memory " \
        "pool configuration" in plain["reason"]
    # rs has rank 8 over --max-lora-rank 4: loaded at start-up unchecked, it fails later.
    assert rs["paths"]["startup"]["verdict"] == "crashes"
    assert rs["verdict"] == "refuses" and "with rank 8" in rs["reason"]
    # No adapter starts it: the given rank and targets size the pool alone.
    serve = done.json()["engine"]["recommended"]["serve"]
    assert "--lora-paths" not in serve and "--max-lora-rank 4 --lora-target-modules q_proj " \
        "v_proj --max-loras-per-batch 2" in serve


def test_inspect_view_speaks_sglang(adapters: dict[str, Path]) -> None:
    done = metrale("inspect", *_named(adapters, "dora", "plain"), "--engine", "sglang",
                   columns=200)
    assert done.code == 1
    assert "SGLang 0.5.23" in done.stdout and "vLLM" not in done.stdout
    assert "--lora-paths  fails_startup: naming it in --lora-paths stops the server" in \
        done.stdout
    serve = done.stdout[done.stdout.index("python -m sglang.launch_server"):]
    assert "dora=" not in serve.split("left out")[0]


def test_layout_bytes_per_gpu_tp_budget_and_tiers() -> None:
    def engine(*args: object) -> dict:
        done = metrale("layout", "--engine", "sglang", "--model", "qwen3-8b", "--max-loras", 8,
                       "--max-rank", 64, "--json", *args)
        assert done.code == 0, done.stderr
        return done.json()["engine"]

    one = engine("--modules", "q_proj,k_proj,v_proj,o_proj")
    two = engine("--modules", "q_proj,k_proj,v_proj,o_proj", "--tp", 2)
    assert one["lora_bytes"] == sum(m["bytes"] for m in one["modules"]) == 8 * one["slot_bytes"]
    assert two["lora_bytes"] < one["lora_bytes"]
    assert one["flags"]["dtype"] == "bfloat16" and one["pool"]["max_lora_rank"] == 64
    tiers = one["tiers"]
    # The base model keeps one of the 8 slots.
    assert (tiers["gpu_slots"], tiers["host_slots"], tiers["gpu_eviction"]) == (7, None, "lru")
    assert tiers["admission"] == "skip" and "scheduler.py" in tiers["source"]
    every = engine("--modules", "all", "--budget", "4GiB")
    heads = {m["module"]: m for m in every["modules"] if m["module"] in ("embed_tokens",
                                                                        "lm_head")}
    # Both targeted: SGLang allocates each pair twice.
    assert {m["copies"] for m in heads.values()} == {2}
    assert every["max_loras_fit"] == (4 << 30) // every["slot_bytes"]
    fifo = engine("--modules", "q_proj", "--eviction-policy", "fifo", "--max-loaded-loras", 16)
    assert (fifo["tiers"]["gpu_eviction"], fifo["tiers"]["host_slots"]) == ("fifo", 16)


def test_layout_gives_the_memory_of_an_adapter_served_otherwise(
        adapters: dict[str, Path]) -> None:
    """SGLang loads a `lora_bias` adapter and drops its biases: it still starts with it and
    allocates its pool, so `layout` gives the bytes, flags the adapter, and exits 1."""
    done = metrale("layout", *_named(adapters, "plain", "bias"), "--engine", "sglang", "--json")
    assert done.code == 1
    engine = done.json()["engine"]
    assert [(n["adapter"], n["verdict"]) for n in engine["not_served"]] == [("bias", "differs")]
    assert "lora_bias" in engine["not_served"][0]["reason"]
    # The same batch: without --max-loras it holds each start-up adapter and the base model.
    alone = metrale("layout", *_named(adapters, "plain"), "--engine", "sglang", "--max-loras",
                    engine["flags"]["max_loras_per_batch"], "--json")
    assert alone.code == 0 and alone.json()["engine"]["not_served"] == []
    assert engine["lora_bytes"] == alone.json()["engine"]["lora_bytes"] > 0
    assert done.stderr == ("error: 1 of 2 adapter(s) not served as PEFT serves them by SGLang "
                           "0.5.23, though it allocates these buffers: bias (differs)\n")
    shown = metrale("layout", *_named(adapters, "plain", "bias"), "--engine", "sglang",
                    columns=300)
    assert shown.code == 1 and f"{engine['lora_bytes']:,} B" in shown.stdout
    assert "not served    bias: differs: loads and serves otherwise than PEFT" in shown.stdout


def test_layout_view_speaks_sglang() -> None:
    done = metrale("layout", "--engine", "sglang", "--model", "qwen3-8b", "--max-rank", 16,
                   "--modules", "all", "--budget", "1GiB")
    assert done.code == 0, done.stderr
    assert "SGLang 0.5.23" in done.stdout and "vLLM" not in done.stdout
    assert "embed_tokens (x2)" in done.stdout
    assert "--max-loras (--max-loras-per-batch)" in done.stdout


@pytest.mark.parametrize(("args", "says"), [
    (["--max-loras", 8, "--max-loaded-loras", 4],
     "max_loaded_loras should be greater than or equal to max_loras_per_batch"),
    (["--modules", "q_proj,nope"], "SGLang's --lora-target-modules takes"),
    (["--modules", "all,q_proj"], "it should be the only module specified"),
    (["--eviction-policy", "fiof"],
     "--eviction-policy 'fiof' (did you mean 'fifo'?): one of lru, fifo"),
    (["--lora-backend", "cuda"], "--lora-backend 'cuda': one of"),
    # Empty is the user's value too, not the default's.
    (["--eviction-policy", ""], "--eviction-policy '': one of lru, fifo"),
    (["--lora-backend", ""], "--lora-backend '': one of"),
    (["--dtype", "int8"], "--dtype 'int8': one of"),
    (["--tp", 3], "do not split over --tp 3; SGLang's"),
    (["--modules", "q_proj", "--max-rank", None], "needs --max-rank and --modules"),
    (["--modules", None], "needs --max-rank and --modules"),
])
def test_bad_flags_are_one_line_exit_2(args: list[object], says: str) -> None:
    given = {"--modules": "q_proj", "--max-rank": 16}
    flags: list[object] = []
    for name, value in zip(args[::2], args[1::2], strict=True):
        given[str(name)] = value  # type: ignore[assignment]
    for name, value in given.items():
        if value is not None:
            flags += [name, value]
    done = metrale("layout", "--engine", "sglang", "--model", "qwen3-8b", *flags)
    assert done.code == 2 and says in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_more_start_up_adapters_than_max_loaded_loras_is_refused(
        adapters: dict[str, Path]) -> None:
    done = metrale("layout", *_named(adapters, "plain", "rs"), "--engine", "sglang",
                   "--max-loras", 1, "--max-loaded-loras", 1)
    assert done.code == 2 and "The number of LoRA paths should not exceed max_loaded_loras" \
        in done.stderr


@pytest.mark.sweep
def test_simulate_replays_sglangs_cache(adapters: dict[str, Path]) -> None:
    done = metrale("simulate", f"plain={adapters['plain']}", "--engine", "sglang",
                   "--requests", 500, "--adapters", 12, "--max-loras", "2,4",
                   "--max-loaded-loras", 6, "--eviction-policy", "fifo", "--json")
    assert done.code == 0, done.stderr
    record = done.json()
    assert record["policies"] == ["fifo"] and record["admission"] == "skip"
    assert record["engine"]["name"] == "sglang" and record["host"]["slots"] == 6
    for n in (2, 4):
        layout = metrale("layout", f"plain={adapters['plain']}", "--engine", "sglang",
                         "--max-loras", n, "--max-loaded-loras", 6,
                         "--eviction-policy", "fifo", "--json").json()["engine"]
        assert record["engine"]["tiers"][str(n)] == layout["tiers"]
        result = next(r for r in record["results"] if r["max_loras"] == n)
        assert result["pool_bytes"] == layout["lora_bytes"]
        # The adapters' slots: one fewer than --max-loras (the base model keeps one).
        assert record["engine"]["tiers"][str(n)]["gpu_slots"] == n - 1
        assert result["host_hits"] + result["host_misses"] == result["misses"]
    unlimited = metrale("simulate", f"plain={adapters['plain']}", "--engine", "sglang",
                        "--requests", 200, "--adapters", 5, "--max-loras", 3, "--json").json()
    # No --max-loaded-loras: every adapter, once loaded, stays in CPU memory.
    assert unlimited["host"]["slots"] == 5
    assert unlimited["results"][0]["host_misses"] <= 5


@pytest.mark.proc
def test_engine_sglang_imports_no_torch(adapters: dict[str, Path]) -> None:
    code = ("import sys\nfrom metrale_cli.cli.app import main\n"
            "sys.argv = ['metrale'] + sys.argv[1:]\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "bad = [m for m in ('torch', 'cupy', 'sglang') if m in sys.modules]\n"
            "assert not bad, bad\n")
    for args in (["inspect", str(adapters["plain"]), "--engine", "sglang"],
                 ["layout", "--engine", "sglang", "--model", "qwen3-8b", "--max-rank", "8",
                  "--modules", "q_proj", "--tp", "4"]):
        done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True,
                              text=True)
        assert done.returncode == 0, (args, done.stderr)


def test_architectures_holding_no_class_name_is_one_verdict(
        adapters: dict[str, Path], tmp_path: Path) -> None:
    """A config whose `architectures` holds a list or an object, not a class name: SGLang's
    registry cannot look it up (the server never starts), so the adapter is
    `unsupported_model` on both paths, exit 1; it was an internal error (exit 70), the
    Transformers-backend check putting the entries in a set."""
    base = json.loads((adapters["plain"] / "adapter_config.json").read_text())
    config = json.loads((Path(base["base_model_name_or_path"]) / "config.json").read_text())
    for archs in ([["LlamaForCausalLM"]], {"LlamaForCausalLM": 1}):
        (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": archs}))
        done = metrale("inspect", adapters["plain"], "--engine", "sglang", "-m", tmp_path,
                       "--json")
        assert done.code == 1, done.stderr
        engine = done.json()["adapters"][0]["engine"]
        assert engine["verdict"] == "unsupported_model"
        assert engine["reason_class"] == "architecture"
        assert "not a class name" in engine["reason"]
        assert {p["verdict"] for p in engine["paths"].values()} == {"unsupported_model"}


@pytest.mark.parametrize(("edit", "says"), [
    ({"r": "abc"}, "r 'abc' is not a positive integer"),
    ({"r": [4]}, "r [4] is not a positive integer"),
    ({"lora_alpha": None}, "lora_alpha None is not a finite number"),
    ({"lora_alpha": "4"}, "lora_alpha '4' is not a finite number"),
    ({"target_modules": None}, "target_modules None is neither a name nor a list of names"),
])
def test_config_values_sglang_cannot_use_are_a_refusal(
        adapters: dict[str, Path], tmp_path: Path, edit: dict[str, object], says: str) -> None:
    """SGLang reads r, lora_alpha and target_modules unchecked and then compares, divides and
    normalises them: a value of another kind is its load's failure (exit 1, the adapter
    `refuses`), not metrale's internal error (exit 70 from the same arithmetic in the rules)."""
    from tests.support.hostile_inputs import copy_adapter

    bad = copy_adapter(adapters["plain"], tmp_path / "bad", **edit)
    done = metrale("inspect", bad, adapters["plain"], "--engine", "sglang", "--json")
    assert done.code == 1, done.stderr
    first, second = (a["engine"] for a in done.json()["adapters"])
    assert first["verdict"] == "refuses" and first["reason_class"] == "config_value"
    assert says in first["reason"]
    assert second["verdict"] == "serves"  # the start-up pool is sized without the bad one


def test_no_start_up_adapter_that_starts_the_server_sizes_no_pool(tmp_path: Path) -> None:
    """A Qwen3-Next adapter on every module (`out_proj` among them) stops SGLang's start-up:
    with no --max-rank and --modules no server starts, so there is no pool. inspect said
    `max_lora_rank 0 (inferred)` and `LoRA memory 0 B`; layout gave 0 B buffers `though it
    allocates these buffers` and exit 1."""
    adapter = tmp_path / "all"
    assert metrale("synth", adapter, "-m", "qwen3-next-80b-a3b", "--modules", "all", "-r",
                   4).code == 0
    shown = metrale("inspect", adapter, "--engine", "sglang", columns=200)
    assert shown.code == 1
    assert "max_lora_rank 0" not in shown.stdout and "0 B (0 B)" not in shown.stdout
    assert ("LoRA memory  none: no adapter can start the server, and without one it needs "
            "--max-rank and --modules") in shown.stdout
    assert "max_lora_rank not inferred (no adapter starts the server)" in shown.stdout
    for json_out in ([], ["--json"]):
        laid = metrale("layout", adapter, "--engine", "sglang", *json_out)
        assert laid.code == 1
        assert laid.stderr.splitlines()[-1] == (
            "error: 1 of 1 adapter(s) start no SGLang 0.5.23 server, which without one needs "
            "--max-rank and --modules: all")
        assert "get_hidden_dim not implemented for out_proj" in laid.stderr
        if json_out:
            assert laid.json()["refused"] == "not_servable"
    sized = metrale("layout", adapter, "--engine", "sglang", "--max-rank", 8, "--modules",
                    "q_proj", "--json")
    assert sized.code == 1 and sized.json()["engine"]["lora_bytes"] > 0
