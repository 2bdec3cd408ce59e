"""Which source reads a checkpoint path: format detection, in one place.

Without a named format, a path is a Hugging Face checkpoint (one ``.safetensors`` file, or a
folder with ``model.safetensors.index.json`` or ``model.safetensors`` and no
``shardkit.json``) or else a shardkit checkpoint. A DCP folder is never detected: its
``.metadata`` is a pickle, so it is opened only when the caller names ``"dcp"``, and a folder
that holds one is otherwise refused by the shardkit source with an error saying how to read it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ._dcp import DcpSource
from ._files import HuggingFaceSource, ShardkitSource
from ._hf import KeyMap, find_hf
from ._source import FORMATS, Format, Source
from ._storage import resolve

__all__ = ["open_source", "check_format"]


def check_format(from_format: object, *, what: str = "from_format") -> Format | None:
    """``from_format`` itself if it names a format a checkpoint can be read in (or is ``None``)."""
    if from_format is not None and from_format not in FORMATS:
        msg = (f"{what}={from_format!r} is not a checkpoint format; use None (a shardkit or Hugging Face "
               f"checkpoint, told apart by its files), 'shardkit', 'huggingface' or 'dcp' (a "
               f"torch.distributed.checkpoint folder, read only when named).")
        raise ValueError(msg)
    return from_format


def open_source(path: str | os.PathLike[str], *, from_format: Format | None = None,
                storage_options: Mapping[str, Any] | None = None, key_map: KeyMap | None = None) -> Source:
    """The checkpoint at ``path``, opened by the source of its format (detected when ``from_format`` is None).

    Raises:
        FileNotFoundError: there is no checkpoint of that format at ``path``.
        CheckpointError: the checkpoint's metadata is malformed, unsafe or incomplete.
        ValueError: an unknown ``from_format``.
    """
    check_format(from_format)
    if from_format == "dcp":
        return DcpSource(path, key_map=key_map)
    fs, root = resolve(path, storage_options)
    if from_format in (None, "huggingface"):
        found = find_hf(fs, root)
        if found is not None:
            return HuggingFaceSource(fs, found, key_map=key_map)
        if from_format == "huggingface":
            msg = (f"no Hugging Face checkpoint at {root!r}: expected a .safetensors file, or a folder with "
                   f"model.safetensors.index.json or model.safetensors (and no shardkit.json).")
            raise FileNotFoundError(msg)
    return ShardkitSource(fs, root, key_map=key_map)
