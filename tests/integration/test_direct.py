"""The direct allreduce of ordinary buffers across real processes (``ringcore.plans.direct``).

Every rank on one host may copy to and from every other, so an allreduce of
``RINGCORE_DIRECT_BYTES`` (auto: 384 KiB at N=2, 1 MiB for more) or more goes
direct: the results are checked against numpy and against the ring
(``RINGCORE_DIRECT_BYTES=0``) on the same inputs; a smaller one takes the
mailboxes' one or two shots (``test_twoshot.py``). The vote sends
ranks whose memory does not allow it (a GPU buffer among host ones) to the
ring together; a rank that fails waits for the peers still writing into its
buffer, and names one that does not stop.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests import tasks
from tests.cluster import Background, Cluster, RankError
from tests.gpu import tasks as gpu_tasks
from tests.reference import check_allreduce


@pytest.fixture(scope="module", autouse=True)
def _copies_allowed() -> None:
    """Skip where ranks may not copy from each other (Yama's ptrace_scope, seccomp): no vote there."""
    with Cluster(2, timeout=60) as cluster:
        if not all(cluster.results(tasks.can_copy)):
            pytest.skip("ranks may not process_vm_readv/writev each other here (ptrace_scope, seccomp)")


KIB = 1024
MIB = 1024 * KIB
CASES = [  # (dtype, op, bytes): all but the last at or above RINGCORE_DIRECT_BYTES
    ("float32", "sum", MIB + 4),
    ("float64", "max", 2 * MIB + 8),
    ("int32", "sum", 4 * MIB),
    ("int64", "prod", MIB),
    ("float32", "avg", 3 * MIB + 12),
    ("float16", "min", MIB + 2),
    ("uint16", "max", MIB),
    ("float32", "sum", 256 * KIB),
]


def inputs_for(rng: np.random.Generator, size: int, dtype: str, op: str, nbytes: int) -> list[np.ndarray]:
    count = nbytes // np.dtype(dtype).itemsize
    low, high = (1, 3) if op == "prod" else (-50, 50)
    return [rng.integers(low, high, count).astype(dtype) for _ in range(size)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("size", [2, 3, 4])
def test_ordinary_buffers_go_direct_and_match_numpy_and_the_ring(size: int) -> None:
    rng = np.random.default_rng(size)
    cases = [(dtype, op, inputs_for(rng, size, dtype, op, nbytes)) for dtype, op, nbytes in CASES]
    with Cluster(size, env={"RINGCORE_DIRECT_BYTES": "0"}, timeout=120) as cluster:
        ring = [cluster.results(tasks.allreduce_routed, inputs, op, timeout=120) for _, op, inputs in cases]
    with Cluster(size, timeout=120) as cluster:
        for (dtype, op, inputs), by_ring in zip(cases, ring, strict=True):
            for kind in ("numpy", "array"):
                if kind == "array" and (op == "prod" or dtype == "float16"):
                    continue
                reports = cluster.results(tasks.allreduce_routed, inputs, op, kind, timeout=120)
                for rank, (report, ordinary) in enumerate(zip(reports, by_ring, strict=True)):
                    where = f"rank {rank} {kind} {dtype} {op} {inputs[0].nbytes} bytes:"
                    assert ordinary["direct"] == 0 and not ordinary["voted"], (
                        f"{where} RINGCORE_DIRECT_BYTES=0"
                    )
                    assert report["voted"], f"{where} no vote"
                    direct = inputs[0].nbytes >= MIB
                    assert report["direct"] == direct, f"{where} the direct route ran: {report['direct']}"
                    check_allreduce(report["result"], inputs, op, where=where)
                    np.testing.assert_allclose(report["result"], ordinary["result"], rtol=1e-6, err_msg=where)
                first = reports[0]["result"]
                for report in reports[1:]:  # each share is reduced once: every rank holds the same bits
                    assert first.tobytes() == report["result"].tobytes()


@pytest.mark.timeout(180)
def test_symmetric_and_ordinary_buffers_meet_on_the_direct_route() -> None:
    rng = np.random.default_rng(8)
    inputs = [rng.standard_normal(300_000).astype(np.float32) for _ in range(3)]  # 1.2 MB: a vote
    with Cluster(3, timeout=60) as cluster:
        reports = cluster.results(tasks.allreduce_symmetric_on, inputs, [0, 2], timeout=60)
        ring = cluster.results(tasks.allreduce, inputs, "sum")
    for rank, (report, result) in enumerate(zip(reports, ring, strict=True)):
        assert report["error"] == "no error", (rank, report)
        assert report["voted direct"] == 1, f"rank {rank}: the vote did not send it direct"
        check_allreduce(report["result"], inputs, "sum", where=f"rank {rank}, mixed memory")
        check_allreduce(result, inputs, "sum", where=f"rank {rank}, ordinary")
        assert report["result"].tobytes() == reports[0]["result"].tobytes(), "ranks disagree on the bits"


@pytest.mark.timeout(120)
def test_ranks_that_change_their_memory_at_calls_of_their_own_are_reached_where_it_now_lies() -> None:
    """The route keeps the peers a vote gave while every rank passes the memory of the last call:
    here rank 1 moves to its second array and back while the others stay, then rank 2 moves."""
    count = 300_000  # 1.2 MB: a vote
    switches = [[0, 0, 0, 0, 0], [0, 1, 1, 0, 0], [0, 0, 0, 0, 1]]
    with Cluster(3, timeout=60) as cluster:
        reports = cluster.results(tasks.allreduce_switching_buffers, count, switches, timeout=60)
    base = np.arange(count, dtype=np.float32)
    for rank, report in enumerate(reports):
        assert report["direct"] == len(switches[0]), f"rank {rank}: not every call went direct"
        for call, result in enumerate(report["results"]):
            want = sum(base * (peer + 1) + call for peer in range(3))
            np.testing.assert_array_equal(result, want, err_msg=f"rank {rank}, call {call}")


@pytest.mark.timeout(180)
def test_a_gpu_buffer_among_host_ones_sends_every_rank_to_the_ring() -> None:
    """The vote: a (fake) GPU buffer on rank 1 makes all three ranks run the ring, and they agree."""
    rng = np.random.default_rng(11)
    inputs = list((rng.standard_normal((3, 300_000)) * 3).astype(np.float32))  # 1.2 MB: a vote
    with Cluster(3, timeout=60) as cluster:
        cluster.results(gpu_tasks.use_fake, 2)
        results = cluster.results(gpu_tasks.mixed_ring, inputs, "sum", None, timeout=60)
        host = cluster.results(tasks.allreduce_routed, inputs, "sum", timeout=60)
    for rank, result in enumerate(results):
        check_allreduce(result.view(np.float32), inputs, "sum", where=f"rank {rank}, mixed")
        assert result.tobytes() == results[0].tobytes(), "ranks disagree on the bits"
    assert [report["direct"] for report in host] == [1, 1, 1], "all-host ranks went direct"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("memory", ["ordinary", "symmetric"])
@pytest.mark.parametrize(("fault", "error"), [("kill9", "PeerFailure"), ("stop", "CollectiveTimeout")])
def test_a_rank_that_dies_or_stops_mid_push_is_reported(fault: str, error: str, memory: str) -> None:
    """Every survivor names rank 1; a stopped writer is named in the note; nothing is left in /dev/shm."""
    before = set(os.listdir("/dev/shm"))
    env = {"RINGCORE_TIMEOUT": "4"}
    with Cluster(3, env=env, timeout=60) as cluster:
        args = (600_000, 1, fault, memory)
        doomed = Background(cluster, tasks.direct_then_fault, *args, ranks=[1], timeout=20)
        reports = cluster.run(tasks.direct_then_fault, *args, ranks=[0, 2], timeout=60)
        (victim,) = doomed.join(40)
        assert isinstance(victim, RankError), victim
    for rank, report in zip([0, 2], reports, strict=True):
        assert not isinstance(report, RankError), report
        assert report["error"] == error, (rank, report)
        assert "rank 1" in report["message"], report["message"]
        assert any("may hold partial sums" in note for note in report["notes"]), report["notes"]
        stuck = [
            note for note in report["notes"] if "had not finished writing into this rank's buffer" in note
        ]
        assert bool(stuck) == (fault == "stop"), report["notes"]  # a dead rank writes nothing more
        assert all(note.startswith("rank 1 ") for note in stuck), stuck
    assert set(os.listdir("/dev/shm")) <= before


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["write", "refuse"])
def test_no_rank_writes_into_a_buffer_whose_owner_returned(mode: str) -> None:
    """Rank 1 dies; rank 2 goes on only once rank 0 gave up (plans.direct, "Safety").

    ``write``: rank 2 writes a piece into rank 0 after that, and rank 0's error waits for it.
    ``refuse``: rank 2 had not pushed yet, finds that rank 0 gave up, and writes nothing.
    Either way rank 0's buffer no longer changes once its error is raised, and every error
    names rank 1, the cause.
    """
    with Cluster(3, env={"RINGCORE_TIMEOUT": "20"}, timeout=60) as cluster:
        doomed = Background(cluster, tasks.late_writer, 600_000, mode, ranks=[1], timeout=30)
        reports = cluster.run(tasks.late_writer, 600_000, mode, ranks=[0, 2], timeout=60)
        (victim,) = doomed.join(40)
        assert isinstance(victim, RankError), victim
    for rank, report in zip([0, 2], reports, strict=True):
        assert not isinstance(report, RankError), report
        assert report["error"] == "PeerFailure" and "rank 1" in report["message"], (rank, report)
        assert report["stable"], f"rank {rank}'s buffer changed after its error was raised"
        assert not any("had not finished" in note for note in report["notes"]), report["notes"]
    assert reports[1]["saw rank 0 give up"], "rank 2 went on before rank 0 gave up: nothing was tested"
