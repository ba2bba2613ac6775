"""Pool images and the files packed into them that must be refused, not read (issue 25): JSON
keys given twice, metadata nested past the parser, verify passing what show refuses, an
adapter cut short while it is packed, non-finite or flipped weights, images without digests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from metrale_cli.errors import FormatError
from metrale_cli.files.jsondoc import load_json
from metrale_cli.image.pool_image import PoolImage
from tests.support.cli_runner import Result, metrale
from tests.support.hostile_inputs import tiny_model
from tests.support.image_edit import header_text, replace_header


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("integrity"))


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


# -- item 27: a key given twice ------------------------------------------------------------------


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


# -- item 26: metadata nested 100,000 deep -------------------------------------------------------


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
