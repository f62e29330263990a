"""float16 <-> float32 casts: torch's borrowed loop against numpy's, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from ringcore.buffers import DTYPES
from ringcore.kernels import casts
from ringcore.kernels.numpy_ops import Reducer
from ringcore.ops import Compression, ReduceOp

torch = pytest.importorskip(
    "torch", reason="torch not installed (pip install torch==2.13.0): casts stay numpy's"
)

EDGES = [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x00000001, 0x33000000]
EDGES += [0x33000001, 0x387FE000, 0x38800000, 0x477FEFFF, 0x477FF000, 0x47800000, 0x3F800000]


def signaling_nan32(bits: np.ndarray) -> np.ndarray:
    return ((bits & 0x7F800000) == 0x7F800000) & ((bits & 0x007FFFFF) != 0) & ((bits & 0x00400000) == 0)


def both_ways(dst_dtype: type, src: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    by_numpy, by_torch = np.empty(src.size, dst_dtype), np.empty(src.size, dst_dtype)
    with np.errstate(all="ignore"):
        np.copyto(by_numpy, src, casting="unsafe")
    assert casts.borrows_torch()
    casts.cast(by_torch, src)
    return by_numpy, by_torch


def test_float32_to_float16_matches_numpy_except_signaling_nans() -> None:
    rng = np.random.default_rng(0)
    bits = np.concatenate([rng.integers(0, 2**32, 1 << 22, dtype=np.uint64).astype(np.uint32), EDGES])
    bits = bits.astype(np.uint32)
    by_numpy, by_torch = both_ways(np.float16, bits.view(np.float32))
    differ = by_numpy.view(np.uint16) != by_torch.view(np.uint16)
    assert np.array_equal(differ, signaling_nan32(bits)), "only signaling NaNs may convert differently"
    assert np.isnan(by_numpy[differ]).all() and np.isnan(by_torch[differ]).all()


def test_float16_to_float32_matches_numpy_on_every_non_signaling_value() -> None:
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    by_numpy, by_torch = both_ways(np.float32, bits.view(np.float16))
    signaling = ((bits & 0x7C00) == 0x7C00) & ((bits & 0x03FF) != 0) & ((bits & 0x0200) == 0)
    differ = by_numpy.view(np.uint32) != by_torch.view(np.uint32)
    assert np.array_equal(differ, signaling)


@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX])
def test_fp16_reducer_is_bit_identical_with_and_without_torch(op: ReduceOp, monkeypatch) -> None:
    rng = np.random.default_rng(1)
    own = (rng.standard_normal(50_000) * 1e3).astype(np.float32)
    own[:4] = [np.inf, -np.inf, np.nan, 7e4]  # overflow to inf in float16, quiet NaN
    wire = rng.standard_normal(50_000).astype(np.float16)
    results = []
    for borrow in (False, True):
        monkeypatch.setattr(casts, "BORROW_TORCH", borrow)
        reducer = Reducer(DTYPES["float32"], op, Compression.FP16, 3)
        packed, combined, unpacked = np.empty_like(wire), np.empty_like(wire), np.empty_like(own)
        with np.errstate(all="ignore"):
            reducer.convert(packed, own)
            reducer.combine(combined, wire, own, final=True)
            reducer.convert(unpacked, combined)
        results.append([a.tobytes() for a in (packed, combined, unpacked)])
    assert results[0] == results[1]


def test_falls_back_to_numpy_where_torch_cannot_help() -> None:
    src = np.arange(10, dtype=np.float32)
    src.flags.writeable = False  # torch.from_numpy wants writable memory
    out = np.empty(10, np.float16)
    casts.cast(out, src)
    np.testing.assert_array_equal(out, src.astype(np.float16))
    wide = np.empty(10, np.float64)
    casts.cast(wide, out)  # not a float16/float32 pair
    np.testing.assert_array_equal(wide, src)


def test_can_be_turned_off(monkeypatch) -> None:
    monkeypatch.setattr(casts, "BORROW_TORCH", False)
    assert not casts.borrows_torch()
