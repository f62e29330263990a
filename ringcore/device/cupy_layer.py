"""The device layer on CuPy: streams, events, pinned memory and the CUDA kernels.

Device arrays are CuPy arrays; a caller's buffer is wrapped without a copy
(``UnownedMemory`` over its pointer, keeping the caller's object alive).
Everything runs on the GPU of the first GPU buffer the process reduces (found
from its pointer, so an async collective on another thread uses it too); a
later buffer on another GPU is refused: one GPU per process, as with NCCL.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ringcore.buffers import Buffer, DType
from ringcore.ops import Compression, ReduceOp

try:
    import cupy
except ImportError as err:  # pragma: no cover - depends on the machine
    raise TypeError(
        "a GPU buffer needs CuPy: pip install 'ringcore[gpu]' (cupy-cuda12x) on a machine with CUDA"
    ) from err


class CupyLayer:
    """:class:`~ringcore.device.layer.DeviceLayer` on CuPy (see module docstring)."""

    name = "cupy"

    def __init__(self) -> None:
        self.device: int | None = None  # the GPU of the first buffer wrapped

    def context(self) -> Any:
        return cupy.cuda.Device(cupy.cuda.Device().id if self.device is None else self.device)

    def wrap(self, buffer: Buffer) -> Any:
        count = buffer.count
        if not count:
            return cupy.empty(0, buffer.dtype.storage)
        where = int(cupy.cuda.runtime.pointerGetAttributes(buffer.ptr).device)
        if self.device is None:
            self.device = where
        elif where != self.device:
            raise ValueError(
                f"the buffer is on GPU {where} but this process's earlier GPU buffers were on GPU "
                f"{self.device}; ringcore uses one GPU per process"
            )
        memory = cupy.cuda.UnownedMemory(buffer.ptr, buffer.nbytes, buffer.owner, where)
        return cupy.ndarray((count,), buffer.dtype.storage, cupy.cuda.MemoryPointer(memory, 0))

    def from_dlpack(self, obj: Any) -> Any:
        return cupy.from_dlpack(obj)

    def empty(self, count: int, dtype: np.dtype) -> Any:
        with self.context():
            return cupy.empty(count, dtype)

    def pinned(self, nbytes: int) -> np.ndarray:
        memory = cupy.cuda.alloc_pinned_memory(nbytes)
        return np.frombuffer(memory, np.uint8, nbytes)  # the array keeps the allocation alive

    def stream(self) -> Any:
        with self.context():
            return cupy.cuda.Stream(non_blocking=True)

    def after_producer(self, stream: Any, buffer: Buffer) -> None:
        if buffer.stream == 1:
            producer = cupy.cuda.Stream.null
        elif buffer.stream == 2:
            producer = cupy.cuda.Stream.ptds
        elif buffer.stream:
            producer = cupy.cuda.ExternalStream(buffer.stream)
        else:
            producer = cupy.cuda.get_current_stream()
        stream.wait_event(producer.record())

    def copy(self, dst: Any, src: Any, stream: Any) -> None:
        if dst.nbytes:
            dst.data.copy_from_device_async(src.data, dst.nbytes, stream)

    def download(self, dst: np.ndarray, src: Any, stream: Any) -> None:
        src.data.copy_to_host_async(dst.ctypes.data, src.nbytes, stream)

    def upload(self, dst: Any, src: np.ndarray, stream: Any) -> None:
        dst.data.copy_from_host_async(src.ctypes.data, dst.nbytes, stream)

    def record(self, stream: Any) -> Any:
        return _Event(stream.record(cupy.cuda.Event(disable_timing=True)))

    def wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event.event)

    def synchronize(self, stream: Any) -> None:
        stream.synchronize()

    def reducer(self, dtype: DType, op: ReduceOp, compression: Compression, world: int, stream: Any) -> Any:
        from ringcore.kernels.cupy_ops import CudaReducer

        with self.context():
            return CudaReducer(dtype, op, compression, world, stream)


class _Event:
    __slots__ = ("event",)

    def __init__(self, event: Any) -> None:
        self.event = event

    def done(self) -> bool:
        return bool(self.event.done)
