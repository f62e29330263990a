"""ringcore: a pure-Python pipelined ring-allreduce engine on raw TCP sockets.

>>> import numpy as np, ringcore
>>> ringcore.init()                      # rank/size from the launcher's environment
>>> g = np.ones(1000, np.float32)
>>> ringcore.allreduce(g)                # in place: every rank now holds the sum
"""

from ringcore.api import (
    allgather,
    allreduce,
    allreduce_async,
    barrier,
    broadcast,
    broadcast_async,
    communicator,
    init,
    is_initialized,
    local_rank,
    local_size,
    new_communicator,
    rank,
    reduce_scatter,
    shutdown,
    size,
)
from ringcore.comm import Communicator, Handle
from ringcore.errors import (
    AuthenticationError,
    CollectiveTimeout,
    CommunicatorClosed,
    ConfigError,
    MismatchError,
    PeerFailure,
    RingcoreError,
)
from ringcore.ops import Compression, ReduceOp

__version__ = "0.1.0"

__all__ = [
    "AuthenticationError",
    "CollectiveTimeout",
    "Communicator",
    "CommunicatorClosed",
    "Compression",
    "ConfigError",
    "Handle",
    "MismatchError",
    "PeerFailure",
    "ReduceOp",
    "RingcoreError",
    "__version__",
    "allgather",
    "allreduce",
    "allreduce_async",
    "barrier",
    "broadcast",
    "broadcast_async",
    "communicator",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "new_communicator",
    "rank",
    "reduce_scatter",
    "shutdown",
    "size",
]
