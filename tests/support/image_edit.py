"""Editing pool images in place for tests: the bytes of one tensor element, or one metadata value
(with the header kept at its length so every data offset stays put)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np

from metrale_cli.files.safetensors_header import read_header

_NP = {"F32": "<f4", "I32": "<i4", "I64": "<i8", "U8": "u1"}


def read_element(path: Path, tensor: str, index: tuple[int, ...]) -> Any:
    info = read_header(path).tensors[tensor]
    dtype = np.dtype(_NP[info.dtype])
    flat = int(np.ravel_multi_index(index, info.shape))
    with path.open("rb") as f:
        f.seek(info.begin + flat * dtype.itemsize)
        return np.frombuffer(f.read(dtype.itemsize), dtype=dtype)[0].item()


def write_element(path: Path, tensor: str, index: tuple[int, ...], value: Any) -> None:
    info = read_header(path).tensors[tensor]
    dtype = np.dtype(_NP[info.dtype])
    flat = int(np.ravel_multi_index(index, info.shape))
    with path.open("r+b") as f:
        f.seek(info.begin + flat * dtype.itemsize)
        f.write(np.array([value], dtype=dtype).tobytes())


def edit_metadata(path: Path, key: str, value: str) -> None:
    """Replace one `__metadata__` value; the new header must fit in the old one's length."""
    with path.open("r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        doc = json.loads(f.read(n))
        doc["__metadata__"][key] = value
        blob = json.dumps(doc, separators=(",", ":")).encode()
        assert len(blob) <= n, "the edited header is longer than the original"
        f.seek(8)
        f.write(blob + b" " * (n - len(blob)))


def header_text(path: Path) -> bytes:
    """The header's JSON bytes as written (padding stripped)."""
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return f.read(n).rstrip(b" ")


def replace_header(path: Path, text: bytes) -> None:
    """Write `text` as the header, of any length, with the data buffer unchanged after it (its
    offsets are relative to the buffer) and the buffer still starting 256-byte aligned."""
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        f.seek(8 + n)
        data = f.read()
    text += b" " * (-(8 + len(text)) % 256)
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)
