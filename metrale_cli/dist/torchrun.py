"""Pools for a tensor-parallel deployment: one pool image per rank, each rank reading from the
adapter files only its shard's bytes; packed in one process (`metrale pack --tp N`) or one
process per rank under `torchrun` (`torchrun --nproc-per-node N -m metrale_cli pack ... --tp N`).

Rank k's image is `DIR/rank-{k}-of-{N}.safetensors`, a `pool/1` image of the rank's layout
(`sharding.RankLayout`) with `metrale.shard` metadata (docs/tensor-parallel.md).

torch is imported inside the functions that run under torchrun only.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np

from metrale_cli import env
from metrale_cli.files.atomic import atomic_directory, publish_new
from metrale_cli.adapters.audit import AdapterReport
from metrale_cli.errors import LayoutMismatch, MetraleError, OutputExists, RankFailed, UsageError
from metrale_cli.layout.expert_layout import ExpertLayout
from metrale_cli.layout.slot_layout import SlotLayout
from metrale_cli.pool.packing import pack_pool
from metrale_cli.pool.pool import LoraPool, SlotContents, SlotSource, pick_device
from metrale_cli.layout.sharding import ShardSpec, rank_layouts, rank_report, refuse_unshardable

# Every rank image's name matches it: `--force` replaces a DIR that holds only such files.
IMAGE_GLOB = "rank-*-of-*.safetensors"


def image_name(spec: ShardSpec) -> str:
    return f"rank-{spec.tp_rank}-of-{spec.tp_size}.safetensors"


@dataclass
class ShardedPackResult:
    """What `pack --tp` did: each rank's pack record, rank 0 first."""

    spec: ShardSpec
    out: Path | None
    ranks: list[dict[str, Any]]

    @property
    def warnings(self) -> list[str]:
        """What the rank pools hold that the kernels would refuse (the same for every rank)."""
        return list(self.ranks[0]["warnings"]) if self.ranks else []

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
    refuse_unshardable(reports, spec)
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

    atomic_directory(out, fill, force, owned=[IMAGE_GLOB])
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


def _gather(dist: Any, rank: int, status: dict[str, Any], timeout: float,
            what: str) -> list[dict[str, Any]]:
    """Every rank's `status`, or RankFailed once a rank has not answered within `timeout`."""
    gathered: list[Any] = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(gathered, status)
    except RuntimeError as exc:
        raise RankFailed(f"rank {rank}: a rank did not answer {what} within {timeout:g} s "
                         f"({_first_line(exc)})") from None
    return gathered


def _failure(gathered: list[dict[str, Any]]) -> RankFailed | None:
    """The first failing rank's error, as every rank raises it."""
    failed = next((s for s in gathered if s["error"]), None)
    return None if failed is None else RankFailed(f"rank {failed['rank']}: {failed['error']}")


def _exchange(dist: Any, rank: int, status: dict[str, Any], timeout: float,
              what: str) -> list[dict[str, Any]]:
    """Every rank's `status`; RankFailed when a rank failed or did not answer."""
    gathered = _gather(dist, rank, status, timeout, what)
    failure = _failure(gathered)
    if failure is not None:
        raise failure
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
    committed = created = False
    try:
        try:
            chosen = pick_device(device)
            if chosen == "cuda":
                from metrale_cli.compat import cupy_module

                cupy_module().cuda.Device(int(os.environ.get("LOCAL_RANK", rank))).use()
            if final is not None:
                # Of the ranks on a node one makes DIR; it removes DIR again if the pack fails.
                with contextlib.suppress(FileExistsError):
                    final.parent.mkdir()
                    created = True
            record = pack_rank(layout, ex, max_loras, reports, me, chosen, staged, force=True)
            record["image"] = str(final) if final is not None else None
            status = {"rank": rank, "error": None, "record": record}
        except (MetraleError, OSError) as exc:
            status = {"rank": rank, "error": _message(exc)}
        statuses = _gather(dist, rank, status, timeout, "after packing")
        failure = _failure(statuses)
        if failure is not None:
            # Every rank answered: each removes its staged image, and once all have, the rank
            # that made DIR finds it empty.
            if staged is not None:
                staged.unlink(missing_ok=True)
            with contextlib.suppress(RuntimeError):
                dist.barrier()
            raise failure
        if staged is not None and final is not None:
            if force:
                os.replace(staged, final)
            else:  # a file written at `final` since the existence check stays: OutputExists
                publish_new(staged, final)
                staged.unlink()
        committed = True
    finally:
        if not committed and staged is not None:
            staged.unlink(missing_ok=True)
            if created:
                with contextlib.suppress(OSError):  # not empty: something else is there
                    staged.parent.rmdir()
    if rank != 0:
        return None
    return ShardedPackResult(me, out, [s["record"] for s in statuses])


# -- peer landing across processes --------------------------------------------------------------


@dataclass
class ReceivedSlot:
    """One slot a peer process sent, as a `land_slot` source (its only slot is 0)."""

    layout: SlotLayout
    expert_layout: ExpertLayout | None
    contents: SlotContents
    max_loras: int = 1

    def slot_contents(self, slot: int) -> SlotContents:
        return self.contents


def _fingerprints(source: SlotSource) -> list[str | None]:
    ex = source.expert_layout
    return [source.layout.fingerprint, ex.fingerprint if ex is not None else None]


def send_slot(source: SlotSource, slot: int, dst: int) -> None:
    """Send `slot` of `source` (a `LoraPool` or a `PoolImage`) to process `dst` of the default
    `torch.distributed` group, which calls `receive_slot`. Both sides first swap their layout
    fingerprints (slot and expert); on a mismatch, or when the receiver refuses (its slot out of
    range or busy), both raise `LayoutMismatch` before any slot byte moves. The bytes travel as
    host tensors (gloo)."""
    import torch
    import torch.distributed as dist

    if not 0 <= slot < source.max_loras:
        raise UsageError(f"slot {slot} is out of range [0, {source.max_loras})")
    contents = source.slot_contents(slot)
    header = {"fingerprints": _fingerprints(source), "info": contents.info,
              "adapted": contents.adapted, "expert_adapted": contents.expert_adapted,
              "overlay": contents.overlay}
    dist.send_object_list([header], dst=dst)
    reply: list[Any] = [None]
    dist.recv_object_list(reply, src=dst)
    if reply[0]["error"]:
        raise LayoutMismatch(f"process {dst} refused slot {slot}: {reply[0]['error']}")
    dist.send(torch.from_numpy(np.ascontiguousarray(contents.data)), dst=dst)
    if contents.expert_data is not None:
        dist.send(torch.from_numpy(np.ascontiguousarray(contents.expert_data)), dst=dst)


def receive_slot(pool: LoraPool, slot: int, src: int) -> int:
    """Land the slot process `src` sends (`send_slot`) in `slot` of `pool` with `land_slot`:
    the same checks, the generation bumped. Returns the new generation."""
    import torch
    import torch.distributed as dist

    received: list[Any] = [None]
    dist.recv_object_list(received, src=src)
    header = received[0]
    theirs, ours = header["fingerprints"], _fingerprints(pool)
    error = None
    if theirs != ours:
        error = f"layout fingerprints {theirs} do not match the receiving pool's {ours}"
    elif not 0 <= slot < pool.max_loras:
        error = f"slot {slot} is out of range [0, {pool.max_loras})"
    elif pool.manager.ref_count(slot) > 0:
        error = f"slot {slot} has {pool.manager.ref_count(slot)} in-flight sequences"
    dist.send_object_list([{"error": error}], dst=src)
    if error is not None:
        raise LayoutMismatch(f"slot from process {src} refused: {error}")
    data = torch.empty(pool.layout.slot_bytes, dtype=torch.uint8)
    dist.recv(data, src=src)
    expert_data = None
    if header["expert_adapted"] is not None and pool.expert_layout is not None:
        expert_data = torch.empty(pool.expert_layout.slot_bytes, dtype=torch.uint8)
        dist.recv(expert_data, src=src)
    contents = SlotContents(header["info"], data.numpy(), header["adapted"],
                            expert_data.numpy() if expert_data is not None else None,
                            header["expert_adapted"], header["overlay"])
    return pool.land_slot(slot, ReceivedSlot(pool.layout, pool.expert_layout, contents), 0)
