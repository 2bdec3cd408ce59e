"""The metadata-first ShardedTensor: creation, resharding, gathering."""

from . import _attention  # noqa: F401 - registers nn.MultiheadAttention

from ._comm import CommCounter
from ._dfunction import DFunction, LayoutDecision, register_layout_rule
from ._create import empty, full, ones, rand, randn, shard_tensor, zeros
from ._dtensor import from_dtensor
from ._optim import load_optim_state_dict, optim_state_dict
from ._parallel import ParamLayout
from ._regions import loss_parallel
from ._registry import ShardedCall, ShardedModule, register_sharded_module
from ._sharder import shard_model, shard_parameter
from ._tensor import Shard, ShardedTensor
from ._training import all_reduce_grads, clip_grad_norm_, get_state_dict, set_state_dict
from ._visualize import visualize_sharding

__all__ = [
    "ShardedTensor", "Shard", "CommCounter",
    "empty", "zeros", "ones", "full", "rand", "randn", "shard_tensor",
    "visualize_sharding", "from_dtensor",
    "shard_parameter", "shard_model", "optim_state_dict", "load_optim_state_dict", "loss_parallel",
    "ShardedModule", "ShardedCall", "ParamLayout", "register_sharded_module",
    "DFunction", "LayoutDecision", "register_layout_rule",
    "clip_grad_norm_", "get_state_dict", "set_state_dict", "all_reduce_grads",
]
