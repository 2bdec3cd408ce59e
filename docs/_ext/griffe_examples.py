"""Griffe extension for the API reference: read a Google-style ``Example:`` section as ``Examples:``.

The docstrings use the singular ``Example:`` heading, which griffe renders as a plain
admonition; read as ``Examples:``, its ``>>>`` lines render as Python code.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_SINGULAR = re.compile(r"^(?P<indent>[ \t]*)Example:[ \t]*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    """Rename ``Example:`` section headings to ``Examples:`` before docstrings are parsed."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _SINGULAR.sub(r"\g<indent>Examples:", obj.docstring.value)
