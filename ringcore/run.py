"""``ringcore-run``: start N copies of a command as the ranks of one job.

Usage::

    ringcore-run -np 4 python train.py --lr 0.1
    python -m ringcore.run -np 2 -- python -c "import os; print(os.environ['RINGCORE_RANK'])"

Every rank ``r`` in ``0..N-1`` runs the command with the launcher's
environment plus:

- ``RINGCORE_RANK=r`` and ``RINGCORE_LOCAL_RANK=r``
- ``RINGCORE_SIZE=N`` and ``RINGCORE_LOCAL_SIZE=N`` (all ranks run on this host)
- ``RINGCORE_ADDR`` and ``RINGCORE_PORT``: where the ranks rendezvous
  (``--addr``, default ``127.0.0.1``; ``--port``, default a free local port)
- ``PYTHONUNBUFFERED=1`` so output arrives line by line
- torch's ``env://`` variables, each unless the launcher's environment already
  has it: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
  ``MASTER_ADDR`` (``--addr``) and ``MASTER_PORT``, a second free port (never
  ``RINGCORE_PORT`` or the one below it), so ``dist.init_process_group()``
  works as under torchrun. ringcore itself keeps reading ``RINGCORE_*``, which
  win over torch's variables in its discovery.

Binding (``--bind-to core``, the default; ``RINGCORE_BIND_TO`` sets the
default, e.g. for ``ringcore-bench --np``): when the host has a CPU for every
rank, rank ``r`` is bound to the ``r``-th equal share of the CPUs this
launcher may use (Open MPI binds small jobs too). A rank the scheduler leaves
on its peer's core makes a 4 KiB allreduce take 250-400 us instead of 45-95
us (measured, N=2 on 2 cores). A share keeps all its CPUs (a rank's own
threads, e.g. torch's, still spread over them). With more ranks than CPUs,
rank ``r`` is bound to CPU ``r mod CPUs`` (round robin, as Open MPI's
``--map-by core --bind-to core:overload-allowed``): ranks the scheduler moves
between cores run on cold caches, and at N=4 on 2 cores a 4 KiB allreduce
took 240-300 us bound against 390-450 unbound (bench/RESULTS.md).
``--bind-to none`` never binds.

Each rank runs in its own session, so it and everything it starts form one
process group that the launcher can signal as a whole. Its stdin is
``/dev/null``. Its stdout and stderr are piped back line by line, prefixed
``[r]<stdout>: `` and ``[r]<stderr>: `` (``--no-prefix`` passes lines through
unchanged). When the job ends, processes a rank left behind in its group are
stopped too (SIGTERM, then SIGKILL after ``--grace``).

Failure semantics, modelled on torchrun's "first failure is the root cause":

- All ranks exit 0: the launcher exits 0.
- A rank exits non-zero or is killed by a signal: the launcher sends SIGTERM to
  every rank still running, SIGKILL after ``--grace`` seconds, prints one line
  naming that *first* failing rank, and exits with its code (``128 + signal``
  for a signal). Ranks it stopped are never reported as the cause.
- ``--timeout`` expires: ranks are stopped the same way; exit 124.
- The launcher gets SIGINT or SIGTERM: ranks are stopped the same way; exit
  130 or 143.
- The command cannot be found: exit 127 (126 when it is not executable).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import queue
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import BinaryIO, TextIO

PROG = "ringcore-run"
EXIT_TIMEOUT = 124
EXIT_NOT_EXECUTABLE = 126
EXIT_NOT_FOUND = 127
POLL_SECONDS = 0.05
# Bound on waiting for output after all ranks are gone: a grandchild that left
# the rank's process group may still hold a pipe open.
DRAIN_SECONDS = 5.0

_NP_HELP = "number of ranks to start (required)"
_EPILOG = """\
examples:
  ringcore-run -np 4 python train.py --lr 0.1
  ringcore-run -n 2 --timeout 600 -- python -m mypkg.train
  ringcore-run --np 8 --no-prefix python bench.py > bench.log

exit status: 0 when every rank exits 0; otherwise the first failing rank's
exit code (128+N when it was killed by signal N), 124 on --timeout, 127 when
the command is not found, 130/143 when the launcher gets SIGINT/SIGTERM.
"""


@dataclasses.dataclass(frozen=True)
class Options:
    """The parsed command line.

    Attributes:
        size: Number of ranks to start.
        addr: Rendezvous address handed to every rank.
        port: Rendezvous port handed to every rank.
        prefix: Whether to prefix each output line with its rank and stream.
        grace: Seconds between SIGTERM and SIGKILL when stopping ranks.
        timeout: Wall-clock limit for the whole job in seconds; 0 means none.
        command: The program and its arguments.
        bind: Bind each rank to its CPUs (:func:`rank_cores`).
        secret: The job's RINGCORE_SECRET: the launcher's own if set, else a fresh random one.
        master_port: torch's ``MASTER_PORT`` for every rank; 0 picks a free port other than ``port``.
    """

    size: int
    addr: str
    port: int
    prefix: bool
    grace: float
    timeout: float
    command: list[str]
    bind: bool = True
    secret: str = dataclasses.field(
        default_factory=lambda: os.environ.get("RINGCORE_SECRET") or secrets.token_hex(32), repr=False
    )
    master_port: int = 0

    def __post_init__(self) -> None:
        if self.master_port == 0:
            object.__setattr__(self, "master_port", torch_port(self.port))


# --------------------------------------------------------------------------- command line


def _positive_int(text: str) -> int:
    value = _number(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return int(value)


def _seconds(text: str) -> float:
    value = _number(text, float)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative number of seconds, got {text}")
    return float(value)


def _port(text: str) -> int:
    value = _number(text, int)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be between 1 and 65535, got {text}")
    return int(value)


def _number(text: str, kind: type[int] | type[float]) -> float:
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of ``ringcore-run``."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Start N copies of COMMAND as the ranks of one ringcore job on this host,\n"
        "prefix their output, and stop them all as soon as one of them fails.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    add = parser.add_argument
    add("-np", "-n", "--np", dest="size", type=_positive_int, required=True, metavar="N", help=_NP_HELP)
    add("--addr", default="127.0.0.1", help="rendezvous address given to the ranks (default: %(default)s)")
    add("--port", type=_port, default=None, help="rendezvous port (default: a free local port)")
    add("--no-prefix", action="store_true", help="do not prefix output lines with [rank]<stream>:")
    add("--grace", type=_seconds, default=3.0, metavar="SECONDS", help="SIGTERM to SIGKILL delay (default 3)")
    add("--timeout", type=_seconds, default=0.0, metavar="SECONDS", help="wall-clock limit; 0 = none")
    add(
        "--bind-to",
        choices=("core", "none"),
        default=os.environ.get("RINGCORE_BIND_TO", "core"),
        help="core (default; RINGCORE_BIND_TO sets it): rank r runs on the r-th equal share of "
        "the usable CPUs, or on CPU r mod CPUs when ranks outnumber them; none: let the "
        "scheduler place the ranks",
    )
    add("command", nargs=argparse.REMAINDER, help="the program to run and its arguments (after -- if needed)")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> Options:
    """Parse the command line; exit 2 with a usage message when it is wrong.

    Args:
        argv: Arguments without the program name; ``None`` reads ``sys.argv``.

    Returns:
        The options, with a concrete port chosen when ``--port`` was not given.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.bind_to not in ("core", "none"):
        parser.error(f"RINGCORE_BIND_TO must be core or none, got {args.bind_to!r}")
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        parser.error("no command given; e.g. ringcore-run -np 2 python train.py")
    port = args.port if args.port is not None else find_free_port()
    return Options(
        args.size,
        args.addr,
        port,
        not args.no_prefix,
        args.grace,
        args.timeout,
        command,
        bind=args.bind_to == "core",
    )


def find_free_port() -> int:
    """Return a TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def torch_port(port: int) -> int:
    """A free port for torch's store: not ``port`` (ringcore's), nor ``port - 1`` (whose + 1 is ringcore's)."""
    while (candidate := find_free_port()) in (port, port - 1):
        pass
    return candidate


def rank_env(base: Mapping[str, str], options: Options, rank: int) -> dict[str, str]:
    """Return the environment of ``rank``: ``base`` plus the ``RINGCORE_*`` identity and torch's variables.

    Args:
        base: The launcher's environment.
        options: The job's options.
        rank: The rank, in ``0..options.size - 1``.
    """
    env = dict(base)
    env.update(
        RINGCORE_SECRET=options.secret,
        RINGCORE_RANK=str(rank),
        RINGCORE_SIZE=str(options.size),
        RINGCORE_LOCAL_RANK=str(rank),
        RINGCORE_LOCAL_SIZE=str(options.size),
        RINGCORE_ADDR=options.addr,
        RINGCORE_PORT=str(options.port),
        PYTHONUNBUFFERED="1",
    )
    torch_vars = {
        "RANK": rank,
        "WORLD_SIZE": options.size,
        "LOCAL_RANK": rank,
        "LOCAL_WORLD_SIZE": options.size,
        "MASTER_ADDR": options.addr,
        "MASTER_PORT": options.master_port,
    }
    for name, value in torch_vars.items():
        env.setdefault(name, str(value))
    return env


# --------------------------------------------------------------------------- output


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

    def rank_line(self, rank: int, stream: str, line: bytes) -> None:
        """Write one line that ``rank`` printed on ``stream`` (``"stdout"``/``"stderr"``)."""
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


# --------------------------------------------------------------------------- ranks


class LaunchError(Exception):
    """The command could not be started; ``code`` is the launcher's exit code."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class Job:
    """The running ranks: their processes, output pumps and exit events."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.procs: list[subprocess.Popen[bytes]] = []
        self.exits: dict[int, int] = {}
        self._events: queue.Queue[tuple[int, int]] = queue.Queue()
        self._threads: list[threading.Thread] = []

    def start(self, options: Options) -> None:
        """Start every rank; on failure stop those already started and raise.

        Raises:
            LaunchError: The command was not found or is not executable.
        """
        cores = rank_cores(options.size) if options.bind else None
        for rank in range(options.size):
            try:
                with _bound_to(cores[rank] if cores else None):
                    proc = _spawn(options, rank)
            except LaunchError:
                self.stop(options.grace)
                raise
            self.procs.append(proc)
            self._watch(rank, proc)

    def _watch(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        self._thread(_pump, proc.stdout, self.sink, rank, "stdout")
        self._thread(_pump, proc.stderr, self.sink, rank, "stderr")
        self._thread(self._wait, rank, proc)

    def _thread(self, target: Callable[..., None], *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _wait(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        # One waiter per rank: events reach the queue in the order ranks exited.
        self._events.put((rank, proc.wait()))

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
        targets = [rank for rank in range(len(self.procs)) if self._alive(rank)]
        self._signal(targets, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(map(self._alive, targets)):
            self.collect(POLL_SECONDS)
        self._signal([rank for rank in targets if self._alive(rank)], signal.SIGKILL)
        while not self.done():
            self.collect(POLL_SECONDS)

    def _signal(self, ranks: list[int], signum: int) -> None:
        for rank in ranks:
            with contextlib.suppress(ProcessLookupError, PermissionError):  # group already gone
                os.killpg(self.procs[rank].pid, signum)

    def _alive(self, rank: int) -> bool:
        # Once the leader is reaped its PID stays reserved while its group has members.
        return rank not in self.exits or _group_alive(self.procs[rank].pid)

    def join(self, timeout: float = DRAIN_SECONDS) -> None:
        """Wait (bounded) for the output pumps to drain what the ranks left."""
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))


def rank_cores(size: int) -> list[set[int]]:
    """Each rank's CPUs: disjoint equal shares of the usable CPUs, or one each, round robin, when crowded."""
    usable = sorted(os.sched_getaffinity(0))
    if size > len(usable):
        return [{usable[rank % len(usable)]} for rank in range(size)]
    share = len(usable) // size
    return [set(usable[rank * share : (rank + 1) * share]) for rank in range(size)]


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


def _spawn(options: Options, rank: int) -> subprocess.Popen[bytes]:
    try:
        return subprocess.Popen(
            options.command,
            env=rank_env(os.environ, options, rank),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
    except FileNotFoundError:
        raise LaunchError(f"command not found: {options.command[0]}", EXIT_NOT_FOUND) from None
    except PermissionError:
        raise LaunchError(f"permission denied: {options.command[0]}", EXIT_NOT_EXECUTABLE) from None
    except OSError as exc:
        raise LaunchError(f"cannot start {options.command[0]}: {exc}", EXIT_NOT_EXECUTABLE) from None


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


def _stopped_suffix(ranks: list[int]) -> str:
    if not ranks:
        return ""
    return "; stopped ranks " + ", ".join(str(rank) for rank in ranks)


def supervise(job: Job, options: Options, catcher: SignalCatcher) -> int:
    """Wait for the ranks; stop them all on the first failure, timeout or signal.

    Returns:
        The launcher's exit code.
    """
    deadline = time.monotonic() + options.timeout if options.timeout > 0 else None
    while not job.done():
        failure = next(((rank, rc) for rank, rc in job.collect(POLL_SECONDS) if rc != 0), None)
        if failure is not None:
            how, code = describe_exit(failure[1])
            return _stop(job, options, f"rank {failure[0]} {how}", code)
        if catcher.signum is not None:
            name = signal.Signals(catcher.signum).name
            return _stop(job, options, f"received {name}", 128 + catcher.signum)
        if deadline is not None and time.monotonic() >= deadline:
            reason = f"job exceeded --timeout {options.timeout:g}s"
            return _stop(job, options, reason, EXIT_TIMEOUT)
    return 0


def _stop(job: Job, options: Options, reason: str, code: int) -> int:
    stopped = job.stop(options.grace)
    job.sink.message(reason + _stopped_suffix(stopped))
    return code


def main(argv: list[str] | None = None) -> int:
    """Run ``ringcore-run``; see the module docstring.

    Args:
        argv: Arguments without the program name; ``None`` reads ``sys.argv``.

    Returns:
        The exit code: 0, the first failing rank's code, 124, 126, 127, 130 or 143.
    """
    options = parse_args(argv)
    sink = Sink(sys.stdout, sys.stderr, options.prefix)
    job = Job(sink)
    with SignalCatcher().installed() as catcher:
        try:
            job.start(options)
        except LaunchError as exc:
            job.join()
            sink.message(str(exc))
            return exc.code
        code = supervise(job, options, catcher)
        job.terminate(options.grace)
    job.join()
    return code


if __name__ == "__main__":
    sys.exit(main())
