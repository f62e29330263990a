"""Functions the Ray tests send to RingcoreExecutor ranks and to Ray Train workers.

Executor functions join the job with ``ringcore.init()`` when this actor has
not yet (an earlier call may have), as a user's function would; they return
plain numpy data for the test to compare against numpy. ``train_loop`` is the
digits training of the bindings tests, run by ``TorchTrainer`` on whichever
backend ``TorchConfig`` names.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np

import ringcore
from tests.bindings import digits

_keep: list[Any] = []  # DDP models of finished runs: see ddp_tasks._retired (freeing one can deadlock gloo)


def inputs(rank: int, count: int = 7, dtype: str = "float32") -> np.ndarray:
    """Rank ``rank``'s input: the same on the ranks and in the test."""
    values = np.random.default_rng(100 + rank).uniform(0.5, 1.5, count)
    return (values * 8).astype(dtype) if np.dtype(dtype).kind == "i" else values.astype(dtype)


def _join() -> tuple[int, int]:
    if not ringcore.is_initialized():
        ringcore.init()
    return ringcore.rank(), ringcore.size()


# ------------------------------------------------------------------ executor


def collectives(count: int) -> dict[str, Any]:
    """Every core collective on this rank's inputs, and what the executor told this rank."""
    rank, size = _join()
    x = inputs(rank, count)
    out: dict[str, Any] = {
        "rank": rank,
        "size": size,
        "local": (ringcore.local_rank(), ringcore.local_size()),
        "env": os.environ.get("RC_TEST_ENV"),
        "secret set": bool(os.environ.get("RINGCORE_SECRET")),
    }
    for op in ("sum", "avg", "min", "max", "prod"):
        out[op] = ringcore.allreduce(x.copy(), op=op)
    out["int64 sum"] = ringcore.allreduce(inputs(rank, count, "int64"))
    out["broadcast"] = ringcore.broadcast(x.copy(), root=size - 1)
    out["allgather"] = ringcore.allgather(inputs(rank, 2 * (rank + 1)).reshape(rank + 1, 2))
    out["reduce_scatter"] = ringcore.reduce_scatter(x, op="sum")
    ringcore.barrier()
    return out


def remember(state: Any) -> int:
    """Keep a value in the actor's state; returns the actor's pid."""
    state.value = 10 * int(os.environ["RINGCORE_RANK"])
    return os.getpid()


def recall(state: Any) -> tuple[int, int]:
    return state.value, os.getpid()


def raise_on(victim: int) -> None:
    """Rank ``victim`` raises before the allreduce the others wait in."""
    rank, _ = _join()
    if rank == victim:
        raise ValueError(f"boom on rank {rank}")
    ringcore.allreduce(np.ones(1000, np.float32))


def die_on(victim: int) -> None:
    """Rank ``victim``'s process is killed (SIGKILL) while the others are in an allreduce."""
    rank, _ = _join()
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    while True:
        ringcore.allreduce(np.ones(1000, np.float32))


def ray_collectives(group: str) -> dict[str, Any]:
    """Every ``ray.util.collective`` call on backend "ringcore", on numpy arrays and torch tensors."""
    import torch
    from ray.util import collective as col
    from ray.util.collective.backend_registry import _global_registry

    registered = _global_registry.is_registered("RINGCORE")  # by ringcore.ray.setup_worker, on import
    rank, size = int(os.environ["RINGCORE_RANK"]), int(os.environ["RINGCORE_SIZE"])
    col.init_collective_group(size, rank, backend="ringcore", group_name=group)
    out: dict[str, Any] = {"registered by the hook": registered, "rank": col.get_rank(group)}
    for kind, wrap in (("numpy", np.asarray), ("torch", torch.from_numpy)):
        x = wrap(inputs(rank, 6))
        col.allreduce(x, group_name=group)
        out[f"{kind} allreduce"] = np.asarray(x)
        x = wrap(inputs(rank, 6))
        col.allreduce(x, group_name=group, op=col.types.ReduceOp.MAX)
        out[f"{kind} allreduce max"] = np.asarray(x)
        x = wrap(inputs(rank, 6))
        col.broadcast(x, src_rank=size - 1, group_name=group)
        out[f"{kind} broadcast"] = np.asarray(x)
        parts = [wrap(np.zeros((2, 3), np.float32)) for _ in range(size)]
        col.allgather(parts, wrap(inputs(rank, 6).reshape(2, 3)), group_name=group)
        out[f"{kind} allgather"] = [np.asarray(p) for p in parts]
        mine = wrap(np.zeros(3, np.float32))
        col.reducescatter(mine, [wrap(inputs(rank + 10 * r, 3)) for r in range(size)], group_name=group)
        out[f"{kind} reducescatter"] = np.asarray(mine)
        col.barrier(group_name=group)
    col.destroy_collective_group(group)
    out["torch imported"] = "torch" in sys.modules
    return out


# ------------------------------------------------------------------ Ray Train


def train_loop(config: dict[str, Any]) -> None:
    """``config["steps"]`` SGD steps of DDP on the digits MLP; each rank saves its parameters."""
    import ray.train
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    context = ray.train.get_context()
    rank, size = context.get_world_rank(), context.get_world_size()
    torch.set_num_threads(1)
    model = digits.torch_mlp(seed=1)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(config["steps"]):
        x, y = (torch.from_numpy(a) for a in digits.shard(step, config["batch"], rank, size))
        loss = F.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    params = {f"param/{k}": v.detach().numpy().copy() for k, v in model.named_parameters()}
    np.savez(Path(config["out"]) / f"rank{rank}.npz", backend=dist.get_backend(), losses=losses, **params)
    _keep.append(ddp)


class Holder:
    """An ``executable_cls``: state made once per actor by ``start()``."""

    def __init__(self, value: int) -> None:
        self.value = value + int(os.environ["RINGCORE_RANK"])
