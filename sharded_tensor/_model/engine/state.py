"""What the engine keeps per thread while a sharded model runs.

A zone's forward runs on the calling thread, and so does every rule; the state is
thread-local so that simulated ranks (threads of one process, in the tests) and a model run
in a worker thread each see their own.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch

from _shardkit import comm as _comm

__all__ = ["STATE", "rank", "rank_and_world", "outside_zone_mode"]


class _State(threading.local):
    def __init__(self) -> None:
        self.depth = 0  # zone calls open on this thread
        # Per open zone call: whole tensors already given to ``copy_to_ranks`` (by id), so the q, k
        # and v projections of one input share one copy and their input's gradient one all-reduce.
        self.copies: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = []
        self.keep_split_outputs = False  # inside ``loss_parallel``
        self.ranks: dict[Any, tuple[int, int]] = {}  # (rank, world) per group, looked up once per zone call
        self.tracing = False  # inside torch.compile's trace of a zone
        self.cache: Any = None  # the decision cache (``dispatch``), made on first use
        self.explaining: Any = None  # what ``st.explain`` records while it runs (``explain``)


STATE = _State()


def rank_and_world(group: _comm.ProcessGroup) -> tuple[int, int]:
    """``_comm.rank_and_world(group)``, looked up once per outermost zone call (groups change only between)."""
    if not STATE.depth:
        return _comm.rank_and_world(group)
    ranks = STATE.ranks
    try:
        return ranks[group]
    except KeyError:
        found = ranks[group] = _comm.rank_and_world(group)
        return found


def rank(group: _comm.ProcessGroup) -> int:
    """This process's rank in ``group``."""
    return rank_and_world(group)[0]



class _Outside(contextlib.AbstractContextManager[None]):
    """Leaves the zone mode for a ``with`` block when it is the innermost torch function mode.

    The engine's mode is recognized by a class attribute (``dispatch.ZoneMode`` sets it): this
    module is below the one that defines it.
    """

    __slots__ = ("_popped",)

    def __enter__(self) -> None:
        self._popped = None
        if STATE.depth:
            n = torch._C._len_torch_function_stack()
            if n and getattr(torch._C._get_function_stack_at(n - 1), "zone_mode", False):
                self._popped = torch._C._pop_torch_function_stack()

    def __exit__(self, *exc: object) -> None:
        if self._popped is not None:
            torch._C._push_on_torch_function_stack(self._popped)
            self._popped = None


def outside_zone_mode() -> _Outside:
    """A ``with`` block whose ops run on the tensors given, unseen by the zone mode (a sharded layer's own
    forward, a collective's local work)."""
    return _Outside()
