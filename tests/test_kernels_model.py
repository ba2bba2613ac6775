"""The roofline model of `metrale bench kernels --model-only`: no GPU, the launch plans the
kernels would get and the loads in flight their SASS is checked to keep."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from metrale_cli.bench import roofline
from metrale_cli.ops import costs, kernels, plans, sources
from tests.support.cli_runner import metrale

# Qwen3-Next-80B-A3B's benchmark modules (out_dim, in_dim): the bench's default shapes.
SHAPES = [("q_proj", 8192, 2048), ("k_proj", 512, 2048), ("v_proj", 512, 2048),
          ("o_proj", 2048, 4096), ("out_proj", 2048, 4096)]


class Recorder:
    """A kernels.Backend that keeps the launches it is given instead of running them."""

    def __init__(self, sms: int) -> None:
        self.sms = sms
        self.plans: list[plans.KernelLaunch] = []

    def launch(self, plan: plans.KernelLaunch) -> None:
        self.plans.append(plan)

    def new_t(self, like: Any, shape: tuple[int, ...]) -> Any:
        return np.empty(shape, dtype=np.float32)

    def workspace(self, like: Any, partials: int, tickets: int) -> tuple[Any, Any]:
        return np.empty(partials, dtype=np.float32), np.zeros(tickets, dtype=np.uint32)

    checks_tickets = False  # nothing runs: the counters stay as allocated

    def capturing(self) -> bool:
        return False

    def release_workspace(self) -> None:
        pass

    def array(self, like: Any, values: np.ndarray) -> Any:
        return np.ascontiguousarray(values)

    def placement(self, like: Any) -> str:
        return "numpy"

    def num_sms(self, requested: int | None) -> int:
        return self.sms if requested is None else requested


def planned(module: str, out_dim: int, in_dim: int, rank: int, tokens: int,
            adapters: int) -> list[plans.KernelLaunch]:
    """The launches the real launchers make for a benchmark shape (decode through plan_batch
    and kernels.bgmv, prefill through kernels.sgmv), on buffers of its real size (never
    touched: the recorder runs nothing)."""
    backend = Recorder(roofline.ModelDevice().sms)
    x = np.empty((tokens, in_dim), dtype=np.uint16)
    y = np.empty((tokens, out_dim), dtype=np.uint16)
    tables = [np.arange(1, adapters + 1, dtype=np.uint64) * np.uint64(1 << 20) for _ in "ab"]
    ranks = np.full(adapters, rank, dtype=np.int32)
    scales = np.ones(adapters, dtype=np.float32)
    if tokens <= 256:
        slots = roofline.decode_slots(tokens, adapters)
        batch = plans.plan_batch(slots, ranks, rank)
        kernels.bgmv(x, y, slots, *tables, scales, ranks, rank, batch=batch, backend=backend)
    else:
        starts = roofline.prefill_starts(tokens, adapters)
        kernels.sgmv(x, y, starts, np.arange(adapters, dtype=np.int32), *tables, scales, ranks,
                     rank, t_cols=rank, backend=backend)
    return backend.plans


# One shape per path, and the ranks across a 64-column tile.
PLANNED = [
    ("q_proj", 8192, 2048, 16, 256, 256),  # per-token
    ("q_proj", 8192, 2048, 64, 256, 1),  # grouped
    ("k_proj", 512, 2048, 128, 64, 8),  # grouped shrink, per-token expand
    ("o_proj", 2048, 4096, 64, 1, 1),  # one token
    ("q_proj", 8192, 2048, 128, 4096, 8),  # prefill segments
    ("k_proj", 512, 2048, 16, 512, 512),  # a segment per token
]


@pytest.mark.parametrize("shape", PLANNED, ids=lambda s: f"{s[0]}-r{s[3]}-T{s[4]}-D{s[5]}")
def test_the_model_s_inputs_are_the_launch_plan(shape: tuple[str, int, int, int, int, int]
                                                ) -> None:
    """What the model charges comes from the plan the launchers really make: kernel, grid and
    split count of both launches, and the SGMV work list its chunks come from."""
    module, out_dim, in_dim, rank, tokens, adapters = shape
    shrink, expand = planned(*shape)
    for kind, plan in (("shrink", shrink), ("expand", expand)):
        record = roofline.model_record(module, out_dim, in_dim, rank, tokens, adapters, kind)
        assert record["kernel"] == plan.kernel
        assert tuple(record["grid"]) == plan.grid
        if kind == "shrink":
            assert record["splits"] == plan.grid[2]  # split-K: the grid's z
        if plan.kernel.startswith("sgmv"):
            chunks = plan.args[2 if kind == "shrink" else 1]  # after x and its stride, or t
            assert chunks.shape == (plan.grid[1], 4)  # a CTA row per chunk
            rows = chunks[:, 1] - chunks[:, 0]
            assert int(rows.sum()) == tokens and int(rows.max()) <= sources.SGMV_TILE


@pytest.mark.parametrize(("rank", "tokens", "adapters", "path"), [
    (16, 1, 1, "per-token"), (64, 256, 256, "per-token"), (128, 8, 8, "per-token"),
    (16, 256, 8, "grouped"), (64, 64, 1, "grouped"), (128, 256, 1, "grouped"),
    (16, 4096, 8, "segments"), (64, 4096, 4096, "segments"), (128, 512, 1, "segments")])
def test_the_fused_model_is_the_fused_launch_plan(rank: int, tokens: int, adapters: int,
                                                  path: str) -> None:
    """A fused group's records are the two launches the fused launchers really make
    (kernels.bgmv_fused per token and on a grouped batch, kernels.sgmv_fused for prefill):
    kernel, grid (the SGMV shrink's column tiles over the slices' rank columns, the other
    slices on z), splits and work list; one launch floor per kernel instead of one per slice,
    and x's bytes once."""
    (slices, in_dim), = roofline.fused_groups(SHAPES)
    widths = [out for _, out in slices]
    backend = Recorder(roofline.ModelDevice().sms)
    cols = [0, *np.cumsum(widths).tolist()]
    tables = [np.arange(1, 3 * adapters + 1, dtype=np.uint64).reshape(3, adapters)
              << np.uint64(20) for _ in "ab"]
    x = np.empty((tokens, in_dim), dtype=np.uint16)
    y = np.empty((tokens, cols[-1]), dtype=np.uint16)
    ranks = np.full(adapters, rank, dtype=np.int32)
    pool = (np.ones(adapters, dtype=np.float32), ranks, rank)
    if path == "segments":
        kernels.sgmv_fused(x, y, cols, roofline.prefill_starts(tokens, adapters),
                           np.arange(adapters, dtype=np.int32), *tables, *pool, backend=backend)
    else:
        slots = roofline.decode_slots(tokens, adapters)
        batch = plans.plan_batch(slots, ranks, rank)
        assert batch.grouped == (path == "grouped")
        kernels.bgmv_fused(x, y, cols, slots, *tables, *pool, batch=batch, backend=backend)
    shrink, expand = backend.plans
    for kind, plan in (("shrink", shrink), ("expand", expand)):
        record = roofline.fused_record(slices, in_dim, rank, tokens, adapters, kind)
        assert record["kernel"] == plan.kernel and record["path"].startswith(path)
        assert tuple(record["grid"]) == plan.grid
        if plan.kernel == "sgmv_shrink":
            assert plan.grid[0] == -(-len(slices) * rank // sources.SGMV_TILE)
            assert record["splits"] == plan.grid[2]
        else:
            assert plan.grid[2] % len(slices) == 0
        if plan.kernel.startswith("sgmv"):
            chunks = plan.args[2 if kind == "shrink" else 1]
            assert plan.grid[1] == len(chunks)
        separate = [roofline.model_record(n, out, in_dim, rank, tokens, adapters, kind)
                    for n, out in slices]
        assert record["terms"]["launch"] <= max(r["terms"]["launch"] for r in separate)
        assert record["unfused_us"] == pytest.approx(sum(r["expected_us"] for r in separate))
        x_again = (len(slices) - 1) * 2 * tokens * in_dim if kind == "shrink" else 0
        assert record["bytes"] == sum(r["bytes"] for r in separate) - x_again
        assert record["expected_us"] <= record["unfused_us"]


def test_fusing_a_decode_token_s_qkv_saves_two_launch_floors_per_kernel() -> None:
    (slices, in_dim), = roofline.fused_groups(SHAPES)
    for kind in ("shrink", "expand"):
        record = roofline.fused_record(slices, in_dim, 16, 1, 1, kind)
        assert record["binding"] == "launch"
        assert record["expected_us"] == pytest.approx(2.0)
        assert record["unfused_us"] == pytest.approx(6.0)


def test_fused_rank_16_qkv_reads_a_chunk_s_x_once() -> None:
    """Prefill's fused shrink at rank 16: q, k and v are 48 rank columns, one column tile, so
    the shrink asks L2 for x once where the three unfused shrinks ask for it three times."""
    (slices, in_dim), = roofline.fused_groups(SHAPES)
    record = roofline.fused_record(slices, in_dim, 16, 4096, 8, "shrink")
    separate = [roofline.model_record(n, out, in_dim, 16, 4096, 8, "shrink")
                for n, out in slices]
    x_bytes = 2 * 4096 * in_dim
    assert record["grid"][0] == 1

    def partials(r: dict, columns: int) -> int:
        # What its split-K partials move (a rank-16 tile stores 2 of its 8 column groups, the
        # fused 48-column tile all 8): apart from the x, A and t reads compared here.
        return costs.split_partial_bytes("sgmv", r["grid"][0] * r["grid"][1], r["splits"],
                                         columns)

    reads = (sum(r["l2_bytes"] - partials(r, 16) for r in separate)
             - (record["l2_bytes"] - partials(record, 48)))
    assert reads >= 2 * x_bytes


def test_every_record_is_at_least_its_largest_term() -> None:
    records = roofline.model(SHAPES)
    device = roofline.ModelDevice()
    for r in records:
        terms = r["terms"]
        assert set(roofline.TERMS) <= set(terms)
        assert r["expected_us"] >= max(terms.values()) - 1e-9, r
        assert r["expected_us"] >= device.launch_s * 1e6
        assert r["l2_bytes"] >= r["bytes"] - 4 * r["tokens"] * r["rank"] * r["splits"]
        assert r["binding"] in roofline.TERMS
        streamed = terms["in_flight"] + terms["serial"]
        largest = max(max(terms.values()), streamed)
        named = streamed if r["binding"] in ("in_flight", "serial") else terms[r["binding"]]
        assert named == pytest.approx(largest), r
    assert {"per-token", "grouped", "segments", "grouped+per-token"} <= {r["path"] for r in records}
    # Rotation groups are capped at 64: what they read at T = 1 and rank 16 fits in the 50 MiB
    # L2, so a measurement there reads L2.
    assert all(r["l2_resident"] for r in records if r["tokens"] == 1 and r["rank"] == 16)
    assert not all(r["l2_resident"] for r in records if r["tokens"] == 1)
    for r in records:
        assert r["l2_resident"] == (r["rotation_groups"] * r["bytes"] <= device.l2_bytes)


def test_l2_traffic_is_charged_and_steers_the_grouped_expand() -> None:
    # The per-token expand of a grouped batch reads B once per token from L2: q_proj, 64 tokens
    # on one rank-64 adapter, 64 x 8192 x 64 x 2 bytes, at least 6.7 us at 10 TB/s. The
    # planner (costs.grouped_expand) charges that and keeps the SGMV expand, which reads B
    # once per 64-token tile.
    per_token = costs.expand_cost_us("bgmv", 64, 8192, 64, 1, 132)
    assert per_token >= 64 * 8192 * 64 * 2 / 10e6
    record = roofline.model_record("q_proj", 8192, 2048, 64, 64, 1, "expand")
    assert record["path"] == "grouped" and record["kernel"] == "sgmv_expand_bf16"
    assert record["expected_us"] < per_token
    # Where it does take the per-token path (rank 16 over 8 adapters: 1,024 SGMV CTAs of one
    # pass each are 3 waves, the 512 per-token CTAs one), its L2 bytes are charged as such.
    narrow = roofline.model_record("q_proj", 8192, 2048, 16, 64, 8, "expand")
    assert narrow["path"] == "grouped+per-token"
    assert narrow["l2_bytes"] >= 64 * 8192 * 16 * 2
    assert narrow["terms"]["l2"] == pytest.approx(narrow["l2_bytes"] / 10e12 * 1e6)
    assert narrow["expected_us"] >= narrow["terms"]["l2"]


def _expand_load_sectors(out_dim: int, rank: int, max_rank: int) -> int:
    """The 32-byte sectors bgmv_expand's B loads ask for, enumerated load by load from the
    kernel's mapping (kernels/bgmv.cu, expand_rows): warp load s of warp w in a pass at row r0
    reads, for each lane, row r0 + w * G + s * 4 G + lane / L (clamped into the CTA) at vector
    min(lane % L, vecs - 1), with L lanes per row and G = 32 / L rows per load."""
    vecs = -(-rank // 8)
    lanes = costs.lanes_per_row(rank)
    groups = 32 // lanes
    steps = sources.CONFIG["BGMV_EXPAND_STEPS"]
    total = 0
    for o0 in range(0, out_dim, costs.EXPAND_CTA_ROWS):
        rows = min(costs.EXPAND_CTA_ROWS, out_dim - o0)
        for r0 in range(0, rows, steps * 4 * groups):
            for warp in range(4):
                for s in range(steps):
                    sectors = set()
                    for lane in range(32):
                        row = min(r0 + warp * groups + s * 4 * groups + lane // lanes, rows - 1)
                        at = (o0 + row) * 2 * max_rank + 16 * min(lane % lanes, vecs - 1)
                        sectors.add(at // 32)
                    # A load whose rows all lie past the CTA's re-reads its last row: the same
                    # sectors as the load that read it, asked for again only if it is another.
                    first = r0 + warp * groups + s * 4 * groups
                    total += len(sectors) if first < rows else 0
    return total


@pytest.mark.parametrize(("out_dim", "rank", "max_rank"),
                         [(512, 64, 64), (1096, 128, 128), (200, 8, 8), (72, 40, 48),
                          (136, 24, 24), (520, 16, 64), (64, 131, 136), (2048, 72, 256)])
def test_the_expand_s_b_sectors_are_its_loads(out_dim: int, rank: int, max_rank: int) -> None:
    """The L2 term charges the sectors the coalesced expand's loads touch: the rank prefixes'
    bytes when the rank fills B's row pitch, a sector per row and load past it."""
    sectors = roofline.expand_b_sectors(out_dim, rank, max_rank)
    assert sectors == _expand_load_sectors(out_dim, rank, max_rank)
    if rank == max_rank and rank % 16 == 0:
        assert sectors * 32 == out_dim * rank * 2


def test_the_expand_s_passes_are_its_lane_groups() -> None:
    # A pass is 16 rows per thread: 16 x 128 / L rows of the CTA, L lanes per row.
    assert [costs.lanes_per_row(r) for r in (8, 16, 24, 64, 72, 128, 131, 256)] == [
        1, 2, 4, 8, 16, 16, 32, 32]
    assert costs.expand_cta_passes(1024, 64) == 4
    assert costs.expand_cta_passes(512, 64) == 2  # k_proj: every thread works, in half the passes
    assert costs.expand_cta_passes(1024, 256) == 16
    assert costs.expand_cta_passes(72, 16) == 1
    record = roofline.model_record("k_proj", 512, 2048, 128, 64, 64, "expand")
    assert record["kernel"].startswith("bgmv_expand") and record["passes"] == 64 * 4


def test_distinct_bytes_in_flight_bound_a_segment_per_token() -> None:
    # Prefill, one adapter per token: a CTA per one-token chunk, its 3-stage pipeline holding
    # one x row and the 16 rank rows of A per K tile: 3 x 17 x 128 bytes a CTA, 3 CTAs an SM,
    # about the 19 KiB per SM that Little's law asks for (when a CTA walked 64 one-row
    # segments, one pass each: under 8 KiB, and 22% of peak).
    record = roofline.model_record("q_proj", 8192, 2048, 16, 4096, 4096, "shrink")
    assert record["path"] == "segments" and record["grid"] == [1, 4096, 1]
    # (32 K tiles are 11 passes of 3, the last of 2: a pass's average is a little short of 3.)
    assert record["in_flight_per_sm_bytes"] == pytest.approx(3 * 3 * 17 * 128, rel=0.04)
    assert record["in_flight_per_sm_bytes"] > 0.9 * record["needed_in_flight_per_sm_bytes"]
    assert record["expected_pct_peak"] > 70
    # The expand: a CTA per (one-token chunk, 64 outputs) would move one 2 KiB B tile after its
    # two metadata round trips (16% of peak); the planner gives each CTA 32 output tiles,
    # streamed through its 2 stages, so the metadata is paid once per 32 tiles. Its 2 stages of
    # 2 KiB B tiles still hold under the 19 KiB per SM: the distinct bytes in flight bind, in
    # whole waves (16,384 uniform CTAs are 41.4 waves of 396, run as 42).
    expand = roofline.model_record("q_proj", 8192, 2048, 16, 4096, 4096, "expand")
    assert expand["grid"] == [128 // 32, 4096, 1]
    assert expand["binding"] == "tail"
    streamed = expand["terms"]["in_flight"] + expand["terms"]["serial"]
    assert streamed < expand["terms"]["tail"] < 1.03 * streamed
    assert expand["in_flight_per_sm_bytes"] < expand["needed_in_flight_per_sm_bytes"]
    assert 50 < expand["expected_pct_peak"] < 70


def test_no_kernel_beats_the_launch_floor() -> None:
    record = roofline.model_record("o_proj", 2048, 4096, 16, 1, 1, "shrink")
    assert record["binding"] == "launch" and record["expected_us"] == pytest.approx(2.0)
    assert record["expected_copy_ratio"] == pytest.approx(1.0)


def test_a_serial_kernel_misses_by_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    # One load in flight per thread (the pre-restructuring bgmv_shrink) starves the memory.
    record = roofline.model_record("o_proj", 2048, 4096, 64, 256, 256, "shrink")
    assert record["meets_target"] and record["regime"] == "bandwidth"
    monkeypatch.setitem(sources.CONFIG, "BGMV_SHRINK_LOADS", 1)
    serial = roofline.model_record("o_proj", 2048, 4096, 64, 256, 256, "shrink")
    assert not serial["meets_target"] and serial["binding"] in ("in_flight", "tail")
    assert serial["expected_pct_peak"] < 0.6 * record["expected_pct_peak"]


def test_model_plans_grids_from_the_rank_not_a_larger_pool() -> None:
    record = roofline.model_record("q_proj", 8192, 2048, 16, 64, 64, "shrink")
    assert record["grid"][1] == 16 // sources.SHRINK_ROWS


def test_model_only_needs_no_gpu() -> None:
    result = metrale("bench", "kernels", "--model-only", "--tokens", "256", "--rank", "16",
                     "--modules", "q_proj", "--json")
    assert result.code == 0, result.stderr
    records = result.json()["records"]
    assert [r["adapters"] for r in records] == [1, 1, 8, 8, 256, 256]
    assert all(r["binding"] in roofline.TERMS and "l2_bytes" in r for r in records)


def model_table(tokens: int) -> str:
    """The markdown table docs/benchmarks.md shows for `tokens` (regenerate it with
    `python -m tests.test_kernels_model`)."""
    rows = ["| module | r | D | shrink: path, us, binding term, % peak, x copy | "
            "expand: path, us, binding term, % peak, x copy | MB (shrink + expand) | "
            "L2 MB (shrink + expand) |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    records = roofline.model(SHAPES, tokens=(tokens,))
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
            cells.append(f"{r['path']}, {r['expected_us']:.1f}, {r['binding']}, {pct}, {ratio}"
                         + ("" if r["meets_target"] else " (misses)"))
        megabytes = f"{shrink['bytes'] / 1e6:.1f} + {expand['bytes'] / 1e6:.1f}"
        l2 = f"{shrink['l2_bytes'] / 1e6:.1f} + {expand['l2_bytes'] / 1e6:.1f}"
        rows.append(f"| {shrink['module']} | {shrink['rank']} | {shrink['adapters']} | "
                    f"{cells[0]} | {cells[1]} | {megabytes} | {l2} |")
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


@pytest.mark.parametrize(("out_dim", "rank", "out_tiles"),
                         [(8192, 16, 32), (8192, 64, 1), (512, 128, 8), (4096, 256, 3)])
def test_the_expand_planner_charges_the_model_s_passes(out_dim: int, rank: int,
                                                       out_tiles: int) -> None:
    """costs.sgmv_expand_stream_us (what expand_out_tiles and grouped_expand choose on) charges
    a CTA the round trips roofline._sgmv_work counts for it: ceil(items / SGMV_EXPAND_STAGES),
    y adding none (tests/test_kernels_sass.py holds the kernel to that: no pipeline iteration
    waits on a load of its own), plus its 2 metadata round trips."""
    grid = plans.launch_grid("sgmv_expand_bf16", 1, out_dim, rank, out_tiles=out_tiles)
    work = roofline._sgmv_work("expand", grid, np.array([[0, 1, 0, 0]]), 1, rank, 64, out_dim,
                               1, 2, out_tiles=out_tiles)
    items = min(out_tiles, -(-out_dim // 64)) * -(-rank // 64)
    assert work[3] == -(-items // sources.SGMV_EXPAND_STAGES)
    expected = work[3] * costs._DRAM_LATENCY_US + work[4] * costs._L2_LATENCY_US
    assert costs.sgmv_expand_stream_us(1, out_dim, rank, out_tiles, 132) == pytest.approx(
        expected)


# --- what the hardware runs: whole waves, the splits that have K ----------------------------------


def test_a_grid_of_uniform_ctas_is_priced_in_whole_waves() -> None:
    """1.3 waves of identical CTAs run as two: the tail term charges ceil(waves) CTA times,
    where `in_flight` spreads the passes over the resident slots (1.3 of them)."""
    device = roofline.ModelDevice()
    resident = device.sms * sources.min_ctas_per_sm("sgmv_shrink")
    for waves, whole in ((1.3, 2), (2.6, 3), (1.0, 1)):
        ctas = round(waves * resident)
        work = roofline.LaunchWork("sgmv_shrink", "segments", (1, ctas, 1), 1, 10**6,
                                   passes=4 * ctas, chains=2 * ctas, cta_passes=4, cta_chains=2)
        record = roofline.cost_terms(work, 10**6, device)
        cta_us = record["terms"]["critical_path"]
        assert record["terms"]["tail"] == pytest.approx(whole * cta_us)
        assert record["expected_us"] >= whole * cta_us - 1e-9
        streamed = record["terms"]["in_flight"] + record["terms"]["serial"]
        assert streamed == pytest.approx(ctas / resident * cta_us)
        if whole > waves:
            assert record["binding"] == "tail"
    # CTAs that differ (one heavier than the rest) get no tail term: the wave count says
    # nothing of when the heavy one runs.
    work = roofline.LaunchWork("sgmv_shrink", "segments", (1, 500, 1), 1, 10**6, passes=501,
                               chains=1000, cta_passes=2, cta_chains=2)
    assert roofline.cost_terms(work, 10**6, device)["terms"]["tail"] == 0


def test_the_split_reduction_is_priced_on_the_splits_that_run() -> None:
    """K 4096 in 12 splits of 64-column chunks: k_chunk (384) leaves the 12th without K, so 11
    splits store partials and the last CTA reads 11 (SGMV_SPLITS_PER_TRIP at a time at rank
    16, then the rest one a round trip): the model and the planner price those."""
    lengths = roofline._split_lengths(4096, 12, sources.SGMV_TILE)
    assert int((lengths > 0).sum()) == 11
    chunks = np.array([[0, 8, 0, 0]])
    grid = plans.launch_grid("sgmv_shrink", 1, 4096, 16, 12)
    work = roofline._sgmv_work("shrink", grid, chunks, 8, 16, 4096, 0, 12, 2)
    assert work[4] == 2 + costs.split_reduction_round_trips("sgmv", 11, 16)
    assert costs.split_reduction_round_trips("sgmv", 11, 16) != (
        costs.split_reduction_round_trips("sgmv", 12, 16))
    partials = costs.split_partial_bytes("sgmv", 1, 11, 16)
    assert partials == 2 * 4 * 11 * 64 * 16  # rank 16: 2 of a tile's 8 column groups stored
    assert work[0] == 2 * 4096 * (8 + 16) + 4 * 8 * 16 + partials
    planned = costs.shrink_cost_us("sgmv", 8, 4096, 16, 12, 132, 1)
    stream = -(-costs.k_chunk(4096, 12, 64) // (sources.SGMV_SHRINK_STAGES * 64)) * 0.6 + 0.6
    assert planned == pytest.approx(stream + 0.3 * costs.split_reduction_round_trips(
        "sgmv", 11, 16) + partials / 10e6)
