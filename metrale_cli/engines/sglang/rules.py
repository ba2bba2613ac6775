"""What SGLang 0.5.23 does with a PEFT adapter (its pool's bytes are model.py's),
read from SGLang 0.5.23's installed source (`sglang/srt/lora/`); each rule names the file and
function it comes from. Checked against SGLang's own code running on CPU tensors
(tests/test_engine_sglang.py, through tests/support/sglang_runner.py); the rules that cannot run
here (`SOURCE_RULES`) are held to the source text they cite (tests/test_engine_sglang.py).

An adapter meets SGLang in three places: its load (`LoRAManager._load_lora_adapter`: at start-up
for `--lora-paths`, where an error stops the server; at runtime for `/load_lora_adapter`, where
it is an HTTP 400 and the server keeps serving), the start-up's shape inference
(`init_lora_shapes`, start-up adapters only) and its first batch, when the scheduler copies it
into a pool slot (`LoRAMemoryPool.load_lora_weight_to_buffer`; an error there is raised in the
scheduler's forward step and takes the server down). `judge` answers all three; the engine
behind the seam (`SglangEngine`, __init__.py) gives each load path's verdict as `judge_report`
answers it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from metrale_cli.adapters.adapter import AdapterConfig
from metrale_cli.engines.verdict import Verdict

if TYPE_CHECKING:
    from metrale_cli.adapters.audit import AdapterReport
    from metrale_cli.model.config import ModelConfig

VERSION = "0.5.23"

# srt/lora/utils.py get_normalized_target_modules: params_mapping (the dense entries).
_NORMALISED = {
    "q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj",
    "embed_tokens": "embed_tokens", "vocab_emb": "embed_tokens", "embeddings": "embed_tokens",
    "word_embeddings": "embed_tokens", "lm_head": "lm_head", "output": "lm_head",
    "unembed_tokens": "lm_head",
    # Multi-head latent attention's query and KV down-projections, one fused linear in
    # SGLang's DeepSeek class.
    "q_a_proj": "fused_qkv_a_proj_with_mqa", "kv_a_proj_with_mqa": "fused_qkv_a_proj_with_mqa",
}

# srt/lora/utils.py get_stacked_multiply: the A buffer holds c ranks for a fused module.
STACKED = {"qkv_proj": 3, "gate_up_proj": 2, "fused_qkv_a_proj_with_mqa": 2}


class SGLangConfigError(ValueError):
    """A `target_modules` SGLang does not accept, in SGLang's words."""


def normalised_targets(target_modules: str | Iterable[str]) -> set[str]:
    """srt/lora/utils.py get_normalized_target_modules: a string is only 'all'/'all-linear'
    ({"all"}); a list maps each name's last dotted part through params_mapping."""
    if isinstance(target_modules, str):
        if target_modules not in ("all", "all-linear"):
            raise SGLangConfigError(_STRING_TARGETS)
        return {"all"}
    out = set()
    for name in target_modules:
        leaf = name.split(".")[-1]
        out.add(_NORMALISED.get(leaf, leaf))
    return out


_STRING_TARGETS = "Only 'all' or 'all-linear' can be used as the string for target module"
# srt/lora/utils.py auto_detect_lora_target_modules on a dense model: its LinearBase leaves
# (normalised), ParallelLMHead and VocabParallelEmbedding.
DENSE_MODULES = frozenset({"qkv_proj", "o_proj", "gate_up_proj", "down_proj"})
EMBEDDING_MODULES = frozenset({"embed_tokens", "lm_head"})


def config_value_error(config: Mapping[str, Any]) -> str | None:
    """Why SGLang cannot use the config's values as they are, else None: srt/lora/lora_config.py
    reads `r`, `lora_alpha` and `target_modules` unchecked, and the manager and the adapter
    then compare `r` with the pool's rank, divide `lora_alpha` by it and normalise the targets
    as names; a value of another kind raises there (a TypeError, a ZeroDivisionError)."""
    r, alpha, targets = config.get("r"), config.get("lora_alpha"), config.get("target_modules")
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        return f"r {r!r} is not a positive integer"
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        return f"lora_alpha {alpha!r} is not a finite number"
    if not isinstance(targets, str) and not (isinstance(targets, list)
                                             and all(isinstance(t, str) for t in targets)):
        return f"target_modules {targets!r} is neither a name nor a list of names"
    return None


def scaling(config: Mapping[str, Any]) -> float:
    """srt/lora/lora.py LoRAAdapter.__init__: `self.scaling = lora_alpha / r`, whatever
    `use_rslora`, `rank_pattern` or `alpha_pattern` say."""
    return config["lora_alpha"] / config["r"]


def peft_scaling(config: Mapping[str, Any]) -> float:
    """PEFT's scale for the same config's default rank: alpha/sqrt(r) under rsLoRA."""
    r, alpha = config["r"], config["lora_alpha"]
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def startup_pool(configs: Iterable[Mapping[str, Any]], max_lora_rank: int | None = None,
                 lora_target_modules: Iterable[str] | None = None, *,
                 tie_word_embeddings: bool = False,
                 all_targets: frozenset[str] | None = None) -> tuple[int, set[str]]:
    """The pool `LoRAManager.init_lora_shapes` (srt/lora/lora_manager.py) sizes for the
    start-up adapters on a dense model: `--lora-target-modules` normalised (`all`: every
    module auto_detect_lora_target_modules finds plus both embedding names), else the union of
    the adapters' targets (a string `all`/`all-linear` adds what auto-detection finds: with
    tied embeddings the head is the embedding module itself, which `named_modules` yields once,
    as embed_tokens); the rank is `--max-lora-rank`, else the largest `r`. An adapter whose
    targets are outside given `--lora-target-modules` fails the start-up (`judge(...,
    path="startup")` says so). `all_targets`: what auto-detection finds on a class that is not
    dense-shaped (model.py SglangFamily.all_targets), embeddings aside."""
    # A config whose values SGLang cannot use fails its own load before the pool is sized.
    configs = [c for c in configs if config_value_error(c) is None]
    found = (all_targets or DENSE_MODULES) | EMBEDDING_MODULES
    given = set(lora_target_modules or ())
    if given == {"all"}:
        targets = set(found)
    else:
        targets = normalised_targets(given) if given else set()
        if not given:
            for config in configs:
                t = config.get("target_modules") or []
                if isinstance(t, str):
                    if t not in ("all", "all-linear"):
                        continue  # its own load fails first
                    targets |= found - ({"lm_head"} if tie_word_embeddings else set())
                else:
                    targets |= normalised_targets(t)
    rank = max_lora_rank if max_lora_rank is not None else max(
        (c["r"] for c in configs), default=0)
    return rank, targets


def added_tokens(adapter_dir: str | Path, vocab_size: int) -> int:
    """The tokens SGLang counts as added (srt/lora/lora_config.py LoRAConfig): the entries of
    the adapter's `added_tokens.json` whose id is at or past the base vocabulary (a copy of the
    base tokenizer's own is not counted); an unreadable file counts none, as SGLang logs it and
    goes on."""
    path = Path(adapter_dir) / "added_tokens.json"
    if not path.is_file():
        return 0
    try:
        tokens = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return 0
    if not isinstance(tokens, dict):
        return 0
    return sum(1 for i in tokens.values() if isinstance(i, int) and i >= vocab_size)


@dataclass(frozen=True)
class Judgement:
    """One adapter through one path. `accepted`: the load succeeds (at start-up, the server
    starts); else `error_type`/`error` are what SGLang raises (at start-up, the exception that
    stops the server). An accepted adapter's first batch may still raise in the scheduler
    (`batch_error_type`; `batch_errors` are the texts it may raise first, SGLang visiting the
    pool's modules in a set's order); `differs` names what it serves otherwise than PEFT."""

    accepted: bool
    error_type: str = ""
    error: str = ""
    differs: tuple[str, ...] = ()
    batch_error_type: str = ""
    batch_errors: tuple[str, ...] = ()
    # A stable name for the kind of reason (`dora`, `rank_above_max`, `slot_shape`, `rslora`,
    # ...; the first of several differences); "" when it serves.
    reason_class: str = ""
    path: str = "runtime"
    # Accepted, and no LoRA weight of it is ever applied (`ignores`).
    ignored: bool = False

    @property
    def batch_error(self) -> str:
        return self.batch_errors[0] if self.batch_errors else ""

    @property
    def verdict(self) -> Verdict:
        if not self.accepted:
            return Verdict.FAILS_STARTUP if self.path == "startup" else Verdict.REFUSES
        if self.batch_error_type:
            return Verdict.CRASHES
        if self.ignored:
            return Verdict.IGNORES
        return Verdict.DIFFERS if self.differs else Verdict.SERVES


# srt/layers/utils/common.py get_layer_id.
_LAYER = re.compile(r"layers\.(\d+)\.")
_PEFT_PREFIX = "base_model.model."
_LORA_PARTS = (".lora_A.weight", ".lora_B.weight", ".lora_embedding_A", ".lora_embedding_B")


def _layer_of(name: str) -> int | None:
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def _size(shape: tuple[int, ...]) -> str:
    return f"torch.Size([{', '.join(str(d) for d in shape)}])"


def judge(name: str, config: Mapping[str, Any],
          weights: Iterable[str] | Mapping[str, tuple[int, ...]], *,
          pool: tuple[int, set[str]] | None = None, added_tokens: int = 0,
          path: str | None = None, num_hidden_layers: int | None = None,
          hf_backbone: bool = False, lora_backend: str = "csgmv") -> Judgement:
    """What SGLang does with the adapter `name` (its `adapter_config.json` as a dict, its
    tensor names, or names to shapes: the safetensors header, which the rank checks need).

    `path` is "startup" (`--lora-paths`: a load error is the RuntimeError that stops the
    server) or "runtime" (`/load_lora_adapter`: the HTTP 400's text); by default "runtime" when
    `pool` is given, else "load": the load alone, its error as `_load_lora_adapter` returns it.
    `pool` is (max rank, target set): the running pool at runtime, the one the start-up builds
    at start-up (`startup_pool`); without it no check against a pool or first batch is made.
    `added_tokens`: the adapter's `added_tokens.json` entries at or past the base vocabulary
    (`added_tokens`); `num_hidden_layers`: the base model's. `hf_backbone`: SGLang builds its
    Transformers backend for the model (`hf_backbone_judgement`), under `lora_backend`."""
    path = path or ("runtime" if pool is not None else "load")
    shapes = dict(weights) if isinstance(weights, Mapping) else dict.fromkeys(weights)
    failed = _load_error(name, config, shapes, pool, added_tokens, path, num_hidden_layers)
    if failed is not None:
        kind, text, why = failed
        if path == "startup" and why != "startup_target_modules":
            # srt/lora/lora_manager.py init_lora_adapters wraps a failed load.
            kind, text = "RuntimeError", f"Failed to load LoRA adapter {name}: {text}"
        return Judgement(False, kind, text, reason_class=why, path=path)
    if pool is not None:
        batch = _batch_errors(config, shapes, pool)
        if batch is not None:
            return Judgement(True, batch_error_type=batch[0], batch_errors=batch[1],
                             reason_class=batch[2], path=path)
    differs = _differs(config, shapes)
    judged = Judgement(True, differs=tuple(d for _, d in differs),
                       reason_class=differs[0][0] if differs else "", path=path)
    if hf_backbone and pool is not None:
        return hf_backbone_judgement(judged, config, pool[1], lora_backend)
    return judged


def judge_report(report: AdapterReport, model: ModelConfig, *,
                 pool: tuple[int, set[str]] | None = None,
                 path: str | None = None, hf_backbone: bool = False,
                 lora_backend: str = "csgmv") -> Judgement:
    """`judge` on what the audit read: the config, the safetensors header's shapes, the base
    model's layer count, and the adapter directory's `added_tokens.json`."""
    adapter = report.adapter
    return judge(report.name, adapter.config.raw,
                 {n: t.shape for n, t in adapter.header.tensors.items()}, pool=pool,
                 added_tokens=added_tokens(adapter.path, model.vocab_size), path=path,
                 num_hidden_layers=model.num_hidden_layers, hf_backbone=hf_backbone,
                 lora_backend=lora_backend)


def _load_error(name: str, config: Mapping[str, Any], shapes: dict[str, Any],
                pool: tuple[int, set[str]] | None, added_tokens: int, path: str,
                num_layers: int | None) -> tuple[str, str, str] | None:
    """(error class, text, reason class) of the first step of `_load_lora_adapter` that raises,
    in its order, then the start-up's target check (`startup_target_modules`)."""
    # srt/lora/lora_config.py LoRAConfig.__init__ indexes these keys.
    for key in ("target_modules", "r", "lora_alpha"):
        if key not in config:
            return "KeyError", repr(key), "config_key"
    wrong = config_value_error(config)
    if wrong is not None:
        return "TypeError", (f"{wrong}: SGLang reads adapter_config.json's values unchecked "
                             "and compares, divides and normalises them as they are"), \
            "config_value"
    # srt/lora/lora_manager.py validate_new_adapter.
    if added_tokens > 0:
        return "ValueError", (f"Failed to load {name} because LoRA serving currently doesn't "
                              "support adapters that add tokens to the vocabulary"), "added_tokens"
    if config.get("use_dora"):
        return "ValueError", (f"Failed to load {name} because LoRA serving currently doesn't "
                              "support DoRA adapters"), "dora"
    targets = config["target_modules"]
    bad_string = isinstance(targets, str) and targets not in ("all", "all-linear")
    if path == "runtime" and pool is not None:
        # srt/lora/mem_pool.py LoRAMemoryPool.can_support (normalising raises on a string).
        if config["r"] > pool[0]:
            return "ValueError", _incompatible(name, config["r"]), "rank_above_max"
        if bad_string:
            return "ValueError", _STRING_TARGETS, "string_target_modules"
        wanted = normalised_targets(targets)
        if "all" not in wanted and not wanted <= pool[1]:
            return "ValueError", _incompatible(name, config["r"]), "target_modules"
    # srt/lora/lora.py LoRAAdapter._process_weight, per tensor in the file's (sorted) order:
    # it normalises the targets first, then files a weight under its layer.
    if bad_string and shapes:
        return "ValueError", _STRING_TARGETS, "string_target_modules"
    if num_layers is not None:
        for tensor in sorted(shapes):
            layer = _layer_of(tensor)
            if layer is not None and layer >= num_layers:
                return "IndexError", f"index {layer} is out of range", "layer_past_base"
    # srt/lora/lora.py LoRAAdapter._normalize_weights, layer by layer.
    for names in _by_layer(shapes).values():
        failed = _fuse_error(names, shapes)
        if failed is not None:
            return failed
    # srt/lora/lora_manager.py init_lora_shapes: given --lora-target-modules must cover it.
    if path == "startup" and pool is not None and not bad_string:
        wanted = normalised_targets(targets)
        if "all" not in wanted and not wanted <= pool[1]:
            missing = sorted(wanted - pool[1])
            return "ValueError", (
                f"LoRA adapter '{name}' contains target modules {missing} that are not included "
                f"in the specified --lora-target-modules {sorted(pool[1])}. Please update "
                "--lora-target-modules to include all required modules: "
                f"{sorted(pool[1] | wanted)}, or use 'all' to enable all supported modules."), \
                "startup_target_modules"
    return None


def _incompatible(name: str, r: int) -> str:
    return (f"LoRA adapter {name} with rank {r} is incompatible with the current LoRA memory "
            "pool configuration. Please ensure that the LoRA adapter's rank is within the "
            "configured `--max-lora-rank` and that the target modules are included in "
            "`--lora-target-modules`.")


def _by_layer(shapes: Mapping[str, Any]) -> dict[int, list[str]]:
    layers: dict[int, list[str]] = {}
    for tensor in sorted(shapes):
        layer = _layer_of(tensor)
        if layer is not None:
            layers.setdefault(layer, []).append(tensor)
    return dict(sorted(layers.items()))


def _cat_error(tensors: list[Any]) -> tuple[str, str, str] | None:
    """torch.cat along dim 0: every other dim must match the first tensor's."""
    if any(t is None for t in tensors):
        return None
    first = tensors[0]
    for i, t in enumerate(tensors[1:], 1):
        for dim in range(1, len(first)):
            if t[dim] != first[dim]:
                return "RuntimeError", (
                    "Sizes of tensors must match except in dimension 0. Expected size "
                    f"{first[dim]} but got size {t[dim]} for tensor number {i} in the list."), \
                    "fused_rank_mismatch"
    return None


def _fuse_error(names: list[str],
                shapes: Mapping[str, Any]) -> tuple[str, str, str] | None:
    """srt/lora/lora.py normalize_qkv_proj and normalize_gate_up_proj on one layer: q_proj is
    stacked with k_proj (zeros when the layer has none) and v_proj, which must exist (a
    KeyError on its name); gate_proj with up_proj (zeros when absent). Stacking concatenates
    along dim 0, so q, k and v (gate and up) must have one rank."""
    has_k = any("k_proj" in n for n in names)
    for n in names:
        if "q_proj" not in n:
            continue
        k, v = n.replace("q_proj", "k_proj"), n.replace("q_proj", "v_proj")
        if has_k and k not in shapes:
            return "KeyError", repr(k), "fused_part_missing"
        if v not in shapes:
            return "KeyError", repr(v), "fused_part_missing"
        failed = _cat_error([shapes[n], shapes[k] if has_k else shapes[v], shapes[v]])
        if failed is not None:
            return failed
    for n in names:
        if "gate_proj" not in n:
            continue
        up = n.replace("gate_proj", "up_proj")
        if up in shapes:
            failed = _cat_error([shapes[n], shapes[up]])
            if failed is not None:
                return failed
    return None


def _fused_layer(names: list[str], shapes: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """A layer's weights after `_normalize_weights` in the dict's order: what is left of the
    file's names in place, then each stacked qkv_proj / gate_up_proj weight (its shape: the
    parts' dim 0 summed). A weight the checkpoint already fuses (phi3's qkv_proj, phi3's and
    glm4's gate_up_proj) stays in place, its A repeated once per slice (lora.py
    normalize_qkv_proj and normalize_gate_up_proj: `repeat(3, 1)`, `repeat(2, 1)`; B as it
    is)."""
    has_k = any("k_proj" in n for n in names)
    kept: dict[str, Any] = {}
    for n in names:
        fused = next((m for m in ("qkv_proj", "gate_up_proj") if f".{m}." in n), None)
        shape = shapes[n]
        if fused and "lora_A" in n and shape is not None:
            shape = (shape[0] * STACKED[fused], *shape[1:])
        kept[n] = shape
    out: dict[str, Any] = {}
    for n in names:
        if "q_proj" in n:
            k, v = n.replace("q_proj", "k_proj"), n.replace("q_proj", "v_proj")
            parts = [shapes[n], shapes[k] if has_k else shapes[v], shapes[v]]
            for gone in (n, v, k) if has_k else (n, v):
                kept.pop(gone, None)
            out[n.replace("q_proj", "qkv_proj")] = _stacked(parts)
    for n in names:
        if "gate_proj" in n:
            up = n.replace("gate_proj", "up_proj")
            parts = [shapes[n], shapes.get(up) or shapes[n]]
            kept.pop(n, None)
            kept.pop(up, None)
            out[n.replace("gate_proj", "gate_up_proj")] = _stacked(parts)
    return list(kept.items()) + list(out.items())


def _stacked(parts: list[Any]) -> Any:
    if any(p is None for p in parts):
        return None
    return (sum(p[0] for p in parts), *parts[0][1:])


def _target_of(tensor: str, targets: set[str]) -> str | None:
    """srt/lora/utils.py get_target_module_name: the longest target in the name."""
    hits = [t for t in targets if t in tensor]
    return max(hits, key=len) if hits else None


def _batch_errors(config: Mapping[str, Any], shapes: Mapping[str, Any],
                  pool: tuple[int, set[str]]) -> tuple[str, tuple[str, ...], str] | None:
    """srt/lora/mem_pool.py load_lora_weight_to_buffer, layer by layer: every weight of the
    layer must name a pool target (a ValueError), then each wrapped module's slot view, A
    `[:r * c, :]` and B `[:, :r]` of a buffer sized for the pool's max rank, must have the
    weight's shape (an AssertionError). `r` is the config's, whatever `rank_pattern` says."""
    max_rank, targets = pool
    r = config["r"]
    targets = set(targets)
    for names in _by_layer(shapes).values():
        fused = _fused_layer(names, shapes)
        for tensor, _ in fused:
            if _target_of(tensor, targets) is None:
                shown = "{" + ", ".join(repr(t) for t in sorted(targets)) + "}"
                return "ValueError", (f"Cannot find target module name for {tensor} in {shown}",), \
                    "no_target_module"
        a_side: dict[str, Any] = {}
        b_side: dict[str, Any] = {}
        for tensor, shape in fused:
            module = _target_of(tensor, targets)
            (a_side if "lora_A" in tensor else b_side)[module] = shape
        # Every A slot of the layer is filled before any B slot: an A mismatch comes first.
        for side, table in (("A", a_side), ("B", b_side)):
            found = []
            for module in sorted(table):
                shape = table[module]
                if module not in DENSE_MODULES or shape is None:
                    continue
                c = STACKED.get(module, 1) if side == "A" else 1
                if side == "A":
                    view = (min(r * c, max_rank * c), *shape[1:])
                else:
                    view = (shape[0], min(r, max_rank))
                if tuple(shape) != view:
                    found.append(f"LoRA buffer shape {_size(view)} does not match weight "
                                 f"shape {_size(tuple(shape))}.")
            if found:
                return "AssertionError", tuple(found), "slot_shape"
    return None


def _differs(config: Mapping[str, Any],
             shapes: Mapping[str, Any]) -> list[tuple[str, str]]:
    """What an accepted adapter serves otherwise than PEFT: (reason class, words) each."""
    out: list[tuple[str, str]] = []
    cfg = AdapterConfig.from_dict(dict(config))
    sglang = scaling(config)
    peft = {}
    for tensor in shapes:
        if tensor.endswith(".lora_A.weight") or tensor.endswith(".lora_embedding_A"):
            key = tensor.removeprefix(_PEFT_PREFIX).rsplit(".lora_", 1)[0]
            peft[key] = cfg.scaling(cfg.rank_for(key), cfg.alpha_for(key))
    if not peft:  # no tensor names given: the config's own scale
        peft[""] = cfg.scaling(cfg.r, cfg.lora_alpha)
    other = sorted({s for s in peft.values() if not math.isclose(s, sglang, rel_tol=1e-12)})
    if other:
        why = "rsLoRA" if cfg.use_rslora else "alpha_pattern"
        out.append((why.lower(), f"scale {sglang:g} (lora_alpha / r) on every module where "
                    f"PEFT applies {', '.join(f'{s:g}' for s in other)} ({why})"))
    # srt/lora/lora.py LoRAAdapter._process_weight keeps a weight off the layers only for a
    # targeted embed_tokens / lm_head; load_lora_weight_to_buffer copies only their LoRA A/B.
    targets = config["target_modules"]
    # A string other than all/all-linear fails the load once there is a weight to file.
    wanted = set() if isinstance(targets, str) and targets not in ("all", "all-linear") \
        else normalised_targets(targets)
    saved, tokens, biases, lora_biases = set(), False, set(), False
    for tensor in shapes:
        inner = tensor.removeprefix(_PEFT_PREFIX)
        if _layer_of(inner) is not None:
            if tensor.endswith(".lora_B.bias"):
                lora_biases = True
            elif tensor.endswith(".bias"):
                # The B side of the slot takes the module's lora_B weight, filed after it.
                biases.add(tensor)
            continue
        if "trainable_tokens_delta" in tensor:
            tokens = True
        elif tensor.endswith(_LORA_PARTS):
            module = "embed_tokens" if "embed_tokens" in tensor else "lm_head"
            if "all" not in wanted and module not in wanted:
                saved.add(inner.rsplit(".lora_", 1)[0])
        elif not tensor.endswith(".base_layer.weight"):
            saved.add(inner.rsplit(".", 1)[0])
    if saved:
        out.append(("modules_to_save", f"modules_to_save {sorted(saved)} not loaded"))
    if tokens:
        out.append(("trainable_tokens",
                    f"trainable tokens {config.get('trainable_token_indices')} not loaded"))
    if biases:
        out.append(("bias", f"bias={config.get('bias')!r}: the {len(biases)} trained bias "
                    "tensors not loaded"))
    if lora_biases:
        out.append(("lora_bias", "lora_bias: the lora_B biases not loaded"))
    return out


# -- SGLang's Transformers backend ------------------------------------------------------------

# models/transformers.py TransformersBase.recursive_replace: the HF model's own modules, each
# nn.Linear swapped for an SGLang linear under its HF name (`replace_linear_class`), so the
# attention keeps q_proj, k_proj, v_proj apart and the MLP gate_proj, up_proj. The LoRA manager
# wraps a module whose last name is a normalised target (lora/lora_manager.py
# init_lora_modules: `parts[-1] in self.target_modules`), and normalising turns q/k/v into
# `qkv_proj` and gate/up into `gate_up_proj`, names no module there has.
HF_BACKBONE_UNWRAPPED = frozenset({"qkv_proj", "gate_up_proj"})
# The row-parallel layers that keep their names, wrapped by RowParallelLinearWithLoRA, whose
# forward takes the (tokens, hidden) input SGLang's own models give it; the backbone hands it
# HF's (1, tokens, hidden) (`_run_hf_backbone`: `input_ids[None, ...]`).
HF_BACKBONE_WRAPPED_3D = frozenset({"o_proj", "down_proj"})
# The LoRA A kernel each --lora-backend runs on that 3-D input, and what it raises:
# csgmv: kernels/ops/lora/dense/chunked_sgmv_shrink.py chunked_sgmv_lora_shrink_forward and
# triton: kernels/ops/lora/dense/sgemm_lora_a.py sgemm_lora_a_fwd (`assert len(x.shape) ==
# 2`); torch_native: lora/torch_ops/lora_ops.py sgemm_lora_a_fwd (`total_seq_len, input_dim =
# inputs.shape`, run in tests/test_engine_sglang.py).
HF_BACKBONE_ERRORS = {"csgmv": ("AssertionError", ""), "triton": ("AssertionError", ""),
                      "torch_native": ("ValueError", "too many values to unpack (expected 2)")}


def hf_backbone_judgement(judged: Judgement, config: Mapping[str, Any], targets: set[str],
                          lora_backend: str) -> Judgement:
    """An accepted adapter on SGLang's Transformers backend (a model whose architecture
    SGLang has no class for: model_loader/utils.py get_model_architecture), against the
    running pool's `targets`. Where the pool wraps o_proj or down_proj, the first forward pass
    through them raises in the scheduler, whatever the batch's adapters (`crashes`); else
    the adapter's q/k/v and gate/up weights load and are never applied: `ignores` where nothing
    else of it is applied (embed_tokens and lm_head are wrapped as on a native class)."""
    if not judged.accepted or judged.batch_error_type:
        return judged
    if targets & HF_BACKBONE_WRAPPED_3D:
        kind, text = HF_BACKBONE_ERRORS.get(lora_backend, (
            "an error", f"--lora-backend {lora_backend}'s kernel was not read: metrale read "
            f"{', '.join(HF_BACKBONE_ERRORS)}'s"))
        return Judgement(True, differs=judged.differs, batch_error_type=kind,
                         batch_errors=(text,), reason_class="hf_backbone_forward",
                         path=judged.path)
    raw = config["target_modules"]
    wanted = (set(DENSE_MODULES | EMBEDDING_MODULES) if isinstance(raw, str)
              else normalised_targets(raw))
    lost = sorted(wanted & HF_BACKBONE_UNWRAPPED)
    if not lost:
        return judged
    applied = wanted - HF_BACKBONE_UNWRAPPED
    why = (f"{' and '.join(lost)} never applied: SGLang's Transformers backend keeps HF's "
           "separate q_proj/k_proj/v_proj and gate_proj/up_proj modules, and its LoRA manager "
           f"wraps only modules named {', '.join(lost)}")
    return Judgement(True, differs=(why, *judged.differs), reason_class="hf_backbone_unwrapped",
                     path=judged.path, ignored=not applied)


@dataclass(frozen=True)
class SourceRule:
    """A rule the CPU runner cannot show (the HTTP server, the scheduler, MoE and hybrid
    models), `checked: source`: the function of `sglang/srt/<file>` it was read from and the
    line it depends on (tests/test_engine_sglang.py finds that line in the installed source)."""

    case: str
    behaviour: str
    file: str
    function: str
    line: str


SOURCE_RULES = (
    SourceRule("runtime load refused", "`/load_lora_adapter` answers HTTP 400 with the load's "
               "error text; the server keeps serving", "entrypoints/http_server.py",
               "load_lora_adapter",
               "status_code = HTTPStatus.OK if result.success else HTTPStatus.BAD_REQUEST"),
    SourceRule("first batch", "an adapter is copied into a pool slot when a batch naming it "
               "is built, in the scheduler's forward step", "model_executor/forward_batch_info.py",
               "ForwardBatch.init_new",
               "model_runner.lora_manager.fetch_new_loras(set(ret.lora_ids))"),
    SourceRule("first-batch error", "an exception there ends the scheduler, which sends the "
               "server SIGQUIT: every adapter's requests go down (`crashes`)",
               "managers/scheduler.py", "run_scheduler_process",
               "parent_process.send_signal(signal.SIGQUIT)"),
    SourceRule("one scale per adapter", "each batch passes one scale per adapter slot, its "
               "`lora_alpha / r`, to every module's kernel", "lora/lora_manager.py",
               "LoRAManager.prepare_lora_batch", "scalings[weight_index] = lora.scaling"),
    SourceRule("all-linear on an MoE model", "`all`/`all-linear` resolve a fused-MoE layer to "
               "`gate_up_proj` and `down_proj`: the routed experts are targeted",
               "lora/utils.py", "auto_detect_lora_target_modules",
               "if isinstance(module, FusedMoE):"),
    SourceRule("Gated-DeltaNet in_proj (Qwen3.5)", "`in_proj_q/k/v/z` are stacked into "
               "`in_proj_qkvz` only when the layer has all four", "lora/lora.py",
               "LoRAAdapter._normalize_in_proj_qkvz",
               'qkvz_name = weight_name.replace("in_proj_q", "in_proj_qkvz")'),
)
