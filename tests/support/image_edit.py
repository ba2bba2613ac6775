"""Editing pool images in place for tests: the bytes of one tensor element, or one metadata value
(with the header kept at its length so every data offset stays put)."""

from __future__ import annotations

import hashlib
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


def write_element(path: Path, tensor: str, index: tuple[int, ...], value: Any,
                  reseal: bool = True) -> None:
    """Write one element; with `reseal` (a crafted image, not a damaged one) the tensor's
    digest is recomputed, so that the checks behind the digests are what meets the edit."""
    info = read_header(path).tensors[tensor]
    dtype = np.dtype(_NP[info.dtype])
    flat = int(np.ravel_multi_index(index, info.shape))
    with path.open("r+b") as f:
        f.seek(info.begin + flat * dtype.itemsize)
        f.write(np.array([value], dtype=dtype).tobytes())
    if reseal:
        reseal_digest(path, tensor)


def reseal_digest(path: Path, tensor: str) -> None:
    """Give `tensor` the digest of its bytes as they are now (in an image that has digests)."""
    meta = read_header(path).metadata
    if "metrale.digests" not in meta:
        return
    info = read_header(path).tensors[tensor]
    with path.open("rb") as f:
        f.seek(info.begin)
        data = f.read(info.nbytes)
    doc = json.loads(meta["metrale.digests"])
    doc["tensors"][tensor] = hashlib.sha256(data).hexdigest()
    edit_metadata(path, "metrale.digests", json.dumps(doc, separators=(",", ":")))


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


def strip_digests(path: Path) -> None:
    """Make `path` an image as pack wrote it before pool/1 carried `metrale.digests`: the
    header without the key, re-padded (byte for byte the old writer's output)."""
    doc = json.loads(header_text(path))
    del doc["__metadata__"]["metrale.digests"]
    replace_header(path, json.dumps(doc, separators=(",", ":")).encode())
