"""Tasks for ``ringcore.torch``'s Horovod API, run on each rank of a test ``Cluster``: ``fn(comm, *args)``.

Ranks already hold ringcore's default communicator, so ``hvd.init()`` keeps it.
Results travel back as numpy arrays or plain Python values.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from tests.bindings import digits


def _hvd() -> Any:
    import torch

    import ringcore.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    return hvd


def _np(tensor: Any) -> np.ndarray:
    import torch

    tensor = tensor.detach()
    if tensor.dtype is torch.bfloat16:
        return tensor.float().numpy()
    return tensor.numpy().copy()


# ------------------------------------------------------------------ collectives


def allreduce(
    comm: Any, inputs: list[np.ndarray], dtype: str, op: str, in_place: bool, kw: dict | None = None
) -> np.ndarray:
    """``hvd.allreduce`` (or ``allreduce_``) of this rank's input, cast to torch ``dtype``; ``kw``: more arguments."""
    import torch

    hvd = _hvd()
    tensor = torch.from_numpy(inputs[comm.rank].copy()).to(getattr(torch, dtype))
    ops = {"average": hvd.Average, "sum": hvd.Sum, "min": hvd.Min, "max": hvd.Max, "product": hvd.Product}
    if in_place:
        out = hvd.allreduce_(tensor, op=ops[op], **(kw or {}))
        assert out is tensor
    else:
        out = hvd.allreduce(tensor, op=ops[op], **(kw or {}))
    return _np(out)


def allreduce_non_contiguous(comm: Any) -> np.ndarray:
    """``allreduce_`` of a transposed view writes the sum back into the view's own memory."""
    import torch

    hvd = _hvd()
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4) * (comm.rank + 1)
    view = base.t()
    assert not view.is_contiguous()
    hvd.allreduce_(view, op=hvd.Sum)
    return _np(base)


def async_calls(comm: Any) -> list[np.ndarray]:
    """Several async calls in flight at once, synchronized in reverse order."""
    import torch

    hvd = _hvd()
    r = comm.rank
    handles = [
        hvd.allreduce_async_(torch.full((5,), float(r + 1)), op=hvd.Sum, name="a"),
        hvd.allreduce_async(torch.full((3,), float(r)), name="b"),
        hvd.allgather_async(torch.full((r + 1, 2), r, dtype=torch.int32)),
        hvd.broadcast_async_(torch.full((4,), float(r)), root_rank=comm.size - 1),
        hvd.reducescatter_async(torch.arange(7.0) * (r + 1), op=hvd.Sum),
    ]
    out = [_np(hvd.synchronize(h)) for h in reversed(handles)]
    assert all(hvd.poll(h) for h in handles)
    group = [torch.full((2,), float(r)), torch.arange(3, dtype=torch.int64) * (r + 1)]
    grouped = hvd.grouped_allreduce_async_(group, op=hvd.Sum, name="g")
    summed = hvd.synchronize(grouped)
    assert hvd.poll(grouped) and summed[0] is group[0] and summed[1] is group[1]
    out += [_np(t) for t in summed]
    averaged = hvd.grouped_allreduce([torch.full((2,), float(r)), torch.full((1,), 2.0 * r)])
    out += [_np(t) for t in averaged]
    return out


def allgather(comm: Any, inputs: list[np.ndarray]) -> np.ndarray:
    import torch

    hvd = _hvd()
    return _np(hvd.allgather(torch.from_numpy(inputs[comm.rank].copy())))


def broadcast(
    comm: Any, inputs: list[np.ndarray], root: int, in_place: bool
) -> tuple[np.ndarray, np.ndarray]:
    """(result, the input tensor afterwards)."""
    import torch

    hvd = _hvd()
    tensor = torch.from_numpy(inputs[comm.rank].copy())
    out = hvd.broadcast_(tensor, root) if in_place else hvd.broadcast(tensor, root)
    return _np(out), _np(tensor)


def reducescatter(comm: Any, inputs: list[np.ndarray], op: str) -> np.ndarray:
    import torch

    hvd = _hvd()
    ops = {"average": hvd.Average, "sum": hvd.Sum, "max": hvd.Max}
    return _np(hvd.reducescatter(torch.from_numpy(inputs[comm.rank].copy()), op=ops[op]))


def objects(comm: Any) -> tuple[Any, list[Any]]:
    hvd = _hvd()
    shared = hvd.broadcast_object({"rank": comm.rank, "data": list(range(comm.rank + 3))}, root_rank=1)
    everyone = hvd.allgather_object(("rank", comm.rank, "x" * comm.rank))
    hvd.barrier()
    return shared, everyone


def gradients(comm: Any) -> dict[str, np.ndarray]:
    """Gradients through allreduce (Sum, Average), allgather, broadcast and reducescatter."""
    import torch

    hvd = _hvd()
    r = comm.rank
    out = {}
    for name, make in (
        ("sum", lambda w: hvd.allreduce(w * (r + 1), op=hvd.Sum)),
        ("average", lambda w: hvd.allreduce(w * (r + 1))),
        ("allgather", lambda w: hvd.allgather(w[: r + 1] * (r + 1))),
        ("broadcast", lambda w: hvd.broadcast(w * (r + 1), root_rank=1)),
        ("reducescatter", lambda w: hvd.reducescatter(w * (r + 1), op=hvd.Sum)),
    ):
        w = torch.arange(1.0, 5.0, requires_grad=True)
        y = make(w)
        (y * torch.arange(1.0, y.shape[0] + 1.0)).sum().backward()
        out[name] = _np(w.grad)
    return out


def bad_input(comm: Any) -> dict[str, str]:
    """Each bad call's error (type: message); then a good allreduce proves nothing half-ran."""
    import torch

    import ringcore

    hvd = _hvd()
    calls = {
        "not a tensor": lambda: hvd.allreduce([1.0, 2.0]),
        "bool tensor": lambda: hvd.allreduce(torch.ones(3, dtype=torch.bool)),
        "leaf requires grad": lambda: hvd.allreduce_(torch.ones(3, requires_grad=True)),
        "adasum": lambda: hvd.allreduce(torch.ones(3), op=hvd.Adasum),
        "scale on ints": lambda: hvd.allreduce(torch.ones(3, dtype=torch.int32), prescale_factor=2.0),
        "root out of range": lambda: hvd.broadcast_(torch.ones(3), root_rank=comm.size),
        "0-d allgather": lambda: hvd.allgather(torch.tensor(1.0)),
        "unknown compression": lambda: hvd.allreduce(torch.ones(3), compression="zip"),
        "optimizer op": lambda: hvd.DistributedOptimizer(
            torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=1), op=hvd.Max
        ),
        "not an optimizer": lambda: hvd.DistributedOptimizer(object()),
    }
    errors = {}
    for what, call in calls.items():
        try:
            call()
            errors[what] = "no error"
        except Exception as err:
            errors[what] = f"{type(err).__name__}: {err}"
    with torch.no_grad():  # allowed, as torch allows in-place updates of leaves there
        leaf = torch.ones(3, requires_grad=True)
        hvd.allreduce_(leaf, op=hvd.Sum)
    errors["after"] = str(leaf.tolist())
    assert isinstance(ringcore.communicator(), type(comm))
    return errors


# ------------------------------------------------------------------ training


def _train_step(model: Any, opt: Any, x: np.ndarray, y: np.ndarray, scale: float = 1.0) -> float:
    import torch
    import torch.nn.functional as F

    loss = F.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y)) * scale
    loss.backward()
    return float(loss.detach())


def params_of(model: Any) -> dict[str, np.ndarray]:
    return {name: p.detach().numpy().copy() for name, p in model.named_parameters()}


def train(
    comm: Any,
    steps: int,
    batch: int,
    compression: str = "none",
    passes: int = 1,
    optimizer: str = "sgd",
    hidden: int = 32,
) -> dict[str, np.ndarray]:
    """Train the digits MLP on this rank's shards with ``DistributedOptimizer``; final parameters.

    With ``passes`` > 1, each step runs that many backward passes on consecutive
    global batches (loss divided by ``passes``), as a rank accumulating locally.
    """
    import torch

    hvd = _hvd()
    model = digits.torch_mlp(seed=0, hidden=hidden)
    base = _optimizer(model, optimizer)
    comp = hvd.Compression.fp16 if compression == "fp16" else hvd.Compression.none
    opt = hvd.DistributedOptimizer(
        base, named_parameters=model.named_parameters(), compression=comp, backward_passes_per_step=passes
    )
    assert isinstance(opt, type(base)) and opt.param_groups is base.param_groups
    for step in range(steps):
        opt.zero_grad()
        for micro in range(passes):
            x, y = digits.shard(step * passes + micro, batch, comm.rank, comm.size)
            _train_step(model, opt, x, y, 1.0 / passes)
        opt.step()
    out = params_of(model)
    out["accuracy"] = np.array(digits.accuracy(lambda x: model(torch.from_numpy(x)).detach().numpy()))
    return out


def train_reporting_calls(comm: Any, steps: int, batch: int) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """``train``, then the calls of each allreduce route (``comm.plan_cache()["calls"]``)."""
    params = train(comm, steps, batch)
    params.pop("accuracy")
    return params, comm.plan_cache()["calls"]


def _optimizer(model: Any, name: str) -> Any:
    import torch

    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=0.01)
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)


def train_uneven_with_join(
    comm: Any, steps_per_rank: list[int], batch: int
) -> tuple[dict[str, np.ndarray], int]:
    """Rank r trains ``steps_per_rank[r]`` steps, then joins; (final parameters, join's answer)."""
    hvd = _hvd()
    model = digits.torch_mlp(seed=0)
    opt = hvd.DistributedOptimizer(_optimizer(model, "sgd"), named_parameters=model.named_parameters())
    for step in range(steps_per_rank[comm.rank]):
        opt.zero_grad()
        _train_step(model, opt, *digits.shard(step, batch, comm.rank, comm.size))
        opt.step()
    last = hvd.join()
    return params_of(model), last


def different_models(comm: Any) -> str:
    """Rank 1 builds a wider hidden layer: every rank must say which parameter differs."""
    import torch

    hvd = _hvd()
    model = digits.torch_mlp(seed=0, hidden=33 if comm.rank == 1 else 32)
    try:
        hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
        )
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def optimizer_misuse(comm: Any) -> dict[str, str]:
    """zero_grad() with averaging pending; more backward passes than declared; a repeated step."""
    import warnings

    import torch

    hvd = _hvd()
    model = digits.torch_mlp(seed=0)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    x, y = digits.shard(0, 32, comm.rank, comm.size)
    found = {}
    _train_step(model, opt, x, y)
    try:
        opt.zero_grad()
        found["zero_grad"] = "no error"
    except RuntimeError as err:
        found["zero_grad"] = str(err)
    opt.step()
    opt.zero_grad()
    _train_step(model, opt, x, y)
    try:
        _train_step(model, opt, x, y)
        found["passes"] = "no error"
    except RuntimeError as err:
        found["passes"] = str(err)
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    found["step after synchronize"] = "; ".join(str(w.message) for w in caught)
    opt.zero_grad()
    _train_step(model, opt, x, y)
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    with opt.skip_synchronize():
        opt.step()
    found["params"] = json.dumps([float(p.detach().sum()) for p in model.parameters()])
    return found


def broadcast_state(comm: Any) -> dict[str, Any]:
    """Ranks start from different weights and optimizer state; afterwards all hold rank 0's."""
    import torch

    hvd = _hvd()
    model = digits.torch_mlp(seed=comm.rank, batch_norm=True)
    model[1].num_batches_tracked += comm.rank + 5
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (comm.rank + 1))
    if comm.rank == 0:  # only the root has stepped: the others' state does not exist yet
        x, y = digits.shard(0, 32, 0, 1)
        _train_step(model, opt, x, y)
        opt.step()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    state = opt.state_dict()
    moments = {str(k): _np(v["exp_avg"]) for k, v in state["state"].items()}
    return {
        "params": {k: _np(v) for k, v in model.state_dict().items()},
        "lr": state["param_groups"][0]["lr"],
        "steps": [float(v["step"]) for v in state["state"].values()],
        "moments": moments,
    }


def timeline_overlap(comm: Any, template: str, steps: int) -> dict[str, Any]:
    """Bucket allreduces' names and start times against when backward started and ended.

    ``template``: ``RINGCORE_TIMELINE``'s value, with ``{rank}``.
    """
    import torch

    hvd = _hvd()
    torch.manual_seed(0)
    layers = [torch.nn.Linear(256, 256) for _ in range(8)]
    model = torch.nn.Sequential(*layers)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters()
    )
    spans = []
    x = torch.randn(256, 256)
    for _ in range(steps):
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        start = time.perf_counter_ns() / 1000.0
        loss.backward()
        spans.append((start, time.perf_counter_ns() / 1000.0))
        opt.step()
    hvd.shutdown()  # closes the timeline file
    trace = json.loads(Path(template.format(rank=comm.rank)).read_text())
    events = [
        {"name": e["args"].get("name"), "ts": e["ts"]}
        for e in trace
        if e.get("ph") == "X" and e.get("cat") == "collective" and e["name"].startswith("allreduce")
    ]
    return {"spans": spans, "events": events}


def sampler_sync(comm: Any, samples: int, batch: int) -> dict[str, Any]:
    """Rank 0 is in epoch 2 with one batch committed and a second not; the last rank joins fresh
    (epoch 0, nothing done); the others are in epoch 2 too. Then a sync, as after a change of world."""
    hvd = _hvd()
    import ringcore.torch.elastic  # noqa: F401 - hvd.elastic

    sampler = hvd.elastic.ElasticSampler(range(samples), seed=7)
    state = hvd.elastic.TorchState(sampler=sampler, epoch=0)
    if comm.rank < comm.size - 1:
        sampler.set_epoch(2)
        sampler.record_batch(0, batch)
        state.save()
        sampler.record_batch(1, batch)  # lost: never committed
    state.sync()
    return {"state": state.sampler.state_dict(), "shard": list(state.sampler)}
