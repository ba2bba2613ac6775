"""`metrale verify`: a fresh pack verifies; one flipped byte, a changed scale, a changed overlay
row are each caught and named; an image show refuses (a swapped pair of offsets, tables against
the slots' metadata) is refused alike; real PEFT adapters (dense, hybrid with
rank/alpha patterns and BF16/F16 files, MoE experts, overlays) verify against their own pack."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from metrale_cli.image.format import read_tables
from tests.support.cli_runner import metrale
from tests.support.image_edit import edit_metadata, read_element, write_element

MODEL = "qwen3-next-80b-a3b"


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Synthetic adapters a (q, v, out_proj; F32, so packing rounds) and b in a 3-slot pool."""
    root = tmp_path_factory.mktemp("verify")
    for name, modules, rank, seed, dtype in (("a", "q_proj,v_proj,out_proj", 8, 0, "f32"),
                                             ("b", "q_proj,o_proj", 4, 2, "bf16")):
        done = metrale("synth", root / name, "-m", MODEL, "--modules", modules, "-r", rank,
                       "--seed", seed, "--dtype", dtype)
        assert done.code == 0, done.stderr
    out = root / "pool.safetensors"
    done = metrale("pack", root / "a", root / "b", "--max-loras", 3, "-m", MODEL, "--out", out,
                   "--device", "cpu")
    assert done.code == 0, done.stderr
    return out


@pytest.fixture
def image(packed: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "pool.safetensors"
    shutil.copy(packed, copy)
    return copy


def _adapters(packed: Path) -> list[str]:
    return [f"a={packed.parent / 'a'}", f"b={packed.parent / 'b'}"]


def test_a_fresh_pack_verifies(packed: Path) -> None:
    result = metrale("verify", packed, *_adapters(packed), "--json")
    assert result.code == 0, result.stdout + result.stderr
    doc = result.json()
    assert doc["ok"] and doc["unchecked"] == []
    assert [(a["slot"], a["name"], a["ok"], a["entries"]) for a in doc["adapters"]] == [
        (0, "a", True, 12 + 12 + 36), (1, "b", True, 12 + 12)]
    t = read_tables(packed)
    regions = sum(e.a_bytes + e.b_bytes for e in t.layout.entries)
    assert doc["bytes_compared"] == sum(
        e.a_bytes + e.b_bytes for i, e in enumerate(t.layout.entries)
        for k in (0, 1) if t.a_offsets[i, k] >= 0)
    assert doc["bytes_compared"] < 2 * regions
    text = metrale("verify", packed, *_adapters(packed))
    assert "slot 0 a: ok" in text.stdout and "slot 1 b: ok" in text.stdout
    assert "GB/s" in text.stdout


def test_unchecked_slots_are_listed(packed: Path) -> None:
    result = metrale("verify", packed, f"b={packed.parent / 'b'}", "--json")
    assert result.code == 0
    assert result.json()["unchecked"] == [{"slot": 0, "name": "a"}]


def test_an_adapter_not_in_the_image_is_an_error(packed: Path) -> None:
    result = metrale("verify", packed, f"c={packed.parent / 'a'}")
    assert result.code == 2
    assert "c: no slot of" in result.stderr and "(it holds: a, b)" in result.stderr


def test_the_wrong_adapter_for_a_slot_differs(packed: Path) -> None:
    result = metrale("verify", packed, f"b={packed.parent / 'a'}", "--json")
    assert result.code == 1
    verdict = result.json()["adapters"][0]
    assert verdict["slot_differences"] == ["rank 4 in the image; the adapter's is 8"]
    notes = {(d["layer"], d["module"], d["note"]) for d in verdict["differences"]}
    assert (3, "v_proj", "not in the image") in notes
    assert (3, "o_proj", "only in the image") in notes


def _b_region(path: Path, entry: int, slot: int) -> int:
    """File offset of entry `entry`'s B in slot `slot`."""
    t = read_tables(path)
    return t.tensor("pool").begin + int(t.b_offsets[entry, slot])


def test_one_flipped_byte_in_b_is_named(packed: Path, image: Path) -> None:
    t = read_tables(image)
    entry = t.layout.index[next(k for k in t.layout.index if k[0] == 3
                                and k[1].peft_name == "q_proj")]
    at = _b_region(image, entry, 0) + 2 * 5 + 1  # the high byte of B[0, 5]
    with image.open("r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x40]))
    result = metrale("verify", image, *_adapters(packed), "--json")
    assert result.code == 1, result.stderr
    a, b = result.json()["adapters"]
    assert b["ok"] and not a["ok"] and a["slot_differences"] == []
    [diff] = a["differences"]
    assert (diff["layer"], diff["module"], diff["part"], diff["bytes_differing"]) == (
        3, "q_proj", "B", 1)
    assert diff["max_delta_difference"] > 0
    text = metrale("verify", image, *_adapters(packed))
    assert "slot 0 a: DIFFERS" in text.stdout and "q_proj" in text.stdout
    # Exit 1 ends with one line saying why, as every command's does; it said nothing.
    assert text.code == 1 and text.stderr.splitlines()[-1] == (
        "error: 1 of 2 adapter(s) differ from their slot: a; 1 tensor differs from the digest "
        "the image records")
    assert result.stderr.splitlines()[-1] == text.stderr.splitlines()[-1]


def _slot_metadata(path: Path, slot: int, **fields: object) -> None:
    slots = read_tables(path).slots_doc
    slots[slot].update(fields)
    edit_metadata(path, "metrale.slots", json.dumps(slots, separators=(",", ":")))


def test_a_changed_scale_is_named(packed: Path, image: Path) -> None:
    """The scale table and the slot's metadata agree (the image is consistent) on a scale
    that is not the adapter's."""
    write_element(image, "scales", (1,), 3.0)
    _slot_metadata(image, 1, scaling=3.0)
    result = metrale("verify", image, *_adapters(packed), "--json")
    assert result.code == 1
    a, b = result.json()["adapters"]
    assert a["ok"] and b["slot_differences"] == ["scale 3 in the image; the adapter's is 2"]
    # dW = scale * B @ A: every module of the slot is off by the scale's change.
    assert b["differences"] == []


def _swap_offsets(path: Path) -> None:
    x, y = read_element(path, "a_offsets", (0, 0)), read_element(path, "a_offsets", (1, 0))
    write_element(path, "a_offsets", (0, 0), y)
    write_element(path, "a_offsets", (1, 0), x)


# Images show refuses as inconsistent: verify once passed each of them.
INCONSISTENT = {
    "scale table against the slot's scaling": lambda p: write_element(p, "scales", (1,), 3.0),
    "rank table against the slot's rank": lambda p: write_element(p, "ranks", (0,), 4),
    "a rank that lies in both": lambda p: (write_element(p, "ranks", (1,), 99),
                                           _slot_metadata(p, 1, rank=99)),
    "swapped offsets": _swap_offsets,
}


@pytest.mark.parametrize("name", sorted(INCONSISTENT))
def test_verify_refuses_what_show_refuses(packed: Path, image: Path, name: str) -> None:
    INCONSISTENT[name](image)
    show = metrale("show", image)
    assert show.code == 1 and show.stderr.count("\n") == 1, show.stderr
    result = metrale("verify", image, *_adapters(packed), "--json")
    assert (result.code, result.stderr) == (1, show.stderr)
    assert result.json() == {"refused": "image_inconsistent",
                             "error": show.stderr.removeprefix("error: ").rstrip("\n")}
    assert metrale("verify", image, *_adapters(packed)).stderr == show.stderr


# -- real PEFT adapters ---------------------------------------------------------------------------

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.mark.slow
def test_peft_adapters_verify_and_show(peft_zoo, tmp_path: Path) -> None:
    """Dense, hybrid with rank/alpha patterns (folded into B) in BF16 and F16, one pool."""
    adapters = {
        "dense": peft_zoo.adapter("qwen3_next", r=4, lora_alpha=8,
                                  target_modules=ATTN + ["out_proj"]),
        "patterns": peft_zoo.adapter("qwen3_next", r=8, lora_alpha=16, use_rslora=True,
                                     dtype="bf16", target_modules=["q_proj", "v_proj", "out_proj"],
                                     rank_pattern={"v_proj": 2,
                                                   "layers.2.linear_attn.out_proj": 6},
                                     alpha_pattern={"q_proj": 5}),
        "half": peft_zoo.adapter("qwen3_next", r=2, lora_alpha=3, dtype="f16", seed=7,
                                 target_modules=["o_proj", "k_proj"]),
    }
    out = tmp_path / "pool.safetensors"
    args = [f"{n}={t.path}" for n, t in adapters.items()]
    assert metrale("pack", *args, "--max-loras", 4, "--out", out).code == 0
    assert metrale("show", out).code == 0
    result = metrale("verify", out, *args, "--json")
    assert result.code == 0, result.stdout
    # Another adapter's bytes under a pattern adapter's name: the folded B differs.
    wrong = metrale("verify", out, f"patterns={adapters['dense'].path}", "--json")
    assert wrong.code == 1


@pytest.mark.slow
def test_experts_and_overlays_verify_and_are_named(peft_zoo, tmp_path: Path) -> None:
    moe = peft_zoo.adapter("qwen3_moe", r=4, lora_alpha=8, target_modules=["q_proj"],
                           target_parameters=["mlp.experts.gate_up_proj",
                                              "mlp.experts.down_proj", "mlp.gate.weight"])
    out = tmp_path / "moe.safetensors"
    assert metrale("pack", f"moe={moe.path}", "--max-loras", 2, "--experts", "--out",
                   out).code == 0
    shown = metrale("show", out, "--json")
    assert shown.code == 0, shown.stderr
    assert shown.json()["slots"][0]["expert_entries"] > 0
    assert metrale("verify", out, f"moe={moe.path}").code == 0
    t = read_tables(out)
    assert t.expert_layout is not None and t.expert_b_offsets is not None
    entry = next(i for i, e in enumerate(t.expert_layout.entries)
                 if e.proj.value == "down_proj" and e.expert == 2)
    at = t.tensor("expert_pool").begin + int(t.expert_b_offsets[entry, 0])
    with out.open("r+b") as f:
        f.seek(at + 1)
        byte = f.read(1)[0]
        f.seek(at + 1)
        f.write(bytes([byte ^ 0x01]))
    result = metrale("verify", out, f"moe={moe.path}", "--json")
    assert result.code == 1
    [diff] = result.json()["adapters"][0]["differences"]
    layer = t.expert_layout.entries[entry].layer
    assert (diff["layer"], diff["module"], diff["part"], diff["bytes_differing"]) == (
        layer, "down_proj expert 2", "B", 1)
    # show checks the expert tables as it does the slot pool's.
    off = read_element(out, "expert_a_offsets", (entry, 0))
    write_element(out, "expert_a_offsets", (entry, 0), off + 2)
    shown = metrale("show", out)
    assert shown.code == 1
    assert (f"layer {layer} down_proj expert 2: expert_a_offsets[{entry}, 0] = {off + 2} is "
            "not 256-byte aligned") in shown.stderr, shown.stderr

    tokens = peft_zoo.adapter("llama", r=4, lora_alpha=8, target_modules=["q_proj"],
                              trainable_token_indices=[0, 5, 7])
    out = tmp_path / "tokens.safetensors"
    assert metrale("pack", f"tok={tokens.path}", "--max-loras", 1, "--out", out).code == 0
    assert metrale("show", out).code == 0
    assert metrale("verify", out, f"tok={tokens.path}").code == 0
    row = read_element(out, "overlay_rows", (1, 3))
    write_element(out, "overlay_rows", (1, 3), np.float32(row) + 1)
    result = metrale("verify", out, f"tok={tokens.path}", "--json")
    assert result.code == 1
    assert result.json()["adapters"][0]["slot_differences"] == [
        "overlays: 1 embed_tokens rows differ"]


@pytest.mark.parametrize("differs", ["b_row", "a_col", "both", "scale"])
def test_the_delta_difference_is_the_dense_one(differs: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """max |dW_got - dW_want| by the row (column) shortcut where one side's A (B) is the
    other's, and by the blocked stacked product otherwise, equals the dense float64 value."""
    from metrale_cli.bf16 import bf16_to_f32, f32_to_bf16
    from metrale_cli.image import verify as verify_module
    from metrale_cli.layout.slot_layout import PaddedPair

    e = PaddedPair(out_dim=96, in_dim=80, a_offset=0, b_offset=0, max_rank=8)
    rng = np.random.default_rng(7)

    def region(rows: int, cols: int) -> np.ndarray:
        return f32_to_bf16(rng.standard_normal((rows, cols)).astype(np.float32))

    a, b = region(8, 80), region(96, 8)
    a2, b2, s2 = a.copy(), b.copy(), 0.5
    if differs == "b_row":
        b2[17] ^= 0x40
    elif differs == "a_col":
        a2[:, 33] ^= 0x40
    elif differs == "both":
        a2, b2 = region(8, 80), region(96, 8)
    else:
        s2 = 0.25

    def dense(a_bits: np.ndarray, b_bits: np.ndarray, s: float) -> np.ndarray:
        return s * (bf16_to_f32(b_bits).astype(np.float64) @ bf16_to_f32(a_bits).astype(np.float64))

    want = float(np.abs(dense(a, b, 0.5) - dense(a2, b2, s2)).max())
    # Several blocks of output rows in the stacked path.
    monkeypatch.setattr(verify_module, "_DIFF_BLOCK_ELEMENTS", 3 * 80)
    got = verify_module._max_delta_difference(
        e, (a.view(np.uint8).ravel(), b.view(np.uint8).ravel(), 0.5),
        (a2.view(np.uint8).ravel(), b2.view(np.uint8).ravel(), s2))
    assert want > 0 and got == pytest.approx(want, rel=1e-5)


def test_verify_fits_60_columns(packed: Path, tmp_path: Path) -> None:
    """Each `ok` line wraps to the terminal as key/value lines do, `slot N NAME: ok` whole on
    its first line; at 100 columns each is one line, as before."""
    image, name = tmp_path / "pool.safetensors", "customer-support-assistant-v2"
    assert metrale("pack", f"{name}={packed.parent / 'a'}", packed.parent / "b", "--max-loras",
                   3, "-m", MODEL, "--out", image, "--device", "cpu").code == 0
    given = [f"{name}={packed.parent / 'a'}"]
    wide = metrale("verify", image, *given, columns=100).stdout.splitlines()
    narrow = metrale("verify", image, *given, columns=60).stdout.splitlines()
    assert all(len(line) <= 60 for line in narrow), narrow
    ok = next(line for line in wide if line.startswith(f"slot 0 {name}: ok ("))
    assert len(ok) > 60 and ok.endswith(" of its entries compared)")
    assert narrow[0].startswith(f"slot 0 {name}: ok (") and narrow[1].startswith("  ")
    assert " ".join([narrow[0], narrow[1].strip()]) == ok
    unchecked = next(line for line in wide if line.startswith("slot 1 b: unchecked"))
    assert unchecked in narrow
