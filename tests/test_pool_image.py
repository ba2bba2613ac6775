"""The pool image: its bytes are pinned (a refactor of the pool must not move one), and an
image is validated at open, so that landing one never yields a pointer outside the pool."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metrale_cli.adapters.synth import synth_adapter
from metrale_cli.errors import FormatError
from metrale_cli.image.pool_image import PoolImage
from metrale_cli.model.config import ModelConfig
from metrale_cli.model.modules import LoraModule
from metrale_cli.pool.pool import LoraPool
from tests.support.cli_runner import metrale
from tests.support.image_edit import strip_digests

DENSE = {
    "model_type": "qwen3_next", "hidden_size": 32, "num_hidden_layers": 4,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
    "intermediate_size": 48, "linear_num_value_heads": 3, "linear_value_head_dim": 8,
    "full_attention_interval": 2, "num_experts": 0,
}
MOE = {
    "model_type": "qwen3_moe", "hidden_size": 32, "num_hidden_layers": 3,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
    "intermediate_size": 48, "num_experts": 4, "moe_intermediate_size": 8,
    "num_experts_per_tok": 2, "mlp_only_layers": [0], "vocab_size": 64,
}
# sha256 of the images `pinned_images` packs, written before the pool's region refactor, and
# without `metrale.digests` (the per-tensor digests came later and moved nothing else): the image
# format and bytes must not change. The experts image's model gained a top-k of 2 (its config
# had none: Qwen3MoeConfig's 8 is more than its 4 experts, which transformers cannot route); its
# bytes are the first pin's with that one digit of the metrale.model summary 0 where it is 2.
PINNED = {
    "dense": "5faa2a9e97fbcf82b53e3ad1fee4182bb2e9d8b99d8a1f9c2e7c2251a071cf87",
    "experts": "ec2dc42562aaf35e8a8ce88bdea293f9919ab0e28a55bce5b4f496c3fce989e1",
}
# ... and with them.
PINNED_WITH_DIGESTS = {
    "dense": "3c1351829c3dd5e8d5fb01002b0b643b3188f40f294d4a08d55174634ce1b4ce",
    "experts": "831e5ab4a5e8469a0387801bddd56d29c6b04b02eb7756a0a1c568b91a31ed4e",
}


def pinned_images(root: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """Pack deterministic synthetic adapters (relative paths, so `source` is stable)."""
    monkeypatch.chdir(root)
    for name, config in (("dense", DENSE), ("moe", MOE)):
        Path(name).mkdir()
        Path(name, "config.json").write_text(json.dumps(config))
    made = {
        "a": ("dense", "q_proj,k_proj,v_proj,o_proj,out_proj", 4, "bf16", []),
        "b": ("dense", "q_proj,v_proj,out_proj", 2, "f32", ["--rslora", "--seed", "1"]),
        "c": ("dense", "q_proj,out_proj", 3, "f16", ["--seed", "2"]),
    }
    for name, (model, modules, rank, dtype, extra) in made.items():
        result = metrale("synth", name, "--model", model, "--modules", modules, "--rank", rank,
                         "--dtype", dtype, *extra)
        assert result.code == 0, result.stderr
    moe = ModelConfig.from_hf("moe")
    synth_adapter("e", moe, "moe", [LoraModule.Q_PROJ, LoraModule.O_PROJ], 4, dtype="f32",
                  seed=3, expert_layers=2)
    synth_adapter("f", moe, "moe", [LoraModule.Q_PROJ], 2, dtype="bf16", seed=4,
                  expert_layers=1)
    out = {"dense": Path("dense.safetensors"), "experts": Path("experts.safetensors")}
    packed = metrale("pack", "a", "b", "c", "--model", "dense", "--max-loras", 5,
                     "--max-rank", 8, "--device", "cpu", "--out", out["dense"])
    assert packed.code == 0, packed.stderr
    packed = metrale("pack", "e", "f", "--model", "moe", "--max-loras", 3, "--max-rank", 4,
                     "--experts", "--device", "cpu", "--out", out["experts"])
    assert packed.code == 0, packed.stderr
    return out


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_image_bytes_are_pinned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    images = pinned_images(tmp_path, monkeypatch)
    assert {name: sha256(path) for name, path in images.items()} == PINNED_WITH_DIGESTS
    for path in images.values():
        strip_digests(path)
    assert {name: sha256(path) for name, path in images.items()} == PINNED
    experts = PoolImage.open(images["experts"])
    assert experts.expert_region is not None and experts.expert_region.memory.any()


@pytest.fixture(scope="module")
def expert_image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("image")
    with pytest.MonkeyPatch.context() as mp:
        return root / pinned_images(root, mp)["experts"]


def rewrite(src: Path, dst: Path, edit: Callable[[dict[str, Any], bytearray], None]) -> Path:
    """Copy image `src` to `dst` with its header JSON and data buffer edited in place; the header
    is padded, as `write_image` pads it, so the data buffer stays 256-byte aligned."""
    raw = src.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    doc = json.loads(raw[8:8 + n])
    data = bytearray(raw[8 + n:])
    edit(doc, data)
    # A crafted image, digests and all: what meets the edit is the checks behind them (an
    # entry the edit has made no tensor keeps no digest).
    digests = {}
    for name, t in doc.items():
        try:
            begin, end = t["data_offsets"]
            digests[name] = hashlib.sha256(bytes(data[begin:end])).hexdigest()
        except (KeyError, TypeError, ValueError):
            continue
    if isinstance(doc.get("__metadata__"), dict):
        digests.pop("__metadata__", None)
        doc["__metadata__"]["metrale.digests"] = json.dumps({"algorithm": "sha256",
                                                             "tensors": digests})
    blob = json.dumps(doc).encode()
    blob += b" " * (-(8 + len(blob)) % 256)
    dst.write_bytes(len(blob).to_bytes(8, "little") + blob + bytes(data))
    return dst


def poke(doc: dict[str, Any], data: bytearray, tensor: str, index: int, value: Any) -> None:
    """Element `index` (flat) of `tensor` becomes `value`."""
    dtype = {"I64": "<i8", "I32": "<i4", "F32": "<f4"}[doc[tensor]["dtype"]]
    start = doc[tensor]["data_offsets"][0]
    table = np.frombuffer(data, dtype=dtype, offset=start,
                          count=int(np.prod(doc[tensor]["shape"])))
    table = table.copy()
    table[index] = value
    data[start:start + table.nbytes] = table.tobytes()


@pytest.mark.parametrize(("tensor", "index", "value", "message"), [
    ("a_offsets", 0, 2**36, r"a_offsets\[0, 0\] = 68719476736 puts its A .* outside the slot"),
    ("b_offsets", 1, 0, "b_offsets"),
    ("expert_a_offsets", 3, -1, "only one of its A and B"),
    ("ranks", 0, 9, r"ranks\[0\] is 9; the slot's metadata says"),
    ("ranks", 1, -1, r"ranks\[1\] is -1; the slot's metadata says"),
    ("scales", 0, np.nan, r"scales\[0\] is nan; the slot's metadata says"),
])
def test_open_refuses_tables_that_do_not_match_the_layout(
        expert_image: Path, tmp_path: Path, tensor: str, index: int, value: Any,
        message: str) -> None:
    bad = rewrite(expert_image, tmp_path / "bad.safetensors",
                  lambda doc, data: poke(doc, data, tensor, index, value))
    with pytest.raises(FormatError, match=message):
        PoolImage.open(bad)


def test_open_refuses_bad_overlays_and_slots(expert_image: Path, tmp_path: Path) -> None:
    def overlays(doc: dict[str, Any], data: bytearray) -> None:
        doc["__metadata__"]["metrale.overlays"] = json.dumps(
            {"hidden_size": 32, "runs": [{"slot": 7, "table": "embed_tokens", "start": 0,
                                          "count": 0, "tied_lm_head": False}]})
        end = len(data)
        for name, dtype, shape in (("overlay_slots", "I32", [0]), ("overlay_tokens", "I64", [0]),
                                   ("overlay_rows", "F32", [0, 32])):
            doc[name] = {"dtype": dtype, "shape": shape, "data_offsets": [end, end]}

    with pytest.raises(FormatError, match="overlay run 0 belongs to slot 7, which holds no"):
        PoolImage.open(rewrite(expert_image, tmp_path / "o.safetensors", overlays))

    def active(doc: dict[str, Any], data: bytearray) -> None:
        doc["__metadata__"]["metrale.active"] = "3"

    with pytest.raises(FormatError, match=r"metrale.active is 3, outside \[0, 3\)"):
        PoolImage.open(rewrite(expert_image, tmp_path / "a.safetensors", active))

    def layers(doc: dict[str, Any], data: bytearray) -> None:
        model = json.loads(doc["__metadata__"]["metrale.model"])
        doc["__metadata__"]["metrale.model"] = json.dumps({**model,
                                                           "num_hidden_layers": 10**8})

    # The bound a config file meets on its layer count, which the header reader applies before
    # anything is rebuilt layer by layer (10**8 would hang there).
    with pytest.raises(FormatError, match="num_hidden_layers 100000000 is above the 1,024"):
        PoolImage.open(rewrite(expert_image, tmp_path / "l.safetensors", layers))

    def generation(doc: dict[str, Any], data: bytearray) -> None:
        slots = json.loads(doc["__metadata__"]["metrale.slots"])
        slots[0]["generation"] = 2**64
        doc["__metadata__"]["metrale.slots"] = json.dumps(slots)

    with pytest.raises(FormatError, match="64 bits"):
        PoolImage.open(rewrite(expert_image, tmp_path / "g.safetensors", generation))


def land_everything(image: PoolImage) -> None:
    """Land every filled slot of `image` into a fresh pool: every pointer inside the pool."""
    pool = LoraPool(image.layout, image.max_loras, expert_layout=image.expert_layout)
    for k, s in enumerate(image.slots):
        if s.filled:
            pool.land_slot(k, image, k)
    for region in pool.regions():
        low, high = region.base_address, region.base_address + region.memory.nbytes
        for tables, size in ((region.a_tables, "a_bytes"), (region.b_tables, "b_bytes")):
            for i, e in enumerate(region.layout.entries):
                for ptr in (int(p) for p in tables[i]):
                    assert ptr == 0 or low <= ptr and ptr + getattr(e, size) <= high


JSON_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
    st.lists(st.integers(-4, 4), max_size=3), st.dictionaries(st.text(max_size=4),
                                                              st.integers(), max_size=2))


def mutate_json(value: Any, data: st.DataObject) -> Any:
    """`value` with one randomly chosen leaf (or subtree) replaced."""
    if isinstance(value, dict) and value and data.draw(st.booleans()):
        key = data.draw(st.sampled_from(sorted(value)))
        return {**value, key: mutate_json(value[key], data)}
    if isinstance(value, list) and value and data.draw(st.booleans()):
        i = data.draw(st.integers(0, len(value) - 1))
        return [*value[:i], mutate_json(value[i], data), *value[i + 1:]]
    return data.draw(JSON_VALUES)


@pytest.mark.slow  # 100 fuzzed images: 2 to 4 s
@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_images_never_escape(expert_image: Path, tmp_path: Path,
                                    data: st.DataObject) -> None:
    """Mutated metadata, headers and tables: PoolImage.open raises FormatError or gives an image
    whose every slot lands with every pointer inside the pool."""

    def edit(doc: dict[str, Any], buffer: bytearray) -> None:
        # Tables first, while the header still says where they are; then the header.
        for _ in range(data.draw(st.integers(0, 2))):
            name = data.draw(st.sampled_from(["a_offsets", "b_offsets", "expert_a_offsets",
                                              "expert_b_offsets", "ranks", "scales"]))
            count = int(np.prod(doc[name]["shape"]))
            value = (data.draw(st.floats(allow_nan=True, allow_infinity=True, width=32))
                     if name == "scales" else data.draw(st.integers(-2**31, 2**31 - 1)))
            poke(doc, buffer, name, data.draw(st.integers(0, count - 1)), value)
        for _ in range(data.draw(st.integers(0, 2))):
            meta = doc["__metadata__"]
            if data.draw(st.booleans()):
                key = data.draw(st.sampled_from(sorted(meta) + ["metrale.overlays"]))
                try:
                    value = json.loads(meta.get(key, "{}"))
                except json.JSONDecodeError:
                    value = meta[key]
                meta[key] = json.dumps(mutate_json(value, data))
            else:
                name = data.draw(st.sampled_from(sorted(k for k in doc if k != "__metadata__")))
                doc[name] = mutate_json(doc[name], data)

    path = rewrite(expert_image, tmp_path / "fuzz.safetensors", edit)
    try:
        image = PoolImage.open(path)
    except FormatError:
        return
    land_everything(image)
