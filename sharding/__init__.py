"""Declarative sharding specs and shard metadata: pure data, no communication."""

from ._metadata import ShardedTensorMetadata, ShardMetadata
from ._placement import PlacementSpec, RemoteDevice
from ._specs import (
    CompositeShardingSpec,
    DevicePlacement,
    EnumerableShardingSpec,
    MeshShardingSpec,
    ShardingSpec,
    SingleSplitShardingSpec,
    composite,
    mesh,
    single_split,
    spec_from_dict,
)

__all__ = [
    "RemoteDevice", "PlacementSpec", "DevicePlacement", "ShardingSpec",
    "SingleSplitShardingSpec", "MeshShardingSpec", "CompositeShardingSpec", "EnumerableShardingSpec",
    "single_split", "mesh", "composite", "spec_from_dict",
    "ShardMetadata", "ShardedTensorMetadata",
]
