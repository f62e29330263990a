"""Ranks on other hosts: one ssh session per rank, running :mod:`ringcore.rank_agent` at the far end.

``ringcore-run`` starts ``ssh -T -o BatchMode=yes -o StrictHostKeyChecking=accept-new
[-p PORT] [-i KEY] HOST 'exec python3 -c BOOTSTRAP ringcore-rank R'`` (the
system's OpenSSH client) and writes the agent's source and the rank's job on
the session's stdin (:mod:`ringcore.rank_agent` describes both ends). What
the launcher sees is a process like a local rank's: the rank's stdout and
stderr come back on ssh's, the agent's last stderr line tells how the rank
ended, and closing ssh's stdin stops the rank (the agent sends SIGTERM, then
SIGKILL after ``--grace``, and reports).

One session per rank, not per host: each rank keeps its own output streams,
exit status and stop switch, so the launcher supervises remote ranks exactly
as it supervises local ones, and the far end needs no protocol to multiplex
them. The price is one ssh handshake and one sshd session per rank. sshd
drops unauthenticated connections beyond ``MaxStartups`` (default 10), so the
launcher keeps at most :data:`MAX_STARTUPS` sessions per host between
``ssh`` starting and the agent saying it is ready.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import shlex
import signal
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ringcore import rank_agent

MAX_STARTUPS = 8  # below sshd's default MaxStartups (10) per host
QUERY_TIMEOUT = 60.0
SSH_OPTIONS = (
    "-T",  # no pty: the agent, not a hangup, ends the rank when the session goes
    "-x",
    "-o",
    "BatchMode=yes",  # never prompt: a key that does not work is an error
    "-o",
    "StrictHostKeyChecking=accept-new",
    "-o",
    "LogLevel=ERROR",  # no "Permanently added ..." line in a rank's stderr
    "-o",
    "ControlMaster=no",  # a master would linger in the background holding the rank's output pipes
    "-o",
    "ConnectTimeout=20",
    "-o",
    "ServerAliveInterval=5",  # a host that vanishes fails its ranks within 15 s
    "-o",
    "ServerAliveCountMax=3",
)


class RemoteError(Exception):
    """ssh could not be run, or a question asked over it got no answer."""


@dataclasses.dataclass(frozen=True)
class SshOptions:
    """How to reach the hosts.

    Attributes:
        port: ``--ssh-port``; ``None`` leaves it to ssh (22 or its config).
        identity_file: ``--ssh-identity-file``; ``None`` leaves it to ssh.
        extra: ``--ssh-args``, split like a shell, inserted before the host.
    """

    port: int | None = None
    identity_file: str | None = None
    extra: tuple[str, ...] = ()

    def command(self, host: str, remote_command: str) -> list[str]:
        """The ssh command line that runs ``remote_command`` on ``host``."""
        argv = ["ssh", *SSH_OPTIONS]
        if self.port is not None:
            argv += ["-p", str(self.port)]
        if self.identity_file:
            argv += ["-i", self.identity_file, "-o", "IdentitiesOnly=yes"]
        return [*argv, *self.extra, "--", host, remote_command]


@functools.cache
def agent_source() -> str:
    """The source of :mod:`ringcore.rank_agent`, as it is sent to the far end."""
    return Path(rank_agent.__file__).read_text()


def agent_command(label: str) -> str:
    """The remote shell command that runs the agent; ``label`` only makes it recognisable in ``ps``."""
    return f"exec python3 -c {shlex.quote(rank_agent.BOOTSTRAP)} ringcore-rank {shlex.quote(label)}"


def agent_input(job: dict[str, Any]) -> bytes:
    """The two lines the agent reads from stdin: its source, then ``job``."""
    return (json.dumps(agent_source()) + "\n" + json.dumps(job) + "\n").encode()


def _start_ssh(argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    try:
        return subprocess.Popen(argv, **kwargs)
    except FileNotFoundError:
        raise RemoteError(
            "ssh not found: install the OpenSSH client (apt-get install openssh-client)"
        ) from None


class RemoteRank:
    """One rank started over ssh (see the module docstring).

    Attributes:
        rank: The rank.
        host: Its host, as the user wrote it.
        proc: The local ssh process.
        code: The rank's ``Popen.returncode`` as the agent reported it; ``None`` until then.
        started: Set once the agent is running (or ssh has ended).
    """

    def __init__(self, rank: int, host: str, proc: subprocess.Popen[bytes], marker: bytes) -> None:
        self.rank = rank
        self.host = host
        self.proc = proc
        self.code: int | None = None
        self.started = threading.Event()
        self._marker = marker

    @classmethod
    def start(cls, rank: int, host: str, ssh: SshOptions, job: dict[str, Any]) -> RemoteRank:
        """Start ssh to ``host`` and hand the agent ``job`` (which carries the marker).

        Raises:
            RemoteError: ssh is not installed.
        """
        proc = _start_ssh(
            ssh.command(host, agent_command(str(rank))),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # Ctrl-C reaches the launcher, which stops ranks in order
        )
        assert proc.stdin is not None  # stdin=PIPE
        with contextlib.suppress(OSError):  # ssh died at once: its exit tells why
            proc.stdin.write(agent_input(job))
            proc.stdin.flush()
        return cls(rank, host, proc, job["marker"].encode())

    def stop(self) -> None:
        """Close ssh's stdin: the agent stops the rank (SIGTERM, SIGKILL after the grace) and reports."""
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()

    def kill(self) -> None:
        """Kill the local ssh; the agent sees the session end and stops the rank on its own."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def pump_stderr(self, emit: Callable[[bytes], None]) -> None:
        """Pass the rank's stderr lines to ``emit``, keeping the agent's reports out of them."""
        assert self.proc.stderr is not None  # stderr=PIPE
        with self.proc.stderr as pipe:
            for line in iter(pipe.readline, b""):
                found = line.find(self._marker)
                if found < 0:
                    emit(line)
                    continue
                if found > 0:  # the rank's last line had no newline
                    emit(line[:found])
                self._report(line[found + len(self._marker) :].split())

    def _report(self, words: list[bytes]) -> None:
        if words[:1] == [b"ready"]:
            self.started.set()
        elif words[:1] == [b"exit"] and len(words) == 2:
            self.code = int(words[1])

    def returncode(self, ssh_code: int) -> int:
        """The rank's return code: the agent's report, else ssh's own exit code."""
        return self.code if self.code is not None else ssh_code


def interface_address(host: str, ifname: str, ssh: SshOptions) -> str:
    """Ask ``host``, over ssh, for the IPv4 address of its interface ``ifname``.

    Raises:
        RemoteError: ssh failed, or the interface has no IPv4 address there.
    """
    argv = ssh.command(host, agent_command("ifaddr"))
    try:
        proc = _start_ssh(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = proc.communicate(agent_input({"ifaddr": ifname}), timeout=QUERY_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise RemoteError(f"{host} did not answer over ssh within {QUERY_TIMEOUT:g} s") from None
    answer = (out.decode(errors="replace").strip() or err.decode(errors="replace").strip()).splitlines()
    if proc.returncode != 0 or not answer:
        why = answer[-1] if answer else f"ssh exited with code {proc.returncode}"
        raise RemoteError(f"cannot get the address of {ifname} on {host}: {why}")
    return answer[-1]
