"""vLLM rules the CPU build cannot show running, held to what vLLM 0.32.0's source does (the
GPU build): fused-MoE formats, Mixtral's block name, the output-head limit, the CPU build's
own record. tests/test_engine_vllm.py holds everything the CPU build can run."""

from __future__ import annotations

import ast
import functools
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from metrale_cli.adapters.adapter import Adapter
from metrale_cli.adapters.audit import audit
from metrale_cli.engines.verdict import Verdict
from metrale_cli.engines.vllm import rules as vllm
from metrale_cli.engines.vllm.model import FAMILIES as VLLM_FAMILIES
from metrale_cli.engines.vllm.model import TRANSFORMERS_FALLBACK, VllmFamily
from metrale_cli.model.config import LayerType, ModelConfig
from tests.conftest import VLLM_PYTHON
from tests.support.cli_runner import metrale

FLAGS = vllm.Flags(16, 2)


def _judge(truth, flags: vllm.Flags = FLAGS) -> vllm.EngineVerdict:  # type: ignore[no-untyped-def]
    model = ModelConfig.from_hf(truth.base_dir)
    return vllm.judge(audit(Adapter.load(truth.path), model), model, flags)


# Builds a PEFT MoE model in its call on a cold worker: 3-7 s, past the quick tier's 3 s.
@pytest.mark.slow
def test_peft_3d_experts_on_a_2d_moe_wrapper_are_refused(peft_zoo) -> None:  # type: ignore[no-untyped-def]
    """Qwen3-MoE's vLLM wrapper is 2-D: PEFT's fused expert weights need
    --enable-mixed-moe-lora-format (model_manager._validate_moe_lora_format)."""
    truth = peft_zoo.adapter("qwen3_moe", r=8, lora_alpha=16,
                             target_parameters=["mlp.experts.gate_up_proj",
                                                "mlp.experts.down_proj"])
    verdict = _judge(truth)
    assert verdict.verdict is Verdict.REFUSES and verdict.reason_class == "moe_3d_format"
    assert "--enable-mixed-moe-lora-format" in verdict.reason
    # And the CPU build cannot run the model with LoRA at all.
    assert verdict.elsewhere["cpu_build"]["verdict"] == "unsupported_model"


@pytest.mark.slow  # it builds a PEFT MoE model in its call: 3-15 s on a cold or loaded worker
def test_mixtral_transformers5_expert_weights_reach_nothing(peft_zoo) -> None:  # type: ignore[no-untyped-def]
    """vLLM's Mixtral keeps `block_sparse_moe`; PEFT's transformers-5 `mlp.experts` and
    `mlp.gate` weights pass the name check (their leaf names exist) and are never applied."""
    truth = peft_zoo.adapter("mixtral", r=8, lora_alpha=16,
                             target_modules=["q_proj", "v_proj", "gate"],
                             target_parameters=["mlp.experts.gate_up_proj",
                                                "mlp.experts.down_proj"])
    verdict = _judge(truth)
    assert verdict.verdict is Verdict.DIFFERS
    dropped = {m.module for m in verdict.modules if not m.served}
    assert dropped == {"mlp.experts", "mlp.gate"}
    served = {m.module for m in verdict.modules if m.served}
    assert served == {"self_attn.q_proj", "self_attn.v_proj"}


def test_an_output_head_over_the_lora_limit_is_unsupported(peft_zoo) -> None:  # type: ignore[no-untyped-def]
    truth = peft_zoo.adapter("qwen3", r=8, lora_alpha=16, target_modules=["q_proj"])
    model = ModelConfig.from_hf(truth.base_dir)
    wide = replace(model, vocab_size=vllm.MAX_LORA_VOCAB + 1)
    verdict = vllm.judge(audit(Adapter.load(truth.path), wide), wide, FLAGS)
    assert verdict.verdict is Verdict.UNSUPPORTED_MODEL
    assert verdict.reason_class == "vocab_too_large"
    assert vllm.judge(audit(Adapter.load(truth.path), model), model, FLAGS).serves


def test_moe_rewrite_rank_pattern_sets_the_max_lora_rank(peft_zoo) -> None:  # type: ignore[no-untyped-def]
    """PEFT's MoE rewrite saves `rank_pattern` gate_up at 2r; vLLM checks every pattern value,
    so an r=8 expert adapter needs --max-lora-rank 16, and 8 refuses it."""
    truth = peft_zoo.adapter("qwen3_5_moe", r=8, lora_alpha=16,
                             target_parameters=["mlp.experts.gate_up_proj",
                                                "mlp.experts.down_proj"],
                             rank_pattern={"mlp.experts.gate_up_proj": 16})
    model = ModelConfig.from_hf(truth.base_dir)
    report = audit(Adapter.load(truth.path), model)
    assert vllm.recommend([report], model).flags.max_lora_rank == 16
    refused = vllm.judge(report, model, vllm.Flags(8, 1))
    assert refused.verdict is Verdict.REFUSES and refused.reason_class == "rank_above_max"
    # Qwen3.5-MoE's wrapper is 3-D: the fused weights load.
    assert vllm.judge(report, model, vllm.Flags(16, 1)).serves


def test_tp_shards_follow_vllm_create_lora_weights() -> None:
    """Under TP each GPU holds 1/tp of column B and row A, KV heads replicate past tp, and
    --fully-sharded-loras also splits column A's rank and row B's output."""
    model = ModelConfig.preset("qwen3-8b")
    qkv = next(m for m in vllm.engine_modules(model) if m.path == "self_attn.qkv_proj")
    row = next(m for m in vllm.engine_modules(model) if m.path == "self_attn.o_proj")
    assert qkv.buffers(1, 64, 4, False)[3:] == [("lora_b", (1, 1, 1024, 64)),
                                               ("lora_b", (1, 1, 256, 64)),
                                               ("lora_b", (1, 1, 256, 64))]
    # 8 KV heads over TP 16: one head each, replicated.
    assert qkv.buffers(1, 64, 16, False)[4] == ("lora_b", (1, 1, 128, 64))
    assert qkv.buffers(1, 64, 4, True)[0] == ("lora_a", (1, 1, 16, 4096))
    assert row.buffers(1, 64, 4, False) == [("lora_a", (1, 1, 64, 1024)),
                                            ("lora_b", (1, 1, 4096, 64))]
    assert row.buffers(1, 64, 4, True)[1] == ("lora_b", (1, 1, 1024, 64))


def test_no_embedding_lora_where_the_model_class_declares_none(peft_zoo) -> None:  # type: ignore[no-untyped-def]
    """vLLM's Qwen3-Next (and Qwen2, Mistral) class has no `embedding_modules`: it wraps neither
    embed_tokens nor lm_head (the engine's buffers show it), so an adapter on lm_head names a
    module vLLM does not expect."""
    truth = peft_zoo.adapter("qwen3_next", r=8, lora_alpha=16,
                             target_modules=["q_proj", "lm_head"])
    verdict = _judge(truth)
    assert verdict.verdict is Verdict.REFUSES and verdict.reason_class == "unexpected_module"
    assert "lm_head" in verdict.reason
    model = ModelConfig.from_hf(truth.base_dir)
    assert not {"embed_tokens", "lm_head"} & {m.path for m in vllm.engine_modules(model)}


def test_a_hostile_config_is_a_refusal_not_a_traceback(peft_zoo, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A rank_pattern that is not a mapping, or a rank that is not a number, is what vLLM's
    PEFTHelper fails on: `refuses`, with the field named."""
    import shutil

    truth = peft_zoo.adapter("qwen3", r=8, lora_alpha=16, target_modules=["q_proj"])
    model = ModelConfig.from_hf(truth.base_dir)
    for field, value, says in (("rank_pattern", ["q_proj", 4], "rank_pattern must map"),
                               ("r", "eight", "must be a positive integer")):
        copy = tmp_path / field
        shutil.copytree(truth.path, copy)
        config = json.loads((copy / "adapter_config.json").read_text())
        config[field] = value
        (copy / "adapter_config.json").write_text(json.dumps(config))
        report = audit(Adapter.load(copy), model)
        verdict = vllm.judge(report, model, FLAGS)
        assert verdict.verdict is Verdict.REFUSES and says in verdict.reason
        assert vllm.recommend([report], model).shut_out


# -- every vLLM row held to the source it cites ----------------------------------------------

VLLM_MODELS = (VLLM_PYTHON.parent.parent / "lib" / "python3.11" / "site-packages" / "vllm"
               / "model_executor" / "models")


@functools.cache
def _parsed(file: str) -> ast.Module:
    return ast.parse((VLLM_MODELS / file).read_text())


@functools.cache
def _registry() -> dict[str, tuple[str, str]]:
    """registry.py's tables: architecture -> (module, class), every dict literal of the file."""
    tree = _parsed("registry.py")
    found: dict[str, tuple[str, str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if (isinstance(key, ast.Constant) and isinstance(value, ast.Tuple)
                        and len(value.elts) == 2
                        and all(isinstance(e, ast.Constant) for e in value.elts)):
                    found[key.value] = (value.elts[0].value, value.elts[1].value)
    return found


def _class_chain(file: str, name: str) -> list[tuple[str, ast.ClassDef]]:
    """The class `name` of models/`file` and its bases defined in vLLM's model files (same
    file, or imported from a sibling module), nearest first, each with its file."""
    tree = _parsed(file)
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)
    assert cls is not None, f"vLLM {vllm.VERSION}: no class {name} in models/{file}"
    chain = [(file, cls)]
    for base in cls.bases:
        module = _home(file, tree, base.id) if isinstance(base, ast.Name) else None
        if module is not None:
            chain += _class_chain(module, base.id)
    return chain


def _home(file: str, tree: ast.Module, name: str) -> str | None:
    """The model file that defines class `name` as `file` sees it (itself, or the sibling it
    imports it from); None for anything else (torch, the interfaces)."""
    if any(isinstance(n, ast.ClassDef) and n.name == name for n in tree.body):
        return file
    module = next((node.module.rsplit(".", 1)[-1] for node in tree.body
                   if isinstance(node, ast.ImportFrom) and node.module
                   and any((a.asname or a.name) == name for a in node.names)), "")
    found = VLLM_MODELS / f"{module}.py"
    return f"{module}.py" if module and module != "interfaces" and found.exists() else None


def _declared(chain: list[tuple[str, ast.ClassDef]], attr: str) -> Any:
    """The class attribute `attr` as the nearest class of `chain` assigns it (a literal, or
    another class's attribute `|` a literal), or None where none does."""
    for file, cls in chain:
        for node in cls.body:
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, ast.AnnAssign) and node.value else [])
            if any(isinstance(t, ast.Name) and t.id == attr for t in targets):
                value = node.value  # type: ignore[union-attr]
                if isinstance(value, ast.BinOp) and isinstance(value.left, ast.Attribute) \
                        and isinstance(value.left.value, ast.Name):
                    other = value.left.value.id
                    home = _home(file, _parsed(file), other)
                    assert home is not None, (file, other)
                    return {**_declared(_class_chain(home, other), value.left.attr),
                            **ast.literal_eval(value.right)}
                return ast.literal_eval(value)
    return None


def _bases(chain: list[tuple[str, ast.ClassDef]]) -> set[str]:
    return {b.id for _, cls in chain for b in cls.bases if isinstance(b, ast.Name)}


@pytest.mark.vllm
@pytest.mark.parametrize("row", [*VLLM_FAMILIES.values(), *TRANSFORMERS_FALLBACK.values()],
                         ids=[*VLLM_FAMILIES, *(f"{t}-transformers" for t in
                                                TRANSFORMERS_FALLBACK)])
def test_each_vllm_row_is_the_source_it_cites(row: VllmFamily) -> None:
    """Every architecture of the row is one vLLM's registry builds, its class (and the class
    the row cites, a wrapper's language model) registers LoRA support (SupportsLoRA), and the
    row's embedding modules and packing are what the cited class declares; an architecture
    vLLM does not register is built on the transformers backend."""
    registry = _registry()
    for arch in row.architectures:
        if arch not in registry:
            # A class vLLM does not register that transformers has: registry.py
            # `resolve_model_cls` falls back to the transformers backend (Ministral's, run in
            # tests/test_engine_vllm.py).
            assert "# Fallback to transformers impl" in (VLLM_MODELS / "registry.py").read_text()
            assert row.cites == "transformers/base.py Base", arch
        module, name = registry.get(arch, ("transformers", "TransformersForCausalLM"))
        path = "transformers/base.py" if module == "transformers" else f"{module}.py"
        built = _class_chain(path, "Base" if module == "transformers" else name)
        assert "SupportsLoRA" in _bases(built), f"{arch}: {name} does not support LoRA"
        if module == "transformers":
            assert row.cites == "transformers/base.py Base", arch
        # The wrapper's own packing wins over its language model's.
        _holds_packing(row, _declared(built, "packed_modules_mapping"), arch)
    file, name = row.cites.split()
    cited = _class_chain(file, name)
    assert "SupportsLoRA" in _bases(cited), row.cites
    assert tuple(_declared(cited, "embedding_modules") or ()) == row.embedding_modules
    packed = _declared(cited, "packed_modules_mapping")
    if packed is None:
        # The transformers backend packs at load time (its fusers); tests/test_engine_vllm.py
        # runs OLMo 2 on it.
        assert file == "transformers/base.py", row.cites
        assert dict(row.packed_modules) == {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                                            "gate_up_proj": ("gate_proj", "up_proj")}
    else:
        _holds_packing(row, packed, row.cites)


def _transformers_causal_lm() -> dict[str, str]:
    """transformers' model_type -> causal-LM class, as the transformers beside vLLM maps them
    (models/auto/modeling_auto.py MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, read, not imported)."""
    path = VLLM_MODELS.parents[2] / "transformers" / "models" / "auto" / "modeling_auto.py"
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"
                for t in node.targets):
            pairs = node.value.args[0].elts  # OrderedDict([(model_type, class), ...])
            return {p.elts[0].value: p.elts[1].value for p in pairs
                    if isinstance(p, ast.Tuple) and isinstance(p.elts[1], ast.Constant)}
    raise AssertionError(f"no MODEL_FOR_CAUSAL_LM_MAPPING_NAMES in {path}")


@pytest.mark.vllm
def test_each_family_is_judged_under_the_class_transformers_writes() -> None:
    """A checkpoint transformers saves names transformers' own class (`config.architectures`):
    for every family, vLLM registers it (a row's architecture), or its registry falls back to
    the transformers backend, which TRANSFORMERS_FALLBACK models (phimoe: transformers writes
    PhimoeForCausalLM, vLLM registers PhiMoEForCausalLM)."""
    causal = _transformers_causal_lm()
    registry = _registry()
    for model_type, row in VLLM_FAMILIES.items():
        cls = causal.get(model_type)
        if cls is None or cls in row.architectures:
            continue
        assert cls not in registry, (model_type, cls)
        assert cls in TRANSFORMERS_FALLBACK[model_type].architectures, (model_type, cls)
    for model_type, row in TRANSFORMERS_FALLBACK.items():
        assert row.architectures == (causal[model_type],), model_type


def test_an_unregistered_transformers_class_is_built_on_the_backend(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """registry.py `resolve_model_cls`: where vLLM registers none of `architectures`, the first,
    a class transformers has, is built on the transformers backend (embed_tokens alone,
    transformers' `mlp.router` and `mlp.experts`); one registered class among them wins; a
    class neither has is refused in vLLM's words."""
    import json

    def judged(*archs: str) -> tuple[str, tuple[str, ...] | None]:
        config = {"model_type": "phimoe", "architectures": list(archs), "vocab_size": 128,
                  "hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1,
                  "num_hidden_layers": 2, "intermediate_size": 32, "num_local_experts": 4,
                  "num_experts_per_tok": 2}
        (tmp_path / "config.json").write_text(json.dumps(config))
        model = ModelConfig.from_hf(tmp_path)
        refused = vllm.model_support(model)
        if refused is not None:
            return refused[1], None
        return vllm.family(model).cites, tuple(m.path for m in vllm.engine_modules(model))

    cites, paths = judged("PhimoeForCausalLM")
    assert cites == "transformers/base.py Base"
    assert paths is not None and "mlp.router" in paths and "mlp.experts" in paths
    assert "lm_head" not in paths and "embed_tokens" in paths
    for archs in (("PhimoeForCausalLM", "PhiMoEForCausalLM"), ("PhiMoEForCausalLM",)):
        cites, paths = judged(*archs)
        assert cites == "phimoe.py PhiMoEForCausalLM", archs
        assert paths is not None and "block_sparse_moe.gate" in paths and "lm_head" in paths
    said, paths = judged("PhimoeForCausalLMv2")
    assert paths is None and said.startswith(
        "Model architectures ['PhimoeForCausalLMv2'] are not supported for now")


def _holds_packing(row: VllmFamily, packed: dict[str, list[str]] | None, where: str) -> None:
    """The class's packing of the fused layers the row models (a class without a dense MLP
    packs no gate_up_proj; DeepSeek's adds fused_qkv_a_proj in __init__: ROW_RULES)."""
    if not packed:
        return
    for fused, names in row.packed_modules:
        if fused in packed:
            assert tuple(packed[fused]) == names, (where, fused)


@pytest.mark.slow
@pytest.mark.parametrize("wrapper", ["mistral3_vl", "gemma3_vl", "qwen2_5_vl", "qwen3_vl"])
def test_a_vision_language_wrapper_is_its_registered_class(peft_zoo, wrapper: str) -> None:  # type: ignore[no-untyped-def]
    """A wrapper's config names the wrapper class (Mistral3ForConditionalGeneration, ...),
    which vLLM registers with LoRA: its language-model adapter is judged, not refused as an
    unregistered architecture. Where q_proj and v_proj also name the vision tower's modules
    (SigLIP, Pixtral), PEFT adapts them and vLLM does not: without
    --enable-tower-connector-lora the tower has no punica wrapper (lora/model_manager.py
    `_create_lora_modules`), so those weights load and are never applied."""
    truth = peft_zoo.adapter(wrapper, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    model = ModelConfig.from_hf(truth.base_dir)
    assert model.architectures and model.architectures[0].endswith("ForConditionalGeneration")
    verdict = vllm.judge(audit(Adapter.load(truth.path), model), model, FLAGS)
    tower = {m.module.split(".", 1)[0] for m in verdict.modules if not m.served}
    if wrapper in ("mistral3_vl", "gemma3_vl"):
        assert verdict.verdict is Verdict.DIFFERS and tower == {"vision_tower"}, verdict.reason
    else:  # Qwen's tower names its projections qkv and proj
        assert verdict.verdict is Verdict.SERVES and not tower, verdict.reason


@pytest.mark.slow
@pytest.mark.parametrize(("wrapper", "towers", "mlp"), [
    ("qwen2_5_vl", {"visual"}, "mlp"), ("qwen3_vl", {"visual"}, "mlp"),
    ("qwen3_5_vl", {"visual"}, "mlp"),
    ("llama4_vl", {"vision_model", "multi_modal_projector"}, "feed_forward")])
def test_a_tower_adapter_loads_and_is_never_applied(peft_zoo, wrapper: str, towers: set[str],  # type: ignore[no-untyped-def]
                                                    mlp: str) -> None:
    """PEFT's all-linear on a Qwen-VL wrapper (Qwen3.5's, Llama 4's too) adapts the tower's
    attention and MLP, and Llama 4's projector, as well: their leaf names are LoRA modules of
    vLLM's model (ROW_RULES), so the adapter is not refused, and they have no LoRA layer, so
    their weights are never applied: `differs`, the language model's modules served (run for
    the Qwen wrappers: tests/test_engine_vllm.py). vLLM's Qwen3.5 text class, built on the
    same checkpoint where `architectures` names it, has no tower: the same names are
    unexpected there."""
    truth = peft_zoo.adapter(wrapper, r=8, lora_alpha=16, target_modules="all-linear")
    verdict = _judge(truth)
    assert verdict.verdict is Verdict.DIFFERS, verdict.reason
    assert verdict.reason_class == "vision_tower"
    dropped = [m for m in verdict.modules if not m.served]
    assert {m.module for m in dropped} == towers
    assert all(m.why.endswith(vllm.TOWER_NOT_APPLIED) for m in dropped)
    assert {m.engine_module for m in verdict.modules if m.served} >= {
        "self_attn.qkv_proj", "self_attn.o_proj", f"{mlp}.gate_up_proj", f"{mlp}.down_proj"}
    if wrapper == "qwen3_5_vl":
        model = ModelConfig.from_hf(truth.base_dir)
        text = replace(model, architectures=("Qwen3_5ForCausalLM",))
        verdict = vllm.judge(audit(Adapter.load(truth.path), text), text, FLAGS)
        assert verdict.verdict is Verdict.REFUSES, verdict.reason
        assert "model.visual.blocks.0.attn.qkv" in verdict.reason


def test_phi3_fused_layers_take_one_slice_each_under_tp() -> None:
    """phi3.py packs qkv_proj and gate_up_proj as themselves: QKVParallelLinearWithLoRA and
    ColumnParallelLinearWithLoRA, one A and one B each, B over this GPU's output rows
    (`output_size_per_partition`: q and KV heads over TP, gate|up over TP)."""
    model = ModelConfig.preset("phi-4-mini")  # hidden 3072, 24 heads, 8 KV heads of 128
    modules = {m.path: m for m in vllm.engine_modules(model)}
    assert modules["self_attn.qkv_proj"].adapter_names == ("qkv_proj",)
    assert modules["self_attn.qkv_proj"].buffers(1, 64, 2, False) == [
        ("lora_a", (1, 1, 64, 3072)), ("lora_b", (1, 1, 1536 + 2 * 512, 64))]
    assert modules["mlp.gate_up_proj"].buffers(1, 64, 2, False) == [
        ("lora_a", (1, 1, 64, 3072)), ("lora_b", (1, 1, 8192, 64))]
    assert vllm.target_modules(model, "qkv_proj,gate_up_proj") == ("qkv_proj", "gate_up_proj")


def _function(file: str, qualname: str) -> str:
    """The source of `qualname` (a function, a class, or Class.method) in vllm/`file`."""
    text = (VLLM_MODELS.parent.parent / file).read_text()
    node: Any = ast.parse(text)
    for part in qualname.split("."):
        node = next(n for n in ast.iter_child_nodes(node)
                    if isinstance(n, ast.FunctionDef | ast.ClassDef) and n.name == part)
    return ast.get_source_segment(text, node) or ""


_L4 = "model_executor/models/llama4.py"
_NH = "model_executor/models/nemotron_h.py"
_MAMBA = "model_executor/layers/mamba/mamba_mixer2.py"
_GO = "model_executor/models/gpt_oss.py"
_G4 = "model_executor/models/gemma4.py"
_DS = "model_executor/models/deepseek_v2.py"
_MLA_LAYER = "model_executor/layers/attention/mla_attention.py"
_Q2VL = "model_executor/models/qwen2_vl.py"
_Q25VL = "model_executor/models/qwen2_5_vl.py"
_Q3VL = "model_executor/models/qwen3_vl.py"
_MM = "lora/model_manager.py"
# The lines each rule of a family's row rests on: (family, what the row says, file under
# vllm/, function or class, the line).
ROW_RULES = (
    ("gpt_oss", "attn_block: the checkpoint's (and an adapter's) self_attn is vLLM's attn", _GO,
     "GptOssForCausalLM", '".self_attn.": ".attn.",'),
    ("gpt_oss", "attn_block: the decoder layer's attention is `attn`", _GO,
     "TransformerBlock.__init__", "self.attn = self.attention_cls("),
    ("gpt_oss", "router: the MoE block's router is `router`, a GateLinear", _GO,
     "MLPBlock.__init__", "self.router = GateLinear("),
    ("gpt_oss", "experts_3d: the fused experts take the 3-D wrapper", _GO,
     "GptOssForCausalLM", "is_3d_moe_weight: typing.ClassVar[bool] = True"),
    ("gpt_oss", "the interleaved gate|up LoRA B is split gate, up by the loader",
     "lora/model_manager.py", "LoRAModelManager._convert_3d_to_2d_moe_lora",
     "w1_b = gate_up_b[:, ::2, :].contiguous()"),
    # The vision-language wrappers' towers (VllmFamily.tower, tower_modules): their linear
    # layers' leaf names are LoRA module names of the model, so an adapter's tower weights
    # pass the name check, and the tower gets no punica wrapper unless the flag is on.
    ("qwen2_vl", "tower_modules: every LinearBase of the model names a LoRA module",
     "lora/utils.py", "get_supported_lora_modules",
     "if isinstance(module, (LinearBase, MoERunner)):"),
    ("qwen2_vl", "tower: no punica wrapper without --enable-tower-connector-lora", _MM,
     "LoRAModelManager._maybe_init_mm", "if not self.lora_config.enable_tower_connector_lora:"),
    ("qwen2_vl", "tower: a module without a punica wrapper gets no LoRA layer", _MM,
     "LoRAModelManager._create_lora_modules", "if punica_wrapper is None:"),
    ("qwen2_vl", "tower: the adapter's model.visual. is vLLM's visual.", _Q2VL,
     "Qwen2VLForConditionalGeneration", '"model.visual.": "visual.",'),
    ("qwen2_vl", "tower_modules: attention qkv", _Q2VL, "Qwen2VisionAttention.__init__",
     "self.qkv = ColumnParallelLinear("),
    ("qwen2_vl", "tower_modules: attention proj", _Q2VL, "Qwen2VisionAttention.__init__",
     "self.proj = RowParallelLinear("),
    ("qwen2_vl", "tower_modules: MLP fc1", _Q2VL, "Qwen2VisionMLP.__init__",
     "self.fc1 = ColumnParallelLinear("),
    ("qwen2_vl", "tower_modules: MLP fc2", _Q2VL, "Qwen2VisionMLP.__init__",
     "self.fc2 = RowParallelLinear("),
    ("qwen2_vl", "tower_modules: the merger's mlp.0 and mlp.2", _Q2VL,
     "Qwen2VisionPatchMerger.__init__", "self.mlp = nn.ModuleList("),
    ("qwen2_5_vl", "tower: the adapter's model.visual. is vLLM's visual.", _Q25VL,
     "Qwen2_5_VLForConditionalGeneration", '"model.visual.": "visual.",'),
    ("qwen2_5_vl", "tower_modules: attention qkv (packing itself)", _Q25VL,
     "Qwen2_5_VLForConditionalGeneration", '"qkv": ["qkv"],'),
    ("qwen2_5_vl", "tower_modules: attention proj", _Q25VL, "Qwen2_5_VisionAttention.__init__",
     "self.proj = RowParallelLinear("),
    ("qwen2_5_vl", "tower_modules: MLP gate_proj, up_proj packed in gate_up_proj", _Q25VL,
     "Qwen2_5_VisionMLP.__init__", "self.gate_up_proj = MergedColumnParallelLinear("),
    ("qwen2_5_vl", "tower_modules: MLP down_proj", _Q25VL, "Qwen2_5_VisionMLP.__init__",
     "self.down_proj = RowParallelLinear("),
    ("qwen2_5_vl", "tower_modules: the merger's mlp.0 and mlp.2", _Q25VL,
     "Qwen2_5_VisionPatchMerger.__init__", "self.mlp = nn.Sequential("),
    ("llama4", "towers: the vision tower and projector", "model_executor/models/mllama4.py",
     "Llama4ForConditionalGeneration.get_mm_mapping", 'tower_model="vision_model.",'),
    ("llama4", "tower_modules: attention qkv_proj (q/k/v packed)",
     "model_executor/models/mllama4.py", "Llama4VisionAttention.__init__",
     "self.qkv_proj = QKVParallelLinear("),
    ("llama4", "tower_modules: attention o_proj", "model_executor/models/mllama4.py",
     "Llama4VisionAttention.__init__", "self.o_proj = RowParallelLinear("),
    ("llama4", "tower_modules: MLP fc1, fc2", "model_executor/models/mllama4.py",
     "Llama4VisionMLP.__init__", "self.fc1 = ColumnParallelLinear("),
    ("llama4", "tower_modules: the patch embedding's linear", "model_executor/models/mllama4.py",
     "Llama4UnfoldConvolution.__init__", "self.linear = ColumnParallelLinear("),
    ("llama4", "tower_modules: the projector's linear_1", "model_executor/models/mllama4.py",
     "Llama4MultiModalProjector.__init__", "self.linear_1 = ColumnParallelLinear("),
    ("qwen3_5", "tower: the wrapper is Qwen3-VL's", "model_executor/models/qwen3_5.py",
     "Qwen3_5ForConditionalGeneration",
     "class Qwen3_5ForConditionalGeneration(Qwen3VLForConditionalGeneration, IsHybrid):"),
    ("qwen3_5", "tower_modules: Qwen3-VL's tower", "model_executor/models/qwen3_5.py",
     "Qwen3_5ForConditionalGeneration.__init__", "self.visual = Qwen3_VisionTransformer("),
    ("qwen3_vl", "tower: the adapter's model.visual. is vLLM's visual.", _Q3VL,
     "Qwen3VLForConditionalGeneration", '"model.visual.": "visual.",'),
    ("qwen3_vl", "tower_modules: attention qkv and proj are Qwen2.5-VL's", _Q3VL,
     "Qwen3_VisionBlock.__init__", "self.attn = Qwen2_5_VisionAttention("),
    ("qwen3_vl", "tower_modules: MLP linear_fc1", _Q3VL, "Qwen3_VisionMLP.__init__",
     "self.linear_fc1 = ColumnParallelLinear("),
    ("qwen3_vl", "tower_modules: MLP linear_fc2", _Q3VL, "Qwen3_VisionMLP.__init__",
     "self.linear_fc2 = RowParallelLinear("),
    ("qwen3_vl", "tower_modules: the mergers' linear_fc1, linear_fc2", _Q3VL,
     "Qwen3_VisionPatchMerger.__init__", "self.linear_fc1 = ColumnParallelLinear("),
    ("llama4", "moe_step: MoE layers every interleave_moe_layer_step, no list read", _L4,
     "Llama4DecoderLayer.__init__",
     "and (self.layer_idx + 1) % config.interleave_moe_layer_step == 0"),
    ("llama4", "mlp_block: the dense MLP is `feed_forward`", _L4,
     "Llama4DecoderLayer.__init__", 'prefix=f"{prefix}.feed_forward",'),
    ("llama4", "the dense MLP is intermediate_size_mlp wide", _L4,
     "Llama4DecoderLayer.__init__", "intermediate_size=config.intermediate_size_mlp,"),
    ("llama4", "router: the MoE block's router is `router`, a GateLinear", _L4,
     "Llama4MoE.__init__", "self.router = GateLinear("),
    ("llama4", "a GateLinear is a ReplicatedLinear (ReplicatedLinearWithLoRA)",
     "model_executor/layers/fused_moe/router/gate_linear.py", "GateLinear",
     "class GateLinear(ReplicatedLinear):"),
    ("llama4", "shared_expert_gate=False: the shared expert is a LlamaMLP, no gate", _L4,
     "Llama4MoE.__init__", "self.shared_expert = LlamaMLP("),
    ("llama4", "experts and shared expert are intermediate_size wide", _L4,
     "Llama4MoE.__init__", "intermediate_size_moe = config.intermediate_size"),
    ("gemma4", "routed experts wherever the config sets num_experts", _G4,
     "Gemma4DecoderLayer.__init__",
     'self.enable_moe_block = getattr(config, "num_experts", None) is not None'),
    ("gemma4", "router.proj: the router's projection, a GateLinear", _G4,
     "Gemma4Router.__init__", "self.proj = GateLinear("),
    ("gemma4", "experts: gated fused experts moe_intermediate_size wide", _G4,
     "Gemma4DecoderLayer.__init__",
     'names = ("moe_intermediate_size", "expert_intermediate_size")'),
    ("phimoe", "TRANSFORMERS_FALLBACK: no registered class, the first on the backend",
     "model_executor/models/registry.py", "_ModelRegistry.resolve_model_cls",
     "arch = self._try_resolve_transformers(architectures[0], model_config)"),
    ("phimoe", "TRANSFORMERS_FALLBACK: a class transformers has",
     "model_executor/models/registry.py", "_ModelRegistry._try_resolve_transformers",
     "model_module = getattr(transformers, architecture, None)"),
    ("phimoe", "TRANSFORMERS_FALLBACK: an MoE config's backend is TransformersMoEForCausalLM",
     "config/model.py", "ModelConfig._get_transformers_backend_cls",
     'cls += "MoE" if self.is_moe else ""'),
    ("phimoe", "TRANSFORMERS_FALLBACK: the backend's experts are transformers' `experts`",
     "model_executor/models/transformers/moe.py", "MoEMixin.recursive_replace",
     'experts_name = "experts"'),
    ("nemotron_h", "blocks: a Mamba layer's mixer is MambaMixer2", _NH,
     "NemotronHMambaDecoderLayer.__init__", "self.mixer = MambaMixer2("),
    ("nemotron_h", "the Mamba inner width is mamba_num_heads * mamba_head_dim", _NH,
     "NemotronHMambaDecoderLayer.__init__",
     "intermediate_size=config.mamba_num_heads * config.mamba_head_dim,"),
    ("nemotron_h", "in_proj: five slices (z, x, B, C, dt), a merged column", _MAMBA,
     "MambaMixer2.__init__", "self.in_proj = MergedColumnParallelLinear("),
    ("nemotron_h", "conv1d: three slices (x, B, C) over the kernel taps", _MAMBA,
     "MambaMixer2.__init__", "self.conv1d = MergedColumnParallelLinear("),
    ("nemotron_h", "B and C are n_groups * ssm_state_size wide", _MAMBA, "MambaMixer2.__init__",
     "self.groups_ssm_state_size = self.n_groups * self.ssm_state_size"),
    ("nemotron_h", "a merged column of 3+ slices, one adapter name: a LoRA slice per slice",
     "lora/layers/column_parallel_linear.py",
     "MergedColumnParallelLinearVariableSliceWithLoRA.can_replace_layer",
     "and len(source_layer.output_sizes) >= 3"),
    ("nemotron_h", "out_proj is row-parallel", _MAMBA, "MambaMixer2.__init__",
     "self.out_proj = RowParallelLinear("),
    ("nemotron_h", "the MLP blocks are non-gated: up_proj, down_proj", _NH,
     "NemotronHMLP.__init__", "self.up_proj = ColumnParallelLinear("),
    ("nemotron_h", "the MoE is non-gated", _NH, "NemotronHForCausalLM",
     "is_non_gated_moe = True"),
    ("nemotron_h", "EXPERTS_UP: a non-gated MoE's wrapper has one w13 slice",
     "lora/layers/fused_moe.py", "FusedMoEWithLoRA.__init__",
     "self._w13_slices = 2 if base_layer.moe_config.is_act_and_mul else 1"),
    ("nemotron_h", "no router LoRA: mixer.gate skipped on a non-gated MoE",
     "lora/model_manager.py", "LoRAModelManager._create_lora_modules",
     'if self._is_non_gated_moe and module_name.endswith("mixer.gate"):'),
    ("nemotron_h", "the shared experts are `mixer.shared_experts`", _NH, "NemotronHMoE.__init__",
     'prefix=f"{prefix}.shared_experts",'),
    ("nemotron_h", "shared experts moe_shared_expert_intermediate_size * n_shared_experts", _NH,
     "NemotronHMoE.__init__",
     "config.moe_shared_expert_intermediate_size * config.n_shared_experts"),
    ("nemotron_h", "with moe_latent_size, the experts run at the latent width", _NH,
     "NemotronHMoE.__init__", "hidden_size=self.moe_hidden_size,"),
    ("nemotron_h", "fc1_latent_proj / fc2_latent_proj are ReplicatedLinear", _NH,
     "NemotronHMoE.__init__", "self.fc1_latent_proj = ReplicatedLinear("),
    ("deepseek_v3", "_PACKED_MLA: q_a_proj and kv_a_proj_with_mqa pack into fused_qkv_a_proj",
     _DS, "DeepseekV2ForCausalLM.__init__",
     'self.packed_modules_mapping["fused_qkv_a_proj"] = ['),
    ("deepseek_v3", "fused_qkv_a_proj only where the config has a q_lora_rank", _DS,
     "DeepseekV2ForCausalLM.__init__",
     'hasattr(config, "q_lora_rank") and config.q_lora_rank is not None'),
    ("deepseek_v3", "fused_qkv_a_proj: q_lora_rank | kv_lora_rank + rope", _DS,
     "DeepseekV2MLAAttention.__init__",
     "[self.q_lora_rank, self.kv_lora_rank + self.qk_rope_head_dim],"),
    ("deepseek_v3", "REPLICATED: fused_qkv_a_proj is built unsharded", _DS,
     "DeepSeekV2FusedQkvAProjLinear.__init__", "disable_tp=True,"),
    ("deepseek_v3", "an unsharded merged subclass takes the 2-slice wrapper, fully sharded "
     "or not", "lora/layers/column_parallel_linear.py",
     "MergedColumnParallelLinearWithLoRA.can_replace_layer", "return tp_size == 1"),
    ("deepseek_v3", "q_b_proj is column-parallel", _DS, "DeepseekV2MLAAttention.__init__",
     "self.q_b_proj = q_proj_cls("),
    ("deepseek_v2", "without a q_lora_rank, q_proj is column-parallel", _DS,
     "DeepseekV2MLAAttention.__init__", "self.q_proj = q_proj_cls("),
    ("deepseek_v2", "without a q_lora_rank, kv_a_proj_with_mqa is a ReplicatedLinear", _DS,
     "DeepseekV2MLAAttention.__init__", "self.kv_a_proj_with_mqa = ReplicatedLinear("),
    ("deepseek_v2", "kv_b_proj is column-parallel", _DS, "DeepseekV2MLAAttention.__init__",
     "self.kv_b_proj = ColumnParallelLinear("),
    ("deepseek_v2", "o_proj is row-parallel over the heads' values", _DS,
     "DeepseekV2MLAAttention.__init__", "self.num_heads * self.v_head_dim,"),
    ("deepseek_v2", "the MLA wrapper calls the projections through its own attributes",
     "model_executor/layers/mla.py", "MultiHeadLatentAttentionWrapper.forward",
     "q = q_proj_layer(q_proj_input)[0]"),
    ("deepseek_v2", "... which the manager rewires to the one wrapper", "lora/model_manager.py",
     "LoRAModelManager._create_lora_modules",
     'setattr(parent, module_name.rpartition(".")[-1], existing_wrapper)'),
    ("deepseek_v2", "KV_B_UNAPPLIED: the impl keeps the kv_b_proj it was built with",
     _MLA_LAYER, "MLACommonBaseImpl.__init__", "self.kv_b_proj = kv_b_proj"),
    ("deepseek_v2", "KV_B_UNAPPLIED: the CPU impl too", "v1/attention/backends/mla/cpu_mla.py",
     "CPUMLAImpl.__init__", 'self.kv_b_proj = mla_args["kv_b_proj"]'),
    ("deepseek_v2", "KV_B_UNAPPLIED: the impl is no torch module (the manager never sees its "
     "attribute)", "v1/attention/backend.py", "MLAAttentionImpl",
     "class MLAAttentionImpl(AttentionImplBase[T], Generic[T]):"),
    ("deepseek_v2", "KV_B_UNAPPLIED: prefill runs the impl's kv_b_proj", _MLA_LAYER,
     "MLACommonBaseImpl.forward_mha", "kv_nope = self.kv_b_proj(kv_c_normed)[0].view("),
    ("deepseek_v2", "KV_B_UNAPPLIED: decode the weights absorbed from it at load", _MLA_LAYER,
     "MLAAttention.process_weights_after_loading", "W_UK, W_UV = split_kv_b_proj("),
    ("deepseek_v2", "MoE from first_k_dense_replace on, every moe_layer_freq", _DS,
     "DeepseekV2DecoderLayer.__init__", "and layer_idx >= config.first_k_dense_replace"),
    ("deepseek_v2", "router: `gate`, a GateLinear", _DS, "DeepseekV2MoE.__init__",
     "self.gate = GateLinear("),
    ("deepseek_v2", "shared_expert: mlp.shared_experts, n_shared_experts x "
     "moe_intermediate_size", _DS, "DeepseekV2MoE.__init__",
     "intermediate_size = config.moe_intermediate_size * config.n_shared_experts"),
    ("deepseek_v2", "the shared experts are a DeepseekV2MLP (gate_up_proj, down_proj)", _DS,
     "DeepseekV2MoE.__init__", "self.shared_experts = DeepseekV2MLP("),
    ("deepseek_v3", "V3 is V2's class", _DS, "DeepseekV3ForCausalLM",
     "class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):"),
)


@pytest.mark.vllm
@pytest.mark.parametrize("rule", ROW_RULES, ids=lambda r: f"{r[0]}: {r[1]}")
def test_each_row_rule_is_the_line_it_cites(rule: tuple[str, str, str, str, str]) -> None:
    family, _, file, function, line = rule
    assert family in VLLM_FAMILIES
    assert line in _function(file, function), (file, function, line)


@pytest.mark.vllm
def test_llama4_experts_take_the_2d_wrapper() -> None:
    """No class of Llama4ForCausalLM's chain sets is_3d_moe_weight: the 2-D FusedMoEWithLoRA
    (lora/model_manager.py `_is_3d_moe_model`), as the row models (experts_3d=False)."""
    chain = _class_chain("llama4.py", "Llama4ForCausalLM")
    assert _declared(chain, "is_3d_moe_weight") is None
    assert not VLLM_FAMILIES["llama4"].experts_3d


# Builds a PEFT Llama 4 model in its call: several seconds.
@pytest.mark.slow
def test_llama4_layers_are_the_ones_vllm_wraps(peft_zoo) -> None:  # type: ignore[no-untyped-def]
    """Llama 4 under --engine vllm: attention on every layer, the dense `feed_forward` MLP on
    the layers between MoE ones, and on the MoE layers the router, the shared expert's packed
    gate|up and its down (LlamaMLP) and the 2-D fused experts; a PEFT adapter on the attention,
    both MLPs and the router is served whole (the shared expert's gate_proj/up_proj/down_proj
    are leaf names vLLM expects)."""
    truth = peft_zoo.adapter("llama4", r=8, lora_alpha=16,
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                             "up_proj", "down_proj", "router"])
    model = ModelConfig.from_hf(truth.base_dir)
    moe = tuple(model.moe_layers)
    dense = tuple(i for i in range(model.num_hidden_layers) if i not in moe)
    assert moe and dense
    every = tuple(range(model.num_hidden_layers))
    got = {m.path: (m.kind, m.layers) for m in vllm.engine_modules(model)}
    K = vllm.Kind
    assert got == {
        "self_attn.qkv_proj": (K.QKV, every), "self_attn.o_proj": (K.ROW, every),
        "feed_forward.gate_up_proj": (K.COLUMN, dense), "feed_forward.down_proj": (K.ROW, dense),
        "feed_forward.router": (K.REPLICATED, moe), "feed_forward.experts": (K.EXPERTS, moe),
        "feed_forward.shared_expert.gate_up_proj": (K.COLUMN, moe),
        "feed_forward.shared_expert.down_proj": (K.ROW, moe),
        "embed_tokens": (K.EMBEDDING, ()), "lm_head": (K.LOGITS, ())}
    widths = {m.path: m.out_sizes for m in vllm.engine_modules(model)}
    assert widths["feed_forward.gate_up_proj"] == (model.intermediate_size_mlp,) * 2
    assert widths["feed_forward.shared_expert.gate_up_proj"] == (model.intermediate_size,) * 2
    verdict = _judge(truth)
    assert verdict.verdict is Verdict.SERVES, verdict.reason
    assert all(m.served for m in verdict.modules)
    assert {m.module for m in verdict.modules} >= {"feed_forward.router",
                                                    "feed_forward.shared_expert.gate_proj"}


# Builds PEFT gpt_oss models in its call: several seconds.
@pytest.mark.slow
def test_gpt_oss_adapters_land_in_vllms_renamed_layers(peft_zoo) -> None:  # type: ignore[no-untyped-def]
    """gpt_oss under --engine vllm: PEFT's `self_attn` projections land in vLLM's `attn`
    (its hf_to_vllm_mapper renames LoRA names too) and its 3-D expert parameters in the 3-D
    fused-experts wrapper, whose loader splits the interleaved gate|up (ROW_RULES): served."""
    attn = peft_zoo.adapter("gpt_oss", r=8, lora_alpha=16,
                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    experts = peft_zoo.adapter("gpt_oss", r=8, lora_alpha=16, target_modules=["q_proj"],
                               target_parameters=["mlp.experts.gate_up_proj",
                                                  "mlp.experts.down_proj"])
    for truth, landed in ((attn, {"attn.qkv_proj", "attn.o_proj"}),
                          (experts, {"attn.qkv_proj", "mlp.experts"})):
        verdict = _judge(truth)
        assert verdict.verdict is Verdict.SERVES, verdict.reason
        assert {m.engine_module for m in verdict.modules} == landed
        assert all(m.module.startswith(("self_attn.", "mlp.")) for m in verdict.modules)


# Builds a PEFT Gemma 4 model in its call: several seconds.
@pytest.mark.slow
def test_gemma4_keys_as_values_differ(peft_zoo) -> None:  # type: ignore[no-untyped-def]
    """Gemma 4 under --engine vllm: PEFT's q_proj on the KV-shared layers lands in their q_proj
    of its own, every other module in its layer kind's; k_proj on a full layer whose keys are
    its values reaches the keys alone (keys_as_values): the adapter differs from PEFT there and
    nowhere else."""
    truth = peft_zoo.adapter("gemma4", r=8, lora_alpha=16,
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                             "up_proj", "down_proj"])
    model = ModelConfig.from_hf(truth.base_dir)
    shared = tuple(i for i in range(model.num_hidden_layers) if model.is_kv_shared_layer(i))
    full = tuple(i for i, t in enumerate(model.layer_types)
                 if t is LayerType.FULL_ATTENTION and i not in shared)
    assert shared and full
    verdict = _judge(truth)
    assert verdict.verdict is Verdict.DIFFERS and verdict.reason_class == "keys_as_values"
    outcomes = {(o.module, o.layers): (o.engine_module, o.served) for o in verdict.modules}
    assert outcomes[("self_attn.k_proj", full)] == ("self_attn.qkv_proj", False)
    assert outcomes[("self_attn.q_proj", shared)] == ("self_attn.q_proj", True)
    assert [m for (m, _), (_, served) in outcomes.items() if not served] == ["self_attn.k_proj"]


# Builds a PEFT Nemotron-H model in its call: several seconds.
@pytest.mark.slow
def test_nemotron_h_blocks_are_the_ones_vllm_wraps(peft_zoo) -> None:  # type: ignore[no-untyped-def]
    """Nemotron-H under --engine vllm, one block a layer: a PEFT adapter on the attention
    block, the MLP block and the Mamba block's in_proj is served whole (PEFT's one in_proj pair
    over vLLM's five slices); the MoE block's experts are the non-gated wrapper's (one w13
    slice) and its router takes no LoRA."""
    truth = peft_zoo.adapter("nemotron_h", r=8, lora_alpha=16,
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                             "mixer.up_proj", "mixer.down_proj", "in_proj"])
    model = ModelConfig.from_hf(truth.base_dir)
    kinds = {m.path: (m.kind, m.layers) for m in vllm.engine_modules(model)}
    K = vllm.Kind
    mamba, attn, mlp, moe = ((i,) for i in range(4))  # the tiny model's blocks, in order
    assert kinds == {
        "mixer.in_proj": (K.COLUMN, mamba), "mixer.conv1d": (K.COLUMN, mamba),
        "mixer.out_proj": (K.ROW, mamba), "mixer.qkv_proj": (K.QKV, attn),
        "mixer.o_proj": (K.ROW, attn), "mixer.up_proj": (K.COLUMN, mlp),
        "mixer.down_proj": (K.ROW, mlp), "mixer.experts": (K.EXPERTS_UP, moe),
        "mixer.shared_experts.up_proj": (K.COLUMN, moe),
        "mixer.shared_experts.down_proj": (K.ROW, moe),
        "embed_tokens": (K.EMBEDDING, ()), "lm_head": (K.LOGITS, ())}
    experts = next(m for m in vllm.engine_modules(model) if m.path == "mixer.experts")
    assert [n for n, _ in experts.buffers(2, 8, 1, False)] == [
        "w13_lora_a", "w13_lora_b", "w2_lora_a", "w2_lora_b"]
    verdict = _judge(truth)
    assert verdict.verdict is Verdict.SERVES, verdict.reason
    assert {m.module for m in verdict.modules if m.served} >= {"mixer.in_proj", "mixer.up_proj"}


# -- shared experts: dense MLPs beside FusedMoE, wrapped as any other -------------------------

# The tiny models' widths (tests/support/peft_factory.py): hidden 64, MoE on layers 1-3;
# qwen2_moe's shared expert 24 wide, glm4_moe's one shared expert of moe_intermediate_size 40.
SHARED = {"qwen2_moe": ("mlp.shared_expert", 24, True),
          "glm4_moe": ("mlp.shared_experts", 40, False)}


def _shared_expert_bytes(width: int, gated: bool, L: int, R: int, tp: int, elem: int) -> int:
    """One MoE layer's shared-expert LoRA bytes on one GPU, by hand from vLLM 0.32's
    `create_lora_weights` (lora/layers): MergedColumnParallelLinearWithLoRA's gate_up_proj, two
    A [L, 1, R, H] and two B [L, 1, S/tp, R]; RowParallelLinearWithLoRA's down_proj, A
    [L, 1, R, S/tp] and B [L, 1, H, R]; qwen's shared_expert_gate a ReplicatedLinearWithLoRA,
    A [L, 1, R, H] and B [L, 1, 1, R]."""
    H = 64
    gate_up = 2 * L * R * H + 2 * L * (width // tp) * R
    down = L * R * (width // tp) + L * H * R
    gate = L * R * H + L * 1 * R if gated else 0
    return (gate_up + down + gate) * elem


@pytest.mark.slow  # builds a PEFT MoE model in its call
@pytest.mark.parametrize("family", sorted(SHARED))
@pytest.mark.parametrize("tp", [1, 2])
def test_a_shared_expert_takes_lora_as_a_dense_mlp(
        tmp_path, monkeypatch: pytest.MonkeyPatch, family: str, tp: int) -> None:  # type: ignore[no-untyped-def]
    """qwen2_moe.py and glm4_moe.py build the MoE layers' shared expert(s) as a dense MLP
    (gate_up_proj, down_proj) that the LoRA manager wraps; packed_modules_mapping's
    gate_up_proj takes an adapter's `<shared>.gate_proj` and `.up_proj`, so an adapter made
    before PEFT's MoE rewrite (glm4_moe: made with it off, as under transformers 4) is served
    whole, and its buffers are the hand formula's bytes at the shared expert's own width."""
    import peft.utils.transformers_weight_conversion as conversion

    from tests.support.peft_factory import make_adapter

    monkeypatch.setattr(conversion, "_convert_peft_config_moe", lambda *args: None)
    truth = make_adapter(family, tmp_path / "a", r=8, lora_alpha=16,
                         target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"])
    path, width, gated = SHARED[family]
    flags = vllm.Flags(16, 2, tp=tp, lora_dtype="float16")
    verdict = _judge(truth, flags)
    assert verdict.verdict is Verdict.SERVES, verdict.reason
    shared = {(m.module, m.engine_module, m.layers) for m in verdict.modules
              if m.module.startswith(path + ".")}
    assert shared == {(f"{path}.gate_proj", f"{path}.gate_up_proj", (1, 2, 3)),
                      (f"{path}.up_proj", f"{path}.gate_up_proj", (1, 2, 3)),
                      (f"{path}.down_proj", f"{path}.down_proj", (1, 2, 3))}
    model = ModelConfig.from_hf(truth.base_dir)
    memory = vllm.Memory.of(model, flags)
    got = sum(b for m, b in memory.per_module if m.path.startswith(path))
    assert got == 3 * _shared_expert_bytes(width, gated, 2, 16, tp, 2)


@pytest.mark.vllm
def test_the_shared_expert_rows_are_the_source_they_cite() -> None:
    """The lines the shared-expert rows stand on: each class builds its shared expert as its
    dense MLP at the width the row reads, and that MLP is a MergedColumnParallelLinear
    gate_up_proj and a RowParallelLinear down_proj; Qwen's gate over it a one-output
    ReplicatedLinear."""
    def source(file: str, cls: str) -> str:
        text = (VLLM_MODELS / file).read_text()
        node = next(n for n in _parsed(file).body if isinstance(n, ast.ClassDef)
                    and n.name == cls)
        return " ".join((ast.get_source_segment(text, node) or "").split())

    for file, mlp, block, built in (
            ("qwen2_moe.py", "Qwen2MoeMLP", "Qwen2MoeSparseMoeBlock",
             "self.shared_expert = Qwen2MoeMLP( hidden_size=config.hidden_size, "
             "intermediate_size=config.shared_expert_intermediate_size,"),
            ("glm4_moe.py", "Glm4MoeMLP", "Glm4MoE",
             "intermediate_size = config.moe_intermediate_size * config.n_shared_experts "
             "self.shared_experts = Glm4MoeMLP(")):
        assert built in source(file, block), file
        assert VLLM_FAMILIES[file.removesuffix(".py")].shared_expert == (
            "mlp.shared_expert" if file == "qwen2_moe.py" else "mlp.shared_experts")
        assert "self.gate_up_proj = MergedColumnParallelLinear(" in source(file, mlp)
        assert "self.down_proj = RowParallelLinear(" in source(file, mlp)
    assert ("self.shared_expert_gate = ReplicatedLinear( config.hidden_size, 1,"
            in source("qwen2_moe.py", "Qwen2MoeSparseMoeBlock"))
    assert "shared_expert_gate" not in source("glm4_moe.py", "Glm4MoE")
    assert not VLLM_FAMILIES["glm4_moe"].shared_expert_gate
    # The FusedMoE runner holds the same shared-expert module (and Qwen2MoeMLP the same gate)
    # under a second path; the manager rewires an alias to the first wrapper, so each takes
    # its buffers once.
    manager = (VLLM_MODELS.parents[1] / "lora" / "model_manager.py").read_text()
    assert "existing_wrapper = wrapped_by_id.get(id(module))" in manager


def test_a_row_without_a_shared_expert_models_none() -> None:
    """Only a row that names its shared expert gets one: Qwen3-MoE's class builds none, so a
    shared width in its config adds no buffers, where Qwen2-MoE's adds gate_up, down and the
    gate at that width."""
    width = 512
    qwen3 = replace(ModelConfig.preset("qwen3-30b-a3b"), shared_expert_intermediate_size=width)
    assert not [m for m in vllm.engine_modules(qwen3) if "shared" in m.path]
    qwen2 = replace(qwen3, model_type="qwen2_moe", architectures=None)
    shared = {m.path: m.out_sizes for m in vllm.engine_modules(qwen2) if "shared" in m.path}
    assert shared == {"mlp.shared_expert.gate_up_proj": (width, width),
                      "mlp.shared_expert.down_proj": (qwen3.hidden_size,),
                      "mlp.shared_expert_gate": (1,)}


# -- DeepSeek's multi-head latent attention ---------------------------------------------------

MLA_TARGETS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]


@pytest.mark.slow  # builds a PEFT DeepSeek model in its call
def test_mla_kv_b_proj_loads_and_is_never_applied(peft_zoo) -> None:  # type: ignore[no-untyped-def]
    """DeepSeek-V3 under --engine vllm: q_a_proj and kv_a_proj_with_mqa land in the fused
    `fused_qkv_a_proj`, q_b_proj and o_proj in their own layers; kv_b_proj loads into its
    buffers and is never applied (KV_B_UNAPPLIED: the run in tests/test_engine_vllm.py gives the
    base model's log-probs for it): beside the others the adapter differs, alone it ignores,
    and the flags metrale recommends wrap no kv_b_proj."""
    both = peft_zoo.adapter("deepseek_v3", r=8, lora_alpha=16, target_modules=MLA_TARGETS)
    verdict = _judge(both)
    assert verdict.verdict is Verdict.DIFFERS and verdict.reason_class == "mla_kv_b_unapplied"
    landed = {m.module: (m.engine_module, m.served) for m in verdict.modules}
    assert landed == {"self_attn.q_a_proj": ("self_attn.fused_qkv_a_proj", True),
                      "self_attn.kv_a_proj_with_mqa": ("self_attn.fused_qkv_a_proj", True),
                      "self_attn.q_b_proj": ("self_attn.q_b_proj", True),
                      "self_attn.kv_b_proj": ("self_attn.kv_b_proj", False),
                      "self_attn.o_proj": ("self_attn.o_proj", True)}
    # The tiny model has MoE layers: the CPU build cannot serve it with LoRA.
    assert verdict.elsewhere["cpu_build"]["reason_class"] == "cpu_fused_moe_lora"
    model = ModelConfig.from_hf(both.base_dir)
    report = audit(Adapter.load(both.path), model)
    assert vllm.recommend([report], model).flags.target_modules == (
        "fused_qkv_a_proj", "o_proj", "q_b_proj")
    alone = peft_zoo.adapter("deepseek_v3", r=8, lora_alpha=16, target_modules=["kv_b_proj"])
    verdict = _judge(alone)
    assert verdict.verdict is Verdict.IGNORES and verdict.reason_class == "mla_kv_b_unapplied"


def test_mla_buffers_follow_vllm_create_lora_weights() -> None:
    """DeepSeek-V2-Lite (no q_lora_rank; hidden 2048, 16 heads, kv_lora_rank 512, rope 64,
    nope 128, v 128) at TP 2: q_proj a column layer (B split; fully sharded, A's rank too),
    kv_a_proj_with_mqa a ReplicatedLinearWithLoRA whole on every GPU, fully sharded or not."""
    model = ModelConfig.preset("deepseek-v2-lite")
    modules = {m.path: m for m in vllm.engine_modules(model)}
    assert [p for p in modules if p.startswith("self_attn.")] == [
        "self_attn.q_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj",
        "self_attn.o_proj"]
    q, kv_a = modules["self_attn.q_proj"], modules["self_attn.kv_a_proj_with_mqa"]
    assert q.buffers(1, 64, 2, False) == [("lora_a", (1, 1, 64, 2048)),
                                          ("lora_b", (1, 1, 16 * 192 // 2, 64))]
    assert q.buffers(1, 64, 2, True)[0] == ("lora_a", (1, 1, 32, 2048))
    for sharded in (False, True):
        assert kv_a.buffers(1, 64, 2, sharded) == [("lora_a", (1, 1, 64, 2048)),
                                                   ("lora_b", (1, 1, 512 + 64, 64))]


@pytest.mark.parametrize("change", [{"moe_layer_freq": 2},
                                    {"qk_nope_head_dim": 0, "qk_rope_head_dim": 0}])
def test_deepseek_layers_mla_does_not_model_are_refused(tmp_path, change: dict[str, int]) -> None:  # type: ignore[no-untyped-def]
    """vLLM's DeepSeek class puts MoE layers every `moe_layer_freq` and builds plain attention
    (qkv_proj) where both qk head widths are 0: metrale models neither, so `--engine vllm`
    refuses in one line, exit 2, rather than guess."""
    lite = Path(__file__).parent / "data" / "model_configs" / "deepseek-v2-lite.config.json"
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**json.loads(lite.read_text()), **change}))
    done = metrale("layout", "-m", config, "--max-rank", 16, "--engine", "vllm")
    assert done.code == 2 and "multi-head latent attention" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert metrale("layout", "-m", lite, "--max-rank", 16, "--engine", "vllm").code == 0


@pytest.mark.vllm
def test_cpu_build_moe_takes_triton_whenever_lora_is_enabled() -> None:
    """The cpu_build record's rule: with LoRA enabled vLLM picks the Triton MoE LoRA backend
    before any other (the CPU build has no Triton), whatever --lora-target-modules wraps."""
    source = _function("model_executor/layers/fused_moe/oracle/unquantized.py",
                       "select_unquantized_moe_backend")
    lora = source.index("if moe_config.is_lora_enabled:")
    assert lora < source.index("return UnquantizedMoeBackend.TRITON") < source.index(
        "AVAILABLE_BACKENDS = _get_priority_backends(moe_config)")
    assert "target_modules" not in source
    model = ModelConfig.preset("deepseek-v3")
    assert "Triton" in (vllm.cpu_build_support(model) or ("", ""))[1]
