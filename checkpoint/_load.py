"""``checkpoint.load``: fill a state_dict in place, for its current layout, from any checkpoint source.

``load`` opens the checkpoint through ``_sources.open_source`` (shardkit, Hugging Face, or DCP
when named) and hands it to ``fill``, the one fill path every format shares: names matched
(``strict``), values placed, ``None`` entries and Python numbers given tensors of the saved
size and dtype, sizes, dtypes and targets checked, and then the source fills the local
blocks of every tensor (``Source.read``: byte ranges for shardkit and Hugging Face files, in
``_files``; torch's reader for DCP, in ``_dcp``). DTensor entries are filled through
``ShardedTensor`` views of their local tensors (``_dtensor``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from _shardkit import comm as _comm
from sharded_tensor import ShardedTensor

from ._dtensor import dtensor_views
from ._hf import KeyMap
from ._schema import CheckpointError
from ._source import Block, Format, Source
from ._sources import check_format, open_source
from ._unfilled import check_filled, mark_filled
from ._walk import flatten_state_dict

__all__ = ["load", "fill"]


def load(state_dict: dict[str, Any], path: str | os.PathLike[str], *, process_group: _comm.ProcessGroup = None,
         storage_options: Mapping[str, Any] | None = None, strict: bool = True, cast: bool = False,
         key_map: KeyMap | None = None, quiet: bool | None = None,
         timeout: float | None = None, mmap: bool = False,
         from_format: Format | None = None, allow_uninitialized: bool = False) -> dict[str, Any]:
    """Fill ``state_dict`` in place from a checkpoint, whatever layout and world size saved it. Collective.

    A ``ShardedTensor`` entry is filled for its current layout: each rank reads, for each of
    its local shards, only the bytes of the saved regions that overlap it (fsspec range reads).
    A plain tensor receives the full tensor (in place); a ``None`` entry is replaced by a new
    CPU tensor. Non-tensor values replace the entry. Nested dicts match dotted names.
    ``DTensor`` entries (FSDP2, ``parallelize_module``, ``get_state_dict``) are filled in place
    like ``ShardedTensor``s of their layout.

    A folder written by ``torch.distributed.checkpoint.save`` (DCP: ``.metadata`` plus
    ``.distcp`` files) is read only when asked with ``from_format="dcp"``, into any layout.
    DCP's ``.metadata`` is a pickle: it is read with a restricted unpickler that admits
    DCP's metadata classes only and refuses any other global before calling it. Without
    ``from_format``, nothing is ever unpickled.

    ``path`` may also be a Hugging Face safetensors checkpoint: one ``.safetensors`` file, or a
    folder with ``model.safetensors.index.json`` (or a single ``model.safetensors``) and no
    ``shardkit.json``. Each rank then parses every file's header once and reads only the byte
    ranges of its own blocks, so ``shard_model(model, spec, init=False)`` followed by
    ``load(model.state_dict(), hf_folder)`` never holds the full model anywhere. Such files
    carry no checksums: their bytes are checked for length only. Names are converted as
    ``from_pretrained`` converts them (with transformers installed and a ``config.json`` in the
    folder: older names such as GPT-NeoX's ``embed_out``, the base model's prefix), and a tied
    weight the folder omits (GPT-2's ``lm_head``) is filled through the name it is tied to.

    Args:
        state_dict: the (possibly nested) state_dict to fill, e.g. ``model.state_dict()`` of the
            sharded model, with tensors of the right sizes and dtypes.
        path: the checkpoint folder: a local path or any fsspec URL.
        process_group: the group that loads; every rank of it calls ``load``.
        storage_options: passed to the fsspec file system.
        strict: names in the state_dict but not in the checkpoint (missing) or the other way
            round (unexpected) are an error; with ``False`` they are skipped.
        cast: allow a target dtype other than the saved one (values are converted like
            ``Tensor.copy_``, e.g. a bfloat16 file into float32 parameters); without it a dtype
            difference is an error.
        key_map: renames the checkpoint's tensors before they are matched with the
            state_dict: a dict (names it lacks stay as they are) or a callable taking a
            checkpoint name and returning the state_dict name, or ``None`` to skip the tensor
            (e.g. ``lambda k: "model." + k`` to add a prefix).
        quiet: ``True`` hides the progress bar rank 0 shows on a terminal for large loads.
        timeout: seconds a rank waits for the others once its own part is read; a rank that
            crashed or hangs makes the others raise ``CheckpointError`` within this time (at
            once when its connection closes), naming the ranks that did not answer. ``None``:
            the environment variable ``SHARDKIT_TIMEOUT``, else 600 s.
        mmap: local files only: a target block that lies in one contiguous range of a file
            (whole saved regions, row blocks, the output-feature blocks of a Hugging Face
            weight), with the file's dtype, and that no other tensor shares, is pointed at the
            file's pages (a private, copy-on-write mapping) instead of receiving a copy; other
            blocks are copied as usual. Loading then costs almost nothing and pages are read
            when first used; a write (an optimizer step) copies the page it touches and never
            reaches the file. A ``model.state_dict()`` entry shares its parameter's memory, so
            pass ``model.state_dict(keep_vars=True)`` to map the parameters themselves. The
            files must not be modified or truncated while the tensors live (replacing them with
            new files, as ``checkpoint.save`` does, is fine).
        from_format: ``None`` (a shardkit or Hugging Face checkpoint, told apart by their
            files), ``"shardkit"``, ``"huggingface"``, or ``"dcp"`` (a local DCP folder; never
            inferred).
        allow_uninitialized: parameters that ``shard_model(..., init=False)`` allocated without
            values and that this load does not fill are an error naming them, whatever
            ``strict`` says (their memory holds garbage); ``True`` allows it, for a model filled
            from several sources (the unfilled ones stay refused by a later load until filled).

    Returns:
        ``state_dict`` itself.

    Raises:
        CheckpointError: the checkpoint is incomplete (no committed metadata), corrupt
            (checksum, truncated or missing file, malformed metadata, unsafe file name), or does
            not match the state_dict (missing/unexpected names under ``strict``, size, dtype);
            the message names the file and the tensor; parameters left uninitialized by
            ``shard_model(..., init=False)`` that this load would not fill (unless
            ``allow_uninitialized``). A failure on any rank raises on all, as does a rank that
            does not finish within ``timeout``.
        FileNotFoundError: there is no checkpoint at ``path``.

    Example:
        >>> # saved by 4 ranks split by rows; loaded by 2 ranks split by columns
        >>> sd = {"w": st.empty(10, 4, single_split(1, ["rank:0/cpu", "rank:1/cpu"]))}  # doctest: +SKIP
        >>> # rank r reads columns 2r..2r+1 of every row
        >>> checkpoint.load(sd, "ckpt")["w"].local_shard().shape  # doctest: +SKIP
        torch.Size([10, 2])
    """
    check_format(from_format)

    def read() -> None:
        views, restore = dtensor_views(state_dict, process_group)
        rank, _ = _comm.rank_and_world(process_group)
        with open_source(path, from_format=from_format, storage_options=storage_options, key_map=key_map) as source:
            fill(views, source, strict=strict, cast=cast, rank=rank, quiet=quiet, mmap=mmap,
                 allow_uninitialized=allow_uninitialized)
        restore()

    step = f"checkpoint.load from {os.fspath(path) if isinstance(path, (str, os.PathLike)) else path!r}"
    _, world = _comm.rank_and_world(process_group)

    def peer_lost(exc: _comm.CollectiveError) -> CheckpointError:
        return CheckpointError(f"{step} failed: not every one of the {world} ranks finished loading ({exc}); a rank "
                               f"crashed, is stuck, or is not calling load.")

    _comm.agree(step, read, process_group, timeout=timeout, error=CheckpointError, lost=peer_lost)
    return state_dict


def fill(state_dict: dict[Any, Any], source: Source, *, strict: bool = True, cast: bool = False,
         rank: int = 0, quiet: bool | None = None, mmap: bool = False, allow_uninitialized: bool = False) -> None:
    """Fill ``state_dict`` in place from ``source``: the one fill path of every checkpoint format.

    Matches names (``strict``), places non-tensor values, allocates ``None`` entries (after
    ``source.prepare``), checks sizes, dtypes and targets, then has the source read every
    local block at once (``Source.read``).
    """
    where = source.where
    leaves: list[tuple[str, Any, Any, Any]] = list(flatten_state_dict(state_dict))
    names = {name for name, *_ in leaves}
    tied = source.match_names((name, value) for name, _, _, value in leaves)
    metadata = source.describe(names)
    saved = set(metadata.tensors) | set(metadata.values) | tied
    if not allow_uninitialized:  # before strict's report: the more precise one after init=False
        check_filled(leaves, saved, where)
    if strict:
        missing, unexpected = sorted(names - saved), sorted(saved - names)
        if missing or unexpected:
            msg = (f"checkpoint {where!r} does not match the state_dict: missing={missing} (in the "
                   f"state_dict, not in the checkpoint), unexpected={unexpected} (in the checkpoint, not in "
                   f"the state_dict); pass strict=False to load only what matches.")
            raise CheckpointError(msg, missing=missing, unexpected=unexpected)
    blocks: list[Block] = []
    scalars: list[tuple[Any, Any, type, torch.Tensor]] = []
    for name, parent, key, value in leaves:
        if name in metadata.values:
            if _is_scalar_tensor(value) and _is_number(metadata.values[name]):
                # Optimizer steps: a number in shardkit's optimizer state, a 0-dim tensor in torch's.
                value.fill_(metadata.values[name])
                continue
            if isinstance(value, (torch.Tensor, ShardedTensor)):
                msg = (f"checkpoint {where!r} holds a non-tensor value for {name!r}, but the state_dict has a "
                       f"{type(value).__name__} there.")
                raise CheckpointError(msg)
            parent[key] = metadata.values[name]
            continue
        entry = metadata.tensors.get(name)
        if entry is None:
            continue
        if _is_number(value) and len(entry.size) == 0:
            tensor = torch.empty((), dtype=entry.dtype)
            scalars.append((parent, key, type(value), tensor))
            value = tensor
        if value is None:
            source.prepare(name, entry)
            value = torch.empty(entry.size, dtype=entry.dtype)
            parent[key] = value
        if not isinstance(value, (torch.Tensor, ShardedTensor)):
            msg = (f"checkpoint {where!r} holds a tensor for {name!r}, but the state_dict has "
                   f"{type(value).__name__} {value!r} there; put a tensor (or None) under that name.")
            raise CheckpointError(msg)
        if isinstance(value, ShardedTensor) and (pending := value.sharding_metadata().pending) is not None:
            msg = (f"cannot load {name!r} from {where!r} into a ShardedTensor holding partial values "
                   f"(partial({pending.reduce_op})): every holder would get the whole tensor; "
                   f"reshard it to a plain layout (a split or DevicePlacement) before loading.")
            raise ValueError(msg)
        if tuple(value.shape) != tuple(entry.size):
            msg = (f"tensor {name!r} in {where!r} has size {tuple(entry.size)}, but the state_dict's "
                   f"{type(value).__name__} has size {tuple(value.shape)}; load into a tensor of the saved size.")
            raise CheckpointError(msg)
        if value.dtype != entry.dtype and not cast:
            msg = (f"tensor {name!r} in {where!r} has dtype {entry.dtype}, but the state_dict's has "
                   f"{value.dtype}; pass cast=True to convert on load.")
            raise CheckpointError(msg)
        _check_target(name, value, where)
        blocks.extend(Block(name, entry, offsets, tensor) for offsets, tensor in _targets(value))
    settle = mark_filled(leaves, saved)
    source.read(blocks, rank=rank, quiet=quiet, mmap=mmap)
    settle()
    for parent, key, kind, tensor in scalars:
        parent[key] = kind(tensor.item())


def _targets(value: Any) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """``(global offsets, tensor)`` of every local block to fill."""
    if isinstance(value, ShardedTensor):
        return [(tuple(s.metadata.offsets), s.tensor) for s in value.local_shards()]
    return [((0,) * value.dim(), value)]


def _check_target(name: str, value: Any, source: str) -> None:
    """Refuse targets a load cannot fill: on the meta device (no memory) or with overlapping memory."""
    blocks = [s.tensor for s in value.local_shards()] if isinstance(value, ShardedTensor) else [value]
    for block in blocks:
        if block.device.type == "meta":
            msg = (f"cannot load {name!r} from {source!r} into a tensor on the meta device: it has no memory to "
                   f"fill. Materialize it first (e.g. model.to_empty(device='cpu'), or shard_model(..., init=False)).")
            raise CheckpointError(msg)
        if torch._debug_has_internal_overlap(block) == 1:  # 1: definitely overlaps (stride 0, expand)
            msg = (f"cannot load {name!r} from {source!r} into a tensor whose elements overlap in memory (stride "
                   f"{tuple(block.stride())} for size {tuple(block.shape)}, e.g. from expand()); load into a tensor "
                   f"with its own memory (.clone() or .contiguous()).")
            raise CheckpointError(msg)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_scalar_tensor(value: Any) -> bool:
    return type(value) is torch.Tensor and value.dim() == 0
