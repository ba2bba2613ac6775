"""The pool image: a safetensors file that holds a pool exactly (format `pool/1`, documented in
docs/pool-format.md), written atomically, and read back memory-mapped."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from metrale_cli.atomic import atomic_write
from metrale_cli.bf16 import bf16_to_f32
from metrale_cli.errors import FormatError, MetraleError
from metrale_cli.expert_pool import ExpertLayout
from metrale_cli.layout import SlotLayout
from metrale_cli.models import MAX_LAYERS, ModelConfig
from metrale_cli.modules import LoraModule
from metrale_cli.overlays import TABLES, OverlayRaw
from metrale_cli.pool import LoraPool, SlotContents
from metrale_cli.safetensors_header import read_header
from metrale_cli.slots import U64_MASK, AdapterSlot

FORMAT = "pool/1"
# The data buffer starts at a multiple of this, so `pool` can be mapped and DMA'd aligned.
DATA_ALIGN = 256
COPY_CHUNK = 64 << 20
_ITEM_BYTES = {"U8": 1, "F32": 4, "I32": 4, "I64": 8}
_NP_DTYPES = {"U8": "u1", "F32": "<f4", "I32": "<i4", "I64": "<i8"}
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


def write_image(pool: LoraPool, path: str | Path, force: bool = False) -> int:
    """Write `pool` as an image at `path` atomically; returns the file size in bytes."""
    header, tensors = image_header(pool)

    def write(f: Any) -> None:
        f.write(len(header).to_bytes(8, "little"))
        f.write(header)
        for name, array in tensors:
            if array.size == 0:
                continue  # an expert-only pool has a zero-byte slot pool
            if name in _DEVICE_TENSORS and pool.device == "cuda":
                for start in range(0, array.size, COPY_CHUNK):
                    f.write(pool.xp.asnumpy(array[start:start + COPY_CHUNK]).tobytes())
            else:
                f.write(memoryview(np.ascontiguousarray(array)).cast("B"))

    atomic_write(Path(path), write, force)
    return Path(path).stat().st_size


@dataclass(frozen=True)
class ImageRegion:
    """One pool of an image (`pool` or `expert_pool`) as its tensors hold it: the bytes,
    memory-mapped, and the `[n_entries, max_loras]` offset tables, checked at open against
    `layout` (every offset is its entry's own or -1)."""

    layout: SlotLayout | ExpertLayout
    memory: np.ndarray
    a_offsets: np.ndarray
    b_offsets: np.ndarray

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
        return a.reshape(e.max_rank, e.in_dim), b.reshape(e.out_dim, e.max_rank)

    def check(self, path: Path, name: str) -> None:
        """FormatError unless every slot's A and B offsets of an entry are both its layout's
        (`slot * slot_bytes + entry offset`) or both -1."""
        count = self.a_offsets.shape[1]
        slots = np.arange(count, dtype=np.int64) * self.layout.slot_bytes
        for which, offsets, attr in (("a", self.a_offsets, "a_offset"),
                                     ("b", self.b_offsets, "b_offset")):
            own = np.array([getattr(e, attr) for e in self.layout.entries], dtype=np.int64)
            table = np.asarray(offsets)
            bad = (table != own[:, None] + slots[None, :]) & (table != -1)
            if bad.any():
                entry, slot = (int(i) for i in np.argwhere(bad)[0])
                raise FormatError(f"{path}: {name} {which}_offsets[{entry}, {slot}] is "
                                  f"{int(table[entry, slot])}; the layout puts that entry at "
                                  f"{int(own[entry] + slots[slot])} (or -1: not adapted)")
        mixed = (np.asarray(self.a_offsets) < 0) != (np.asarray(self.b_offsets) < 0)
        if mixed.any():
            entry, slot = (int(i) for i in np.argwhere(mixed)[0])
            raise FormatError(f"{path}: {name} entry {entry} of slot {slot} has only one of "
                              "its A and B")


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

    @classmethod
    def open(cls, path: str | Path) -> PoolImage:
        path = Path(path)
        header = read_header(path)
        meta = header.metadata
        if meta.get("metrale.format") != FORMAT:
            raise FormatError(f"{path}: not a metrale pool image (metrale.format is "
                              f"{meta.get('metrale.format')!r}, expected {FORMAT!r})")
        try:
            layout_doc = json.loads(meta["metrale.layout"])
            model = ModelConfig.from_summary(json.loads(meta["metrale.model"]))
            if not 0 < model.num_hidden_layers <= MAX_LAYERS:
                # A config's own bound on layers. The layout is rebuilt layer by layer: a
                # header saying 10**8 would hang here.
                raise ValueError(f"num_hidden_layers {model.num_hidden_layers!r} is not in "
                                 f"[1, {MAX_LAYERS}]")
            layout = SlotLayout.build(model, [LoraModule(m) for m in layout_doc["modules"]],
                                      layout_doc["max_rank"], layout_doc["align"])
            max_loras = _count(layout_doc["max_loras"], "max_loras", 1)
            fingerprint = layout.fingerprint
            expert_layout, ex_fingerprint = None, None
            if "metrale.expert_layout" in meta:
                ex_doc = json.loads(meta["metrale.expert_layout"])
                expert_layout = ExpertLayout.from_record(model, ex_doc)
                ex_fingerprint = ex_doc.get("fingerprint")
            slots, pinned = _slots(json.loads(meta["metrale.slots"]), max_loras)
            active = _count(meta.get("metrale.active", "0"), "metrale.active", 0)
        except (KeyError, ValueError, TypeError, AttributeError, IndexError, OverflowError,
                RecursionError, MetraleError) as exc:
            raise FormatError(f"{path}: bad metrale metadata ({exc})") from exc
        if fingerprint != layout_doc.get("fingerprint"):
            raise FormatError(f"{path}: the layout does not reproduce its fingerprint")
        if expert_layout is not None and expert_layout.fingerprint != ex_fingerprint:
            raise FormatError(f"{path}: the expert layout does not reproduce its fingerprint")
        if active >= max_loras:
            raise FormatError(f"{path}: active slot {active} is out of range [0, {max_loras})")

        def tensor(name: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
            info = header.tensors.get(name)
            if info is None or info.dtype != dtype or info.shape != shape:
                raise FormatError(f"{path}: tensor {name!r} must be {dtype} {list(shape)}")
            if info.nbytes == 0:
                return np.zeros(shape, dtype=_NP_DTYPES[dtype])  # mmap refuses empty ranges
            return np.memmap(path, dtype=_NP_DTYPES[dtype], mode="r", offset=info.begin,
                             shape=shape)

        def region(prefix: str, the_layout: SlotLayout | ExpertLayout) -> ImageRegion:
            n = len(the_layout.entries)
            found = ImageRegion(
                the_layout, tensor(f"{prefix}pool", "U8", (max_loras * the_layout.slot_bytes,)),
                tensor(f"{prefix}a_offsets", "I64", (n, max_loras)),
                tensor(f"{prefix}b_offsets", "I64", (n, max_loras)))
            found.check(path, f"{prefix}pool")
            return found

        scales = tensor("scales", "F32", (max_loras,))
        ranks = tensor("ranks", "I32", (max_loras,))
        if not np.isfinite(scales).all():
            raise FormatError(f"{path}: scales hold non-finite values")
        top = max(layout.max_rank, expert_layout.max_rank if expert_layout else 0)
        if ((ranks < 0) | (ranks > top)).any():
            raise FormatError(f"{path}: ranks must be in [0, {top}]")
        return cls(
            path=path, layout=layout, max_loras=max_loras, slots=slots, pinned=pinned,
            active=active, region=region("", layout), scales=scales, ranks=ranks,
            expert_layout=expert_layout,
            expert_region=region("expert_", expert_layout) if expert_layout else None,
            overlay_raw=_overlays(path, meta, model, max_loras, tensor),
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


def _count(value: Any, what: str, least: int) -> int:
    """A JSON integer (or its decimal string) of at least `least`."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"{what} must be an integer")
    number = int(value)
    if number < least:
        raise ValueError(f"{what} must be at least {least}, got {number}")
    return number


def _slots(doc: Any, max_loras: int) -> tuple[list[AdapterSlot], list[bool]]:
    if not isinstance(doc, list) or len(doc) != max_loras:
        raise ValueError(f"metrale.slots must list {max_loras} slots")
    slots, pinned = [], []
    for s in doc:
        if not isinstance(s, dict):
            raise ValueError("a metrale.slots entry is not an object")
        name, source = s["name"], s["source"]
        alpha, scaling = float(s["alpha"]), float(s["scaling"])
        if not isinstance(name, str) or not isinstance(source, str):
            raise ValueError("slot name and source must be strings")
        if not (math.isfinite(alpha) and math.isfinite(scaling)):
            raise ValueError("slot alpha and scaling must be finite")
        generation = _count(s["generation"], "generation", 0)
        if generation > U64_MASK:
            raise ValueError("generation must fit 64 bits")
        slots.append(AdapterSlot(name, _count(s["rank"], "rank", 0), alpha, scaling, source,
                                 {}, generation))
        pinned.append(s["pinned"] is True)
    return slots, pinned


def _overlays(path: Path, meta: dict[str, str], model: ModelConfig, max_loras: int,
              tensor: Callable[[str, str, tuple[int, ...]], np.ndarray],
              ) -> list[OverlayRaw | None]:
    """Every slot's overlays, checked: runs tile the rows in order, each names a slot in range
    and a known table, its rows are that slot's, its token ids inside the vocabulary."""
    overlay_raw: list[OverlayRaw | None] = [None] * max_loras
    if "metrale.overlays" not in meta:
        return overlay_raw
    try:
        doc = json.loads(meta["metrale.overlays"])
        runs, hidden = doc["runs"], _count(doc["hidden_size"], "hidden_size", 1)
        if hidden != model.hidden_size or not isinstance(runs, list):
            raise ValueError(f"hidden_size {hidden} is not the model's {model.hidden_size}")
        n_rows = sum(_count(r["count"], "count", 0) for r in runs)
        slot_of_row = tensor("overlay_slots", "I32", (n_rows,))
        tokens = tensor("overlay_tokens", "I64", (n_rows,))
        rows = tensor("overlay_rows", "F32", (n_rows, hidden))
        cursor = 0
        for run in runs:
            start, count = _count(run["start"], "start", 0), _count(run["count"], "count", 0)
            slot, table = _count(run["slot"], "slot", 0), run["table"]
            if start != cursor or slot >= max_loras or table not in TABLES:
                raise ValueError(f"run {run!r} does not follow the previous one, or names a "
                                 "slot or table that does not exist")
            cursor += count
            ids = np.array(tokens[start:start + count])
            if (np.asarray(slot_of_row[start:start + count]) != slot).any():
                raise ValueError(f"overlay_slots disagree with the run of slot {slot}")
            if ((ids < 0) | (model.vocab_size > 0) & (ids >= model.vocab_size)).any():
                raise ValueError(f"token ids outside the vocabulary [0, {model.vocab_size})")
            raw = overlay_raw[slot] or OverlayRaw()
            raw.tables.append(str(table))
            raw.tokens.append(ids)
            raw.rows.append(np.array(rows[start:start + count]))
            raw.tied_lm_head.append(run["tied_lm_head"] is True)
            overlay_raw[slot] = raw
    except (KeyError, ValueError, TypeError, AttributeError) as exc:
        raise FormatError(f"{path}: bad metrale.overlays ({exc})") from exc
    return overlay_raw
