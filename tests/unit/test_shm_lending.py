"""Combining straight from a peer's shared-memory slots: lent receives, and which steps may use them."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from ringcore.algo import halving_doubling, program, recursive_doubling, ring
from ringcore.algo.steps import Buf, Region, Schedule, Step
from ringcore.transport import shm
from ringcore.transport.base import FrameMismatch, Request
from tests.conformance.test_transport import SIG, drive, shm_mesh, tcp_mesh, view
from tests.unit.test_shm_single_copy import link_pair

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def shm_pair() -> Iterator[list]:
    """Two ranks over shared memory, one channel; closed after the test."""
    t = shm_mesh(2, 1)
    try:
        yield t
    finally:
        for transport in t:
            transport.close()


def _send(writer: shm._Link, frame: np.ndarray, tag: int) -> Request:
    request = Request(1, 0, tag, view(frame))
    writer.sends.append((request, SIG, 0))
    writer.push()
    return request


def _lent_receive(reader: shm._Link, nbytes: int, tag: int) -> tuple[Request, np.ndarray]:
    out = np.zeros(nbytes, np.uint8)
    request = Request(0, 0, tag, view(out))
    request.lent = []
    reader.recvs.append((request, SIG, 0))
    return request, out


def test_a_lent_frame_stays_in_its_slots_until_released() -> None:
    writer, reader = link_pair(slots=4)
    first = np.arange(200, dtype=np.uint8)  # 4 pieces of at most 64 bytes: the whole ring
    _send(writer, first, 7)
    lent, out = _lent_receive(reader, 200, 7)
    assert reader.pull() and lent.done
    assert lent.lent is not None and [offset for offset, _ in lent.lent] == [0, 64, 128, 192]
    assert b"".join(bytes(piece) for _, piece in lent.lent) == first.tobytes()
    assert not out.any(), "nothing was copied into the view"

    second = np.full(10, 9, np.uint8)
    sent = _send(writer, second, 8)
    assert not sent.done, "every slot is still lent: the writer waits"
    copied, got = _lent_receive(reader, 10, 8)
    copied.lent = None  # posted as a plain receive
    reader.pull()
    assert not copied.done, "no later frame is read while one is lent"

    reader.release()
    assert writer.push() and sent.done
    assert reader.pull() and copied.done
    np.testing.assert_array_equal(got, second)


def test_a_frame_the_ring_cannot_hold_at_once_is_copied() -> None:
    writer, reader = link_pair(slots=2)
    frame = np.arange(200, dtype=np.uint8)  # 4 pieces through 2 slots
    request, out = _lent_receive(reader, 200, 7)
    sent = Request(1, 0, 7, view(frame))
    writer.sends.append((sent, SIG, 0))
    while not request.done:
        writer.push()
        reader.pull()
    assert request.lent is None and reader.held is None
    np.testing.assert_array_equal(out, frame)


def test_a_frame_sent_as_a_pointer_is_copied_not_lent() -> None:
    writer, reader = link_pair(single_copy_bytes=100)
    frame = np.arange(150, dtype=np.uint8)
    _send(writer, frame, 7)
    request, out = _lent_receive(reader, 150, 7)
    assert reader.pull() and request.done
    assert request.lent is None and reader.held is None
    np.testing.assert_array_equal(out, frame)


def test_cancel_gives_lent_slots_back(shm_pair: list) -> None:
    t = shm_pair
    frames = [np.arange(1000, dtype=np.uint8), np.arange(1000, dtype=np.uint8)[::-1].copy()]
    first = t[0].isend(1, 0, 5, SIG, view(frames[0]))
    drive(t[0], [first])
    lent = t[1].irecv_lent(0, 0, 5, SIG, view(np.zeros(1000, np.uint8)))
    drive(t[1], [lent])
    assert lent.lent, "a frame from a local peer in slots is lent"
    blocked = [t[0].isend(1, 0, 6 + k, SIG, view(frames[1])) for k in range(3)]
    t[0].progress(0)
    assert not blocked[-1].done, "3 slots, one lent: the third frame waits"
    t[1].cancel()  # a failed collective: the lent frame is dropped, its slots freed
    drive(t[0], blocked)
    outs = [np.zeros(1000, np.uint8) for _ in blocked]
    received = [t[1].irecv(0, 0, 6 + k, SIG, view(out)) for k, out in enumerate(outs)]
    drive(t[1], received)
    for out in outs:
        np.testing.assert_array_equal(out, frames[1])


# --------------------------------------------------------------------------- which steps lend


def _lends(schedule: Schedule) -> list[int]:
    return [program._lend(schedule, i, _reduce(step)) for i, step in enumerate(schedule.steps)]


def _reduce(step: Step) -> tuple | None:
    if step.reduce is None:
        return None
    dst, a, b = step.reduce
    if step.commit:
        dst = Region(Buf.USER, dst.start, dst.count)
    return tuple(program._key(region) for region in (dst, a, b))


def test_the_library_schedules_lend_every_combine() -> None:
    in_place_ring = ring.allreduce(0, 2, 1000, 4, 1 << 20, in_place=True)
    assert _lends(in_place_ring) == [1, 0], (
        "the commit reads WORK's received chunk, which nothing reads after"
    )
    assert _lends(ring.allreduce(1, 3, 999, 4, 1 << 20)) == [1, 1, 0, 0]
    assert _lends(recursive_doubling.allreduce(0, 3, 100, 4, 1 << 20)) == [2, 2, 0], (
        "the fold-in's STAGE is overwritten by the next receive before anything reads it"
    )
    assert _lends(recursive_doubling.allreduce(1, 4, 100, 4, 1 << 20)) == [1, 2], (
        "the lower rank's bytes go first"
    )
    assert _lends(halving_doubling.allreduce(0, 4, 100, in_place=True)) == [1, 2, 0, 0]


def test_a_received_region_read_later_is_not_lent() -> None:
    work, stage = Region(Buf.WORK, 0, 10), Region(Buf.STAGE, 0, 10)
    sent_on = Schedule((Step(1, work, 1, stage, reduce=(work, work, stage)), Step(2, stage)), 1, work)
    assert _lends(sent_on) == [0, 0], "a later step sends the received bytes on"
    partly, half = Region(Buf.STAGE, 5, 5), Region(Buf.WORK, 5, 5)
    reread = Schedule(
        (
            Step(1, work, 1, stage, reduce=(work, work, stage)),
            Step(recv_peer=1, recv=partly, reduce=(half, half, partly)),
        ),
        1,
        work,
    )
    assert _lends(reread) == [0, 2], "only half is overwritten before a later combine reads the region"
    kept = Schedule((Step(1, work, 1, stage, reduce=(work, work, stage)),), 1, stage)
    assert _lends(kept) == [0], "the received bytes are the result"


# --------------------------------------------------------------------------- the latency path


def test_swap_lends_a_frame_and_returns_its_receive_done(shm_pair: list) -> None:
    t = shm_pair
    frame = np.arange(1000, dtype=np.uint8)
    drive(t[0], [t[0].isend(1, 0, 5, SIG, view(frame))])
    out = np.zeros(1000, np.uint8)
    sent, received = t[1].swap(None, (0, 0, view(out)), 5, SIG, lend=True, scratch=False)
    assert sent is None and received is not None and received.done
    assert received.lent and b"".join(bytes(p) for _, p in received.lent) == frame.tobytes()
    assert not out.any(), "a lent frame is read where it lies"
    t[1].release(received)
    assert t[1].links[(0, 0)].held is None


def test_swap_checks_a_frame_before_a_byte_lands_in_the_callers_memory(shm_pair: list) -> None:
    t = shm_pair
    drive(t[0], [t[0].isend(1, 0, 5, SIG, view(np.full(100, 7, np.uint8)))])
    out = np.zeros(100, np.uint8)
    with pytest.raises(FrameMismatch):
        t[1].swap(None, (0, 0, view(out)), 6, SIG, scratch=False)
    assert not out.any(), "the wrong frame left the caller's memory alone"


def test_tcp_swap_refuses_a_receive_into_the_callers_memory() -> None:
    t = tcp_mesh(2, 1)
    try:
        assert t[1].swap(None, (0, 0, view(np.zeros(10, np.uint8))), 5, SIG, scratch=False) is None
        assert not t[1].conns[(0, 0)].recvs, "refused, having posted nothing"
    finally:
        for transport in t:
            transport.close()


def _in_place_allreduce(transports: list, users: list[np.ndarray]) -> None:
    """The in-place ring (2 ranks) or halving-doubling (4) over ``transports``, in lockstep, into ``users``."""
    from ringcore.algo.lockstep import LockstepExecutor
    from ringcore.buffers import DTYPES
    from ringcore.kernels.numpy_ops import Reducer
    from ringcore.ops import Compression, ReduceOp
    from tests.conformance.test_transport import in_parallel

    size, count = len(transports), users[0].size

    def run(rank: int) -> None:
        if size == 2:
            schedule = ring.allreduce(rank, size, count, 4, 1 << 20, True)
        else:
            schedule = halving_doubling.allreduce(rank, size, count, True)
        arrays = {buf: np.empty(count, np.float32) for buf in (*schedule.scratch, Buf.WORK)}
        arrays[Buf.USER] = users[rank]
        reducer = Reducer(DTYPES["float32"], ReduceOp.SUM, Compression.NONE, size)
        LockstepExecutor(transports[rank], schedule, arrays, reducer, 1, SIG, 20.0).run()

    in_parallel(*[lambda rank=rank: run(rank) for rank in range(size)])


@pytest.mark.parametrize("size", [2, 4])
def test_in_place_steps_over_shared_memory_take_the_latency_path_and_agree_with_posting(size: int) -> None:
    """Lent and caller-memory receives go through ``swap``; with it disabled, posted, the same bits."""
    rng = np.random.default_rng(size)
    inputs = [
        rng.standard_normal(1 << 16).astype(np.float32) for _ in range(size)
    ]  # frames of 64-128 KiB: lent
    results, calls = {}, []
    for latency_path in (True, False):
        t = shm_mesh(size, 1, shm_bytes=256 << 10)
        try:
            for transport in t:
                real = transport.swap
                spy = lambda *a, real=real, **kw: calls.append(a[4:6]) or real(*a, **kw)  # noqa: E731
                transport.swap = spy if latency_path else None  # None: every step posted
            results[latency_path] = [x.copy() for x in inputs]
            _in_place_allreduce(t, results[latency_path])
        finally:
            for transport in t:
                transport.close()
    assert any(lend for lend, _ in calls), "a lent receive took swap"
    assert any(not scratch for _, scratch in calls), "a receive into USER took swap"
    for fast, posted in zip(results[True], results[False], strict=True):
        np.testing.assert_array_equal(fast, posted)
    np.testing.assert_allclose(results[True][0], np.sum(inputs, axis=0), rtol=1e-5, atol=1e-5)
