"""`inspect --engine vllm --confirm` (`VllmEngine.confirm`): metrale's prediction checked by the
installed vLLM.

The engine is started beside metrale (`python -m vllm.entrypoints.openai.api_server`, which
works under the GPU build and the CPU build alike, on 127.0.0.1 at a free port, with the flags
the verdicts were judged under and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`), each adapter is
loaded through the runtime path (`POST /v1/load_lora_adapter`), one fixed prompt is sent to the
base model and to every adapter that loaded, and each adapter's predicted outcome (its
runtime-path verdict) is set against what the engine did. The engine is always stopped, its
whole process group, on success, on an error, on the time bound, on Ctrl-C and on SIGTERM, and
then every process it left (one that left the group with setsid() too: engines/descendants.py).
Standard library only (subprocess, urllib): no torch, no vLLM import in metrale's process.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from metrale_cli.engines.answers import EngineInspection, engine_inspect
from metrale_cli.engines.descendants import reaping

# At run time, not only for type checking: the library's argument check reads them.
from metrale_cli.engines.engine import Engine
from metrale_cli.engines.verdict import Verdict
from metrale_cli.engines.vllm.model import NAME
from metrale_cli.engines.vllm.server_args import bare_word
from metrale_cli.errors import EngineFailed, EngineTimeout, UsageError
from metrale_cli.layout.pipeline import AuditedAdapters

DEFAULT_TIMEOUT_S = 900.0
# The longest --confirm-timeout taken (a week): far past any engine's start, and far below what
# the clock and the socket layer can add to a time (1e10 s overflows them).
MAX_TIMEOUT_S = 7 * 86400.0
# The prompt every request sends, as token ids: no tokenizer is needed (a model directory
# without one serves under --skip-tokenizer-init), and ids this small exist in every vocabulary.
PROMPT_IDS = (1, 5, 9, 17, 33, 2)
MAX_TOKENS = 4
TOP_LOGPROBS = 5
# An adapter changes the output when a greedy token differs from the base's, or the
# log-probability of one of the base's top first tokens moves by more than this (nats).
LOGPROB_TOLERANCE = 0.01
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# How long a stopped engine gets between SIGTERM and SIGKILL.
STOP_GRACE_S = 30.0

# The runtime-path verdict -> what the engine should then do.
EXPECTED = {
    Verdict.SERVES: "loads",
    Verdict.DIFFERS: "loads",
    Verdict.IGNORES: "loads_unchanged",
    Verdict.REFUSES: "refused",
    Verdict.CRASHES: "refused",
    Verdict.FAILS_STARTUP: "refused",
    Verdict.UNSUPPORTED_MODEL: "not_started",
}

# vLLM's options metrale sets itself, each spelling vLLM 0.32's parser has for it -> the metrale
# option that sets it (None: metrale's own). `--config` too: vLLM reads options out of its file.
_OWN_ARGS = {
    "--model": None, "--host": None, "--port": None, "--enable-lora": None,
    "--no-enable-lora": None, "--lora-modules": None, "--config": None,
    "--max-lora-rank": "--max-rank", "--max-loras": "--max-loras",
    "--max-cpu-loras": "--max-cpu-loras", "--lora-dtype": "--lora-dtype", "--dtype": "--dtype",
    "--lora-target-modules": "--modules", "--tensor-parallel-size": "--tp", "-tp": "--tp",
    "--fully-sharded-loras": "--fully-sharded", "--no-fully-sharded-loras": "--fully-sharded",
}
# vLLM's options that open a socket or a unix socket of their own, or start engines beside the
# one checked: a Unix socket instead of 127.0.0.1's port, KV events published on tcp://*:5557,
# KV and encoder-cache transfer, weight transfer, the data-parallel, multi-node and gRPC
# listeners, a headless engine, a Ray cluster (its own ports on the host's address).
_NETWORK_ARGS = (
    "--uds", "--headless", "--grpc", "--grpc-port", "--kv-events-config",
    "--kv-transfer-config", "--ec-transfer-config", "--weight-transfer-config",
    "--distributed-executor-backend", "--master-addr", "--master-port", "--nnodes", "-n",
    "--node-rank", "-r", "--data-parallel-size", "-dp", "--data-parallel-rank", "-dpn",
    "--data-parallel-start-rank", "-dpr", "--data-parallel-size-local", "-dpl",
    "--data-parallel-address", "-dpa", "--data-parallel-rpc-port", "-dpp",
    "--data-parallel-backend", "-dpb", "--data-parallel-hybrid-lb",
    "--no-data-parallel-hybrid-lb", "-dph", "--data-parallel-external-lb",
    "--no-data-parallel-external-lb", "-dpe", "--data-parallel-multi-port-external-lb", "-dpm",
    "--data-parallel-supervisor-port",
)


def check_timeout(timeout_s: float) -> None:
    """`--confirm-timeout`: seconds, more than 0 and at most MAX_TIMEOUT_S (a UsageError
    otherwise: NaN, infinity and the overflowing sizes among them)."""
    if not 0 < timeout_s <= MAX_TIMEOUT_S:
        raise UsageError(f"--confirm-timeout {timeout_s}: a positive number of seconds, at "
                         f"most {MAX_TIMEOUT_S:.0f} (a week)")


def engine_python(given: str | None, timeout_s: float = DEFAULT_TIMEOUT_S) -> str:
    """The Python that runs vLLM: `given` (`--engine-python`), which must be a file that can
    import vllm, else the running interpreter where it can; anything else is one UsageError
    saying what to pass. vLLM is found, not imported (an import takes seconds). The probe of
    `given` runs in its own process group with its output discarded, within `timeout_s`
    (EngineTimeout past it); its whole group is killed when it ends or is given up on, and
    every process it started besides (`reaping`)."""
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    if given is None:
        if importlib.util.find_spec("vllm") is not None:
            return sys.executable
        raise UsageError(f"--confirm: this Python ({sys.executable}) cannot import vllm; pass "
                         "--engine-python PATH, the python of an environment that has vLLM")
    # Not resolved: a venv's python is a symlink whose target is outside the venv.
    path = os.path.abspath(given)
    if not os.path.isfile(path):
        raise UsageError(f"--engine-python {given}: no such file")
    if not os.access(path, os.X_OK):
        raise UsageError(f"--engine-python {given}: not executable")
    with reaping():  # and what left the group: every process the probe started ends with it
        try:
            proc = subprocess.Popen([path, "-c", probe], stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    start_new_session=True)
        except OSError as exc:
            raise UsageError(f"--engine-python {given}: cannot run it ({exc})") from None
        try:
            status = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise EngineTimeout(f"--engine-python {given}: no answer to whether it can import "
                                f"vllm within {timeout_s:g} s (--confirm-timeout)") from None
        finally:  # what the probe forked goes with it, and a probe given up on is killed
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if status != 0:
        raise UsageError(f"--engine-python {given}: cannot import vllm (exit status {status})")
    return path


def engine_args(text: str | None) -> list[str]:
    """`--engine-args`: more of vLLM's own arguments (shell words), none that vLLM's parser
    would read as an option metrale sets (`refuse_own_args`)."""
    if not text:
        return []
    try:
        words = shlex.split(text)
    except ValueError as exc:
        raise UsageError(f"--engine-args {text!r}: {exc}") from None
    refuse_own_args(words)
    return words


def refuse_own_args(words: Sequence[str]) -> None:
    """A UsageError naming the first word vLLM's parser could read as one of the options metrale
    sets, or as one that listens beyond 127.0.0.1 (`_NETWORK_ARGS`), under any spelling it
    takes: `_` for `-` in a long name, a `=value` or `.key` tail (a JSON option's), any prefix
    of the name (argparse's `allow_abbrev`: `--hos` is `--host`; a prefix of several is refused
    too, vLLM refuses it as ambiguous), and a one-letter option with its value attached (`-n2`).
    A bare `--` is refused too: it would make metrale's options, which follow, positional words;
    and so is a last word with a `.key` and no `=`, whose value vLLM would take from the word
    after it, metrale's `--model`, and a word that is no option's value (server_args.py
    `bare_word`: a bare `foo`, or one after an option that takes no value), which vLLM's API
    server would read as its positional model tag and drop without a word."""
    for i, word in enumerate(words):
        if word == "--":
            raise UsageError("--engine-args: -- is not passed through (it would end vLLM's "
                             "options before metrale's)")
        if not word.startswith("-") or word == "-":
            continue
        name = word.split("=", 1)[0]
        if i == len(words) - 1 and "." in name and "=" not in word:
            raise UsageError(f"--engine-args: {word} ends the words without its value (vLLM "
                             "would take metrale's --model as it); give it one")
        if name.startswith("--"):
            # FlexibleArgumentParser: `_` read as `-` from the dashes to the first `.`.
            name = "--" + name[2:].split(".", 1)[0].replace("_", "-")
        else:
            name = name.split(".", 1)[0]
        if name in ("--", "-"):
            continue
        long = name.startswith("--")
        hits = [own for own in (*_OWN_ARGS, *_NETWORK_ARGS)
                if long == own.startswith("--") and (own.startswith(name)
                                                     or not long and own == name[:2])]
        if not hits:
            continue
        givers = sorted({g for g in (_OWN_ARGS.get(h) for h in hits) if g})
        instead = f"give metrale's {' or '.join(givers)}" if givers else "metrale sets it"
        if hits == ["--config"]:
            instead = "its file could set what metrale sets; give its options as words"
        elif all(h in _NETWORK_ARGS for h in hits):
            instead = ("it listens beyond 127.0.0.1 or starts engines beside the one metrale "
                       "checks")
        if hits == [word.split("=", 1)[0]]:
            raise UsageError(f"--engine-args: {hits[0]} is not passed through ({instead})")
        raise UsageError(f"--engine-args: {word.split('=', 1)[0]} is vLLM's "
                         f"{' or '.join(hits)}, not passed through ({instead})")
    bare = bare_word(words)
    if bare is not None:
        word, after = bare
        why = f"{after} takes no value" if after else "no option takes it as its value"
        raise UsageError(f"--engine-args: {shlex.quote(word)} is not passed through ({why}, "
                         "so vLLM's API server would read it as its positional model tag, "
                         "which it ignores)")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class VllmServer:
    """One `vllm serve` (its API server module) on 127.0.0.1, its output in `log` (created,
    never overwritten), in its own session so that stopping it reaches its engine-core
    processes and a Ctrl-C in the terminal reaches metrale alone. Use it as a context manager:
    leaving the block stops the engine, however the block is left, and ends every process it
    started, in its group or not (`reaping`). `extra` (the user's words)
    come first and metrale's options (`args`, the model, host and port) after them: vLLM's
    parser keeps the last value given, so metrale's are the ones that hold."""

    def __init__(self, python: str, model: str, args: Sequence[str], log: Path, *,
                 extra: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 port: int | None = None) -> None:
        refuse_own_args(extra)
        self.python = python
        self.model = model
        self.port = port or free_port()
        self.log = log
        self.command = [python, "-m", SERVER_MODULE, *extra, "--model", model, "--host",
                        "127.0.0.1", "--port", str(self.port), *args]
        # The runtime load endpoints exist only with VLLM_ALLOW_RUNTIME_LORA_UPDATING.
        self.env = {**(os.environ if env is None else env),
                    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
        self.proc: subprocess.Popen[bytes] | None = None
        self._reaping = contextlib.ExitStack()

    def __enter__(self) -> VllmServer:
        self._reaping.enter_context(reaping())
        try:
            with self.log.open("xb") as out:
                self.proc = subprocess.Popen(self.command, stdout=out,
                                             stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, env=self.env,
                                             start_new_session=True)
        except BaseException:
            self._reaping.close()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        with self._reaping:
            self.stop()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_exit(self, timeout_s: float) -> int | None:
        """The exit status, or None if it still runs after `timeout_s`."""
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def wait_ready(self, deadline: float, timeout_s: float | None = None) -> float:
        """Seconds until `/health` answers. EngineFailed when the server exits first (its
        last error line), EngineTimeout at `deadline` (time.monotonic; `timeout_s`: the
        --confirm-timeout it was set from, for the message)."""
        t0 = time.monotonic()
        while True:
            if not self.alive:
                assert self.proc is not None
                raise EngineFailed(f"vLLM exited with status {self.proc.returncode} before it "
                                   f"was ready: {self.last_error()}; its log: {self.log}")
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=5):
                    return time.monotonic() - t0
            except OSError:
                pass
            if time.monotonic() >= deadline:
                bound = deadline - t0 if timeout_s is None else timeout_s
                raise EngineTimeout(f"vLLM was not ready within {bound:g} s "
                                    f"(--confirm-timeout); its log: {self.log}")
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def request(self, path: str, body: dict[str, Any] | None, deadline: float,
                ) -> tuple[int, str]:
        """GET (body None) or POST JSON: (HTTP status, body text). EngineTimeout when no
        answer comes before `deadline`."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url(path), data=data,
                                     headers={"Content-Type": "application/json"})
        left = deadline - time.monotonic()
        late = EngineTimeout(f"vLLM did not answer {path} within --confirm-timeout; its log: "
                             f"{self.log}")
        if left <= 0:
            raise late
        try:
            with urllib.request.urlopen(req, timeout=left) as answer:
                return answer.status, answer.read().decode(errors="replace")
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode(errors="replace")
        except TimeoutError:
            raise late from None
        except urllib.error.URLError as error:
            if isinstance(error.reason, TimeoutError):
                raise late from None
            raise EngineFailed(f"vLLM stopped answering ({error.reason}) at {path}; its "
                               f"log: {self.log}") from None

    def last_error(self) -> str:
        """The log's last line that names an error, else its last line."""
        try:
            lines = [ln.strip() for ln in self.log.read_text(errors="replace").splitlines()
                     if ln.strip()]
        except OSError:
            return "no log"
        errors = [ln for ln in lines if "Error" in ln or "error" in ln]
        return (errors or lines or ["nothing in its log"])[-1][:500]

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after STOP_GRACE_S; then whatever
        of the group is left (an engine core that outlived its server) is killed too."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
            finally:  # past the grace, or a second Ctrl-C while waiting for it
                if self.proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait()
        # The group outlives its leader while a member does: its id is not reused until then.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)


@dataclass(frozen=True)
class Output:
    """One completion of PROMPT_IDS: its greedy tokens and the first position's top
    log-probabilities (token id -> log-prob)."""

    tokens: list[int]
    first: dict[int, float]

    def delta(self, base: Output) -> float:
        """The largest move of a base top first token's log-probability (a token missing
        from this output's top counts as moved beyond the tolerance)."""
        moves = [abs(self.first[t] - lp) if t in self.first else float("inf")
                 for t, lp in base.first.items()]
        return max(moves, default=0.0)

    def changes(self, base: Output) -> bool:
        return self.tokens != base.tokens or self.delta(base) > LOGPROB_TOLERANCE

    def record(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "first_logprobs": {str(t): lp for t, lp in
                                                          self.first.items()}}


@dataclass
class Observed:
    """What the engine did with one adapter through the runtime path."""

    loaded: bool | None = None  # None: never tried (the engine was gone)
    status: int | None = None
    error: str | None = None
    output: Output | None = None
    delta: float | None = None
    changes_output: bool | None = None
    engine_alive: bool = True

    def summary(self) -> str:
        if self.loaded is None:
            return "not tried: the engine was gone"
        if not self.loaded:
            gone = "" if self.engine_alive else "; the server died"
            return f"refused (HTTP {self.status}: {self.error}){gone}"
        if self.changes_output is None:
            return f"loaded; its prompt failed (HTTP {self.status}: {self.error})"
        return "loaded, output differs from the base's" if self.changes_output else \
            "loaded, output equal to the base's"

    def record(self) -> dict[str, Any]:
        return {"loaded": self.loaded, "status": self.status, "error": self.error,
                "output": self.output.record() if self.output else None,
                "max_logprob_delta": None if self.delta is None or self.delta == float("inf")
                else round(self.delta, 6), "changes_output": self.changes_output,
                "engine_alive": self.engine_alive, "summary": self.summary()}


@dataclass
class AdapterCheck:
    """One adapter: the prediction, what was observed, and whether they agree."""

    name: str
    predicted: Verdict
    reason: str
    observed: Observed
    agrees: bool = False
    why: str = ""
    note: str = ""

    @property
    def expected(self) -> str:
        return EXPECTED[self.predicted]

    def judge(self) -> None:
        o, want = self.observed, self.expected
        if o.loaded is None:
            self.agrees, self.why = False, "the engine died before it was tried"
        elif want == "refused":
            # `crashes` says the error takes the engine down; the others that it keeps serving.
            survives = o.engine_alive or self.predicted is Verdict.CRASHES
            self.agrees = o.loaded is False and survives
            if o.loaded:
                self.why = "vLLM loaded it; metrale said it would refuse it"
            elif not survives:
                self.why = "the load took the server down; metrale said it keeps serving"
            elif self.reason not in (o.error or ""):
                self.note = f"vLLM's words are not metrale's ({self.reason})"
        elif o.loaded is False:
            self.agrees, self.why = False, f"vLLM refused it: {o.error}"
        elif o.changes_output is None:
            self.agrees, self.why = False, f"loaded, but its prompt failed: {o.error}"
        elif want == "loads_unchanged":
            self.agrees = not o.changes_output
            if o.changes_output:
                self.why = ("its output differs from the base's; metrale said vLLM applies "
                            "none of it")
        else:
            self.agrees = True
            if not o.changes_output:
                self.note = ("loaded, but its output equals the base's (greedy tokens and top "
                             f"log-probs within {LOGPROB_TOLERANCE}): too weak to change this "
                             "prompt, or vLLM applies none of it")
        if want == "not_started":
            self.agrees, self.why = False, "vLLM started on this model; metrale said it cannot"

    def record(self) -> dict[str, Any]:
        return {"name": self.name, "predicted": self.predicted.value, "expected": self.expected,
                "observed": self.observed.record(), "agrees": self.agrees, "why": self.why,
                "note": self.note}


@dataclass
class Confirmation:
    """The prediction (`inspection`), and per adapter what the engine did with it."""

    inspection: EngineInspection
    checks: list[AdapterCheck]
    engine: dict[str, Any]
    base: Output | None
    prompt: dict[str, Any] = field(default_factory=lambda: {
        "token_ids": list(PROMPT_IDS), "max_tokens": MAX_TOKENS, "temperature": 0.0,
        "top_logprobs": TOP_LOGPROBS, "logprob_tolerance": LOGPROB_TOLERANCE})

    @property
    def disagreements(self) -> list[AdapterCheck]:
        return [c for c in self.checks if not c.agrees]

    @property
    def agrees(self) -> bool:
        return not self.disagreements

    @property
    def record(self) -> dict[str, Any]:
        """`inspect --engine vllm --confirm --json`: the inspection's record with `confirm`."""
        return {**self.inspection.record, "confirm": {
            "agrees": self.agrees, "disagreements": [c.name for c in self.disagreements],
            "engine": self.engine, "prompt": self.prompt,
            "base": self.base.record() if self.base else None,
            "adapters": [c.record() for c in self.checks]}}


def confirm(audited: AuditedAdapters, engine: Engine,
            given: Mapping[str, object] | None = None, *, python: str | None = None,
            extra_args: Sequence[str] = (), timeout_s: float = DEFAULT_TIMEOUT_S,
            log: Path | None = None,
            progress: Callable[[str], None] | None = None) -> Confirmation:
    """Predict what `engine` does with `audited` (`engine_inspect`), then start the installed
    vLLM (`python`: --engine-python, else the running interpreter) with the flags judged under
    and `extra_args`, load each adapter at runtime, prompt the base and each adapter, and set
    the prediction against it; within `timeout_s` overall (EngineTimeout past it). The engine's
    output goes to `log` (created; default a new temp directory's `vllm.log`)."""
    if engine.name != NAME:
        # Another engine confirms through its own `Engine.confirm`.
        raise UsageError(f"--confirm: this check starts vLLM, not {engine.name}")
    check_timeout(timeout_s)
    refuse_own_args(extra_args)
    say = progress or (lambda _line: None)
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    python = engine_python(python, timeout_s)
    inspection = engine_inspect(audited, engine, given)
    if log is None:
        log = Path(tempfile.mkdtemp(prefix="metrale-confirm-")) / "vllm.log"
    model = inspection.record["engine"]["recommended"]["model"]
    args = inspection.flags.serve_args()
    reports = audited.reports
    checks = [AdapterCheck(r.name, v.verdict, v.reason, Observed())
              for r, v in zip(reports, inspection.verdicts, strict=True)]
    engine_record: dict[str, Any] = {"python": python, "model": model,
                                     "flags": [*extra_args, *args],
                                     "log": str(log), "version": None, "ready_s": None}
    from metrale_cli.files.atomic import cleanup_on_signals

    with cleanup_on_signals(), VllmServer(python, model, args, log, extra=extra_args) as server:
        engine_record["command"] = server.command
        say(f"starting vLLM: {shlex.join(server.command)}")
        say(f"its log: {log}")
        try:
            ready = server.wait_ready(deadline, timeout_s)
        except EngineFailed:
            if checks and all(c.expected == "not_started" for c in checks):
                # Predicted: vLLM cannot serve this model with LoRA; it did not start.
                for c in checks:
                    c.agrees, c.observed.loaded = True, False
                    c.observed.error = f"the engine did not start: {server.last_error()}"
                engine_record["seconds"] = round(time.monotonic() - t0, 1)
                return Confirmation(inspection, checks, engine_record, None)
            raise
        engine_record["ready_s"] = round(ready, 1)
        status, text = server.request("/version", None, deadline)
        with contextlib.suppress(ValueError, AttributeError):
            engine_record["version"] = json.loads(text).get("version")
        say(f"ready after {ready:.0f} s (vLLM {engine_record['version']})")
        say("prompting the base model")
        base = _complete(server, model, deadline)
        if not isinstance(base, Output):
            raise EngineFailed(f"vLLM answered the base model's prompt with HTTP {base[0]}: "
                               f"{base[1]}; its log: {log}")
        for report, check in zip(reports, checks, strict=True):
            o = check.observed
            if not server.alive:
                o.engine_alive = False
                check.judge()
                continue
            say(f"loading {report.name}")
            o.status, text = server.request(
                "/v1/load_lora_adapter", {"lora_name": report.name,
                                          "lora_path": str(Path(report.adapter.path).resolve())},
                deadline)
            o.loaded = o.status == 200
            if not o.loaded:
                o.error = _error_text(text)
            else:
                say(f"prompting {report.name}")
                out = _complete(server, report.name, deadline)
                if isinstance(out, Output):
                    o.output, o.delta, o.changes_output = out, out.delta(base), out.changes(base)
                else:
                    o.status, o.error = out[0], _error_text(out[1])
            o.engine_alive = server.alive
            check.judge()
        engine_record["seconds"] = round(time.monotonic() - t0, 1)
    say(f"stopped vLLM after {time.monotonic() - t0:.0f} s")
    return Confirmation(inspection, checks, engine_record, base)


def _complete(server: VllmServer, model: str, deadline: float) -> Output | tuple[int, str]:
    """PROMPT_IDS completed greedily by `model` (the base's name or an adapter's), or the
    HTTP status and text of the failure."""
    status, text = server.request("/v1/completions", {
        "model": model, "prompt": list(PROMPT_IDS), "max_tokens": MAX_TOKENS,
        "temperature": 0.0, "ignore_eos": True, "logprobs": TOP_LOGPROBS,
        "return_tokens_as_token_ids": True, "return_token_ids": True}, deadline)
    if status != 200:
        return status, _error_text(text)
    try:
        choice = json.loads(text)["choices"][0]
        top = choice["logprobs"]["top_logprobs"][0]
        first = {int(k.rsplit(":", 1)[-1]): float(v) for k, v in top.items()}
        return Output([int(t) for t in choice["token_ids"]], first)
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        return status, f"an answer metrale cannot read ({type(exc).__name__}: {text[:300]})"


def _error_text(text: str) -> str:
    """vLLM's error message from an error answer's JSON body (else the body)."""
    try:
        body = json.loads(text)
    except ValueError:
        return text.strip()[:2000]
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])[:2000]
        if "message" in body:
            return str(body["message"])[:2000]
    return text.strip()[:2000]
