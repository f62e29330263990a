"""The ``ringcore-run`` command line: its flags, their checks, the ``--help`` text, and :class:`Options`.

:func:`parse_args` turns ``sys.argv`` into one frozen :class:`Options`, or
exits 2 with argparse's usage line and a message that says what to write
instead. Everything that depends on the command line alone is decided here,
before any process starts:

- the command (after ``--`` if needed) and the number of ranks: ``-np``, or
  all the slots of ``-H``/``--hostfile`` (:func:`ringcore.hosts.placement`);
- the rendezvous port (``--port``, default a free local port) and torch's
  ``MASTER_PORT``, a second free port that is neither that port nor the one
  below it (:func:`torch_port`);
- ``-x VAR[=VALUE]``: a ``VAR`` this environment lacks is skipped with a warning;
- ``--bind-to`` (``RINGCORE_BIND_TO`` sets its default; ``core`` or ``none``);
- ``--aslr`` (``RINGCORE_ASLR`` sets its default; ``auto``, ``on`` or ``off``);
- the elastic options (:class:`~ringcore.elastic_workers.ElasticOptions`):
  any of ``--min-np``, ``--max-np``, ``--host-discovery-script`` makes the job
  elastic; ``--elastic-timeout`` and ``--failure-cooldown`` need one of them,
  a discovery script names the hosts itself (no ``-H``/``--hostfile``), and
  ``--min-np`` <= ``-np`` <= ``--max-np``.

The rendezvous address that ``-H``/``--hostfile`` leave to the launcher is
found later, when launching (:func:`ringcore.run.find_rendezvous`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import secrets
import shlex
import socket
import sys
from collections.abc import Sequence
from typing import Literal

from ringcore import hosts
from ringcore.config import Settings
from ringcore.elastic_workers import ElasticOptions
from ringcore.errors import ConfigError
from ringcore.processes import PROG
from ringcore.rank_agent import ASLR_CHOICES
from ringcore.remote import SshOptions

_VARIABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

_NP_HELP = "number of ranks to start (required without -H/--hostfile; with them, all their slots)"
_EPILOG = """\
examples:
  ringcore-run -np 4 python train.py --lr 0.1
  ringcore-run -n 2 --timeout 600 -- python -m mypkg.train
  ringcore-run --np 8 --no-prefix python bench.py > bench.log
  ringcore-run -np 8 -H hostA:4,hostB:4 -x LD_LIBRARY_PATH -x OMP_NUM_THREADS=4 python train.py
  ringcore-run --hostfile hosts.txt --network-interface eth0 --ssh-port 2222 python train.py
  ringcore-run -np 4 --min-np 2 --max-np 4 python train.py            # elastic (ringcore.elastic)
  ringcore-run --min-np 2 --max-np 8 --host-discovery-script ./discover.sh python train.py

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
Elastic: 0 when every rank of the last generation exits 0; otherwise the first
failing worker's code once fewer than --min-np are left (after --elastic-timeout
when a discovery script may add more).
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
        bind: Bind each rank to its CPUs (:func:`ringcore.rank_agent.rank_cores`).
        aslr: ``auto``, ``on`` or ``off``: which ranks start without address-space randomization
            (:func:`ringcore.rank_agent.fixed_layout`).
        secret: The job's RINGCORE_SECRET: the launcher's own if set, else a fresh random one.
        master_port: torch's ``MASTER_PORT`` for every rank; 0 picks a free port other than ``port``.
        slots: Where each rank runs (``-H``/``--hostfile``); empty: every rank on this host.
        exports: ``-x`` variables as ``(name, value)``.
        ifname: ``--network-interface``: handed to the ranks as ``RINGCORE_IFNAME``.
        ssh: How to reach the other hosts.
        elastic: ``--min-np``/``--max-np``/``--host-discovery-script``; ``None``: a fixed job.
    """

    size: int
    addr: str
    port: int
    prefix: bool
    grace: float
    timeout: float
    command: list[str]
    bind: bool = True
    aslr: Literal["auto", "on", "off"] = "auto"
    secret: str = dataclasses.field(
        default_factory=lambda: os.environ.get("RINGCORE_SECRET") or secrets.token_hex(32), repr=False
    )
    master_port: int = 0
    slots: tuple[hosts.Slot, ...] = ()
    exports: tuple[tuple[str, str], ...] = ()
    ifname: str | None = None
    ssh: SshOptions = dataclasses.field(default_factory=SshOptions)
    elastic: ElasticOptions | None = None

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
    add(
        "--aslr",
        choices=ASLR_CHOICES,
        default=os.environ.get("RINGCORE_ASLR", "auto"),
        help="auto (default; RINGCORE_ASLR sets it): ranks that outnumber the CPUs start without "
        "address-space randomization (as setarch -R), one layout for all, so ranks taking turns on "
        "a core share branch predictions (4 ranks on 2 CPUs: a 4 KiB allreduce in 19 us, not 33); "
        "their addresses are then predictable. off: every job so; on: every rank randomized",
    )
    _add_host_options(parser)
    _add_elastic_options(parser)
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


def _add_elastic_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "elastic training (ringcore.elastic)",
        "any of --min-np, --max-np, --host-discovery-script makes the job elastic: a lost\n"
        "worker (rank 0 too) is survived while --min-np remain, and new workers join at the\n"
        "next commit; workers, not ranks, are numbered in the output",
    )
    add = group.add_argument
    add("--min-np", type=_positive_int, metavar="N", help="fewest workers to go on with (default: -np)")
    add(
        "--max-np",
        type=_positive_int,
        metavar="N",
        help="most workers at once (default: -np; with a discovery script, all its slots)",
    )
    add(
        "--host-discovery-script",
        metavar="CMD",
        help="shell command printing 'host:slots' lines, run every second; new slots get workers",
    )
    add(
        "--elastic-timeout",
        type=_seconds,
        metavar="SECONDS",
        help="bound on each rendezvous and on running below --min-np (default 60)",
    )
    add(
        "--failure-cooldown",
        type=_seconds,
        metavar="SECONDS",
        help="a host where a worker failed gets no new one for this long, doubled per failure (default 10)",
    )


def _elastic_options(
    parser: argparse.ArgumentParser, args: argparse.Namespace, size: int
) -> ElasticOptions | None:
    """The elastic options, checked against ``size`` (0: from the discovery script); ``None``: a fixed job."""
    if args.min_np is None and args.max_np is None and args.host_discovery_script is None:
        for flag, value in (
            ("--elastic-timeout", args.elastic_timeout),
            ("--failure-cooldown", args.failure_cooldown),
        ):
            if value is not None:
                parser.error(f"{flag} needs elastic mode: --min-np, --max-np or --host-discovery-script")
        return None
    min_np = args.min_np if args.min_np is not None else max(size, 1)
    max_np = args.max_np if args.max_np is not None else (None if args.host_discovery_script else size)
    if size and min_np > size:
        parser.error(f"--min-np {min_np} is more than -np {size}")
    if max_np is not None and (size > max_np or min_np > max_np):
        parser.error(
            f"--max-np {max_np} is less than {'-np' if size > max_np else '--min-np'} {max(size, min_np)}"
        )
    return ElasticOptions(
        min_np,
        max_np,
        args.host_discovery_script,
        60.0 if args.elastic_timeout is None else args.elastic_timeout,
        10.0 if args.failure_cooldown is None else args.failure_cooldown,
    )


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
    if args.aslr not in ASLR_CHOICES:
        parser.error(f"RINGCORE_ASLR must be auto, on or off, got {args.aslr!r}")
    exports = _exports(parser, args.exports)
    try:  # every rank reads this environment (and -x's): a bad value is said once here, not by every rank
        Settings.from_env({**os.environ, **dict(exports)})
    except ConfigError as err:
        parser.error(f"{err} (in the environment every rank gets)")
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        parser.error("no command given; e.g. ringcore-run -np 2 python train.py")
    if args.host_discovery_script is not None and (args.hosts or args.hostfile):
        parser.error("--host-discovery-script names the hosts: leave out -H/--hostfile")
    try:
        if args.host_discovery_script is not None:
            size, slots = args.size or 0, ()
        else:
            size, slots = hosts.placement(args.size, args.hosts, args.hostfile)
    except hosts.HostError as err:
        parser.error(str(err))
    elastic = _elastic_options(parser, args, size)
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
        aslr=args.aslr,
        slots=slots,
        exports=exports,
        ifname=args.network_interface,
        ssh=SshOptions(args.ssh_port, args.ssh_identity_file, tuple(shlex.split(args.ssh_args))),
        elastic=elastic,
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
