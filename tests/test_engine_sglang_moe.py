"""`layout --engine sglang` on the MoE families against SGLang 0.5.23's own `LoRAMemoryPool`
built over SGLang's own model class for each (tests/support/sglang_runner.py `own_class`: its
FusedMoE experts, shared experts and dense layers on CPU tensors): per pool key (a routed
expert's `gate_up_proj_moe` / `down_proj_moe`, a shared expert's or dense layer's 3-D
`gate_up_proj` / `down_proj`, attention) layer 0's A and B shapes and the bytes over every
layer, and the total, at TP 1 and 2; the same over the Llama 4 and Qwen3.5 wrappers, whose
own get_hidden_dim the pool reads, and over the pool start-up adapters make on them; and where
SGLang's start raises for a pool, its error in metrale's refusal.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import SGLANG_PYTHON
from tests.support.cli_runner import metrale
from tests.support.engine_cases import assert_sglang_pool, run_job
from tests.support.peft_factory import make_adapter, write_base_config

RUNNER = Path(__file__).parent / "support" / "sglang_runner.py"

pytestmark = [pytest.mark.sglang, pytest.mark.proc, pytest.mark.slow]

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
LINEAR = [*ATTN, "gate_proj", "up_proj", "down_proj"]

MLA = ["q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]

# job: (config, --lora-target-modules, --max-lora-rank, --max-loras-per-batch, TP, dtype)
JOBS: dict[str, tuple[str, list[str], int, int, int, str]] = {
    # No shared expert: routed experts' buffers alone (SGLang makes every layer sparse).
    "qwen3_moe": ("qwen3_moe", LINEAR, 8, 2, 1, "float32"),
    "qwen3_moe_tp2": ("qwen3_moe", LINEAR, 8, 2, 2, "bfloat16"),
    "olmoe": ("olmoe", LINEAR, 4, 3, 1, "float32"),
    "granitemoe": ("granitemoe", LINEAR, 8, 2, 1, "float32"),
    "gpt_oss": ("gpt_oss", LINEAR, 8, 2, 1, "float32"),
    "phimoe": ("phimoe", LINEAR, 8, 2, 1, "float32"),
    # A shared expert beside the routed ones: a 3-D buffer at its width too.
    "qwen2_moe": ("qwen2_moe", LINEAR, 8, 2, 1, "float32"),
    "qwen2_moe_tp2": ("qwen2_moe", LINEAR, 8, 2, 2, "float32"),
    # A dense first layer, shared experts after it: the 3-D buffers' widths differ by layer.
    "glm4_moe": ("glm4_moe", LINEAR, 8, 2, 1, "float32"),
    "glm4_moe_tp2": ("glm4_moe", [*LINEAR, "lm_head"], 4, 2, 2, "float32"),
    # Multi-head latent attention: the fused q_a / kv_a down-projection (replicated), q_b_proj
    # and kv_b_proj (column), o_proj at v_head_dim; a dense first layer, then shared experts.
    # q_proj takes a qkv_proj buffer SGLang's DeepSeek class never reads.
    "deepseek_v3": ("deepseek_v3", [*MLA, *MLP], 8, 2, 1, "float32"),
    "deepseek_v3_tp2": ("deepseek_v3", [*MLA, *MLP], 4, 3, 2, "bfloat16"),
    "deepseek_v2": ("deepseek_v2", ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", *MLP],
                    8, 2, 1, "float32"),
    # Without a head_dim in the config (as V2's checkpoints): the config class's is
    # qk_rope_head_dim, not hidden / heads.
    "deepseek_v2_head_dim": ("deepseek_v2_head_dim", ["q_proj", "kv_b_proj"], 8, 2, 1,
                             "float32"),
    # Mixtral's config without a head_dim: SGLang's config loading gives it (transformers'
    # MixtralConfig alone would hold None). Llama 4's attention alone (its MLP targets' pool
    # raises).
    "mixtral": ("mixtral", LINEAR, 8, 2, 1, "float32"),
    "llama4_attention": ("llama4", ATTN, 8, 2, 1, "float32"),
    # SGLang's start raises.
    "llama4": ("llama4", LINEAR, 8, 2, 1, "float32"),
    # DeepSeek-V2 without the query's low rank: q_b_proj has no input width.
    "deepseek_v2_q_b": ("deepseek_v2", ["q_b_proj", "kv_b_proj"], 8, 2, 1, "float32"),
    # Qwen3-Next's class has no get_hidden_dim: attention at the default dims (its output gate
    # not counted), every layer sparse with a shared expert.
    "qwen3_next": ("qwen3_next", LINEAR, 8, 2, 1, "float32"),
    # Qwen3.5's text classes (models/qwen3_5_text.py) have no get_hidden_dim either: the
    # default dims, dense or with routed and shared experts.
    "qwen3_5": ("qwen3_5", [*LINEAR, "embed_tokens"], 8, 2, 1, "float32"),
    "qwen3_5_moe": ("qwen3_5_moe", LINEAR, 8, 2, 1, "float32"),
    # The wrappers (composite configs): their own get_hidden_dim. Llama 4's gives attention
    # alone; Qwen3.5's the query with its output gate (at TP 2 over one KV head: beyond the KV
    # heads). Their vision towers' two heads bound TP at 2.
    "llama4_wrapper": ("llama4_vl", ATTN, 8, 2, 1, "float32"),
    "llama4_wrapper_tp2": ("llama4_vl", ATTN, 4, 3, 2, "bfloat16"),
    "qwen3_5_wrapper": ("qwen3_5_vl", [*LINEAR, "embed_tokens"], 8, 2, 1, "float32"),
    "qwen3_5_wrapper_tp2": ("qwen3_5_vl_kv1", [*LINEAR, "lm_head"], 8, 2, 2, "bfloat16"),
    "qwen3_5_moe_wrapper_tp2": ("qwen3_5_moe_vl", [*LINEAR, "lm_head"], 8, 2, 2, "float32"),
    # Gemma 4's: attention at head_dim, where the full layers' widths are the others'.
    "gemma4_wrapper": ("gemma4_vl_uniform", ATTN, 8, 2, 1, "float32"),
    "gemma4_wrapper_tp2": ("gemma4_vl_uniform", ATTN, 4, 3, 2, "bfloat16"),
    # SGLang's start raises: the Llama 4 wrapper's get_hidden_dim has no embeddings; Gemma 4's
    # reads head_dim off a config whose full layers differ, takes an int intermediate_size for
    # a list, has no embeddings, and its tied head has no org_vocab_size.
    "llama4_wrapper_embed": ("llama4_vl", [*ATTN, "embed_tokens"], 8, 2, 1, "float32"),
    "gemma4_wrapper_per_layer": ("gemma4_vl", ATTN, 8, 2, 1, "float32"),
    "gemma4_wrapper_mlp": ("gemma4_vl_uniform", ["gate_proj"], 8, 2, 1, "float32"),
    "gemma4_wrapper_embed": ("gemma4_vl_uniform", [*ATTN, "embed_tokens"], 8, 2, 1, "float32"),
    "gemma4_wrapper_head": ("gemma4_vl_uniform", ["lm_head"], 8, 2, 1, "float32"),
}
# PEFT adapters named at start-up (no pool flags: their targets make the pool) whose start
# SGLang stops once they load, building the pool: `inspect` says `fails_startup` in its words.
# Qwen3-Next's usual targets (its shared expert's gate a plain torch Linear), its Gated-DeltaNet
# projections (no default dims), Llama 4's MLP (no buffer for its dense and shared linears).
STARTUP: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_next_gate": ("qwen3_next", {"r": 4, "lora_alpha": 8}),
    "qwen3_next_gdn": ("qwen3_next", {"r": 4, "lora_alpha": 8, "target_modules": [
        *ATTN, "in_proj_qkvz", "in_proj_ba", "out_proj"]}),
    "llama4_mlp": ("llama4", {"r": 4, "lora_alpha": 8}),
    "qwen3_5_gdn": ("qwen3_5", {"r": 4, "lora_alpha": 8}),
    "qwen3_5_moe_gate": ("qwen3_5_moe", {"r": 4, "lora_alpha": 8}),
    # The wrappers: Qwen3.5's Gated-DeltaNet in_proj_* (no width in its get_hidden_dim either),
    # Llama 4's routed experts (none in its get_hidden_dim).
    "qwen3_5_wrapper_gdn": ("qwen3_5_vl", {"r": 4, "lora_alpha": 8}),
    "llama4_wrapper_mlp": ("llama4_vl", {"r": 4, "lora_alpha": 8, "target_modules": LINEAR}),
}
# PEFT adapters named at start-up whose pool SGLang builds on a wrapper: Qwen3.5's out_proj
# (its get_hidden_dim gives one; the text class's has none), Llama 4's attention.
STARTS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_5_wrapper_out_proj": ("qwen3_5_text_on_vl", {"r": 4, "lora_alpha": 8,
                                                        "target_modules": [*LINEAR, "out_proj"]}),
    "llama4_wrapper_attention": ("llama4_vl", {"r": 4, "lora_alpha": 8, "target_modules": ATTN}),
}
STARTUP_RAISES = {"qwen3_next_gate": "Exception", "qwen3_next_gdn": "NotImplementedError",
                  "llama4_mlp": "KeyError", "qwen3_5_gdn": "NotImplementedError",
                  "qwen3_5_moe_gate": "Exception", "qwen3_5_wrapper_gdn": "NotImplementedError",
                  "llama4_wrapper_mlp": "NotImplementedError"}
RAISES = {"llama4": "KeyError", "deepseek_v2_q_b": "TypeError",
          "llama4_wrapper_embed": "NotImplementedError",
          "gemma4_wrapper_per_layer": "AmbiguousGlobalPerLayerAttributeError",
          "gemma4_wrapper_mlp": "TypeError", "gemma4_wrapper_embed": "NotImplementedError",
          "gemma4_wrapper_head": "AttributeError"}
# config: (tiny model, keys as the published checkpoints write them where transformers 5's
# differ). Phi-3.5-MoE's class name (transformers spells it PhimoeForCausalLM, which SGLang
# does not register: its Transformers backend); DeepSeek's MoE keys, which SGLang's class reads
# (transformers 5's config drops them); DeepSeek-V2's config without a head_dim.
_DEEPSEEK = {"moe_layer_freq": 1, "scoring_func": "softmax", "topk_method": "greedy"}
_HYBRID = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_vl", "qwen3_5_moe_vl",
           "qwen3_5_text_on_vl")
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "phimoe": ("phimoe", {"architectures": ["PhiMoEForCausalLM"]}),
    "deepseek_v2": ("deepseek_v2", _DEEPSEEK),
    "deepseek_v2_head_dim": ("deepseek_v2", {**_DEEPSEEK, "head_dim": None}),
    "deepseek_v3": ("deepseek_v3", {**_DEEPSEEK, "scoring_func": "sigmoid",
                                    "topk_method": "noaux_tc"}),
    # Qwen3-Next's and Qwen3.5's layer pattern as their checkpoints give it (SGLang's config
    # classes read it).
    **{m: (m, {"full_attention_interval": 2}) for m in _HYBRID},
    "qwen3_5_vl_kv1": ("qwen3_5_vl", {"full_attention_interval": 2, "num_key_value_heads": 1}),
    # Gemma 4's full layers at the sliding layers' widths: no per-layer overrides.
    "gemma4_vl_uniform": ("gemma4_vl", {"global_head_dim": 24, "num_global_key_value_heads": 2,
                                        "per_layer_config": {}}),
}
# SGLang's hybrid (Mamba-state) models take a radix-cache strategy the CPU platform supports.
SERVER_ARGS = {m: {"mamba_radix_cache_strategy": "no_buffer", "disable_overlap_schedule": True}
               for m in (*_HYBRID, "qwen3_5_vl_kv1")}


def _config_keys(config: Path, name: str) -> None:
    """`name`'s CONFIGS keys written into the config.json at `config` (a composite one's
    text_config)."""
    keys = CONFIGS.get(name, (name, {}))[1]
    raw = json.loads(config.read_text())
    raw.get("text_config", raw).update(keys)
    config.write_text(json.dumps(raw))


def _flags(name: str) -> list[Any]:
    _, targets, rank, slots, tp, dtype = JOBS[name]
    return ["--max-rank", rank, "--modules", ",".join(targets), "--max-loras", slots, "--tp",
            tp, "--dtype", dtype]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Every job's pool from SGLang's code in one runner process (no start-up adapters: the
    flags give the pool), and the config each ran on."""
    tmp = tmp_path_factory.mktemp("sglang_moe")
    configs = {}
    for model, *_ in JOBS.values():
        configs[model] = write_base_config(CONFIGS.get(model, (model, {}))[0], tmp / model)
        _config_keys(configs[model] / "config.json", model)
    jobs = [{"model": str(configs[model]), "own_class": True, "lora_target_modules": targets,
             "max_lora_rank": rank, "max_loras_per_batch": slots, "tp_size": tp, "dtype": dtype,
             "server_args": SERVER_ARGS.get(model, {})}
            for model, targets, rank, slots, tp, dtype in JOBS.values()]
    adapters = {}
    for name, (model, kwargs) in (STARTUP | STARTS).items():
        adapters[name] = tmp / name
        make_adapter(model, adapters[name], **kwargs)
        _config_keys(adapters[name] / "base" / "config.json", model)
        jobs.append({"model": str(adapters[name] / "base"), "own_class": True,
                     "max_loras_per_batch": 2, "dtype": "float32",
                     "server_args": SERVER_ARGS.get(model, {}),
                     "startup": [{"name": name, "path": str(adapters[name])}]})
    report, _ = run_job(SGLANG_PYTHON, RUNNER, tmp, {"jobs": jobs}, "SGLang runner")
    out = dict(zip([*JOBS, *STARTUP, *STARTS], report["jobs"], strict=True))
    return {**{name: {**out[name], "config": configs[JOBS[name][0]] / "config.json"}
               for name in JOBS},
            **{name: {**out[name], "adapter": adapters[name]} for name in (STARTUP | STARTS)}}


@pytest.mark.parametrize("name", [n for n in JOBS if n not in RAISES])
def test_moe_pool_buffers_are_the_ones_sglang_allocates(runs: dict[str, dict], name: str) -> None:
    """Per pool key, layer 0's A and B shapes and the bytes over every layer, and the total,
    equal the buffers of SGLang's own LoRAMemoryPool over its own model class."""
    done = metrale("layout", "--model", runs[name]["config"], "--engine", "sglang",
                   *_flags(name), "--json")
    _assert_pool(runs[name], done)


@pytest.mark.parametrize("name", list(STARTS))
def test_a_start_up_adapters_pool_on_a_wrapper_is_the_one_sglang_allocates(
        runs: dict[str, dict], name: str) -> None:
    """Named in --lora-paths (no pool flags), the adapter starts SGLang on the wrapper, and
    `layout` with it gives the pool SGLang builds from it, per key and in all."""
    done = metrale("layout", runs[name]["adapter"], "--engine", "sglang", "--max-loras", 2,
                   "--dtype", "float32", "--json")
    _assert_pool(runs[name], done)


def _assert_pool(run: dict[str, Any], done: Any) -> None:
    assert run["started"], run.get("start_error")
    assert done.code == 0, done.stderr
    engine = done.json()["engine"]
    assert_sglang_pool(run, engine)
    assert engine["pool"] == {"max_lora_rank": run["max_lora_rank"],
                              "target_modules": run["target_modules"]}


@pytest.mark.parametrize("name", list(RAISES))
def test_a_pool_sglang_cannot_start_is_refused_in_its_words(runs: dict[str, dict],
                                                            name: str) -> None:
    """DeepSeek-V2's q_b_proj (no q_lora_rank), Llama 4's gate_up_proj / down_proj (dense
    and shared-expert linears with no buffer) and its wrapper's embed_tokens (no width in the
    wrapper's get_hidden_dim, an error without text), Gemma 4's wrapper beyond attention at
    uniform widths: SGLang's start raises, and
    `layout` refuses the pool with that error, one line, exit 2."""
    run = runs[name]
    assert not run["started"]
    error = run["start_error"]
    assert error["type"] == RAISES[name]
    done = metrale("layout", "--model", run["config"], "--engine", "sglang", *_flags(name))
    assert done.code == 2
    said = f"{error['type']}: {error['text']}".replace("'", "")
    assert said in done.stderr.replace("'", ""), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("name", list(STARTUP))
def test_a_start_up_adapter_whose_pool_sglang_cannot_build_fails_startup(
        runs: dict[str, dict], name: str) -> None:
    """Named in --lora-paths, the adapter loads, and the pool its targets make raises as
    SGLang builds it: `inspect --engine sglang` says `fails_startup` with SGLang's error (for
    a module without default dims, the one SGLang met first among those it names), and leaves
    it off the launch line."""
    run = runs[name]
    assert not run["started"]
    error = run["start_error"]
    assert error["type"] == STARTUP_RAISES[name]
    done = metrale("inspect", f"{name}={run['adapter']}", "--engine", "sglang", "--max-loras", 2,
                   "--dtype", "float32", "--json")
    got = done.json()["adapters"][0]["engine"]["paths"]["startup"]
    assert got["verdict"] == "fails_startup", got
    said = got["reason"].replace("'", "")
    if error["type"] == "NotImplementedError" and not error["text"]:  # Llama 4's wrapper
        assert "NotImplementedError: (no text)" in said, said
    elif error["type"] == "NotImplementedError":
        assert error["text"].startswith("get_hidden_dim not implemented for ")
        assert f"{error['type']}: get_hidden_dim not implemented for" in said
        assert error["text"].rsplit(" ", 1)[-1] in said
    else:
        assert f"{error['type']}: {error['text']}".replace("'", "") in said, said
    assert f"{name}=" not in (done.json()["engine"]["recommended"]["serve"] or "")
