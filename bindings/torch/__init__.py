"""ringcore.torch: Horovod's PyTorch API on ringcore, and the torch.distributed backend "ringcore".

A script written for ``horovod.torch`` runs with one changed line::

    import ringcore.torch as hvd

    hvd.init()
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    for x, y in loader:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()   # gradients are averaged while backward runs
        optimizer.step()

Importing it registers the ``"ringcore"`` backend of ``torch.distributed``, so
DDP users switch with ``dist.init_process_group("ringcore")``. ``import
ringcore`` alone never imports torch.

Which file does what: ``basics`` (init, rank..., ops, compression),
``tensors`` (tensors in and out of ringcore), ``collectives`` (allreduce,
allgather, broadcast, reducescatter, barrier, join, objects), ``joining`` (how a
rank out of data serves the others), ``fusion`` (gradient buckets),
``optimizer`` (DistributedOptimizer), ``elastic`` (TorchState for
``ringcore-run --min-np``), ``elastic_sampler`` (ElasticSampler), ``parameters`` (broadcast_parameters,
broadcast_optimizer_state), ``objects`` (pickled objects, model layout
checks), ``sync_batch_norm``, ``process_group`` (the torch.distributed
backend) with ``work`` (its Work objects) and ``launcher_env`` (torch's
variables under mpirun and srun), ``ddp_hooks`` (DDP communication hooks with
ringcore's compression).
"""

from ringcore.torch import ddp_hooks, elastic
from ringcore.torch import process_group as _process_group
from ringcore.torch.basics import (
    Adasum,
    Average,
    Compression,
    Max,
    Min,
    Product,
    Sum,
    cross_rank,
    cross_size,
    cuda_built,
    gloo_built,
    gloo_enabled,
    init,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    shutdown,
    size,
)
from ringcore.torch.collectives import (
    Handle,
    allgather,
    allgather_async,
    allgather_object,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    broadcast_object,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    join,
    poll,
    reducescatter,
    reducescatter_async,
    synchronize,
)
from ringcore.torch.optimizer import DistributedOptimizer
from ringcore.torch.parameters import broadcast_optimizer_state, broadcast_parameters
from ringcore.torch.sync_batch_norm import SyncBatchNorm

_process_group.register()

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "DistributedOptimizer",
    "Handle",
    "Max",
    "Min",
    "Product",
    "Sum",
    "SyncBatchNorm",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddp_hooks",
    "elastic",
    "gloo_built",
    "gloo_enabled",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "init",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "poll",
    "rank",
    "reducescatter",
    "reducescatter_async",
    "rocm_built",
    "shutdown",
    "size",
    "synchronize",
]
