"""Halving-doubling allreduce over real processes and sockets: which sizes take it, and its results.

On a power-of-two world of 4 or more, allreduces above ``RINGCORE_SMALL_BYTES``
and up to ``RINGCORE_HALVING_BYTES`` (wire bytes) use halving-doubling; the
schedule itself is checked against numpy in memory in
``tests/unit/test_schedules.py``. Here: the size boundaries, results against
numpy and bit-identical across ranks (every op, integer and float dtypes, fp16
compression) at N=4 and N=8, a dead peer in the middle of one, and sliced
buffers, which keep the ring.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import ringcore
from tests import tasks
from tests.cluster import Background, Cluster, RankError, qualified

pytestmark = pytest.mark.timeout(180)

SMALL = 64 * 1024 // 4  # float32 elements at the default RINGCORE_SMALL_BYTES
HALVING = 4 * 1024 * 1024 // 4  # ... at the default RINGCORE_HALVING_BYTES


def reference(inputs: list[np.ndarray], op: str) -> np.ndarray:
    wide = np.stack([x.astype(np.float64 if x.dtype.kind == "f" else x.dtype) for x in inputs])
    if op == "avg":
        return wide.sum(axis=0) / len(inputs)
    ufunc = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}[op]
    return ufunc.reduce(wide, axis=0, dtype=wide.dtype)


def check_results(results: list[np.ndarray], want: np.ndarray, rtol: float) -> None:
    for got in results:
        assert got.tobytes() == results[0].tobytes(), "ranks disagree bit for bit"
    if want.dtype.kind == "f":
        np.testing.assert_allclose(results[0], want, rtol=rtol, atol=rtol)
    else:
        np.testing.assert_array_equal(results[0], want)


def test_sizes_between_the_thresholds_take_halving_doubling_on_4_ranks() -> None:
    with Cluster(4) as cluster:
        picked = {
            count: cluster.results(tasks.allreduce_algorithm, count, 4)
            for count in (SMALL, SMALL + 1, HALVING, HALVING + 1)
        }
        sliced = cluster.results(tasks.allreduce_algorithm, SMALL + 1, 4, True)
    assert picked == {
        SMALL: ["recursive-doubling"] * 4,
        SMALL + 1: ["halving-doubling"] * 4,
        HALVING: ["halving-doubling"] * 4,
        HALVING + 1: ["ring"] * 4,
    }
    assert sliced == ["ring"] * 4  # each slice of a sliced buffer is a ring


def test_three_and_six_ranks_keep_the_ring() -> None:
    for size in (3, 6):
        with Cluster(size) as cluster:
            assert cluster.results(tasks.allreduce_algorithm, 100_000, 4) == ["ring"] * size


@pytest.mark.parametrize("size", [4, 8])
def test_halving_doubling_matches_numpy(size: int) -> None:
    rng = np.random.default_rng(size)
    count = 50_001  # 200 KB of float32: above the small path, odd so halves are uneven
    cases = [
        (np.float32, "sum", None, 1e-5),
        (np.float32, "avg", None, 1e-5),
        (np.float64, "max", None, 0.0),
        (np.float32, "sum", "fp16", 2e-2),
        (np.int32, "sum", None, 0.0),
        (np.int64, "prod", None, 0.0),
        (np.uint8, "min", None, 0.0),
    ]
    with Cluster(size) as cluster:
        assert cluster.results(tasks.allreduce_algorithm, count, 4) == ["halving-doubling"] * size
        for dtype, op, compression, rtol in cases:
            if np.dtype(dtype).kind == "f":
                inputs = [rng.standard_normal(count).astype(dtype) for _ in range(size)]
            else:
                inputs = [rng.integers(-3, 4, count).astype(dtype) for _ in range(size)]
            results = cluster.results(tasks.allreduce, inputs, op, compression, timeout=60)
            check_results(results, reference(inputs, op).astype(dtype), rtol)


def test_sliced_buffer_on_4_ranks_matches_numpy() -> None:
    rng = np.random.default_rng(11)
    inputs = [rng.standard_normal(300_000).astype(np.float32) for _ in range(4)]
    with Cluster(4, env={"RINGCORE_SLICE_BYTES": "256K"}) as cluster:
        results = cluster.results(tasks.allreduce, inputs, "sum", timeout=60)
    check_results(results, reference(inputs, "sum").astype(np.float32), 1e-5)


def test_dead_peer_mid_halving_doubling_fails_every_survivor_and_leaves_buffers_untouched() -> None:
    size, victim, count = 4, 2, 250_000  # 1 MB: halving-doubling, a few ms per allreduce
    survivors = [r for r in range(size) if r != victim]
    with Cluster(size, env={"RINGCORE_TIMEOUT": "20"}) as cluster:
        doomed = Background(
            cluster, tasks.allreduce_until_failure, count, 100_000, ranks=[victim], timeout=90
        )
        working = Background(
            cluster, tasks.allreduce_until_failure, count, 100_000, ranks=survivors, timeout=90
        )
        time.sleep(1.0)
        cluster.kill(victim)
        reports = working.join(60)
        (victim_report,) = doomed.join(30)
    assert isinstance(victim_report, RankError) and victim_report.type_name == "dead", victim_report
    for rank, report in zip(survivors, reports, strict=True):
        assert not isinstance(report, RankError), (rank, report)
        assert report["error"] == qualified(ringcore.PeerFailure), (rank, report)
        assert report["peer"] == victim and f"rank {victim}" in report["message"], (rank, report)
        assert report["rounds"] > 0, (rank, report)
        # halving-doubling writes the caller's buffer only after its last step
        assert report["untouched"] and report["exposed"] in (None, (0, 0)), (rank, report)
