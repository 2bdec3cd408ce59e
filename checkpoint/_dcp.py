"""Checkpoints written by ``torch.distributed.checkpoint`` (DCP): load into any layout, convert both ways.

A DCP folder holds ``.metadata`` (the layout of every tensor, **pickled**) and ``*.distcp``
data files. A folder is read as DCP only when the caller says so (``from_format="dcp"``);
its ``.metadata`` is then read by ``_dcp_metadata``'s restricted unpickler, which admits
DCP's metadata classes only, and the data through torch's ``FileSystemReader``.
shardkit's own format never uses pickle, and nothing here changes that.

Loading plans the reads with shardkit's targets: each rank asks torch's reader for the
overlaps between the saved chunks and its own local blocks (``ShardedTensor`` shards,
DTensor local tensors through the same views ``load`` uses, or whole plain tensors), and the
reader copies them straight into those blocks. No rank exchanges data; the plans are local,
so unlike ``dcp.load`` there is no collective planning step.

DCP flattens lists as well as dicts (``optim.param_groups.0.lr``); shardkit keeps a list as
one value. A shardkit entry that is a list (or ``None``) is rebuilt from the DCP entries under
its name. Non-tensor DCP entries are ``torch.save`` blobs and are read with
``torch.load(weights_only=True)``: plain Python values only.
"""

from __future__ import annotations

import io
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from _shardkit import comm as _comm
from sharded_tensor import ShardedTensor

from ._dcp_metadata import read_dcp_metadata
from ._schema import CheckpointError
from ._walk import flatten_state_dict

__all__ = ["convert", "load_dcp"]


def _reader(path: str | os.PathLike[str]) -> tuple[Any, Any]:
    from torch.distributed.checkpoint import FileSystemReader

    local = os.fspath(path)
    if "://" in local and not local.startswith("file://"):
        msg = (f"DCP checkpoint {local!r}: only local DCP folders are read (torch's FileSystemReader); "
               f"copy the folder to a local disk first.")
        raise CheckpointError(msg)
    local = local.removeprefix("file://")
    # DCP's .metadata is a pickle: read with an unpickler that admits DCP's metadata classes only,
    # never with FileSystemReader.read_metadata (plain pickle.load).
    metadata = read_dcp_metadata(local)
    reader = FileSystemReader(local)
    reader.set_up_storage_reader(metadata, True)
    return reader, metadata


@dataclass
class _Targets:
    """What ``read_data`` writes into: local blocks by (name, offsets), bytes values by name."""

    blocks: dict[tuple[str, tuple[int, ...]], torch.Tensor] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    source: str = ""

    # The three calls torch's reader makes on its planner.
    def resolve_tensor(self, item: Any) -> torch.Tensor:
        block = self.blocks[(item.dest_index.fqn, tuple(item.dest_index.offset))]
        for d, (start, length) in enumerate(zip(item.dest_offsets, item.lengths)):
            block = block.narrow(d, start, length)
        return block

    def commit_tensor(self, item: Any, tensor: torch.Tensor) -> None:
        pass

    def load_bytes(self, item: Any, value: io.BytesIO) -> None:
        name = item.dest_index.fqn
        try:
            self.values[name] = torch.load(value, weights_only=True)
        except Exception as exc:
            msg = (f"DCP checkpoint {self.source!r}: the non-tensor entry {name!r} is not a plain Python value "
                   f"(torch.load(weights_only=True) refused it: {exc}); shardkit reads only plain values.")
            raise CheckpointError(msg) from exc


def _blocks(value: Any) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    if isinstance(value, ShardedTensor):
        return [(tuple(s.metadata.offsets), s.tensor) for s in value.local_shards()]
    return [((0,) * value.dim(), value)]


def _rebuild(entries: list[tuple[tuple[Any, ...], Any]]) -> Any:
    """Nested lists/dicts from ``(relative path, value)`` pairs (int keys make lists)."""
    if len(entries) == 1 and not entries[0][0]:
        return entries[0][1]
    groups: dict[Any, list[tuple[tuple[Any, ...], Any]]] = {}
    for path, value in entries:
        groups.setdefault(path[0], []).append((path[1:], value))
    if all(isinstance(k, int) for k in groups):
        return [_rebuild(groups[k]) for k in sorted(groups)]
    return {k: _rebuild(v) for k, v in groups.items()}


def load_dcp(state_dict: dict[str, Any], path: str | os.PathLike[str], *, strict: bool = True,
             cast: bool = False) -> None:
    """Fill ``state_dict`` (ShardedTensor views for DTensors already in place) from a DCP folder.

    Called by ``checkpoint.load`` on every rank, inside its all-ranks error report; local only.
    """
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        MetadataIndex,
    )
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import (
        _create_read_item_for_byteio,
        create_read_items_for_chunk_list,
    )

    source = os.fspath(path)
    reader, metadata = _reader(path)
    saved = metadata.state_dict_metadata
    paths = {fqn: tuple(p) for fqn, p in (metadata.planner_data or {}).items()}
    leaves = list(flatten_state_dict(state_dict))
    names = {name for name, *_ in leaves}
    # DCP entries under a shardkit leaf that DCP flattened further (a list, or a None placeholder).
    nested: dict[str, list[str]] = {}
    for fqn in saved:
        if fqn in names:
            continue
        for name in names:
            if fqn.startswith(name + "."):
                nested.setdefault(name, []).append(fqn)
                break
    used = set(names & set(saved)) | {f for fqns in nested.values() for f in fqns}
    if strict:
        missing = sorted(n for n in names if n not in saved and n not in nested)
        unexpected = sorted(set(saved) - used)
        if missing or unexpected:
            msg = (f"DCP checkpoint {source!r} does not match the state_dict: missing={missing} (in the "
                   f"state_dict, not in the checkpoint), unexpected={unexpected} (in the checkpoint, not in the "
                   f"state_dict); pass strict=False to load only what matches.")
            raise CheckpointError(msg, missing=missing, unexpected=unexpected)

    targets = _Targets(source=source)
    items: list[Any] = []
    after: list[Any] = []  # callbacks once the data is read

    def plan_tensor(fqn: str, value: Any) -> None:
        entry = saved[fqn]
        if tuple(value.shape) != tuple(entry.size):
            msg = (f"tensor {fqn!r} in DCP checkpoint {source!r} has size {tuple(entry.size)}, but the "
                   f"state_dict's {type(value).__name__} has size {tuple(value.shape)}; load into a tensor of "
                   f"the saved size.")
            raise CheckpointError(msg)
        dtype = entry.properties.dtype
        if value.dtype != dtype and not cast:
            msg = (f"tensor {fqn!r} in DCP checkpoint {source!r} has dtype {dtype}, but the state_dict's has "
                   f"{value.dtype}; pass cast=True to convert on load.")
            raise CheckpointError(msg)
        chunks = []
        for offsets, block in _blocks(value):
            if block.numel() == 0:
                continue
            targets.blocks[(fqn, offsets)] = block
            chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=block.shape))
        items.extend(create_read_items_for_chunk_list(fqn, entry, chunks))

    def plan_bytes(fqn: str) -> None:
        items.append(_create_read_item_for_byteio(dest_index=MetadataIndex(fqn), dest_offset=0,
                                                  storage_index=MetadataIndex(fqn), storage_offset=0, length=0))

    def new_full(fqn: str) -> torch.Tensor:
        entry = saved[fqn]
        return torch.empty(entry.size, dtype=entry.properties.dtype)

    for name, parent, key, value in leaves:
        if name in nested:
            parts: list[tuple[tuple[Any, ...], tuple[str, Any]]] = []
            for fqn in nested[name]:
                tail = _tail(paths.get(fqn), fqn, name)
                if isinstance(saved[fqn], BytesStorageMetadata):
                    plan_bytes(fqn)
                    parts.append((tail, ("bytes", fqn)))
                else:
                    tensor = new_full(fqn)
                    plan_tensor(fqn, tensor)
                    parts.append((tail, ("tensor", tensor)))

            def finish(parent: Any = parent, key: Any = key, parts: list[Any] = parts) -> None:
                resolved = [(p, targets.values[v] if kind == "bytes" else v) for p, (kind, v) in parts]
                parent[key] = _rebuild(resolved)
            after.append(finish)
            continue
        entry = saved.get(name)
        if entry is None:
            continue
        if isinstance(entry, BytesStorageMetadata):
            if isinstance(value, (torch.Tensor, ShardedTensor)) and not (type(value) is torch.Tensor
                                                                         and value.dim() == 0):
                msg = (f"DCP checkpoint {source!r} holds a non-tensor value for {name!r}, but the state_dict "
                       f"has a {type(value).__name__} there.")
                raise CheckpointError(msg)
            plan_bytes(name)

            def finish_value(parent: Any = parent, key: Any = key, name: str = name, value: Any = value) -> None:
                loaded = targets.values[name]
                if type(value) is torch.Tensor and value.dim() == 0:
                    value.fill_(loaded)
                else:
                    parent[key] = loaded
            after.append(finish_value)
            continue
        if value is None:
            value = new_full(name)
            parent[key] = value  # type: ignore[index]
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and len(entry.size) == 0:
            scalar = new_full(name)
            kind = type(value)
            after.append(lambda parent=parent, key=key, scalar=scalar, kind=kind:
                         parent.__setitem__(key, kind(scalar.item())))
            value = scalar
        if not isinstance(value, (torch.Tensor, ShardedTensor)):
            msg = (f"DCP checkpoint {source!r} holds a tensor for {name!r}, but the state_dict has "
                   f"{type(value).__name__} {value!r} there; put a tensor (or None) under that name.")
            raise CheckpointError(msg)
        plan_tensor(name, value)

    plan = reader.prepare_local_plan(LoadPlan(items))
    plan = reader.prepare_global_plan([plan])[0]
    with torch.no_grad():
        reader.read_data(plan, targets).wait()
    for callback in after:
        callback()


def convert(path: str | os.PathLike[str], output: str | os.PathLike[str], *,
            from_format: Literal["shardkit", "dcp"] = "shardkit",
            to_format: Literal["shardkit", "dcp", "safetensors"] = "shardkit") -> None:
    """Convert a checkpoint between shardkit's format, a DCP folder and one safetensors file. One process.

    - ``from_format="dcp"``: read a folder written by ``torch.distributed.checkpoint.save``
      (its ``.metadata`` is a pickle, read with a restricted unpickler that admits DCP's
      metadata classes only) into a shardkit checkpoint
      (``to_format="shardkit"``) or one ``.safetensors`` file (``to_format="safetensors"``).
    - ``to_format="dcp"``: write a shardkit checkpoint as a DCP folder that ``dcp.load`` reads
      under any layout (full tensors in one ``.distcp`` file; non-tensor values as DCP values).

    The whole checkpoint passes through this process's memory once. Run it without a process
    group (or on one rank of a world of one).

    Args:
        path: the source folder (a DCP folder must be local).
        output: the destination folder (or ``.safetensors`` file).
        from_format: ``"shardkit"`` or ``"dcp"``.
        to_format: ``"shardkit"``, ``"dcp"`` or ``"safetensors"``.

    Raises:
        ValueError: an unsupported pair of formats, or a multi-rank process group.
        CheckpointError: the source is not a valid checkpoint of that format.

    Example:
        >>> checkpoint.convert("dcp_ckpt", "ckpt", from_format="dcp")  # doctest: +SKIP
        >>> checkpoint.convert("ckpt", "dcp_ckpt", to_format="dcp")  # doctest: +SKIP
    """
    if (from_format, to_format) not in {("dcp", "shardkit"), ("dcp", "safetensors"), ("shardkit", "dcp")}:
        msg = (f"convert(from_format={from_format!r}, to_format={to_format!r}) is not supported; use "
               f"from_format='dcp' with to_format='shardkit' or 'safetensors', or from_format='shardkit' with "
               f"to_format='dcp' (use checkpoint.consolidate for shardkit -> safetensors).")
        raise ValueError(msg)
    _, world = _comm.rank_and_world(None)
    if world != 1:
        msg = (f"convert runs in one process, but a process group of {world} ranks is initialized; call it "
               f"from a single process (e.g. the command line: python -m checkpoint convert).")
        raise ValueError(msg)
    if from_format == "dcp":
        state = _read_dcp_full(path)
        if to_format == "shardkit":
            from ._save import save

            save(state, output, quiet=True)
        else:
            _write_safetensors(state, output)
        return
    _write_dcp(path, output)


def _read_dcp_full(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Every entry of a DCP folder as full CPU tensors and plain values, under shardkit names.

    DCP's dotted names are kept, except that entries DCP flattened out of a list
    (``optim.param_groups.0.lr``) are regrouped into that list (``optim.param_groups``).
    """
    _, metadata = _reader(path)
    flat: dict[str, Any] = {}
    for fqn in metadata.state_dict_metadata:
        where = tuple((metadata.planner_data or {}).get(fqn, ()))
        first_index = next((i for i, part in enumerate(where) if isinstance(part, int)), None)
        flat[fqn if first_index is None else ".".join(str(p) for p in where[:first_index])] = None
    load_dcp(flat, path)
    return flat


def _tail(where: tuple[Any, ...] | None, fqn: str, name: str) -> tuple[Any, ...]:
    """The part of DCP's path for ``fqn`` below the shardkit leaf ``name`` (ints are list indices)."""
    if where:
        for k in range(len(where) + 1):
            if ".".join(str(p) for p in where[:k]) == name:
                return tuple(where[k:])
    return tuple(int(p) if p.isdigit() else p for p in fqn[len(name) + 1:].split("."))


def _write_safetensors(state: dict[str, Any], output: str | os.PathLike[str]) -> None:
    import json

    from safetensors.torch import save_file

    tensors, values = {}, {}
    for name, _, _, value in flatten_state_dict(state):
        if isinstance(value, torch.Tensor):
            tensors[name] = value.contiguous()
        else:
            values[name] = value
    save_file(tensors, os.fspath(output), metadata={"shardkit.values": json.dumps(values, default=str)})
    # safetensors creates its file private (0600); give it the mode of any other file written
    # here (consolidate's, a checkpoint's): 0666 less the umask, 0644 usually.
    os.chmod(output, 0o666 & ~_umask())


def _umask() -> int:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    # Elsewhere the umask can only be read by setting it; put it straight back.
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _write_dcp(path: str | os.PathLike[str], output: str | os.PathLike[str]) -> None:
    import torch.distributed.checkpoint as dcp

    from ._load import load
    from ._storage import read_metadata

    metadata = read_metadata(path)
    state: dict[str, Any] = {name: None for name in metadata.tensors}
    state.update(metadata.values)
    load(state, path, quiet=True)
    with warnings.catch_warnings():
        # dcp.save notes that it saves in one process: that is the point here.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(os.fspath(output)), no_dist=True)
