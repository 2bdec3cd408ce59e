"""The collectives checkpoint uses: small JSON payloads, each wait bounded by a timeout.

Tensor data never travels between ranks in save or load, only metadata about what was written
and error reports. With ``timeout``, a rank that does not arrive within that many seconds (or
whose peer died) raises ``CollectiveError`` instead of hanging. They live with every other
``torch.distributed`` call in ``sharded_tensor._comm``.
"""

from sharded_tensor._comm import (CollectiveError, ProcessGroup, all_gather_json, broadcast_json, exchange,
                                  gather_json, rank_and_world)

__all__ = ["CollectiveError", "ProcessGroup", "rank_and_world", "gather_json", "broadcast_json",
           "all_gather_json", "exchange"]
