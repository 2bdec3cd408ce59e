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
* names: ``save_pretrained`` still writes older names for some models (GPT-NeoX's
  ``embed_out``, ViT's ``encoder.layer.N.attention.attention.query``) and a head model's
  checkpoint may lack or carry the base model's prefix. When the state_dict's names are not
  all in the checkpoint, transformers (if installed) is asked for the renamings its
  ``from_pretrained`` applies to the folder's model class (``config.json``), and the checkpoint's
  names are renamed the same way: names only, every byte is still read straight from its file
  (see ``convert_hf_names``);
* per-expert tensors (``save_pretrained`` of Mixtral, Qwen2-MoE) for a model with fused experts:
  each fused tensor is described as saved in regions, one per expert and matrix, at the bytes
  of the per-expert tensor, so a rank reads only the experts or rows it holds (``_hf_fuse``);
* tied weights are saved once (``save_pretrained`` drops ``lm_head.weight`` when it is the
  embedding): a tied name the checkpoint lacks counts as loaded when its tensor is the same
  memory as the name it is tied to, and is read from that name's bytes otherwise.

Every header is validated before anything is read from the data: known dtype, a shape of
non-negative ints, data offsets inside the file and of exactly the size the shape implies.
"""

from __future__ import annotations

import math
import posixpath
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import fsspec
import torch

from . import _strict_json as strict_json
from ._hf_fuse import FusedPiece, fused_entries, fusion_of
from ._reader import DataReader
from ._safe_open import read_regular
from ._schema import (
    METADATA_FILE,
    CheckpointError,
    CheckpointMetadata,
    SavedShard,
    TensorEntry,
    check_file_name,
    dtype_from_code,
)
from ._storage import is_local
from ._strict_json import shown

__all__ = ["INDEX_FILE", "find_hf", "read_hf_metadata", "apply_key_map", "KeyMap", "convert_hf_names"]

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
        weight_map = read_index(fs, index)
        files = sorted({check_file_name(f, source=index, tensor=t) for t, f in weight_map.items()})
        return root, files, index
    if fs.exists(posixpath.join(root, _SINGLE_FILE)):
        return root, [_SINGLE_FILE], posixpath.join(root, _SINGLE_FILE)
    return None


def read_small(fs: fsspec.AbstractFileSystem, path: str) -> bytes:
    """A whole small file of a Hugging Face folder: locally a regular file (or a cache snapshot's link into its
    own blobs/, ``_safe_open``), elsewhere as the file system gives it."""
    if is_local(fs):
        return read_regular(path, cache_links=True)
    data: bytes = fs.cat_file(path)
    return data


def read_index(fs: fsspec.AbstractFileSystem, index: str) -> dict[str, str]:
    """The ``weight_map`` of a ``model.safetensors.index.json`` (tensor name -> file), strictly parsed.

    Raises:
        CheckpointError: not JSON within ``_strict_json``'s limits (depth, size, no duplicate key), or
            no object ``weight_map`` of strings to strings.
    """
    try:
        data = strict_json.loads(read_small(fs, index), source=index, what="malformed safetensors index")
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        found = type(weight_map).__name__ if isinstance(data, dict) else f"a {type(data).__name__}"
        msg = (f"{index!r} is not a valid safetensors index: expected a JSON object whose 'weight_map' maps tensor "
               f"names to file names, found {found}.")
        raise CheckpointError(msg)
    return weight_map


def _entry(path: str, name: str, info: object, file: str, start: int, size: int) -> TensorEntry:
    where = f"tensor {name!r} in {path!r}"
    if not isinstance(info, dict):
        msg = f"{where}: the header entry is not an object."
        raise CheckpointError(msg)
    dtype = dtype_from_code(info.get("dtype"), where=where)
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not (isinstance(shape, list) and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)):
        msg = f"{where} has shape {shown(shape)}; a shape is a list of non-negative ints."
        raise CheckpointError(msg)
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(n, int) for n in offsets)):
        msg = f"{where} has data_offsets {shown(offsets)}; expected [begin, end]."
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
    with DataReader(fs, cache_links=True) as reader:
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
        weight_map = read_index(fs, source)
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



_CONFIG_FILE = "config.json"


def convert_hf_names(fs: fsspec.AbstractFileSystem, folder: str, metadata: CheckpointMetadata,
                     targets: Iterable[tuple[str, Any]]) -> tuple[CheckpointMetadata, set[str]]:
    """The checkpoint's tensors under the names ``from_pretrained`` would give them, and the tied names.

    ``targets`` are the state_dict's ``(name, value)`` pairs. Nothing changes when every target
    name is in the checkpoint already, when transformers is not installed, or when the folder
    has no ``config.json`` naming a transformers model class. Otherwise the folder's model class
    is built on the meta device (no memory) to ask transformers for its conversions
    (``conversion_mapping.get_model_conversion_mapping``: the legacy renamings, the base model's
    prefix added or dropped), the per-expert tensors it stacks into fused experts (described as
    regions of the fused tensor, still read by byte ranges: ``_hf_fuse``) and its tied weights
    (``all_tied_weights_keys``). Conversions that compute on the data (splitting a fused
    tensor, transposing) are not applied: those tensors keep their names and show as
    missing/unexpected.

    Returns:
        ``(metadata, tied)``: ``metadata`` with renamed tensors, plus an entry for every tied
        target whose tensor is not the memory of the name it is tied to (it is read from that
        name's bytes), without the tensors the model class tells ``from_pretrained`` to skip
        (``_keys_to_ignore_on_load_unexpected``); ``tied``: the tied target names that need
        no data of their own.
    """
    values = dict(targets)
    if (all(name in metadata.tensors or name in metadata.values for name in values)
            and all(name in values for name in metadata.tensors)):
        return metadata, set()
    model = _meta_model(fs, folder)
    if model is None:
        return metadata, set()
    names, pieces, matched = _renames(model, metadata, values)
    renamed = apply_key_map(metadata, names.get, source=folder)  # the fused pieces map to None: dropped
    fused = fused_entries(pieces, matched, metadata.tensors, source=folder)
    for name in fused.keys() & renamed.tensors.keys():
        parts = sorted(p.name for p in pieces if p.target == name)
        msg = (f"{folder!r} holds {name!r} both whole and as the pieces {parts} that from_pretrained fuses "
               f"into it; remove one of them.")
        raise CheckpointError(msg)
    # Tensors from_pretrained skips without a word (old attention-mask buffers of GPT-2, GPT-NeoX).
    ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
    tensors = {name: entry for name, entry in renamed.tensors.items()
               if name in values or not any(p.search(name) for p in ignored)}
    tensors.update(fused)
    tied: set[str] = set()
    # The ties this model's config makes (transformers 5); _tied_weights_keys lists possible ones only.
    links = getattr(model, "all_tied_weights_keys", None) or {}
    if isinstance(links, Mapping):
        for target, source in links.items():
            if target in tensors or target not in values or source not in tensors or source not in values:
                continue
            if _same_memory(values[target], values[source]):
                tied.add(target)
            else:
                tensors[target] = tensors[source]
    return CheckpointMetadata(tensors=tensors, values=renamed.values, files=renamed.files,
                              generation=renamed.generation, world_size=renamed.world_size,
                              version=renamed.version), tied


def _meta_model(fs: fsspec.AbstractFileSystem, folder: str) -> Any:
    """The folder's transformers model class built on the meta device, or ``None``."""
    try:
        import transformers
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    except ImportError:
        return None
    path = posixpath.join(folder, _CONFIG_FILE)
    try:
        data = strict_json.loads(read_small(fs, path), source=path)
    except (FileNotFoundError, ValueError, CheckpointError):
        return None
    if not isinstance(data, dict):
        return None
    architectures = data.get("architectures") or []
    cls = getattr(transformers, architectures[0], None) if architectures and isinstance(architectures[0], str) else None
    model_type = data.get("model_type")
    if cls is None or not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        return None
    try:
        config = CONFIG_MAPPING[model_type].from_dict(data)
        with torch.device("meta"):
            return cls(config)
    except (ValueError, TypeError, KeyError, AttributeError, ImportError, OSError, RuntimeError):
        # A class this transformers cannot build (other version, missing extra): names stay as
        # saved, and the load reports any that do not match.
        return None


def _renames(model: Any, metadata: CheckpointMetadata,
             values: Mapping[str, Any]) -> tuple[dict[str, str], list[FusedPiece], dict[str, str]]:
    """Checkpoint name -> the name transformers' ``from_pretrained`` gives it for ``model``.

    Also the checkpoint tensors that are pieces of a fused tensor of the model (per-expert
    tensors: see ``_hf_fuse``), and each piece's name after the renamings, which holds the index
    the converter's ``*`` stands for.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, apply_renamings, rename_source_key

    mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    wanted = dict.fromkeys(values, True)  # rename_source_key asks .get(name) is not None
    prefix = getattr(model, "base_model_prefix", None) or None
    names: dict[str, str] = {}
    pieces: list[FusedPiece] = []
    matched: dict[str, str] = {}
    for name in metadata.tensors:
        new, pattern = rename_source_key(name, renamings, converters, prefix, wanted)
        if pattern is not None:
            converter = next(c for c in converters if pattern in c.source_patterns)
            fusion = fusion_of(converter)
            if fusion is not None and new in wanted and name not in wanted:
                pieces.append(FusedPiece(name, new, fusion, list(converter.source_patterns).index(pattern)))
                matched[name] = apply_renamings(name, renamings)
                continue
            new = name  # a conversion that computes on the data (not by byte ranges)
        elif new not in wanted and name in wanted:
            new = name  # a rename that leads nowhere
        names[name] = new
    return names, pieces, matched


def _same_memory(a: Any, b: Any) -> bool:
    """Whether two state_dict values are views of the same memory on this rank (tied parameters)."""
    blocks_a = [s.tensor for s in a.local_shards()] if hasattr(a, "local_shards") else [a]
    blocks_b = [s.tensor for s in b.local_shards()] if hasattr(b, "local_shards") else [b]
    if not all(isinstance(t, torch.Tensor) for t in (*blocks_a, *blocks_b)) or len(blocks_a) != len(blocks_b):
        return False
    for x, y in zip(blocks_a, blocks_b):
        if x.numel() == 0 and y.numel() == 0:
            continue
        if x.device != y.device or x.shape != y.shape or x.data_ptr() != y.data_ptr():
            return False
    return True
