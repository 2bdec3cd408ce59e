"""For the property tests that run a whole list of drawn cases in one spawn: values, regions, the report.

Each rank builds the same pseudo-random tensors from a seed (nothing is sent to make them),
checks its regions of the result, and returns its problems as data; the parent then fails
once, naming every failing case.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sharding import ShardMetadata

__all__ = ["assert_no_problems", "random_tensor", "region"]


def random_tensor(size: tuple[int, ...], dtype: torch.dtype, seed: int, *,
                  small_integers: bool = False) -> torch.Tensor:
    """The same pseudo-random tensor on every rank for one ``seed``.

    Booleans, integers in [-2**40, 2**40), floats from a normal draw; with ``small_integers``,
    floats that hold integers in [-16, 16], whose sums are exact in any order.
    """
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, size, generator=g).bool()
    if not dtype.is_floating_point:
        return torch.randint(-(2**40), 2**40, size, generator=g).to(dtype)
    if small_integers:
        return torch.randint(-16, 17, size, generator=g).to(dtype)
    return torch.randn(size, generator=g, dtype=torch.float64).to(dtype)


def region(x: torch.Tensor, md: ShardMetadata) -> torch.Tensor:
    """The block of the whole tensor ``x`` that the shard ``md`` covers."""
    return x[tuple(slice(o, o + n) for o, n in zip(md.offsets, md.dims))]


def assert_no_problems(case_list: Sequence[object], problems: Sequence[Sequence[str]]) -> None:
    """Fail naming every case that has problems (``problems[i]`` are case ``i``'s), not only the first."""
    failures = [f"case {i} {case}:\n  " + "\n  ".join(found)
                for i, (case, found) in enumerate(zip(case_list, problems, strict=True)) if found]
    assert not failures, "\n".join(failures)
