"""Argument checks every plan maker runs in the caller's thread, before anything is sent."""

from __future__ import annotations

from typing import Any

import numpy as np

from ringcore.buffers import Buffer, dlpack_only_cuda
from ringcore.buffers import as_buffer as _view
from ringcore.ops import Compression, ReduceOp


def as_buffer(obj: Any, *, writable: bool, what: str) -> Buffer:
    """:func:`ringcore.buffers.as_buffer`, after the device layer imported DLPack-only CUDA memory (JAX)."""
    if dlpack_only_cuda(obj):
        from ringcore import device

        obj = device.layer().from_dlpack(obj)
    return _view(obj, writable=writable, what=what)


def check_reduction(buffer: Buffer, op: ReduceOp, compression: Compression, what: str) -> None:
    """Refuse an op or compression the buffer's dtype cannot take."""
    if op is ReduceOp.AVG and not buffer.dtype.is_float:
        raise ValueError(
            f"{what}: op 'avg' needs a floating-point buffer, got {buffer.dtype.name}; "
            "use 'sum' and divide by ringcore.size()"
        )
    if compression is Compression.FP16 and not buffer.dtype.is_float:
        raise ValueError(
            f"{what}: fp16 compression applies to floating-point buffers, got {buffer.dtype.name}"
        )


def check_root(root: int, size: int, what: str) -> int:
    """``root`` as an int, if it is a rank of a world of ``size``."""
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)):
        raise TypeError(f"{what}: root must be an int, got {type(root).__name__}")
    if not 0 <= root < size:
        raise ValueError(f"{what}: root {root} is not a rank of this world of size {size}")
    return int(root)


def check_allreduce(obj: Any, op: Any, compression: Any) -> tuple[Buffer, ReduceOp, Compression]:
    """Validate an allreduce's arguments (``TypeError``/``ValueError`` before anything is sent)."""
    buffer = as_buffer(obj, writable=True, what="allreduce buffer")
    reduce_op, comp = ReduceOp.parse(op), Compression.parse(compression)
    check_reduction(buffer, reduce_op, comp, "allreduce")
    return buffer, reduce_op, comp


def host_only(buffer: Buffer, what: str) -> Buffer:
    """``buffer``, if it is in host memory (only allreduce and broadcast take GPU buffers)."""
    if buffer.device != "cpu":
        raise TypeError(
            f"{what}: GPU buffers are supported by allreduce and broadcast only; "
            "pass a host copy (e.g. cupy.asnumpy(x) or tensor.cpu())"
        )
    return buffer


def rows(buffer: Buffer, what: str) -> int:
    """The length of ``buffer``'s first dimension (the one allgather and reduce_scatter split)."""
    if not buffer.shape:
        raise ValueError(f"{what} needs an array with at least one dimension, got a 0-d array")
    return buffer.shape[0]


def as_caller_dtype(out: np.ndarray, obj: Any) -> np.ndarray:
    """bfloat16 results come back in the caller's numpy bfloat16 dtype when it has one."""
    dtype = getattr(obj, "dtype", None)
    if isinstance(dtype, np.dtype) and dtype.itemsize == out.itemsize and dtype != out.dtype:
        return out.view(dtype)
    return out
