"""A pool image's tables, and the one check of their consistency (docs/pool-format.md), done
without reading the pool bytes: `metrale show`, `verify`, `unpack` and `PoolImage.open` all
read and check an image here.

`read_tables(path)` reads the safetensors header, the `metrale.*` metadata and the small tables
(scales, ranks, offsets, overlay slots and tokens) with positional reads; the `pool`,
`expert_pool` and `overlay_rows` tensors are never touched, so a 40 GB image shows as fast as a
40 MB one. `problems(tables)` lists every inconsistency, most basic first; `show_image` returns
the `ImageShow` record or raises `ImageInconsistent` (exit 1, a `FormatError`) naming the
first. A file that is not a pool image, or is truncated, is a plain `FormatError` (exit 2).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from metrale_cli.adapters.overlays import TABLES
from metrale_cli.errors import FormatError, ImageInconsistent, MetraleError
from metrale_cli.files.safetensors_header import SafetensorsHeader, TensorInfo, read_header
from metrale_cli.layout.expert_layout import ExpertLayout
from metrale_cli.layout.sharding import RankExpertLayout, RankLayout, shard_of
from metrale_cli.layout.slot_layout import SlotLayout
from metrale_cli.model.config import MAX_LAYERS, ModelConfig
from metrale_cli.model.modules import LoraModule
from metrale_cli.pool.slots import U64_MASK

FORMAT = "pool/1"
# The data buffer starts at a multiple of this, so `pool` can be mapped and DMA'd aligned.
DATA_ALIGN = 256
_NP_DTYPES = {"U8": "u1", "F32": "<f4", "I32": "<i4", "I64": "<i8"}
# Which part of the file each tensor is, for the bytes-by-part view.
_PARTS = {"pool": "pool", "expert_pool": "expert_pool", "overlay_slots": "overlays",
          "overlay_tokens": "overlays", "overlay_rows": "overlays"}


@dataclass(frozen=True)
class Region:
    """One pool region as an image's tables place it: which pool, whose entry, A or B."""

    pool: str  # "pool" or "expert_pool"
    entry: int
    slot: int
    part: str  # "A" or "B"
    what: str  # e.g. "layer 1 k_proj", "layer 1 gate_proj expert 3"


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
    try:
        return json.loads(meta[key])
    except KeyError:
        raise FormatError(f"{path}: no {key} in the metadata: not a complete pool image") from None
    except json.JSONDecodeError as exc:
        raise FormatError(f"{path}: {key} is not JSON ({exc})") from exc


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
    return np.frombuffer(data, dtype=_NP_DTYPES[info.dtype]).reshape(info.shape)


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
    try:
        model = ModelConfig.from_summary(_json_meta(path, meta, "metrale.model"))
        if not 0 < model.num_hidden_layers <= MAX_LAYERS:
            # A config's own bound on layers. The layout is rebuilt layer by layer: a header
            # saying 10**8 would hang here.
            raise ValueError(f"num_hidden_layers {model.num_hidden_layers!r} is not in "
                             f"[1, {MAX_LAYERS}]")
        layout = SlotLayout.build(model, [LoraModule(m) for m in layout_doc["modules"]],
                                  int(layout_doc["max_rank"]), int(layout_doc["align"]))
        shard = shard_of(meta)  # a tensor-parallel rank's image: its own layout
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
    if max_loras <= 0:
        raise ImageInconsistent(f"{path}: max_loras is {max_loras}")
    if not isinstance(slots_doc, list):
        raise FormatError(f"{path}: metrale.slots is not a list")
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
    )


# -- consistency --------------------------------------------------------------------------------


def _recorded_layout_problems(what: str, doc: dict[str, Any], fingerprint: str,
                              size_key: str, size: int, entries: list[dict[str, Any]]
                              ) -> list[str]:
    """One layout's recorded fingerprint, slot size and entries against the rebuilt layout (the
    slot layout and the expert layout alike)."""
    found = []
    if doc.get("fingerprint") != fingerprint:
        found.append(f"the {what} does not reproduce its fingerprint (recorded "
                     f"{doc.get('fingerprint')}, recomputed {fingerprint})")
    if doc.get(size_key) != size:
        found.append(f"{what} {size_key} is {doc.get(size_key)}; its entries take {size}")
    if doc.get("entries") != entries:
        found.append(_first_entry_difference(what, doc.get("entries"), entries))
    return found


def layout_problems(t: ImageTables) -> list[str]:
    """The layouts reproduce their recorded fingerprints, sizes and entries; the pools start
    aligned in the file."""
    layout = t.layout
    found = _recorded_layout_problems("layout", t.layout_doc, layout.fingerprint, "slot_bytes",
                                      layout.slot_bytes, [e.record() for e in layout.entries])
    if t.layout_doc.get("pool_bytes") != layout.pool_bytes(t.max_loras):
        found.append(f"layout pool_bytes is {t.layout_doc.get('pool_bytes')}; {t.max_loras} "
                     f"slots of {layout.slot_bytes} B are {layout.pool_bytes(t.max_loras)}")
    ex = t.expert_layout
    if ex is not None and t.expert_doc is not None:
        found += _recorded_layout_problems("expert layout", t.expert_doc, ex.fingerprint,
                                           "expert_slot_bytes", ex.slot_bytes,
                                           [e.record() for e in ex.entries])
    for name in ("pool", "expert_pool"):
        info = t.header.tensors.get(name)
        if info is not None and info.nbytes and info.begin % DATA_ALIGN:
            found.append(f"tensor {name!r} starts at file offset {info.begin}, not a multiple "
                         f"of {DATA_ALIGN}")
    if not 0 <= t.active < t.max_loras:
        found.append(f"metrale.active is {t.active}, outside [0, {t.max_loras})")
    return found


def _first_entry_difference(what: str, recorded: Any, computed: list[dict[str, Any]]) -> str:
    if not isinstance(recorded, list) or len(recorded) != len(computed):
        n = len(recorded) if isinstance(recorded, list) else "no"
        return f"the {what} records {n} entries; its modules and model give {len(computed)}"
    i = next(i for i, (a, b) in enumerate(zip(recorded, computed, strict=True)) if a != b)
    return f"{what} entry {i} is recorded as {recorded[i]}; the model gives {computed[i]}"


def _float32(value: float) -> np.float32:
    """`value` rounded to float32 as the scale table holds it; one past float32's range is
    infinity, quietly (NumPy would warn on stderr besides the error line that reports it)."""
    with np.errstate(over="ignore"):
        return np.float32(value)


def slot_problems(t: ImageTables, slot: int) -> list[str]:
    """Slot `slot`'s tables against its metadata and the layouts: rank and scale, and every
    offset -1 on both sides or inside the slot, aligned, not overlapping another region of the
    slot, and where the layout puts it."""
    found = []
    s = t.slots_doc[slot]
    name = s.get("name", "")
    where = f"slot {slot}" + (f" ({name})" if name else "")
    rank, scale = int(t.ranks[slot]), float(t.scales[slot])
    if rank != s.get("rank"):
        found.append(f"{where}: ranks[{slot}] is {rank}; the slot's metadata says "
                     f"{s.get('rank')}")
    want_scale = s.get("scaling")
    if not isinstance(want_scale, (int, float)) or _float32(want_scale) != np.float32(scale):
        found.append(f"{where}: scales[{slot}] is {scale:.9g}; the slot's metadata says "
                     f"{want_scale}")
    if name:
        if not 1 <= rank <= t.layout.max_rank:
            found.append(f"{where}: rank {rank} outside [1, {t.layout.max_rank}]")
        if not (math.isfinite(scale) and scale > 0):
            found.append(f"{where}: scale {scale} is not a positive number")
    elif rank or scale:
        found.append(f"{where}: an empty slot with rank {rank} and scale {scale:g}")
    found += _region_problems(t, where, slot, "pool", t.layout.entries, t.layout.slot_bytes,
                              t.layout.align, t.a_offsets, t.b_offsets, bool(name))
    ex = t.expert_layout
    if ex is not None:
        assert t.expert_a_offsets is not None and t.expert_b_offsets is not None
        found += _region_problems(t, where, slot, "expert_pool", ex.entries,
                                  ex.slot_bytes, ex.align, t.expert_a_offsets,
                                  t.expert_b_offsets, bool(name))
    if not name and t.overlay_runs(slot):
        found.append(f"{where}: an empty slot with token overlays")
    return found


def _region_problems(t: ImageTables, where: str, slot: int, pool: str, entries: Any,
                     size: int, align: int, a_offsets: np.ndarray, b_offsets: np.ndarray,
                     filled: bool) -> list[str]:
    found: list[str] = []
    base = slot * size
    prefix = "" if pool == "pool" else "expert_"
    spans: list[tuple[int, int, str]] = []
    for i, e in enumerate(entries):
        a, b = int(a_offsets[i, slot]), int(b_offsets[i, slot])
        what = t.entry_name(pool, i)
        if (a < 0) != (b < 0) or min(a, b) < -1:
            found.append(f"{where}: {what}: A offset {a} and B offset {b}: only one of its A "
                         "and B (both -1 or both offsets)")
            continue
        if a < 0:
            continue
        if not filled:
            found.append(f"{where}: an empty slot adapts {what}")
            continue
        for part, off, nbytes, layout_off in (("A", a, e.a_bytes, e.a_offset),
                                              ("B", b, e.b_bytes, e.b_offset)):
            cell = f"{prefix}{part.lower()}_offsets[{i}, {slot}]"
            if not base <= off <= base + size - nbytes:
                found.append(f"{where}: {what}: {cell} = {off} puts its {part} "
                             f"({nbytes} B) outside the slot [{base}, {base + size})")
            elif off % align:
                found.append(f"{where}: {what}: {cell} = {off} is not {align}-byte aligned")
            else:
                spans.append((off, off + nbytes, f"{what} {part}"))
                if off != base + layout_off:
                    found.append(f"{where}: {what}: {cell} = {off}; the layout puts its {part} "
                                 f"at {base + layout_off}")
    spans.sort()
    for (_, end, first), (start, _, second) in zip(spans, spans[1:], strict=False):
        if start < end:
            found.insert(0, f"{where}: {first} and {second} overlap in {pool}")
    return found


def overlay_problems(t: ImageTables) -> list[str]:
    """Runs tile the overlay rows in order, name a filled slot and a known table, replace rows
    (tied to the head or not), and agree with `overlay_slots`; token ids are inside the
    vocabulary."""
    if t.overlay_doc is None:
        return []
    assert t.overlay_slots is not None and t.overlay_tokens is not None
    found = []
    hidden = int(t.overlay_doc["hidden_size"])
    if hidden != t.model.hidden_size:
        found.append(f"overlays are {hidden} wide; the model's hidden_size is "
                     f"{t.model.hidden_size}")
    cursor = 0
    for j, run in enumerate(t.overlay_doc["runs"]):
        slot, start, count = run["slot"], run["start"], run["count"]
        if start != cursor:
            found.append(f"overlay run {j} starts at row {start}; the previous one ends at "
                         f"{cursor}")
        cursor = start + count
        if slot >= t.max_loras or not t.slots_doc[slot].get("name"):
            found.append(f"overlay run {j} belongs to slot {slot}, which holds no adapter")
        if run.get("table") not in TABLES:
            found.append(f"overlay run {j}: table {run.get('table')!r} is not one of "
                         f"{', '.join(TABLES)}")
        if run.get("mode") != "replace":
            # pool/1's rows replace table rows; a reader serving anything else would be wrong.
            found.append(f"overlay run {j}: mode {run.get('mode')!r} is not 'replace'")
        if not isinstance(run.get("tied_lm_head"), bool):
            found.append(f"overlay run {j}: tied_lm_head must be true or false")
        if (np.asarray(t.overlay_slots[start:start + count]) != slot).any():
            found.append(f"overlay run {j}: overlay_slots[{start}:{cursor}] is not all {slot}")
        tokens = np.asarray(t.overlay_tokens[start:start + count])
        vocab = t.model.vocab_size
        if (tokens < 0).any() or (vocab and (tokens >= vocab).any()):
            found.append(f"overlay run {j}: token ids outside [0, {vocab})")
    return found


def slot_record_problems(t: ImageTables) -> list[str]:
    """`metrale.slots` is one record per slot, in order, of the types pool/1 gives them (what
    the views and the slot-matching read, so that none of them meets a list for a name)."""
    if len(t.slots_doc) != t.max_loras:
        return [f"metrale.slots lists {len(t.slots_doc)} slots; the layout has max_loras "
                f"{t.max_loras}"]
    for k, s in enumerate(t.slots_doc):
        if not isinstance(s, dict) or s.get("slot") != k:
            return [f"metrale.slots entry {k} is not slot {k}'s record"]
        generation, alpha = s.get("generation"), s.get("alpha")
        if not (isinstance(s.get("name"), str) and isinstance(s.get("source"), str)):
            return [f"metrale.slots entry {k}: name and source must be strings"]
        if (isinstance(generation, bool) or not isinstance(generation, int)
                or not 0 <= generation <= U64_MASK):
            return [f"metrale.slots entry {k}: generation {generation!r} is not an integer "
                    "that fits 64 bits"]
        if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(
                alpha):
            return [f"metrale.slots entry {k}: alpha {alpha!r} is not a finite number"]
        if not isinstance(s.get("pinned"), bool):
            return [f"metrale.slots entry {k}: pinned must be true or false"]
    return []


def problems(t: ImageTables) -> list[str]:
    """Every inconsistency of the image, most basic first (empty: consistent)."""
    found = layout_problems(t)
    records = slot_record_problems(t)
    if records:
        return found + records
    for k in range(t.max_loras):
        found += slot_problems(t, k)
    return found + overlay_problems(t)


def check(t: ImageTables) -> None:
    """ImageInconsistent naming the first problem (and how many more there are)."""
    refusal = ImageShow(t, problems(t)).refusal()
    if refusal is not None:
        raise refusal


# -- the record ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ImageShow:
    """What `metrale show` prints: the image's record, after it has been checked; for an
    inconsistent image (`problems`), the record says so and holds nothing read from the tables
    the problems put in doubt."""

    tables: ImageTables
    problems: list[str] = field(default_factory=list)

    @property
    def valid(self) -> bool:
        return not self.problems

    def refusal(self) -> ImageInconsistent | None:
        """What the library raises for this image (`check`), or None when it is consistent."""
        if self.valid:
            return None
        more = f" (and {len(self.problems) - 1} more)" if len(self.problems) > 1 else ""
        return ImageInconsistent(f"{self.tables.path}: {self.problems[0]}{more}")

    def slot_record(self, k: int) -> dict[str, Any]:
        t, s = self.tables, self.tables.slots_doc[k]
        ex = t.expert_a_offsets
        return {
            "slot": k, "name": s.get("name", ""), "generation": s.get("generation", 0),
            "rank": int(t.ranks[k]), "alpha": s.get("alpha"), "scale": float(t.scales[k]),
            "pinned": bool(s.get("pinned")), "source": s.get("source", ""),
            "entries": int((t.a_offsets[:, k] >= 0).sum()),
            "expert_entries": int((ex[:, k] >= 0).sum()) if ex is not None else 0,
            "overlays": [{"table": r["table"], "tokens": int(r["count"]),
                          "tied_lm_head": bool(r["tied_lm_head"])} for r in t.overlay_runs(k)],
        }

    def bytes_by_part(self) -> dict[str, int]:
        t = self.tables
        parts = {"header": t.header.data_start, "pool": 0, "expert_pool": 0, "tables": 0,
                 "overlays": 0}
        for name, info in t.header.tensors.items():
            parts[_PARTS.get(name, "tables")] += info.nbytes
        parts["total"] = t.file_bytes
        return parts

    def record(self) -> dict[str, Any]:
        t = self.tables
        if not self.valid:
            return {"path": str(t.path), "format": FORMAT, "valid": False,
                    "problems": self.problems}
        slots = [self.slot_record(k) for k in range(t.max_loras)]
        return {
            "path": str(t.path),
            "format": FORMAT,
            "valid": True,
            "model": t.model.summary(),
            "layout": {**{k: v for k, v in t.layout.record(t.max_loras).items()
                          if k != "entries"}, "entries": len(t.layout.entries)},
            "experts": ({**t.expert_layout.record(t.max_loras, entries=False),
                         "entries": len(t.expert_layout.entries)}
                        if t.expert_layout is not None else None),
            "active": t.active,
            "slots": slots,
            "free_slots": [s["slot"] for s in slots if not s["name"]],
            "bytes": self.bytes_by_part(),
        }


def show_image(path: str | Path) -> ImageShow:
    """Read and check the image at `path` (header and tables only): its record, which for an
    inconsistent image lists the problems (`refusal()` is then what `check` raises)."""
    tables = read_tables(path)
    return ImageShow(tables, problems(tables))
