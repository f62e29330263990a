"""Symmetric allocations and the direct allreduce's arithmetic, in one process.

A world of two whose "peer" is this same process (its record allgathered
twice) exercises the real exchange: the memfd is reopened through
``/proc/<pid>/fd`` and mapped a second time.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ringcore.algo import direct
from ringcore.buffers import DTYPES
from ringcore.errors import PeerFailure
from ringcore.kernels.numpy_ops import Reducer
from ringcore.ops import Compression, ReduceOp
from ringcore.plans import direct as route
from ringcore.symmetric import SymmetricMemory, create, open_peer
from ringcore.transport import cma


def self_as_peer(record: np.ndarray) -> np.ndarray:
    return np.concatenate([record, record])


def test_an_allocation_is_mapped_twice_and_found_by_address() -> None:
    memory = SymmetricMemory(0, 2, shared=True)
    agreed = []
    arr = memory.empty((100, 10), np.dtype(np.float32), self_as_peer, lambda ok: agreed.append(ok) or ok)
    assert agreed == [True] and arr.shape == (100, 10) and arr.dtype == np.float32
    allocation, offset = memory.locate(arr[10:20])  # type: ignore[misc]
    assert offset == 10 * 10 * 4 and allocation.serial == 1
    (peer,) = allocation.peers(offset, 100, np.dtype(np.float32))
    arr[10:20] = 3.5
    assert np.all(peer == 3.5), "the second mapping shows the same memory"
    assert memory.locate(arr[:, 0]) is None, "not contiguous"
    assert memory.locate(np.empty(10, np.float32)) is None


def test_the_registry_forgets_an_allocation_once_its_array_is_gone() -> None:
    memory = SymmetricMemory(0, 2, shared=True)
    arr = memory.empty((1000,), np.dtype(np.float64), self_as_peer, lambda ok: ok)
    assert memory.locate(arr) is not None
    del arr
    gc.collect()
    assert memory.locate(np.empty(10)) is None
    assert memory._registry == ([], {})


def memfd_descriptors() -> list[str]:
    links = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor is gone by now
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
    return [link for link in links if "ringcore-symmetric" in link]


def test_no_descriptor_outlives_the_allocation_call() -> None:
    """Mappings hold no descriptor, so the memfds cannot be opened through /proc afterwards."""
    memory = SymmetricMemory(0, 2, shared=True)
    before = memfd_descriptors()
    arrays = [memory.empty((4096,), np.dtype(np.float32), self_as_peer, lambda ok: ok) for _ in range(3)]
    assert all(memory.locate(a) is not None for a in arrays)
    assert memfd_descriptors() == before


def test_a_rank_without_memfds_still_takes_part_and_all_fall_back(monkeypatch: pytest.MonkeyPatch) -> None:
    from ringcore import symmetric

    def refused(nbytes: int) -> object:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(symmetric, "create", refused)
    memory = SymmetricMemory(0, 2, shared=True)
    seen: list[object] = []
    arr = memory.empty((10,), np.dtype(np.int64), lambda r: seen.append(r) or self_as_peer(r), lambda ok: ok)
    assert len(seen) == 1, "the exchange still ran"
    arr[...] = 3
    assert memory.locate(arr) is None and np.all(arr == 3)


def test_an_allocation_no_peer_could_map_stays_an_ordinary_array() -> None:
    memory = SymmetricMemory(0, 2, shared=True)

    def unreadable(record: np.ndarray) -> np.ndarray:
        return np.concatenate([record, [os.getpid(), 987654, record[2], record[3]]])  # no such descriptor

    arr = memory.empty((64,), np.dtype(np.int32), unreadable, lambda ok: ok)
    arr[...] = 5
    assert memory.locate(arr) is None and np.all(arr == 5)
    assert memory.serials == 1, "the serial counts every collective allocation"


def test_ranks_that_ask_for_different_sizes_get_a_value_error() -> None:
    memory = SymmetricMemory(0, 2, shared=True)

    def other_size(record: np.ndarray) -> np.ndarray:
        return np.concatenate([record, [*record[:3], record[3] + 4]])

    with pytest.raises(ValueError, match=r"rank 0: 400 bytes, rank 1: 404 bytes"):
        memory.empty((100,), np.dtype(np.float32), other_size, lambda ok: ok)


def test_a_job_across_hosts_allocates_locally_without_collectives() -> None:
    memory = SymmetricMemory(0, 4, shared=False)

    def never(*_: object) -> object:
        raise AssertionError("no collective across hosts")

    arr = memory.empty((8,), np.dtype(np.float32), never, never)  # type: ignore[arg-type]
    assert arr.shape == (8,) and memory.locate(arr) is None


def test_the_memfd_is_sealed_and_reopened_only_at_its_size() -> None:
    fd, mapping = create(5000)
    try:
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 10)
        inode = os.fstat(fd).st_ino
        assert open_peer(os.getpid(), fd, inode, 5000) is not None
        assert open_peer(os.getpid(), fd, inode, 9000) is None, "another size names another file"
        assert open_peer(os.getpid(), fd, inode + 1, 5000) is None, "another inode is another memfd"
        assert open_peer(os.getpid(), 10**6, inode, 5000) is None
        with open(os.devnull, "rb") as other:
            assert open_peer(os.getpid(), other.fileno(), inode, 5000) is None, "only ringcore's memfds"
    finally:
        del mapping
        os.close(fd)


@given(st.integers(0, 10_000), st.integers(1, 9), st.sampled_from([1, 2, 4, 8]))
def test_shares_cover_the_buffer_in_aligned_disjoint_pieces(count: int, size: int, itemsize: int) -> None:
    bounds = direct.shares(count, size, itemsize)
    assert len(bounds) == size and bounds[0][0] == 0 and bounds[-1][1] == count
    for (lo, hi), (next_lo, _) in itertools.pairwise(bounds):
        assert lo <= hi == next_lo
        assert (hi * itemsize) % direct.ALIGN_BYTES == 0 or hi == count


@pytest.mark.parametrize("way", ["mapped", "remote"])
@pytest.mark.parametrize("op", ["sum", "avg", "max", "prod"])
@pytest.mark.parametrize("size", [2, 3, 5])
def test_reduce_and_push_give_every_buffer_the_reduction(op: str, size: int, way: str) -> None:
    if way == "remote" and not cma.available():
        pytest.skip("process_vm_readv is not available on this platform")
    rng = np.random.default_rng(size)
    count = 3 * direct.PIECE_BYTES // 8 + 17  # several pieces
    buffers = [rng.integers(1, 4, count).astype(np.float64) for _ in range(size)]
    expected = {
        "sum": np.sum(buffers, axis=0),
        "avg": np.sum(buffers, axis=0) / size,
        "max": np.max(buffers, axis=0),
        "prod": np.prod(buffers, axis=0),
    }[op]
    reducer = Reducer(DTYPES["float64"], ReduceOp.parse(op), Compression.NONE, size)
    bounds = direct.shares(count, size, 8)
    scratch = np.empty(direct.PIECE_BYTES, np.uint8)
    for rank in range(size):  # the ranks one after another: each touches only its share
        order = [(rank + step) % size for step in range(1, size)]
        peers: list[direct.Peer] = [
            direct.Mapped(buffers[peer])
            if way == "mapped"  # remote: through this process's own pid, as a peer's would be
            else route.Remote(peer, os.getpid(), buffers[peer].ctypes.data, buffers[rank], scratch)
            for peer in order
        ]
        direct.reduce_and_push(buffers[rank], peers, *bounds[rank], reducer)
    for rank, buf in enumerate(buffers):
        np.testing.assert_allclose(buf, expected, rtol=1e-12, err_msg=f"rank {rank}")


@pytest.mark.skipif(not cma.available(), reason="process_vm_readv is not available on this platform")
@pytest.mark.parametrize("pieces", [1, 3])
def test_remote_peers_kept_across_calls_reach_each_calls_data(pieces: int) -> None:
    """The route keeps its ``Remote`` peers while every rank passes the same memory (a training
    loop): the same peers, three calls with fresh inputs, give each call's sum. One piece a share:
    the transfers stay aimed from call to call; several: they are aimed again at every piece."""
    size = 3
    count = size * (pieces * direct.PIECE_BYTES // 8) - 5
    buffers = [np.empty(count) for _ in range(size)]
    reducer = Reducer(DTYPES["float64"], ReduceOp.SUM, Compression.NONE, size)
    bounds = direct.shares(count, size, 8)
    scratch = np.empty(direct.PIECE_BYTES, np.uint8)
    kept = {
        rank: [
            route.Remote(peer, os.getpid(), buffers[peer].ctypes.data, buffers[rank], scratch)
            for peer in [(rank + step) % size for step in range(1, size)]
        ]
        for rank in range(size)
    }
    rng = np.random.default_rng(pieces)
    for call in range(3):
        inputs = [rng.integers(-9, 9, count).astype(np.float64) for _ in range(size)]
        for buf, x in zip(buffers, inputs, strict=True):
            buf[...] = x
        for rank in range(size):
            direct.reduce_and_push(buffers[rank], kept[rank], *bounds[rank], reducer)
        for rank, buf in enumerate(buffers):
            np.testing.assert_array_equal(buf, np.sum(inputs, axis=0), err_msg=f"call {call}, rank {rank}")


@pytest.mark.skipif(not cma.available(), reason="process_vm_readv is not available on this platform")
def test_a_remote_peer_whose_process_is_gone_is_a_peer_failure_naming_it() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=20)  # reaped: the pid names no process
    mine = np.ones(1024, np.float32)
    peer = route.Remote(3, gone.pid, mine.ctypes.data, mine, np.empty(direct.PIECE_BYTES, np.uint8))
    for attempt in (lambda: peer.read(0, 16), lambda: peer.write(mine, 0, 16)):
        with pytest.raises(
            PeerFailure, match=r"rank 3: could not \w+ its buffer \(its process is gone\)"
        ) as failure:
            attempt()
        assert failure.value.peer == 3
    assert (mine == 1).all()


def test_the_vote_takes_mapped_memory_at_one_place_else_remote_else_none() -> None:
    mapped, remote, none = route.MAPPED, route.REMOTE, route.NONE
    assert route._agreed([[mapped, 100, 3, 64], [mapped, 900, 3, 64]]) == mapped
    assert route._agreed([[mapped, 100, 3, 64], [mapped, 900, 3, 0]]) == remote, "another offset"
    assert route._agreed([[mapped, 100, 3, 64], [mapped, 900, 4, 64]]) == remote, "another allocation"
    assert route._agreed([[mapped, 100, 3, 64], [remote, 900, 0, 0]]) == remote
    assert route._agreed([[remote, 100, 0, 0], [none, 0, 0, 0], [mapped, 5, 1, 0]]) == none, "a GPU buffer"


def test_bad_shapes_and_dtypes_are_refused_before_any_collective() -> None:
    from ringcore.comm import Communicator
    from ringcore.config import Settings

    comm = Communicator(0, 1, 0, 1, Settings.from_env({}), None)  # a world of one: no collective at all
    for shape, dtype, error in [
        ((2, 2.5), np.float32, TypeError),
        ((True,), np.float32, TypeError),
        ("ab", np.float32, TypeError),
        ((3, -1), np.float32, ValueError),
        ((4,), object, TypeError),
    ]:
        with pytest.raises(error, match=r"ringcore\.empty"):
            comm.empty(shape, dtype)  # type: ignore[arg-type]
    arr = comm.empty((3, 4), np.int16)
    assert arr.shape == (3, 4) and arr.dtype == np.int16 and arr.flags.writeable
    comm.shutdown()
