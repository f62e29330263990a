"""On a real GPU: the CUDA kernels against numpy bit for bit, and collectives of cupy and torch buffers.

Skipped, with the reason, where CuPy or a CUDA device is missing. The kernel
test launches every instantiation on the values of ``test_kernel_rules``
(specials, random bit patterns), at offsets that exercise the scalar head,
the 16-byte packs and the tail. The collective tests run N = 2..4 processes
sharing the GPU over TCP and require each GPU result to equal, bit for bit,
the host path's on the same inputs, and to keep the rules of numpy's
reference (``tests/reference.py``: exact for integers, min and max, within
a rounding bound for sums and products, NaN and infinities where numpy puts
them), plus the fp16 compression error bound against the exact sum.
"""

from __future__ import annotations

import importlib.util
import itertools

import numpy as np
import pytest

from ringcore.buffers import DTYPES
from ringcore.kernels import cuda_source
from ringcore.kernels.numpy_ops import Reducer
from ringcore.ops import Compression, ReduceOp
from tests.cluster import Cluster
from tests.gpu import tasks
from tests.gpu.gpu import needs_gpu, unavailable
from tests.gpu.test_fake_cluster import RING_ENV, cases
from tests.gpu.test_kernel_rules import (
    COUNT,
    _cases,
    _kinds,
    numpy_casts,  # noqa: F401 (autouse: numpy's casts are the rule)
    values,
)
from tests.reference import check_allreduce

pytestmark = [*needs_gpu, pytest.mark.timeout(240)]


def torch_cuda() -> bool:
    """Whether torch is installed with CUDA and sees a device (a CPU build of torch has no CUDA tensors)."""
    if unavailable() is not None or importlib.util.find_spec("torch") is None:
        return False  # no GPU here: do not import torch just to ask
    import torch

    return torch.cuda.is_available()


HAS_TORCH_CUDA = torch_cuda()
NEEDS_TORCH_CUDA = pytest.mark.skipif(not HAS_TORCH_CUDA, reason="no CUDA build of torch")


def _bits(x: np.ndarray) -> np.ndarray:
    return x.view(f"u{x.itemsize}")


@pytest.mark.parametrize(("name", "compression"), _cases())
@pytest.mark.parametrize("op", list(ReduceOp))
def test_kernels_bitwise_equal_numpy(name: str, compression: Compression, op: ReduceOp) -> None:
    import cupy

    from ringcore.kernels.cupy_ops import CudaReducer

    dtype = DTYPES[name]
    if op is ReduceOp.AVG and not dtype.is_float:
        pytest.skip("avg is refused for integers")
    stream = cupy.cuda.Stream(non_blocking=True)
    reducer = CudaReducer(dtype, op, compression, 3, stream)
    bf16 = name == "bfloat16"
    kinds = _kinds(dtype, compression)
    for (d, a_t, b_t), final, offset in itertools.product(
        itertools.product(kinds, repeat=3), (False, True), (0, 3)
    ):
        full_a = values(a_t, bf16 and a_t == np.uint16, 1)
        full_b = values(b_t, bf16 and b_t == np.uint16, 2)
        a, b = full_a[offset:], full_b[offset:]
        want = np.zeros(COUNT - offset, d)
        with np.errstate(all="ignore"):
            Reducer(dtype, op, compression, 3).combine(want, a, b, final=final)
        got = cupy.zeros(COUNT, d)[offset:]
        # slices of device arrays: misaligned by `offset`, so heads, packs and tails all run
        reducer.combine(got, cupy.asarray(full_a)[offset:], cupy.asarray(full_b)[offset:], final=final)
        stream.synchronize()
        wrong = np.flatnonzero(_bits(want) != _bits(cupy.asnumpy(got)))
        kernel = cuda_source.combine_name(dtype, op, d, a_t, b_t)
        assert not wrong.size, f"{kernel} final={final} offset={offset}: {wrong.size} differ"


@pytest.mark.parametrize("name", ["float32", "float64", "bfloat16"])
def test_convert_kernels_bitwise_equal_numpy(name: str) -> None:
    import cupy

    from ringcore.kernels.cupy_ops import CudaReducer

    dtype = DTYPES[name]
    stream = cupy.cuda.Stream(non_blocking=True)
    reducer = CudaReducer(dtype, ReduceOp.SUM, Compression.FP16, 2, stream)
    wire = cuda_source.wire_dtype(dtype, Compression.FP16)
    for (dst_t, src_t), offset in itertools.product(((wire, dtype.storage), (dtype.storage, wire)), (0, 5)):
        full = values(src_t, name == "bfloat16" and src_t == np.uint16, 5)
        src = full[offset:]
        want = np.zeros(src.size, dst_t)
        with np.errstate(all="ignore"):
            Reducer(dtype, ReduceOp.SUM, Compression.FP16, 2).convert(want, src)
        got = cupy.zeros(COUNT, dst_t)[offset:]
        reducer.convert(got, cupy.asarray(full)[offset:])
        stream.synchronize()
        assert np.array_equal(_bits(want), _bits(cupy.asnumpy(got))), f"{dst_t} <- {src_t} offset {offset}"


CONFIGS = [
    ("cupy", 2, RING_ENV, 5000),
    ("cupy", 3, RING_ENV, 3001),
    ("cupy", 4, {}, 100),
    ("cupy", 4, RING_ENV, 20000),
    pytest.param("torch", 2, RING_ENV, 5000, marks=NEEDS_TORCH_CUDA),
    pytest.param("torch", 4, {}, 100, marks=NEEDS_TORCH_CUDA),
]


@pytest.mark.parametrize(("kind", "size", "env", "count"), CONFIGS)
def test_gpu_buffers_equal_host_path(kind: str, size: int, env: dict, count: int) -> None:
    with Cluster(size, env=env) as cluster:
        all_cases = cases(size, count)
        results = cluster.results(tasks.real_vs_host, all_cases, kind, timeout=200)
        for c, (inputs, bfloat16, op, compression) in enumerate(all_cases):
            for rank in range(size):
                gpu, host = results[rank][c]
                label = f"{kind} case {c} ({host.dtype}, bf16={bfloat16}, {op}, {compression}) rank {rank}"
                np.testing.assert_array_equal(gpu, host, err_msg=label)
                np.testing.assert_array_equal(host, results[0][c][1], err_msg=label)
            check_allreduce(results[0][c][0], inputs, op, compression, bfloat16, where=f"{kind} case {c}")


@pytest.mark.parametrize("size", [2, 4])
def test_fp16_compression_error_bound(size: int) -> None:
    rng = np.random.default_rng(size)
    inputs = [rng.standard_normal(50_000).astype(np.float32) for _ in range(size)]
    with Cluster(size, env=RING_ENV) as cluster:
        results = cluster.results(tasks.real_vs_host, [(inputs, False, "sum", "fp16")], "cupy")
    exact = np.sum([x.astype(np.float64) for x in inputs], axis=0)
    bound = (size + 1) * 2.0**-11 * np.sum([np.abs(x.astype(np.float64)) for x in inputs], axis=0) + 1e-6
    for rank_results in results:
        got = rank_results[0][0].view(np.float32)
        assert np.all(np.abs(got - exact) <= bound)
        check_allreduce(got, inputs, "sum", "fp16")


def test_broadcast_cupy() -> None:
    size = 3
    with Cluster(size, env=RING_ENV) as cluster:
        inputs = [np.arange(10_000, dtype=np.float32) * (r + 1) for r in range(size)]
        for root in range(size):
            for result in cluster.results(tasks.real_broadcast, inputs, root):
                np.testing.assert_array_equal(result, inputs[root])
