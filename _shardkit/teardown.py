"""A clean interpreter exit for processes that used ``torch.distributed``.

A Gloo process group runs worker threads until the group object is freed. A worker that
finishes a collective drops its reference to the work last, and when the work's tensors
are owned by Python objects that takes the interpreter lock. If this happens while the
interpreter is finalizing, CPython ends the thread inside a C++ destructor, the C++ runtime
calls ``std::terminate`` ("terminate called without an active exception") and the rank
dies by SIGABRT after its work is done, so ``torchrun`` reports a failure. (Seen in a core
dump: the main thread in ``Py_FinalizeEx``, a ``ProcessGroupGloo::runLoop`` thread in
``~AsyncWork`` -> ``decref_pyobject`` -> ``take_gil`` -> ``pthread_exit``.)

``destroy_process_group`` frees the group, and so joins its threads while the interpreter
is whole, only if nothing else refers to it. Two things commonly do:

- ``torch.distributed.nn.functional`` binds ``group.WORLD`` as a default argument of its
  functions when it is imported. torch imports it lazily (through ``torch._dynamo``, e.g.
  the first random initialization on the meta device), usually after
  ``init_process_group``, so the default group outlives ``destroy_process_group``.
  Importing it here, before any group exists, binds ``None`` instead.
- groups cached by the library itself (the checkpoint's background-save group): they
  register a release function with :func:`on_exit`.

:func:`_at_exit`, registered with ``atexit`` when this module is imported (after torch,
so it runs before torch's own exit handlers), releases those references, destroys a
process group the script left initialized, and collects garbage, so every group is freed
before finalization starts. Python has already joined shardkit's own threads by then
(the background save is a non-daemon thread; the page-release executor joins at
``threading`` shutdown).
"""

from __future__ import annotations

import atexit
import gc
import sys
from collections.abc import Callable

import torch.distributed as dist

if dist.is_available():
    # Imported for its side effect: its default arguments bind group.WORLD now, while it is None.
    import torch.distributed.nn.functional  # noqa: F401

__all__ = ["on_exit"]

_releases: list[Callable[[], None]] = []


def on_exit(release: Callable[[], None]) -> None:
    """Call ``release`` at interpreter exit, before the process group is destroyed."""
    _releases.append(release)


def _unbind_stale_defaults() -> None:
    # The module was imported after init_process_group (shardkit imported late): its
    # defaults still hold the destroyed default group. None is what they bind when the
    # module is imported before any group exists.
    module = sys.modules.get("torch.distributed.nn.functional")
    if module is None:
        return
    for value in list(vars(module).values()):
        defaults = getattr(value, "__defaults__", None)
        if callable(value) and defaults and any(isinstance(d, dist.ProcessGroup) for d in defaults):
            value.__defaults__ = tuple(None if isinstance(d, dist.ProcessGroup) else d for d in defaults)


def _at_exit() -> None:
    for release in reversed(_releases):
        try:
            release()
        except Exception:  # noqa: BLE001, S112 - one failed release must not keep the others from running
            continue
    if not dist.is_available():
        return
    if dist.is_initialized():
        dist.destroy_process_group()
    _unbind_stale_defaults()
    gc.collect()


atexit.register(_at_exit)
