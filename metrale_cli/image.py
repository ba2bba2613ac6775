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
from metrale_cli.errors import FormatError
from metrale_cli.layout import SlotLayout
from metrale_cli.models import ModelConfig
from metrale_cli.modules import LoraModule
from metrale_cli.pool import AdapterSlot, LoraPool
from metrale_cli.safetensors_header import read_header

FORMAT = "pool/1"
# The data buffer starts at a multiple of this, so `pool` can be mapped and DMA'd aligned.
DATA_ALIGN = 256
COPY_CHUNK = 64 << 20


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
    doc: dict[str, Any] = {
        "__metadata__": {
            "metrale.format": FORMAT,
            "metrale.layout": json.dumps(layout.record(pool.max_loras), separators=(",", ":")),
            "metrale.slots": json.dumps(pool.slot_records(), separators=(",", ":")),
            "metrale.model": json.dumps(layout.model.summary(), separators=(",", ":")),
            "metrale.active": str(pool.active),
        }
    }
    cursor = 0
    for name, dtype, shape, _ in tensors:
        size = int(np.prod(shape)) * {"U8": 1, "F32": 4, "I32": 4, "I64": 8}[dtype]
        doc[name] = {"dtype": dtype, "shape": shape, "data_offsets": [cursor, cursor + size]}
        cursor += size
    header = json.dumps(doc, separators=(",", ":")).encode()
    # Pad with spaces (allowed by the format) so the buffer, and so `pool`, starts aligned.
    padded = (8 + len(header) + DATA_ALIGN - 1) // DATA_ALIGN * DATA_ALIGN - 8
    header += b" " * (padded - len(header))
    return header, [(name, array) for name, _, _, array in tensors]


def write_image(pool: LoraPool, path: str | Path, force: bool = False) -> int:
    """Write `pool` as an image at `path` atomically; returns the file size in bytes."""
    header, tensors = image_header(pool)

    def write(f: Any) -> None:
        f.write(len(header).to_bytes(8, "little"))
        f.write(header)
        for name, array in tensors:
            if name == "pool" and pool.device == "cuda":
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
        except (KeyError, ValueError, TypeError) as exc:
            raise FormatError(f"{path}: bad metrale metadata ({exc})") from exc
        if layout.fingerprint != layout_doc.get("fingerprint"):
            raise FormatError(f"{path}: the layout does not reproduce its fingerprint")

        def tensor(name: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
            info = header.tensors.get(name)
            if info is None or info.dtype != dtype or info.shape != shape:
                raise FormatError(f"{path}: tensor {name!r} must be {dtype} {list(shape)}")
            np_dtype = {"U8": "u1", "F32": "<f4", "I32": "<i4", "I64": "<i8"}[dtype]
            return np.memmap(path, dtype=np_dtype, mode="r", offset=info.begin, shape=shape)

        n = len(layout.entries)
        slots = [
            AdapterSlot(s["name"], s["rank"], s["alpha"], s["scaling"], s["source"], {},
                        s["generation"])
            for s in slots_doc
        ]
        return cls(
            path=path, layout=layout, max_loras=max_loras, slots=slots,
            pinned=[bool(s["pinned"]) for s in slots_doc],
            active=int(meta.get("metrale.active", "0")),
            pool=tensor("pool", "U8", (max_loras * layout.slot_bytes,)),
            scales=tensor("scales", "F32", (max_loras,)),
            ranks=tensor("ranks", "I32", (max_loras,)),
            a_offsets=tensor("a_offsets", "I64", (n, max_loras)),
            b_offsets=tensor("b_offsets", "I64", (n, max_loras)),
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

    @cached_property
    def summary(self) -> dict[str, Any]:
        return {"path": str(self.path), "layout": self.layout.record(self.max_loras),
                "slots": [s.record(k, self.pinned[k]) for k, s in enumerate(self.slots)]}
