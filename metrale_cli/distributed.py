"""Pools for a tensor-parallel deployment: one pool image per rank, each rank reading from the
adapter files only its shard's bytes; packed in one process (`metrale pack --tp N`) or one
process per rank under `torchrun` (`torchrun --nproc-per-node N -m metrale_cli pack ... --tp N`).

Rank k's image is `DIR/rank-{k}-of-{N}.safetensors`, a `pool/1` image of the rank's layout
(`sharding.RankLayout`) with `metrale.shard` metadata (docs/tensor-parallel.md).

torch is imported inside the functions that run under torchrun only.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np

from metrale_cli import env
from metrale_cli.atomic import atomic_directory
from metrale_cli.audit import AdapterReport
from metrale_cli.errors import LayoutMismatch, MetraleError, OutputExists, RankFailed, UsageError
from metrale_cli.expert_pool import ExpertLayout
from metrale_cli.layout import SlotLayout
from metrale_cli.overlays import OverlayRaw
from metrale_cli.packing import pack_pool
from metrale_cli.pool import AdapterSlot, LoraPool, pick_device
from metrale_cli.sharding import ShardSpec, rank_layouts, rank_report


def image_name(spec: ShardSpec) -> str:
    return f"rank-{spec.tp_rank}-of-{spec.tp_size}.safetensors"


@dataclass
class ShardedPackResult:
    """What `pack --tp` did: each rank's pack record, rank 0 first."""

    spec: ShardSpec
    out: Path | None
    ranks: list[dict[str, Any]]

    def record(self) -> dict[str, Any]:
        return {"tp_size": self.spec.tp_size, "ep_size": self.spec.ep_size,
                "fully_sharded": self.spec.fully_sharded,
                "out": str(self.out) if self.out is not None else None,
                "bytes_read": sum(r["bytes_read"] for r in self.ranks),
                "ranks": self.ranks}


def pack_rank(layout: SlotLayout, expert_layout: ExpertLayout | None, max_loras: int,
              reports: list[AdapterReport], spec: ShardSpec, device: str = "auto",
              path: Path | None = None, force: bool = False) -> dict[str, Any]:
    """Pack rank `spec.tp_rank`'s pool (its slices of every adapter) and write its image to
    `path` if given; returns the rank's pack record with its `shard`."""
    ranked, ranked_experts = rank_layouts(layout, expert_layout, spec)
    result = pack_pool(ranked, max_loras, [rank_report(r, ranked_experts) for r in reports],
                       device, path, force, expert_layout=ranked_experts)
    return {"shard": spec.record(), **result.record()}


def pack_shards(layout: SlotLayout, expert_layout: ExpertLayout | None, max_loras: int,
                reports: list[AdapterReport], spec: ShardSpec, device: str = "auto",
                out: Path | None = None, force: bool = False) -> ShardedPackResult:
    """Every rank of `spec`'s deployment, one after another in this process (one rank's pool
    in memory at a time). With `out`, the images land in that directory all at once: a failure
    leaves no directory."""
    specs = spec.all_ranks()
    for s in specs:
        rank_layouts(layout, expert_layout, s)  # every rank's rules hold before any byte moves
    records: list[dict[str, Any]] = []
    if out is None:
        records = [pack_rank(layout, expert_layout, max_loras, reports, s, device)
                   for s in specs]
        return ShardedPackResult(spec, None, records)

    def fill(tmp: Path) -> None:
        for s in specs:
            record = pack_rank(layout, expert_layout, max_loras, reports, s, device,
                               tmp / image_name(s))
            record["image"] = str(out / image_name(s))
            records.append(record)

    atomic_directory(out, fill, force)
    return ShardedPackResult(spec, out, records)


# -- one process per rank (torchrun) ------------------------------------------------------------

Plan = Callable[[], tuple[SlotLayout, ExpertLayout | None, list[AdapterReport]]]


def under_torchrun() -> bool:
    """Whether this process is one of a torch.distributed launch (torchrun sets RANK and
    WORLD_SIZE, with MASTER_ADDR and MASTER_PORT for the env:// rendezvous)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def pack_torchrun(plan: Plan, max_loras: int, spec: ShardSpec, device: str = "auto",
                  out: Path | None = None, force: bool = False) -> ShardedPackResult | None:
    """This process's part of a distributed pack: rank 0 audits and plans (`plan()`) and
    broadcasts every rank's expected layout fingerprints; every rank plans too (it needs the
    audited tensors) and all check that each holds what rank 0 expects before any byte moves;
    each packs its own shard (host memory with `--device cpu`, else `cuda:LOCAL_RANK`) and
    stages its image; only when every rank has staged does each rename its image into place.
    Any failure, or a rank silent for METRALE_DIST_TIMEOUT seconds, makes every rank raise
    `RankFailed` with the failing rank's message and leaves no image. Returns the whole record
    on rank 0, None elsewhere."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != spec.tp_size:
        raise UsageError(f"--tp {spec.tp_size} under torchrun needs {spec.tp_size} processes "
                         f"(one per rank), got {world}")
    timeout = env.dist_timeout()
    try:
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout))
    except (RuntimeError, ValueError) as exc:
        raise RankFailed(f"rank {rank}: no rendezvous within {timeout:g} s "
                         f"({_first_line(exc)})") from None
    try:
        return _pack_in_group(dist, rank, plan, max_loras, spec.all_ranks()[rank], device,
                              out, force, timeout)
    finally:
        dist.destroy_process_group()


def _message(exc: MetraleError | OSError) -> str:
    """The one line the CLI edge would print for `exc`, without `error: `."""
    if isinstance(exc, OSError):
        where = f"{exc.filename}: " if exc.filename else ""
        return where + str(exc.strerror or exc)
    return str(exc)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _exchange(dist: Any, rank: int, status: dict[str, Any], timeout: float,
              what: str) -> list[dict[str, Any]]:
    """Every rank's `status`, or RankFailed once a rank has not answered within `timeout`."""
    gathered: list[Any] = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(gathered, status)
    except RuntimeError as exc:
        raise RankFailed(f"rank {rank}: a rank did not answer {what} within {timeout:g} s "
                         f"({_first_line(exc)})") from None
    failed = next((s for s in gathered if s["error"]), None)
    if failed is not None:
        raise RankFailed(f"rank {failed['rank']}: {failed['error']}")
    return gathered


def _pack_in_group(dist: Any, rank: int, plan: Plan, max_loras: int, me: ShardSpec,
                   device: str, out: Path | None, force: bool,
                   timeout: float) -> ShardedPackResult | None:
    planned = None
    payload: list[Any] = [None]
    if rank == 0:
        try:
            planned = plan()
            layout, ex, _ = planned
            expected = []
            for s in me.all_ranks():
                ranked, ranked_ex = rank_layouts(layout, ex, s)
                expected.append([ranked.fingerprint, ranked_ex.fingerprint if ranked_ex
                                 else None])
            payload[0] = {"rank": 0, "error": None, "expected": expected}
        except (MetraleError, OSError) as exc:
            payload[0] = {"rank": 0, "error": _message(exc)}
    try:
        dist.broadcast_object_list(payload, src=0)
    except RuntimeError as exc:
        raise RankFailed(f"rank {rank}: rank 0 did not send the plan within {timeout:g} s "
                         f"({_first_line(exc)})") from None
    if payload[0]["error"]:
        raise RankFailed(f"rank 0: {payload[0]['error']}")
    final = out / image_name(me) if out is not None else None
    status: dict[str, Any] = {"rank": rank, "error": None}
    try:
        if planned is None:
            planned = plan()
        ranked, ranked_ex = rank_layouts(planned[0], planned[1], me)
        held = [ranked.fingerprint, ranked_ex.fingerprint if ranked_ex else None]
        if held != payload[0]["expected"][rank]:
            status["error"] = (f"holds layout fingerprints {held}, rank 0 expects "
                               f"{payload[0]['expected'][rank]} (other adapters or another "
                               "model on this node?)")
        if final is not None and final.exists() and not force:
            raise OutputExists(f"{final} exists; pass --force to overwrite it")
    except (MetraleError, OSError) as exc:
        status["error"] = _message(exc)
    _exchange(dist, rank, status, timeout, "the fingerprint check")
    layout, ex, reports = planned
    staged = final.with_name(f".{final.name}.staged") if final is not None else None
    committed = False
    try:
        try:
            chosen = pick_device(device)
            if chosen == "cuda":
                from metrale_cli.compat import cupy_module

                cupy_module().cuda.Device(int(os.environ.get("LOCAL_RANK", rank))).use()
            if final is not None:
                final.parent.mkdir(exist_ok=True)
            record = pack_rank(layout, ex, max_loras, reports, me, chosen, staged, force=True)
            record["image"] = str(final) if final is not None else None
            status = {"rank": rank, "error": None, "record": record}
        except (MetraleError, OSError) as exc:
            status = {"rank": rank, "error": _message(exc)}
        statuses = _exchange(dist, rank, status, timeout, "after packing")
        if staged is not None and final is not None:
            os.replace(staged, final)
        committed = True
    finally:
        if not committed and staged is not None:
            staged.unlink(missing_ok=True)
    if rank != 0:
        return None
    return ShardedPackResult(me, out, [s["record"] for s in statuses])


# -- peer landing across processes --------------------------------------------------------------


@dataclass
class ReceivedSlot:
    """One slot received from a peer process, as a landing source for `LoraPool.land_slot`
    (the source slot is 0; its table offsets are rebased to it)."""

    layout: SlotLayout
    expert_layout: ExpertLayout | None
    slots: list[AdapterSlot]
    overlay_raw: list[OverlayRaw | None]
    data: np.ndarray
    offsets: tuple[np.ndarray, np.ndarray]
    expert_data: np.ndarray
    expert_offsets: tuple[np.ndarray, np.ndarray]
    max_loras: int = 1

    def slot_bytes_host(self, slot: int) -> np.ndarray:
        return self.data

    def slot_offsets(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        return self.offsets

    def expert_slot_bytes_host(self, slot: int) -> np.ndarray:
        return self.expert_data

    def expert_slot_offsets(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        return self.expert_offsets


def _fingerprints(pool: Any) -> list[str | None]:
    ex = pool.expert_layout
    return [pool.layout.fingerprint, ex.fingerprint if ex is not None else None]


def _rebased(offsets: tuple[np.ndarray, np.ndarray], start: int) -> tuple[np.ndarray, ...]:
    return tuple(np.where(o < 0, -1, o - start) for o in offsets)


def send_slot(pool: Any, slot: int, dst: int) -> None:
    """Send `slot` of `pool` (a `LoraPool` or a `PoolImage`) to process `dst` of the default
    `torch.distributed` group, which calls `receive_slot`. Both sides first swap their layout
    fingerprints (slot and expert); on a mismatch, or when the receiver refuses (a busy slot),
    both raise before any slot byte moves. The bytes travel as host tensors (gloo)."""
    import torch
    import torch.distributed as dist

    if not 0 <= slot < pool.max_loras:
        raise UsageError(f"slot {slot} is out of range [0, {pool.max_loras})")
    slot_bytes = pool.layout.slot_bytes
    ex = pool.expert_layout
    header = {
        "fingerprints": _fingerprints(pool), "slot": pool.slots[slot],
        "offsets": _rebased(pool.slot_offsets(slot), slot * slot_bytes),
        "expert_offsets": (_rebased(pool.expert_slot_offsets(slot), slot * ex.expert_slot_bytes)
                           if ex is not None else None),
        "overlay": (getattr(pool, "overlay_raw", None) or [None] * pool.max_loras)[slot],
    }
    dist.send_object_list([header], dst=dst)
    reply: list[Any] = [None]
    dist.recv_object_list(reply, src=dst)
    if reply[0]["error"]:
        raise LayoutMismatch(f"process {dst} refused slot {slot}: {reply[0]['error']}")
    dist.send(torch.from_numpy(np.ascontiguousarray(pool.slot_bytes_host(slot))), dst=dst)
    if ex is not None:
        dist.send(torch.from_numpy(np.ascontiguousarray(pool.expert_slot_bytes_host(slot))),
                  dst=dst)


def receive_slot(pool: LoraPool, slot: int, src: int) -> int:
    """Land the slot process `src` sends (`send_slot`) in `slot` of `pool`, as `land_slot`
    lands one from a local pool: same checks, the generation bumped. Returns the new
    generation."""
    import torch
    import torch.distributed as dist

    header: list[Any] = [None]
    dist.recv_object_list(header, src=src)
    theirs, ours = header[0]["fingerprints"], _fingerprints(pool)
    error = None
    if theirs != ours:
        error = (f"layout fingerprints {theirs} do not match the receiving pool's {ours}")
    elif not 0 <= slot < pool.max_loras:
        error = f"slot {slot} is out of range [0, {pool.max_loras})"
    elif pool.ref_counts[slot] > 0:
        error = f"slot {slot} has {pool.ref_counts[slot]} in-flight sequences"
    dist.send_object_list([{"error": error}], dst=src)
    if error is not None:
        raise LayoutMismatch(f"slot from process {src} refused: {error}")
    data = torch.empty(pool.layout.slot_bytes, dtype=torch.uint8)
    dist.recv(data, src=src)
    ex = pool.expert_layout
    expert_data = torch.empty(ex.expert_slot_bytes if ex is not None else 0, dtype=torch.uint8)
    if ex is not None:
        dist.recv(expert_data, src=src)
    empty = np.zeros(0, dtype=np.int64)
    source = ReceivedSlot(
        pool.layout, ex, [header[0]["slot"]], [header[0]["overlay"]], data.numpy(),
        header[0]["offsets"], expert_data.numpy(), header[0]["expert_offsets"] or (empty, empty))
    return pool.land_slot(slot, source, 0)
