"""The pool image: a safetensors file that holds a pool exactly (format `pool/1`, documented in
docs/pool-format.md), written atomically, and read back memory-mapped."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from metrale_cli.adapters.overlays import OverlayRaw
from metrale_cli.arguments import checked_as
from metrale_cli.bf16 import bf16_to_f32
from metrale_cli.errors import FormatError, UsageError
from metrale_cli.files.atomic import atomic_write
from metrale_cli.image import digest
from metrale_cli.image.check import check, digest_state
from metrale_cli.image.format import DATA_ALIGN, FORMAT, NP_DTYPES, ImageTables, read_tables
from metrale_cli.layout.expert_layout import ExpertLayout
from metrale_cli.layout.sharding import RankLayout
from metrale_cli.layout.slot_layout import SlotLayout
from metrale_cli.pool.pool import LoraPool, SlotContents
from metrale_cli.pool.slots import AdapterSlot

COPY_CHUNK = 64 << 20
_ITEM_BYTES = {"U8": 1, "F32": 4, "I32": 4, "I64": 8}
# Tensors that may live in device memory and are copied out in chunks.
_DEVICE_TENSORS = ("pool", "expert_pool")


def image_header(pool: LoraPool) -> tuple[bytes, list[tuple[str, Any]]]:
    """The safetensors header of `pool`'s image and the tensors in buffer order."""
    layout = pool.layout
    a_offsets, b_offsets = pool.region.offset_tables()
    tensors: list[tuple[str, str, list[int], Any]] = [
        ("pool", "U8", [pool.max_loras * layout.slot_bytes], pool.region.memory),
        ("scales", "F32", [pool.max_loras], pool.to_host(pool.scale_table).astype("<f4")),
        ("ranks", "I32", [pool.max_loras], pool.to_host(pool.rank_table).astype("<i4")),
        ("a_offsets", "I64", list(a_offsets.shape), a_offsets.astype("<i8")),
        ("b_offsets", "I64", list(b_offsets.shape), b_offsets.astype("<i8")),
    ]
    metadata: dict[str, str] = {}
    if isinstance(layout, RankLayout):
        # A tensor-parallel rank's image: its entries record their slices, this names the rank.
        metadata["metrale.shard"] = json.dumps(layout.shard.record(), separators=(",", ":"))
    ex = pool.expert_region
    if ex is not None and pool.expert_layout is not None:
        ea, eb = ex.offset_tables()
        # expert_pool right after pool: pool's size is a multiple of the alignment, so the
        # expert pool starts aligned too.
        tensors.insert(1, ("expert_pool", "U8", [pool.max_loras * ex.slot_bytes], ex.memory))
        tensors += [("expert_a_offsets", "I64", list(ea.shape), ea.astype("<i8")),
                    ("expert_b_offsets", "I64", list(eb.shape), eb.astype("<i8"))]
        metadata["metrale.expert_layout"] = json.dumps(pool.expert_layout.record(pool.max_loras),
                                                       separators=(",", ":"))
    overlay_tensors, overlay_doc = _overlay_tensors(pool)
    if overlay_doc is not None:
        tensors += overlay_tensors
        metadata["metrale.overlays"] = json.dumps(overlay_doc, separators=(",", ":"))
    # Written as a placeholder of the same length, replaced once the bytes are hashed.
    metadata[digest.KEY] = digest.digests_doc(digest.placeholder(t[0] for t in tensors))
    doc: dict[str, Any] = {
        "__metadata__": {
            "metrale.format": FORMAT,
            "metrale.layout": json.dumps(layout.record(pool.max_loras), separators=(",", ":")),
            "metrale.slots": json.dumps(pool.slot_records(), separators=(",", ":")),
            "metrale.model": json.dumps(layout.model.summary(), separators=(",", ":")),
            "metrale.active": str(pool.manager.active),
            **metadata,
        }
    }
    cursor = 0
    for name, dtype, shape, _ in tensors:
        size = int(np.prod(shape)) * _ITEM_BYTES[dtype]
        doc[name] = {"dtype": dtype, "shape": shape, "data_offsets": [cursor, cursor + size]}
        cursor += size
    header = json.dumps(doc, separators=(",", ":")).encode()
    # Pad with spaces (allowed by the format) so the buffer, and so `pool`, starts aligned.
    padded = (8 + len(header) + DATA_ALIGN - 1) // DATA_ALIGN * DATA_ALIGN - 8
    header += b" " * (padded - len(header))
    return header, [(name, array) for name, _, _, array in tensors]


def _overlay_tensors(
    pool: LoraPool,
) -> tuple[list[tuple[str, str, list[int], Any]], dict[str, Any] | None]:
    """Every slot's overlay rows, concatenated: `overlay_slots` I32 [n], `overlay_tokens` I64
    [n], `overlay_rows` F32 [n, hidden]; the JSON names each (slot, table) run of rows."""
    runs, slots, tokens, rows = [], [], [], []
    start = 0
    for k, raw in enumerate(pool.overlay_raw):
        if raw is None:
            continue
        for table, ids, values, tied in zip(raw.tables, raw.tokens, raw.rows, raw.tied_lm_head,
                                            strict=True):
            runs.append({"slot": k, "table": table, "mode": "replace", "tied_lm_head": tied,
                         "start": start, "count": len(ids)})
            slots.append(np.full(len(ids), k, dtype="<i4"))
            tokens.append(ids.astype("<i8"))
            rows.append(values.astype("<f4"))
            start += len(ids)
    if not runs:
        return [], None
    hidden = pool.layout.model.hidden_size
    return [
        ("overlay_slots", "I32", [start], np.concatenate(slots)),
        ("overlay_tokens", "I64", [start], np.concatenate(tokens)),
        ("overlay_rows", "F32", [start, hidden], np.concatenate(rows).reshape(start, hidden)),
    ], {"hidden_size": hidden, "runs": runs}


def write_image(pool: LoraPool, path: str | Path, force: bool = False,
                progress: Callable[[int, int], None] | None = None) -> int:
    """Write `pool` as an image at `path` atomically; returns the file size in bytes.
    `progress` gets the bytes of each chunk of the tensors written and their total."""
    header, tensors = image_header(pool)
    data_bytes = sum(array.nbytes for _, array in tensors)

    def chunks(name: str, array: Any) -> Iterator[Any]:
        """The tensor's bytes in order, `COPY_CHUNK` at a time (copied off the device)."""
        if array.size == 0:
            return  # an expert-only pool has a zero-byte slot pool
        if name in _DEVICE_TENSORS and pool.device == "cuda":
            for start in range(0, array.size, COPY_CHUNK):
                yield pool.xp.asnumpy(array[start:start + COPY_CHUNK]).tobytes()
        else:
            data = memoryview(np.ascontiguousarray(array)).cast("B")
            for start in range(0, len(data), COPY_CHUNK):
                yield data[start:start + COPY_CHUNK]

    def write(f: Any) -> None:
        f.write(len(header).to_bytes(8, "little"))
        f.write(header)
        digests = {}
        # Each chunk is hashed on a second thread while it is written (both release the GIL):
        # hashing after the write made writing a 490 MB image 1.5-2.6 s slower on the VM.
        with ThreadPoolExecutor(1) as hasher:
            for name, array in tensors:
                h = hashlib.sha256()
                hashed: Future[None] | None = None
                for chunk in chunks(name, array):
                    if hashed is not None:
                        hashed.result()  # in order: one chunk at a time
                    hashed = hasher.submit(h.update, chunk)
                    f.write(chunk)
                    if progress is not None:
                        progress(len(chunk), data_bytes)
                if hashed is not None:
                    hashed.result()
                digests[name] = h.hexdigest()
        f.seek(8)
        f.write(_with_digests(header, digests))

    atomic_write(Path(path), write, force)
    return Path(path).stat().st_size


def _with_digests(header: bytes, digests: dict[str, str]) -> bytes:
    """`header` with its placeholder digests replaced by `digests` (the same length: the
    placeholder is as long as the digests and the names are the same)."""
    def quoted(value: dict[str, str]) -> bytes:
        return json.dumps(digest.digests_doc(value))[1:-1].encode()

    before, after = quoted(digest.placeholder(digests)), quoted(digests)
    assert header.count(before) == 1 and len(before) == len(after)
    return header.replace(before, after)


@dataclass(frozen=True)
class ImageRegion:
    """One pool of an image (`pool` or `expert_pool`) as its tensors hold it: the bytes,
    memory-mapped, and the `[n_entries, max_loras]` offset tables, checked at open against
    `layout` (every offset is its entry's own or -1)."""

    layout: SlotLayout | ExpertLayout
    memory: np.ndarray
    a_offsets: np.ndarray
    b_offsets: np.ndarray
    begin: int  # where `memory` starts in the image file, in bytes

    def file_offset(self, entry: int, slot: int, part: str) -> int | None:
        """Where entry `entry`'s A (`part="A"`) or B (`"B"`) of `slot` starts in the image
        file, in bytes (the first BF16 value's low byte), or None where not adapted."""
        if part not in ("A", "B"):
            raise UsageError(f"part must be 'A' or 'B', not {part!r}")
        offset = int((self.a_offsets if part == "A" else self.b_offsets)[entry, slot])
        return None if offset < 0 else self.begin + offset

    def host_bytes(self, slot: int) -> np.ndarray:
        size = self.layout.slot_bytes
        return np.asarray(self.memory[slot * size:(slot + 1) * size])

    def adapted(self, slot: int) -> np.ndarray:
        """[n_entries] bool: the entries slot `slot` adapts."""
        return np.asarray(self.a_offsets[:, slot]) >= 0

    def factors(self, entry: int, slot: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Entry `entry`'s A `[max_rank, in]` and B `[out, max_rank]` of `slot` as float32
        (zero past the slot's rank, so it adds nothing to B @ A), or None where not adapted."""
        a_off, b_off = int(self.a_offsets[entry, slot]), int(self.b_offsets[entry, slot])
        if a_off < 0:
            return None
        e = self.layout.entries[entry]
        a = bf16_to_f32(np.asarray(self.memory[a_off:a_off + e.a_bytes]).view("<u2"))
        b = bf16_to_f32(np.asarray(self.memory[b_off:b_off + e.b_bytes]).view("<u2"))
        # A has `a_rows` rows: `max_rank`, or a fully sharded rank's part of them.
        return a.reshape(e.a_rows, e.in_dim), b.reshape(e.out_dim, e.max_rank)


@dataclass
class PoolImage:
    """A pool image opened read-only and validated; the pool bytes are memory-mapped, never
    read whole. A `land_slot` source (`pool.SlotSource`)."""

    path: Path
    layout: SlotLayout
    max_loras: int
    slots: list[AdapterSlot]
    pinned: list[bool]
    active: int
    region: ImageRegion
    scales: np.ndarray
    ranks: np.ndarray
    expert_layout: ExpertLayout | None = None
    expert_region: ImageRegion | None = None
    overlay_raw: list[OverlayRaw | None] = field(default_factory=list)
    digests: str = "none"  # check.digest_state: `checked`, `tables` or `none`

    @classmethod
    @checked_as("PoolImage.open")
    def open(cls, path: str | Path, check_contents: bool = True) -> PoolImage:
        """Open the image at `path`: not an image, or truncated, is a FormatError; one whose
        tables contradict its layout (a pointer that would land outside the pool, among
        others), or whose bytes do not match its digests, is ImageInconsistent, a FormatError
        too. Both are checked by image.check, the same code as `metrale show`. The digest
        check reads the pool once; `check_contents=False` skips that read (the tables' digests
        are checked either way). An image without digests opens as before (`digests`)."""
        t = read_tables(path)
        check(t, contents=check_contents)
        try:
            slots, pinned = _slots(t.slots_doc)
        except (KeyError, ValueError, TypeError, OverflowError) as exc:
            raise FormatError(f"{t.path}: bad metrale.slots ({exc})") from exc

        def tensor(name: str) -> np.ndarray:
            info = t.tensor(name)
            if info.nbytes == 0:
                return np.zeros(info.shape, dtype=NP_DTYPES[info.dtype])  # mmap refuses empty
            return np.memmap(t.path, dtype=NP_DTYPES[info.dtype], mode="r", offset=info.begin,
                             shape=info.shape)

        ex = t.expert_layout
        expert_region = None
        if ex is not None:
            assert t.expert_a_offsets is not None and t.expert_b_offsets is not None
            expert_region = ImageRegion(ex, tensor("expert_pool"), t.expert_a_offsets,
                                        t.expert_b_offsets, t.tensor("expert_pool").begin)
        return cls(
            path=t.path, layout=t.layout, max_loras=t.max_loras, slots=slots, pinned=pinned,
            active=t.active, region=ImageRegion(t.layout, tensor("pool"), t.a_offsets,
                                                t.b_offsets, t.tensor("pool").begin),
            scales=t.scales, ranks=t.ranks, expert_layout=ex, expert_region=expert_region,
            overlay_raw=_overlays(t, tensor), digests=digest_state(t, check_contents),
        )

    def slot_contents(self, slot: int) -> SlotContents:
        ex = self.expert_region
        info = replace(self.slots[slot], scaling=float(self.scales[slot]),
                       rank=int(self.ranks[slot]))
        return SlotContents(
            info=info, data=self.region.host_bytes(slot), adapted=self.region.adapted(slot),
            expert_data=ex.host_bytes(slot) if ex is not None else None,
            expert_adapted=ex.adapted(slot) if ex is not None else None,
            overlay=self.overlay_raw[slot])

    @cached_property
    def summary(self) -> dict[str, Any]:
        return {"path": str(self.path), "layout": self.layout.record(self.max_loras),
                "experts": (self.expert_layout.record(self.max_loras, entries=False)
                            if self.expert_layout is not None else None),
                "slots": [s.record(k, self.pinned[k]) for k, s in enumerate(self.slots)]}


def _slots(doc: list[dict[str, Any]]) -> tuple[list[AdapterSlot], list[bool]]:
    """The checked image's slot records as AdapterSlots (image.check has checked their types
    and matched their ranks and scales against the tables)."""
    slots, pinned = [], []
    for s in doc:
        slots.append(AdapterSlot(s["name"], int(s["rank"]), float(s["alpha"]),
                                 float(s["scaling"]), s["source"], {}, s["generation"]))
        pinned.append(s["pinned"] is True)
    return slots, pinned


def _overlays(t: ImageTables, tensor: Callable[[str], np.ndarray]) -> list[OverlayRaw | None]:
    """Every slot's overlays, from the checked image's runs (image.check has matched them
    against `overlay_slots`, the slots and the vocabulary)."""
    overlay_raw: list[OverlayRaw | None] = [None] * t.max_loras
    if t.overlay_doc is None:
        return overlay_raw
    assert t.overlay_tokens is not None
    rows = tensor("overlay_rows")
    for run in t.overlay_doc["runs"]:
        slot, start, count = run["slot"], run["start"], run["count"]
        raw = overlay_raw[slot] or OverlayRaw()
        raw.tables.append(str(run["table"]))
        raw.tokens.append(np.array(t.overlay_tokens[start:start + count]))
        raw.rows.append(np.array(rows[start:start + count]))
        raw.tied_lm_head.append(run["tied_lm_head"])
        overlay_raw[slot] = raw
    return overlay_raw
