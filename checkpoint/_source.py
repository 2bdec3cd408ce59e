"""The checkpoint source interface: one format's checkpoint, opened for reading.

``load``, ``convert``, ``verify`` and the command line read every format through this one
interface; ``_sources.open_source`` picks the implementation (the only place that looks at a
folder to tell formats apart). The implementations:

- ``_files.ShardkitSource``: a shardkit checkpoint (``shardkit.json`` plus safetensors data
  files), read by byte ranges with every chunk checksum verified;
- ``_files.HuggingFaceSource``: a Hugging Face safetensors checkpoint, read by byte ranges
  (its files carry no checksums);
- ``_dcp.DcpSource``: a ``torch.distributed.checkpoint`` folder, read through torch's
  ``FileSystemReader`` after its pickled ``.metadata`` passed the restricted unpickler; only
  ever opened when the caller names the format.

A source describes what it holds as ``CheckpointMetadata`` (tensors with their size and
dtype, non-tensor values), and fills blocks (``Block``): the local blocks of the state_dict's
tensors, after ``_load.fill`` (the one fill path, shared by every format) has matched names,
checked sizes and dtypes and allocated what needs allocating.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from ._schema import CheckpointMetadata, TensorEntry

__all__ = ["Format", "FORMATS", "Block", "Source"]

Format = Literal["shardkit", "huggingface", "dcp"]
FORMATS: tuple[Format, ...] = ("shardkit", "huggingface", "dcp")


@dataclass(frozen=True, slots=True, eq=False)
class Block:
    """One local block of a target tensor to fill: tensor ``name``'s elements from global ``offsets``."""

    name: str
    entry: TensorEntry
    offsets: tuple[int, ...]
    tensor: torch.Tensor  # the block itself (filled in place); its shape gives the block's extent


class Source(ABC):
    """A checkpoint of one format, opened for reading; close it (or use ``with``) when done."""

    format: ClassVar[Format]

    def __init__(self, where: str) -> None:
        self.where = where  # the path named in messages

    @abstractmethod
    def describe(self, names: Collection[str] | None = None) -> CheckpointMetadata:
        """What the checkpoint holds: tensors (name -> size, dtype) and non-tensor values.

        ``names`` are the leaf names of the state_dict to fill (``None``: the whole
        checkpoint, as ``convert`` reads it); a format that flattens deeper than a state_dict
        leaf (DCP's lists) regroups its entries under those names.
        """

    def match_names(self, targets: Iterable[tuple[str, Any]]) -> set[str]:
        """Rename what the checkpoint holds to the names the format's own loader gives the state_dict.

        ``targets`` are the state_dict's ``(name, value)`` leaves. Called before ``describe``.
        Returns the target names that need no data of their own (tied weights). Formats whose
        names are the state_dict's own rename nothing.
        """
        del targets
        return set()

    def prepare(self, name: str, entry: TensorEntry) -> None:
        """Called before memory is allocated for the whole of tensor ``name``: raise if the data cannot
        hold what the description claims (so a crafted description allocates nothing)."""
        del name, entry

    @abstractmethod
    def read(self, blocks: Sequence[Block], *, rank: int = 0, quiet: bool | None = None,
             mmap: bool = False) -> None:
        """Fill every block from the checkpoint's data (``mmap``: map file pages where the format can)."""

    @abstractmethod
    def verify(self, *, quiet: bool | None = None) -> list[str]:
        """Re-read the whole checkpoint; every problem found, each a message naming the file and tensor."""

    def close(self) -> None:  # noqa: B027  # most sources hold no open files
        """Release open files."""

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
