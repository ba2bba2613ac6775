"""`metrale unpack`: a slot back as a PEFT adapter that PEFT itself loads onto the tiny model, with
forward deltas equal to the original adapter's within BF16 tolerance; atomic, no overwrite."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support.cli_runner import metrale
from tests.support.peft_factory import DENSE_FAMILIES, TINY_MODELS, AdapterTruth

pytestmark = pytest.mark.slow
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


def _load_unpacked(model_name: str, path: Path, seed: int = 0) -> object:
    from peft import PeftModel

    model = TINY_MODELS[model_name].build_model(seed)
    return PeftModel.from_pretrained(model, str(path)).eval()


def _assert_deltas_equal(truth: AdapterTruth, unpacked: object) -> int:
    rng = np.random.default_rng(0)
    compared = 0
    for path, m in truth.modules.items():
        layer = unpacked.base_model.model.get_submodule(path)  # type: ignore[attr-defined]
        x = torch.from_numpy(rng.standard_normal((5, m.base_in)).astype(np.float32))
        want = truth.forward_delta(path, x).numpy()
        with torch.no_grad():
            got = (layer(x) - layer.base_layer(x)).float().numpy()
        np.testing.assert_allclose(got, want, rtol=0, atol=3e-2 * np.abs(want).max(),
                                   err_msg=path)
        compared += 1
    return compared


CASES = {
    "dense": ("llama", {"r": 4, "lora_alpha": 8, "target_modules": ATTN + MLP}),
    "hybrid": ("qwen3_next", {"r": 8, "lora_alpha": 16, "use_rslora": True, "dtype": "bf16",
                              "target_modules": ["q_proj", "v_proj", "out_proj"],
                              "rank_pattern": {"v_proj": 2, "layers.2.linear_attn.out_proj": 6},
                              "alpha_pattern": {"q_proj": 5}}),
    "moe attention": ("qwen3_moe", {"r": 4, "lora_alpha": 8, "target_modules": ATTN}),
    "vl": ("qwen3_5_vl", {"r": 4, "lora_alpha": 8, "target_modules": ATTN + ["out_proj"]}),
    # The language model of a wrapper whose tower the plain suffixes would reach too.
    "gemma3 vl": ("gemma3_vl", {"r": 4, "lora_alpha": 8, "target_modules":
                                r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|"
                                r"up_proj|down_proj)"}),
    "mistral3 vl": ("mistral3_vl", {"r": 4, "lora_alpha": 8, "target_modules":
                                    r".*language_model.*\.(q_proj|v_proj|down_proj)"}),
    # llama4's wrapper keeps its text model at `language_model.model.layers.N`; the dense
    # layers' MLP and the MoE layers' shared expert.
    "llama4 vl": ("llama4_vl", {"r": 4, "lora_alpha": 8, "target_modules":
                                r".*language_model.*\.(q_proj|o_proj|gate_proj|down_proj)"}),
    # Every layer kind of Gemma 4's language model (sliding, full at its own widths, KV-shared
    # with a double-wide MLP), the per-layer input's projections too.
    "gemma4 vl": ("gemma4_vl", {"r": 4, "lora_alpha": 8, "dtype": "bf16"}),
}


def _round_trips(truth: AdapterTruth, model_name: str, tmp_path: Path) -> None:
    """`truth` packed, unpacked, and loaded by PEFT onto the same base with its own deltas;
    repacked, the unpacked adapter is byte for byte the slot it came from."""
    image = tmp_path / "pool.safetensors"
    packed = metrale("pack", f"x={truth.path}", "--max-loras", 2, "--out", image)
    assert packed.code == 0, packed.stderr
    out = tmp_path / "back"
    result = metrale("unpack", image, "--name", "x", out, "--json")
    assert result.code == 0, result.stderr
    assert result.json()["modules"] == len(truth.modules)
    assert _assert_deltas_equal(truth, _load_unpacked(model_name, out)) == len(truth.modules)
    assert metrale("verify", image, f"x={out}").code == 0


@pytest.mark.parametrize("model", ["gemma3_vl", "llama4_vl"])
def test_peft_loads_a_synthetic_adapter_onto_a_wrapper(tmp_path: Path, model: str) -> None:
    """synth on a vision-language wrapper's config writes its keys where unpack does, under the
    language model: PEFT loads every tensor onto the wrapper as written (it found none under
    `model.layers`)."""
    from peft import PeftModel
    from safetensors.torch import load_file

    from tests.support.peft_factory import write_base_config

    base = write_base_config(model, tmp_path / "base")
    adapter = tmp_path / "adapter"
    done = metrale("synth", adapter, "-m", base, "--modules", "q_proj,gate_proj", "-r", 4,
                   "--dtype", "f32")
    assert done.code == 0, done.stderr
    loaded = PeftModel.from_pretrained(TINY_MODELS[model].build_model(0), str(adapter))
    written = load_file(str(adapter / "adapter_model.safetensors"))
    params = dict(loaded.named_parameters())
    for key, value in written.items():
        name = re.sub(r"\.lora_([AB])\.weight$", r".lora_\1.default.weight", key)
        assert torch.equal(params[name].detach(), value), key


@pytest.mark.parametrize("case", sorted(CASES))
def test_peft_loads_the_unpacked_slot(peft_zoo, tmp_path: Path, case: str) -> None:
    model, kwargs = CASES[case]
    truth = peft_zoo.adapter(model, **kwargs)
    _round_trips(truth, truth.model_name, tmp_path)


@pytest.mark.parametrize("model", [*DENSE_FAMILIES, "phi3", "glm4", "starcoder2", "gpt_oss",
                                   "deepseek_v2", "deepseek_v3", "qwen2_moe", "olmoe",
                                   "glm4_moe", "nemotron_h", "llama4", "phimoe",
                                   "granitemoe", "gemma4", "gemma4_moe"])
def test_every_family_round_trips_through_peft(peft_zoo, tmp_path: Path, model: str) -> None:
    """Each family's PEFT adapter over every LoRA-able projection of its layers (phi3's fused
    qkv_proj and gate_up_proj, glm4's gate_up_proj, gpt_oss's attention beside its experts,
    gemma4's modules at each layer's own widths):
    packed, unpacked, and loaded by PEFT onto the same base with PEFT's own deltas."""
    truth = peft_zoo.adapter(model, r=4, lora_alpha=8, dtype="bf16")
    _round_trips(truth, model, tmp_path)


@pytest.mark.parametrize("model", ["deepseek_v2", "deepseek_v3", "glm4_moe"])
def test_shared_experts_of_an_adapter_made_before_peft_s_moe_rewrite(
        tmp_path: Path, model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """PEFT 0.21 with transformers 5 turns gate/up/down targets on these types into expert LoRA
    and adapts neither the dense MLP nor the shared experts; an adapter made before that rewrite
    (transformers 4) carries both, each at its own width (the shared experts'
    `n_shared_experts * moe_intermediate_size`). Made and loaded with the rewrite off, as then:
    packed, unpacked, and loaded by PEFT with the original's deltas."""
    import peft.utils.transformers_weight_conversion as conversion

    from tests.support.peft_factory import make_adapter

    monkeypatch.setattr(conversion, "_convert_peft_config_moe", lambda *args: None)
    truth = make_adapter(model, tmp_path / "adapter", r=4, lora_alpha=8, dtype="bf16",
                         target_modules=MLP)
    assert {p.split(".", 3)[3] for p in truth.modules} == {
        *(f"mlp.{m}" for m in MLP), *(f"mlp.shared_experts.{m}" for m in MLP)}
    _round_trips(truth, model, tmp_path)


def _param_deltas(peft_model: object) -> dict[str, np.ndarray]:
    """Every target_parameters wrapper's delta [E, out, in] by parameter path, from PEFT."""
    from peft.tuners.lora.layer import ParamWrapper

    found = {}
    for name, mod in peft_model.named_modules():  # type: ignore[attr-defined]
        if isinstance(mod, ParamWrapper) and "default" in mod.lora_A:
            path = name.removeprefix("base_model.model.")
            while path.endswith(".base_layer"):
                path = path.removesuffix(".base_layer")
            with torch.no_grad():
                delta = mod.get_delta_weight("default").float().numpy()
            found[f"{path}.{mod.parameter_name}"] = delta.reshape(-1, *delta.shape[-2:])
    return found


EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"]


@pytest.mark.parametrize("model", ["qwen3_moe", "qwen3_next", "deepseek_v3", "qwen2_moe",
                                   "olmoe", "glm4_moe", "phimoe", "granitemoe", "gpt_oss",
                                   "llama4"])
def test_peft_loads_unpacked_expert_lora(peft_zoo, tmp_path: Path, model: str) -> None:
    """Fused experts and the router, beside attention modules: PEFT's per-expert deltas of the
    unpacked adapter equal the original's (phimoe's and gpt_oss's router is `mlp.router`, not
    the pool's `mlp.gate`, and granitemoe's experts sit under `block_sparse_moe`: their experts
    alone; gpt_oss's interleave gate and up in (E, in, out) experts; llama4's, (E, in, out)
    too, PEFT wraps with A and B swapped)."""
    params = {"phimoe": EXPERT_PARAMS[:2], "gpt_oss": EXPERT_PARAMS[:2],
              "llama4": [p.replace("mlp.", "feed_forward.") for p in EXPERT_PARAMS[:2]],
              "granitemoe": [p.replace("mlp.", "block_sparse_moe.") for p in EXPERT_PARAMS[:2]],
              }.get(model, EXPERT_PARAMS)
    truth = peft_zoo.adapter(model, r=4, lora_alpha=8, target_modules=["q_proj"],
                             target_parameters=params)
    image = tmp_path / "pool.safetensors"
    assert metrale("pack", f"m={truth.path}", "--max-loras", 1, "--experts", "--out",
                   image).code == 0
    out = tmp_path / "back"
    result = metrale("unpack", image, "--slot", 0, out)
    assert result.code == 0, result.stderr
    unpacked = _load_unpacked(truth.model_name, out)
    assert _assert_deltas_equal(truth, unpacked) == len(truth.modules)
    got = _param_deltas(unpacked)
    assert sorted(got) == sorted(truth.params)
    for path, p in truth.params.items():
        want = p.expert_deltas.numpy()
        np.testing.assert_allclose(got[path], want, rtol=0, atol=3e-2 * np.abs(want).max(),
                                   err_msg=path)
    assert metrale("verify", image, f"m={out}").code == 0


def test_per_expert_lora_unpacks_block_diagonal(peft_zoo, tmp_path: Path) -> None:
    """A transformers-4 per-expert adapter: gate and up have their own A, so the fused gate_up
    is block-diagonal over [gate; up] at twice the rank (a rank and alpha pattern)."""
    truth = peft_zoo.hand_v4("qwen3_moe", r=4, alpha=8, include_router=True)
    image = tmp_path / "pool.safetensors"
    assert metrale("pack", f"v4={truth.path}", "--max-loras", 1, "--experts", "--out",
                   image).code == 0
    out = tmp_path / "back"
    assert metrale("unpack", image, "--slot", 0, out).code == 0
    config = json.loads((out / "adapter_config.json").read_text())
    expert_rank = metrale("show", image, "--json").json()["experts"]["max_rank"]
    assert config["rank_pattern"]["mlp.experts.gate_up_proj"] == 2 * expert_rank
    # Every pattern keeps PEFT's scaling at the slot's scale.
    scale = config["lora_alpha"] / config["r"]
    assert all(config["alpha_pattern"][k] == pytest.approx(scale * r)
               for k, r in config["rank_pattern"].items())
    got = _param_deltas(_load_unpacked(truth.model_name, out))
    inter = truth.expert_intermediate
    compared = 0
    for (layer, expert, leaf), pair in truth.experts.items():
        param = "down_proj" if leaf == "down_proj" else "gate_up_proj"
        delta = got[f"model.layers.{layer}.mlp.experts.{param}"][expert]
        rows = {"gate_proj": slice(0, inter), "up_proj": slice(inter, 2 * inter),
                "down_proj": slice(None)}[leaf]
        want = pair.delta_weight.numpy()
        np.testing.assert_allclose(delta[rows], want, rtol=0, atol=3e-2 * np.abs(want).max(),
                                   err_msg=str((layer, expert, leaf)))
        compared += 1
    for layer, pair in truth.routers.items():
        want = pair.delta_weight.numpy()
        np.testing.assert_allclose(got[f"model.layers.{layer}.mlp.gate.weight"][0], want,
                                   rtol=0, atol=3e-2 * np.abs(want).max())
    assert compared == len(truth.experts) > 0 and truth.routers


def test_overlays_come_back_as_trainable_tokens(peft_zoo, tmp_path: Path) -> None:
    ids = [0, 5, 7, 127]
    truth = peft_zoo.adapter("llama", r=4, lora_alpha=8, target_modules=["q_proj"],
                             trainable_token_indices=ids)
    image = tmp_path / "pool.safetensors"
    assert metrale("pack", f"t={truth.path}", "--max-loras", 1, "--out", image).code == 0
    out = tmp_path / "back"
    assert metrale("unpack", image, "--slot", 0, out).code == 0
    assert json.loads((out / "adapter_config.json").read_text())[
        "trainable_token_indices"] == {"embed_tokens": ids}
    unpacked = _load_unpacked(truth.model_name, out)
    embed = unpacked.base_model.model.model.embed_tokens  # type: ignore[attr-defined]
    want = truth._peft_model.base_model.model.model.embed_tokens
    with torch.no_grad():
        np.testing.assert_array_equal(embed(torch.tensor([ids])).numpy(),
                                      want(torch.tensor([ids])).numpy())
    assert _assert_deltas_equal(truth, unpacked) == len(truth.modules)


def test_no_overwrite_and_bad_slots(peft_zoo, tmp_path: Path) -> None:
    truth = peft_zoo.adapter("llama", r=4, lora_alpha=8, target_modules=["q_proj"])
    image = tmp_path / "pool.safetensors"
    assert metrale("pack", f"x={truth.path}", "--max-loras", 2, "--out", image).code == 0
    out = tmp_path / "back"
    out.mkdir()
    (out / "keep").write_text("mine")
    refused = metrale("unpack", image, "--slot", 0, out)
    assert refused.code == 2 and "--force" in refused.stderr
    assert (out / "keep").read_text() == "mine"
    # --force replaces a directory of unpack's own files only: the user's file is no such file.
    forced = metrale("unpack", image, "--slot", 0, out, "--force")
    assert forced.code == 2 and forced.stderr.strip() == (
        f"error: {out} holds keep, which metrale does not write there; --force replaces only "
        "a directory of metrale's own outputs"), forced.stderr
    assert (out / "keep").read_text() == "mine"
    (out / "keep").unlink()
    assert metrale("unpack", image, "--slot", 0, out, "--force").code == 0
    assert metrale("unpack", image, "--slot", 0, out, "--force").code == 0  # over its own
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json",
                                                     "adapter_model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".back")]
    for args, message in ((["--slot", 1], "holds no adapter"), (["--slot", 2], "outside"),
                          (["--name", "y"], "(it holds: x)"), ([], "exactly one of"),
                          # The empty slot 1's name: it wrote an adapter of 0 modules, exit 0.
                          (["--name", ""], "holds '' (it holds: x)")):
        result = metrale("unpack", image, tmp_path / "other", *args)
        assert result.code == 2 and message in result.stderr, result.stderr
        assert result.stderr.count("\n") == 1


def _packed(peft_zoo, tmp_path: Path) -> Path:
    truth = peft_zoo.adapter("llama", r=4, lora_alpha=8, target_modules=["q_proj"])
    image = tmp_path / "pool.safetensors"
    assert metrale("pack", f"x={truth.path}", "--max-loras", 2, "--out", image).code == 0
    return image


# `metrale unpack IMAGE --slot 0 OUT`, in its own process, with another writer creating OUT
# (holding a file of its own) after unpack has found OUT absent and before it publishes.
RACING = """
import sys
from pathlib import Path
import metrale_cli.image.unpack as unpack
from metrale_cli.cli.app import main

build = unpack.adapter_tensors
def slipped_in(*args):
    out = Path(sys.argv[-1])
    out.mkdir()
    (out / "theirs").write_text("the other writer's")
    return build(*args)
unpack.adapter_tensors = slipped_in
main()
"""


def test_a_writer_that_slips_in_is_never_replaced(peft_zoo, tmp_path: Path) -> None:
    image = _packed(peft_zoo, tmp_path)
    out = tmp_path / "back"
    done = subprocess.run([sys.executable, "-c", RACING, "unpack", str(image), "--slot", "0",
                           str(out)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "COLUMNS": "100"})
    assert done.returncode == 2, done.stderr
    assert "written meanwhile by another process" in done.stderr
    assert done.stderr.count("\n") == 1
    assert [p.name for p in out.iterdir()] == ["theirs"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".back")]


def test_concurrent_unpacks_one_wins(peft_zoo, tmp_path: Path) -> None:
    image = _packed(peft_zoo, tmp_path)
    out = tmp_path / "back"
    runs = [subprocess.Popen([sys.executable, "-m", "metrale_cli", "unpack", str(image),
                              "--slot", "0", str(out)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for _ in range(4)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in runs]  # type: ignore[union-attr]
    assert sorted(code for code, _ in results) == [0, 2, 2, 2], results
    assert all("exists" in err and err.count("\n") == 1 for code, err in results if code)
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json",
                                                     "adapter_model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".back")]


# A writer that made its temporary directory and then died by SIGKILL (no cleanup ran).
KILLED = """
import sys, time
from pathlib import Path
from metrale_cli.files.atomic import temp_dir
tmp = temp_dir(Path(sys.argv[1]))
(tmp / "adapter_model.safetensors").write_bytes(b"half")
print(tmp, flush=True)
time.sleep(600)
"""


def test_a_killed_unpack_leaves_a_temp_the_next_sweeps(peft_zoo, tmp_path: Path) -> None:
    image = _packed(peft_zoo, tmp_path)
    out = tmp_path / "back"
    writers = [subprocess.Popen([sys.executable, "-c", KILLED, str(out)],
                                stdout=subprocess.PIPE, text=True) for _ in range(2)]
    dead, alive = (Path(w.stdout.readline().strip()) for w in writers)  # type: ignore[union-attr]
    try:
        assert str(writers[0].pid) in dead.name and dead.is_dir()
        writers[0].send_signal(signal.SIGKILL)
        writers[0].wait(timeout=60)
        assert dead.is_dir()
        assert metrale("unpack", image, "--slot", 0, out).code == 0
        assert not dead.exists()
        assert alive.is_dir()  # its writer still runs: not swept
    finally:
        writers[1].kill()
        writers[1].wait(timeout=60)


# -- hostile input: the alpha form an unpacked adapter is written in -------------------------------


@pytest.mark.parametrize("rslora,alpha", [(True, 181), (False, 16), (True, 8)])
def test_unpack_writes_the_alpha_form_the_adapter_had(tiny: Path, tmp_path: Path, rslora: bool,
                                                      alpha: float) -> None:
    flags = ["--rslora"] if rslora else []
    adapter = tmp_path / "a"
    assert metrale("synth", adapter, "--model", tiny, "--modules", "q_proj", "--rank", 8,
                   "--alpha", alpha, *flags).code == 0
    image = tmp_path / "pool.safetensors"
    assert metrale("pack", adapter, "--model", tiny, "--max-loras", 1, "--out", image).code == 0
    back = tmp_path / "back"
    result = metrale("unpack", image, "--slot", 0, back, "--json")
    assert result.code == 0, result.stderr
    config = json.loads((back / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["use_rslora"]) == (8, alpha, rslora)
    assert result.json()["lora_alpha"] == alpha
    # The same delta: the unpacked adapter packs to the very bytes of the slot.
    assert metrale("verify", image, f"a={back}").code == 0
