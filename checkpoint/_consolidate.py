"""``checkpoint.consolidate``: a sharded checkpoint to one safetensors file or a Hugging Face style folder.

Offline, one process, streaming. The output's safetensors headers are computed from the
checkpoint's metadata alone (names, dtypes, shapes, hence every data offset), written first,
and then each tensor's bytes follow in order:

- a tensor whose saved regions are each one contiguous run of the full tensor (row blocks:
  a split on dim 0, or a single region) is copied region by region, in bounded chunks,
  without ever holding the tensor: memory is one chunk;
- any other tensor (a split on dim 1, a mesh) is assembled in one preallocated full-size
  buffer, each region read whole and copied into its block, then written: memory is one
  output tensor plus one saved region.

Every region's checksum is verified as it is read; on any error the partial output is
removed, so ``output`` is either complete or absent (local outputs are written under a
temporary name and renamed; object stores publish an upload only when it completes).
"""

from __future__ import annotations

import json
import math
import os
import posixpath
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import fsspec
import torch

from ._codec import build_safetensors_header, tensor_bytes
from ._export import ConfigLike, checkpoint_folder, config_files
from ._progress import progress
from ._reader import DataReader
from ._schema import CheckpointMetadata, SavedShard, TensorEntry
from ._storage import atomic_write, member, read_metadata_at, remove_quietly, resolve

__all__ = ["consolidate", "consolidate_files", "parse_size", "select", "INDEX_FILE", "VALUES_KEY"]

Include = str | Sequence[str] | Callable[[str], bool] | None  # name prefixes, or a predicate on the dotted name

INDEX_FILE = "model.safetensors.index.json"
"""Name of the Hugging Face index written next to the shard files."""

VALUES_KEY = "shardkit.values"
"""Key under which the checkpoint's non-tensor values are kept (as JSON) in the output."""

_CHUNK = 16 << 20  # largest single read/write when streaming a region

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")


def parse_size(value: int | str) -> int:
    """Bytes in ``value``: an int, or a string like ``"5GB"`` (10^9) or ``"500MiB"`` (2^20).

    Units follow Hugging Face's ``max_shard_size``: KB/MB/GB/TB are powers of 1000 and
    KiB/MiB/GiB/TiB powers of 1024, case-insensitive; a bare number is bytes.

    Raises:
        ValueError: not a positive size, or an unknown unit.
    """
    if isinstance(value, bool):
        number = None
    elif isinstance(value, int):
        number = value
    elif isinstance(value, str) and (match := _SIZE.match(value)) and match.group(2).upper() in _UNITS:
        number = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    else:
        number = None
    if number is None or number <= 0:
        msg = (f"max_shard_size={value!r} is not a positive size; pass bytes as an int or a string such as "
               f"'5GB', '500MB' or '2GiB' (units: {', '.join(u for u in _UNITS if u)}).")
        raise ValueError(msg)
    return number


@dataclass(frozen=True, slots=True)
class _OutputFile:
    path: str                   # full path on the output file system
    name: str                   # base name (for the index)
    tensors: tuple[str, ...]
    nbytes: int                 # tensor bytes in this file


def consolidate(path: str | os.PathLike[str] | Any, output: str | os.PathLike[str], *,
                max_shard_size: int | str | None = None,
                include: str | Sequence[str] | Callable[[str], bool] | None = None, strip_prefix: str | None = None,
                config: ConfigLike = None, step: int | None = None,
                storage_options: Mapping[str, Any] | None = None, quiet: bool | None = None) -> None:
    """Turn a sharded checkpoint into one ``.safetensors`` file, or a Hugging Face style folder.

    Offline and single-process: no process group is needed. Memory stays about one output
    tensor (row-block layouts stream in chunks with far less), never the whole model.

    Without ``max_shard_size``, ``output`` is the ``.safetensors`` file to write (if it is an
    existing folder, ``output/model.safetensors`` is written). With ``max_shard_size``,
    ``output`` is a folder that receives ``model-00001-of-0000N.safetensors`` ... and
    ``model.safetensors.index.json`` (``{"metadata": {"total_size": ...}, "weight_map":
    {name: file}}``), as ``transformers``' ``save_pretrained`` writes them: tensors are packed
    in checkpoint order, a new file starting when the next tensor would exceed
    ``max_shard_size``; a tensor larger than that gets a file of its own.

    Tensor names are the checkpoint's dotted names. Non-tensor values (the step, the
    optimizer's hyper-parameters, ...) are kept as JSON: in a single file under the
    ``__metadata__`` key ``"shardkit.values"`` (safetensors metadata is str to str), and in a
    folder under ``"shardkit.values"`` of the index's ``"metadata"``. Every output file also
    carries ``__metadata__["format"] = "pt"``, which ``transformers`` expects.

    ``include`` and ``strip_prefix`` export part of a checkpoint under other names: a
    training checkpoint saved as ``{"model": ..., "optim": ..., "step": ...}`` becomes model
    weights that ``model.load_state_dict(..., strict=True)`` or ``from_pretrained`` accept
    with ``include="model", strip_prefix="model"``. A prefix matches whole dotted
    components: ``"model"`` (or ``"model."``) selects ``model`` and ``model.*``, never
    ``model_ema.*``. Non-tensor values are selected and renamed the same way.

    With ``config``, ``output`` is a folder that ``from_pretrained`` loads: the weights
    (``model.safetensors``, or the shard files and index with ``max_shard_size``) plus
    ``config.json`` and, for a model that generates, ``generation_config.json``, as
    ``save_pretrained`` writes them. ``path`` may also be a ``CheckpointManager`` or its root
    folder: the latest committed step is exported, or ``step``. A whole training run to a
    Hugging Face folder is then one call::

        checkpoint.consolidate(manager, "llama-hf", include="model", strip_prefix="model", config=model)

    Args:
        path: the checkpoint folder, a local path or fsspec URL; or a ``CheckpointManager`` or its
            root folder.
        output: the file (or folder, with ``max_shard_size``) to write; a local path or fsspec
            URL. It receives ``storage_options`` too when it uses the same protocol as ``path``.
        max_shard_size: largest output file, in bytes (int) or as ``"5GB"``/``"500MB"``.
        include: export only these entries: a name prefix, a list of prefixes, or a
            predicate called with each dotted name (``None``: everything).
        strip_prefix: remove this prefix (``"model"`` or ``"model."``) from the exported names
            that start with it.
        config: also write the model's config files: a transformers config (``model.config``), a
            transformers model (its config and generation config), or a pretrained folder (or
            its ``config.json``) whose ``config.json`` and ``generation_config.json`` are copied.
        step: with a manager (or its root), the step to export; ``None``: the latest committed one.
        storage_options: fsspec options (credentials, endpoint, ...) for ``path``.
        quiet: ``True`` hides the progress bar shown on a terminal for large checkpoints;
            ``None`` follows the ``SHARDKIT_QUIET`` environment variable.

    Raises:
        CheckpointError: the checkpoint is incomplete or corrupt (a checksum, a missing or
            truncated file); the message names the file and the tensor.
        ValueError: a bad ``max_shard_size``, an ``include`` that selects no tensor, a
            ``strip_prefix`` that no selected name starts with or that makes two names
            equal, or a tensor named ``"__metadata__"``.
        FileNotFoundError: no checkpoint at ``path``.

    Example:
        >>> checkpoint.consolidate("ckpt", "model.safetensors")  # doctest: +SKIP
        >>> checkpoint.consolidate("s3://b/ckpt", "hf", max_shard_size="5GB")  # doctest: +SKIP
        >>> safetensors.torch.load_file("model.safetensors")["fc.weight"].shape  # doctest: +SKIP
        torch.Size([10, 4])
        >>> # a training checkpoint {"model": ..., "optim": ..., "step": ...}: the weights only
        >>> checkpoint.consolidate("ckpt", "hf", max_shard_size="5GB", include="model",
        ...                        strip_prefix="model")  # doctest: +SKIP
    """
    consolidate_files(path, output, max_shard_size=max_shard_size, include=include, strip_prefix=strip_prefix,
                      config=config, step=step, storage_options=storage_options, quiet=quiet)


def consolidate_files(path: str | os.PathLike[str] | Any, output: str | os.PathLike[str], *,
            max_shard_size: int | str | None = None, include: Include = None, strip_prefix: str | None = None,
            config: ConfigLike = None, step: int | None = None,
            storage_options: Mapping[str, Any] | None = None, quiet: bool | None = None) -> list[str]:
    """``consolidate``, returning the paths it wrote (data files, then the index if any, then the configs)."""
    limit = None if max_shard_size is None else parse_size(max_shard_size)
    path = checkpoint_folder(path, step, storage_options)
    extra = {} if config is None else config_files(config)  # before anything is written: a bad config fails first
    in_fs, root = resolve(path, storage_options)
    metadata = select(read_metadata_at(in_fs, root), include=include, strip_prefix=strip_prefix,
                      source=os.fspath(path))
    if "__metadata__" in metadata.tensors:
        msg = ("checkpoint has a tensor named '__metadata__', which safetensors reserves for its metadata; "
               "rename it in the state_dict and save again.")
        raise ValueError(msg)
    out_fs, out_path = _output_fs(path, output, storage_options)
    files = _plan_files(metadata, out_fs, out_path, limit, folder=bool(extra))
    total = metadata.nbytes
    done: list[str] = []
    with progress(total, "consolidate", quiet=quiet) as bar, DataReader(in_fs) as reader:
        source = _Source(root, reader)
        _check_files(metadata, source)
        try:
            if limit is not None or extra:
                out_fs.makedirs(out_path, exist_ok=True)
            for file in files:
                header = {"format": "pt"}
                if limit is None and metadata.values:
                    header[VALUES_KEY] = json.dumps(dict(metadata.values), separators=(",", ":"))
                _write_file(out_fs, file, metadata, header, source, bar)
                done.append(file.path)
            if limit is not None:
                index = {"metadata": {"total_size": total, **({VALUES_KEY: dict(metadata.values)}
                                                              if metadata.values else {})},
                         "weight_map": {name: f.name for f in files for name in f.tensors}}
                index_path = posixpath.join(out_path, INDEX_FILE)
                atomic_write(out_fs, index_path, [json.dumps(index, indent=2).encode()])
                done.append(index_path)
            for name, data in extra.items():
                atomic_write(out_fs, posixpath.join(out_path, name), [data])
                done.append(posixpath.join(out_path, name))
        except BaseException:
            for p in done:
                remove_quietly(out_fs, p)
            raise
    return done


def _check_files(metadata: CheckpointMetadata, source: _Source) -> None:
    """Before anything is allocated or written: every data file has its recorded size, and its header
    describes each region as the metadata does (dtype, shape, byte range)."""
    by_file: dict[str, list[tuple[str, SavedShard, torch.dtype]]] = {}
    for name, entry in metadata.tensors.items():
        for shard in entry.shards:
            if shard.numel > 0:
                by_file.setdefault(shard.file, []).append((name, shard, entry.dtype))
    for file, regions in sorted(by_file.items()):
        source.reader.check_data_file(source.path(regions[0][1]), metadata.files[file], regions)


# -- selecting ---------------------------------------------------------------------------------

def _component_prefix(prefix: str) -> str:
    return prefix if prefix.endswith(".") else prefix + "."


def _under(name: str, prefix: str) -> bool:
    return name == prefix.rstrip(".") or name.startswith(_component_prefix(prefix))


def _matcher(include: Include) -> Callable[[str], bool]:
    if include is None:
        return lambda name: True
    if isinstance(include, str):
        include = [include]
    if callable(include):
        return include
    prefixes = list(include)
    bad = [p for p in prefixes if not isinstance(p, str) or not p.rstrip(".")]
    if bad or not prefixes:
        msg = (f"include={include!r}: expected a non-empty name prefix such as 'model', a list of them, or a "
               f"callable taking a dotted name and returning a bool.")
        raise TypeError(msg) if any(not isinstance(p, str) for p in bad) else ValueError(msg)
    return lambda name: any(_under(name, p) for p in prefixes)


def _top_level(names: Sequence[str]) -> list[str]:
    return sorted({name.split(".", 1)[0] for name in names})


def select(metadata: CheckpointMetadata, *, include: Include = None, strip_prefix: str | None = None,
           source: str = "?") -> CheckpointMetadata:
    """The part of ``metadata`` that ``include`` selects, renamed by ``strip_prefix``. Pure.

    Raises:
        ValueError: nothing selected, a ``strip_prefix`` no selected name starts with, or two
            names equal after stripping.
    """
    if include is None and strip_prefix is None:
        return metadata
    keep = _matcher(include)
    tensors = {name: entry for name, entry in metadata.tensors.items() if keep(name)}
    values = {name: value for name, value in metadata.values.items() if keep(name)}
    if not tensors:
        msg = (f"include={include!r} selects none of the {len(metadata.tensors)} tensors of checkpoint {source!r}; "
               f"its names start with {_top_level(list(metadata.tensors) + list(metadata.values))} (a prefix "
               f"matches whole dotted components: 'model' selects 'model.*').")
        raise ValueError(msg)
    if strip_prefix is not None:
        if not isinstance(strip_prefix, str) or not strip_prefix.rstrip("."):
            msg = f"strip_prefix={strip_prefix!r}: expected a non-empty name prefix such as 'model'."
            raise ValueError(msg)
        cut = _component_prefix(strip_prefix)
        if not any(name.startswith(cut) for name in tensors):
            msg = (f"strip_prefix={strip_prefix!r} begins none of the {len(tensors)} selected tensor names "
                   f"(e.g. {sorted(tensors)[:3]}); their names start with {_top_level(list(tensors))}.")
            raise ValueError(msg)
        renamed: dict[str, TensorEntry] = {}
        origin: dict[str, str] = {}
        for name, entry in tensors.items():
            new = name.removeprefix(cut)
            if new in renamed:
                msg = (f"strip_prefix={strip_prefix!r} gives tensors {origin[new]!r} and {name!r} the same name "
                       f"{new!r}; select only one of them with include=.")
                raise ValueError(msg)
            renamed[new], origin[new] = entry, name
        tensors = renamed
        values = {name.removeprefix(cut): value for name, value in values.items() if name != cut.rstrip(".")}
    return replace(metadata, tensors=tensors, values=values)


# -- planning ----------------------------------------------------------------------------------

def _output_fs(path: str | os.PathLike[str], output: str | os.PathLike[str],
               storage_options: Mapping[str, Any] | None) -> tuple[fsspec.AbstractFileSystem, str]:
    in_protocol = fsspec.core.split_protocol(os.fspath(path))[0] or "file"
    out_text = os.fspath(output)
    out_protocol = fsspec.core.split_protocol(out_text)[0] or "file"
    options = dict(storage_options or {}) if in_protocol == out_protocol else {}
    fs, out_path = fsspec.core.url_to_fs(out_text, **options)
    return fs, out_path.rstrip("/") or out_path


def _plan_files(metadata: CheckpointMetadata, fs: fsspec.AbstractFileSystem, out_path: str,
                limit: int | None, *, folder: bool = False) -> list[_OutputFile]:
    names = list(metadata.tensors)
    if limit is None:
        target = out_path
        if folder or fs.isdir(out_path):
            target = posixpath.join(out_path, "model.safetensors")
        return [_OutputFile(target, posixpath.basename(target), tuple(names), metadata.nbytes)]
    groups: list[list[str]] = []
    sizes: list[int] = []
    for name in names:
        nbytes = metadata.tensors[name].nbytes
        if not groups or (sizes[-1] + nbytes > limit and groups[-1]):
            groups.append([])
            sizes.append(0)
        groups[-1].append(name)
        sizes[-1] += nbytes
    if not groups:
        groups, sizes = [[]], [0]
    count = len(groups)
    return [_OutputFile(posixpath.join(out_path, f"model-{k + 1:05d}-of-{count:05d}.safetensors"),
                        f"model-{k + 1:05d}-of-{count:05d}.safetensors", tuple(group), size)
            for k, (group, size) in enumerate(zip(groups, sizes))]


def _contiguous_start(entry: TensorEntry, shard: SavedShard) -> int | None:
    """Element offset of ``shard`` in the full tensor if its block is one contiguous run, else None.

    A block is one run of the row-major full tensor when, past its first dimension of
    length > 1, every dimension is whole.
    """
    size = entry.size
    k = next((d for d, n in enumerate(shard.dims) if n != 1), len(size))
    if any(shard.dims[d] != size[d] for d in range(k + 1, len(size))):
        return None
    strides = [math.prod(size[d + 1:]) for d in range(len(size))]
    return sum(o * s for o, s in zip(shard.offsets, strides))


# -- reading and writing ------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class _Source:
    """The checkpoint being read: its folder and the reader of its data files."""

    root: str
    reader: DataReader

    def path(self, shard: SavedShard) -> str:
        return member(self.root, shard.file)


class _Buffers:
    """Reusable uninitialized CPU buffers: filling fresh memory costs page faults every time."""

    def __init__(self) -> None:
        self._store: dict[str, torch.Tensor] = {}

    def get(self, key: str, size: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A tensor of ``size`` and ``dtype`` over the buffer ``key``, grown when too small."""
        nbytes = math.prod(size) * dtype.itemsize
        buffer = self._store.get(key)
        if buffer is None or buffer.numel() < nbytes:
            self._store.pop(key, None)  # free the old one before allocating the larger
            buffer = self._store[key] = torch.empty(nbytes, dtype=torch.uint8)
        return buffer[:nbytes].view(dtype).view(size)


def _tensor_pieces(name: str, entry: TensorEntry, source: _Source, scratch: memoryview,
                   buffers: _Buffers, bar: Any) -> Iterator[memoryview]:
    """The full tensor's bytes in row-major order, in pieces, assembled from its saved regions (verified)."""
    regions = [s for s in entry.shards if s.numel > 0]
    starts = [_contiguous_start(entry, s) for s in regions]
    if all(s is not None for s in starts):
        # Row blocks: the regions, sorted by where they start, are the tensor's bytes in order.
        for _, shard in sorted(zip(starts, regions), key=lambda p: p[0]):  # type: ignore[arg-type, return-value]
            for piece in source.reader.region_pieces(source.path(shard), shard, scratch, tensor=name):
                yield piece
                bar.update(len(piece))
        return
    # One full-size buffer and one region-size buffer, both reused from tensor to tensor.
    full = buffers.get("full", entry.size, entry.dtype)
    for shard in regions:
        block = buffers.get("region", torch.Size(shard.dims), entry.dtype)
        source.reader.read_region(source.path(shard), shard, tensor_bytes(block), tensor=name)
        index = tuple(slice(o, o + n) for o, n in zip(shard.offsets, shard.dims))
        full[index].copy_(block)
        bar.update(shard.nbytes)
    data = tensor_bytes(full)
    for start in range(0, len(data), _CHUNK):
        yield data[start:start + _CHUNK]


def _write_file(fs: fsspec.AbstractFileSystem, file: _OutputFile, metadata: CheckpointMetadata,
                header_metadata: Mapping[str, str], source: _Source, bar: Any) -> None:
    entries = [(name, metadata.tensors[name].dtype, tuple(metadata.tensors[name].size)) for name in file.tensors]
    prefix, _ = build_safetensors_header(entries, header_metadata)
    scratch = memoryview(bytearray(_CHUNK))
    buffers = _Buffers()

    def body() -> Iterator[bytes | memoryview]:
        yield prefix
        for name in file.tensors:
            yield from _tensor_pieces(name, metadata.tensors[name], source, scratch, buffers, bar)

    atomic_write(fs, file.path, body())
