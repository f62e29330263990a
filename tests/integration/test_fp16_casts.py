"""fp16 compression in a ring where some ranks borrow torch's casts and others use numpy's."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from tests import tasks
from tests.cluster import Cluster

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None,
    reason="torch not installed (pip install torch==2.13.0): every rank casts with numpy",
)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_ranks_with_and_without_torch_end_bit_identical(op: str) -> None:
    rng = np.random.default_rng(5)
    inputs = [(rng.standard_normal(300_001) * 100).astype(np.float32) for _ in range(3)]
    env = {"RINGCORE_SMALL_BYTES": "4K", "RINGCORE_SEGMENT_BYTES": "64K"}  # the ring, many segments
    with Cluster(3, env=env) as cluster:
        reports = cluster.run(tasks.allreduce_with_torch_on, inputs, op, "fp16", [0, 2], timeout=90)
    assert [borrowed for _, borrowed in reports] == [True, False, True]
    results = [result for result, _ in reports]
    assert len({r.tobytes() for r in results}) == 1, "ranks disagree bit for bit"
    want = np.sum(np.asarray(inputs, np.float64), axis=0) / (3 if op == "avg" else 1)
    np.testing.assert_allclose(results[0], want, rtol=2e-3, atol=0.5)
