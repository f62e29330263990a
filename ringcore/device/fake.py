"""A device layer on numpy whose streams run late: the staged executor's tests, on any machine.

"Device memory" is host memory hidden behind :class:`FakeDeviceArray`, which
has no buffer protocol, so code that hands device memory to a transport, or
reads it without the layer, fails loudly. Work queued on a :class:`FakeStream`
does not run when it is queued: it runs a few operations at a time, in
stream order, whenever the host polls an event (and all of it at
``synchronize``), as a GPU would. Reading a pinned slot before its copy's
event fired, or reusing one too early, therefore gives wrong bytes, and the
end-to-end tests comparing against numpy catch it. The schedule of when work
runs comes from a seeded random generator, so a failure replays.

:class:`FakeCudaArray` is a "GPU buffer" for tests: host memory exposed
through ``__cuda_array_interface__``, which this layer maps back.
"""

from __future__ import annotations

import contextlib
import ctypes
import random
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from ringcore.buffers import Buffer, DType
from ringcore.kernels.numpy_ops import Reducer
from ringcore.ops import Compression, ReduceOp


class FakeDeviceArray:
    """A flat array in fake device memory (host memory the host must not touch directly)."""

    __slots__ = ("host",)

    def __init__(self, host: np.ndarray) -> None:
        self.host = host

    def __getitem__(self, index: slice) -> FakeDeviceArray:
        return FakeDeviceArray(self.host[index])

    def view(self, dtype: Any) -> FakeDeviceArray:
        return FakeDeviceArray(self.host.view(dtype))

    @property
    def dtype(self) -> np.dtype:
        return self.host.dtype

    @property
    def size(self) -> int:
        return int(self.host.size)

    @property
    def nbytes(self) -> int:
        return int(self.host.nbytes)


class FakeCudaArray:
    """Host memory posing as a GPU buffer (``__cuda_array_interface__`` v3), for tests."""

    def __init__(self, data: np.ndarray, read_only: bool = False, bfloat16: bool = False) -> None:
        self.data = data
        self.read_only = read_only
        self.bfloat16 = bfloat16  # uint16 bits posing as a torch.bfloat16 CUDA tensor

    @property
    def dtype(self) -> Any:
        return "torch.bfloat16" if self.bfloat16 else self.data.dtype

    def view(self, dtype: Any) -> FakeCudaArray:
        """What torch's ``tensor.view(torch.int16)`` does for a bfloat16 tensor."""
        return FakeCudaArray(self.data.view(np.int16), self.read_only)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        if self.bfloat16:
            raise TypeError("Got unsupported ScalarType BFloat16")  # as torch says
        typestr = self.data.dtype.str
        return {
            "shape": self.data.shape,
            "typestr": typestr,
            "data": (self.data.ctypes.data, self.read_only),
            "strides": None if self.data.flags.c_contiguous else self.data.strides,
            "version": 3,
            "stream": None,
        }


class FakeStream:
    """Operations queued in order; ``completed`` counts those that ran."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.pending: deque[tuple[Callable[[], None], FakeEvent | None]] = deque()
        self.queued = 0
        self.completed = 0

    def run_one(self) -> bool:
        """Run the next operation unless it waits for an event that has not fired; True if it ran."""
        if not self.pending:
            return False
        op, after = self.pending[0]
        if after is not None and after.stream.completed < after.index:
            return False
        self.pending.popleft()
        with np.errstate(all="ignore"):
            op()
        self.completed += 1
        return True


class FakeEvent:
    def __init__(self, layer: FakeLayer, stream: FakeStream, index: int) -> None:
        self.layer, self.stream, self.index = layer, stream, index

    def done(self) -> bool:
        self.layer.tick()
        return self.stream.completed >= self.index


class FakeReducer:
    """The numpy reference kernels, queued on a fake stream."""

    def __init__(self, layer: FakeLayer, reducer: Reducer, stream: FakeStream) -> None:
        self.layer, self.reducer, self.stream = layer, reducer, stream
        self.wire_dtype = reducer.wire_dtype
        self._scratch = FakeDeviceArray(np.empty(0, np.uint8))

    def combine(
        self, dst: FakeDeviceArray, a: FakeDeviceArray, b: FakeDeviceArray, final: bool = False
    ) -> None:
        self.layer.enqueue(self.stream, lambda: self.reducer.combine(dst.host, a.host, b.host, final=final))

    def convert(self, dst: FakeDeviceArray, src: FakeDeviceArray) -> None:
        self.layer.enqueue(self.stream, lambda: self.reducer.convert(dst.host, src.host))

    def scratch_like(self, x: FakeDeviceArray) -> FakeDeviceArray:
        if self._scratch.nbytes < x.nbytes:
            self._scratch = FakeDeviceArray(np.empty(x.nbytes, np.uint8))
        return self._scratch[: x.nbytes].view(x.dtype)


class FakeLayer:
    """The fake device (see module docstring); ``seed`` fixes when queued work runs."""

    name = "fake"

    def __init__(self, seed: int = 0, max_ops_per_poll: int = 2) -> None:
        self.random = random.Random(seed)
        self.max_ops = max_ops_per_poll
        self.streams: list[FakeStream] = []
        self.pinned_bytes = 0  # total ever allocated: tests check it stays bounded

    def enqueue(self, stream: FakeStream, op: Callable[[], None], after: FakeEvent | None = None) -> None:
        stream.pending.append((op, after))
        stream.queued += 1

    def tick(self) -> None:
        """Let the "GPU" run a few queued operations, on streams picked at random."""
        for _ in range(self.random.randint(0, self.max_ops)):
            busy = [s for s in self.streams if s.pending]
            if busy:
                self.random.choice(busy).run_one()

    # ----------------------------------------------------------------- DeviceLayer

    def context(self) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    def wrap(self, buffer: Buffer) -> FakeDeviceArray:
        raw = (ctypes.c_byte * buffer.nbytes).from_address(buffer.ptr) if buffer.nbytes else bytearray()
        return FakeDeviceArray(np.frombuffer(raw, buffer.dtype.storage))

    def from_dlpack(self, obj: Any) -> Any:
        return FakeCudaArray(np.from_dlpack(obj))

    def empty(self, count: int, dtype: np.dtype) -> FakeDeviceArray:
        garbage = np.frombuffer(self.random.randbytes(count * np.dtype(dtype).itemsize), dtype)
        return FakeDeviceArray(garbage.copy())  # uninitialised memory is not zeros

    def pinned(self, nbytes: int) -> np.ndarray:
        self.pinned_bytes += nbytes
        return np.zeros(nbytes, np.uint8)

    def stream(self) -> FakeStream:
        stream = FakeStream(f"fake-{len(self.streams)}")
        self.streams.append(stream)
        return stream

    def after_producer(self, stream: FakeStream, buffer: Buffer) -> None:
        pass  # the tests' producers (numpy) finish their writes before calling

    def copy(self, dst: FakeDeviceArray, src: FakeDeviceArray, stream: FakeStream) -> None:
        self.enqueue(stream, lambda: np.copyto(dst.host, src.host))

    def download(self, dst: np.ndarray, src: FakeDeviceArray, stream: FakeStream) -> None:
        target = dst[: src.nbytes]
        self.enqueue(stream, lambda: np.copyto(target, src.host.view(np.uint8)))

    def upload(self, dst: FakeDeviceArray, src: np.ndarray, stream: FakeStream) -> None:
        source = src[: dst.nbytes]
        self.enqueue(stream, lambda: np.copyto(dst.host.view(np.uint8), source))

    def record(self, stream: FakeStream) -> FakeEvent:
        return FakeEvent(self, stream, stream.queued)

    def wait(self, stream: FakeStream, event: FakeEvent) -> None:
        self.enqueue(stream, lambda: None, after=event)

    def synchronize(self, stream: FakeStream) -> None:
        while stream.pending:
            if not stream.run_one():  # blocked on another stream: let that one run
                for other in self.streams:
                    other.run_one()

    def reducer(
        self, dtype: DType, op: ReduceOp, compression: Compression, world: int, stream: FakeStream
    ) -> FakeReducer:
        return FakeReducer(self, Reducer(dtype, op, compression, world), stream)
