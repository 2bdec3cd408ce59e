"""Declarative sharding specs and shard metadata: pure data, no communication."""

from ._device import RemoteDevice
from ._metadata import ShardedTensorMetadata, ShardMetadata
from ._placement import PlacementSpec, spec_from_dict
from ._specs import (
    CompositeShardingSpec,
    DevicePlacement,
    EnumerableShardingSpec,
    MeshShardingSpec,
    PartialSpec,
    ShardingSpec,
    SingleSplitShardingSpec,
    composite,
    mesh,
    partial,
    single_split,
)

__all__ = [
    "RemoteDevice", "PlacementSpec", "DevicePlacement", "ShardingSpec",
    "SingleSplitShardingSpec", "MeshShardingSpec", "CompositeShardingSpec", "EnumerableShardingSpec",
    "PartialSpec", "single_split", "mesh", "composite", "partial", "spec_from_dict",
    "ShardMetadata", "ShardedTensorMetadata",
]
