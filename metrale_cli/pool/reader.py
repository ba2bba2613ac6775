"""Reading an adapter's tensors from its safetensors file, a block of rows and columns at a
time, through one read-only memory map of the file.

A block is a view of the file's bytes (strided where it takes some columns of each row), which
the fill copies straight into the slot or converts from there: a tensor-parallel rank's column
slice costs one copy, as a whole tensor does, where positional reads took a call per row (the
ranks of `bench pack --tp 4` went from 0.15-0.28 of memcpy to 0.22-0.42). Unchecked, a copy out
of the map measured no faster than `preadv` into the pool; with the finite check on each chunk
as it lands (pool/fill.py) the whole pack is at least as fast. The map's pages are dropped every
`DROP_BYTES` (MADV_DONTNEED; they stay in the page cache), so the process's memory stays near
the pool's size however large the adapter.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from typing import Protocol

import numpy as np

from metrale_cli.bf16 import RAW_DTYPES
from metrale_cli.errors import FormatError
from metrale_cli.files.safetensors_header import TensorInfo

# Mapped bytes after which the map's pages are dropped: bounds what the map adds to the
# process's resident memory, at one call per that many bytes.
DROP_BYTES = 16 << 20


class RawReader(Protocol):
    """Reads a tensor's raw elements: whole, or a block of its rows and columns."""

    def read(self, info: TensorInfo) -> np.ndarray: ...
    def block(self, info: TensorInfo, rows: tuple[int, int],
              cols: tuple[int, int]) -> np.ndarray: ...


class TensorReader:
    """The tensors of the safetensors file open at `fd` (named `name` in errors), read through
    a memory map of it; `close()` when done. Every block is checked against the file's size
    when the reader opened it (a FormatError); a file cut short after that would fault the
    process (SIGBUS), as with any memory-mapped reader, safetensors' own included."""

    def __init__(self, fd: int, name: str) -> None:
        self.name = name
        self.size = os.fstat(fd).st_size
        self.map = mmap.mmap(fd, 0, prot=mmap.PROT_READ) if self.size else None
        self.mapped = 0  # bytes handed out since the map's pages were last dropped

    def close(self) -> None:
        if self.map is not None:
            # A view still referenced (by an exception's frames) keeps the map until collected.
            with contextlib.suppress(BufferError):
                self.map.close()

    def read(self, info: TensorInfo) -> np.ndarray:
        """The whole tensor as raw elements, flat (a copy)."""
        self._check(info, info.begin + info.nbytes)
        return np.frombuffer(self.map, RAW_DTYPES[info.dtype], info.numel, info.begin).copy()

    def block(self, info: TensorInfo, rows: tuple[int, int],
              cols: tuple[int, int]) -> np.ndarray:
        """Rows `[r0, r1)` and columns `[c0, c1)` of a 2-D tensor as a `[r1 - r0, c1 - c0]`
        read-only view of raw elements over the file's bytes, valid until `close()`."""
        n_rows, n_cols = info.shape
        (r0, r1), (c0, c1) = rows, cols
        if not (0 <= r0 <= r1 <= n_rows and 0 <= c0 <= c1 <= n_cols):
            raise FormatError(f"{self.name}: read past the end of tensor {info.name!r}")
        dtype = RAW_DTYPES[info.dtype]
        shape = (r1 - r0, c1 - c0)
        if 0 in shape:
            return np.empty(shape, dtype)
        item, row = dtype.itemsize, n_cols * dtype.itemsize
        end = info.begin + (r1 - 1) * row + c1 * item
        self._check(info, end)
        return np.ndarray(shape, dtype, self.map, info.begin + r0 * row + c0 * item,
                          (row, item))

    def _check(self, info: TensorInfo, end: int) -> None:
        """`info`'s bytes up to `end` lie in the file; the pages mapped so far are dropped
        once `DROP_BYTES` have been handed out (they stay in the page cache, and a view
        reads them again from there)."""
        if self.map is None or end > self.size or end > info.begin + info.nbytes:
            raise FormatError(f"{self.name}: file ended inside tensor {info.name!r}")
        self.mapped += info.nbytes
        if self.mapped > DROP_BYTES:
            self.map.madvise(mmap.MADV_DONTNEED)
            self.mapped = 0
