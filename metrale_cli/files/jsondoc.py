"""JSON from untrusted files (adapter configs, model configs, safetensors headers and the pool
image's metadata): every way the text can fail to be a document becomes one FormatError naming
the file, a key given twice in one object among them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from metrale_cli.errors import FormatError


class _DuplicateKey(Exception):
    """A key an object gives twice; not a ValueError, so that the parser lets it through."""


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object's members as a dict, refusing a key given twice: Python's parser keeps the
    last, other readers (and the tool that wrote the file) may keep the first, so the two would
    read different documents from the same bytes."""
    doc = dict(pairs)
    if len(doc) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return doc


# One decoder for every document: `json.loads` with a hook builds a new one per call, which a
# JSON-lines trace (a document a line) would pay millions of times.
_DECODER = json.JSONDecoder(object_pairs_hook=_unique)


def load_json(path: Path | str, text: bytes | str, what: str = "JSON file") -> Any:
    """The document in `text`, read from `path`: FormatError for bad UTF-8, bad JSON, a key
    given twice in one object, or JSON nested deeper than the parser recurses (`[[[[...`
    100,000 deep)."""
    try:
        return _DECODER.decode(text.decode("utf-8") if isinstance(text, bytes) else text)
    except json.JSONDecodeError as exc:
        # One line of text (a JSON-lines row, a safetensors header): the character, not a
        # "line 1" (or 2, past its newline) beside the file line `path` may name.
        at = (f"character {exc.pos + 1}" if "\n" not in exc.doc.rstrip("\r\n")
              else f"line {exc.lineno} column {exc.colno}")
        raise FormatError(f"{path}: not a readable {what} ({exc.msg} at {at})") from exc
    except (UnicodeDecodeError, ValueError) as exc:
        # ValueError besides JSONDecodeError: an integer of more than 4,300 digits.
        raise FormatError(f"{path}: not a readable {what} ({exc})") from exc
    except RecursionError:
        raise FormatError(f"{path}: not a readable {what} (nested too deeply)") from None
    except _DuplicateKey as exc:
        raise FormatError(f"{path}: not a readable {what} (key {shown(exc.args[0])} is given "
                          "twice in one object)") from None


def shown(value: Any, limit: int = 60) -> str:
    """A short repr of a value read from a file, for an error line: numbers and strings as they
    are (cut at `limit`), containers by their kind (a repr of 100,000 nested lists would not do)."""
    if isinstance(value, dict):
        return "a JSON object"
    if isinstance(value, list):
        return "a JSON array"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
