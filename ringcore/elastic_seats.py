"""Where an elastic job's workers go: free slots on the listed hosts, and the discovery script's listing.

Workers are placed on the hosts' slots (``-H``, ``--hostfile``, this host
with ``-np`` slots, or what the discovery script prints, re-read every
second), never more than ``--max-np`` at once; those on other hosts start
over ssh as ranks do (:mod:`ringcore.remote`), and reach the store at
``--addr``, which must then be an address of this machine they can reach.
Without a discovery script a lost worker is not replaced. A host where a worker failed gets no new
worker for ``--failure-cooldown`` s, doubled for each further failure
there, so a crashing host cannot make the world restart in a loop.

:func:`plan_seats` picks the free slots, :func:`excess` the workers whose
slots left the listing, and a :class:`Discoverer` re-runs the script on a
thread of its own; the driver (:mod:`ringcore.elastic_driver`) keeps the
cooldowns and starts the workers.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from ringcore import discovery, hosts


def plan_seats(
    listing: Sequence[hosts.Host], taken: dict[str, set[int]], cooling: set[str], room: int
) -> list[tuple[str, int, int]]:
    """Free slots to start workers on, host by host in listed order: ``(host, slot, host's slots)``.

    Args:
        listing: The hosts and their slots.
        taken: Slots in use, per host name.
        cooling: Hosts that get no new worker now.
        room: How many workers may still start (``--max-np`` less those running).
    """
    seats: list[tuple[str, int, int]] = []
    for host in listing:
        if host.name in cooling:
            continue
        used = taken.get(host.name, set())
        seats += [(host.name, slot, host.slots) for slot in range(host.slots) if slot not in used]
    return seats[: max(0, room)]


def excess(seats: dict[int, hosts.Slot], listing: Sequence[hosts.Host]) -> set[int]:
    """Workers on slots the listing no longer has (their host left it, or lost slots)."""
    slots = {host.name: host.slots for host in listing}
    return {number for number, seat in seats.items() if seat.local_rank >= slots.get(seat.host, 0)}


class Discoverer:
    """Runs the discovery script every :data:`ringcore.discovery.INTERVAL` s on a thread of its own."""

    def __init__(self, script: str) -> None:
        self.script = script
        self._lock = threading.Lock()
        self._listing: list[hosts.Host] | None = None
        self._error: str | None = None
        self._last_error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ringcore-discovery", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def take(self) -> tuple[list[hosts.Host] | None, str | None]:
        """The newest listing and a new error message, each once (``None``: nothing new)."""
        with self._lock:
            found, self._listing, error, self._error = self._listing, None, self._error, None
        return found, error

    def _loop(self) -> None:
        while not self._stop.wait(discovery.INTERVAL):
            try:
                listing = discovery.discover(self.script)
            except discovery.DiscoveryError as err:
                with self._lock:
                    if str(err) != self._last_error:
                        self._error = self._last_error = str(err)
                continue
            with self._lock:
                self._listing, self._last_error = listing, None
