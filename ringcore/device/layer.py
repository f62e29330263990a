"""The device-layer interface: what the staged executor may ask of a GPU runtime.

Every operation is asynchronous on a stream and ordered within it; events
order streams against each other and tell the host when work is done. Device
arrays are the layer's own objects (CuPy arrays, or the fake's wrappers);
ringcore only slices them (``x[a:b]``), views them (``x.view(dtype)``) and
reads ``dtype``, ``size`` and ``nbytes``; pinned host memory is a numpy
array, the only memory a transport ever sees.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol

import numpy as np

from ringcore.buffers import Buffer, DType
from ringcore.ops import Compression, ReduceOp

DeviceArray = Any  # sliceable, viewable flat array in device memory
Stream = Any


class Event(Protocol):
    def done(self) -> bool:
        """True once the work recorded before this event has finished."""
        ...


class DeviceReducer(Protocol):
    """:class:`ringcore.kernels.numpy_ops.Reducer`'s interface, on device arrays, on one stream."""

    wire_dtype: np.dtype

    def combine(self, dst: DeviceArray, a: DeviceArray, b: DeviceArray, final: bool = False) -> None: ...

    def convert(self, dst: DeviceArray, src: DeviceArray) -> None: ...

    def scratch_like(self, x: DeviceArray) -> DeviceArray: ...


class DeviceLayer(Protocol):
    name: str

    def context(self) -> AbstractContextManager[Any]:
        """Makes the layer's GPU current in this thread (async collectives run on another thread)."""
        ...

    def wrap(self, buffer: Buffer) -> DeviceArray:
        """A flat device array over a ``device="cuda"`` buffer's memory (no copy)."""
        ...

    def from_dlpack(self, obj: Any) -> Any:
        """An object with ``__cuda_array_interface__`` over a CUDA DLPack producer's memory."""
        ...

    def empty(self, count: int, dtype: np.dtype) -> DeviceArray: ...

    def pinned(self, nbytes: int) -> np.ndarray:
        """Page-locked host memory (uint8), for fast asynchronous copies."""
        ...

    def stream(self) -> Stream:
        """A new stream that does not synchronise with the default stream."""
        ...

    def after_producer(self, stream: Stream, buffer: Buffer) -> None:
        """Make ``stream`` wait for the work the buffer's producer queued (its stream, or the current one)."""
        ...

    def copy(self, dst: DeviceArray, src: DeviceArray, stream: Stream) -> None: ...

    def download(self, dst: np.ndarray, src: DeviceArray, stream: Stream) -> None:
        """Device -> pinned host, ``src.nbytes`` bytes."""
        ...

    def upload(self, dst: DeviceArray, src: np.ndarray, stream: Stream) -> None:
        """Pinned host -> device, ``dst.nbytes`` bytes."""
        ...

    def record(self, stream: Stream) -> Event: ...

    def wait(self, stream: Stream, event: Event) -> None:
        """Later work on ``stream`` starts after ``event``."""
        ...

    def synchronize(self, stream: Stream) -> None:
        """Block the host until ``stream`` is idle."""
        ...

    def reducer(
        self, dtype: DType, op: ReduceOp, compression: Compression, world: int, stream: Stream
    ) -> DeviceReducer: ...
