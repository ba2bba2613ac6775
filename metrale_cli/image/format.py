"""The pool image format `pool/1` (docs/pool-format.md) and its reader: `read_tables(path)`
reads the safetensors header, the `metrale.*` metadata and the small tables (scales, ranks,
offsets, overlay slots and tokens) with positional reads. The `pool`, `expert_pool` and
`overlay_rows` tensors are never touched, so a 40 GB image reads as fast as a 40 MB one.

The reader checks only what it needs to read (the metadata describes a layout, every tensor
has the shape it fixes); image/check.py checks that the tables agree. A file that is not a pool
image, or is truncated, is a `FormatError` (exit 2).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from metrale_cli.errors import FormatError, ImageInconsistent, MetraleError
from metrale_cli.files.jsondoc import load_json
from metrale_cli.files.safetensors_header import SafetensorsHeader, TensorInfo, read_header
from metrale_cli.image import digest
from metrale_cli.image.digest import read_digests
from metrale_cli.layout.expert_layout import ExpertLayout
from metrale_cli.layout.sharding import RankExpertLayout, RankLayout, ShardSpec
from metrale_cli.layout.slot_layout import SlotLayout
from metrale_cli.model.config import ModelConfig
from metrale_cli.model.modules import LoraModule

FORMAT = "pool/1"
# The data buffer starts at a multiple of this, so `pool` can be mapped and DMA'd aligned.
DATA_ALIGN = 256
# The NumPy dtype of each safetensors dtype the format uses.
NP_DTYPES = {"U8": "u1", "F32": "<f4", "I32": "<i4", "I64": "<i8"}


@dataclass
class ImageTables:
    """A pool image's header, metadata and tables: everything but the pool bytes.

    Offsets are `[n_entries, max_loras]` int64 byte offsets into their pool, -1 = not adapted.
    """

    path: Path
    file_bytes: int
    header: SafetensorsHeader
    model: ModelConfig
    layout: SlotLayout
    layout_doc: dict[str, Any]
    max_loras: int
    slots_doc: list[dict[str, Any]]
    active: int
    scales: np.ndarray  # [max_loras] f32
    ranks: np.ndarray  # [max_loras] i32
    a_offsets: np.ndarray
    b_offsets: np.ndarray
    expert_layout: ExpertLayout | None = None
    expert_doc: dict[str, Any] | None = None
    expert_a_offsets: np.ndarray | None = None
    expert_b_offsets: np.ndarray | None = None
    overlay_doc: dict[str, Any] | None = None
    overlay_slots: np.ndarray | None = None  # [n] i32
    overlay_tokens: np.ndarray | None = None  # [n] i64
    # Tensor name -> SHA-256 of its bytes (image/digest.py); None in an image without digests.
    digests: dict[str, str] | None = None

    def table_arrays(self) -> dict[str, np.ndarray]:
        """Every small table by its tensor name, as read from the file."""
        tables = {"scales": self.scales, "ranks": self.ranks, "a_offsets": self.a_offsets,
                  "b_offsets": self.b_offsets, "expert_a_offsets": self.expert_a_offsets,
                  "expert_b_offsets": self.expert_b_offsets,
                  "overlay_slots": self.overlay_slots, "overlay_tokens": self.overlay_tokens}
        return {name: array for name, array in tables.items() if array is not None}

    def tensor(self, name: str) -> TensorInfo:
        return self.header.tensors[name]

    def entry_label(self, pool: str, entry: int) -> tuple[int, str]:
        """(layer, module) of an entry of `pool`: `q_proj`, `gate_proj expert 3`, `router`."""
        if pool == "pool":
            e = self.layout.entries[entry]
            return e.layer, e.module.peft_name
        assert self.expert_layout is not None
        x = self.expert_layout.entries[entry]
        return x.layer, x.proj.value + ("" if x.proj.value == "router" else f" expert {x.expert}")

    def entry_name(self, pool: str, entry: int) -> str:
        layer, module = self.entry_label(pool, entry)
        return f"layer {layer} {module}"

    def overlay_runs(self, slot: int) -> list[dict[str, Any]]:
        if self.overlay_doc is None:
            return []
        return [r for r in self.overlay_doc["runs"] if int(r["slot"]) == slot]


def _json_meta(path: Path, meta: dict[str, str], key: str) -> Any:
    if key not in meta:
        raise FormatError(f"{path}: no {key} in the metadata: not a complete pool image")
    return load_json(path, meta[key], f"{key} (JSON)")


def _need(path: Path, header: SafetensorsHeader, name: str, dtype: str,
          shape: tuple[int, ...]) -> TensorInfo:
    info = header.tensors.get(name)
    if info is None:
        raise ImageInconsistent(f"{path}: no tensor {name!r}; {FORMAT} needs {dtype} "
                                f"{list(shape)}")
    if info.dtype != dtype or info.shape != shape:
        raise ImageInconsistent(f"{path}: tensor {name!r} is {info.dtype} {list(info.shape)}; "
                                f"{FORMAT} needs {dtype} {list(shape)}")
    return info


def _read(fd: int, info: TensorInfo) -> np.ndarray:
    """One small table, read with a positional read (never mapped: the reads are counted)."""
    data = os.pread(fd, info.nbytes, info.begin) if info.nbytes else b""
    if len(data) != info.nbytes:
        raise FormatError(f"file ended inside tensor {info.name!r}")
    return np.frombuffer(data, dtype=NP_DTYPES[info.dtype]).reshape(info.shape)


def _count(value: Any, what: str) -> int:
    """A JSON integer (or its decimal string), not negative."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"{what} must be an integer")
    number = int(value)
    if number < 0:
        raise ValueError(f"{what} must not be negative, got {number}")
    return number


def read_tables(path: str | Path) -> ImageTables:
    """The header, metadata and tables of the pool image at `path`, never its pool bytes."""
    path = Path(path)
    header = read_header(path)  # not safetensors, or truncated: FormatError
    meta = header.metadata
    if meta.get("metrale.format") != FORMAT:
        raise FormatError(f"{path}: not a metrale pool image (metrale.format is "
                          f"{meta.get('metrale.format')!r}, expected {FORMAT!r})")
    layout_doc = _json_meta(path, meta, "metrale.layout")
    slots_doc = _json_meta(path, meta, "metrale.slots")
    model_doc = _json_meta(path, meta, "metrale.model")
    # A tensor-parallel rank's image names its rank.
    shard_doc = _json_meta(path, meta, "metrale.shard") if "metrale.shard" in meta else None
    try:
        model = ModelConfig.from_summary(model_doc)  # within a config file's bounds
        layout = SlotLayout.build(model, [LoraModule(m) for m in layout_doc["modules"]],
                                  int(layout_doc["max_rank"]), int(layout_doc["align"]))
        shard = ShardSpec.from_record(shard_doc) if shard_doc is not None else None
        if shard is not None:
            layout = RankLayout.of(layout, shard)
        # Built here, so that a model summary without a dim (or a shard its model cannot split)
        # is bad metadata, not an error where the entries are first read.
        n = len(layout.entries)
        max_loras = int(layout_doc["max_loras"])
        active = int(meta.get("metrale.active", "0"))
    except (KeyError, ValueError, TypeError, AttributeError, IndexError, OverflowError,
            RecursionError, MetraleError) as exc:
        raise FormatError(f"{path}: metadata does not describe a layout ({exc})") from exc
    if not model.num_experts_per_tok and model.moe_layers and model.weights_family is None:
        # A config.json's rule (ModelConfig.from_dict), for the config a header carries: images
        # of a family metrale knows, packed before configs were held to it, recorded 0. A
        # family read from weights may record 0: its config gave none, its class's default
        # unknown.
        raise FormatError(f"{path}: its model's num_experts_per_tok is 0: each token goes to no "
                          "routed expert, which is no MoE; pack its adapters again with the "
                          "model's config")
    if max_loras <= 0:
        raise ImageInconsistent(f"{path}: max_loras is {max_loras}")
    if not isinstance(slots_doc, list):
        raise FormatError(f"{path}: metrale.slots is not a list")
    if (layout_doc.get("fingerprint") != layout.fingerprint
            and layout_doc.get("slot_bytes") != layout.slot_bytes):
        # The model and modules it records give another layout here: a family whose modules
        # changed since the image was packed (qwen2_moe's shared experts), or an edit.
        raise ImageInconsistent(
            f"{path}: its layout ({layout_doc.get('slot_bytes')} B a slot, fingerprint "
            f"{layout_doc.get('fingerprint')}) is not the one this metrale builds for its "
            f"model and modules ({layout.slot_bytes} B, {layout.fingerprint}): packed by "
            "another metrale version, or edited; pack its adapters again")
    # The metadata fixes every table's shape: check them all before reading any.
    _need(path, header, "pool", "U8", (max_loras * layout.slot_bytes,))
    needs = {"scales": ("F32", (max_loras,)), "ranks": ("I32", (max_loras,)),
             "a_offsets": ("I64", (n, max_loras)), "b_offsets": ("I64", (n, max_loras))}
    expert_layout, expert_doc = None, None
    if "metrale.expert_layout" in meta:
        expert_doc = _json_meta(path, meta, "metrale.expert_layout")
        try:
            expert_layout = ExpertLayout.from_record(model, expert_doc)
            if shard is not None:
                expert_layout = RankExpertLayout.of(expert_layout, shard)
            n_e = len(expert_layout.entries)
        except (KeyError, ValueError, TypeError, AttributeError, OverflowError, RecursionError,
                MetraleError) as exc:
            raise FormatError(f"{path}: metrale.expert_layout does not describe a layout "
                              f"({exc})") from exc
        _need(path, header, "expert_pool", "U8",
              (max_loras * expert_layout.slot_bytes,))
        needs |= {"expert_a_offsets": ("I64", (n_e, max_loras)),
                  "expert_b_offsets": ("I64", (n_e, max_loras))}
    overlay_doc = None
    if "metrale.overlays" in meta:
        overlay_doc = _json_meta(path, meta, "metrale.overlays")
        try:
            runs = overlay_doc["runs"]
            if not isinstance(runs, list) or not all(isinstance(r, dict) for r in runs):
                raise TypeError("runs is not a list of objects")
            for r in runs:
                r |= {k: _count(r[k], k) for k in ("slot", "start", "count")}
            rows = sum(r["count"] for r in runs)
            hidden = _count(overlay_doc["hidden_size"], "hidden_size")
        except (KeyError, ValueError, TypeError, AttributeError) as exc:
            raise FormatError(f"{path}: metrale.overlays is malformed ({exc})") from exc
        needs |= {"overlay_slots": ("I32", (rows,)), "overlay_tokens": ("I64", (rows,))}
        _need(path, header, "overlay_rows", "F32", (rows, hidden))
    infos = {name: _need(path, header, name, dtype, shape)
             for name, (dtype, shape) in needs.items()}
    known = {"pool", "expert_pool", "overlay_rows", *infos}
    extra = sorted(set(header.tensors) - known)
    if extra:
        raise ImageInconsistent(f"{path}: tensor {extra[0]!r} is not part of {FORMAT}")
    digests = (read_digests(path, header, _json_meta(path, meta, digest.KEY))
               if digest.KEY in meta else None)
    fd = os.open(path, os.O_RDONLY)
    try:
        tables = {name: _read(fd, info) for name, info in infos.items()}
    finally:
        os.close(fd)
    return ImageTables(
        path=path, file_bytes=path.stat().st_size, header=header, model=model, layout=layout,
        layout_doc=layout_doc, max_loras=max_loras, slots_doc=slots_doc, active=active,
        scales=tables["scales"], ranks=tables["ranks"], a_offsets=tables["a_offsets"],
        b_offsets=tables["b_offsets"], expert_layout=expert_layout, expert_doc=expert_doc,
        expert_a_offsets=tables.get("expert_a_offsets"),
        expert_b_offsets=tables.get("expert_b_offsets"), overlay_doc=overlay_doc,
        overlay_slots=tables.get("overlay_slots"), overlay_tokens=tables.get("overlay_tokens"),
        digests=digests,
    )
