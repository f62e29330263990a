"""``ringcore-run``: start N copies of a command as the ranks of one job.

Usage::

    ringcore-run -np 4 python train.py --lr 0.1
    python -m ringcore.run -np 2 -- python -c "import os; print(os.environ['RINGCORE_RANK'])"
    ringcore-run -np 8 -H hostA:4,hostB:4 -x LD_LIBRARY_PATH python train.py

Every rank ``r`` in ``0..N-1`` runs the command with the launcher's
environment plus:

- ``RINGCORE_RANK=r`` and ``RINGCORE_LOCAL_RANK=r``
- ``RINGCORE_SIZE=N`` and ``RINGCORE_LOCAL_SIZE=N`` (all ranks run on this host;
  across hosts: the rank's place among its host's ranks, and their number)
- ``RINGCORE_ADDR`` and ``RINGCORE_PORT``: where the ranks rendezvous
  (``--addr``, default ``127.0.0.1``, across hosts the first host's address;
  ``--port``, default a free local port)
- ``RINGCORE_IFNAME`` with ``--network-interface``; what ``-x`` names
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

Across hosts (``-H hostA:4,hostB:4``, ``--hostfile FILE``; :mod:`ringcore.hosts`):
ranks fill the hosts' slots in order, ``-np`` defaults to all of them. Ranks
on this machine start as above, the others over ssh (:mod:`ringcore.remote`,
:mod:`ringcore.rank_agent`), with the job's secret on the session's stdin.
They get ``RINGCORE_*`` (the launcher's too), torch's variables and ``-x``
on top of the remote login's environment. Stopping a remote rank closes its
session's stdin: the agent sends the rank's process group SIGTERM, SIGKILL
after ``--grace``, and reports, which the launcher awaits up to
``REMOTE_SLACK`` s more. Messages name the host: ``rank 5 on hostB was
killed by signal SIGKILL (9)``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import queue
import re
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import BinaryIO, TextIO

from ringcore import hosts, remote
from ringcore.rank_agent import rank_cores
from ringcore.remote import RemoteError, RemoteRank, SshOptions

PROG = "ringcore-run"
EXIT_TIMEOUT = 124
EXIT_NOT_EXECUTABLE = 126
EXIT_NOT_FOUND = 127
EXIT_SSH = 255  # as ssh itself: a host that cannot be reached or asked
POLL_SECONDS = 0.05
# Seconds past --grace that a remote rank's agent has to stop it and report.
REMOTE_SLACK = 3.0
TORCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_VARIABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Bound on waiting for output after all ranks are gone: a grandchild that left
# the rank's process group may still hold a pipe open.
DRAIN_SECONDS = 5.0

_NP_HELP = "number of ranks to start (required without -H/--hostfile; with them, all their slots)"
_EPILOG = """\
examples:
  ringcore-run -np 4 python train.py --lr 0.1
  ringcore-run -n 2 --timeout 600 -- python -m mypkg.train
  ringcore-run --np 8 --no-prefix python bench.py > bench.log
  ringcore-run -np 8 -H hostA:4,hostB:4 -x LD_LIBRARY_PATH -x OMP_NUM_THREADS=4 python train.py
  ringcore-run --hostfile hosts.txt --network-interface eth0 --ssh-port 2222 python train.py

across hosts: ranks fill the hosts' slots in order (hostfile lines: 'hostA slots=4').
Ranks on other hosts start over ssh in batch mode (keys, no passwords), run in
this directory when it exists there, and need python3 on the remote PATH; they
get the remote login's environment plus RINGCORE_*, torch's variables and -x.
The job's secret travels on the ssh session's stdin, never on a command line,
so remote ranks read /dev/null on stdin. The rendezvous address is the first
host's (--network-interface: that interface's address there).

exit status: 0 when every rank exits 0; otherwise the first failing rank's
exit code (128+N when it was killed by signal N), 124 on --timeout, 127 when
the command is not found, 130/143 when the launcher gets SIGINT/SIGTERM,
ssh's code (255) when a remote rank's ssh fails or no rendezvous address is found.
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
        slots: Where each rank runs (``-H``/``--hostfile``); empty: every rank on this host.
        exports: ``-x`` variables as ``(name, value)``.
        ifname: ``--network-interface``: handed to the ranks as ``RINGCORE_IFNAME``.
        ssh: How to reach the other hosts.
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
    slots: tuple[hosts.Slot, ...] = ()
    exports: tuple[tuple[str, str], ...] = ()
    ifname: str | None = None
    ssh: SshOptions = dataclasses.field(default_factory=SshOptions)

    def __post_init__(self) -> None:
        if self.master_port == 0:
            object.__setattr__(self, "master_port", torch_port(self.port))

    def slot(self, rank: int) -> hosts.Slot:
        """Where ``rank`` runs; without ``-H``/``--hostfile``, on this host with every other rank."""
        if self.slots:
            return self.slots[rank]
        return hosts.Slot(rank, "localhost", rank, self.size, local=True)


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
        description="Start N copies of COMMAND as the ranks of one ringcore job on this host\n"
        "(or across hosts, over ssh: -H, --hostfile), prefix their output, and stop them\n"
        "all as soon as one of them fails.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    add = parser.add_argument
    add("-np", "-n", "--np", dest="size", type=_positive_int, metavar="N", help=_NP_HELP)
    add(
        "--addr",
        help="rendezvous address given to the ranks (default: 127.0.0.1; with -H/--hostfile, "
        "the first host's address as the other hosts reach it)",
    )
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
    _add_host_options(parser)
    add("command", nargs=argparse.REMAINDER, help="the program to run and its arguments (after -- if needed)")
    return parser


def _add_host_options(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "-H",
        "--host",
        dest="hosts",
        metavar="HOST:N,...",
        help="run across hosts, N ranks (slots) each, e.g. -H hostA:4,hostB:4 (N defaults to 1)",
    )
    where.add_argument("--hostfile", metavar="FILE", help="hosts from FILE, one 'host slots=N' a line")
    add = parser.add_argument
    add(
        "-x",
        dest="exports",
        action="append",
        default=[],
        metavar="VAR[=VALUE]",
        help="give every rank VAR (this environment's value, or VALUE), as mpirun -x; repeatable",
    )
    add(
        "--network-interface",
        metavar="NIC",
        help="interface the ranks use (RINGCORE_IFNAME); the rendezvous address is its address on the first host",
    )
    add("--ssh-port", type=_port, metavar="PORT", help="ssh port of the hosts (default: ssh's)")
    add("--ssh-identity-file", metavar="FILE", help="private key for ssh (default: ssh's)")
    add("--ssh-args", default="", metavar="ARGS", help="more ssh arguments, e.g. '-F ~/.ssh/cluster.conf'")


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
    try:
        size, slots = hosts.placement(args.size, args.hosts, args.hostfile)
    except hosts.HostError as err:
        parser.error(str(err))
    if args.network_interface is not None and not re.fullmatch(r"[^\s,/]+", args.network_interface):
        parser.error(f"--network-interface {args.network_interface!r}: give one interface name, e.g. eth0")
    port = args.port if args.port is not None else find_free_port()
    return Options(
        size,
        args.addr or ("" if slots else "127.0.0.1"),
        port,
        not args.no_prefix,
        args.grace,
        args.timeout,
        command,
        bind=args.bind_to == "core",
        slots=slots,
        exports=_exports(parser, args.exports),
        ifname=args.network_interface,
        ssh=SshOptions(args.ssh_port, args.ssh_identity_file, tuple(shlex.split(args.ssh_args))),
    )


def _exports(parser: argparse.ArgumentParser, items: list[str]) -> tuple[tuple[str, str], ...]:
    """``-x VAR`` / ``-x VAR=VALUE`` as pairs; a VAR this environment lacks is skipped with a warning."""
    found = []
    for item in items:
        name, equals, value = item.partition("=")
        if not _VARIABLE.fullmatch(name):
            parser.error(f"-x {item!r}: write -x VAR or -x VAR=VALUE")
        if equals:
            found.append((name, value))
        elif name in os.environ:
            found.append((name, os.environ[name]))
        else:
            print(f"{PROG}: warning: -x {name}: not set here, not forwarded", file=sys.stderr)
    return tuple(found)


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
    slot = options.slot(rank)
    env = dict(base)
    env.update(options.exports)
    env.update(
        RINGCORE_SECRET=options.secret,
        RINGCORE_RANK=str(rank),
        RINGCORE_SIZE=str(options.size),
        RINGCORE_LOCAL_RANK=str(slot.local_rank),
        RINGCORE_LOCAL_SIZE=str(slot.local_size),
        RINGCORE_ADDR=options.addr,
        RINGCORE_PORT=str(options.port),
        PYTHONUNBUFFERED="1",
    )
    if options.ifname:
        env["RINGCORE_IFNAME"] = options.ifname
    torch_values = (rank, options.size, slot.local_rank, slot.local_size, options.addr, options.master_port)
    for name, value in zip(TORCH_VARS, torch_values, strict=True):
        env.setdefault(name, str(value))
    return env


def remote_env(options: Options, rank: int) -> dict[str, str]:
    """What a remote ``rank`` adds to its login's environment: :func:`rank_env` less the launcher's own."""
    keep = {*TORCH_VARS, "PYTHONUNBUFFERED", *(name for name, _ in options.exports)}
    env = rank_env(os.environ, options, rank)
    return {name: value for name, value in env.items() if name.startswith("RINGCORE_") or name in keep}


def find_rendezvous(options: Options) -> Options:
    """Fill in the rendezvous address that ``-H``/``--hostfile`` left to the launcher
    (:func:`ringcore.hosts.rendezvous_address`).

    Raises:
        LaunchError: The address cannot be found (exit 255, as ssh's).
    """
    if options.addr:
        return options
    ask = functools.partial(remote.interface_address, ssh=options.ssh)
    try:
        addr = hosts.rendezvous_address(options.slots, options.ifname, ask)
    except (hosts.HostError, RemoteError) as err:
        raise LaunchError(f"no rendezvous address: {err}", EXIT_SSH) from None
    return dataclasses.replace(options, addr=addr)


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
    """The running ranks: their processes (a local rank's own, a remote rank's ssh), output pumps and exit events."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.procs: list[subprocess.Popen[bytes]] = []
        self.exits: dict[int, int] = {}
        self.remote: dict[int, RemoteRank] = {}
        self.hosts: dict[int, str] = {}  # rank -> host, when -H/--hostfile named them
        self._marker = f"\0ringcore-rank-{secrets.token_hex(4)}:"  # the agents' reports (ringcore.rank_agent)
        self._events: queue.Queue[tuple[int, int]] = queue.Queue()
        self._threads: list[threading.Thread] = []

    def start(self, options: Options, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Start every rank; on failure stop those already started and raise.

        Args:
            options: The job.
            should_stop: Polled while remote starts wait for room (:data:`ringcore.remote.MAX_STARTUPS`
                per host); true (the launcher got a signal): start no more ranks.

        Raises:
            LaunchError: The command (or ssh) was not found or is not executable.
        """
        slots = [options.slot(rank) for rank in range(options.size)]
        shares = {
            slot.local_size: rank_cores(slot.local_size) for slot in slots if slot.local and options.bind
        }
        for slot in slots:
            if options.slots:
                self.hosts[slot.rank] = slot.host
            try:
                if slot.local:
                    with _bound_to(shares[slot.local_size][slot.local_rank] if options.bind else None):
                        proc = _spawn(options, slot.rank)
                    self.procs.append(proc)
                    self._watch(slot.rank, proc)
                elif self._startup_room(slot.host, should_stop):
                    self._start_remote(options, slot)
                else:
                    return
            except LaunchError:
                self.stop(options.grace)
                raise

    def _watch(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        self._thread(_pump, proc.stdout, self.sink, rank, "stdout")
        self._thread(_pump, proc.stderr, self.sink, rank, "stderr")
        self._thread(self._wait, rank, proc)

    def _start_remote(self, options: Options, slot: hosts.Slot) -> None:
        job = {
            "marker": self._marker,
            "env": remote_env(options, slot.rank),
            "argv": options.command,
            "cwd": os.getcwd(),
            "grace": options.grace,
            "bind": [slot.local_rank, slot.local_size] if options.bind else None,
        }
        try:
            rank = RemoteRank.start(slot.rank, slot.host, options.ssh, job)
        except RemoteError as err:
            raise LaunchError(str(err), EXIT_NOT_FOUND) from None
        self.procs.append(rank.proc)
        self.remote[slot.rank] = rank
        self._thread(_pump, rank.proc.stdout, self.sink, slot.rank, "stdout")
        stderr = self._thread(rank.pump_stderr, functools.partial(self.sink.rank_line, slot.rank, "stderr"))
        self._thread(self._wait_remote, rank, stderr)

    def _startup_room(self, host: str, should_stop: Callable[[], bool]) -> bool:
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
        where = f"rank {rank} on {self.hosts[rank]}" if rank in self.hosts else f"rank {rank}"
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
        targets = [rank for rank in range(len(self.procs)) if self._alive(rank)]
        self._signal(targets, signal.SIGTERM)
        self._await(targets, grace)
        self._signal(
            [rank for rank in targets if self._alive(rank) and rank not in self.remote], signal.SIGKILL
        )
        # A remote rank's agent kills it after its own grace and reports; ssh goes only if it never does.
        self._await([rank for rank in targets if rank in self.remote], REMOTE_SLACK)
        self._signal([rank for rank in targets if self._alive(rank)], signal.SIGKILL)
        while not self.done():
            self.collect(POLL_SECONDS)

    def _await(self, ranks: list[int], seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and any(map(self._alive, ranks)):
            self.collect(POLL_SECONDS)

    def _signal(self, ranks: list[int], signum: int) -> None:
        for rank in ranks:
            if rank in self.remote:
                # SIGTERM: close the session's stdin, the agent stops the rank; SIGKILL: kill ssh.
                (self.remote[rank].stop if signum == signal.SIGTERM else self.remote[rank].kill)()
                continue
            with contextlib.suppress(ProcessLookupError, PermissionError):  # group already gone
                os.killpg(self.procs[rank].pid, signum)

    def _alive(self, rank: int) -> bool:
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
            how, code = job.describe(*failure)
            return _stop(job, options, how, code)
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
        The exit code: 0, the first failing rank's code, 124, 126, 127, 130, 143 or 255.
    """
    options = parse_args(argv)
    sink = Sink(sys.stdout, sys.stderr, options.prefix)
    job = Job(sink)
    with SignalCatcher().installed() as catcher:
        try:
            options = find_rendezvous(options)
            job.start(options, lambda: catcher.signum is not None)
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
