"""A tensor-parallel pack with one process per rank under `torchrun`
(`torchrun --nproc-per-node N -m metrale_cli pack ... --tp N`): each rank packs its own pool
with `image.pack.pack_rank`, the pack every `metrale pack` runs; and peer slot transfer between
processes.

torch is imported inside the functions that run under torchrun only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np

from metrale_cli import env
from metrale_cli.adapters.adapter import Adapter
from metrale_cli.adapters.audit import AdapterReport
from metrale_cli.errors import (
    FormatError,
    LayoutMismatch,
    MetraleError,
    OutputExists,
    RankFailed,
    RankSilent,
    UsageError,
)
from metrale_cli.files.atomic import check_output, publish_new, remove_stale_temps
from metrale_cli.image.pack import PackResult, image_name, pack_rank
from metrale_cli.layout.expert_layout import ExpertLayout
from metrale_cli.layout.sharding import ShardSpec, rank_layouts
from metrale_cli.layout.slot_layout import SlotLayout
from metrale_cli.pool.pool import LoraPool, SlotContents, SlotSource, pick_device
from metrale_cli.layout.sharding import refuse_unshardable

# The slot fields every torchrun rank must hold alike, in the order a difference is named.
SLOT_FIELDS = ("name", "rank", "alpha", "scaling", "module scales", "tensors")
_DIGEST_CHUNK = 1 << 20


@dataclass(frozen=True)
class RankFiles:
    """The names one rank's image goes through in DIR: staged (written, not yet published),
    final, and the image `--force` replaces, kept aside until every rank has published."""

    final: Path

    @property
    def staged(self) -> Path:
        return self.final.with_name(f".{self.final.name}.staged")

    @property
    def replaced(self) -> Path:
        return self.final.with_name(f".{self.final.name}.replaced")

    def reserve(self, force: bool) -> None:
        """Give the staged image its final name, keeping the staged name (a hard link) so
        `undo` knows the file at `final` is this run's. Without `force` only if the name is
        absent (OutputExists); with it the image there is moved aside first."""
        if force:
            with contextlib.suppress(FileNotFoundError):
                os.rename(self.final, self.replaced)
        publish_new(self.staged, self.final)

    def commit(self) -> None:
        self.staged.unlink(missing_ok=True)
        self.replaced.unlink(missing_ok=True)

    def undo(self) -> None:
        """Take back what `reserve` did, if anything: the final name only while it is still
        this run's image, then the replaced image back under it, then the staged file. Safe to
        run for another rank's names (one that died) and twice."""
        with contextlib.suppress(OSError):
            if os.path.samefile(self.final, self.staged):
                self.final.unlink()
        with contextlib.suppress(OSError):
            publish_new(self.replaced, self.final)  # never over a file written there since
            self.replaced.unlink()
        self.staged.unlink(missing_ok=True)



# -- one process per rank (torchrun) ------------------------------------------------------------

Plan = Callable[[], tuple[SlotLayout, ExpertLayout | None, list[AdapterReport]]]


def under_torchrun() -> bool:
    """Whether this process is one of a torch.distributed launch (torchrun sets RANK and
    WORLD_SIZE, with MASTER_ADDR and MASTER_PORT for the env:// rendezvous); UsageError when
    they are set but are not a launch's."""
    return env.torchrun_rank() is not None


def pack_torchrun(plan: Plan, max_loras: int, spec: ShardSpec, device: str = "auto",
                  out: Path | None = None, force: bool = False) -> PackResult | None:
    """This process's part of a distributed pack: rank 0 audits and plans (`plan()`) and
    broadcasts every rank's expected layout fingerprints and `pack_inputs`; every rank plans
    too (it needs the audited tensors) and all check, before any byte moves, that each holds
    the inputs and fingerprints rank 0 expects; each packs its own shard (host memory with
    `--device cpu`, else `cuda:LOCAL_RANK`) and stages its image; when every rank has staged,
    each reserves its final name (`RankFiles.reserve`), and only when every rank has does any
    commit. Any failure, or a rank silent for METRALE_DIST_TIMEOUT seconds, makes every rank
    raise `RankFailed` with the failing rank's message and undo what it published, so no
    image is left. Returns the whole record on rank 0, None elsewhere."""
    launch = env.torchrun_rank()
    if launch is None:
        raise UsageError("pack_torchrun runs in a process torchrun started (RANK, WORLD_SIZE)")
    env.rendezvous()  # before torch: a bad address is one line, not torch's socket warnings
    import torch.distributed as dist

    rank, world = launch
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
        raise RankSilent(f"rank {rank}: a rank did not answer {what} within {timeout:g} s "
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


def tensors_digest(adapter: Adapter) -> str:
    """sha256 over an adapter file's tensors in name order: each one's name, dtype, shape and
    bytes (not the file's metadata or tensor order, which do not reach a pool)."""
    digest = hashlib.sha256()
    with adapter.weights_path.open("rb") as f:
        for name in sorted(adapter.header.tensors):
            t = adapter.header.tensors[name]
            digest.update(json.dumps([name, t.dtype, list(t.shape)]).encode())
            f.seek(t.begin)
            left = t.nbytes
            while left:
                chunk = f.read(min(left, _DIGEST_CHUNK))
                if not chunk:
                    raise FormatError(f"{adapter.weights_path}: ends inside tensor {name}")
                digest.update(chunk)
                left -= len(chunk)
    return digest.hexdigest()


def pack_inputs(max_loras: int, reports: list[AdapterReport]) -> dict[str, Any]:
    """What every rank of a torchrun pack must hold alike, before any byte moves: max_loras
    and per slot (the adapters in order) the name, rank, alpha, scaling, every pair's scale
    (rank and alpha patterns), and a digest of the adapter's tensors."""
    slots = []
    for r in reports:
        scales = hashlib.sha256(json.dumps(
            [[m.layer, m.module.peft_name, m.r, m.alpha, m.scaling] for m in r.modules]
            + [[p.layer, p.proj.value, p.expert, p.r, p.alpha, p.scaling]
               for p in r.expert_pairs]).encode()).hexdigest()
        slots.append({"name": r.name, "rank": r.rank, "alpha": r.adapter.config.lora_alpha,
                      "scaling": r.scaling, "module scales": scales,
                      "tensors": tensors_digest(r.adapter)})
    return {"max_loras": max_loras, "slots": slots}


def input_difference(held: dict[str, Any], expected: dict[str, Any]) -> str | None:
    """The first way `held` (this rank's `pack_inputs`) differs from rank 0's, as one line."""
    if held["max_loras"] != expected["max_loras"]:
        return f"--max-loras {held['max_loras']}, where rank 0 has {expected['max_loras']}"
    if len(held["slots"]) != len(expected["slots"]):
        return (f"{len(held['slots'])} adapters, where rank 0 has {len(expected['slots'])} "
                "(the slots must be the same on every rank)")
    for slot, (mine, theirs) in enumerate(zip(held["slots"], expected["slots"], strict=True)):
        for name in SLOT_FIELDS:
            if mine[name] != theirs[name]:
                shown = ((f"{mine[name][:12]}...", f"{theirs[name][:12]}...")
                         if name in ("tensors", "module scales") else (mine[name], theirs[name]))
                return (f"slot {slot} ({theirs['name']}): {name} {shown[0]}, where rank 0 has "
                        f"{shown[1]} (other adapter files on this node?)")
    return None


def _pack_in_group(dist: Any, rank: int, plan: Plan, max_loras: int, me: ShardSpec,
                   device: str, out: Path | None, force: bool,
                   timeout: float) -> PackResult | None:
    planned = None
    payload: list[Any] = [None]
    if rank == 0:
        try:
            planned = plan()
            layout, ex, reports = planned
            refuse_unshardable(reports, me)
            expected = []
            for s in me.all_ranks():
                ranked, ranked_ex = rank_layouts(layout, ex, s)
                expected.append([ranked.fingerprint, ranked_ex.fingerprint if ranked_ex
                                 else None])
            payload[0] = {"rank": 0, "error": None, "expected": expected,
                          "inputs": pack_inputs(max_loras, reports)}
        except (MetraleError, OSError) as exc:
            payload[0] = {"rank": 0, "error": _message(exc)}
    try:
        dist.broadcast_object_list(payload, src=0)
    except RuntimeError as exc:
        raise RankFailed(f"rank {rank}: rank 0 did not send the plan within {timeout:g} s "
                         f"({_first_line(exc)})") from None
    if payload[0]["error"]:
        raise RankFailed(f"rank 0: {payload[0]['error']}")
    files = RankFiles(out / image_name(me)) if out is not None else None
    status: dict[str, Any] = {"rank": rank, "error": None}
    try:
        if planned is None:
            planned = plan()
        # Inputs first: other adapter weights or alphas, or another --max-loras, leave the
        # layout fingerprints alike.
        status["error"] = input_difference(pack_inputs(max_loras, planned[2]),
                                           payload[0]["inputs"])
        ranked, ranked_ex = rank_layouts(planned[0], planned[1], me)
        held = [ranked.fingerprint, ranked_ex.fingerprint if ranked_ex else None]
        if status["error"] is None and held != payload[0]["expected"][rank]:
            status["error"] = (f"holds layout fingerprints {held}, rank 0 expects "
                               f"{payload[0]['expected'][rank]} (other adapters or another "
                               "model on this node?)")
        if files is not None:
            check_output(files.final, force)
    except (MetraleError, OSError) as exc:
        status["error"] = _message(exc)
    _exchange(dist, rank, status, timeout, "the input check")
    layout, ex, reports = planned
    everyone = [RankFiles(out / image_name(s)) for s in me.all_ranks()] if out else []
    committed = created = False
    try:
        try:
            chosen = pick_device(device)
            if chosen == "cuda":
                from metrale_cli.compat import cupy_module

                cupy_module().cuda.Device(env.local_rank(rank)).use()
            if files is not None:
                # Of the ranks on a node one makes DIR; it removes DIR again if the pack fails.
                with contextlib.suppress(FileExistsError):
                    files.final.parent.mkdir()
                    created = True
            _, record = pack_rank(layout, ex, max_loras, reports, me, chosen,
                                  files.staged if files is not None else None, force=True)
            record["image"] = str(files.final) if files is not None else None
            status = {"rank": rank, "error": None, "record": record}
        except (MetraleError, OSError) as exc:
            status = {"rank": rank, "error": _message(exc)}
        statuses = _exchange(dist, rank, status, timeout, "after packing")
        # Every rank has staged its image: each reserves its final name, and only when every
        # rank holds its own does any let go of its staged and replaced files (the commit).
        if files is not None:
            try:
                files.reserve(force)
                status = {"rank": rank, "error": None}
            except (MetraleError, OSError) as exc:
                status = {"rank": rank, "error": _message(exc)}
        _exchange(dist, rank, status, timeout, "after publishing")
        if files is not None:
            files.commit()
        committed = True
    except RankFailed as failure:
        if files is not None:
            files.undo()
            if isinstance(failure, RankSilent):
                # A rank died or hangs: what it staged or reserved in this DIR is undone too
                # (its names are known; on another node they are not here).
                for other in everyone:
                    other.undo()
                    remove_stale_temps(other.final.parent, other.staged.name)
            else:
                # Every rank answered and undoes its own; once all have, the rank that made
                # DIR finds it empty.
                with contextlib.suppress(RuntimeError):
                    dist.barrier()
        raise
    finally:
        if not committed and files is not None:
            files.undo()
            if created:
                with contextlib.suppress(OSError):  # not empty: something else is there
                    files.final.parent.rmdir()
    if rank != 0:
        return None
    return PackResult(me, out, [s["record"] for s in statuses])


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
