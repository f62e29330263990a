"""Lifecycle: no leaks across init/shutdown, re-init after a failure, clean exit, timeline, stall inspector.

Leak checks run in fresh ``spawn`` processes (outside ``Cluster``), which
compare their open file descriptors (``/proc/self/fd``) and live threads
before the first ``init`` and after every ``shutdown``. The timeline test
loads every rank's Chrome trace and checks how its events nest. The stall
tests run real jobs under ``python -m ringcore.run`` so they can read rank
0's stderr, where the inspector logs.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests import tasks
from tests.cluster import Cluster, collect, free_port
from tests.conftest import RING_ONLY

REPO = Path(__file__).resolve().parents[2]
CYCLES = 5


def spawn_ranks(target: Any, args_of: Any, ranks: list[int], reports: int, timeout: float) -> dict[int, Any]:
    """Run ``target(*args_of(rank), results)`` in a fresh process per rank; collect ``reports`` answers."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args_of(r), results)) for r in ranks]
    return collect(procs, results, reports, timeout)


def assert_same_resources(before: Any, after: Any, where: str) -> None:
    fds, threads = before
    fds_now, threads_now = after
    assert len(fds_now) == len(fds), (
        f"{where}: fds {len(fds)} -> {len(fds_now)}: {sorted(set(fds_now) - set(fds))}"
    )
    assert threads_now == threads, f"{where}: threads {threads} -> {threads_now}"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("timeline", [False, True], ids=["plain", "timeline"])
def test_init_shutdown_cycles_leak_nothing(timeline: bool, tmp_path: Path) -> None:
    """5 cycles of init / allreduce / shutdown in one process: fds and threads back to the baseline."""
    ports = [free_port() for _ in range(CYCLES)]
    env = {"RINGCORE_TIMEOUT": "20", "RINGCORE_INIT_TIMEOUT": "20", "RINGCORE_SECRET": "cycles"}
    if timeline:
        env["RINGCORE_TIMELINE"] = str(tmp_path / "trace.json")
    reports = spawn_ranks(tasks.lifecycle_cycles, lambda r: (r, 2, ports, env), [0, 1], 2, 80)
    for rank, report in reports.items():
        assert "error" not in report, report
        assert report["sums"] == [(1.0 + 2 * c, 2.0, 3.0) for c in range(CYCLES)], report["sums"]
        for cycle, after in enumerate(report["after"]):
            assert_same_resources(report["before"], after, f"rank {rank} after cycle {cycle}")
    if timeline:
        for rank in (0, 1):
            events = json.loads((tmp_path / f"trace.rank{rank}.json").read_text())
            assert sum(e.get("cat") == "collective" for e in events) == 3  # the last cycle's file


@pytest.mark.timeout(90)
def test_reinit_after_a_peer_was_killed(tmp_path: Path) -> None:
    """Rank 2 dies mid-allreduce; ranks 0 and 1 get PeerFailure, the communicator refuses more work,
    and after shutdown they leak nothing and can init again (new port, world of 2)."""
    ports = [free_port(), free_port()]
    env = {
        "RINGCORE_TIMEOUT": "10",
        "RINGCORE_INIT_TIMEOUT": "20",
        "RINGCORE_SEGMENT_BYTES": "64K",
        "RINGCORE_SECRET": "reinit",
        **RING_ONLY,  # the fault strikes the ring's scatter-reduce
    }
    stamp = str(tmp_path / "fault_at")
    reports = spawn_ranks(tasks.reinit_after_failure, lambda r: (r, ports, env, stamp), [0, 1, 2], 2, 80)
    for rank in (0, 1):
        report = reports[rank]
        assert "crash" not in report, report
        assert (report["error"], report["peer"]) == ("PeerFailure", 2), report
        assert report["broken"] == "CommunicatorClosed", report
        assert report["second"] == (3.0, 3.0, 2), report
        assert_same_resources(report["before"], report["after_failure"], f"rank {rank} after the failed job")
        assert_same_resources(report["before"], report["after_second"], f"rank {rank} after the second job")


EXIT_WITHOUT_SHUTDOWN = """\
import atexit, os, threading
import numpy as np

def link(fd):
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # the descriptor listdir itself used
        return ""

def check():  # registered before ringcore's own atexit hook, so it runs after it
    threads = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())
    sockets = [fd for fd in os.listdir("/proc/self/fd") if link(fd).startswith("socket:")]
    print("at exit: threads", threads, "sockets", len(sockets), flush=True)

atexit.register(check)
import ringcore
ringcore.init()
ringcore.allreduce(np.ones(100_000, np.float32))
ringcore.allreduce_async(np.ones(10, np.float32)).wait(30)
print("returning without shutdown", flush=True)
"""


@pytest.mark.timeout(60)
def test_interpreter_exit_without_shutdown_closes_everything(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(EXIT_WITHOUT_SHUTDOWN)
    done = subprocess.run(
        [sys.executable, "-m", "ringcore.run", "-np", "3", "--timeout", "40", sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
        env={**os.environ, "RINGCORE_TIMEOUT": "10"},
    )
    assert done.returncode == 0, (done.stdout, done.stderr)
    for rank in range(3):
        assert f"[{rank}]<stdout>: at exit: threads [] sockets 0" in done.stdout, done.stdout


# ---------------------------------------------------------------------------- timeline


@pytest.mark.timeout(60)
def test_timeline_parses_and_nests(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    env = {"RINGCORE_TIMELINE": str(path), "RINGCORE_SEGMENT_BYTES": "64K"}
    with Cluster(3, env=env) as cluster:
        issued = cluster.results(tasks.timeline_job)
    for rank in range(3):
        with (tmp_path / f"trace.rank{rank}.json").open() as trace:
            events = json.load(trace)
        check_trace(events, rank, issued[rank])


EPS = 0.01  # microseconds: ts and dur are rounded to 3 decimals


def check_trace(events: list[dict[str, Any]], rank: int, issued: int) -> None:
    """Event fields, steps inside their collective, no partial overlap on one (pid, tid) row."""
    assert events[0]["ph"] == "M" and events[0]["args"] == {"name": f"rank {rank}"}, events[0]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == len(events) - 1, [e for e in events[1:] if e["ph"] != "X"]
    for event in complete:
        assert {"name", "cat", "ph", "ts", "dur", "pid", "tid", "args"} <= event.keys(), event
        assert event["pid"] == rank and isinstance(event["tid"], int), event
        assert isinstance(event["ts"], (int, float)) and event["dur"] >= 0, event
        assert (event["cat"], event["tid"] == 0) in {("collective", True), ("step", False)}, event
    collectives = [e for e in complete if e["cat"] == "collective"]
    steps = [e for e in complete if e["cat"] == "step"]
    assert len(collectives) == issued, [e["name"] for e in collectives]
    assert [e["args"]["seq"] for e in collectives] == list(range(1, issued + 1))
    assert {"big", "small", "bcast", "gather", "rs"} <= {e["args"]["name"] for e in collectives}
    assert steps, "no step events"
    outside = [
        s
        for s in steps
        if not any(
            c["ts"] - EPS <= s["ts"] and s["ts"] + s["dur"] <= c["ts"] + c["dur"] + EPS for c in collectives
        )
    ]
    assert not outside, f"rank {rank}: step events outside every collective: {outside[:3]}"
    rows: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for event in complete:
        rows.setdefault((event["pid"], event["tid"]), []).append(event)
    for row, row_events in rows.items():
        row_events.sort(key=lambda e: (e["ts"], -e["dur"]))
        open_ends: list[float] = []  # ends of the enclosing events
        for event in row_events:
            start, end = event["ts"], event["ts"] + event["dur"]
            while open_ends and open_ends[-1] <= start + EPS:
                open_ends.pop()
            assert not open_ends or end <= open_ends[-1] + EPS, f"row {row}: {event} partially overlaps"
            open_ends.append(end)


# ---------------------------------------------------------------------------- stall inspector

STALL_RANK = """\
import json, os, sys, time
import numpy as np
import ringcore

mode = sys.argv[1]
comm = ringcore.init()
if comm.rank == 2:
    time.sleep(3.0 if mode == "warn" else 5.0)
report = {"rank": comm.rank}
try:
    comm.allreduce(np.ones(1000, np.float32), name="grad.w")
    report["error"] = "no error"
except Exception as err:
    report.update(error=type(err).__name__, message=str(err), at=time.time())
print("REPORT " + json.dumps(report), flush=True)
if mode == "shutdown" and comm.rank != 2:
    time.sleep(4.0)  # keep the store (rank 0) up until rank 2 has made its call
ringcore.shutdown()
"""


def run_stall_job(tmp_path: Path, mode: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "stall.py"
    script.write_text(STALL_RANK)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "ringcore.run",
            "-np",
            "3",
            "--timeout",
            "40",
            sys.executable,
            str(script),
            mode,
        ],
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
        env={**os.environ, "RINGCORE_TIMEOUT": "30", **env},
    )


def reports_of(stdout: str) -> dict[int, dict[str, Any]]:
    found = [json.loads(line.split("REPORT ", 1)[1]) for line in stdout.splitlines() if "REPORT " in line]
    return {report["rank"]: report for report in found}


@pytest.mark.timeout(60)
def test_stall_warning_names_the_missing_rank(tmp_path: Path) -> None:
    """Rank 2 enters allreduce(name="grad.w") 3 s late; RINGCORE_STALL_WARNING=1 -> rank 0 warns, repeatedly."""
    done = run_stall_job(tmp_path, "warn", {"RINGCORE_STALL_WARNING": "1"})
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert all(r["error"] == "no error" for r in reports_of(done.stdout).values()), done.stdout
    warnings = [line for line in done.stderr.splitlines() if "stall" in line]
    assert len(warnings) >= 2, f"expected repeated warnings, got: {done.stderr}"
    for line in warnings:
        assert line.startswith("[0]<stderr>:"), f"not from rank 0: {line}"
        for word in ("allreduce #1", "'grad.w'", "rank 2", "ranks 0-1"):
            assert word in line, f"{word!r} not in {line!r}"


@pytest.mark.timeout(60)
def test_stall_shutdown_fails_every_rank(tmp_path: Path) -> None:
    """RINGCORE_STALL_SHUTDOWN=2 and rank 2 stays out 5 s: every rank raises CollectiveTimeout naming the stall."""
    env = {"RINGCORE_STALL_WARNING": "1", "RINGCORE_STALL_SHUTDOWN": "2"}
    done = run_stall_job(tmp_path, "shutdown", env)
    reports = reports_of(done.stdout)
    assert sorted(reports) == [0, 1, 2], (done.stdout, done.stderr)
    for rank, report in reports.items():
        assert report["error"] == "CollectiveTimeout", (rank, report)
        assert "stall" in report["message"] and "grad.w" in report["message"], (rank, report)
    waited = [reports[r]["at"] for r in (0, 1)]
    assert max(waited) - min(waited) < 2.0, reports
