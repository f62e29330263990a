"""Any array-like -> :class:`Buffer`: a flat view of the caller's memory, its dtype and shape.

Accepted without copying: numpy arrays, objects exposing ``__array_interface__``
or DLPack on the CPU (e.g. torch tensors, JAX arrays for read-only inputs), and
anything exporting the buffer protocol with a numeric format (``bytearray``,
``array.array``, ``memoryview``). Everything else is rejected here, before any
byte is sent, with a ``TypeError`` (wrong kind of object or dtype) or a
``ValueError`` (non-contiguous, read-only for an in-place collective).

``Buffer.device`` is where the memory lives. GPU memory (``device="cuda"``)
arrives through ``__cuda_array_interface__`` (CuPy, torch CUDA tensors,
Numba), or a CUDA DLPack capsule, which the collectives first import
through the device layer (this module knows no device code);
it is validated here from the interface
alone, with the same errors as host memory, and described by a device
pointer (``Buffer.ptr``): nothing is imported, no GPU is touched, until the
collective runs on the device path (:mod:`ringcore.device`).

bfloat16 has no numpy dtype: its memory is viewed as ``uint16`` and the
kernels know to widen it to float32 (see :mod:`ringcore.kernels.numpy_ops`).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class DType:
    """An element type ringcore can move and reduce.

    Attributes:
        name: canonical name (``"float32"``, ``"bfloat16"``...), also what descriptors compare.
        storage: the numpy dtype the memory is viewed as (``uint16`` for bfloat16).
    """

    name: str
    storage: np.dtype

    @property
    def itemsize(self) -> int:
        return self.storage.itemsize

    @property
    def is_float(self) -> bool:
        return self.name in ("float16", "bfloat16", "float32", "float64")


_NAMES = [
    "float16",
    "float32",
    "float64",
    "bfloat16",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
]
DTYPES: dict[str, DType] = {
    name: DType(name, np.dtype("uint16" if name == "bfloat16" else name)) for name in _NAMES
}
SUPPORTED = ", ".join(_NAMES)

_DLPACK_CPU = (1, 3)  # kDLCPU, kDLCUDAHost: memory the CPU can address
_DLPACK_CUDA = (2, 13)  # kDLCUDA, kDLCUDAManaged


@dataclasses.dataclass(frozen=True)
class Buffer:
    """A validated, contiguous view of a caller's buffer.

    Attributes:
        array: flat 1-D numpy view of the caller's memory (dtype ``dtype.storage``);
            for GPU memory, an empty placeholder (the memory is at ``ptr``).
        dtype: the element type.
        shape: the caller's shape (``()`` for 0-d arrays).
        device: ``"cpu"`` or ``"cuda"``.
        ptr: the device address of the first element (``"cuda"`` only).
        owner: the caller's object, kept alive while the buffer is in use.
        stream: the CUDA stream the producer asked consumers to wait for
            (``__cuda_array_interface__`` v3), or ``None``.
    """

    array: np.ndarray
    dtype: DType
    shape: tuple[int, ...]
    device: str = "cpu"
    ptr: int = 0
    owner: Any = None
    stream: int | None = None

    @property
    def count(self) -> int:
        if self.device == "cpu":
            return int(self.array.size)
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.count * self.dtype.itemsize


def as_buffer(obj: Any, *, writable: bool, what: str = "buffer") -> Buffer:
    """Wrap ``obj`` as a :class:`Buffer` without copying it.

    Args:
        obj: the caller's array-like.
        writable: the collective writes into ``obj`` (in-place ops).
        what: how to name ``obj`` in error messages (e.g. ``"allreduce buffer"``).

    Raises:
        TypeError: not an array-like, or an unsupported dtype.
        ValueError: not contiguous, or read-only while ``writable``.
    """
    if _is_cuda(obj):
        return _cuda_buffer(obj, writable, what)
    array, dtype_name = _to_numpy(obj, what)
    dtype = _dtype_of(array, dtype_name, what)
    if not array.flags.c_contiguous:
        raise ValueError(
            f"{what} is not contiguous (shape {array.shape}, strides {array.strides}); "
            "pass a contiguous copy, e.g. numpy.ascontiguousarray(x) or tensor.contiguous()"
        )
    if writable and not array.flags.writeable:
        raise ValueError(f"{what} is read-only, but this collective writes its result into it in place")
    return checked_buffer(array, dtype)


def checked_buffer(array: np.ndarray, dtype: DType) -> Buffer:
    """The :class:`Buffer` of a contiguous numpy ``array`` already found to hold ``dtype``."""
    return Buffer(storage_view(array, dtype), dtype, tuple(array.shape))


def storage_view(array: np.ndarray, dtype: DType) -> np.ndarray:
    """A contiguous numpy ``array`` holding ``dtype`` as the flat view :attr:`Buffer.array` is."""
    flat = array if array.ndim == 1 else array.reshape(-1)
    return flat.view(np.uint16) if dtype.name == "bfloat16" else flat


def _to_numpy(obj: Any, what: str) -> tuple[np.ndarray, str | None]:
    """Return a zero-copy ndarray over ``obj`` and an explicit dtype name if numpy can't know it."""
    if isinstance(obj, np.ndarray):
        return obj, None
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        return _from_dlpack(obj, what)
    if hasattr(obj, "__array_interface__"):
        return np.asarray(obj), None
    try:
        view = memoryview(obj)
    except TypeError:
        raise TypeError(
            f"{what} must be a numpy array, a CPU tensor (DLPack / __array_interface__) or an object "
            f"exporting the buffer protocol with a numeric format; got {type(obj).__name__}"
        ) from None
    try:
        return np.asarray(view), None
    except (ValueError, TypeError, NotImplementedError):
        raise TypeError(f"{what} has buffer format {view.format!r}, which is not a numeric type") from None


def _from_dlpack(obj: Any, what: str) -> tuple[np.ndarray, str | None]:
    device_type, _ = obj.__dlpack_device__()
    if int(device_type) not in _DLPACK_CPU:
        raise TypeError(
            f"{what} lives on a device ringcore cannot address (DLPack device type {int(device_type)}); "
            "use CPU or CUDA memory"
        )
    if str(getattr(obj, "dtype", "")) == "torch.bfloat16":
        torch = sys.modules["torch"]
        obj = obj.view(torch.int16)
        name: str | None = "bfloat16"
    else:
        name = None
    try:
        return np.from_dlpack(obj), name
    except RuntimeError as err:
        hint = " (call .detach() first)" if "gradient" in str(err) else ""
        raise TypeError(f"{what} could not be exported through DLPack: {err}{hint}") from None
    except (TypeError, BufferError) as err:
        raise TypeError(f"{what} has a dtype numpy cannot view through DLPack: {err}") from None


_BY_NUMPY: dict[np.dtype, DType] = {d.storage: d for d in DTYPES.values() if d.name != "bfloat16"}


def _dtype_of(array: np.ndarray, explicit: str | None, what: str) -> DType:
    if explicit is None and (known := _BY_NUMPY.get(array.dtype)) is not None:
        return known  # the common case, without numpy's slow dtype.name
    name = explicit or array.dtype.name
    if array.dtype.byteorder == ">" or (array.dtype.byteorder == "=" and sys.byteorder == "big"):
        raise TypeError(f"{what} is big-endian ({array.dtype}); convert it to native byte order")
    dtype = DTYPES.get(name)
    if dtype is None:
        raise TypeError(
            f"{what} has dtype {array.dtype}, which ringcore cannot reduce; supported: {SUPPORTED}"
        )
    return dtype


# --------------------------------------------------------------------------- GPU memory


def _is_cuda(obj: Any) -> bool:
    if isinstance(obj, np.ndarray):
        return False
    try:
        if hasattr(obj, "__cuda_array_interface__"):
            return True
    except Exception:  # torch raises for tensors it cannot describe (bfloat16, requires_grad)
        return True
    if hasattr(obj, "__dlpack_device__"):
        try:
            return int(obj.__dlpack_device__()[0]) in _DLPACK_CUDA
        except Exception:
            return False
    return False


def dlpack_only_cuda(obj: Any) -> bool:
    """CUDA memory exported through DLPack but not ``__cuda_array_interface__`` (JAX): the device layer imports it."""
    if isinstance(obj, np.ndarray):
        return False
    try:
        if hasattr(obj, "__cuda_array_interface__"):
            return False
    except Exception:  # torch raises for tensors it cannot describe: they have the interface
        return False
    try:
        return hasattr(obj, "__dlpack_device__") and int(obj.__dlpack_device__()[0]) in _DLPACK_CUDA
    except Exception:
        return False


def _cuda_buffer(obj: Any, writable: bool, what: str) -> Buffer:
    """A ``device="cuda"`` buffer from ``__cuda_array_interface__``."""
    owner, name = obj, None
    if str(getattr(obj, "dtype", "")) == "torch.bfloat16":  # the interface has no bfloat16 typestr
        obj, name = obj.view(getattr(sys.modules.get("torch"), "int16", None)), "bfloat16"
    try:
        iface = obj.__cuda_array_interface__
    except AttributeError:  # DLPack only (e.g. JAX): ringcore.device.as_buffer imports it first
        raise TypeError(
            f"{what} is CUDA memory exported through DLPack only; pass it to a collective, which imports it through the device layer"
        ) from None
    except RuntimeError as err:
        hint = " (call .detach() first)" if "grad" in str(err) else ""
        raise TypeError(
            f"{what} could not be exported through __cuda_array_interface__: {err}{hint}"
        ) from None
    except TypeError as err:
        raise TypeError(f"{what} has a dtype ringcore cannot reduce on the GPU: {err}") from None
    shape = tuple(int(n) for n in iface["shape"])
    try:
        storage = np.dtype(iface["typestr"])
    except TypeError:
        raise TypeError(f"{what} has typestr {iface['typestr']!r}, which is not a numeric type") from None
    dtype = _dtype_of(np.empty(0, storage), name, what)
    if iface.get("mask") is not None:
        raise TypeError(f"{what} is a masked GPU array; pass its data without a mask")
    if not _c_contiguous(shape, iface.get("strides"), storage.itemsize):
        raise ValueError(
            f"{what} is not contiguous (shape {shape}, strides {iface.get('strides')}); "
            "pass a contiguous copy, e.g. cupy.ascontiguousarray(x) or tensor.contiguous()"
        )
    ptr, read_only = iface["data"]
    if writable and read_only:
        raise ValueError(f"{what} is read-only, but this collective writes its result into it in place")
    empty = np.empty(0, dtype.storage)
    return Buffer(empty, dtype, shape, "cuda", int(ptr or 0), owner, iface.get("stream"))


def _c_contiguous(shape: tuple[int, ...], strides: Any, itemsize: int) -> bool:
    if strides is None or math.prod(shape) == 0:
        return True
    expected = itemsize
    for n, stride in zip(reversed(shape), reversed(tuple(strides)), strict=True):
        if n != 1 and stride != expected:
            return False
        expected *= n
    return True
