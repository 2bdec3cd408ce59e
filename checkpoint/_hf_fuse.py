"""Per-expert checkpoint tensors read as the fused tensors of a model, by byte ranges.

transformers 5 keeps a mixture-of-experts layer's experts as two fused 3-D parameters
(``gate_up_proj`` ``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``), but ``save_pretrained`` still
writes one 2-D tensor per expert and matrix (Mixtral's ``experts.N.w1/w3/w2``, Qwen2-MoE's
``experts.N.gate_proj/up_proj/down_proj``), and ``from_pretrained`` stacks them back
(transformers' ``MergeModulelist``, then ``Concatenate`` of gate and up). Stacking and
concatenating only place whole source tensors side by side, so the fused tensor is described
as a tensor saved in regions: expert ``e``'s gate matrix is the region ``[e, 0:I, :]`` of
``gate_up_proj``, its up matrix ``[e, I:2I, :]``, each region's bytes where the per-expert
tensor lies in its file. The ordinary loader then reads, for each rank, only the overlap of
its blocks with those regions: an expert-parallel rank reads its own experts, a
tensor-parallel rank its rows of every expert, and no rank assembles a fused tensor.

A ``Fusion`` is one such conversion. ``fusion_of`` reads it from a transformers
``WeightConverter`` whose operations are only these placements; any other converter (one
that computes on the data) is not a ``Fusion`` and its tensors keep their names.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._regions import SavedShard
from ._schema import CheckpointError, TensorEntry

__all__ = ["Fusion", "fusion_of", "FusedPiece", "fused_entries"]


@dataclass(frozen=True, slots=True)
class Fusion:
    """Source tensors stacked on ``stack_dim`` (over the ``*`` index), then concatenated on ``cat_dim``.

    ``sources`` are the source patterns in concatenation order (``*`` stands for the index
    of the stacked tensors); ``None`` for a dimension means no stacking / no concatenation.
    """

    sources: tuple[str, ...]
    stack_dim: int | None
    cat_dim: int | None


def fusion_of(converter: Any) -> Fusion | None:
    """The ``Fusion`` a transformers ``WeightConverter`` performs, or ``None`` if it computes on data."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = list(getattr(converter, "operations", ()))
    stack_dim = cat_dim = None
    if ops and type(ops[0]) is MergeModulelist:
        stack_dim = ops.pop(0).dim
    if ops and type(ops[0]) is Concatenate:
        cat_dim = ops.pop(0).dim
    sources = tuple(converter.source_patterns)
    if ops or (stack_dim is None and cat_dim is None) or (cat_dim is None and len(sources) != 1):
        return None
    return Fusion(sources, stack_dim, cat_dim)


@dataclass(frozen=True, slots=True)
class FusedPiece:
    """Checkpoint tensor ``name`` is source ``source`` (an index into ``Fusion.sources``) of ``target``."""

    name: str
    target: str
    fusion: Fusion
    source: int


def _index(pattern: str, name: str) -> int | None:
    """The number ``*`` stands for in ``name`` (``None`` for a pattern without ``*``)."""
    if "*" not in pattern:
        return None
    head, _, tail = pattern.partition("*")
    found = re.search(re.escape(head) + r"(\d+)" + re.escape(tail), name)
    return int(found.group(1)) if found else None


def fused_entries(pieces: Sequence[FusedPiece], renamed: Mapping[str, str], tensors: Mapping[str, TensorEntry],
                  *, source: str) -> dict[str, TensorEntry]:
    """Each fused target's ``TensorEntry``: its pieces' saved regions, placed where the fusion puts them.

    ``renamed`` maps a checkpoint name to the name the pattern matches (after the model's
    renamings). A target whose pieces cannot be placed (an expert missing, shapes or dtypes
    that differ) raises.

    Raises:
        CheckpointError: naming the target and what does not fit.
    """
    by_target: dict[str, list[FusedPiece]] = {}
    for piece in pieces:
        by_target.setdefault(piece.target, []).append(piece)
    out: dict[str, TensorEntry] = {}
    for target, group in by_target.items():
        out[target] = _fused(target, group, renamed, tensors, source)
    return out


def _fused(target: str, group: list[FusedPiece], renamed: Mapping[str, str], tensors: Mapping[str, TensorEntry],
           source: str) -> TensorEntry:
    fusion = group[0].fusion
    where = f"{source!r}: the tensors fused into {target!r}"
    # source pattern -> stacking index -> checkpoint name
    parts: dict[int, dict[int | None, str]] = {i: {} for i in range(len(fusion.sources))}
    for piece in group:
        index = None
        if fusion.stack_dim is not None:
            index = _index(fusion.sources[piece.source], renamed[piece.name])
            if index is None:
                msg = f"{where}: no index in {piece.name!r} where {fusion.sources[piece.source]!r} has '*'."
                raise CheckpointError(msg)
        if index in parts[piece.source]:
            msg = f"{where}: {parts[piece.source][index]!r} and {piece.name!r} both take place {index}."
            raise CheckpointError(msg)
        parts[piece.source][index] = piece.name
    dtypes = {tensors[name].dtype for members in parts.values() for name in members.values()}
    if len(dtypes) != 1:
        msg = (f"{where} have different dtypes {sorted(map(str, dtypes))}; they can be fused only when all are "
               f"one dtype.")
        raise CheckpointError(msg)
    blocks: list[tuple[torch.Size, list[tuple[tuple[int, ...], str]]]] = []  # per source: stacked size, (offset, name)
    for i, members in parts.items():
        if not members:
            msg = (f"{where}: the checkpoint holds none matching {fusion.sources[i]!r} (it holds "
                   f"{sorted(_names(parts))}).")
            raise CheckpointError(msg)
        shapes = {tuple(tensors[name].size) for name in members.values()}
        if len(shapes) != 1:
            msg = f"{where}: the tensors matching {fusion.sources[i]!r} have different shapes {sorted(shapes)}."
            raise CheckpointError(msg)
        shape = shapes.pop()
        if fusion.stack_dim is None:
            blocks.append((torch.Size(shape), [((0,) * len(shape), members[None])]))
            continue
        indices = sorted(k for k in members if k is not None)
        if indices != list(range(len(members))):
            missing = sorted(set(range(max(indices) + 1)) - set(indices))
            msg = (f"{where}: the tensors matching {fusion.sources[i]!r} are numbered {indices}; "
                   f"{missing} are missing (every index from 0 must be present).")
            raise CheckpointError(msg)
        d = fusion.stack_dim
        stacked = torch.Size((*shape[:d], len(indices), *shape[d:]))
        placed = [(tuple(k if j == d else 0 for j in range(len(stacked))), members[k]) for k in indices]
        blocks.append((stacked, placed))
    size, regions = _concatenated(blocks, fusion.cat_dim, where, fusion.sources)
    shards: list[SavedShard] = []
    for offsets, name in regions:
        for shard in tensors[name].shards:
            dims, at = shard.dims, shard.offsets
            if fusion.stack_dim is not None:
                d = fusion.stack_dim
                dims, at = (*dims[:d], 1, *dims[d:]), (*at[:d], 0, *at[d:])
            shards.append(dataclasses.replace(shard, offsets=tuple(a + o for a, o in zip(at, offsets)),
                                              dims=tuple(dims)))
    return TensorEntry(size, dtypes.pop(), tuple(shards))


def _concatenated(blocks: list[tuple[torch.Size, list[tuple[tuple[int, ...], str]]]], cat_dim: int | None,
                  where: str, patterns: tuple[str, ...]) -> tuple[torch.Size, list[tuple[tuple[int, ...], str]]]:
    if cat_dim is None:
        return blocks[0]
    first = blocks[0][0]
    d = cat_dim % len(first)
    for (size, _), pattern in zip(blocks, patterns):
        if len(size) != len(first) or any(a != b for j, (a, b) in enumerate(zip(size, first)) if j != d):
            msg = (f"{where}: {pattern!r} gives size {tuple(size)}, which cannot be concatenated on dim {d} with "
                   f"{patterns[0]!r}'s {tuple(first)}.")
            raise CheckpointError(msg)
    regions: list[tuple[tuple[int, ...], str]] = []
    start = 0
    for size, placed in blocks:
        regions.extend((tuple(o + (start if j == d else 0) for j, o in enumerate(offsets)), name)
                       for offsets, name in placed)
        start += size[d]
    return torch.Size((*first[:d], start, *first[d + 1:])), regions


def _names(parts: Mapping[int, Mapping[int | None, str]]) -> list[str]:
    return [name for members in parts.values() for name in members.values()]
