"""Files in and out on hostile ground (metrale_cli/files/): outputs are written atomically and
never over what is not theirs (a FIFO, a device, a directory that holds other files, one of the
command's own inputs), concurrent writers and signals leave one whole file or none and no temp
file, dead writers' temp files are swept, long names are written whole, and an input that is no
regular file is named in one line."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from metrale_cli.errors import OutputExists
from metrale_cli.files import atomic
from metrale_cli.files.atomic import atomic_write, remove_stale_temps
from metrale_cli.files.pieces import PIECE_BYTES, PieceWriter
from tests.support.cli_runner import metrale
from tests.support.hostile_inputs import TINY, copy_adapter, one_line_error, run_cli


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


def test_synth_writes_nothing_beside_a_device(tmp_path: Path) -> None:
    out = tmp_path / "adapter"
    out.mkdir()
    (out / "adapter_config.json").symlink_to(os.devnull)
    result = metrale("synth", out, "--model", "qwen3-8b", "--modules", "q_proj", "--rank", 8,
                     "--force")
    one_line_error(result, 2)
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json"]


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


def test_piece_writer_writes_whole_pieces_at_aligned_offsets() -> None:
    """`synth` and `unpack` write through it: every write but the last is one whole piece, so
    each lands at a multiple of `PIECE_BYTES` (2 MiB folios in the page cache), and the bytes
    are those given, in order, whatever sizes they came in."""
    writes: list[bytes] = []

    class Recorder:
        def write(self, data: Any) -> int:
            writes.append(bytes(data))
            return len(data)

    rng = random.Random(0)
    chunks = [rng.randbytes(n) for n in (8, 1000, PIECE_BYTES - 1008 + 5, 0,
                                          3 * PIECE_BYTES + 7, 12)]
    out = PieceWriter(Recorder())  # type: ignore[arg-type]
    for chunk in chunks:
        out.write(chunk)
    out.finish()
    assert b"".join(writes) == b"".join(chunks)
    assert [len(w) for w in writes[:-1]] == [PIECE_BYTES] * 4
    assert len(writes[-1]) == sum(map(len, chunks)) - 4 * PIECE_BYTES
