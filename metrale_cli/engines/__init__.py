"""What a serving engine does with adapters, answered offline from configs and headers.

Every engine is one package (its rules, its model, its flags: vllm/, sglang/) whose object
satisfies the `Engine` protocol (engine.py), registered here by name and pinned to the versions
its rules were read from and tested against (vLLM: 0.32.0, SGLang: 0.5.23). It takes the
audit's `AdapterReport`s and the `ModelConfig` and returns the engine-neutral records of
verdict.py, and carries what the commands and views ask of it (its title, load paths, flags,
options, host-cache flag, whether it can be confirmed), so a third engine is a package and one
`register` call, not a change to the audit, the CLI or the views; what engines read alike is
shared.py's. `metrale`, the default, is the project's own pool, whose answers are the audit's
and the layout's: it is no engine object, only the options the pool's commands take
(`POOL_OPTIONS`).
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib import import_module
from typing import TYPE_CHECKING

from metrale_cli.errors import UsageError, did_you_mean

if TYPE_CHECKING:
    from metrale_cli.engines.engine import Engine

# name -> the engine, or the module whose `ENGINE` it is (the built-in engines, imported on
# first use: no engine costs a start-up).
_REGISTRY: dict[str, Engine | str] = {"vllm": "metrale_cli.engines.vllm",
                                      "sglang": "metrale_cli.engines.sglang"}

# The options `inspect` and `layout` take on metrale's own pool (beyond --model, --online,
# --json and the adapters every engine takes).
POOL_OPTIONS: dict[str, frozenset[str]] = {
    "inspect": frozenset({"--max-rank", "--experts"}),
    "layout": frozenset({"--modules", "--max-rank", "--max-loras", "--budget", "--align",
                         "--experts", "--tp", "--ep", "--fully-sharded"}),
    "simulate": frozenset({"--modules", "--max-rank", "--max-loras", "--budget", "--experts",
                           "--tp", "--ep", "--fully-sharded", "--host-slots", "--pin",
                           "--pinned"}),
}


def register(engine: Engine) -> None:
    """Answer `--engine NAME` (and the library's `get_engine`) with `engine`, NAME its `name`:
    every command and view then asks it, and no other file needs to know it."""
    if engine.name == "metrale" or engine.name in _REGISTRY:
        raise UsageError(f"engine {engine.name!r} is registered already")
    _REGISTRY[engine.name] = engine


def names() -> tuple[str, ...]:
    """Every `--engine` name: metrale's own pool, then the registered engines."""
    return ("metrale", *_REGISTRY)


def get_engine(spec: str) -> Engine:
    """The engine `spec` names: `vllm` or `sglang` (the rules' own version), or `NAME==X` for
    an X the rules are pinned to; anything else is a UsageError listing what is known."""
    if not isinstance(spec, str):
        raise UsageError(f"engine: takes a name such as 'vllm', 'sglang' or 'vllm==0.32.0', got "
                         f"{type(spec).__name__}")
    name, _, version = spec.strip().partition("==")
    entry = _REGISTRY.get(name.strip())
    if entry is None:
        raise UsageError(f"--engine {spec!r}{did_you_mean(name, names())}: one of "
                         f"{', '.join(names())} (a version as "
                         "vllm==0.32.0)")
    engine: Engine = import_module(entry).ENGINE if isinstance(entry, str) else entry
    version = version.strip()
    if version and version not in engine.versions:
        raise UsageError(f"--engine {spec!r}: metrale has {engine.name} rules for "
                         f"{', '.join(engine.versions)} only")
    return engine


def options_of(engine: str, command: str) -> frozenset[str]:
    """The options `command` takes with --engine `engine` (a registered name or `metrale`)."""
    if engine == "metrale":
        return POOL_OPTIONS[command]
    return get_engine(engine).options[command]


# Each option a `given` mapping may hold -> the type of its value (None or False: not given), as
# the CLI hands them over: the library's callers are held to the same.
GIVEN_TYPES: dict[str, type] = {
    **dict.fromkeys(("--max-rank", "--max-loras", "--max-cpu-loras", "--tp", "--ep", "--align",
                     "--max-loaded-loras"), int),
    **dict.fromkeys(("--experts", "--fully-sharded", "--confirm"), bool),
    **dict.fromkeys(("--modules", "--dtype", "--lora-dtype", "--eviction-policy",
                     "--lora-backend", "--budget", "--engine-python", "--engine-args"), str),
    "--confirm-timeout": float,
}


def check_given(called: str, given: Mapping[str, object]) -> None:
    """A UsageError, naming `called`, for an option `given` cannot hold or a value of the wrong
    type (`{'--max-loras': 'x'}`), before any engine reads it."""
    from metrale_cli.arguments import describe_argument

    for name, value in given.items():
        kind = GIVEN_TYPES.get(name) if isinstance(name, str) else None
        if kind is None:
            raise UsageError(f"{called}: given holds {describe_argument(name)}, not an option "
                             f"name ({', '.join(GIVEN_TYPES)})")
        if value is None or value is False:
            continue
        fits = isinstance(value, (int, float) if kind is float else kind) and (
            kind is bool or not isinstance(value, bool))
        if not fits:
            raise UsageError(f"{called}: given[{name!r}] must be {kind.__name__}, got "
                             f"{describe_argument(value)}")


def refuse_other_options(engine: str, command: str, given: dict[str, object]) -> None:
    """Refuse, by name, options `command` does not take with `engine` (each named with the
    engines that take it): a flag that means nothing to the chosen engine is never dropped
    without a word."""
    named = [name for name, value in given.items() if value not in (None, False)]
    own = options_of(engine, command)
    foreign = [n for n in named if n not in own]
    if not foreign:
        return
    takers = [e for e in names() if e != engine and all(
        n in options_of(e, command) for n in foreign)]
    one = len(foreign) == 1
    where = (f"{'needs' if one else 'need'} --engine {' or '.join(takers)}" if takers else
             f"{'is not an option' if one else 'are not options'} of `{command}` with --engine "
             f"{engine}")
    raise UsageError(f"{', '.join(foreign)} {where}")
