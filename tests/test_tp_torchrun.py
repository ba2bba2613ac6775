"""`metrale pack --tp` under torchrun: one process per rank over gloo on 127.0.0.1. The images
are byte-identical to the single-process `pack --tp`; a failing or killed rank makes every rank
exit non-zero with its message, within the timeout, and leaves no image."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import preloaded
from tests.support.cli_runner import metrale
from tests.support.tiny_hybrid import FUSED, free_port, tiny_hybrid_adapters

pytestmark = pytest.mark.proc
TIMEOUT_S = 60


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return tiny_hybrid_adapters(tmp_path_factory.mktemp("tp_torchrun"), [
        ("a", 8, "q_proj,k_proj,v_proj,o_proj,out_proj"), ("b", 4, "q_proj,out_proj")])


@pytest.fixture(scope="module")
def fused_adapters(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Phi-3's fused qkv_proj and gate_up_proj: a rank's B rows are one run per slice."""
    return tiny_hybrid_adapters(tmp_path_factory.mktemp("tp_torchrun_fused"), [
        ("a", 8, "qkv_proj,o_proj,gate_up_proj,down_proj"), ("b", 4, "qkv_proj")], FUSED)


def pack_args(adapters: list[Path], out: Path, tp: int) -> list[str]:
    return ["pack", *map(str, adapters), "--max-loras", "3", "--tp", str(tp), "--device",
            "cpu", "--out", str(out)]


@pytest.mark.parametrize(("which", "tp"), [("adapters", 2), ("adapters", 4),
                                         ("fused_adapters", 4)])
def test_torchrun_images_equal_single_process(request: pytest.FixtureRequest, tmp_path: Path,
                                              which: str, tp: int) -> None:
    adapters = request.getfixturevalue(which)
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
          prelude: str = "") -> preloaded.Forked:
    """One rank as torchrun would start it (env:// rendezvous on 127.0.0.1), in a process that
    starts with torch imported (tests/support/preloaded.py)."""
    code = (f"import os, signal, sys\n{prelude}\n"
            "from metrale_cli.cli.app import main\n"
            f"sys.argv = ['metrale'] + {args!r}\nmain()\n")
    env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "METRALE_DIST_TIMEOUT": str(TIMEOUT_S)}
    return preloaded.start(code, env)


def test_a_killed_rank_fails_every_rank_without_an_image(adapters: list[Path],
                                                         tmp_path: Path) -> None:
    """Rank 1 dies by SIGKILL as it starts packing its shard (after the input check).
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


def test_an_image_written_meanwhile_fails_every_rank_and_is_kept(adapters: list[Path],
                                                                  tmp_path: Path) -> None:
    """Another process writes rank 1's image name after the existence check, while rank 1
    packs: without --force rank 1 cannot publish over it, so no rank publishes (rank 0's
    image, reserved first, is taken back), every rank exits 1 naming it, and the file
    stays."""
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
    for p, (stdout, stderr) in zip(procs, results, strict=True):
        assert p.returncode == 1, stderr
        assert stderr.strip().startswith(f"error: rank 1: {theirs} exists"), stderr
        assert len(stderr.strip().splitlines()) == 1 and stdout == ""
    assert theirs.read_text() == "theirs"
    assert sorted(p.name for p in out.iterdir()) == ["rank-1-of-2.safetensors"]


# -- every rank packs the same thing ---------------------------------------------------------------


@pytest.fixture(scope="module")
def other_inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Path]]:
    """Per node, its own copy of adapter `a` (q_proj,out_proj, rank 8): as made, with another
    lora_alpha, and with other weights of the same shapes (another seed)."""
    root = tmp_path_factory.mktemp("tp_inputs")
    made = {}
    for name, seed, alpha in (("same", 8, None), ("alpha", 8, 32), ("weights", 9, None)):
        node = root / name
        node.mkdir()
        [path] = tiny_hybrid_adapters(node, [("a", 8, "q_proj,out_proj")])
        if seed != 8:
            done = metrale("synth", path, "--model", node, "--modules", "q_proj,out_proj",
                           "--rank", 8, "--dtype", "f32", "--seed", seed, "--force")
            assert done.code == 0, done.stderr
        if alpha is not None:
            config = json.loads((path / "adapter_config.json").read_text())
            config["lora_alpha"] = alpha
            (path / "adapter_config.json").write_text(json.dumps(config))
        made[name] = [path]
    return made


@pytest.mark.parametrize(("node", "extra", "field"), [
    ("alpha", (), "slot 0 (a): alpha 32, where rank 0 has 16"),
    ("weights", (), "slot 0 (a): tensors "),
    ("same", ("--max-loras", "5"), "--max-loras 5, where rank 0 has 3"),
])
def test_ranks_with_other_inputs_are_refused_on_every_rank(
        other_inputs: dict[str, list[Path]], tmp_path: Path, node: str,
        extra: tuple[str, ...], field: str) -> None:
    """Rank 1 reads its own copy of `a` (its node's files): another alpha, other weights of
    the same shapes, or another --max-loras leave the layout fingerprints alike, and each
    would make rank 1's shard of another pool. Every rank exits 1 naming rank 1 and the
    field, before any byte moves: no DIR."""
    out, port = tmp_path / "out", free_port()
    procs = [spawn(0, 2, port, pack_args(other_inputs["same"], out, 2)),
             spawn(1, 2, port, [*pack_args(other_inputs[node], out, 2), *extra])]
    results = [p.communicate(timeout=TIMEOUT_S + 120) for p in procs]
    for p, (_, stderr) in zip(procs, results, strict=True):
        assert p.returncode == 1, stderr
        assert stderr.strip().startswith(f"error: rank 1: {field}"), stderr
        assert len(stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_identical_copies_on_each_node_are_taken(other_inputs: dict[str, list[Path]],
                                                 adapters: list[Path], tmp_path: Path) -> None:
    """The same adapter in two directories (two nodes' copies) is the same input."""
    copy = tmp_path / "copy"
    shutil.copytree(other_inputs["same"][0].parent, copy)
    out, port = tmp_path / "out", free_port()
    procs = [spawn(0, 2, port, pack_args(other_inputs["same"], out, 2)),
             spawn(1, 2, port, pack_args([copy / "a"], out, 2))]
    results = [p.communicate(timeout=TIMEOUT_S + 120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results


# -- all or nothing --------------------------------------------------------------------------------

# Dies as soon as every rank has answered that it staged its image.
KILL_BEFORE_RESERVE = ("from metrale_cli.dist import torchrun as distributed\n"
                       "real = distributed._gather\n"
                       "def gather_then_die(dist, rank, status, timeout, what):\n"
                       "    gathered = real(dist, rank, status, timeout, what)\n"
                       "    if what == 'after packing':\n"
                       "        os.kill(os.getpid(), signal.SIGKILL)\n"
                       "    return gathered\n"
                       "distributed._gather = gather_then_die")
KILL_AFTER_RESERVE = ("from metrale_cli.dist import torchrun as distributed\n"
                      "real = distributed.RankFiles.reserve\n"
                      "def reserve_then_die(self, force):\n"
                      "    real(self, force)\n"
                      "    os.kill(os.getpid(), signal.SIGKILL)\n"
                      "distributed.RankFiles.reserve = reserve_then_die")


@pytest.mark.parametrize("kill", [KILL_BEFORE_RESERVE, KILL_AFTER_RESERVE],
                         ids=["before-reserving", "after-reserving"])
def test_a_rank_killed_between_packing_and_publishing_leaves_no_image(
        adapters: list[Path], tmp_path: Path, kill: str) -> None:
    """Every rank has staged its image; rank 1 dies before or just after giving its image its
    final name. Rank 0 notices at the last exchange, takes back its own image and what rank 1
    left in DIR (staged and reserved), and exits 1: DIR (there before) ends empty."""
    out, port = tmp_path / "out", free_port()
    out.mkdir()
    procs = [spawn(0, 2, port, pack_args(adapters, out, 2)),
             spawn(1, 2, port, pack_args(adapters, out, 2), kill)]
    results = [p.communicate(timeout=TIMEOUT_S + 120) for p in procs]
    assert procs[1].returncode == -9
    assert procs[0].returncode == 1, results[0]
    stderr = results[0][1].strip()
    assert stderr.startswith("error: rank 0: a rank did not answer after publishing"), stderr
    assert results[0][0] == ""  # no success reported
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("kill", [KILL_BEFORE_RESERVE, KILL_AFTER_RESERVE],
                         ids=["before-reserving", "after-reserving"])
def test_a_failed_forced_pack_restores_the_images_it_replaced(adapters: list[Path],
                                                             tmp_path: Path, kill: str) -> None:
    """With --force over an earlier pack, rank 1 dies before or after reserving: the earlier
    images come back byte for byte, and nothing else is left."""
    out = tmp_path / "out"
    assert metrale(*pack_args(adapters[:1], out, 2)).code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    port = free_port()
    procs = [spawn(0, 2, port, [*pack_args(adapters, out, 2), "--force"]),
             spawn(1, 2, port, [*pack_args(adapters, out, 2), "--force"], kill)]
    results = [p.communicate(timeout=TIMEOUT_S + 120) for p in procs]
    assert procs[0].returncode == 1, results[0]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_what_killed_ranks_left_is_replaced_with_force(adapters: list[Path],
                                                      tmp_path: Path) -> None:
    """Both ranks die after staging their images: DIR holds their hidden staged files. They
    are metrale's own, so the recovery `pack --force` (one process, or torchrun) replaces DIR;
    without --force DIR is refused as existing."""
    out, port = tmp_path / "out", free_port()
    kill = ("from metrale_cli.dist import torchrun as distributed\n"
            "real = distributed.pack_rank\n"
            "def pack_then_die(*a, **k):\n"
            "    real(*a, **k)\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n"
            "distributed.pack_rank = pack_then_die")
    procs = [spawn(k, 2, port, pack_args(adapters, out, 2), kill) for k in range(2)]
    for p in procs:
        p.communicate(timeout=TIMEOUT_S + 120)
    assert [p.returncode for p in procs] == [-9, -9]
    assert sorted(p.name for p in out.iterdir()) == [".rank-0-of-2.safetensors.staged",
                                                     ".rank-1-of-2.safetensors.staged"]
    assert metrale(*pack_args(adapters, out, 2)).code == 2
    done = metrale(*pack_args(adapters, out, 2), "--force")
    assert done.code == 0, done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["rank-0-of-2.safetensors",
                                                     "rank-1-of-2.safetensors"]


@pytest.mark.parametrize(("variables", "says"), [
    ({"MASTER_ADDR": "256.1.1.1", "MASTER_PORT": "29500"}, "MASTER_ADDR='256.1.1.1': not an"),
    ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "70000"}, "MASTER_PORT='70000': not a port"),
    ({"MASTER_PORT": "29500"}, "MASTER_ADDR unset"),
])
def test_a_bad_rendezvous_is_one_line_before_torch(adapters: list[Path], tmp_path: Path,
                                                   variables: dict[str, str],
                                                   says: str) -> None:
    """A launch's address that cannot be resolved printed 42 lines of torch's socket warnings
    (C++, past any Python filter) before metrale's: a real process, so that
    torch's stderr would show."""
    environ = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run(
        [sys.executable, "-m", "metrale_cli", *pack_args(adapters, tmp_path / "out", 2)],
        env={**environ, "RANK": "0", "WORLD_SIZE": "2", "METRALE_DIST_TIMEOUT": "5",
             **variables}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"error: {says}") and done.stderr.count("\n") == 1, done.stderr
    assert not (tmp_path / "out").exists()
