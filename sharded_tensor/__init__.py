"""The metadata-first ShardedTensor: creation, resharding, gathering."""

from ._comm import CommCounter
from ._create import empty, full, ones, rand, randn, shard_tensor, zeros
from ._dtensor import from_dtensor
from ._optim import load_optim_state_dict, optim_state_dict
from ._sharder import shard_model, shard_parameter
from ._tensor import Shard, ShardedTensor
from ._visualize import visualize_sharding

__all__ = [
    "ShardedTensor", "Shard", "CommCounter",
    "empty", "zeros", "ones", "full", "rand", "randn", "shard_tensor",
    "visualize_sharding", "from_dtensor",
    "shard_parameter", "shard_model", "optim_state_dict", "load_optim_state_dict",
]
