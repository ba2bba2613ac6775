"""Header-only safetensors reading, validated as the format demands, and the header of an
adapter file metrale writes (`adapter_header`).

Layout of a file: 8 bytes little-endian u64 `N`, then `N` bytes of UTF-8 JSON (may be padded with
spaces), then the byte buffer; `data_offsets` are relative to the buffer. Only the header is read,
so a 10 GB adapter audits as fast as a 1 MB one.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from metrale_cli.errors import FormatError
from metrale_cli.files.jsondoc import load_json
from metrale_cli.files.regular import refuse_not_regular

# Bytes per element of every dtype the format defines (sub-byte ones are not LoRA dtypes).
DTYPE_BYTES: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1,
    "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
    "F8_E4M3": 1, "F8_E4M3FNUZ": 1, "F8_E5M2": 1, "F8_E5M2FNUZ": 1, "F8_E8M0": 1, "C64": 8,
}
MAX_HEADER_BYTES = 100_000_000


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    # Byte range within the file (not the buffer): [begin, end).
    begin: int
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class SafetensorsHeader:
    path: Path
    metadata: dict[str, str]
    tensors: dict[str, TensorInfo]
    # File offset of the byte buffer: 8 + N.
    data_start: int


def adapter_header(tensors: Iterable[tuple[str, str, Sequence[int], int]]) -> bytes:
    """The bytes before the data of a safetensors file holding `tensors` (name, dtype, shape,
    bytes) end to end in that order, as PEFT's adapter files have them: the header's length
    (8 bytes, little-endian), then its JSON (format `pt`), padded with spaces to 8 bytes."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    cursor = 0
    for name, dtype, shape, nbytes in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [cursor, cursor + nbytes]}
        cursor += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return len(blob).to_bytes(8, "little") + blob


def read_header(path: str | Path) -> SafetensorsHeader:
    """Parse and validate a safetensors header; FormatError names the file and the defect."""
    path = Path(path)
    refuse_not_regular(path)  # a FIFO would block the read below
    try:
        with path.open("rb") as f:
            file_size = f.seek(0, 2)
            f.seek(0)
            prefix = f.read(8)
            if len(prefix) < 8:
                raise FormatError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", prefix)
            if n > MAX_HEADER_BYTES:
                raise FormatError(f"{path}: header length {n} exceeds the 100 MB limit")
            if 8 + n > file_size:
                raise FormatError(
                    f"{path}: header length {n} runs past the end of the {file_size}-byte file"
                )
            raw = f.read(n)
    except OSError as exc:
        raise FormatError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    return parse_header(path, raw, file_size)


def parse_header(path: Path, raw: bytes, file_size: int) -> SafetensorsHeader:
    if not raw.startswith(b"{"):
        raise FormatError(f"{path}: header does not start with '{{'")
    doc = load_json(path, raw, "header (UTF-8 JSON)")
    if not isinstance(doc, dict):
        raise FormatError(f"{path}: header is not a JSON object")
    data_start = 8 + len(raw)
    buffer_size = file_size - data_start

    metadata = doc.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise FormatError(f"{path}: __metadata__ must map strings to strings")

    tensors: dict[str, TensorInfo] = {}
    for name, entry in doc.items():
        tensors[name] = _tensor(path, name, entry, buffer_size, data_start)

    # The ranges must tile the buffer exactly: no overlap, no hole, nothing past the end.
    cursor = 0
    for info in sorted(tensors.values(), key=lambda t: (t.begin, t.end)):
        begin = info.begin - data_start
        if begin < cursor:
            raise FormatError(f"{path}: tensor {info.name!r} overlaps another tensor's bytes")
        if begin > cursor:
            raise FormatError(f"{path}: {begin - cursor} unused bytes before tensor {info.name!r}")
        cursor = info.end - data_start
    if cursor != buffer_size:
        raise FormatError(
            f"{path}: tensors cover {cursor} bytes but the data buffer holds {buffer_size}"
        )
    return SafetensorsHeader(path=path, metadata=metadata, tensors=tensors, data_start=data_start)


def _tensor(path: Path, name: str, entry: object, buffer_size: int, data_start: int) -> TensorInfo:
    if not isinstance(entry, dict):
        raise FormatError(f"{path}: tensor {name!r}: entry is not an object")
    dtype = entry.get("dtype")
    shape = entry.get("shape")
    offsets = entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise FormatError(f"{path}: tensor {name!r}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise FormatError(f"{path}: tensor {name!r}: shape must be a list of non-negative ints")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
    ):
        raise FormatError(f"{path}: tensor {name!r}: data_offsets must be two integers")
    begin, end = offsets
    if not 0 <= begin <= end <= buffer_size:
        raise FormatError(
            f"{path}: tensor {name!r}: data_offsets [{begin}, {end}] fall outside the "
            f"{buffer_size}-byte data buffer"
        )
    expected = math.prod(shape) * DTYPE_BYTES[dtype]
    if end - begin != expected:
        raise FormatError(
            f"{path}: tensor {name!r}: {end - begin} bytes for {dtype} {shape}, "
            f"which needs {expected}"
        )
    return TensorInfo(name, dtype, tuple(shape), data_start + begin, data_start + end)
