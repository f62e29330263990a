"""Rank programs run outside a Cluster, each in its own process: ``fn(rank, ...)``, not ``fn(comm, ...)``.

They call ``ringcore.init`` and ``shutdown`` themselves: cycles of both in one
process, a rank failing during rendezvous, re-init after a peer died, the file
descriptors and threads left behind, a job run in a fresh interpreter. Reports go
on a ``results`` queue, or are returned to a ``python -c`` caller.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tests.tasks.failures import _qualified
from tests.tasks.faults import _hook_phase, _inject, _stamp


def init_shutdown_cycles(rank: int, size: int, ports: list[int], results: Any) -> None:
    """Outside a Cluster: init / allreduce / shutdown once per port, in one process.

    Puts (rank, report) on ``results``; the report lists each cycle's result,
    the thread count before the first init and after each shutdown, and what a
    second ``init()`` without ``shutdown()`` raised.
    """
    import os
    import threading
    import time

    os.environ.update({"RINGCORE_TIMEOUT": "30", "RINGCORE_INIT_TIMEOUT": "30"})
    import ringcore

    report: dict[str, Any] = {"baseline": threading.active_count(), "sums": [], "threads": [], "reinit": None}
    try:
        for cycle, port in enumerate(ports):
            comm = ringcore.init(rank=rank, size=size, addr="127.0.0.1", port=port)
            if cycle == 0:
                try:
                    ringcore.init(rank=rank, size=size, addr="127.0.0.1", port=port)
                except Exception as err:
                    report["reinit"] = type(err).__name__
            buf = np.full(1000 + cycle, rank + 1 + 10 * cycle, np.float64)
            ringcore.allreduce(buf)
            big = np.full(100_000, float(rank + cycle), np.float32)  # ring path
            ringcore.allreduce(big, op="max")
            report["sums"].append((buf.tolist(), float(big.min()), float(big.max()), comm.size))
            ringcore.shutdown()
            deadline = time.monotonic() + 10
            while threading.active_count() > report["baseline"] and time.monotonic() < deadline:
                time.sleep(0.05)
            report["threads"].append(threading.active_count())
            report["initialized_after_shutdown"] = ringcore.is_initialized()
    except Exception as err:
        report["error"] = f"{type(err).__name__}: {err}"
    results.put((rank, report))


def init_and_report(rank: int, size: int, *ports: int) -> dict[str, Any]:
    """Outside a Cluster: init, allreduce, shutdown once per store port; report sums or the error.

    Run in a fresh interpreter by the security tests (``python -c``), so its
    stderr (ringcore's log) can be captured.
    """
    import ringcore
    from ringcore.errors import AuthenticationError

    report: dict[str, Any] = {"sums": [], "error": None}
    try:
        for port in ports:
            comm = ringcore.init(rank=rank, size=size, addr="127.0.0.1", port=port)
            buf = np.full(16, float(rank + 1))
            comm.allreduce(buf)
            report["sums"].append(buf.tolist())
            ringcore.shutdown()
    except Exception as err:
        report.update(
            error=_qualified(err), message=str(err), authentication=isinstance(err, AuthenticationError)
        )
    return report


def init_with_fault(
    rank: int,
    size: int,
    port: int,
    env: dict[str, str],
    victim: int,
    fault: str,
    stamp: str,
    results: Any,
    delay: float = 0.0,
) -> None:
    """Outside a Cluster: ``ringcore.init`` with the victim failing at a point of the rendezvous.

    ``fault``: ``"absent"`` (the victim never calls init), ``"after_join"``
    (SIGKILL once it has joined the store, before it publishes its address),
    ``"before_mesh"`` (SIGKILL after publishing its address, before connecting
    the mesh), ``"before_mesh_late"`` (the same 1.5 s later, once higher ranks
    have connected to its listener and wait in the handshake), ``"mid_handshake"`` (SIGKILL with its first data connection to a
    lower rank open but not yet authenticated; the victim must not be rank 0).
    Every other rank waits ``delay`` seconds, calls init and puts ``(rank, report)`` on ``results``.
    """
    import os
    import time

    os.environ.update(env)
    import ringcore
    from ringcore import bootstrap
    from ringcore.transport import mesh

    if rank == victim:
        if fault == "absent":
            _stamp(stamp)
            return

        def die(*args: Any, **kwargs: Any) -> Any:
            _inject(None, "kill9", stamp)

        if fault == "after_join":
            bootstrap.make_listener = die
        elif fault == "before_mesh":
            bootstrap.connect_mesh = die
        elif fault == "before_mesh_late":

            def linger_then_die(*args: Any, **kwargs: Any) -> Any:
                time.sleep(1.5)  # higher ranks' connections wait, unaccepted, in our listener's backlog
                die()

            bootstrap.connect_mesh = linger_then_die
        elif fault == "mid_handshake":
            mesh._introduce = die  # the TCP connection to a lower rank is open, not yet authenticated
        else:
            raise ValueError(fault)
    time.sleep(delay)
    report: dict[str, Any] = {"error": "no error"}
    started = time.time()
    try:
        ringcore.init(rank=rank, size=size, addr="127.0.0.1", port=port)
    except Exception as err:
        import traceback

        report.update(error=_qualified(err), message=str(err), peer=getattr(err, "peer", None))
        report["trace"] = traceback.format_exc()
        report["is_ringcore_error"] = isinstance(err, ringcore.RingcoreError)
    report["started"], report["failed_at"] = started, time.time()
    ringcore.shutdown()
    results.put((rank, report))


def _resources() -> tuple[list[str], list[str]]:
    """This process's open file descriptors (with what they point to) and live thread names."""
    import contextlib
    import os
    import threading

    fds = []
    for fd in sorted(os.listdir("/proc/self/fd"), key=int):
        with contextlib.suppress(OSError):  # OSError: the descriptor listdir itself used
            fds.append(f"{fd}->{os.readlink(f'/proc/self/fd/{fd}')}")
    return fds, sorted(t.name for t in threading.enumerate())


def _settle(baseline: tuple[list[str], list[str]], seconds: float = 5.0) -> tuple[list[str], list[str]]:
    """Resources now, waiting up to ``seconds`` for threads that are on their way out."""
    import time

    deadline = time.monotonic() + seconds
    while True:
        now = _resources()
        if (len(now[0]), len(now[1])) == (len(baseline[0]), len(baseline[1])) or time.monotonic() > deadline:
            return now
        time.sleep(0.05)


def lifecycle_cycles(rank: int, size: int, ports: list[int], env: dict[str, str], results: Any) -> None:
    """Outside a Cluster: init / allreduce / shutdown once per port, recording fds and threads.

    Puts ``(rank, report)`` on ``results``: the resources before the first init
    and after each shutdown, and each cycle's results.
    """
    import os

    os.environ.update(env)
    import ringcore

    report: dict[str, Any] = {"before": _resources(), "after": [], "sums": []}
    try:
        for cycle, port in enumerate(ports):
            ringcore.init(rank=rank, size=size, addr="127.0.0.1", port=port)
            small = np.full(100, float(rank + cycle), np.float64)
            big = np.full(200_000, float(rank + 1), np.float32)  # ring path
            direct = np.full(1 << 18, float(rank + 1), np.float32)  # 1 MiB: the direct route on one host
            ringcore.allreduce(small, name="small")
            ringcore.allreduce(big, op="max", name="big")
            ringcore.allreduce(direct, name="direct")
            report["sums"].append((float(small[0]), float(big.max()), float(direct.min())))
            ringcore.shutdown()
            report["after"].append(_resources())  # at once: shutdown() must have stopped everything
    except Exception as err:
        report["error"] = f"{type(err).__name__}: {err}"
    results.put((rank, report))


def reinit_after_failure(rank: int, ports: list[int], env: dict[str, str], stamp: str, results: Any) -> None:
    """Outside a Cluster: 3 ranks; rank 2 is SIGKILLed mid-allreduce; ranks 0 and 1 see the
    failure, shut down, and init again as a world of 2 on a new port.

    Ranks 0 and 1 put ``(rank, report)`` on ``results``: the error, what a
    collective on the broken communicator raised, the resources before the
    first init, after the failed communicator's shutdown and after the second
    job's shutdown, and the second job's allreduce result.
    """
    import os

    os.environ.update(env)
    import ringcore

    report: dict[str, Any] = {"before": _resources()}
    try:
        comm = ringcore.init(rank=rank, size=3, addr="127.0.0.1", port=ports[0])
        ringcore.allreduce(np.ones(10, np.float32))
        if rank == 2:
            _hook_phase(comm, "kill9", "scatter-reduce", 3, stamp)
        try:
            ringcore.allreduce(np.ones(1_000_000, np.float32))
            report["error"] = "no error"
        except ringcore.PeerFailure as err:
            report["error"], report["peer"] = "PeerFailure", err.peer
        try:
            ringcore.barrier()
        except Exception as err:
            report["broken"] = type(err).__name__
        ringcore.shutdown()
        report["after_failure"] = _settle(report["before"])
        ringcore.init(rank=rank, size=2, addr="127.0.0.1", port=ports[1])
        buf = np.full(300_000, float(rank + 1), np.float32)
        ringcore.allreduce(buf)
        report["second"] = (float(buf.min()), float(buf.max()), ringcore.size())
        ringcore.shutdown()
        report["after_second"] = _settle(report["before"])
    except Exception as err:
        report["crash"] = f"{type(err).__name__}: {err}"
    results.put((rank, report))
