"""Adapter files whose data is a sparse hole: a real safetensors header, no bytes written for
the tensors. The audit reads only headers, so these stand in for adapters of any size."""

from __future__ import annotations

import json
import math
from pathlib import Path

ITEMSIZE = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2}


def write_header_only(path: Path, tensors: list[tuple[str, str, list[int]]]) -> int:
    """Write `(name, dtype, shape)` tensors as a safetensors file of the full size (sparse);
    returns the file size."""
    header: dict = {}
    cursor = 0
    for name, dtype, shape in tensors:
        size = math.prod(shape) * ITEMSIZE[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [cursor, cursor + size]}
        cursor += size
    blob = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
        f.truncate(8 + len(blob) + cursor)
    return 8 + len(blob) + cursor
