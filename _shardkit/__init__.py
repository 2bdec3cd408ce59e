"""shardkit's private runtime, shared by ``sharded_tensor`` and ``checkpoint``.

``comm`` holds every ``torch.distributed`` call (collectives with timeouts, JSON exchange),
``memory`` the CPU allocation helpers, ``dtensor`` the test for PyTorch's ``DTensor``, ``launch``
the process launcher of tests and benchmarks. Nothing here is public API; it imports only torch
and ``sharding``.
"""
