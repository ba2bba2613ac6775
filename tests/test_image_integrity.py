"""Pool images and the files packed into them that must be refused, not read: JSON keys given
twice, metadata nested past the parser, non-finite or flipped weights; and images without
digests, which still read (verify against show: test_verify.py; an adapter cut short while
packed: test_pack_truncated.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from metrale_cli.errors import FormatError, ImageInconsistent
from metrale_cli.files.jsondoc import load_json
from metrale_cli.image.format import read_tables
from metrale_cli.image.pool_image import PoolImage
from tests.support.cli_runner import Result, metrale
from tests.support.image_edit import (
    header_text,
    replace_header,
    reseal_digest,
    strip_digests,
    write_element,
)


@pytest.fixture
def image(tiny: Path, tmp_path: Path) -> Path:
    """A 2-slot image of the tiny model holding adapter `a` in slot 0."""
    out = tmp_path / "pool.safetensors"
    done = metrale("pack", tiny / "a", "--model", tiny, "--max-loras", 2, "--out", out,
                   "--device", "cpu")
    assert done.code == 0, done.stderr
    return out


def one_line(result: Result, code: int) -> str:
    assert result.code == code, (result.code, result.stdout, result.stderr)
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    return result.stderr


# -- a key given twice -----------------------------------------------------------------------------


def test_a_key_given_twice_is_refused_wherever_json_is_read(tmp_path: Path) -> None:
    for text in (b'{"a": 1, "a": 2}', b'{"x": [{"r": 8, "q": 1, "r": 16}]}'):
        with pytest.raises(FormatError, match=r"f\.json: .*key '[ar]' is given twice"):
            load_json(tmp_path / "f.json", text)
    assert load_json("f", b'{"a": {"a": 1}, "b": [{"a": 2}, {"a": 3}]}') == {
        "a": {"a": 1}, "b": [{"a": 2}, {"a": 3}]}


def test_an_image_header_with_a_key_given_twice_is_refused(image: Path, tmp_path: Path) -> None:
    """The last `metrale.active` won (show said slot 1); a reader keeping the first used 0."""
    header = header_text(image)
    assert b'"metrale.active":"0"' in header
    replace_header(image, header.replace(b'"metrale.active":"0"',
                                         b'"metrale.active":"0","metrale.active":"1"'))
    for args in (["show", image], ["show", image, "--json"],
                 ["unpack", image, "--slot", 0, tmp_path / "out"]):
        line = one_line(metrale(*args), 2)
        assert line.startswith(f"error: {image}: ") and "'metrale.active' is given twice" in line
    with pytest.raises(FormatError, match="'metrale.active' is given twice"):
        PoolImage.open(image)


def test_metadata_json_with_a_key_given_twice_is_refused(image: Path) -> None:
    header = json.loads(header_text(image))
    slots = header["__metadata__"]["metrale.slots"]
    header["__metadata__"]["metrale.slots"] = slots.replace('"rank":2,', '"rank":2,"rank":3,', 1)
    replace_header(image, json.dumps(header, separators=(",", ":")).encode())
    line = one_line(metrale("show", image), 2)
    assert "metrale.slots (JSON)" in line and "'rank' is given twice" in line


def test_configs_with_a_key_given_twice_are_refused(tiny: Path, tmp_path: Path) -> None:
    adapter = tmp_path / "twice"
    adapter.mkdir()
    config = (tiny / "a" / "adapter_config.json").read_text()
    (adapter / "adapter_config.json").write_text(config.replace('"r": 2', '"r": 2, "r": 64', 1))
    (adapter / "adapter_model.safetensors").write_bytes(
        (tiny / "a" / "adapter_model.safetensors").read_bytes())
    assert '"r": 64' in (adapter / "adapter_config.json").read_text()
    line = one_line(metrale("inspect", adapter, "--model", tiny), 2)
    assert "adapter_config.json" in line and "'r' is given twice" in line
    model = tmp_path / "model"
    model.mkdir()
    text = (tiny / "config.json").read_text()
    (model / "config.json").write_text(text.replace('"hidden_size": 32',
                                                    '"hidden_size": 32, "hidden_size": 64'))
    line = one_line(metrale("layout", "--model", model, "--modules", "q_proj",
                            "--max-rank", 8), 2)
    assert "config.json" in line and "'hidden_size' is given twice" in line


# -- metadata nested 100,000 deep ------------------------------------------------------------------


@pytest.mark.parametrize("key", ["metrale.layout", "metrale.slots", "metrale.model",
                                 "metrale.shard"])
def test_metadata_nested_past_the_parser_is_exit_2(image: Path, tmp_path: Path,
                                                   key: str) -> None:
    header = json.loads(header_text(image))
    header["__metadata__"][key] = "[" * 100_000 + "]" * 100_000
    replace_header(image, json.dumps(header, separators=(",", ":")).encode())
    for args in (["show", image], ["unpack", image, "--slot", 0, tmp_path / "out"]):
        line = one_line(metrale(*args), 2)
        assert line == f"error: {image}: not a readable {key} (JSON) (nested too deeply)\n"
    with pytest.raises(FormatError, match="nested too deeply"):
        PoolImage.open(image)


# -- non-finite weights, and a digest per tensor ---------------------------------------------------


def _pool_offset(path: Path, slot: int, part: str = "a") -> int:
    """File offset of entry 0's A (or B) in `slot`."""
    t = read_tables(path)
    offsets = t.a_offsets if part == "a" else t.b_offsets
    return t.tensor("pool").begin + int(offsets[0, slot])


def _flip(path: Path, at: int, mask: int = 0x01) -> None:
    with path.open("r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ mask]))


def test_unpack_refuses_non_finite_weights(image: Path, tmp_path: Path) -> None:
    """pack refuses NaN; unpack wrote it without a word. A crafted image (its digests
    recomputed), so that the finite check itself meets it."""
    t = read_tables(image)
    entry = t.layout.entries[0]
    with image.open("r+b") as f:
        f.seek(_pool_offset(image, 0, "b") + 2 * 3)
        f.write(np.array([0x7FC0], "<u2").tobytes())  # BF16 NaN in B[0, 3]
    reseal_digest(image, "pool")
    line = one_line(metrale("unpack", image, "--slot", 0, tmp_path / "out"), 1)
    assert line == (f"error: {image}: slot 0 (a): layer {entry.layer} "
                    f"{entry.module.peft_name} B holds 1 non-finite values (NaN or infinity); "
                    "pack never writes them, refusing to unpack it\n")
    assert not (tmp_path / "out").exists()


def test_a_flipped_bit_is_caught_by_every_reader(image: Path, tmp_path: Path) -> None:
    # The low bit of a value in slot 1, which holds no adapter: no comparison reads it.
    _flip(image, read_tables(image).tensor("pool").begin + read_tables(image).layout.slot_bytes)
    assert metrale("show", image).code == 0  # the tables are whole; show reads no more
    message = "tensor 'pool' does not match its sha256 digest: its bytes changed after pack"
    line = one_line(metrale("show", image, "--check"), 1)
    assert line.startswith(f"error: {image}: {message}")
    result = metrale("show", image, "--check", "--json")
    assert result.code == 1 and result.json()["problems"][0].startswith(message)
    assert one_line(metrale("unpack", image, "--slot", 0, tmp_path / "out"), 1) == line
    assert not (tmp_path / "out").exists()
    verify = metrale("verify", image, _adapter(image), "--json")
    assert verify.code == 1
    doc = verify.json()
    assert [a["ok"] for a in doc["adapters"]] == [True] and not doc["ok"]
    assert doc["digest_differences"] == [message + " wrote them"]
    assert f"DIFFERS: {message}" in metrale("verify", image, _adapter(image)).stdout
    with pytest.raises(ImageInconsistent, match=message):
        PoolImage.open(image)
    assert PoolImage.open(image, check_contents=False).digests == "tables"


def test_a_flipped_table_bit_is_caught_by_show(image: Path) -> None:
    _flip(image, read_tables(image).tensor("scales").begin, 0x01)
    line = one_line(metrale("show", image), 1)
    assert "tensor 'scales' does not match its sha256 digest" in line


def test_a_fresh_image_carries_digests_and_they_match(image: Path) -> None:
    assert metrale("show", image, "--json").json()["digests"] == "tables"
    checked = metrale("show", image, "--check")
    assert checked.code == 0 and checked.stderr == ""
    assert "sha256 per tensor, every tensor checked" in checked.stdout
    verify = metrale("verify", image, _adapter(image), "--json")
    assert verify.code == 0 and verify.json()["digests"] == "checked"
    assert PoolImage.open(image).digests == "checked"


def test_an_image_without_digests_still_reads_with_a_note(image: Path, tmp_path: Path) -> None:
    """An image pack wrote before pool/1 carried digests (test_pool_image pins that stripping
    them gives that writer's bytes exactly)."""
    strip_digests(image)
    note = (f"note: {image} carries no content digests (written before pool/1 had them): its "
            "bytes are not checked against what pack wrote\n")
    for args in (["show", image], ["show", image, "--check"], ["verify", image, _adapter(image)],
                 ["unpack", image, "--slot", 0, tmp_path / "out"]):
        result = metrale(*args)
        assert result.code == 0 and result.stderr == note, (args, result.stderr)
    assert metrale("show", image, "--json").json()["digests"] == "none"
    assert PoolImage.open(image).digests == "none"


def _adapter(image: Path) -> str:
    """The tiny model's adapter `a`, packed into `image` (the tiny fixture's directory)."""
    return str(read_tables(image).slots_doc[0]["source"])


def test_the_documented_digest_check_runs(image: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = (Path(__file__).parent.parent / "docs" / "pool-format.md").read_text()
    code = re.search(r"```python\n(import hashlib.*?)```", text, re.S).group(1)
    monkeypatch.chdir(image.parent)
    exec(compile(code, "pool-format.md", "exec"), {})
    write_element(image, "scales", (0,), 7.0, reseal=False)
    with pytest.raises(AssertionError):
        exec(compile(code, "pool-format.md", "exec"), {})


# -- a model config the header carries -------------------------------------------------------------


def test_an_image_whose_model_routes_to_no_expert_is_refused_by_every_reader(
        tmp_path: Path) -> None:
    """A config.json with a routed-expert top-k of 0 is refused (no MoE routes a token to no
    expert); an image header carries the model's config, and one recording 0 (packed before
    configs were held to it) loaded in show, verify, unpack and PoolImage.open."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "hidden_size": 32, "num_hidden_layers": 3,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
        "intermediate_size": 48, "num_experts": 4, "moe_intermediate_size": 8,
        "num_experts_per_tok": 2, "mlp_only_layers": [0], "vocab_size": 64}))
    adapter, image = tmp_path / "a", tmp_path / "pool.safetensors"
    assert metrale("synth", adapter, "--model", model, "--modules", "q_proj,v_proj",
                   "--rank", 2).code == 0
    done = metrale("pack", adapter, "--model", model, "--max-loras", 2, "--out", image,
                   "--device", "cpu")
    assert done.code == 0, done.stderr
    assert PoolImage.open(image).layout.model.num_experts_per_tok == 2
    header = header_text(image)
    assert header.count(b'\\"num_experts_per_tok\\":2') == 1
    replace_header(image, header.replace(b'\\"num_experts_per_tok\\":2',
                                         b'\\"num_experts_per_tok\\":0'))
    refusal = (f"error: {image}: its model's num_experts_per_tok is 0: each token goes to no "
               "routed expert, which is no MoE; pack its adapters again with the model's "
               "config\n")
    for args in (["show", image], ["show", image, "--json"], ["verify", image, adapter],
                 ["unpack", image, "--slot", 0, tmp_path / "out"]):
        assert one_line(metrale(*args), 2) == refusal
    assert not (tmp_path / "out").exists()
    with pytest.raises(FormatError, match="num_experts_per_tok is 0"):
        PoolImage.open(image)
