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
    cross_rank: int = 0  # this rank's place among the ranks with its local rank (Horovod's cross_rank)
    cross_size: int = 1  # how many ranks have its local rank: the number of hosts, when all are alike
    grid: tuple[tuple[int, ...], ...] | None = None  # grid[host][local rank] = rank (see host_grid)

    @property
    def crowded(self) -> bool:
        """This host runs more ranks than it has CPUs for them."""
        return self.local_size > self.host_cpus

    def cache_slices(self, tcp: bool, shm: bool = False) -> bool:
        """Allreduce in cache-sized slices (``Settings.allreduce_slice_bytes``) on one host.

        Over TCP (``tcp``; shared memory counts, it wraps the mesh) with a CPU
        per rank; over shared memory (``shm``) crowded too: there a slice's
        last step waits on the slots, not on a socket, and the slices' one
        segment per rank runs in lockstep, in place (N=3, 4, 6 on 2 cores, 16
        and 64 MiB: 1.2-1.4x less time than 48 MiB slices, ``bench/HISTORY.md``,
        "Cache slices for crowded hosts on shared memory").
        """
        return tcp and self.one_host and (not self.crowded or shm)

    def wide_segments(self, tcp: bool, shm: bool = False) -> bool:
        """2 MiB ring segments: TCP without cache-sized slices (``Settings.segment_size``)."""
        return tcp and not self.cache_slices(tcp, shm)


def describe_me(local_size: int | None, local_rank: int | None = None) -> dict[str, Any]:
    """What :func:`place` needs to know about this rank, for its rendezvous record."""
    return {
        "hostname": socket.gethostname(),
        "cpus": sorted(_affinity()),
        "local_size": local_size,
        "local_rank": local_rank,
    }


def place(rank: int, records: list[dict[str, Any]], local_rank: int | None = None) -> Placement:
    """Group ``records`` (one per rank, from :func:`describe_me`) into hosts; ``rank``'s placement."""
    hosts: dict[str, list[int]] = {}
    for peer, record in enumerate(records):
        hosts.setdefault(record["hostname"], []).append(peer)
    ranks = hosts[records[rank]["hostname"]]
    declared = {records[peer].get("local_size") for peer in ranks} - {None}
    local_size = declared.pop() if len(declared) == 1 else len(ranks)
    cpus: set[int] = set().union(*(records[peer].get("cpus") or () for peer in ranks))
    local_ranks = _local_ranks(records, hosts)
    if local_rank is not None:
        local_ranks[rank] = local_rank
    alike = [peer for peer, lr in enumerate(local_ranks) if lr == local_ranks[rank]]
    return Placement(
        local_rank=local_ranks[rank],
        local_size=local_size,
        host_cpus=len(cpus) or 1,
        one_host=len(hosts) == 1 and local_size == len(records),
        cross_rank=alike.index(rank),
        cross_size=len(alike),
        grid=host_grid(hosts, local_ranks, [record.get("local_size") for record in records]),
    )


def host_grid(
    hosts: dict[str, list[int]], local_ranks: list[int], declared_sizes: list[int | None]
) -> tuple[tuple[int, ...], ...] | None:
    """``grid[host][local rank] = rank`` when the job is hosts of equal size, else ``None``.

    Hosts are ordered by their lowest rank. ``None`` where hosts differ in
    size, where a host's local ranks are not ``0..L-1``, or where a launcher
    declared a local size that disagrees with the host names (network
    namespaces that share one host name): the hierarchical allreduce
    (:mod:`ringcore.algo.hierarchical`) then does not apply.
    """
    sizes = {len(ranks) for ranks in hosts.values()}
    if len(sizes) != 1:
        return None
    (size,) = sizes
    if any(declared not in (None, size) for declared in declared_sizes):
        return None
    grid = []
    for ranks in sorted(hosts.values(), key=min):
        row = sorted(ranks, key=lambda peer: local_ranks[peer])
        if [local_ranks[peer] for peer in row] != list(range(size)):
            return None
        grid.append(tuple(row))
    return tuple(grid)


def _local_ranks(records: list[dict[str, Any]], hosts: dict[str, list[int]]) -> list[int]:
    """Every rank's local rank: the launcher's when it published one, else its place on its host."""
    found = [0] * len(records)
    for ranks in hosts.values():
        for index, peer in enumerate(ranks):
            declared = records[peer].get("local_rank")
            found[peer] = index if declared is None else int(declared)
    return found


def _affinity() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))
