"""The processes of a ``ringcore-run`` job: start them (here or over ssh), pump their output, stop them.

A :class:`Job` numbers its processes 0, 1, ... in the order they start: the
ranks of a fixed job (:mod:`ringcore.run`), the workers of an elastic one
(:mod:`ringcore.elastic_driver`), whose ranks change while the numbers stay.
Each local process runs in its own session, so it and everything it starts
form one process group that can be signalled as a whole; its stdin is
``/dev/null``, its stdout and stderr come back line by line through the
:class:`Sink`, prefixed ``[n]<stdout>: ``. A process on another host is an
ssh session running :mod:`ringcore.rank_agent` (:mod:`ringcore.remote`):
closing the session's stdin stops it (the agent sends SIGTERM, SIGKILL after
the grace period, and reports how the program ended).
"""

from __future__ import annotations

import contextlib
import functools
import os
import queue
import secrets
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, BinaryIO, TextIO

from ringcore import remote
from ringcore.rank_agent import personality, set_layout
from ringcore.remote import RemoteError, RemoteRank, SshOptions

PROG = "ringcore-run"
EXIT_NOT_EXECUTABLE = 126
EXIT_NOT_FOUND = 127
POLL_SECONDS = 0.05
# Seconds past --grace that a remote rank's agent has to stop it and report.
REMOTE_SLACK = 3.0
# Bound on waiting for output after all ranks are gone: a grandchild that left
# the rank's process group may still hold a pipe open.
DRAIN_SECONDS = 5.0


# --------------------------------------------------------------------------- output


_NO_RINGCORE = b"No module named 'ringcore'"  # a rank's Python without ringcore (not a missing part of it)


class Sink:
    """Writes whole lines to the launcher's stdout/stderr, one line at a time.

    A single lock guards both streams so that a line is never interleaved
    with another, and every line is flushed as soon as it is written.
    """

    def __init__(self, stdout: TextIO, stderr: TextIO, prefix: bool) -> None:
        self._streams = {"stdout": stdout, "stderr": stderr}
        self._prefix = prefix
        self._lock = threading.Lock()
        self._broken: set[str] = set()
        self.missing_ringcore = False  # a rank said its Python has no ringcore (the hint after a failure)

    def rank_line(self, rank: int, stream: str, line: bytes) -> None:
        """Write one line that ``rank`` printed on ``stream`` (``"stdout"``/``"stderr"``)."""
        if stream == "stderr" and not self.missing_ringcore and _NO_RINGCORE in line:
            self.missing_ringcore = True
        if self._prefix:
            text = line.decode("utf-8", errors="replace").removesuffix("\n")
            line = f"[{rank}]<{stream}>: {text}\n".encode()
        self._write(stream, line)

    def message(self, text: str) -> None:
        """Write one ``ringcore-run: ...`` line to stderr."""
        self._write("stderr", f"{PROG}: {text}\n".encode())

    def _write(self, stream: str, data: bytes) -> None:
        target = self._streams[stream]
        with self._lock:
            if stream in self._broken:
                return
            try:
                _write_bytes(target, data)
            except (OSError, ValueError):
                # The reader went away; keep draining the ranks so they never block.
                self._broken.add(stream)


def _write_bytes(target: TextIO, data: bytes) -> None:
    binary: BinaryIO | None = getattr(target, "buffer", None)
    if binary is None:
        target.write(data.decode("utf-8", errors="replace"))
        target.flush()
        return
    target.flush()
    binary.write(data)
    binary.flush()


def _pump(pipe: BinaryIO, sink: Sink, rank: int, stream: str) -> None:
    with pipe:
        for line in iter(pipe.readline, b""):
            sink.rank_line(rank, stream, line)


# --------------------------------------------------------------------------- processes


class LaunchError(Exception):
    """The command could not be started; ``code`` is the launcher's exit code."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class Job:
    """The running processes (a local one's own, a remote one's ssh), their output pumps and exit events.

    Args:
        sink: Where their output goes.
        noun: What messages call a process: ``"rank"``, or ``"worker"`` in an elastic job.
    """

    def __init__(self, sink: Sink, noun: str = "rank") -> None:
        self.sink = sink
        self.noun = noun
        self.procs: list[subprocess.Popen[bytes]] = []
        self.exits: dict[int, int] = {}
        self.remote: dict[int, RemoteRank] = {}
        self.hosts: dict[int, str] = {}  # number -> host, when the launcher was given hosts
        self._marker = f"\0ringcore-rank-{secrets.token_hex(4)}:"  # the agents' reports (ringcore.rank_agent)
        self._events: queue.Queue[tuple[int, int]] = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._layout_said = False

    def start_local(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        cpus: set[int] | None,
        host: str | None = None,
        fixed_layout: bool | None = None,
    ) -> int:
        """Start ``argv`` here, bound to ``cpus`` (``None``: unbound); return its number.

        Args:
            host: The host's name as the user gave it, for messages (``None``: none given).
            fixed_layout: Start it without (True) or with (False) address-space randomization, or
                as this process runs (None): :func:`ringcore.rank_agent.fixed_layout`.

        Raises:
            LaunchError: The command was not found or is not executable.
        """
        number = len(self.procs)
        with _bound_to(cpus), _laid_out(fixed_layout, self._layout_refused):
            proc = _spawn(argv, env)
        self.procs.append(proc)
        if host is not None:
            self.hosts[number] = host
        self._thread(_pump, proc.stdout, self.sink, number, "stdout")
        self._thread(_pump, proc.stderr, self.sink, number, "stderr")
        self._thread(self._wait, number, proc)
        return number

    def _layout_refused(self, err: OSError) -> None:
        """Say once that the kernel kept this job's ranks in the layout the launcher runs in."""
        if not self._layout_said:
            self._layout_said = True
            self.sink.message(
                f"--aslr: cannot set the ranks' address layout here ({err}); they run as {PROG} does"
            )

    def start_remote(self, host: str, ssh: SshOptions, job: dict[str, Any]) -> int:
        """Start a process on ``host`` over ssh (``job``: :mod:`ringcore.rank_agent`'s, less the marker).

        Raises:
            LaunchError: ssh was not found.
        """
        number = len(self.procs)
        try:
            rank = RemoteRank.start(number, host, ssh, {**job, "marker": self._marker})
        except RemoteError as err:
            raise LaunchError(str(err), EXIT_NOT_FOUND) from None
        self.procs.append(rank.proc)
        self.remote[number] = rank
        self.hosts[number] = host
        self._thread(_pump, rank.proc.stdout, self.sink, number, "stdout")
        stderr = self._thread(rank.pump_stderr, functools.partial(self.sink.rank_line, number, "stderr"))
        self._thread(self._wait_remote, rank, stderr)
        return number

    def startup_room(self, host: str, should_stop: Callable[[], bool]) -> bool:
        """Wait until fewer than MAX_STARTUPS sessions to ``host`` are starting; false if told to stop."""
        while (
            sum(r.host == host and not r.started.is_set() for r in self.remote.values())
            >= remote.MAX_STARTUPS
        ):
            if should_stop():
                return False
            time.sleep(POLL_SECONDS)
        return True

    def _thread(self, target: Callable[..., None], *args: object) -> threading.Thread:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        self._threads.append(thread)
        return thread

    def _wait(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        # One waiter per rank: events reach the queue in the order ranks exited.
        self._events.put((rank, proc.wait()))

    def _wait_remote(self, rank: RemoteRank, stderr: threading.Thread) -> None:
        ssh_code = rank.proc.wait()
        stderr.join(DRAIN_SECONDS)  # the agent's report is the last line on ssh's stderr
        rank.started.set()
        self._events.put((rank.rank, rank.returncode(ssh_code)))

    def describe(self, rank: int, returncode: int) -> tuple[str, int]:
        """How ``rank`` ended, naming its host when hosts were given, and the launcher's exit code for it."""
        where = f"{self.noun} {rank} on {self.hosts[rank]}" if rank in self.hosts else f"{self.noun} {rank}"
        how, code = describe_exit(returncode)
        if rank in self.remote and self.remote[rank].code is None:
            return f"{where}: ssh {how} before the rank reported how it ended (see its stderr)", code
        return f"{where} {how}", code

    def collect(self, timeout: float) -> list[tuple[int, int]]:
        """Wait up to ``timeout`` s for exits; return new ``(rank, returncode)`` in exit order."""
        found: list[tuple[int, int]] = []
        try:
            found.append(self._events.get(timeout=timeout))
            while True:
                found.append(self._events.get_nowait())
        except queue.Empty:
            pass
        self.exits.update(found)
        return found

    def running(self) -> list[int]:
        """Return the ranks whose process has not been seen to exit."""
        return [rank for rank in range(len(self.procs)) if rank not in self.exits]

    def done(self) -> bool:
        """Return whether every started rank has exited."""
        return not self.running()

    def stop(self, grace: float) -> list[int]:
        """Stop every rank still running (see :meth:`terminate`); return those ranks."""
        self.collect(0)
        running = self.running()
        self.terminate(grace)
        return running

    def terminate(self, grace: float) -> None:
        """SIGTERM every rank group with a live process in it, SIGKILL after ``grace`` s.

        Groups of ranks that already exited are included, so that processes a
        rank left behind do not outlive the job.
        """
        targets = [rank for rank in range(len(self.procs)) if self.alive(rank)]
        self.send(targets, signal.SIGTERM)
        self._await(targets, grace)
        self.send([rank for rank in targets if self.alive(rank) and rank not in self.remote], signal.SIGKILL)
        # A remote rank's agent kills it after its own grace and reports; ssh goes only if it never does.
        self._await([rank for rank in targets if rank in self.remote], REMOTE_SLACK)
        self.send([rank for rank in targets if self.alive(rank)], signal.SIGKILL)
        while not self.done():
            self.collect(POLL_SECONDS)

    def _await(self, ranks: list[int], seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and any(map(self.alive, ranks)):
            self.collect(POLL_SECONDS)

    def send(self, ranks: Sequence[int], signum: int) -> None:
        """Signal the process groups of ``ranks``; a remote one's SIGTERM closes its session's stdin."""
        for rank in ranks:
            if rank in self.remote:
                # SIGTERM: close the session's stdin, the agent stops the rank; SIGKILL: kill ssh.
                (self.remote[rank].stop if signum == signal.SIGTERM else self.remote[rank].kill)()
                continue
            with contextlib.suppress(ProcessLookupError, PermissionError):  # group already gone
                os.killpg(self.procs[rank].pid, signum)

    def alive(self, rank: int) -> bool:
        """Whether ``rank``'s process, or one it left in its process group, still runs."""
        if rank in self.remote:
            return rank not in self.exits  # ssh ends after the agent has stopped the rank's whole group
        # Once the leader is reaped its PID stays reserved while its group has members.
        return rank not in self.exits or _group_alive(self.procs[rank].pid)

    def join(self, timeout: float = DRAIN_SECONDS) -> None:
        """Wait (bounded) for the output pumps to drain what the ranks left."""
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))


@contextlib.contextmanager
def _bound_to(cpus: set[int] | None) -> Iterator[None]:
    """Run the block on ``cpus``: a child started meanwhile inherits that affinity.

    ``sched_setaffinity(0, ...)`` sets the calling thread's mask only, so the
    launcher's output threads keep theirs; the old mask is restored after.
    """
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


@contextlib.contextmanager
def _laid_out(fixed: bool | None, refused: Callable[[OSError], None]) -> Iterator[None]:
    """Run the block with the address layout ``fixed`` asks (:func:`ringcore.rank_agent.set_layout`):
    a child started meanwhile inherits it; the calling thread's persona is restored after.
    Where the kernel refuses, ``refused(err)`` and the block runs as it is."""
    before = None
    try:
        before = set_layout(fixed)
    except OSError as err:
        refused(err)
    try:
        yield
    finally:
        if before is not None:
            with contextlib.suppress(OSError):  # the child started: never lose it over this
                personality(before)


def _spawn(argv: Sequence[str], env: Mapping[str, str]) -> subprocess.Popen[bytes]:
    try:
        return subprocess.Popen(
            list(argv),
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
    except FileNotFoundError:
        raise LaunchError(f"command not found: {argv[0]}", EXIT_NOT_FOUND) from None
    except PermissionError:
        raise LaunchError(f"permission denied: {argv[0]}", EXIT_NOT_EXECUTABLE) from None
    except OSError as exc:
        raise LaunchError(f"cannot start {argv[0]}: {exc}", EXIT_NOT_EXECUTABLE) from None


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# --------------------------------------------------------------------------- supervision


class SignalCatcher:
    """Records SIGINT/SIGTERM sent to the launcher so the main loop can react."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def _handle(self, signum: int, frame: object) -> None:
        if self.signum is None:
            self.signum = signum

    @contextlib.contextmanager
    def installed(self) -> Iterator[SignalCatcher]:
        """Install the handlers (main thread only) and restore the old ones on exit."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        old = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield self
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)


def describe_exit(returncode: int) -> tuple[str, int]:
    """Return how a process ended, in words, and the matching shell exit code.

    Args:
        returncode: ``Popen.returncode``; negative means killed by that signal.

    Returns:
        For example ``("exited with code 3", 3)`` or
        ``("was killed by signal SIGKILL (9)", 137)``.
    """
    if returncode >= 0:
        return f"exited with code {returncode}", returncode
    signum = -returncode
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    return f"was killed by signal {name} ({signum})", 128 + signum


def stopped_suffix(ranks: Sequence[int], noun: str = "ranks") -> str:
    """``"; stopped ranks 0, 1, 3"``, or ``""`` when none were stopped."""
    if not ranks:
        return ""
    return f"; stopped {noun} " + ", ".join(str(rank) for rank in ranks)
