"""JSON as a checkpoint reader must parse it: duplicate keys and runaway nesting are errors, not surprises.

``json.loads`` keeps the last of two equal keys (so a tampered file can say one thing to
this reader and another to a different one) and raises ``RecursionError`` on deeply nested
input. ``loads`` refuses both with a ``ValueError`` whose message names the file; the
callers (metadata and header parsers) turn it into a ``CheckpointError``.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["loads"]


class _Duplicate(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Duplicate(key)
        out[key] = value
    return out


def loads(text: str | bytes | bytearray, *, source: str, what: str = "malformed JSON") -> Any:
    """Parse ``text`` (of file ``source``); ``ValueError`` naming ``source`` if it is malformed, has a key
    twice in one object, or nests too deeply for the parser. Messages start with ``f"{what} {source!r}: "``."""
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except _Duplicate as exc:
        msg = (f"{what} {source!r}: the key {exc.key!r} appears twice in one object (a duplicate key); a reader "
               f"cannot tell which one is meant, so the file is corrupt (refusing it).")
        raise ValueError(msg) from None
    except RecursionError:
        msg = f"{what} {source!r}: it nests too deeply to parse; the file is corrupt or not a checkpoint."
        raise ValueError(msg) from None
    except (UnicodeDecodeError, ValueError) as exc:
        msg = f"{what} {source!r}: not valid JSON ({exc})."
        raise ValueError(msg) from exc
