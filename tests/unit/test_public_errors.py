"""What users see of an error is public: tracebacks name ``checkpoint.CheckpointError``, ``st.CollectiveError``.

Every exception class a public package exports is shown under that package (its
``__module__``), so a traceback's last line names the class as users import it, never the
private module defining it. (That no private subclass reaches users from a save whose peer
died is checked where peers die: ``tests/distributed/test_rank_death.py``.)
"""

from __future__ import annotations

import pickle
import traceback

import pytest

import checkpoint
import sharded_tensor
import sharding

PACKAGES = [checkpoint, sharded_tensor, sharding]


def _exceptions() -> list[tuple[str, type[BaseException]]]:
    found = []
    for package in PACKAGES:
        for name in package.__all__:
            value = getattr(package, name)
            if isinstance(value, type) and issubclass(value, BaseException):
                found.append((f"{package.__name__}.{name}", value))
    return found


def test_every_public_exception_is_shown_under_its_package() -> None:
    found = _exceptions()
    assert {name for name, _ in found} >= {"checkpoint.CheckpointError", "sharded_tensor.CollectiveError"}
    for name, cls in found:
        assert f"{cls.__module__}.{cls.__qualname__}" == name, (name, cls.__module__)


@pytest.mark.parametrize("error", [
    pytest.param(lambda: checkpoint.CheckpointError("what went wrong", missing=["w"]), id="CheckpointError"),
    pytest.param(lambda: sharded_tensor.CollectiveError("reshard", "closed", [2], timeout=5.0, elapsed=0.5),
                 id="CollectiveError"),
])
def test_a_traceback_names_the_public_class(error) -> None:  # type: ignore[no-untyped-def]
    made = error()
    cls = type(made)
    try:
        raise made
    except cls as exc:
        last = traceback.format_exception_only(exc)[-1]
        again = pickle.loads(pickle.dumps(exc))  # across processes (a rank's error) it stays the same class
    public = next(name for name, c in _exceptions() if c is cls)
    assert last == f"{public}: {made}\n"
    assert type(again) is cls and str(again) == str(made) and again.__dict__ == made.__dict__
