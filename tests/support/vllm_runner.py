"""Runs the real vLLM on a list of jobs and reports what it did, as JSON. Runs under
`.venv-vllm`'s python, never under the suite's (it imports no metrale and no test helper).

    .venv-vllm/bin/python tests/support/vllm_runner.py JOBS.json OUT.json

JOBS: {"jobs": [JOB, ...], "claims": DIR} (or one JOB alone; OUT is then its report alone), each
      {"model": DIR, "engine": {LLM kwargs over FIXED, below},
       "prompt": [token ids], "logprobs": K,
       "adapters": [{"name": N, "path": DIR, "via": "serve" | "request"}, ...]}

Runners given the same JOBS and claims directory share the jobs out: each takes the next job
no runner has claimed (a file per job in DIR, created exclusively), so a runner that drew short
jobs goes on to the next while another still runs a long one. OUT lists the jobs this runner
ran, each with its "index" in JOBS.

One engine per job (none where vLLM refuses the model in this process, before it starts one),
started the way `vllm serve` runs it (engine core and worker each in their own process), so an
error that ends the engine here ends it there; it is shut down before the next job's starts. The
jobs share this process's vLLM import (about 13 CPU-seconds), not the engine's: each engine core
and worker is a fresh interpreter, as under `vllm serve`. Each adapter is tried in turn with one
greedy next-token request: loaded (with the top-K next-token log-probs), or the error's type and
text, and whether the engine still answers a base-model request afterwards. The base model's own
log-probs come first, so an adapter that changes nothing is visible as equal log-probs.
OUT also holds the LoRA tensors the engine allocated, per wrapped module: every stacked A/B
buffer's shape, dtype and bytes (a view of a buffer already counted: 0), read off the model
inside the engine's worker.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

import job_report

# The model's modules travel back from the worker process as plain data; vLLM serialises the
# function that reads them only with this set.
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Printed as each job starts (`n`: its index in JOBS).
JOB_LOG_MARK = "vllm_runner: job {} starts"

# Every engine here: a tiny model, no tokenizer, eager (no torch.compile), a few short requests,
# and a KV cache of 128 MiB (the CPU build's default reserves a share of the machine's memory):
# with an explicit size and eager mode the CPU worker skips its warm-up pass.
FIXED = {"skip_tokenizer_init": True, "enforce_eager": True, "enable_lora": True,
         "dtype": "float32", "max_model_len": 64, "max_num_seqs": 4,
         "max_num_batched_tokens": 64, "kv_cache_memory_bytes": 128 << 20}


def start_engine(job: dict[str, Any]) -> Any:
    """The job's `LLM`: FIXED under the job's own "engine" kwargs. Its worker process can import
    this directory's modules, so a probe passed to `apply_model` or `collective_rpc` travels by
    reference (module and name)."""
    here = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (here, os.environ.get("PYTHONPATH")) if p)
    from vllm import LLM

    return LLM(model=job["model"], **{**FIXED, **job.get("engine", {})})


def lora_buffers(model: Any) -> dict[str, Any]:
    """Every LoRA-wrapped module's stacked buffers: {module: {"class": C, "tensors": [[name,
    shape, dtype, bytes]]}}. Runs inside the worker."""
    import torch
    from vllm.lora.layers import BaseLayerWithLoRA

    found: dict[str, Any] = {}
    # A buffer can be a view of another (the embedding's 2-D alias of its A stack): bytes
    # count once per storage.
    storages: set[int] = set()
    for name, module in model.named_modules():
        if not isinstance(module, BaseLayerWithLoRA):
            continue
        tensors = []
        for attr, value in vars(module).items():
            if not attr.startswith(("lora_a", "lora_b", "w13_lora", "w2_lora", "w1_lora",
                                    "w3_lora")):
                continue
            items = value if isinstance(value, (tuple, list)) else [value]
            for i, t in enumerate(items):
                if isinstance(t, torch.Tensor):
                    storage = t.untyped_storage().data_ptr()
                    fresh = storage not in storages
                    storages.add(storage)
                    tensors.append([f"{attr}[{i}]", list(t.shape), str(t.dtype).removeprefix(
                        "torch."), t.numel() * t.element_size() if fresh else 0])
        found[name] = {"class": type(module).__name__, "tensors": tensors}
    return found


def main(spec: dict[str, Any], out_path: str) -> int:
    jobs = spec.get("jobs", [spec])
    out: dict[str, Any] = {"jobs": []}

    def save() -> None:
        job_report.save(out if "jobs" in spec else out["jobs"][0], out_path)

    for n, job in enumerate(jobs):
        if "claims" in spec and not claim(spec["claims"], n):
            continue
        # The engine's processes share this output: the line tells one job's log from the next.
        # One write, from a line's start: the last job's engine may still be writing a line in
        # pieces as it shuts down (a resource_tracker warning), which would otherwise run on
        # into the mark and hide it (a runner's job missing from its log, seen once in CI).
        sys.stdout.write("\n" + JOB_LOG_MARK.format(n) + "\n")
        sys.stdout.flush()
        out["jobs"].append({"index": n, "adapters": [], "started": False})
        run_job(job, out["jobs"][-1], save)
    save()
    return 0


def claim(directory: str, n: int) -> bool:
    """Whether this runner takes job `n`: no other runner has (its file in `directory`)."""
    try:
        os.close(os.open(os.path.join(directory, str(n)), os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    return True


def run_job(job: dict[str, Any], report: dict[str, Any], save: Callable[[], None]) -> None:
    """One engine on `job`, its findings in `report` (saved after each step); the engine is shut
    down on the way out, whatever happened."""
    t0 = time.monotonic()
    try:
        llm = start_engine(job)
    except Exception as exc:  # the engine refused the model or the flags
        report["start_error"] = {"type": type(exc).__name__, "text": error_text(exc)}
        save()
        return
    report["started"] = True
    report["start_s"] = round(time.monotonic() - t0, 2)
    try:
        ask_each(job, llm, report, save)
    finally:
        llm.llm_engine.engine_core.shutdown()


def ask_each(job: dict[str, Any], llm: Any, report: dict[str, Any],
             save: Callable[[], None]) -> None:
    """The base model, then each adapter in turn, on the started engine `llm`."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    # By reference: the worker imports this file as `vllm_runner` (start_engine).
    from vllm_runner import lora_buffers as probe

    report["lora_buffers"] = llm.apply_model(probe)[0]
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=job.get("logprobs", 8))
    prompt = {"prompt_token_ids": job["prompt"]}

    def ask(request: Any) -> dict[int, float]:
        result = llm.generate([prompt], params, lora_request=request, use_tqdm=False)
        top = result[0].outputs[0].logprobs[0]
        return {int(k): float(v.logprob) for k, v in top.items()}

    try:
        report["base"] = {str(k): v for k, v in ask(None).items()}
    except Exception as exc:  # the engine started but cannot run this model (with LoRA)
        report["base_error"] = {"type": type(exc).__name__, "text": error_text(exc)}
        save()
        return
    save()
    for i, adapter in enumerate(job["adapters"], start=1):
        entry: dict[str, Any] = {"name": adapter["name"], "via": adapter.get("via", "serve")}
        request = LoRARequest(adapter["name"], i, adapter["path"])
        try:
            if entry["via"] == "serve":
                # What `vllm serve` does for --lora-modules and /v1/load_lora_adapter before any
                # request names the adapter; "request" sends it with the first request instead
                # (the offline LLM API), where a load error happens inside the engine's step.
                llm.llm_engine.add_lora(request)
            probs = ask(request)
            entry["loaded"] = True
            entry["logprobs"] = {str(k): v for k, v in probs.items()}
        except Exception as exc:
            entry["loaded"] = False
            entry["error"] = {"type": type(exc).__name__, "text": error_text(exc)}
            try:
                ask(None)
                entry["engine_alive"] = True
            except Exception as after:
                entry["engine_alive"] = False
                entry["after"] = {"type": type(after).__name__, "text": error_text(after)}
        report["adapters"].append(entry)
        save()
        if entry.get("engine_alive") is False:
            break


def error_text(exc: BaseException) -> str:
    """The error's own text, with its causes (the engine wraps the worker's error)."""
    parts = []
    seen = 0
    while exc is not None and seen < 5:
        parts.append(f"{type(exc).__name__}: {exc}")
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return " <- ".join(parts)[:4000]


if __name__ == "__main__":
    job_report.run(main)
