"""ringcore.ray: ringcore jobs on a Ray cluster, with no launcher of ringcore's own.

- :class:`RingcoreExecutor` places one actor per rank (a placement group),
  numbers the ranks by node, gives each its ``RINGCORE_*`` variables and a
  fresh secret, runs functions on every rank, and names the rank and node
  that failed a call (``executor``, ``layout``, ``worker``, ``failures``).
- :class:`ElasticRingcoreExecutor` runs an elastic job (``ringcore.elastic``)
  on ``min_workers``..``max_workers`` actors: a lost actor is replaced and the
  job goes on from the last commit (``elastic``, ``elastic_pool``).
- Ray Train: ``TorchTrainer(..., torch_config=TorchConfig(backend="ringcore"))``
  trains on ringcore's torch.distributed backend once every worker has
  registered it; Ray's ``worker_process_setup_hook`` does that:
  ``ray.init(runtime_env=ringcore.ray.RUNTIME_ENV)`` (``setup_hook``).
- ``ray.util.collective``: ``import ringcore.ray.collective`` (or the same
  hook) registers the backend "ringcore" (``collective``).

``import ringcore.ray`` imports Ray but neither torch nor ``ray.util.collective``.
"""

from ringcore.ray.elastic import ElasticRingcoreExecutor
from ringcore.ray.executor import RingcoreExecutor
from ringcore.ray.failures import WorkerError, WorkerLost, WorkerTimeout
from ringcore.ray.layout import Slot
from ringcore.ray.setup_hook import RUNTIME_ENV, after_import, setup_worker

__all__ = [
    "RUNTIME_ENV",
    "ElasticRingcoreExecutor",
    "RingcoreExecutor",
    "Slot",
    "WorkerError",
    "WorkerLost",
    "WorkerTimeout",
    "after_import",
    "setup_worker",
]
