"""The CUDA kernels' element rules, built for the host with g++, against numpy bit for bit.

Every instantiation a collective may launch is checked on values chosen to
break careless kernels: random bit patterns (NaN payloads, signalling NaNs,
subnormals), infinities of both signs, signed zeros, rounding ties, and
values beyond float16's range. Runs on any machine with a C++ compiler; the
same comparison on a real GPU is in ``test_cuda.py``.
"""

from __future__ import annotations

import ctypes
import itertools
import shutil

import numpy as np
import pytest

from ringcore.buffers import DTYPES, DType
from ringcore.kernels import casts, cuda_source
from ringcore.kernels.numpy_ops import Reducer
from ringcore.ops import Compression, ReduceOp
from tests.gpu import native

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None, reason="no C++ compiler (g++) on PATH"
)
COUNT = 4096


@pytest.fixture(autouse=True)
def numpy_casts(monkeypatch: pytest.MonkeyPatch) -> None:
    """numpy's casts are the rule the kernels follow: keep them even if this process imported torch.

    (torch's loop quiets signaling NaNs, ringcore.kernels.casts; these tests feed them on purpose.)
    """
    monkeypatch.setattr(casts, "BORROW_TORCH", False)


pytestmark = [pytestmark, pytest.mark.filterwarnings("ignore:overflow encountered")]
_SPECIAL = {
    np.dtype(np.float16): [0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFE01, 0x0001, 0x03FF, 0x7BFF],
    np.dtype(np.float32): [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00001, 0x7F800001, 0x477FF000,
                           0x477FE000, 0x33000000, 0x33000001, 0x387FC000, 0x00000001],
    np.dtype(np.float64): [0, 1 << 63, 0x7FF0 << 48, 0xFFF0 << 48, 0x7FF8000000000001,
                           0x7FF0000000000001, 0x40EFFE0000000000, 0x3E70000000000000],
}  # fmt: skip


def values(x: np.dtype, bf16: bool, seed: int) -> np.ndarray:
    """COUNT values of storage dtype ``x``: specials, random bits, and ordinary numbers.

    Seeds 1 and 2 (a and b) lay the specials out so that each meets every other.
    """
    rng = np.random.default_rng(seed)
    if x.kind in "iu":
        info = np.iinfo(x)
        return rng.integers(info.min, info.max, COUNT, dtype=x, endpoint=True)
    bits = np.dtype(f"u{x.itemsize}")
    out = rng.integers(0, np.iinfo(bits).max, COUNT, dtype=bits, endpoint=True)
    numbers = rng.standard_normal(COUNT // 2) * rng.choice([1e-6, 1, 100, 7e4, 1e6], COUNT // 2)
    if bf16:
        ordinary = (numbers.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        special = np.array(_SPECIAL[np.dtype(np.float32)], np.uint64) >> 16
    else:
        ordinary = numbers.astype(x).view(bits)  # overflow to inf is wanted
        special = np.array(_SPECIAL[x], np.uint64)
    out[: COUNT // 2] = ordinary
    rng.shuffle(out)
    # the first n*n elements pair every special of a with every special of b
    n = special.size
    out[: n * n] = (np.repeat if seed == 1 else np.tile)(special.astype(bits), n)
    return out.view(x)


def _ptr(x: np.ndarray) -> ctypes.c_void_p:
    return ctypes.c_void_p(x.ctypes.data)


def _bits(x: np.ndarray) -> np.ndarray:
    return x.view(f"u{x.itemsize}")


def _cases() -> list[tuple[str, Compression]]:
    return [(n, c) for n in DTYPES for c in Compression if c is Compression.NONE or DTYPES[n].is_float]


def _kinds(dtype: DType, compression: Compression) -> list[np.dtype]:
    return sorted({dtype.storage, cuda_source.wire_dtype(dtype, compression)}, key=str)


@pytest.mark.parametrize(("name", "compression"), _cases())
@pytest.mark.parametrize("op", list(ReduceOp))
def test_combine_bitwise(name: str, compression: Compression, op: ReduceOp) -> None:
    dtype = DTYPES[name]
    if op is ReduceOp.AVG and not dtype.is_float:
        pytest.skip("avg is refused for integers")
    lib = native.host_library()
    kinds = _kinds(dtype, compression)
    bf16 = name == "bfloat16"
    for (d, a_t, b_t), final in itertools.product(itertools.product(kinds, repeat=3), (False, True)):
        a = values(a_t, bf16 and a_t == np.uint16, 1)
        b = values(b_t, bf16 and b_t == np.uint16, 2)
        want, got = np.zeros(COUNT, d), np.zeros(COUNT, d)
        with np.errstate(all="ignore"):
            Reducer(dtype, op, compression, 3).combine(want, a, b, final=final)
        kernel = cuda_source.combine_name(dtype, op, d, a_t, b_t)
        scale = int(final and op is ReduceOp.AVG)
        lib[kernel](_ptr(got), _ptr(a), _ptr(b), ctypes.c_longlong(COUNT), scale, ctypes.c_double(3.0))
        wrong = np.flatnonzero(_bits(want) != _bits(got))
        assert not wrong.size, (
            f"{kernel} final={final}: {wrong.size} differ, first at {wrong[0]}: "
            f"a={_bits(a)[wrong[0]]:#x} b={_bits(b)[wrong[0]]:#x} "
            f"numpy={_bits(want)[wrong[0]]:#x} kernel={_bits(got)[wrong[0]]:#x}"
        )


@pytest.mark.parametrize("name", ["float32", "float64", "bfloat16"])
def test_convert_bitwise(name: str) -> None:
    dtype = DTYPES[name]
    lib = native.host_library()
    wire = cuda_source.wire_dtype(dtype, Compression.FP16)
    reducer = Reducer(dtype, ReduceOp.SUM, Compression.FP16, 2)
    for dst_t, src_t in ((wire, dtype.storage), (dtype.storage, wire)):
        src = values(src_t, name == "bfloat16" and src_t == np.uint16, 5)
        want, got = np.zeros(COUNT, dst_t), np.zeros(COUNT, dst_t)
        with np.errstate(all="ignore"):
            reducer.convert(want, src)
        kernel = cuda_source.convert_name(dtype, dst_t, src_t)
        lib[kernel](_ptr(got), _ptr(src), ctypes.c_longlong(COUNT))
        wrong = np.flatnonzero(_bits(want) != _bits(got))
        assert not wrong.size, (
            f"{kernel}: {wrong.size} differ, first src={_bits(src)[wrong[0]]:#x} "
            f"numpy={_bits(want)[wrong[0]]:#x} kernel={_bits(got)[wrong[0]]:#x}"
        )


def test_vector_head() -> None:
    assert cuda_source.vector_head([256, 512], [4, 4], 100) == 0
    assert cuda_source.vector_head([260, 516], [4, 4], 100) == 3  # both 12 bytes short of 16
    assert cuda_source.vector_head([260, 512], [4, 4], 100) == 100  # never aligned together
    assert cuda_source.vector_head([258, 516], [2, 4], 100) == 3  # a float16 and a float32 pack of 4
    assert cuda_source.vector_head([260, 516], [4, 4], 2) == 2
