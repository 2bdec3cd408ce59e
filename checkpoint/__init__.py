"""Sharded state_dict save, load, collect and consolidate, on safetensors and fsspec."""

from ._async import AsyncSaveHandle, async_save
from ._collect import collect_state_dict
from ._consolidate import consolidate
from ._convert import convert
from ._load import load
from ._manager import CheckpointManager
from ._memory_tier import LoadReport
from ._save import save
from ._schema import CheckpointError, CheckpointMetadata
from ._storage import read_metadata

__all__ = ["save", "async_save", "AsyncSaveHandle", "CheckpointManager", "LoadReport", "load", "collect_state_dict",
           "consolidate", "convert", "read_metadata", "CheckpointMetadata", "CheckpointError"]

# Tracebacks and reprs name the class where users import it, not the private module defining it.
CheckpointError.__module__ = __name__
