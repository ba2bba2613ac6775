"""Public trace formats read from small hand-made files in their published layouts
(tests/data/traces/, see tests/data/PROVENANCE.md), and adapters attached where a trace names
none."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from metrale_cli.errors import FormatError, UsageError
from metrale_cli.sim.trace_formats import Assign, read_public_trace
from tests.support.cli_runner import metrale

TRACES = Path(__file__).parent / "data" / "traces"
SLOT = ["--model", "qwen3-8b", "--modules", "q_proj", "--max-rank", "8"]
ZIPF = Assign("zipf", adapters=4, seed=3)


def test_azure_llm_2023() -> None:
    w = read_public_trace(TRACES / "azure_llm_2023.csv", "azure-llm", ZIPF)
    # Sorted by time, relative to the first; 7 fraction digits kept to the float's precision.
    np.testing.assert_allclose(w.arrival, [0.0, 3.1265433, 3.8765434, 60.0], atol=1e-6)
    assert w.input_tokens.tolist() == [410, 1024, 380, 2048]
    assert w.output_tokens.tolist() == [52, 3, 97, 512]
    assert np.isnan(w.duration).all() and (w.adapter >= 0).all()
    assert w.source["format"] == "azure-llm" and w.source["assign"]["zipf_s"] == 1.5


def test_azure_llm_2024_with_zone() -> None:
    w = read_public_trace(TRACES / "azure_llm_2024.csv", "azure-llm", ZIPF)
    np.testing.assert_allclose(w.arrival, [0.0, 0.05, 1.5], atol=1e-9)
    assert w.input_tokens.tolist() == [2100, 1200, 4096]


@pytest.mark.parametrize("name,arrival,inputs,outputs", [
    ("burstgpt_v1.csv", [0, 34, 104, 115], [450, 1000, 400, 320], [20, 250, 300, 0]),
    ("burstgpt_v3.csv", [0, 1.75], [100, 50], [20, 40]),
])
def test_burstgpt(name: str, arrival: list[float], inputs: list[int],
                  outputs: list[int]) -> None:
    w = read_public_trace(TRACES / name, "burstgpt", Assign("uniform", adapters=2))
    np.testing.assert_allclose(w.arrival, arrival)
    assert w.input_tokens.tolist() == inputs and w.output_tokens.tolist() == outputs


def test_azure_functions_2021() -> None:
    """A function (app/func: a func id is unique only within its app) is the adapter; it
    arrives at end_timestamp - duration and holds its slot for duration."""
    w = read_public_trace(TRACES / "azure_functions_2021.csv", "azure-functions")
    names = [w.adapters[a] for a in w.adapter]
    assert names == ["aa11bb22cc33dd44/f00dfeed00000001", "ee55ff6600112233/f00dfeed00000002",
                     "4455667788990011/f00dfeed00000003", "aa11bb22cc33dd44/f00dfeed00000001",
                     "ee55ff6600112233/f00dfeed00000001"]
    # Starts: 6000.25, 6001.0625, 6009.5, 6029.5, 6020.75, sorted and from the first.
    np.testing.assert_allclose(w.arrival, [0.0, 0.8125, 9.25, 20.5, 29.25])
    np.testing.assert_allclose(w.duration, [0.25, 0.0625, 40.5, 42.0, 0.5])


def test_assign_is_seeded_and_follows_its_model() -> None:
    a = Assign("zipf", adapters=50, seed=7).draw(20_000)
    assert (a == Assign("zipf", adapters=50, seed=7).draw(20_000)).all()
    assert not (a == Assign("zipf", adapters=50, seed=8).draw(20_000)).all()
    share = np.bincount(a, minlength=50) / a.size
    want = 1 / np.arange(1, 51) ** 1.5
    np.testing.assert_allclose(share[:3], (want / want.sum())[:3], atol=0.01)
    u = np.bincount(Assign("uniform", adapters=4).draw(40_000)) / 40_000
    np.testing.assert_allclose(u, 0.25, atol=0.01)


def test_wrong_layouts_and_missing_assign(tmp_path: Path) -> None:
    with pytest.raises(FormatError, match=r"not the burstgpt layout: no Timestamp, Request "
                                          r"tokens, Response tokens column \(columns found: "
                                          r"'TIMESTAMP', 'ContextTokens', 'GeneratedTokens'\)"):
        read_public_trace(TRACES / "azure_llm_2023.csv", "burstgpt", ZIPF)
    with pytest.raises(UsageError, match="names no adapter: give --assign"):
        read_public_trace(TRACES / "burstgpt_v1.csv", "burstgpt")
    with pytest.raises(UsageError, match="names its adapters"):
        read_public_trace(TRACES / "azure_functions_2021.csv", "azure-functions", ZIPF)
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:47.5,1,2\n"
                   "yesterday,1,2\n")
    with pytest.raises(FormatError, match=r"bad\.csv:3: TIMESTAMP 'yesterday' is not a time"):
        read_public_trace(bad, "azure-llm", ZIPF)
    bad.write_text("Timestamp,Model,Request tokens,Response tokens\n1,x,2.5,3\n")
    with pytest.raises(FormatError, match=r"bad\.csv:2: Request tokens '2\.5' must be a whole"):
        read_public_trace(bad, "burstgpt", ZIPF)


def test_cli_trace_formats() -> None:
    r = metrale("simulate", *SLOT, "--trace", TRACES / "burstgpt_v1.csv", "--trace-format",
                "burstgpt", "--assign", "zipf:1.2", "--adapters", "3", "--seed", "1", "--json")
    assert r.code == 0, r.stderr
    rec = r.json()
    assert rec["workload"]["format"] == "burstgpt" and rec["workload"]["requests"] == 4
    assert rec["workload"]["assign"] == {"kind": "zipf", "adapters": 3, "seed": 1,
                                         "zipf_s": 1.2}
    r = metrale("simulate", *SLOT, "--trace", TRACES / "azure_functions_2021.csv",
                "--trace-format", "azure-functions", "--json")
    assert r.code == 0 and r.json()["workload"]["distinct_adapters"] == 4
    for args, message in (
            (["--trace-format", "burstgpt"], "names no adapter: give --assign"),
            (["--trace-format", "sharegpt", "--assign", "zipf"], "--trace-format must be one"),
            (["--trace-format", "burstgpt", "--assign", "pareto"], "'pareto' is not one of"),
            (["--trace-format", "burstgpt", "--assign", "zipf:x"], "zipf:S needs a number")):
        bad = metrale("simulate", *SLOT, "--trace", TRACES / "burstgpt_v1.csv", *args)
        assert bad.code == 2 and message in bad.stderr, (args, bad.stderr)
        assert len(bad.stderr.strip().splitlines()) == 1
    bad = metrale("simulate", *SLOT, "--assign", "zipf")
    assert bad.code == 2 and "--trace-format and --assign are for --trace" in bad.stderr
