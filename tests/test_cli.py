"""The command line as users meet it: exit codes, one-line errors, JSON, fast start."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metrale_cli import env
from metrale_cli.errors import UsageError
from tests.support.cli_runner import metrale
from tests.support.header_only import write_header_only
from tests.support.hostile_inputs import TINY, copy_adapter, one_line_error, run_cli

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


@pytest.mark.proc
def test_help_and_inspect_do_not_import_torch_cupy_or_numba(synth_pair: tuple[Path, Path]) -> None:
    code = (
        "import sys\n"
        "from metrale_cli.cli.app import main\n"
        "sys.argv = ['metrale'] + sys.argv[1:]\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "bad = [m for m in ('torch', 'cupy', 'numba') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    for args in (["--help"], ["inspect", str(synth_pair[0])],
                 ["layout", "--model", "qwen3-8b", "--modules", "q_proj", "--max-rank", "8"],
                 ["models"]):
        done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True,
                              text=True)
        assert done.returncode == 0, (args, done.stderr)


def imported_packages(*args: str) -> set[str]:
    """The top-level packages a fresh interpreter imports running `python ARGS`, read from
    `-X importtime` (standard-library modules left out)."""
    done = subprocess.run([sys.executable, "-X", "importtime", *args], capture_output=True,
                          text=True, check=True)
    names = {line.split("|")[-1].strip().split(".")[0] for line in done.stderr.splitlines()
             if line.startswith("import time:") and not line.endswith("| package")}
    return {n for n in names if n not in sys.stdlib_module_names and not n.startswith("_")}


def test_help_imports_nothing_beyond_typer_and_rich() -> None:
    """`metrale --help` imports no package that `import typer, rich` does not (no numpy), so it
    starts about as fast (scripts/bench_startup.py measures the ratio)."""
    baseline = imported_packages("-c", "import typer, rich")
    help_imports = imported_packages("-m", "metrale_cli", "--help")
    assert "typer" in baseline and "metrale_cli" in help_imports
    assert help_imports - baseline - {"metrale_cli"} == set()


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
    # The adapter's own slot is named apart from the pool's (`pool_slot.slot_bytes`, the one
    # layout, pack and show give): both were `slot_bytes`, of different sizes.
    assert first["own_slot_bytes"] == 15_335_424 and "slot_bytes" not in first
    assert doc["pool_slot"]["slot_bytes"] == 15_335_424
    # Rank above --max-rank makes it not servable: exit 1, with the reason.
    over = metrale("inspect", a, "--max-rank", 8, "--json")
    assert over.code == 1
    codes = {f["code"] for f in over.json()["adapters"][0]["findings"]}
    assert "rank_above_max" in codes


def test_inspect_ends_with_why_it_exits_1(synth_pair: tuple[Path, Path]) -> None:
    """However long the view, its last line says why the exit code is not 0: how many of the
    adapters are not servable, and which (the view and the record stay on stdout)."""
    a, b = synth_pair
    done = metrale("inspect", a, f"other={b}", f"again={a}", "--max-rank", 8)
    assert done.code == 1
    assert done.stderr == "error: 2 of 3 adapter(s) not servable: chat, again\n"
    assert done.output.endswith(done.stderr)
    as_json = metrale("inspect", a, f"other={b}", "--max-rank", 8, "--json")
    assert as_json.code == 1 and as_json.json()["adapters"][0]["servable"] is False
    assert as_json.stderr == "error: 1 of 2 adapter(s) not servable: chat\n"


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
        # Finite, but its bytes were not: int() of infinity (exit 70), in layout, simulate's
        # --budget and --bandwidth alike.
        (["layout", "--model", "qwen3-8b", "--max-rank", "8", "--modules", "q_proj",
          "--budget", "1e300TiB"], 2,
         "not a size: '1e300TiB' (more bytes than floating point holds)"),
        (["simulate", "--model", "qwen3-8b", "--max-rank", "8", "--modules", "q_proj",
          "--requests", "50", "--bandwidth", "1e300TB/s"], 2,
         "--bandwidth: not a size: '1e300tb' (more bytes than floating point holds)"),
        (["pack", "/nonexistent", "--max-loras", "2"], 2, "no such adapter"),
        # It wrote an adapter that pack, inspect and every engine check then refuse.
        (["synth", "/nonexistent/out", "--model", "qwen3-8b", "--modules", "q_proj", "--rank",
          "2", "--alpha", "1e308"], 2, "--alpha 1e+308 with --rank 2 gives a scaling of "
         "5e+307, outside the 2^-60 to 2^60 a pool holds"),
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


@pytest.mark.slow
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


@pytest.mark.proc
def test_inspect_reads_only_the_header(tmp_path: Path) -> None:
    """A 4.8 GB adapter inspects reading as many bytes as a 4 MB one: the header alone."""
    huge = _sparse_adapter(tmp_path / "huge", 8192)
    tiny = _sparse_adapter(tmp_path / "tiny", 8)
    assert huge > 4_500_000_000 and tiny < 5_000_000
    code = (
        "import sys\n"
        "from metrale_cli.cli.app import main\n"
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


@pytest.mark.parametrize("columns", [80, 120])
def test_models_reads_whole_at_80_and_120_columns(columns: int) -> None:
    """Every preset's name and key dims, no cell cut short, no line past the terminal."""
    from metrale_cli.model.config import PRESETS

    result = metrale("models", columns=columns)
    assert result.code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "…" not in result.stdout and max(map(len, lines)) <= columns
    for preset in PRESETS:
        record = preset.record()
        row = next(line.split() for line in lines if line.startswith(preset.name + " "))
        layers = (f"{record['full_attention_layers']}+{record['linear_attention_layers']}"
                  if record["linear_attention_layers"] else str(record["num_hidden_layers"]))
        ffn = (f"{record['num_experts']}x{record['expert_intermediate_size']}"
               if record["num_experts"] else str(record["intermediate_size"]))
        assert row == [preset.name, record["model_type"], layers, str(record["hidden_size"]),
                       f"{record['num_attention_heads']}/{record['num_key_value_heads']}"
                       f"x{record['head_dim']}", "yes" if record["attn_gated"] else "no", ffn]


def test_max_rank_defaults_to_what_the_kernels_serve(tmp_path: Path) -> None:
    """A rank-10 adapter: layout, pack and inspect's slot figure all pad to 16 by default."""
    adapter = tmp_path / "r10"
    assert metrale("synth", adapter, "--model", "qwen3-8b", "--modules", "q_proj,v_proj",
                   "--rank", 10).code == 0
    at_16 = metrale("layout", "--model", "qwen3-8b", "--modules", "q_proj,v_proj",
                    "--max-rank", 16, "--json").json()
    planned = metrale("layout", adapter, "--json")
    assert planned.code == 0 and planned.stderr == ""
    assert planned.json()["max_rank"] == 16 and planned.json()["warnings"] == []
    assert planned.json()["fingerprint"] == at_16["fingerprint"]
    packed = metrale("pack", adapter, "--max-loras", 2, "--device", "cpu", "--json")
    assert packed.code == 0 and packed.stderr == "", packed.stderr
    assert packed.json()["layout"]["max_rank"] == 16 and packed.json()["warnings"] == []
    inspected = metrale("inspect", adapter, "--json").json()
    assert inspected["adapters"][0]["own_slot_bytes"] == at_16["slot_bytes"]


@pytest.mark.parametrize("max_rank,nearest", [(10, 16), (300, 256)])
def test_a_max_rank_the_kernels_refuse_plans_with_a_warning(tmp_path: Path, max_rank: int,
                                                            nearest: int) -> None:
    """The layout holds; one warning line on stderr names the nearest max rank they serve,
    and the JSON record carries the same line."""
    args = ("--model", "qwen3-8b", "--modules", "q_proj", "--max-rank", max_rank)
    human = metrale("layout", *args)
    assert human.code == 0 and re.search(rf"^max rank\s+{max_rank}\s*$", human.stdout, re.M)
    assert human.stderr.count("\n") == 1 and human.stderr.startswith("warning: max rank ")
    assert human.stderr.rstrip().endswith(f"the nearest max rank they serve is {nearest}")
    record = metrale("layout", *args, "--json")
    assert record.code == 0 and record.json()["max_rank"] == max_rank
    assert record.json()["warnings"] == [human.stderr.removeprefix("warning: ").rstrip()]
    assert metrale("synth", tmp_path / "a", "--model", "qwen3-8b", "--modules", "q_proj",
                   "--rank", 8).code == 0
    inspected = metrale("inspect", tmp_path / "a", "--max-rank", max_rank, "--json")
    assert inspected.code == 0 and inspected.stderr == human.stderr
    assert inspected.json()["warnings"] == record.json()["warnings"]


def test_explicit_max_rank_keeps_the_readme_fingerprint() -> None:
    doc = metrale("layout", "--model", "qwen3-next-80b-a3b", "--modules", ATTN, "--max-rank",
                  16, "--json").json()
    assert doc["fingerprint"] == "e3298e5b193f86eb1f4fe085e95b4dff"


def test_pack_warns_at_a_max_rank_the_kernels_refuse(tmp_path: Path) -> None:
    assert metrale("synth", tmp_path / "a", "--model", "qwen3-8b", "--modules", "q_proj",
                   "--rank", 8).code == 0
    packed = metrale("pack", tmp_path / "a", "--max-loras", 1, "--max-rank", 12, "--device",
                     "cpu", "--json")
    assert packed.code == 0 and packed.json()["layout"]["max_rank"] == 12
    assert packed.stderr == f"warning: {packed.json()['warnings'][0]}\n"
    assert "the nearest max rank they serve is 16" in packed.stderr


# -- hostile input at the command line: naming, markup, usage errors, terminals, booleans -----


def test_a_file_argument_is_named_after_its_directory(tiny: Path, tmp_path: Path) -> None:
    x1 = copy_adapter(tiny / "a", tmp_path / "one" / "x")
    x2 = copy_adapter(tiny / "a", tmp_path / "two" / "x")
    # Two adapters both named `x`: once by directory, once by a file inside it.
    dup = metrale("pack", x1, x2 / "adapter_model.safetensors", "--max-loras", 2,
                  "--model", tiny)
    one_line_error(dup, 2)
    assert "two adapters are named 'x'" in dup.stderr
    # Two config files in different directories are two adapters named after them.
    y = copy_adapter(tiny / "a", tmp_path / "y")
    both = metrale("inspect", x1 / "adapter_config.json", y / "adapter_config.json",
                   "--model", tiny, "--json")
    assert both.code == 0, both.stderr
    assert [a["name"] for a in both.json()["adapters"]] == ["x", "y"]
    # Any other file names no adapter, and an empty path is not the current directory.
    (tmp_path / "notes.txt").write_text("hi")
    one_line_error(metrale("inspect", tmp_path / "notes.txt", "--model", tiny), 2)
    for empty in ("", "x=", " "):
        one_line_error(metrale("inspect", empty, "--model", tiny), 2)


def test_a_hub_id_is_named_by_the_same_rule(tiny: Path, tmp_path: Path) -> None:
    """`org/x` and a local directory `x` are both named `x`: refused before anything is read."""
    local = copy_adapter(tiny / "a", tmp_path / "x")
    result = metrale("inspect", "some-org/x", local, "--model", tiny)
    one_line_error(result, 2)
    assert "two adapters are named 'x'" in result.stderr


def test_synth_refuses_a_non_finite_alpha(tmp_path: Path) -> None:
    for alpha in ("nan", "inf", "-inf"):
        one_line_error(metrale("synth", tmp_path / alpha, "--model", "qwen3-8b", "--modules",
                               "q_proj", "--rank", 8, "--alpha", alpha), 2)
        assert not (tmp_path / alpha).exists()


def test_synth_rank_is_bounded_by_the_weights_it_adapts(tmp_path: Path) -> None:
    result = metrale("synth", tmp_path / "a", "--model", "qwen3-8b", "--modules", "q_proj",
                     "--rank", 100_000_000)
    one_line_error(result, 2)
    assert "--rank 100000000 is above 4096" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_markup_in_names_is_shown_as_typed(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    copy_adapter(tiny / "a", tmp_path / "[bold red]evil")
    copy_adapter(tiny / "a", tmp_path / "a[/]b")
    for command in (("inspect",), ("pack", "--max-loras", 2)):
        result = metrale(*command, "[bold red]evil", "a[/]b", "--model", tiny)
        assert result.code == 0, result.stderr
        assert "[bold red]evil" in result.stdout and "a[/]b" in result.stdout
    assert metrale("synth", "[/]x", "--model", tiny, "--modules", "q_proj",
                   "--rank", 2).stdout.startswith("wrote [/]x")


def test_markup_in_tensor_names_is_shown_as_typed(tiny: Path, tmp_path: Path) -> None:
    from tests.support.header_only import write_header_only

    odd = copy_adapter(tiny / "a", tmp_path / "odd")
    write_header_only(odd / "adapter_model.safetensors",
                      [("base_model.model.[/]weird[red]", "BF16", [2, 2])])
    result = metrale("inspect", odd, "--model", tiny)
    assert result.code == 1, result.stderr
    assert "[/]weird[red]" in result.stdout.replace("\n", "")


def test_no_internal_error_where_a_usage_error_belongs(tiny: Path, tmp_path: Path) -> None:
    one_line_error(metrale("layout", "--model", tiny, "--modules", "q_proj", "--max-rank", 8,
                           "--budget", "1e999"), 2)
    one_line_error(metrale("synth", tmp_path / "s", "--model", tiny, "--modules", "q_proj",
                           "--rank", 2, "--seed", -1), 2)
    deep = "[" * 100_000 + "]" * 100_000
    model_dir = tmp_path / "deep-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(deep)
    one_line_error(metrale("layout", "--model", model_dir, "--modules", "q_proj",
                           "--max-rank", 8), 2)
    deep_config = copy_adapter(tiny / "a", tmp_path / "deep-config")
    (deep_config / "adapter_config.json").write_text(deep)
    one_line_error(metrale("inspect", deep_config, "--model", tiny), 2)
    deep_header = copy_adapter(tiny / "a", tmp_path / "deep-header")
    blob = b'{"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    (deep_header / "adapter_model.safetensors").write_bytes(len(blob).to_bytes(8, "little")
                                                            + blob)
    one_line_error(metrale("inspect", deep_header, "--model", tiny), 2)
    huge = tmp_path / "huge-model"
    huge.mkdir()
    (huge / "config.json").write_text(json.dumps({**TINY, "num_hidden_layers": 100_000_000}))
    start = time.monotonic()
    one_line_error(metrale("layout", "--model", huge, "--modules", "q_proj", "--max-rank", 8), 2)
    assert time.monotonic() - start < 10


@pytest.mark.proc
def test_an_ascii_terminal_gets_the_view(tiny: Path) -> None:
    done = run_cli("inspect", tiny / "a", "--model", tiny,
                   env_extra={"PYTHONIOENCODING": "ascii", "COLUMNS": "100"})
    assert done.returncode == 0, done.stderr
    assert "servable" in done.stdout and done.stderr == ""


@pytest.mark.parametrize("value,expected", [
    ("1", True), ("true", True), (" YES ", True), ("On", True),
    ("0", False), ("false", False), ("no", False), ("off", False), (" 0", False), ("", False),
])
def test_boolean_variables(monkeypatch: pytest.MonkeyPatch, value: str, expected: bool) -> None:
    for name in ("METRALE_LORA_EXPERTS", "METRALE_DEBUG", "METRALE_ONLINE"):
        monkeypatch.setenv(name, value)
    assert env.experts_enabled() is expected and env.debug() is expected
    assert env.online() is expected


@pytest.mark.parametrize("value", ["00", "maybe", "2", "y"])
def test_a_boolean_variable_that_is_not_one_is_refused(
    monkeypatch: pytest.MonkeyPatch, tiny: Path, value: str
) -> None:
    monkeypatch.setenv("METRALE_LORA_EXPERTS", value)
    with pytest.raises(UsageError, match="METRALE_LORA_EXPERTS"):
        env.experts_enabled()
    result = metrale("inspect", tiny / "a", "--model", tiny)
    one_line_error(result, 2)
    assert "METRALE_LORA_EXPERTS" in result.stderr
    monkeypatch.delenv("METRALE_LORA_EXPERTS")
    monkeypatch.setenv("METRALE_DEBUG", value)
    one_line_error(metrale("inspect", tiny / "a", "--model", tiny), 2)


def test_experts_false_means_off(monkeypatch: pytest.MonkeyPatch, tiny: Path) -> None:
    monkeypatch.setenv("METRALE_LORA_EXPERTS", "false")
    assert metrale("inspect", tiny / "a", "--model", tiny, "--json").json()[
        "experts_enabled"] is False


@pytest.mark.proc
def test_zero_columns_still_prints(tiny: Path) -> None:
    done = run_cli("inspect", tiny / "a", "--model", tiny, env_extra={"COLUMNS": "0"})
    assert done.returncode == 0, done.stderr
    assert "servable" in done.stdout
    refused = run_cli("inspect", "/nonexistent", env_extra={"COLUMNS": "0"})
    assert refused.returncode == 2 and "no such adapter" in refused.stderr


@pytest.mark.parametrize("args,says", [
    (["layout", "--max-rank", "abc"], "'--max-rank'"),
    (["pack", "x"], "Missing option '--max-loras'"),
    (["inspect", "--nope"], "No such option: --nope"),
    (["nosuch"], "No such command 'nosuch'"),
    # Input with a line break in it still makes one line, the break shown escaped.
    (["inspect", "a\nb"], "error: a\\nb: no such adapter directory"),
    (["layout", "--model", "x\ry", "--max-rank", "8"], "'x\\ry'"),
])
def test_click_usage_errors_are_one_line(args: list[str], says: str) -> None:
    result = metrale(*args)
    one_line_error(result, 2)
    assert result.stderr.startswith("error: ") and says in result.stderr


LLAMA = ["-m", "llama-3.1-8b", "--max-rank", "8"]
SIM = ["simulate", *LLAMA, "--modules", "q_proj", "--max-loras", "2"]


@pytest.mark.parametrize("args,hint", [
    (["layout", *LLAMA, "--modules", "q_prj"], "'q_proj'"),
    (["layout", *LLAMA, "--modules", "qkv_prj", "--engine", "vllm"], "'qkv_proj'"),
    (["layout", *LLAMA, "--modules", "q_prj", "--engine", "sglang"], "'q_proj'"),
    (["layout", *LLAMA, "--modules", "q_proj", "--engine", "sglang", "--eviction-policy", "lr"],
     "'lru'"),
    (["layout", *LLAMA, "--modules", "q_proj", "--engine", "sglang", "--lora-backend",
      "trition"], "'triton'"),
    (["layout", *LLAMA, "--modules", "q_proj", "--engine", "vllm", "--dtype", "bfloat6"],
     "'bfloat16'"),
    (["layout", *LLAMA, "--modules", "q_proj", "--engine", "vllm", "--lora-dtype", "foat16"],
     "'float16'"),
    (["synth", "x", "-m", "llama-3.1-8b", "--modules", "q_proj", "-r", "8", "--dtype", "bf61"],
     "'bf16'"),
    ([*SIM, "--policy", "lr"], "'lru'"),
    ([*SIM, "--workload", "zip"], "'zipf'"),
    ([*SIM, "--admission", "fcf"], "'fcfs'"),
    ([*SIM, "--replicas", "2", "--route", "round-robn"], "'round-robin'"),
    ([*SIM, "--trace", "t.csv", "--trace-format", "burstpt"], "'burstgpt'"),
])
def test_a_mistyped_choice_says_which_it_was_near(args: list[str], hint: str) -> None:
    """Every value metrale takes from a list says which one a typo was nearest to, as a
    mistyped preset, engine, command or option does."""
    result = metrale(*args)
    one_line_error(result, 2)
    assert f"(did you mean {hint}?)" in result.stderr


def test_synth_modules_all_names_the_modules_the_model_has(tmp_path: Path) -> None:
    """`--modules all` on Llama writes q..down, not `out_proj` (Qwen3-Next's GDN module) with
    no tensor: layout and SGLang's rules then read the adapter as written."""
    out = tmp_path / "all"
    r = metrale("synth", out, "-m", "llama-3.1-8b", "--modules", "all", "--rank", "1")
    assert r.code == 0, r
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj",
                                        "up_proj", "v_proj"]
    for engine in ("metrale", "sglang"):
        done = metrale("layout", out, "--engine", engine)
        assert done.code == 0, (engine, done)


def _tensor_names(adapter: Path) -> list[str]:
    raw = (adapter / "adapter_model.safetensors").read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    return sorted(k for k in header if k != "__metadata__")


_LLAMA4_WRAPPER = {"model_type": "llama4", "text_config": {
    "model_type": "llama4_text", "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 32,
    "intermediate_size_mlp": 64, "num_local_experts": 2, "interleave_moe_layer_step": 2,
    "vocab_size": 128}}


@pytest.mark.parametrize(("model", "stack"), [
    ("gemma-3-27b", "model.language_model.layers"),
    (_LLAMA4_WRAPPER, "language_model.model.layers"),
])
def test_synth_writes_a_vision_language_wrapper_s_layers_where_peft_has_them(
        tmp_path: Path, model: object, stack: str) -> None:
    """A wrapper's decoder layers are under its language model (PEFT's module names on
    Gemma3ForConditionalGeneration, llama4's `language_model.model`): synth writes its keys
    there, as unpack does, so a synthetic adapter packs and unpacks to its own tensor names.
    It wrote `model.layers`, keys PEFT does not load onto the wrapper."""
    if isinstance(model, dict):
        (tmp_path / "config.json").write_text(json.dumps(model))
        model = tmp_path / "config.json"
    made, image, back = tmp_path / "made", tmp_path / "pool.safetensors", tmp_path / "back"
    done = metrale("synth", made, "-m", model, "--modules", "q_proj,gate_proj", "--rank", 4)
    assert done.code == 0, done.stderr
    names = _tensor_names(made)
    assert names and all(n.startswith(f"base_model.model.{stack}.") for n in names), names[0]
    assert metrale("pack", made, "-m", model, "--max-loras", 1, "--out", image).code == 0
    assert metrale("unpack", image, back, "--slot", 0).code == 0
    assert _tensor_names(back) == names


@pytest.fixture(scope="module")
def ranks_8_and_64(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    """A small Llama config and two adapters on it: rank 8 (q, v) and 64 (q, k, v, o)."""
    root = tmp_path_factory.mktemp("ranks")
    model = root / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 512}))
    for name, modules, rank in (("a8", "q_proj,v_proj", 8), ("a64", "q_proj,k_proj,v_proj,o_proj",
                                                                64)):
        assert metrale("synth", root / name, "--model", model, "--modules", modules,
                       "--rank", rank).code == 0
    return model, [root / "a8", root / "a64"]


def test_one_answer_to_how_big_a_slot_is(tmp_path: Path,
                                         ranks_8_and_64: tuple[Path, list[Path]]) -> None:
    """Adapters of rank 8 (q, v) and 64 (q, k, v, o): inspect, layout, pack and show give the
    same slot; inspect's per-adapter figure is labelled as what it is (the adapter alone), and
    verify's as the bytes of its entries, not a second slot size."""
    model, adapters = ranks_8_and_64
    inspected = metrale("inspect", *adapters, "--model", model, "--json").json()
    slot = metrale("layout", *adapters, "--model", model, "--json").json()["slot_bytes"]
    assert inspected["pool_slot"] == {"slot_bytes": slot, "max_rank": 64, "modules": [
        "q_proj", "k_proj", "v_proj", "o_proj"]}
    image = tmp_path / "pool.st"
    assert metrale("pack", *adapters, "--model", model, "--max-loras", 2, "--out",
                   image).code == 0
    assert metrale("show", image, "--json").json()["layout"]["slot_bytes"] == slot
    text = metrale("inspect", *adapters, "--model", model).stdout
    assert f"slot size  {slot:,} B (" in text and "in a pool of these adapters" in text
    assert text.count("│ own slot ") == 2 and "│ slot " not in text
    verified = metrale("verify", image, *adapters).stdout
    assert "of its entries compared)" in verified


@pytest.mark.parametrize("engine", ["metrale", "vllm", "sglang"])
def test_every_command_ends_a_refusal_with_the_same_line(
        tmp_path: Path, ranks_8_and_64: tuple[Path, list[Path]], engine: str) -> None:
    """One adapter above --max-rank: every command that judges the adapters ends with the same
    count of the same total, naming the same adapter (with the engine's verdict under an
    engine), with or without --json. `layout`, `pack` and `simulate` said `1 adapter(s)`
    where `inspect` said `1 of 2`, and `simulate --engine` named neither the adapter nor the
    engine as inspect does."""
    model, adapters = ranks_8_and_64
    common = [*adapters, "--model", model, "--max-rank", 16]
    commands = [["inspect", *common], ["layout", *common],
                ["simulate", *common, "--max-loras", 2, "--requests", 20]]
    if engine == "metrale":
        commands.append(["pack", *common, "--max-loras", 2])
        said = "not servable", ": a64"
        label = ""
    else:
        commands = [[*c, "--engine", engine] for c in commands]
        label = {"vllm": "vLLM 0.32.0", "sglang": "SGLang 0.5.23"}[engine]
        said = "not served as PEFT serves them by", ": a64 (refuses)"
    for args in commands:
        for json_out in ([], ["--json"]):
            done = metrale(*args, *json_out)
            assert done.code == 1, (args, done.stderr)
            last = done.stderr.splitlines()[-1]
            assert last.startswith(f"error: 1 of 2 adapter(s) {said[0]}"), (args, last)
            assert last.endswith(said[1]) and label in last, (args, last)
            if json_out:
                done.json()


@pytest.mark.parametrize("engine,options", [
    ("vllm", []), ("vllm", ["--tp", 2]), ("vllm", ["--max-loras", 1]),
    ("vllm", ["--tp", 2, "--max-loras", 1]), ("vllm", ["--max-cpu-loras", 1]),
    ("vllm", ["--max-rank", 16]), ("vllm", ["--max-rank", 128]),
    ("sglang", []), ("sglang", ["--tp", 2]), ("sglang", ["--max-loras", 5]),
    ("sglang", ["--max-rank", 16]),
])
def test_inspect_and_layout_give_one_lora_memory_for_the_same_flags(
        ranks_8_and_64: tuple[Path, list[Path]], engine: str, options: list[object]) -> None:
    """`inspect --engine E` names which flags are the user's and gives the LoRA bytes of the
    flags it judged under, the ones `layout --engine E` gives for the same options; the
    recommended line's bytes, where those flags differ, are labelled as the serve line's.
    Given --max-loras 1, inspect recommended (and sized) 2 where layout sized 1; SGLang's
    layout sized SGLang's default batch of 8 where inspect sized 3."""
    model, adapters = ranks_8_and_64
    args = [*adapters, "--model", model, "--engine", engine, *options]
    layout = metrale("layout", *args, "--json")
    inspected = metrale("inspect", *args, "--json")
    assert layout.code == inspected.code, (layout.stderr, inspected.stderr)
    judged = inspected.json()["engine"]
    assert sorted(judged["given"]) == sorted(o for o in options if isinstance(o, str))
    memory = judged["memory"] or judged["recommended"]
    assert memory["lora_bytes"] == layout.json()["engine"]["lora_bytes"]
    assert memory["slot_bytes"] == layout.json()["engine"]["slot_bytes"]
    shown = metrale("inspect", *args, columns=200).stdout
    flag_words = ", ".join(judged["given"])
    assert (f"flags judged ({flag_words} given, the rest recommended)" if options
            else "flags recommended:") in shown
    assert f"{memory['lora_bytes']:,} B" in shown
    assert ("with the serve line's flags" in shown) == (judged["memory"] is not None)
