"""Hostile and careless input, one regression test per way it once served wrong weights, lost
data or hung: the naming rule, non-finite config values, layout refusing what pack refuses,
outputs (non-regular files, concurrent writers, signals, odd paths), catastrophic regexes, Rich
markup in names, exit 70 where a usage error belongs, METRALE_* booleans, --model resolution and
COLUMNS=0."""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from metrale_cli import env
from metrale_cli.adapters import patterns
from metrale_cli.errors import OutputExists, UsageError
from metrale_cli.files import atomic
from metrale_cli.files.atomic import atomic_write, remove_stale_temps
from metrale_cli.files.safetensors_header import read_header
from tests.support.cli_runner import Result, metrale
from tests.support.hostile_inputs import CATASTROPHIC, TINY, tiny_model
from tests.support.image_edit import edit_metadata


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model directory with one synthesised adapter `a` (rank 2) beside its config."""
    return tiny_model(tmp_path_factory.mktemp("hostile"))


def copy_adapter(src: Path, dst: Path, **config: object) -> Path:
    """A copy of adapter `src` at `dst` whose config has `config` merged in."""
    dst.mkdir(parents=True)
    doc = json.loads((src / "adapter_config.json").read_text())
    doc.update(config)
    (dst / "adapter_config.json").write_text(json.dumps(doc))
    (dst / "adapter_model.safetensors").write_bytes((src / "adapter_model.safetensors")
                                                    .read_bytes())
    return dst


def one_line_error(result: Result, code: int) -> None:
    assert result.code == code, (result.code, result.stdout, result.stderr)
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr


def strict_json(text: str) -> object:
    """JSON as the standard has it: NaN and Infinity are not JSON."""
    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def run_cli(*args: object, env_extra: dict[str, str] | None = None, cwd: Path | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "metrale_cli", *map(str, args)],
                          capture_output=True, text=True, env=environment, cwd=cwd,
                          timeout=timeout)


# -- 2: one naming rule ------------------------------------------------------------------------


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


# -- 3: non-finite and non-integral config values ----------------------------------------------


@pytest.mark.parametrize("field,value,named", [
    ("lora_alpha", math.nan, "'lora_alpha'"),
    ("lora_alpha", math.inf, "'lora_alpha'"),
    ("r", math.nan, "'r'"),
    ("r", math.inf, "'r'"),
    ("r", 2.5, "'r'"),
    ("alpha_pattern", {"q_proj": math.inf}, "alpha_pattern['q_proj']"),
    ("rank_pattern", {"q_proj": math.nan}, "rank_pattern['q_proj']"),
    ("rank_pattern", {"q_proj": 1.5}, "rank_pattern['q_proj']"),
    # Finite, but a scale the pool's float32 tables cannot hold (it became Infinity there).
    ("lora_alpha", 1e300, "'lora_alpha'"),
    ("alpha_pattern", {"q_proj": 1e-30}, "alpha_pattern"),
])
def test_non_finite_config_values_are_audit_errors(
    tiny: Path, tmp_path: Path, field: str, value: object, named: str
) -> None:
    bad = copy_adapter(tiny / "a", tmp_path / "bad", **{field: value})
    result = metrale("inspect", bad, "--model", tiny, "--json")
    assert result.code == 1, result.stderr
    doc = strict_json(result.stdout)
    findings = doc["adapters"][0]["findings"]
    assert any(f["code"] == "bad_config_value" and named in f["message"] for f in findings)
    view = metrale("inspect", bad, "--model", tiny)
    assert view.code == 1 and "bad_config_value" in view.stdout, view.stderr
    packed = metrale("pack", bad, "--model", tiny, "--max-loras", 2, "--json")
    # The refusal's record (issue 18.28), strict JSON even for a NaN alpha.
    assert packed.code == 1 and strict_json(packed.stdout)["adapters"][0]["servable"] is False


def test_synth_refuses_a_non_finite_alpha(tmp_path: Path) -> None:
    for alpha in ("nan", "inf", "-inf"):
        one_line_error(metrale("synth", tmp_path / alpha, "--model", "qwen3-8b", "--modules",
                               "q_proj", "--rank", 8, "--alpha", alpha), 2)
        assert not (tmp_path / alpha).exists()


# -- 5: layout refuses where pack refuses ------------------------------------------------------


def test_layout_refuses_what_pack_refuses(tiny: Path, tmp_path: Path) -> None:
    # No (layer, module) pair applies: a dense model has no linear-attention out_proj.
    empty = metrale("layout", "--model", "qwen3-8b", "--modules", "out_proj", "--max-rank", 8,
                    "--budget", "40GiB")
    one_line_error(empty, 2)
    assert "applies to any layer" in empty.stderr
    # An adapter above --max-rank, and a DoRA adapter: the same refusal, exit 1, by layout,
    # simulate (which sizes its slots by the adapters) and pack.
    dora = copy_adapter(tiny / "a", tmp_path / "dora", use_dora=True)
    for args in ((tiny / "a", "--max-rank", 1), (dora,)):
        planned = metrale("layout", *args, "--model", tiny)
        simulated = metrale("simulate", *args, "--model", tiny, "--requests", 20)
        packed = metrale("pack", *args, "--model", tiny, "--max-loras", 2)
        assert planned.code == simulated.code == packed.code == 1, (
            planned.stderr, simulated.stderr, packed.stderr)
        assert planned.stderr == simulated.stderr == packed.stderr
        assert planned.stdout == simulated.stdout == ""
    # Modules the adapter has outside --modules: refused by both, naming the adapter.
    narrow = metrale("layout", tiny / "a", "--model", tiny, "--modules", "k_proj")
    one_line_error(narrow, 2)
    assert "error: a: out_proj on layer 0 is not in the pool's layout" in narrow.stderr


# -- 6-9: outputs ------------------------------------------------------------------------------


def test_force_never_replaces_a_non_regular_file(tiny: Path, tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    to_null = tmp_path / "to-null"
    to_null.symlink_to(os.devnull)
    for target in (fifo, to_null):
        result = metrale("pack", tiny / "a", "--model", tiny, "--max-loras", 1, "--out", target,
                         "--force")
        one_line_error(result, 2)
        assert "not a regular file" in result.stderr
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert os.readlink(to_null) == os.devnull and stat.S_ISCHR(os.stat(os.devnull).st_mode)


def _racer(path: str, barrier: Any, payload: bytes) -> None:
    """One writer: its exit code is 0 when it published, 2 when told the output exists."""
    def write(f: Any) -> None:
        f.write(payload)
        barrier.wait(timeout=30)  # both temp files are written: now both publish at once
    try:
        atomic_write(Path(path), write, force=False)
    except OutputExists:
        sys.exit(2)
    sys.exit(0)


def test_two_concurrent_writers_one_wins(tmp_path: Path) -> None:
    """Two processes write the same output without --force at the same moment: exactly one file
    appears, whole, and the other writer is told it exists."""
    target = tmp_path / "pool.safetensors"
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(2)
    writers = [ctx.Process(target=_racer, args=(str(target), barrier, payload))
               for payload in (b"A" * 4096, b"B" * 4096)]
    for w in writers:
        w.start()
    for w in writers:
        w.join(timeout=60)
    assert sorted(w.exitcode for w in writers) == [0, 2]
    assert target.read_bytes() in (b"A" * 4096, b"B" * 4096)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pool.safetensors"]


@pytest.mark.proc
def test_two_concurrent_packs_one_wins(tiny: Path, tmp_path: Path) -> None:
    target = tmp_path / "pool.safetensors"
    args = [sys.executable, "-m", "metrale_cli", "pack", str(tiny / "a"), "--model", str(tiny),
            "--max-loras", "2", "--out", str(target)]
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    done = [p.communicate(timeout=120) for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 2], done
    loser = done[[p.returncode for p in procs].index(2)]
    assert "exists" in loser[1] and loser[0] == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pool.safetensors"]


# The pack in the child blocks after its image is fully written to the temp file and before it
# is published, and says so on stderr: the signal lands while the temp file exists.
_SLOW_PACK = """
import sys, time
import metrale_cli.image.pool_image as image
from metrale_cli.cli.app import main
publish = image.atomic_write
def held(path, write, force):
    def hold(f):
        write(f)
        f.flush()
        sys.stderr.write("written\\n")
        sys.stderr.flush()
        time.sleep(120)
    return publish(path, hold, force)
image.atomic_write = held
sys.argv = ["metrale", *sys.argv[1:]]
main()
"""


@pytest.mark.proc
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_during_pack_out_leaves_no_temp_file(
    tiny: Path, tmp_path: Path, signum: int
) -> None:
    target = tmp_path / "pool.safetensors"
    # The signal's default action, whatever the suite inherited (under nohup SIGHUP is ignored,
    # and an ignored hangup stays ignored: the next test).
    child = subprocess.Popen(
        [sys.executable, "-c", _SLOW_PACK, "pack", str(tiny / "a"), "--model", str(tiny),
         "--max-loras", "2", "--out", str(target)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signum, signal.SIG_DFL))
    assert child.stderr is not None
    assert child.stderr.readline() == "written\n"
    temps = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert len(temps) == 1 and temps[0].stat().st_size > 0
    child.send_signal(signum)
    _, rest = child.communicate(timeout=60)
    assert child.returncode == 128 + signum, rest
    assert "terminated" in rest and "Traceback" not in rest
    assert list(tmp_path.iterdir()) == []


@pytest.mark.proc
def test_an_ignored_hangup_stays_ignored(tiny: Path, tmp_path: Path) -> None:
    """Under `nohup` (SIGHUP ignored) a hangup during the write does not end it."""
    target = tmp_path / "pool.safetensors"
    child = subprocess.Popen(
        [sys.executable, "-c", _SLOW_PACK, "pack", str(tiny / "a"), "--model", str(tiny),
         "--max-loras", "2", "--out", str(target)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    assert child.stderr is not None
    assert child.stderr.readline() == "written\n"
    child.send_signal(signal.SIGHUP)
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=1)  # still writing
    child.send_signal(signal.SIGTERM)
    _, rest = child.communicate(timeout=60)
    assert child.returncode == 128 + signal.SIGTERM, rest
    assert list(tmp_path.iterdir()) == []


def test_stale_temp_files_of_dead_writers_are_removed(tiny: Path, tmp_path: Path) -> None:
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True)
    dead_pid = int(finished.stdout)
    stale = tmp_path / f".pool.safetensors.{dead_pid}.k2x_9abc.tmp"
    live = tmp_path / f".pool.safetensors.{os.getpid()}.zz81qq0p.tmp"
    other = tmp_path / f".other.safetensors.{dead_pid}.k2x_9abc.tmp"
    for p in (stale, live, other):
        p.write_bytes(b"partial")
    result = metrale("pack", tiny / "a", "--model", tiny, "--max-loras", 1, "--out",
                     tmp_path / "pool.safetensors")
    assert result.code == 0, result.stderr
    assert not stale.exists() and live.exists() and other.exists()
    assert remove_stale_temps(tmp_path, "other.safetensors") == [other]


@pytest.mark.parametrize("out,says", [("", "--out is empty"), ("  ", "--out is empty"),
                                      ("newdir/", "names a directory")])
def test_out_must_name_a_file(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, out: str, says: str
) -> None:
    monkeypatch.chdir(tmp_path)
    result = metrale("pack", tiny / "a", "--model", tiny, "--max-loras", 1, "--out", out)
    one_line_error(result, 2)
    assert says in result.stderr and list(tmp_path.iterdir()) == []


# -- 10: regexes -------------------------------------------------------------------------------


@pytest.mark.proc
def test_the_issues_regexes_finish(tiny: Path, tmp_path: Path) -> None:
    """`(.*.*)*z` once ran past 20 s in `re`; matched through `regex`, it finishes at once."""
    bad = copy_adapter(tiny / "a", tmp_path / "slow", target_modules="(.*.*)*z",
                       rank_pattern={"(.*.*.*.*.*.*.*.*.*.*)*z": 2})
    start = time.monotonic()
    done = run_cli("inspect", bad, "--model", tiny, "--json", timeout=60)
    assert done.returncode == 0 and time.monotonic() - start < 20, done.stderr
    codes = {f["code"] for f in json.loads(done.stdout)["adapters"][0]["findings"]}
    assert "unexplained_key" in codes


@pytest.mark.parametrize("field,value", [
    ("target_modules", CATASTROPHIC),
    ("rank_pattern", {CATASTROPHIC: 2}),
    ("alpha_pattern", {CATASTROPHIC: 4}),
    ("exclude_modules", CATASTROPHIC),
])
def test_catastrophic_regex_is_an_error_not_a_hang(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, field: str, value: object
) -> None:
    monkeypatch.setattr(patterns, "AUDIT_SECONDS", 0.2)
    bad = copy_adapter(tiny / "a", tmp_path / "slow", **{field: value})
    start = time.monotonic()
    result = metrale("inspect", bad, "--model", tiny, "--json")
    assert time.monotonic() - start < 5
    assert result.code == 1, result.stderr
    findings = result.json()["adapters"][0]["findings"]
    errors = [f for f in findings if f["severity"] == "error"]
    assert [f["code"] for f in errors] == ["slow_pattern"] and field in errors[0]["message"]
    assert result.json()["adapters"][0]["modules"] == []


@pytest.mark.parametrize("field,value", [
    ("target_modules", "("),
    ("modules_to_save", ["("]),
    ("layers_pattern", "("),
    ("exclude_modules", "(["),
    ("rank_pattern", {"(": 2}),
])
def test_invalid_regex_is_not_servable(tiny: Path, tmp_path: Path, field: str, value: object
                                       ) -> None:
    config: dict[str, object] = {field: value}
    if field == "layers_pattern":
        config["layers_to_transform"] = [0, 1]
    bad = copy_adapter(tiny / "a", tmp_path / "bad", **config)
    result = metrale("inspect", bad, "--model", tiny, "--json")
    assert result.code == 1, result.stderr
    findings = result.json()["adapters"][0]["findings"]
    assert any(f["code"] == "bad_pattern" and f["message"].startswith(field) for f in findings)


# -- 11: markup --------------------------------------------------------------------------------


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


# -- 12: usage and format errors, never exit 70 ------------------------------------------------


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


# -- 13: METRALE_* booleans --------------------------------------------------------------------


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


# -- 14: --model resolution --------------------------------------------------------------------


def test_an_adapter_directory_named_like_a_preset_does_not_hide_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert metrale("synth", "qwen3-8b", "--model", "qwen3-8b", "--modules", "q_proj",
                   "--rank", 8).code == 0
    result = metrale("inspect", "qwen3-8b", "--json")
    assert result.code == 0, result.stderr
    assert result.json()["model"]["source"] == "qwen3-8b"
    # A directory that is no preset and holds no config.json says so.
    (tmp_path / "plain").mkdir()
    missing = metrale("layout", "--model", "plain", "--modules", "q_proj", "--max-rank", 8)
    one_line_error(missing, 2)
    assert "without config.json" in missing.stderr


# -- 15: COLUMNS=0 -----------------------------------------------------------------------------


@pytest.mark.proc
def test_zero_columns_still_prints(tiny: Path) -> None:
    done = run_cli("inspect", tiny / "a", "--model", tiny, env_extra={"COLUMNS": "0"})
    assert done.returncode == 0, done.stderr
    assert "servable" in done.stdout
    refused = run_cli("inspect", "/nonexistent", env_extra={"COLUMNS": "0"})
    assert refused.returncode == 2 and "no such adapter" in refused.stderr


# -- Click's own usage errors, and line breaks in input ----------------------------------------


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


def test_synth_writes_nothing_beside_a_device(tmp_path: Path) -> None:
    out = tmp_path / "adapter"
    out.mkdir()
    (out / "adapter_config.json").symlink_to(os.devnull)
    result = metrale("synth", out, "--model", "qwen3-8b", "--modules", "q_proj", "--rank", 8,
                     "--force")
    one_line_error(result, 2)
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json"]


def test_unpack_never_replaces_a_non_directory(tiny: Path, tmp_path: Path) -> None:
    image = tmp_path / "pool.safetensors"
    assert metrale("pack", tiny / "a", "--model", tiny, "--max-loras", 1, "--out", image).code == 0
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    to_null = tmp_path / "to-null"
    to_null.symlink_to(os.devnull)
    for target in (fifo, to_null):
        result = metrale("unpack", image, target, "--slot", 0, "--force")
        one_line_error(result, 2)
        assert "not a directory" in result.stderr
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and os.readlink(to_null) == os.devnull
    one_line_error(metrale("unpack", image, "", "--slot", 0, "--force"), 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "pool.safetensors", "to-null"]


def test_a_hub_id_is_named_by_the_same_rule(tiny: Path, tmp_path: Path) -> None:
    """`org/x` and a local directory `x` are both named `x`: refused before anything is read."""
    local = copy_adapter(tiny / "a", tmp_path / "x")
    result = metrale("inspect", "some-org/x", local, "--model", tiny)
    one_line_error(result, 2)
    assert "two adapters are named 'x'" in result.stderr


# -- issue 18: hostile input that still escaped, and what a new user trips over ----------------


@pytest.mark.parametrize("rank,world", [("x", "abc"), ("0", "abc"), ("2", "2"), ("-1", "2")])
def test_torchrun_variables_that_are_not_a_launch_are_refused(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rank: str, world: str
) -> None:
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", world)
    result = metrale("pack", tiny / "a", "--model", tiny, "--max-loras", 2, "--tp", 2,
                     "--out", tmp_path / "ranks")
    one_line_error(result, 2)
    assert f"RANK={rank!r} WORLD_SIZE={world!r}" in result.stderr
    assert not (tmp_path / "ranks").exists()


@pytest.mark.proc
def test_a_scale_past_float32_is_one_error_line(tiny: Path, tmp_path: Path) -> None:
    image = tmp_path / "pool.safetensors"
    assert metrale("pack", tiny / "a", "--model", tiny, "--max-loras", 2, "--out", image).code == 0
    slots = read_header(image).metadata["metrale.slots"]
    edit_metadata(image, "metrale.slots", slots.replace('"scaling":2.0', '"scaling":1e39', 1))
    # In a process of its own: NumPy's warnings go to the real stderr.
    result = run_cli("show", image)
    assert result.returncode == 1, result.stderr
    assert result.stderr.count("\n") == 1 and "Warning" not in result.stderr, result.stderr
    assert "the slot's metadata says 1e+39" in result.stderr


@pytest.mark.proc
@pytest.mark.parametrize("existing", [False, True])
def test_synth_onto_a_full_disk_leaves_nothing(tmp_path: Path, existing: bool) -> None:
    # A missing parent is made for it, and removed again.
    out = tmp_path / "adapter" if existing else tmp_path / "made" / "adapter"
    if existing:  # an empty directory made for it stays as it was: empty
        out.mkdir()

    def small_disk() -> None:
        # Writes past 64 KiB fail with EFBIG (Python ignores SIGXFSZ), as on a full disk.
        import resource
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))

    result = subprocess.run([sys.executable, "-m", "metrale_cli", "synth", str(out), "--model",
                             "qwen3-8b", "--modules", "q_proj", "--rank", "8"],
                            capture_output=True, text=True, preexec_fn=small_disk, timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "File too large" in result.stderr, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == (["adapter"] if existing else [])
    assert not existing or list(out.iterdir()) == []


@pytest.mark.parametrize("length", [240, 255])
def test_a_long_legal_out_name_is_written(tiny: Path, tmp_path: Path, length: int) -> None:
    image = tmp_path / ("p" * (length - len(".safetensors")) + ".safetensors")
    result = metrale("pack", tiny / "a", "--model", tiny, "--max-loras", 2, "--out", image)
    assert result.code == 0, result.stderr
    adapter = tmp_path / ("é" * (length // 2))  # 2 bytes a character: NAME_MAX counts bytes
    assert metrale("unpack", image, "--slot", 0, adapter).code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([image.name, adapter.name])


def test_a_long_names_stale_temp_is_still_swept(tmp_path: Path) -> None:
    target = tmp_path / ("x" * 250)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    pid = int(dead.stdout)

    def left_by_dead_writer(path: Path) -> Path:
        """What a writer with that pid, SIGKILLed, left behind: its temp file for `path`."""
        prefix = atomic._temp_prefix(path).replace(f".{os.getpid()}.", f".{pid}.")
        (tmp_path / f"{prefix}abcdefgh.tmp").write_bytes(b"partial")
        return tmp_path / f"{prefix}abcdefgh.tmp"

    stale = left_by_dead_writer(target)
    # Another long name with the same start: its temp name is cut alike, its digest differs.
    other = left_by_dead_writer(tmp_path / ("x" * 249 + "y"))
    assert remove_stale_temps(tmp_path, target.name) == [stale]
    assert other.exists()


def test_pack_never_writes_over_one_of_its_inputs(tiny: Path, tmp_path: Path) -> None:
    adapter = copy_adapter(tiny / "a", tmp_path / "a")
    weights = (adapter / "adapter_model.safetensors").read_bytes()
    (tmp_path / "link.safetensors").symlink_to(adapter / "adapter_model.safetensors")
    for out in (adapter / "adapter_model.safetensors", adapter / "adapter_config.json",
                tmp_path / "link.safetensors"):
        result = metrale("pack", adapter, "--model", tiny, "--max-loras", 2, "--out", out,
                         "--force")
        one_line_error(result, 2)
        assert "an input of this command" in result.stderr
    assert (adapter / "adapter_model.safetensors").read_bytes() == weights


def large_pattern_errors(result: Result) -> list[str]:
    assert result.code == 1, result.stderr
    adapter = result.json()["adapters"][0]
    assert adapter["modules"] == []
    return [f["message"] for f in adapter["findings"] if f["code"] == "large_pattern"]


@pytest.mark.parametrize("field,value,says", [
    ("target_modules", "(" + "|".join(f"model.layers.{i}.self_attn.q_proj"
                                      for i in range(200_000)) + ")",
     "the config's regexes (target_modules) hold 7,288,891 characters"),
    ("rank_pattern", {f"layers.{i}.q_proj": 2 for i in range(patterns.MAX_PATTERNS + 1)},
     f"the config holds {patterns.MAX_PATTERNS + 1:,} regexes (rank_pattern)"),
    ("target_modules", [f"layers.{i}.q_proj" for i in range(patterns.MAX_NAMES + 1)],
     f"target_modules lists {patterns.MAX_NAMES + 1:,} names"),
])
def test_patterns_are_bounded_by_size_not_by_time(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, field: str, value: object,
    says: str
) -> None:
    # No time bound to run into: the refusal is by size, the same on any machine under any load.
    monkeypatch.setattr(patterns, "AUDIT_SECONDS", 1e9)
    compiled: list[str] = []
    monkeypatch.setattr(patterns, "compile_error", lambda p: compiled.append(p))
    bad = copy_adapter(tiny / "a", tmp_path / "large", **{field: value})
    errors = large_pattern_errors(metrale("inspect", bad, "--model", tiny, "--json"))
    assert len(errors) == 1 and says in errors[0], errors
    assert compiled == []


def test_a_long_name_list_within_the_bound_matches_as_peft_does(tiny: Path,
                                                                 tmp_path: Path) -> None:
    # Matched by looking up a path's dotted suffixes in a set, no longer name by name.
    names = [f"layers.{i}.mlp.gate_proj" for i in range(patterns.MAX_NAMES - 3)]
    # A dotted suffix matches, a bare last part matches, a part of a name does not.
    names += ["self_attn.q_proj", "k_proj", "_proj"]
    adapter = copy_adapter(tiny / "a", tmp_path / "long", target_modules=names)
    result = metrale("inspect", adapter, "--model", tiny, "--json")
    assert result.code == 0, result.stderr
    unexplained = {f["message"].split()[0] for f in result.json()["adapters"][0]["findings"]
                   if f["code"] == "unexplained_key"}
    assert unexplained == {"o_proj", "v_proj", "out_proj"}


@pytest.mark.parametrize("edit,says", [
    ({"head_dim": 0}, "'head_dim' missing or not a positive integer"),
    ({"num_key_value_heads": 7}, "'num_key_value_heads' 7 does not divide 'num_attention_heads' 2"),
    ({"num_key_value_heads": 0}, "'num_key_value_heads' missing or not a positive integer"),
    ({"head_dim": None, "hidden_size": 1}, "no 'head_dim', and 'hidden_size' 1 is smaller"),
])
def test_base_model_configs_that_cannot_be_built_are_refused(
    tmp_path: Path, edit: dict[str, object], says: str
) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**TINY, **edit}))
    result = metrale("layout", "--model", tmp_path, "--modules", "q_proj", "--max-rank", 8)
    one_line_error(result, 2)
    assert says in result.stderr


def test_a_null_head_dim_is_derived(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**TINY, "head_dim": None,
                                                      "num_key_value_heads": None}))
    result = metrale("layout", "--model", tmp_path, "--modules", "q_proj", "--max-rank", 8,
                     "--json")
    assert result.code == 0, result.stderr


def not_a_file(path: Path, kind: str) -> None:
    """Replace the file `path` with something of `kind` that is no regular file."""
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        path.symlink_to(os.devnull)
    else:  # a symbolic link loop
        path.symlink_to(path.name)


@pytest.mark.parametrize("kind,says", [("fifo", "a FIFO"), ("device", "a character device"),
                                       ("loop", "a symbolic link loop")])
@pytest.mark.parametrize("which", ["config.json", "adapter_config.json",
                                   "adapter_model.safetensors", "pool.safetensors"])
def test_an_input_that_is_not_a_regular_file_says_so(
    tiny: Path, tmp_path: Path, kind: str, says: str, which: str
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY))
    adapter = copy_adapter(tiny / "a", tmp_path / "a")
    image = tmp_path / "pool.safetensors"
    assert metrale("pack", adapter, "--model", model, "--max-loras", 2, "--out", image).code == 0
    path = {"config.json": model / "config.json", "pool.safetensors": image}.get(
        which, adapter / which)
    not_a_file(path, kind)
    args = ["show", image] if which == "pool.safetensors" else ["inspect", adapter, "--model",
                                                                 model]
    if kind == "fifo":  # in a process of its own, with a time limit: reading one would block
        ran = run_cli(*args, timeout=30)
        code, stderr = ran.returncode, ran.stderr
    else:
        result = metrale(*args)
        code, stderr = result.code, result.stderr
    assert code == 2, stderr
    assert stderr == f"error: {path}: {says}, not a regular file\n"


@pytest.mark.proc
@pytest.mark.parametrize("online", [[], ["--online"]])
def test_a_hugging_face_home_that_is_no_directory_is_one_line(
    tiny: Path, online: list[str]
) -> None:
    result = run_cli("inspect", tiny / "a", "--model", "org/name", *online,
                     env_extra={"HF_HOME": os.devnull, "HF_ENDPOINT": "http://127.0.0.1:9"})
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "Errno" not in result.stderr, result.stderr
    assert "/dev/null" in result.stderr


@pytest.mark.parametrize("command", ["layout", "pack"])
def test_a_json_refusal_prints_its_record(tiny: Path, tmp_path: Path, command: str) -> None:
    bad = copy_adapter(tiny / "a", tmp_path / "bad", use_dora=True)
    args = ["--max-loras", 2, "--out", tmp_path / "pool.safetensors"] if command == "pack" else []
    result = metrale(command, tiny / "a", bad, "--model", tiny, *args, "--json")
    assert result.code == 1, result.stderr
    adapters = {a["name"]: a for a in result.json()["adapters"]}
    assert adapters["a"]["servable"] and not adapters["bad"]["servable"]
    assert [f["code"] for f in adapters["bad"]["findings"] if f["severity"] == "error"] == ["dora"]
    # stderr: one line per error finding, then the summary.
    lines = result.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith("bad: dora: ")
    assert lines[1] == "error: 1 adapter(s) not servable: bad"
    assert not (tmp_path / "pool.safetensors").exists()


def test_show_json_of_an_inconsistent_image_prints_its_record(tiny: Path,
                                                              tmp_path: Path) -> None:
    image = tmp_path / "pool.safetensors"
    assert metrale("pack", tiny / "a", "--model", tiny, "--max-loras", 2, "--out", image).code == 0
    slots = read_header(image).metadata["metrale.slots"]
    edit_metadata(image, "metrale.slots", slots.replace('"scaling":2.0', '"scaling":3.0', 1))
    result = metrale("show", image, "--json")
    one_line_error(result, 1)
    assert result.json() == {"path": str(image), "format": "pool/1", "valid": False,
                             "problems": ["slot 0 (a): scales[0] is 2; the slot's metadata "
                                          "says 3.0"]}
    assert result.stderr == f"error: {image}: slot 0 (a): scales[0] is 2; the slot's metadata " \
                            "says 3.0\n"


def test_at_80_columns_no_value_is_split_across_lines(tiny: Path, tmp_path: Path) -> None:
    image = tmp_path / "pool.safetensors"
    pack = metrale("pack", tiny / "a", "--model", tiny, "--max-loras", 2, "--out", image,
                   columns=80)
    assert pack.code == 0, pack.stderr
    fingerprint = metrale("show", image, "--json").json()["layout"]["fingerprint"]
    lines = pack.stdout.splitlines()
    assert any(line.endswith(f"layout fingerprint {fingerprint}") for line in lines), lines
    assert any(line.endswith("1 empty cache slots") for line in lines), lines
    record = metrale("layout", tiny / "a", "--model", tiny, "--max-loras", 2800, "--json").json()
    slot, pool = record["slot_bytes"], record["pool_bytes"]
    show = metrale("show", image, columns=80).stdout.splitlines()
    assert f"fingerprint  {fingerprint}" in show
    assert any(line.startswith("layout ") and f"slot {slot:,} B, 2 slots" in line
               for line in show), show
    layout = metrale("layout", tiny / "a", "--model", tiny, "--max-loras", 2800,
                     columns=80).stdout.splitlines()
    # One separator for every count of slots, as the budget line has.
    assert any(line.startswith("pool ") and f"2,800 slots: {pool:,} B (" in line
               for line in layout), layout
    assert any(line.startswith("slot ") and f"{slot:,} B (" in line for line in layout), layout


@pytest.mark.parametrize("command", ["show", "layout", "inspect"])
def test_no_color_on_a_terminal_sends_no_styles(tiny: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch,
                                                command: str) -> None:
    image = tmp_path / "pool.safetensors"
    assert metrale("pack", tiny / "a", "--model", tiny, "--max-loras", 2, "--out", image).code == 0
    args = [image] if command == "show" else [tiny / "a", "--model", tiny]
    monkeypatch.setenv("FORCE_COLOR", "1")  # Rich takes stdout for a terminal
    styled = metrale(command, *args)
    assert styled.code == 0 and "\x1b[" in styled.stdout
    monkeypatch.setenv("NO_COLOR", "1")
    plain = metrale(command, *args)
    assert plain.code == 0 and "\x1b" not in plain.stdout + plain.stderr, plain.stdout


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


def test_inspect_says_which_rank_the_slot_uses_and_why(tiny: Path) -> None:
    def slot_line(*args: object) -> str:
        result = metrale("inspect", tiny / "a", "--model", tiny, *args, columns=200)
        return next(line for line in result.stdout.splitlines() if "slot  " in line)

    assert "at rank 2: its own rank, above --max-rank 1 (refused)" in slot_line("--max-rank", 1)
    assert "at rank 16: --max-rank 16 (its rank is 2)" in slot_line("--max-rank", 16)
    assert "at rank 8: its rank 2 rounded up to a multiple of 8 (the kernels')" in slot_line()


def test_pack_tp_checks_its_out_directory_before_the_audit(tiny: Path, tmp_path: Path) -> None:
    bad = copy_adapter(tiny / "a", tmp_path / "bad", use_dora=True)  # the audit would refuse it
    taken = tmp_path / "ranks"
    taken.mkdir()
    result = metrale("pack", bad, "--model", tiny, "--max-loras", 2, "--tp", 2, "--out", taken)
    one_line_error(result, 2)
    assert f"{taken} exists; pass --force" in result.stderr
    (taken / "notes.txt").write_text("mine")
    forced = metrale("pack", bad, "--model", tiny, "--max-loras", 2, "--tp", 2, "--out", taken,
                     "--force")
    one_line_error(forced, 2)
    assert "holds notes.txt, which metrale does not write there" in forced.stderr


def test_synth_rank_is_bounded_by_the_weights_it_adapts(tmp_path: Path) -> None:
    result = metrale("synth", tmp_path / "a", "--model", "qwen3-8b", "--modules", "q_proj",
                     "--rank", 100_000_000)
    one_line_error(result, 2)
    assert "--rank 100000000 is above 4096" in result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.sweep
def test_simulate_off_a_terminal_is_not_silent(tiny: Path) -> None:
    # 3 policies x 1 size x 30,000 requests: progress is told at the end of each replay.
    result = metrale("simulate", "--model", tiny, "--modules", "q_proj", "--max-rank", 8,
                     "--workload", "zipf", "--adapters", 50, "--requests", 30_000,
                     "--max-loras", 8)
    assert result.code == 0, result.stderr
    said = [line for line in result.stderr.splitlines() if line.startswith("simulating: ")]
    assert said == ["simulating: 30% of 90,000 request replays",
                    "simulating: 60% of 90,000 request replays"], result.stderr
