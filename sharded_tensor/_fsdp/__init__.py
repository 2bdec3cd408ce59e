"""Fully sharded data parallel: ``st.fully_shard`` and ``st.no_sync``.

``plan`` is the pure layout of a unit's flat buffers; ``unit`` the runtime around a
module's forward and backward (gather, free, reduce-scatter, prefetch); ``api`` the public
functions, which record fully sharded parameters exactly as ``shard_model`` records split
ones, so state dicts, checkpoints, clipping and optimizer state work on them unchanged.
The collectives themselves are in ``_shardkit.flat``.
"""
