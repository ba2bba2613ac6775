"""Content digests of a pool image (`metrale.digests`, docs/pool-format.md): one SHA-256 per
tensor, of its bytes in the file, written by `pack` as it writes them. `check.problems` checks
the small tables' (read anyway); `content_problems` reads the pool-sized tensors to check theirs
(`verify`, `unpack`, `show --check`, `PoolImage.open`). An image written before pool/1 carried
digests has none: it still reads, and says so."""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from metrale_cli.errors import FormatError
from metrale_cli.files.safetensors_header import SafetensorsHeader

KEY = "metrale.digests"
ALGORITHM = "sha256"
# The tensors as large as the pool: read in chunks of this many bytes to be checked.
LARGE = ("pool", "expert_pool", "overlay_rows")
CHUNK = 16 << 20
NO_DIGESTS = ("carries no content digests (written before pool/1 had them): its bytes are not "
              "checked against what pack wrote")
_HEX = re.compile(r"[0-9a-f]{64}")


def digests_doc(digests: dict[str, str]) -> str:
    """`metrale.digests`' value. A placeholder of the same length (`placeholder`) is written
    first and replaced once the bytes have been hashed, so the header keeps its length."""
    return json.dumps({"algorithm": ALGORITHM, "tensors": digests}, separators=(",", ":"))


def placeholder(names: Iterable[str]) -> dict[str, str]:
    return {name: "0" * 64 for name in names}


def read_digests(path: Path, header: SafetensorsHeader, doc: Any) -> dict[str, str]:
    """The parsed `metrale.digests` of the image at `path`: one digest for every tensor."""
    if (not isinstance(doc, dict) or doc.get("algorithm") != ALGORITHM
            or not isinstance(doc.get("tensors"), dict)):
        raise FormatError(f"{path}: {KEY} is not {{\"algorithm\": \"{ALGORITHM}\", "
                          "\"tensors\": {...}}")
    digests = doc["tensors"]
    if set(digests) != set(header.tensors):
        missing = sorted(set(header.tensors) ^ set(digests))
        raise FormatError(f"{path}: {KEY} does not list every tensor once ({missing[0]!r})")
    bad = next((n for n, d in digests.items() if not (isinstance(d, str) and _HEX.fullmatch(d))),
               None)
    if bad is not None:
        raise FormatError(f"{path}: {KEY}: {bad!r} is not a SHA-256 hex digest")
    return digests


def mismatch(name: str) -> str:
    return (f"tensor {name!r} does not match its {ALGORITHM} digest: its bytes changed after "
            "pack wrote them")


def table_problems(digests: dict[str, str] | None, tables: dict[str, bytes]) -> list[str]:
    """The small tables (their bytes as read) against their digests."""
    if digests is None:
        return []
    return [mismatch(name) for name, data in tables.items()
            if hashlib.sha256(data).hexdigest() != digests[name]]


def content_problems(path: Path, header: SafetensorsHeader,
                     digests: dict[str, str] | None) -> list[str]:
    """The pool-sized tensors, read whole in chunks, against their digests (none to check in
    an image without digests)."""
    if digests is None:
        return []
    found = []
    fd = os.open(path, os.O_RDONLY)
    try:
        for name in LARGE:
            info = header.tensors.get(name)
            if info is None:
                continue
            h = hashlib.sha256()
            for start in range(info.begin, info.end, CHUNK):
                data = os.pread(fd, min(CHUNK, info.end - start), start)
                if not data:
                    raise FormatError(f"{path}: file ended inside tensor {name!r}")
                h.update(data)
            if h.hexdigest() != digests[name]:
                found.append(mismatch(name))
    finally:
        os.close(fd)
    return found
