"""Python scripts run in processes of their own that start with torch already imported.

A fresh interpreter spends about 3.5 CPU-seconds importing torch before a script's first line,
and the torchrun ranks and the mutated-kernel runs start dozens of them. Here each script runs
in a child forked from a server: one interpreter per test process that imported torch,
torch.distributed and numpy once, and imports no metrale module. The child is a process of its
own (its own pid, environment, working directory, stdout and stderr, exit status; a signal's is
negative, as Popen's) and shares nothing with the test process or with other scripts; it reads
metrale's sources and settings afresh.

What differs from `python -c SCRIPT`: the interpreter's start-up is the server's, so variables
Python reads only at start-up (PYTHONPATH and the like) are the test process's. Tests of the
interpreter's own start-up (what a command imports, what torch prints before metrale) start
`python` themselves.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# The server's side. One request a line on stdin: {"script", "env", "cwd", "out": [stdout,
# stderr, status]}; it answers the child's pid on a line, and when the child ends writes its
# exit status (Popen's convention) to the status file, renamed in whole.
SERVER = r"""
import json, os, selectors, sys, traceback
import torch, torch.distributed, numpy
os.write(1, b"ready\n")

def child(request, closing):
    for fd in closing:
        os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, path in ((1, request["out"][0]), (2, request["out"][1])):
        opened = os.open(path, os.O_WRONLY | os.O_TRUNC)
        os.dup2(opened, fd)
        os.close(opened)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.argv = ["-c"]
    code = 0
    try:
        exec(compile(request["script"], "<string>", "exec"), {"__name__": "__main__"})
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException as error:  # printed as python -c would: from the script's frame
        traceback.print_exception(type(error), error, error.__traceback__.tb_next)
        code = 1
    import atexit
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

selector = selectors.DefaultSelector()
selector.register(0, selectors.EVENT_READ)
pending = b""
while True:
    for key, _ in selector.select():
        if key.fd == 0:
            chunk = os.read(0, 1 << 16)
            if not chunk:  # the test process is done: wait for the children still running
                for key in list(selector.get_map().values()):
                    if key.fd != 0:
                        os.waitpid(key.data[0], 0)
                sys.exit(0)
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                closing = [selector.fileno(), *(fd for fd in selector.get_map() if fd != 0)]
                pid = os.fork()
                if pid == 0:
                    child(request, closing)
                ended = os.pidfd_open(pid)
                selector.register(ended, selectors.EVENT_READ, (pid, request["out"][2]))
                os.write(1, b"%d\n" % pid)
        else:
            pid, status = key.data
            _, wait = os.waitpid(pid, 0)
            selector.unregister(key.fd)
            os.close(key.fd)
            with open(status + ".part", "w") as f:
                f.write(str(os.waitstatus_to_exitcode(wait)))
            os.rename(status + ".part", status)
"""

_server: subprocess.Popen[bytes] | None = None
_lock = threading.Lock()


def _stop(server: subprocess.Popen[bytes]) -> None:
    """End the server: at the end of its input it exits, once its children have ended (so
    their CPU time counts in this process's, as a subprocess's would)."""
    assert server.stdin is not None
    server.stdin.close()
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()


def _running() -> subprocess.Popen[bytes]:
    """The server, started where there is none or it ended (the lock is held)."""
    global _server
    if _server is None or _server.poll() is not None:
        _server = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE)
        atexit.register(_stop, _server)
        assert _server.stdout is not None
        # Its first line, once torch is imported: a server is started only when it has said so.
        if _server.stdout.readline() != b"ready\n":
            raise RuntimeError(f"the preloaded server did not start (exit {_server.wait()})")
    return _server


def warm() -> None:
    """Start the server now, ahead of the first script, and wait until it has imported torch
    (about 2.5 s): a cost for a fixture's setup (conftest `preloaded_server`), not a test's
    call."""
    with _lock:
        _running()


def _ask(request: dict[str, object]) -> tuple[subprocess.Popen[bytes], int]:
    """Hand `request` to the server (started on first use): the server and the child's pid."""
    with _lock:
        server = _running()
        assert server.stdin is not None and server.stdout is not None
        server.stdin.write(json.dumps(request).encode() + b"\n")
        server.stdin.flush()
        answer = server.stdout.readline()
    if not answer:
        raise RuntimeError(f"the preloaded server ended (exit {server.wait()})")
    return server, int(answer)


class Forked:
    """A running script: the parts of subprocess.Popen the tests use (text output)."""

    def __init__(self, script: str, env: dict[str, str] | None, cwd: Path | None) -> None:
        self._directory = Path(tempfile.mkdtemp(prefix="metrale-preloaded-"))
        self._out = [self._directory / name for name in ("stdout", "stderr", "status")]
        for path in self._out[:2]:
            path.touch()
        self.returncode: int | None = None
        self._server, self.pid = _ask({
            "script": script, "env": dict(os.environ if env is None else env),
            "cwd": str(cwd or os.getcwd()), "out": [str(p) for p in self._out]})

    def poll(self) -> int | None:
        if self.returncode is None and self._out[2].is_file():
            self.returncode = int(self._out[2].read_text())
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Wait for the script's end (subprocess.TimeoutExpired after `timeout` seconds, the
        script still running); its stdout and stderr."""
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired(["<preloaded script>"], timeout or 0)
            if self._server.poll() is not None and self.poll() is None:
                raise RuntimeError(f"the preloaded server ended (exit "
                                   f"{self._server.returncode}) before script {self.pid} did")
            time.sleep(0.01)
        stdout, stderr = (p.read_text(errors="replace") for p in self._out[:2])
        for path in self._out:
            path.unlink()
        self._directory.rmdir()
        return stdout, stderr


def start(script: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> Forked:
    """`script` started in a process of its own, torch already imported; `env` replaces the
    environment (default: this process's), `cwd` the working directory."""
    return Forked(script, env, cwd)


def run(script: str, env: dict[str, str] | None = None, cwd: Path | None = None,
        timeout: float | None = None) -> subprocess.CompletedProcess[str]:
    """`script` run to its end, as subprocess.run(capture_output=True, text=True); on timeout
    it is killed and TimeoutExpired raised."""
    forked = start(script, env, cwd)
    try:
        stdout, stderr = forked.communicate(timeout)
    except subprocess.TimeoutExpired:
        forked.kill()
        forked.communicate()
        raise
    assert forked.returncode is not None
    return subprocess.CompletedProcess(["<preloaded script>"], forked.returncode, stdout,
                                       stderr)
