"""``checkpoint.convert``: a checkpoint of one format rewritten in another, in one process.

The source is any checkpoint source (``_sources.open_source``: shardkit, Hugging Face, or a DCP
folder when named); the whole checkpoint is read through the fill path every load uses
(``_load.fill``, into ``None`` placeholders), then written as a shardkit checkpoint
(``save``), a DCP folder (``dcp.save``) or one ``.safetensors`` file.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any, Literal

import torch

from _shardkit import comm as _comm

from ._load import fill
from ._save import save
from ._source import Format
from ._sources import check_format, open_source
from ._walk import flatten_state_dict

__all__ = ["convert", "convert_to", "Target"]

Target = Literal["shardkit", "dcp", "safetensors"]
_TARGETS: tuple[Target, ...] = ("shardkit", "dcp", "safetensors")
_SUPPORTED: dict[Format, tuple[Target, ...]] = {
    "shardkit": ("dcp",),
    "huggingface": ("shardkit", "dcp"),
    "dcp": ("shardkit", "safetensors"),
}


def convert(path: str | os.PathLike[str], output: str | os.PathLike[str], *,
            from_format: Format | None = None, to_format: Target | None = None) -> None:
    """Convert a checkpoint between shardkit's format, a DCP folder and one safetensors file. One process.

    - ``from_format=None`` (the default) infers the source from its files: a shardkit
      checkpoint or a Hugging Face one. A DCP folder is never inferred (its ``.metadata`` is a
      pickle): name it with ``from_format="dcp"``; its ``.metadata`` is then read with a
      restricted unpickler that admits DCP's metadata classes only.
    - ``to_format=None`` (the default) writes a DCP folder from a shardkit checkpoint, and a
      shardkit checkpoint from anything else; ``"safetensors"`` writes one ``.safetensors``
      file (from a DCP folder; a shardkit checkpoint goes through ``checkpoint.consolidate``).

    The command line (``python -m checkpoint convert``) has the same defaults. The whole
    checkpoint passes through this process's memory once. Run it without a process group (or
    on one rank of a world of one).

    Args:
        path: the source folder (a DCP folder must be local).
        output: the destination folder (or ``.safetensors`` file).
        from_format: ``None`` (inferred), ``"shardkit"``, ``"huggingface"`` or ``"dcp"``.
        to_format: ``None`` (see above), ``"shardkit"``, ``"dcp"`` or ``"safetensors"``.

    Raises:
        ValueError: an unsupported pair of formats, or a multi-rank process group.
        FileNotFoundError: no checkpoint of the (inferred) format at ``path``; for a DCP
            folder read without ``from_format="dcp"``, the message says to pass it.
        CheckpointError: the source is not a valid checkpoint of that format.

    Example:
        >>> checkpoint.convert("dcp_ckpt", "ckpt", from_format="dcp")  # doctest: +SKIP
        >>> checkpoint.convert("ckpt", "dcp_ckpt")  # a shardkit checkpoint: to DCP  # doctest: +SKIP
    """
    convert_to(path, output, from_format=from_format, to_format=to_format)


def convert_to(path: str | os.PathLike[str], output: str | os.PathLike[str], *,
               from_format: Format | None = None, to_format: Target | None = None) -> Target:
    """``convert``, returning the format it wrote."""
    check_format(from_format)
    if to_format is not None and to_format not in _TARGETS:
        msg = f"to_format={to_format!r} is not an output format; use None, 'shardkit', 'dcp' or 'safetensors'."
        raise ValueError(msg)
    # A pair no possible source supports is refused before the source is looked at.
    possible: tuple[Format, ...] = (from_format,) if from_format is not None else ("shardkit", "huggingface")
    if to_format is not None and all(to_format not in _SUPPORTED[f] for f in possible):
        raise ValueError(_unsupported(from_format or "shardkit", to_format))
    _, world = _comm.rank_and_world(None)
    if world != 1:
        msg = (f"convert runs in one process, but a process group of {world} ranks is initialized; call it "
               f"from a single process (e.g. the command line: python -m checkpoint convert).")
        raise ValueError(msg)
    with open_source(path, from_format=from_format) as source:
        target: Target = to_format or ("dcp" if source.format == "shardkit" else "shardkit")
        if target not in _SUPPORTED[source.format]:
            raise ValueError(_unsupported(source.format, target))
        metadata = source.describe()
        state: dict[str, Any] = {name: None for name in (*metadata.tensors, *metadata.values)}
        fill(state, source, quiet=True)
    if target == "shardkit":
        save(state, output, quiet=True)
    elif target == "dcp":
        _write_dcp(state, output)
    else:
        _write_safetensors(state, output)
    return target


def _unsupported(from_format: Format, to_format: Target) -> str:
    return (f"convert(from_format={from_format!r}, to_format={to_format!r}) is not supported; supported: "
            + ", ".join(f"{f!r} -> {t!r}" for f, ts in _SUPPORTED.items() for t in ts)
            + " (use checkpoint.consolidate for shardkit -> safetensors).")


def _write_safetensors(state: dict[str, Any], output: str | os.PathLike[str]) -> None:
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


def _write_dcp(state: dict[str, Any], output: str | os.PathLike[str]) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        # dcp.save notes that it saves in one process: that is the point here.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(os.fspath(output)), no_dist=True)
