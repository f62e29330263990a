"""The far end of a rank that ``ringcore-run`` starts over ssh: start it, watch it, stop it, report.

This module is stdlib-only and never imports ringcore: ``ringcore-run`` sends
its source over the ssh session, so a remote host needs nothing but
``python3`` (3.8+) on its ``PATH`` to run it. The remote command is::

    exec python3 -c 'import json,sys;exec(json.loads(sys.stdin.readline()))' ringcore-rank R

and the session's stdin carries two lines, then stays open:

1. this source, as a JSON string;
2. the job, as a JSON object: ``argv``, ``env`` (the rank's ``RINGCORE_*``
   identity, the job's secret, torch's variables and what ``-x`` forwards),
   ``cwd``, ``grace``, ``bind`` (``[local_rank, local_size]`` or null), ``aslr``
   (``[choice, local_size]``, :func:`fixed_layout`) and ``marker``; or
   ``{"ifaddr": NAME}``, which prints that interface's IPv4 address and exits.

So neither the secret nor any forwarded value is on a command line (``ps``
shows ``python3 -c ... ringcore-rank R`` and the program's own argv), and the
rank's stdin is ``/dev/null``.

The agent starts the program in its own session (one process group), with
the remote login's environment plus ``env``, in ``cwd`` when that exists
there, bound to its share of this host's CPUs (:func:`rank_cores`, as
``ringcore-run`` binds local ranks), with or without address-space
randomization as :func:`fixed_layout` says. Then it waits for the first of:

- the program exits: whatever it left in its process group gets SIGTERM,
  then SIGKILL after ``grace`` s;
- end of file on stdin: ``ringcore-run`` closed it to stop the rank, or the
  ssh connection (or ``ringcore-run`` itself) died. Without a pty nothing else
  tells a remote process that its session is gone, so this is what keeps
  orphans from outliving the job;
- SIGTERM, SIGINT or SIGHUP to the agent.

In the last two cases the program's group gets SIGTERM, then SIGKILL after
``grace`` s. Finally the agent writes ``<marker>exit <returncode>`` on stderr
(negative: killed by that signal) and exits with the shell's code for it;
``<marker>ready`` is written once the job is read, before the program starts.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time

BOOTSTRAP = "import json,sys;exec(json.loads(sys.stdin.readline()))"
POLL_SECONDS = 0.1
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_stop_signal: list[int] = []
ASLR_CHOICES = ("auto", "on", "off")
ADDR_NO_RANDOMIZE = 0x0040000  # personality(2): programs exec'd from now on get the same layout every time
QUERY = 0xFFFFFFFF  # personality(2): change nothing, say the current persona


def rank_cores(size: int) -> list[set[int]]:
    """Each rank's CPUs: disjoint equal shares of the usable CPUs, or one each, round robin, when crowded."""
    usable = sorted(os.sched_getaffinity(0))
    if size > len(usable):
        return [{usable[rank % len(usable)]} for rank in range(size)]
    share = len(usable) // size
    return [set(usable[rank * share : (rank + 1) * share]) for rank in range(size)]


def fixed_layout(aslr: str, size: int) -> bool | None:
    """How this host's ``size`` ranks start (``--aslr``, :mod:`ringcore.run`): True without
    address-space randomization, False with it, None as the launcher itself runs.

    ``off``: True; ``on``: False; ``auto``: True where the ranks outnumber the usable CPUs (the
    affinity mask's: a container's CPU quota does not count), else None.
    """
    if aslr == "auto":
        return True if size > len(os.sched_getaffinity(0)) else None
    return aslr == "off"


def set_layout(fixed: bool | None) -> int | None:
    """Make the programs the calling thread starts next run without (True) or with (False)
    address-space randomization; the persona before, to restore, or None where nothing changed.

    Raises:
        OSError: The kernel refused (Docker's default seccomp profile refuses this flag).
    """
    if fixed is None:
        return None
    before = personality()
    wanted = before | ADDR_NO_RANDOMIZE if fixed else before & ~ADDR_NO_RANDOMIZE
    if wanted == before:
        return None
    personality(wanted)
    return before


def personality(persona: int = QUERY) -> int:
    """Linux's ``personality(2)`` for the calling thread (what the programs it starts inherit): set
    ``persona``, or with none only read it; the persona before.

    Raises:
        OSError: The kernel refused.
    """
    before = int(_libc().personality(ctypes.c_ulong(persona)))
    if before < 0:  # glibc may return -errno without setting errno
        raise OSError(ctypes.get_errno() or -before, "personality(2) refused")
    return before


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def interface_address(ifname: str) -> str | None:
    """IPv4 address of network interface ``ifname``, or ``None`` when it has none."""
    import fcntl

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            packed = fcntl.ioctl(
                probe.fileno(), 0x8915, struct.pack("256s", ifname.encode()[:15])
            )  # SIOCGIFADDR
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def shell_code(returncode: int) -> int:
    """``Popen.returncode`` as a shell exit status: ``128 + N`` for a death by signal ``N``."""
    return returncode if returncode >= 0 else 128 - returncode


def main() -> int:
    """Read the job from stdin and run it (see the module docstring); return the exit status."""
    line = sys.stdin.readline()
    if not line:
        return 2
    job = json.loads(line)
    if "ifaddr" in job:
        address = interface_address(job["ifaddr"])
        print(address or f"no IPv4 address on {job['ifaddr']} on {socket.gethostname()}")
        return 0 if address else 1
    for signum in _STOP_SIGNALS:
        signal.signal(signum, lambda signum, frame: _stop_signal.append(signum))
    _say(job["marker"], "ready")
    code = run(job)
    _say(job["marker"], f"exit {code}")
    return shell_code(code)


def run(job: dict) -> int:
    """Start ``job["argv"]`` and watch it until it ends or must stop; return its ``Popen.returncode``."""
    argv = job["argv"]
    aslr, local_size = job.get("aslr") or ("auto", 1)
    try:  # the agent starts nothing else, so nothing to restore
        set_layout(fixed_layout(aslr, local_size))  # before binding narrows the CPUs it counts
    except OSError as err:  # an optimisation, like binding: rather started as it is than not at all
        host = socket.gethostname()
        print(
            f"ringcore-run: --aslr {aslr}: cannot set the address layout on {host} ({err})", file=sys.stderr
        )
    if job.get("bind"):
        local_rank, local_size = job["bind"]
        with contextlib.suppress(OSError):  # binding is an optimisation: rather unbound than not at all
            os.sched_setaffinity(0, rank_cores(local_size)[local_rank])
    cwd = job.get("cwd")
    try:
        child = subprocess.Popen(
            argv,
            env={**os.environ, **job["env"]},
            cwd=cwd if cwd and os.path.isdir(cwd) else None,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    except OSError as err:
        where = f"on {socket.gethostname()}"
        if isinstance(err, FileNotFoundError):
            print(f"ringcore-run: command not found {where}: {argv[0]}", file=sys.stderr, flush=True)
            return 127
        print(f"ringcore-run: cannot start {argv[0]} {where}: {err}", file=sys.stderr, flush=True)
        return 126
    while child.poll() is None:
        if _stop_signal or _stdin_closed(POLL_SECONDS):
            break
    stop_group(child, float(job.get("grace", 3.0)))
    return int(child.returncode)


def _stdin_closed(timeout: float) -> bool:
    """Wait up to ``timeout`` s for stdin; whether it reached end of file (nothing else is ever sent)."""
    try:
        ready, _, _ = select.select([0], [], [], timeout)
        return bool(ready) and not os.read(0, 4096)
    except OSError:
        return True


def stop_group(child: subprocess.Popen, grace: float) -> None:
    """SIGTERM ``child``'s process group if anything is left in it, SIGKILL after ``grace`` s; reap the child."""
    if _group_alive(child):
        _killpg(child.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and _group_alive(child):
            time.sleep(0.02)
        _killpg(child.pid, signal.SIGKILL)
    child.wait()


def _group_alive(child: subprocess.Popen) -> bool:
    if child.poll() is None:
        return True
    try:
        os.killpg(child.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _killpg(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is gone already
        os.killpg(pgid, signum)


def _say(marker: str, words: str) -> None:
    with contextlib.suppress(OSError):  # the session is gone: nobody is left to tell
        os.write(2, f"{marker}{words}\n".encode())


if __name__ == "__main__":
    sys.exit(main())
