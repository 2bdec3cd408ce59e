"""How many examples a property test draws: all it asks for in the full suite, a quarter in the quick tier.

A property test states the count it is written for, ``@settings(max_examples=examples(200))``.
Under hypothesis' default profile (100 examples) that is exactly 200. The quick tier
(``-m "not slow"``; see ``tests/conftest.py``) loads the profile ``quick`` (25 examples), which
scales every count by 25/100, to at least ``MINIMUM``: each property is still tried on many
cases between edits, and on all of them in the full suite (``./scripts/test.sh``). Pass
``--hypothesis-profile default`` to draw them all with ``-m "not slow"`` too.
"""

from __future__ import annotations

from hypothesis import settings

__all__ = ["MINIMUM", "QUICK", "examples"]

QUICK = "quick"
MINIMUM = 10
# hypothesis' own default; the full suite draws exactly the counts the tests name.
_FULL = 100

settings.register_profile(QUICK, max_examples=_FULL // 4)


def examples(count: int) -> int:
    """``count`` scaled by the loaded profile (``count`` itself in the full suite), at least ``MINIMUM``."""
    return max(MINIMUM, count * settings.default.max_examples // _FULL)
