"""Hugging Face safetensors checkpoints as a source for ``checkpoint.load``.

A Hugging Face checkpoint is one ``model.safetensors`` file, or a folder of
``model-0000k-of-0000N.safetensors`` files with a ``model.safetensors.index.json`` that maps
each tensor to its file. Every file is self-describing: an 8-byte little-endian header
length, a JSON header (``name -> {"dtype", "shape", "data_offsets"}``), then the data. So a
loading rank reads each file's header once (two small range reads), turns it into the same
``TensorEntry``/``SavedShard`` description a shardkit checkpoint has (one saved region per
tensor, covering all of it), and the ordinary loader then reads only the byte ranges of the
blocks the rank holds: the full model never exists on any rank.

Differences from shardkit's own format, and what follows:

* no checksums: the bytes are checked for length (a truncated file is an error) but cannot be
  checked for corruption;
* no non-tensor values;
* tied weights are saved once (``save_pretrained`` drops ``lm_head.weight`` when it is the
  embedding): a state_dict that lists both names either loads with ``strict=False`` or maps
  the missing name with ``key_map``.

Every header is validated before anything is read from the data: known dtype, a shape of
non-negative ints, data offsets inside the file and of exactly the size the shape implies.
"""

from __future__ import annotations

import json
import math
import posixpath
from collections.abc import Callable, Mapping

import fsspec
import torch

from ._reader import DataReader
from ._schema import (
    METADATA_FILE,
    CheckpointError,
    CheckpointMetadata,
    SavedShard,
    TensorEntry,
    check_file_name,
    dtype_from_code,
)

__all__ = ["INDEX_FILE", "find_hf", "read_hf_metadata", "apply_key_map", "KeyMap"]

INDEX_FILE = "model.safetensors.index.json"
_SINGLE_FILE = "model.safetensors"

KeyMap = Callable[[str], "str | None"] | Mapping[str, str]


def find_hf(fs: fsspec.AbstractFileSystem, root: str) -> tuple[str, list[str], str] | None:
    """``(folder, data files, source for messages)`` if ``root`` is a Hugging Face checkpoint.

    ``root`` is one ``.safetensors`` file, or a folder with ``model.safetensors.index.json`` or
    ``model.safetensors`` and no ``shardkit.json`` (a shardkit checkpoint wins).
    """
    if root.endswith(".safetensors") and fs.isfile(root):
        return posixpath.dirname(root), [posixpath.basename(root)], root
    if fs.exists(posixpath.join(root, METADATA_FILE)):
        return None
    index = posixpath.join(root, INDEX_FILE)
    if fs.exists(index):
        try:
            data = json.loads(fs.cat_file(index))
            weight_map = data["weight_map"]
            files = sorted({check_file_name(f, source=index, tensor=t) for t, f in weight_map.items()})
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            msg = f"{index!r} is not a valid safetensors index (a JSON object with a 'weight_map'): {exc}."
            raise CheckpointError(msg) from exc
        return root, files, index
    if fs.exists(posixpath.join(root, _SINGLE_FILE)):
        return root, [_SINGLE_FILE], posixpath.join(root, _SINGLE_FILE)
    return None


def _entry(path: str, name: str, info: object, file: str, start: int, size: int) -> TensorEntry:
    where = f"tensor {name!r} in {path!r}"
    if not isinstance(info, dict):
        msg = f"{where}: the header entry is not an object."
        raise CheckpointError(msg)
    dtype = dtype_from_code(info.get("dtype"), where=where)
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not (isinstance(shape, list) and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)):
        msg = f"{where} has shape {shape!r}; a shape is a list of non-negative ints."
        raise CheckpointError(msg)
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(n, int) for n in offsets)):
        msg = f"{where} has data_offsets {offsets!r}; expected [begin, end]."
        raise CheckpointError(msg)
    begin, end = offsets
    nbytes = math.prod(shape) * dtype.itemsize
    if not 0 <= begin <= end or end - begin != nbytes or start + end > size:
        msg = (f"{where}: data_offsets {offsets} do not hold its {nbytes} bytes ({dtype}, shape {shape}) inside "
               f"the file's {size - start} data bytes; the file is corrupt or truncated.")
        raise CheckpointError(msg)
    shard = SavedShard((0,) * len(shape), tuple(shape), file, name, (start + begin, start + end), "")
    return TensorEntry(torch.Size(shape), dtype, (shard,))


def read_hf_metadata(fs: fsspec.AbstractFileSystem, folder: str, files: list[str], source: str) -> CheckpointMetadata:
    """The tensors of a Hugging Face checkpoint, described like a shardkit checkpoint's.

    Raises:
        CheckpointError: a file is missing, truncated or has a malformed header; a tensor
            appears in two files; the index names a tensor its file does not hold.
    """
    tensors: dict[str, TensorEntry] = {}
    sizes: dict[str, int] = {}
    with DataReader(fs) as reader:
        headers = {file: reader.read_header(posixpath.join(folder, check_file_name(file, source=source)))
                   for file in files}
    for file, (header, start, size) in headers.items():
        path = posixpath.join(folder, file)
        sizes[file] = size
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if name in tensors:
                msg = f"tensor {name!r} appears in {tensors[name].shards[0].file!r} and in {file!r} of {source!r}."
                raise CheckpointError(msg)
            tensors[name] = _entry(path, name, info, file, start, size)
    if source.endswith(INDEX_FILE):
        weight_map = json.loads(fs.cat_file(source))["weight_map"]
        for name, file in weight_map.items():
            held = tensors.get(name)
            if held is None or held.shards[0].file != file:
                msg = f"{source!r} maps tensor {name!r} to {file!r}, which does not hold it."
                raise CheckpointError(msg)
    return CheckpointMetadata(tensors=tensors, values={}, files=sizes, generation="", world_size=0)


def apply_key_map(metadata: CheckpointMetadata, key_map: KeyMap | None, *, source: str) -> CheckpointMetadata:
    """``metadata`` with its tensor names mapped by ``key_map`` (a dict, or a callable; ``None`` drops a name)."""
    if key_map is None:
        return metadata
    if not callable(key_map) and not isinstance(key_map, Mapping):
        msg = f"key_map must be a dict or a callable taking a checkpoint name, got {type(key_map).__name__}."
        raise TypeError(msg)
    mapped: dict[str, TensorEntry] = {}
    origin: dict[str, str] = {}
    for name, entry in metadata.tensors.items():
        new = key_map(name) if callable(key_map) else key_map.get(name, name)
        if new is None:
            continue
        if not isinstance(new, str):
            msg = f"key_map returned {new!r} for {name!r}; it must return a str (or None to skip the tensor)."
            raise TypeError(msg)
        if new in mapped:
            msg = f"key_map maps both {origin[new]!r} and {name!r} of {source!r} to {new!r}."
            raise CheckpointError(msg)
        mapped[new] = entry
        origin[new] = name
    return CheckpointMetadata(tensors=mapped, values=metadata.values, files=metadata.files,
                              generation=metadata.generation, world_size=metadata.world_size,
                              version=metadata.version)

