"""The adapter audit: what of an adapter a pool can serve, at which scale, and why not the rest.

`audit(adapter, model, max_rank, experts)` returns an `AdapterReport`: findings (severity,
stable code, one-line message), one `ModuleRecord` per adapted (layer, module) pair of the pool's
module set, the routed-expert and router pairs for the expert pool (only with the experts
opt-in), and the token overlays. An `error` finding makes the adapter not servable.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any

from metrale_cli import env
from metrale_cli.adapters import experts, overlays, patterns
from metrale_cli.adapters.adapter import Adapter, AdapterKey
from metrale_cli.adapters.experts import ExpertPair
from metrale_cli.adapters.findings import Code, Collector, Finding, Severity, layer_ranges
from metrale_cli.adapters.pair_checks import check_pair, rank_and_scale
from metrale_cli.errors import PatternTimeout
from metrale_cli.files.safetensors_header import TensorInfo
from metrale_cli.model.config import ModelConfig
from metrale_cli.model.families import Layers
from metrale_cli.model.modules import ALL, LoraModule, family_modules

BYTES_PER_ELEMENT = 2  # the pool holds BF16
# The scales a pool can hold: its scale tables are float32, and each module's scale relative to
# its slot's is folded into B, so every scale stays within 2^+-60 (a ratio of two within 2^120,
# inside float32's 2^128). Trained adapters scale by 0.01 to 100.
MIN_SCALING, MAX_SCALING = 2.0**-60, 2.0**60


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
    # Routed-expert and router pairs, in expert-layout order; empty without the opt-in.
    expert_pairs: list[ExpertPair] = field(default_factory=list)
    overlays: list[overlays.Overlay] = field(default_factory=list)

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
    def expert_rank(self) -> int:
        """The largest rank among the expert pairs (0 when none)."""
        return max((p.r for p in self.expert_pairs), default=0)

    @property
    def overlay_tokens(self) -> int:
        return sum(len(o.tokens) for o in self.overlays)

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
        # A config whose r or lora_alpha is unusable has no rank, alpha or scale to state.
        stated = not self.adapter.config.value_errors
        return {
            "path": str(self.adapter.path),
            "name": self.name,
            "servable": self.servable,
            "rank": self.rank if stated else None,
            "alpha": self.adapter.config.lora_alpha if stated else None,
            "scaling": self.scaling if stated else None,
            "use_rslora": self.adapter.config.use_rslora,
            "findings": [f.record() for f in self.findings],
            "modules": [m.record() for m in self.modules],
            "expert_pairs": len(self.expert_pairs),
            "expert_rank": self.expert_rank,
            "expert_coverage": experts.coverage(self.expert_pairs),
            "overlays": [o.record() for o in self.overlays],
            "overlay_tokens": self.overlay_tokens,
        }


def layer_rows(model: ModelConfig, report: AdapterReport) -> list[dict[str, Any]]:
    """`inspect`'s per-layer table: one row per set of layers that look alike (not only
    adjacent ones: a hybrid model's layers repeat with a period), so 48+ layers stay a few rows.
    Each row: its `layers`, whether they are `all_of_kind` (every layer of their kind), the
    layer `kind`, and per module of the report's set a cell: `r16`, `r16 x2` where a rank/alpha
    pattern moved the scale off the adapter's, "" where not adapted, None where it does not
    apply."""
    scale = report.scaling
    per_layer: dict[int, dict[str, str]] = {}
    for m in report.modules:
        cell = f"r{m.r}" if abs(m.scaling - scale) <= 1e-9 * scale else f"r{m.r} x{m.scaling:.3g}"
        per_layer.setdefault(m.layer, {})[m.module.peft_name] = cell
    columns = report.module_set
    groups: dict[tuple[Any, ...], list[int]] = {}
    for layer in range(model.num_hidden_layers):
        cells = per_layer.get(layer, {})
        # Layers where any module applies differently stay apart, shown or not.
        applicable = tuple(m.applies_to_layer(model, layer) for m in ALL)
        signature = (model.layer_type(layer), applicable, tuple(
            cells.get(m.peft_name) or ("" if m.applies_to_layer(model, layer) else None)
            for m in columns))
        groups.setdefault(signature, []).append(layer)
    rows = []
    for (kind, _, cells), layers in groups.items():
        of_kind = [i for i in range(model.num_hidden_layers) if model.layer_type(i) is kind]
        rows.append({"layers": layers, "all_of_kind": layers == of_kind,
                     "kind": kind.value.split("_")[0],
                     "cells": dict(zip((m.peft_name for m in columns), cells, strict=True))})
    return rows


# -- what a key names ---------------------------------------------------------------------------

# Modules a decoder layer has that the pool's eight modules do not cover, and why.
_UNSERVABLE_IN_LAYER = (
    # gemma4's MoE sits beside the dense MLP at the layer's top level, not under an MoE block.
    (re.compile(r"^experts$"),
     "gemma4's routed experts (`experts`, beside the dense MLP): the expert pool reads routed "
     "experts under an MoE block (`mlp.experts`), not these"),
    (re.compile(r"^router\.proj$"),
     "gemma4's router (`router.proj`): the expert pool reads a router under an MoE block "
     "(`mlp.gate`), not this one"),
    (re.compile(r"^linear_attn\.(in_proj_qkvz|in_proj_ba|in_proj_qkv|in_proj_z|in_proj_a|"
                r"in_proj_b|conv1d)$"),
     "a Gated-DeltaNet input projection; the pool serves linear_attn.out_proj only"),
    (re.compile(r"^mixer\.in_proj$"),
     "a Mamba-2 input projection (nemotron_h): the pool serves no Mamba-2 module"),
    (re.compile(r"^(mlp|mixer|feed_forward)\.shared_experts?\.(gate_proj|up_proj|down_proj)$"),
     "a shared-expert projection: the shared expert is a dense MLP beside the routed ones, and "
     "neither this family's slot modules (qwen3_next's and qwen3_5_moe's layouts hold none) "
     "nor the expert pool (routed experts and the router) hold it"),
    (re.compile(r"^mlp\.shared_expert_gate$"),
     "the shared-expert gate (a [1, hidden] sigmoid gate): neither the slot pool nor the "
     "expert pool (routed experts and the router) holds it"),
)
_UNSERVABLE_TOP = (
    (re.compile(r"^(model\.)?embed_tokens$"),
     "the input embedding (embed_tokens): embedding LoRA adds a rank-r term to every row of "
     "the table, and overlays only replace listed rows"),
    (re.compile(r"^lm_head$"), "the output head (lm_head)"),
    # gemma4's: every layer's per-layer input, projected from the embeddings at once.
    (re.compile(r"^model\.per_layer_model_projection$"),
     "the per-layer inputs' projection (per_layer_model_projection), outside the decoder "
     "layers"),
    # gemma4's projections of its vision and audio towers' output into the language model.
    (re.compile(r"^model\.(embed_vision|embed_audio)\..*$"),
     "a multimodal projector into the language model"),
    (re.compile(r"^(score|classifier|classification_head|qa_outputs)(\..*)?$"),
     "a classifier head"),
)
# A vision-language checkpoint's vision tower (SigLIP, Pixtral, Qwen-VL's `visual`, llama4's
# top-level `vision_model`) or audio tower (gemma4's): PEFT's suffix matching adapts its q_proj
# or gate_proj as readily as the language model's.
_TOWER = re.compile(r"^((?:model\.)?(?:visual|vision_tower|vision_model|audio_tower))\.")
_BASE_MUTATING_INITS = ("pissa", "olora", "corda", "lora_ga", "loftq")


def audit(
    adapter: Adapter,
    model: ModelConfig,
    max_rank: int | None = None,
    experts_enabled: bool | None = None,
) -> AdapterReport:
    """`experts_enabled` is the expert-pool opt-in (`--experts`); None reads
    METRALE_LORA_EXPERTS."""
    if experts_enabled is None:
        experts_enabled = env.experts_enabled()
    adapter = replace(adapter, config=adapter.config.with_default_targets(
        model.family, model.composite))
    report = AdapterReport(adapter)
    out = Collector()
    too_large = adapter.config.size_errors()
    if too_large:
        # Before anything is compiled: a verdict by size, not by how fast this machine is.
        for line in too_large:
            out.add(Severity.ERROR, Code.LARGE_PATTERN, line)
        report.findings = out.findings()
        return report
    _audit_config(adapter, model, out)
    if adapter.config.value_errors:
        # Ranks and scales the config cannot state: nothing below could be judged honestly.
        report.findings = out.findings()
        return report
    try:
        with patterns.time_bound():
            _audit_tensors(adapter, model, max_rank, experts_enabled, report, out)
    except PatternTimeout as exc:
        # Whatever the matching found before the deadline is moot: the config is hostile.
        report, out = AdapterReport(adapter), Collector()
        _audit_config(adapter, model, out)
        out.add(Severity.ERROR, Code.SLOW_PATTERN, f"{exc}; PEFT would hang on it too")
    report.findings = out.findings()
    return report


def _audit_tensors(
    adapter: Adapter, model: ModelConfig, max_rank: int | None, experts_enabled: bool,
    report: AdapterReport, out: Collector,
) -> None:
    """Every tensor of the adapter against the model and the pool: module records, expert
    pairs and overlays into `report`, findings into `out`."""

    # Pair each module's tensors: (module_key) -> part -> key.
    by_module: dict[str, dict[str, AdapterKey]] = defaultdict(dict)
    for key in adapter.keys:
        by_module[key.module_key][key.part + (".inner" if key.inner else "")] = key

    expert_modules: dict[str, dict[str, AdapterKey]] = {}
    overlay_keys: list[AdapterKey] = []
    towers: dict[str, list[str]] = defaultdict(list)  # tower -> its adapted modules
    for module_key, parts in sorted(by_module.items(), key=lambda kv: _sort_key(kv[1])):
        any_key = next(iter(parts.values()))
        tower = _TOWER.match(any_key.sub) if any_key.layer is None else None
        if tower is not None:
            towers[tower.group(1)].append(any_key.sub)
            continue
        if overlays.OVERLAY_PART in parts:
            overlay_keys.append(parts.pop(overlays.OVERLAY_PART))
            if not parts:
                continue
        if any_key.layer is not None and experts.is_expert_key(any_key.sub) and all(
            p.removesuffix(".inner") in ("lora_A.weight", "lora_B.weight") for p in parts
        ):
            expert_modules[module_key] = parts
            continue
        record = _audit_module(adapter, model, module_key, any_key, parts, out)
        if record is not None:
            report.modules.append(record)

    for tower, subs in towers.items():
        # gemma4's towers wrap each Linear (`q_proj.linear`): the projection names it.
        leaves = sorted({sub.removesuffix(".linear").rsplit(".", 1)[-1] for sub in subs})
        kind = "audio" if tower.endswith("audio_tower") else "vision"
        out.add(Severity.ERROR, Code.UNSERVABLE_MODULE,
                f"{tower}: the {kind} tower has {len(subs)} adapted module"
                f"{'s' if len(subs) > 1 else ''} ({', '.join(leaves)}); the pool serves the "
                "language model's layers only (target_modules matched the tower's too)")
    pairs = experts.scan(adapter, model, expert_modules, out) if expert_modules else []
    if expert_modules or adapter.config.target_parameters:
        _explain_experts(adapter, model, sorted({k.layer for p in expert_modules.values()
                                                  for k in p.values() if k.layer is not None}),
                         experts_enabled, out)
    if experts_enabled:
        report.expert_pairs = pairs
    if overlay_keys or adapter.config.raw.get("trainable_token_indices"):
        report.overlays = overlays.scan(adapter, model, overlay_keys, out)
    if not (report.modules or report.expert_pairs or report.overlays) and not any(
        f.severity is Severity.ERROR for f in out.findings()
    ):
        out.add(Severity.ERROR, Code.NO_SERVABLE_MODULES,
                "the adapter adapts none of the pool's modules "
                f"({', '.join(m.peft_name for m in family_modules(model))}), no routed expert or "
                "router, and overlays no token")
    _missing_targets(adapter, model, report.modules, out)
    if max_rank is not None:
        over = [m for m in report.modules if m.r > max_rank]
        if over:
            modules = [m for m in ALL if any(o.module is m for o in over)]
            ranks = sorted({m.r for m in over})
            out.add(Severity.ERROR, Code.RANK_ABOVE_MAX,
                    f"{', '.join(m.peft_name for m in modules)}: rank "
                    f"{', '.join(map(str, ranks))} above --max-rank {max_rank}")
        over_pairs = [p for p in report.expert_pairs if p.r > max_rank]
        for proj in sorted({p.proj for p in over_pairs}, key=list(experts.ExpertProj).index):
            ranks = sorted({p.r for p in over_pairs if p.proj is proj})
            rewrite = (" (PEFT's transformers-5 rewrite trains gate_up at rank 2r)"
                       if proj in (experts.ExpertProj.GATE_PROJ, experts.ExpertProj.UP_PROJ)
                       and any(p.source == "v5" for p in over_pairs) else "")
            out.add(Severity.ERROR, Code.RANK_ABOVE_MAX,
                    f"expert {proj.value} has rank {', '.join(map(str, ranks))} above "
                    f"--max-rank {max_rank}{rewrite}")
    order = family_modules(model)
    report.modules.sort(key=lambda m: (m.layer, order.index(m.module)))
    _check_scales(report, out)


def _check_scales(report: AdapterReport, out: Collector) -> None:
    """Scales the pool's float32 tables cannot hold (`lora_alpha: 1e300` once made a slot's
    scale Infinity): errors naming the value that gave them."""
    def outside(scaling: float) -> bool:
        return not MIN_SCALING <= scaling <= MAX_SCALING

    cfg = report.adapter.config
    if outside(report.scaling):
        out.add(Severity.ERROR, Code.BAD_CONFIG_VALUE,
                f"'lora_alpha' {cfg.lora_alpha:g} with 'r' {cfg.r} gives a scaling of "
                f"{report.scaling:g}, outside the 2^-60 to 2^60 a pool holds")
    for m in report.modules:
        # A module at the adapter's own scale is reported once, above.
        if outside(m.scaling) and m.scaling != report.scaling:
            out.at(Severity.ERROR, Code.BAD_CONFIG_VALUE,
                   f"{m.module.peft_name}{{where}}: alpha {m.alpha:g} (alpha_pattern or "
                   f"lora_alpha) gives a scaling of {m.scaling:g}, outside the "
                   f"2^-60 to 2^60 a pool holds", m.layer)
    for p in report.expert_pairs:
        if outside(p.scaling):
            out.at(Severity.ERROR, Code.BAD_CONFIG_VALUE,
                   f"expert {p.proj.value}{{where}}: alpha {p.alpha:g} gives a scaling of "
                   f"{p.scaling:g}, outside the 2^-60 to 2^60 a pool holds",
                   p.layer)


def _sort_key(parts: dict[str, AdapterKey]) -> tuple[int, str]:
    key = next(iter(parts.values()))
    return (key.layer if key.layer is not None else 1 << 30, key.sub)


def _audit_module(
    adapter: Adapter,
    model: ModelConfig,
    module_key: str,
    key: AdapterKey,
    parts: dict[str, AdapterKey],
    out: Collector,
) -> ModuleRecord | None:
    cfg = adapter.config
    layer, sub = key.layer, key.sub
    unknown_parts = [p for p in parts if p == ""]
    if unknown_parts:
        for p in parts.values():
            if p.part == "":
                out.add(Severity.ERROR, Code.UNKNOWN_TENSOR,
                        f"tensor {p.tensor!r} is not a LoRA tensor metrale recognises")
        return None

    # Non-LoRA tensors: whole modules, base biases, DoRA magnitudes, trainable tokens.
    for part, code, what in (
        ("lora_magnitude_vector", Code.DORA, "DoRA magnitude vectors (lora_magnitude_vector)"),
        ("lora_B.bias", Code.LORA_BIAS, "LoRA B biases (lora_B.bias)"),
        ("base_layer.bias", Code.BIAS, "trained base biases (base_layer.bias)"),
        ("base_layer.weight", Code.FULL_WEIGHTS, "full base weights (base_layer.weight)"),
        ("weight", Code.MODULES_TO_SAVE, "full module copies (modules_to_save)"),
        ("bias", Code.MODULES_TO_SAVE, "full module copies (modules_to_save)"),
    ):
        if part in parts:
            out.at(Severity.ERROR, code,
                   f"{what} for {sub}{{where}}: not a plain additive LoRA delta", layer)
    if "lora_embedding_A" in parts or "lora_embedding_B" in parts:
        out.at(Severity.ERROR, Code.EMBEDDING_LORA,
               f"embedding LoRA (lora_embedding_A/B) on {sub}{{where}}: a rank-r term added to "
               "every row of the table; the slot pool has no embedding kernel and token "
               "overlays replace listed rows only (trainable_token_indices serves that)", layer)

    a_key = parts.get("lora_A.weight") or parts.get("lora_A.weight.inner")
    b_key = parts.get("lora_B.weight") or parts.get("lora_B.weight.inner")
    if a_key is None and b_key is None:
        return None

    # Modules outside the pool's eight.
    if layer is None:
        reason = next((why for rx, why in _UNSERVABLE_TOP if rx.match(sub)), None)
        if reason is None:
            out.at(Severity.ERROR, Code.UNSERVABLE_MODULE,
                   f"{sub}: not a decoder-layer module the pool can serve", None)
        else:
            out.at(Severity.ERROR, Code.UNSERVABLE_MODULE,
                   f"{sub}: {reason}, which the pool cannot serve", None)
        return None
    if experts.is_expert_key(sub):
        # Expert keys with parts other than A/B (DoRA, biases): reported above, not served.
        return None
    # The family's entries at this path (a module may sit elsewhere on other layers).
    at_path = [spec for spec in model.family.modules if spec.path == sub]
    if not at_path:
        why = next((why for rx, why in _UNSERVABLE_IN_LAYER if rx.match(sub)),
                   "not one of the pool's modules")
        out.at(Severity.ERROR, Code.UNSERVABLE_MODULE, f"{sub}{{where}}: {why}", layer)
        return None
    module = LoraModule(at_path[0].name)
    if layer >= model.num_hidden_layers:
        out.at(Severity.ERROR, Code.LAYER_OUT_OF_RANGE,
               f"{module.peft_name}{{where}}: past the model's {model.num_hidden_layers} layers",
               layer)
        return None
    here = module.spec(model, layer)
    if here not in at_path:
        # On this layer the module is at another path (deepseek's dense MLP and shared
        # experts), or nowhere.
        why = (f"the layer's {module.peft_name} is {here.path}, not {sub}" if here is not None
               else "the base model's weights carry no such module on this layer"
               if at_path[0].layers is Layers.LISTED
               else f"the module does not apply on {_layer_kind(model, layer)}")
        out.at(Severity.ERROR, Code.MODULE_NOT_APPLICABLE, f"{module.peft_name}{{where}}: {why}",
               layer)
        return None

    pair = check_pair(adapter, a_key, b_key, module.peft_name, layer, out,
                      module.dims(model, layer))
    if pair is None:
        return None
    a, b = pair
    r = a.shape[0]
    alpha, scaling = rank_and_scale(adapter, module_key, module.peft_name, r, layer, out)
    for name, hits in cfg.overlapping_patterns(module_key).items():
        out.at(Severity.WARNING, Code.PATTERN_OVERLAP,
               f"{name} keys {', '.join(repr(h) for h in hits)} all match "
               f"{module.peft_name}{{where}} with different values; PEFT takes the first in "
               "file order after a reload, training took the user's order", layer)
    if not cfg.is_targeted(module_key):
        out.at(Severity.WARNING, Code.UNEXPLAINED_KEY,
               f"{module.peft_name}{{where}}: has tensors, but the config's target_modules "
               "(with exclude_modules and layers_to_transform) does not select it", layer)
    return ModuleRecord(layer, module, r, alpha, scaling, a, b)


def _layer_kind(model: ModelConfig, layer: int) -> str:
    kind = model.layer_type(layer).value.replace("_", "-")
    moe = " of a model with routed experts" if model.num_experts else ""
    if model.is_kv_shared_layer(layer):  # gemma4's last layers: no k_proj, v_proj
        return f"{kind} layers reusing an earlier layer's keys and values{moe}"
    if model.attention_k_eq_v and kind == "full-attention":
        return f"{kind} layers whose keys are their values (attention_k_eq_v){moe}"
    return f"{kind} layers{moe}"


def _audit_config(adapter: Adapter, model: ModelConfig, out: Collector) -> None:
    raw = adapter.config.raw
    checks: list[tuple[bool, str, str]] = [
        (bool(raw.get("use_dora")), Code.DORA,
         "DoRA (use_dora): the output is renormalised by the base weight, not W + s*BA"),
        (bool(raw.get("lora_bias")), Code.LORA_BIAS,
         "lora_bias: B carries a bias that a plain LoRA pool does not apply"),
        (raw.get("bias", "none") not in (None, "none"), Code.BIAS,
         f"bias={raw.get('bias')!r}: the adapter replaces base biases"),
        (bool(adapter.config.modules_to_save), Code.MODULES_TO_SAVE,
         f"modules_to_save {adapter.config.modules_to_save}: whole modules are replaced"),
        (bool(raw.get("use_qalora")), Code.QALORA,
         "QA-LoRA (use_qalora): A has in/group columns"),
        (bool(raw.get("use_bdlora")), Code.BDLORA,
         "BD-LoRA (use_bdlora): block-diagonal factors of another shape"),
        (bool(raw.get("alora_invocation_tokens")), Code.ALORA,
         "activated LoRA (alora_invocation_tokens): active only after its invocation tokens"),
        (bool(raw.get("megatron_config")), Code.MEGATRON,
         "megatron_config: Megatron module names, not the model's"),
        (bool(raw.get("layer_replication")), Code.LAYER_REPLICATION,
         "layer_replication: layer indices of a deeper, replicated model"),
        (bool(raw.get("arrow_config")), Code.VARIANT, "arrow_config: Arrow routing among adapters"),
        (bool(raw.get("kasa_config")), Code.VARIANT, "kasa_config: KaSA adds lora_diag"),
        (bool(raw.get("monteclora_config")), Code.VARIANT,
         "monteclora_config: MonteCLoRA sampler parameters"),
    ]
    init = raw.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_MUTATING_INITS):
        checks.append((True, Code.BASE_MUTATING_INIT,
                       f"init_lora_weights={init!r} changed the base weights during training; "
                       "the adapter is only valid on that changed base"))
    for hit, code, message in checks:
        if hit:
            out.add(Severity.ERROR, code, f"{message}; not servable as plain LoRA")
    if raw.get("fan_in_fan_out"):
        out.add(Severity.INFO, Code.FAN_IN_FAN_OUT,
                "fan_in_fan_out: the base stores (in, out); A/B keep their usual shapes")
    if raw.get("velora_config"):
        out.add(Severity.INFO, Code.VELORA, "velora_config changes only the backward pass")
    for bad in adapter.config.pattern_errors():
        out.add(Severity.ERROR, Code.BAD_PATTERN, f"{bad}; PEFT would fail to load the adapter")
    for bad in adapter.config.value_errors:
        out.add(Severity.ERROR, Code.BAD_CONFIG_VALUE, bad)
    if isinstance(adapter.config.target_modules, str) and (
        adapter.config.layers_to_transform is not None or adapter.config.layers_pattern
    ):
        out.add(Severity.WARNING, Code.LAYERS_WITH_REGEX,
                "layers_to_transform is ignored by PEFT when target_modules is a regex string")


def _explain_experts(
    adapter: Adapter, model: ModelConfig, expert_layers: list[int], enabled: bool,
    out: Collector,
) -> None:
    cfg = adapter.config
    if expert_layers and not enabled:
        out.add(Severity.ERROR, Code.EXPERT_LORA,
                f"routed-expert or router LoRA on layers {layer_ranges(expert_layers)}: "
                "not servable by the slot pool; it goes to the expert pool, which is opt-in: "
                "pass --experts (or set METRALE_LORA_EXPERTS=1)")
    ffn_targets = isinstance(cfg.target_modules, list) and any(
        t.split(".")[-1] in (*experts.EXPERT_LEAF_NAMES, "gate") for t in cfg.target_modules
    )
    rewritten = any(re.search(r"gate_up_proj", k) for k in cfg.rank_pattern)
    # Plain target_parameters adapters need no explanation; gate/up/down targets (or a
    # re-saved rewrite, which carries the gate_up rank pattern) do.
    if not model.num_experts or not (ffn_targets or rewritten):
        return
    if not model.family.peft_rewrites_moe_targets:
        out.add(Severity.WARNING, Code.MOE_REWRITE,
                f"on {model.model_type}, PEFT (0.21) does not rewrite gate_proj/up_proj/down_proj "
                "targets into expert LoRA: they reach the dense-MLP and shared-expert "
                "projections where it has them, never the routed experts, which get LoRA only "
                "through target_parameters (mlp.experts.gate_up_proj/down_proj)")
        return
    out.add(Severity.WARNING, Code.MOE_REWRITE,
            f"on {model.model_type} (routed experts), PEFT >= 0.19 with transformers 5 turns "
            "gate_proj/up_proj/down_proj targets into expert LoRA (target_parameters "
            "gate_up_proj/down_proj" + (", gate_up at rank 2r and alpha 2*alpha" if rewritten
                                        else "")
            + "); dense-MLP and shared-expert projections then get no LoRA at all "
            "(huggingface/peft#3711)")


def _missing_targets(
    adapter: Adapter, model: ModelConfig, modules: list[ModuleRecord], out: Collector
) -> None:
    """Pool modules the config selects on a layer where the file has no tensors for them."""
    present = {(m.layer, m.module) for m in modules}
    # The decoder stack as the file names it (`model.layers`, a wrapper's
    # `model.language_model.layers` or llama4's `language_model.model.layers`).
    prefix = next((k.module_key.removesuffix(f".{k.layer}.{k.sub}") for k in adapter.keys
                   if k.layer is not None), "model.layers")
    for module in family_modules(model):
        missing = [
            layer
            for layer in range(model.num_hidden_layers)
            if module.applies_to_layer(model, layer)
            and (layer, module) not in present
            and adapter.config.is_targeted(f"{prefix}.{layer}.{module.path_in(model, layer)}")
        ]
        for layer in missing:
            out.at(Severity.WARNING, Code.TARGETED_MISSING,
                   f"{module.peft_name}{{where}}: the config selects it but the file holds no "
                   "tensors for it", layer)
