"""Writing a file in large pieces at aligned offsets, so that the page cache holds it in large
folios: the kernel sizes a written file's folios by the writes that made them, and a write of
2 MiB or more at a 2 MiB-aligned offset gives 2 MiB folios, which `pack`'s positional reads
(`metrale_cli/pool/reader.py`) copy out of about 1.2x as fast as out of the smaller folios of a
file written a tensor at a time (as safetensors' `save_file` writes it) and still cached since
(docs/pack.md, "How fast a file reads")."""

from __future__ import annotations

from typing import BinaryIO

# A multiple of the 2 MiB folio: each piece lands at a multiple of it from the file's start.
PIECE_BYTES = 8 << 20


class PieceWriter:
    """Bytes for the file `f` (open for writing at its start) collected and written in
    `PIECE_BYTES` pieces; `finish()` writes the last, shorter one."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.buffer = bytearray(PIECE_BYTES)
        self.used = 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        while view:
            n = min(len(view), PIECE_BYTES - self.used)
            self.buffer[self.used:self.used + n] = view[:n]
            self.used += n
            view = view[n:]
            if self.used == PIECE_BYTES:
                self.f.write(self.buffer)
                self.used = 0

    def finish(self) -> None:
        self.f.write(memoryview(self.buffer)[:self.used])
        self.used = 0
