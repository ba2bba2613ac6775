"""Token overlays against PEFT: adapters with `trainable_token_indices` made by the real peft
library; the image's overlay rows equal PEFT's saved rows at the right token ids, and PEFT's own
embedding forward returns exactly those rows (the rows replace, they do not add)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from metrale_cli.image.pool_image import PoolImage
from tests.support.cli_runner import metrale
from tests.support.hostile_inputs import copy_adapter

pytestmark = pytest.mark.slow
DELTA = "token_adapter.trainable_tokens_delta"


def saved_rows(path: Path) -> dict[str, np.ndarray]:
    """table -> PEFT's saved `trainable_tokens_delta` [n, hidden] (float32)."""
    tensors = load_file(str(path / "adapter_model.safetensors"))
    return {k.split(".")[-3]: v.astype(np.float32) for k, v in tensors.items() if DELTA in k}


def image_rows(image: PoolImage, slot: int) -> dict[str, tuple[np.ndarray, np.ndarray, bool]]:
    assert image.overlay_raw is not None
    raw = image.overlay_raw[slot]
    assert raw is not None
    return {t: (ids, rows, tied) for t, ids, rows, tied in
            zip(raw.tables, raw.tokens, raw.rows, raw.tied_lm_head, strict=True)}


def test_overlay_rows_equal_peft_at_the_token_ids(peft_zoo, tmp_path: Path) -> None:
    ids = [0, 5, 7, 127]
    truth = peft_zoo.adapter("llama", r=4, lora_alpha=8, target_modules=["q_proj"],
                             trainable_token_indices=ids)
    result = metrale("inspect", truth.path, "--json")
    assert result.code == 0, result.stdout
    report = result.json()["adapters"][0]
    assert report["overlay_tokens"] == 4
    assert report["overlays"][0]["table"] == "embed_tokens"
    assert "4 tokens" in metrale("inspect", truth.path).stdout

    out = tmp_path / "pool.safetensors"
    packed = metrale("pack", truth.path, "--max-loras", 2, "--out", out, "--json")
    assert packed.code == 0, packed.stderr
    assert packed.json()["slots"][0]["overlays"][0]["tokens"] == 4
    image = PoolImage.open(out)
    got_ids, got_rows, tied = image_rows(image, 0)["embed_tokens"]
    assert got_ids.tolist() == ids and not tied
    np.testing.assert_array_equal(got_rows, saved_rows(truth.path)["embed_tokens"])
    # PEFT's forward: the embedding of token ids[i] IS row i (index_copy, not base + row).
    embed = truth._peft_model.base_model.model.model.embed_tokens
    with torch.no_grad():
        served = embed(torch.tensor([ids])).numpy()[0]
    np.testing.assert_array_equal(got_rows, served)
    assert image.overlay_raw is not None and image.overlay_raw[1] is None
    # The tensors a reader without metrale uses.
    tensors = load_file(str(out))
    assert tensors["overlay_tokens"].tolist() == ids
    assert tensors["overlay_slots"].tolist() == [0] * 4
    np.testing.assert_array_equal(tensors["overlay_rows"], got_rows)


def test_untied_lm_head_gets_its_own_rows(peft_zoo, tmp_path: Path) -> None:
    truth = peft_zoo.adapter("llama", r=4, lora_alpha=8, target_modules=["q_proj"],
                             trainable_token_indices={"embed_tokens": [1, 2],
                                                      "lm_head": [3, 9]})
    out = tmp_path / "pool.safetensors"
    assert metrale("pack", truth.path, "--max-loras", 1, "--out", out).code == 0
    rows = image_rows(PoolImage.open(out), 0)
    saved = saved_rows(truth.path)
    assert rows["embed_tokens"][0].tolist() == [1, 2]
    assert rows["lm_head"][0].tolist() == [3, 9]
    for table in ("embed_tokens", "lm_head"):
        np.testing.assert_array_equal(rows[table][1], saved[table])


def test_tied_embeddings_overlay_the_head_too(peft_zoo, tmp_path: Path) -> None:
    """PEFT ties the lm_head token adapter to the embedding's when the model ties them."""
    truth = peft_zoo.adapter("llama", r=4, lora_alpha=8, target_modules=["q_proj"],
                             trainable_token_indices=[0, 5, 7])
    base = tmp_path / "tied"
    base.mkdir()
    doc = json.loads((truth.base_dir / "config.json").read_text())
    doc["tie_word_embeddings"] = True
    (base / "config.json").write_text(json.dumps(doc))
    report = metrale("inspect", truth.path, "-m", base, "--json").json()["adapters"][0]
    assert report["overlays"][0]["tied_lm_head"] is True


def test_overlay_audit_vocabulary_and_width(peft_zoo, tmp_path: Path) -> None:
    truth = peft_zoo.adapter("llama", r=4, lora_alpha=8, target_modules=["q_proj"],
                             trainable_token_indices=[0, 5, 7])

    def codes(path: Path, *extra: object) -> set[str]:
        result = metrale("inspect", path, "--json", *extra)
        assert result.code == 1
        return {f["code"] for f in result.json()["adapters"][0]["findings"]
                if f["severity"] == "error"}

    outside = copy_adapter(truth.path, tmp_path / "outside", trainable_token_indices=[0, 5, 128])
    assert "overlay_token_range" in codes(outside)
    fewer = copy_adapter(truth.path, tmp_path / "fewer", trainable_token_indices=[0, 5])
    assert "overlay_shape" in codes(fewer)
    twice = copy_adapter(truth.path, tmp_path / "twice", trainable_token_indices=[0, 5, 5])
    assert "overlay_duplicate_tokens" in codes(twice)
    narrow = tmp_path / "narrow"
    narrow.mkdir()
    doc = json.loads((truth.base_dir / "config.json").read_text())
    doc["hidden_size"] = 32
    (narrow / "config.json").write_text(json.dumps(doc))
    assert "overlay_shape" in codes(truth.path, "-m", narrow)
    result = metrale("pack", outside, "--max-loras", 1)
    assert result.code == 1 and "overlay_token_range" in result.stderr
    assert "Traceback" not in result.stderr


def test_embedding_lora_is_still_refused_precisely(peft_zoo) -> None:
    truth = peft_zoo.adapter("llama", r=4, lora_alpha=8, target_modules=["q_proj",
                                                                         "embed_tokens"])
    result = metrale("inspect", truth.path, "--json")
    assert result.code == 1
    finding = next(f for f in result.json()["adapters"][0]["findings"]
                   if f["code"] == "embedding_lora")
    assert "every row" in finding["message"]


@pytest.mark.parametrize(("field", "value"), [("tied_lm_head", None), ("tied_lm_head", "yes"),
                                              ("mode", "add")])
def test_an_overlay_run_of_the_wrong_shape_is_one_line(peft_zoo, tmp_path: Path, field: str,
                                                      value: object) -> None:
    """A run without its boolean tied_lm_head (or that does not replace rows) is named in one
    line, exit 1, by show and verify, as by PoolImage.open; never an internal error."""
    from metrale_cli.errors import ImageInconsistent
    from metrale_cli.image.format import read_tables
    from tests.support.image_edit import edit_metadata

    truth = peft_zoo.adapter("llama", r=4, lora_alpha=8, target_modules=["q_proj"],
                             trainable_token_indices=[0, 5])
    out = tmp_path / "pool.safetensors"
    assert metrale("pack", truth.path, "--max-loras", 2, "--out", out).code == 0
    doc = read_tables(out).overlay_doc
    assert doc is not None
    run = doc["runs"][0]
    if value is None:
        del run[field]
    else:
        run[field] = value
    edit_metadata(out, "metrale.overlays", json.dumps(doc, separators=(",", ":")))
    for args in (["show", out], ["show", out, "--json"], ["verify", out, truth.path]):
        result = metrale(*args)
        assert result.code == 1, (result.stdout, result.stderr)
        assert result.stderr.startswith(f"error: {out}: overlay run 0: ")
        assert result.stderr.count("\n") == 1
    with pytest.raises(ImageInconsistent, match="overlay run 0: "):
        PoolImage.open(out)
