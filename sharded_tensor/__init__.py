"""The metadata-first ShardedTensor: creation, resharding, gathering."""

from _shardkit.comm import CollectiveError, CommCounter

from ._create import empty, full, ones, rand, randn, shard_tensor, zeros
from ._dtensor import from_dtensor
from ._fsdp.api import fully_shard, no_sync
from ._model import attention as _attention  # noqa: F401 - registers nn.MultiheadAttention
from ._model.dfunction import DFunction, LayoutDecision, register_layout_rule
from ._model.engine.zone import loss_parallel
from ._model.explain import explain
from ._model.optim import load_optim_state_dict, optim_state_dict
from ._model.parallel import ParamLayout
from ._model.registry import ShardedCall, ShardedModule, register_sharded_module
from ._model.sharder import shard_model, shard_parameter
from ._model.split_rules import register_split_rule
from ._model.tp_plan import tensor_parallel_spec
from ._model.training import (
    all_reduce_grads,
    clip_grad_norm_,
    get_state_dict,
    set_state_dict,
)
from ._tensor import Shard, ShardedTensor
from ._visualize import visualize_sharding

__all__ = [
    "ShardedTensor", "Shard", "CommCounter", "CollectiveError",
    "empty", "zeros", "ones", "full", "rand", "randn", "shard_tensor",
    "visualize_sharding", "from_dtensor",
    "shard_parameter", "shard_model", "tensor_parallel_spec",
    "optim_state_dict", "load_optim_state_dict", "loss_parallel",
    "ShardedModule", "ShardedCall", "ParamLayout", "register_sharded_module",
    "DFunction", "LayoutDecision", "register_layout_rule", "register_split_rule",
    "clip_grad_norm_", "get_state_dict", "set_state_dict", "all_reduce_grads",
    "fully_shard", "no_sync", "explain",
]

# Tracebacks and reprs name the class where users import it (``st.CollectiveError``), not the
# private runtime module defining it.
CollectiveError.__module__ = __name__
