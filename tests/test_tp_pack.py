"""`metrale pack --tp`: rank images against PEFT's own forward pass and against the unsharded
image. For adapters made by the real peft library, the rank images' deltas reassembled as the
engines do (column slices placed, row partials summed, fully sharded shrinks gathered) equal
PEFT's forward delta; and every rank image's regions are the matching slices of the unsharded
image's, byte for byte."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from metrale_cli.adapters.experts import ExpertProj
from metrale_cli.bf16 import bf16_to_f32
from metrale_cli.image.pool_image import PoolImage
from metrale_cli.layout.sharding import Slice
from metrale_cli.model.modules import LoraModule
from tests.support.cli_runner import metrale
from tests.support.peft_factory import AdapterTruth

pytestmark = pytest.mark.slow
_LAYERED = re.compile(r"^model\.(?:language_model\.)?layers\.(\d+)\.(.+)$")
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"]


def pack(tmp_path: Path, truths: list[AdapterTruth], *extra: object) -> Path:
    out = tmp_path / ("tp" if "--tp" in extra else "pool.safetensors")
    args = [f"a{i}={t.path}" for i, t in enumerate(truths)]
    result = metrale("pack", *args, "--max-loras", len(truths) + 1, "--out", out, "--device",
                     "cpu", *extra)
    assert result.code == 0, result.stderr
    return out


def rank_images(out: Path, tp: int) -> list[PoolImage]:
    assert sorted(p.name for p in out.iterdir()) == sorted(
        f"rank-{k}-of-{tp}.safetensors" for k in range(tp))
    images = [PoolImage.open(out / f"rank-{k}-of-{tp}.safetensors") for k in range(tp)]
    for k, image in enumerate(images):
        assert image.layout.shard.tp_rank == k
    return images


def regions(pool: np.ndarray, e: object, a_off: int, b_off: int) -> tuple[np.ndarray, ...]:
    """An entry's A `[a_rows, in]` and B `[out, max_rank]` BF16 bits."""
    a = np.asarray(pool[a_off:a_off + e.a_bytes]).view("<u2").reshape(e.a_rows, e.in_dim)
    b = np.asarray(pool[b_off:b_off + e.b_bytes]).view("<u2").reshape(e.out_dim, e.max_rank)
    return a, b


def held(image: PoolImage, key: tuple, slot: int, expert: bool) -> tuple | None:
    """(slice, A f32, B f32) of one entry of `slot` in a rank image, None where not held."""
    region = image.expert_region if expert else image.region
    i = region.layout.index.get(key)
    if i is None:
        return None
    a_off, b_off = int(region.a_offsets[i, slot]), int(region.b_offsets[i, slot])
    if a_off < 0:
        return None
    e = region.layout.entries[i]
    a, b = regions(region.memory, e, a_off, b_off)
    return e.slice, bf16_to_f32(a), bf16_to_f32(b)


def reassembled(images: list[PoolImage], key: tuple, slot: int, x: np.ndarray,
                out_dim: int, expert: bool = False) -> np.ndarray:
    """The full delta from the rank images, as the engines compute it: each rank shrinks its
    input columns by its A (rank rows `ranks`, or all); shrinks of distinct (cols, ranks) pieces
    are summed into their rank rows (row partials all-reduced, fully sharded pieces gathered;
    replicated pieces are identical and counted once); each rank expands its B's output rows."""
    max_rank = images[0].layout.max_rank
    scale = float(images[0].scales[slot])
    pieces: dict[tuple, np.ndarray] = {}
    parts = [p for p in (held(image, key, slot, expert) for image in images) if p is not None]
    assert parts, key
    for s, a, _ in parts:
        ranks = s.ranks or (0, max_rank)
        shrink = x[:, s.cols[0]:s.cols[1]].astype(np.float64) @ a.T.astype(np.float64)
        piece = (s.cols, ranks)
        if piece in pieces:
            np.testing.assert_array_equal(pieces[piece], shrink)
        pieces[piece] = shrink
    full = np.zeros((x.shape[0], max_rank))
    for (_, (lo, hi)), shrink in pieces.items():
        full[:, lo:hi] += shrink
    delta = np.full((x.shape[0], out_dim), np.nan)
    for s, _, b in parts:
        rows = scale * full @ b.T.astype(np.float64)
        at = 0  # B's rows are the slice's runs end to end (one run per slice of a fused pair)
        for lo, hi in s.rows:
            placed, mine = delta[:, lo:hi], rows[:, at:at + hi - lo]
            assert np.isnan(placed).all() or np.array_equal(placed, mine), key
            delta[:, lo:hi] = mine
            at += hi - lo
    assert not np.isnan(delta).any(), f"{key}: rows no rank holds"
    return delta


def module_key(path: str) -> tuple[int, LoraModule]:
    hit = _LAYERED.match(path)
    return int(hit.group(1)), next(m for m in LoraModule if m.peft_path == hit.group(2))


def check_modules(images: list[PoolImage], slot: int, truth: AdapterTruth) -> int:
    rng = np.random.default_rng(slot)
    for path, m in truth.modules.items():
        x = rng.standard_normal((5, m.base_in)).astype(np.float32)
        want = truth.forward_delta(path, torch.from_numpy(x)).numpy()
        got = reassembled(images, module_key(path), slot, x, m.base_out)
        np.testing.assert_allclose(got, want, rtol=0, atol=3e-2 * np.abs(want).max(),
                                   err_msg=path)
    return len(truth.modules)


def check_experts(images: list[PoolImage], slot: int, truth: AdapterTruth) -> int:
    """Each expert's (and router's) delta on x against PEFT's `get_delta_weight` for it."""
    rng = np.random.default_rng(100 + slot)
    compared = 0
    for (layer, proj, expert), delta in truth.per_expert_deltas().items():
        x = rng.standard_normal((3, delta.shape[1])).astype(np.float32)
        want = x.astype(np.float64) @ delta.T.astype(np.float64)
        got = reassembled(images, (layer, ExpertProj(proj), expert), slot, x, delta.shape[0],
                          expert=True)
        np.testing.assert_allclose(got, want, rtol=0, atol=3e-2 * np.abs(want).max(),
                                   err_msg=f"layer {layer} {proj} {expert}")
        compared += 1
    return compared


def check_slices_of_unsharded(images: list[PoolImage], whole: PoolImage) -> None:
    """Every region of every rank image is the matching slice of the unsharded image's."""
    np.testing.assert_array_equal(images[0].scales, whole.scales)
    np.testing.assert_array_equal(images[0].ranks, whole.ranks)
    for expert in ([False, True] if whole.expert_region is not None else [False]):
        region = whole.expert_region if expert else whole.region
        for image in images:
            rank = image.expert_region if expert else image.region
            for i, e in enumerate(region.layout.entries):
                key = (e.layer, e.proj, e.expert) if expert else (e.layer, e.module)
                j = rank.layout.index.get(key)
                if j is None:  # another EP group's expert
                    continue
                re_ = rank.layout.entries[j]
                for slot in range(whole.max_loras):
                    if int(region.a_offsets[i, slot]) < 0:
                        assert int(rank.a_offsets[j, slot]) < 0
                        continue
                    a, b = regions(region.memory, e, int(region.a_offsets[i, slot]),
                                   int(region.b_offsets[i, slot]))
                    ra, rb = regions(rank.memory, re_, int(rank.a_offsets[j, slot]),
                                     int(rank.b_offsets[j, slot]))
                    s = re_.slice
                    lo, hi = s.ranks or (0, e.max_rank)
                    np.testing.assert_array_equal(ra, a[lo:hi, s.cols[0]:s.cols[1]])
                    np.testing.assert_array_equal(
                        rb, np.concatenate([b[lo:hi] for lo, hi in s.rows]))


@pytest.mark.parametrize("fully", [False, True])
@pytest.mark.parametrize("tp", [2, 4])
def test_dense_gqa(peft_zoo, tmp_path: Path, tp: int, fully: bool) -> None:
    """Llama: 4 query heads, 2 KV heads (fewer than 4 ranks), dense MLP; two adapters of ranks
    4 and 2 in a max-rank-8 pool, so fully sharded ranks past an adapter's rank hold zero A."""
    truths = [peft_zoo.adapter("llama", r=4, lora_alpha=8, target_modules=ATTN + MLP),
              peft_zoo.adapter("llama", r=2, lora_alpha=3, dtype="bf16", seed=4,
                               target_modules=["k_proj", "o_proj", "down_proj"])]
    shard = ("--tp", tp, *(["--fully-sharded"] if fully else []))
    images = rank_images(pack(tmp_path, truths, "--max-rank", 8, *shard), tp)
    for slot, truth in enumerate(truths):
        assert check_modules(images, slot, truth) == len(truth.modules)
    check_slices_of_unsharded(images, PoolImage.open(pack(tmp_path, truths, "--max-rank", 8)))


@pytest.mark.parametrize("fully", [False, True])
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("family", ["phi3", "glm4"])
def test_fused_projections(peft_zoo, tmp_path: Path, family: str, tp: int, fully: bool) -> None:
    """phi3's qkv_proj and gate_up_proj, glm4's gate_up_proj: one PEFT pair over q|k|v or
    gate|up, each slice split on its own (4 query heads, 2 KV heads: at TP 4 each KV head on
    two ranks). The engines' reassembly of the rank images is PEFT's delta, each rank's B is
    its slices' rows of the unsharded image's, and verify passes every rank image."""
    truth = peft_zoo.adapter(family, r=4, lora_alpha=8)
    assert {m.leaf for m in truth.modules.values()} >= {"gate_up_proj"}
    shard = ("--tp", tp, *(["--fully-sharded"] if fully else []))
    out = pack(tmp_path, [truth], "--max-rank", 8, *shard)
    images = rank_images(out, tp)
    assert check_modules(images, 0, truth) == len(truth.modules)
    check_slices_of_unsharded(images, PoolImage.open(pack(tmp_path, [truth], "--max-rank", 8)))
    for k in range(tp):
        verified = metrale("verify", out / f"rank-{k}-of-{tp}.safetensors", f"a0={truth.path}")
        assert verified.code == 0, verified.stderr


@pytest.mark.parametrize("fully", [False, True])
@pytest.mark.parametrize("tp", [2, 4])
def test_gemma4_layer_kinds(peft_zoo, tmp_path: Path, tp: int, fully: bool) -> None:
    """Gemma 4: each layer kind split at its own widths (sliding heads of 24 over 2 KV heads,
    full ones of 40 over one KV head, whole on every rank; the KV-shared layers' double-wide
    MLP) and the per-layer input's projections whole on every rank."""
    truth = peft_zoo.adapter("gemma4", r=4, lora_alpha=8)
    shard = ("--tp", tp, *(["--fully-sharded"] if fully else []))
    images = rank_images(pack(tmp_path, [truth], "--max-rank", 8, *shard), tp)
    assert check_modules(images, 0, truth) == len(truth.modules) == 31
    # The full layer's one KV head: every rank holds its whole k_proj B rows.
    full_k = [held(image, (1, LoraModule.K_PROJ), 0, False)[0] for image in images]
    assert {s.rows for s in full_k} == {((0, 40),)}
    check_slices_of_unsharded(images, PoolImage.open(pack(tmp_path, [truth], "--max-rank", 8)))


@pytest.mark.parametrize(("tp", "ep", "fully"), [(2, 1, False), (4, 1, False), (2, 1, True),
                                                 (4, 1, True), (2, 2, False), (4, 2, False)])
def test_gated_hybrid_with_experts(peft_zoo, tmp_path: Path, tp: int, ep: int,
                                   fully: bool) -> None:
    """Qwen3-Next: gated q_proj, out_proj on the linear-attention layers, fused routed experts
    and the router, at TP 2 and 4, fully sharded or not, and with EP 2."""
    truth = peft_zoo.adapter("qwen3_next", r=4, lora_alpha=8,
                             target_modules=ATTN + ["out_proj"], target_parameters=EXPERTS)
    shard = ("--tp", tp, "--ep", ep, *(["--fully-sharded"] if fully else []))
    images = rank_images(pack(tmp_path, [truth], "--experts", *shard), tp)
    assert check_modules(images, 0, truth) == len(truth.modules)
    assert check_experts(images, 0, truth) == 3 * 4 * 3 + 3
    if ep > 1:
        owned = [{e.expert for e in image.expert_layout.entries if e.expert >= 0}
                 for image in images]
        groups = tp // ep
        assert owned == [set(range(2 * (k // groups), 2 * (k // groups) + 2))
                         for k in range(tp)]
    check_slices_of_unsharded(images, PoolImage.open(pack(tmp_path, [truth], "--experts")))


@pytest.mark.parametrize("ep", [1, 2])
@pytest.mark.parametrize("model", ["gpt_oss", "llama4"])
def test_in_out_experts_sharded(peft_zoo, tmp_path: Path, model: str, ep: int) -> None:
    """(E, in, out) experts at TP 2: gpt_oss's, gate and up interleaved (each rank holds its
    rows of gate and up: every other row of PEFT's B), and llama4's, which PEFT wraps with A
    and B swapped (a rank's rows of gate are columns of PEFT's A); whole experts with EP 2."""
    params = [p.replace("mlp.", "feed_forward.") for p in EXPERTS] if model == "llama4" \
        else EXPERTS
    truth = peft_zoo.adapter(model, r=4, lora_alpha=8, target_modules=ATTN,
                             target_parameters=params)
    images = rank_images(pack(tmp_path, [truth], "--tp", 2, "--ep", ep, "--experts"), 2)
    assert check_modules(images, 0, truth) == len(truth.modules)
    assert check_experts(images, 0, truth) == len(truth.per_expert_deltas()) > 0


def test_moe_expert_parallel_only(peft_zoo, tmp_path: Path) -> None:
    """Qwen3-MoE at TP 2 with EP 2 (vLLM's expert parallelism: every expert whole on one
    rank)."""
    truth = peft_zoo.adapter("qwen3_moe", r=4, lora_alpha=8, target_modules=ATTN,
                             target_parameters=EXPERTS)
    images = rank_images(pack(tmp_path, [truth], "--tp", 2, "--ep", 2, "--experts"), 2)
    for image in images:  # MoE TP 1: every expert whole
        assert all(e.slice == Slice.whole(e.out_dim, e.in_dim)
                   for e in image.expert_layout.entries)
    assert check_modules(images, 0, truth) == len(truth.modules)
    assert check_experts(images, 0, truth) > 0
    check_slices_of_unsharded(images, PoolImage.open(pack(tmp_path, [truth], "--experts")))


def test_each_rank_reads_only_its_slice(peft_zoo, tmp_path: Path) -> None:
    """At TP 2 a rank reads column layers' A whole and half their B, row layers' half A and
    whole B: exactly those bytes of the file."""
    truth = peft_zoo.adapter("llama", r=4, lora_alpha=8, target_modules=ATTN + MLP)
    result = metrale("pack", truth.path, "--max-loras", 1, "--tp", 2, "--device", "cpu",
                     "--json")
    assert result.code == 0, result.stderr
    column = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    want = 0
    for m in truth.modules.values():
        a, b = 4 * m.a_shape[0] * m.a_shape[1], 4 * m.b_shape[0] * m.b_shape[1]  # F32 file
        # k/v: 2 KV heads over 2 ranks, one head each, so half of B like any column layer.
        want += a + b // 2 if m.leaf in column else a // 2 + b
    assert [r["bytes_read"] for r in result.json()["ranks"]] == [want, want]


def test_a_pool_format_reader_reads_a_rank_image(peft_zoo, tmp_path: Path) -> None:
    """The reader in docs/pool-format.md, unchanged, reads a rank image: each rank's delta is
    its slice's (column rows; a partial sum for row layers)."""
    code = re.search(r"```python\n(import json.*?)```",
                     (Path(__file__).parents[1] / "docs" / "pool-format.md").read_text(),
                     re.S).group(1)
    namespace: dict = {}
    exec(compile(code, "pool-format.md", "exec"), namespace)
    truth = peft_zoo.adapter("qwen3_next", r=4, lora_alpha=8, target_modules=ATTN + ["out_proj"])
    out = pack(tmp_path, [truth], "--tp", 2)
    rng = np.random.default_rng(0)
    for k, image in enumerate(rank_images(out, 2)):
        for i, e in enumerate(image.layout.entries):
            x = rng.standard_normal((2, e.in_dim)).astype(np.float32)
            got = namespace["pool_delta"](str(out / f"rank-{k}-of-2.safetensors"), i, 0, x)
            _, a, b = held(image, (e.layer, e.module), 0, False)
            np.testing.assert_allclose(got, float(image.scales[0]) * (x @ a.T) @ b.T,
                                       rtol=1e-5, atol=1e-6)


def test_a_failing_rank_leaves_no_directory(peft_zoo, tmp_path: Path, monkeypatch) -> None:
    from metrale_cli.image import pack as packing

    truth = peft_zoo.adapter("llama", r=4, lora_alpha=8, target_modules=ATTN)
    real = packing.pack_rank

    def fail_on_rank_2(*args: object, **kwargs: object) -> tuple:
        if args[4].tp_rank == 2:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(packing, "pack_rank", fail_on_rank_2)
    result = metrale("pack", truth.path, "--max-loras", 1, "--tp", 4, "--out", tmp_path / "tp")
    assert result.code == 2 and "No space left on device" in result.stderr
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(packing, "pack_rank", real)
    (tmp_path / "tp").mkdir()
    refused = metrale("pack", truth.path, "--max-loras", 1, "--tp", 4, "--out", tmp_path / "tp")
    assert refused.code == 2 and "exists; pass --force" in refused.stderr
    done = metrale("pack", truth.path, "--max-loras", 1, "--tp", 4, "--out", tmp_path / "tp",
                   "--force", "--json")
    assert done.code == 0, done.stderr
    assert [r["image"] for r in done.json()["ranks"]] == [
        str(tmp_path / "tp" / f"rank-{k}-of-4.safetensors") for k in range(4)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tp"]
    # Over its own images (of another --tp too) --force packs again; a file of the user's stops
    # it, whichever name sorts first among the foreign ones is named, and nothing is removed.
    (tmp_path / "tp" / "rank-0-of-2.safetensors").write_bytes(b"older pack")
    again = metrale("pack", truth.path, "--max-loras", 1, "--tp", 4, "--out", tmp_path / "tp",
                    "--force")
    assert again.code == 0, again.stderr
    assert sorted(p.name for p in (tmp_path / "tp").iterdir()) == [
        f"rank-{k}-of-4.safetensors" for k in range(4)]
    (tmp_path / "tp" / "notes.txt").write_text("mine")
    (tmp_path / "tp" / "rank-notes").mkdir()
    kept = sorted(p.name for p in (tmp_path / "tp").iterdir())
    refused = metrale("pack", truth.path, "--max-loras", 1, "--tp", 4, "--out", tmp_path / "tp",
                      "--force")
    assert refused.code == 2 and refused.stderr.strip() == (
        f"error: {tmp_path / 'tp'} holds notes.txt, which metrale does not write there; "
        "--force replaces only a directory of metrale's own outputs"), refused.stderr
    assert sorted(p.name for p in (tmp_path / "tp").iterdir()) == kept
    assert (tmp_path / "tp" / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tp"]


def test_show_and_verify_read_a_rank_image(peft_zoo, tmp_path: Path) -> None:
    """`show` and `verify` rebuild a rank's layout from `metrale.shard`: the image is
    consistent, and its bytes are what the rank's pack writes for the adapter."""
    truth = peft_zoo.adapter("llama", r=4, lora_alpha=8, target_modules=ATTN + MLP)
    out = pack(tmp_path, [truth], "--tp", 2, "--fully-sharded")
    rank1 = out / "rank-1-of-2.safetensors"
    shown = metrale("show", rank1, "--json")
    assert shown.code == 0, shown.stderr
    assert shown.json()["layout"]["fingerprint"] == PoolImage.open(rank1).layout.fingerprint
    verified = metrale("verify", rank1, f"a0={truth.path}")
    assert verified.code == 0, verified.stderr


@pytest.mark.parametrize("fully", [False, True])
def test_unpack_refuses_a_rank_image(peft_zoo, tmp_path: Path, fully: bool) -> None:
    """A rank image holds slices: written back under the full model's module names they would
    be an adapter of the wrong shapes (and a fully sharded A does not even have max_rank rows).
    unpack refuses it in one line and writes nothing."""
    truth = peft_zoo.adapter("llama", r=4, lora_alpha=8, target_modules=ATTN + MLP)
    out = pack(tmp_path, [truth], "--tp", 2, *(["--fully-sharded"] if fully else []))
    target = tmp_path / "unpacked"
    result = metrale("unpack", out / "rank-1-of-2.safetensors", "--slot", "0", target)
    assert result.code == 2, result.stderr
    assert "rank 1 of a tensor-parallel" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not target.exists()


def test_verify_passes_every_expert_parallel_rank_image(peft_zoo, tmp_path: Path) -> None:
    """At --tp 4 --ep 4 each rank holds one whole expert: verify rebuilds what that rank packs
    (its own experts only) and passes every rank image; another adapter's weights differ."""
    truth = peft_zoo.adapter("qwen3_next", r=4, lora_alpha=8, target_modules=["q_proj"],
                             target_parameters=EXPERTS)
    other = peft_zoo.adapter("qwen3_next", r=4, lora_alpha=8, target_modules=["q_proj"],
                             target_parameters=EXPERTS, seed=7)
    out = pack(tmp_path, [truth], "--experts", "--tp", 4, "--ep", 4)
    for k, image in enumerate(rank_images(out, 4)):
        assert {e.expert for e in image.expert_layout.entries} == {-1, k}
        path = out / f"rank-{k}-of-4.safetensors"
        assert metrale("show", path).code == 0
        verified = metrale("verify", path, f"a0={truth.path}", "--json")
        assert verified.code == 0, verified.stderr
        assert verified.json()["adapters"][0]["expert_entries"] == 3 * 3 + 3  # 3 MoE layers
        assert metrale("verify", path, f"a0={other.path}").code == 1


def test_an_expert_parallel_rank_pool_swaps_in_and_lands_a_moe_adapter(peft_zoo,
                                                                       tmp_path: Path) -> None:
    """`LoraPool.swap_in` of a new MoE adapter into a pool of one EP rank's layouts writes what
    `pack --tp 4 --ep 4` writes for that rank, and landing the rank image's slot gives the
    same bytes."""
    from metrale_cli.adapters.adapter import Adapter
    from metrale_cli.adapters.audit import audit
    from metrale_cli.pool.pool import LoraPool

    truth = peft_zoo.adapter("qwen3_next", r=4, lora_alpha=8, target_modules=["q_proj"],
                             target_parameters=EXPERTS)
    out = pack(tmp_path, [truth], "--experts", "--tp", 4, "--ep", 4, "--max-rank", 4)
    for image in rank_images(out, 4):
        report = audit(Adapter.load(truth.path), image.layout.model, 4, experts_enabled=True)
        pool = LoraPool(image.layout, 2, "cpu", image.expert_layout)
        pool.swap_in(0, report)
        pool.land_slot(1, image, 0)
        for slot in (0, 1):
            got, want = pool.slot_contents(slot), image.slot_contents(0)
            np.testing.assert_array_equal(got.data, want.data)
            np.testing.assert_array_equal(got.adapted, want.adapted)
            np.testing.assert_array_equal(got.expert_data, want.expert_data)
            np.testing.assert_array_equal(got.expert_adapted, want.expert_adapted)
        assert int(pool.expert_rank_table[0]) == 4
