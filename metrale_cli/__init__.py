"""metrale: audit, lay out, pack and benchmark multi-LoRA adapter pools.

The library API (docs/library.md): `from metrale_cli import plan_pool, LoraPool, ...`. Each name
is imported from its stage on first use (PEP 562), so `import metrale_cli` costs what it did
before the API existed and `metrale --help` still imports no NumPy; `__all__` and `dir()` list
every name.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

# name -> the module that defines it, in the order data flows (docs/architecture.md).
_API = {
    # errors every stage raises (the CLI maps each to an exit code)
    "MetraleError": "metrale_cli.errors",
    "UsageError": "metrale_cli.errors",
    "FormatError": "metrale_cli.errors",
    "NotServable": "metrale_cli.errors",
    "ImageInconsistent": "metrale_cli.errors",
    "PoolFull": "metrale_cli.errors",
    "SlotBusy": "metrale_cli.errors",
    "EngineFailed": "metrale_cli.errors",
    "EngineTimeout": "metrale_cli.errors",
    # the base model
    "ModelConfig": "metrale_cli.model.config",
    "LayerType": "metrale_cli.model.config",
    "PRESETS": "metrale_cli.model.config",
    "resolve_model": "metrale_cli.model.resolve",
    "LoraModule": "metrale_cli.model.modules",
    # adapters: loading, the audit, synthetic adapters
    "Adapter": "metrale_cli.adapters.adapter",
    "AdapterConfig": "metrale_cli.adapters.adapter",
    "load_adapter": "metrale_cli.adapters.adapter",
    "load_adapters": "metrale_cli.adapters.loading",
    "model_for": "metrale_cli.adapters.loading",
    "audit": "metrale_cli.adapters.audit",
    "AdapterReport": "metrale_cli.adapters.audit",
    "Finding": "metrale_cli.adapters.findings",
    "Severity": "metrale_cli.adapters.findings",
    "synth_adapter": "metrale_cli.adapters.synth",
    # layouts and plans
    "SlotLayout": "metrale_cli.layout.slot_layout",
    "ExpertLayout": "metrale_cli.layout.expert_layout",
    "ShardSpec": "metrale_cli.layout.sharding",
    "ShardedPlan": "metrale_cli.layout.sharding",
    "rank_layouts": "metrale_cli.layout.sharding",
    "PoolPlan": "metrale_cli.layout.plan",
    "Footprint": "metrale_cli.layout.plan",
    "plan_layouts": "metrale_cli.layout.plan",
    "kernel_max_rank": "metrale_cli.layout.plan",
    "AuditedAdapters": "metrale_cli.layout.pipeline",
    "PlannedPool": "metrale_cli.layout.pipeline",
    "audit_adapters": "metrale_cli.layout.pipeline",
    "plan_pool": "metrale_cli.layout.pipeline",
    # serving engines: what vLLM does with the adapters, its flags, memory and cache
    "get_engine": "metrale_cli.engines",
    "Engine": "metrale_cli.engines.engine",
    "SlotTiers": "metrale_cli.engines.engine",
    "Verdict": "metrale_cli.engines.verdict",
    "EngineVerdict": "metrale_cli.engines.verdict",
    "EngineInspection": "metrale_cli.engines.answers",
    "engine_inspect": "metrale_cli.engines.answers",
    "engine_layout": "metrale_cli.engines.answers",
    "confirm": "metrale_cli.engines.vllm.confirm",
    "Confirmation": "metrale_cli.engines.vllm.confirm",
    "VllmServer": "metrale_cli.engines.vllm.confirm",
    # the pool and its slot manager
    "LoraPool": "metrale_cli.pool.pool",
    "SlotManager": "metrale_cli.pool.slots",
    "AdapterSlot": "metrale_cli.pool.slots",
    "pack_pool": "metrale_cli.image.pack",
    # pool images
    "PoolImage": "metrale_cli.image.pool_image",
    "write_image": "metrale_cli.image.pool_image",
    "show_image": "metrale_cli.image.show",
    "Verifier": "metrale_cli.image.verify",
    "unpack": "metrale_cli.image.unpack",
    # tensor-parallel peers: a slot from one process's pool into another's
    "send_slot": "metrale_cli.dist.torchrun",
    "receive_slot": "metrale_cli.dist.torchrun",
    # the simulator
    "Workload": "metrale_cli.sim.workload",
    "GeneratorSpec": "metrale_cli.sim.workload",
    "generate": "metrale_cli.sim.workload",
    "read_trace": "metrale_cli.sim.workload",
    "Targets": "metrale_cli.sim.simulate",
    "simulate": ("metrale_cli.sim.simulate", "run"),
    "EngineCache": "metrale_cli.sim.simulate",
    "SimulateRequest": "metrale_cli.sim.request",
}

__all__ = ["__version__", *_API]


def __getattr__(name: str) -> Any:
    where = _API.get(name)
    if where is None:
        raise AttributeError(f"module 'metrale_cli' has no attribute {name!r}")
    module, attr = where if isinstance(where, tuple) else (where, name)
    import inspect
    from importlib import import_module

    value = getattr(import_module(module), attr)
    if inspect.isfunction(value):
        # Arguments of the wrong type are a UsageError naming them (arguments.py).
        from metrale_cli.arguments import checked

        value = checked(value, name)
    globals()[name] = value  # resolved once: later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
