"""Buffers larger than RINGCORE_SLICE_BYTES: reduced slice by slice, scratch bounded by the slice.

Real processes over TCP with a 64 KiB slice, so a few hundred KiB make many
slices; results against numpy, and what a failure in the middle leaves behind.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ringcore
from ringcore.buffers import as_buffer
from ringcore.config import MIB, SCRATCH_SLICE_BYTES
from ringcore.slicing import allreduce_schedule, buffer_slices, failure_note
from tests import tasks
from tests.cluster import Background, Cluster, RankError, qualified

pytestmark = pytest.mark.usefixtures("ring_only")  # the ring's slices, not the direct route

SLICED = {"RINGCORE_SLICE_BYTES": "64K", "RINGCORE_TIMEOUT": "20"}
COUNT = 100_003  # float32: 7 equal slices (within 7 elements) of at most 64 KiB


def test_slices_are_equal_and_cover_the_buffer() -> None:
    buffer = as_buffer(np.zeros(COUNT, np.float32), writable=True)
    pieces = buffer_slices(buffer, 64 * 1024, 4)
    assert [start for start, _ in pieces] == list(range(0, COUNT, 14_287))  # 7 slices of <= 16384
    assert sum(piece.count for _, piece in pieces) == COUNT
    assert max(p.count for _, p in pieces) - min(p.count for _, p in pieces) <= 7
    assert all(np.shares_memory(piece.array, buffer.array) for _, piece in pieces)
    assert buffer_slices(buffer, 1 << 30, 4) == [(0, buffer)]
    assert len(buffer_slices(buffer, 64 * 1024, 2)) == 4  # fp16 on the wire: scratch is half as long


def test_a_failed_slice_notes_what_is_already_done() -> None:
    with pytest.raises(ringcore.PeerFailure) as info, failure_note(500, 0, 1000):
        raise ringcore.PeerFailure("rank 1 died", 1, "host")
    notes = " ".join(info.value.__notes__)
    assert "elements [0, 500) of 1000 already hold the result" in notes
    assert "partial" not in notes and "other elements are untouched" in notes
    with pytest.raises(ValueError) as first, failure_note(0, 0, 1000):
        raise ValueError("slice 0 failed")
    assert not getattr(first.value, "__notes__", None)  # nothing was written yet: no note


def test_a_failed_in_place_run_notes_the_elements_it_may_have_written() -> None:
    with pytest.raises(ringcore.CollectiveTimeout) as info, failure_note(500, 250, 1000):
        raise ringcore.CollectiveTimeout("no progress")
    notes = " ".join(info.value.__notes__)
    assert "elements [500, 750) of 1000 may hold partial sums" in notes and "RINGCORE_ATOMIC=1" in notes
    with pytest.raises(ringcore.PeerFailure) as whole, failure_note(0, 1000, 1000):
        raise ringcore.PeerFailure("rank 1 died", 1, "host")
    assert "elements [0, 1000) of 1000 may hold partial sums" in " ".join(whole.value.__notes__)
    assert "untouched" not in " ".join(whole.value.__notes__)  # no other elements
    with pytest.raises(ringcore.MismatchError) as mismatch, failure_note(0, 1000, 1000):
        raise ringcore.MismatchError("ranks disagree")
    assert not getattr(mismatch.value, "__notes__", None)  # a mismatch fails before any write


@pytest.mark.timeout(120)
def test_sliced_collectives_match_numpy() -> None:
    rng = np.random.default_rng(3)
    floats = [rng.standard_normal(COUNT).astype(np.float32) for _ in range(3)]
    ints = [rng.integers(-1000, 1000, COUNT).astype(np.int32) for _ in range(3)]
    with Cluster(3, env=SLICED) as cluster:
        summed = cluster.run(tasks.allreduce, ints, "sum", timeout=60)
        averaged = cluster.run(tasks.allreduce, floats, "avg", "fp16", timeout=60)
        broadcast = cluster.run(tasks.broadcast, floats, 2, timeout=60)
    for got in summed:
        np.testing.assert_array_equal(got, np.sum(ints, axis=0, dtype=np.int32))
    want = np.mean(np.asarray(floats, np.float64), axis=0)
    for got in averaged:
        np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)
        assert got.tobytes() == averaged[0].tobytes()
    for got in broadcast:
        assert got.tobytes() == floats[2].tobytes()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("atomic", ["0", "1"])
def test_killed_peer_mid_slices_leaves_done_slices_reduced_and_the_rest_untouched(
    atomic: str, tmp_path: Path
) -> None:
    """The failed slice may hold partial sums by default; with RINGCORE_ATOMIC=1 it is restored.

    Rank 2 kills itself inside the second allreduce, a little past half of its sends (of the first).
    """
    count = 2_000_000  # 8 MB: ~122 slices of 64 KiB, each a few ms
    env = {**SLICED, "RINGCORE_SMALL_BYTES": "4K", "RINGCORE_ATOMIC": atomic}  # the in-place ring
    fault = (2, "kill9", str(tmp_path / "killed_at"), 0.53)
    with Cluster(3, env=env) as cluster:
        doomed = Background(
            cluster, tasks.sliced_allreduce_until_failure, count, 3, fault, ranks=[2], timeout=90
        )
        working = Background(
            cluster, tasks.sliced_allreduce_until_failure, count, 3, fault, ranks=[0, 1], timeout=90
        )
        reports = working.join(60)
        doomed.join(30)
    for rank, report in enumerate(reports):
        assert not isinstance(report, RankError), (rank, report)
        assert report["error"] == qualified(ringcore.PeerFailure), (rank, report)
        assert report["rounds"] == 1 and report["done_reduced"] and report["rest_untouched"], (rank, report)
        start, end = report["exposed"]
        assert start == report["done"] and (end == start) == (atomic == "1"), (rank, report)
    print("elements done when the peer died:", [r["done"] for r in reports])


def slice_sizes(comm: object) -> tuple[int, int]:
    return comm.allreduce_slice_bytes, comm.settings.scratch_slice_bytes()  # type: ignore[attr-defined]


def ring_segment_bytes(comm: Any, in_place: bool = True) -> int:
    """Bytes per segment of this communicator's allreduce ring (48 MiB of float32: 2 or 3 equal chunks).

    ``in_place=False`` is the compressed ring (its wire dtype differs from the buffer's).
    """
    count = 3 << 22
    schedule = allreduce_schedule(comm.ctx, count, 4, in_place=in_place)
    return count // comm.size * 4 // schedule.segments


@pytest.mark.timeout(120)
def test_a_ring_on_one_uncrowded_host_reduces_in_cache_sized_slices() -> None:
    """Two ranks with a CPU each: 2 MiB allreduce slices by default; results still match numpy."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs: with more ranks than CPUs the slices stay 48 MiB")
    rng = np.random.default_rng(5)
    count = 1_500_001  # 6 MB of float32: 3 slices of 2 MiB, the last one short
    floats = [rng.standard_normal(count).astype(np.float32) for _ in range(2)]
    with Cluster(2) as cluster:
        sizes = cluster.results(slice_sizes)
        summed = cluster.results(tasks.allreduce, floats, "sum", timeout=60)
        compressed = cluster.results(tasks.allreduce, floats, "max", "fp16", timeout=60)
    assert sizes == [(2 * MIB, SCRATCH_SLICE_BYTES)] * 2  # broadcasts keep the scratch budget
    for got in summed:
        assert got.tobytes() == (floats[0] + floats[1]).tobytes()
    want = np.maximum(floats[0].astype(np.float16), floats[1].astype(np.float16)).astype(np.float32)
    for got in compressed:
        assert got.tobytes() == want.tobytes()


@pytest.mark.timeout(60)
def test_slices_stay_as_set() -> None:
    with Cluster(2, env={"RINGCORE_SLICE_BYTES": "3M"}) as cluster:
        assert cluster.results(slice_sizes) == [(3 * MIB, 3 * MIB)] * 2


@pytest.mark.timeout(60)
def test_a_crowded_host_keeps_the_scratch_budget_over_tcp() -> None:
    """More ranks than CPUs over TCP: each slice boundary would wait on sockets for descheduled ranks."""
    if len(os.sched_getaffinity(0)) >= 3:
        pytest.skip("needs fewer than 3 CPUs to crowd 3 ranks")
    with Cluster(3, env={"RINGCORE_TRANSPORT": "tcp"}) as cluster:
        assert [size for size, _ in cluster.results(slice_sizes)] == [SCRATCH_SLICE_BYTES] * 3
        assert cluster.results(ring_segment_bytes) == [2 * MIB] * 3  # larger segments: fewer wake-ups
        assert cluster.results(ring_segment_bytes, False) == [512 * 1024] * 3  # compressed: casts overlap


@pytest.mark.timeout(60)
def test_a_crowded_host_slices_for_the_cache_over_shared_memory() -> None:
    """Over shared memory a slice boundary waits on the slots: N MiB slices, one 1 MiB segment per rank."""
    if len(os.sched_getaffinity(0)) >= 3:
        pytest.skip("needs fewer than 3 CPUs to crowd 3 ranks")
    with Cluster(3, env={"RINGCORE_TRANSPORT": "shm"}) as cluster:
        assert [size for size, _ in cluster.results(slice_sizes)] == [3 * MIB] * 3
        assert cluster.results(ring_segment_bytes) == [MIB] * 3
        assert cluster.results(slice_segments) == [1] * 3


def slice_segments(comm: Any) -> int:
    """Segments per chunk of one cache-sized slice's ring (float32)."""
    return allreduce_schedule(
        comm.ctx, comm.allreduce_slice_bytes // 4, 4, in_place=True, sliced=True
    ).segments


@pytest.mark.timeout(60)
def test_an_uncrowded_host_rings_each_slice_in_one_segment_and_a_set_size_wins() -> None:
    """A CPU per rank: 1 MiB segments, a rank's whole chunk of a slice (so slices run in lockstep)."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs: with more ranks than CPUs the ring takes 2 MiB segments")
    with Cluster(2) as cluster:
        assert cluster.results(ring_segment_bytes) == [MIB] * 2
        assert cluster.results(slice_segments) == [1] * 2
        assert cluster.results(ring_segment_bytes, False) == [512 * 1024] * 2  # compressed: casts overlap
    with Cluster(3, env={"RINGCORE_SEGMENT_BYTES": "256K"}) as cluster:  # crowded, yet as set
        assert cluster.results(ring_segment_bytes) == [256 * 1024] * 3
