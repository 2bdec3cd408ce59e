"""A terminal picture of which rank holds which block of a ShardedTensor."""

from __future__ import annotations

import sys
from typing import TextIO

import torch

from _shardkit import comm as _comm
from sharding import ShardedTensorMetadata

from ._tensor import ShardedTensor

__all__ = ["visualize_sharding"]

_MAX_BLOCKS = 16  # beyond this many blocks along a dimension, a list reads better than a grid


def _cuts(metadata: ShardedTensorMetadata, dim: int) -> list[int]:
    n = metadata.size[dim]
    points = {0, n}
    for s in metadata.shards:
        points.update((s.offsets[dim], s.offsets[dim] + s.dims[dim]))
    return sorted(p for p in points if p <= n)


def _holders(metadata: ShardedTensorMetadata, lo: tuple[int, ...]) -> str:
    ranks = sorted({s.rank for s in metadata.shards if s.rank is not None
                    and s.numel > 0 and all(o <= x < o + n for x, o, n in zip(lo, s.offsets, s.dims))})
    if not ranks:
        return "-"
    holders = "rank " + ",".join(str(r) for r in ranks)
    # Partial values are not replicas: say which reduction of them the tensor is.
    pending = metadata.pending
    return holders if pending is None else f"partial({pending.reduce_op}) {holders}"


def _not_sharded(value: object) -> str:
    if isinstance(value, torch.Tensor):
        kind = "a DTensor" if type(value).__name__ == "DTensor" else f"a plain {type(value).__name__}"
        fix = ("convert it with st.from_dtensor(tensor) first" if kind == "a DTensor" else
               "shard it first (st.shard_tensor(tensor, spec)); a sharded model's parameters are "
               "ShardedTensors in model.state_dict(), e.g. st.visualize_sharding(model.state_dict()['0.weight'])")
        return (f"visualize_sharding draws a ShardedTensor or a ShardedTensorMetadata, got {kind} of size "
                f"{tuple(value.shape)}, which has no sharding to draw; {fix}.")
    return (f"visualize_sharding draws a ShardedTensor or a ShardedTensorMetadata, got "
            f"{type(value).__name__} {value!r:.80}.")


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    line = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
    out = [line]
    for i, row in enumerate(rows):
        out.append("| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths)) + " |")
        if i == 0:
            out.append(line.replace("-", "="))
    out.append(line)
    return "\n".join(out)


def visualize_sharding(tensor: ShardedTensor | ShardedTensorMetadata, *, file: TextIO | None = None,
                       all_ranks: bool = False) -> str:
    """Draw which rank holds which block of a 1-D or 2-D tensor; list the shards for more dims.

    Partial values show as ``partial(sum) rank 0,1`` (and ``partial(sum)`` in the title): the
    tensor is the sum of the holders' values, not a replica.

    The picture comes from metadata alone (no communication). It is printed on rank 0 (or on
    every rank with ``all_ranks=True``) and returned on every rank.

    Example:
        >>> spec = mesh([["rank:0/cpu", "rank:1/cpu"], ["rank:2/cpu", "rank:3/cpu"]])
        >>> _ = st.visualize_sharding(spec.build_metadata((8, 8)))
        size=(8, 8) dtype=float32 shards=4 ranks=[0, 1, 2, 3]
        +----------+----------+----------+
        |          | cols 0:4 | cols 4:8 |
        +==========+==========+==========+
        | rows 0:4 | rank 0   | rank 1   |
        | rows 4:8 | rank 2   | rank 3   |
        +----------+----------+----------+
    """
    if not isinstance(tensor, ShardedTensor | ShardedTensorMetadata):
        raise TypeError(_not_sharded(tensor))
    metadata = tensor.sharding_metadata() if isinstance(tensor, ShardedTensor) else tensor
    size = tuple(metadata.size)
    title = (f"size={size} dtype={str(metadata.dtype).removeprefix('torch.')} "
             f"shards={len(metadata.shards)} ranks={list(metadata.ranks)}"
             + ("" if metadata.pending is None else f" partial({metadata.pending.reduce_op})"))
    too_many = any(len(_cuts(metadata, d)) - 1 > _MAX_BLOCKS for d in range(min(len(size), 2)))
    if len(size) == 1 and not too_many:
        cuts = _cuts(metadata, 0)
        header = [""] + [f"{a}:{b}" for a, b in zip(cuts, cuts[1:])]
        body = ["holder"] + [_holders(metadata, (a,)) for a in cuts[:-1]]
        picture = _table([header, body])
    elif len(size) == 2 and not too_many:
        rows, cols = _cuts(metadata, 0), _cuts(metadata, 1)
        table = [[""] + [f"cols {a}:{b}" for a, b in zip(cols, cols[1:])]]
        for r0, r1 in zip(rows, rows[1:]):
            table.append([f"rows {r0}:{r1}"] + [_holders(metadata, (r0, c)) for c in cols[:-1]])
        picture = _table(table) if len(table[0]) > 1 and len(table) > 1 else "(empty tensor)"
    else:
        table = [["shard", "rank", "device", "offsets", "dims"]]
        for i, s in enumerate(metadata.shards[:_MAX_BLOCKS * 4]):
            table.append([str(i), str(s.rank), str(s.device.device), str(s.offsets), str(s.dims)])
        picture = _table(table)
        if len(metadata.shards) > _MAX_BLOCKS * 4:
            picture += f"\n... {len(metadata.shards) - _MAX_BLOCKS * 4} more shards"
    text = f"{title}\n{picture}"
    rank, _ = _comm.rank_and_world(tensor.process_group if isinstance(tensor, ShardedTensor) else None)
    if all_ranks or rank == 0:
        print(text, file=file if file is not None else sys.stdout)
    return text
