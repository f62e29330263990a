"""``--host-discovery-script``: which hosts an elastic job may use now, as Horovod asks for them.

The script is a shell command (run by ``/bin/sh``) that prints one host a
line, ``name:slots`` or ``name`` (one slot); blank lines and ``#`` comments
are skipped, and a name printed twice adds up its slots. It is run at the
start and then every :data:`INTERVAL` seconds. A run that fails (non-zero
exit, output that is not understood, no answer within :data:`TIMEOUT` s)
leaves the last good list in force; the message says why.
"""

from __future__ import annotations

import subprocess

from ringcore import hosts

INTERVAL = 1.0
TIMEOUT = 30.0


class DiscoveryError(Exception):
    """The script failed or printed something that is not a host list; the message says which."""


def parse(output: str) -> list[hosts.Host]:
    """Hosts from the script's output: ``name[:slots]`` lines.

    Raises:
        DiscoveryError: A line is not ``name[:slots]`` with a positive slot count.
    """
    found: list[hosts.Host] = []
    for number, raw in enumerate(output.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if "," in line or " " in line:
            raise DiscoveryError(f"line {number} {raw!r}: write one 'host:slots' a line")
        try:
            found += hosts.parse_host_list(line)
        except hosts.HostError as err:
            raise DiscoveryError(f"line {number} {raw!r}: {err}") from None
    return hosts.merge(found)


def discover(script: str, timeout: float = TIMEOUT) -> list[hosts.Host]:
    """Run ``script`` once and return the hosts it lists (possibly none).

    Raises:
        DiscoveryError: It failed, timed out, or printed what :func:`parse` refuses.
    """
    try:
        done = subprocess.run(
            script, shell=True, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        raise DiscoveryError(f"{script!r} gave no answer within {timeout:g} s") from None
    except OSError as err:
        raise DiscoveryError(f"{script!r} could not be run: {err}") from None
    if done.returncode != 0:
        last = done.stderr.strip().splitlines()[-1:] or ["no message"]
        raise DiscoveryError(f"{script!r} exited with code {done.returncode}: {last[0]}")
    try:
        return parse(done.stdout)
    except DiscoveryError as err:
        raise DiscoveryError(f"{script!r}: {err}") from None
