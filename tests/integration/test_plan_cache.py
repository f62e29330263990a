"""Small allreduces skip validation for array layouts that passed it: results, and nothing stale.

``Communicator._allreduce_plan`` remembers which (dtype, shape, strides, op,
compression) passed validation. These tests reduce arrays again and again
over real processes and sockets, change what the cache keys on in between
(values, op, shape, writability, the array object), check every result
against numpy and every refusal against a fresh validation's, and check that
no reference to the caller's array is kept.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import numpy as np
import pytest

from tests import tasks
from tests.cluster import Cluster


def reduce_one_array_again_and_again(comm: Any) -> dict[str, Any]:
    """Reduce one array object in several ways; what each call returned, and the refusals."""
    x = np.zeros(1000, np.float32)
    out: dict[str, Any] = {"steps": []}
    for step in range(6):
        x[:] = np.arange(1000) * (comm.rank + 1) + step  # new values, same object
        assert comm.allreduce(x) is x
        out["steps"].append(x.copy())
    x[:] = comm.rank
    comm.allreduce(x, op="max")  # the same object, another op
    out["max"] = x.copy()
    x.shape = (10, 100)  # reshaped in place: same object, new shape
    x[:] = 1
    comm.allreduce(x)
    out["reshaped"] = x.copy()
    x.flags.writeable = False  # the cached plan must not be reused for a read-only array
    try:
        comm.allreduce(x)
    except ValueError as err:
        out["read_only"] = str(err)
    x.flags.writeable = True
    strided = np.zeros((10, 200), np.float32)[:, ::2]  # x's dtype and shape, but not contiguous
    try:
        comm.allreduce(strided)
    except ValueError as err:
        out["strided"] = str(err)
    comm.allreduce(x)  # still usable, and every rank still agrees on the order
    out["after"] = x.copy()
    other = np.empty_like(x)  # same layout, another object: its own memory, not x's
    for step in range(3):
        other[:] = comm.rank + step
        x[:] = -1
        comm.allreduce(other)
        out.setdefault("other", []).append((other.copy(), x.copy()))
    gone = np.ones(16, np.float32)
    ref = weakref.ref(gone)
    comm.allreduce(gone)
    del gone
    gc.collect()
    out["released"] = ref() is None
    ints = np.full(7, comm.rank + 1, np.int64)
    for _ in range(3):
        comm.allreduce(ints, op="prod")
    out["prod"] = ints.copy()
    y = np.ones(1000, np.float32)
    comm.allreduce(y)
    if comm.rank == 0:
        y.shape = (10, 100)  # now the ranks disagree, which the cached plan must not hide
    try:
        comm.allreduce(y)
    except Exception as err:  # the communicator is unusable afterwards: this comes last
        out["disagree"] = type(err).__name__
    return out


@pytest.mark.timeout(120)
def test_reusing_one_small_array_gives_numpy_results_and_the_same_refusals() -> None:
    size = 3
    with Cluster(size) as cluster:
        reports = cluster.results(reduce_one_array_again_and_again, timeout=60)
    weight = sum(r + 1 for r in range(size))
    for report in reports:
        for step, got in enumerate(report["steps"]):
            want = (np.arange(1000) * weight + size * step).astype(np.float32)
            np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(report["max"], np.full(1000, size - 1, np.float32))
        assert report["reshaped"].shape == (10, 100)
        np.testing.assert_array_equal(report["reshaped"], np.full((10, 100), size, np.float32))
        assert "writes its result into it in place" in report["read_only"]  # refused before sending
        assert "not contiguous" in report["strided"]
        np.testing.assert_array_equal(report["after"], np.full((10, 100), size**2, np.float32))
        for step, (got, untouched) in enumerate(report["other"]):
            np.testing.assert_array_equal(got, np.full((10, 100), sum(range(size)) + size * step, np.float32))
            np.testing.assert_array_equal(untouched, np.full((10, 100), -1, np.float32))
        assert report["released"], "the communicator kept a reference to the caller's array"
        np.testing.assert_array_equal(report["prod"], np.full(7, 6**9, np.int64))  # 1*2*3, then cubed twice
        assert report["disagree"] == "MismatchError"


@pytest.mark.timeout(120)
def test_scratch_of_remembered_layouts_stays_within_its_bound() -> None:
    """300 layouts of 16 B to 64 KiB, three calls each, under a 1 MiB bound: every result exact, and
    the small layouts' own scratch never above the bound (it grew without one: +352 MiB for 4096)."""
    counts = [4 + 54 * i for i in range(300)]  # 16 B .. 64 KiB of float32
    with Cluster(2, env={"RINGCORE_PLAN_CACHE_BYTES": "1M"}) as cluster:
        for ok, cache in cluster.results(tasks.many_layouts, counts, 3):
            assert all(ok)
            assert 0 < cache["scratch_bytes"] <= 1 << 20, cache
            assert cache["layouts"] < len(counts), cache  # the oldest were forgotten
