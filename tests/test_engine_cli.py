"""`inspect --engine vllm` and `layout --engine vllm` as users run them: records, exit codes,
one-line refusals, no torch. What vLLM itself does is tests/test_engine_vllm.py's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cli_runner import metrale

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
DATA = Path(__file__).parent / "data" / "model_configs"


@pytest.fixture(scope="module")
def adapters(peft_zoo) -> dict[str, Path]:  # type: ignore[no-untyped-def]
    """Real PEFT adapters on the tiny Qwen3: one vLLM serves, one it refuses (DoRA)."""
    plain = peft_zoo.adapter("qwen3", r=8, lora_alpha=16, target_modules=ATTN)
    ranked = peft_zoo.adapter("qwen3", r=8, lora_alpha=16, target_modules=["q_proj"],
                              rank_pattern={"q_proj": 40}, seed=1)
    dora = peft_zoo.adapter("qwen3", r=8, lora_alpha=16, target_modules=["q_proj"],
                            use_dora=True, seed=2)
    return {"plain": plain.path, "ranked": ranked.path, "dora": dora.path,
            "base": plain.base_dir}


def test_inspect_records_each_verdict_and_recommends_flags(adapters: dict[str, Path]) -> None:
    done = metrale("inspect", f"plain={adapters['plain']}", f"ranked={adapters['ranked']}",
                   "--engine", "vllm", "--json")
    assert done.code == 0, done.stderr
    record = done.json()
    engines = [a["engine"] for a in record["adapters"]]
    assert [e["verdict"] for e in engines] == ["serves", "serves"]
    assert {e["name"] for e in engines} == {"vllm"} and {e["version"] for e in engines} == {
        "0.32.0"}
    assert all(e["flags_source"] == "recommended" for e in engines)
    rec = record["engine"]["recommended"]
    # rank_pattern 40 rounds up to the next rank vLLM allows.
    assert rec["flags"]["max_lora_rank"] == 64
    assert rec["flags"]["lora_target_modules"] == ["o_proj", "qkv_proj"]
    assert rec["serve"].startswith("vllm serve ") and "--max-lora-rank 64" in rec["serve"]
    # Absolute paths: `vllm serve` resolves --lora-modules against its own directory.
    assert f"plain={adapters['plain'].resolve()}" in rec["serve"]
    assert rec["lora_bytes"] == rec["slot_bytes"] * rec["flags"]["max_loras"]
    # The rank-8 adapter leaves most of a rank-64 slot empty; 32 would shut out `ranked`.
    padding = {p["adapter"]: p["unused_share"] for p in rec["padding"]}
    assert padding["plain"] > padding["ranked"] > 0
    assert rec["lower_max_rank"]["max_lora_rank"] == 32
    assert rec["lower_max_rank"]["shuts_out"] == ["ranked"]


def test_inspect_given_flags_judge_and_exit_1(adapters: dict[str, Path]) -> None:
    done = metrale("inspect", f"plain={adapters['plain']}", f"ranked={adapters['ranked']}",
                   "--engine", "vllm", "--max-rank", 16, "--json")
    assert done.code == 1
    plain, ranked = (a["engine"] for a in done.json()["adapters"])
    assert plain["verdict"] == "serves" and plain["flags_source"] == "given"
    assert ranked["verdict"] == "refuses" and ranked["reason_class"] == "rank_above_max"
    assert ranked["reason"] == "LoRA rank 40 is greater than max_lora_rank 16."
    assert ranked["paths"]["offline"]["verdict"] == "crashes"
    assert ranked["paths"]["startup"]["verdict"] == "fails_startup"
    assert ranked["paths"]["runtime"]["verdict"] == "refuses"
    assert "stops the server from starting" in ranked["paths"]["startup"]["reason"]
    assert plain["paths"]["startup"]["verdict"] == "serves"
    engine = done.json()["engine"]
    assert engine["startup_fails"] and "ranked ends the engine" in engine["offline_batch"][
        "reason"]
    narrowed = metrale("inspect", adapters["plain"], "--engine", "vllm", "--modules", "o_proj",
                       "--json")
    assert narrowed.code == 1
    engine = narrowed.json()["adapters"][0]["engine"]
    assert engine["verdict"] == "differs" and engine["reason_class"] == "target_modules"
    served = {m["module"]: m["served"] for m in engine["modules"]}
    assert served == {"self_attn.q_proj": False, "self_attn.k_proj": False,
                      "self_attn.v_proj": False, "self_attn.o_proj": True}


def test_inspect_view_names_verdict_and_serve_line(adapters: dict[str, Path]) -> None:
    done = metrale("inspect", f"dora={adapters['dora']}", f"plain={adapters['plain']}",
                   "--engine", "vllm", columns=200)
    assert done.code == 1
    assert "refuses" in done.stdout and "vLLM does not yet support DoRA." in done.stdout
    assert "vllm serve" in done.stdout and "dora: vLLM does not yet support DoRA." in done.stdout
    assert "naming it in --lora-modules stops the server from starting" in done.stdout
    serve = done.stdout[done.stdout.index("vllm serve"):]
    assert "dora=" not in serve.split("left out")[0]


def test_layout_bytes_per_gpu_tp_and_budget() -> None:
    def engine(*args: object) -> dict:
        done = metrale("layout", "--engine", "vllm", "--model", "qwen3-8b", "--max-loras", 8,
                       "--max-rank", 64, "--json", *args)
        assert done.code == 0, done.stderr
        return done.json()["engine"]

    one, four = engine(), engine("--tp", 4)
    sharded = engine("--tp", 4, "--fully-sharded")
    assert one["lora_bytes"] == sum(m["bytes"] for m in one["modules"])
    assert one["lora_bytes"] == 8 * one["slot_bytes"]
    assert sharded["lora_bytes"] < four["lora_bytes"] < one["lora_bytes"]
    assert one["flags"]["lora_dtype"] == "bfloat16" and one["host_cache_bytes"] > 0
    fits = engine("--budget", "4GiB")
    assert fits["max_loras_fit"] == (4 << 30) // fits["slot_bytes"]
    narrow = engine("--modules", "q_proj,o_proj")
    assert {m["module"] for m in narrow["modules"]} == {"self_attn.qkv_proj",
                                                        "self_attn.o_proj"}


@pytest.mark.parametrize(("args", "says"), [
    (["layout", "--model", "qwen3-8b", "--engine", "tgi"], "--engine 'tgi'"),
    (["layout", "--model", "qwen3-8b", "--engine", "vllm", "--max-rank", "600"],
     "--max-rank 600: past 512, the largest --max-lora-rank vLLM 0.32.0 takes"),
    (["layout", "--model", "qwen3-8b", "--engine", "vllm", "--modules", "nope"],
     "vLLM's LoRA modules of this model"),
    (["layout", "--model", "qwen3-8b", "--engine", "vllm", "--lora-dtype", "int8"],
     "--lora-dtype 'int8'"),
    (["layout", "--model", "qwen3-8b", "--dtype", "float16"], "--dtype needs --engine vllm"),
    (["layout", "--model", "qwen3-8b", "--engine", "vllm", "--max-loras", "4",
      "--max-cpu-loras", "2"], "below --max-loras"),
    (["layout", "--model", "qwen3-8b", "--engine", "vllm", "--tp", "3"],
     "do not split over --tp 3"),
])
def test_bad_flags_are_one_line_exit_2(args: list[str], says: str) -> None:
    done = metrale(*args)
    assert done.code == 2 and says in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_inspect_vllm_only_options_need_the_engine(adapters: dict[str, Path]) -> None:
    done = metrale("inspect", adapters["plain"], "--tp", 2)
    assert done.code == 2 and "--tp needs --engine vllm" in done.stderr


@pytest.mark.proc
def test_engine_vllm_imports_no_torch(adapters: dict[str, Path]) -> None:
    code = ("import sys\nfrom metrale_cli.cli.app import main\n"
            "sys.argv = ['metrale'] + sys.argv[1:]\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "bad = [m for m in ('torch', 'cupy', 'vllm') if m in sys.modules]\n"
            "assert not bad, bad\n")
    for args in (["inspect", str(adapters["plain"]), "--engine", "vllm"],
                 ["layout", "--engine", "vllm", "--model", "qwen3-30b-a3b", "--tp", "4"]):
        done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True,
                              text=True)
        assert done.returncode == 0, (args, done.stderr)


@pytest.mark.parametrize("slots, says", [(1, "for 1 adapter, per TP worker"),
                                         (2, "for 2 adapters, per TP worker")])
def test_layout_host_cache_counts_adapters_in_english(slots: int, says: str) -> None:
    done = metrale("layout", "--engine", "vllm", "--model", "qwen3-8b", "--max-loras", slots,
                   "--max-rank", 16, "--modules", "q_proj")
    assert done.code == 0 and says in done.stdout, done.stdout


def test_a_mistyped_engine_gets_the_nearest_name(tmp_path: Path) -> None:
    done = metrale("inspect", tmp_path, "--engine", "vlm")
    assert done.code == 2 and done.stderr == (
        "error: --engine 'vlm' (did you mean 'vllm'?): one of metrale, vllm, sglang (a version "
        "as vllm==0.32.0)\n")


@pytest.mark.parametrize(("value", "says"), [
    ("abc", "missing or not a positive integer"), ([4], "missing or not a positive integer"),
    (-4, "missing or not a positive integer"), (1e30, "missing or not a positive integer"),
    (True, "missing or not a positive integer"),
    (10**30, f"is {10**30}, above the 4,194,304 that metrale accepts; not a real model's "
             "config"),
])
def test_the_gdn_convolution_width_is_checked_as_every_width(tmp_path: Path, value: object,
                                                              says: str) -> None:
    """Qwen3.5's `linear_conv_kernel_dim`, which vLLM wraps as conv1d's input width: a bad
    value is one line and exit 2, as a bad `hidden_size` is, never a traceback or a size."""
    config = json.loads((DATA / "qwen3.5-35b-a3b.config.json").read_text())
    good = tmp_path / "good.json"
    good.write_text(json.dumps(config))
    args = ["layout", "--engine", "vllm", "--max-rank", 16, "--json"]
    conv = [m for m in metrale(*args, "-m", good).json()["engine"]["modules"]
            if m["module"] == "linear_attn.conv1d"]
    assert conv and conv[0]["buffers"][0][1][-1] == 4
    config["text_config"]["linear_conv_kernel_dim"] = value
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(config))
    done = metrale(*args, "-m", bad)
    assert done.code == 2 and done.stdout == ""
    assert done.stderr == f"error: {bad}: 'linear_conv_kernel_dim' {says}\n"


def test_inspect_reads_the_config_once_for_the_rules(adapters: dict[str, Path],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The base model's config.json is read twice per `inspect --engine vllm`: once for
    ModelConfig, once for the keys the vLLM rules read besides (dtype, the convolution
    width), however many modules and flags ask; a 50 MB config took a minute at 21 reads."""
    reads: dict[Path, int] = {}
    read_bytes = Path.read_bytes

    def counted(path: Path) -> bytes:
        if path.name == "config.json":
            reads[path] = reads.get(path, 0) + 1
        return read_bytes(path)

    base = adapters["base"] / "config.json"
    monkeypatch.setattr(Path, "read_bytes", counted)
    done = metrale("inspect", adapters["plain"], "-m", base, "--engine", "vllm", "--max-rank",
                   64, "--max-loras", 2, "--json")
    assert done.code == 0, done.stderr
    assert reads == {base: 2}


def test_inspect_tp_alone_keeps_the_recommended_flags(adapters: dict[str, Path]) -> None:
    """`--tp 2` alone is the user's TP degree; every flag not given stays the recommended one
    (not vLLM's defaults, rank 16 and one slot, which would refuse the rank-40 adapter), and the
    LoRA bytes per GPU are `layout --tp 2`'s: fully sharded LoRA is said to save bytes, never
    assumed."""
    named = [f"plain={adapters['plain']}", f"ranked={adapters['ranked']}"]
    done = metrale("inspect", *named, "--engine", "vllm", "--tp", 2, "--json")
    assert done.code == 0, done.stdout
    engine = done.json()["engine"]
    rec = engine["recommended"]
    assert engine["flags_source"] == "given"
    assert engine["flags"] == {**rec["flags"], "tensor_parallel_size": 2}
    assert (engine["flags"]["max_lora_rank"], engine["flags"]["max_loras"]) == (64, 2)
    assert not engine["flags"]["fully_sharded_loras"]
    assert "--tensor-parallel-size 2" in rec["serve"] and "--fully-sharded" not in rec["serve"]
    laid = metrale("layout", *named, "--engine", "vllm", "--tp", 2, "--json")
    assert laid.code == 0, laid.stderr
    assert rec["lora_bytes"] == laid.json()["engine"]["lora_bytes"]
    sharded = metrale("layout", *named, "--engine", "vllm", "--tp", 2, "--fully-sharded",
                      "--json").json()["engine"]["lora_bytes"]
    assert rec["fully_sharded_saves_bytes"] == rec["lora_bytes"] - sharded > 0
    # A flag given is the user's, the rest still recommended: for the adapters vLLM loads
    # under it (one slot: the rank-40 adapter is left out).
    given = metrale("inspect", *named, "--engine", "vllm", "--tp", 2, "--max-rank", 16,
                    "--json")
    assert given.code == 1
    flags = given.json()["engine"]["flags"]
    assert (flags["max_lora_rank"], flags["max_loras"], flags["tensor_parallel_size"]) == (
        16, 1, 2)


# GLM-4.5-Air's shape (zai-org/GLM-4.5-Air config.json): 46 layers, the first dense, then 128
# routed experts and one shared expert of moe_intermediate_size 1408 beside them.
GLM45_AIR = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
             "hidden_size": 4096, "num_hidden_layers": 46, "num_attention_heads": 96,
             "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 10944,
             "moe_intermediate_size": 1408, "n_routed_experts": 128, "n_shared_experts": 1,
             "num_experts_per_tok": 8, "first_k_dense_replace": 1, "vocab_size": 151552,
             "torch_dtype": "bfloat16"}


def test_glm4_moe_shared_experts_take_vllm_buffers_in_layout_and_simulate(
        tmp_path: Path) -> None:
    """glm4_moe.py's shared experts are one dense MLP, n_shared_experts x
    moe_intermediate_size wide, on each MoE layer: `layout --engine vllm` gives their
    MergedColumn / Row buffers (lora/layers `create_lora_weights`) at TP 2, and `simulate`
    swaps slots of the bytes `layout` gives; metrale's own TP 2 rank slot for the same MLPs is
    vLLM's."""
    (tmp_path / "config.json").write_text(json.dumps(GLM45_AIR))
    args = ["--engine", "vllm", "-m", tmp_path, "--max-rank", 16, "--max-loras", 2,
            "--tp", 2]
    done = metrale("layout", *args, "--json")
    assert done.code == 0, done.stderr
    engine = done.json()["engine"]
    modules = {m["module"]: m for m in engine["modules"]}
    L, R, H, S = 2, 16, 4096, 1408
    assert modules["mlp.shared_experts.gate_up_proj"]["buffers"] == [
        ["lora_a", [L, 1, R, H]]] * 2 + [["lora_b", [L, 1, S // 2, R]]] * 2
    assert modules["mlp.shared_experts.down_proj"]["buffers"] == [
        ["lora_a", [L, 1, R, S // 2]], ["lora_b", [L, 1, H, R]]]
    per_layer = (2 * L * R * H + 2 * L * (S // 2) * R) + (L * R * (S // 2) + L * H * R)
    assert (modules["mlp.shared_experts.gate_up_proj"]["bytes"]
            + modules["mlp.shared_experts.down_proj"]["bytes"]) == 45 * per_layer * 2
    assert "mlp.shared_experts_gate" not in modules
    sim = metrale("simulate", *args, "--modules", "qkv_proj,gate_up_proj,down_proj",
                  "--workload", "zipf", "--adapters", 8, "--requests", 200,
                  "--input-tokens", 0, "--output-tokens", 0, "--ranks", 16, "--json")
    assert sim.code == 0, sim.stderr
    narrowed = metrale("layout", *args, "--modules", "qkv_proj,gate_up_proj,down_proj",
                       "--json").json()["engine"]
    assert sim.json()["swap"]["slot_bytes"] == narrowed["slot_bytes"]
    assert {m["module"] for m in narrowed["modules"]} >= {
        "mlp.shared_experts.gate_up_proj", "mlp.shared_experts.down_proj"}
    # metrale's own pool at TP 2 reserves the same gate, up and down (the first layer's dense
    # MLP, the shared experts after it) to the byte: a rank's slot is vLLM's.
    ours = metrale("layout", "-m", tmp_path, "--modules", "gate_proj,up_proj,down_proj",
                   "--max-rank", 16, "--tp", 2, "--max-loras", 1, "--json")
    mlp = metrale("layout", "--engine", "vllm", "-m", tmp_path, "--modules",
                  "gate_up_proj,down_proj", "--max-rank", 16, "--tp", 2, "--max-loras", 1,
                  "--dtype", "bfloat16", "--json")
    assert ours.code == mlp.code == 0, (ours.stderr, mlp.stderr)
    assert {g["slot_bytes"] for g in ours.json()["rank_layouts"]} == {
        mlp.json()["engine"]["slot_bytes"]}
