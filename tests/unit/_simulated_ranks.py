"""Ranks simulated as threads of one process, with the collectives ``_comm`` offers the engine.

``_comm``'s rank, all-reduce and all-gather are served by a shared in-process exchange, so the
engine's rules, their fallbacks and the adjoints of every placement move (gather, scatter,
``copy_to_ranks``, ``reduce_from_ranks``) run unchanged.

One rank computes at a time: a rank holds the turn from its start to its next collective
and from there to the next one. Real ranks are processes, each with its own random generator
seeded alike; threads share torch's one CPU generator, so a rank's generator state is put
back whenever it takes its turn (``seeded``): dropout draws on every rank what one process
seeded alike would draw.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from _shardkit import comm as _comm

__all__ = ["Ranks", "simulated"]


class Ranks:
    """``world`` ranks as threads of this process (see the module's docstring)."""

    def __init__(self, world: int, *, timeout: float = 10.0) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=timeout)
        self.slots: list[Any] = [None] * world
        self.local = threading.local()
        self._turn = threading.Lock()
        self._states: list[torch.Tensor | None] = [None] * world

    def rank_and_world(self, group: Any = None) -> tuple[int, int]:
        return self.local.rank, self.world

    def _give_turn(self) -> None:
        rank = self.local.rank
        if self._states[rank] is not None:
            self._states[rank] = torch.get_rng_state()
        self._turn.release()

    def _take_turn(self) -> None:
        self._turn.acquire()
        state = self._states[self.local.rank]
        if state is not None:
            torch.set_rng_state(state)

    def _exchange(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.slots[self.local.rank] = tensor.detach().clone()
        self._give_turn()
        try:
            self.barrier.wait()
            everyone = list(self.slots)
            self.barrier.wait()
        finally:
            self._take_turn()
        return everyone

    def all_reduce(self, tensor: torch.Tensor, group: Any = None, *, op: str = "sum", **_: Any) -> torch.Tensor:
        self.local.all_reduces = getattr(self.local, "all_reduces", 0) + 1
        everyone = self._exchange(tensor)
        total = everyone[0].clone()
        for other in everyone[1:]:  # in rank order, as one process would add them
            total = torch.maximum(total, other) if op == "max" else total + other
        with torch.no_grad():
            tensor.copy_(total)
        return tensor

    def all_gather_tensor(self, tensor: torch.Tensor, group: Any = None, **_: Any) -> list[torch.Tensor]:
        self.local.all_gathers = getattr(self.local, "all_gathers", 0) + 1
        return self._exchange(tensor)

    def run(self, fn: Callable[[int], Any], *, seed: int | None = None) -> list[Any]:
        """``fn(rank)`` on every rank; with ``seed``, each rank's generator starts from ``torch.manual_seed(seed)``."""
        results: list[Any] = [None] * self.world
        errors: list[BaseException] = []
        saved = torch.get_rng_state()
        if seed is not None:
            torch.manual_seed(seed)
            self._states = [torch.get_rng_state() for _ in range(self.world)]
            torch.set_rng_state(saved)

        def main(rank: int) -> None:
            self.local.rank = rank
            self.local.all_reduces = self.local.all_gathers = 0
            self._take_turn()
            try:
                results[rank] = fn(rank)
            except BaseException as exc:  # noqa: BLE001 - reported below, after every thread ends
                errors.append(exc)
                self.barrier.abort()
            finally:
                self._give_turn()

        threads = [threading.Thread(target=main, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self._states = [None] * self.world
        torch.set_rng_state(saved)
        if errors:
            raise errors[0]
        return results


@contextlib.contextmanager
def simulated(world: int, *, timeout: float = 10.0) -> Iterator[Ranks]:
    """``_comm`` serving ``world`` ranks as threads of this process, for the ``with`` block."""
    ranks = Ranks(world, timeout=timeout)
    names = ("rank_and_world", "all_reduce", "all_gather_tensor")
    saved = {name: getattr(_comm, name) for name in names}
    for name in names:
        setattr(_comm, name, getattr(ranks, name))
    try:
        yield ranks
    finally:
        for name, value in saved.items():
            setattr(_comm, name, value)
