"""Property tests of the promise every command makes, whatever it is given: exit 0, 1, 2 or 3;
for an error one line on stderr (a refusal may list its findings first) and never a traceback;
no partial output; no hang. Over every CLI option, adapter and model config values (NaN,
Infinity, huge, negative, wrong types, deep nesting, pathological regexes under a lowered time
bound) and output paths (existing files, directories, symlinks, devices, FIFOs, read-only
directories). In-process through the CLI runner; the `metrale` hypothesis profile (conftest)
bounds the examples so the whole file runs in well under a minute."""

from __future__ import annotations

import json
import os
import stat
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from metrale_cli.adapters import patterns
from metrale_cli.bf16 import bf16_to_f32
from metrale_cli.image.pool_image import PoolImage
from tests.support.cli_runner import Result, metrale
from tests.support.hostile_inputs import ATTN, CATASTROPHIC, TINY, tiny_model

# A per-case bound far above any honest case here (tens of milliseconds): a hang fails it.
CASE_SECONDS = 30


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This module's own copy of conftest's `tiny`: the fuzzed commands write inside it."""
    return tiny_model(tmp_path_factory.mktemp("fuzz"))


def holds_the_promise(result: Result, started: float) -> None:
    assert time.monotonic() - started < CASE_SECONDS
    assert result.code in (0, 1, 2, 3), (result.code, result.stderr)
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr, result.stderr
    if result.code in (2, 3):
        assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: "), result.stderr
    elif result.code == 1 and result.stderr:
        # pack's and layout's refusal: each error finding, then one summary line.
        assert result.stderr.splitlines()[-1].startswith("error: "), result.stderr


def run(*args: object) -> Result:
    started = time.monotonic()
    result = metrale(*args)
    holds_the_promise(result, started)
    return result


# -- every CLI option --------------------------------------------------------------------------

# A command line cannot carry NUL; everything else can.
ODD_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
                   max_size=12)
JUNK = st.one_of(
    st.sampled_from(["", " ", "1e999", "-1e999", "nan", "inf", "-0", "0x10", "1_000", "[/]",
                     "[bold red]x", "·", "∞", "40GiB", "-1GiB", "1e-9", "00", "1.5", "q_proj,",
                     ",", "all", "q_proj,q_proj", "Q_PROJ", "a\nb", "\t", "x\r\n", "\x1b[31m"]),
    st.integers(-(2**70), 2**70).map(str),
    st.floats().map(repr),
    ODD_TEXT,
)
# Values that are valid where an integer is, small enough that `pack` and `synth` stay small.
SMALL = st.integers(-3, 64).map(str)
MODULES = st.one_of(st.sampled_from(["q_proj", ATTN, "all", "out_proj", "gate_proj,up_proj"]),
                    JUNK)


def option(name: str, values: st.SearchStrategy[str]) -> st.SearchStrategy[list[str]]:
    return st.one_of(st.just([]), values.map(lambda v: [name, v]))


@st.composite
def command_lines(draw: st.DrawFn, tiny: Path, image: Path, out_dir: Path) -> list[str]:
    models = [str(tiny), "qwen3-8b", "qwen3-next-80b-a3b", str(tiny / "a")]
    model = option("--model", st.one_of(st.sampled_from(models), JUNK))
    adapters = st.lists(st.one_of(st.sampled_from([str(tiny / "a"), f"x={tiny / 'a'}",
                                                   str(tiny / "a" / "adapter_config.json")]),
                                  JUNK), max_size=2)
    flags = st.lists(st.sampled_from(["--json", "--experts", "--force", "--rslora"]),
                     max_size=2, unique=True)
    command = draw(st.sampled_from(["inspect", "layout", "pack", "synth", "models", "show",
                                    "verify", "unpack"]))
    images = st.one_of(st.just(str(image)), st.just(str(tiny / "a" / "adapter_model.safetensors")),
                       JUNK)
    if command == "inspect":
        parts = [*draw(adapters), *draw(model), *draw(option("--max-rank", st.one_of(SMALL, JUNK)))]
        parts += [f for f in draw(flags) if f in ("--json", "--experts")]
    elif command == "layout":
        parts = [*draw(adapters), *draw(model), *draw(option("--modules", MODULES)),
                 *draw(option("--max-rank", st.one_of(SMALL, JUNK))),
                 *draw(option("--max-loras", st.one_of(SMALL, JUNK))),
                 *draw(option("--budget", st.one_of(st.sampled_from(["40GiB", "1MiB"]), JUNK))),
                 *draw(option("--align", st.one_of(st.sampled_from(["1", "3", "0", "256"]), JUNK)))]
        parts += [f for f in draw(flags) if f in ("--json", "--experts")]
    elif command == "pack":
        out = option("--out", st.one_of(st.just(str(out_dir / "pool.safetensors")), ODD_TEXT))
        parts = [*draw(adapters), *draw(model), *draw(option("--max-loras", SMALL)),
                 *draw(option("--max-rank", SMALL)), *draw(option("--modules", MODULES)),
                 *draw(option("--device", st.sampled_from(["cpu", "auto", "tpu", ""]))),
                 *draw(out)]
        parts += [f for f in draw(flags) if f in ("--json", "--experts", "--force")]
    elif command == "synth":
        where = draw(st.one_of(st.just(str(out_dir / "synth")), ODD_TEXT))
        parts = [where, *draw(model), *draw(option("--modules", MODULES)),
                 *draw(option("--rank", st.integers(-2, 8).map(str))),
                 *draw(option("--alpha", JUNK)), *draw(option("--seed", st.one_of(SMALL, JUNK))),
                 *draw(option("--dtype", st.sampled_from(["bf16", "f16", "f32", "f8", ""])))]
        parts += [f for f in draw(flags) if f in ("--json", "--force", "--rslora")]
    elif command == "show":
        parts = [draw(images), *[f for f in draw(flags) if f == "--json"]]
    elif command == "verify":
        parts = [draw(images), *draw(adapters), *[f for f in draw(flags) if f == "--json"]]
    elif command == "unpack":
        where = draw(st.one_of(st.just(str(out_dir / "unpacked")), ODD_TEXT))
        parts = [draw(images), where, *draw(option("--slot", st.one_of(SMALL, JUNK))),
                 *draw(option("--name", st.one_of(st.just("a"), JUNK)))]
        parts += [f for f in draw(flags) if f in ("--json", "--force")]
    else:
        parts = [f for f in draw(flags) if f == "--json"]
    return [command, *parts]


@pytest.mark.slow
@given(data=st.data())
def test_every_option_keeps_the_promise(tiny: Path, image: Path, data: st.DataObject,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    with tempfile.TemporaryDirectory(dir=tiny) as scratch:
        monkeypatch.chdir(scratch)  # relative junk paths land in the scratch directory
        args = data.draw(command_lines(tiny, image, Path(scratch)))
        result = run(*args)
        if "--json" in args and result.code in (0, 1) and result.stdout:
            json.loads(result.stdout, parse_constant=lambda name: pytest.fail(f"{name} in JSON"))
        leftovers = [p for p in Path(scratch).rglob("*") if p.name.endswith(".tmp")]
        assert leftovers == []


# -- config values -----------------------------------------------------------------------------

DEEP = "[" * 50_000 + "]" * 50_000
VALUES = st.one_of(
    st.sampled_from(["NaN", "Infinity", "-Infinity", "1e400", "-1", "0", "2.5", "1e308", "true",
                     "false", "null", '""', "[]", "{}", DEEP, '"("', '["("]', '{"(": 2}',
                     json.dumps(CATASTROPHIC), json.dumps([CATASTROPHIC]),
                     json.dumps({CATASTROPHIC: 2}), '{"q_proj": NaN}', '{"q_proj": -3}',
                     '{"q_proj": "x"}', "1" + "0" * 5000, '"LORA"', '"IA3"', "[0, -1, 99]",
                     '"q_proj"', '["q_proj", 7]', "100000000", "[[[[1]]]]"]),
    st.integers(-(2**64), 2**64).map(str),
    st.floats(allow_nan=False).map(lambda f: json.dumps(f)),
    ODD_TEXT.map(json.dumps),
)
ADAPTER_FIELDS = ["r", "lora_alpha", "use_rslora", "target_modules", "exclude_modules",
                  "rank_pattern", "alpha_pattern", "layers_to_transform", "layers_pattern",
                  "modules_to_save", "target_parameters", "base_model_name_or_path",
                  "trainable_token_indices", "peft_type", "use_dora", "bias",
                  "init_lora_weights", "fan_in_fan_out"]
MODEL_FIELDS = [*TINY, "layer_types", "mlp_only_layers", "decoder_sparse_step", "text_config",
                "num_experts_per_tok", "moe_intermediate_size", "vocab_size",
                "tie_word_embeddings", "attn_output_gate"]


def with_values(base: dict[str, object], values: dict[str, str]) -> str:
    """`base` as JSON text with `values` (JSON text each, possibly not JSON at all) put in."""
    kept = {k: json.dumps(v) for k, v in base.items() if k not in values}
    return "{" + ", ".join(f"{json.dumps(k)}: {v}" for k, v in {**kept, **values}.items()) + "}"


@pytest.mark.slow
@given(adapter_values=st.dictionaries(st.sampled_from(ADAPTER_FIELDS), VALUES, max_size=3),
       model_values=st.dictionaries(st.sampled_from(MODEL_FIELDS), VALUES, max_size=2),
       command=st.sampled_from(["inspect", "layout", "pack"]))
def test_config_values_keep_the_promise(
    tiny: Path, monkeypatch: pytest.MonkeyPatch, adapter_values: dict[str, str],
    model_values: dict[str, str], command: str,
) -> None:
    monkeypatch.setattr(patterns, "AUDIT_SECONDS", 0.05)  # a catastrophic pattern costs little
    with tempfile.TemporaryDirectory(dir=tiny) as scratch:
        root = Path(scratch)
        (root / "config.json").write_text(with_values(TINY, model_values))
        adapter = root / "adapter"
        adapter.mkdir()
        base = json.loads((tiny / "a" / "adapter_config.json").read_text())
        (adapter / "adapter_config.json").write_text(with_values(base, adapter_values))
        (adapter / "adapter_model.safetensors").symlink_to(tiny / "a" /
                                                           "adapter_model.safetensors")
        image = root / "pool.safetensors"
        extra = ["--max-loras", "2", "--out", image] if command == "pack" else []
        result = run(command, adapter, "--model", root, "--json", *extra)
        if result.code in (0, 1) and result.stdout:
            json.loads(result.stdout, parse_constant=lambda name: pytest.fail(f"{name} in JSON"))
        if command == "pack" and result.code == 0:
            # What was packed is what the adapter says: finite scales, finite weights.
            packed = PoolImage.open(image)
            assert np.isfinite(packed.scales).all()
            assert np.isfinite(bf16_to_f32(np.asarray(packed.region.memory).view("<u2"))).all()


# -- output paths ------------------------------------------------------------------------------

OUTPUT_KINDS = ["absent", "regular", "directory", "symlink_to_regular", "dangling_symlink",
                "symlink_to_devnull", "fifo", "under_a_file", "missing_parent",
                "read_only_directory", "trailing_slash", "empty"]


def make_output(root: Path, kind: str) -> str:
    target = root / "out.safetensors"
    if kind == "regular":
        target.write_bytes(b"precious")
    elif kind == "directory":
        target.mkdir()
    elif kind == "symlink_to_regular":
        (root / "real").write_bytes(b"precious")
        target.symlink_to(root / "real")
    elif kind == "dangling_symlink":
        target.symlink_to(root / "nowhere")
    elif kind == "symlink_to_devnull":
        target.symlink_to(os.devnull)
    elif kind == "fifo":
        os.mkfifo(target)
    elif kind == "under_a_file":
        (root / "file").write_bytes(b"precious")
        return str(root / "file" / "out.safetensors")
    elif kind == "missing_parent":
        return str(root / "no" / "such" / "out.safetensors")
    elif kind == "read_only_directory":
        (root / "ro").mkdir()
        (root / "ro").chmod(0o500)
        return str(root / "ro" / "out.safetensors")
    elif kind == "trailing_slash":
        return str(root / "newdir") + "/"
    elif kind == "empty":
        return ""
    return str(target)


def snapshot(root: Path) -> dict[str, tuple[int, bytes | str | None]]:
    """Every entry under `root`: its type and contents (link target, bytes) as seen by lstat."""
    seen: dict[str, tuple[int, bytes | str | None]] = {}
    for path in sorted(root.rglob("*")):
        mode = path.lstat().st_mode
        body: bytes | str | None = None
        if stat.S_ISLNK(mode):
            body = os.readlink(path)
        elif stat.S_ISREG(mode):
            body = path.read_bytes()
        seen[str(path.relative_to(root))] = (stat.S_IFMT(mode), body)
    return seen


@pytest.fixture(scope="module")
def image(tiny: Path) -> Path:
    path = tiny / "pool.safetensors"
    assert metrale("pack", tiny / "a", "--model", tiny, "--max-loras", 1, "--out", path).code == 0
    return path


@pytest.mark.slow
@given(kind=st.sampled_from(OUTPUT_KINDS), force=st.booleans(),
       command=st.sampled_from(["pack", "synth", "unpack", "simulate"]))
def test_output_paths_keep_the_promise(
    tiny: Path, image: Path, kind: str, force: bool, command: str
) -> None:
    with tempfile.TemporaryDirectory(dir=tiny) as scratch:
        root = Path(scratch)
        target = make_output(root, kind)
        before = snapshot(root)
        if command == "pack":
            args = ["pack", tiny / "a", "--model", tiny, "--max-loras", 2, "--out", target]
        elif command == "synth":
            args = ["synth", target, "--model", tiny, "--modules", "q_proj", "--rank", 2]
        elif command == "unpack":
            args = ["unpack", image, target, "--slot", 0]
        else:
            args = ["simulate", "--model", tiny, "--modules", "q_proj", "--max-rank", 8,
                    "--requests", 5, "--max-loras", "2", "--save-trace", target]
        result = run(*args, *(["--force"] if force else []))
        try:
            after = snapshot(root)
            assert [p for p in after if p.endswith(".tmp")] == []
            if result.code != 0:
                assert after == before  # nothing written, nothing replaced
            elif command == "pack":
                written = Path(target)
                assert stat.S_ISREG(os.lstat(written).st_mode)
                assert PoolImage.open(written).max_loras == 2
            elif command == "simulate":
                assert len(Path(target).read_text().splitlines()) == 5
            else:
                assert sorted(p.name for p in Path(target).iterdir()) == [
                    "adapter_config.json", "adapter_model.safetensors"]
            if kind in ("fifo", "symlink_to_devnull", "directory") and command in (
                    "pack", "simulate"):
                assert result.code == 2
            if kind in ("fifo", "symlink_to_devnull", "regular") and command in (
                    "synth", "unpack"):
                assert result.code == 2
            if kind == "regular" and command == "pack":
                assert result.code == (0 if force else 2)
        finally:
            if (root / "ro").exists():
                (root / "ro").chmod(0o700)  # so the scratch directory can be removed
