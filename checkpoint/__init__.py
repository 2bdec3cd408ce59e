"""Sharded state_dict save, load, collect and consolidate, on safetensors and fsspec."""

from ._async import AsyncSaveHandle, async_save
from ._collect import collect_state_dict
from ._consolidate import consolidate
from ._dcp import convert
from ._format import CheckpointError, CheckpointMetadata, read_metadata
from ._load import load
from ._manager import CheckpointManager
from ._save import save

__all__ = ["save", "async_save", "AsyncSaveHandle", "CheckpointManager", "load", "collect_state_dict",
           "consolidate", "convert", "read_metadata", "CheckpointMetadata", "CheckpointError"]
