"""The roofline model of `metrale bench kernels --model-only`: no GPU, the launch plans the
kernels would get and the loads in flight their SASS is checked to keep."""

from __future__ import annotations

import json

import pytest

from metrale_cli.bench import kernels as bench_kernels
from metrale_cli.ops import kernels
from tests.support.cli_runner import metrale

# Qwen3-Next-80B-A3B's benchmark modules (out_dim, in_dim): the bench's default shapes.
SHAPES = [("q_proj", 8192, 2048), ("k_proj", 512, 2048), ("v_proj", 512, 2048),
          ("o_proj", 2048, 4096), ("out_proj", 2048, 4096)]


def test_decode_at_256_tokens_and_prefill_at_4096_meet_the_targets() -> None:
    records = bench_kernels.model(SHAPES, tokens=(256, 4096))
    # ranks x token counts x adapter counts x kinds
    assert len(records) == len(SHAPES) * 3 * 2 * 3 * 2
    missed = [(r["kernel"], r["module"], r["rank"], r["tokens"], r["adapters"])
              for r in records if not r["meets_target"]]
    assert not missed
    paths = {r["path"] for r in records}
    assert {"per-token", "grouped", "segments", "grouped+per-token"} <= paths


def test_little_s_law_turns_loads_in_flight_into_bandwidth() -> None:
    # Every token its own rank-16 adapter, q_proj shrink: 1024 CTAs, 6 resident per SM.
    record = bench_kernels.model_record("q_proj", 8192, 2048, 16, 256, 256, "shrink")
    assert record["kernel"] == "bgmv_shrink" and record["path"] == "per-token"
    assert record["grid"] == [256, 4, 1]
    per_cta = kernels.loads_in_flight("bgmv_shrink") * 16 * kernels.THREADS
    assert record["in_flight_per_sm_bytes"] == kernels.min_ctas_per_sm("bgmv_shrink") * per_cta
    assert record["in_flight_per_sm_bytes"] >= record["needed_in_flight_per_sm_bytes"]
    assert record["little_pct_peak"] == pytest.approx(100 * 4.3 / 4.8)


def test_a_serial_kernel_misses_by_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    # One load in flight per thread (the pre-restructuring bgmv_shrink) starves the memory.
    record = bench_kernels.model_record("o_proj", 2048, 4096, 64, 256, 256, "shrink")
    assert record["meets_target"] and record["regime"] == "bandwidth"
    monkeypatch.setitem(kernels.CONFIG, "BGMV_SHRINK_LOADS", 1)
    serial = bench_kernels.model_record("o_proj", 2048, 4096, 64, 256, 256, "shrink")
    assert not serial["meets_target"]
    assert serial["expected_pct_peak"] < 0.6 * record["expected_pct_peak"]


def test_model_plans_grids_from_the_rank_not_a_larger_pool() -> None:
    record = bench_kernels.model_record("q_proj", 8192, 2048, 16, 64, 64, "shrink")
    assert record["grid"][1] == 16 // kernels.SHRINK_ROWS


def test_model_only_needs_no_gpu() -> None:
    result = metrale("bench", "kernels", "--model-only", "--tokens", "256", "--rank", "16",
                     "--modules", "q_proj", "--json")
    assert result.code == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["adapters"] for r in records] == [1, 1, 8, 8, 256, 256]
    assert all(r["meets_target"] for r in records)


def model_table(tokens: int) -> str:
    """The markdown table docs/benchmarks.md shows for `tokens` (regenerate it with
    `python -m tests.test_kernels_model`)."""
    rows = ["| module | r | D | shrink: path, CTAs, KiB/SM in flight, % peak, x copy | "
            "expand: path, CTAs, KiB/SM in flight, % peak, x copy | MB (shrink + expand) |",
            "| --- | --- | --- | --- | --- | --- |"]
    records = bench_kernels.model(SHAPES, tokens=(tokens,))
    for shrink, expand in zip(records[::2], records[1::2], strict=True):
        # The figure a shape is judged by is in bold: % of peak in the bandwidth regime, the
        # copy ratio below it.
        cells = []
        for r in (shrink, expand):
            pct, ratio = f"{r['expected_pct_peak']:.1f}", f"{r['expected_copy_ratio']:.2f}"
            if r["regime"] == "bandwidth":
                pct = f"**{pct}**"
            else:
                ratio = f"**{ratio}**"
            cells.append(f"{r['path']}, {r['ctas']}, {r['in_flight_per_sm_bytes'] / 1024:.1f}, "
                         f"{pct}, {ratio}" + ("" if r["meets_target"] else " (misses)"))
        megabytes = f"{shrink['bytes'] / 1e6:.1f} + {expand['bytes'] / 1e6:.1f}"
        rows.append(f"| {shrink['module']} | {shrink['rank']} | {shrink['adapters']} | "
                    f"{cells[0]} | {cells[1]} | {megabytes} |")
    return "\n".join(rows) + "\n"


@pytest.mark.parametrize("tokens", [256, 4096])
def test_docs_show_the_model_as_it_is(tokens: int) -> None:
    from pathlib import Path

    docs = (Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md").read_text()
    assert model_table(tokens) in docs, (
        "docs/benchmarks.md's model table is stale: python -m tests.test_kernels_model")


if __name__ == "__main__":
    for count in (256, 4096):
        print(f"T = {count}\n\n{model_table(count)}")
