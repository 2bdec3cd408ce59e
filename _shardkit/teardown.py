"""A clean interpreter exit for processes that used ``torch.distributed``.

A Gloo process group runs worker threads until the group object is freed. A worker that
finishes a collective drops its reference to the work last, and when the work's tensors
are owned by Python objects that takes the interpreter lock. If this happens while the
interpreter is finalizing, CPython ends the thread inside a C++ destructor, the C++ runtime
calls ``std::terminate`` ("terminate called without an active exception") and the rank
dies by SIGABRT after its work is done, so ``torchrun`` reports a failure. (Seen in a core
dump: the main thread in ``Py_FinalizeEx``, a ``ProcessGroupGloo::runLoop`` thread in
``~AsyncWork`` -> ``decref_pyobject`` -> ``take_gil`` -> ``pthread_exit``.)

A group is freed, and its threads joined while the interpreter is whole, when it is
destroyed and nothing else refers to it. The script's own groups are the script's to
destroy (``destroy_process_group()`` at its end); shardkit never destroys them. What
shardkit answers for:

- its own references. ``torch.distributed.nn.functional`` binds ``group.WORLD`` as a
  default argument of its functions when it is imported, and torch imports it lazily
  (through ``torch._dynamo``, e.g. on the first random initialization on the meta device),
  usually after ``init_process_group``, so the default group would outlive
  ``destroy_process_group``. Importing it here, when shardkit is imported before any group
  exists, binds ``None`` instead. Imported later, shardkit leaves it alone: the binding is
  torch's, and shardkit changes nothing in torch.
- the groups it creates (:func:`created`): destroyed at exit if the script has not destroyed
  them already (``destroy_process_group()`` without arguments destroys every group);
- the references it caches (the checkpoint's background-save group, the liveness watch):
  their owners register a release function with :func:`on_exit`.

:func:`_at_exit`, registered with ``atexit`` when this module is imported (after torch,
so it runs before torch's own exit handlers), runs the releases, destroys shardkit's
groups still registered, drops them and collects garbage, so that none of them is left
for finalization. Python has already joined shardkit's own threads by then (the
background save is a non-daemon thread; the page-release executor joins at ``threading``
shutdown).
"""

from __future__ import annotations

import atexit
import gc
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

if dist.is_available() and not dist.is_initialized():
    # Imported for its side effect: its default arguments bind group.WORLD now, while it is None.
    import torch.distributed.nn.functional  # noqa: F401

__all__ = ["on_exit", "created"]

_releases: list[Callable[[], None]] = []
_created: weakref.WeakSet[Any] = weakref.WeakSet()  # weak: a group the script destroyed goes at once

G = TypeVar("G")


def on_exit(release: Callable[[], None]) -> None:
    """Call ``release`` at interpreter exit, before shardkit's groups are destroyed."""
    _releases.append(release)


def created(group: G) -> G:
    """Return ``group``, a process group shardkit created; it is destroyed at exit if still registered."""
    if isinstance(group, dist.ProcessGroup):  # not new_group's marker for a rank outside the group
        _created.add(group)
    return group


def _destroy_created() -> None:
    # Its own function, so that no local variable holds a group once it returns.
    for group in list(_created):
        try:
            if dist.is_initialized() and group in dist.distributed_c10d._world.pg_map:
                dist.destroy_process_group(group)
        except Exception:  # noqa: BLE001, S112 - a group torch refuses to destroy is still dropped below
            continue
    _created.clear()


def _at_exit() -> None:
    for release in reversed(_releases):
        try:
            release()
        except Exception:  # noqa: BLE001, S112 - one failed release must not keep the others from running
            continue
    if dist.is_available():
        _destroy_created()
    gc.collect()


atexit.register(_at_exit)
