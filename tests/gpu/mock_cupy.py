"""Just enough of CuPy's API, on host memory, to run ringcore's CuPy layer without a GPU.

Arrays are numpy arrays behind CuPy's interface (slices, views, ``.data.ptr``
and the ``copy_*_async`` calls, run at once); ``RawModule`` kernels call the
element rules that ``tests/gpu/native.py`` builds for the host, with the
arguments ringcore passes to the real kernels. So the Python side of
:mod:`ringcore.kernels.cupy_ops` and :mod:`ringcore.device.cupy_layer` (names,
argument order, pointers of slices, copies) runs end to end here; only the
device code and CuPy's own behaviour are left to the GPU tests.
"""

from __future__ import annotations

import contextlib
import ctypes
import types
from typing import Any

import numpy as np

from tests.gpu import native


class _Pointer:
    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def copy_from_device_async(self, src: _Pointer, size: int, stream: Any = None) -> None:
        ctypes.memmove(self.ptr, src.ptr, size)

    def copy_to_host_async(self, mem: int, size: int, stream: Any = None) -> None:
        ctypes.memmove(mem, self.ptr, size)

    def copy_from_host_async(self, mem: int, size: int, stream: Any = None) -> None:
        ctypes.memmove(self.ptr, mem, size)


class ndarray:
    def __init__(self, shape: Any, dtype: Any, memptr: _Pointer | None = None, _array: Any = None) -> None:
        if _array is None:
            count = int(np.prod(shape))
            raw = (ctypes.c_byte * (count * np.dtype(dtype).itemsize)).from_address(memptr.ptr)
            _array = np.frombuffer(raw, dtype).reshape(shape)
        self._a = _array

    def __getitem__(self, index: Any) -> ndarray:
        return ndarray(None, None, _array=self._a[index])

    def view(self, dtype: Any) -> ndarray:
        return ndarray(None, None, _array=self._a.view(dtype))

    dtype = property(lambda self: self._a.dtype)
    size = property(lambda self: int(self._a.size))
    nbytes = property(lambda self: int(self._a.nbytes))
    data = property(lambda self: _Pointer(self._a.ctypes.data))

    def set(self, host: np.ndarray) -> None:
        self._a[...] = host

    def get(self) -> np.ndarray:
        return self._a.copy()


class _Stream:
    def __init__(self, non_blocking: bool = False) -> None:
        pass

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def record(self, event: Any = None) -> Any:
        return event or _Event()

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _Event:
    done = True


class _Device:
    def __init__(self, device: int | None = None) -> None:
        self.id = 0
        self.attributes = {"MultiProcessorCount": 4}

    def __enter__(self) -> _Device:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class _Kernel:
    def __init__(self, name: str) -> None:
        self.function = native.host_library()[name]
        self.combine = name.startswith("rc_combine<")
        self.launches: list[tuple[int, int]] = []

    def __call__(self, grid: tuple[int], block: tuple[int], args: tuple[Any, ...]) -> None:
        ptrs = [ctypes.c_void_p(a.data.ptr) for a in args if isinstance(a, ndarray)]
        n, head = int(args[len(ptrs)]), int(args[len(ptrs) + 1])
        assert 0 <= head <= n and grid[0] >= 1 and block[0] == 256, (grid, block, n, head)
        if self.combine:
            scale, world = int(args[5]), float(args[6])
            self.function(*ptrs, ctypes.c_longlong(n), scale, ctypes.c_double(world))
        else:
            self.function(*ptrs, ctypes.c_longlong(n))


class RawModule:
    def __init__(self, code: str, options: tuple[str, ...] = (), name_expressions: Any = None) -> None:
        self.names = set(name_expressions)

    def get_function(self, name: str) -> _Kernel:
        assert name in self.names, f"{name} was not compiled"
        return _Kernel(name)


def empty(count: int, dtype: Any) -> ndarray:
    return ndarray(None, None, _array=np.empty(count, dtype))


def module() -> types.ModuleType:
    """A ``cupy`` module object built from the pieces above."""
    cuda = types.SimpleNamespace(
        Stream=_Stream,
        ExternalStream=lambda ptr: _Stream(),
        get_current_stream=_Stream,
        Event=lambda disable_timing=False: _Event(),
        Device=_Device,
        UnownedMemory=lambda ptr, size, owner, device=-1: _Pointer(ptr),
        MemoryPointer=lambda memory, offset: _Pointer(memory.ptr + offset),
        alloc_pinned_memory=bytearray,
        runtime=types.SimpleNamespace(pointerGetAttributes=lambda ptr: types.SimpleNamespace(device=0)),
    )
    _Stream.null = _Stream.ptds = _Stream()  # type: ignore[attr-defined]
    mod = types.ModuleType("cupy")
    mod.__dict__.update(
        ndarray=ndarray, empty=empty, RawModule=RawModule, cuda=cuda, from_dlpack=None, __version__="mock"
    )
    return mod


@contextlib.contextmanager
def installed() -> Any:
    """``import cupy`` gives the mock (and ringcore's CuPy modules are imported fresh) inside."""
    import sys

    names = ("cupy", "ringcore.device.cupy_layer", "ringcore.kernels.cupy_ops")
    saved = {name: sys.modules.pop(name) for name in names if name in sys.modules}
    sys.modules["cupy"] = module()
    try:
        yield
    finally:
        for name in names:
            sys.modules.pop(name, None)
        sys.modules.update(saved)
