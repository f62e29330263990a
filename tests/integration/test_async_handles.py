"""The async forms of allgather and reduce_scatter, and Handle's done-callbacks, over real processes."""

from __future__ import annotations

import numpy as np
import pytest

from tests import tasks
from tests.cluster import Cluster


@pytest.mark.timeout(90)
@pytest.mark.parametrize("size", [2, 3])
def test_async_allgather_and_reduce_scatter_match_numpy_and_call_back_in_order(size: int) -> None:
    rng = np.random.default_rng(size)
    inputs = [rng.standard_normal((7, 3)) for _ in range(size)]
    with Cluster(size) as cluster:
        outs = cluster.results(tasks.async_new_arrays, inputs)
    total = np.sum(inputs, axis=0)
    for rank, (gathered, scattered, seen) in enumerate(outs):
        np.testing.assert_array_equal(gathered, np.concatenate(inputs))
        np.testing.assert_allclose(scattered, np.array_split(total, size)[rank], rtol=1e-12)
        assert seen == ["allgather None", "reduce_scatter None", "at once"]
