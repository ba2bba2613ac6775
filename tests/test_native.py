"""The compiled reader (metrale_cli/_native.c): the pack's host fill reads file bytes straight
into slot spans a chunk at a time and checks each chunk for BF16 NaN and infinity while it is in
cache. Checked here against the file's bytes and the BF16 definition of every value, at every
chunk, block and span boundary; the fills that use it are in test_pool.py (both with it and
with the NumPy fallback, `host_reads`)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest

from metrale_cli import native
from metrale_cli.bf16 import non_finite

# The compiled scan's block (`BLOCK` in _native.c): a non-finite value on either side of a
# block's edge is found.
BLOCK = 4096


@pytest.fixture
def compiled():  # type: ignore[no-untyped-def]
    assert native.compiled is not None, "the install did not build metrale_cli._native"
    return native.compiled


def finite_bits(n: int, seed: int = 0) -> np.ndarray:
    """`n` random BF16 values, none NaN or infinity (every other exponent, sign and mantissa)."""
    bits = np.random.default_rng(seed).integers(0, 1 << 16, n, dtype=np.uint16)
    bad = (bits & 0x7F80) == 0x7F80
    bits[bad] &= np.uint16(0xBFFF)  # the exponent's top bit cleared: finite
    return bits


def test_the_install_built_the_compiled_reader() -> None:
    """`make test` and `make demo` build it (a C compiler is there): without it `pack` falls back
    to os.preadv and NumPy, below `bench pack`'s target, and would say so only in that record."""
    assert native.compiled is not None
    assert Path(native.compiled.__file__).parent == Path(native.__file__).parent


def test_any_non_finite_is_the_bf16_definition_on_every_value(compiled) -> None:  # type: ignore[no-untyped-def]
    """All 65,536 BF16 bit patterns, each among finite values: non-finite exactly where its
    exponent bits are all set, as NumPy's count says (the largest finite values and the
    smallest NaN and infinities among them)."""
    values = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    expected = (values & 0x7F80) == 0x7F80
    around = finite_bits(7)
    for value, bad in zip(values, expected, strict=True):
        bits = around.copy()
        bits[3] = value
        assert compiled.any_non_finite(bits) is bool(bad), hex(value)
    assert not compiled.any_non_finite(np.empty(0, np.uint16))
    assert [non_finite(np.array(v, np.uint16)) for v in (0x7F7F, 0xFF7F, 0x7F80, 0xFF80,
                                                          0x7FC0, 0xFFFF)] == [0, 0, 1, 1, 1, 1]


def test_any_non_finite_finds_one_value_at_every_position(compiled) -> None:  # type: ignore[no-untyped-def]
    """One NaN at each position of three blocks and a tail: found wherever it is, at either
    side of a block's edge too, and in bytes at an odd address (a buffer handed in from
    elsewhere: read as bytes, not as aligned uint16)."""
    clean = finite_bits(3 * BLOCK + 5)
    assert not compiled.any_non_finite(clean)
    odd = np.empty(clean.nbytes + 1, np.uint8)[1:]
    assert odd.ctypes.data % 2 == 1
    for at in range(clean.size):
        bits = clean.copy()
        bits[at] = 0xFFC1  # a negative NaN
        assert compiled.any_non_finite(bits), at
        odd[:] = bits.view(np.uint8)
        assert compiled.any_non_finite(odd), at
    odd[:] = clean.view(np.uint8)
    assert not compiled.any_non_finite(odd)


def test_any_non_finite_refuses_what_is_not_bf16_bits(compiled) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="even byte count"):
        compiled.any_non_finite(b"abc")
    with pytest.raises(ValueError, match="not C-contiguous"):
        compiled.any_non_finite(np.zeros((4, 4), np.uint16)[:, ::2])
    with pytest.raises(TypeError):
        compiled.any_non_finite(3)


def spans_of(sizes: list[int]) -> list[np.ndarray]:
    return [np.full(n, 0xAA, np.uint8) for n in sizes]


@pytest.mark.parametrize("chunk", [2, 6, 64, 4096, 1 << 20])
def test_read_checked_reads_every_byte_into_its_spans(tmp_path: Path, compiled,  # type: ignore[no-untyped-def]
                                                      chunk: int) -> None:
    """Spans of every even size (empty ones, one element, more than a chunk, and more spans in
    one chunk than one read takes), from an offset: each holds the file's bytes, all of them
    read; finite values only, so nothing is seen."""
    data = finite_bits(40_000, seed=1).tobytes()
    path = tmp_path / "f"
    path.write_bytes(data)
    rng = np.random.default_rng(2)
    sizes = [0, 2, 0, *[2] * 150, *(2 * rng.integers(1, 900, 30)).tolist(), 10_000]
    spans = spans_of(sizes)
    offset = 12
    fd = os.open(path, os.O_RDONLY)
    try:
        read, seen = compiled.read_checked(fd, offset, spans, chunk)
    finally:
        os.close(fd)
    assert (read, seen) == (sum(sizes), False)
    assert b"".join(s.tobytes() for s in spans) == data[offset:offset + sum(sizes)]


def test_read_checked_sees_one_value_in_any_chunk_and_span(tmp_path: Path, compiled) -> None:  # type: ignore[no-untyped-def]
    """One infinity at each position of a file read in 6-byte chunks into spans of 2 to 10
    bytes: seen wherever it is, in the first span, the last, and across each edge."""
    clean = finite_bits(300, seed=3)
    path = tmp_path / "f"
    sizes = [2, 10, 4, 6, 8, 2, 568]
    assert sum(sizes) == clean.nbytes
    for at in range(clean.size):
        bits = clean.copy()
        bits[at] = 0x7F80  # +infinity
        path.write_bytes(bits.tobytes())
        fd = os.open(path, os.O_RDONLY)
        try:
            read, seen = compiled.read_checked(fd, 0, spans_of(sizes), 6)
        finally:
            os.close(fd)
        assert (read, seen) == (clean.nbytes, True), at


def test_read_checked_stops_where_the_file_ends(tmp_path: Path, compiled) -> None:  # type: ignore[no-untyped-def]
    """A file shorter than its spans: the bytes it has, read into the spans in turn, and the
    count says where it ended (the reader names the tensor there)."""
    path = tmp_path / "f"
    path.write_bytes(finite_bits(50, seed=4).tobytes())  # 100 bytes
    spans = spans_of([40, 40, 40])
    fd = os.open(path, os.O_RDONLY)
    try:
        assert compiled.read_checked(fd, 10, spans, 16) == (90, False)
        assert compiled.read_checked(fd, 100, spans_of([2]), 16) == (0, False)
    finally:
        os.close(fd)
    assert spans[1].tobytes() == path.read_bytes()[50:90]
    assert set(spans[2][10:].tolist()) == {0xAA}  # past the end: untouched


def test_read_checked_refuses_bad_arguments(tmp_path: Path, compiled) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "f"
    path.write_bytes(bytes(64))
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(ValueError, match="odd byte count"):
            compiled.read_checked(fd, 0, spans_of([4, 3]), 16)
        for offset, chunk in ((-1, 16), (0, 0), (0, 7)):
            with pytest.raises(ValueError, match="chunk an even count"):
                compiled.read_checked(fd, offset, spans_of([4]), chunk)
        with pytest.raises(BufferError):
            compiled.read_checked(fd, 0, [bytes(4)], 16)  # read-only
        with pytest.raises(TypeError):
            compiled.read_checked(fd, 0, 5, 16)
    finally:
        os.close(fd)
    with pytest.raises(OSError) as closed:
        compiled.read_checked(fd, 0, spans_of([4]), 16)
    assert closed.value.errno == errno.EBADF


def test_read_checked_goes_on_after_a_short_read(compiled) -> None:  # type: ignore[no-untyped-def]
    """A file whose every read returns one page at most (/proc/kallsyms, a seq_file): each
    short read is continued where it stopped, inside a span too, until the spans are full
    (a regular file reads short only at its end, so the other tests never take this path)."""
    fd = os.open("/proc/kallsyms", os.O_RDONLY)
    try:
        assert len(os.pread(fd, 1 << 16, 0)) < 1 << 16  # a short read, as the test needs
        expected = b""
        while len(expected) < 100_000:
            more = os.pread(fd, 1 << 16, len(expected))
            assert more, "/proc/kallsyms is shorter than the test needs"
            expected += more
        sizes = [2, 998, 4, 60_000, 38_996]
        spans = spans_of(sizes)
        read, _ = compiled.read_checked(fd, 0, spans, 1 << 20)
    finally:
        os.close(fd)
    assert read == sum(sizes) == 100_000
    assert b"".join(s.tobytes() for s in spans) == expected[:read]
