"""metrale's SGLang 0.5.23 rules (metrale_cli/engines/sglang/rules.py) against SGLang's own LoRA
code running on CPU tensors (tests/support/sglang_runner.py under .venv-sglang) on PEFT-made
adapters, every case in one runner process: whether the load accepts each adapter on each path
(and SGLang's error class and text when not), what its first batch does, the scaling its adapter
object holds, its normalised targets, the pool start-up builds, and which of the file's weights
land in the pool slot. Then the rules that cannot run here, held to the source text they cite."""

from __future__ import annotations

import ast
import functools
import json
import math
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from safetensors import safe_open

from metrale_cli.engines.sglang import flags as sglang_flags
from metrale_cli.engines.sglang import model as sglang_model
from metrale_cli.engines.sglang import rules as sglang
from metrale_cli.engines.verdict import Verdict
from metrale_cli.model.config import ModelConfig
from tests.conftest import SGLANG_PYTHON
from tests.support.cli_runner import metrale
from tests.support.engine_cases import run_job
from tests.support.peft_factory import make_adapter

RUNNER = Path(__file__).parent / "support" / "sglang_runner.py"
SGLANG_SRC = SGLANG_PYTHON.parent.parent / "lib" / "python3.11" / "site-packages" / "sglang" / "srt"

_ALL_DENSE = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name: (tiny model, make_adapter kwargs); "config" rewrites adapter_config.json keys after.
ADAPTERS: dict[str, tuple[str, dict[str, Any]]] = {
    "plain": ("llama", {"r": 4, "lora_alpha": 8}),
    "rslora": ("llama", {"r": 4, "lora_alpha": 8, "use_rslora": True}),
    "alpha_pattern": ("llama", {"r": 4, "lora_alpha": 8, "alpha_pattern": {"o_proj": 16}}),
    "layers_to_transform": ("llama", {"r": 4, "lora_alpha": 8, "layers_to_transform": [1]}),
    "lora_bias": ("llama", {"r": 4, "lora_alpha": 8, "lora_bias": True}),
    "modules_to_save": ("llama", {"r": 4, "lora_alpha": 8, "modules_to_save": ["lm_head"]}),
    "trainable_tokens": ("llama", {"r": 4, "lora_alpha": 8, "trainable_token_indices": [3, 5]}),
    # PEFT saves "all-linear" as the list of module paths it matched.
    "all_linear_peft": ("llama", {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}),
    "dora": ("llama", {"r": 4, "lora_alpha": 8, "use_dora": True}),
    "q_no_v": ("llama", {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}),
    "v_only": ("llama", {"r": 4, "lora_alpha": 8, "target_modules": ["v_proj"]}),
    "rank_above": ("llama", {"r": 8, "lora_alpha": 8}),
    "outside_targets": ("llama", {"r": 4, "lora_alpha": 8,
                                  "target_modules": ["q_proj", "v_proj", "lm_head"]}),
    "rank_pattern_q": ("llama", {"r": 4, "lora_alpha": 8, "rank_pattern": {"q_proj": 8}}),
    "rank_pattern_o": ("llama", {"r": 4, "lora_alpha": 8, "rank_pattern": {"o_proj": 2}}),
    "layer_replication": ("llama", {"r": 4, "lora_alpha": 8,
                                    "layer_replication": [[0, 2], [1, 2]]}),
    "regex": ("llama", {"r": 4, "lora_alpha": 8, "target_modules": r".*\.(q_proj|v_proj)"}),
    "modules_to_save_in_layer": ("llama", {"r": 4, "lora_alpha": 8,
                                           "modules_to_save": ["post_attention_layernorm"]}),
    "embedding": ("llama", {"r": 4, "lora_alpha": 8,
                            "target_modules": ["embed_tokens", "q_proj", "v_proj"]}),
    "lm_head": ("llama", {"r": 8, "lora_alpha": 8,
                          "target_modules": ["lm_head", "q_proj", "v_proj"]}),
    # A hand-written (or older PEFT) config keeping the string.
    "all_linear_string": ("llama", {"r": 4, "lora_alpha": 8, "config": {
        "target_modules": "all-linear"}}),
    # added_tokens.json: two tokens past the 128-row vocabulary; a copy of base tokens.
    "added_tokens": ("llama", {"r": 4, "lora_alpha": 8,
                               "added_tokens": {"<a>": 128, "<b>": 129}}),
    "added_tokens_copied": ("llama", {"r": 4, "lora_alpha": 8, "added_tokens": {"<s>": 1}}),
    "q3_plain": ("qwen3", {"r": 4, "lora_alpha": 16}),
    "q3_alpha": ("qwen3", {"r": 2, "lora_alpha": 3, "target_modules": ["q_proj", "v_proj"]}),
    "q2_plain": ("qwen2", {"r": 4, "lora_alpha": 8}),
    "q2_bias_all": ("qwen2", {"r": 4, "lora_alpha": 8, "bias": "all"}),
    "q2_bias_lora_only": ("qwen2", {"r": 4, "lora_alpha": 8, "bias": "lora_only"}),
    "m_plain": ("mistral", {"r": 8, "lora_alpha": 16}),
    # The families' dense classes (SGLang's gemma3_causal.py, granite.py, commandr.py, olmo2.py:
    # the same qkv_proj / gate_up_proj layers, no get_hidden_dim of their own), and the fused
    # checkpoints: phi3's qkv_proj and gate_up_proj, glm4's gate_up_proj, each one PEFT pair.
    "gemma3_plain": ("gemma3_text", {"r": 4, "lora_alpha": 8}),
    "granite_plain": ("granite", {"r": 4, "lora_alpha": 8}),
    "cohere_plain": ("cohere", {"r": 4, "lora_alpha": 8}),
    "olmo2_plain": ("olmo2", {"r": 4, "lora_alpha": 8}),
    "phi3_fused": ("phi3", {"r": 4, "lora_alpha": 8}),
    "phi3_qkv": ("phi3", {"r": 4, "lora_alpha": 8, "target_modules": ["qkv_proj"]}),
    "glm4_fused": ("glm4", {"r": 4, "lora_alpha": 8}),
    # The other dense families with a native class (gemma.py, gemma2.py, olmo2.py for OLMo 3,
    # commandr.py, exaone4.py): every module.
    **{f"{family}_plain": (family, {"r": 4, "lora_alpha": 8})
       for family in ("gemma", "gemma2", "olmo3", "cohere2", "exaone4")},
    # Families SGLang has no class for: its Transformers backend around the HF model. Each
    # family's every-module adapter (o_proj and down_proj wrapped: the first forward fails)
    # and a q/v one (nothing wrapped: ignored); lm_head is wrapped as on a native class.
    **{f"{family}_{kind}": (family, {"r": 4, "lora_alpha": 8, **kwargs})
       for family in ("seed_oss", "smollm3", "ministral", "ernie4_5")
       for kind, kwargs in (("plain", {}), ("qv", {"target_modules": ["q_proj", "v_proj"]}))},
    "seed_oss_head": ("seed_oss", {"r": 4, "lora_alpha": 8,
                                   "target_modules": ["q_proj", "v_proj", "lm_head"]}),
    # ERNIE 4.5 under SGLang's own class name (models/ernie4.py): a Llama-shaped class.
    "ernie4_5_native": ("ernie4_5", {"r": 4, "lora_alpha": 8,
                                     "architecture": "Ernie4_5_ForCausalLM"}),
}

# Each job: one server. "flags": --max-lora-rank / --lora-target-modules.
JOBS: dict[str, dict[str, Any]] = {
    "llama": {"startup": ["plain", "rslora", "alpha_pattern", "layers_to_transform",
                          "lora_bias", "modules_to_save", "trainable_tokens",
                          "all_linear_peft"],
              "runtime": ["dora", "q_no_v", "v_only", "rank_above", "outside_targets",
                          "rank_pattern_q", "rank_pattern_o", "layer_replication", "regex",
                          "modules_to_save_in_layer", "embedding", "added_tokens",
                          "added_tokens_copied"]},
    "llama_all": {"flags": {"max_lora_rank": 8, "lora_target_modules": ["all"]},
                  "startup": ["embedding", "lm_head"],
                  "runtime": ["all_linear_string", "rank_pattern_o", "regex"]},
    "qwen3": {"startup": ["q3_plain"], "runtime": ["q3_alpha"]},
    "qwen2": {"startup": ["q2_plain", "q2_bias_all", "q2_bias_lora_only"]},
    "mistral": {"startup": ["m_plain"]},
    "gemma3": {"startup": ["gemma3_plain"]},
    "granite": {"startup": ["granite_plain"]},
    "cohere": {"startup": ["cohere_plain"]},
    "olmo2": {"startup": ["olmo2_plain"]},
    "phi3": {"startup": ["phi3_fused"], "runtime": ["phi3_qkv"]},
    "glm4": {"startup": ["glm4_fused"]},
    **{family: {"startup": [f"{family}_plain"]}
       for family in ("gemma", "gemma2", "olmo3", "cohere2")},
    # SGLang's server arguments refuse EXAONE 4 under the CPU's attention backend (intel_amx:
    # model_hook.py `handle_model_specific_adjustments` accepts fa3, triton, trtllm_mha); the
    # LoRA code runs no attention, so the job names triton, a GPU server's.
    "exaone4": {"startup": ["exaone4_plain"], "attention_backend": "triton"},
    # The Transformers backend: a pool of q/v (and lm_head) serves nothing of q/v, and refuses
    # an every-module adapter at runtime (o_proj is outside it); a pool with o_proj/down_proj
    # fails its first forward.
    "seed_oss": {"startup": ["seed_oss_qv", "seed_oss_head"], "runtime": ["seed_oss_plain"]},
    **{family: {"startup": [f"{family}_qv"], "runtime": [f"{family}_plain"]}
       for family in ("smollm3", "ministral", "ernie4_5")},
    **{f"{family}_all": {"startup": [f"{family}_plain"]}
       for family in ("seed_oss", "smollm3", "ministral", "ernie4_5")},
    "ernie4_5_native": {"startup": ["ernie4_5_native"]},
    "startup_dora": {"startup": ["plain", "dora"]},
    "startup_regex": {"startup": ["regex"]},
    "startup_layer_replication": {"startup": ["layer_replication"]},
    "startup_rank_pattern_q": {"startup": ["rank_pattern_q"]},
    "startup_outside_targets": {"flags": {"lora_target_modules": ["q_proj", "v_proj"]},
                                "startup": ["plain"]},
    "startup_rank_above": {"flags": {"max_lora_rank": 2}, "startup": ["plain"]},
    "startup_all_linear_string": {"startup": ["all_linear_string"]},
    "startup_added_tokens": {"startup": ["added_tokens"]},
}

# The families' jobs: SGLang's own LoRA code on their PEFT adapters.
FAMILY_JOBS = ("gemma3", "granite", "cohere", "olmo2", "phi3", "glm4", "seed_oss", "smollm3",
               "ministral", "ernie4_5", "ernie4_5_native", "gemma", "gemma2", "olmo3",
               "cohere2", "exaone4")
# The jobs whose model SGLang builds on its Transformers backend.
HF_BACKBONE_JOBS = ("seed_oss", "smollm3", "ministral", "ernie4_5", "seed_oss_all",
                    "smollm3_all", "ministral_all", "ernie4_5_all")

# The tests that read the runner's answers; the source rules need only the installed files.
_RUN = [pytest.mark.sglang, pytest.mark.proc, pytest.mark.slow]


def _runs(test: Any) -> Any:
    for mark in _RUN:
        test = mark(test)
    return test


@pytest.fixture(scope="module")
def sglang_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every adapter made by PEFT, every job through one runner process."""
    tmp = tmp_path_factory.mktemp("sglang")
    made: dict[str, Any] = {}
    for seed, (name, (model, kwargs)) in enumerate(ADAPTERS.items()):
        kwargs = dict(kwargs)
        rewrite = kwargs.pop("config", None)
        tokens = kwargs.pop("added_tokens", None)
        architecture = kwargs.pop("architecture", None)
        made[name] = make_adapter(model, tmp / name, seed=seed, **kwargs)
        if architecture:
            base_config = made[name].base_dir / "config.json"
            base_config.write_text(json.dumps({**json.loads(base_config.read_text()),
                                               "architectures": [architecture]}))
        if tokens:
            (made[name].path / "added_tokens.json").write_text(json.dumps(tokens))
        if rewrite:
            config_path = made[name].path / "adapter_config.json"
            config = json.loads(config_path.read_text())
            config.update(rewrite)
            config_path.write_text(json.dumps(config))
    jobs = []
    for job in JOBS.values():
        first = made[(job["startup"] + job.get("runtime", []))[0]]
        jobs.append({"model": str(first.base_dir), "dtype": "float32", "max_loras_per_batch": 4,
                     **job.get("flags", {}),
                     "attention_backend": job.get("attention_backend"),
                     **{p: [{"name": n, "path": str(made[n].path)} for n in job.get(p, [])]
                        for p in ("startup", "runtime")}})
    report, _ = run_job(SGLANG_PYTHON, RUNNER, tmp, {"jobs": jobs}, "SGLang runner")
    return {"made": made, "jobs": dict(zip(JOBS, report["jobs"], strict=True))}


def _config(truth: Any) -> dict[str, Any]:
    return json.loads((truth.path / "adapter_config.json").read_text())


def _shapes(truth: Any) -> dict[str, tuple[int, ...]]:
    return {n: tuple(s) for n, (_, s) in truth.tensors.items()}


def _pool(run: dict[str, Any], job: str) -> tuple[int, set[str]]:
    spec = JOBS[job]
    return sglang.startup_pool([_config(run["made"][n]) for n in spec["startup"]],
                               **spec.get("flags", {}))


def _judge(run: dict[str, Any], job: str, name: str, path: str) -> sglang.Judgement:
    truth = run["made"][name]
    base = json.loads((truth.base_dir / "config.json").read_text())
    return sglang.judge(name, _config(truth), _shapes(truth), pool=_pool(run, job), path=path,
                        added_tokens=sglang.added_tokens(truth.path, base["vocab_size"]),
                        num_hidden_layers=base["num_hidden_layers"],
                        hf_backbone=sglang_model.hf_backbone(ModelConfig.from_hf(truth.base_dir)),
                        lora_backend="torch_native")  # the runner's backend


@_runs
def test_the_startup_pool_is_the_one_sglang_builds(sglang_run: dict[str, Any]) -> None:
    for job, report in sglang_run["jobs"].items():
        if not report["started"]:
            continue
        rank, targets = _pool(sglang_run, job)
        assert (rank, sorted(targets)) == (report["max_lora_rank"], report["target_modules"]), job


@_runs
def test_every_load_is_judged_as_sglang_judges_it(sglang_run: dict[str, Any]) -> None:
    """Start-up: the server starts, or the first failing adapter's error stops it; runtime:
    each load accepted, or SGLang's error class and text (the HTTP 400's message)."""
    checked = 0
    for job, report in sglang_run["jobs"].items():
        startup = [_judge(sglang_run, job, n, "startup") for n in JOBS[job]["startup"]]
        refused = [j for j in startup if not j.accepted]
        assert report["started"] == (not refused), (job, report.get("start_error"))
        if refused:
            assert refused[0].verdict is Verdict.FAILS_STARTUP
            assert (refused[0].error_type, refused[0].error) == (
                report["start_error"]["type"], report["start_error"]["text"]), job
            checked += 1
            continue
        for entry in report["runtime"]:
            got = _judge(sglang_run, job, entry["name"], "runtime")
            assert got.accepted == entry["accepted"], (job, entry)
            if not got.accepted:
                assert got.verdict is Verdict.REFUSES
                assert (got.error_type, got.error) == (entry["error"]["type"],
                                                       entry["error"]["text"]), (job, entry)
            checked += 1
    assert checked >= 16


@_runs
def test_first_batches_fail_where_sglang_fails(sglang_run: dict[str, Any]) -> None:
    """An accepted adapter's first batch copies it into a pool slot; where that raises, the
    scheduler's forward step raises (the server goes down)."""
    crashes = set()
    for job, report in sglang_run["jobs"].items():
        for path in ("startup", "runtime"):
            for entry in report[path]:
                if not entry["accepted"]:
                    continue
                got = _judge(sglang_run, job, entry["name"], path)
                batch = entry["batch"]
                assert (not got.batch_error_type) == batch["ok"], (job, entry["name"], batch)
                if batch["ok"]:
                    continue
                assert got.verdict is Verdict.CRASHES
                assert got.batch_error_type == batch["error"]["type"], (job, entry["name"])
                text = batch["error"]["text"]
                if got.batch_error_type == "ValueError":
                    # SGLang prints the pool's targets as a set, in its hash order.
                    head, _, targets = text.partition(" in {")
                    mine, _, my_targets = got.batch_error.partition(" in {")
                    assert head == mine and set(re.findall(r"'([^']+)'", targets)) == \
                        set(re.findall(r"'([^']+)'", my_targets))
                else:  # the first mismatched module, SGLang visiting a set's order
                    assert text in got.batch_errors, (job, entry["name"], text)
                crashes.add((job, entry["name"]))
    assert crashes == {("llama", "v_only"), ("llama", "rank_pattern_o"),
                       ("llama", "modules_to_save_in_layer"), ("llama_all", "rank_pattern_o"),
                       ("startup_rank_above", "plain"),
                       *((f"{f}_all", f"{f}_plain")
                         for f in ("seed_oss", "smollm3", "ministral", "ernie4_5"))}


@_runs
def test_the_class_sglang_builds_is_the_rows(sglang_run: dict[str, Any]) -> None:
    """SGLang's own class resolution (get_model_architecture) picks its Transformers backend
    exactly where metrale's family row says (`hf_backbone`), and there its LoRA manager wraps
    the pool's targets but qkv_proj and gate_up_proj, which name no module of the HF model; an
    adapter that reaches only those is `ignores`, one with lm_head beside them `differs`."""
    for job, report in sglang_run["jobs"].items():
        base = sglang_run["made"][JOBS[job]["startup"][0]].base_dir
        backbone = report["model_class"].startswith("Transformers")
        assert sglang_model.hf_backbone(ModelConfig.from_hf(base)) == backbone, job
        assert backbone == (job in HF_BACKBONE_JOBS), (job, report["model_class"])
        if backbone:
            assert report["wrapped"] == sorted(
                set(report["target_modules"]) - sglang.HF_BACKBONE_UNWRAPPED), job
    assert sglang_run["jobs"]["ernie4_5_native"]["model_class"] == "Ernie4_5_ForCausalLM"
    for name, verdict in (("seed_oss_qv", Verdict.IGNORES), ("seed_oss_head", Verdict.DIFFERS),
                          ("smollm3_qv", Verdict.IGNORES), ("ernie4_5_native", Verdict.SERVES)):
        job = next(j for j, spec in JOBS.items() if spec["startup"][0] == name
                   or name in spec["startup"])
        assert _judge(sglang_run, job, name, "startup").verdict is verdict, name


@_runs
def test_pool_bytes_are_the_buffers_sglang_allocates(sglang_run: dict[str, Any]) -> None:
    for job in ("llama", "qwen3", "qwen2", "mistral", "startup_rank_above", *FAMILY_JOBS):
        report = sglang_run["jobs"][job]
        base = sglang_run["made"][JOBS[job]["startup"][0]].base_dir
        pool = sglang_model.Pool(report["max_lora_rank"], frozenset(report["target_modules"]))
        predicted = sglang_model.Memory.of(
            ModelConfig.from_hf(base), sglang_flags.Flags(max_loras_per_batch=4, dtype="float32"),
            pool).lora_bytes
        assert predicted == report["pool"]["bytes"] == sum(
            b[-1] for b in report["pool"]["buffers"]), job


@_runs
def test_scaling_and_targets_are_sglangs(sglang_run: dict[str, Any]) -> None:
    seen = 0
    for report in sglang_run["jobs"].values():
        for entry in report["startup"] + report["runtime"]:
            if not entry["accepted"]:
                continue
            config = _config(sglang_run["made"][entry["name"]])
            assert sglang.scaling(config) == entry["scaling"], entry["name"]
            assert sorted(sglang.normalised_targets(config["target_modules"])) == \
                entry["target_modules"], entry["name"]
            seen += 1
    assert seen >= 20


def _sglang_buffer(tensor: str) -> str | None:
    """Where a LoRA tensor PEFT applies goes in SGLang's pool (by its module's name)."""
    module = tensor.rsplit(".lora_", 1)[0].rsplit(".", 1)[-1]
    side = "A" if "lora_A" in tensor or "lora_embedding_A" in tensor else "B"
    if module == "embed_tokens":
        return f"embedding_{side}.embed_tokens"
    if module == "lm_head":
        return f"lm_head_{side}.lm_head"
    return f"{side}.{sglang.normalised_targets([module]).pop()}"


@_runs
def test_the_slot_holds_peft_lora_weights_and_nothing_else(sglang_run: dict[str, Any]) -> None:
    """After the first batch each pool buffer's slot holds exactly the LoRA A/B tensors PEFT
    applies for it (their absolute sums match): biases, modules_to_save and trainable tokens
    are not there, as `differs` says, and nothing is scaled into B; on the Transformers
    backend, nothing of q/k/v or gate/up either."""
    for job, report in sglang_run["jobs"].items():
        for entry in report["startup"] + report["runtime"]:
            if not (entry["accepted"] and entry["batch"]["ok"]):
                continue
            truth = sglang_run["made"][entry["name"]]
            want: dict[tuple[str, int], float] = {}
            with safe_open(str(truth.path / "adapter_model.safetensors"), "pt") as f:
                for module in truth.modules.values():
                    for key in (module.a_key, module.b_key):
                        where = (_sglang_buffer(key), module.layer or 0)
                        # A fused PEFT A (phi3's qkv_proj) is stacked once per slice
                        # (lora.py normalize_qkv_proj / normalize_gate_up_proj repeat it).
                        copies = _FUSED_SLICES.get(module.path.rsplit(".", 1)[-1], 1) \
                            if key == module.a_key else 1
                        want[where] = want.get(where, 0.0) + copies * float(
                            f.get_tensor(key).double().abs().sum())
                for key in truth.tensors:  # PEFT's embedding LoRA is no Linear of `modules`
                    if "lora_embedding" in key:
                        want[(_sglang_buffer(key), 0)] = float(
                            f.get_tensor(key).double().abs().sum())
            if job in HF_BACKBONE_JOBS:
                # A slot takes a layer's weights for the modules wrapped on it (mem_pool.py
                # load_lora_weight_to_buffer): none named qkv_proj or gate_up_proj there.
                want = {k: v for k, v in want.items()
                        if k[0].split(".", 1)[-1] not in sglang.HF_BACKBONE_UNWRAPPED}
            for buffer, per_layer in entry["batch"]["mass"].items():
                for layer, mass in enumerate(per_layer):
                    assert math.isclose(mass, want.get((buffer, layer), 0.0), rel_tol=1e-6,
                                        abs_tol=1e-9), (job, entry["name"], buffer, layer)


# Slices of a layer that PEFT can adapt whole (phi3's qkv_proj, phi3's and glm4's gate_up_proj).
_FUSED_SLICES = {"qkv_proj": 3, "gate_up_proj": 2}


def _parts(model: dict[str, Any], fused: str) -> list[tuple[str, int]]:
    """The PEFT modules SGLang stacks into `fused`, with their output widths."""
    head_dim = model.get("head_dim") or model["hidden_size"] // model["num_attention_heads"]
    if fused == "qkv_proj":
        kv = model["num_key_value_heads"] * head_dim
        return [("q_proj", model["num_attention_heads"] * head_dim), ("k_proj", kv),
                ("v_proj", kv)]
    if fused == "gate_up_proj":
        return [("gate_proj", model["intermediate_size"]), ("up_proj", model["intermediate_size"])]
    return [(fused, 0)]


@_runs
def test_sglang_applies_peft_delta_at_its_own_scale(sglang_run: dict[str, Any]) -> None:
    """One decode step through SGLang's own LoRA layers: each layer's output delta is PEFT's
    own forward delta for the same input, times SGLang's scale over PEFT's for that module;
    so an adapter judged `serves` gives PEFT's outputs, and rsLoRA and alpha_pattern give
    others. lora_bias is the one whose delta lacks a term (the lora_B bias)."""
    import torch

    compared = 0
    for job, report in sglang_run["jobs"].items():
        for path in ("startup", "runtime"):
            for entry in report[path]:
                if not (entry["accepted"] and entry["batch"]["ok"]):
                    continue
                truth = sglang_run["made"][entry["name"]]
                config = _config(truth)
                model = json.loads((truth.base_dir / "config.json").read_text())
                judged = _judge(sglang_run, job, entry["name"], path)
                exact = same_as_peft = True
                for sg_path, seen in entry["batch"]["deltas"].items():
                    x = torch.tensor([seen["x"]])
                    prefix, fused = sg_path.rsplit(".", 1)
                    want, peft = [], []
                    # PEFT's own fused module where the checkpoint fuses it, else its parts.
                    whole = f"{prefix}.{fused}" in truth.modules
                    for leaf, width in [(fused, 0)] if whole else _parts(model, fused):
                        module = truth.modules.get(f"{prefix}.{leaf}")
                        if module is None:
                            want.append(torch.zeros(width or len(seen["delta"])))
                            peft.append(want[-1])
                            continue
                        peft.append(truth.forward_delta(module.path, x)[0])
                        want.append(peft[-1] * sglang.scaling(config) / module.scaling)
                    got = torch.tensor(seen["delta"])
                    exact &= torch.allclose(got, torch.cat(want), rtol=1e-4, atol=1e-5)
                    same_as_peft &= torch.allclose(got, torch.cat(peft), rtol=1e-4, atol=1e-5)
                    compared += 1
                assert exact == (judged.reason_class != "lora_bias"), (job, entry["name"])
                if judged.reason_class in ("", "rslora", "alpha_pattern"):
                    assert same_as_peft == (judged.verdict is Verdict.SERVES), entry["name"]
    assert compared > 100


@_runs
def test_differs_names_what_sglang_serves_otherwise(sglang_run: dict[str, Any]) -> None:
    def differs(name: str) -> tuple[str, ...]:
        job = next(j for j, spec in JOBS.items() if name in spec["startup"])
        got = _judge(sglang_run, job, name, "startup")
        assert got.verdict is (Verdict.DIFFERS if got.differs else Verdict.SERVES)
        return got.differs

    for plain in ("plain", "layers_to_transform", "all_linear_peft", "q2_plain", "q3_plain",
                  "m_plain"):
        assert differs(plain) == (), plain
    assert differs("rslora") == ("scale 2 (lora_alpha / r) on every module where PEFT "
                                 "applies 4 (rsLoRA)",)
    assert differs("alpha_pattern") == ("scale 2 (lora_alpha / r) on every module where PEFT "
                                        "applies 4 (alpha_pattern)",)
    assert differs("modules_to_save") == ("modules_to_save ['lm_head'] not loaded",)
    assert differs("trainable_tokens") == ("trainable tokens [3, 5] not loaded",)
    assert differs("lora_bias") == ("lora_bias: the lora_B biases not loaded",)
    assert differs("q2_bias_all") == ("bias='all': the 6 trained bias tensors not loaded",)
    assert differs("q2_bias_lora_only") == (
        "bias='lora_only': the 6 trained bias tensors not loaded",)


@_runs
def test_each_reason_has_its_class(sglang_run: dict[str, Any]) -> None:
    expected = {
        ("llama", "dora", "runtime"): "dora",
        ("llama", "added_tokens", "runtime"): "added_tokens",
        ("llama", "q_no_v", "runtime"): "fused_part_missing",
        ("llama", "rank_pattern_q", "runtime"): "fused_rank_mismatch",
        ("llama", "rank_above", "runtime"): "rank_above_max",
        ("llama", "outside_targets", "runtime"): "target_modules",
        ("llama", "layer_replication", "runtime"): "layer_past_base",
        ("llama", "regex", "runtime"): "string_target_modules",
        ("startup_outside_targets", "plain", "startup"): "startup_target_modules",
        ("llama", "v_only", "runtime"): "no_target_module",
        ("llama", "rank_pattern_o", "runtime"): "slot_shape",
        ("llama", "rslora", "startup"): "rslora",
        ("llama", "alpha_pattern", "startup"): "alpha_pattern",
        ("llama", "modules_to_save", "startup"): "modules_to_save",
        ("llama", "trainable_tokens", "startup"): "trainable_tokens",
        ("llama", "lora_bias", "startup"): "lora_bias",
        ("qwen2", "q2_bias_all", "startup"): "bias",
        ("llama", "plain", "startup"): "",
    }
    got = {case: _judge(sglang_run, *case).reason_class for case in expected}
    assert got == expected


@_runs
def test_judge_takes_names_alone_and_audit_reports(sglang_run: dict[str, Any]) -> None:
    """Tensor names alone (no shapes) still give the load's verdict; an AdapterReport gives
    the same answer as its config and header."""
    from metrale_cli.adapters.adapter import Adapter
    from metrale_cli.adapters.audit import audit
    from metrale_cli.model.config import ModelConfig

    made = sglang_run["made"]
    pool = _pool(sglang_run, "llama")
    names_only = sglang.judge("q_no_v", _config(made["q_no_v"]), list(made["q_no_v"].tensors),
                              pool=pool)
    assert (names_only.error_type, names_only.verdict) == ("KeyError", Verdict.REFUSES)
    for name in ("rank_pattern_q", "rslora", "layer_replication", "added_tokens"):
        model = ModelConfig.from_hf(made[name].base_dir)
        report = audit(Adapter.load(made[name].path), model)
        assert sglang.judge_report(report, model, pool=pool) == _judge(
            sglang_run, "llama", name, "runtime"), name


def _inspect(run: dict[str, Any], names: list[str], flags: dict[str, Any]) -> dict[str, Any]:
    """`inspect --engine sglang --json` on the adapters under the runner's flags."""
    given: list[object] = ["--max-loras", 4, "--dtype", "float32",
                           "--lora-backend", "torch_native"]  # the runner's
    if flags.get("max_lora_rank") is not None:
        given += ["--max-rank", flags["max_lora_rank"]]
    if flags.get("lora_target_modules"):
        given += ["--modules", ",".join(flags["lora_target_modules"])]
    done = metrale("inspect", *(f"{n}={run['made'][n].path}" for n in names), "--engine",
                   "sglang", *given, "--json")
    assert done.code in (0, 1), done.stderr
    return done.json()


def _agrees(path: dict[str, str], entry: dict[str, Any]) -> None:
    """One load path of the engine's record against what SGLang's code did with it."""
    assert path["checked"] == "run"
    if not entry["accepted"]:
        assert path["verdict"] == "refuses"
        assert f"HTTP 400 ({entry['error']['text']})" in path["reason"]
    elif not entry["batch"]["ok"]:
        assert path["verdict"] == "crashes"
        assert f"raises {entry['batch']['error']['type']}: " in path["reason"]
    else:
        assert path["verdict"] in ("serves", "differs", "ignores")


@_runs
def test_inspect_engine_sglang_says_what_sglang_did(sglang_run: dict[str, Any]) -> None:
    """`inspect --engine sglang`, the CLI's verdict records, on every job the runner ran: at
    start-up (the job's start-up adapters and flags) the server starts iff no adapter's
    start-up path fails it, the failing one with SGLang's error and text, each first batch
    that raised `crashes`, and the pool the start-up built; at runtime (the job's runtime
    adapters against that pool, given as --max-rank and --modules) each load refused with
    SGLang's HTTP 400 text, or accepted and its first batch as SGLang's."""
    paths_seen = 0
    for job, report in sglang_run["jobs"].items():
        spec = JOBS[job]
        record = _inspect(sglang_run, spec["startup"], spec.get("flags", {}))
        startup = {a["name"]: a["engine"]["paths"]["startup"] for a in record["adapters"]}
        failing = [p for p in startup.values() if p["verdict"] == "fails_startup"]
        assert report["started"] == (not failing), (job, report.get("start_error"))
        if not report["started"]:
            error = report["start_error"]
            assert any(f"({error['type']}: {error['text']})" in p["reason"] for p in failing)
            paths_seen += 1
            continue
        for entry in report["startup"]:
            _agrees(startup[entry["name"]], entry)
            paths_seen += 1
        if all(p["verdict"] in ("serves", "differs", "ignores") for p in startup.values()):
            assert record["engine"]["pool"] == {"max_lora_rank": report["max_lora_rank"],
                                                "target_modules": report["target_modules"]}
        if not report["runtime"]:
            continue
        record = _inspect(sglang_run, [e["name"] for e in report["runtime"]], {
            "max_lora_rank": report["max_lora_rank"],
            "lora_target_modules": report["target_modules"]})
        runtime = {a["name"]: a["engine"] for a in record["adapters"]}
        for entry in report["runtime"]:
            engine = runtime[entry["name"]]
            assert engine["verdict"] == engine["paths"]["runtime"]["verdict"]
            _agrees(engine["paths"]["runtime"], entry)
            paths_seen += 1
    assert paths_seen >= 35


# -- what cannot run here, held to the source it cites -------------------------------------------


@functools.cache
def _parsed(path: str) -> tuple[str, ast.Module]:
    text = (SGLANG_SRC / path).read_text()
    return text, ast.parse(text)


def _function_source(path: str, qualname: str) -> str:
    text, tree = _parsed(path)
    node: Any = tree
    for part in qualname.split("."):
        node = next(n for n in ast.iter_child_nodes(node)
                    if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                    and n.name == part)
    return ast.get_source_segment(text, node) or ""


@pytest.mark.sglang
@pytest.mark.parametrize("rule", sglang.SOURCE_RULES, ids=lambda r: r.case)
def test_source_rules_hold_to_the_installed_source(rule: sglang.SourceRule) -> None:
    text = _function_source(rule.file, rule.function)
    assert rule.line in text, f"{rule.file} {rule.function} no longer says {rule.line!r}"


@pytest.mark.sglang
def test_the_transformers_backend_rules_hold_to_the_source() -> None:
    """rules.py's Transformers-backend rule (`hf_backbone_judgement`), each line it rests on:
    the wrap by last name, the backbone's 3-D input, and the GPU kernels' 2-D assertion (the
    torch_native kernel's error is run in `test_first_batches_fail_where_sglang_fails`)."""
    kernels = SGLANG_SRC.parent / "kernels" / "ops" / "lora" / "dense"
    for path, function, line in (
            ("lora/lora_manager.py", "LoRAManager.init_lora_modules",
             "parts[-1] in self.target_modules"),
            ("models/transformers.py", "TransformersBase._run_hf_backbone",
             "hf_input_ids = None if input_ids is None else input_ids[None, ...]"),
            ("models/transformers.py", "replace_linear_class", "return super().forward(input)[0]"),
            ("lora/layers.py", "get_lora_layer", "RowParallelLinear: RowParallelLinearWithLoRA")):
        assert line in _function_source(path, function), (path, function, line)
    for kernel, function in (("chunked_sgmv_shrink.py", "chunked_sgmv_lora_shrink_forward"),
                             ("sgemm_lora_a.py", "sgemm_lora_a_fwd")):
        text = (kernels / kernel).read_text()
        node = next(n for n in ast.parse(text).body
                    if isinstance(n, ast.FunctionDef) and n.name == function)
        assert "assert len(x.shape) == 2" in (ast.get_source_segment(text, node) or ""), kernel
    assert {b for b, (kind, _) in sglang.HF_BACKBONE_ERRORS.items()
            if kind == "AssertionError"} == {"csgmv", "triton"}


# Imports transformers' model classes: 5-9 s.
@pytest.mark.sglang
@pytest.mark.slow
def test_each_rows_classes_are_sglangs_registry() -> None:
    """A row's `architectures` are classes SGLang registers (a models/*.py `EntryClass`); its
    `transformers` names are none it registers, but transformers' own classes, which SGLang's
    registry sends to its Transformers backend."""
    import transformers

    registered: set[str] = set()
    for path in (SGLANG_SRC / "models").glob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == "EntryClass" for t in node.targets):
                value = node.value
                names = value.elts if isinstance(value, ast.List) else [value]
                registered |= {n.id for n in names if isinstance(n, ast.Name)}
    assert "TransformersForCausalLM" in registered
    rows = sglang_model.FAMILIES.values()
    for row in rows:
        assert not set(row.transformers) & registered, row.model_type
        assert all(hasattr(transformers, name) for name in row.transformers), row.model_type
    fallback = {row.model_type for row in rows if row.transformers}
    assert fallback == {"seed_oss", "smollm3", "ministral", "ernie4_5"}
    for row in rows:
        assert set(row.architectures) <= registered, row.model_type


def test_docs_list_every_source_rule() -> None:
    doc = (Path(__file__).parent.parent / "docs" / "engines.md").read_text()
    section = doc.split("### SGLang: what each adapter meets", 1)[1].split("\n## ", 1)[0]
    for rule in sglang.SOURCE_RULES:
        assert f"| {rule.case} |" in section and "source" in section, rule.case


# -- the model SGLang builds from `architectures` ------------------------------------------------

_MODEL_CONFIG = """
import json, sys
from sglang.srt.configs.model_config import ModelConfig
out = {}
for path in sys.argv[1:]:
    try:
        ModelConfig(path)
        out[path] = "built"
    except Exception as exc:
        out[path] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


@pytest.mark.sglang
@pytest.mark.proc
@pytest.mark.slow
def test_a_config_without_architectures_is_judged_as_sglang_builds_it(
        tmp_path: Path) -> None:
    """SGLang's own `ModelConfig` (what launch_server builds first) on the tiny Llama's config
    with `architectures` left out and empty: each fails, so every adapter is
    `unsupported_model` on both load paths, in SGLang's words, and the launch line names none.
    With `architectures` as written it builds."""
    truth = make_adapter("llama", tmp_path / "adapter", r=4, lora_alpha=8,
                         target_modules=["q_proj", "v_proj"])
    config = json.loads((truth.base_dir / "config.json").read_text())
    dirs = {}
    for name, archs in (("written", config["architectures"]), ("none", None), ("empty", [])):
        dirs[name] = tmp_path / name
        dirs[name].mkdir()
        edited = {k: v for k, v in config.items() if k != "architectures"}
        if archs is not None:
            edited["architectures"] = archs
        (dirs[name] / "config.json").write_text(json.dumps(edited))
    done = subprocess.run([str(SGLANG_PYTHON), "-c", _MODEL_CONFIG, *map(str, dirs.values())],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    built = json.loads(done.stdout.strip().splitlines()[-1])
    assert built[str(dirs["written"])] == "built"
    for name in ("none", "empty"):
        said = built[str(dirs[name])]
        assert said != "built"
        inspected = metrale("inspect", truth.path, "--engine", "sglang", "-m", dirs[name],
                            "--json")
        assert inspected.code == 1, inspected.stderr
        record = inspected.json()
        engine = record["adapters"][0]["engine"]
        assert engine["verdict"] == "unsupported_model"
        assert engine["reason_class"] == "architecture"
        assert engine["reason"].startswith(f"{said}: ")
        assert {p["verdict"] for p in engine["paths"].values()} == {"unsupported_model"}
        rec = record["engine"]["recommended"]
        assert rec["serve"] is None and rec["lora_paths"] == [] and len(rec["shut_out"]) == 1
    written = metrale("inspect", truth.path, "--engine", "sglang", "-m", dirs["written"],
                      "--json")
    assert written.code == 0, written.stdout


@pytest.mark.sglang
@pytest.mark.proc
@pytest.mark.slow
def test_a_text_only_gemma4_config_stops_sglang_as_metrale_says(tmp_path: Path) -> None:
    """SGLang's own `ModelConfig` on Gemma 4's text-only config (full layers at their own head
    width and KV heads: transformers' per_layer_config) fails, its transformers refusing the
    per-layer attribute SGLang's config parser reads off the whole config; on the wrapper's
    config it builds. metrale says unsupported_model for the first, in those words, and judges
    adapters on the second."""
    text = make_adapter("gemma4", tmp_path / "text", r=4, lora_alpha=8)
    wrapper = make_adapter("gemma4_vl", tmp_path / "wrapper", r=4, lora_alpha=8)
    done = subprocess.run([str(SGLANG_PYTHON), "-c", _MODEL_CONFIG, str(text.base_dir),
                           str(wrapper.base_dir)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    built = json.loads(done.stdout.strip().splitlines()[-1])
    assert built[str(wrapper.base_dir)] == "built"
    said = built[str(text.base_dir)]
    assert said.startswith("AmbiguousGlobalPerLayerAttributeError: "), said
    for truth, refused in ((text, True), (wrapper, False)):
        inspected = metrale("inspect", truth.path, "--engine", "sglang", "--json")
        engine = inspected.json()["adapters"][0]["engine"]
        assert (engine["verdict"] == "unsupported_model") is refused, engine
    assert engine["reason_class"] != "per_layer_config"
    inspected = metrale("inspect", text.path, "--engine", "sglang", "--json")
    engine = inspected.json()["adapters"][0]["engine"]
    assert engine["reason_class"] == "per_layer_config"
    assert engine["reason"].startswith("AmbiguousGlobalPerLayerAttributeError: ")
