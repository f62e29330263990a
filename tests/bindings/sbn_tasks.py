"""Rank-side tasks for the SyncBatchNorm tests (``fn(comm, *args)``, run by ``tests.cluster.Cluster``).

Data is made from a seed on every rank and in the test alike (``case``), and
each rank keeps its rows of the global batch (``rows``: explicit counts per
rank, so shards can be uneven or empty). Results come back as numpy arrays.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tests.bindings import digits

CHANNELS = 4
_KEPT: dict[str, Any] = {}  # layers that outlive one task on a rank (eval after training)


def case(
    shape: tuple[int, ...], seed: int, dtype: str = "float32", offset: float = 0.0
) -> dict[str, np.ndarray]:
    """A global batch ``x`` of ``shape``, an output gradient ``g`` of the same shape, weight and bias."""
    rng = np.random.default_rng(seed)
    channels = shape[1]
    spread = rng.uniform(0.5, 3.0, channels).reshape(1, channels, *([1] * (len(shape) - 2)))
    return {
        "x": (offset + spread * rng.standard_normal(shape)).astype(dtype),
        "g": rng.standard_normal(shape).astype(dtype),
        "weight": rng.uniform(0.5, 2.0, channels).astype(dtype),
        "bias": rng.standard_normal(channels).astype(dtype),
    }


def rows(a: np.ndarray, sizes: list[int], rank: int) -> np.ndarray:
    """Rank ``rank``'s rows of ``a`` when rank r holds ``sizes[r]`` consecutive rows."""
    start = sum(sizes[:rank])
    return a[start : start + sizes[rank]]


def _layer(num_features: int, dtype: str, weight: Any = None, bias: Any = None, **kwargs: Any) -> Any:
    import torch

    from ringcore.torch.sync_batch_norm import SyncBatchNorm

    torch.set_num_threads(1)  # ranks share 2 cores with each other and other test runs
    layer = SyncBatchNorm(num_features, **kwargs).to(getattr(torch, dtype))
    if weight is not None:
        with torch.no_grad():
            layer.weight.copy_(torch.from_numpy(weight))
            layer.bias.copy_(torch.from_numpy(bias))
    return layer


def forward_backward(
    comm: Any,
    shape: tuple[int, ...],
    sizes: list[int],
    seed: int,
    dtype: str,
    affine: bool = True,
    input_grad: bool = True,
) -> dict[str, np.ndarray]:
    """One training forward and backward of this rank's rows; output and the gradients there are.

    Gradients: ``dx`` (input), ``dweight`` and ``dbias`` (this rank's local sums).
    """
    import torch

    data = case(shape, seed, dtype)
    if affine:
        layer = _layer(shape[1], dtype, data["weight"], data["bias"])
    else:
        layer = _layer(shape[1], dtype, affine=False, track_running_stats=False)
    x = torch.from_numpy(rows(data["x"], sizes, comm.rank).copy()).requires_grad_(input_grad)
    y = layer(x)
    if y.requires_grad:
        (y * torch.from_numpy(rows(data["g"], sizes, comm.rank))).sum().backward()
    grads = {"dx": x.grad} if input_grad else {}
    if affine:
        grads.update(dweight=layer.weight.grad, dbias=layer.bias.grad)
    return {"y": y.detach().numpy(), **{key: grad.numpy() for key, grad in grads.items()}}


def train_running_stats(
    comm: Any, sizes: list[int], steps: int, momentum: float | None, offset: float
) -> dict[str, np.ndarray]:
    """``steps`` training forwards (seeds 0..steps-1, shape ``(sum(sizes), CHANNELS, 3)``); keep the layer."""
    import torch

    layer = _layer(CHANNELS, "float32", momentum=momentum)
    for step in range(steps):
        x = rows(case((sum(sizes), CHANNELS, 3), step, offset=offset)["x"], sizes, comm.rank)
        layer(torch.from_numpy(x))
    _KEPT["layer"] = layer
    return {name: buf.numpy().copy() for name, buf in layer.named_buffers()}


def eval_kept(comm: Any, x: np.ndarray) -> np.ndarray:
    """The kept layer in eval mode on ``x``: running statistics, no communication."""
    import torch

    layer = _KEPT["layer"].eval()
    with torch.no_grad():
        return layer(torch.from_numpy(x)).numpy()


def forward_shapes(comm: Any, shapes: list[tuple[int, ...]], dtypes: list[str]) -> tuple[int, ...]:
    """A training forward and backward of a ``CHANNELS``-feature layer on this rank's shape and dtype."""
    import torch

    layer = _layer(CHANNELS, "float32")
    x = torch.ones(shapes[comm.rank], dtype=getattr(torch, dtypes[comm.rank]))
    if x.is_floating_point():
        x = (x + torch.arange(x.numel()).reshape(x.shape)).requires_grad_()
    y = layer(x)
    y.sum().backward()
    return tuple(y.shape)


def train_digits(comm: Any, steps: int, batch: int, lr: float) -> dict[str, np.ndarray]:
    """SGD on digits with SyncBatchNorm; the loss is each rank's share of the global mean, gradients summed.

    Rank r's loss is ``sum(losses of its rows) / batch``, so the ranks' losses add
    up to the global batch's mean loss and the summed gradients are its gradient,
    whatever the shard sizes (with equal shards: the mean loss and ``op="avg"``).
    """
    import torch
    import torch.nn.functional as F

    from ringcore.torch.sync_batch_norm import SyncBatchNorm

    torch.set_num_threads(1)
    model = SyncBatchNorm.convert_sync_batchnorm(digits.torch_mlp(0, batch_norm=True))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        x, y = digits.shard(step, batch, comm.rank, comm.size)
        opt.zero_grad()
        out = model(torch.from_numpy(x))
        (F.cross_entropy(out, torch.from_numpy(y), reduction="sum") / batch).backward()
        for p in model.parameters():
            comm.allreduce(p.grad, op="sum")
        opt.step()
    return {name: t.detach().numpy().copy() for name, t in model.state_dict().items()}
