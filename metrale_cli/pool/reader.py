"""Reading an adapter's tensors from its safetensors file: a block of rows and columns at a
time, with positional reads, straight into its destination or into a per-thread scratch buffer,
so memory beside the pool stays one block however large the adapter."""

from __future__ import annotations

import os
import threading
from typing import Protocol

import numpy as np

from metrale_cli.bf16 import RAW_DTYPES
from metrale_cli.errors import FormatError
from metrale_cli.files.safetensors_header import TensorInfo


class RawReader(Protocol):
    """Reads a tensor's raw elements: whole, or a block of its rows and columns."""

    def read(self, info: TensorInfo) -> np.ndarray: ...
    def read_block(self, info: TensorInfo, rows: tuple[int, int], cols: tuple[int, int],
                   out: np.ndarray | None = None) -> np.ndarray: ...


class TensorReader:
    """Reads blocks of a safetensors file's tensors with positional reads: straight into the
    destination when no conversion is needed, else into a per-thread scratch buffer.
    (Per-tensor mmap measured half as fast; reader threads did not help on two cores.)"""

    def __init__(self, fd: int, name: str) -> None:
        self.fd = fd
        self.name = name
        self.local = threading.local()

    def into(self, info: TensorInfo, dest: np.ndarray, at: int = 0) -> None:
        """Fill `dest` with the tensor's bytes from byte `at` of the tensor on."""
        view = memoryview(dest).cast("B")
        if at + view.nbytes > info.nbytes:
            raise FormatError(f"{self.name}: read past the end of tensor {info.name!r}")
        done = 0
        while done < view.nbytes:
            n = os.preadv(self.fd, [view[done:]], info.begin + at + done)
            if n <= 0:
                raise FormatError(f"{self.name}: file ended inside tensor {info.name!r}")
            done += n

    def read(self, info: TensorInfo) -> np.ndarray:
        """The whole tensor as raw elements, flat; valid until the next read on this thread."""
        raw = self._scratch(info.nbytes)
        self.into(info, raw)
        return raw.view(RAW_DTYPES[info.dtype])

    def read_block(self, info: TensorInfo, rows: tuple[int, int], cols: tuple[int, int],
                   out: np.ndarray | None = None) -> np.ndarray:
        """Rows `[r0, r1)` and columns `[c0, c1)` of a 2-D tensor as `[r1 - r0, c1 - c0]` raw
        elements, reading only those bytes (one read when the columns are whole rows, else one
        per row): into `out` (contiguous, the block's size) when given, else into the scratch
        buffer, valid until the next read on this thread."""
        n_rows, n_cols = info.shape
        (r0, r1), (c0, c1) = rows, cols
        if not (0 <= r0 <= r1 <= n_rows and 0 <= c0 <= c1 <= n_cols):
            raise FormatError(f"{self.name}: read past the end of tensor {info.name!r}")
        item = info.nbytes // max(1, info.numel)
        width = (c1 - c0) * item
        block = (self._scratch((r1 - r0) * width) if out is None
                 else out.reshape(-1).view(np.uint8))
        if (c0, c1) == (0, n_cols):
            self.into(info, block, r0 * width)
        else:
            for i in range(r1 - r0):
                self.into(info, block[i * width:(i + 1) * width],
                          ((r0 + i) * n_cols + c0) * item)
        return block.view(RAW_DTYPES[info.dtype]).reshape(r1 - r0, c1 - c0)

    def _scratch(self, nbytes: int) -> np.ndarray:
        scratch = getattr(self.local, "scratch", None)
        if scratch is None or scratch.size < nbytes:
            scratch = self.local.scratch = np.empty(nbytes, dtype=np.uint8)
        return scratch[:nbytes]
