"""Switches read from the environment at each call, with one error for a value that is neither 0 nor 1."""

from __future__ import annotations

import os

__all__ = ["flag"]


def flag(name: str, *, default: bool, on: str, off: str) -> bool:
    """The switch ``name``: ``True`` for ``"1"``, ``False`` for ``"0"``, ``default`` when unset or empty.

    Any other value raises ``ValueError``; ``on`` and ``off`` say what 1 and 0 do, for its message.
    """
    text = os.environ.get(name, "")
    if text == "":
        return default
    if text in ("0", "1"):
        return text == "1"
    msg = f"{name}={text!r} is neither 1 nor 0; set it to 1 {on}, or to 0 {off} (unset: {int(default)})."
    raise ValueError(msg)
