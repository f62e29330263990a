"""Placement: hosts from rendezvous records, the same answer on every rank."""

from __future__ import annotations

from typing import Any

from ringcore.placement import describe_me, place


def record(hostname: str, cpus: list[int], local_size: int | None = None) -> dict[str, Any]:
    return {"hostname": hostname, "cpus": cpus, "local_size": local_size}


def test_ranks_bound_to_a_core_each_do_not_crowd_their_host() -> None:
    records = [record("a", [0]), record("a", [1])]  # ringcore-run / mpirun --bind-to core
    for rank in (0, 1):
        where = place(rank, records)
        assert (where.local_rank, where.local_size, where.host_cpus) == (rank, 2, 2)
        assert where.one_host and not where.crowded


def test_more_ranks_than_the_union_of_their_cpus_crowd_the_host() -> None:
    records = [record("a", [0, 1]) for _ in range(4)]
    assert place(3, records).crowded and place(3, records).one_host
    bound_together = [record("a", [0]), record("a", [0])]
    assert place(1, bound_together).crowded


def test_two_hosts_are_not_one_and_each_counts_its_own_ranks() -> None:
    records = [record("a", [0, 1]), record("b", [0]), record("a", [2]), record("b", [1])]
    where = place(2, records)
    assert (where.local_rank, where.local_size, where.host_cpus) == (1, 2, 3)
    assert not where.one_host and not place(1, records).one_host


def test_the_launchers_local_size_overrides_a_shared_host_name() -> None:
    """The emulated cluster: network namespaces share a host name, each 'host' runs one rank."""
    records = [record("vm", [0, 1], local_size=1) for _ in range(4)]
    where = place(2, records, local_rank=0)
    assert (where.local_rank, where.local_size) == (0, 1)
    assert not where.one_host and not where.crowded


def test_describe_me_reports_this_process() -> None:
    me = describe_me(None)
    assert me["hostname"] and me["cpus"] and me["local_size"] is None
    assert all(isinstance(cpu, int) for cpu in me["cpus"])


def test_the_ring_is_tuned_alike_on_every_rank_from_the_placement() -> None:
    """Cache slices on one host over TCP with a CPU per rank, over shared memory crowded too; else 2 MiB segments."""
    uncrowded = [record("a", [0]), record("a", [1])]
    crowded = [record("a", [0, 1]) for _ in range(3)]
    cluster = [record("n", [0, 1], local_size=1) for _ in range(4)]  # netns hosts share a host name
    cases = ((uncrowded, True, True), (crowded, False, True), (cluster, False, False))
    for records, tcp_slices, shm_slices in cases:
        for rank in range(len(records)):
            where = place(rank, records)
            assert (where.cache_slices(tcp=True), where.wide_segments(tcp=True)) == (
                tcp_slices,
                not tcp_slices,
            )
            shm = (where.cache_slices(tcp=True, shm=True), where.wide_segments(tcp=True, shm=True))
            assert shm == (shm_slices, not shm_slices)
            assert not where.cache_slices(tcp=False) and not where.wide_segments(tcp=False)  # RDMA


def test_cross_rank_counts_the_ranks_that_share_a_local_rank() -> None:
    """Horovod's cross_rank/cross_size: two hosts of two ranks, interleaved, and the netns cluster."""
    records = [record("a", [0]), record("b", [0]), record("a", [1]), record("b", [1])]
    found = [place(rank, records) for rank in range(4)]
    assert [(w.local_rank, w.cross_rank, w.cross_size) for w in found] == [
        (0, 0, 2),
        (0, 1, 2),
        (1, 0, 2),
        (1, 1, 2),
    ]
    declared = [{**record("vm", [0], local_size=1), "local_rank": 0} for _ in range(3)]
    assert [(place(r, declared).cross_rank, place(r, declared).cross_size) for r in range(3)] == [
        (0, 3),
        (1, 3),
        (2, 3),
    ]
    one_host = [record("a", [0]), record("a", [1])]
    assert [(place(r, one_host).cross_rank, place(r, one_host).cross_size) for r in range(2)] == [(0, 1)] * 2


def test_one_reducer_where_one_host_runs_more_ranks_than_cpus_unless_set() -> None:
    """The one-shot allreduce's choice (``ringcore.plans.oneshot.one_reducer``): auto follows the
    records every rank sees alike; ``RINGCORE_ONE_REDUCER`` wins either way."""
    from ringcore.plans.oneshot import one_reducer

    crowded = [record("a", [0, 1]) for _ in range(3)]
    a_core_each = [record("a", [0]), record("a", [1])]
    two_hosts = [record("a", [0]), record("a", [0]), record("b", [0]), record("b", [0])]
    for rank in range(3):
        assert one_reducer(None, place(rank, crowded))
    for rank in range(2):
        assert not one_reducer(None, place(rank, a_core_each))
    assert not one_reducer(None, place(0, two_hosts))  # crowded, but no mailboxes across hosts
    assert not one_reducer(False, place(0, crowded))
    assert one_reducer(True, place(0, a_core_each))
