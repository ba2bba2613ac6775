"""The audit against adapters made by the real peft library on tiny models of every supported
model type: metrale must report exactly PEFT's per-module r, alpha, scaling and shapes."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from metrale_cli.model.config import ModelConfig
from metrale_cli.model.modules import LoraModule, family_modules
from tests.support.cli_runner import metrale
from tests.support.peft_factory import EXPERT_TARGET_PARAMETERS, TINY_MODELS, AdapterTruth

pytestmark = pytest.mark.slow
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
# A decoder layer's path: `model.layers.N`, a wrapper's `model.language_model.layers.N`, or
# llama4's wrapper's `language_model.model.layers.N`.
_LAYERED = re.compile(
    r"^(?:model\.(?:language_model\.)?|language_model\.model\.)layers\.(\d+)\.(.+)$")


def _pool_module(model: ModelConfig, path: str) -> tuple[int, LoraModule] | None:
    """The (layer, module) whose path in its layer, as the family declares it there, is
    `path`'s (nemotron_h's `mixer.q_proj`, a shared expert's `mlp.shared_expert.gate_proj`)."""
    hit = _LAYERED.match(path)
    if hit is None:
        return None
    layer = int(hit.group(1))
    return next(((layer, m) for m in family_modules(model) if m.applies_to_layer(model, layer)
                 and m.path_in(model, layer) == hit.group(2)), None)


def servable_truth(truth: AdapterTruth) -> dict[tuple[int, str], object]:
    """PEFT's adapted Linears that are pool modules, keyed like inspect's JSON."""
    model = ModelConfig.from_hf(truth.base_dir)
    found = {}
    for path, m in truth.modules.items():
        key = _pool_module(model, path)
        if key is not None:
            found[(key[0], key[1].peft_name)] = m
    return found


def inspect_json(truth: AdapterTruth, *extra: object) -> tuple[int, dict]:
    result = metrale("inspect", truth.path, "--json", *extra)
    assert result.code in (0, 1), result.stderr
    return result.code, result.json()["adapters"][0]


def assert_matches_peft(truth: AdapterTruth, report: dict) -> None:
    want = servable_truth(truth)
    got = {(m["layer"], m["module"]): m for m in report["modules"]}
    assert set(got) == set(want)
    for key, m in want.items():
        g = got[key]
        assert (g["r"], g["alpha"]) == (m.r, m.alpha), key
        assert g["scaling"] == pytest.approx(m.scaling, rel=1e-12), key
        assert tuple(g["a_shape"]) == m.a_shape and tuple(g["b_shape"]) == m.b_shape, key
        assert g["dtype"] == truth.dtype


@pytest.mark.parametrize("model", sorted(TINY_MODELS))
def test_every_model_type_inspects_like_peft(peft_zoo, model: str) -> None:
    """The tiny model's usual targets (attention, GDN, MLP): PEFT's numbers for every pool
    module, and a reason for every module the pool cannot serve."""
    truth = peft_zoo.adapter(model)
    code, report = inspect_json(truth)
    assert_matches_peft(truth, report)
    codes = {f["code"] for f in report["findings"]}
    model = ModelConfig.from_hf(truth.base_dir)
    unservable = [p for p in truth.modules if _pool_module(model, p) is None]
    if unservable or truth.params:
        assert code == 1 and not report["servable"]
        assert codes & {"unservable_module", "expert_lora", "module_not_applicable"}
        messages = " ".join(f["message"] for f in report["findings"])
        for path in unservable:
            leaf = path.rsplit(".", 1)[1]
            assert leaf in messages, (path, messages)
    else:
        assert code == 0 and report["servable"], report["findings"]


@pytest.mark.parametrize("model", ["llama", "qwen3_next", "qwen3_5_vl", "qwen3_5_moe"])
def test_pool_targets_are_servable(peft_zoo, model: str) -> None:
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "out_proj"]
    truth = peft_zoo.adapter(model, r=4, lora_alpha=8, target_modules=targets)
    code, report = inspect_json(truth)
    assert code == 0, report["findings"]
    assert_matches_peft(truth, report)


# PEFT's suffix match reaches each wrapper's vision tower too: (tower, its adapted modules).
VISION_TOWERS = {"gemma3_vl": ("model.vision_tower", 3), "mistral3_vl": ("model.vision_tower", 7),
                 "qwen2_5_vl": ("model.visual", 3), "llama4_vl": ("vision_model", 4)}


@pytest.mark.parametrize("model", sorted(VISION_TOWERS))
def test_targets_reaching_the_vision_tower_are_named(peft_zoo, model: str) -> None:
    """The language model audited exactly as PEFT built it; the tower's modules one finding
    naming the tower and how many of its modules PEFT adapted."""
    truth = peft_zoo.adapter(model, r=4, lora_alpha=8)
    tower, count = VISION_TOWERS[model]
    assert sum(p.startswith(tower + ".") for p in truth.modules) == count
    code, report = inspect_json(truth)
    assert code == 1 and not report["servable"]
    assert_matches_peft(truth, report)
    found = [f for f in report["findings"] if f["message"].startswith(tower + ":")]
    assert len(found) == 1 and f"has {count} adapted modules" in found[0]["message"]
    # Targets that stop at the language model (a regex over its path) are servable.
    lm_only = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
    truth = peft_zoo.adapter(model, r=4, lora_alpha=8, target_modules=lm_only)
    code, report = inspect_json(truth)
    assert code == 0, report["findings"]
    assert_matches_peft(truth, report)


def test_gemma4_all_linear_names_the_tower_and_what_lies_outside_the_layers(
        peft_zoo, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """all-linear on Gemma 4's wrapper: PEFT adapts the vision tower's wrapped Linears
    (`q_proj.linear`) and patch embedder, the vision embedder's projection and the per-layer
    inputs' projection beside the language model; each is one finding, the language model's
    31 pairs (its every layer kind) audited exactly. Without target_modules, PEFT's own default
    for the wrapper (a regex over the language model's q_proj and v_proj) is servable."""
    truth = peft_zoo.adapter("gemma4_vl", r=4, lora_alpha=8, target_modules="all-linear")
    code, report = inspect_json(truth)
    assert code == 1 and not report["servable"]
    assert_matches_peft(truth, report)
    assert len(report["modules"]) == 31
    messages = [f["message"] for f in report["findings"]]
    tower = sum(p.startswith("model.vision_tower.") for p in truth.modules)
    assert tower == 8 and any(m.startswith(
        f"model.vision_tower: the vision tower has {tower} adapted modules (down_proj, "
        "gate_proj, input_proj, k_proj, o_proj, q_proj, up_proj, v_proj)") for m in messages)
    assert any(m.startswith("model.embed_vision.embedding_projection: a multimodal projector")
               for m in messages)
    assert any(m.startswith("model.per_layer_model_projection: the per-layer inputs'")
               for m in messages)
    assert len(messages) == 3, messages
    truth = peft_zoo.adapter("gemma4_vl", r=4, lora_alpha=8, target_modules=None)
    # PEFT writes the default it resolved; a config that leaves it null means the same.
    assert truth.config["target_modules"] == r".*language_model\..*\.(q_proj|v_proj)"
    null = tmp_path / "null"
    shutil.copytree(truth.path, null)
    config = json.loads((null / "adapter_config.json").read_text())
    (null / "adapter_config.json").write_text(json.dumps({**config, "target_modules": None}))
    for path in (truth.path, null):
        result = metrale("inspect", path, "--json")
        assert result.code == 0, result.stdout
        report = result.json()["adapters"][0]
        assert_matches_peft(truth, report)
        assert report["findings"] == []  # the config selects exactly what the file holds
    # q_proj on every layer, v_proj on the one layer that has it (0: sliding, its own KV).
    assert sorted((m["layer"], m["module"]) for m in report["modules"]) == [
        (0, "q_proj"), (0, "v_proj"), (1, "q_proj"), (2, "q_proj"), (3, "q_proj")]


def test_the_llama4_wrapper_audits_as_its_text_model(peft_zoo) -> None:
    """Llama4ForConditionalGeneration's language model (`language_model.model.layers.N`):
    every module, its rank, scaling and shapes, as on Llama4ForCausalLM (the dense layers' MLP
    and the MoE layers' shared expert at their own widths)."""
    lm_only = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
    wrapped = peft_zoo.adapter("llama4_vl", r=4, lora_alpha=8, target_modules=lm_only)
    assert all(p.startswith("language_model.model.layers.") for p in wrapped.modules)
    text = peft_zoo.adapter("llama4", r=4, lora_alpha=8, target_modules=list(_ATTN + _MLP))
    reports = []
    for truth in (wrapped, text):
        code, report = inspect_json(truth)
        assert code == 0, report["findings"]
        assert_matches_peft(truth, report)
        reports.append([{k: m[k] for k in ("layer", "module", "r", "alpha", "scaling",
                                            "a_shape", "b_shape")} for m in report["modules"]])
    assert reports[0] == reports[1] and len(reports[0]) == 28


def test_gemma4_s_experts_and_router_are_named_not_servable(peft_zoo) -> None:
    """Gemma 4's MoE beside its dense MLP: the experts PEFT adapts through target_parameters
    and the router Linear are each one finding saying why the expert pool does not read them;
    the dense MLP and attention beside them audited as PEFT built them."""
    truth = peft_zoo.adapter("gemma4_moe", r=4, lora_alpha=8,
                             target_modules=["q_proj", "gate_proj", "router.proj"],
                             target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    assert truth.params
    code, report = inspect_json(truth, "--experts")
    assert code == 1 and not report["servable"]
    assert_matches_peft(truth, report)
    errors = [f["message"] for f in report["findings"] if f["severity"] == "error"]
    assert sorted(m.split(":")[0] for m in errors) == ["experts on layers 0-3",
                                                       "router.proj on layers 0-3"]
    assert all("the expert pool reads" in m for m in errors)
    # A plain gate_proj reaches the dense MLP, not the experts (no rewrite on gemma4).
    warned = [f["message"] for f in report["findings"] if f["code"] == "moe_rewrite"]
    assert len(warned) == 1 and "reach the dense-MLP and shared-expert projections" in warned[0]
    assert report["expert_pairs"] == 0


def test_gpt_oss_expert_lora_is_read_with_the_opt_in(peft_zoo, monkeypatch) -> None:
    """gpt_oss's fused experts ((E, in, out), gate and up interleaved) are the expert pool's
    with --experts, refused without it; the attention beside them is audited as PEFT built it.
    Its router is `mlp.router`, never the pool's `mlp.gate`: `layout --experts` reserves no
    router entry, so its expert slot is the bytes inspect sizes for an adapter of every
    expert."""
    monkeypatch.delenv("METRALE_LORA_EXPERTS", raising=False)
    truth = peft_zoo.adapter("gpt_oss", r=8, lora_alpha=8, target_modules=["q_proj", "o_proj"],
                             target_parameters=list(EXPERT_TARGET_PARAMETERS))
    assert truth.params
    code, report = inspect_json(truth)
    assert code == 1 and not report["servable"]
    assert any(f["code"] == "expert_lora" and "--experts" in f["message"]
               for f in report["findings"])
    code, report = inspect_json(truth, "--experts")
    assert code == 0 and report["servable"], report["findings"]
    assert_matches_peft(truth, report)
    assert report["expert_pairs"] == 4 * 4 * 3  # layers x experts x gate/up/down
    layout = metrale("layout", "-m", truth.base_dir / "config.json", "--experts",
                     "--max-rank", 8, "--modules", "q_proj,o_proj", "--json").json()
    assert layout["experts"]["n_entries"] == report["expert_pairs"]
    assert layout["experts"]["expert_slot_bytes"] == report["own_expert_slot_bytes"]


def test_rslora_and_patterns_like_peft(peft_zoo) -> None:
    """docs/peft_format.md §1.4's table, checked with PEFT: rank/alpha patterns with rsLoRA."""
    truth = peft_zoo.adapter(
        "llama", r=8, lora_alpha=16, use_rslora=True,
        target_modules=["q_proj", "v_proj", "down_proj"],
        rank_pattern={"v_proj": 4, r"^model\.layers\.1\.self_attn\.q_proj": 2,
                      "layers.0.mlp.down_proj": 16},
        alpha_pattern={"down_proj": 32},
    )
    code, report = inspect_json(truth)
    assert code == 0, report["findings"]
    assert_matches_peft(truth, report)
    got = {(m["layer"], m["module"]): m["scaling"] for m in report["modules"]}
    assert got[(0, "q_proj")] == pytest.approx(5.6569, abs=1e-4)
    assert got[(1, "q_proj")] == pytest.approx(11.3137, abs=1e-4)
    assert got[(0, "down_proj")] == pytest.approx(8.0)


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
def test_dtypes(peft_zoo, dtype: str) -> None:
    truth = peft_zoo.adapter("qwen3", dtype=dtype, r=4, lora_alpha=4,
                             target_modules=["q_proj", "o_proj"])
    code, report = inspect_json(truth)
    assert code == 0
    assert_matches_peft(truth, report)


def test_regex_targets_and_layers_to_transform(peft_zoo) -> None:
    regex = peft_zoo.adapter("qwen3", r=4, lora_alpha=8,
                             target_modules=r".*layers\.1\.(self_attn\.(q|v)_proj|mlp\.up_proj)")
    code, report = inspect_json(regex)
    assert code == 0, report["findings"]
    assert_matches_peft(regex, report)
    assert {(m["layer"], m["module"]) for m in report["modules"]} == {
        (1, "q_proj"), (1, "v_proj"), (1, "up_proj")}
    subset = peft_zoo.adapter("llama", r=4, lora_alpha=8, target_modules=["k_proj", "gate_proj"],
                              layers_to_transform=[1])
    code, report = inspect_json(subset)
    assert code == 0, report["findings"]
    assert_matches_peft(subset, report)
    assert {m["layer"] for m in report["modules"]} == {1}
    assert not [f for f in report["findings"] if f["code"] == "targeted_missing"]


def test_max_rank(peft_zoo) -> None:
    truth = peft_zoo.adapter("llama", r=8, lora_alpha=8, target_modules=["q_proj"])
    code, report = inspect_json(truth, "--max-rank", 4)
    assert code == 1 and "rank_above_max" in {f["code"] for f in report["findings"]}


def test_dora_is_refused(peft_zoo) -> None:
    truth = peft_zoo.adapter("llama", r=4, lora_alpha=8, target_modules=["q_proj"], use_dora=True)
    code, report = inspect_json(truth)
    assert code == 1
    codes = {f["code"] for f in report["findings"] if f["severity"] == "error"}
    assert "dora" in codes


@pytest.mark.parametrize("model", ["qwen3_moe", "qwen3_next", "mixtral"])
def test_expert_lora_is_refused_with_the_reason(peft_zoo, model: str) -> None:
    truth = peft_zoo.adapter(model, r=4, lora_alpha=8, target_modules=["q_proj"],
                             target_parameters=list(EXPERT_TARGET_PARAMETERS))
    code, report = inspect_json(truth)
    assert code == 1
    expert = [f for f in report["findings"] if f["code"] == "expert_lora"]
    assert expert and expert[0]["severity"] == "error"
    assert "routed-expert" in expert[0]["message"]


def test_transformers5_rewrite_is_explained(peft_zoo) -> None:
    """gate/up/down on an MoE model become expert LoRA (PEFT >= 0.19, transformers 5)."""
    truth = peft_zoo.adapter("qwen3_moe", r=4, lora_alpha=8,
                             target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"])
    code, report = inspect_json(truth)
    assert code == 1
    rewrite = [f for f in report["findings"] if f["code"] == "moe_rewrite"]
    assert rewrite and "expert LoRA" in rewrite[0]["message"]


def test_overlapping_patterns_are_reported(peft_zoo) -> None:
    truth = peft_zoo.adapter("llama", r=8, lora_alpha=8, target_modules=["q_proj"],
                             rank_pattern={"q_proj": 4, "layers.0.self_attn.q_proj": 2})
    code, report = inspect_json(truth)
    found = {(f["code"], f["severity"]) for f in report["findings"]}
    # Training took "q_proj" first (rank 4 on layer 0); the saved file's keys are sorted, so
    # PEFT reloading it takes the layer-0 key's rank 2 and refuses the rank-4 tensors.
    assert code == 1 and found == {("pattern_overlap", "warning"),
                                   ("rank_config_mismatch", "error")}, report["findings"]
    mismatch = next(f for f in report["findings"] if f["code"] == "rank_config_mismatch")
    assert mismatch["message"].startswith("q_proj on layer 0: tensors have rank 4")
    # The report serves what the tensors hold, which is what PEFT trained.
    assert_matches_peft(truth, report)


def test_nemotron_h_as_peft_adapts_it(peft_zoo) -> None:
    """PEFT 0.21 on Nemotron-H: its default targets are the attention blocks'; a plain `up_proj`
    reaches the MLP block's and the MoE block's shared experts, each served at its own width;
    it refuses a Mamba `out_proj` outright, so no family module is one."""
    truth = peft_zoo.adapter("nemotron_h", r=4, lora_alpha=8, target_modules=None)
    code, report = inspect_json(truth)
    assert code == 0, report["findings"]
    assert_matches_peft(truth, report)
    assert {(m["layer"], m["module"]) for m in report["modules"]} == {
        (1, "q_proj"), (1, "k_proj"), (1, "v_proj"), (1, "o_proj")}
    truth = peft_zoo.adapter("nemotron_h", r=4, lora_alpha=8, target_modules=["up_proj"])
    assert set(truth.modules) == {"model.layers.2.mixer.up_proj",
                                  "model.layers.3.mixer.shared_experts.up_proj"}
    code, report = inspect_json(truth)
    assert code == 0 and report["servable"], report["findings"]
    assert_matches_peft(truth, report)
    assert {(m["layer"], m["module"], m["b_shape"][0]) for m in report["modules"]} == {
        (2, "up_proj", 96), (3, "up_proj", 24)}
    truth = peft_zoo.adapter("nemotron_h", r=4, lora_alpha=8, target_modules=["in_proj"])
    assert set(truth.modules) == {"model.layers.0.mixer.in_proj"}
    code, report = inspect_json(truth)
    assert code == 1 and any("Mamba-2 input projection" in f["message"]
                             for f in report["findings"])
    with pytest.raises(ValueError, match="incompatible with Mamba"):
        peft_zoo.adapter("nemotron_h", r=4, lora_alpha=8, target_modules=["out_proj"])


def test_llama4_as_peft_adapts_it(peft_zoo) -> None:
    """PEFT 0.21 on Llama 4's text model: a plain `gate_proj` reaches the dense layers' MLP
    (`intermediate_size_mlp` wide) and the MoE layers' shared expert (`intermediate_size`),
    both served, never the fused experts; those, as target_parameters, are the expert pool's
    with --experts ((E, in, out) as gpt_oss's, and PEFT swaps their A and B roles)."""
    truth = peft_zoo.adapter("llama4", r=4, lora_alpha=8, target_modules=["gate_proj"])
    assert set(truth.modules) == {"model.layers.0.feed_forward.gate_proj",
                                  "model.layers.1.feed_forward.shared_expert.gate_proj",
                                  "model.layers.2.feed_forward.gate_proj",
                                  "model.layers.3.feed_forward.shared_expert.gate_proj"}
    code, report = inspect_json(truth)
    assert code == 0 and report["servable"], report["findings"]
    assert_matches_peft(truth, report)
    assert [m["b_shape"][0] for m in report["modules"]] == [96, 40, 96, 40]
    truth = peft_zoo.adapter("llama4", r=8, lora_alpha=8, target_modules=["q_proj"],
                             target_parameters=["feed_forward.experts.gate_up_proj"])
    assert truth.params
    # PEFT swaps in and out on these unmarked (E, in, out) experts: A [E*r, 2I], B [H, E*r].
    assert all(p.a_shape == (4 * 8, 2 * 40) and p.b_shape == (64, 8 * 4)
               for p in truth.params.values())
    code, report = inspect_json(truth, "--experts")
    assert code == 0 and report["servable"], report["findings"]
    assert_matches_peft(truth, report)
    assert report["expert_pairs"] == 2 * 4 * 2  # MoE layers 1, 3 x experts x gate/up
    # The router (`feed_forward.router`) is not the pool's: layout reserves none.
    layout = metrale("layout", "-m", truth.base_dir / "config.json", "--experts",
                     "--max-rank", 8, "--modules", "q_proj", "--json").json()
    assert layout["experts"]["n_entries"] == 2 * 4 * 3
