"""The audit of an adapter's config on hostile input: values that are not finite or not whole,
regexes that are invalid, backtrack without end or are too large to match in time, long name
lists matched as PEFT matches them, and the rank inspect says a slot is padded to, and why."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from metrale_cli.adapters import patterns
from tests.support.cli_runner import Result, metrale
from tests.support.hostile_inputs import CATASTROPHIC, copy_adapter, run_cli, strict_json


@pytest.mark.parametrize("field,value,named", [
    ("lora_alpha", math.nan, "'lora_alpha'"),
    ("lora_alpha", math.inf, "'lora_alpha'"),
    ("r", math.nan, "'r'"),
    ("r", math.inf, "'r'"),
    ("r", 2.5, "'r'"),
    ("alpha_pattern", {"q_proj": math.inf}, "alpha_pattern['q_proj']"),
    ("rank_pattern", {"q_proj": math.nan}, "rank_pattern['q_proj']"),
    ("rank_pattern", {"q_proj": 1.5}, "rank_pattern['q_proj']"),
    # Finite, but a scale the pool's float32 tables cannot hold (it became Infinity there).
    ("lora_alpha", 1e300, "'lora_alpha'"),
    ("alpha_pattern", {"q_proj": 1e-30}, "alpha_pattern"),
])
def test_non_finite_config_values_are_audit_errors(
    tiny: Path, tmp_path: Path, field: str, value: object, named: str
) -> None:
    bad = copy_adapter(tiny / "a", tmp_path / "bad", **{field: value})
    result = metrale("inspect", bad, "--model", tiny, "--json")
    assert result.code == 1, result.stderr
    doc = strict_json(result.stdout)
    findings = doc["adapters"][0]["findings"]
    assert any(f["code"] == "bad_config_value" and named in f["message"] for f in findings)
    view = metrale("inspect", bad, "--model", tiny)
    assert view.code == 1 and "bad_config_value" in view.stdout, view.stderr
    packed = metrale("pack", bad, "--model", tiny, "--max-loras", 2, "--json")
    # A refusal prints its record under --json, strict JSON even for a NaN alpha.
    assert packed.code == 1 and strict_json(packed.stdout)["adapters"][0]["servable"] is False


@pytest.mark.proc
def test_nested_star_regexes_finish_at_once(tiny: Path, tmp_path: Path) -> None:
    """`(.*.*)*z` once ran past 20 s in `re`; matched through `regex`, it finishes at once."""
    bad = copy_adapter(tiny / "a", tmp_path / "slow", target_modules="(.*.*)*z",
                       rank_pattern={"(.*.*.*.*.*.*.*.*.*.*)*z": 2})
    start = time.monotonic()
    done = run_cli("inspect", bad, "--model", tiny, "--json", timeout=60)
    assert done.returncode == 0 and time.monotonic() - start < 20, done.stderr
    codes = {f["code"] for f in json.loads(done.stdout)["adapters"][0]["findings"]}
    assert "unexplained_key" in codes


@pytest.mark.parametrize("field,value", [
    ("target_modules", CATASTROPHIC),
    ("rank_pattern", {CATASTROPHIC: 2}),
    ("alpha_pattern", {CATASTROPHIC: 4}),
    ("exclude_modules", CATASTROPHIC),
])
def test_catastrophic_regex_is_an_error_not_a_hang(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, field: str, value: object
) -> None:
    monkeypatch.setattr(patterns, "AUDIT_SECONDS", 0.2)
    bad = copy_adapter(tiny / "a", tmp_path / "slow", **{field: value})
    start = time.monotonic()
    result = metrale("inspect", bad, "--model", tiny, "--json")
    assert time.monotonic() - start < 5
    assert result.code == 1, result.stderr
    findings = result.json()["adapters"][0]["findings"]
    errors = [f for f in findings if f["severity"] == "error"]
    assert [f["code"] for f in errors] == ["slow_pattern"] and field in errors[0]["message"]
    assert result.json()["adapters"][0]["modules"] == []


@pytest.mark.parametrize("field,value", [
    ("target_modules", "("),
    ("modules_to_save", ["("]),
    ("layers_pattern", "("),
    ("exclude_modules", "(["),
    ("rank_pattern", {"(": 2}),
])
def test_invalid_regex_is_not_servable(tiny: Path, tmp_path: Path, field: str, value: object
                                       ) -> None:
    config: dict[str, object] = {field: value}
    if field == "layers_pattern":
        config["layers_to_transform"] = [0, 1]
    bad = copy_adapter(tiny / "a", tmp_path / "bad", **config)
    result = metrale("inspect", bad, "--model", tiny, "--json")
    assert result.code == 1, result.stderr
    findings = result.json()["adapters"][0]["findings"]
    assert any(f["code"] == "bad_pattern" and f["message"].startswith(field) for f in findings)


def large_pattern_errors(result: Result) -> list[str]:
    assert result.code == 1, result.stderr
    adapter = result.json()["adapters"][0]
    assert adapter["modules"] == []
    return [f["message"] for f in adapter["findings"] if f["code"] == "large_pattern"]


@pytest.mark.parametrize("field,value,says", [
    ("target_modules", "(" + "|".join(f"model.layers.{i}.self_attn.q_proj"
                                      for i in range(200_000)) + ")",
     "the config's regexes (target_modules) hold 7,288,891 characters"),
    ("rank_pattern", {f"layers.{i}.q_proj": 2 for i in range(patterns.MAX_PATTERNS + 1)},
     f"the config holds {patterns.MAX_PATTERNS + 1:,} regexes (rank_pattern)"),
    ("target_modules", [f"layers.{i}.q_proj" for i in range(patterns.MAX_NAMES + 1)],
     f"target_modules lists {patterns.MAX_NAMES + 1:,} names"),
])
def test_patterns_are_bounded_by_size_not_by_time(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, field: str, value: object,
    says: str
) -> None:
    # No time bound to run into: the refusal is by size, the same on any machine under any load.
    monkeypatch.setattr(patterns, "AUDIT_SECONDS", 1e9)
    compiled: list[str] = []
    monkeypatch.setattr(patterns, "compile_error", lambda p: compiled.append(p))
    bad = copy_adapter(tiny / "a", tmp_path / "large", **{field: value})
    errors = large_pattern_errors(metrale("inspect", bad, "--model", tiny, "--json"))
    assert len(errors) == 1 and says in errors[0], errors
    assert compiled == []


def test_a_long_name_list_within_the_bound_matches_as_peft_does(tiny: Path,
                                                                 tmp_path: Path) -> None:
    # Matched by looking up a path's dotted suffixes in a set, no longer name by name.
    names = [f"layers.{i}.mlp.gate_proj" for i in range(patterns.MAX_NAMES - 3)]
    # A dotted suffix matches, a bare last part matches, a part of a name does not.
    names += ["self_attn.q_proj", "k_proj", "_proj"]
    adapter = copy_adapter(tiny / "a", tmp_path / "long", target_modules=names)
    result = metrale("inspect", adapter, "--model", tiny, "--json")
    assert result.code == 0, result.stderr
    unexplained = {f["message"].split()[0] for f in result.json()["adapters"][0]["findings"]
                   if f["code"] == "unexplained_key"}
    assert unexplained == {"o_proj", "v_proj", "out_proj"}


def test_inspect_says_which_rank_the_slot_uses_and_why(tiny: Path) -> None:
    def slot_line(*args: object) -> str:
        result = metrale("inspect", tiny / "a", "--model", tiny, *args, columns=200)
        return next(line for line in result.stdout.splitlines() if "slot  " in line)

    assert "at rank 2: its own rank, above --max-rank 1 (refused)" in slot_line("--max-rank", 1)
    assert "at rank 16: --max-rank 16 (its rank is 2)" in slot_line("--max-rank", 16)
    assert "at rank 8: its rank 2 rounded up to a multiple of 8 (the kernels')" in slot_line()
