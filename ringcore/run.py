"""``ringcore-run``: start N copies of a command as the ranks of one job.

Usage::

    ringcore-run -np 4 python train.py --lr 0.1
    python -m ringcore.run -np 2 -- python -c "import os; print(os.environ['RINGCORE_RANK'])"
    ringcore-run -np 8 -H hostA:4,hostB:4 -x LD_LIBRARY_PATH python train.py

The command line (its flags, their checks, ``--help``) is
:mod:`ringcore.run_options`; this module starts the job and watches it.

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
launcher may use (Open MPI binds small jobs too): a rank the scheduler leaves
on its peer's core makes small allreduces several times slower. A share keeps
all its CPUs (a rank's own threads, e.g. torch's, still spread over them).
With more ranks than CPUs, rank ``r`` is bound to CPU ``r mod CPUs`` (round
robin, as Open MPI's ``--map-by core --bind-to core:overload-allowed``): ranks
the scheduler moves between cores run on cold caches (measured:
``bench/HISTORY.md``, "Crowded ranks bound round robin").
``--bind-to none`` never binds.

Address layout (``--aslr``, ``RINGCORE_ASLR`` sets its default): with ``auto``, the
default, ranks that outnumber the CPUs of their host (its affinity mask; a
container's CPU quota does not count) start without address-space
randomization (``personality(ADDR_NO_RANDOMIZE)``, as ``setarch -R``), so every
rank has the interpreter's code at the same addresses. Ranks that take turns on
one core then most likely keep each other's branch predictions warm instead of
evicting them (the VM measured has no counters to show it; ``bench/layout_turns.py``
shows the effect without ringcore): at N=4 on 2 CPUs a 4 KiB allreduce takes
19 us against 33 with each rank laid out at random, 1 MiB 0.88x the time
(``bench/HISTORY.md``, "One address layout for crowded ranks"). With a core per
rank nothing is shared and ``auto`` leaves the ranks as the launcher runs.
``off`` starts every job without randomization, ``on`` every job with it. The
price is that defence against memory-corruption exploits: such ranks, and every
process they start, have addresses that are the same in every rank and every
run, and can be worked out offline. A host that must keep it says ``--aslr on``.
Where the kernel refuses the change (Docker's default seccomp profile), the
launcher says so once and starts the ranks as it runs itself.

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

Elastic mode (``--min-np``, ``--max-np``, ``--host-discovery-script``;
:mod:`ringcore.elastic_driver`): the launcher serves the job's store at
``RINGCORE_ADDR:RINGCORE_PORT`` and starts *workers* instead of ranks. Each
gets ``RINGCORE_ELASTIC_WORKER`` (its number, which prefixes its output),
the secret, ``RINGCORE_INIT_TIMEOUT`` (``--elastic-timeout`` unless set) and
what ``-x`` names, but no rank: ``ringcore.elastic`` asks the launcher for
one in every generation. Losing a worker, rank 0's included, is survived
while at least ``--min-np`` remain.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

from ringcore import elastic_driver, hosts, remote
from ringcore.config import Settings
from ringcore.elastic_workers import ElasticOptions
from ringcore.errors import RingcoreError
from ringcore.processes import (
    EXIT_NOT_EXECUTABLE,
    EXIT_NOT_FOUND,
    POLL_SECONDS,
    Job,
    LaunchError,
    SignalCatcher,
    Sink,
    describe_exit,
    stopped_suffix,
)
from ringcore.rank_agent import fixed_layout, rank_cores
from ringcore.remote import RemoteError
from ringcore.run_options import Options, parse_args

__all__ = [
    "EXIT_NOT_EXECUTABLE",
    "EXIT_NOT_FOUND",
    "Job",
    "LaunchError",
    "Options",
    "SignalCatcher",
    "Sink",
    "describe_exit",
    "main",
    "parse_args",
    "rank_cores",
    "rank_env",
    "start_ranks",
]

EXIT_TIMEOUT = 124
EXIT_SSH = 255  # as ssh itself: a host that cannot be reached or asked
TORCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


# --------------------------------------------------------------------------- environments


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
    return _for_remote(options, rank_env(os.environ, options, rank))


def _for_remote(options: Options, env: Mapping[str, str]) -> dict[str, str]:
    keep = {*TORCH_VARS, "PYTHONUNBUFFERED", *(name for name, _ in options.exports)}
    return {name: value for name, value in env.items() if name.startswith("RINGCORE_") or name in keep}


def worker_env(base: Mapping[str, str], options: Options, worker: Mapping[str, str]) -> dict[str, str]:
    """The environment of an elastic job's worker: ``base``, ``-x``, the launcher's store, the secret, ``worker``.

    No rank, size or torch variables: the worker learns its rank from the launcher, generation by
    generation (:mod:`ringcore.elastic_rendezvous`).
    """
    env = {name: value for name, value in base.items() if name not in _IDENTITY}
    env.update(options.exports)
    env.update(
        RINGCORE_SECRET=options.secret,
        RINGCORE_ADDR=options.addr,
        RINGCORE_PORT=str(options.port),
        PYTHONUNBUFFERED="1",
    )
    if options.elastic is not None:
        env.setdefault("RINGCORE_INIT_TIMEOUT", f"{options.elastic.timeout:g}")
    if options.ifname:
        env["RINGCORE_IFNAME"] = options.ifname
    env.update(worker)
    return env


_IDENTITY = ("RINGCORE_RANK", "RINGCORE_SIZE", "RINGCORE_LOCAL_RANK", "RINGCORE_LOCAL_SIZE")


def start_worker(job: Job, options: Options, seat: hosts.Slot, worker: dict[str, str]) -> int:
    """Start one worker of an elastic job on ``seat`` (its slot on its host); return its number."""
    env = worker_env(os.environ, options, worker)
    if seat.local:
        cpus = rank_cores(seat.local_size)[seat.local_rank] if options.bind else None
        named = bool(options.slots) or (options.elastic is not None and options.elastic.discovery is not None)
        fixed = fixed_layout(options.aslr, seat.local_size)
        return job.start_local(options.command, env, cpus, seat.host if named else None, fixed)
    return job.start_remote(seat.host, options.ssh, remote_job(options, seat, _for_remote(options, env)))


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


# --------------------------------------------------------------------------- ranks


def start_ranks(job: Job, options: Options, should_stop: Callable[[], bool] = lambda: False) -> None:
    """Start every rank; on failure stop those already started and raise.

    Args:
        job: Where the ranks go; rank ``r`` is the job's process ``r``.
        options: The job.
        should_stop: Polled while remote starts wait for room (:data:`ringcore.remote.MAX_STARTUPS`
            per host); true (the launcher got a signal): start no more ranks.

    Raises:
        LaunchError: The command (or ssh) was not found or is not executable.
    """
    slots = [options.slot(rank) for rank in range(options.size)]
    shares = {slot.local_size: rank_cores(slot.local_size) for slot in slots if slot.local and options.bind}
    for slot in slots:
        try:
            if slot.local:
                cpus = shares[slot.local_size][slot.local_rank] if options.bind else None
                env = rank_env(os.environ, options, slot.rank)
                fixed = fixed_layout(options.aslr, slot.local_size)
                job.start_local(options.command, env, cpus, slot.host if options.slots else None, fixed)
            elif job.startup_room(slot.host, should_stop):
                job.start_remote(
                    slot.host, options.ssh, remote_job(options, slot, remote_env(options, slot.rank))
                )
            else:
                return
        except LaunchError:
            job.stop(options.grace)
            raise


def remote_job(options: Options, slot: hosts.Slot, env: dict[str, str]) -> dict[str, Any]:
    """What a remote process's agent is told (:mod:`ringcore.rank_agent`), less the job's marker."""
    return {
        "env": env,
        "argv": options.command,
        "cwd": os.getcwd(),
        "grace": options.grace,
        "bind": [slot.local_rank, slot.local_size] if options.bind else None,
        "aslr": [options.aslr, slot.local_size],
    }


# --------------------------------------------------------------------------- supervision


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
    job.sink.message(reason + stopped_suffix(stopped))
    if job.sink.missing_ringcore:
        job.sink.message(
            f"the ranks' {options.command[0]!r} cannot import ringcore; activate the environment it is "
            f"installed in, or give that Python's path (this launcher runs {sys.executable})"
        )
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
    job = Job(sink, "rank" if options.elastic is None else "worker")
    with SignalCatcher().installed() as catcher:
        try:
            options = find_rendezvous(options)
            if options.elastic is not None:
                code = supervise_elastic(job, options, options.elastic, catcher)
            else:
                start_ranks(job, options, lambda: catcher.signum is not None)
                code = supervise(job, options, catcher)
        except LaunchError as exc:
            job.stop(options.grace)
            job.join()
            sink.message(str(exc))
            return exc.code
        job.terminate(options.grace)
    job.join()
    return code


def supervise_elastic(job: Job, options: Options, elastic: ElasticOptions, catcher: SignalCatcher) -> int:
    """Run an elastic job (:class:`ringcore.elastic_driver.Driver`) with its store on ``--addr``.

    Raises:
        LaunchError: The store cannot be served there.
    """
    try:
        settings = Settings.from_env()
        store, client = elastic_driver.serve_store(
            options.addr, options.port, options.secret.encode(), settings
        )
    except (OSError, RingcoreError) as err:
        raise LaunchError(
            f"cannot serve the elastic job's store on {options.addr}:{options.port} ({err}); the launcher "
            "serves it, so give --addr an address of this machine",
            1,
        ) from None
    fixed = [hosts.Host(slot.host, slot.local_size) for slot in options.slots if slot.local_rank == 0]
    driver = elastic_driver.Driver(
        job,
        elastic,
        options.size,
        fixed or [hosts.Host("localhost", options.size)],
        functools.partial(start_worker, job, options),
        store,
        client,
        options.grace,
        options.timeout,
    )
    return driver.run(catcher)


if __name__ == "__main__":
    sys.exit(main())
