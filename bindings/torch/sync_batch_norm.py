"""SyncBatchNorm: batch normalization with statistics over every rank's batch (Horovod's ``hvd.SyncBatchNorm``).

One class for 2-D to 5-D inputs ``(batch, C, *spatial)``, a drop-in for
``torch.nn.BatchNorm1d/2d/3d`` as ``torch.nn.SyncBatchNorm`` is. In training mode
the mean and variance are those of the *global* batch, the concatenation of
every rank's batch (which may differ in size, or be empty); in eval mode, when
ringcore is not initialized, or in a world of one, it is ``F.batch_norm`` and
communicates nothing.

Math (per channel; ``n`` values per channel on a rank, ``N = sum n`` over ranks):

- forward: each rank computes, in float64, its count ``n``, sum ``s = n m`` and
  ``q = M2 + n m^2``, where ``m`` and ``M2`` (sum of squared deviations from ``m``)
  come from ``torch.var_mean`` of its own values in float64. One allreduce sums
  ``(n, s, q)``; then ``mean = S / N`` and ``M2 = Q - S mean`` is Chan's
  combination ``sum M2_r + sum n_r (m_r - mean)^2`` with the between-rank term
  expanded. Within a rank nothing cancels; the expansion costs about
  ``eps64 (mean/std)^2`` of the variance, less than the variance float32
  rounding of the inputs already adds (``eps32^2 (mean/std)^2 / 3``), so the
  statistics are as good as the data. ``y = (x - mean) * invstd * weight + bias``
  with ``invstd = 1 / sqrt(M2 / N + eps)``.
- running stats: ``running_mean`` moves towards ``mean`` and ``running_var``
  towards the unbiased ``M2 / (N - 1)`` (``momentum``, or the cumulative
  average when it is ``None``), exactly as BatchNorm over the global batch.
- backward: with ``xhat = (x - mean) * invstd`` and ``dy`` the local output
  gradient, ``dx = weight * invstd * (dy - sum(dy) / N - xhat * sum(dy xhat) / N)``
  where both sums run over the global batch: one allreduce of the local sums
  (float64). ``dweight = sum(dy xhat)`` and ``dbias = sum(dy)`` are the *local*
  sums, as in ``torch.nn.SyncBatchNorm``: summed over ranks they are the
  gradient of the sum of every rank's loss, so averaging gradients over ranks
  afterwards (DDP, a distributed optimizer, ``allreduce(grad, op="avg")``)
  treats them like every other parameter's. With uneven shards, averaging
  weighs every rank's mean loss equally, which is not the global batch's mean:
  make each rank's loss its share of it (its rows' summed loss / the global
  batch size) and sum gradients instead.

Communication, per layer and training step: forward, one allreduce of ``2C + 2``
float64 (a bad-input flag, the count, ``s`` and ``q``); backward, one of ``2C``
float64 (none when the input needs no gradient). Both are small (16 KiB at
``C = 1024``: ringcore's latency path, about ``log2(N)`` exchanges). Compute: the input
is read about three times each way, and the forward holds one float64 copy of
it while it computes the local moments.

Rules: every rank must run the same layers in the same mode, in the same order,
with the same ``num_features``, forward and backward (as with torch's); a rank
that skips one leaves the others waiting until ``RINGCORE_TIMEOUT`` raises
``CollectiveTimeout``. A rank
whose input this layer cannot normalize (fewer than 2 dims, a channel count
other than ``num_features``, a non-floating dtype) still joins the forward
allreduce with a flag, so every rank raises ``ValueError`` together instead of
waiting for it. A global batch of at most one value per channel raises
``ValueError`` on every rank, like BatchNorm's "more than 1 value per channel".
A rank with an empty batch contributes nothing and gets an empty output.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

import ringcore

_F64 = torch.float64


def _reduce_dims(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def _per_channel(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``v`` (shape ``(C,)``) shaped to broadcast against ``x`` (``(batch, C, *spatial)``), in x's dtype."""
    return v.to(x.dtype).view(1, -1, *([1] * (x.dim() - 2)))


def _input_problem(x: torch.Tensor, num_features: int) -> str | None:
    """Why this layer cannot normalize ``x``, or ``None`` when it can."""
    if x.dim() < 2:
        return f"expected at least 2D input (batch, {num_features}, ...), got {x.dim()}D input"
    if num_features < 1:
        return f"a layer needs at least one channel, this one has num_features={num_features}"
    if x.size(1) != num_features:
        return f"expected {num_features} channels (dim 1), got input of shape {tuple(x.shape)}"
    if not x.is_floating_point():
        return f"expected a floating-point input, got {x.dtype}"
    return None


def _local_moments(x: torch.Tensor, num_features: int) -> torch.Tensor:
    """``(n, s, q)`` of the module docstring packed as ``[n, s_1..s_C, q_1..q_C]`` (float64, CPU)."""
    out = torch.zeros(2 * num_features + 1, dtype=_F64)
    n = x.numel() // num_features
    out[0] = n
    if n > 0:
        var, mean = torch.var_mean(x.detach().to(_F64), dim=_reduce_dims(x), correction=0)
        s = mean * n
        out[1 : num_features + 1] = s.cpu()
        out[num_features + 1 :] = (var * n + mean * s).cpu()
    return out


def _global_moments(comm: Any, x: torch.Tensor, num_features: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    """The global count, mean and biased variance per channel: one allreduce (see module docstring).

    Raises:
        ValueError: on every rank, when any rank's input is bad or the global
            batch has at most one value per channel.
    """
    problem = _input_problem(x, num_features)
    buf = torch.zeros(2 * num_features + 2, dtype=_F64)
    if problem is None:
        buf[1:] = _local_moments(x, num_features)
    else:
        buf[0] = 1.0
    comm.allreduce(buf, op="sum", name="SyncBatchNorm.forward")
    if problem is not None:
        raise ValueError(f"SyncBatchNorm (rank {comm.rank}): {problem}")
    if buf[0] > 0:
        raise ValueError(
            f"SyncBatchNorm (rank {comm.rank}): {int(buf[0])} other rank(s) passed input this layer "
            "cannot normalize (their errors say why); no rank normalized this batch"
        )
    count = int(buf[1])
    if count <= 1:
        raise ValueError(
            f"SyncBatchNorm: expected more than 1 value per channel when training, got {count} "
            f"over all {comm.size} ranks"
        )
    total, squares = buf[2 : num_features + 2], buf[num_features + 2 :]
    mean = total / count
    var = ((squares - total * mean) / count).clamp_min(0.0)
    return count, mean.to(x.device), var.to(x.device)


class _SyncBatchNormFunction(torch.autograd.Function):
    """Normalize with given global statistics; the backward reduces ``sum(dy)`` and ``sum(dy xhat)``."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        mean: torch.Tensor,
        invstd: torch.Tensor,
        count: int,
        comm: Any,
    ) -> torch.Tensor:
        y = (x - _per_channel(mean, x)) * _per_channel(invstd, x)
        if weight is not None:
            y = y * _per_channel(weight, x)
        if bias is not None:
            y = y + _per_channel(bias, x)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.count, ctx.comm = count, comm
        ctx.param_dtype = x.dtype if weight is None else weight.dtype
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable  # the allreduce is invisible to a second backward
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, mean, invstd = ctx.saved_tensors
        xhat = (x - _per_channel(mean, x)) * _per_channel(invstd, x)
        dims = _reduce_dims(x)
        sums = torch.stack([dy.sum(dims, dtype=_F64), (dy * xhat).sum(dims, dtype=_F64)])  # (2, C)
        dweight = sums[1].to(ctx.param_dtype) if ctx.needs_input_grad[1] else None
        dbias = sums[0].to(ctx.param_dtype) if ctx.needs_input_grad[2] else None
        dx = None
        if ctx.needs_input_grad[0]:
            # A copy even on the CPU (where .cpu() is a no-op): dweight and dbias may be views of sums.
            total = sums.to("cpu", copy=True)
            ctx.comm.allreduce(total, op="sum", name="SyncBatchNorm.backward")
            means = (total / ctx.count).to(x.device)
            scale = invstd if weight is None else invstd * weight.to(_F64)
            dx = (dy - _per_channel(means[0], x) - xhat * _per_channel(means[1], x)) * _per_channel(scale, x)
        return dx, dweight, dbias, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Batch normalization over the global batch of all ranks (module docstring: math, cost, rules).

    Args:
        num_features: ``C`` of an input ``(batch, C, *spatial)``.
        eps: added to the variance for numerical stability.
        momentum: running-stat update factor; ``None`` for a cumulative average.
        affine: learn a per-channel weight and bias.
        track_running_stats: keep running mean and variance for eval mode.

    Example (on every rank, after ``ringcore.init()``)::

        model = SyncBatchNorm.convert_sync_batchnorm(model)
        loss_fn(model(x_local), y_local).backward()   # statistics over all ranks' x
        for p in model.parameters():
            ringcore.allreduce(p.grad, op="avg")
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        *,
        device: Any = None,
        dtype: Any = None,
        bias: bool = True,
    ) -> None:
        extra = {} if bias else {"bias": False}  # torch >= 2.6 only; only asked for when needed
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype, **extra
        )

    def _check_input_dim(self, input: torch.Tensor) -> None:
        problem = _input_problem(input, self.num_features)
        if problem is not None:
            raise ValueError(f"SyncBatchNorm: {problem}")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalize ``input``; in training with a world of several ranks, over all ranks' batches.

        Raises:
            ValueError: bad input (on every rank when synchronizing; module docstring).
            ringcore.RingcoreError: the allreduce failed (a peer died, timed out, disagreed).
        """
        comm = self._sync_communicator()
        if comm is None:
            return self._local_forward(input)
        count, mean, var = _global_moments(comm, input, self.num_features)
        self._update_running_stats(mean, var * count / (count - 1))
        invstd = torch.rsqrt(var + self.eps)
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias, mean, invstd, count, comm)

    def _uses_batch_stats(self) -> bool:
        return self.training or (self.running_mean is None and self.running_var is None)

    def _sync_communicator(self) -> Any:
        """The default communicator when this forward synchronizes; ``None`` when it is local."""
        if not (self.training and ringcore.is_initialized()):
            return None
        comm = ringcore.communicator()
        return comm if comm.size > 1 else None

    def _local_forward(self, input: torch.Tensor) -> torch.Tensor:
        """Plain ``F.batch_norm``, the way ``torch.nn.BatchNorm*d`` calls it."""
        self._check_input_dim(input)
        tracking = self.training and self.track_running_stats
        factor = self._average_factor() if tracking else 0.0
        keep = not self.training or self.track_running_stats
        return F.batch_norm(
            input,
            self.running_mean if keep else None,
            self.running_var if keep else None,
            self.weight,
            self.bias,
            self._uses_batch_stats(),
            factor,
            self.eps,
        )

    def _average_factor(self) -> float:
        """Count this batch and return its running-stat weight (momentum, or 1/batches when ``None``)."""
        if self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        if self.momentum is None:
            return 1.0 / float(self.num_batches_tracked)
        return self.momentum

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, unbiased_var: torch.Tensor) -> None:
        if not self.track_running_stats or self.running_mean is None or self.running_var is None:
            return
        factor = self._average_factor()
        self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
        self.running_var.mul_(1 - factor).add_(unbiased_var.to(self.running_var.dtype), alpha=factor)

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module) -> torch.nn.Module:
        """Replace every ``BatchNorm*d`` in ``module`` by a ``SyncBatchNorm`` sharing its weights and buffers.

        Like ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``: returns ``module``
        with its BatchNorm layers swapped (a new layer when ``module`` is one);
        parameters and running buffers are the same tensors, not copies.
        """
        out = module
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            out = cls(
                module.num_features,
                module.eps,
                module.momentum,
                module.affine,
                module.track_running_stats,
                bias=not module.affine or module.bias is not None,
            )
            if module.affine:
                out.weight, out.bias = module.weight, module.bias
            out.running_mean, out.running_var = module.running_mean, module.running_var
            out.num_batches_tracked = module.num_batches_tracked
            out.train(module.training)
            if hasattr(module, "qconfig"):
                out.qconfig = module.qconfig
        for name, child in module.named_children():
            out.add_module(name, cls.convert_sync_batchnorm(child))
        return out
