"""Reductions and fp16 compression on CuPy arrays: ``cuda/reduce.cu`` through ``RawModule``.

:class:`CudaReducer` has :class:`~ringcore.kernels.numpy_ops.Reducer`'s
interface (``combine``, ``convert``, ``scratch_like``) on device arrays and
gives bitwise the same results (see ``cuda/reduce.cu`` for the rules). Every
kernel is launched on the reducer's stream and returns at once.

Modules are built lazily, one per (dtype, compression) with every kernel such
a collective may need, and cached per device; CuPy also caches the compiled
binaries on disk, so a process pays NVRTC once per kind of collective. This
module imports CuPy: import it only when a GPU buffer has arrived.
"""

from __future__ import annotations

import functools
from typing import Any

import cupy
import numpy as np

from ringcore.buffers import DType
from ringcore.kernels import cuda_source
from ringcore.ops import Compression, ReduceOp

THREADS = 256
BLOCKS_PER_SM = 8


@functools.cache
def module(dtype_name: str, compression: Compression, device: int) -> Any:
    """The compiled kernels of one kind of collective on one device (built on first use)."""
    from ringcore.buffers import DTYPES

    names = cuda_source.instantiations(DTYPES[dtype_name], compression)
    with cupy.cuda.Device(device):
        return cupy.RawModule(
            code=cuda_source.source(), options=cuda_source.COMPILE_OPTIONS, name_expressions=names
        )


@functools.cache
def _multiprocessors(device: int) -> int:
    return int(cupy.cuda.Device(device).attributes["MultiProcessorCount"])


class CudaReducer:
    """The kernels of one collective on device arrays, on ``stream``.

    Args:
        dtype: the caller's element type.
        op: the reduction.
        compression: what travels on the wire.
        world: the world size (``avg`` divides by it).
        stream: the CuPy stream every kernel is launched on.
    """

    def __init__(self, dtype: DType, op: ReduceOp, compression: Compression, world: int, stream: Any) -> None:
        self.dtype, self.op, self.compression, self.world = dtype, op, compression, world
        self.stream = stream
        self.wire_dtype = cuda_source.wire_dtype(dtype, compression)
        self.device = cupy.cuda.Device().id
        self._module = module(dtype.name, compression, self.device)
        self._result: Any = None
        self._names: dict[tuple[np.dtype, ...], str] = {}  # per segment, so worth remembering

    def combine(self, dst: Any, a: Any, b: Any, final: bool = False) -> None:
        """``dst = op(a, b)`` element-wise; with ``final``, apply avg's division too."""
        n = int(dst.size)
        if not n:
            return
        key = (dst.dtype, a.dtype, b.dtype)
        name = self._names.get(key)
        if name is None:
            name = self._names[key] = cuda_source.combine_name(self.dtype, self.op, *key)
        scale = int(final and self.op is ReduceOp.AVG and self.world > 1)
        arrays = (dst, a, b)
        head = cuda_source.vector_head([x.data.ptr for x in arrays], [x.dtype.itemsize for x in arrays], n)
        args = (dst, a, b, np.int64(n), np.int64(head), np.int32(scale), np.float64(self.world))
        self._launch(name, n, arrays, args)

    def convert(self, dst: Any, src: Any) -> None:
        """Copy ``src`` into ``dst``, rounding when the dtypes differ (compression)."""
        n = int(dst.size)
        if not n:
            return
        if dst.dtype == src.dtype:
            dst.data.copy_from_device_async(src.data, dst.nbytes, self.stream)
            return
        name = cuda_source.convert_name(self.dtype, dst.dtype, src.dtype)
        arrays = (dst, src)
        head = cuda_source.vector_head([x.data.ptr for x in arrays], [x.dtype.itemsize for x in arrays], n)
        self._launch(name, n, arrays, (dst, src, np.int64(n), np.int64(head)))

    def scratch_like(self, x: Any) -> Any:
        """A reusable device array shaped and typed like ``x``."""
        if self._result is None or self._result.nbytes < x.nbytes:
            with self.stream:
                self._result = cupy.empty(x.nbytes, np.uint8)
        return self._result[: x.nbytes].view(x.dtype)

    def _launch(self, name: str, n: int, arrays: tuple[Any, ...], args: tuple[Any, ...]) -> None:
        width = 16 // max(x.dtype.itemsize for x in arrays)
        work = max(1, -(-n // width))
        blocks = max(1, min(-(-work // THREADS), _multiprocessors(self.device) * BLOCKS_PER_SM))
        kernel = self._module.get_function(name)
        with self.stream:
            kernel((blocks,), (THREADS,), args)
