"""Tensor- and expert-parallel sharding rules and per-rank layouts (docs/tensor-parallel.md)."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from metrale_cli.adapters.experts import ExpertProj
from metrale_cli.errors import NotServable, UsageError
from metrale_cli.layout.expert_layout import ExpertLayout
from metrale_cli.layout.sharding import (
    RankExpertLayout,
    RankLayout,
    ShardedPlan,
    ShardSpec,
    Slice,
    check_model_split,
    expert_slice,
    module_slice,
    owns_expert,
    rank_layouts,
    refuse_unshardable,
)
from metrale_cli.layout.slot_layout import SlotLayout
from metrale_cli.model.config import ModelConfig
from metrale_cli.model.modules import LoraModule
from tests.support.cli_runner import metrale
from tests.support.hostile_inputs import one_line_error

ATTN = [LoraModule(m) for m in ("q_proj", "k_proj", "v_proj", "o_proj", "out_proj")]
NEXT = ModelConfig.preset("qwen3-next-80b-a3b")


def next_layout(max_rank: int = 16) -> SlotLayout:
    return SlotLayout.build(NEXT, ATTN, max_rank)


@pytest.mark.parametrize(("tp", "fully", "slot_bytes"), [
    (1, False, 15_335_424), (2, False, 10_420_224), (4, False, 8_060_928),
    (8, False, 6_881_280), (4, True, 3_932_160),
])
def test_qwen3_next_figures(tp: int, fully: bool, slot_bytes: int) -> None:
    """Qwen3-Next's slot bytes per GPU at each TP size (docs/tensor-parallel.md's table), the
    same on every rank."""
    layout = next_layout()
    ranks = [RankLayout.of(layout, ShardSpec(tp, k, 1, fully)) for k in range(tp)]
    assert [r.slot_bytes for r in ranks] == [slot_bytes] * tp
    fingerprints = {r.fingerprint for r in ranks}
    if tp == 1:  # the unsharded bytes: the unsharded fingerprint
        assert fingerprints == {layout.fingerprint}
        return
    # Each rank has its own fingerprint, and none is the unsharded one.
    assert len(fingerprints) == tp and layout.fingerprint not in fingerprints


def test_unsharded_layout_record_is_untouched() -> None:
    layout = next_layout()
    assert layout.fingerprint == "e3298e5b193f86eb1f4fe085e95b4dff"
    assert "shard" not in layout.record()
    assert all("slice" not in e for e in layout.record()["entries"])


def test_column_row_and_fully_sharded_slices() -> None:
    spec = ShardSpec(4, 1)
    h, attn = NEXT.hidden_size, NEXT.num_attention_heads * NEXT.head_dim
    value = NEXT.linear_value_width
    q, o, out = (2 * attn, h), (h, attn), (h, value)
    # Gated q_proj: 2 * 16 * 256 rows, a quarter each: 4 whole heads with their gates.
    assert module_slice(NEXT, LoraModule.Q_PROJ, 3, spec, 16) == Slice(q, ((2048, 4096),), (0, h))
    assert module_slice(NEXT, LoraModule.O_PROJ, 3, spec, 16) == Slice(o, ((0, h),), (1024, 2048))
    assert module_slice(NEXT, LoraModule.OUT_PROJ, 0, spec, 16) == Slice(
        out, ((0, h),), (value // 4, value // 2))
    fully = ShardSpec(4, 3, fully_sharded=True)
    assert module_slice(NEXT, LoraModule.Q_PROJ, 3, fully, 16) == Slice(
        q, ((3 * 2 * attn // 4, 2 * attn),), (0, h), (12, 16))
    assert module_slice(NEXT, LoraModule.O_PROJ, 3, fully, 16) == Slice(
        o, ((3 * h // 4, h),), (3 * attn // 4, attn))


def test_a_module_is_sliced_at_each_layer_s_own_width() -> None:
    """DeepSeek-V2-Lite: gate_proj is the dense MLP's (10944 rows) on layer 0 and the two
    shared experts' (2 * 1408) on the MoE layers; each splits its own rows (down_proj its own
    columns) over the ranks."""
    lite = ModelConfig.preset("deepseek-v2-lite")
    layout = SlotLayout.build(lite, [LoraModule.GATE_PROJ, LoraModule.DOWN_PROJ], 16)
    rank = RankLayout.of(layout, ShardSpec(2, 1))
    got = {(e.layer, e.module.value): (e.slice.rows, e.slice.cols) for e in rank.entries
           if e.layer < 2}
    assert got == {(0, "gate_proj"): (((5472, 10944),), (0, 2048)),
                   (0, "down_proj"): (((0, 2048),), (5472, 10944)),
                   (1, "gate_proj"): (((1408, 2816),), (0, 2048)),
                   (1, "down_proj"): (((0, 2048),), (1408, 2816))}


@pytest.mark.parametrize(("tp", "heads"), [(2, [0, 1]), (4, [0, 0, 1, 1]),
                                           (8, [0, 0, 0, 0, 1, 1, 1, 1])])
def test_fewer_kv_heads_than_ranks(tp: int, heads: list[int]) -> None:
    """Qwen3-Next has 2 KV heads of 256: rank k holds head k // (tp / 2)."""
    for k, head in enumerate(heads):
        for module in (LoraModule.K_PROJ, LoraModule.V_PROJ):
            s = module_slice(NEXT, module, 3, ShardSpec(tp, k), 16)
            assert s.rows == ((head * 256, (head + 1) * 256),)


def test_counts_that_do_not_split_are_refused() -> None:
    cfg = dataclasses.replace(NEXT, num_key_value_heads=3)
    with pytest.raises(UsageError, match="3 KV heads neither split over --tp 4"):
        module_slice(cfg, LoraModule.K_PROJ, 3, ShardSpec(4, 0), 16)
    with pytest.raises(UsageError, match=r"q_proj heads \(each with its gate\) \(16\) does not "
                                         "split over --tp 32"):
        module_slice(NEXT, LoraModule.Q_PROJ, 3, ShardSpec(32, 0), 16)
    with pytest.raises(UsageError, match="max rank .12. does not split over --tp 8"):
        RankLayout.of(next_layout(12), ShardSpec(8, 0, fully_sharded=True)).entries  # noqa: B018
    with pytest.raises(UsageError, match="--ep with --fully-sharded is refused"):
        ShardSpec(4, 0, 2, True)
    with pytest.raises(UsageError, match="--ep 3 does not divide --tp 4"):
        ShardSpec(4, 0, 3)
    with pytest.raises(UsageError, match=r"routed experts \(512\) does not split over --ep 3"):
        owns_expert(NEXT, ShardSpec(6, 0, 3), 7)


def test_experts_by_moe_tp_and_ep() -> None:
    """TP 4 with EP 2: MoE TP 2; ranks 0-1 hold experts [0, 256), ranks 2-3 [256, 512), each
    expert's intermediate split in two; the router is on every rank, whole."""
    inter, h = NEXT.expert_intermediate_size, NEXT.hidden_size
    specs = [ShardSpec(4, k, 2) for k in range(4)]
    assert [(s.ep_rank, s.moe_tp_rank) for s in specs] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [owns_expert(NEXT, s, 300) for s in specs] == [False, False, True, True]
    assert all(owns_expert(NEXT, s, -1) for s in specs)
    assert expert_slice(NEXT, ExpertProj.UP_PROJ, specs[1], 16) == Slice(
        (inter, h), ((inter // 2, inter),), (0, h))
    assert expert_slice(NEXT, ExpertProj.DOWN_PROJ, specs[3], 16) == Slice(
        (h, inter), ((0, h),), (inter // 2, inter))
    assert expert_slice(NEXT, ExpertProj.ROUTER, specs[3], 16) == Slice(
        (NEXT.num_experts, h), ((0, NEXT.num_experts),), (0, h))
    full = ExpertLayout.for_model(NEXT, 16)
    ranked = RankExpertLayout.of(full, specs[2])
    experts = {e.expert for e in ranked.entries if e.proj is not ExpertProj.ROUTER}
    assert experts == set(range(256, 512))
    assert sum(e.proj is ExpertProj.ROUTER for e in ranked.entries) == len(NEXT.moe_layers)
    assert ranked.fingerprint != RankExpertLayout.of(full, specs[3]).fingerprint


def test_rank_entries_record_slices_and_are_laid_out_like_a_slot() -> None:
    ranked = RankLayout.of(next_layout(), ShardSpec(4, 2, fully_sharded=True))
    record = ranked.record(4)
    assert record["shard"] == {"tp_size": 4, "tp_rank": 2, "ep_size": 1, "ep_rank": 0,
                               "fully_sharded": True}
    q = next(e for e in record["entries"] if e["module"] == "q_proj")
    assert q["slice"] == {"full": [8192, 2048], "rows": [4096, 6144], "cols": [0, 2048],
                          "ranks": [8, 12]}
    end = 0
    for e in ranked.entries:
        assert e.a_offset % 256 == 0 and e.b_offset == e.a_offset + e.a_bytes
        assert e.a_offset >= end
        end = e.b_offset + e.b_bytes
    assert ranked.slot_bytes == end


def test_budget_is_per_gpu() -> None:
    layout = next_layout()
    plan = ShardedPlan.sized(layout, None, ShardSpec(4), budget_bytes=40 * 2**30)
    per_slot = plan.ranks[0].bytes_per_slot
    assert plan.plan.max_loras == 40 * 2**30 // per_slot
    record = plan.record()
    assert (record["tp_size"], record["ep_size"], record["fully_sharded"]) == (4, 1, False)
    [group] = record["rank_layouts"]
    assert group["ranks"] == [0, 1, 2, 3] and group["slot_bytes"] == 8_060_928
    assert len(set(group["fingerprints"])) == 4
    assert record["slot_bytes"] == 15_335_424


# -- fused projections (phi3's qkv_proj, phi3's and glm4's gate_up_proj) --------------------------

PHI4 = ModelConfig.preset("phi-4-mini")  # 24 query heads, 8 KV heads of 128, I 8192
# THUDM/GLM-4-9B-0414's config.json: 32 query heads, 2 KV heads of 128, I 13696.
GLM4 = ModelConfig.from_dict({"model_type": "glm4", "hidden_size": 4096, "num_hidden_layers": 40,
                              "num_attention_heads": 32, "num_key_value_heads": 2,
                              "head_dim": 128, "intermediate_size": 13696,
                              "vocab_size": 151552}, "glm-4-9b")
PHI_MODULES = [LoraModule(m) for m in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")]
GLM_MODULES = [LoraModule(m) for m in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj",
                                       "down_proj")]
FUSED_CASES = [(PHI4, PHI_MODULES, tp) for tp in (2, 4, 8)] + [
    (dataclasses.replace(PHI4, num_key_value_heads=2), PHI_MODULES, 4),  # a KV head per 2 ranks
    *((GLM4, GLM_MODULES, tp) for tp in (2, 4))]


def _pair_bytes(out: int, in_: int, a_rows: int, max_rank: int) -> int:
    """A `[a_rows, in]` then B `[out, max_rank]`, BF16, each region 256-byte aligned."""
    return (-(-a_rows * in_ * 2 // 256) * 256) + (-(-out * max_rank * 2 // 256) * 256)


@pytest.mark.parametrize("fully", [False, True])
@pytest.mark.parametrize(("model", "modules", "tp"), FUSED_CASES)
def test_fused_per_rank_bytes_by_hand(model: ModelConfig, modules: list[LoraModule], tp: int,
                                      fully: bool) -> None:
    """Per rank and layer: qkv_proj B holds q/N rows and, of k and v each, kv/N heads (one
    head when there are fewer KV heads than ranks), A whole (rank rows R/N fully sharded);
    gate_up_proj B 2I/N rows; o_proj and down_proj A input columns / N, B whole (output rows /
    N fully sharded). Every rank alike."""
    r = 16
    h, hd, inter = model.hidden_size, model.head_dim, model.intermediate_size
    q, kv = model.num_attention_heads * hd, model.num_key_value_heads
    kv_rows = kv * hd // tp if kv >= tp else hd
    col_a = r // tp if fully else r
    row_out = h // tp if fully else h
    per_module = {
        "qkv_proj": _pair_bytes(q // tp + 2 * kv_rows, h, col_a, r),
        "q_proj": _pair_bytes(q // tp, h, col_a, r),
        "k_proj": _pair_bytes(kv_rows, h, col_a, r),
        "v_proj": _pair_bytes(kv_rows, h, col_a, r),
        "o_proj": _pair_bytes(row_out, q // tp, r, r),
        "gate_up_proj": _pair_bytes(2 * inter // tp, h, col_a, r),
        "down_proj": _pair_bytes(row_out, inter // tp, r, r),
    }
    want = model.num_hidden_layers * sum(per_module[m.value] for m in modules)
    layout = SlotLayout.build(model, modules, r)
    plan = ShardedPlan.sized(layout, None, ShardSpec(tp, 0, 1, fully), max_loras=3)
    assert [p.layout.slot_bytes for p in plan.ranks] == [want] * tp
    [group] = plan.record()["rank_layouts"]
    assert group["ranks"] == list(range(tp)) and group["slot_bytes"] == want
    assert len(set(group["fingerprints"])) == tp  # every rank holds its own rows


@pytest.mark.parametrize(("model", "modules", "tp"), FUSED_CASES)
def test_fused_rows_are_each_slice_s_torch_chunk(model: ModelConfig, modules: list[LoraModule],
                                                 tp: int) -> None:
    """A rank's B rows of a fused projection are, slice after slice, the rows torch.chunk of
    that slice gives the rank (k and v chunked by KV head and shared by tp / kv ranks when
    there are fewer KV heads than ranks); over the ranks every row is held, each as often as
    its slice is replicated; A is whole on every rank."""
    kv = model.num_key_value_heads
    for module in (m for m in modules if m.declared(model, 0).fused):
        out_dim, in_dim = module.dims(model, 0)
        widths = module.slices(model, 0)
        held = torch.zeros(out_dim, dtype=torch.int64)
        for k in range(tp):
            s = module_slice(model, module, 0, ShardSpec(tp, k), 16)
            assert s.full == (out_dim, in_dim) and s.cols == (0, in_dim) and s.ranks is None
            rows = torch.cat([torch.arange(lo, hi) for lo, hi in s.rows])
            want = []
            for i, piece in enumerate(torch.arange(out_dim).split(list(widths))):
                is_kv = module is LoraModule.QKV_PROJ and i > 0
                if is_kv and kv < tp:
                    want.append(piece.chunk(kv)[k // (tp // kv)])
                else:
                    want.append(piece.chunk(tp)[k])
            assert torch.equal(rows, torch.cat(want)), (module, k)
            held[rows] += 1
            entries = [e for e in RankLayout.of(SlotLayout.build(model, modules, 16),
                                                ShardSpec(tp, k)).entries
                       if e.module is module]
            assert {(e.out_dim, e.in_dim, e.a_rows) for e in entries} == {(len(rows), in_dim,
                                                                            16)}
        copies = torch.ones(out_dim, dtype=torch.int64)
        if module is LoraModule.QKV_PROJ and kv < tp:
            copies[widths[0]:] = tp // kv
        assert torch.equal(held, copies), module


def test_fused_slices_record_their_runs_and_tp_1_is_whole() -> None:
    """A rank's qkv_proj records its three runs; gate_up_proj its two; at --tp 1 a fused
    projection is one run, the unsharded bytes and fingerprint."""
    q, kv = 24 * 128, 8 * 128
    ranked = RankLayout.of(SlotLayout.build(PHI4, PHI_MODULES, 16), ShardSpec(4, 1))
    record = {e["module"]: e["slice"] for e in ranked.record()["entries"] if e["layer"] == 0}
    assert record["qkv_proj"] == {"full": [q + 2 * kv, 3072],
                                  "rows": [[q // 4, q // 2], [q + kv // 4, q + kv // 2],
                                           [q + kv + kv // 4, q + kv + kv // 2]],
                                  "cols": [0, 3072]}
    assert record["gate_up_proj"]["rows"] == [[2048, 4096], [8192 + 2048, 8192 + 4096]]
    layout = SlotLayout.build(PHI4, PHI_MODULES, 16)
    for fully in (False, True):
        assert RankLayout.of(layout, ShardSpec(1, 0, 1, fully)).fingerprint == layout.fingerprint
    assert module_slice(PHI4, LoraModule.QKV_PROJ, 0, ShardSpec(1), 16).rows == ((0, q + 2 * kv),)
    # docs/tensor-parallel.md's example and figures are these.
    text = " ".join((Path(__file__).parents[1] / "docs" / "tensor-parallel.md").read_text().split())
    assert f'"rows": {json.dumps(record["qkv_proj"]["rows"])}' in text
    assert (f"{layout.slot_bytes:,} B unsharded, "
            f"{RankLayout.of(layout, ShardSpec(4)).slot_bytes:,} B at TP 4") in text


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_fused_rank_bytes_are_what_vllm_allocates(tp: int) -> None:
    """Phi-4-mini per GPU: vLLM's phi3 LoRA buffers (QKVParallelLinearWithLoRA and, over the
    merged gate_up, ColumnParallelLinearWithLoRA: one `[R, in]` A and the rank's B rows each)
    as `layout --engine vllm` sizes them are a metrale rank's slot to the byte (every region
    here is a multiple of the 256-byte alignment)."""
    args = ("layout", "-m", "phi-4-mini", "--modules", "qkv_proj,o_proj,gate_up_proj,down_proj",
            "--max-rank", 16, "--tp", tp, "--max-loras", 1, "--json")
    ours, vllm = metrale(*args), metrale(*args, "--engine", "vllm")
    assert ours.code == vllm.code == 0, (ours.stderr, vllm.stderr)
    assert {g["slot_bytes"] for g in ours.json()["rank_layouts"]} == {
        vllm.json()["engine"]["slot_bytes"]}


@pytest.mark.parametrize(("model", "modules", "extra_a"), [
    # Phi-4-mini: vLLM's one slice per fused layer is metrale's A; SGLang stacks a fused A
    # once per slice (lora.py normalize_qkv_proj, normalize_gate_up_proj): 2 more on qkv, 1
    # more on gate_up.
    ("phi-4-mini", "qkv_proj,o_proj,gate_up_proj,down_proj", {"vllm": 0, "sglang": 3}),
    # GLM-4: both engines pack gate_up_proj from gate/up, one A per slice (vLLM's
    # MergedColumnParallelLinearWithLoRA, SGLang's stacked buffer), where metrale keeps the
    # checkpoint's one fused A.
    ("glm-4", "qkv_proj,o_proj,gate_up_proj,down_proj", {"vllm": 1, "sglang": 1}),
])
def test_fused_rank_bytes_against_both_engines_at_tp_2(tmp_path: Path, model: str, modules: str,
                                                       extra_a: dict[str, int]) -> None:
    """At --tp 2 each engine's slot is a metrale rank's slot plus the A copies it stacks per
    slice (`[R, hidden]` each, A is whole on every rank); the B rows, split over TP, agree."""
    config = PHI4 if model == "phi-4-mini" else GLM4
    if model == "glm-4":
        (tmp_path / "config.json").write_text(json.dumps(
            {"model_type": "glm4", "architectures": ["Glm4ForCausalLM"], "hidden_size": 4096,
             "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 2,
             "head_dim": 128, "intermediate_size": 13696, "vocab_size": 151552}))
        model = str(tmp_path)
    ours_modules = modules if config is PHI4 else "q_proj,k_proj,v_proj,o_proj," + \
        modules.split(",", 2)[2]
    args = ("-m", model, "--max-rank", 16, "--tp", 2, "--max-loras", 1, "--json")
    ours = metrale("layout", "--modules", ours_modules, *args)
    assert ours.code == 0, ours.stderr
    [rank_slot] = {g["slot_bytes"] for g in ours.json()["rank_layouts"]}
    for engine, extra in extra_a.items():
        got = metrale("layout", "--engine", engine, "--modules", modules, *args,
                      "--dtype", "bfloat16")
        assert got.code == 0, got.stderr
        a = 16 * config.hidden_size * 2  # one A [R, hidden], BF16
        assert got.json()["engine"]["slot_bytes"] == rank_slot + config.num_hidden_layers * \
            extra * a, engine


@pytest.mark.parametrize(("args", "message"), [
    (("-m", "phi-4-mini", "--tp", 5), "phi-4-mini: query heads (24) do not split over --tp 5"),
    (("-m", "phi-4-mini", "--tp", 16), "phi-4-mini: query heads (24) do not split over --tp 16"),
    (("-m", "phi-4-mini", "--tp", 3), "phi-4-mini: KV heads (8) do not split over --tp 3"),
])
def test_fused_heads_that_do_not_split_are_one_line(args: tuple[object, ...],
                                                    message: str) -> None:
    result = metrale("layout", *args, "--modules", "qkv_proj,gate_up_proj", "--max-rank", 16)
    assert result.code == 2, result.stdout
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"error: {message}"), line


def test_fused_slice_refuses_kv_heads_that_neither_split_nor_divide() -> None:
    """module_slice on its own (a rank image names its shard) refuses as the unfused
    k_proj does, naming the fused slice."""
    with pytest.raises(UsageError, match="qkv_proj slice 1: 8 KV heads neither split over "
                                         "--tp 12 nor divide it"):
        module_slice(dataclasses.replace(PHI4, num_attention_heads=48), LoraModule.QKV_PROJ,
                     0, ShardSpec(12, 0), 16)


# -- `metrale layout --tp` ------------------------------------------------------------------------

NEXT_ARGS = ("layout", "-m", "qwen3-next-80b-a3b", "--modules",
             "q_proj,k_proj,v_proj,o_proj,out_proj", "--max-rank", 16)


def test_layout_tp_json_and_view() -> None:
    result = metrale(*NEXT_ARGS, "--budget", "40GiB", "--tp", 4, "--json")
    assert result.code == 0, result.stderr
    doc = result.json()
    assert (doc["tp_size"], doc["ep_size"], doc["fully_sharded"]) == (4, 1, False)
    assert doc["fingerprint"] == "e3298e5b193f86eb1f4fe085e95b4dff"
    [group] = doc["rank_layouts"]
    assert group["ranks"] == [0, 1, 2, 3] and group["slot_bytes"] == 8_060_928
    per_gpu = group["bytes_per_slot"]
    assert doc["max_loras"] == 40 * 2**30 // per_gpu and group["total_bytes"] <= 40 * 2**30
    view = metrale(*NEXT_ARGS, "--budget", "40GiB", "--tp", 4)
    assert view.code == 0
    assert "15,335,424 B" in view.stdout and "slot 8,060,928 B" in view.stdout
    assert f"holds {doc['max_loras']:,} slots on every rank" in view.stdout


@pytest.mark.slow
def test_layout_tp_with_experts_and_ep() -> None:
    result = metrale(*NEXT_ARGS, "--experts", "--tp", 4, "--ep", 2, "--max-loras", 2, "--json")
    assert result.code == 0, result.stderr
    doc = result.json()
    assert doc["ep_size"] == 2
    groups = doc["rank_layouts"]
    assert sorted(k for g in groups for k in g["ranks"]) == [0, 1, 2, 3]
    # Per rank: 256 of the 512 experts, each over MoE TP 2 (gate/up A [16, 2048] whole with B
    # [256, 16]; down A [16, 256] with B [2048, 16] whole), and the whole router [512 x 2048],
    # on each of the 48 MoE layers; every region is a multiple of 256 bytes.
    expert = 2 * (16 * 2048 + 256 * 16) * 2 + (16 * 256 + 2048 * 16) * 2
    router = (16 * 2048 + 512 * 16) * 2
    assert {g["expert_slot_bytes"] for g in groups} == {48 * (256 * expert + router)}


@pytest.mark.parametrize(("args", "message"), [
    (("--ep", 2), "--ep and --fully-sharded need --tp"),
    (("--tp", 32), "qwen3-next-80b-a3b: query heads (16) do not split over --tp 32; vLLM's "
                   "QKVParallelLinear would refuse to build"),
    (("--tp", 4, "--ep", 2, "--fully-sharded"),
     "--ep with --fully-sharded is refused (vLLM refuses expert parallelism with fully sharded "
     "LoRA)"),
    (("--tp", 0), "--tp must be positive, got 0"),
    (("--tp", 2, "--ep", 0), "--ep must be positive, got 0"),  # was taken as --ep 1
])
def test_layout_tp_refusals_are_one_line(args: tuple[object, ...], message: str) -> None:
    result = metrale(*NEXT_ARGS, *args)
    assert result.code == 2
    assert result.stderr.strip() == f"error: {message}"


@pytest.mark.proc
def test_layout_tp_does_not_import_torch() -> None:
    code = ("import sys\nfrom metrale_cli.cli.app import main\n"
            "sys.argv = ['metrale'] + sys.argv[1:]\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules and 'cupy' not in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", code, *map(str, NEXT_ARGS), "--tp", "2"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "10,420,224" in done.stdout


@pytest.mark.proc
def test_bench_pack_per_rank() -> None:
    result = metrale("bench", "pack", "--model", "qwen3-8b", "--modules", "q_proj,o_proj",
                     "--rank", 8, "--adapters", 1, "--repeats", 1, "--tp", 2, "--json")
    assert result.code == 0, result.stderr
    tp = result.json()["tp"]
    assert (tp["tp_size"], tp["ep_size"], tp["fully_sharded"]) == (2, 1, False)
    # Per layer q_proj A [8, 4096] whole + half of B [4096, 8]; o_proj half of A [8, 4096]
    # + B [4096, 8] whole; BF16, 36 layers.
    per_layer = (8 * 4096 + 2048 * 8 + 8 * 2048 + 4096 * 8) * 2
    assert [r["bytes_read"] for r in tp["ranks"]] == [36 * per_layer] * 2
    for r in tp["ranks"]:
        assert r["pack_gb_per_s"] > 0
        assert r["pack_vs_memcpy"] == pytest.approx(
            r["pack_gb_per_s"] / result.json()["memcpy_gb_per_s"])


def test_the_docs_figures_are_the_code_s() -> None:
    """docs/tensor-parallel.md's table of per-rank slot bytes is what the layouts give."""
    text = (Path(__file__).parents[1] / "docs" / "tensor-parallel.md").read_text()
    rows = re.findall(r"^\| (unsharded|TP (\d)(, fully sharded)?) \| ([\d,]+) \|$", text, re.M)
    assert len(rows) == 5
    layout = next_layout()
    for _, tp, fully, figure in rows:
        got = (RankLayout.of(layout, ShardSpec(int(tp), 0, 1, bool(fully))).slot_bytes if tp
               else layout.slot_bytes)
        assert got == int(figure.replace(",", ""))


@pytest.mark.parametrize("value", ["soon", "0", "-5", "inf"])
def test_a_bad_dist_timeout_is_one_line(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from metrale_cli import env
    from metrale_cli.errors import UsageError as Usage

    monkeypatch.setenv("METRALE_DIST_TIMEOUT", value)
    with pytest.raises(Usage, match=f"METRALE_DIST_TIMEOUT='{value}': not a positive number"):
        env.dist_timeout()
    monkeypatch.setenv("METRALE_DIST_TIMEOUT", " 2.5 ")
    assert env.dist_timeout() == 2.5


@pytest.mark.parametrize("value", ["false", 0, None])
def test_shard_record_refuses_a_fully_sharded_that_is_not_a_boolean(value: object) -> None:
    """`bool("false")` is True: a rank image saying "false" must be refused by name, not read
    as fully sharded and then refused for a fingerprint it does not have."""
    doc = {"tp_size": 2, "tp_rank": 0, "ep_size": 1, "ep_rank": 0, "fully_sharded": value}
    with pytest.raises(ValueError, match="fully_sharded is .* not true or false"):
        ShardSpec.from_record(doc)
    assert ShardSpec.from_record({**doc, "fully_sharded": False}).fully_sharded is False


# -- what the base model can take (vLLM's parallel layers) ----------------------------------------

QWEN3 = ModelConfig.preset("qwen3-8b")
MOE = ModelConfig.preset("qwen3-30b-a3b")


@pytest.mark.parametrize(("args", "message"), [
    (("-m", "qwen3-8b", "--modules", "gate_proj,up_proj,down_proj", "--tp", 3),
     "qwen3-8b: query heads (32) do not split over --tp 3"),
    (("-m", "qwen3-8b", "--modules", "gate_proj,up_proj,down_proj", "--tp", 48),
     "qwen3-8b: query heads (32) do not split over --tp 48"),
    (("-m", "qwen3-30b-a3b", "--experts", "--tp", 3),
     "qwen3-30b-a3b: query heads (32) do not split over --tp 3"),
    (("-m", "qwen3-8b", "--modules", "q_proj", "--tp", 2, "--ep", 2),
     "--ep 2: qwen3-8b has no routed experts to split"),
    (("-m", "qwen3-30b-a3b", "--modules", "q_proj", "--tp", 2, "--ep", 2),
     "--ep 2 needs the expert pool (--experts)"),
])
def test_a_tp_the_model_cannot_take_is_refused(args: tuple[object, ...], message: str) -> None:
    """The pool's modules split (the MLP alone at --tp 3), but no engine builds the model: one
    line naming the count and the size, exit 2, before anything is planned."""
    for command in ("layout", "simulate"):
        extra = ("--max-loras", 2, "--requests", 10) if command == "simulate" else ()
        result = metrale(command, "--max-rank", 8, *args, *extra)
        assert result.code == 2, (command, result.stdout)
        [line] = result.stderr.strip().splitlines()
        assert line.startswith(f"error: {message}"), line


@pytest.mark.parametrize(("model", "spec", "message"), [
    (dataclasses.replace(QWEN3, num_attention_heads=48), ShardSpec(12),
     r"KV heads \(8\) neither split over --tp 12 nor divide it"),
    (dataclasses.replace(QWEN3, intermediate_size=12300), ShardSpec(8),
     r"MLP intermediate size \(12300\) does not split over --tp 8"),
    (dataclasses.replace(NEXT, linear_num_value_heads=24), ShardSpec(16),
     r"linear-attention value heads \(24\) do not split over --tp 16"),
    (dataclasses.replace(NEXT, linear_num_key_heads=12), ShardSpec(8),
     r"linear-attention key heads \(12\) do not split over --tp 8"),
    (dataclasses.replace(NEXT, shared_expert_intermediate_size=500), ShardSpec(8),
     r"shared-expert intermediate size \(500\) does not split over --tp 8"),
    (dataclasses.replace(MOE, moe_intermediate_size=770), ShardSpec(4),
     r"expert intermediate size \(770\) does not split over MoE TP \(tp / ep\) 4"),
    (dataclasses.replace(MOE, num_experts=100), ShardSpec(8, 0, 8),
     r"routed experts \(100\) do not split over --ep 8"),
    (dataclasses.replace(MOE, num_experts=2, num_experts_per_tok=2), ShardSpec(4),
     r"--tp 4 is above the 2 routed experts"),
    (dataclasses.replace(MOE, intermediate_size=6145, mlp_only_layers=(0,)), ShardSpec(4),
     r"MLP intermediate size \(6145\) does not split over --tp 4"),
    # Llama 4's dense layers are intermediate_size_mlp wide (its intermediate_size, the
    # experts' and the shared expert's, splits), DeepSeek's shared experts n_shared_experts
    # expert widths: neither was checked, so a layout vLLM cannot build was planned.
    (dataclasses.replace(ModelConfig.preset("deepseek-v2-lite"), moe_intermediate_size=1407,
                         n_shared_experts=1), ShardSpec(2, 0, 2),
     r"shared-expert intermediate size \(1407\) does not split over --tp 2"),
    (ModelConfig.from_dict({"model_type": "llama4_text", "intermediate_size_mlp": 16383,
                            "interleave_moe_layer_step": 2}),
     ShardSpec(2), r"MLP intermediate size \(16383\) does not split over --tp 2"),
])
def test_every_dimension_vllm_divides_is_checked(model: ModelConfig, spec: ShardSpec,
                                                 message: str) -> None:
    with pytest.raises(UsageError, match=message):
        check_model_split(model, spec)


@pytest.mark.parametrize(("model", "spec"), [
    (QWEN3, ShardSpec(16)),  # 8 KV heads replicated twice
    (NEXT, ShardSpec(16)),  # 2 KV heads, 16 query heads, 16/32 linear heads
    (dataclasses.replace(MOE, moe_intermediate_size=770), ShardSpec(4, 0, 2)),  # MoE TP 2
    (dataclasses.replace(MOE, intermediate_size=6145), ShardSpec(4)),  # no dense layer
    (dataclasses.replace(QWEN3, num_attention_heads=48, num_key_value_heads=6), ShardSpec(12)),
])
def test_what_vllm_builds_is_accepted(model: ModelConfig, spec: ShardSpec) -> None:
    check_model_split(model, spec)


def test_tp_1_rank_layouts_are_the_unsharded_ones() -> None:
    """Identical bytes, identical fingerprints: a --tp 1 rank (fully sharded or not) lands
    slots with the unsharded pool, slot and expert layout alike."""
    layout = SlotLayout.build(MOE, [LoraModule.Q_PROJ, LoraModule.O_PROJ], 16)
    experts = ExpertLayout.for_model(MOE, 16)
    for fully in (False, True):
        ranked, ranked_experts = rank_layouts(layout, experts, ShardSpec(1, 0, 1, fully))
        assert ranked.fingerprint == layout.fingerprint
        assert ranked_experts is not None
        assert ranked_experts.fingerprint == experts.fingerprint
    two, _ = rank_layouts(layout, experts, ShardSpec(2))
    assert two.fingerprint != layout.fingerprint
    result = metrale("layout", "-m", "qwen3-8b", "--modules", "q_proj", "--max-rank", 16,
                     "--tp", 1, "--json")
    assert result.code == 0, result.stderr
    doc = result.json()
    assert doc["rank_layouts"][0]["fingerprints"] == [doc["fingerprint"]]


@pytest.mark.slow
def test_fully_sharded_refuses_an_expert_rank_tp_does_not_divide(peft_zoo,
                                                                 tmp_path: Path) -> None:
    """vLLM's fused-MoE LoRA slices each expert's A by rank and asserts rank % tp == 0
    (FusedMoEWithLoRA._slice_w13_a); its dense layers slice the padded A unchecked."""
    moe = peft_zoo.adapter("qwen3_next", r=6, lora_alpha=12, target_modules=["q_proj"],
                           target_parameters=["mlp.experts.gate_up_proj",
                                              "mlp.experts.down_proj"])
    dense = peft_zoo.adapter("llama", r=6, lora_alpha=12, target_modules=["q_proj", "o_proj"])
    for command, extra in (("layout", ()), ("pack", ("--out", tmp_path / "out", "--device",
                                                     "cpu")),
                           ("simulate", ("--requests", 10))):
        refused = metrale(command, f"moe={moe.path}", "--experts", "--max-rank", 8,
                          "--max-loras", 2, "--tp", 4, "--fully-sharded", *extra)
        assert refused.code == 1, (command, refused.stdout, refused.stderr)
        [line] = refused.stderr.strip().splitlines()
        assert line.startswith("error: moe: routed-expert gate_proj rank 6 (layer "), line
        assert "does not split over --tp 4 under --fully-sharded" in line
        assert not (tmp_path / "out").exists()
        # Not fully sharded, or at a TP that divides 6, the same adapter is taken.
        for shard in (("--tp", 4), ("--tp", 2, "--fully-sharded")):
            taken = metrale(command, f"moe={moe.path}", "--experts", "--max-rank", 8,
                            "--max-loras", 2, *shard, *(() if command == "pack" else extra))
            assert taken.code == 0, (command, shard, taken.stderr)
        dense_taken = metrale(command, f"dense={dense.path}", "--max-rank", 8,
                              "--max-loras", 2, "--tp", 4, "--fully-sharded",
                              *(() if command == "pack" else extra))
        assert dense_taken.code == 0, (command, dense_taken.stderr)


def test_refuse_unshardable_names_the_adapter_rank_and_size() -> None:
    from types import SimpleNamespace

    pair = SimpleNamespace(proj=ExpertProj.UP_PROJ, r=6, layer=3, expert=5)
    report = SimpleNamespace(name="moe", expert_pairs=[pair])
    with pytest.raises(NotServable, match=r"^moe: routed-expert up_proj rank 6 \(layer 3, "
                                          r"expert 5\) does not split over --tp 4"):
        refuse_unshardable([report], ShardSpec(4, 0, 1, True))
    refuse_unshardable([report], ShardSpec(4))
    refuse_unshardable([report], ShardSpec(2, 0, 1, True))
    down = SimpleNamespace(name="moe", expert_pairs=[SimpleNamespace(
        proj=ExpertProj.DOWN_PROJ, r=6, layer=3, expert=5)])
    refuse_unshardable([down], ShardSpec(4, 0, 1, True))  # w2 A is sliced by column


# -- hostile input: torchrun's variables where no launch set them ----------------------------------


@pytest.mark.parametrize("rank,world", [("x", "abc"), ("0", "abc"), ("2", "2"), ("-1", "2")])
def test_torchrun_variables_that_are_not_a_launch_are_refused(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rank: str, world: str
) -> None:
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", world)
    result = metrale("pack", tiny / "a", "--model", tiny, "--max-loras", 2, "--tp", 2,
                     "--out", tmp_path / "ranks")
    one_line_error(result, 2)
    assert f"RANK={rank!r} WORLD_SIZE={world!r}" in result.stderr
    assert not (tmp_path / "ranks").exists()


@pytest.mark.parametrize(("module", "says"), [
    (LoraModule.GATE_PROJ, "gate_proj (mlp.shared_experts.gate_proj) output rows (1407) does not "
                           "split over --tp 2"),
    (LoraModule.DOWN_PROJ, "down_proj (mlp.shared_experts.down_proj) input columns (1407) does "
                           "not split over --tp 2"),
])
def test_a_module_at_two_paths_is_refused_with_the_path_that_does_not_split(
        module: LoraModule, says: str) -> None:
    """DeepSeek's gate_proj is the dense MLP's (10944 rows) on layer 0 and the shared experts'
    (`n_shared_experts * moe_intermediate_size`) on the MoE layers: a slot width --tp does not
    split is named with its path, not as a bare gate_proj whose dense width splits (the CLI
    refuses this model first, as vLLM would; a family read from weights reaches it)."""
    lite = dataclasses.replace(ModelConfig.preset("deepseek-v2-lite"),
                               moe_intermediate_size=1407, n_shared_experts=1)
    layout = SlotLayout.build(lite, [module], 8)
    with pytest.raises(UsageError) as refused:
        RankLayout.of(layout, ShardSpec(2, 0)).entries  # noqa: B018
    assert str(refused.value) == says


@pytest.mark.parametrize("command", [
    ["layout", "--modules", "q_proj", "--max-rank", "8"],
    ["layout", "--modules", "q_proj", "--max-rank", "8", "--budget", "1GiB"],
    ["simulate", "--modules", "q_proj", "--max-rank", "8", "--requests", "100", "--adapters",
     "5", "--max-loras", "2"],
])
def test_a_tp_no_model_takes_is_refused_before_its_ranks_are_made(command: list[str]) -> None:
    """--tp 10**20 is the model's refusal at once: every rank's layout was made first (a list
    of 10**20, a MemoryError after a minute)."""
    done = metrale(*command, "-m", "llama-3.1-8b", "--tp", "99999999999999999999")
    one_line_error(done, 2)
    assert "query heads (32) do not split over --tp 99999999999999999999" in done.stderr
