"""`--model` at weights: shapes from the checkpoint's own safetensors headers (model/weights.py,
files/checkpoint.py). Tiny transformers models saved with `save_pretrained` (one file, and
sharded by `max_shard_size`): a known family's config checked against them, a lying config
refused naming the tensor, a family no row knows (a llama renamed, and transformers' Arcee,
whose MLP has no gate_proj) served from them through inspect, layout, pack, show, verify and
unpack, PEFT loading the result with PEFT's deltas; lying headers refused; nothing reads a
tensor's data (a real-size checkpoint whose data is a sparse hole)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from metrale_cli.model.config import ModelConfig
from metrale_cli.model.families import FAMILIES
from metrale_cli.model.resolve import resolve_model
from tests.support.cli_runner import metrale
from tests.support.header_only import write_header_only
from tests.support.hub_server import Hub, cache_repo, run_metrale, serve
from tests.support.peft_factory import TINY_MODELS

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
TINY = {"vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 96}


def _save(model: Any, out: Path, model_type: str | None = None, **kwargs: Any) -> Path:
    """`model.save_pretrained(out)` (safetensors), its config's model_type renamed if given."""
    model.save_pretrained(out, **kwargs)
    if model_type is not None:
        config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny checkpoints: `llama` (model.safetensors), `sharded` (the same, index and shards),
    `renamed` (the llama, model_type `acme_llm`), `arcee` (transformers' Arcee, a real family
    metrale has no row for)."""
    import torch
    from transformers import ArceeConfig, ArceeForCausalLM, LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("weights")
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    arcee = ArceeForCausalLM(ArceeConfig(**TINY, bos_token_id=1, eos_token_id=2)).eval()
    return {"llama": _save(llama, root / "llama"),
            "sharded": _save(llama, root / "sharded", max_shard_size="20KB"),
            "renamed": _save(llama, root / "renamed", model_type="acme_llm"),
            "arcee": _save(arcee, root / "arcee")}


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _layout(model: Path | str, *args: object) -> dict[str, Any]:
    result = metrale("layout", "-m", model, "--modules", "all", "--max-rank", 8, "--json", *args)
    assert result.code == 0, result.stderr
    return result.json()


def _refused(*args: object) -> str:
    """The one stderr line of a command refused with exit 2."""
    result = metrale(*args)
    assert result.code == 2, (result.code, result.stdout, result.stderr)
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    return result.stderr


# -- a known family: the config checked ---------------------------------------------------------


def test_known_family_is_checked_against_its_weights(saved: dict[str, Path],
                                                      tmp_path: Path) -> None:
    alone = tmp_path / "config-only"
    alone.mkdir()
    shutil.copy(saved["llama"] / "config.json", alone)
    plain = _layout(alone)
    assert plain["model"]["shapes_from"] == "config"
    for name in ("llama", "sharded"):
        checked = _layout(saved[name])
        assert checked["model"]["shapes_from"] == "config checked against weights"
        assert (checked["entries"], checked["slot_bytes"]) == (plain["entries"],
                                                              plain["slot_bytes"])
    # A config.json named in its model directory is the directory.
    named = _layout(saved["sharded"] / "config.json")
    assert named["model"]["shapes_from"] == "config checked against weights"
    shown = metrale("layout", "-m", saved["sharded"], "--modules", "q_proj", "--max-rank", 8)
    assert "(llama): 2 layers; shapes from the config checked against weights" in " ".join(
        shown.stdout.split())
    assert "shapes from" not in metrale("layout", "-m", alone, "--modules", "q_proj",
                                        "--max-rank", 8).stdout


@pytest.mark.parametrize("key, value, message", [
    ("intermediate_size", 80, "model.layers.0.mlp.gate_proj.weight is [96, 64] in the weights "
                              "({}), the config gives [80, 64]"),
    ("num_key_value_heads", 4, "model.layers.0.self_attn.k_proj.weight is [32, 64] in the "
                               "weights ({}), the config gives [64, 64]"),
    ("num_hidden_layers", 3, "model.layers.2.self_attn.q_proj.weight is not in the weights "
                             "({}), where the config's llama layers carry q_proj on layer 2"),
])
@pytest.mark.parametrize("name, weights", [("llama", "model.safetensors"),
                                           ("sharded", "model.safetensors.index.json")])
def test_a_config_that_contradicts_its_weights_names_the_tensor(
        saved: dict[str, Path], tmp_path: Path, name: str, weights: str, key: str, value: int,
        message: str) -> None:
    lying = _copy(saved[name], tmp_path / name)
    config = json.loads((lying / "config.json").read_text())
    (lying / "config.json").write_text(json.dumps({**config, key: value}))
    line = _refused("layout", "-m", lying, "--modules", "q_proj", "--max-rank", 8)
    assert line == f"error: {lying / 'config.json'}: {message.format(lying / weights)}\n"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_every_tiny_family_s_saved_weights_check(name: str, tmp_path: Path) -> None:
    """Each family's row against the checkpoint transformers itself saves (vision-language
    wrappers, fused projections, hybrids and MoE among them): every module it declares is
    there, at the config's shape."""
    TINY_MODELS[name].build_model(0).save_pretrained(tmp_path)
    assert resolve_model(str(tmp_path)).shapes_from == "config checked against weights"


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Mixtral as transformers saves it: 4 experts a layer, one by one (w1, w2, w3)."""
    folder = tmp_path_factory.mktemp("mixtral")
    TINY_MODELS["mixtral"].build_model(0).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("key, value, message", [
    ("num_local_experts", 3, "model.layers.0.block_sparse_moe.experts.3.w1.weight is in the "
                             "weights ({}), past the config's 3 experts"),
    ("num_local_experts", 5, "model.layers.0.block_sparse_moe.experts.4.w1.weight is not in the "
                             "weights ({}), where the config's layer 0 has 5 experts"),
    ("intermediate_size", 40, "model.layers.0.block_sparse_moe.experts.0.w1.weight is [48, 64] "
                              "in the weights ({}), the config gives [40, 64]"),
])
def test_routed_experts_stored_one_by_one_are_checked(mixtral: Path, tmp_path: Path, key: str,
                                                      value: int, message: str) -> None:
    assert _layout(mixtral)["model"]["shapes_from"] == "config checked against weights"
    lying = _copy(mixtral, tmp_path / "mixtral")
    config = json.loads((lying / "config.json").read_text())
    (lying / "config.json").write_text(json.dumps({**config, key: value}))
    line = _refused("layout", "-m", lying, "--modules", "q_proj", "--max-rank", 8)
    assert line == (f"error: {lying / 'config.json'}: "
                    f"{message.format(lying / 'model.safetensors')}\n")


# -- a family no row knows: served from the weights ---------------------------------------------


def test_an_unknown_family_without_weights_says_what_would_serve_it(saved: dict[str, Path],
                                                                     tmp_path: Path) -> None:
    alone = tmp_path / "acme"
    alone.mkdir()
    shutil.copy(saved["renamed"] / "config.json", alone)
    line = _refused("layout", "-m", alone, "--modules", "q_proj", "--max-rank", 8)
    assert "model type 'acme_llm' is not supported: no family row" in line
    assert "its weights would (the model directory holding its model.safetensors" in line
    assert "--online" in line and "supported: llama," in line


@pytest.mark.parametrize("name, modules", [("renamed", ATTN + MLP),
                                           ("arcee", ATTN + ["up_proj", "down_proj"])])
def test_an_unknown_family_takes_its_modules_from_the_weights(
        saved: dict[str, Path], name: str, modules: list[str]) -> None:
    assert json.loads((saved[name] / "config.json").read_text())["model_type"] not in FAMILIES
    doc = _layout(saved[name])
    model = doc["model"]
    assert model["shapes_from"] == "weights"
    assert [m["name"] for m in model["weights_family"]["modules"]] == modules
    # The same bytes as the llama's config gives for the modules they share.
    known = _layout(saved["llama"], "--modules", ",".join(modules))
    assert doc["slot_bytes"] == known["slot_bytes"]
    assert [(e["layer"], e["module"], e["out_dim"], e["in_dim"]) for e in doc["entries"]] == [
        (e["layer"], e["module"], e["out_dim"], e["in_dim"]) for e in known["entries"]]
    shown = metrale("layout", "-m", saved[name], "--modules", "q_proj", "--max-rank", 8)
    assert "2 layers; shapes from the weights" in " ".join(shown.stdout.split())


def test_a_module_is_on_the_layers_whose_weights_carry_it(saved: dict[str, Path],
                                                          tmp_path: Path) -> None:
    """Layer 1 without down_proj, layer 0 with an up_proj of another shape, layer 1's gate_proj
    at another path: down_proj is on layer 0 only, and an adapter on it at layer 1 is refused
    saying why; up_proj and gate_proj are served per group of layers, each at its own shape and
    path; o_proj, at two paths of layer 0, is no module (PEFT adapts both, a slot holds one)."""
    from tests.support.peft_factory import read_safetensors_header

    folder = _copy(saved["renamed"], tmp_path / "acme")
    header = read_safetensors_header(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    del header["model.layers.1.mlp.down_proj.weight"]
    header["model.layers.0.mlp.up_proj.weight"] = ("F32", (50, 64))
    header["model.layers.1.mlp.shared_expert.gate_proj.weight"] = header.pop(
        "model.layers.1.mlp.gate_proj.weight")
    header["model.layers.0.mlp.extra.o_proj.weight"] = ("F32", (64, 64))
    write_header_only(folder / "model.safetensors",
                      [(name, dtype, list(shape)) for name, (dtype, shape) in header.items()])
    doc = _layout(folder)
    modules = [(m["name"], m["path"], m["out"], m["layers"])
               for m in doc["model"]["weights_family"]["modules"]]
    assert [m for m in modules if m[0] in ("gate_proj", "up_proj", "down_proj", "o_proj")] == [
        ("gate_proj", "mlp.gate_proj", ["intermediate_size"], [0]),
        ("gate_proj", "mlp.shared_expert.gate_proj", ["intermediate_size"], [1]),
        ("up_proj", "mlp.up_proj", [50], [0]),
        ("up_proj", "mlp.up_proj", ["intermediate_size"], [1]),
        ("down_proj", "mlp.down_proj", ["hidden_size"], [0])]
    assert [(e["layer"], e["out_dim"]) for e in doc["entries"] if e["module"] == "up_proj"] == [
        (0, 50), (1, 96)]
    # The slot's layer-1 gate_proj is the shared expert's: synth writes it there.
    gated = tmp_path / "gated"
    assert metrale("synth", gated, "-m", folder, "--modules", "gate_proj", "-r", 8).code == 0
    assert metrale("inspect", gated, "-m", folder).code == 0
    adapter = tmp_path / "adapter"
    assert metrale("synth", adapter, "-m", saved["renamed"], "--modules", "down_proj",
                   "-r", 8).code == 0
    result = metrale("inspect", adapter, "-m", folder, "--json")
    assert result.code == 1
    [finding] = [f for f in result.json()["adapters"][0]["findings"]
                 if f["code"] == "module_not_applicable"]
    assert finding["message"] == ("down_proj on layer 1: the base model's weights carry no such "
                                  "module on this layer")


def test_a_family_from_weights_names_widths_the_config_gives_and_counts_the_rest(
        saved: dict[str, Path], tmp_path: Path) -> None:
    """A width the config names keeps its name (TP splits q_proj by heads as for a known
    family); one it does not is kept in elements, and that module's layers are the ones whose
    weights carry it."""
    odd = _copy(saved["renamed"], tmp_path / "odd")
    config = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**config, "intermediate_size": 7}))
    family = _layout(odd)["model"]["weights_family"]
    gate = next(m for m in family["modules"] if m["name"] == "gate_proj")
    q = next(m for m in family["modules"] if m["name"] == "q_proj")
    assert (gate["out"], gate["in"], gate["layers"]) == ([96], "hidden_size", [0, 1])
    assert (q["out"], q["in"]) == (["q_width"], "hidden_size")


def test_a_family_from_weights_round_trips_through_an_image_s_record(
        saved: dict[str, Path]) -> None:
    cfg = resolve_model(str(saved["renamed"]))
    back = ModelConfig.from_summary(json.loads(json.dumps(cfg.summary())))
    assert back == cfg and back.shapes_from == "weights"
    # A record whose modules lie is bad metadata, as any other field is.
    bad = cfg.summary()
    bad["weights_family"]["modules"][0]["out"] = [0]
    with pytest.raises(ValueError, match="not a module of known widths"):
        ModelConfig.from_summary(bad)
    # A module may be declared again on other layers, never twice on one.
    again = cfg.summary()
    modules = again["weights_family"]["modules"]
    modules.append({**modules[0], "path": "elsewhere.q_proj", "layers": [7]})
    assert ModelConfig.from_summary(again).family.modules[-1].on_layers == (7,)
    modules[-1]["layers"] = [1]
    with pytest.raises(ValueError, match="'q_proj' is declared twice on one layer"):
        ModelConfig.from_summary(again)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["renamed", "arcee"])
def test_peft_adapters_on_an_unknown_family_pack_and_unpack_with_peft_s_deltas(
        saved: dict[str, Path], tmp_path: Path, name: str) -> None:
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from peft.tuners.lora.layer import Linear as LoraLinear
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(1)
    base = saved["llama" if name == "renamed" else name]

    def model() -> Any:
        config = AutoConfig.from_pretrained(base)
        return AutoModelForCausalLM.from_pretrained(base, config=config).eval()

    targets = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]
    peft_model = get_peft_model(model(), LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                    init_lora_weights=False))
    peft_model.save_pretrained(tmp_path / "adapter")
    inspected = metrale("inspect", tmp_path / "adapter", "-m", saved[name], "--json")
    assert inspected.code == 0, inspected.stderr
    [report] = inspected.json()["adapters"]
    assert report["servable"] and inspected.json()["model"]["shapes_from"] == "weights"
    image = tmp_path / "pool.safetensors"
    packed = metrale("pack", f"x={tmp_path / 'adapter'}", "-m", saved[name], "--max-loras", 2,
                     "--out", image)
    assert packed.code == 0, packed.stderr
    show = metrale("show", image, "--json").json()
    assert show["model"]["shapes_from"] == "weights"
    assert "shapes from the weights" in " ".join(metrale("show", image).stdout.split())
    assert metrale("verify", image, f"x={tmp_path / 'adapter'}").code == 0
    unpacked = metrale("unpack", image, "--name", "x", tmp_path / "back")
    assert unpacked.code == 0, unpacked.stderr

    def deltas(path: Path) -> dict[str, np.ndarray]:
        loaded = PeftModel.from_pretrained(model(), str(path))
        with torch.no_grad():
            return {n: m.get_delta_weight("default").float().numpy()
                    for n, m in loaded.named_modules() if isinstance(m, LoraLinear)}

    want, got = deltas(tmp_path / "adapter"), deltas(tmp_path / "back")
    assert sorted(got) == sorted(want) and len(want) == 2 * len(targets)
    for key, delta in want.items():
        # The pool holds BF16: within its rounding of A and B.
        np.testing.assert_allclose(got[key], delta, rtol=0, atol=2e-2 * np.abs(delta).max(),
                                   err_msg=key)


# -- lying headers and indexes ------------------------------------------------------------------


def _index(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "model.safetensors.index.json").read_text())


def _write_index(folder: Path, doc: dict[str, Any]) -> None:
    (folder / "model.safetensors.index.json").write_text(json.dumps(doc))


def _lie(kind: str, folder: Path) -> str:
    """Make `folder` (a sharded checkpoint) lie one way; the words its refusal must say."""
    doc = _index(folder)
    shards = sorted(set(doc["weight_map"].values()))
    if kind == "missing shard":
        (folder / shards[1]).unlink()
        return f"names shard '{shards[1]}', which is not in {folder}"
    if kind == "tensor not in its shard":
        name = next(n for n, s in doc["weight_map"].items() if s == shards[0])
        doc["weight_map"][name] = shards[1]
        _write_index(folder, doc)
        return f"names tensor '{name}' in {shards[1]}, whose header does not hold it"
    if kind == "tensor in two shards":
        name = next(n for n, s in doc["weight_map"].items() if s == shards[0])
        write_header_only(folder / "extra.safetensors", [(name, "F32", [2, 2])])
        doc["weight_map"]["extra.tensor"] = "extra.safetensors"
        _write_index(folder, doc)
        return f"tensor '{name}' is in two shards (extra.safetensors and {shards[0]})"
    if kind == "shard outside the folder":
        doc["weight_map"]["x"] = "../model.safetensors"
        _write_index(folder, doc)
        return "shard '../model.safetensors' is not a file name in the index's folder"
    if kind == "absurd shard count":
        doc["weight_map"] = {f"t{i}": f"s{i}.safetensors" for i in range(5000)}
        _write_index(folder, doc)
        return "5,000 tensors in 5,000 shards, above"
    if kind == "shape past the file":
        path = folder / shards[0]
        with path.open("r+b") as f:
            f.truncate(path.stat().st_size - 4)
        return "fall outside the"
    if kind == "name given twice":
        name = next(iter(doc["weight_map"]))
        entry = '{"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}'
        blob = f'{{"{name}": {entry}, "{name}": {entry}}}'.encode()
        (folder / shards[0]).write_bytes(len(blob).to_bytes(8, "little") + blob + bytes(4))
        return f"key '{name}' is given twice in one object"
    raise AssertionError(kind)


LIES = ["missing shard", "tensor not in its shard", "tensor in two shards",
        "shard outside the folder", "absurd shard count", "shape past the file",
        "name given twice"]


@pytest.mark.parametrize("kind", LIES)
@pytest.mark.parametrize("name", ["sharded", "renamed-sharded"])
def test_a_lying_checkpoint_is_refused(saved: dict[str, Path], tmp_path: Path, kind: str,
                                       name: str) -> None:
    folder = _copy(saved["sharded"], tmp_path / name)
    if name == "renamed-sharded":  # no config to fall back on: the weights are the shapes
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "model_type": "acme_llm"}))
    words = _lie(kind, folder)
    line = _refused("layout", "-m", folder, "--modules", "q_proj", "--max-rank", 8)
    assert words in line, line


def test_a_single_file_that_lies_is_refused(saved: dict[str, Path], tmp_path: Path) -> None:
    folder = _copy(saved["renamed"], tmp_path / "renamed")
    weights = folder / "model.safetensors"
    with weights.open("r+b") as f:
        f.truncate(weights.stat().st_size - 2)
    line = _refused("layout", "-m", folder, "--modules", "q_proj", "--max-rank", 8)
    assert str(weights) in line


def test_weights_without_a_decoder_stack_of_the_config_s_layers(saved: dict[str, Path],
                                                                tmp_path: Path) -> None:
    folder = _copy(saved["renamed"], tmp_path / "renamed")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 5}))
    line = _refused("layout", "-m", folder, "--modules", "q_proj", "--max-rank", 8)
    assert ("no decoder stack in the weights" in line
            and "with the config's 5 layers (layers per stack: model.layers: 2)" in line)


def test_absurd_layer_numbers_in_names_are_not_layers(saved: dict[str, Path],
                                                      tmp_path: Path) -> None:
    """A name whose layer number has thousands of digits (int() refuses 4,300) or is past the
    config's layers is no decoder layer's: the family is read from the others."""
    folder = _copy(saved["renamed"], tmp_path / "renamed")
    doc = _layout(folder)
    (folder / "model.safetensors").unlink()
    tensors = [(f"model.layers.{n}.{m['path']}.weight", "F32", [e["out_dim"], e["in_dim"]])
               for m in doc["model"]["weights_family"]["modules"] for n in (0, 1)
               for e in doc["entries"] if (e["layer"], e["module"]) == (n, m["name"])]
    tensors += [("model.layers." + "9" * 5000 + ".self_attn.q_proj.weight", "F32", [1, 1]),
                ("model.layers.99999999.mlp.w9.weight", "F32", [1, 1])]
    write_header_only(folder / "model.safetensors", tensors)
    again = _layout(folder)
    assert again["model"]["weights_family"] == doc["model"]["weights_family"]


@pytest.mark.parametrize("names, words", [
    (["transformer.h.{n}.attn.c_attn.weight"],
     "no decoder stack in the weights ({}) with the config's 2 layers (layers per stack: none)"),
    (["model.layers.{n}.attn.c_attn.weight", "model.layers.{n}.mlp.experts.0.up_proj.weight"],
     "model type 'acme_llm' is not one metrale knows, and its weights ({}) hold no "
     "decoder-layer projection it pools (model.layers.N.<path>.weight, 2-D, named one of q_proj"),
])
def test_weights_with_nothing_metrale_pools_are_refused(saved: dict[str, Path], tmp_path: Path,
                                                        names: list[str], words: str) -> None:
    folder = tmp_path / "acme"
    folder.mkdir()
    shutil.copy(saved["renamed"] / "config.json", folder)
    write_header_only(folder / "model.safetensors", [
        (name.format(n=n), "F32", [8, 8]) for name in names for n in (0, 1)])
    line = _refused("layout", "-m", folder, "--modules", "q_proj", "--max-rank", 8)
    assert words.format(folder / "model.safetensors") in line, line


@pytest.mark.parametrize("name", ["model.safetensors", "model.safetensors.index.json",
                                  "model-00002-of-00014.safetensors"])
def test_a_checkpoint_file_that_is_a_fifo_says_so(saved: dict[str, Path], tmp_path: Path,
                                                 name: str) -> None:
    """Reading it would block: refused by what it is, never opened."""
    folder = _copy(saved["sharded" if "-of-" in name or "index" in name else "llama"],
                   tmp_path / "model")
    (folder / name).unlink(missing_ok=True)
    if name == "model.safetensors":
        (folder / "model.safetensors.index.json").unlink(missing_ok=True)
    os.mkfifo(folder / name)
    line = _refused("layout", "-m", folder, "--modules", "q_proj", "--max-rank", 8)
    assert line == f"error: {folder / name}: a FIFO, not a regular file\n"


# -- real sizes, no data ------------------------------------------------------------------------


def test_a_real_size_checkpoint_is_read_from_its_headers_alone(tmp_path: Path) -> None:
    """Llama 3.1 8B's decoder at full size (15 GB of BF16) as a sparse hole: the data is never
    read, and the checked layout is the preset's."""
    from metrale_cli.model.config import find_preset

    preset = find_preset("llama-3.1-8b")
    assert preset is not None
    cfg = ModelConfig.from_dict(preset.config)
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_width, cfg.kv_width
    per_layer = {"self_attn.q_proj": [q, h], "self_attn.k_proj": [kv, h],
                 "self_attn.v_proj": [kv, h], "self_attn.o_proj": [h, q],
                 "mlp.gate_proj": [i, h], "mlp.up_proj": [i, h], "mlp.down_proj": [h, i],
                 "input_layernorm": [h], "post_attention_layernorm": [h]}
    tensors = [("model.embed_tokens.weight", "BF16", [cfg.vocab_size, h])]
    tensors += [(f"model.layers.{n}.{path}.weight", "BF16", shape)
                for n in range(cfg.num_hidden_layers) for path, shape in per_layer.items()]
    folder = tmp_path / "llama-8b"
    folder.mkdir()
    size = write_header_only(folder / "model.safetensors", tensors)
    assert size > 15e9
    (folder / "config.json").write_text(json.dumps(preset.config))
    doc = _layout(folder)
    assert doc["model"]["shapes_from"] == "config checked against weights"
    assert doc["entries"] == _layout("llama-3.1-8b")["entries"]


# -- the hub cache -----------------------------------------------------------------------------


@pytest.fixture
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("METRALE_ONLINE", raising=False)
    return tmp_path / "hf" / "hub"


def test_a_cached_snapshot_is_weights(saved: dict[str, Path], hf_cache: Path) -> None:
    cache_repo(hf_cache, "acme/llm", saved["renamed"])
    cache_repo(hf_cache, "acme/sharded", saved["sharded"])
    doc = _layout("acme/llm")
    assert (doc["model"]["source"], doc["model"]["shapes_from"]) == ("acme/llm", "weights")
    assert _layout("acme/sharded")["model"]["shapes_from"] == "config checked against weights"


def test_a_cached_index_without_its_shards_needs_online(saved: dict[str, Path],
                                                        hf_cache: Path, tmp_path: Path) -> None:
    partial = tmp_path / "partial"
    partial.mkdir()
    for name in ("config.json", "model.safetensors.index.json"):
        shutil.copy(saved["sharded"] / name, partial)
    cache_repo(hf_cache, "acme/partial", partial)
    line = _refused("layout", "-m", "acme/partial", "--modules", "q_proj", "--max-rank", 8)
    assert "acme/partial: model.safetensors.index.json names model-0000" in line
    assert "pass --online to read its header from the hub" in line


# -- the hub, online: the index downloaded, each shard's header by ranged reads -----------------


@pytest.mark.proc
def test_online_weights_are_headers_only(saved: dict[str, Path], tmp_path: Path) -> None:
    hub = Hub()
    hub.add("acme/sharded", saved["sharded"])
    hub.add("acme/llm", saved["renamed"])
    with serve(hub):
        for repo, shapes in (("acme/sharded", "config checked against weights"),
                             ("acme/llm", "weights")):
            cache = tmp_path / repo.replace("/", "-")
            done = run_metrale(hub, cache, "layout", "-m", repo, "--online", "--modules", "all",
                               "--max-rank", 8, "--json")
            assert done.returncode == 0, done.stderr
            assert json.loads(done.stdout)["model"]["shapes_from"] == shapes
            files = hub.repos[repo]
            for name, data in files.items():
                if name.endswith(".safetensors"):
                    # Exactly the 8-byte length and the header: never a tensor's byte.
                    header = 8 + int.from_bytes(data[:8], "little")
                    assert hub.served[(repo, name)] == header < len(data), name
            assert not list(cache.rglob("*.safetensors"))
