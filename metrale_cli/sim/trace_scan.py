"""Trace blocks scanned at compiled speed: the lines of one block of a plain CSV or JSON-lines
trace (`workload._plain_blocks`: UTF-8, `\\n` or `\\r\\n` line ends, no line past the bound)
matched against the common row shape in one numba pass over the bytes, their whole-number
cells converted there, their fractional numbers copied out for one C conversion
(`numpy.fromstring`, correctly rounded as Python's `float`), their adapter names interned in
a hash table over the bytes.

The scan takes only what it fully understands and says so per line (JSON lines) or per block
(CSV); everything else goes to the readers in `workload.py`, which name the line and say what
is wrong exactly as the line reader does. Its grammar is therefore narrow on purpose:

- a number: JSON's, no sign (`0|[1-9][0-9]*`, then `.[0-9]+`, then `[eE][-+]?[0-9]+`); a
  token count or a rank only as a whole number of at most 18 digits below 2**53;
- an adapter name: no blank (ASCII or a Unicode space) at either end, so it needs no strip;
  in JSON a string with no escape and no control character, or `null`;
- JSON lines: one flat object, the keys of the block's first request in their order, blanks
  (space, tab) anywhere between tokens; a key metrale does not read may also hold a signed
  number of at most 100 integer digits (JSON reads 4,301 as an error), a string, `true`,
  `false` or `null`;
- CSV: exactly the header's number of cells (the block has no quote character), a number cell
  nothing but the number, an empty cell only where the column is optional.

numba is imported here only, and this module only when a trace is read, so `metrale --help`,
`inspect` and `layout` never load it; its functions are cached on disk (`cache=True`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

# Cell kinds, by column name; any other column is OTHER (read for its shape, then dropped).
TIMESTAMP, ADAPTER, INPUT, OUTPUT, RANK, DURATION, OTHER = range(7)
KINDS = {"timestamp": TIMESTAMP, "adapter": ADAPTER, "input_tokens": INPUT,
         "output_tokens": OUTPUT, "rank": RANK, "duration": DURATION}
_MAX_TOKENS = 2**53  # as workload.MAX_TOKENS (not imported: that module imports this one)
_NEWLINE, _CR, _SPACE, _TAB, _QUOTE, _BACKSLASH = 10, 13, 32, 9, 34, 92
_COMMA, _COLON, _OPEN, _CLOSE, _DOT, _MINUS, _PLUS = 44, 58, 123, 125, 46, 45, 43


@njit(cache=True)
def _skip_blanks(buf: Any, i: int, end: int) -> int:
    while i < end and (buf[i] == _SPACE or buf[i] == _TAB):
        i += 1
    return i


@njit(cache=True)
def _digits(buf: Any, i: int, end: int) -> int:
    while i < end and 48 <= buf[i] <= 57:
        i += 1
    return i


@njit(cache=True)
def _number(buf: Any, i: int, end: int, signed: bool) -> tuple[int, int, bool]:
    """(the end of the JSON number at i, or -1; its integer digits; whether it is whole, with no
    fraction or exponent)."""
    if signed and i < end and buf[i] == _MINUS:
        i += 1
    start = i
    if i >= end or not 48 <= buf[i] <= 57:
        return -1, 0, False
    i = i + 1 if buf[i] == 48 else _digits(buf, i, end)
    count = i - start
    whole = True
    if i < end and buf[i] == _DOT:
        j = _digits(buf, i + 1, end)
        if j == i + 1:
            return -1, 0, False
        i, whole = j, False
    if i < end and (buf[i] == 101 or buf[i] == 69):  # e, E
        j = i + 1
        if j < end and (buf[j] == _MINUS or buf[j] == _PLUS):
            j += 1
        k = _digits(buf, j, end)
        if k == j:
            return -1, 0, False
        i, whole = k, False
    return i, count, whole


@njit(cache=True)
def _whole(buf: Any, i: int, end: int) -> int:
    """The whole number buf[i:end] (digits only, at most 18 of them), or -1 at 2**53 or
    above."""
    value = 0
    for j in range(i, end):
        value = value * 10 + (buf[j] - 48)
    return value if value < _MAX_TOKENS else -1


@njit(cache=True)
def _is_space_at(buf: Any, i: int) -> bool:
    """Whether the character at byte i (a first byte) could be white space to `str.strip`:
    ASCII's, or a multi-byte character whose lead is that of U+0085, U+00A0, U+1680,
    U+2000-U+205F or U+3000 (others with those leads are refused too: they only cost a line
    to the slower reader)."""
    b = buf[i]
    return b == _SPACE or 9 <= b <= 13 or 28 <= b <= 31 or b == 0xC2 or 0xE1 <= b <= 0xE3


@njit(cache=True)
def _plain_name(buf: Any, start: int, end: int) -> bool:
    """Whether the name buf[start:end] (not empty) has no blank at either end."""
    if _is_space_at(buf, start):
        return False
    last = end - 1
    while last > start and (buf[last] & 0xC0) == 0x80:  # back to the last character's lead
        last -= 1
    return not _is_space_at(buf, last)


@njit(cache=True)
def _copy_number(buf: Any, i: int, end: int, out: Any, used: int) -> int:
    """buf[i:end] and a space appended to `out` at `used`; the new length."""
    for j in range(i, end):
        out[used] = buf[j]
        used += 1
    out[used] = _SPACE
    return used + 1


@njit(cache=True)
def _literal(buf: Any, i: int, end: int, text: Any, start: int, stop: int) -> int:
    """The end of text[start:stop] (uint8) at buf[i], or -1 (offsets, not a slice: a slice
    is an array object a line)."""
    if end - i < stop - start:
        return -1
    for j in range(stop - start):
        if buf[i + j] != text[start + j]:
            return -1
    return i + stop - start


_WORDS = np.frombuffer(b"nulltruefalse", dtype=np.uint8)  # null [0, 4), true, false [8, 13)


@njit(cache=True)
def _string(buf: Any, i: int, end: int) -> int:
    """The end of the JSON string at i (past its closing quote) with no escape and no control
    character, or -1."""
    if i >= end or buf[i] != _QUOTE:
        return -1
    i += 1
    while i < end:
        b = buf[i]
        if b == _QUOTE:
            return i + 1
        if b == _BACKSLASH or b < 32:
            return -1
        i += 1
    return -1


@njit(cache=True)
def _intern(buf: Any, start: int, end: int, line: int, table: Any, starts: Any, ends: Any,
            first: Any, count: int) -> tuple[int, int]:
    """(the index of name buf[start:end] among those seen, the count seen): a new name is
    added, first seen on `line`."""
    h = 0
    for j in range(start, end):
        h = (h * 131 + buf[j]) & 0xFFFFFFFFFF
    mask = table.size - 1
    slot = h & mask
    while True:
        u = table[slot]
        if u < 0:
            table[slot], starts[count], ends[count], first[count] = count, start, end, line
            return count, count + 1
        if ends[u] - starts[u] == end - start:
            same = True
            for j in range(end - start):
                if buf[starts[u] + j] != buf[start + j]:
                    same = False
                    break
            if same:
                return u, count
        slot = (slot + 1) & mask


@njit(cache=True)
def _lines(buf: Any) -> int:
    n = 0
    for b in buf:
        if b == _NEWLINE:
            n += 1
    return n + (1 if buf.size and buf[buf.size - 1] != _NEWLINE else 0)


@njit(cache=True)
def _scan(buf: Any, kinds: Any, keys: Any, key_ends: Any, json: bool) -> tuple[Any, ...]:
    """The lines of `buf` matched against one row shape: for JSON lines the flat object of
    the keys `keys[key_ends[q-1]:key_ends[q]]` (quoted) of kinds `kinds`, for CSV the cells of
    kinds `kinds` (the scan stops at the first line it does not take: a block is read by one
    reader or the other). Per line whether it was taken, its adapter (an index of the names
    seen, -1 the base model), token counts and rank, whether it gives a duration; the
    timestamps and durations of the taken lines as text, and the names' spans."""
    n = _lines(buf)
    taken = np.zeros(n, dtype=np.bool_)
    adapter = np.full(n, -1, dtype=np.int64)
    inputs = np.zeros(n, dtype=np.int64)
    outputs = np.zeros(n, dtype=np.int64)
    rank = np.zeros(n, dtype=np.int64)
    has_duration = np.zeros(n, dtype=np.bool_)
    times = np.empty(buf.size + n, dtype=np.uint8)
    durations = np.empty(buf.size + n, dtype=np.uint8)
    size = 2
    while size < 2 * n:
        size *= 2
    table = np.full(size, -1, dtype=np.int64)
    starts = np.empty(n, dtype=np.int64)
    ends = np.empty(n, dtype=np.int64)
    first = np.empty(n, dtype=np.int64)
    seen = used_t = used_d = 0
    width = kinds.size
    line_start = 0
    for line in range(n):
        end = line_start
        while end < buf.size and buf[end] != _NEWLINE:
            end += 1
        next_start = end + 1
        if end > line_start and buf[end - 1] == _CR:
            end -= 1
        i = line_start
        ok = True
        name_start = name_end = -1
        t0 = t1 = d0 = d1 = -1
        if json:
            i = _skip_blanks(buf, i, end)
            ok = i < end and buf[i] == _OPEN
            i += 1
        for q in range(width):
            if not ok:
                break
            if json:
                i = _skip_blanks(buf, i, end)
                if q:
                    if i >= end or buf[i] != _COMMA:
                        ok = False
                        break
                    i = _skip_blanks(buf, i + 1, end)
                i = _literal(buf, i, end, keys, key_ends[q - 1] if q else 0, key_ends[q])
                if i < 0:
                    ok = False
                    break
                i = _skip_blanks(buf, i, end)
                if i >= end or buf[i] != _COLON:
                    ok = False
                    break
                i = _skip_blanks(buf, i + 1, end)
                cell_end = end  # a value ends where its grammar ends
            else:
                if q:
                    if i >= end or buf[i] != _COMMA:
                        ok = False
                        break
                    i += 1
                cell_end = i
                while cell_end < end and buf[cell_end] != _COMMA:
                    cell_end += 1
            kind = kinds[q]
            null = json and _literal(buf, i, end, _WORDS, 0, 4) >= 0
            if kind == ADAPTER:
                if null:
                    i += 4
                elif json:
                    j = _string(buf, i, end)
                    if j < 0:
                        ok = False
                        break
                    name_start, name_end, i = i + 1, j - 1, j
                else:
                    name_start, name_end, i = i, cell_end, cell_end
                if name_end > name_start and not _plain_name(buf, name_start, name_end):
                    ok = False
            elif kind == OTHER:
                if json:
                    j = _number(buf, i, end, True)[0]
                    if j < 0 or j - i > 101:
                        j = _string(buf, i, end)
                    if j < 0:
                        j = max(_literal(buf, i, end, _WORDS, 0, 4),
                                _literal(buf, i, end, _WORDS, 4, 8),
                                _literal(buf, i, end, _WORDS, 8, 13))
                    ok = j >= 0
                    i = j
                else:
                    i = cell_end
            elif null or (not json and i == cell_end):  # not given
                if kind == TIMESTAMP:
                    ok = False
                i += 4 if null else 0
            else:
                j, count, is_whole = _number(buf, i, end, False)
                if j < 0 or (not json and j != cell_end):
                    ok = False
                elif kind == TIMESTAMP:
                    t0, t1 = i, j
                elif kind == DURATION:
                    d0, d1 = i, j
                else:
                    value = _whole(buf, i, j) if is_whole and count <= 18 else -1
                    ok = value >= 0
                    if kind == INPUT:
                        inputs[line] = value
                    elif kind == OUTPUT:
                        outputs[line] = value
                    else:
                        rank[line] = value
                i = j
        if ok and json:
            i = _skip_blanks(buf, i, end)
            ok = i < end and buf[i] == _CLOSE
            i = _skip_blanks(buf, i + 1, end)
        ok = ok and i == end and t0 >= 0
        if ok:
            taken[line] = True
            used_t = _copy_number(buf, t0, t1, times, used_t)
            if d0 >= 0:
                has_duration[line] = True
                used_d = _copy_number(buf, d0, d1, durations, used_d)
            if name_end > name_start:
                adapter[line], seen = _intern(buf, name_start, name_end, line, table, starts,
                                              ends, first, seen)
        elif not json:
            break
        line_start = next_start
    return (taken, adapter, inputs, outputs, rank, has_duration, times[:used_t], durations[:used_d],
            starts[:seen], ends[:seen], first[:seen])


class Scan:
    """One block's scan (`_scan`), its numbers converted: per line `taken`, `adapter` (an
    index of `names`, -1 the base model), `inputs`, `outputs`, `rank`, `arrival` and
    `duration` (NaN where not taken or not given); `names` in order of first use, each
    with the line it first appears on (`first_line`)."""

    def __init__(self, block: bytes, columns: list[str], json: bool) -> None:
        buf = np.frombuffer(block, dtype=np.uint8)
        kinds = np.array([KINDS.get(c, OTHER) for c in columns], dtype=np.int64)
        quoted = [f'"{c}"'.encode() for c in columns] if json else []
        key_ends = np.cumsum([0] + [len(k) for k in quoted])[1:].astype(np.int64)
        (self.taken, self.adapter, self.inputs, self.outputs, self.rank, has_duration, times,
         durations, starts, ends, self.first_line) = _scan(
            buf, kinds, np.frombuffer(b"".join(quoted), dtype=np.uint8), key_ends, json)
        n = self.taken.size
        self.arrival, self.duration = np.full(n, np.nan), np.full(n, np.nan)
        self.arrival[self.taken] = _floats(times)
        self.duration[has_duration] = _floats(durations)
        self.names = [block[s:e].decode("utf-8") for s, e in zip(starts.tolist(),
                                                                  ends.tolist(), strict=True)]


def compile_now() -> None:
    """Compile (or load from the cache) the scan: `make` runs it once."""
    Scan(b'{"timestamp": 0, "adapter": "a"}\n', ["timestamp", "adapter"], json=True)


def _floats(text: np.ndarray) -> np.ndarray:
    """The numbers in `text` (uint8: JSON numbers, each followed by a space) as float64,
    rounded as Python's float rounds them (past float64: inf)."""
    if not text.size:
        return np.empty(0)
    return np.fromstring(text.tobytes(), dtype=np.float64, sep=" ")
