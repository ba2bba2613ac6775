"""`inspect --engine vllm --confirm`: metrale's prediction set against the installed vLLM.

One real server start (the CPU build's API server on a tiny Qwen3, 1-3 minutes on 2 cores)
covers an adapter vLLM serves (its output differs from the base's), one it ignores under
`--lora-target-modules` (its output equals the base's), one it refuses (DoRA: HTTP 500 with
vLLM's reason, as predicted), and a disagreement: the rules in a test double forget
`--max-lora-rank`, so they say a rank-32 adapter serves under 16, and the engine refuses it.
The rest runs no vLLM: bad inputs, and a stand-in engine (a shell script in the python's place)
that never gets ready, exits at once, or is interrupted, whose processes must all be gone.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import stat
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from rich.console import Console

from metrale_cli.engines import vllm as vllm_engine
from metrale_cli.engines.verdict import EngineVerdict, Verdict
from metrale_cli.engines.vllm import VllmEngine
from tests.conftest import VLLM_CACHE_ROOT, VLLM_PYTHON
from tests.support.cli_runner import Result, metrale

ROOT = Path(__file__).resolve().parent.parent
# What the CPU build needs on the tiny model beyond the LoRA flags metrale sets.
CPU_ARGS = ("--max-model-len 64 --max-num-seqs 4 --max-num-batched-tokens 64 --enforce-eager "
            "--skip-tokenizer-init")


@pytest.fixture(scope="module")
def adapter(peft_zoo) -> Path:  # type: ignore[no-untyped-def]
    """A real PEFT adapter on the tiny Qwen3 (header-only base): the stand-in engines and the
    bad inputs need one to predict for, never its weights in an engine."""
    return peft_zoo.adapter("qwen3", r=8, lora_alpha=16, target_modules=["q_proj"]).path


# -- bad inputs: one line, exit 2, no engine started -----------------------------------------


@pytest.mark.parametrize(("args", "said"), [
    (["--confirm"], "--confirm needs --engine vllm"),
    (["--engine", "vllm", "--engine-python", "/bin/sh"], "--engine-python needs --confirm"),
    (["--engine", "vllm", "--confirm-timeout", "5"], "--confirm-timeout needs --confirm"),
    (["--engine", "vllm", "--confirm", "--engine-python", "/no/such/python"],
     "--engine-python /no/such/python: no such file"),
    (["--engine", "vllm", "--confirm", "--engine-python", "pyproject.toml"],
     "--engine-python pyproject.toml: not executable"),
    (["--engine", "vllm", "--confirm", "--engine-args", "--max-loras 4"],
     "--engine-args: --max-loras is not passed through (give metrale's --max-loras)"),
    (["--engine", "vllm", "--confirm", "--engine-args", "--port=8000"],
     "--engine-args: --port is not passed through (metrale sets it)"),
    (["--engine", "vllm", "--confirm", "--engine-args", "'unclosed"],
     "--engine-args \"'unclosed\": No closing quotation"),
    (["--engine", "vllm", "--confirm", "--confirm-timeout", "0"],
     "--confirm-timeout 0.0: a positive number of seconds, at most 604800 (a week)"),
    # Spellings vLLM's parser takes for the options metrale sets (a prefix, `_` for `-`, the
    # `--no-` of a boolean, a dotted JSON key): the server would listen beyond 127.0.0.1.
    (["--engine", "vllm", "--confirm", "--engine-args", "--hos 0.0.0.0"],
     "--engine-args: --hos is vLLM's --host, not passed through (metrale sets it)"),
    (["--engine", "vllm", "--confirm", "--engine-args", "--ho=0.0.0.0"],
     "--engine-args: --ho is vLLM's --host, not passed through (metrale sets it)"),
    (["--engine", "vllm", "--confirm", "--engine-args", "--enforce-eager --por 8000"],
     "--engine-args: --por is vLLM's --port, not passed through (metrale sets it)"),
    (["--engine", "vllm", "--confirm", "--engine-args", "--max_loras 9"],
     "--engine-args: --max_loras is vLLM's --max-loras, not passed through (give metrale's "
     "--max-loras)"),
    (["--engine", "vllm", "--confirm", "--engine-args", "--max-lora_rank 64"],
     "--engine-args: --max-lora_rank is vLLM's --max-lora-rank, not passed through (give "
     "metrale's --max-rank)"),
    (["--engine", "vllm", "--confirm", "--engine-args", "--tensor_parallel_size 2"],
     "--engine-args: --tensor_parallel_size is vLLM's --tensor-parallel-size, not passed "
     "through (give metrale's --tp)"),
    (["--engine", "vllm", "--confirm", "--engine-args", "-t 2"],
     "--engine-args: -t is vLLM's -tp, not passed through (give metrale's --tp)"),
    (["--engine", "vllm", "--confirm", "--engine-args", "--lora_modules z=/etc"],
     "--engine-args: --lora_modules is vLLM's --lora-modules, not passed through (metrale "
     "sets it)"),
    (["--engine", "vllm", "--confirm", "--engine-args", "--no-enable-lora"],
     "--engine-args: --no-enable-lora is not passed through (metrale sets it)"),
    (["--engine", "vllm", "--confirm", "--engine-args", "--host.x 1"],
     "--engine-args: --host.x is vLLM's --host, not passed through (metrale sets it)"),
    (["--engine", "vllm", "--confirm", "--engine-args", "--config serve.yaml"],
     "--engine-args: --config is not passed through (its file could set what metrale sets; "
     "give its options as words)"),
    (["--engine", "vllm", "--confirm", "--engine-args", "--enforce-eager --"],
     "--engine-args: -- is not passed through (it would end vLLM's options before "
     "metrale's)"),
    # Options that listen beyond 127.0.0.1 or start engines beside the one checked: KV events
    # on tcp://*:5557, a data-parallel address, a one-letter option with its value attached.
    *[(["--engine", "vllm", "--confirm", "--engine-args", words],
       f"--engine-args: {said} not passed through (it listens beyond 127.0.0.1 or starts "
       "engines beside the one metrale checks)")
      for words, said in (
          ("--kv-e '{\"enable_kv_cache_events\": true}'", "--kv-e is vLLM's --kv-events-config,"),
          ("--data_parallel_a 0.0.0.0", "--data_parallel_a is vLLM's --data-parallel-address,"),
          ("--enforce-eager -n2", "-n2 is vLLM's -n,"), ("-r=1", "-r is"),
          ("--uds /tmp/vllm.sock", "--uds is"), ("--headl", "--headl is vLLM's --headless,"),
          ("--distributed-executor-backend ray",  "--distributed-executor-backend is"))],
    # vLLM takes the word after a dotted key as its value: here metrale's --model would be.
    (["--engine", "vllm", "--confirm", "--engine-args", "--compilation-config.mode"],
     "--engine-args: --compilation-config.mode ends the words without its value (vLLM would "
     "take metrale's --model as it); give it one"),
    # A word no option takes: vLLM's API server reads it as its positional model tag and
    # drops it without a word (the engine started as if it were not given).
    *[(["--engine", "vllm", "--confirm", "--engine-args", words],
       f"--engine-args: {said} is not passed through ({why}, so vLLM's API server would read "
       "it as its positional model tag, which it ignores)")
      for words, said, why in (
          ("foo", "foo", "no option takes it as its value"),
          ("--enforce-eager foo", "foo", "--enforce-eager takes no value"),
          ("--enforce foo", "foo", "--enforce-eager takes no value"),
          ("--max-model-len 64 4096", "4096", "no option takes it as its value"),
          ("--max-model-len 64 '' -5", "''", "no option takes it as its value"),
          ("-O3 --compilation-config.mode 3 x", "x", "no option takes it as its value"))],
    # Past what the clock and sockets can add to a time (an OverflowError once vLLM was up).
    *[(["--engine", "vllm", "--confirm", "--confirm-timeout", given],
       f"--confirm-timeout {read}: a positive number of seconds, at most 604800 (a week)")
      for given, read in (("inf", "inf"), ("1e10", "10000000000.0"), ("1e300", "1e+300"),
                          ("99999999999999999999999", "1e+23"), ("nan", "nan"))],
])
def test_bad_input_is_one_line_and_exit_2(adapter: Path, args: list[str], said: str) -> None:
    done = metrale("inspect", adapter, *args)
    assert done.code == 2, done
    assert done.stderr.strip().splitlines() == [f"error: {said}"], done.stderr


@pytest.mark.parametrize("json_out", [[], ["--json"]])
def test_a_disagreement_ends_with_one_line_saying_why(
        adapter: Path, monkeypatch: pytest.MonkeyPatch, json_out: list[str]) -> None:
    """Exit 1 on a disagreement ends, as every exit 1 does, with one line on stderr naming the
    adapters that did otherwise (--json too, its record on stdout). It said nothing. The
    engine's run is replaced by its record (the real runs are the tests below)."""
    record = {"confirm": {"agrees": False, "disagreements": ["a"], "adapters": [{}, {}]}}

    ran = SimpleNamespace(agrees=False, record=record)
    monkeypatch.setattr(VllmEngine, "confirm", lambda *args, **kwargs: ran)
    monkeypatch.setattr("metrale_cli.cli.render_engine.engine_confirm_view",
                        lambda rec: "confirm view")
    done = metrale("inspect", adapter, "--engine", "vllm", "--confirm", *json_out)
    assert done.code == 1, done
    assert done.stderr.splitlines()[-1] == (
        "error: 1 of 2 adapter(s) did otherwise in the installed vLLM than predicted: a")
    if json_out:
        assert done.json() == record


def test_without_vllm_here_it_asks_for_engine_python(adapter: Path) -> None:
    """The suite's own python has no vllm: the default refuses and names the way out."""
    done = metrale("inspect", adapter, "--engine", "vllm", "--confirm")
    assert done.code == 2
    assert done.stderr.strip() == (f"error: --confirm: this Python ({sys.executable}) cannot "
                                   "import vllm; pass --engine-python PATH, the python of an "
                                   "environment that has vLLM")


@pytest.mark.proc
def test_an_engine_python_without_vllm_is_refused(adapter: Path) -> None:
    done = metrale("inspect", adapter, "--engine", "vllm", "--confirm", "--engine-python",
                   sys.executable)
    assert done.code == 2
    assert done.stderr.strip() == (f"error: --engine-python {sys.executable}: cannot import "
                                   "vllm (exit status 1)")


def _own_spellings() -> list[str]:
    """Every spelling vLLM's parser could take for an option metrale sets or refuses as one that
    listens beyond 127.0.0.1: each prefix of each name (argparse's abbreviations), `_` for `-`,
    a `=value` and a dotted JSON key."""
    from metrale_cli.engines.vllm.confirm import _NETWORK_ARGS, _OWN_ARGS

    words = set()
    for own in (*_OWN_ARGS, *_NETWORK_ARGS):
        dashes = 2 if own.startswith("--") else 1
        for end in range(dashes + 1, len(own) + 1):
            prefix = own[:end]
            variants = {prefix, prefix[:dashes] + prefix[dashes:].replace("-", "_")} \
                if dashes == 2 else {prefix}
            for v in variants:
                words |= {v, f"{v}=0.0.0.0", f"{v}.key"}
    return sorted(words)


@pytest.mark.vllm
@pytest.mark.proc
def test_engine_args_refuse_what_vllms_own_parser_reads_as_metrales(tmp_path: Path) -> None:
    """Against the parser of the installed vLLM: every word it reads as an option metrale sets,
    or as one that listens beyond 127.0.0.1, is refused, every other option it has is passed, a
    refused word is one vLLM reads as one of those or refuses (unknown, or a prefix of several),
    and in the command metrale builds metrale's values are the ones vLLM ends with."""
    from metrale_cli.engines.vllm.confirm import (
        _NETWORK_ARGS,
        _OWN_ARGS,
        VllmServer,
        refuse_own_args,
    )
    from metrale_cli.errors import UsageError

    def refused(words: list[str]) -> bool:
        try:
            refuse_own_args(words)
        except UsageError:
            return True
        return False

    words = _own_spellings()
    extra = ["--max-model-len", "64", "--enforce-eager", "--uvicorn-log-level", "debug"]
    server = VllmServer("python", "/m", ["--enable-lora", "--max-lora-rank", "16",
                                         "--max-loras", "2"], tmp_path / "log", extra=extra,
                        port=23456)
    (tmp_path / "in.json").write_text(json.dumps({"words": words,
                                                  "argv": server.command[3:]}))
    subprocess.run([str(VLLM_PYTHON), str(ROOT / "tests/support/vllm_argparse.py"),
                    str(tmp_path / "in.json"), str(tmp_path / "out.json")], check=True,
                   capture_output=True, timeout=600)
    out = json.loads((tmp_path / "out.json").read_text())
    own = {out["options"][o] for o in (*_OWN_ARGS, *_NETWORK_ARGS)}
    assert own >= {"host", "port", "max_loras", "max_lora_rank", "enable_lora", "uds",
                   "kv_events_config", "data_parallel_address", "nnodes", "node_rank"}
    # null: an option vLLM does not know (it exits on it); "ambiguous": a prefix of several.
    wrong = [(word, dest) for word, dest in out["resolved"].items()
             if refused([word, "1"]) != (dest in own)
             and not (dest in ("ambiguous", None) and refused([word, "1"]))]
    assert not wrong
    passed = [o for o, dest in out["options"].items() if dest not in own]
    assert len(passed) > 300 and not [o for o in passed
                                      if refused([o] if out["nargs"][o] == 0 else [o, "1"])]
    assert server.command.index("--model") == 3 + len(extra)
    assert out["parsed"] == {**out["parsed"], "host": "127.0.0.1", "port": 23456,
                             "model": "/m", "enable_lora": True, "max_lora_rank": 16,
                             "max_loras": 2}


# Words whose reading FlexibleArgumentParser's rewriting or argparse's matching decides: `-5`
# is a value, `-O3` the optimization level with its value, a dotted key takes the next word
# (and `--enforce-eager.x 1` hands its JSON to an option that takes none), `--enforce` is
# `--enforce-eager`, `--kv-cache-dtype` is itself though `--kv-cache-dtype-skip-layers` takes
# many, `-tp` is itself though `-t` abbreviates it, `--max_model_len` is `--max-model-len`.
_READINGS = [
    ["foo"], ["-"], [""], ["a b"], ["-5"], ["--seed", "-5"], ["--seed", "-5", "x"], ["-O3"],
    ["-O3", "x"], ["-O", "3"], ["-O", "3", "x"], ["-O=2", "x"], ["--compilation-config.mode", "3"],
    ["--compilation-config.mode", "3", "y"], ["--compilation-config.mode=3", "y"],
    ["--enforce-eager.x", "1"], ["--enforce"], ["--enforce", "x"], ["--max-model", "64"],
    ["--max-model", "64", "x"], ["--max_model_len", "3", "x"], ["--kv-cache-dtype", "auto"],
    ["--kv-cache-dtype", "auto", "x"], ["--long-prefill-token-threshold", "5"],
    ["--long-prefill-token-threshold", "5", "x"], ["--grpc", "x"], ["-tp", "2", "x"],
    ["-t", "2"], ["-t", "2", "x"], ["--port=1", "x"], ["-tp=2", "x"], ["--hf-token"],
    ["--hf-token", "t", "x"], ["--served-model-name", "a", "b", "--enforce-eager", "c"],
    ["--enforce-eager", "--max-model-len", "64", "--no-enforce-eager", "x"],
]


@pytest.mark.vllm
@pytest.mark.proc
def test_a_word_no_option_takes_is_what_vllms_own_parser_drops(tmp_path: Path) -> None:
    """Against the parser of the installed vLLM: metrale's table of its options is that
    parser's, word for word and by the words each takes, and a word metrale refuses as no
    option's value is exactly one the parser puts in its positional model tag (which the API
    server ignores): each option alone, with its values, and with one word past them, and
    the words whose reading its rewriting or argparse's matching decides."""
    from metrale_cli.engines.vllm import server_args
    from metrale_cli.engines.vllm.flags import MAX_LORA_RANKS

    # --help prints and exits; --config reads its file first (metrale refuses it as a word).
    options = sorted(server_args.OPTIONS - {"-h", "--help", "--config"})
    commands = [*_READINGS]
    for o in options:
        taken = {0: [], "+": ["a", "b"], "?": ["t"]}.get(server_args.nargs(o), ["v"])
        commands += [[o, *taken], [o, *taken, "foo"]]
    (tmp_path / "in.json").write_text(json.dumps({"words": [], "commands": commands}))
    subprocess.run([str(VLLM_PYTHON), str(ROOT / "tests/support/vllm_argparse.py"),
                    str(tmp_path / "in.json"), str(tmp_path / "out.json")], check=True,
                   capture_output=True, timeout=600)
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["nargs"] == {o: server_args.nargs(o) for o in server_args.OPTIONS}
    # And the ranks metrale rounds a --max-rank up to are the ones --max-lora-rank takes.
    assert out["max_lora_ranks"] == list(MAX_LORA_RANKS)
    wrong = [(c, tag) for c, tag in zip(commands, out["tags"], strict=True)
             if (tag is not None) != (server_args.bare_word(c) is not None)]
    assert not wrong
    assert sum(tag is not None for tag in out["tags"]) > len(options)


def test_metrales_options_follow_the_users_words_in_the_command(tmp_path: Path) -> None:
    """vLLM keeps an option's last value: the user's words go first, metrale's after."""
    from metrale_cli.engines.vllm.confirm import VllmServer

    server = VllmServer("py", "m", ["--max-loras", "2"], tmp_path / "log",
                        extra=["--max-model-len", "64"], port=1234)
    assert server.command == ["py", "-m", "vllm.entrypoints.openai.api_server",
                              "--max-model-len", "64", "--model", "m", "--host", "127.0.0.1",
                              "--port", "1234", "--max-loras", "2"]


def test_the_library_refuses_metrales_options_in_extra_args(adapter: Path) -> None:
    """`confirm(..., extra_args=...)` checks the words as --engine-args does, before anything
    starts."""
    from metrale_cli import UsageError, audit_adapters, confirm, get_engine

    audited = audit_adapters([str(adapter)])
    with pytest.raises(UsageError, match="--hos is vLLM's --host"):
        confirm(audited, get_engine("vllm"), extra_args=["--hos", "0.0.0.0"],
                python="/no/such/python")


# -- a stand-in engine: the time bound, an early exit, signals; no process left --------------


def _escapee(tmp: Path) -> str:
    """Shell lines that start a process which leaves the script's process group (setsid()),
    and wait until it has written its pid to escapee.pid."""
    return (f"{sys.executable} -c 'import os, time; os.setsid(); "
            f"open(\"{tmp}/escapee.tmp\", \"w\").write(str(os.getpid())); "
            f"os.rename(\"{tmp}/escapee.tmp\", \"{tmp}/escapee.pid\"); time.sleep(1000)' &\n"
            f"while [ ! -f {tmp}/escapee.pid ]; do sleep 0.05; done\n")


def _fake(tmp: Path, body: str) -> Path:
    """A python stand-in: it answers the vllm probe (`-c ...`) yes, and asked to serve runs
    `body`, after writing its pid, its child's (an engine core's place) and that of a process
    that left its group."""
    script = tmp / "python"
    script.write_text("#!/bin/sh\n"
                      'case "$1" in -c) exit 0;; esac\n'
                      f"sleep 1000 & echo $! > {tmp}/child.pid\n"
                      f"{_escapee(tmp)}"
                      f"echo $$ > {tmp}/server.pid\n"
                      f"{body}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def _gone(pid: int, within_s: float = 10.0) -> bool:
    """No such process, or a zombie its new parent has yet to reap."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state == "Z":
            return True
        time.sleep(0.1)
    return False


def _none_left(pids: list[int], within_s: float = 10.0) -> None:
    """Every process of `pids` is gone; one left (metrale let it escape) is killed here, so
    that it outlives no test run, and the test fails."""
    left = [pid for pid in pids if not _gone(pid, within_s)]
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not left


def _pids(tmp: Path) -> list[int]:
    return [int((tmp / f"{n}.pid").read_text()) for n in ("server", "child", "escapee")]


def _log_named(done: Result) -> Path:
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("error: ") and "; its log: " in line, done.stderr
    return Path(line.rsplit("; its log: ", 1)[1])


@pytest.mark.proc
def test_the_vllm_probe_keeps_to_the_time_bound_reads_nothing_and_leaves_nothing(
        adapter: Path, tmp_path: Path) -> None:
    """An --engine-python whose probe forks a child and prints /dev/zero: metrale keeps none of
    the output (it runs under 2 GiB of address space), gives up at --confirm-timeout (exit 4),
    and takes the probe's whole process group with it."""
    import resource

    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\n"
                    f"sleep 1000 & echo $! > {tmp_path}/child.pid\n"
                    f"{_escapee(tmp_path)}"
                    f"echo $$ > {tmp_path}/server.pid\n"
                    "cat /dev/zero\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "metrale_cli", "inspect", str(adapter),
                           "--engine", "vllm", "--confirm", "--engine-python", str(fake),
                           "--confirm-timeout", "3"], capture_output=True, text=True,
                          timeout=120, preexec_fn=limit,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 4, done.stderr[-2000:]
    assert time.monotonic() - t0 < 60
    assert done.stderr.strip().splitlines() == [
        f"error: --engine-python {fake}: no answer to whether it can import vllm within 3 s "
        "(--confirm-timeout)"]
    _none_left(_pids(tmp_path))


@pytest.mark.proc
def test_an_engine_never_ready_is_the_time_bound_exit_4(adapter: Path, tmp_path: Path) -> None:
    fake = _fake(tmp_path, "echo loading weights; wait")
    t0 = time.monotonic()
    done = metrale("inspect", adapter, "--engine", "vllm", "--confirm", "--engine-python", fake,
                   "--confirm-timeout", "3")
    assert done.code == 4, done
    assert time.monotonic() - t0 < 60
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("error: vLLM was not ready within 3 s (--confirm-timeout)"), line
    assert "loading weights" in _log_named(done).read_text()
    _none_left(_pids(tmp_path))


@pytest.mark.proc
def test_a_time_bound_below_a_second_is_said_as_given(adapter: Path, tmp_path: Path) -> None:
    """--confirm-timeout 1e-9 is past before anything answers: the message says 1e-09 s, not
    a rounded, negative `-0 s`."""
    fake = _fake(tmp_path, "wait")
    done = metrale("inspect", adapter, "--engine", "vllm", "--confirm", "--engine-python", fake,
                   "--confirm-timeout", "1e-9")
    assert done.code == 4, done
    assert "within 1e-09 s (--confirm-timeout)" in done.stderr and "-0 s" not in done.stderr


@pytest.mark.proc
def test_an_engine_that_exits_at_once_is_exit_3_with_its_error(adapter: Path,
                                                                tmp_path: Path) -> None:
    fake = _fake(tmp_path, "echo 'RuntimeError: Failed to infer device type'; exit 1")
    done = metrale("inspect", adapter, "--engine", "vllm", "--confirm", "--engine-python", fake)
    assert done.code == 3, done
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("error: vLLM exited with status 1 before it was ready: "
                           "RuntimeError: Failed to infer device type; its log: "), line
    assert _log_named(done).is_file()
    _none_left(_pids(tmp_path))


@pytest.mark.proc
def test_an_engine_that_cannot_build_the_model_agrees_with_unsupported_model(
        adapter: Path, tmp_path: Path) -> None:
    """A model vLLM registers no class for is `unsupported_model`: an engine that exits before
    it is ready is then what was predicted (exit 0), not the machine's failure."""
    base = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    source = json.loads((Path(base) / "config.json").read_text())
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**source, "architectures": [
        "FrobnicatorForCausalLM"]}))
    fake = _fake(tmp_path, "echo \"ValueError: Model architectures ['FrobnicatorForCausalLM'] "
                           "are not supported for now.\"; exit 1")
    done = metrale("inspect", adapter, "--model", model, "--engine", "vllm", "--confirm",
                   "--engine-python", fake, "--json")
    assert done.code == 0, done
    check = done.json()["confirm"]
    assert check["agrees"] and check["base"] is None
    (only,) = check["adapters"]
    assert only["predicted"] == "unsupported_model" and only["agrees"]
    assert only["observed"]["error"].startswith("the engine did not start: ValueError: Model "
                                                "architectures")
    _none_left(_pids(tmp_path))


@pytest.mark.proc
@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_stops_the_engine_with_metrale(adapter: Path, tmp_path: Path, signum: int,
                                                 code: int) -> None:
    """Ctrl-C (SIGINT) or SIGTERM to metrale while the engine starts: metrale exits as it
    does on that signal, and takes the engine's whole process group with it."""
    fake = _fake(tmp_path, "wait")
    # metrale as a terminal's foreground job starts it: SIGINT at its default, whatever this
    # process inherited (a non-interactive shell's background job, `make test &`, ignores
    # SIGINT, and Python then installs no KeyboardInterrupt). faulthandler: a metrale that
    # outlives the signal prints where it is on SIGABRT.
    proc = subprocess.Popen(
        [sys.executable, "-X", "faulthandler", "-m", "metrale_cli", "inspect", str(adapter),
         "--engine", "vllm", "--confirm", "--engine-python", str(fake)], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "server.pid").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)  # the child's pid is written just before
        proc.send_signal(signum)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            _, err = proc.communicate(timeout=60)
            pytest.fail(f"metrale still ran 60 s after the signal; there:\n{err.decode()}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == code, err.decode()
    _none_left(_pids(tmp_path))


def _hostile(tmp: Path, probe_status: int) -> Path:
    """A python stand-in that leaves a process behind outside its process group, probed and
    serving alike: it forks a child that calls setsid() (a session and group of its own),
    writes its pid to `probe.pid` or `server.pid` and sleeps; the probe then exits with
    `probe_status` (0: it can import vllm), the server never gets ready."""
    script = tmp / "python"
    script.write_text(f"#!{sys.executable}\n"
                      "import os, sys, time\n"
                      "role = 'probe' if sys.argv[1:2] == ['-c'] else 'server'\n"
                      f"pid_file = os.path.join({str(tmp)!r}, role + '.pid')\n"
                      "if os.fork() == 0:\n"
                      "    os.setsid()\n"
                      "    with open(pid_file + '.tmp', 'w') as f:\n"
                      "        f.write(str(os.getpid()))\n"
                      "    os.rename(pid_file + '.tmp', pid_file)\n"
                      "    time.sleep(1000)\n"
                      "    os._exit(0)\n"
                      "while not os.path.exists(pid_file):\n"
                      "    time.sleep(0.01)\n"
                      f"if role == 'probe':\n    sys.exit({probe_status})\n"
                      "time.sleep(1000)\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


@pytest.mark.proc
@pytest.mark.parametrize(("probe_status", "code", "left"), [(0, 4, ("probe", "server")),
                                                            (1, 2, ("probe",))])
def test_a_process_that_leaves_the_group_ends_with_metrale(
        adapter: Path, tmp_path: Path, probe_status: int, code: int,
        left: tuple[str, ...]) -> None:
    """An --engine-python whose probe, and then whose server, forks a child that calls setsid()
    and sleeps: the process-group kill misses it, and it outlived metrale (re-parented to
    init). Now metrale is their subreaper while they run and ends every descendant on its way
    out: after metrale exits (the time bound, exit 4; a probe that says no vllm, exit 2), no
    such process runs."""
    fake = _hostile(tmp_path, probe_status)
    done = subprocess.run([sys.executable, "-m", "metrale_cli", "inspect", str(adapter),
                           "--engine", "vllm", "--confirm", "--engine-python", str(fake),
                           "--confirm-timeout", "3"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == code, done.stderr[-2000:]
    assert len(done.stderr.strip().splitlines()) == (3 if code == 4 else 1), done.stderr
    _none_left([int((tmp_path / f"{role}.pid").read_text()) for role in left], within_s=2)


def test_reaping_ends_what_the_block_started_and_nothing_else(tmp_path: Path) -> None:
    """In a process (the library's caller) with a child of its own: a process started in the
    block leaves a setsid() child behind and exits; leaving the block ends that child and
    reaps it, keeps the caller's child, and puts the process's subreaper setting back."""
    import ctypes

    from metrale_cli.engines import descendants

    def subreaper() -> int:
        value = ctypes.c_int(-1)
        assert ctypes.CDLL(None).prctl(descendants.PR_GET_CHILD_SUBREAPER,
                                       ctypes.byref(value), 0, 0, 0) == 0
        return value.value

    fake = _hostile(tmp_path, 0)
    own = subprocess.Popen(["sleep", "1000"])
    try:
        assert subreaper() == 0
        with descendants.reaping():
            assert subreaper() == 1
            assert subprocess.run([fake, "-c", "probe"], timeout=60).returncode == 0
            escaped = int((tmp_path / "probe.pid").read_text())
            # Orphaned, it is this process's child now, not init's.
            assert escaped in descendants.children(os.getpid())
        assert subreaper() == 0
        assert not Path(f"/proc/{escaped}").exists()  # killed and reaped, not a zombie
        assert own.poll() is None
    finally:
        own.kill()
        own.wait()


def test_reaping_spares_a_child_the_caller_starts_meanwhile(tmp_path: Path) -> None:
    """A library caller's thread may start a child of its own while a check runs: in the
    caller's session, it is no engine's (the probe and the server run in sessions of their
    own, as do their descendants), and it outlives the block, its exit status the caller's to
    read (killed and reaped by the block, Popen read it as a clean exit, 0). What the block's
    engine left is ended all the same."""
    from metrale_cli.engines import descendants

    fake = _hostile(tmp_path, 0)
    with descendants.reaping():
        probe = subprocess.Popen([fake, "-c", "probe"], start_new_session=True)
        own = subprocess.Popen(["sleep", "1000"])  # as the caller's other thread starts it
        assert probe.wait(timeout=60) == 0
    try:
        escaped = int((tmp_path / "probe.pid").read_text())
        assert not Path(f"/proc/{escaped}").exists()
        assert own.poll() is None
    finally:
        own.kill()
        assert own.wait() == -signal.SIGKILL


def test_reaping_where_the_subreaper_setting_may_be_read_but_not_set(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A seccomp filter may let prctl read the subreaper setting and refuse to set it: the
    block runs with the process-group kill alone (as where prctl is missing), no OSError, and
    a block after it tries again."""
    from metrale_cli.engines import descendants

    def prctl(option: int, *_args: object) -> int:
        return -1 if option == descendants.PR_SET_CHILD_SUBREAPER else 0

    monkeypatch.setattr(descendants, "_prctl", lambda: prctl)
    for _ in range(2):
        ran = False
        with descendants.reaping():
            ran = True
        assert ran
        assert descendants._holders == 0


# -- the real vLLM: one start ----------------------------------------------------------------


class ForgetsMaxRank(VllmEngine):
    """vLLM's rules with one deliberately wrong: an adapter above --max-lora-rank serves."""

    def judge(self, report: Any, model: Any, flags: Any,
              flags_source: str = "given") -> EngineVerdict:
        verdict = super().judge(report, model, flags, flags_source)
        if verdict.reason_class == "rank_above_max":
            return replace(verdict, verdict=Verdict.SERVES, reason="(the double forgets it)")
        return verdict


@pytest.fixture(scope="module")
def confirmed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One `inspect --confirm --json` against the real vLLM under the wrong rules, with
    --lora-target-modules o_proj: `attn` (q/v) is ignored, `out` (o_proj) served, `dora`
    refused, and `wide` (rank 32 over 16) refused where the double says it serves."""
    if not VLLM_PYTHON.exists():
        pytest.skip(f"needs {VLLM_PYTHON}")
    from tests.support.engine_cases import make_case, write_model

    root = tmp_path_factory.mktemp("confirm")
    base = write_model("qwen3", root / "base")
    cases = {"attn": {"target_modules": ["q_proj", "v_proj"]},
             "out": {"target_modules": ["o_proj"]},
             "dora": {"target_modules": ["o_proj"], "use_dora": True},
             "wide": {"target_modules": ["o_proj"], "r": 32}}
    paths = {name: make_case("qwen3", base, root, name, **{"r": 8, "lora_alpha": 16, **kw}).path
             for name, kw in cases.items()}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(vllm_engine, "ENGINE", ForgetsMaxRank())
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("HOME", str(root))
        mp.setenv("VLLM_CACHE_ROOT", str(VLLM_CACHE_ROOT))
        done = metrale("inspect", *(f"{n}={p}" for n, p in paths.items()), "--engine", "vllm",
                       "--max-rank", 16, "--max-loras", 2, "--modules", "o_proj", "--dtype",
                       "float32", "--confirm", "--engine-python", VLLM_PYTHON,
                       "--engine-args", CPU_ARGS, "--confirm-timeout", 900, "--json")
    assert done.code in (0, 1), done.stderr
    record = done.json()
    return {"code": done.code, "stderr": done.stderr, "record": record,
            "checks": {a["name"]: a for a in record["confirm"]["adapters"]}}


@pytest.mark.vllm
@pytest.mark.proc
def test_a_served_adapter_is_confirmed_and_changes_the_output(confirmed: dict[str, Any],
                                                              ) -> None:
    out = confirmed["checks"]["out"]
    assert out["predicted"] == "serves" and out["agrees"] and not out["note"], out
    observed = out["observed"]
    assert observed["loaded"] and observed["changes_output"]
    base = confirmed["record"]["confirm"]["base"]
    # Strong enough that greedy decoding itself differs, not only the log-probs.
    assert observed["output"]["tokens"] != base["tokens"], (observed, base)


@pytest.mark.vllm
@pytest.mark.proc
def test_an_ignored_adapter_loads_and_changes_nothing(confirmed: dict[str, Any]) -> None:
    attn = confirmed["checks"]["attn"]
    assert attn["predicted"] == "ignores" and attn["agrees"], attn
    observed = attn["observed"]
    assert observed["loaded"] and observed["changes_output"] is False
    assert observed["output"]["tokens"] == confirmed["record"]["confirm"]["base"]["tokens"]
    assert observed["max_logprob_delta"] <= 1e-4


@pytest.mark.vllm
@pytest.mark.proc
def test_a_refused_adapter_is_observed_refused_in_vllms_words(confirmed: dict[str, Any],
                                                              ) -> None:
    dora = confirmed["checks"]["dora"]
    assert dora["predicted"] == "refuses" and dora["agrees"] and not dora["note"], dora
    observed = dora["observed"]
    assert observed["loaded"] is False and observed["status"] == 500
    assert "vLLM does not yet support DoRA." in observed["error"]
    assert observed["engine_alive"]


@pytest.mark.vllm
@pytest.mark.proc
def test_a_wrong_rule_is_a_disagreement_printed_first_and_exit_1(
        confirmed: dict[str, Any]) -> None:
    from metrale_cli.cli.render_engine import engine_confirm_view

    assert confirmed["code"] == 1
    record = confirmed["record"]
    assert record["confirm"]["agrees"] is False
    assert record["confirm"]["disagreements"] == ["wide"]
    wide = confirmed["checks"]["wide"]
    assert wide["predicted"] == "serves" and not wide["agrees"]
    assert "LoRA rank 32 is greater than max_lora_rank 16." in wide["observed"]["error"]
    assert wide["why"].startswith("vLLM refused it: ")
    # The view of this record (the output without --json) opens with the disagreement.
    console = Console(file=io.StringIO(), width=100, color_system=None)
    console.print(engine_confirm_view(record), crop=False)
    first = console.file.getvalue().splitlines()[0]  # type: ignore[attr-defined]
    assert first.startswith("DISAGREES wide: predicted serves, observed refused (HTTP 500: "), first


@pytest.mark.vllm
@pytest.mark.proc
def test_the_record_names_the_engine_flags_log_and_nothing_outlives_it(
        confirmed: dict[str, Any]) -> None:
    engine = confirmed["record"]["confirm"]["engine"]
    assert engine["version"] == "0.32.0"
    assert engine["python"] == str(VLLM_PYTHON)
    flags = " ".join(engine["flags"])
    assert "--enable-lora --max-lora-rank 16 --max-loras 2 --max-cpu-loras 2" in flags
    assert "--lora-target-modules o_proj" in flags and CPU_ARGS in flags
    assert 0 < engine["ready_s"] <= engine["seconds"]
    log = Path(engine["log"])
    assert "load_lora_adapter" in log.read_text() or log.stat().st_size > 0
    for line in ("starting vLLM: ", f"its log: {log}", "ready after ", "loading dora",
                 "prompting out", "stopped vLLM after "):
        assert line in confirmed["stderr"], confirmed["stderr"]
    port = engine["command"][engine["command"].index("--port") + 1]
    alive = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _serves_on(p, port)]
    assert not alive, alive


def _serves_on(proc: Path, port: str) -> bool:
    try:
        words = (proc / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"--port" in words and port.encode() in words and any(
        b"vllm" in w for w in words)


def test_the_record_is_json_serialisable_without_nan() -> None:
    """The observed record's log-prob delta is never Infinity (strict JSON): a base top
    token missing from an adapter's top is recorded as null."""
    from metrale_cli.engines.vllm.confirm import Observed, Output

    base = Output([1, 2], {3: -0.5, 4: -1.0})
    moved = Output([1, 2], {3: -0.5, 9: -1.0})
    o = Observed(loaded=True, status=200, output=moved, delta=moved.delta(base),
                 changes_output=moved.changes(base))
    assert o.changes_output and json.loads(json.dumps(o.record(), allow_nan=False))[
        "max_logprob_delta"] is None


@pytest.mark.proc
def test_the_launcher_imports_no_torch() -> None:
    """engines/vllm/confirm.py drives the engine with the standard library alone."""
    code = ("import sys, metrale_cli.engines.vllm.confirm\n"
            "print(sorted(m for m in ('torch', 'vllm', 'cupy') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.stdout.strip() == "[]", done.stdout


def _observed(kind: str) -> Any:
    from metrale_cli.engines.vllm.confirm import Observed, Output

    base = Output([7, 7], {7: -0.1})
    if kind == "refused":
        return Observed(loaded=False, status=500, error="x: vLLM does not yet support DoRA.")
    if kind == "refused_dead":
        return Observed(loaded=False, status=500, error="boom", engine_alive=False)
    if kind == "gone":
        return Observed(engine_alive=False)
    out = Output([7, 8], {7: -2.0}) if kind == "changed" else Output([7, 7], {7: -0.1})
    return Observed(loaded=True, status=200, output=out, delta=out.delta(base),
                    changes_output=out.changes(base))


@pytest.mark.parametrize(("predicted", "kind", "agrees", "said"), [
    ("serves", "changed", True, ""),
    ("serves", "same", True, "note: loaded, but its output equals the base's"),
    ("serves", "refused", False, "why: vLLM refused it: x: vLLM does not yet support DoRA."),
    ("differs", "changed", True, ""),
    ("ignores", "same", True, ""),
    ("ignores", "changed", False, "why: its output differs from the base's"),
    ("refuses", "refused", True, ""),
    ("refuses", "changed", False, "why: vLLM loaded it"),
    ("refuses", "refused_dead", False, "why: the load took the server down"),
    ("crashes", "refused_dead", True, "note: vLLM's words are not metrale's"),
    ("serves", "gone", False, "why: the engine died before it was tried"),
    ("unsupported_model", "changed", False, "why: vLLM started on this model"),
])
def test_each_prediction_is_judged_against_what_vllm_did(predicted: str, kind: str,
                                                         agrees: bool, said: str) -> None:
    from metrale_cli.engines.vllm.confirm import AdapterCheck

    check = AdapterCheck("a", Verdict(predicted), "vLLM does not yet support DoRA.",
                         _observed(kind))
    check.judge()
    assert check.agrees is agrees
    if said:
        field, text = said.split(": ", 1)
        assert getattr(check, field).startswith(text), (check.why, check.note)
    else:
        assert not check.why and not check.note, (check.why, check.note)
