"""The one check of a pool image's consistency (docs/pool-format.md, docs/show.md), done on its
tables without reading the pool bytes: `metrale show`, `verify`, `unpack` and `PoolImage.open`
all check an image here. `problems(tables)` lists every inconsistency, most basic first;
`check(tables)` raises `ImageInconsistent` (exit 1, a `FormatError`) naming the first.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from metrale_cli.adapters.overlays import TABLES
from metrale_cli.errors import ImageInconsistent
from metrale_cli.image.digest import content_problems, table_problems
from metrale_cli.image.format import DATA_ALIGN, ImageTables
from metrale_cli.pool.slots import U64_MASK


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
    """Every inconsistency of the image, most basic first (empty: consistent): the small
    tables against their digests (bytes changed after pack explain whatever else is wrong)."""
    found = table_problems(t.digests, {name: array.tobytes()
                                       for name, array in t.table_arrays().items()})
    found += layout_problems(t)
    records = slot_record_problems(t)
    if records:
        return found + records
    for k in range(t.max_loras):
        found += slot_problems(t, k)
    return found + overlay_problems(t)


def check(t: ImageTables, contents: bool = False) -> None:
    """ImageInconsistent naming the first problem (and how many more there are); with
    `contents`, the pool-sized tensors are read whole and checked against their digests too."""
    found = inconsistency(t.path, problems(t) or (
        content_problems(t.path, t.header, t.digests) if contents else []))
    if found is not None:
        raise found


def digest_state(t: ImageTables, checked: bool) -> str:
    """What a record says of the image's digests: `checked` (its contents matched them),
    `tables` (only the small tables were checked), `none` (an image without digests)."""
    if t.digests is None:
        return "none"
    return "checked" if checked else "tables"


def inconsistency(path: Path | str, found: list[str]) -> ImageInconsistent | None:
    """The ImageInconsistent an image with the problems `found` is refused with: the first
    problem (and how many more there are); None when there are none."""
    if not found:
        return None
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    return ImageInconsistent(f"{path}: {found[0]}{more}")
