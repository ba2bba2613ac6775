"""The command line as users meet it: exit codes, one-line errors, JSON, fast start."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.cli_runner import metrale
from tests.header_only import write_header_only

ATTN = "q_proj,k_proj,v_proj,o_proj,out_proj"


@pytest.fixture(scope="module")
def synth_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("synth")
    a = root / "chat"
    b = root / "code"
    assert metrale("synth", a, "--model", "qwen3-next-80b-a3b", "--modules", ATTN,
                   "--rank", 16).code == 0
    assert metrale("synth", b, "--model", "qwen3-next-80b-a3b", "--modules", "q_proj,out_proj",
                   "--rank", 8, "--dtype", "f32", "--rslora", "--seed", 3).code == 0
    return a, b


def test_help_and_inspect_do_not_import_torch_or_cupy(synth_pair: tuple[Path, Path]) -> None:
    code = (
        "import sys\n"
        "from metrale_cli.cli import main\n"
        "sys.argv = ['metrale'] + sys.argv[1:]\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "bad = [m for m in ('torch', 'cupy') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    for args in (["--help"], ["inspect", str(synth_pair[0])],
                 ["layout", "--model", "qwen3-8b", "--modules", "q_proj", "--max-rank", "8"],
                 ["models"]):
        done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True,
                              text=True)
        assert done.returncode == 0, (args, done.stderr)


def test_inspect_json_and_exit_codes(synth_pair: tuple[Path, Path]) -> None:
    a, b = synth_pair
    result = metrale("inspect", a, f"other={b}", "--json")
    assert result.code == 0, result.stderr
    doc = result.json()
    assert doc["model"]["model_type"] == "qwen3_next" and len(doc["model"]["layer_types"]) == 48
    first, second = doc["adapters"]
    assert first["name"] == "chat" and second["name"] == "other"
    assert first["servable"] and first["rank"] == 16
    assert len(first["modules"]) == 84
    q = next(m for m in first["modules"] if m["module"] == "q_proj")
    assert q == {"layer": 3, "module": "q_proj", "r": 16, "alpha": 32, "scaling": 2.0,
                 "a_shape": [16, 2048], "b_shape": [8192, 16], "dtype": "BF16"}
    assert second["modules"][0]["scaling"] == pytest.approx(16 / 8**0.5)
    assert first["slot_bytes"] == 15_335_424
    # Rank above --max-rank makes it not servable: exit 1, with the reason.
    over = metrale("inspect", a, "--max-rank", 8, "--json")
    assert over.code == 1
    codes = {f["code"] for f in over.json()["adapters"][0]["findings"]}
    assert "rank_above_max" in codes


@pytest.mark.parametrize(
    "args,code,message",
    [
        (["inspect", "/nonexistent/adapter"], 2, "no such adapter directory"),
        (["layout", "--model", "gpt-9", "--max-rank", "8", "--modules", "q_proj"], 2,
         "not a preset"),
        (["layout", "--model", "qwen3-8b", "--max-rank", "8", "--modules", "qq_proj"], 2,
         "unknown module 'qq_proj'"),
        (["layout", "--model", "qwen3-8b", "--max-rank", "0", "--modules", "q_proj"], 2,
         "must be positive"),
        (["layout", "--model", "qwen3-8b", "--max-rank", "8", "--modules", "q_proj",
          "--budget", "lots"], 2, "not a size"),
        (["pack", "/nonexistent", "--max-loras", "2"], 2, "no such adapter"),
    ],
)
def test_bad_input_is_one_line(args: list[str], code: int, message: str) -> None:
    result = metrale(*args)
    assert result.code == code
    assert message in result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_adapter_problems(tmp_path: Path, synth_pair: tuple[Path, Path]) -> None:
    a, _ = synth_pair
    # Two adapters with one name.
    dup = metrale("inspect", a, f"chat={synth_pair[1]}")
    assert dup.code == 2 and "two adapters are named 'chat'" in dup.stderr
    # A pickle is never loaded.
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text((a / "adapter_config.json").read_text())
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04not really")
    result = metrale("inspect", pickled)
    assert result.code == 2 and "pickle" in result.stderr and "save_pretrained" in result.stderr
    # Not a LoRA config.
    other = tmp_path / "ia3"
    other.mkdir()
    (other / "adapter_config.json").write_text(json.dumps({"peft_type": "IA3"}))
    (other / "adapter_model.safetensors").write_bytes((a / "adapter_model.safetensors")
                                                      .read_bytes())
    result = metrale("inspect", other)
    assert result.code == 2 and "not a PEFT LoRA adapter" in result.stderr
    # No base model anywhere.
    cfg = json.loads((a / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = "/trained/on/another/machine"
    lost = tmp_path / "lost"
    lost.mkdir()
    (lost / "adapter_config.json").write_text(json.dumps(cfg))
    (lost / "adapter_model.safetensors").symlink_to(a / "adapter_model.safetensors")
    result = metrale("inspect", lost)
    assert result.code == 2 and "pass --model" in result.stderr


def test_layout_json(synth_pair: tuple[Path, Path]) -> None:
    doc = metrale("layout", "--model", "qwen3-next-80b-a3b", "--modules", ATTN, "--max-rank",
                  16, "--max-loras", 4, "--json").json()
    assert doc["slot_bytes"] == 15_335_424 and doc["pool_bytes"] == 4 * 15_335_424
    assert doc["entries"][0] == {"layer": 0, "module": "out_proj", "out_dim": 2048,
                                 "in_dim": 4096, "a_offset": 0, "b_offset": 131072}
    # From startup adapters: the union of their modules and their largest rank.
    from_adapters = metrale("layout", *synth_pair, "--json").json()
    assert from_adapters["max_rank"] == 16 and from_adapters["slot_bytes"] == 15_335_424
    budget = metrale("layout", "--model", "qwen3-next-80b-a3b", "--modules", ATTN,
                     "--max-rank", 16, "--budget", "40GiB", "--json").json()
    assert budget["max_loras"] == 2800


@pytest.fixture(scope="module")
def tiny_adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tiny")
    (root / "config.json").write_text(json.dumps({
        "model_type": "qwen3_next", "hidden_size": 32, "num_hidden_layers": 4,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
        "intermediate_size": 48, "linear_num_value_heads": 2, "linear_value_head_dim": 8,
        "full_attention_interval": 2, "num_experts": 0}))
    assert metrale("synth", root / "a", "--model", root, "--modules", ATTN, "--rank", 2,
                   "--dtype", "f16").code == 0
    return root / "a"


@settings(max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_adapters_never_traceback(tiny_adapter: Path, data: st.DataObject) -> None:
    """Mutated configs and weight files give exit 0, 1 or 2 and never a traceback."""
    src = tiny_adapter
    dst = Path(tempfile.mkdtemp(dir=src.parent))
    config = bytearray((src / "adapter_config.json").read_bytes())
    weights = bytearray((src / "adapter_model.safetensors").read_bytes())
    target = data.draw(st.sampled_from(["config", "weights", "both"]))
    for blob, wanted in ((config, "config"), (weights, "weights")):
        if target in (wanted, "both"):
            for _ in range(data.draw(st.integers(1, 6))):
                pos = data.draw(st.integers(0, len(blob) - 1))
                blob[pos] = data.draw(st.integers(0, 255))
    (dst / "adapter_config.json").write_bytes(bytes(config))
    (dst / "adapter_model.safetensors").write_bytes(bytes(weights))
    result = metrale("inspect", dst, "--model", src.parent)
    assert result.code in (0, 1, 2)
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr


def _sparse_adapter(path: Path, rank: int) -> int:
    """A qwen3-8b q_proj adapter at `rank` whose data is a sparse hole: header only on disk."""
    path.mkdir()
    tensors = []
    for layer in range(36):
        key = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
        tensors += [(f"{key}.lora_A.weight", "BF16", [rank, 4096]),
                    (f"{key}.lora_B.weight", "BF16", [4096, rank])]
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": ["q_proj"],
         "base_model_name_or_path": "Qwen/Qwen3-8B"}))
    return write_header_only(path / "adapter_model.safetensors", tensors)


def test_inspect_reads_only_the_header(tmp_path: Path) -> None:
    """A 4.8 GB adapter inspects reading as many bytes as a 4 MB one: the header alone."""
    huge = _sparse_adapter(tmp_path / "huge", 8192)
    tiny = _sparse_adapter(tmp_path / "tiny", 8)
    assert huge > 4_500_000_000 and tiny < 5_000_000
    code = (
        "import sys\n"
        "from metrale_cli.cli import main\n"
        "sys.argv = ['metrale', 'inspect', sys.argv[1], '--json']\n"
        "try:\n    main()\nexcept SystemExit as e:\n    assert e.code in (0, None), e.code\n"
        "io = dict(line.split(': ') for line in open('/proc/self/io').read().splitlines())\n"
        "sys.stderr.write(io['rchar'])\n"
    )
    read = {}
    for name in ("huge", "tiny"):
        done = subprocess.run([sys.executable, "-c", code, str(tmp_path / name)],
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["adapters"][0]["servable"]
        read[name] = int(done.stderr.strip().splitlines()[-1])
    assert abs(read["huge"] - read["tiny"]) < 1_000_000, read


def test_unwritable_output_is_one_line(synth_pair: tuple[Path, Path]) -> None:
    """/proc takes no new files, not even from root: an OSError becomes one line, exit 2."""
    result = metrale("pack", synth_pair[0], "--max-loras", 1, "--out", "/proc/pool.safetensors")
    assert result.code == 2 and result.stderr.startswith("error: ")
    assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1
