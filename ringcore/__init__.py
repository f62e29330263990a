"""ringcore: a pure-Python pipelined ring-allreduce engine on raw TCP sockets.

>>> import numpy as np, ringcore
>>> ringcore.init()                      # rank/size from the launcher's environment
>>> g = np.ones(1000, np.float32)
>>> ringcore.allreduce(g)                # in place: every rank now holds the sum

Which file does what, top down (imports run one way):

- :mod:`~ringcore.api`: the module functions, over one default Communicator.
- :mod:`~ringcore.comm`: the Communicator: one route for every collective
  (make or find its plan, take a ticket, run the plan in its turn; async on one thread).
- :mod:`ringcore.plans`: one plan per collective; the allreduce plan cache.
  :mod:`~ringcore.slicing`: slices and the allreduce's schedule choice, shared with
  :mod:`ringcore.device` (GPU buffers).
- :mod:`~ringcore.symmetric`: arrays every rank of a one-host job maps (``ringcore.empty``).
- :mod:`~ringcore.context`: what plans run with (transport, scratch, reducers; ``execute``, ``fail``).
- :mod:`ringcore.algo`: schedules, their compiled programs, the executors.
- :mod:`ringcore.transport`, :mod:`ringcore.kernels`: moving and reducing bytes.
- Start-up: :mod:`~ringcore.config` (every ``RINGCORE_*`` variable), :mod:`~ringcore.rendezvous`,
  :mod:`~ringcore.bootstrap`, :mod:`~ringcore.store`, :mod:`~ringcore.auth`, :mod:`~ringcore.placement`.
- Launching: :mod:`~ringcore.run` (``ringcore-run``), across hosts and elastic (``hosts``,
  ``remote``, ``rank_agent``, ``processes``, ``elastic*``, ``discovery``).
- Operations: :mod:`~ringcore.stall`, :mod:`~ringcore.timeline`; errors: :mod:`~ringcore.errors`.
"""

from ringcore.api import (
    allgather,
    allreduce,
    allreduce_async,
    barrier,
    broadcast,
    broadcast_async,
    communicator,
    empty,
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
    "empty",
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
