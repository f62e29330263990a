"""Symmetric memory across real processes: ``ringcore.empty`` and the direct allreduce on it.

The results are checked against numpy and against the ordinary route on the
same inputs; the failure cases check what the route promises beyond the data:
ranks that disagree on the memory fail before anyone reads a peer's array, and
nothing is ever left in ``/dev/shm`` (a rank killed or stopped mid-push:
``tests/integration/test_direct.py``).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests import tasks
from tests.cluster import Cluster
from tests.reference import check_allreduce

SHM = {"RINGCORE_TRANSPORT": "shm", "RINGCORE_TIMEOUT": "20"}
KIB = 1024


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("size", "transport", "direct_bytes"),
    [(2, "shm", "1G"), (3, "shm", "1G"), (4, "shm", "1G"), (3, "tcp", "1G"), (3, "shm", "1M")],
)
def test_direct_allreduce_matches_numpy_and_the_ring(size: int, transport: str, direct_bytes: str) -> None:
    """Against ordinary arrays (``RINGCORE_DIRECT_BYTES=1G``: only symmetric memory goes direct; ordinary
    arrays take the ring, or one or two shots through the mailboxes up to 1 MiB).

    At the default 1M the cases from 1 MiB vote, and the ordinary arrays beside them go direct too.
    """
    rng = np.random.default_rng(size)
    env = {**SHM, "RINGCORE_TRANSPORT": transport, "RINGCORE_DIRECT_BYTES": direct_bytes}
    cases = [
        ("float32", "sum", 256 * KIB, 0),
        ("float64", "max", 1024 * KIB + 8, 3),
        ("int32", "sum", 4096 * KIB, 16),
        ("int64", "prod", 96 * KIB, 1),
        ("float32", "avg", 300 * KIB + 4, 5),
        ("float16", "min", 200 * KIB, 2),
    ]
    with Cluster(size, env=env, timeout=120) as cluster:
        for dtype, op, nbytes, offset in cases:
            count = nbytes // np.dtype(dtype).itemsize
            low, high = (1, 3) if op == "prod" else (-50, 50)
            inputs = [rng.integers(low, high, count).astype(dtype) for _ in range(size)]
            direct = cluster.results(tasks.allreduce_symmetric, inputs, op, offset, 9, timeout=120)
            ring = cluster.results(tasks.allreduce, inputs, op, timeout=120)
            for rank, (report, ordinary) in enumerate(zip(direct, ring, strict=True)):
                where = f"rank {rank} {dtype} {op} {nbytes} bytes at element {offset}:"
                assert report["direct"] == 1, f"{where} the direct route did not run"
                assert report["outside intact"], f"{where} elements outside the view changed"
                check_allreduce(report["result"], inputs, op, where=where)
                np.testing.assert_allclose(report["result"], ordinary, rtol=1e-6, err_msg=where)
            first = direct[0]["result"]
            for report in direct[1:]:  # each share is reduced once: every rank holds the same bits
                assert first.tobytes() == report["result"].tobytes()


@pytest.mark.timeout(180)
def test_small_buffers_take_the_ordinary_route() -> None:
    """At or below RINGCORE_SMALL_BYTES the one-shot route (one wait) beats the direct one (two barriers)."""
    inputs = [np.full(1024, r + 1, np.float32) for r in range(2)]
    with Cluster(2, env=SHM, timeout=60) as cluster:
        for report in cluster.results(tasks.allreduce_symmetric, inputs, "sum"):
            assert report["direct"] == 0
            np.testing.assert_array_equal(report["result"], np.full(1024, 3, np.float32))


@pytest.mark.timeout(180)
def test_memory_is_mapped_only_within_one_host_and_never_named() -> None:
    before = set(os.listdir("/dev/shm"))
    with Cluster(2, env=SHM, timeout=60) as cluster:
        for report in cluster.results(tasks.symmetric_is_mapped):
            assert report["mapped"]
            assert set(report["shm files"]) <= before | {
                f for f in report["shm files"] if f.startswith("sem.")
            }
    hosts = ["sym-host-a", "sym-host-a", "sym-host-b", "sym-host-b"]
    with Cluster(4, env={"RINGCORE_TIMEOUT": "20"}, timeout=60, hostnames=hosts) as cluster:
        assert [r["mapped"] for r in cluster.results(tasks.symmetric_is_mapped)] == [False] * 4
        rng = np.random.default_rng(5)
        inputs = [rng.integers(-9, 9, 100_000).astype(np.float32) for _ in range(4)]
        for report in cluster.results(tasks.allreduce_symmetric, inputs, "sum"):
            assert report["direct"] == 0
            check_allreduce(report["result"], inputs, "sum")


@pytest.mark.timeout(180)
def test_ranks_that_disagree_on_the_memory_fail_untouched() -> None:
    """Where ranks cannot copy from each other (here: TCP), there is no vote; the descriptor names the memory.

    (Where they can, the vote takes them all direct: ``tests/integration/test_direct.py``.)
    """
    rng = np.random.default_rng(8)
    inputs = [rng.standard_normal(200_000).astype(np.float32) for _ in range(3)]
    with Cluster(3, env={**SHM, "RINGCORE_TRANSPORT": "tcp"}, timeout=60) as cluster:
        reports = cluster.results(tasks.allreduce_symmetric_on, inputs, [0, 2], timeout=60)
    for rank, report in enumerate(reports):
        assert report["error"] == "MismatchError", (rank, report)
        assert "memory" in report["message"] and "rank 1 passed ordinary memory" in report["message"]
        assert report["untouched"], f"rank {rank} changed its buffer before the ranks agreed"


@pytest.mark.timeout(120)
def test_ranks_that_allocate_different_sizes_are_told() -> None:
    with Cluster(3, env=SHM, timeout=60) as cluster:
        messages = cluster.results(tasks.empty_of_rank_sizes, [1000, 1000, 999])
    for message in messages:
        assert message.startswith("ValueError: ringcore.empty #1: the ranks asked for different sizes")
        assert "rank 2: 3996 bytes" in message
