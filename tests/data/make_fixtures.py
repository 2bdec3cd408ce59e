"""How the checkpoints of older format versions in ``tests/data/v<N>/`` were made; the values they must load to.

The committed folders are the point: ``tests/data/v1`` was written by the version-1 writer,
``tests/data/v2`` by the version-2 writer (and so on to ``v4``), from the same state_dicts, and every later reader
must load them bit for bit (``tests/unit/test_format_versions.py``,
``tests/distributed/test_format_versions.py``). Running this script writes new folders in the
current version (new generation ids); it is only needed to freeze the current version before
the format changes again, never to refresh a committed folder::

    PYTHONPATH=$PWD python -m tests.data.make_fixtures tests/data/v3

- ``one_rank``: saved by a world of one: several dtypes, a 0-d tensor, a ``ShardedTensor``
  split into three row blocks, a nested state_dict with JSON values.
- ``two_ranks``: saved by 2 Gloo ranks: ``rows`` split by rows, ``cols`` split by columns,
  ``bias`` a plain tensor, ``step`` a value.

The expected values are computed here from fixed formulas (no random generator whose
stream could change between torch versions).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

R = ["rank:0/cpu", "rank:1/cpu"]


def _ramp(shape: tuple[int, ...], dtype: torch.dtype, scale: float = 0.25, shift: float = -3.0) -> torch.Tensor:
    """A deterministic pattern: ``(i * 37 % 101) * scale + shift`` over the flat index ``i``, in ``dtype``."""
    n = 1
    for s in shape:
        n *= s
    base = (torch.arange(n, dtype=torch.float64) * 37 % 101) * scale + shift
    if dtype == torch.bool:
        return (torch.arange(n) % 3 == 0).reshape(shape)
    if dtype.is_complex:
        return torch.complex(base, -base).to(dtype).reshape(shape)
    if not (dtype.is_floating_point):
        return (torch.arange(n, dtype=torch.int64) * 37 % 101 - 7).to(dtype).reshape(shape)
    return base.to(dtype).reshape(shape)


def one_rank_tensors() -> dict[str, torch.Tensor]:
    """Dotted name -> full expected value of every tensor in ``one_rank``."""
    return {
        "model.w": _ramp((6, 5), torch.float32),
        "model.b": _ramp((5,), torch.float64),
        "model.half": _ramp((3, 4), torch.float16),
        "model.bf": _ramp((4, 3), torch.bfloat16),
        "model.ids": _ramp((7,), torch.int64),
        "model.small": _ramp((2, 3), torch.int8),
        "model.mask": _ramp((3, 3), torch.bool),
        "model.c": _ramp((2, 2), torch.complex64),
        "model.sharded": _ramp((9, 4), torch.float32, 0.5, 1.0),
        "scalar": torch.tensor(2.5, dtype=torch.float32),
    }


ONE_RANK_VALUES: dict[str, Any] = {
    "epoch": 3, "meta.name": "run-ü", "meta.lr": [0.1, 0.01], "meta.flags.a": True,
    "meta.flags.b": None,
}


def two_rank_tensors() -> dict[str, torch.Tensor]:
    """Dotted name -> full expected value of every tensor in ``two_ranks``."""
    return {"rows": _ramp((8, 6), torch.float32), "cols": _ramp((5, 8), torch.bfloat16, 0.125, 0.0),
            "bias": _ramp((6,), torch.float32, 1.0, 0.0)}


TWO_RANK_VALUES: dict[str, Any] = {"step": 17}


def fill(t: Any, full: torch.Tensor) -> Any:
    """Copy the matching blocks of ``full`` into every local shard of ShardedTensor ``t``; return it."""
    for shard in t.local_shards():
        box = tuple(slice(o, o + n) for o, n in zip(shard.metadata.offsets, shard.metadata.dims))
        shard.tensor.copy_(full[box])
    return t


def _one_rank(folder: Path) -> None:
    import checkpoint
    import sharded_tensor as st
    from sharding import single_split

    full = one_rank_tensors()
    sharded = fill(st.zeros(9, 4, sharding_spec=single_split(0, ["rank:0/cpu"] * 3), dtype=torch.float32),
                   full["model.sharded"])
    model = {k.split(".", 1)[1]: v for k, v in full.items() if k.startswith("model.") and k != "model.sharded"}
    model["sharded"] = sharded
    state = {"model": model, "scalar": full["scalar"], "epoch": 3,
             "meta": {"name": "run-ü", "lr": [0.1, 0.01], "flags": {"a": True, "b": None}}}
    checkpoint.save(state, str(folder), quiet=True)


def _two_ranks(rank: int, world_size: int, folder: str) -> None:
    import checkpoint
    import sharded_tensor as st
    from sharding import single_split

    full = two_rank_tensors()
    state = {"rows": fill(st.zeros(8, 6, sharding_spec=single_split(0, R)), full["rows"]),
             "cols": fill(st.zeros(5, 8, sharding_spec=single_split(1, R), dtype=torch.bfloat16), full["cols"]),
             "bias": full["bias"].clone(), "step": 17}
    checkpoint.save(state, folder, quiet=True)


def main(out: str) -> None:
    from tests.distributed._launch import run_distributed

    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    _one_rank(root / "one_rank")
    run_distributed(_two_ranks, 2, str(root / "two_ranks"))


if __name__ == "__main__":
    main(sys.argv[1])
