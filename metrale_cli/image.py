"""The pool image: a safetensors file that holds a pool exactly (format `pool/1`, documented in
docs/pool-format.md), written atomically, and read back memory-mapped."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from metrale_cli.atomic import atomic_write
from metrale_cli.errors import FormatError, MetraleError
from metrale_cli.expert_pool import ExpertLayout, expert_factors
from metrale_cli.layout import SlotLayout
from metrale_cli.models import ModelConfig
from metrale_cli.modules import LoraModule
from metrale_cli.overlays import OverlayRaw
from metrale_cli.pool import AdapterSlot, LoraPool
from metrale_cli.safetensors_header import read_header
from metrale_cli.sharding import RankExpertLayout, RankLayout, ShardSpec

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
    n = len(layout.entries)
    offsets = [pool.slot_offsets(k) for k in range(pool.max_loras)]
    a_offsets = np.stack([a for a, _ in offsets], axis=1) if n else np.zeros((0, pool.max_loras))
    b_offsets = np.stack([b for _, b in offsets], axis=1) if n else np.zeros((0, pool.max_loras))
    tensors: list[tuple[str, str, list[int], Any]] = [
        ("pool", "U8", [pool.max_loras * layout.slot_bytes], pool.pool),
        ("scales", "F32", [pool.max_loras], pool.to_host(pool.scale_table).astype("<f4")),
        ("ranks", "I32", [pool.max_loras], pool.to_host(pool.rank_table).astype("<i4")),
        ("a_offsets", "I64", [n, pool.max_loras], a_offsets.astype("<i8")),
        ("b_offsets", "I64", [n, pool.max_loras], b_offsets.astype("<i8")),
    ]
    metadata: dict[str, str] = {}
    if isinstance(layout, RankLayout):
        # A tensor-parallel rank's image: its entries record their slices, this names the rank.
        metadata["metrale.shard"] = json.dumps(layout.shard.record(), separators=(",", ":"))
    ex = pool.expert_layout
    if ex is not None:
        n_e = len(ex.entries)
        e_offsets = [pool.expert_slot_offsets(k) for k in range(pool.max_loras)]
        shape = (n_e, pool.max_loras)
        ea = np.stack([a for a, _ in e_offsets], axis=1) if n_e else np.zeros(shape)
        eb = np.stack([b for _, b in e_offsets], axis=1) if n_e else np.zeros(shape)
        # expert_pool right after pool: pool's size is a multiple of the alignment, so the
        # expert pool starts aligned too.
        tensors.insert(1, ("expert_pool", "U8", [pool.max_loras * ex.expert_slot_bytes],
                           pool.expert_pool))
        tensors += [("expert_a_offsets", "I64", list(shape), ea.astype("<i8")),
                    ("expert_b_offsets", "I64", list(shape), eb.astype("<i8"))]
        metadata["metrale.expert_layout"] = json.dumps(ex.record(pool.max_loras),
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
            "metrale.active": str(pool.active),
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


@dataclass
class PoolImage:
    """A pool image opened read-only; `pool` is memory-mapped, never read whole."""

    path: Path
    layout: SlotLayout
    max_loras: int
    slots: list[AdapterSlot]
    pinned: list[bool]
    active: int
    pool: np.ndarray
    scales: np.ndarray
    ranks: np.ndarray
    a_offsets: np.ndarray
    b_offsets: np.ndarray
    expert_layout: ExpertLayout | None = None
    expert_pool: np.ndarray | None = None
    expert_a_offsets: np.ndarray | None = None
    expert_b_offsets: np.ndarray | None = None
    overlay_raw: list[OverlayRaw | None] | None = None

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
            slots_doc = json.loads(meta["metrale.slots"])
            model = ModelConfig.from_summary(json.loads(meta["metrale.model"]))
            layout = SlotLayout.build(model, [LoraModule(m) for m in layout_doc["modules"]],
                                      layout_doc["max_rank"], layout_doc["align"])
            max_loras = int(layout_doc["max_loras"])
            shard = (ShardSpec.from_record(json.loads(meta["metrale.shard"]))
                     if "metrale.shard" in meta else None)
            if shard is not None:
                layout = RankLayout.of(layout, shard)
        except (KeyError, ValueError, TypeError, MetraleError) as exc:
            raise FormatError(f"{path}: bad metrale metadata ({exc})") from exc
        if layout.fingerprint != layout_doc.get("fingerprint"):
            raise FormatError(f"{path}: the layout does not reproduce its fingerprint")
        expert_layout = None
        if "metrale.expert_layout" in meta:
            try:
                ex_doc = json.loads(meta["metrale.expert_layout"])
                expert_layout = ExpertLayout.from_record(model, ex_doc)
                if shard is not None:
                    expert_layout = RankExpertLayout.of(expert_layout, shard)
            except (KeyError, ValueError, TypeError) as exc:
                raise FormatError(f"{path}: bad metrale.expert_layout ({exc})") from exc
            if expert_layout.fingerprint != ex_doc.get("fingerprint"):
                raise FormatError(f"{path}: the expert layout does not reproduce its "
                                  "fingerprint")

        def tensor(name: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
            info = header.tensors.get(name)
            if info is None or info.dtype != dtype or info.shape != shape:
                raise FormatError(f"{path}: tensor {name!r} must be {dtype} {list(shape)}")
            if info.nbytes == 0:
                return np.zeros(shape, dtype=_NP_DTYPES[dtype])  # mmap refuses empty ranges
            return np.memmap(path, dtype=_NP_DTYPES[dtype], mode="r", offset=info.begin,
                             shape=shape)

        n = len(layout.entries)
        slots = [
            AdapterSlot(s["name"], s["rank"], s["alpha"], s["scaling"], s["source"], {},
                        s["generation"])
            for s in slots_doc
        ]
        experts: dict[str, Any] = {}
        if expert_layout is not None:
            n_e = len(expert_layout.entries)
            experts = {
                "expert_layout": expert_layout,
                "expert_pool": tensor("expert_pool", "U8",
                                      (max_loras * expert_layout.expert_slot_bytes,)),
                "expert_a_offsets": tensor("expert_a_offsets", "I64", (n_e, max_loras)),
                "expert_b_offsets": tensor("expert_b_offsets", "I64", (n_e, max_loras)),
            }
        overlay_raw: list[OverlayRaw | None] = [None] * max_loras
        if "metrale.overlays" in meta:
            try:
                doc = json.loads(meta["metrale.overlays"])
                runs, hidden = doc["runs"], int(doc["hidden_size"])
                n_rows = sum(int(r["count"]) for r in runs)
                tokens = tensor("overlay_tokens", "I64", (n_rows,))
                rows = tensor("overlay_rows", "F32", (n_rows, hidden))
                for run in runs:
                    start, count = int(run["start"]), int(run["count"])
                    raw = overlay_raw[int(run["slot"])] or OverlayRaw()
                    raw.tables.append(str(run["table"]))
                    raw.tokens.append(np.array(tokens[start:start + count]))
                    raw.rows.append(np.array(rows[start:start + count]))
                    raw.tied_lm_head.append(bool(run["tied_lm_head"]))
                    overlay_raw[int(run["slot"])] = raw
            except (KeyError, ValueError, TypeError, IndexError) as exc:
                raise FormatError(f"{path}: bad metrale.overlays ({exc})") from exc
        return cls(
            path=path, layout=layout, max_loras=max_loras, slots=slots,
            pinned=[bool(s["pinned"]) for s in slots_doc],
            active=int(meta.get("metrale.active", "0")),
            pool=tensor("pool", "U8", (max_loras * layout.slot_bytes,)),
            scales=tensor("scales", "F32", (max_loras,)),
            ranks=tensor("ranks", "I32", (max_loras,)),
            a_offsets=tensor("a_offsets", "I64", (n, max_loras)),
            b_offsets=tensor("b_offsets", "I64", (n, max_loras)),
            overlay_raw=overlay_raw,
            **experts,
        )

    def slot_bytes_host(self, slot: int) -> np.ndarray:
        size = self.layout.slot_bytes
        return np.asarray(self.pool[slot * size:(slot + 1) * size])

    def slot_offsets(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        return np.asarray(self.a_offsets[:, slot]), np.asarray(self.b_offsets[:, slot])

    def factors(self, entry: int, slot: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Entry `entry`'s A `[rank, in]` and B `[out, rank]` of `slot` as float32, or None."""
        from metrale_cli.bf16 import bf16_to_f32

        a_off, b_off = int(self.a_offsets[entry, slot]), int(self.b_offsets[entry, slot])
        if a_off < 0:
            return None
        e = self.layout.entries[entry]
        r, max_rank = int(self.ranks[slot]), self.layout.max_rank
        a = bf16_to_f32(self.pool[a_off:a_off + e.a_bytes].view("<u2")).reshape(max_rank, e.in_dim)
        b = bf16_to_f32(self.pool[b_off:b_off + e.b_bytes].view("<u2")).reshape(e.out_dim, max_rank)
        return a[:r], b[:, :r]

    def expert_slot_bytes_host(self, slot: int) -> np.ndarray:
        if self.expert_layout is None or self.expert_pool is None:
            return np.zeros(0, dtype=np.uint8)
        size = self.expert_layout.expert_slot_bytes
        return np.asarray(self.expert_pool[slot * size:(slot + 1) * size])

    def expert_slot_offsets(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        if self.expert_a_offsets is None or self.expert_b_offsets is None:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        return (np.asarray(self.expert_a_offsets[:, slot]),
                np.asarray(self.expert_b_offsets[:, slot]))

    def expert_factors(self, entry: int, slot: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Expert entry `entry`'s A `[max_rank, in]` and B `[out, max_rank]` of `slot` as
        float32 (zero-padded), or None where the slot does not adapt it."""
        if self.expert_layout is None or self.expert_pool is None:
            return None
        assert self.expert_a_offsets is not None and self.expert_b_offsets is not None
        a_off = int(self.expert_a_offsets[entry, slot])
        b_off = int(self.expert_b_offsets[entry, slot])
        if a_off < 0:
            return None
        return expert_factors(self.expert_pool, self.expert_layout, entry, a_off, b_off)

    @cached_property
    def summary(self) -> dict[str, Any]:
        return {"path": str(self.path), "layout": self.layout.record(self.max_loras),
                "experts": (self.expert_layout.record(self.max_loras, entries=False)
                            if self.expert_layout is not None else None),
                "slots": [s.record(k, self.pinned[k]) for k, s in enumerate(self.slots)]}
