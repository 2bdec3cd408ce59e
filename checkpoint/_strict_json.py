"""JSON as a checkpoint reader must parse it: duplicate keys and runaway nesting are errors, not surprises.

``json.loads`` keeps the last of two equal keys (so a tampered file can say one thing to
this reader and another to a different one) and raises ``RecursionError`` on deeply nested
input. ``loads`` refuses both with a ``CheckpointError`` naming the file.
"""

from __future__ import annotations

import json
from typing import Any

from ._format import CheckpointError

__all__ = ["loads"]


class _Duplicate(ValueError):
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


def loads(text: str | bytes | bytearray, *, source: str, what: str = "JSON") -> Any:
    """Parse ``text`` (the ``what`` of file ``source``); ``CheckpointError`` naming ``source`` if it is
    malformed, has a key twice in one object, or nests too deeply for the parser."""
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except _Duplicate as exc:
        msg = (f"{what} of {source!r} has the key {exc.key!r} twice in one object; a reader cannot tell which "
               f"one is meant, so the file is corrupt (refusing it).")
        raise CheckpointError(msg) from None
    except RecursionError:
        msg = f"{what} of {source!r} nests too deeply to parse; the file is corrupt or not a checkpoint."
        raise CheckpointError(msg) from None
    except (UnicodeDecodeError, ValueError) as exc:
        msg = f"{what} of {source!r} is not valid JSON: {exc}."
        raise CheckpointError(msg) from exc
