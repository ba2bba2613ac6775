"""Reading an adapter's tensors from its safetensors file, a block of rows and columns at a
time, with checked positional reads.

A block is one `preadv` of the bytes its rows span into a buffer of its own, handed out as a
(strided, where it takes some columns of each row) view of that buffer, which the fill copies
straight into the slot or converts from there: a tensor-parallel rank's column slice costs one
read call (with the other columns of the rows it spans), where a call per row was slower.
Bytes that go into the pool as the file holds them are read straight into it (`into`): tensors
end to end in the file with one call, scattered to their spans; or, where the compiled module
is built, by one call of it that reads them a chunk at a time and checks each for NaN and
infinity as it lands (`into_checked`). The reads are checked: a file
cut short while it is packed (by another process) is a short read, a FormatError naming it,
where the memory map this reader used before faulted the process (SIGBUS) with no line.
Measured against the map, `bench pack --tp 4 --adapters 2 --repeats 2` on the 2-core VM (load
4), two runs each: pack 49-51% of numpy.copyto (map 37-47%), the ranks 29-53% (map 17-35%),
peak RSS 169 MiB (map 178 MiB).
"""

from __future__ import annotations

import os
from typing import Protocol

import numpy as np

from metrale_cli import native
from metrale_cli.bf16 import RAW_DTYPES, Scratch
from metrale_cli.errors import FormatError
from metrale_cli.files.safetensors_header import TensorInfo

# Buffers one `preadv` takes at most (Linux's UIO_MAXIOV).
IOV_MAX = 1024
# Bytes `into_checked` reads, then checks, at a time: within this core's L2 (1 MiB here), so
# the check reads them from there. `bench pack`'s adapters, sizes alternating in one process,
# five rounds: 125 KiB 0.84-1.09 of numpy.copyto, 256 KiB 0.81-0.95, 512 KiB 0.85-0.93, alike
# within the noise (NumPy's check after each 4 MiB read: 0.72-0.88 in the same rounds).
CHECK_BYTES = 256 << 10


class RawReader(Protocol):
    """Reads a tensor's raw elements: whole, or a block of its rows and columns."""

    def read(self, info: TensorInfo) -> np.ndarray: ...
    def block(self, info: TensorInfo, rows: tuple[int, int], cols: tuple[int, int],
              scratch: Scratch | None = None) -> np.ndarray: ...
    def rows_into(self, info: TensorInfo, rows: tuple[int, int], out: np.ndarray) -> None: ...
    def into(self, start: int, parts: list[tuple[TensorInfo, np.ndarray]]) -> None: ...
    def into_checked(self, start: int, parts: list[tuple[TensorInfo, np.ndarray]]) -> bool: ...


class TensorReader:
    """The tensors of the safetensors file open at `fd` (named `name` in errors), read with
    positional reads of a duplicate of `fd` (the caller may close its own); `close()` when
    done. Every read is checked against the file's size when the reader opened it and against
    what the read returned: a file cut short meanwhile is a FormatError."""

    def __init__(self, fd: int, name: str) -> None:
        self.name = name
        self.fd = os.dup(fd)
        self.size = os.fstat(self.fd).st_size

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def read(self, info: TensorInfo) -> np.ndarray:
        """The whole tensor as raw elements, flat."""
        return self._span(info, info.begin, info.begin + info.nbytes).view(
            RAW_DTYPES[info.dtype])

    def block(self, info: TensorInfo, rows: tuple[int, int], cols: tuple[int, int],
              scratch: Scratch | None = None) -> np.ndarray:
        """Rows `[r0, r1)` and columns `[c0, c1)` of a 2-D tensor as a `[r1 - r0, c1 - c0]`
        view of raw elements over a buffer read for it: `scratch`'s read buffer where given
        (valid until the next block read with it), else a fresh one."""
        n_rows, n_cols = info.shape
        (r0, r1), (c0, c1) = rows, cols
        if not (0 <= r0 <= r1 <= n_rows and 0 <= c0 <= c1 <= n_cols):
            raise FormatError(f"{self.name}: read past the end of tensor {info.name!r}")
        dtype = RAW_DTYPES[info.dtype]
        shape = (r1 - r0, c1 - c0)
        if 0 in shape:
            return np.empty(shape, dtype)
        item, row = dtype.itemsize, n_cols * dtype.itemsize
        start = info.begin + r0 * row + c0 * item
        end = info.begin + (r1 - 1) * row + c1 * item
        if scratch is None:
            data = self._span(info, start, end)
        else:
            data = scratch.take("read", (end - start,), np.uint8)
            self.into(start, [(info, data)])
        return np.ndarray(shape, dtype, data, 0, (row, item))

    def rows_into(self, info: TensorInfo, rows: tuple[int, int], out: np.ndarray) -> None:
        """Whole rows `[r0, r1)` of a 2-D tensor, their raw bytes as the file holds them, read
        straight into `out` (contiguous, exactly their size): no buffer between the file and
        `out`, which the fill makes a span of the pool."""
        n_rows, n_cols = info.shape
        r0, r1 = rows
        row = n_cols * RAW_DTYPES[info.dtype].itemsize
        if not 0 <= r0 <= r1 <= n_rows or out.nbytes != (r1 - r0) * row:
            raise FormatError(f"{self.name}: read past the end of tensor {info.name!r}")
        self.into(info.begin + r0 * row, [(info, out.reshape(-1).view(np.uint8))])

    def into(self, start: int, parts: list[tuple[TensorInfo, np.ndarray]]) -> None:
        """The file's bytes from `start` on, read straight into each part's `out` in turn
        (contiguous u8, bytes of its tensor `info`) with one positional read for them all:
        tensors that lie end to end in the file cost one call, whatever their number."""
        self._within(start, parts)
        todo = [(info, out) for info, out in parts if out.nbytes]
        while todo:  # a positional read may return less than asked
            n = os.preadv(self.fd, [out for _, out in todo[:IOV_MAX]], start)
            if n == 0:
                self._cut(todo[0][0])
            start += n
            while todo and n >= todo[0][1].nbytes:
                n -= todo.pop(0)[1].nbytes
            if n:
                todo[0] = (todo[0][0], todo[0][1][n:])

    def into_checked(self, start: int, parts: list[tuple[TensorInfo, np.ndarray]]) -> bool:
        """`into` BF16 parts, each `CHECK_BYTES` of them checked for NaN and infinity as it
        lands, while it is in this core's cache, in one compiled call that does not hold the
        GIL: whether any part holds such a value. Only where `metrale_cli/_native.c` is built
        (`native.compiled`)."""
        compiled = native.compiled
        assert compiled is not None
        self._within(start, parts)
        n, seen = compiled.read_checked(self.fd, start, [out for _, out in parts], CHECK_BYTES)
        for info, out in parts:  # the part the file ended in
            if n < out.nbytes:
                self._cut(info)
            n -= out.nbytes
        return bool(seen)

    def _within(self, start: int, parts: list[tuple[TensorInfo, np.ndarray]]) -> None:
        """A FormatError unless each part's bytes, end to end from `start`, lie within its
        tensor and the file."""
        end = start
        for info, out in parts:
            if end < info.begin:
                raise FormatError(f"{self.name}: read outside tensor {info.name!r}")
            end += out.nbytes
            if end > self.size or end > info.begin + info.nbytes:
                raise FormatError(f"{self.name}: file ended inside tensor {info.name!r}")

    def _cut(self, info: TensorInfo) -> None:
        raise FormatError(f"{self.name}: file ended inside tensor {info.name!r} "
                          "(cut short while it was read)")

    def _span(self, info: TensorInfo, start: int, end: int) -> np.ndarray:
        """The file's bytes `[start, end)` of tensor `info` in a buffer of their own, read whole
        or a FormatError."""
        data = np.empty(max(0, end - start), np.uint8)
        self.into(start, [(info, data)])
        return data
