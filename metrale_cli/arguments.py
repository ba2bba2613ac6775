"""The library's argument check: every public function of `metrale_cli.__all__` is handed out
wrapped by `checked`, which compares each argument with the function's own annotation before
the call, so that `resolve_model(None)` is a UsageError naming `spec` and what it takes, not an
AttributeError from deep inside. One mechanism, read from the signatures: nothing to keep in
step with them by hand.

Annotations are resolved on the first call (the modules use `from __future__ import
annotations`; a name imported only for type checking leaves that parameter unchecked).
Containers are checked with their elements, a Protocol by its members; a TypeVar and `Any`
accept anything;
`bool` is not accepted where `int` or `float` is asked for. An argument annotated `Path` also
takes a `str` or any `os.PathLike` naming a path, and the function is handed a `Path` (Python
callers pass strings); anything else is still refused.
"""

from __future__ import annotations

import collections.abc
import functools
import inspect
import os
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from metrale_cli.errors import UsageError

F = TypeVar("F", bound=Callable[..., Any])
C = TypeVar("C")
_UNCHECKED = object()


def checked(fn: F, public_name: str | None = None) -> F:
    """`fn`, checking its arguments' types against its annotations (UsageError on a wrong
    one, naming the function by `public_name`, its own name by default)."""
    signature = inspect.signature(fn)
    called = public_name or fn.__name__
    hints: dict[str, Any] = {}

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not hints:
            hints.update(_hints(fn, signature))
        try:  # the arguments given are checked even where others are missing
            bound = signature.bind_partial(*args, **kwargs)
        except TypeError as exc:
            raise UsageError(f"{called}: {exc}") from None
        for name, value in bound.arguments.items():
            hint = hints.get(name, _UNCHECKED)
            kind = signature.parameters[name].kind
            if hint is _UNCHECKED or kind in (inspect.Parameter.VAR_POSITIONAL,
                                              inspect.Parameter.VAR_KEYWORD):
                continue
            value = bound.arguments[name] = _as_path(value, hint)
            if not _matches(value, hint):
                raise UsageError(f"{called}: {name} must be {_describe(hint)}, got "
                                 f"{_kind_of(value)}")
        try:
            signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise UsageError(f"{called}: {exc}") from None
        return fn(*bound.args, **bound.kwargs)

    return wrapper  # type: ignore[return-value]


def checked_as(public_name: str) -> Callable[[F], F]:
    """`checked` as a decorator, for the constructor, class methods and methods of a class the
    API exports (`@checked_as("SlotManager")` on `__init__`): the same check as the functions',
    named as the caller wrote it. Not for a method on a hot path (about 30 us a call)."""
    return lambda fn: checked(fn, public_name)


def checked_fields(public_name: str) -> Callable[[type[C]], type[C]]:
    """`checked` on the constructor of a dataclass the API exports (`@checked_fields("ShardSpec")`
    above `@dataclass`): every field given is compared with its annotation before the
    dataclass's own `__post_init__` reads it, so `ShardSpec(None)` is a UsageError naming
    `tp_size`, not a TypeError from a comparison."""
    def wrap(cls: type[C]) -> type[C]:
        cls.__init__ = checked(cls.__init__, public_name)  # type: ignore[misc]
        return cls
    return wrap


def describe_argument(value: Any) -> str:
    """`value` as the check's messages show a wrong argument: `str '4'`, `None`."""
    return _kind_of(value)


def _hints(fn: Callable[..., Any], signature: inspect.Signature) -> dict[str, Any]:
    """Each parameter's annotation resolved in `fn`'s module; one that cannot be (a name only
    imported for type checking) is left out, so unchecked."""
    namespace = getattr(inspect.unwrap(fn), "__globals__", {})
    resolved: dict[str, Any] = {}
    for name, parameter in signature.parameters.items():
        annotation = parameter.annotation
        if annotation is inspect.Parameter.empty:
            continue
        if isinstance(annotation, str):
            try:
                annotation = eval(annotation, dict(namespace))  # the module's own names
            except Exception:  # noqa: BLE001 - an unresolvable annotation is not checked
                continue
        resolved[name] = annotation
    return resolved


def _as_path(value: Any, hint: Any) -> Any:
    """`value` as a `Path` where `hint` asks for one and `value` names a path some other way
    (a `str` where `str` itself is not asked for, or another `os.PathLike`); else `value`."""
    members = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union,
                                                                 types.UnionType) else (hint,)
    if Path not in members or isinstance(value, Path) or (isinstance(value, str)
                                                          and str in members):
        return value
    if isinstance(value, str) or (isinstance(value, os.PathLike)
                                  and isinstance(_fspath(value), str)):
        return Path(value)
    return value


def _fspath(value: os.PathLike[Any]) -> Any:
    try:
        return os.fspath(value)
    except Exception:  # noqa: BLE001 - a broken __fspath__ names no path; refused as it is
        return None


def _matches(value: Any, hint: Any) -> bool:
    if hint is Any or hint is object or isinstance(hint, TypeVar):
        return True
    if hint is None or hint is type(None):
        return value is None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in args)
    if origin is typing.Literal:
        return value in args
    if origin is collections.abc.Callable or hint is collections.abc.Callable:
        return callable(value)
    if origin is not None:
        if not isinstance(origin, type):
            return True  # a special form this check does not read
        # A string is a sequence of strings: never what a list of names asks for.
        if not isinstance(value, origin) or isinstance(value, (str, bytes)):
            return False
        if not args:
            return True
        if origin is tuple:
            if len(args) == 2 and args[1] is Ellipsis:
                return all(_matches(v, args[0]) for v in value)
            return len(value) == len(args) and all(map(_matches, value, args))
        if issubclass(origin, collections.abc.Mapping):
            return all(_matches(k, args[0]) and _matches(v, args[1]) for k, v in value.items())
        if issubclass(origin, collections.abc.Iterable) and len(args) == 1:
            return all(_matches(v, args[0]) for v in value)
        return True
    if not isinstance(hint, type):
        return True
    if getattr(hint, "_is_protocol", False):
        # A protocol's members, as a structural isinstance would look for them.
        members = {n for n in vars(hint) if not n.startswith("_")}
        members |= set(getattr(hint, "__annotations__", {}))
        return all(hasattr(value, m) for m in members)
    if hint in (int, float) and isinstance(value, bool):
        return False
    if hint is float:
        return isinstance(value, (int, float))
    return isinstance(value, hint)


def _describe(hint: Any) -> str:
    """A type as a user reads it: `str`, `str or Path or None`, `list of LoraModule`; a `Path`
    is named with the `str` it also takes."""
    if hint is None or hint is type(None):
        return "None"
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if Path in args and str in args:
            args = tuple(a for a in args if a is not str)
        return " or ".join(_describe(a) for a in args)
    if hint is Path:
        return "str or Path"
    if origin is typing.Literal:
        return " or ".join(repr(a) for a in args)
    if origin is not None and args:
        return f"{getattr(origin, '__name__', str(origin))} of {_describe(args[0])}"
    return getattr(hint, "__name__", str(hint))


def _kind_of(value: Any) -> str:
    return "None" if value is None else f"{type(value).__name__} {_shown(value)}"


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
