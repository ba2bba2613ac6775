"""Runs SGLang 0.5.23's own LoRA code on CPU tensors for a list of jobs and reports, as JSON,
what it did. Runs under `.venv-sglang`'s python, never under the suite's (it imports no metrale,
only tests/support/job_report.py, stdlib). One process, one SGLang import (tens of seconds),
every job in turn, each published as its own server's settings (its TP size and eviction
policy too) after SGLang's reset of the last one's.

    .venv-sglang/bin/python tests/support/sglang_runner.py JOBS.json OUT.json

JOBS: {"jobs": [JOB, ...]} (or one JOB alone), each
      {"model": DIR (a base config.json), "max_loras_per_batch": N, "dtype": "float32",
       "max_lora_rank": R | null, "lora_target_modules": [..] | null,
       "tp_size": 1,                                     # this process is TP rank 0
       "shared_experts": {"path": P, "width": W, "layers": [..]} | null,  # _base_model
       "own_class": false,                               # SGLang's class: _class_model
       "server_args": {},                                # more ServerArgs fields
       "eviction_policy": "lru",                         # --lora-eviction-policy
       "batches": [[NAME | null, ...], ...],             # running batches through the pool
       "startup": [{"name": N, "path": DIR}, ...],       # --lora-paths
       "runtime": [{"name": N, "path": DIR}, ...]}       # /load_lora_adapter, after start-up
The base model has a `ParallelLMHead` unless its embeddings are tied (so under TP the pool
reads its vocabulary shard from it, as a server's does); `parallel_lm_head` is accepted for
that and changes nothing.

The engine cannot start on a CPU (no CPU `sgl_kernel`), so this builds the part of it that
LoRA touches from SGLang's own classes. First it asks SGLang which class it builds for the
model (model_loader/utils.py `get_model_architecture`, reported as `model_class`). Where that is
its Transformers backend (`TransformersForCausalLM`: no class of SGLang's own for the config's
architecture), it builds that class itself, SGLang's code around the HF model, as one rank of
one (its pipeline and tensor-parallel groups stated as such). Else it builds a base model whose
decoder layers are SGLang's own
`QKVParallelLinear`, `RowParallelLinear`, `MergedColumnParallelLinear`, `VocabParallelEmbedding`
and `ParallelLMHead` (named as SGLang's Llama/Qwen2/Qwen3/Mistral classes name them, with no
`get_hidden_dim` of their own: SGLang's default dims, right for those dense families); with
`own_class`, SGLang's own class for the model instead (`_class_model`: a MoE family's FusedMoE
experts, shared experts and dense layers as SGLang builds them, which is what its pool reads),
whose first batch is not run (FusedMoE's forward needs its GPU kernel). Then a
real `LoRAManager` built by its own `__init__` (so `init_state` runs whole: every start-up
adapter through `_load_lora_adapter`, `init_lora_shapes`, `init_lora_modules` wrapping the
layers, `init_memory_pool` with real buffers on `cpu`, `update_lora_info`; a failure there is
the server not starting). The kernel backend is `torch_native`, the one that runs without a
GPU; loading, validation and the pool do not depend on the backend, and its kernels compute what
the GPU ones do (`x A^T B^T` times the adapter's scale). The only change to the libraries is
that host tensors are not pinned (pinning needs a CUDA driver; it changes no value). Then each
runtime adapter goes through `_load_lora_adapter` against the running pool (a failure is the
HTTP 400 answer; the server keeps serving), and each
loaded adapter (at TP 1) through its first batch: `fetch_new_loras`, which copies it into a
pool slot (`LoRAMemoryPool.prepare_lora_batch` / `load_lora_weight_to_buffer`); an error there
is raised in the scheduler's forward step. On the Transformers backend the batch then runs one
forward pass of the HF backbone as `_run_hf_backbone` shapes it (one token, a batch dimension of
1), with HF's eager attention in place of SGLang's RadixAttention (which needs a server's
forward batch): the LoRA-wrapped layers see the input they see in a server, and an error there
is the first batch's. With `batches`, those run first, in turn.

OUT per job: per adapter accepted or the error's class and text; the scaling its `LoRAAdapter`
holds; its normalised target modules; the weight names it kept per layer and off the layers;
its first batch (ok, or the error's class and text) and, per pool buffer and layer, the sum of
absolute values its slot holds, and one decode step's output delta through each wrapped layer
(its input too; none on the Transformers backend, whose forward is the backbone's). Then the
class SGLang builds, the modules its LoRA manager wrapped (their last names), the server's
target set and rank, and the pool's buffers:
every A/B tensor's name, layer, shape and bytes, and their total. One JOB alone in, its report
alone out.
"""

from __future__ import annotations

import os
import re
from typing import Any

import job_report

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _unpinned_tensors() -> None:
    """Pinning host memory without a CUDA driver raises (`torch.tensor` and `torch.zeros` with
    `pin_memory=True`, `Tensor.pin_memory()`); here they leave the tensor unpinned, its values
    unchanged."""
    import torch

    if torch.cuda.is_available():
        return
    make = torch.tensor

    def tensor(*args: Any, pin_memory: bool = False, **kwargs: Any) -> Any:
        return make(*args, **kwargs)

    torch.tensor = tensor
    zeros = torch.zeros

    def zeros_unpinned(*args: Any, pin_memory: bool = False, **kwargs: Any) -> Any:
        return zeros(*args, **kwargs)

    torch.zeros = zeros_unpinned
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self


def _publish(job: dict[str, Any]) -> Any:
    """The process-wide server settings SGLang's LoRA code reads (`runtime_context.get_lora`,
    `get_parallel`), published as the scheduler of TP rank 0 publishes them (`publish` with
    the launcher's placement, world rank 0: every TP, pipeline, attention and MoE rank its
    own rules give rank 0), after SGLang's own reset of what the last job published
    (`reset_context`: a fresh server's state)."""
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    reset_context()

    args = ServerArgs(
        model_path=job["model"], device="cpu", enable_lora=True,
        max_loras_per_batch=job.get("max_loras_per_batch", 8),
        lora_eviction_policy=job.get("eviction_policy", "lru"),
        lora_backend="torch_native", tp_size=job.get("tp_size", 1), skip_server_warmup=True,
        attention_backend=job.get("attention_backend"), **job.get("server_args", {}),
    )
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0))
    return args


def _model_class(model_dir: str) -> tuple[Any, str, Any]:
    """The class SGLang builds for the model, the architecture it resolved, and the config
    object SGLang loads (its own config classes where it has them: configs/qwen3_next.py's
    `layers_block_type`), which a server hands its model class and LoRA manager."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.utils import get_model_architecture

    config = ModelConfig(model_dir)
    return (*get_model_architecture(config), config.hf_config)


def _rank_zero_groups(tp: int) -> None:
    """The process groups a model class reads as it is built, stated as TP rank 0's of `tp`
    (a server builds them with torch.distributed; building reads only their sizes and this
    rank's place): the pipeline group of one, the TP group, and the MoE TP group, which at
    expert parallelism 1 is the TP group itself (layers/moe/utils.py
    post_experts_reduction_group compares them by identity)."""
    import types

    from sglang.srt.runtime_context import get_parallel

    alone = types.SimpleNamespace(is_first_rank=True, is_last_rank=True, world_size=1,
                                  rank_in_group=0)
    tp_group = types.SimpleNamespace(is_first_rank=True, is_last_rank=True, world_size=tp,
                                     rank_in_group=0, cpu_group=None, device_group=None)
    get_parallel().override_permanently(pp_group=alone, tp_group=tp_group,
                                        moe_tp_group=tp_group)


def _class_model(cls: Any, hf_config: Any, tp: int) -> Any:
    """The class SGLang builds for the model (`_model_class`: its own, or its Transformers
    backend around the HF model), built on the CPU as TP rank 0 of `tp` (`_rank_zero_groups`),
    its weights zero. SGLang's own classes bring their FusedMoE experts, shared experts and
    dense layers at SGLang's widths, which its pool reads. Their rotary embeddings are the
    ones a GPU server builds, on their CPU path: off CUDA, layers/rotary_embedding/base.py
    imports a fallback kernel (vllm._custom_ops) unless SGLang runs its CPU engine (`_is_cpu`),
    which needs sgl_kernel's CPU build; and on a `cpu` device factory.py get_rope_wrapper
    (DeepSeek's attention) takes get_rope_cpu, which has DeepSeek's YaRN alone, where a GPU
    server takes get_rope (the same arguments, the device aside). The embeddings are no part
    of LoRA and neither change touches anything else."""
    import sglang.srt.layers.rotary_embedding.base as rotary
    import sglang.srt.layers.rotary_embedding.factory as rope_factory
    import torch

    rotary._is_cpu = True
    rope_factory.get_rope_cpu = lambda *args: rope_factory.get_rope(*args[:-1])
    _rank_zero_groups(tp)
    model = cls(hf_config)
    for p in model.parameters():  # as the stand-in's: a zero base
        torch.nn.init.zeros_(p.data)
    return model


def _base_model(hf_config: Any, shared: dict[str, Any] | None = None) -> Any:
    """The dense decoder's LoRA-facing layers, SGLang's own classes at SGLang's names. With
    `shared` ({"path": "mlp.shared_expert", "width": W, "layers": [...]}), those layers hold
    an MoE block's shared expert instead of the dense MLP: the same two classes at that path
    and width, as SGLang's qwen2_moe.py (Qwen2MoeMLP) and glm4_moe.py build it; the routed
    experts beside it are not built (FusedMoE needs a GPU kernel), so the pool has no `_moe`
    buffers."""
    import torch
    from sglang.srt.layers.linear import (
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    c = hf_config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    qkv_bias = c.model_type == "qwen2"  # Qwen2's q/k/v carry biases

    def layer(i: int) -> torch.nn.Module:
        attn = torch.nn.Module()
        attn.qkv_proj = QKVParallelLinear(c.hidden_size, head_dim, c.num_attention_heads,
                                          c.num_key_value_heads, bias=qkv_bias)
        attn.o_proj = RowParallelLinear(c.num_attention_heads * head_dim, c.hidden_size,
                                        bias=False)
        width = c.intermediate_size
        mlp = torch.nn.Module()
        block = torch.nn.Module()
        block.self_attn, block.mlp = attn, mlp
        if shared and i in shared["layers"]:
            width = shared["width"]
            mlp = torch.nn.Module()
            setattr(block.mlp, shared["path"].split(".", 1)[1], mlp)
        mlp.gate_up_proj = MergedColumnParallelLinear(c.hidden_size, [width] * 2, bias=False)
        mlp.down_proj = RowParallelLinear(width, c.hidden_size, bias=False)
        return block

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = c
            self.model = torch.nn.Module()
            self.model.embed_tokens = VocabParallelEmbedding(c.vocab_size, c.hidden_size)
            self.model.layers = torch.nn.ModuleList(layer(i) for i in range(c.num_hidden_layers))
            self.lm_head = (self.model.embed_tokens if getattr(c, "tie_word_embeddings", False)
                            else ParallelLMHead(c.vocab_size, c.hidden_size))

    model = Model()
    for p in model.parameters():  # the LoRA delta is what is measured: a zero base
        torch.nn.init.zeros_(p.data)
    return model


def _error(exc: BaseException) -> dict[str, str]:
    return {"type": type(exc).__name__, "text": str(exc)}


def _strip_layer(name: str) -> str:
    return re.sub(r"\.layers\.\d+\.", ".layers.N.", name)


def _adapter_entry(manager: Any, ref: Any) -> dict[str, Any]:
    from sglang.srt.lora.utils import get_normalized_target_modules

    config = manager.configs[ref.lora_id]
    adapter = manager.loras[ref.lora_id]
    entry: dict[str, Any] = {"name": ref.lora_name, "accepted": True,
                             "scaling": adapter.scaling, "r": config.r}
    try:
        entry["target_modules"] = sorted(get_normalized_target_modules(config.target_modules))
    except ValueError as exc:
        entry["target_modules_error"] = str(exc)
    entry["layer_weights"] = sorted({_strip_layer(n) for layer in adapter.layers
                                     for n in layer.weights})
    entry["layers"] = sorted(i for i, layer in enumerate(adapter.layers) if layer.weights)
    entry["embedding_weights"] = sorted(adapter.embedding_layers)
    return entry


def _error_class(manager: Any, ref: Any) -> str:
    """`_load_lora_adapter` returns only the text; the class comes from re-running the same
    steps (pure until `self.configs` is written, which is undone here)."""
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


def _first_batch(manager: Any, ref: Any, hf_backbone: bool) -> dict[str, Any]:
    """The adapter's first batch: SGLang copies it into a pool slot; then the sum of absolute
    values its slot holds per buffer (and layer), to match against the file's tensors, and the
    forward pass (`_hf_forward` on the Transformers backend, else `_decode_deltas`)."""
    try:
        manager.fetch_new_loras({ref.lora_id})
    except Exception as exc:
        return {"ok": False, "error": _error(exc)}
    pool = manager.memory_pool
    slot = pool.uid_to_buffer_id[ref.lora_id]
    mass = {}
    for kind, table in (("A", pool.A_buffer), ("B", pool.B_buffer)):
        for module, per_layer in table.items():
            mass[f"{kind}.{module}"] = [float(t[slot].double().abs().sum()) for t in per_layer]
    for kind, table in (("embedding_A", pool.embedding_A_buffer),
                        ("embedding_B", pool.embedding_B_buffer),
                        ("lm_head_A", pool.lm_head_A_buffer),
                        ("lm_head_B", pool.lm_head_B_buffer)):
        for module, t in table.items():
            mass[f"{kind}.{module}"] = [float(t[slot].double().abs().sum())]
    if not hf_backbone:
        return {"ok": True, "mass": mass, "deltas": _decode_deltas(manager, ref)}
    try:
        _hf_forward(manager, ref)
    except Exception as exc:
        return {"ok": False, "error": _error(exc), "mass": mass}
    return {"ok": True, "mass": mass, "deltas": {}}


def _hf_forward(manager: Any, ref: Any) -> None:
    """One decode step of one request naming the adapter through the Transformers backend's HF
    model, its input shaped as `TransformersBase._run_hf_backbone` shapes it
    (`input_ids[None, ...]`), attention eager (module docstring)."""
    import types

    import torch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    manager.prepare_lora_batch(types.SimpleNamespace(
        forward_mode=ForwardMode.DECODE, batch_size=1, lora_ids=[ref.lora_id]))
    hf_model = manager.base_model.model
    hf_model.config._attn_implementation = "eager"
    ids = torch.tensor([5])
    with torch.no_grad():
        hf_model(input_ids=ids[None, ...], position_ids=torch.zeros_like(ids)[None, ...],
                 use_cache=False, return_dict=False)


def _decode_deltas(manager: Any, ref: Any) -> dict[str, Any]:
    """One decode step of one request naming the adapter, through each wrapped layer's own
    forward (the torch_native kernels) for a seeded input: the base weights are zero, so the
    output is the LoRA delta.
    The batch is a stand-in `ForwardBatch` with the three fields a decode batch's LoRA
    preparation reads."""
    import types

    import torch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    manager.prepare_lora_batch(types.SimpleNamespace(
        forward_mode=ForwardMode.DECODE, batch_size=1, lora_ids=[ref.lora_id]))
    gen = torch.Generator().manual_seed(0)
    out = {}
    with torch.no_grad():
        for layer in manager.lora_modules:
            for path, module in layer.items():
                x = torch.randn(1, module.base_layer.input_size, generator=gen)
                out[path] = {"x": x[0].tolist(), "delta": module(x)[0][0].tolist()}
    return out


def _pool_record(pool: Any) -> dict[str, Any]:
    import torch

    buffers, total = [], 0
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
    return {"buffers": buffers, "bytes": total}


def run_job(job: dict[str, Any], server_args: Any) -> dict[str, Any]:
    import torch
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.lora.lora_manager import LoRAManager
    from sglang.srt.lora.lora_registry import LoRARef
    from transformers import AutoConfig

    report: dict[str, Any] = {"startup": [], "runtime": [], "started": False}
    cls, report["model_class"], sglang_config = _model_class(job["model"])
    hf_backbone = report["model_class"].startswith("Transformers")
    own = job.get("own_class", False) and not hf_backbone
    hf_config = sglang_config if own else AutoConfig.from_pretrained(job["model"])
    base_model = (_class_model(cls, hf_config, job.get("tp_size", 1)) if hf_backbone or own
                  else _base_model(hf_config, job.get("shared_experts")))
    # pinned: the server passes False unless `--lora-paths` JSON pins it.
    startup = [LoRARef(lora_name=s["name"], lora_path=s["path"], pinned=False)
               for s in job.get("startup", [])]
    targets = job.get("lora_target_modules")
    try:
        # ModelRunner.init_lora_manager's call, with the flags the job gives.
        manager = LoRAManager(
            base_model=base_model, base_hf_config=hf_config,
            max_loras_per_batch=job.get("max_loras_per_batch", 8), load_config=LoadConfig(),
            dtype=getattr(torch, job.get("dtype", "float32")), server_args=server_args,
            lora_backend="torch_native", max_lora_rank=job.get("max_lora_rank"),
            target_modules=set(targets) if targets else None, lora_paths=startup)
    except Exception as exc:  # init_state raised: the server does not start
        report["start_error"] = _error(exc)
        return report
    report["started"] = True
    tops = {"embed_tokens": manager.embed_tokens_module, "lm_head": manager.lm_head_module}
    report["wrapped"] = sorted({name.rsplit(".", 1)[-1] for layer in manager.lora_modules
                                for name in layer} | {m for m, w in tops.items() if w is not None})
    report["target_modules"] = sorted(manager.target_modules)
    report["max_lora_rank"] = manager.max_lora_rank
    report["pool"] = _pool_record(manager.memory_pool)
    refs = list(startup)
    report["startup"] = [_adapter_entry(manager, ref) for ref in startup]
    for spec in job.get("runtime", []):
        ref = LoRARef(lora_name=spec["name"], lora_path=spec["path"], pinned=False)
        result = manager._load_lora_adapter(ref)
        if result.success:
            report["runtime"].append(_adapter_entry(manager, ref))
            refs.append(ref)
        else:
            report["runtime"].append({"name": ref.lora_name, "accepted": False, "error": {
                "type": _error_class(manager, ref), "text": result.error_message}})
    if "batches" in job:
        report["batches"] = _replay_batches(manager, job["batches"])
    # A rank's layers cannot run its forward without its peers, nor FusedMoE without its GPU
    # kernel: SGLang's own class gives the pool only.
    if job.get("tp_size", 1) == 1 and not own:
        entries = {e["name"]: e for e in report["startup"] + report["runtime"]}
        for ref in refs:
            entries[ref.lora_name]["batch"] = _first_batch(manager, ref, hf_backbone)
    return report


def _replay_batches(manager: Any, batches: list[list[str | None]]) -> list[Any]:
    """Job key `batches`: each a running batch's adapters by name (None: the base model), in
    turn through `fetch_new_loras` (the pool's own `prepare_lora_batch`, its slots and
    eviction), from the pool as `init_memory_pool` left it. After each, the adapter each slot
    holds: its name, None for the base model, "" for an empty slot."""
    from sglang.srt.lora.mem_pool import EMPTY_SLOT

    ids = {ref.lora_name: lora_id for lora_id, ref in manager.lora_refs.items()}
    names = {lora_id: name for name, lora_id in ids.items()}
    states = []
    for batch in batches:
        manager.fetch_new_loras({None if n is None else ids[n] for n in batch})
        states.append(["" if uid is EMPTY_SLOT else None if uid is None else names[uid]
                       for uid in manager.memory_pool.buffer_id_to_uid])
    return states


def main(spec: dict[str, Any], out_path: str) -> int:
    jobs = spec.get("jobs", [spec])
    _unpinned_tensors()
    out: dict[str, Any] = {"jobs": []}
    for job in jobs:
        out["jobs"].append(run_job(job, _publish(job)))
        job_report.save(out if "jobs" in spec else out["jobs"][0], out_path)
    return 0


if __name__ == "__main__":
    job_report.run(main)
