"""The hierarchical allreduce across real processes on emulated hosts: host names of their own.

Each rank takes a host name of its own in a new UTS namespace (root only;
skipped otherwise), so ranks with one name are a host: placement builds the
host grid from the names, and ``RINGCORE_TRANSPORT=auto`` connects ranks of
one host through shared memory and the hosts through TCP. Results against
numpy, every rank bit-identical, the flat ring agreeing on exact data, and a
killed rank named by the others.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import ringcore
from tests import tasks
from tests.cluster import Cluster, can_own_hostname, kill_mid_allreduce, qualified
from tests.reference import check_allreduce

pytestmark = pytest.mark.skipif(
    not can_own_hostname(), reason="emulated hosts need root (a UTS namespace per rank)"
)

KIB = 1024
HOSTS = ["host-a", "host-b", "host-a", "host-b"]  # interleaved, as a round-robin launcher deals ranks
GRID = ((0, 2), (1, 3))


def layout(comm: object) -> dict[str, object]:
    """What this rank knows of the hosts (a Cluster task)."""
    from ringcore.slicing import allreduce_schedule, gather_schedule

    transport = comm.transport  # type: ignore[attr-defined]

    schedule = allreduce_schedule(comm.ctx, 1 << 20, 4, in_place=True)  # type: ignore[attr-defined]
    chunks = tuple((i * 100_000, 100_000) for i in range(4))
    gathers = [gather_schedule(comm.ctx, kind, chunks, 4) for kind in ("allgather", "reduce_scatter")]  # type: ignore[attr-defined]
    comm.barrier()  # type: ignore[attr-defined]
    grid = comm.ctx.grid  # type: ignore[attr-defined]
    host = {rank: h for h, row in enumerate(grid) for rank in row}
    from ringcore.plans.barrier import bound_barrier

    barrier_peers = [step[1][0] for step in bound_barrier(comm.ctx).steps]  # type: ignore[attr-defined]
    return {
        "barrier": [host[peer] == host[comm.rank] for peer in barrier_peers],  # type: ignore[attr-defined]
        "grid": comm.ctx.grid,  # type: ignore[attr-defined]
        "transport": type(transport).__name__,
        "local": list(getattr(transport, "local", [])),
        "stages": sorted({step.label for step in schedule.steps}),
        "result": schedule.result.buf.name,  # in place (USER) unless RINGCORE_ATOMIC=1 (WORK)
        "gather stages": [sorted({step.label for step in g.steps}) for g in gathers],
    }


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_allreduce_matches_numpy_on_two_hosts_of_two(transport: str) -> None:
    rng = np.random.default_rng(7)
    env = {"RINGCORE_TRANSPORT": transport, "RINGCORE_TIMEOUT": "30"}
    with Cluster(4, env=env, timeout=120, hostnames=HOSTS) as cluster:
        stages = ["cross allgather", "cross reduce-scatter", "local allgather", "local reduce-scatter"]
        for rank, report in enumerate(cluster.results(layout)):
            assert report["grid"] == GRID and report["stages"] == stages and report["result"] == "USER"
            assert report["barrier"] == [True, False], "a round inside the host, then one across"
            assert report["gather stages"] == [stages[:1] + stages[2:3], stages[1:2] + stages[3:]]
            if transport == "auto":  # the other rank of its host only
                assert (report["transport"], report["local"]) == ("ShmTransport", [rank ^ 2])
        cases = [
            ("int32", "sum", 4 * KIB),  # below the small limit: recursive doubling
            ("int64", "max", 256 * KIB + 8),
            ("float32", "sum", 1024 * KIB),
            ("float64", "avg", 3 * 1024 * KIB + 24),
            ("int32", "sum", 9 * 1024 * KIB + 4),
        ]
        for dtype, op, nbytes in cases:
            count = nbytes // np.dtype(dtype).itemsize
            inputs = [rng.integers(-50, 50, count).astype(dtype) for _ in range(4)]
            results = cluster.results(tasks.allreduce, inputs, op, timeout=120)
            for rank, got in enumerate(results):
                check_allreduce(got, inputs, op, where=f"rank {rank} {dtype} {nbytes} bytes:")
                assert got.tobytes() == results[0].tobytes()
        noisy = [rng.standard_normal(300_001).astype(np.float32) for _ in range(4)]
        for compression in (None, "fp16"):
            results = cluster.results(tasks.allreduce, noisy, "sum", compression, timeout=120)
            for rank, got in enumerate(results):
                check_allreduce(got, noisy, "sum", compression, where=f"rank {rank} {compression}:")
                assert got.tobytes() == results[0].tobytes()


@pytest.mark.timeout(300)
def test_broadcast_allgather_reduce_scatter_on_two_hosts_of_two() -> None:
    """Host-by-host chain broadcast from every root, hierarchical allgather (uneven rows) and reduce_scatter."""
    rng = np.random.default_rng(5)
    with Cluster(4, env={"RINGCORE_TRANSPORT": "auto"}, timeout=120, hostnames=HOSTS) as cluster:
        inputs = [rng.standard_normal(500_003).astype(np.float32) for _ in range(4)]
        for root in range(4):
            for got in cluster.results(tasks.broadcast, inputs, root, timeout=120):
                np.testing.assert_array_equal(got, inputs[root])
        rows = [rng.integers(-9, 9, (40_000 + 1_000 * r, 3)).astype(np.int32) for r in range(4)]
        for got in cluster.results(tasks.allgather, rows, timeout=120):
            np.testing.assert_array_equal(got, np.concatenate(rows))
        ints = [rng.integers(0, 100, (4 * 50_000 + 3, 2)).astype(np.int64) for _ in range(4)]
        total = np.sum(ints, axis=0)
        for rank, got in enumerate(cluster.results(tasks.reduce_scatter, ints, "sum", timeout=120)):
            np.testing.assert_array_equal(got, np.array_split(total, 4)[rank])
        noisy = [rng.standard_normal((4 * 30_000, 5)).astype(np.float32) for _ in range(4)]
        results = cluster.results(tasks.reduce_scatter, noisy, "avg", "fp16", timeout=120)
        want = np.array_split(np.mean(noisy, axis=0), 4)
        for rank, got in enumerate(results):
            np.testing.assert_allclose(got, want[rank], atol=0.01)


@pytest.mark.timeout(300)
def test_the_flat_ring_and_the_atomic_form_agree_exactly() -> None:
    """RINGCORE_HIERARCHICAL=0, and RINGCORE_ATOMIC=1 (out of place), on the same hosts: the same integers."""
    rng = np.random.default_rng(3)
    inputs = [rng.integers(-1000, 1000, 700_001).astype(np.int64) for _ in range(4)]
    found = []
    for hierarchical, atomic in (("1", "0"), ("0", "0"), ("1", "1")):
        env = {"RINGCORE_TRANSPORT": "auto", "RINGCORE_HIERARCHICAL": hierarchical, "RINGCORE_ATOMIC": atomic}
        with Cluster(4, env=env, timeout=120, hostnames=HOSTS) as cluster:
            if hierarchical == "1":
                want = "WORK" if atomic == "1" else "USER"
                assert all(report["result"] == want for report in cluster.results(layout))
            found.append(cluster.results(tasks.allreduce, inputs, "sum", timeout=120))
    for results in zip(*found, strict=True):
        for got in results:
            np.testing.assert_array_equal(got, np.sum(inputs, axis=0))


@pytest.mark.timeout(240)
def test_hosts_that_disagree_fail_every_rank_and_say_what_reached_the_buffer() -> None:
    """host-a passes sum, host-b max: every rank fails with MismatchError. In place the local rounds
    sum into the caller's buffer before the other host's frames arrive, so a buffer that changed must
    carry the note naming its elements; the atomic form (out of place) leaves every buffer as it was."""
    ops = ["sum" if host == "host-a" else "max" for host in HOSTS]
    count = 1 << 18  # 1 MiB of float32: above the small limit, the hierarchical allreduce
    for atomic in ("0", "1"):
        env = {"RINGCORE_TRANSPORT": "auto", "RINGCORE_TIMEOUT": "20", "RINGCORE_ATOMIC": atomic}
        with Cluster(4, env=env, timeout=60, hostnames=HOSTS) as cluster:
            reports = cluster.results(tasks.op_by_rank, count, ops)
        # the first cross-host frames leave after their senders' local rounds wrote their buffers
        assert atomic == "1" or not all(report["untouched"] for report in reports), reports
        for rank, report in enumerate(reports):
            assert report["error"] == "MismatchError", (atomic, rank, report)
            if atomic == "1":
                assert report["untouched"], (rank, report)
            elif not report["untouched"]:
                assert f"elements [0, {count}) of {count} may hold partial sums" in report["notes"], (
                    rank,
                    report,
                )


@pytest.mark.timeout(240)
def test_a_killed_rank_is_named_by_every_other_rank(tmp_path: Path) -> None:
    """kill -9 of a rank halfway through its sends: its host's peer and both ranks of the other host name it."""
    victim = 3
    env = {"RINGCORE_TRANSPORT": "auto", "RINGCORE_TIMEOUT": "20"}
    with Cluster(4, env=env, timeout=120, hostnames=HOSTS) as cluster:
        survivors, reports, _ = kill_mid_allreduce(cluster, victim, tmp_path / "killed_at", 2_000_000)
        for rank, report in zip(survivors, reports, strict=True):
            assert report["error"] == qualified(ringcore.PeerFailure), (rank, report)
            assert report["peer"] == victim and f"rank {victim}" in report["message"], (rank, report)
