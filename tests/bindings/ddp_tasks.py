"""Rank tasks for the torch.distributed "ringcore" backend tests: ``fn(comm, *args)``, run by ``Cluster``.

``comm`` (the cluster's own ringcore communicator) only supplies rank and
size: every task makes its own process group over ``tcp://127.0.0.1:{port}``
with the port the test picked, and destroys it before returning (importing
``ringcore.torch``, here through ``ddp_hooks``, registered the backend). Training
tasks return parameters and buffers as numpy arrays, so the test compares
backends and ranks.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

from ringcore.config import Settings
from ringcore.torch import ddp_hooks
from ringcore.torch import process_group as ringcore_pg
from tests.bindings import digits

STEPS, BATCH = 20, 60
_live: dict[str, Any] = {}  # a group kept between tasks (failure tests)
# DDP models of finished runs, never freed. Freeing one can deadlock torch 2.13:
# ~ProcessGroupGloo (under the GIL) joins a gloo thread that is still destroying the last Work
# and waits for the GIL to drop a Python object (seen 1 run in 3 when freed at once, and again
# when freed at the next run). Rank processes end in os._exit (multiprocessing), so nothing
# frees them at exit either; a few small models per process.
_retired: list[Any] = []
# Broadcast buffers from rank 0 at every forward: ``broadcast_buffers``, renamed in torch 2.13.
_SYNC_BUFFERS = {
    "forward_sync_buffers"
    if "forward_sync_buffers" in inspect.signature(DDP).parameters
    else "broadcast_buffers": True
}


@contextlib.contextmanager
def process_group(comm: Any, backend: str, port: int, **kwargs: Any) -> Iterator[None]:
    """The default process group of ``backend`` for the block, on every rank."""
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank, world_size=comm.size, **kwargs
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------ training


class Branchy(torch.nn.Module):
    """The digits MLP plus a head that only some steps use (for ``find_unused_parameters``)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.body = digits.torch_mlp(seed)
        self.extra = torch.nn.Linear(digits.CLASSES, digits.CLASSES)

    def forward(self, x: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        y = self.body(x)
        return self.extra(y) if use_extra else y


def _model(kind: str) -> torch.nn.Module:
    if kind == "branchy":
        return Branchy(seed=1)
    return digits.torch_mlp(seed=1, batch_norm=kind == "batchnorm")


def train(
    comm: Any, backend: str, port: int, kind: str, mode: str = "plain", hook: str | None = None
) -> dict:
    """``STEPS`` SGD steps of DDP on this rank's digits shards; parameters, buffers and losses.

    Args:
        kind: ``"mlp"``, ``"batchnorm"`` (BatchNorm1d, buffers broadcast) or ``"branchy"``.
        mode: ``"plain"``; ``"unused"`` (find_unused_parameters, the extra head
            skipped on some steps, not the same ones on every rank); ``"no_sync"``
            (gradients accumulated over 2 batches); ``"join"`` (rank r has
            ``2 r`` fewer batches, under ``Join``).
        hook: ``"fp16"``: ringcore's fp16 compression hook.
    """
    with process_group(comm, backend, port):
        model = _model(kind)
        ddp = DDP(model, **_SYNC_BUFFERS, find_unused_parameters=mode == "unused")
        if hook == "fp16":
            ddp.register_comm_hook(None, ddp_hooks.fp16_compress_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
        steps = STEPS - 2 * comm.rank if mode == "join" else STEPS
        losses = []
        with Join([ddp]) if mode == "join" else contextlib.nullcontext():
            for step in range(steps):
                losses.append(_step(ddp, opt, comm, step, mode))
        _retired.append(ddp)
        return {
            "params": {k: v.detach().numpy().copy() for k, v in model.named_parameters()},
            "buffers": {k: v.detach().numpy().copy() for k, v in model.named_buffers()},
            "losses": losses,
        }


def _step(ddp: DDP, opt: torch.optim.Optimizer, comm: Any, step: int, mode: str) -> float:
    x, y = (torch.from_numpy(a) for a in digits.shard(step, BATCH, comm.rank, comm.size))
    out = ddp(x, use_extra=(step + comm.rank) % 3 != 0) if mode == "unused" else ddp(x)
    loss = F.cross_entropy(out, y)
    value = float(loss.detach())
    if mode == "no_sync" and step % 2 == 0:
        with ddp.no_sync():
            loss.backward()
        return value
    loss.backward()
    opt.step()
    opt.zero_grad()
    return value


def train_both(comm: Any, ports: tuple[int, int], kind: str, mode: str = "plain") -> dict[str, dict]:
    """:func:`train` on "ringcore", then the same on "gloo"."""
    ringcore_port, gloo_port = ports
    return {
        "ringcore": train(comm, "ringcore", ringcore_port, kind, mode),
        "gloo": train(comm, "gloo", gloo_port, kind, mode),
    }


# ------------------------------------------------------------------ collectives


def inputs(rank: int, count: int = 7, dtype: str = "float32") -> np.ndarray:
    """Rank ``rank``'s input (the test recomputes every rank's for its numpy reference)."""
    values = np.random.default_rng(rank).uniform(0.5, 1.5, count)
    return (values * 10).astype(dtype) if dtype.startswith("int") else values.astype(dtype)


def collectives(comm: Any, port: int) -> dict[str, Any]:
    """Every implemented collective once (several ways for allreduce); results by name."""
    rank, n = comm.rank, comm.size
    out: dict[str, Any] = {}
    with process_group(comm, "ringcore", port):
        for op in ("SUM", "AVG", "PRODUCT", "MIN", "MAX"):
            t = torch.from_numpy(inputs(rank))
            dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
            out[f"all_reduce {op}"] = t.numpy()
        t = torch.from_numpy(inputs(rank, dtype="int64"))
        dist.all_reduce(t)
        out["all_reduce int64"] = t.numpy()
        wide = torch.from_numpy(inputs(rank, 12)).reshape(3, 4)
        strided = wide[:, ::2]  # not contiguous: reduced through a copy, written back
        dist.all_reduce(strided)
        out["all_reduce strided"] = wide.numpy()

        work = dist.all_reduce(torch.from_numpy(inputs(rank)), async_op=True)
        out["wait"] = work.wait()
        out["async wait"] = work.result()[0].numpy()
        fut = dist.all_reduce(torch.from_numpy(inputs(rank)), async_op=True).get_future()
        out["async future"] = fut.wait()[0].numpy()
        inner = torch.from_numpy(inputs(rank + 20))

        def nested(
            done: Any,
        ) -> torch.Tensor:  # as torch's powerSGD_hook: a collective waited for in a callback
            return dist.all_reduce(inner, async_op=True).get_future().wait()[0] + done.value()[0]

        fut = dist.all_reduce(torch.from_numpy(inputs(rank)), async_op=True).get_future().then(nested)
        out["collective in a callback"] = fut.wait().numpy()
        reduced = torch.from_numpy(inputs(rank))
        dist.reduce(reduced, dst=n - 1, op=dist.ReduceOp.MAX)
        out["reduce MAX to the last"] = reduced.numpy()
        gathered_at_0 = [torch.empty(2, 3) for _ in range(n)] if rank == 0 else None
        dist.gather(torch.from_numpy(inputs(rank, 6)).reshape(2, 3), gathered_at_0, dst=0)
        out["gather to 0"] = None if gathered_at_0 is None else [g.numpy() for g in gathered_at_0]
        part = torch.empty(2, 2, dtype=torch.float64)
        parts = [torch.full((2, 2), float(10 * r + 1), dtype=torch.float64) for r in range(n)]
        dist.scatter(part, parts if rank == 1 else None, src=1)
        out["scatter from 1"] = part.numpy()
        # functional collectives (DTensor's, FSDP2's) find the group by the name torch gave it
        import torch.distributed._functional_collectives as functional

        out["group name"] = dist.group.WORLD.group_name
        reduced = functional.all_reduce(torch.from_numpy(inputs(rank)), "sum", dist.group.WORLD)
        out["functional all_reduce"] = functional.wait_tensor(reduced).numpy()

        pair = [torch.from_numpy(inputs(rank, 6)).reshape(2, 3), torch.from_numpy(inputs(rank + 10, 4))]
        dist.all_reduce_coalesced(pair)
        out["all_reduce_coalesced"] = [p.numpy() for p in pair]

        b = torch.from_numpy(inputs(rank))
        dist.broadcast(b, src=n - 1)
        out["broadcast"] = b.numpy()
        flags = torch.tensor([rank % 2 == 0, True, False])
        dist.broadcast(flags, src=n - 1)
        out["broadcast bool"] = flags.numpy()

        gathered = [torch.empty(2, 3) for _ in range(n)]
        dist.all_gather(gathered, torch.from_numpy(inputs(rank, 6)).reshape(2, 3))
        out["all_gather"] = [g.numpy() for g in gathered]
        flat = torch.empty(n * 4, dtype=torch.bfloat16)
        dist.all_gather_into_tensor(flat, torch.from_numpy(inputs(rank, 4)).to(torch.bfloat16))
        out["all_gather_into_tensor bf16"] = flat.float().numpy()

        for op in ("SUM", "MAX"):
            mine = torch.empty(2, 2)
            dist.reduce_scatter_tensor(
                mine, torch.from_numpy(inputs(rank, 4 * n)), op=getattr(dist.ReduceOp, op)
            )
            out[f"reduce_scatter_tensor {op}"] = mine.numpy()
        mine = torch.empty(3)
        dist.reduce_scatter(mine, list(torch.from_numpy(inputs(rank, 3 * n)).reshape(n, 3)))
        out["reduce_scatter"] = mine.numpy()

        objects: list[Any] = [None] * n
        dist.all_gather_object(objects, {"rank": rank})
        out["all_gather_object"] = objects
        dist.barrier()
        out["barrier"] = True
    return out


def fsdp2_params(comm: Any, backend: str, port: int) -> dict[str, Any]:
    """Five SGD steps of a small MLP under FSDP2 (``fully_shard``: DTensor's collectives, coalesced);
    the whole parameters gathered, and DTensor's ``full_tensor`` of a tensor sharded by hand."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    with process_group(comm, backend, port):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        generator = torch.Generator().manual_seed(comm.rank)
        for _ in range(5):
            x, y = torch.randn(16, 8, generator=generator), torch.randn(16, 4, generator=generator)
            loss = ((model(x) - y) ** 2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        params = torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()]).detach().numpy()
        mesh = init_device_mesh("cpu", (comm.size,))
        sharded = distribute_tensor(torch.arange(6.0 * comm.size), mesh, [Shard(0)])
        return {"params": params, "full": sharded.full_tensor().numpy(), "local": sharded.to_local().numpy()}


def refusals(comm: Any, port: int) -> dict[str, str]:
    """What the unimplemented calls, an unsupported op and bad input raise: ``"Type: message"``."""
    rank, n = comm.rank, comm.size
    t = torch.ones(3)
    calls = {
        "send": lambda: dist.send(t, dst=(rank + 1) % n),
        "all_to_all": lambda: dist.all_to_all([torch.empty(1) for _ in range(n)], [torch.ones(1)] * n),
        "all_to_all_single": lambda: dist.all_to_all_single(torch.empty(n), torch.ones(n)),
        "BAND": lambda: dist.all_reduce(torch.ones(3, dtype=torch.int32), op=dist.ReduceOp.BAND),
        "bool sum": lambda: dist.all_reduce(torch.ones(3, dtype=torch.bool)),
        "reduce_scatter_tensor size": lambda: dist.reduce_scatter_tensor(
            torch.empty(2), torch.ones(2 * n + 1)
        ),
    }
    out = {}
    with process_group(comm, "ringcore", port):
        for name, call in calls.items():
            out[name] = _error(call)
        ok = torch.ones(2)
        dist.all_reduce(ok)  # still usable: every refusal came before anything was sent
        out["after"] = ok.tolist()
    return out


def mismatch(comm: Any, port: int) -> dict[str, str]:
    """Ranks disagree on the shape: an error on every rank; the group is closed afterwards."""
    out = {}
    with process_group(comm, "ringcore", port):
        out["first"] = _error(lambda: dist.all_reduce(torch.ones(4 + comm.rank)))
        out["next"] = _error(lambda: dist.all_reduce(torch.ones(4)))
    return out


def subgroup(comm: Any, ports: tuple[int, int], members: list[int]) -> dict[str, Any]:
    """A "ringcore" ``new_group`` of ``members`` inside a gloo world, and ringcore's timeout rule."""
    out: dict[str, Any] = {}
    with process_group(comm, "gloo", ports[0]):
        group = dist.new_group(members, backend="ringcore", timeout=timedelta(seconds=42))
        t = torch.full((3,), float(comm.rank + 1))
        if comm.rank in members:
            dist.all_reduce(t, group=group)
            out["timeout"] = ringcore_pg.communicator(group).settings.timeout
        out["sum"] = t.tolist()
        world = torch.ones(1)
        dist.all_reduce(world)  # the gloo world still works beside it
        out["world"] = world.item()
    with process_group(comm, "ringcore", ports[1]):
        out["default timeout"] = ringcore_pg.communicator().settings.timeout
    out["RINGCORE_TIMEOUT"] = Settings.from_env().timeout
    return out


# ------------------------------------------------------------------ a failing peer


def join_and_reduce(comm: Any, port: int) -> float:
    """A "ringcore" world, and DDP over a "ringcore" group of all ranks: one step each, kept for later."""
    dist.init_process_group(
        "ringcore", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank, world_size=comm.size
    )
    t = torch.ones(1000)
    dist.all_reduce(t)
    ddp = DDP(digits.torch_mlp(seed=1), process_group=dist.new_group(backend="ringcore"))
    _live["ddp"] = ddp
    _ddp_step(ddp, comm)
    return float(t[0])


def _ddp_step(ddp: DDP, comm: Any) -> None:
    x, y = (torch.from_numpy(a) for a in digits.shard(0, BATCH, comm.rank, comm.size))
    F.cross_entropy(ddp(x), y).backward()


def reduce_after_failure(comm: Any) -> dict[str, Any]:
    """After a peer died: DDP's backward and each way of waiting raise; how long each took."""
    out: dict[str, Any] = {}
    start = time.monotonic()
    out["ddp"] = _error(lambda: _ddp_step(_live["ddp"], comm))
    out["ddp seconds"] = time.monotonic() - start
    start = time.monotonic()
    work = dist.all_reduce(torch.ones(1000), async_op=True)
    out["wait"] = _error(work.wait)
    out["wait seconds"] = time.monotonic() - start
    out["future"] = _error(work.get_future().wait)
    out["next"] = _error(dist.barrier)
    _live.clear()
    dist.destroy_process_group()
    return out


def _error(call: Any) -> str:
    """``"Type: message"`` of what ``call()`` raises, or ``"no error"``."""
    try:
        call()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "no error"
