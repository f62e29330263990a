"""Where ``ringcore-run``'s ranks go: ``-H``/``--hostfile`` parsing, rank placement, the rendezvous address.

Hosts are read as Open MPI and Horovod read them:

- ``-H hostA:4,hostB:4`` (``--host``): comma-separated ``name[:slots]``, one
  slot when the count is left out (IPv6 addresses in brackets: ``[fe80::1]:2``);
- ``--hostfile FILE``: one host a line, ``name [slots=N] [max_slots=M]``
  (``max_slots`` is accepted and ignored) or ``name:N`` (as ``-H`` and host
  discovery scripts write it), ``#`` starts a comment, blank lines are
  skipped. A name given twice adds up its slots, as Open MPI does.

A name may carry a user (``alice@hostA``), which only ssh sees. Ranks fill the
hosts' slots in order (rank 0 on the first slot of the first host, Open MPI's
``--map-by slot``); a host's ranks are numbered 0.. by local rank.

A host is *local* (its ranks start as child processes, without ssh) when it
is ``localhost``, this machine's host name, or a name whose address can be
bound here (a loopback address or one of this network namespace's own).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import socket
from collections.abc import Callable, Sequence
from pathlib import Path

from ringcore import rank_agent

LOCAL_NAMES = ("localhost", "localhost.localdomain")


class HostError(ValueError):
    """A host list, a hostfile or a placement that cannot work; the message says which and why."""


@dataclasses.dataclass(frozen=True)
class Host:
    """One host of the job.

    Attributes:
        name: As written by the user (``alice@hostA`` keeps the user for ssh).
        slots: Ranks it may run.
    """

    name: str
    slots: int

    @property
    def address_name(self) -> str:
        """The name without a ``user@``: what is resolved and compared."""
        return address_name(self.name)


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one rank runs.

    Attributes:
        rank: The rank.
        host: The host's name as written by the user.
        local_rank: The rank's place among its host's ranks.
        local_size: How many ranks of the job run on that host.
        local: Whether the host is this machine (no ssh).
    """

    rank: int
    host: str
    local_rank: int
    local_size: int
    local: bool


def parse_host_list(text: str) -> list[Host]:
    """Parse ``-H hostA:4,hostB:4`` (``name`` alone means one slot).

    Raises:
        HostError: An empty name or a slot count that is not a positive integer.
    """
    hosts = []
    for item in (part.strip() for part in text.split(",")):
        name, colon, count = ("", "", "") if item.endswith("]") else item.rpartition(":")
        if not colon:
            name, count = item, "1"
        name = name[1:-1] if name.startswith("[") and name.endswith("]") else name  # [::1]:2
        if not name:
            raise HostError(f"-H {text!r}: empty host name; write e.g. -H hostA:4,hostB:4")
        hosts.append(Host(name, _slots(count, f"-H {item!r}")))
    return merge(hosts)


def parse_hostfile(path: str | Path) -> list[Host]:
    """Parse a hostfile: ``name [slots=N] [max_slots=M]`` or ``name:N`` lines, ``#`` comments.

    Raises:
        HostError: The file cannot be read, names no host, or has a line that is not understood.
    """
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as err:
        raise HostError(f"--hostfile {path}: {err.strerror or err}") from None
    hosts = []
    for number, raw in enumerate(lines, start=1):
        words = raw.split("#", 1)[0].split()
        if words:
            hosts.append(_hostfile_line(words, f"--hostfile {path}, line {number}"))
    if not hosts:
        raise HostError(f"--hostfile {path}: no hosts in it; write one 'host slots=N' a line")
    return merge(hosts)


def _hostfile_line(words: list[str], where: str) -> Host:
    user, at, address = words[0].rpartition("@")  # alice@hostA:2: the user is ssh's
    name, colon, count = address.rpartition(":")
    bracketed = name.startswith("[") and name.endswith("]")  # [fe80::1]:2
    if colon and count.isdigit() and (":" not in name or bracketed):  # host:N
        if len(words) > 1:
            raise HostError(f"{where}: {' '.join(words)!r}: write either 'host:N' or 'host slots=N'")
        name = name[1:-1] if bracketed else name
        return Host(f"{user}{at}{name}", _slots(count, f"{where}: {words[0]!r}"))
    slots = 1
    for word in words[1:]:
        key, equals, value = word.partition("=")
        if key in ("slots", "max_slots", "max-slots") and equals:
            count = _slots(value, f"{where}: {word!r}")
            slots = count if key == "slots" else slots
        else:
            raise HostError(f"{where}: {word!r} not understood; write 'host slots=N' or 'host:N'")
    return Host(words[0], slots)


def _slots(text: str, where: str) -> int:
    try:
        count = int(text)
    except ValueError:
        raise HostError(f"{where}: slots must be a whole number, got {text!r}") from None
    if count < 1:
        raise HostError(f"{where}: slots must be at least 1, got {count}")
    return count


def address_name(name: str) -> str:
    """``name`` without a ``user@``: what is resolved and compared."""
    return name.rpartition("@")[2]


def merge(hosts: Sequence[Host]) -> list[Host]:
    """Add up the slots of hosts named more than once, keeping first-appearance order."""
    slots: dict[str, int] = {}
    for host in hosts:
        slots[host.name] = slots.get(host.name, 0) + host.slots
    return [Host(name, count) for name, count in slots.items()]


def place(hosts: Sequence[Host], size: int) -> list[Slot]:
    """Put ``size`` ranks on the hosts' slots in order; ``slots[r]`` is rank ``r``'s.

    Raises:
        HostError: The hosts have fewer slots than ``size``.
    """
    total = sum(host.slots for host in hosts)
    if size > total:
        listed = ", ".join(f"{host.name}:{host.slots}" for host in hosts)
        raise HostError(f"-np {size} needs {size} slots, the hosts have {total} ({listed})")
    names: list[Host] = []
    for host in hosts:
        names.extend([host] * host.slots)
    names = names[:size]
    slots = []
    for host in dict.fromkeys(names):
        ranks = [rank for rank, owner in enumerate(names) if owner is host]
        local = is_local(host.address_name)
        slots += [Slot(rank, host.name, index, len(ranks), local) for index, rank in enumerate(ranks)]
    return sorted(slots, key=lambda slot: slot.rank)


def is_local(name: str) -> bool:
    """Whether ``name`` is this machine: ``localhost``, its host name, or an address bound here."""
    if name in LOCAL_NAMES or name == socket.gethostname():  # not getfqdn(): a DNS lookup that may hang
        return True
    return any(_bindable(address) for address in resolve_all(name))


def _bindable(address: str) -> bool:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((address, 0))
        except OSError:
            return False
    return True


def resolve_all(name: str) -> list[str]:
    """Every address ``name`` resolves to, IPv4 first; empty when it does not resolve."""
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return []
    addresses = [str(info[4][0]) for info in infos]
    return sorted(dict.fromkeys(addresses), key=lambda address: ":" in address)


def resolve(name: str) -> str:
    """``name``'s first address (IPv4 preferred).

    Raises:
        HostError: The name does not resolve.
    """
    found = resolve_all(name)
    if not found:
        raise HostError(f"host {name!r} does not resolve to an address")
    return found[0]


def is_loopback(address: str) -> bool:
    """Whether ``address`` is a loopback address (``127.0.0.0/8``, ``::1``)."""
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def route_source(destination: str) -> str:
    """This machine's address on the route to ``destination`` (a UDP connect sends nothing).

    Raises:
        HostError: There is no route.
    """
    family = socket.AF_INET6 if ":" in destination else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((destination, 9))
        except OSError as err:
            raise HostError(f"no route to {destination}: {err.strerror or err}") from None
        return str(probe.getsockname()[0])


def placement(size: int | None, host_list: str | None, hostfile: str | None) -> tuple[int, tuple[Slot, ...]]:
    """The job's size and every rank's slot, from ``-np``, ``-H`` and ``--hostfile``.

    Without hosts the slots are empty (every rank on this machine) and ``size`` is required;
    with hosts it defaults to all their slots.

    Raises:
        HostError: No size and no hosts, or hosts that cannot take ``size`` ranks.
    """
    if host_list is None and hostfile is None:
        if size is None:
            raise HostError("the following arguments are required: -np/-n/--np (or -H/--hostfile)")
        return size, ()
    found = parse_host_list(host_list) if host_list is not None else parse_hostfile(str(hostfile))
    size = size if size is not None else sum(host.slots for host in found)
    return size, tuple(place(found, size))


def rendezvous_address(slots: Sequence[Slot], ifname: str | None, ask: Callable[[str, str], str]) -> str:
    """The rendezvous address: the first host's, as the other hosts reach it.

    With ``ifname`` (``--network-interface``), that interface's address on the
    first host, found here or with ``ask(host, ifname)`` (over ssh). Else the
    first host's name resolved here; a first host that is this machine under a
    loopback name (``localhost``; Debian maps the host name to 127.0.1.1) is
    unreachable from other hosts, so then this machine's address on the route
    to the first remote host is used.

    Raises:
        HostError: A name does not resolve, or there is no route or no such interface.
    """
    first = slots[0]
    if ifname and first.local:
        found = rank_agent.interface_address(ifname)
        if found is None:
            raise HostError(f"--network-interface {ifname}: no IPv4 address on it here")
        return found
    if ifname:
        return ask(first.host, ifname)
    address = resolve(address_name(first.host))
    remote = next((slot for slot in slots if not slot.local), None)
    if not first.local or not is_loopback(address) or remote is None:
        return address
    return route_source(resolve(address_name(remote.host)))
