"""Sharded state_dict save, load, collect and consolidate (placeholder; not implemented yet)."""

from __future__ import annotations

__all__: list[str] = []
