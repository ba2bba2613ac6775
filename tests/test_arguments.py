"""Every public function of `metrale_cli.__all__` refuses an argument of the wrong type with a
UsageError naming the argument and what it takes (15 calls once raised a bare
TypeError or AttributeError, `resolve_model(None)` "'NoneType' object has no attribute
'strip'")."""

from __future__ import annotations

import dataclasses
import inspect
import os
from pathlib import Path
from typing import Any

import pytest

import metrale_cli
from metrale_cli.arguments import checked
from metrale_cli.errors import UsageError

FUNCTIONS = sorted(n for n in metrale_cli.__all__
                   if inspect.isfunction(getattr(metrale_cli, n)))


class Wrong:
    """A value of no type any annotation asks for."""


def test_the_api_has_functions() -> None:
    assert {"resolve_model", "load_adapters", "plan_pool", "pack_pool", "unpack",
            "read_trace", "simulate"} <= set(FUNCTIONS)


@pytest.mark.parametrize("name", FUNCTIONS)
def test_every_argument_of_the_wrong_type_is_named(name: str) -> None:
    fn = getattr(metrale_cli, name)
    parameters = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    assert parameters, name
    for parameter in parameters:
        with pytest.raises(UsageError) as caught:
            fn(**{parameter.name: Wrong()})
        message = str(caught.value)
        assert message.startswith(f"{name}: {parameter.name} must be "), message
        assert ", got Wrong <" in message, message


@pytest.mark.parametrize(("call", "says"), [
    (lambda: metrale_cli.resolve_model(None), "resolve_model: spec must be str, got None"),
    (lambda: metrale_cli.load_adapters("chat"),
     "load_adapters: args must be Sequence of str, got str 'chat'"),
    (lambda: metrale_cli.kernel_max_rank(True), "kernel_max_rank: rank must be int, got bool"),
    (lambda: metrale_cli.unpack("pool.safetensors", "out", slot="0"),
     "unpack: slot must be int or None, got str '0'"),
    (lambda: metrale_cli.show_image(3), "show_image: path must be str or Path, got int 3"),
])
def test_the_reported_cases(call: Any, says: str) -> None:
    with pytest.raises(UsageError, match="^" + says.replace("(", r"\(")):
        call()


def _planned() -> Any:
    return metrale_cli.plan_pool([], "llama-3.1-8b", modules=[metrale_cli.LoraModule.Q_PROJ],
                                 max_rank=8)


def _audited() -> Any:
    return metrale_cli.audit_adapters([], "llama-3.1-8b")


# The classes and methods the API exports get the functions' check, and their own values are
# checked as the CLI checks its options: each of these raised a bare TypeError or
# AttributeError, ran 22 s into a MemoryError, or wrote a config with NaN.
@pytest.mark.parametrize(("call", "says"), [
    (lambda: metrale_cli.PoolImage.open(123), "PoolImage.open: path must be str or Path, got "
     "int 123"),
    (lambda: metrale_cli.PoolImage.open(None), "PoolImage.open: path must be str or Path, got "
     "None"),
    (lambda: metrale_cli.SlotManager("4"), "SlotManager: max_loras must be int, got str '4'"),
    (lambda: metrale_cli.SlotManager(4).acquire_slot(None), "slot must be int, got None"),
    (lambda: metrale_cli.SlotManager(4).release_slot("0"), "slot must be int, got str '0'"),
    (lambda: metrale_cli.SlotManager(10**12), "max_loras 1,000,000,000,000 is more slots than "
     "a slot manager holds (at most 1,048,576)"),
    (lambda: metrale_cli.LoraPool(None, 2), "LoraPool: layout must be SlotLayout, got None"),
    (lambda: metrale_cli.generate(metrale_cli.GeneratorSpec("zipf", 10, seed=float("nan"))),
     "GeneratorSpec: seed must be int, got float nan"),
    (lambda: metrale_cli.engine_inspect(_audited(), metrale_cli.get_engine("vllm"),
                                        {"--max-loras": "x"}),
     "engine_inspect: given['--max-loras'] must be int, got str 'x'"),
    (lambda: metrale_cli.engine_layout(_audited(), metrale_cli.get_engine("sglang"),
                                       {"--max-loras": True}),
     "engine_layout: given['--max-loras'] must be int, got bool True"),
    (lambda: metrale_cli.engine_inspect(_audited(), metrale_cli.get_engine("vllm"),
                                        {"--max-lora-rank": 8}),
     "engine_inspect: given holds str '--max-lora-rank', not an option name"),
    (lambda: metrale_cli.synth_adapter("/nonexistent/a", metrale_cli.resolve_model(
        "llama-3.1-8b"), "llama-3.1-8b", [metrale_cli.LoraModule.Q_PROJ], 8, alpha=float("nan")),
     "--alpha must be a positive finite number, got nan"),
    (lambda: metrale_cli.SlotLayout.build(metrale_cli.resolve_model("llama-3.1-8b"),
                                          "q_proj,v_proj", max_rank=16),
     "SlotLayout.build: modules must be list of LoraModule or tuple of LoraModule, got str "
     "'q_proj,v_proj'"),
    (lambda: _planned().sized(budget_bytes="40GiB"), "PlannedPool.sized: budget_bytes must be "
     "int or None, got str '40GiB'"),
    (lambda: _planned().sharded(metrale_cli.ShardSpec(2), max_loras="2"),
     "PlannedPool.sharded: max_loras must be int or None, got str '2'"),
])
def test_the_classes_reported_cases(call: Any, says: str) -> None:
    with pytest.raises(UsageError) as caught:
        call()
    assert str(caught.value).startswith(says), str(caught.value)


# The dataclasses a caller builds and hands in: each field given is checked as it is made.
SPECS = {"ShardSpec": (2,), "PoolPlan": (None,), "GeneratorSpec": ("zipf", 10), "Targets": ()}


@pytest.mark.parametrize("name", SPECS)
def test_every_field_of_the_wrong_type_is_named(name: str) -> None:
    """`ShardSpec(None)`, `GeneratorSpec("zipf", None)`, `PoolPlan("x")`: a TypeError from a
    comparison, an AttributeError, or a NumPy error deep in `generate`, before."""
    cls = getattr(metrale_cli, name)
    for field in dataclasses.fields(cls):
        with pytest.raises(UsageError) as caught:
            cls(**{field.name: Wrong()})
        message = str(caught.value)
        assert message.startswith(f"{name}: {field.name} must be "), message
    assert str(metrale_cli.ShardSpec(2)) == ("ShardSpec(tp_size=2, tp_rank=0, ep_size=1, "
                                            "fully_sharded=False)")


# Methods of the pool and the slot manager with what a wrong argument did before.
@pytest.mark.parametrize(("call", "says"), [
    # A bare AttributeError, from deep in the swap.
    (lambda pool, slots: pool.swap_in(0, None),
     "LoraPool.swap_in: report must be AdapterReport, got None"),
    (lambda pool, slots: pool.land_slot(0, "pool", 0),
     "LoraPool.land_slot: source must be SlotSource, got str 'pool'"),
    # -1 read the last entry's table, "c" the B tables: an address, and no error.
    (lambda pool, slots: pool.table_address(-1), "entry -1 is out of range [0, 2)"),
    (lambda pool, slots: pool.table_address(0, "c"), "which must be 'a' or 'b', got 'c'"),
    (lambda pool, slots: slots.routed_prefill_slot(None), "adapter_slot must be int, got None"),
    (lambda pool, slots: slots.adapter_id_for_slot("0"), "slot must be int, got str '0'"),
    (lambda pool, slots: slots.slot_of(["a"]), "name must be str, got list ['a']"),
    (lambda pool, slots: slots.load_pinned(None),
     "SlotManager.load_pinned: infos must be list of AdapterSlot, got None"),
])
def test_the_pools_and_slot_managers_methods_check_their_arguments(call: Any,
                                                                   says: str) -> None:
    model = metrale_cli.resolve_model("llama-3.1-8b")
    layout = metrale_cli.SlotLayout.build(dataclasses.replace(model, num_hidden_layers=2),
                                          [metrale_cli.LoraModule.Q_PROJ], 8)
    with pytest.raises(UsageError) as caught:
        call(metrale_cli.LoraPool(layout, 2), metrale_cli.SlotManager(4))
    assert str(caught.value) == says


def test_right_types_pass_through() -> None:
    assert metrale_cli.kernel_max_rank(16) >= 16
    assert metrale_cli.resolve_model("qwen3-8b").model_type == "qwen3"


def test_containers_are_checked_with_their_elements() -> None:
    def f(names: list[str], pair: tuple[int, str], table: dict[str, int],
          path: Path | None = None, flag: bool = False) -> None:
        return None

    g = checked(f)
    g(["a"], (1, "x"), {"a": 1}, Path("p"), True)
    for kwargs, bad in (({"names": ["a", 2]}, "names"), ({"pair": (1, 2)}, "pair"),
                        ({"table": {"a": "1"}}, "table"), ({"path": 3}, "path"),
                        ({"flag": 1}, "flag")):
        args = {"names": ["a"], "pair": (1, "x"), "table": {"a": 1}} | kwargs
        with pytest.raises(UsageError, match=f"^f: {bad} must be"):
            g(**args)


class PathLike(os.PathLike):
    """A path as a caller's own type may carry one (not a `Path`)."""

    def __init__(self, path: str | bytes) -> None:
        self.path = path

    def __fspath__(self) -> str | bytes:
        return self.path


def test_a_path_argument_takes_a_str_or_a_path_like_and_gets_a_path(tmp_path: Path) -> None:
    # The check followed the annotations strictly: `read_trace("t.csv")` was "path must be
    # Path, got str" although the function converts it on its first line.
    trace = tmp_path / "t.csv"
    trace.write_text("timestamp,adapter\n0,a\n1,b\n")
    for given in (str(trace), PathLike(str(trace)), trace):
        assert metrale_cli.read_trace(given).adapters == ("a", "b")
    seen: list[Any] = []

    def f(path: Path, out: Path | None = None, name: str | Path = "x") -> None:
        seen.append((path, out, name))

    g = checked(f)
    g("a", out=PathLike("b"), name="c")
    g(PathLike("a"), None, PathLike("c"))
    assert seen == [(Path("a"), Path("b"), "c"), (Path("a"), None, Path("c"))]
    assert all(isinstance(p, Path) for p in (seen[0][0], seen[0][1], seen[1][2]))
    for bad, named in ((3, "int 3"), (b"a", "bytes b'a'"), (None, "None")):
        with pytest.raises(UsageError, match=f"^f: path must be str or Path, got {named}"):
            g(bad)
    with pytest.raises(UsageError, match="^f: out must be str or Path or None, got PathLike "):
        g("a", out=PathLike(b"b"))
    with pytest.raises(UsageError, match="^read_trace: path must be str or Path, got int 3$"):
        metrale_cli.read_trace(3)
