"""Peer landing across processes: `send_slot` / `receive_slot` between two gloo processes move
one slot from one process's pool to another's, fingerprints checked first on both sides, the
generation bumped as `land_slot` bumps it; a mismatch is refused on both sides."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from tests.support import preloaded
from tests.support.tiny_hybrid import free_port, tiny_hybrid_adapters

pytestmark = pytest.mark.proc
ROOT = Path(__file__).resolve().parent.parent


def _pool(adapters: list[str], max_rank: int, names: list[str]) -> object:
    from metrale_cli.adapters.adapter import Adapter
    from metrale_cli.adapters.audit import audit
    from metrale_cli.layout.plan import plan_layouts
    from metrale_cli.model.config import ModelConfig
    from metrale_cli.pool.pool import LoraPool

    loaded = [Adapter.load(a, n) for a, n in zip(adapters, names, strict=True)]
    cfg = ModelConfig.from_hf(Path(adapters[0]).parent / "config.json")
    reports = [audit(a, cfg, max_rank) for a in loaded]
    layout, _ = plan_layouts(cfg, reports, None, max_rank)
    return LoraPool.load(layout, 4, reports)[0]


def _peer(rank: int, port: int, adapters: list[str], receiver_rank: int, out: str) -> None:
    """Rank 0 sends slot 1 of a pool holding both adapters; rank 1 lands it in slot 3 of a pool
    holding only the first (and packs the second into a reference pool to compare against)."""
    import torch.distributed as dist

    from metrale_cli.dist.torchrun import receive_slot, send_slot
    from metrale_cli.errors import LayoutMismatch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=2)
    result: dict = {}
    try:
        if rank == 0:
            pool = _pool(adapters, 8, ["first", "second"])
            send_slot(pool, 1, dst=1)
            result["sent"] = True
        else:
            pool = _pool(adapters[:1], receiver_rank, ["first"])
            before = pool.manager.slot_info(3).generation
            generation = receive_slot(pool, 3, src=0)
            ref = _pool(adapters[1:], receiver_rank, ["second"])
            info = pool.manager.slot_info(3)
            a_tab, b_tab = pool.region.offset_tables()
            ref_a, ref_b = ref.region.offset_tables()
            shift = 3 * pool.layout.slot_bytes  # slot 3's offsets against slot 0's
            result.update(
                bumped=generation == before + 1 == info.generation, name=info.name,
                scale=float(pool.scale_table[3]), rank=int(pool.rank_table[3]),
                same_bytes=bool(np.array_equal(pool.region.host_bytes(3),
                                               ref.region.host_bytes(0))),
                same_offsets=[bool(np.array_equal(np.where(x[:, 3] < 0, -1, x[:, 3] - shift),
                                                  y[:, 0]))
                              for x, y in ((a_tab, ref_a), (b_tab, ref_b))],
                slot0=pool.manager.slot_info(0).name)
    except LayoutMismatch as exc:
        result["refused"] = str(exc)
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    paths = tiny_hybrid_adapters(tmp_path_factory.mktemp("peer"), [
        ("a", 8, "q_proj,o_proj,out_proj"), ("b", 4, "q_proj,o_proj,out_proj")])
    return [str(p) for p in paths]


def run_pair(adapters: list[str], receiver_rank: int, out: Path) -> list[dict]:
    """Both processes at once, each started with torch imported (tests/support/preloaded.py)."""
    port = free_port()
    procs = [preloaded.start("from tests.test_tp_peer import _peer\n"
                             f"_peer({k}, {port}, {adapters!r}, {receiver_rank}, {str(out)!r})",
                             cwd=ROOT)
             for k in range(2)]
    for proc in procs:
        _, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr
    return [json.loads((out / f"rank{k}.json").read_text()) for k in range(2)]


def test_a_slot_lands_across_processes(adapters: list[str], tmp_path: Path) -> None:
    sender, receiver = run_pair(adapters, 8, tmp_path)
    assert sender == {"sent": True}
    assert receiver["bumped"] and receiver["name"] == "second"
    assert receiver["rank"] == 4 and receiver["scale"] == pytest.approx(2.0)
    assert receiver["same_bytes"] and receiver["same_offsets"] == [True, True]
    assert receiver["slot0"] == "first"


def test_a_fingerprint_mismatch_is_refused_on_both_sides(adapters: list[str],
                                                         tmp_path: Path) -> None:
    sender, receiver = run_pair(adapters, 16, tmp_path)  # the receiver's max rank differs
    assert sender["refused"].startswith("process 1 refused slot 1: layout fingerprints")
    assert receiver["refused"].startswith("slot from process 0 refused: layout fingerprints")
