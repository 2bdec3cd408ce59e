"""DCP's ``.metadata`` file, read with an unpickler that admits DCP's own metadata classes only.

``torch.distributed.checkpoint`` stores a folder's description as a pickle of its
``Metadata`` dataclass. Ordinary unpickling calls whatever the pickle names, so a planted
``.metadata`` would run code. Here every global the pickle names (``GLOBAL``,
``STACK_GLOBAL``, extension codes: all go through ``find_class``) is looked up in a fixed
allow-list *before* anything is imported, returned or called; anything else raises
``CheckpointError`` naming it. Admitted:

- DCP's metadata dataclasses (``torch.distributed.checkpoint.metadata``: ``Metadata``,
  ``MetadataIndex``, ``StorageMeta``, ``TensorStorageMetadata``, ``BytesStorageMetadata``,
  ``ChunkStorageMetadata``, ``TensorProperties`` and its memory-format enum) and the storage
  record of DCP's file system writer (``filesystem._StorageInfo``);
- ``torch.Size``; torch dtypes, layouts and memory formats, which are values, not callables
  (found in ``vars(torch)``, never through ``torch.__getattr__``), and
  ``torch.serialization._get_layout``, the lookup torch pickles layouts with;
- paths (``pathlib``'s path classes, DCP's ``checkpoint_id``) and ``collections.OrderedDict``.

The opcodes that build lists, dicts, tuples and sets need no global. The result is then
checked to be a well-formed DCP ``Metadata``: names are strings, sizes and chunk boxes are
tuples of non-negative ints inside their tensor, and every data file is a plain file name
inside the folder (so a crafted record cannot send a read elsewhere).
"""

from __future__ import annotations

import collections
import io
import math
import pathlib
import pickle
import reprlib
from typing import Any

import torch

from ._pickle_scan import PickleRefused, scan
from ._safe_open import read_regular
from ._schema import CheckpointError, check_file_name
from ._strict_json import QUOTE

__all__ = ["DCP_METADATA_FILE", "read_dcp_metadata", "parse_dcp_metadata"]

DCP_METADATA_FILE = ".metadata"

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_FILESYSTEM_MODULE = "torch.distributed.checkpoint.filesystem"

# (module, name) of every class or function a DCP metadata pickle may name.
_ALLOWED_CALLABLES: frozenset[tuple[str, str]] = frozenset({
    (_METADATA_MODULE, "Metadata"),
    (_METADATA_MODULE, "MetadataIndex"),
    (_METADATA_MODULE, "StorageMeta"),
    (_METADATA_MODULE, "TensorStorageMetadata"),
    (_METADATA_MODULE, "BytesStorageMetadata"),
    (_METADATA_MODULE, "ChunkStorageMetadata"),
    (_METADATA_MODULE, "TensorProperties"),
    (_METADATA_MODULE, "_MEM_FORMAT_ENCODING"),
    (_FILESYSTEM_MODULE, "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PurePath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("pathlib", "PosixPath"),
    ("pathlib", "Path"),
    ("collections", "OrderedDict"),
})


def _torch_values() -> dict[str, object]:
    """torch's dtypes, layouts and memory formats by name, from the module's own dict (no import hooks)."""
    kinds = (torch.dtype, torch.layout, torch.memory_format)
    return {name: value for name, value in vars(torch).items() if isinstance(value, kinds)}


def _resolve(module: str, name: str) -> object:
    """The allowed object ``module.name``; only called for pairs in the allow-list."""
    if module == "torch" and name == "Size":
        return torch.Size
    if module == "pathlib":
        return getattr(pathlib, name)
    if module == "collections":
        return collections.OrderedDict
    if module == "torch.serialization":
        from torch.serialization import _get_layout

        return _get_layout
    if module == _FILESYSTEM_MODULE:
        from torch.distributed.checkpoint import filesystem

        return filesystem._StorageInfo
    from torch.distributed.checkpoint import metadata

    return getattr(metadata, name)


class _RestrictedUnpickler(pickle.Unpickler):
    """A pickle reader whose globals are DCP's metadata classes and torch's dtype-like values only."""

    def __init__(self, data: bytes, source: str) -> None:
        super().__init__(io.BytesIO(data))
        self._source = source
        self._torch_values = _torch_values()

    def find_class(self, module: str, name: str) -> Any:
        # Checked before anything is imported or returned: a refused name is never touched.
        if (module, name) in _ALLOWED_CALLABLES:
            return _resolve(module, name)
        if module == "torch" and name in self._torch_values:
            return self._torch_values[name]
        msg = (f"DCP metadata {self._source!r} names the global {_dotted(module, name)}, which is not one of DCP's "
               f"metadata classes; refusing to unpickle it (a DCP .metadata file holds only DCP's dataclasses, "
               f"torch.Size and torch dtypes). The file is corrupt or was crafted to run code.")
        raise CheckpointError(msg)

    def persistent_load(self, pid: Any) -> Any:
        msg = f"DCP metadata {self._source!r} holds a persistent reference ({_shown(pid)}); DCP metadata never does."
        raise CheckpointError(msg)


def parse_dcp_metadata(data: bytes, *, source: str = "?") -> Any:
    """DCP ``Metadata`` from the bytes of a ``.metadata`` file, read with the restricted unpickler.

    Raises:
        CheckpointError: the pickle names a global outside the allow-list, is malformed, or
            does not describe a well-formed DCP checkpoint.
    """
    try:
        scan(data, what=f"DCP metadata {source!r}")  # its cost bounded before anything is built
    except PickleRefused as exc:
        if exc.malformed:
            msg = f"DCP metadata {source!r} is not a readable DCP metadata pickle ({exc.detail})."
            raise CheckpointError(msg) from None
        raise CheckpointError(str(exc)) from None
    try:
        metadata = _RestrictedUnpickler(data, source).load()
    except CheckpointError:
        raise
    except Exception as exc:  # a malformed pickle: any of the unpickler's many errors
        msg = f"DCP metadata {source!r} is not a readable DCP metadata pickle ({type(exc).__name__}: {exc})."
        raise CheckpointError(msg) from None
    _check(metadata, source)
    return metadata


def read_dcp_metadata(path: str) -> Any:
    """The DCP ``Metadata`` of the local folder ``path`` (``path/.metadata``), restricted as above.

    Raises:
        FileNotFoundError: ``path`` holds no ``.metadata`` file.
        CheckpointError: see ``parse_dcp_metadata``.
    """
    source = str(pathlib.PurePosixPath(path) / DCP_METADATA_FILE)
    try:
        data = read_regular(source)
    except FileNotFoundError:
        msg = f"no DCP checkpoint at {path!r}: {source!r} does not exist."
        raise FileNotFoundError(msg) from None
    return parse_dcp_metadata(data, source=source)


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 3, QUOTE, QUOTE, QUOTE


def _shown(value: object) -> str:
    """A bounded ``repr`` for messages: a crafted value is never printed whole."""
    try:
        return _REPR.repr(value)
    except Exception:  # a crafted object whose repr fails
        return f"a {type(value).__name__}"


def _dotted(module: str, name: str) -> str:
    """``module.name``, cut to ``2 * QUOTE`` characters (a crafted pickle may name a megabyte-long global)."""
    text = f"{module}.{name}"
    return text if len(text) <= 2 * QUOTE else f"{text[:2 * QUOTE]}... ({len(text)} characters)"


def _fail(source: str, problem: str) -> CheckpointError:
    return CheckpointError(f"malformed DCP metadata {source!r}: {problem}; the file is corrupt or not DCP's.")


def _box(value: object, ndim: int) -> bool:
    return (isinstance(value, torch.Size) and len(value) == ndim
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value))


def _check(metadata: object, source: str) -> None:
    """Raise ``CheckpointError`` unless ``metadata`` is a well-formed DCP ``Metadata``."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    if not isinstance(metadata, Metadata):
        raise _fail(source, f"it holds a {type(metadata).__name__}, not DCP's Metadata")
    entries = metadata.state_dict_metadata
    if not isinstance(entries, dict):
        raise _fail(source, "state_dict_metadata is not a dict")
    for name, entry in entries.items():
        if not isinstance(name, str):
            raise _fail(source, f"entry name {_shown(name)} is not a str")
        if isinstance(entry, BytesStorageMetadata):
            continue
        if not (isinstance(entry, TensorStorageMetadata) and isinstance(entry.properties, TensorProperties)
                and isinstance(entry.properties.dtype, torch.dtype)):
            raise _fail(source, f"entry {_shown(name)} is {type(entry).__name__}, not a tensor or bytes entry")
        size = entry.size
        if not _box(size, len(size) if isinstance(size, torch.Size) else -1):
            raise _fail(source, f"tensor {_shown(name)} has size {_shown(size)}")
        if not isinstance(entry.chunks, list):
            raise _fail(source, f"tensor {_shown(name)} has chunks {_shown(entry.chunks)}")
        for chunk in entry.chunks:
            if not (isinstance(chunk, ChunkStorageMetadata) and _box(chunk.offsets, len(size))
                    and _box(chunk.sizes, len(size))
                    and all(o + n <= s for o, n, s in zip(chunk.offsets, chunk.sizes, size))):
                raise _fail(source, f"tensor {_shown(name)} of size {_shown(tuple(size))} has chunk "
                                    f"{_shown(chunk)} outside it")
        if math.prod(size) * entry.properties.dtype.itemsize >= 2**63:
            raise _fail(source, f"tensor {_shown(name)} of size {_shown(tuple(size))} is more than 2**63 bytes")
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise _fail(source, f"storage_data is {type(storage).__name__}, not a dict (only DCP's file system "
                            f"format is read)")
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise _fail(source, f"storage_data maps {_shown(index)} to {_shown(info)}")
        check_file_name(info.relative_path, source=source, tensor=_shown(index.fqn))
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in (info.offset, info.length)):
            raise _fail(source, f"storage_data for {_shown(index.fqn)} has offset {_shown(info.offset)}, "
                                f"length {_shown(info.length)}")
    planner = metadata.planner_data
    if planner is not None and not (isinstance(planner, dict) and all(
            isinstance(k, str) and isinstance(v, (tuple, list)) and all(isinstance(p, (str, int)) for p in v)
            for k, v in planner.items())):
        raise _fail(source, "planner_data is not a map of names to key paths")
