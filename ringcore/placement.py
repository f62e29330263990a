"""Where the ranks run: which share a host, and whether that host has a CPU for each.

Every rank publishes :func:`describe_me` in its rendezvous record; every rank
then computes :func:`place` from the same list of records, so decisions that
must be identical on all ranks (the allreduce's slice size) are. A host is
the set of ranks with the same host name; the launcher's local size
(``RINGCORE_LOCAL_SIZE``, ``LOCAL_WORLD_SIZE``...) overrides the count, as on
the emulated cluster, where network namespaces share one host name.

A host's CPUs are the union of its ranks' affinity masks, not any one rank's:
a launcher that binds each rank to its own core (``ringcore-run``, ``mpirun
--bind-to core``) leaves every rank one CPU, yet the host is not crowded;
two ranks bound to the same CPU are.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from typing import Any


@dataclasses.dataclass(frozen=True)
class Placement:
    """This rank's view of the job's layout (the same on every rank of one host but ``local_rank``)."""

    local_rank: int
    local_size: int
    host_cpus: int  # CPUs the ranks of this host may run on, together
    one_host: bool  # every rank of the job runs on this host (then the same on every rank)

    @property
    def crowded(self) -> bool:
        """This host runs more ranks than it has CPUs for them."""
        return self.local_size > self.host_cpus

    def cache_slices(self, tcp: bool) -> bool:
        """Allreduce in cache-sized slices: TCP, one host, a CPU per rank (``Settings.allreduce_slice_bytes``)."""
        return tcp and self.one_host and not self.crowded

    def wide_segments(self, tcp: bool) -> bool:
        """2 MiB ring segments: TCP without cache-sized slices (``Settings.segment_size``)."""
        return tcp and not self.cache_slices(tcp)


def describe_me(local_size: int | None) -> dict[str, Any]:
    """What :func:`place` needs to know about this rank, for its rendezvous record."""
    return {"hostname": socket.gethostname(), "cpus": sorted(_affinity()), "local_size": local_size}


def place(rank: int, records: list[dict[str, Any]], local_rank: int | None = None) -> Placement:
    """Group ``records`` (one per rank, from :func:`describe_me`) into hosts; ``rank``'s placement."""
    hosts: dict[str, list[int]] = {}
    for peer, record in enumerate(records):
        hosts.setdefault(record["hostname"], []).append(peer)
    ranks = hosts[records[rank]["hostname"]]
    declared = {records[peer].get("local_size") for peer in ranks} - {None}
    local_size = declared.pop() if len(declared) == 1 else len(ranks)
    cpus: set[int] = set().union(*(records[peer].get("cpus") or () for peer in ranks))
    return Placement(
        local_rank=ranks.index(rank) if local_rank is None else local_rank,
        local_size=local_size,
        host_cpus=len(cpus) or 1,
        one_host=len(hosts) == 1 and local_size == len(records),
    )


def _affinity() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))
