"""Drives the real vLLM through a fixed request sequence and reports its LoRA cache state after
each request, as JSON. Runs under `.venv-vllm`'s python, never under the suite's (it imports no
metrale and no test helper).

    .venv-vllm/bin/python tests/support/vllm_cache_runner.py JOB.json OUT.json

JOB: {"model": DIR, "engine": {LLM kwargs over vllm_runner.FIXED},
      "prompt": [token ids], "adapters": [DIR, ...], "sequence": [adapter index or -1, ...]}

One offline engine started as tests/support/vllm_runner.py starts one (`start_engine`: engine
core in its own process, as `vllm serve` runs it). Each request of
the sequence is sent alone (`LLM.generate`, one greedy token; -1 is the base model, adapter i
is LoRA id i + 1) and finishes before the next is sent; then the worker's LoRA manager is read
through `collective_rpc`: which adapter each GPU slot holds (`lora_index_to_id`), the GPU
slots' LRU order (`_active_adapters`) and the host cache's (`_registered_adapters`), oldest
first, as adapter indices.
"""

from __future__ import annotations

import time
from typing import Any

import job_report
from vllm_runner import start_engine


def cache_state(worker: Any) -> dict[str, list[int | None]]:
    """The LoRA manager's state inside the worker, as adapter indices (LoRA id - 1)."""
    manager = worker.model_runner.lora_manager._adapter_manager

    def index(lora_id: int | None) -> int | None:
        return None if lora_id is None else lora_id - 1

    return {"slots": [index(i) for i in manager.lora_index_to_id],
            "gpu_lru": [index(i) for i in manager._active_adapters.cache],
            "host_lru": [index(i) for i in manager._registered_adapters.cache]}


def main(job: dict[str, Any], out_path: str) -> int:
    report: dict[str, Any] = {"states": []}
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    t0 = time.monotonic()
    llm = start_engine(job)
    report["start_s"] = round(time.monotonic() - t0, 2)
    # By reference: the worker imports this file as `vllm_cache_runner` (start_engine).
    from vllm_cache_runner import cache_state as probe

    report["initial"] = llm.collective_rpc(probe)[0]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    prompt = {"prompt_token_ids": job["prompt"]}
    requests = [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(job["adapters"])]
    for a in job["sequence"]:
        llm.generate([prompt], params, lora_request=requests[a] if a >= 0 else None,
                     use_tqdm=False)
        report["states"].append(llm.collective_rpc(probe)[0])
    report["run_s"] = round(time.monotonic() - t0, 2)
    job_report.save(report, out_path)
    return 0


if __name__ == "__main__":
    job_report.run(main)
