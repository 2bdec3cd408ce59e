"""JSON as a checkpoint reader must parse it: bounded, unambiguous, refused before it is built.

Every JSON file a checkpoint reader opens (``shardkit.json``, safetensors headers,
``model.safetensors.index.json``, ``config.json``, the save lease, the manager's metric files)
may have been crafted. ``json.loads`` alone keeps the last of two equal keys (so a tampered
file can say one thing to this reader and another to a different one), recurses once per
nesting level (a ``RecursionError``, or with a raised recursion limit a crash), and builds
whatever count of objects the text asks for. ``loads`` first measures the text, in C-speed
passes linear in its size and without building anything:

* nesting deeper than ``MAX_DEPTH`` arrays and objects is refused;
* more than ``MAX_ITEMS`` values (arrays, objects, numbers, strings, literals; counted from
  the separators outside strings) is refused;

then parses it, refusing a key that appears twice in one object. JSON has no references, so
the built value is never larger than the text (no sharing to expand). Every refusal is a
``ValueError`` whose message names the file and quotes at most ``QUOTE`` characters of any
offending text; the callers (metadata and header parsers) turn it into a ``CheckpointError``.
"""

from __future__ import annotations

import json
import re
import reprlib
from typing import Any

import numpy as np

__all__ = ["loads", "measure", "quote", "shown", "MAX_DEPTH", "MAX_ITEMS", "QUOTE"]

MAX_DEPTH = 100
"""Deepest nesting of arrays and objects read (shardkit's own files nest 6 deep)."""
MAX_ITEMS = 2**25
"""Most values in one file (a version-2 ``shardkit.json`` of a million regions holds about 15 million)."""
QUOTE = 60
"""Most characters of a crafted key or value that an error message repeats."""

_ESCAPE = re.compile(rb"\\.", re.DOTALL)
_NOT_STRUCTURE = bytes(range(256)).translate(None, b"[]{},")  # translate(None, this) keeps only [ ] { } ,


def quote(value: object, limit: int = QUOTE) -> str:
    """``repr`` of a string (or bytes) cut to ``limit`` characters, saying how long it was: safe in a message."""
    if isinstance(value, (str, bytes, bytearray)):
        text = value[:limit]
        shown = repr(bytes(text) if isinstance(text, bytearray) else text)
        return shown if len(value) <= limit else f"{shown}... ({len(value)} characters)"
    return f"a {type(value).__name__}"


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 3, 2 * QUOTE, QUOTE, QUOTE
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 8


def shown(value: object) -> str:
    """A ``repr`` of ``value`` for an error message, bounded in length and depth: at most ``2 * QUOTE``
    characters of a string (``QUOTE`` of a number), 8 items of a container, 3 levels (a crafted value is never
    printed whole)."""
    try:
        return _REPR.repr(value)
    except Exception:  # a value whose repr fails
        return f"a {type(value).__name__}"


class _Duplicate(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _Duplicate(key)
            seen.add(key)
    return out


def measure(data: bytes) -> tuple[int, int]:
    """``(depth, items)`` of JSON text ``data`` without parsing it: the deepest nesting of arrays and
    objects, and the values it holds. Linear in ``len(data)``; every pass runs in C.

    Outside strings only: escaped characters are dropped first, so every remaining quote opens
    or closes a string, and every other piece between quotes is a string's content. Where the
    text is not JSON, the parser stops at the first fault, before any nesting found here only
    after it.
    """
    text = _ESCAPE.sub(b"", data) if b"\\" in data else data
    outside = b"".join(text.split(b'"')[0::2])
    structure = outside.translate(None, _NOT_STRUCTURE)  # only [ ] { } and commas remain
    items = structure.count(b",") + structure.count(b"[") + structure.count(b"{") + (1 if data.strip() else 0)
    brackets = np.frombuffer(structure.translate(None, b","), dtype=np.uint8)
    if not len(brackets):
        return 0, items
    steps = np.where((brackets == 0x5B) | (brackets == 0x7B), 1, -1).astype(np.int32)  # [ { open, ] } close
    return int(np.cumsum(steps).max()), items


def loads(text: str | bytes | bytearray, *, source: str, what: str = "malformed JSON") -> Any:
    """Parse ``text`` (of file ``source``) within the limits above.

    Raises:
        ValueError: naming ``source``, if the text is not JSON, nests deeper than ``MAX_DEPTH``,
            holds more than ``MAX_ITEMS`` values, or has a key twice in one object. Messages start
            with ``f"{what} {source!r}: "``.
    """
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)
    depth, items = measure(data)
    if items > MAX_ITEMS:
        msg = (f"{what} {source!r}: it holds about {items} JSON values, more than the {MAX_ITEMS} a checkpoint "
               f"file may hold; the file is corrupt or crafted (refused before parsing).")
        raise ValueError(msg)
    if depth > MAX_DEPTH:
        msg = (f"{what} {source!r}: it nests arrays and objects more than {MAX_DEPTH} levels deep; the file is "
               f"corrupt or crafted (refused before parsing).")
        raise ValueError(msg)
    try:
        return json.loads(data, object_pairs_hook=_no_duplicates)
    except _Duplicate as exc:
        msg = (f"{what} {source!r}: the key {quote(exc.key)} appears twice in one object (a duplicate key); a "
               f"reader cannot tell which one is meant, so the file is corrupt (refusing it).")
        raise ValueError(msg) from None
    except RecursionError:  # not reached within MAX_DEPTH; kept so that no parser error escapes raw
        msg = f"{what} {source!r}: it nests too deeply to parse; the file is corrupt or not a checkpoint."
        raise ValueError(msg) from None
    except (UnicodeDecodeError, ValueError) as exc:
        msg = f"{what} {source!r}: not valid JSON ({_short(exc)})."
        raise ValueError(msg) from None


def _short(exc: BaseException) -> str:
    text = str(exc)
    return text if len(text) <= 2 * QUOTE else text[:2 * QUOTE] + "..."
