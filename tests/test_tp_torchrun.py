"""`metrale pack --tp` under torchrun: one process per rank over gloo on 127.0.0.1. The images
are byte-identical to the single-process `pack --tp`; a failing or killed rank makes every rank
exit non-zero with its message, within the timeout, and leaves no image."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.cli_runner import metrale
from tests.support.tiny_hybrid import free_port, tiny_hybrid_adapters

pytestmark = pytest.mark.slow
TIMEOUT_S = 60


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return tiny_hybrid_adapters(tmp_path_factory.mktemp("tp_torchrun"), [
        ("a", 8, "q_proj,k_proj,v_proj,o_proj,out_proj"), ("b", 4, "q_proj,out_proj")])


def pack_args(adapters: list[Path], out: Path, tp: int) -> list[str]:
    return ["pack", *map(str, adapters), "--max-loras", "3", "--tp", str(tp), "--device",
            "cpu", "--out", str(out)]


@pytest.mark.parametrize("tp", [2, 4])
def test_torchrun_images_equal_single_process(adapters: list[Path], tmp_path: Path,
                                              tp: int) -> None:
    single = tmp_path / "single"
    assert metrale(*pack_args(adapters, single, tp)).code == 0
    run = tmp_path / "torchrun"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp),
         "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
         "-m", "metrale_cli", *pack_args(adapters, run, tp), "--json"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "METRALE_DIST_TIMEOUT": str(TIMEOUT_S)})
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads(done.stdout)  # rank 0 alone reports, for every rank
    assert [r["shard"]["tp_rank"] for r in record["ranks"]] == list(range(tp))
    names = sorted(p.name for p in single.iterdir())
    assert sorted(p.name for p in run.iterdir()) == names and len(names) == tp
    for name in names:
        assert (run / name).read_bytes() == (single / name).read_bytes(), name


def spawn(rank: int, world: int, port: int, args: list[str],
          prelude: str = "") -> subprocess.Popen:
    """One rank as torchrun would start it (env:// rendezvous on 127.0.0.1)."""
    code = (f"import os, signal, sys\n{prelude}\n"
            "from metrale_cli.cli.app import main\n"
            f"sys.argv = ['metrale'] + {args!r}\nmain()\n")
    env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "METRALE_DIST_TIMEOUT": str(TIMEOUT_S)}
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_a_killed_rank_fails_every_rank_without_an_image(adapters: list[Path],
                                                         tmp_path: Path) -> None:
    """Rank 1 dies by SIGKILL as it starts packing its shard (after the fingerprint check).
    DIR was there before the run, so it stays."""
    out, port = tmp_path / "out", free_port()
    out.mkdir()
    kill = ("from metrale_cli.dist import torchrun as distributed\n"
            "distributed.pack_rank = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)")
    started = time.monotonic()
    procs = [spawn(0, 2, port, pack_args(adapters, out, 2)),
             spawn(1, 2, port, pack_args(adapters, out, 2), kill)]
    results = [p.communicate(timeout=TIMEOUT_S + 120) for p in procs]
    assert procs[1].returncode == -9
    assert procs[0].returncode == 1, results[0]
    assert time.monotonic() - started < TIMEOUT_S + 60
    stderr = results[0][1].strip()
    assert stderr.startswith("error: rank 0: a rank did not answer after packing"), stderr
    assert len(stderr.splitlines()) == 1
    assert list(out.iterdir()) == []  # rank 0's staged image removed, none renamed in


def test_a_failed_pack_removes_the_directory_it_made(adapters: list[Path],
                                                    tmp_path: Path) -> None:
    """Rank 1 fails packing its shard after rank 0 has staged its image: both exit 1 with
    rank 1's message, and DIR, made by this run, is gone again."""
    out, port = tmp_path / "out", free_port()
    fail = ("from metrale_cli.dist import torchrun as distributed\n"
            "from metrale_cli.errors import UsageError\n"
            "def fail(*a, **k):\n"
            "    raise UsageError('no memory for the shard')\n"
            "distributed.pack_rank = fail")
    procs = [spawn(0, 2, port, pack_args(adapters, out, 2)),
             spawn(1, 2, port, pack_args(adapters, out, 2), fail)]
    results = [p.communicate(timeout=TIMEOUT_S + 120) for p in procs]
    for p, (_, stderr) in zip(procs, results, strict=True):
        assert p.returncode == 1, stderr
        assert stderr.strip() == "error: rank 1: no memory for the shard", stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_rank_with_other_inputs_is_refused_before_any_byte_moves(adapters: list[Path],
                                                                    tmp_path: Path) -> None:
    """Rank 1 plans with a different max rank (as if its node held other files): both ranks
    exit 1 with rank 1's message, and nothing is written."""
    out, port = tmp_path / "out", free_port()
    procs = [spawn(0, 2, port, pack_args(adapters, out, 2)),
             spawn(1, 2, port, [*pack_args(adapters, out, 2), "--max-rank", "16"])]
    results = [p.communicate(timeout=TIMEOUT_S + 120) for p in procs]
    for p, (_, stderr) in zip(procs, results, strict=True):
        assert p.returncode == 1, stderr
        assert stderr.startswith("error: rank 1: holds layout fingerprints"), stderr
        assert "rank 0 expects" in stderr
    assert not out.exists()


def test_rank_0_refusal_reaches_every_rank(adapters: list[Path], tmp_path: Path) -> None:
    out, port = tmp_path / "out", free_port()
    bad = [*pack_args(adapters, out, 2)]
    bad[1] = str(tmp_path / "missing")
    procs = [spawn(0, 2, port, bad), spawn(1, 2, port, pack_args(adapters, out, 2))]
    results = [p.communicate(timeout=TIMEOUT_S + 120) for p in procs]
    for p, (_, stderr) in zip(procs, results, strict=True):
        assert p.returncode == 1 and stderr.startswith("error: rank 0: "), stderr
        assert "missing" in stderr


def test_an_image_written_meanwhile_is_kept_without_force(adapters: list[Path],
                                                          tmp_path: Path) -> None:
    """Another process writes rank 1's image name after the existence check, while rank 1
    packs: without --force rank 1 refuses to publish over it (exit 2) and the file stays."""
    out, port = tmp_path / "out", free_port()
    out.mkdir()
    theirs = out / "rank-1-of-2.safetensors"
    meanwhile = ("from metrale_cli.dist import torchrun as distributed\n"
                 "real = distributed.pack_rank\n"
                 "def pack_then_write(*a, **k):\n"
                 "    record = real(*a, **k)\n"
                 f"    open({str(theirs)!r}, 'w').write('theirs')\n"
                 "    return record\n"
                 "distributed.pack_rank = pack_then_write")
    procs = [spawn(0, 2, port, pack_args(adapters, out, 2)),
             spawn(1, 2, port, pack_args(adapters, out, 2), meanwhile)]
    results = [p.communicate(timeout=TIMEOUT_S + 120) for p in procs]
    assert procs[1].returncode == 2, results[1]
    stderr = results[1][1].strip()
    assert stderr.startswith(f"error: {theirs} exists"), stderr
    assert len(stderr.splitlines()) == 1
    assert theirs.read_text() == "theirs"
    assert not (out / ".rank-1-of-2.safetensors.staged").exists()
