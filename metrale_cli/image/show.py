"""`metrale show`: what a pool image holds, as the record the view and `--json` print, read
from its header and tables alone and checked first."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from metrale_cli.errors import ImageInconsistent
from metrale_cli.image.check import digest_state, inconsistency, problems
from metrale_cli.image.digest import content_problems
from metrale_cli.image.format import FORMAT, ImageTables, read_tables

# Which part of the file each tensor is, for the bytes-by-part view.
_PARTS = {"pool": "pool", "expert_pool": "expert_pool", "overlay_slots": "overlays",
          "overlay_tokens": "overlays", "overlay_rows": "overlays"}


@dataclass(frozen=True)
class ImageShow:
    """What `metrale show` prints: the image's record, after it has been checked; for an
    inconsistent image (`problems`), the record says so and holds nothing read from the tables
    the problems put in doubt."""

    tables: ImageTables
    problems: list[str] = field(default_factory=list)
    # Whether the pool-sized tensors were read and checked against their digests (`--check`).
    contents_checked: bool = False

    @property
    def valid(self) -> bool:
        return not self.problems

    def refusal(self) -> ImageInconsistent | None:
        """What the library raises for this image (`check`), carrying this record (which
        says why), or None when it is consistent."""
        refusal = inconsistency(self.tables.path, self.problems)
        if refusal is not None:
            refusal.record = self.record()
        return refusal

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
            "model": t.model.record(),
            "layout": {**{k: v for k, v in t.layout.record(t.max_loras).items()
                          if k != "entries"}, "entries": len(t.layout.entries)},
            "experts": ({**t.expert_layout.record(t.max_loras, entries=False),
                         "entries": len(t.expert_layout.entries)}
                        if t.expert_layout is not None else None),
            "active": t.active,
            "digests": digest_state(t, self.contents_checked),
            "slots": slots,
            "free_slots": [s["slot"] for s in slots if not s["name"]],
            "bytes": self.bytes_by_part(),
        }


def show_image(path: str | Path, contents: bool = False) -> ImageShow:
    """Read and check the image at `path` (header and tables only; with `contents` the pool
    bytes too, against their digests): its record, which for an inconsistent image lists the
    problems (`refusal()` is then what `check` raises)."""
    tables = read_tables(path)
    found = problems(tables)
    if contents and not found:
        found = content_problems(tables.path, tables.header, tables.digests)
    return ImageShow(tables, found, contents)
