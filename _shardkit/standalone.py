"""A script that calls ``init_process_group()`` but was started with plain ``python`` runs as one process.

Every multi-process example starts with ``dist.init_process_group("gloo")``, whose default
``env://`` rendezvous reads ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` from the
environment a launcher (``torchrun``) sets. Started with plain ``python``, the same script
would fail there with torch's ``environment variable RANK expected, but not set``, while
shardkit's documentation promises that a script run without a launcher runs, alone.

So once shardkit is imported, the ``env://`` rendezvous of a process that no launcher started
(none of those variables set, nor torchelastic's) makes it rank 0 of a world of one, in an
in-process store, and says so in a ``UserWarning`` that also says how to start N processes.
A process a launcher started, a partial environment (one variable missing: a launch gone
wrong, which torch's own error describes), and every other rendezvous (``tcp://``,
``file://``, an explicit ``store=``) are left to torch as they are.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["install", "LAUNCH_VARIABLES"]

# What torchrun (and torch.distributed.launch, mpirun wrappers, SLURM scripts) set for env://.
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")


def _launched() -> bool:
    return any(os.environ.get(name) for name in LAUNCH_VARIABLES)


def _script() -> str:
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return name if name.endswith(".py") else "script.py"


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside torch: the script's own call, for the warning's line."""
    torch_dir = os.path.dirname(os.path.dirname(dist.__file__))
    frame, level = sys._getframe(2), 2  # the handler's caller first (level 1 is the handler)
    while frame is not None and frame.f_code.co_filename.startswith(torch_dir):
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]
    return level


def _wrap(torch_handler: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
    def env_rendezvous(url: str, timeout: timedelta = timedelta(minutes=30), **kwargs: Any) -> Iterator[Any]:
        if _launched() or "rank=" in url or "world_size=" in url:
            yield from torch_handler(url, timeout=timeout, **kwargs)
            return
        msg = (f"torch.distributed.init_process_group(): no launcher started this process (none of "
               f"{', '.join(LAUNCH_VARIABLES[:4])} is set), so it runs as one process, rank 0 of a world of 1, "
               f"where nothing is split. To run it on N processes, start it with "
               f"torchrun --nproc-per-node N {_script()}.")
        warnings.warn(msg, UserWarning, stacklevel=_caller_level())
        yield (dist.HashStore(), 0, 1)
        msg = "a world of one started without a launcher cannot rendezvous again"
        raise RuntimeError(msg)

    env_rendezvous.__wrapped__ = torch_handler  # type: ignore[attr-defined]
    return env_rendezvous


def install() -> None:
    """Make ``env://`` without a launcher a world of one (once; nothing if torch's registry moved)."""
    if not dist.is_available():
        return
    # The module, not torch.distributed.rendezvous, which the package rebinds to the function.
    handlers = getattr(importlib.import_module("torch.distributed.rendezvous"), "_rendezvous_handlers", None)
    current = handlers.get("env") if isinstance(handlers, dict) else None
    if current is None or hasattr(current, "__wrapped__"):
        return
    handlers["env"] = _wrap(current)  # type: ignore[index]
