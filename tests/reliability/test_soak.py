"""Soak: a bounded run of thousands of mixed collectives, every result checked against numpy.

Each cluster runs ``tasks.soak``: allreduce (blocking and async batches),
broadcast, allgather (ranks give different row counts), reduce_scatter and
barrier, with random sizes (mostly 0-3000 elements, some fewer than the ranks,
2 % between 50k and 200k), dtypes, ops, roots and fp16 compression, and random
0-2 ms sleeps before a quarter of the calls on each rank. The plan and every
rank's input come from ``(seed, index, rank)``, so the test rebuilds them and
computes the expected results with numpy. Results that every rank must hold
identically (allreduce, broadcast, allgather) must also be bit-identical
across ranks. The configurations push the same sizes through every allreduce
algorithm (recursive doubling up to ``RINGCORE_SMALL_BYTES``, on 4 ranks
halving-doubling up to ``RINGCORE_HALVING_BYTES``, the ring above) with many
small segments and more than one channel.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from tests import tasks
from tests.cluster import Cluster

CONFIGS = [
    # (size, collectives, environment)
    (2, 2000, {"RINGCORE_SEGMENT_BYTES": "4K"}),
    (3, 1500, {"RINGCORE_SMALL_BYTES": "1K", "RINGCORE_SEGMENT_BYTES": "4K"}),
    (
        4,
        1000,
        {
            "RINGCORE_SMALL_BYTES": "4K",
            "RINGCORE_HALVING_BYTES": "64K",
            "RINGCORE_SEGMENT_BYTES": "8K",
            "RINGCORE_CHANNELS": "2",
        },
    ),
]
SEED = 20240611
TOTALS: dict[int, int] = {}


def reduce(inputs: list[np.ndarray], op: str) -> np.ndarray:
    wide = np.stack([x.astype(np.float64 if x.dtype.kind == "f" else np.int64) for x in inputs])
    if op in ("sum", "avg"):
        out = wide.sum(axis=0)
        return out / len(inputs) if op == "avg" else out
    return {"min": wide.min, "max": wide.max, "prod": wide.prod}[op](axis=0)


def assert_close(got: np.ndarray, want: np.ndarray, spec: dict[str, Any], where: str) -> None:
    assert got.dtype == np.dtype(spec["dtype"]), f"{where}: dtype {got.dtype}"
    assert got.shape == want.shape, f"{where}: shape {got.shape} != {want.shape}"
    if got.dtype.kind == "i" or (spec["op"] in ("min", "max") and not spec["compression"]):
        np.testing.assert_array_equal(got, want.astype(got.dtype), err_msg=where)
    elif spec["compression"]:
        np.testing.assert_allclose(got, want, rtol=1e-2, atol=2e-2, err_msg=where)
    else:
        tol = 1e-5 if got.dtype == np.float32 else 1e-12
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=where)


def check(seed: int, size: int, index: int, results: list[Any]) -> None:
    """Compare every rank's result of collective ``index`` with numpy."""
    spec = tasks.soak_spec(seed, size, index)
    kind, where = spec["kind"], f"collective {index} ({spec})"
    inputs = [tasks.soak_input(seed, r, index, spec) for r in range(size)]
    if kind == "barrier":
        assert results == [None] * size, where
        return
    if kind == "async":
        for part in range(spec["batch"]):
            parts = [tasks.soak_input(seed, r, index, spec, part) for r in range(size)]
            want = reduce(parts, spec["op"])
            for rank in range(size):
                assert_close(results[rank][part], want, spec, f"{where} part {part} rank {rank}")
            assert all(np.array_equal(results[0][part], results[r][part]) for r in range(size)), where
        return
    for rank in range(size):
        got, here = results[rank], f"{where} rank {rank}"
        if kind == "allreduce":
            assert_close(got, reduce(inputs, spec["op"]), spec, here)
        elif kind == "broadcast":
            np.testing.assert_array_equal(got, inputs[spec["root"]], err_msg=here)
        elif kind == "allgather":
            np.testing.assert_array_equal(got, np.concatenate(inputs), err_msg=here)
        elif kind == "reduce_scatter":
            want = np.array_split(reduce(inputs, spec["op"]), size, axis=0)[rank]
            assert_close(got, want, spec, here)
    if kind in ("allreduce", "broadcast", "allgather"):
        assert all(np.array_equal(results[0], results[r]) for r in range(size)), f"{where}: ranks differ"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("size", "total", "env"), CONFIGS, ids=[f"N={c[0]}" for c in CONFIGS])
def test_soak(size: int, total: int, env: dict[str, str]) -> None:
    seed = SEED + size
    started = time.monotonic()
    with Cluster(size, env={"RINGCORE_TIMEOUT": "30", **env}, timeout=60) as cluster:
        per_rank = cluster.results(tasks.soak, seed, total, timeout=90)
    ran = time.monotonic() - started
    for index in range(total):
        check(seed, size, index, [results[index] for results in per_rank])
    kinds = [tasks.soak_spec(seed, size, i)["kind"] for i in range(total)]
    TOTALS[size] = total
    print(
        f"\n[soak] N={size}: {total} collectives in {ran:.1f} s "
        f"({', '.join(f'{k} {kinds.count(k)}' for k in sorted(set(kinds)))}); "
        f"{sum(TOTALS.values())} soak collectives so far, all checked against numpy"
    )
