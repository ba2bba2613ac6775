"""`--engine vllm` against the real vLLM 0.32.0: for PEFT-made adapters on tiny models of every
family metrale knows, the verdict metrale predicts offline equals what the running engine did,
vLLM's own error text carries metrale's reason, a served adapter's next-token log-probs equal
PEFT's, and the LoRA bytes metrale predicts equal the buffers the engine allocated.

Each job below is one engine (tests/support/vllm_runner.py under .venv-vllm): adapters that
leave it serving share it; the one that ends it comes last. Where the CPU build cannot run a
family with LoRA, the test holds the engine's own failure next to metrale's `cpu_build` record,
and the GPU verdict stays the source-derived one (docs/engines.md). The `unregistered` job
starts none: vLLM refuses its model before an engine process starts, as metrale predicts.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from metrale_cli.adapters.adapter import Adapter
from metrale_cli.adapters.audit import audit
from metrale_cli.engines.verdict import Verdict
from metrale_cli.engines.vllm import rules as vllm
from metrale_cli.engines.vllm.model import FAMILIES as VLLM_FAMILIES
from metrale_cli.model.config import ModelConfig
from tests.conftest import VLLM_PYTHON
from tests.support.engine_cases import PROMPT, Case, make_case, run_job, write_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

RUNNER = Path(__file__).parent / "support" / "vllm_runner.py"
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
# float32 engines match PEFT to four decimals; BF16 ones (the CPU GDN) to BF16's rounding.
TOLERANCE = {"float32": 1e-3, "bfloat16": 0.15}
# DeepSeek's MLA on the CPU build, float32 (the "deepseek_v3" job says why).
MLA_TOLERANCE = 0.05


# The families' engines: float32, as PEFT's reference.
FLOAT32 = {"max_lora_rank": 16, "max_loras": 2, "dtype": "float32"}
# A vision-language wrapper's multimodal processor needs the model's tokenizer.
VISION_LANGUAGE = {**FLOAT32, "skip_tokenizer_init": False}
# PEFT's target_modules for the language model's attention and MLP alone.
LANGUAGE_MODEL = rf".*language_model.*\.({'|'.join(ATTN + MLP)})"


@dataclass
class Job:
    """One engine (or its refusal to start): its model, flags, and adapters in the order they
    are tried."""

    family: str
    engine: dict[str, Any]
    adapters: list[tuple[str, dict[str, Any]]]
    # Adapters sent with a request instead of loaded first (the offline LLM API); last.
    by_request: list[str] = field(default_factory=list)
    # The class the model's config names instead of the one transformers writes.
    architecture: str | None = None
    # How near PEFT's a served adapter's log-probs are, where not the dtype's (TOLERANCE).
    tolerance: float | None = None


JOBS: dict[str, Job] = {
    "qwen3": Job("qwen3", {"max_lora_rank": 16, "max_loras": 2, "dtype": "float32"}, [
        ("plain", {"r": 8, "lora_alpha": 16, "target_modules": ATTN + MLP}),
        ("rslora_patterns", {"r": 8, "lora_alpha": 16, "use_rslora": True,
                             "target_modules": ATTN + MLP, "rank_pattern": {"q_proj": 4},
                             "alpha_pattern": {"down_proj": 3}}),
        ("lm_head", {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "lm_head"]}),
        ("embed", {"r": 8, "lora_alpha": 16, "target_modules": ["v_proj", "embed_tokens"]}),
        ("rank32", {"r": 32, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}),
        ("pattern32", {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"],
                       "rank_pattern": {"nothing_matches": 32}}),
        ("save_head", {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"],
                       "modules_to_save": ["lm_head"]}),
        ("bias", {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], "bias": "all"}),
        ("dora", {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"],
                  "use_dora": True}),
        ("pissa", {"r": 8, "lora_alpha": 8, "target_modules": ["q_proj"],
                   "init_lora_weights": "pissa"}),
        ("tokens", {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"],
                    "trainable_token_indices": [3, 4]}),
    ], by_request=["dora"]),
    # --lora-target-modules o_proj: an attention adapter loses q/k/v, an MLP one everything.
    "llama": Job("llama", {"max_lora_rank": 16, "max_loras": 2, "dtype": "float32",
                           "lora_target_modules": ["o_proj"]}, [
        ("attn", {"r": 8, "lora_alpha": 16, "target_modules": ATTN}),
        ("mlp", {"r": 8, "lora_alpha": 16, "target_modules": MLP}),
    ]),
    "mixtral": Job("mixtral", {"max_lora_rank": 16, "max_loras": 2, "dtype": "float32"},
                   [("attn", {"r": 8, "lora_alpha": 16, "target_modules": ATTN})]),
    "qwen3_next": Job("qwen3_next", {"max_lora_rank": 16, "max_loras": 2,
                                     "dtype": "bfloat16"}, [
        ("gdn", {"r": 8, "lora_alpha": 16,
                 "target_modules": ["q_proj", "v_proj", "in_proj_qkvz", "in_proj_ba",
                                    "out_proj", "shared_expert_gate"]}),
    ]),
    "qwen3_moe": Job("qwen3_moe", {"max_lora_rank": 16, "max_loras": 2, "dtype": "float32"},
                     [("attn", {"r": 8, "lora_alpha": 16, "target_modules": ATTN})]),
    # The other MoE families, one engine each (engine_cases.py: a dense layer and a shared
    # expert where the family has them): the engine starts (buffers checked), and its
    # fused-MoE LoRA has no CPU kernel.
    **{family: Job(family, FLOAT32, [("attn", {"r": 8, "lora_alpha": 16,
                                               "target_modules": ATTN})])
       for family in ("qwen2_moe", "olmoe", "glm4_moe", "granitemoe")},
    # Phi-3.5-MoE under both spellings of its class: the published checkpoints' PhiMoEForCausalLM
    # (phimoe.py, Mixtral's layout), and transformers' own PhimoeForCausalLM, which transformers
    # writes on save and vLLM does not register, so its registry builds the transformers
    # backend (transformers' `mlp.router` and `mlp.experts`, embed_tokens alone).
    "phimoe": Job("phimoe", FLOAT32, [("attn", {"r": 8, "lora_alpha": 16,
                                                 "target_modules": ATTN})],
                  architecture="PhiMoEForCausalLM"),
    "phimoe_transformers": Job("phimoe", FLOAT32, [("attn", {"r": 8, "lora_alpha": 16,
                                                              "target_modules": ATTN})]),
    # Llama 4's interleaved MoE and dense layers (feed_forward: router, shared expert, experts):
    # the engine starts (buffers checked), and its fused-MoE LoRA has no CPU kernel.
    "llama4": Job("llama4", FLOAT32, [("attn", {"r": 8, "lora_alpha": 16,
                                                 "target_modules": ATTN})]),
    # gpt_oss: `attn` (vLLM's name for self_attn), the router, the 3-D experts: the engine
    # starts (buffers checked), and its fused-MoE LoRA has no CPU kernel.
    "gpt_oss": Job("gpt_oss", FLOAT32, [("attn", {"r": 8, "lora_alpha": 16,
                                                   "target_modules": ATTN})]),
    # Nemotron-H's blocks: PEFT's one in_proj pair over vLLM's five Mamba-2 slices, the non-gated
    # MLP, attention; the MoE variant's non-gated experts have no CPU kernel at all.
    "nemotron_h": Job("nemotron_h", FLOAT32, [
        ("attn", {"r": 8, "lora_alpha": 16, "target_modules": ATTN}),
        ("mamba_mlp", {"r": 8, "lora_alpha": 16,
                       "target_modules": ["in_proj", "up_proj", "down_proj"]}),
    ]),
    "nemotron_h_moe": Job("nemotron_h_moe", FLOAT32, [
        ("attn", {"r": 8, "lora_alpha": 16, "target_modules": ATTN})]),
    # Qwen3.5's text model (BF16: the CPU GDN), its full-attention layer, then its GDN
    # layer's five projections (split per slice, as vLLM's class packs them) and every MLP.
    "qwen3_5": Job("qwen3_5", {"max_lora_rank": 16, "max_loras": 2, "dtype": "bfloat16"}, [
        ("attn", {"r": 8, "lora_alpha": 16, "target_modules": ATTN}),
        ("gdn_mlp", {"r": 8, "lora_alpha": 16,
                     "target_modules": ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
                                        "out_proj", *MLP]}),
    ]),
    # The families' classes, one engine each: phi3.py packs qkv_proj and gate_up_proj as
    # themselves; glm4.py packs gate_up_proj from gate/up, so PEFT's fused gate_up_proj is a
    # name it does not expect, and declares no embedding_modules, as Gemma 3's (sliding-window
    # layers) does not, so an embed_tokens adapter is refused; Cohere's declares embed_tokens
    # alone; OLMo 2 runs on vLLM's transformers backend (its packing is made at
    # load time, so no source line holds it). The other families' rows are held to the source
    # they cite (tests/test_engine_rules.py).
    "phi3": Job("phi3", FLOAT32, [
        ("fused", {"r": 8, "lora_alpha": 16,
                   "target_modules": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]}),
        ("lm_head", {"r": 8, "lora_alpha": 16, "target_modules": ["qkv_proj", "lm_head"]}),
    ]),
    "glm4": Job("glm4", FLOAT32, [
        ("attn", {"r": 8, "lora_alpha": 16, "target_modules": [*ATTN, "down_proj"]}),
        ("gate_up", {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "gate_up_proj"]}),
    ]),
    "gemma3": Job("gemma3_text", FLOAT32, [
        ("plain", {"r": 8, "lora_alpha": 16, "target_modules": ATTN + MLP}),
        ("embed", {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "embed_tokens"]}),
    ]),
    # Gemma 4's layers of each kind, an adapter each: a sliding layer (head width 32), a full
    # one (64) whose keys are its values, the per-layer-input projections.
    "gemma4": Job("gemma4_text", FLOAT32, [
        ("q", {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}),
        ("k_sliding", {"r": 8, "lora_alpha": 16, "target_modules": ["k_proj"],
                       "layers_to_transform": [0]}),
        ("k_eq_v", {"r": 8, "lora_alpha": 16, "target_modules": ["k_proj"],
                    "layers_to_transform": [1]}),
        ("rest", {"r": 8, "lora_alpha": 16,
                  "target_modules": ["v_proj", "o_proj", *MLP, "per_layer_input_gate",
                                     "per_layer_projection"]}),
    ]),
    # With routed experts beside each layer's MLP: the router's `router.proj` and the 2-D fused
    # experts; the engine starts (buffers checked), and its fused-MoE LoRA has no CPU kernel.
    "gemma4_moe": Job("gemma4_moe", FLOAT32, [("q", {"r": 8, "lora_alpha": 16,
                                                     "target_modules": ["q_proj"]})]),
    "cohere": Job("cohere", FLOAT32, [
        ("plain", {"r": 8, "lora_alpha": 16, "target_modules": ATTN + MLP}),
        ("embed", {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "embed_tokens"]}),
    ]),
    "olmo2": Job("olmo2", FLOAT32, [
        ("plain", {"r": 8, "lora_alpha": 16, "target_modules": ATTN + MLP}),
    ]),
    # StarCoder 2 on the same backend: q/k/v fused, c_fc and c_proj one layer each; an
    # embed_tokens adapter (the backend's embedding_modules) and an lm_head one (none).
    "starcoder2": Job("starcoder2", FLOAT32, [
        ("plain", {"r": 8, "lora_alpha": 16, "target_modules": [*ATTN, "c_fc", "c_proj"]}),
        ("embed", {"r": 8, "lora_alpha": 16, "target_modules": ["c_fc", "embed_tokens"]}),
        ("lm_head", {"r": 8, "lora_alpha": 16, "target_modules": ["c_proj", "lm_head"]}),
    ]),
    # The other dense families, one engine each: every attention and MLP module, then the
    # embedding module the class's embedding_modules does (lm_head, embed_tokens) or does not
    # (embed_tokens: refused) declare. OLMo 3, Seed-OSS and SmolLM3 run on the transformers
    # backend, and so does Ministral: vLLM registers no MinistralForCausalLM, and its registry
    # falls back to the backend for a class transformers has.
    **{family: Job(family, FLOAT32, [
        ("plain", {"r": 8, "lora_alpha": 16, "target_modules": ATTN + MLP}),
        ("embed", {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", embed]}),
    ]) for family, embed in (
        ("mistral", "embed_tokens"), ("qwen2", "embed_tokens"), ("gemma", "embed_tokens"),
        ("gemma2", "embed_tokens"), ("granite", "lm_head"), ("olmo3", "embed_tokens"),
        ("cohere2", "embed_tokens"), ("exaone4", "lm_head"), ("ernie4_5", "lm_head"),
        ("seed_oss", "embed_tokens"), ("smollm3", "embed_tokens"),
        ("ministral", "embed_tokens"))},
    # DeepSeek's multi-head latent attention, every layer dense: V3's fused q_a|kv_a and
    # q_b_proj, V2's q_proj and kv_a_proj_with_mqa, o_proj: served; kv_b_proj loads and is
    # never applied (the MLA backend runs its base weight itself): alone it changes nothing,
    # beside o_proj the adapter differs from PEFT; the dense MLP (an adapter made before PEFT's
    # MoE rewrite, which leaves DeepSeek's dense MLP alone) served; no embedding_modules.
    # The CPU build's MLA attention is not transformers' to float32's precision (the base
    # model's log-probs are 1e-3 apart): served adapters that sharpen the attention (q, kv_a)
    # come within MLA_TOLERANCE of PEFT's, where an unapplied kv_b_proj is 0.5 away.
    "deepseek_v3": Job("deepseek_v3", FLOAT32, [
        ("q", {"r": 8, "lora_alpha": 16, "target_modules": ["q_a_proj", "q_b_proj"]}),
        ("kv_a_o", {"r": 8, "lora_alpha": 16,
                    "target_modules": ["kv_a_proj_with_mqa", "o_proj"]}),
        ("kv_b", {"r": 8, "lora_alpha": 16, "target_modules": ["kv_b_proj"]}),
        ("kv_b_o", {"r": 8, "lora_alpha": 16, "target_modules": ["kv_b_proj", "o_proj"]}),
        ("mlp", {"r": 8, "lora_alpha": 16, "target_modules": MLP, "moe_rewrite": False}),
        ("lm_head", {"r": 8, "lora_alpha": 16, "target_modules": ["q_b_proj", "lm_head"]}),
    ], tolerance=MLA_TOLERANCE),
    "deepseek_v2": Job("deepseek_v2", FLOAT32, [
        ("q_o", {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "o_proj"]}),
        ("kv_a", {"r": 8, "lora_alpha": 16, "target_modules": ["kv_a_proj_with_mqa"]}),
        ("kv_b", {"r": 8, "lora_alpha": 16, "target_modules": ["kv_b_proj"]}),
        ("embed", {"r": 8, "lora_alpha": 16, "target_modules": ["o_proj", "embed_tokens"]}),
    ], tolerance=MLA_TOLERANCE),
    # Layer 1 routed experts beside the router and a shared expert: the engine starts (buffers
    # checked: every module but the routed experts, which --lora-target-modules leaves out),
    # and with LoRA enabled its fused MoE takes the Triton backend, experts wrapped or not,
    # which has no CPU kernel.
    "deepseek_v3_moe": Job("deepseek_v3_moe", {**FLOAT32, "lora_target_modules": [
        "fused_qkv_a_proj", "q_b_proj", "kv_b_proj", "o_proj", "gate", "gate_up_proj",
        "down_proj"]}, [
        ("attn", {"r": 8, "lora_alpha": 16, "target_modules": ["q_a_proj", "o_proj"]})]),
    # The vision-language wrappers (their text model beside a one-block vision tower, a
    # tokenizer and an image processor: vLLM builds the wrapper's multimodal processor as it
    # starts): the language model's attention and MLP alone (PEFT's target_modules a regex
    # over the language model's names), then the same names beside the tower's own (which
    # Qwen2.5-VL's MLP shares), whose weights load and find no LoRA layer. Qwen3.5's wrapper
    # has Qwen3-VL's tower, in BF16 (the CPU GDN).
    **{family: Job(family, {**VISION_LANGUAGE, "dtype": dtype}, [
        ("language", {"r": 8, "lora_alpha": 16, "target_modules": LANGUAGE_MODEL}),
        ("tower", {"r": 8, "lora_alpha": 16, "target_modules": ATTN + MLP + tower}),
    ]) for family, dtype, tower in (
        ("qwen2_vl", "float32", ["qkv", "proj", "fc1", "fc2"]),
        ("qwen2_5_vl", "float32", ["qkv", "proj"]),
        ("qwen3_vl", "float32", ["qkv", "proj", "linear_fc1", "linear_fc2"]),
        ("qwen3_5_vl", "bfloat16", ["qkv", "proj", "linear_fc1", "linear_fc2"]))},
    # metrale's `unsupported_model` for an architecture vLLM does not register: the engine
    # refuses the model before loading a weight (in the runner's process: no engine starts).
    "unregistered": Job("qwen3", {"max_lora_rank": 16, "max_loras": 2, "dtype": "float32"},
                        [("plain", {"r": 8, "lora_alpha": 16,
                                    "target_modules": ["q_proj", "v_proj"]})],
                        architecture="FrobnicatorForCausalLM"),
}


@dataclass
class Run:
    job: Job
    model_dir: Path
    cases: dict[str, Case]
    report: dict[str, Any]
    # The engine's own log: its worker's root cause when the client sees EngineDeadError.
    log: str

    @property
    def model(self) -> ModelConfig:
        return ModelConfig.from_hf(self.model_dir)

    @property
    def flags(self) -> vllm.Flags:
        e = self.job.engine
        targets = e.get("lora_target_modules")
        return vllm.Flags(e["max_lora_rank"], e["max_loras"], dtype=e["dtype"],
                          target_modules=tuple(targets) if targets else None)

    def judged(self, name: str) -> vllm.EngineVerdict:
        """metrale's verdict."""
        return vllm.judge(audit(Adapter.load(self.cases[name].path, name), self.model),
                          self.model, self.flags)


# Runners the runs fixture starts at once, each bound to its own core (vLLM's CPU worker binds
# its threads to core 0 unless told otherwise, and two engines on one core wait for each other).
# Each runner imports vLLM once and starts engines one after another, taking the next job no
# runner has claimed (each engine's core and worker are two more interpreters importing vLLM,
# as under `vllm serve`). JOBS is in the order they are taken: the longest (most adapters)
# first, so that the short ones fill the end.
ENGINES_AT_ONCE = 2


def selected_jobs(request: pytest.FixtureRequest) -> list[str]:
    """The jobs this session's selected tests of this file ask for, in JOBS' order (`-k
    qwen2_moe` starts that engine alone); every job where a selected test reads them all."""
    wanted: set[str] = set()
    for item in request.session.items:
        if item.module is not request.module or "runs" not in getattr(item, "fixturenames", ()):
            continue
        callspec = getattr(item, "callspec", None)
        if callspec is None or "job" not in callspec.params:
            return list(JOBS)
        wanted.add(callspec.params["job"])
    return [key for key in JOBS if key in wanted]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest,
         ) -> dict[str, Run]:
    """The selected jobs built with PEFT and run through the real vLLM, once: ENGINES_AT_ONCE
    runners at a time, so that most of their start-up overlaps."""
    if not VLLM_PYTHON.exists():
        pytest.skip(f"needs {VLLM_PYTHON}")
    root = tmp_path_factory.mktemp("vllm")
    keys = selected_jobs(request)
    built: dict[str, tuple[Path, dict[str, Case]]] = {}
    specs: list[dict[str, Any]] = []
    for key in keys:
        job = JOBS[key]
        out = root / key
        base = write_model(job.family, out / "base")
        cases = {name: make_case(job.family, base, out, name, **kwargs)
                 for name, kwargs in job.adapters}
        if job.architecture is not None:
            config = json.loads((base / "config.json").read_text())
            config["architectures"] = [job.architecture]
            (base / "config.json").write_text(json.dumps(config))
        adapters = [{"name": n, "path": str(cases[n].path)} for n, _ in job.adapters]
        adapters += [{"name": f"{n}@request", "path": str(cases[n].path), "via": "request"}
                     for n in job.by_request]
        specs.append({"model": str(base), "engine": job.engine, "prompt": PROMPT,
                      "logprobs": 8, "adapters": adapters})
        built[key] = base, cases
    claims = root / "claims"
    claims.mkdir()
    cores = sorted(os.sched_getaffinity(0))
    # No more runners than jobs: each imports vLLM, and one that draws no job has no log.
    at_once = min(ENGINES_AT_ONCE, len(specs))
    results: list[tuple[dict[str, Any], str] | BaseException | None] = [None] * at_once

    def runner(i: int) -> None:
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": str(cores[i % len(cores)])}
        out = root / f"runner{i}"
        out.mkdir()
        try:
            results[i] = run_job(VLLM_PYTHON, RUNNER, out,
                                 {"jobs": specs, "claims": str(claims)}, f"vLLM runner {i}",
                                 env=env)
        except BaseException as exc:  # pytest.fail in a thread: raised again below
            results[i] = exc

    threads = [threading.Thread(target=runner, args=(i,)) for i in range(at_once)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    done: dict[str, Run] = {}
    for result in results:
        if isinstance(result, BaseException):
            raise result
        assert result is not None
        report, log = result
        logs = job_logs(log)
        assert [j["index"] for j in report["jobs"]] == list(logs), log[-3000:]
        for job_report in report["jobs"]:
            key = keys[job_report["index"]]
            base, cases = built[key]
            done[key] = Run(JOBS[key], base, cases, job_report, logs[job_report["index"]])
    assert done.keys() == set(keys), "a job no runner ran"
    return done


def job_logs(log: str) -> dict[int, str]:
    """A runner's log cut at each job's start (vllm_runner.JOB_LOG_MARK): {job index: its
    part}, in the order the runner ran them (the order of JOBS, skipping the jobs another
    runner took)."""
    marks = list(re.finditer(r"^vllm_runner: job (\d+) starts$", log, re.MULTILINE))
    indices = [int(m.group(1)) for m in marks]
    assert indices == sorted(set(indices)), log[-3000:]
    # A runner that took no job (more runners than jobs) logged no mark.
    ends = [m.start() for m in marks[1:]] + [len(log)] if marks else []
    return {n: log[m.end():end] for n, m, end in zip(indices, marks, ends, strict=True)}


def observed(run: Run, entry: dict[str, Any]) -> str:
    """What the engine did with one adapter, in verdict words."""
    if not entry["loaded"]:
        return Verdict.CRASHES.value if entry.get("engine_alive") is False else \
            Verdict.REFUSES.value
    got = {int(k): v for k, v in entry["logprobs"].items()}
    base = {int(k): v for k, v in run.report["base"].items()}
    tol = run.job.tolerance or TOLERANCE[run.job.engine["dtype"]]
    if got.keys() == base.keys() and all(abs(got[k] - base[k]) < 1e-5 for k in got):
        return Verdict.IGNORES.value
    peft = run.cases[entry["name"].split("@")[0]].logprobs
    if all(abs(peft[k] - v) < tol for k, v in got.items()):
        return Verdict.SERVES.value
    return Verdict.DIFFERS.value


def _entries(run: Run) -> list[tuple[str, dict[str, Any]]]:
    return [(e["name"], e) for e in run.report["adapters"]]


# The verdict of every adapter, against what its job's engine did (or its refusal to start).
VERDICT_CASES = [(key, name) for key, job in JOBS.items()
                 for name in [n for n, _ in job.adapters] + [f"{n}@request"
                                                             for n in job.by_request]]


@pytest.mark.parametrize(("job", "adapter"), VERDICT_CASES)
def test_verdict_equals_engine(runs: dict[str, Run], job: str, adapter: str) -> None:
    run = runs[job]
    name, via = adapter.partition("@")[::2]
    judged = run.judged(name)
    cpu = judged.elsewhere.get("cpu_build")
    if run.job.architecture is not None and not run.report["started"]:
        # No build serves it: the engine never starts, refused in the words metrale gives.
        said = f"Model architectures ['{run.job.architecture}'] are not supported for now"
        assert judged.verdict is Verdict.UNSUPPORTED_MODEL and cpu is None
        assert not run.report["started"], run.report
        error = run.report["start_error"]["text"] + run.log
        assert said in error and said in judged.reason, error[-2000:]
        return
    if not run.report.get("started") or "base_error" in run.report:
        # The CPU build cannot run this family with LoRA at all: metrale must say so, as
        # the CPU build's verdict, and why.
        error = (run.report.get("start_error") or run.report.get("base_error"))["text"]
        error += run.log
        assert cpu is not None, f"{job}: the CPU build fails ({error[:200]}) and metrale " \
                                "does not say so"
        assert cpu["verdict"] == Verdict.UNSUPPORTED_MODEL.value
        said = "is_act_and_mul=False" if cpu["reason_class"] == "cpu_non_gated_moe" else "triton"
        assert said in error and said in cpu["reason"], error[-2000:]
        return
    entry = dict(_entries(run))[adapter]
    assert cpu is None
    expected = judged.verdict.value
    if via == "request":
        expected = judged.paths["offline"]["verdict"]
    if judged.reason_class == "vision_tower":
        # Only the tower's weights are not applied: a text prompt never runs the tower, so the
        # log-probs are PEFT's, and no module under the tower has LoRA buffers to apply them.
        towers = tuple(f"{t}." for t in vllm.vision_tower(run.model)[0])
        assert not [m for m in run.report["lora_buffers"] if m.startswith(towers)]
        expected = Verdict.SERVES.value
    assert observed(run, entry) == expected, (adapter, judged.reason, entry)
    if judged.verdict is Verdict.REFUSES and via != "request":
        text = entry["error"]["text"]
        # vLLM's own words: the message metrale gives is the one the engine raised.
        phrase = {"unexpected_module": "expected target modules in",
                  "unsupported_weight": "is unsupported LoRA weight"}.get(judged.reason_class)
        assert (phrase or judged.reason) in text, (judged.reason, text)


@pytest.mark.parametrize("job", list(JOBS))
def test_lora_bytes_equal_allocation(runs: dict[str, Run], job: str) -> None:
    """Per module and in all, the bytes metrale predicts equal the stacked LoRA buffers the
    engine's model allocated (read off the engine's worker)."""
    run = runs[job]
    buffers = run.report.get("lora_buffers")
    if buffers is None:
        # The jobs whose engine never starts (test_verdict_equals_engine says why).
        assert not run.report["started"] and (
            job == "nemotron_h_moe" or run.job.architecture is not None), \
            f"{job}: the engine allocated nothing to compare"
        return
    measured: dict[str, int] = {}
    for module, info in buffers.items():
        # A vision-language wrapper keeps its language model under `language_model`.
        module = module.removeprefix("language_model.")
        path = module.split(".layers.", 1)[-1].split(".", 1)[-1] if ".layers." in module \
            else "lm_head" if module == "logits_processor" else module.removeprefix("model.")
        measured[path] = measured.get(path, 0) + sum(t[3] for t in info["tensors"])
    memory = vllm.Memory.of(run.model, run.flags)
    # A path on layers of different widths (gemma4's sliding and full attention) is one entry
    # per width.
    predicted: dict[str, int] = {}
    for m, b in memory.per_module:
        predicted[m.path] = predicted.get(m.path, 0) + b
    assert predicted == measured
    assert memory.lora_bytes == sum(measured.values())


def test_runner_is_not_imported_by_metrale() -> None:
    """The rules compute from configs and headers: neither torch nor vllm is imported."""
    code = ("import sys; import metrale_cli.engines.vllm; "
            "print(any(m in sys.modules for m in ('torch', 'vllm', 'numpy')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_rows_marked_run_are_the_families_started_here(runs: dict[str, Run]) -> None:
    """A vLLM row says `checked: run` exactly where a job of this file started the CPU build on
    its family (docs/engines.md's family table reads the same field)."""
    started = {run.model.model_type for run in runs.values() if run.report["started"]}
    assert {f for f, row in VLLM_FAMILIES.items() if row.checked == "run"} == started
