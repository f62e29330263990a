"""A live job of N real processes connected by ringcore over TCP, driven from the test.

``Cluster(n)`` spawns N processes that each call ``ringcore.init`` and then run
whatever task the test sends them (a picklable top-level function called as
``fn(comm, *args)``), returning each rank's result or error. One cluster
serves many hypothesis examples, so property tests pay the start-up once.
Every wait is bounded, and ``close()`` kills whatever is left.

Ports. ``ringcore.init`` needs rank 0's store port named in advance, and
any other process may take a port between the moment a test finds it free
and the moment rank 0 binds it. :func:`free_port` picks ports below the
kernel's ephemeral range, so no connection's local port can be one, and
never hands a port out twice; what is left (another process binding the
same port on purpose meanwhile) makes rank 0 fail to serve its store, or the
others meet a stranger's store and fail its handshake: ``Cluster`` then
starts again on another port.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import random
import secrets
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Ranks fork from a server that has imported numpy, ringcore, pytest and the shared tasks
# once: a spawned interpreter spent about 0.6 s of CPU on those imports for every rank of
# every cluster. The server is a fresh process (no test's threads or sockets in it), and
# each rank still applies its own environment before ringcore.init reads it.
_CTX = multiprocessing.get_context("forkserver")
_CTX.set_forkserver_preload(["numpy", "ringcore", "pytest", "hypothesis", "tests.tasks"])


# Below Linux's default ephemeral range (32768-60999): the kernel never gives these to a
# connecting socket, so only a process that binds one on purpose can take it meanwhile.
PORTS = (20000, 32767)
_HANDED_OUT: set[int] = set()


def free_port(neighbours: int = 1) -> int:
    """A port on 127.0.0.1 that is free now, with ``neighbours`` free ports after it, below the ephemeral range.

    The default neighbour serves launchers that put ringcore's store on
    ``MASTER_PORT + 1`` (torchrun). Binding port 0 and releasing it instead
    would hand out an ephemeral port, which any connection on the host may
    take as its local port before the job binds it.
    """
    rng = random.Random()
    low, high = PORTS
    for _ in range(1000):
        port = rng.randrange(low, high - neighbours)
        if not _HANDED_OUT.isdisjoint(range(port, port + neighbours + 1)):
            continue  # free, but given to an earlier caller of this process that may not have bound it yet
        probes = []
        try:
            for candidate in range(port, port + neighbours + 1):
                probe = socket.socket()
                probes.append(probe)
                probe.bind(("127.0.0.1", candidate))
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()
        _HANDED_OUT.update(range(port, port + neighbours + 1))
        return port
    raise RuntimeError(f"no {neighbours + 1} free ports in a row in {low}-{high} on 127.0.0.1")


@dataclasses.dataclass
class RankError:
    """An exception raised on a rank, carried back to the test."""

    type_name: str
    message: str
    exception: BaseException | None
    trace: str


def _worker(
    rank: int, size: int, port: int, conn: Any, env: dict[str, str], hostname: str | None = None
) -> None:
    os.environ.update(env)
    if hostname is not None:
        own_hostname(hostname)
    import ringcore

    try:
        comm = ringcore.init(rank=rank, size=size, addr="127.0.0.1", port=port)
    except BaseException as err:  # report the failure to the test instead of dying silently
        conn.send(("init-error", _error(err)))
        return
    conn.send(("ready", os.getpid()))
    while True:
        task = conn.recv()
        if task is None:
            break
        fn, args = task
        try:
            conn.send(("ok", fn(comm, *args)))
        except BaseException as err:
            conn.send(("err", _error(err)))
    ringcore.shutdown()
    conn.send(("bye", None))


CLONE_NEWUTS = 0x04000000


def own_hostname(name: str) -> None:
    """Give this process a host name of its own (a new UTS namespace: root only), as if on another host."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWUTS) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUTS) failed (needs root)")
    socket.sethostname(name)


def can_own_hostname() -> bool:
    """Whether processes here may take host names of their own (``Cluster(hostnames=...)``)."""
    return os.geteuid() == 0 and hasattr(socket, "sethostname")


def _error(err: BaseException) -> RankError:
    try:
        import pickle

        pickle.dumps(err)
        exception: BaseException | None = err
    except Exception:
        exception = None
    return RankError(type(err).__name__, str(err), exception, traceback.format_exc())


# Under every cluster's own env (tests/conftest.py's ``ring_only`` adds to it). The kernel's copies
# pinned fast, so which route a size takes on one host is the same on every machine the tests run on
# (auto measures them: ringcore.config.Settings.direct_from); tests/integration/test_kernel_copies.py
# runs auto and slow.
PINNED = {"RINGCORE_KERNEL_COPIES": "fast"}
BASE_ENV: dict[str, str] = PINNED


class Cluster:
    """N ringcore ranks in their own processes (see module docstring)."""

    def __init__(
        self,
        size: int,
        env: dict[str, str] | None = None,
        timeout: float = 60.0,
        hostnames: list[str] | None = None,
    ) -> None:
        """``hostnames``: one per rank, each rank's own (see :func:`own_hostname`): emulated hosts."""
        self.size = size
        self.hostnames = hostnames or [None] * size
        self.timeout = timeout
        self.busy: set[int] = set()  # ranks that never answered a task: they cannot take another
        for attempt in range(3):
            replies = self._start(free_port(), env or {}, timeout)
            failed = [r for r, (status, _) in enumerate(replies) if status != "ready"]
            if not failed:
                break
            self.close()
            if attempt == 2 or not any(_port_taken(replies[r][1]) for r in failed):
                raise RuntimeError(f"ranks {failed} failed to start: {[replies[r] for r in failed]}")
        self.pids = [value for _, value in replies]

    def _start(self, port: int, env: dict[str, str], timeout: float) -> list[tuple[str, Any]]:
        base = {
            **BASE_ENV,
            "RINGCORE_TIMEOUT": "30",
            "RINGCORE_INIT_TIMEOUT": "30",
            "RINGCORE_SECRET": f"test-{port}-{secrets.token_hex(8)}",  # a stranger on the port fails the handshake
            **env,
        }
        self.pipes = []
        self.procs = []
        self.busy.clear()
        for rank in range(self.size):
            parent, child = _CTX.Pipe()
            proc = _CTX.Process(
                target=_worker, args=(rank, self.size, port, child, base, self.hostnames[rank]), daemon=True
            )
            proc.start()
            self.pipes.append(parent)
            self.procs.append(proc)
        return self._collect(range(self.size), timeout)

    def _collect(self, ranks: Any, timeout: float) -> list[tuple[str, Any]]:
        deadline = time.monotonic() + timeout
        replies = []
        for rank in ranks:
            pipe = self.pipes[rank]
            if not pipe.poll(max(0.0, deadline - time.monotonic())):
                replies.append(("timeout", None))
                self.busy.add(rank)
                continue
            try:
                replies.append(pipe.recv())
            except EOFError:
                replies.append(("dead", self.procs[rank].exitcode))
        return replies

    def run(
        self, fn: Callable[..., Any], *args: Any, ranks: Any = None, timeout: float | None = None
    ) -> list[Any]:
        """Run ``fn(comm, *args)`` on every rank; results, or ``RankError``s, by rank."""
        ranks = list(range(self.size)) if ranks is None else list(ranks)
        if busy := sorted(self.busy.intersection(ranks)):
            # A rank still inside an earlier task would answer this one with that task's reply,
            # or not at all: fail at once instead of waiting out another timeout (a module-scoped
            # cluster would otherwise cost every later test its whole timeout).
            why = f"ranks {busy} never answered an earlier task (timed out); this cluster can run no more"
            return [RankError("busy", why, None, "") for _ in ranks]
        for rank in ranks:
            self.pipes[rank].send((fn, args))
        replies = self._collect(ranks, self.timeout if timeout is None else timeout)
        return [value if status == "ok" else _as_error(status, value) for status, value in replies]

    def results(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> list[Any]:
        """Like ``run`` but raise if any rank failed."""
        out = self.run(fn, *args, timeout=timeout)
        errors = {r: v for r, v in enumerate(out) if isinstance(v, RankError)}
        if errors:
            details = "\n".join(f"rank {r}: {e.type_name}: {e.message}\n{e.trace}" for r, e in errors.items())
            raise AssertionError(f"ranks failed:\n{details}")
        return out

    def kill(self, rank: int, sig: int = signal.SIGKILL) -> None:
        os.kill(self.pids[rank], sig)

    def close(self) -> None:
        for pipe in self.pipes:
            with contextlib.suppress(OSError, BrokenPipeError):
                pipe.send(None)
        deadline = time.monotonic() + 10
        for proc in self.procs:
            proc.join(timeout=max(0.1, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for pipe in self.pipes:
            pipe.close()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _port_taken(error: Any) -> bool:
    """Whether a rank failed to start because another process had the job's port (see the module docstring)."""
    if not isinstance(error, RankError):
        return False
    return error.type_name == "AuthenticationError" or "could not serve the rendezvous store" in error.message


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie has exited: it does not)."""
    try:
        os.kill(pid, 0)
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][:1] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False


def _as_error(status: str, value: Any) -> Any:
    if isinstance(value, RankError):
        return value
    return RankError(status, f"rank gave no answer ({status}, {value})", None, "")


def read_stamp(path: Any, bound: float = 10.0) -> float:
    """The wall-clock time a rank wrote to ``path`` when it injected a fault (``tasks._stamp``)."""
    from pathlib import Path

    deadline = time.monotonic() + bound
    while not Path(path).exists():
        assert time.monotonic() < deadline, f"the victim never injected its fault ({path})"
        time.sleep(0.01)
    return float(Path(path).read_text())


def qualified(cls: type) -> str:
    """``module.Class``: how tasks report an exception's type across processes."""
    return f"{cls.__module__}.{cls.__qualname__}"


class Background:
    """``cluster.run`` on some ranks in a thread, so the test can act while they work."""

    def __init__(
        self, cluster: Cluster, fn: Any, *args: Any, ranks: list[int] | None = None, timeout: float = 60.0
    ) -> None:
        self.out: list[Any] | None = None
        self.timeout = timeout
        self.thread = threading.Thread(
            target=self._run, args=(cluster, fn, args, ranks, timeout), daemon=True, name="cluster-run"
        )
        self.thread.start()

    def _run(self, cluster: Cluster, fn: Any, args: tuple, ranks: list[int] | None, timeout: float) -> None:
        self.out = cluster.run(fn, *args, ranks=ranks, timeout=timeout)

    def join(self, timeout: float | None = None) -> list[Any]:
        timeout = self.timeout + 10 if timeout is None else timeout
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"no answer within {timeout} s: something hangs"
        assert self.out is not None
        return self.out


def run_with_stopped_rank(
    cluster: Cluster, fn: Any, *args: Any, victim: int, survivors: list[int], timeout: float = 90.0
) -> tuple[list[Any], Any]:
    """Run ``fn(comm, *args)`` on ``victim`` and ``survivors`` at once, the victim stopping itself
    (SIGSTOP) inside it: the survivors' results, then the victim's once it was sent SIGCONT."""
    try:
        stopped = Background(cluster, fn, *args, ranks=[victim], timeout=timeout)
        working = Background(cluster, fn, *args, ranks=survivors, timeout=timeout)
        reports = working.join(60)
        cluster.kill(victim, signal.SIGCONT)
        (resumed,) = stopped.join(60)
        return reports, resumed
    finally:
        cluster.kill(victim, signal.SIGCONT)


def kill_mid_allreduce(
    cluster: Cluster, victim: int, stamp: Any, count: int, join_timeout: float = 60.0
) -> tuple[list[int], list[Any], float]:
    """kill -9 ``victim`` halfway through its sends, inside the second of 3 rounds of allreduces of ``count``.

    Checks that the victim died; returns the survivors, their reports
    (``tasks.allreduce_until_failure``) and when the kill happened.
    """
    from tests import tasks

    fault = (victim, "kill9", str(stamp), 0.5)
    survivors = [rank for rank in range(cluster.size) if rank != victim]
    doomed = Background(cluster, tasks.allreduce_until_failure, count, 3, fault, ranks=[victim], timeout=90)
    working = Background(cluster, tasks.allreduce_until_failure, count, 3, fault, ranks=survivors, timeout=90)
    reports = working.join(join_timeout)
    (victim_report,) = doomed.join(30)
    killed_at = read_stamp(stamp)
    assert isinstance(victim_report, RankError) and victim_report.type_name == "dead", victim_report
    return survivors, reports, killed_at


def collect(procs: list[Any], results: Any, count: int, timeout: float) -> dict[Any, Any]:
    """Start plain processes, take ``count`` ``(key, value)`` reports from ``results``, then reap them all."""
    for proc in procs:
        proc.start()
    try:
        return dict(results.get(timeout=timeout) for _ in range(count))
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
