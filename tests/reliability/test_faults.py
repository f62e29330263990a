"""Fault injection: kill -9, SIGSTOP and cut connections at each phase, N = 2..5.

Faults are injected from inside the victim's own process, by the task (no
hooks in ringcore): a wrapper around ``Executor._combine`` (which runs once per
received segment) fires at the 3rd segment received in a step labelled
``scatter-reduce`` or ``allgather``; ``idle`` faults fire between two
collectives while the other ranks wait. The victim stamps the wall-clock time
of the fault to a file first, so the test measures each survivor's detection
time. ``rendezvous`` faults kill a rank inside ``ringcore.init``.

What every survivor must see:

* ``kill9`` / ``cut_all`` (the rank died, or lost its network): a
  ``PeerFailure`` whose ``peer`` is the victim, promptly.
* ``cut_one`` (only the victim's link to its right neighbour is cut; both
  processes live): blame is ambiguous (each end sees the other vanish, and
  ABORTs relayed by third ranks carry whichever end was reported first), so
  every rank, the two ends included, gets a ``PeerFailure`` naming one of the
  two ends of the link.
* ``sigstop``: a stopped process is not dead (its kernel still acknowledges
  data), so nothing tells the others it failed; the rank waiting on it sees no
  progress for ``RINGCORE_TIMEOUT`` and raises ``CollectiveTimeout``, and its
  ABORT (kind "timeout") makes everyone else raise ``CollectiveTimeout`` too;
  which rank gives up first, and so which rank the messages name, depends on
  timing. TCP keepalive does not fire either: the stopped rank's kernel answers.

In every case: the failed collective left the caller's buffer untouched
outside the elements its error's note says may hold partial sums (none where
the scenario runs with RINGCORE_ATOMIC=1: odd N), a collective that succeeded before the failure was noticed holds the right
result (for example with N=2 a fault in the allgather phase can come after the
survivor already has all its data), the next collective raises
``CommunicatorClosed``, and nothing hangs. The worst detection time is printed
(``pytest -s``) and recorded in ``DETECTION``.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

import ringcore
from ringcore.errors import AuthenticationError
from tests import tasks
from tests.cluster import Background, Cluster, RankError, collect, free_port, qualified
from tests.conftest import RING_ONLY

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 2.0  # RINGCORE_TIMEOUT in every fault scenario
INIT_TIMEOUT = 3.0  # RINGCORE_INIT_TIMEOUT in the rendezvous scenarios
SLACK = 5.0  # detection must happen within the engine's timeout plus this
COUNT = 1_000_000  # float32 elements: the ring path with many 64 KiB segments per step
# One slice, and the ring at every N (not halving-doubling, whose whole steps have no 3rd
# segment, nor the direct route, which has no phases): each scenario strikes one ring at a
# chosen phase (slicing and the direct route have their own tests).
ENV = {
    **RING_ONLY,
    "RINGCORE_TIMEOUT": str(TIMEOUT),
    "RINGCORE_SEGMENT_BYTES": "64K",
    "RINGCORE_SLICE_BYTES": "48M",
    "RINGCORE_HALVING_BYTES": "0",
}

DETECTION: dict[str, float] = {}  # scenario -> worst detection time over its survivors


PEER_FAILURE = qualified(ringcore.PeerFailure)
TIMED_OUT = qualified(ringcore.CollectiveTimeout)
CLOSED = qualified(ringcore.CommunicatorClosed)


def read_stamp(path: Path) -> float:
    deadline = time.monotonic() + 10
    while not path.exists():
        assert time.monotonic() < deadline, f"the victim never injected its fault ({path})"
        time.sleep(0.01)
    return float(path.read_text())


def record(scenario: str, delays: list[float]) -> None:
    DETECTION[scenario] = max(delays)
    print(f"\n[fault] {scenario}: detected in {max(delays):.3f} s (worst survivor)")


@pytest.fixture(scope="module", autouse=True)
def summary() -> Any:
    yield
    if DETECTION:
        worst = max(DETECTION, key=DETECTION.__getitem__)
        print(
            f"\n[fault] {len(DETECTION)} fault scenarios; worst detection {DETECTION[worst]:.3f} s ({worst})"
        )


# ---------------------------------------------------------------------------- in a collective or idle

KINDS = ["kill9", "sigstop", "cut_all", "cut_one"]
PHASES = ["scatter-reduce", "allgather", "idle"]
SCENARIOS = [
    (kind, phase, size)
    for kind in KINDS
    for phase in PHASES
    for size in (2, 3, 4, 5)
    if not (kind == "cut_one" and phase == "idle" and size in (2, 4))  # cut_one idle: N=3, 5 suffice
]


def victim_of(kind: str, size: int) -> int:
    """Spread the victims: rank 0 (which hosts the rendezvous store) too."""
    return (size + KINDS.index(kind)) % size


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("kind", "phase", "size"), SCENARIOS)
def test_fault(kind: str, phase: str, size: int, tmp_path: Path) -> None:
    victim = victim_of(kind, size)
    survivors = [r for r in range(size) if r != victim]
    stamp = tmp_path / "fault_at"
    bound = TIMEOUT + SLACK
    args = (COUNT, victim, kind, phase, str(stamp))
    atomic = size % 2 == 1  # both failure modes see every kind of fault in every phase
    with Cluster(size, env={**ENV, "RINGCORE_ATOMIC": str(int(atomic))}) as cluster:
        try:
            doomed = Background(cluster, tasks.fault_rounds, *args, ranks=[victim], timeout=bound + 30)
            working = Background(cluster, tasks.fault_rounds, *args, ranks=survivors, timeout=bound + 30)
            reports = working.join(bound + 30)
            fault_at = read_stamp(stamp)
            if kind == "sigstop":
                cluster.kill(victim, signal.SIGCONT)
            (victim_report,) = doomed.join(bound + 30)
        finally:
            if kind == "sigstop":
                cluster.kill(victim, signal.SIGCONT)
    delays = []
    for rank, report in zip(survivors, reports, strict=True):
        assert not isinstance(report, RankError), (rank, report)
        assert report["error"] != "no error", f"rank {rank} never noticed the fault: {report}"
        assert report["rounds"] <= 1 and report["results_ok"], (rank, report)
        assert report["untouched"], f"rank {rank}: the failed allreduce wrote outside its note's range"
        assert not (atomic and report["exposed"]), f"rank {rank}: RINGCORE_ATOMIC=1 left partial sums"
        assert report["retry"] == CLOSED, (rank, report)
        assert "ringcore.init() again" in report["retry_message"], (rank, report)
        if kind == "sigstop":
            # Timers fire on each rank's own poll cycle (0.5 s), so a rank downstream of
            # the victim may give up first and blame the (live) rank it waits on.
            assert report["error"] == TIMED_OUT, (rank, report)
            assert f"no progress for {TIMEOUT:g} s" in report["message"], (rank, report)
        elif kind == "cut_one":
            assert report["error"] == PEER_FAILURE, (rank, report)
            assert report["peer"] in {victim, (victim + 1) % size}, (rank, report)
        else:
            assert report["error"] == PEER_FAILURE, (rank, report)
            assert report["peer"] == victim, (rank, report)
            assert f"rank {victim}" in report["message"], (rank, report)
        delays.append(report["failed_at"] - fault_at)
    assert max(delays) < bound, f"detection took {max(delays):.2f} s (bound {bound} s): {reports}"
    record(f"{kind}/{phase}/N={size}/victim={victim}", delays)
    if kind == "kill9":
        assert isinstance(victim_report, RankError) and victim_report.type_name == "dead", victim_report
    else:
        # The victim lives on; its own collective must fail too, cleanly, with its buffer intact.
        assert not isinstance(victim_report, RankError), victim_report
        assert victim_report["untouched"] and victim_report["retry"] == CLOSED, victim_report
        assert not (atomic and victim_report["exposed"]), victim_report
        wanted = TIMED_OUT if kind == "sigstop" else PEER_FAILURE
        assert victim_report["error"] == wanted, victim_report
        if kind == "cut_one":
            assert victim_report["peer"] in {victim, (victim + 1) % size}, victim_report


# ---------------------------------------------------------------------------- rendezvous

RENDEZVOUS = [
    ("absent", 3, 2),
    ("after_join", 4, 1),
    ("after_join", 2, 0),  # rank 0 hosts the store: the others lose it
    ("before_mesh", 3, 1),
    ("mid_handshake", 5, 3),
]


def run_init_fault(
    fault: str, size: int, victim: int, stamp: Path, delays: dict[int, float]
) -> dict[int, dict[str, Any]]:
    """Start ``size`` plain processes that ``ringcore.init``; the victim fails as ``fault`` says."""
    port = free_port()
    env = {
        "RINGCORE_INIT_TIMEOUT": str(INIT_TIMEOUT),
        "RINGCORE_TIMEOUT": str(TIMEOUT),
        "RINGCORE_SECRET": f"rdv-{port}",
    }
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=tasks.init_with_fault,
            args=(r, size, port, env, victim, fault, str(stamp), results, delays.get(r, 0.0)),
        )
        for r in range(size)
    ]
    return collect(procs, results, size - 1, INIT_TIMEOUT + 40)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("fault", "size", "victim"), RENDEZVOUS)
def test_fault_during_rendezvous(fault: str, size: int, victim: int, tmp_path: Path) -> None:
    """The others fail ``init`` with a ringcore error naming the victim within RINGCORE_INIT_TIMEOUT.

    A rank may instead be told that the store at rank 0 went away when rank 0
    gave up first and closed it; that cascade depends on timing and has a
    test of its own (``test_store_host_giving_up_first_hides_the_culprit``).
    """
    stamp = tmp_path / "fault_at"
    reports = run_init_fault(fault, size, victim, stamp, {})
    fault_at = read_stamp(stamp)
    bound = INIT_TIMEOUT + SLACK
    survivors = [r for r in range(size) if r != victim]
    delays = []
    for rank in survivors:
        report = reports[rank]
        assert report["error"] != "no error", (rank, report)
        assert report["is_ringcore_error"], f"rank {rank}: not a RingcoreError: {report}"
        delays.append(report["failed_at"] - max(fault_at, report["started"]))
    assert max(delays) < bound, f"init failed only after {max(delays):.2f} s (bound {bound} s): {reports}"
    record(f"rendezvous/{fault}/N={size}/victim={victim}", delays)
    unnamed = {
        r: reports[r]["message"]
        for r in survivors
        if f"rank {victim}" not in reports[r]["message"]
        and "lost the rendezvous store" not in reports[r]["message"]
    }
    assert not unnamed, f"these ranks' errors do not name the failed rank {victim}: {unnamed}"


@pytest.mark.timeout(60)
def test_store_host_giving_up_first_hides_the_culprit(tmp_path: Path) -> None:
    """Rank 1 never starts; rank 2 starts 2 s after rank 0, so rank 0 gives up 2 s before it.

    Rank 0's failed init closes the store it hosts, and rank 2, still waiting
    for rank 1, should be told that rank 1 is missing, not only that the
    store at rank 0 went away (which blames the wrong rank).
    """
    stamp = tmp_path / "fault_at"
    reports = run_init_fault("absent", 3, 1, stamp, {2: 2.0})
    assert all(report["is_ringcore_error"] for report in reports.values()), reports
    assert "rank 1" in reports[0]["message"], reports[0]
    # the default transport (auto) waits for rank 1 first in the RDMA exchange: still a missing rank
    assert "rank 1 did not join the rendezvous" in reports[0]["message"], reports[0]
    assert "rank 1" in reports[2]["message"], f"rank 2 is not told that rank 1 is missing: {reports[2]}"


@pytest.mark.timeout(60)
def test_peer_dying_in_the_mesh_handshake(tmp_path: Path) -> None:
    """Rank 1 dies while rank 2's connection waits in its listener's backlog.

    Rank 2's handshake then reads a reset (or EOF): that is a dead peer, so it
    must surface as a ringcore error that names rank 1, and not as an
    authentication failure (which tells the user to check the secret).
    """
    stamp = tmp_path / "fault_at"
    reports = run_init_fault("before_mesh_late", 3, 1, stamp, {})
    report = reports[2]
    assert report["is_ringcore_error"], f"rank 2 got a raw {report['error']}: {report.get('trace')}"
    assert report["error"] != qualified(AuthenticationError), report
    assert "rank 1" in report["message"], report


# ---------------------------------------------------------------------------- the launcher

LAUNCHED_RANK = """\
import os, signal, sys, time
import numpy as np
import ringcore
from ringcore.errors import AuthenticationError
from tests import tasks

comm = ringcore.init()
stamp = sys.argv[1]
if comm.rank == 1:
    tasks._hook_phase(comm, "kill9", "scatter-reduce", 3, stamp)
buf = np.ones(1_000_000, np.float32)
try:
    for _ in range(100):
        comm.allreduce(buf)
except ringcore.PeerFailure as err:
    print("survivor saw", type(err).__name__, err.peer, flush=True)
time.sleep(60)  # a rank that hangs after the failure: the launcher must stop it
"""


@pytest.mark.timeout(60)
def test_launcher_stops_the_job_when_a_rank_is_killed(tmp_path: Path) -> None:
    """ringcore-run: a rank SIGKILLed mid-allreduce -> the rest are stopped within 5 s, exit 137."""
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(LAUNCHED_RANK))
    stamp = tmp_path / "fault_at"
    command = [sys.executable, "-m", "ringcore.run", "-np", "3", sys.executable, str(script), str(stamp)]
    env = {
        "RINGCORE_TIMEOUT": str(TIMEOUT),
        "RINGCORE_SEGMENT_BYTES": "64K",
        "PYTHONPATH": str(REPO),
        **RING_ONLY,
    }
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=45, env={**os.environ, **env}, check=False
    )
    ended = time.time()
    fault_at = read_stamp(stamp)
    assert done.returncode == 137, (done.returncode, done.stdout, done.stderr)
    assert "rank 1 was killed by signal SIGKILL (9)" in done.stderr, done.stderr
    assert ended - fault_at < 5.0, f"the launcher took {ended - fault_at:.2f} s to end the job"
    record("launcher/kill9/N=3/victim=1", [ended - fault_at])
