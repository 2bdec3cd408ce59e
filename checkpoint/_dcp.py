"""Checkpoints written by ``torch.distributed.checkpoint`` (DCP) as a checkpoint source.

A DCP folder holds ``.metadata`` (the layout of every tensor, **pickled**) and ``*.distcp``
data files. A folder is read as DCP only when the caller says so (``from_format="dcp"``);
its ``.metadata`` is then read by ``_dcp_metadata``'s restricted unpickler, which admits
DCP's metadata classes only, and the data through torch's ``FileSystemReader``, which reads
each saved chunk with ``torch.load(weights_only=True)``. shardkit's own format never uses
pickle, and nothing here changes that.

``DcpSource`` fills the blocks ``_load.fill`` hands it: each rank asks torch's reader for the
overlaps between the saved chunks and its own local blocks (``ShardedTensor`` shards, DTensor
local tensors through the same views ``load`` uses, or whole plain tensors), and the reader
copies them straight into those blocks. No rank exchanges data; the plans are local, so
unlike ``dcp.load`` there is no collective planning step.

DCP flattens lists as well as dicts (``optim.param_groups.0.lr``); shardkit keeps a list as
one value. A state_dict leaf that is a list (or ``None``) gets the value rebuilt from the DCP
entries under its name; without a state_dict (``convert``), entries are regrouped at their
first list index. Non-tensor DCP entries are ``torch.save`` blobs, read with
``torch.load(weights_only=True)``: plain Python values only.
"""

from __future__ import annotations

import io
import os
import zipfile
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ._dcp_metadata import read_dcp_metadata
from ._hf import KeyMap
from ._pickle_scan import PickleRefused, scan
from ._schema import CheckpointError, CheckpointMetadata, TensorEntry
from ._source import Block, Source

__all__ = ["DcpSource"]

MAX_PICKLE_BYTES = 1 << 30
"""Largest pickle of one non-tensor entry read (its object's cost is bounded by ``_pickle_scan`` too)."""


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
        _check_saved_value(value.getvalue(), f"DCP checkpoint {self.source!r}: the non-tensor entry {name!r}")
        try:
            self.values[name] = torch.load(value, weights_only=True)
        except Exception as exc:
            msg = (f"DCP checkpoint {self.source!r}: the non-tensor entry {name!r} is not a plain Python value "
                   f"(torch.load(weights_only=True) refused it: {exc}); shardkit reads only plain values.")
            raise CheckpointError(msg) from exc


def _check_saved_value(blob: bytes, what: str) -> None:
    """Refuse a ``torch.save`` blob whose pickle passes ``_pickle_scan``'s limits, before ``torch.load`` builds it.

    DCP stores a non-tensor entry as ``torch.save``'s zip archive; its object is the member
    ``<archive>/data.pkl``. Anything else (the legacy format, another archive) is refused.
    """
    try:
        with zipfile.ZipFile(io.BytesIO(blob)) as archive:
            members = [info for info in archive.infolist() if info.filename.endswith("/data.pkl")]
            if len(members) != 1 or members[0].file_size > MAX_PICKLE_BYTES:
                msg = (f"{what} is not one torch.save archive holding one data.pkl of at most {MAX_PICKLE_BYTES} "
                       f"bytes; shardkit reads only plain values saved by torch.save.")
                raise CheckpointError(msg)
            data = archive.read(members[0])
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        msg = (f"{what} is not a torch.save archive ({type(exc).__name__}); shardkit reads only plain values saved "
               f"by torch.save.")
        raise CheckpointError(msg) from None
    try:
        scan(data, what=what)
    except PickleRefused as exc:
        raise CheckpointError(str(exc)) from None


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


def _tail(where: tuple[Any, ...] | None, fqn: str, name: str) -> tuple[Any, ...]:
    """The part of DCP's path for ``fqn`` below the shardkit leaf ``name`` (ints are list indices)."""
    if where:
        for k in range(len(where) + 1):
            if ".".join(str(p) for p in where[:k]) == name:
                return tuple(where[k:])
    return tuple(int(p) if p.isdigit() else p for p in fqn[len(name) + 1:].split("."))


class DcpSource(Source):
    """A local DCP folder, its metadata read by the restricted unpickler (``_dcp_metadata``)."""

    format = "dcp"

    def __init__(self, path: str | os.PathLike[str], *, key_map: KeyMap | None = None) -> None:
        local = os.fspath(path)
        if key_map is not None:
            msg = (f"key_map is not supported for DCP checkpoint {local!r}; convert it first "
                   f"(checkpoint.convert(..., from_format='dcp')) and load the shardkit checkpoint with key_map.")
            raise ValueError(msg)
        from torch.distributed.checkpoint import FileSystemReader

        super().__init__(local)
        if "://" in local and not local.startswith("file://"):
            msg = (f"DCP checkpoint {local!r}: only local DCP folders are read (torch's FileSystemReader); "
                   f"copy the folder to a local disk first.")
            raise CheckpointError(msg)
        local = local.removeprefix("file://")
        # DCP's .metadata is a pickle: read with an unpickler that admits DCP's metadata classes only,
        # never with FileSystemReader.read_metadata (plain pickle.load).
        metadata = read_dcp_metadata(local)
        self._reader = FileSystemReader(local)
        self._reader.set_up_storage_reader(metadata, True)
        self._saved: dict[str, Any] = metadata.state_dict_metadata
        self._paths = {fqn: tuple(p) for fqn, p in (metadata.planner_data or {}).items()}

    def _regrouped(self, names: Collection[str] | None) -> dict[str, list[str]]:
        """DCP entries under a state_dict leaf that DCP flattened further (a list, or a ``None`` placeholder)."""
        if names is None:  # the whole checkpoint: entries DCP flattened out of a list go back into it
            names = set()
            for fqn in self._saved:
                where = self._paths.get(fqn, ())
                first = next((i for i, part in enumerate(where) if isinstance(part, int)), None)
                names.add(fqn if first is None else ".".join(str(p) for p in where[:first]))
        nested: dict[str, list[str]] = {}
        for fqn in self._saved:
            if fqn in names:
                continue
            for name in names:
                if fqn.startswith(name + "."):
                    nested.setdefault(name, []).append(fqn)
                    break
        return nested

    def describe(self, names: Collection[str] | None = None) -> CheckpointMetadata:
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata

        nested = self._regrouped(names)
        inside = {fqn for fqns in nested.values() for fqn in fqns}
        tensors: dict[str, TensorEntry] = {}
        plain: list[str] = []
        for fqn, entry in self._saved.items():
            if fqn in inside:
                continue
            if isinstance(entry, BytesStorageMetadata):
                plain.append(fqn)
            else:
                tensors[fqn] = TensorEntry(torch.Size(entry.size), entry.properties.dtype, ())
        # Non-tensor values, and whatever is nested under a leaf (read whole), are read now.
        targets = _Targets(source=self.where)
        items: list[Any] = [self._bytes_item(fqn) for fqn in plain]
        groups: dict[str, list[tuple[tuple[Any, ...], tuple[str, Any]]]] = {}
        for name, fqns in nested.items():
            for fqn in fqns:
                tail = _tail(self._paths.get(fqn), fqn, name)
                entry = self._saved[fqn]
                if isinstance(entry, BytesStorageMetadata):
                    items.append(self._bytes_item(fqn))
                    groups.setdefault(name, []).append((tail, ("bytes", fqn)))
                else:
                    full = torch.empty(entry.size, dtype=entry.properties.dtype)
                    items.extend(self._tensor_items(Block(fqn, TensorEntry(torch.Size(entry.size),
                                                                           entry.properties.dtype, ()),
                                                          (0,) * full.dim(), full), targets))
                    groups.setdefault(name, []).append((tail, ("tensor", full)))
        self._run(items, targets)
        values: dict[str, Any] = {fqn: targets.values[fqn] for fqn in plain}
        for name, parts in groups.items():
            values[name] = _rebuild([(p, targets.values[v] if kind == "bytes" else v) for p, (kind, v) in parts])
        return CheckpointMetadata(tensors=tensors, values=values, files={}, generation="", world_size=0)

    def read(self, blocks: Sequence[Block], *, rank: int = 0, quiet: bool | None = None,
             mmap: bool = False) -> None:
        targets = _Targets(source=self.where)
        items = [item for block in blocks for item in self._tensor_items(block, targets)]
        self._run(items, targets)

    def verify(self, *, quiet: bool | None = None) -> list[str]:
        """Read every tensor (one at a time) and value; the problems found."""
        problems: list[str] = []
        try:
            metadata = self.describe()
        except CheckpointError as exc:
            return [str(exc)]
        for name, entry in metadata.tensors.items():
            try:
                self.read([Block(name, entry, (0,) * len(entry.size), torch.empty(entry.size, dtype=entry.dtype))])
            except (CheckpointError, OSError, RuntimeError, ValueError) as exc:
                problems.append(f"DCP checkpoint {self.where!r}: tensor {name!r} cannot be read: {exc}")
        return problems

    def _bytes_item(self, fqn: str) -> Any:
        from torch.distributed.checkpoint.metadata import MetadataIndex
        from torch.distributed.checkpoint.planner_helpers import _create_read_item_for_byteio

        return _create_read_item_for_byteio(dest_index=MetadataIndex(fqn), dest_offset=0,
                                            storage_index=MetadataIndex(fqn), storage_offset=0, length=0)

    def _tensor_items(self, block: Block, targets: _Targets) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        if block.tensor.numel() == 0:
            return []
        targets.blocks[(block.name, block.offsets)] = block.tensor
        chunk = ChunkStorageMetadata(offsets=torch.Size(block.offsets), sizes=block.tensor.shape)
        return list(create_read_items_for_chunk_list(block.name, self._saved[block.name], [chunk]))

    def _run(self, items: list[Any], targets: _Targets) -> None:
        from torch.distributed.checkpoint.planner import LoadPlan

        if not items:
            return
        plan = self._reader.prepare_global_plan([self._reader.prepare_local_plan(LoadPlan(items))])[0]
        with torch.no_grad():
            self._reader.read_data(plan, targets).wait()  # type: ignore[arg-type]  # the planner calls it makes
