"""ringcore's CuPy layer and CudaReducer, run without a GPU over a mock of CuPy's API.

See ``mock_cupy.py``: the kernels are the host build of the CUDA element
rules, called with the arguments ringcore passes to the real ones. The
staged executor runs on it in-process, and whole collectives run on it across
processes over TCP, bitwise against the host path and within the rules of
numpy's reference (``tests/reference.py``).
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from ringcore.ops import Compression, ReduceOp
from tests.cluster import Cluster
from tests.gpu import mock_cupy, tasks
from tests.gpu.test_fake_cluster import RING_ENV, cases
from tests.gpu.test_staging import CASES, host_allreduce, inputs, staged_allreduce
from tests.reference import check_allreduce

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.usefixtures("ring_only"),  # the GPU path's bits are the host ring's
    pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler (g++) for the host kernels"),
]


@pytest.mark.parametrize(("dtype", "op", "comp"), CASES)
def test_staged_executor_on_the_cupy_layer(dtype: str, op: ReduceOp, comp: Compression) -> None:
    values = inputs(3, 1003, dtype, seed=4)
    want = host_allreduce(values, dtype, op, comp, "ring", 256, 2)
    with mock_cupy.installed():
        got, _ = staged_allreduce("mock", values, dtype, op, comp, "ring", 256, 2, staging_bytes=1024)
    for rank in range(3):
        np.testing.assert_array_equal(
            got[rank].view(f"u{got[rank].itemsize}"), want[rank].view(f"u{want[rank].itemsize}")
        )
    compression = None if comp is Compression.NONE else comp.value
    check_allreduce(got[0], values, op.value, compression, bfloat16=dtype == "bfloat16")


def test_collectives_through_the_cupy_layer() -> None:
    size = 3
    with Cluster(size, env=RING_ENV) as cluster:
        cluster.results(tasks.use_mock_cupy)
        all_cases = cases(size, 3001)
        results = cluster.results(tasks.fake_vs_host, all_cases, timeout=240)
        for c, (inputs, bfloat16, op, compression) in enumerate(all_cases):
            for rank in range(size):
                gpu, host = results[rank][c]
                label = f"case {c} ({host.dtype}, bf16={bfloat16}, {op}, {compression}) rank {rank}"
                np.testing.assert_array_equal(gpu, host, err_msg=label)
            check_allreduce(results[0][c][0], inputs, op, compression, bfloat16, where=f"case {c}")
