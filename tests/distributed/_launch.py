"""The tests' launcher: ``_shardkit.launch`` (shared with the benchmarks), its forkserver preloaded.

Every rank is forked from one forkserver per test run. Importing what nearly every rank
needs there once, instead of in each rank, saves about 1.5 s of CPU per rank (DTensor and
FSDP2 with the sympy they pull in, ``torch._dynamo``, which building any optimizer imports,
and shardkit itself); the suite starts some 300 ranks. None of these modules reads the
environment at import in a way the tests change, and none starts a thread there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from _shardkit.launch import _GRACE_SECONDS, LaunchError, launch

# The name the distributed tests catch; the same class.
DistributedTestError = LaunchError

PRELOAD = ("pytest", "torch.distributed.tensor", "torch.distributed.fsdp", "torch.distributed.checkpoint",
           "torch._dynamo", "sharding", "sharded_tensor", "checkpoint")

__all__ = ["DistributedTestError", "PRELOAD", "run_distributed"]


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120,
                    grace: float = _GRACE_SECONDS, **kwargs: Any) -> list[Any]:
    """``_shardkit.launch.run_distributed`` with the forkserver preloading ``PRELOAD`` (if it starts here)."""
    return launch(fn, world_size, args, kwargs, timeout=timeout, grace=grace, preload=PRELOAD)
