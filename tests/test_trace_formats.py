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


ENGLISH = ["--model", "llama-3.1-8b", "--modules", "q_proj", "--max-rank", "16"]
HEADERS = {"azure-llm": "TIMESTAMP,ContextTokens,GeneratedTokens",
           "burstgpt": "Timestamp,Model,Request tokens,Response tokens",
           "azure-functions": "app,func,end_timestamp,duration"}
ROWS = {"azure-llm": "2023-11-16 18:15:47.5,{},2", "burstgpt": "1,x,{},3",
        "azure-functions": "a,f{},5,1"}


@pytest.mark.parametrize("fmt,name,head", [
    ("metrale", "bad.csv", "timestamp,adapter\n0,a\n"),
    ("metrale", "bad.jsonl", '{"timestamp": 0, "adapter": "a"}\n' * 2),
    *((fmt, "bad.csv", HEADERS[fmt] + "\n" + ROWS[fmt].format(1) + "\n") for fmt in HEADERS),
])
def test_bytes_that_are_not_utf8_name_the_file_and_line(tmp_path: Path, fmt: str, name: str,
                                                        head: str) -> None:
    """A byte that is not UTF-8 on line 3: one line naming the file and that line, exit 2, in
    every format, never an internal error."""
    path = tmp_path / name
    bad = {"metrale": b"1,ad\xe9\n" if name.endswith(".csv")
           else b'{"timestamp": 1, "adapter": "ad\xe9"}\n'}.get(fmt)
    row = bad if bad is not None else ROWS[fmt].format(7).encode().replace(b"7", b"\xe9") + b"\n"
    # Good rows after it: the text layer decodes a block ahead, past the line it reads.
    path.write_bytes(head.encode() + row + (head.splitlines()[-1] + "\n").encode() * 4000)
    args = ["--trace-format", fmt, *(["--assign", "zipf"] if fmt in ("azure-llm", "burstgpt")
                                     else [])]
    r = metrale("simulate", *ENGLISH, "--trace", path, *args)
    assert r.code == 2, r.stderr
    assert r.stderr.strip() == f"error: {path}:3: not UTF-8 text; a trace is UTF-8"


@pytest.mark.parametrize("fmt", ["azure-llm", "burstgpt"])
def test_token_counts_past_2_53_are_refused_naming_the_line(tmp_path: Path, fmt: str) -> None:
    """`1e19` tokens overflowed int64 (exit 70): refused as the default format refuses it."""
    path = tmp_path / "big.csv"
    path.write_text(f"{HEADERS[fmt]}\n{ROWS[fmt].format(5)}\n{ROWS[fmt].format('1e19')}\n")
    key = "ContextTokens" if fmt == "azure-llm" else "Request tokens"
    with pytest.raises(FormatError, match=rf"big\.csv:3: {key} '1e19' is not below 2\*\*53"):
        read_public_trace(path, fmt, ZIPF)
    path.write_text(f"{HEADERS[fmt]}\n{ROWS[fmt].format(2**53 - 1)}\n")
    assert read_public_trace(path, fmt, ZIPF).input_tokens.tolist() == [2**53 - 1]
    r = metrale("simulate", *ENGLISH, "--trace", path, "--trace-format", fmt, "--assign", "zipf")
    assert r.code == 0, r.stderr


@pytest.mark.parametrize("fmt", list(HEADERS))
def test_a_blank_line_before_a_bad_row_names_the_bad_rows_line(tmp_path: Path,
                                                               fmt: str) -> None:
    path = tmp_path / "gap.csv"
    bad = {"azure-llm": "2023-11-16 18:15:48,x,2", "burstgpt": "2,x,x,3",
           "azure-functions": "a,g,x,1"}[fmt]
    path.write_text(f"{HEADERS[fmt]}\n{ROWS[fmt].format(1)}\n\n{bad}\n")
    with pytest.raises(FormatError, match=r"gap\.csv:4: "):
        read_public_trace(path, fmt, ZIPF if fmt != "azure-functions" else None)


def test_azure_functions_starts_before_the_zero_are_shifted_not_clipped(tmp_path: Path) -> None:
    """a/f ends at 1 after 5 s: it started at -4, 7 s before a/g (3 - 1 = 2), and ended before
    a/g began; clipping its start to 0 made it hold its slot 0-5, over a/g's 2-3."""
    path = tmp_path / "func.csv"
    path.write_text("app,func,end_timestamp,duration\na,f,1,5\na,g,3,1\n")
    w = read_public_trace(path, "azure-functions")
    assert [w.adapters[a] for a in w.adapter] == ["a/f", "a/g"]
    np.testing.assert_allclose(w.arrival, [0.0, 6.0])
    np.testing.assert_allclose(w.arrival + w.duration, [5.0, 7.0])


def test_progress_ends_at_the_size_of_a_trace_with_a_byte_order_mark(tmp_path: Path) -> None:
    """The line reader counts what it decodes: a spreadsheet's byte-order mark is not, and
    neither were the extra bytes of a non-ASCII name, so the count ended short of the size."""
    p = tmp_path / "f.csv"
    p.write_text("\ufeffapp,func,end_timestamp,duration\nä,f,2.0,1.5\nä,g,3.0,0.5\n",
                 encoding="utf-8")
    seen: list[tuple[int, int]] = []
    w = read_public_trace(p, "azure-functions", progress=lambda done, total: seen.append(
        (done, total)))
    size = p.stat().st_size
    assert w.requests == 2 and seen[-1] == (size, size)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
