"""Header-only safetensors reading: real files parse; files that lie give one clean error."""

from __future__ import annotations

import contextlib
import json
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from metrale_cli.errors import FormatError
from metrale_cli.files.safetensors_header import read_header


def _write(path: Path, header: dict, buffer: bytes) -> Path:
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + buffer)
    return path


def test_reads_a_real_file(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    save_file({"a": np.zeros((3, 5), np.float32), "b": np.ones(4, np.float16)}, str(path),
              metadata={"format": "pt"})
    header = read_header(path)
    assert header.metadata == {"format": "pt"}
    assert header.tensors["a"].shape == (3, 5) and header.tensors["a"].nbytes == 60
    assert header.tensors["b"].dtype == "F16"


@pytest.mark.parametrize(
    "header,buffer,defect",
    [
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, "outside"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4, "needs 8"),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
          "b": {"dtype": "F32", "shape": [1], "data_offsets": [2, 6]}}, b"\0" * 6, "overlaps"),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8, "unused"),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 12, "cover"),
        ({"a": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4, "dtype"),
        ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4, "shape"),
        ({"__metadata__": {"k": 1}}, b"", "__metadata__"),
    ],
)
def test_files_that_lie(tmp_path: Path, header: dict, buffer: bytes, defect: str) -> None:
    path = _write(tmp_path / "x.safetensors", header, buffer)
    with pytest.raises(FormatError, match=defect) as info:
        read_header(path)
    assert str(path) in str(info.value)


def test_truncated_and_garbage(tmp_path: Path) -> None:
    short = tmp_path / "short"
    short.write_bytes(b"\x01\x02")
    with pytest.raises(FormatError, match="shorter than 8 bytes"):
        read_header(short)
    long_len = tmp_path / "long"
    long_len.write_bytes(struct.pack("<Q", 1000) + b"{}")
    with pytest.raises(FormatError, match="past the end"):
        read_header(long_len)
    bad_json = tmp_path / "json"
    bad_json.write_bytes(struct.pack("<Q", 5) + b"{nope")
    with pytest.raises(FormatError, match="JSON"):
        read_header(bad_json)


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_headers_never_escape(tmp_path: Path, data: st.DataObject) -> None:
    """Any byte-level mutation of a valid file either parses or raises FormatError."""
    path = tmp_path / "m.safetensors"
    save_file({"w.lora_A.weight": np.ones((2, 3), np.float32),
               "w.lora_B.weight": np.ones((4, 2), np.float16)}, str(path))
    raw = bytearray(path.read_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(raw) - 1))
        raw[pos] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        raw = raw[: data.draw(st.integers(0, len(raw)))]
    path.write_bytes(bytes(raw))
    with contextlib.suppress(FormatError):
        read_header(path)
