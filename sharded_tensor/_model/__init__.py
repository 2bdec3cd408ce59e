"""Model sharding: the registry of sharded modules at its centre, then planning, split
activations, ``shard_model``, layout-invariant init, optimizer state and training helpers.

The tensor core (``ShardedTensor``, creation, reshard, the generator) sits one level up;
this subpackage builds on it and nothing in the core imports it.
"""
