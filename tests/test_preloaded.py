"""tests/support/preloaded.py: a script forked from the preloaded server behaves as
`python -c SCRIPT` would in every way the torchrun and mutated-kernel tests rely on."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.support import preloaded

pytestmark = pytest.mark.proc


def test_output_exit_status_environment_and_directory_are_the_script_s_own(
        tmp_path: Path) -> None:
    script = ("import os, sys\n"
              "print(os.environ['ONLY'], sorted(os.environ), os.getcwd())\n"
              "print('to stderr', file=sys.stderr)\n"
              "sys.exit(3)")
    done = preloaded.run(script, {"ONLY": "this"}, cwd=tmp_path, timeout=60)
    assert (done.returncode, done.stderr) == (3, "to stderr\n")
    assert done.stdout == f"this ['ONLY'] {tmp_path}\n"
    assert os.environ.get("ONLY") is None  # the test process's environment is untouched


def test_the_server_holds_torch_and_no_metrale_module() -> None:
    """Each script reads metrale's sources afresh: nothing of metrale's is imported before it."""
    script = ("import sys\n"
              "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'metrale_cli')"
              " and '.' not in m))")
    assert preloaded.run(script, timeout=60).stdout == "['torch']\n"


def test_a_signal_an_exception_and_an_exit_message_end_as_python_would() -> None:
    killed = preloaded.run("import os, signal\nprint('before', flush=True)\n"
                           "os.kill(os.getpid(), signal.SIGKILL)", timeout=60)
    assert (killed.returncode, killed.stdout) == (-9, "before\n")
    raised = preloaded.run("raise ValueError('boom')", timeout=60)
    assert raised.returncode == 1
    assert raised.stderr == ('Traceback (most recent call last):\n'
                             '  File "<string>", line 1, in <module>\n'
                             'ValueError: boom\n')
    said = preloaded.run("import atexit\natexit.register(print, 'at exit')\nexit('why')",
                         timeout=60)
    assert (said.returncode, said.stdout, said.stderr) == (1, "at exit\n", "why\n")


def test_a_script_past_its_timeout_is_killed() -> None:
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        preloaded.run("import time\ntime.sleep(60)", timeout=1)
    assert time.monotonic() - started < 30


def test_each_script_is_a_process_of_its_own() -> None:
    first = preloaded.start("import os\nprint(os.getpid(), os.getppid())")
    second = preloaded.start("import os\nprint(os.getpid(), os.getppid())")
    (pid1, server1), (pid2, server2) = (map(int, p.communicate(60)[0].split())
                                        for p in (first, second))
    assert (pid1, pid2) == (first.pid, second.pid) and pid1 != pid2
    assert server1 == server2 != os.getpid() and os.getpid() not in (pid1, pid2)


def test_a_server_that_ends_is_named_and_replaced() -> None:
    """A script whose server died is an error at once, not a wait for its timeout; the next
    script gets a new server."""
    sleeping = preloaded.start("import time\ntime.sleep(60)")
    assert preloaded._server is not None
    preloaded._server.kill()
    with pytest.raises(RuntimeError, match="the preloaded server ended"):
        sleeping.communicate(30)
    os.kill(sleeping.pid, 9)
    assert preloaded.run("print('again')", timeout=60).stdout == "again\n"
