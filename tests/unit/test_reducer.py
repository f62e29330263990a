"""``Reducer.reduce`` of N inputs against pairwise ``combine`` in the same order, bit for bit, and numpy."""

from __future__ import annotations

import numpy as np
import pytest

from ringcore.buffers import DTYPES
from ringcore.kernels.numpy_ops import Reducer
from ringcore.ops import Compression, ReduceOp


def inputs_of(name: str, count: int, parts: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    dtype = DTYPES[name]
    if name == "bfloat16":  # float32 values with their low half cut off, as bfloat16 bits
        return [
            (rng.normal(size=count).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
            for _ in range(parts)
        ]
    if dtype.storage.kind == "f":
        return [rng.normal(scale=1e3, size=count).astype(dtype.storage) for _ in range(parts)]
    return [rng.integers(-100, 100, size=count).astype(dtype.storage) for _ in range(parts)]


@pytest.mark.parametrize("name", ["float32", "float64", "float16", "bfloat16", "int32", "int64"])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PROD])
@pytest.mark.parametrize("parts", [2, 3, 5])
def test_reduce_gives_pairwise_combines_bits_in_list_order(name: str, op: ReduceOp, parts: int) -> None:
    if op is ReduceOp.AVG and not DTYPES[name].is_float:
        pytest.skip("avg is for floating-point dtypes")
    inputs = inputs_of(name, 1000, parts, seed=parts)
    reducer = Reducer(DTYPES[name], op, Compression.NONE, parts)
    pairwise, reduced = np.empty_like(inputs[0]), np.full_like(inputs[0], 7)
    with np.errstate(all="ignore"):
        reducer.combine(pairwise, inputs[0], inputs[1], final=parts == 2)
        for index in range(2, parts):
            reducer.combine(pairwise, pairwise, inputs[index], final=index == parts - 1)
        reducer.reduce(reduced, inputs)
    assert reduced.tobytes() == pairwise.tobytes()
    if name in ("float64", "int64") and op is not ReduceOp.AVG:
        want = {"sum": np.sum, "min": np.min, "max": np.max, "prod": np.prod}[op.value](
            np.stack(inputs), axis=0
        )
        np.testing.assert_allclose(reduced, want, rtol=1e-12)
