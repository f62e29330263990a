"""torch tensors in and out of ringcore: checks, zero-copy views, results back as tensors.

ringcore reduces a CPU tensor through a numpy view of its memory
(``tensor.detach().numpy()``: no copy, and numpy arrays take ringcore's
prepared fast path for repeated layouts); bfloat16 has no numpy dtype, so
such tensors, and CUDA tensors (ringcore's GPU path), are handed over as
they are (DLPack / ``__cuda_array_interface__``). Collectives that return new
arrays (allgather, reduce_scatter) come back through ``torch.from_numpy``,
again without a copy, and move to the input's device when it is not the CPU.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

# Every dtype ringcore moves, in a fixed order: join() sends a dtype as its index here.
DTYPES: tuple[torch.dtype, ...] = (
    torch.float16,
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
)


def check_tensor(tensor: Any, what: str) -> torch.Tensor:
    """``tensor`` if it is a tensor of a dtype ringcore moves.

    Raises:
        TypeError: not a ``torch.Tensor``, or a dtype such as bool or complex.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in DTYPES)
        raise TypeError(f"{what} has dtype {tensor.dtype}, which ringcore cannot reduce; supported: {names}")
    if tensor.is_sparse:
        raise TypeError(f"{what} is sparse; pass tensor.to_dense()")
    return tensor


def check_writable(tensor: torch.Tensor, what: str) -> None:
    """Refuse an in-place collective on a leaf that requires grad (autograd would not see the write).

    Raises:
        ValueError: as torch itself refuses ``leaf.add_(...)`` outside ``torch.no_grad()``.
    """
    if tensor.requires_grad and tensor.is_leaf and torch.is_grad_enabled():
        raise ValueError(
            f"{what} is a leaf tensor that requires grad, and an in-place collective would change it "
            "behind autograd's back; use the out-of-place (differentiable) call, e.g. hvd.allreduce(t), "
            "or run it under torch.no_grad() (as optimizers update parameters)"
        )


def is_float(tensor: torch.Tensor) -> bool:
    return tensor.dtype.is_floating_point


def for_ringcore(tensor: torch.Tensor) -> Any:
    """What ringcore reduces in place for a contiguous ``tensor``: a numpy view when it can be one."""
    flat = tensor.detach()
    if flat.device.type == "cpu" and flat.dtype is not torch.bfloat16:
        return flat.numpy()
    return flat


def from_ringcore(array: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """A new array ringcore returned (allgather, reduce_scatter) as a tensor of ``like``'s dtype and device."""
    if like.dtype is torch.bfloat16:
        result = torch.from_numpy(np.ascontiguousarray(array).view(np.int16)).view(torch.bfloat16)
    else:
        result = torch.from_numpy(array)
    return result if like.device.type == "cpu" else result.to(like.device)


def host(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor with ``tensor``'s values (itself when it already is one)."""
    return tensor.detach().cpu().contiguous()
