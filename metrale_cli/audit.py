"""The adapter audit: what of an adapter a pool can serve, at which scale, and why not the rest.

`audit(adapter, model, max_rank)` returns an `AdapterReport`: findings (severity, stable code,
one-line message) and one `ModuleRecord` per adapted (layer, module) pair of the pool's module
set. An `error` finding makes the adapter not servable.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from metrale_cli import env
from metrale_cli.adapter import Adapter, AdapterKey
from metrale_cli.models import ModelConfig
from metrale_cli.modules import ALL, LoraModule
from metrale_cli.safetensors_header import TensorInfo

LORA_DTYPES = ("F32", "BF16", "F16")
BYTES_PER_ELEMENT = 2  # the pool holds BF16


class Severity(str, Enum):
    ERROR = "error"
    WARNING = "warning"
    INFO = "info"


@dataclass(frozen=True)
class Finding:
    severity: Severity
    code: str
    message: str

    def record(self) -> dict[str, str]:
        return {"severity": self.severity.value, "code": self.code, "message": self.message}


@dataclass(frozen=True)
class ModuleRecord:
    """One adapted (layer, module) pair of the pool's module set, with PEFT's scale."""

    layer: int
    module: LoraModule
    r: int
    alpha: float
    scaling: float
    a: TensorInfo
    b: TensorInfo

    @property
    def dtype(self) -> str:
        return self.a.dtype

    def record(self) -> dict[str, Any]:
        return {
            "layer": self.layer,
            "module": self.module.peft_name,
            "r": self.r,
            "alpha": self.alpha,
            "scaling": self.scaling,
            "a_shape": list(self.a.shape),
            "b_shape": list(self.b.shape),
            "dtype": self.dtype,
        }


@dataclass
class AdapterReport:
    adapter: Adapter
    findings: list[Finding] = field(default_factory=list)
    modules: list[ModuleRecord] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.adapter.name

    @property
    def servable(self) -> bool:
        return not any(f.severity is Severity.ERROR for f in self.findings)

    @property
    def rank(self) -> int:
        """The largest rank among the served modules (the config's `r` when none)."""
        return max((m.r for m in self.modules), default=self.adapter.config.r)

    @property
    def module_set(self) -> list[LoraModule]:
        present = {m.module for m in self.modules}
        return [m for m in ALL if m in present]

    @property
    def scaling(self) -> float:
        """The adapter's scale: PEFT's `scaling()` from the config's `r` and `lora_alpha`."""
        cfg = self.adapter.config
        return cfg.scaling(cfg.r, cfg.lora_alpha)

    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity is Severity.ERROR]

    def record(self) -> dict[str, Any]:
        return {
            "path": str(self.adapter.path),
            "name": self.name,
            "servable": self.servable,
            "rank": self.rank,
            "alpha": self.adapter.config.lora_alpha,
            "scaling": self.scaling,
            "use_rslora": self.adapter.config.use_rslora,
            "findings": [f.record() for f in self.findings],
            "modules": [m.record() for m in self.modules],
        }


def layer_ranges(layers: list[int]) -> str:
    """`[0, 1, 2, 5, 7, 8]` -> `0-2, 5, 7-8`."""
    if not layers:
        return "-"
    ordered = sorted(set(layers))
    spans: list[str] = []
    start = prev = ordered[0]
    for n in ordered[1:] + [None]:  # type: ignore[list-item]
        if n is not None and n == prev + 1:
            prev = n
            continue
        spans.append(str(start) if start == prev else f"{start}-{prev}")
        if n is not None:
            start = prev = n
    return ", ".join(spans)


# -- what a key names ---------------------------------------------------------------------------

_SERVABLE = {m.peft_path: m for m in ALL}
_EXPERT = re.compile(
    r"^(mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)$"
)
_FUSED_EXPERTS = re.compile(r"^(mlp|block_sparse_moe)\.experts$")
_ROUTER = re.compile(r"^(mlp|block_sparse_moe)\.gate$")
# Modules a decoder layer has that the pool's eight modules do not cover, and why.
_UNSERVABLE_IN_LAYER = (
    (re.compile(r"^linear_attn\.(in_proj_qkvz|in_proj_ba|in_proj_qkv|in_proj_z|in_proj_a|"
                r"in_proj_b|conv1d)$"),
     "a Gated-DeltaNet input projection; the pool serves linear_attn.out_proj only"),
    (re.compile(r"^mlp\.shared_experts?\.(gate_proj|up_proj|down_proj)$"),
     "a shared-expert projection; shared experts are not in the pool's module set"),
    (re.compile(r"^mlp\.shared_expert_gate$"),
     "the shared-expert gate; not in the pool's module set"),
)
_UNSERVABLE_TOP = (
    (re.compile(r"^(model\.)?embed_tokens$"), "the input embedding (embed_tokens)"),
    (re.compile(r"^lm_head$"), "the output head (lm_head)"),
    (re.compile(r"^(score|classifier|classification_head|qa_outputs)(\..*)?$"),
     "a classifier head"),
    (re.compile(r"^model\.(visual|vision_tower|vision_model)\."), "the vision tower"),
)
_BASE_MUTATING_INITS = ("pissa", "olora", "corda", "lora_ga", "loftq")


class _Collector:
    """Findings grouped by (severity, code, subject) so one line names every layer it hits."""

    def __init__(self) -> None:
        self.layers: dict[tuple[Severity, str, str], list[int]] = defaultdict(list)
        self.single: list[Finding] = []

    def add(self, severity: Severity, code: str, message: str) -> None:
        self.single.append(Finding(severity, code, message))

    def at(self, severity: Severity, code: str, subject: str, layer: int | None) -> None:
        self.layers[(severity, code, subject)].append(-1 if layer is None else layer)

    def findings(self) -> list[Finding]:
        grouped = []
        for (severity, code, subject), layers in self.layers.items():
            real = [n for n in layers if n >= 0]
            where = f" on layers {layer_ranges(real)}" if real else ""
            if len(real) == 1:
                where = f" on layer {real[0]}"
            grouped.append(Finding(severity, code, subject.replace("{where}", where)))
        order = {Severity.ERROR: 0, Severity.WARNING: 1, Severity.INFO: 2}
        return sorted(self.single + grouped, key=lambda f: order[f.severity])


def audit(adapter: Adapter, model: ModelConfig, max_rank: int | None = None) -> AdapterReport:
    report = AdapterReport(adapter)
    out = _Collector()
    _audit_config(adapter, model, out)

    # Pair each module's tensors: (module_key) -> part -> key.
    by_module: dict[str, dict[str, AdapterKey]] = defaultdict(dict)
    for key in adapter.keys:
        by_module[key.module_key][key.part + (".inner" if key.inner else "")] = key

    expert_layers: list[int] = []
    for module_key, parts in sorted(by_module.items(), key=lambda kv: _sort_key(kv[1])):
        any_key = next(iter(parts.values()))
        record = _audit_module(adapter, model, module_key, any_key, parts, out, expert_layers)
        if record is not None:
            report.modules.append(record)

    if expert_layers or adapter.config.target_parameters:
        _explain_experts(adapter, model, expert_layers, out)
    if not report.modules and not any(f.severity is Severity.ERROR for f in out.findings()):
        out.add(Severity.ERROR, "no_servable_modules",
                "the adapter adapts none of the pool's modules "
                f"({', '.join(m.peft_name for m in ALL)})")
    _missing_targets(adapter, model, report.modules, out)
    if max_rank is not None:
        over = [m for m in report.modules if m.r > max_rank]
        for module in {m.module for m in over}:
            ranks = sorted({m.r for m in over if m.module is module})
            out.add(Severity.ERROR, "rank_above_max",
                    f"{module.peft_name} has rank {', '.join(map(str, ranks))} above "
                    f"--max-rank {max_rank}")
    report.modules.sort(key=lambda m: (m.layer, ALL.index(m.module)))
    report.findings = out.findings()
    return report


def _sort_key(parts: dict[str, AdapterKey]) -> tuple[int, str]:
    key = next(iter(parts.values()))
    return (key.layer if key.layer is not None else 1 << 30, key.sub)


def _audit_module(
    adapter: Adapter,
    model: ModelConfig,
    module_key: str,
    key: AdapterKey,
    parts: dict[str, AdapterKey],
    out: _Collector,
    expert_layers: list[int],
) -> ModuleRecord | None:
    cfg = adapter.config
    layer, sub = key.layer, key.sub
    unknown_parts = [p for p in parts if p == ""]
    if unknown_parts:
        for p in parts.values():
            if p.part == "":
                out.add(Severity.ERROR, "unknown_tensor",
                        f"tensor {p.tensor!r} is not a LoRA tensor metrale recognises")
        return None

    # Non-LoRA tensors: whole modules, base biases, DoRA magnitudes, trainable tokens.
    for part, code, what in (
        ("lora_magnitude_vector", "dora", "DoRA magnitude vectors (lora_magnitude_vector)"),
        ("lora_B.bias", "lora_bias", "LoRA B biases (lora_B.bias)"),
        ("base_layer.bias", "bias", "trained base biases (base_layer.bias)"),
        ("base_layer.weight", "full_weights", "full base weights (base_layer.weight)"),
        ("weight", "modules_to_save", "full module copies (modules_to_save)"),
        ("bias", "modules_to_save", "full module copies (modules_to_save)"),
        ("token_adapter.trainable_tokens_delta", "trainable_tokens",
         "trainable token rows (trainable_tokens_delta)"),
        ("lora_embedding_A", "embedding_lora", "embedding LoRA (lora_embedding_A/B)"),
        ("lora_embedding_B", "embedding_lora", "embedding LoRA (lora_embedding_A/B)"),
    ):
        if part in parts:
            out.at(Severity.ERROR, code,
                   f"{what} for {sub}{{where}}: not a plain additive LoRA delta", layer)

    a_key = parts.get("lora_A.weight") or parts.get("lora_A.weight.inner")
    b_key = parts.get("lora_B.weight") or parts.get("lora_B.weight.inner")
    if a_key is None and b_key is None:
        return None

    # Modules outside the pool's eight.
    if layer is None:
        reason = next((why for rx, why in _UNSERVABLE_TOP if rx.match(sub)), None)
        if reason is None:
            out.at(Severity.ERROR, "unservable_module",
                   f"{sub}: not a decoder-layer module the pool can serve", None)
        else:
            out.at(Severity.ERROR, "unservable_module",
                   f"{sub}: {reason}, which the pool cannot serve", None)
        return None
    if _EXPERT.match(sub) or _FUSED_EXPERTS.match(sub) or _ROUTER.match(sub):
        expert_layers.append(layer)
        return None
    for rx, why in _UNSERVABLE_IN_LAYER:
        if rx.match(sub):
            out.at(Severity.ERROR, "unservable_module", f"{sub}{{where}}: {why}", layer)
            return None
    module = _SERVABLE.get(sub)
    if module is None:
        out.at(Severity.ERROR, "unservable_module",
               f"{sub}{{where}}: not one of the pool's modules", layer)
        return None
    if layer >= model.num_hidden_layers:
        out.at(Severity.ERROR, "layer_out_of_range",
               f"{module.peft_name}{{where}}: past the model's {model.num_hidden_layers} layers",
               layer)
        return None
    if not module.applies_to_layer(model, layer):
        out.at(Severity.ERROR, "module_not_applicable",
               f"{module.peft_name}{{where}}: the module does not apply on "
               f"{_layer_kind(model, layer)}", layer)
        return None

    if a_key is None or b_key is None:
        missing, present = ("lora_B", "lora_A") if b_key is None else ("lora_A", "lora_B")
        out.at(Severity.ERROR, f"missing_{missing[-1].lower()}",
               f"{module.peft_name}{{where}}: {present} without {missing}", layer)
        return None

    a, b = adapter.tensor(a_key), adapter.tensor(b_key)
    bad = [t for t in (a, b) if t.dtype not in LORA_DTYPES]
    for t in bad:
        out.at(Severity.ERROR, "bad_dtype",
               f"{module.peft_name}{{where}}: dtype {t.dtype}; LoRA tensors must be "
               f"{'/'.join(LORA_DTYPES)}", layer)
    if a.dtype != b.dtype and not bad:
        out.at(Severity.WARNING, "mixed_dtype",
               f"{module.peft_name}{{where}}: A is {a.dtype}, B is {b.dtype}", layer)
    out_dim, in_dim = module.dims(model)
    if len(a.shape) != 2 or len(b.shape) != 2:
        out.at(Severity.ERROR, "shape_mismatch",
               f"{module.peft_name}{{where}}: A {list(a.shape)} and B {list(b.shape)} must be "
               "two-dimensional", layer)
        return None
    r_a, r_b = a.shape[0], b.shape[1]
    if r_a != r_b:
        out.at(Severity.ERROR, "rank_ab_mismatch",
               f"{module.peft_name}{{where}}: A has rank {r_a}, B has rank {r_b}", layer)
        return None
    if a.shape[1] != in_dim or b.shape[0] != out_dim:
        out.at(Severity.ERROR, "shape_mismatch",
               f"{module.peft_name}{{where}}: A {list(a.shape)}, B {list(b.shape)}; the model "
               f"needs A [r, {in_dim}], B [{out_dim}, r]", layer)
        return None
    if r_a == 0:
        out.at(Severity.ERROR, "shape_mismatch", f"{module.peft_name}{{where}}: rank 0", layer)
        return None

    r_cfg = cfg.rank_for(module_key)
    alpha = cfg.alpha_for(module_key)
    if r_a != r_cfg:
        out.at(Severity.ERROR, "rank_config_mismatch",
               f"{module.peft_name}{{where}}: tensors have rank {r_a}, but the config "
               f"(r and rank_pattern) gives {r_cfg}; PEFT would refuse to load it", layer)
    for name, hits in cfg.overlapping_patterns(module_key).items():
        out.at(Severity.WARNING, "pattern_overlap",
               f"{name} keys {', '.join(repr(h) for h in hits)} all match "
               f"{module.peft_name}{{where}} with different values; PEFT takes the first in "
               "file order after a reload, training took the user's order", layer)
    if not cfg.is_targeted(module_key):
        out.at(Severity.WARNING, "unexplained_key",
               f"{module.peft_name}{{where}}: has tensors, but the config's target_modules "
               "(with exclude_modules and layers_to_transform) does not select it", layer)
    return ModuleRecord(layer, module, r_a, alpha, cfg.scaling(r_a, alpha), a, b)


def _layer_kind(model: ModelConfig, layer: int) -> str:
    kind = model.layer_type(layer).value.replace("_", "-")
    moe = " of a model with routed experts" if model.num_experts else ""
    return f"{kind} layers{moe}"


def _audit_config(adapter: Adapter, model: ModelConfig, out: _Collector) -> None:
    raw = adapter.config.raw
    checks: list[tuple[bool, str, str]] = [
        (bool(raw.get("use_dora")), "dora",
         "DoRA (use_dora): the output is renormalised by the base weight, not W + s*BA"),
        (bool(raw.get("lora_bias")), "lora_bias",
         "lora_bias: B carries a bias that a plain LoRA pool does not apply"),
        (raw.get("bias", "none") not in (None, "none"), "bias",
         f"bias={raw.get('bias')!r}: the adapter replaces base biases"),
        (bool(adapter.config.modules_to_save), "modules_to_save",
         f"modules_to_save {adapter.config.modules_to_save}: whole modules are replaced"),
        (bool(raw.get("trainable_token_indices")), "trainable_tokens",
         "trainable_token_indices: token overlays are not served by this pool"),
        (bool(raw.get("use_qalora")), "qalora",
         "QA-LoRA (use_qalora): A has in/group columns"),
        (bool(raw.get("use_bdlora")), "bdlora",
         "BD-LoRA (use_bdlora): block-diagonal factors of another shape"),
        (bool(raw.get("alora_invocation_tokens")), "alora",
         "activated LoRA (alora_invocation_tokens): active only after its invocation tokens"),
        (bool(raw.get("megatron_config")), "megatron",
         "megatron_config: Megatron module names, not the model's"),
        (bool(raw.get("layer_replication")), "layer_replication",
         "layer_replication: layer indices of a deeper, replicated model"),
        (bool(raw.get("arrow_config")), "variant", "arrow_config: Arrow routing among adapters"),
        (bool(raw.get("kasa_config")), "variant", "kasa_config: KaSA adds lora_diag"),
        (bool(raw.get("monteclora_config")), "variant",
         "monteclora_config: MonteCLoRA sampler parameters"),
    ]
    init = raw.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_MUTATING_INITS):
        checks.append((True, "base_mutating_init",
                       f"init_lora_weights={init!r} changed the base weights during training; "
                       "the adapter is only valid on that changed base"))
    for hit, code, message in checks:
        if hit:
            out.add(Severity.ERROR, code, f"{message}; not servable as plain LoRA")
    if raw.get("fan_in_fan_out"):
        out.add(Severity.INFO, "fan_in_fan_out",
                "fan_in_fan_out: the base stores (in, out); A/B keep their usual shapes")
    if raw.get("velora_config"):
        out.add(Severity.INFO, "velora", "velora_config changes only the backward pass")
    for bad in adapter.config.pattern_errors():
        out.add(Severity.ERROR, "bad_pattern", f"rank/alpha pattern {bad} is not a valid regex")
    if isinstance(adapter.config.target_modules, str) and (
        adapter.config.layers_to_transform is not None or adapter.config.layers_pattern
    ):
        out.add(Severity.WARNING, "layers_with_regex",
                "layers_to_transform is ignored by PEFT when target_modules is a regex string")


def _explain_experts(
    adapter: Adapter, model: ModelConfig, expert_layers: list[int], out: _Collector
) -> None:
    cfg = adapter.config
    if expert_layers:
        how = ("the expert pool is not part of this metrale version" if env.experts_enabled()
               else "routed experts and the router live outside the slot pool")
        out.add(Severity.ERROR, "expert_lora",
                f"routed-expert or router LoRA on layers {layer_ranges(expert_layers)}: "
                f"not servable by the slot pool ({how})")
    ffn_targets = isinstance(cfg.target_modules, list) and any(
        t.split(".")[-1] in ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3", "gate")
        for t in cfg.target_modules
    )
    rewritten = any(re.search(r"gate_up_proj", k) for k in cfg.rank_pattern)
    if not model.num_experts or not (cfg.target_parameters or ffn_targets):
        return
    if model.model_type == "qwen3_5_moe":
        # PEFT 0.21's conversion table maps no rewrite for this type (checked against PEFT).
        out.add(Severity.WARNING, "moe_rewrite",
                "on qwen3_5_moe, PEFT (0.21) does not rewrite gate_proj/up_proj/down_proj "
                "targets into expert LoRA: they reach only the shared expert, and routed experts "
                "get LoRA only through target_parameters (mlp.experts.gate_up_proj/down_proj)")
        return
    out.add(Severity.WARNING, "moe_rewrite",
            f"on {model.model_type} (routed experts), PEFT >= 0.19 with transformers 5 turns "
            "gate_proj/up_proj/down_proj targets into expert LoRA (target_parameters "
            "gate_up_proj/down_proj" + (", gate_up at rank 2r and alpha 2*alpha" if rewritten
                                        else "")
            + "); dense-MLP and shared-expert projections then get no LoRA at all "
            "(huggingface/peft#3711)")


def _missing_targets(
    adapter: Adapter, model: ModelConfig, modules: list[ModuleRecord], out: _Collector
) -> None:
    """Pool modules the config selects on a layer where the file has no tensors for them."""
    present = {(m.layer, m.module) for m in modules}
    vl = any(k.module_key.startswith("model.language_model.") for k in adapter.keys)
    prefix = "model.language_model.layers" if vl else "model.layers"
    for module in ALL:
        missing = [
            layer
            for layer in range(model.num_hidden_layers)
            if module.applies_to_layer(model, layer)
            and (layer, module) not in present
            and adapter.config.is_targeted(f"{prefix}.{layer}.{module.peft_path}")
        ]
        for layer in missing:
            out.at(Severity.WARNING, "targeted_missing",
                   f"{module.peft_name}{{where}}: the config selects it but the file holds no "
                   "tensors for it", layer)
