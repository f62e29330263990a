"""as_buffer: which array-likes are accepted (zero-copy) and which are rejected, and how."""

from __future__ import annotations

import array

import numpy as np
import pytest

from ringcore.buffers import DTYPES, as_buffer

NUMPY_DTYPES = [name for name in DTYPES if name != "bfloat16"]


@pytest.mark.parametrize("name", NUMPY_DTYPES)
def test_numpy_dtypes_zero_copy(name: str) -> None:
    x = np.zeros((3, 4), dtype=name)
    buf = as_buffer(x, writable=True)
    assert buf.dtype is DTYPES[name]
    assert buf.shape == (3, 4)
    assert buf.count == 12 and buf.nbytes == x.nbytes
    assert buf.array.ndim == 1 and buf.array.dtype == np.dtype(name)
    buf.array[5] = 7
    assert x[1, 1] == 7
    assert np.shares_memory(buf.array, x)


def test_ml_dtypes_bfloat16() -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = np.zeros(4, dtype=ml_dtypes.bfloat16)
    buf = as_buffer(x, writable=True)
    assert buf.dtype.name == "bfloat16"
    assert buf.array.dtype == np.uint16
    buf.array[2] = 0x3FC0  # 1.5
    assert float(x[2]) == 1.5


def test_bytearray_and_memoryview() -> None:
    raw = bytearray(8)
    buf = as_buffer(raw, writable=True)
    assert buf.dtype.name == "uint8" and buf.count == 8
    buf.array[3] = 9
    assert raw[3] == 9
    view = memoryview(raw).cast("i")
    ints = as_buffer(view, writable=True)
    assert ints.dtype.name == "int32" and ints.count == 2
    ints.array[1] = -1
    assert raw[4:] == b"\xff\xff\xff\xff"


@pytest.mark.parametrize(
    ("code", "name"), [("d", "float64"), ("f", "float32"), ("b", "int8"), ("H", "uint16")]
)
def test_array_array(code: str, name: str) -> None:
    data = array.array(code, [1, 2, 3])
    buf = as_buffer(data, writable=True)
    assert buf.dtype.name == name
    buf.array[0] = 5
    assert data[0] == 5


def test_zero_d_and_empty_and_multi_dim() -> None:
    scalar = np.array(2.5, np.float32)
    buf = as_buffer(scalar, writable=True)
    assert buf.shape == () and buf.count == 1
    buf.array[0] = 4.0
    assert float(scalar) == 4.0
    empty = as_buffer(np.empty((0, 3), np.int64), writable=True)
    assert empty.shape == (0, 3) and empty.count == 0
    cube = np.arange(24, dtype=np.int16).reshape(2, 3, 4)
    flat = as_buffer(cube, writable=False)
    np.testing.assert_array_equal(flat.array, np.arange(24))


def test_read_only_inputs() -> None:
    frozen = np.arange(4.0)
    frozen.flags.writeable = False
    assert as_buffer(frozen, writable=False).count == 4
    with pytest.raises(ValueError, match="read-only"):
        as_buffer(frozen, writable=True)
    with pytest.raises(ValueError, match="read-only"):
        as_buffer(b"abcd", writable=True)
    assert as_buffer(b"abcd", writable=False).dtype.name == "uint8"


@pytest.mark.parametrize("obj", [[1.0, 2.0], "text", 3.0, None, {"a": 1}])
def test_rejects_non_buffers(obj: object) -> None:
    with pytest.raises(TypeError, match="buffer"):
        as_buffer(obj, writable=False, what="buffer")


@pytest.mark.parametrize("dtype", [object, bool, np.complex64, np.complex128, "U3", "datetime64[s]"])
def test_rejects_unsupported_dtypes(dtype: object) -> None:
    x = np.zeros(3, dtype=dtype)
    with pytest.raises(TypeError, match="dtype"):
        as_buffer(x, writable=True, what="allreduce buffer")


def test_rejects_non_contiguous() -> None:
    x = np.arange(10.0)
    with pytest.raises(ValueError, match="contiguous"):
        as_buffer(x[::2], writable=False)
    with pytest.raises(ValueError, match="contiguous"):
        as_buffer(np.asfortranarray(np.ones((3, 4))), writable=False)
    with pytest.raises(ValueError, match="contiguous"):
        as_buffer(memoryview(bytearray(8))[::2], writable=False)


def test_rejects_big_endian() -> None:
    with pytest.raises(TypeError, match="big-endian"):
        as_buffer(np.arange(4, dtype=">f4"), writable=False)


class FakeCuda:
    """Just an interface: ``as_buffer`` validates it without touching memory or importing CuPy."""

    def __init__(self, **fields: object) -> None:
        base = {"shape": (4,), "typestr": "<f4", "data": (0x7000, False), "version": 3}
        self.__cuda_array_interface__ = {**base, **fields}


def test_gpu_buffers_are_described_not_touched() -> None:
    buf = as_buffer(FakeCuda(shape=(2, 3), stream=7), writable=True)
    assert (buf.device, buf.ptr, buf.shape, buf.count, buf.nbytes) == ("cuda", 0x7000, (2, 3), 6, 24)
    assert buf.dtype.name == "float32" and buf.stream == 7
    assert as_buffer(FakeCuda(strides=(8, 4), shape=(3, 2)), writable=False).count == 6  # C order


def test_cuda_dlpack_goes_through_the_device_layer() -> None:
    """The plans import DLPack-only CUDA memory through the device layer; buffers knows no device code."""
    from ringcore import device
    from ringcore.device.fake import FakeLayer
    from ringcore.plans import validate

    class CudaDLPack:  # a CUDA-only DLPack producer (its bytes are host memory, for the fake layer)
        def __init__(self, data: np.ndarray) -> None:
            self.data = data

        def __dlpack__(self, **kwargs: object) -> object:
            return self.data.__dlpack__(**kwargs)

        def __dlpack_device__(self) -> tuple[int, int]:
            return (2, 0)  # kDLCUDA

    data = np.arange(6, dtype=np.float64)
    previous = device.use(FakeLayer())
    try:
        buf = validate.as_buffer(CudaDLPack(data), writable=True, what="x")
        with pytest.raises(TypeError, match="DLPack only"):
            as_buffer(CudaDLPack(data), writable=True)
    finally:
        device.use(previous)
    assert (buf.device, buf.ptr, buf.count, buf.dtype.name) == ("cuda", data.ctypes.data, 6, "float64")


@pytest.mark.parametrize(
    ("fields", "error", "words"),
    [
        ({"data": (0x7000, True)}, ValueError, "read-only"),
        ({"shape": (4, 4), "strides": (4, 16)}, ValueError, "not contiguous"),
        ({"typestr": "|b1"}, TypeError, "bool"),
        ({"typestr": ">f4"}, TypeError, "big-endian"),
        ({"mask": object()}, TypeError, "masked"),
    ],
)
def test_gpu_buffer_errors_match_host_ones(fields: dict, error: type, words: str) -> None:
    with pytest.raises(error, match=words):
        as_buffer(FakeCuda(**fields), writable=True, what="allreduce buffer")


def test_message_names_the_argument() -> None:
    with pytest.raises(TypeError, match=r"^allreduce buffer"):
        as_buffer(np.zeros(2, bool), writable=True, what="allreduce buffer")


# --------------------------------------------------------------------------- torch


def test_torch_float32_zero_copy() -> None:
    torch = pytest.importorskip("torch")
    t = torch.zeros(2, 3)
    buf = as_buffer(t, writable=True)
    assert buf.dtype.name == "float32" and buf.shape == (2, 3)
    buf.array[4] = 1.5
    assert t[1, 1].item() == 1.5


def test_torch_bfloat16_zero_copy() -> None:
    torch = pytest.importorskip("torch")
    t = torch.zeros(4, dtype=torch.bfloat16)
    buf = as_buffer(t, writable=True)
    assert buf.dtype.name == "bfloat16" and buf.array.dtype == np.uint16
    buf.array[1] = 0xC020  # -2.5
    assert t[1].item() == -2.5


def test_torch_requires_grad_asks_for_detach() -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="detach"):
        as_buffer(torch.zeros(3, requires_grad=True), writable=True)
    assert as_buffer(torch.zeros(3, requires_grad=True).detach(), writable=True).count == 3


def test_torch_non_contiguous_and_bool() -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="contiguous"):
        as_buffer(torch.zeros(4, 4).t(), writable=True)
    with pytest.raises(TypeError):
        as_buffer(torch.zeros(3, dtype=torch.bool), writable=True)
