"""What every rank sees when the job goes wrong: disagreeing ranks, dead and stopped peers.

Each scenario gets a fresh cluster, because a failed collective breaks the
communicator for good (later calls raise ``CommunicatorClosed``). Ranks that
will fail are driven from background threads, one per group of ranks, so the
test can collect the survivors' answers without waiting on the victim. The
victim kills or stops itself from inside the collective (at a send it posts,
``tasks.SendTrigger``), after a round that every rank completed, and stamps
the time first; no sleep in the test has to guess when the others are busy.
Time bounds only cap how long failure detection may take; they are generous.
"""

from __future__ import annotations

import multiprocessing
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ringcore
from tests import tasks
from tests.cluster import (
    Background,
    Cluster,
    RankError,
    collect,
    free_port,
    kill_mid_allreduce,
    qualified,
    read_stamp,
)
from tests.conftest import RING_ONLY

DETECTION_BOUND = 30.0  # seconds from the kill to every survivor's error
BIG = 2_000_000  # float32 elements (8 MB): many segments per step on the ring; direct where allowed


def others(size: int, victim: int) -> list[int]:
    return [r for r in range(size) if r != victim]


# ---------------------------------------------------------------------------- mismatch


Call = tuple[str, tuple, dict]  # (Communicator method, args, kwargs)


def _arange(n: int, dtype: Any = np.float32) -> np.ndarray:
    return np.arange(n, dtype=dtype)


def _same(call: Call, size: int = 3) -> list[Call]:
    return [call] * size


# case -> (per-rank calls, words the message must contain on every rank, per-rank delays before the call)
MISMATCHES: dict[str, tuple[list[Call], list[str], list[float] | None]] = {
    "count": (
        [*_same(("allreduce", (_arange(1000),), {}), 2), ("allreduce", (_arange(1024),), {})],
        ["shape", "ranks 0-1 passed (1000,)", "rank 2 passed (1024,)"],
        None,
    ),
    "count_ring_path": (
        [*_same(("allreduce", (_arange(100_000),), {}), 2), ("allreduce", (_arange(100_001),), {})],
        ["shape", "ranks 0-1 passed (100000,)", "rank 2 passed (100001,)"],
        None,
    ),
    "dtype": (
        [
            ("allreduce", (_arange(100),), {}),
            ("allreduce", (_arange(100, np.float64),), {}),
            ("allreduce", (_arange(100),), {}),
        ],
        ["dtype", "ranks 0, 2 passed float32", "rank 1 passed float64"],
        None,
    ),
    "op": (
        [("allreduce", (_arange(100),), {"op": "max"}), *_same(("allreduce", (_arange(100),), {}), 2)],
        ["op", "rank 0 passed max", "ranks 1-2 passed sum"],
        None,
    ),
    "compression": (
        [
            *_same(("allreduce", (_arange(100),), {}), 2),
            ("allreduce", (_arange(100),), {"compression": "fp16"}),
        ],
        ["compression", "ranks 0-1 passed none", "rank 2 passed fp16"],
        None,
    ),
    # 400-byte broadcasts go one shot: the posts' signatures differ. Rank 1 (root for ranks 1-2) arrives last.
    "broadcast_root": (
        [("broadcast", (_arange(100),), {"root": 0}), *_same(("broadcast", (_arange(100),), {"root": 1}), 2)],
        ["root", "rank 0 passed 0", "ranks 1-2 passed 1"],
        [0.0, 0.5, 0.0],
    ),
    # Rank 0 (the odd one out) arrives last: ranks 1-2 have posted alike and wait for its post.
    "broadcast_root_late_odd_rank": (
        [("broadcast", (_arange(100),), {"root": 0}), *_same(("broadcast", (_arange(100),), {"root": 1}), 2)],
        ["root", "rank 0 passed 0", "ranks 1-2 passed 1"],
        [0.5, 0.0, 0.0],
    ),
    # 400 KB broadcasts go down the chain (past a mailbox's slot): the chain's own root check.
    "broadcast_root_chain": (
        [
            ("broadcast", (_arange(100_000),), {"root": 0}),
            *_same(("broadcast", (_arange(100_000),), {"root": 1}), 2),
        ],
        ["root", "rank 0 passed 0", "ranks 1-2 passed 1"],
        [0.0, 0.5, 0.0],
    ),
    # Rank 0's 400 KB go down the chain, ranks 1-2's 400 bytes in one shot through the mailboxes.
    "broadcast_route": (
        [
            ("broadcast", (_arange(100_000),), {"root": 0}),
            *_same(("broadcast", (_arange(100),), {"root": 0}), 2),
        ],
        ["shape", "rank 0 passed (100000,)", "ranks 1-2 passed (100,)"],
        None,
    ),
    "allgather_rows": (
        [*_same(("allgather", (_arange(100).reshape(10, 10),), {}), 2), ("allgather", (_arange(100),), {})],
        ["shape", "rank 2 passed ()"],
        None,
    ),
    "collective": (
        [*_same(("allreduce", (_arange(100),), {}), 2), ("barrier", (), {})],
        ["the collective", "ranks 0-1 passed allreduce", "rank 2 passed barrier"],
        None,
    ),
}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("case", list(MISMATCHES))
def test_mismatch_fails_every_rank_and_names_the_culprit(case: str) -> None:
    calls, words, delays = MISMATCHES[case]
    with Cluster(3, env={"RINGCORE_TIMEOUT": "10"}) as cluster:
        reports = cluster.run(tasks.mismatch_then_retry, calls, delays, timeout=60)
    assert not any(isinstance(report, RankError) for report in reports), reports
    errors = [report["error"] for report in reports]
    assert errors == [qualified(ringcore.MismatchError)] * 3, f"errors by rank: {errors}"
    for rank, report in enumerate(reports):
        for word in words:
            assert word in report["message"], f"rank {rank}: {word!r} not in {report['message']!r}"
        assert report["untouched"], f"rank {rank}: the failed collective wrote into the caller's buffer"
        assert report["retry"] == qualified(ringcore.CommunicatorClosed), (rank, report)


@pytest.mark.timeout(90)
def test_failed_allreduce_leaves_buffer_untouched() -> None:
    """Ranks 0 and 2 agree and exchange data before rank 1's different count stops them."""
    rng = np.random.default_rng(7)
    inputs = [rng.standard_normal(n).astype(np.float32) for n in (300_000, 300_001, 300_000)]
    with Cluster(3, env={"RINGCORE_TIMEOUT": "10"}) as cluster:
        results = cluster.run(tasks.check_then_allreduce, inputs, timeout=60)
    assert results == [("MismatchError", True)] * 3, results


# ---------------------------------------------------------------------------- dead peers


@pytest.mark.timeout(120)
@pytest.mark.parametrize("route", ["ring", "default"])
@pytest.mark.parametrize(("size", "victim"), [(3, 1), (4, 0), (5, 4)])
def test_sigkill_mid_allreduce_fails_every_survivor(
    size: int, victim: int, route: str, tmp_path: Path
) -> None:
    """Rank 0 hosts the rendezvous store, so killing it is a case of its own.

    ``default`` goes direct on one host where ranks may copy from each other: the victim dies
    in the vote, the route's first synchronisation (it sends nothing else).
    """
    env = {"RINGCORE_TIMEOUT": "20", **(RING_ONLY if route == "ring" else {})}
    with Cluster(size, env=env) as cluster:
        survivors, reports, killed_at = kill_mid_allreduce(
            cluster, victim, tmp_path / "killed_at", BIG, join_timeout=DETECTION_BOUND + 30
        )
        for rank, report in zip(survivors, reports, strict=True):
            assert not isinstance(report, RankError), (rank, report)
            assert report["error"] == qualified(ringcore.PeerFailure), (rank, report)
            assert report["rounds"] >= 1, (rank, report)  # round 0 succeeded: the kill came inside round 1
            assert report["peer"] == victim, (rank, report)
            assert f"rank {victim}" in report["message"], (rank, report)
            assert report["untouched"], f"rank {rank}: the failed allreduce wrote outside its note's range"
            assert report["failed_at"] - killed_at < DETECTION_BOUND, (rank, report)
        after = cluster.run(
            tasks.allreduce, [np.ones(8, np.float32)] * size, "sum", ranks=survivors, timeout=30
        )
        assert [e.type_name for e in after] == ["CommunicatorClosed"] * len(survivors), after


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("size", "victim", "kind"),
    [
        (3, 2, "barrier"),
        (4, 0, "barrier"),
        (3, 0, "broadcast"),
        (3, 1, "allgather"),
        (4, 3, "reduce_scatter"),
    ],
)
def test_rank_exiting_during_barrier_fails_the_others(size: int, victim: int, kind: str) -> None:
    """The victim exits from inside the barrier (or a one-shot broadcast, allgather or reduce_scatter:
    one host, 4 KiB), at its first send or post."""
    with Cluster(size, env={"RINGCORE_TIMEOUT": "20"}) as cluster:
        started = time.monotonic()
        outcomes = cluster.run(tasks.exit_or_barrier, victim, kind, timeout=DETECTION_BOUND + 30)
        elapsed = time.monotonic() - started
    assert isinstance(outcomes[victim], RankError) and outcomes[victim].type_name == "dead", outcomes[victim]
    for rank in others(size, victim):
        error = outcomes[rank]
        assert isinstance(error, RankError) and type(error.exception) is ringcore.PeerFailure, (rank, error)
        assert error.exception.peer == victim, (rank, error)
        assert f"rank {victim}" in error.message and kind in error.message, (rank, error)
    assert elapsed < DETECTION_BOUND, f"the {kind} failed only after {elapsed:.1f} s"


@pytest.mark.timeout(90)
def test_rank_dead_before_the_collective() -> None:
    """A rank killed between collectives: the next collective fails on the others, naming it."""
    with Cluster(3, env={"RINGCORE_TIMEOUT": "20"}) as cluster:
        cluster.results(tasks.barrier)
        cluster.kill(1)
        reports = cluster.run(
            tasks.allreduce_until_failure, 1000, 3, ranks=[0, 2], timeout=DETECTION_BOUND + 30
        )
    for rank, report in zip([0, 2], reports, strict=True):
        assert report["error"] == qualified(ringcore.PeerFailure), (rank, report)
        assert report["peer"] == 1 and "rank 1" in report["message"], (rank, report)
        assert report["rounds"] == 0 and report["untouched"], (rank, report)


@pytest.mark.timeout(120)
def test_stopped_rank_times_out(tmp_path: Path) -> None:
    """Rank 1 stops itself (SIGSTOP) inside an allreduce, with RINGCORE_TIMEOUT=3.

    What the engine does: rank 2, which receives from rank 1, sees no progress
    for 3 s and raises CollectiveTimeout; its ABORT (kind "timeout") reaches
    rank 0, which raises CollectiveTimeout too ("rank 2 gave up: ..."), so
    every survivor gets CollectiveTimeout, not PeerFailure. Rank 2's message
    names rank 1; rank 0's names rank 1, or rank 2 when its own timer fired
    first (it was waiting on rank 2, which waited on rank 1). Once resumed, rank 1 finds the
    aborts, its own stalled clock or a reset connection, and raises
    CollectiveTimeout or PeerFailure instead of hanging.
    """
    victim, survivors = 1, [0, 2]
    fault = (victim, "sigstop", str(tmp_path / "stopped_at"), 0.5)
    with Cluster(3, env={"RINGCORE_TIMEOUT": "3", **RING_ONLY}) as cluster:  # the ring's receives
        try:
            stopped = Background(
                cluster, tasks.allreduce_until_failure, BIG, 3, fault, ranks=[victim], timeout=90
            )
            working = Background(
                cluster, tasks.allreduce_until_failure, BIG, 3, fault, ranks=survivors, timeout=90
            )
            reports = working.join(DETECTION_BOUND + 30)
            stopped_at = read_stamp(fault[2])
            for rank, report in zip(survivors, reports, strict=True):
                assert not isinstance(report, RankError), (rank, report)
                assert report["error"] == qualified(ringcore.CollectiveTimeout), (rank, report)
                assert report["rounds"] >= 1, (rank, report)
                assert "no progress for 3 s" in report["message"], (rank, report)
                assert report["untouched"], (rank, report)
                assert report["failed_at"] - stopped_at < DETECTION_BOUND, (rank, report)
            # Rank 2 waits on rank 1 itself. Rank 0 waits on rank 2: it names rank 1 when rank 2's
            # ABORT reaches it first, or, when its own timer fires first (they expire within a
            # poll interval of each other), rank 2, whose own message then names rank 1.
            by_rank = dict(zip(survivors, reports, strict=True))
            assert "rank 1" in by_rank[2]["message"], by_rank[2]
            assert "rank 1" in by_rank[0]["message"] or "from rank 2" in by_rank[0]["message"], by_rank[0]
            cluster.kill(victim, signal.SIGCONT)
            (resumed,) = stopped.join(DETECTION_BOUND + 30)
            assert not isinstance(resumed, RankError), resumed
            # The resumed rank's own error depends on what it reads first: the aborts, its stalled
            # clock, or a connection a survivor's kernel reset meanwhile (TCP_USER_TIMEOUT on bytes
            # it could not deliver to a stopped process). Either way: a clear error, no hang.
            assert resumed["error"] in (
                qualified(ringcore.CollectiveTimeout),
                qualified(ringcore.PeerFailure),
            ), resumed
            assert resumed["untouched"], resumed
        finally:
            cluster.kill(victim, signal.SIGCONT)


# ---------------------------------------------------------------------------- init / shutdown


@pytest.mark.timeout(120)
def test_repeated_init_and_shutdown_in_one_process() -> None:
    """Two plain processes each init, allreduce and shut down three times on fresh ports."""
    size, cycles = 2, 3
    ports = [free_port() for _ in range(cycles)]
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=tasks.init_shutdown_cycles, args=(r, size, ports, results)) for r in range(size)
    ]
    reports = collect(procs, results, len(procs), 90)
    assert [proc.exitcode for proc in procs] == [0] * size
    for rank in range(size):
        report = reports[rank]
        assert "error" not in report, report
        assert report["reinit"] == "RingcoreError", report
        assert report["initialized_after_shutdown"] is False
        assert report["threads"] == [report["baseline"]] * cycles, f"threads leaked: {report}"
        for cycle, (summed, low, high, world) in enumerate(report["sums"]):
            expected = sum(r + 1 + 10 * cycle for r in range(size))
            assert summed == [float(expected)] * (1000 + cycle), (rank, cycle)
            assert low == high == float(size - 1 + cycle), (rank, cycle)
            assert world == size
