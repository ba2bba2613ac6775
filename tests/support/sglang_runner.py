"""Runs SGLang 0.5.23's own LoRA code on CPU tensors for one job and reports, as JSON, what it
did. Runs under `.venv-sglang`'s python, never under the suite's (it imports no metrale and no
test helper).

    .venv-sglang/bin/python tests/support/sglang_runner.py JOB.json OUT.json

JOB: {"model": DIR (a base config.json), "max_loras_per_batch": N, "dtype": "float32",
      "max_lora_rank": R | null, "lora_target_modules": [..] | null, "tp_size": 1,
      "startup": [{"name": N, "path": DIR}, ...],      # --lora-paths
      "runtime": [{"name": N, "path": DIR}, ...]}      # /load_lora_adapter, after start-up

The engine cannot start on a CPU (no CPU `sgl_kernel`), so this drives the LoRA manager's own
methods in the order `LoRAManager.init_state` calls them: every start-up adapter through
`_load_lora_adapter` (its `LoRAConfig`, `validate_new_adapter` and `LoRAAdapter.
initialize_weights` on the real directory; a failure there is `init_lora_adapters`'
RuntimeError: the server does not start), then `init_lora_shapes` and a real `LoRAMemoryPool`
with buffers on `cpu`; then each runtime adapter through `_load_lora_adapter` against that pool
(a failure there is the HTTP 400 answer; the server keeps serving). What is skipped is only what
needs the real model class or a GPU: `init_lora_modules` (wrapping layers with the LoRA kernels'
backend) and the backend's target check. The base model is a stand-in with SGLang's default
hidden-dim rules (`utils.get_default_hidden_dim`), right for dense Llama, Qwen2, Qwen3, Mistral.

OUT per adapter: accepted or the error's class and text; the scaling its `LoRAAdapter` holds;
its normalised target modules; the weight names it kept per layer and the embedding keys. Then
the server's target set and rank, and the pool's buffers: every A/B tensor's name, layer, shape
and bytes, and their total.
"""

from __future__ import annotations

import os
from typing import Any

import job_report

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _publish(job: dict[str, Any]) -> None:
    """The process-wide server settings SGLang's LoRA code reads (`runtime_context.get_lora`,
    `get_parallel`), published as the scheduler publishes them."""
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    args = ServerArgs(
        model_path=job["model"], device="cpu", enable_lora=True,
        max_loras_per_batch=job.get("max_loras_per_batch", 8),
        lora_eviction_policy=job.get("eviction_policy", "lru"),
        tp_size=job.get("tp_size", 1), skip_server_warmup=True,
    )
    set_global_server_args_for_scheduler(args)
    from sglang.srt.runtime_context import get_parallel

    # This process is rank 0 of its tensor-parallel group (the pool's shapes are per rank).
    get_parallel().override_permanently(tp_rank=0)


def _stand_in(hf_config: Any) -> Any:
    """A base model with one CPU parameter and no model-specific LoRA hooks: SGLang then uses
    its default hidden dims and stacking (`get_hidden_dim`, `get_stacked_multiply`)."""
    import torch

    class StandIn(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.anchor = torch.nn.Parameter(torch.zeros(1))
            self.config = hf_config

    return StandIn()


def _manager(job: dict[str, Any], hf_config: Any, base_model: Any) -> Any:
    """A LoRAManager with the state `__init__` sets before `init_state`, without the kernel
    backend (it needs a GPU); `init_lora_adapters` starts the adapter tables."""
    import torch
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.lora.lora_manager import LoRAManager

    manager = LoRAManager.__new__(LoRAManager)
    manager.base_model = base_model
    manager.base_hf_config = hf_config
    manager.max_loras_per_batch = job.get("max_loras_per_batch", 8)
    manager.load_config = LoadConfig()
    manager.dtype = getattr(torch, job.get("dtype", "float32"))
    manager.device = torch.device("cpu")
    manager.attn_tp_size = job.get("tp_size", 1)
    manager.attn_dp_enabled = False
    manager.lora_added_tokens_size = None
    manager.enable_lora_overlap_loading = False
    manager.eviction_policy = job.get("eviction_policy", "lru")
    manager.lora_strict_loading = False
    manager.speculative_algorithm = None
    manager.lora_backend = None
    manager.init_lora_adapters(None)
    return manager


def _adapter_entry(manager: Any, ref: Any, result: Any) -> dict[str, Any]:
    from sglang.srt.lora.utils import get_normalized_target_modules

    entry: dict[str, Any] = {"name": ref.lora_name, "accepted": bool(result.success)}
    if not result.success:
        entry["error"] = {"type": "ValueError" if result.error_message else "Error",
                          "text": result.error_message}
        return entry
    config = manager.configs[ref.lora_id]
    adapter = manager.loras[ref.lora_id]
    entry["scaling"] = adapter.scaling
    entry["r"] = config.r
    try:
        entry["target_modules"] = sorted(get_normalized_target_modules(config.target_modules))
    except ValueError as exc:
        entry["target_modules_error"] = str(exc)
    entry["layer_weights"] = sorted({_strip_layer(n) for layer in adapter.layers
                                     for n in layer.weights})
    entry["embedding_weights"] = sorted(adapter.embedding_layers)
    return entry


def _strip_layer(name: str) -> str:
    import re

    return re.sub(r"\.layers\.\d+\.", ".layers.N.", name)


def _load(manager: Any, spec: dict[str, Any], exc_class: list[str]) -> Any:
    """`_load_lora_adapter` returns a failed result with only the text; the class comes from
    re-raising the same steps when it failed (they are pure: no state is kept on failure
    before `self.configs` is written, which is undone here)."""
    from sglang.srt.lora.lora_registry import LoRARef

    # pinned: the server passes False unless the request pins it (`--lora-paths` JSON).
    ref = LoRARef(lora_name=spec["name"], lora_path=spec["path"], pinned=False)
    result = manager._load_lora_adapter(ref)
    if not result.success:
        manager.configs.pop(ref.lora_id, None)
        manager.loras.pop(ref.lora_id, None)
        exc_class.append(_error_class(manager, ref))
    return ref, result


def _error_class(manager: Any, ref: Any) -> str:
    from sglang.srt.lora.lora_config import LoRAConfig

    try:
        config = LoRAConfig(ref.lora_path, base_vocab_size=manager.base_hf_config.vocab_size)
        manager.validate_new_adapter(config, ref)
        manager.configs[ref.lora_id] = config
        manager.load_lora_weights(ref)
    except Exception as exc:
        return type(exc).__name__
    finally:
        manager.configs.pop(ref.lora_id, None)
        manager.loras.pop(ref.lora_id, None)
    return "Error"


def main(job: dict[str, Any], out_path: str) -> int:
    report: dict[str, Any] = {"startup": [], "runtime": [], "started": False}

    def save() -> None:
        job_report.save(report, out_path)

    import torch
    from sglang.srt.lora.mem_pool import LoRAMemoryPool
    from transformers import AutoConfig

    _publish(job)
    hf_config = AutoConfig.from_pretrained(job["model"])
    base_model = _stand_in(hf_config)
    manager = _manager(job, hf_config, base_model)
    # init_lora_adapters: each --lora-paths adapter; the first failure stops the start-up.
    for spec in job.get("startup", []):
        classes: list[str] = []
        ref, result = _load(manager, spec, classes)
        entry = _adapter_entry(manager, ref, result)
        if classes:
            entry["error"]["type"] = classes[0]
        report["startup"].append(entry)
        if not result.success:
            report["start_error"] = {
                "type": "RuntimeError",
                "text": f"Failed to load LoRA adapter {ref.lora_name}: {result.error_message}"}
            save()
            return 0
    targets = job.get("lora_target_modules")
    try:
        manager.init_lora_shapes(max_lora_rank=job.get("max_lora_rank"),
                                 target_modules=set(targets) if targets else None)
        manager.experts_shared_outer_loras = False
        pool = LoRAMemoryPool(
            base_hf_config=hf_config, max_loras_per_batch=manager.max_loras_per_batch,
            dtype=manager.dtype, max_lora_rank=manager.max_lora_rank,
            target_modules=manager.target_modules, base_model=base_model,
            eviction_policy=manager.eviction_policy,
            lora_added_tokens_size=manager.lora_added_tokens_size)
    except Exception as exc:  # the start-up's shape inference or the pool refused
        report["start_error"] = {"type": type(exc).__name__, "text": str(exc)}
        save()
        return 0
    manager.memory_pool = pool
    report["started"] = True
    report["target_modules"] = sorted(manager.target_modules)
    report["max_lora_rank"] = manager.max_lora_rank
    buffers = []
    total = 0
    for kind, table in (("A", pool.A_buffer), ("B", pool.B_buffer)):
        for module, per_layer in table.items():
            for layer, t in enumerate(per_layer):
                if isinstance(t, torch.Tensor):
                    size = t.numel() * t.element_size()
                    buffers.append([kind, module, layer, list(t.shape), size])
                    total += size
    for kind, table in (("embedding_A", pool.embedding_A_buffer),
                        ("embedding_B", pool.embedding_B_buffer),
                        ("lm_head_A", pool.lm_head_A_buffer),
                        ("lm_head_B", pool.lm_head_B_buffer)):
        for module, t in table.items():
            size = t.numel() * t.element_size()
            buffers.append([kind, module, None, list(t.shape), size])
            total += size
    report["pool"] = {"buffers": buffers, "bytes": total}
    save()
    # /load_lora_adapter: each against the running pool; a failure is HTTP 400, serving goes on.
    for spec in job.get("runtime", []):
        classes = []
        ref, result = _load(manager, spec, classes)
        entry = _adapter_entry(manager, ref, result)
        if classes:
            entry["error"]["type"] = classes[0]
        report["runtime"].append(entry)
        save()
    return 0


if __name__ == "__main__":
    job_report.run(main)
