"""PEFT LoRA adapters on disk: the config with PEFT's own matching and scaling rules, the
safetensors header, and tensor keys mapped to (layer, module path, tensor part).

Nothing here reads tensor data.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from metrale_cli.adapters import patterns
from metrale_cli.errors import FormatError, UsageError
from metrale_cli.files.hub import cached, fetch, parse_hub_id, remote_header
from metrale_cli.files.jsondoc import load_json, shown
from metrale_cli.files.regular import refuse_not_regular
from metrale_cli.files.safetensors_header import SafetensorsHeader, TensorInfo, read_header
from metrale_cli.model.families import Family

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PICKLE_NAME = "adapter_model.bin"


# -- the config ---------------------------------------------------------------------------------


def _pattern_key(field: str, keys: list[str], module_key: str) -> list[str]:
    """Every pattern key that PEFT's `get_pattern_key` accepts for `module_key`, in file order;
    PEFT takes the first (`re.match(rf"(.*\\.)?({key})$", module_key)`)."""
    return [key for key in keys
            if patterns.match(field, rf"(.*\.)?({key})$", module_key, shown=key)]


@dataclass(frozen=True)
class AdapterConfig:
    """`adapter_config.json`, read with PEFT 0.21's semantics. Unknown keys are kept in `raw`."""

    raw: dict[str, Any]
    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: list[str] | str | None
    exclude_modules: list[str] | str | None
    target_parameters: list[str]
    layers_to_transform: list[int] | None
    layers_pattern: list[str] | None
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    modules_to_save: list[str]
    base_model_name_or_path: str | None
    source: str = ""
    # Ranks and alphas the config states but no pool can use (NaN, Infinity, 0, a fractional
    # rank, a string), one line each naming the field; the audit makes each an error. In their
    # place the fields above hold PEFT's defaults (r=8, lora_alpha=8) or drop the pattern key.
    value_errors: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, raw: Any, source: str = "") -> AdapterConfig:
        where = source or CONFIG_NAME
        if not isinstance(raw, dict):
            raise FormatError(f"{where}: not a JSON object")
        peft_type = raw.get("peft_type")
        if peft_type is None:
            raise FormatError(f"{where}: no 'peft_type': not a PEFT adapter config")
        if str(peft_type).upper() != "LORA":
            raise FormatError(
                f"{where}: peft_type is {peft_type!r}, not 'LORA': not a PEFT LoRA adapter"
            )

        value_errors: list[str] = []

        def judged(field: str, value: Any, rank: bool) -> bool:
            """Whether `value` is a usable rank (a positive integer) or alpha (a positive
            finite number); each unusable one is a value error naming `field`."""
            usable = (
                isinstance(value, (int, float)) and not isinstance(value, bool)
                and math.isfinite(value) and value > 0 and (not rank or value == int(value))
            )
            if not usable:
                what = "a positive integer" if rank else "a positive finite number"
                value_errors.append(f"{field} must be {what}, got {shown(value)}")
            return usable

        def number(key: str, default: int, rank: bool) -> float:
            value = raw.get(key)
            if value is None or not judged(repr(key), value, rank):
                return default
            return value

        def pattern(key: str, rank: bool) -> dict[str, Any]:
            value = raw.get(key) or {}
            if not isinstance(value, dict):
                value_errors.append(f"{key!r} must map patterns to numbers, got {shown(value)}")
                return {}
            return {k: v for k, v in value.items() if judged(f"{key}[{k!r}]", v, rank)}

        def str_list(key: str, allow_str: bool) -> list[str] | str | None:
            value = raw.get(key)
            if value is None:
                return None
            if isinstance(value, str) and allow_str:
                return value
            if isinstance(value, list) and all(isinstance(v, str) for v in value):
                return list(value)
            raise FormatError(f"{where}: {key!r} must be a list of strings or a string")

        layers = raw.get("layers_to_transform")
        if isinstance(layers, int) and not isinstance(layers, bool):
            layers = [layers]
        if layers is not None and not (
            isinstance(layers, list) and all(isinstance(i, int) for i in layers)
        ):
            raise FormatError(f"{where}: 'layers_to_transform' must be an int or a list of ints")
        layers_pattern = raw.get("layers_pattern")
        if isinstance(layers_pattern, str):
            layers_pattern = [layers_pattern]
        if layers_pattern is not None and not (
            isinstance(layers_pattern, list) and all(isinstance(p, str) for p in layers_pattern)
        ):
            raise FormatError(f"{where}: 'layers_pattern' must be a string or a list of strings")
        target_parameters = raw.get("target_parameters") or []
        if not isinstance(target_parameters, list) or not all(
            isinstance(t, str) for t in target_parameters
        ):
            raise FormatError(f"{where}: 'target_parameters' must be a list of strings")
        modules_to_save = str_list("modules_to_save", allow_str=False) or []
        base = raw.get("base_model_name_or_path")
        return cls(
            raw=raw,
            r=int(number("r", 8, rank=True)),
            lora_alpha=number("lora_alpha", 8, rank=False),
            use_rslora=bool(raw.get("use_rslora", False)),
            target_modules=str_list("target_modules", allow_str=True),
            exclude_modules=str_list("exclude_modules", allow_str=True),
            target_parameters=list(target_parameters),
            layers_to_transform=layers,
            layers_pattern=layers_pattern,
            rank_pattern={k: int(v) for k, v in pattern("rank_pattern", rank=True).items()},
            alpha_pattern=pattern("alpha_pattern", rank=False),
            modules_to_save=list(modules_to_save),  # type: ignore[arg-type]
            base_model_name_or_path=base if isinstance(base, str) and base else None,
            source=source,
            value_errors=tuple(value_errors),
        )

    @classmethod
    def from_file(cls, path: Path) -> AdapterConfig:
        try:
            text = path.read_bytes()
        except OSError as exc:
            raise FormatError(f"{path}: not a readable JSON file ({exc})") from exc
        return cls.from_dict(load_json(path, text, "JSON file"), source=str(path))

    # -- PEFT's rules ---------------------------------------------------------------------------

    def rank_for(self, module_key: str) -> int:
        hits = _pattern_key("rank_pattern", list(self.rank_pattern), module_key)
        return self.rank_pattern[hits[0]] if hits else self.r

    def alpha_for(self, module_key: str) -> float:
        hits = _pattern_key("alpha_pattern", list(self.alpha_pattern), module_key)
        return self.alpha_pattern[hits[0]] if hits else self.lora_alpha

    def scaling(self, r: int, alpha: float) -> float:
        """PEFT's `update_layer`: alpha/sqrt(r) with rsLoRA, else alpha/r."""
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    def overlapping_patterns(self, module_key: str) -> dict[str, list[str]]:
        """Pattern dicts in which more than one key matches `module_key`: PEFT takes the first in
        file order after a reload, while training used the user's insertion order."""
        found = {}
        for name, values in (("rank_pattern", self.rank_pattern),
                             ("alpha_pattern", self.alpha_pattern)):
            hits = _pattern_key(name, list(values), module_key)
            if len(hits) > 1 and len({values[h] for h in hits}) > 1:
                found[name] = hits
        return found

    def _regexes(self) -> list[tuple[str, list[str]]]:
        """Every regex of the config, by field: what PEFT compiles."""
        fields: list[tuple[str, list[str]]] = [
            ("rank_pattern", list(self.raw_pattern_keys("rank_pattern"))),
            ("alpha_pattern", list(self.raw_pattern_keys("alpha_pattern"))),
            ("modules_to_save", self.modules_to_save),
            ("layers_pattern", self.layers_pattern or []),
        ]
        for name in ("target_modules", "exclude_modules"):
            value = getattr(self, name)
            if isinstance(value, str):
                fields.append((name, [value]))
        return fields

    def size_errors(self) -> list[str]:
        """Each size bound (patterns.MAX_*) that the config's regexes and name lists pass, one
        line each; the audit judges nothing else of such a config, and compiles none of it."""
        lists = [(name, value) for name in ("target_modules", "exclude_modules")
                 if isinstance(value := getattr(self, name), list)]
        return patterns.size_errors(self._regexes(), lists)

    def pattern_errors(self) -> list[str]:
        """Every regex of the config that Python's `re` (PEFT's) cannot compile, one line each
        naming its field; PEFT would fail on it, so it matches nothing here."""
        bad = []
        for name, values in self._regexes():
            for value in values:
                why = patterns.compile_error(value)
                if why is not None:
                    bad.append(f"{name} {value!r} is not a valid regex ({why})")
        return bad

    def raw_pattern_keys(self, key: str) -> list[str]:
        """The keys of a rank/alpha pattern dict as the file has them (values judged or not)."""
        value = self.raw.get(key)
        return [k for k in value if isinstance(k, str)] if isinstance(value, dict) else []

    def is_targeted(self, module_key: str) -> bool:
        """PEFT's `check_target_module_exists` for a module path as PEFT saw it."""
        if _name_matches("exclude_modules", self.exclude_modules, module_key,
                         self._name_sets.get("exclude_modules")):
            return False
        for m in self.modules_to_save:
            if patterns.match("modules_to_save", rf"(^|.*\.){m}($|\..*)", module_key, shown=m):
                return False
        targets = self.target_modules
        if targets is None:
            return False
        if not _name_matches("target_modules", targets, module_key,
                             self._name_sets.get("target_modules")):
            return False
        if isinstance(targets, str):
            return True
        if self.layers_to_transform is None:
            return True
        index = _layer_index(module_key, self.layers_pattern)
        return index is not None and index in self.layers_to_transform

    @functools.cached_property
    def _name_sets(self) -> dict[str, frozenset[str]]:
        """target_modules and exclude_modules lists as sets: a module path is looked up by its
        dotted suffixes, not compared with every name (65,536 names, thousands of paths)."""
        return {name: frozenset(value) for name in ("target_modules", "exclude_modules")
                if isinstance(value := getattr(self, name), list)}

    def with_default_targets(self, family: Family, composite: bool = False) -> AdapterConfig:
        """This config with PEFT's default for the family when `target_modules` is null: the
        vision-language wrapper's (`composite`) where PEFT keys one of its own."""
        if self.target_modules is not None:
            return self
        if composite and family.peft_wrapper_targets:
            return replace(self, target_modules=family.peft_wrapper_targets)
        if not family.peft_default_targets:
            return self
        return replace(self, target_modules=list(family.peft_default_targets))

    def targets_parameter(self, param_key: str) -> bool:
        """`target_parameters` matching: exact key or dot-suffix, never a regex."""
        return any(param_key == t or param_key.endswith("." + t) for t in self.target_parameters)


def _name_matches(field: str, names: list[str] | str | None, key: str,
                  name_set: frozenset[str] | None) -> bool:
    """PEFT's rule: a string is a regex that must match the whole key; a list (`name_set`, the
    same names) holds names that match the key or its last dotted parts."""
    if names is None:
        return False
    if isinstance(names, str):
        return patterns.match(field, names, key, full=True) is not None
    assert name_set is not None
    # `key == n or key.endswith("." + n)` for some n: the key, or what follows one of its dots.
    return key in name_set or any(key[i + 1:] in name_set
                                  for i, c in enumerate(key) if c == ".")


def _layer_index(key: str, layers_pattern: list[str] | None) -> int | None:
    """The layer index PEFT reads for `layers_to_transform`: the first `.<name>.<digits>.` group,
    or the group after one of `layers_pattern`."""
    if not layers_pattern:
        m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
        return int(m.group("idx")) if m else None
    for p in layers_pattern:
        m = patterns.match("layers_pattern", rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", key, shown=p)
        if m:
            return int(m.group("idx"))
    return None


# -- tensor keys --------------------------------------------------------------------------------

# Tensor parts after the module path, longest first so `lora_B.bias` wins over `bias`.
PARTS = (
    "token_adapter.trainable_tokens_delta",
    "lora_magnitude_vector",
    "lora_embedding_A",
    "lora_embedding_B",
    "base_layer.weight",
    "base_layer.bias",
    "lora_A.weight",
    "lora_B.weight",
    "lora_B.bias",
    "weight",
    "bias",
)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class AdapterKey:
    """One tensor name, taken apart."""

    tensor: str
    # The module path as PEFT saw it in the model (what target and pattern matching read),
    # e.g. `model.language_model.layers.3.self_attn.q_proj`.
    module_key: str
    # The same path with the vision-language prefix folded: `model.layers.3.self_attn.q_proj`.
    path: str
    layer: int | None
    # The path inside the decoder layer (`self_attn.q_proj`), or the whole path off the layers.
    sub: str
    # `lora_A.weight`, `lora_B.weight`, ... (see PARTS), or "" when nothing is recognised.
    part: str
    # The inner of two nested ParamWrappers (`experts.base_layer.lora_A`): gate_up_proj in v5.
    inner: bool = False


def parse_key(tensor: str) -> AdapterKey:
    name = tensor.removeprefix("base_model.model.")
    # A leftover adapter name: `lora_A.default.weight` or a trailing `.default`.
    name = name.removesuffix(".default")
    name = re.sub(r"\.default\.(weight|bias)$", r".\1", name)
    part = next((p for p in PARTS if name.endswith("." + p)), "")
    module_key = name[: -len(part) - 1] if part else name
    inner = False
    if part.startswith("lora_") and module_key.endswith(".base_layer"):
        module_key = module_key.removesuffix(".base_layer")
        inner = True
    path = module_key
    if path.startswith("model.language_model."):
        path = "model." + path.removeprefix("model.language_model.")
    elif path.startswith("language_model.model."):
        path = "model." + path.removeprefix("language_model.model.")
    m = _LAYER.match(path)
    layer, sub = (int(m.group(1)), m.group(2)) if m else (None, path)
    return AdapterKey(tensor, module_key, path, layer, sub, part, inner)


# -- the adapter on disk ------------------------------------------------------------------------


@dataclass(frozen=True)
class Adapter:
    name: str
    path: Path
    config: AdapterConfig
    header: SafetensorsHeader
    keys: list[AdapterKey] = field(default_factory=list)

    @property
    def weights_path(self) -> Path:
        return self.path / WEIGHTS_NAME

    @property
    def config_path(self) -> Path:
        return self.path / CONFIG_NAME

    def tensor(self, key: AdapterKey) -> TensorInfo:
        return self.header.tensors[key.tensor]

    @classmethod
    def load(cls, path: str | Path, name: str | None = None) -> Adapter:
        path = adapter_dir(path)
        config_path = path / CONFIG_NAME
        weights = path / WEIGHTS_NAME
        refuse_not_regular(config_path)
        refuse_not_regular(weights)
        if not config_path.is_file():
            raise UsageError(f"{path}: no {CONFIG_NAME}: not a PEFT adapter directory")
        if not weights.is_file():
            if (path / PICKLE_NAME).is_file():
                raise FormatError(
                    f"{path}: only {PICKLE_NAME} (a pickle, which metrale never loads); convert "
                    "it in a trusted environment: PeftModel.from_pretrained(...)."
                    "save_pretrained(dir, safe_serialization=True)"
                )
            raise UsageError(f"{path}: no {WEIGHTS_NAME}")
        config = AdapterConfig.from_file(config_path)
        header = read_header(weights)
        keys = [parse_key(t) for t in header.tensors]
        return cls(name or default_name(path), path, config, header, keys)


def load_adapter(spec: str, name: str | None = None, online: bool = False,
                 weights: bool = True) -> Adapter:
    """A local adapter directory, or a hub id (`org/name[@revision]`) from the local Hugging
    Face cache; with `online` a missing config is downloaded, and the weights too when
    `weights` is set, else only their header is read (two ranged reads)."""
    ref = parse_hub_id(spec)
    if ref is None:
        return Adapter.load(spec, name)
    config = fetch(ref, CONFIG_NAME, online)
    if weights and online:
        fetch(ref, WEIGHTS_NAME, online)  # into the config's snapshot directory
    elif cached(ref, WEIGHTS_NAME) is None:
        if not online:
            fetch(ref, WEIGHTS_NAME, online)  # raises: not in the cache, pass --online
        header = remote_header(ref, WEIGHTS_NAME)
        return Adapter(name or ref.name, config.parent, AdapterConfig.from_file(config), header,
                       [parse_key(t) for t in header.tensors])
    return Adapter.load(config.parent, name or ref.name)


def adapter_dir(path: str | Path) -> Path:
    """The adapter directory an argument names: the directory itself, or the directory of its
    `adapter_config.json` or `adapter_model.safetensors`."""
    if not str(path).strip():
        raise UsageError("an adapter path is empty")  # Path("") would be the current directory
    path = Path(path).expanduser()
    if not path.exists():
        raise UsageError(f"{path}: no such adapter directory")
    if path.is_dir():
        return path
    if path.name in (CONFIG_NAME, WEIGHTS_NAME, PICKLE_NAME):
        return path.parent
    raise UsageError(f"{path}: not an adapter directory, nor its {CONFIG_NAME} or "
                     f"{WEIGHTS_NAME}")


def default_name(directory: Path) -> str:
    """An adapter's name when the argument gives none: its directory's name."""
    resolved = directory.resolve()
    return resolved.name or str(resolved)


def parse_adapter_args(args: list[str]) -> list[tuple[str, str]]:
    """`PATH` or `NAME=PATH` arguments into (name, adapter), by one rule: NAME when given, else
    the name of the adapter directory (a file argument names its directory), or of a hub id's
    repository (`name@revision` with one). The adapter is its directory, or the hub id as
    given. Two adapters with one name are refused, since the name is the adapter's cache
    identity."""
    parsed: list[tuple[str, str]] = []
    for arg in args:
        name, sep, spec = arg.partition("=")
        if not (sep and name and "/" not in name and not Path(arg).exists()):
            name, spec = "", arg
        hub = parse_hub_id(spec) if spec.strip() else None
        if hub is not None:
            parsed.append((name or hub.name, spec))
        else:
            directory = adapter_dir(spec)
            parsed.append((name or default_name(directory), str(directory)))
    seen: set[str] = set()
    for name, _ in parsed:
        if name in seen:
            raise UsageError(f"two adapters are named {name!r}; name them apart with NAME=PATH")
        seen.add(name)
    return parsed
