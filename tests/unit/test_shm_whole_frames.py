"""The shared-memory latency path's whole frames: one slot written and read with no request."""

from __future__ import annotations

import numpy as np
import pytest

from ringcore.transport import shm, wire
from ringcore.transport.base import FrameMismatch, Request
from tests.conformance.test_transport import SIG, drive_for, shm_mesh, view
from tests.unit.test_shm_single_copy import link_pair

pytestmark = pytest.mark.timeout(60)


def _queued_receive(reader: shm._Link, nbytes: int, tag: int) -> tuple[Request, np.ndarray]:
    out = np.zeros(nbytes, np.uint8)
    request = Request(0, 0, tag, view(out))
    reader.recvs.append((request, SIG, 0))
    return request, out


def test_a_whole_frame_goes_through_one_slot_and_frees_it() -> None:
    writer, reader = link_pair(slots=2)
    for k in range(5):  # more frames than slots: each read frees its slot for the next write
        frame = np.arange(64, dtype=np.uint8) + k
        assert writer.write_whole(7 + k, SIG, view(frame))
        out = np.zeros(64, np.uint8)
        assert reader.read_whole(7 + k, SIG, view(out)) is True
        np.testing.assert_array_equal(out, frame)
    assert reader.read_whole(99, SIG, view(np.zeros(64, np.uint8))) is False, "nothing there yet"


def test_an_empty_frame_is_whole_too() -> None:
    writer, reader = link_pair()
    assert writer.write_whole(3, SIG, view(np.zeros(0, np.uint8)))
    assert reader.read_whole(3, SIG, view(np.zeros(0, np.uint8))) is True


def test_whole_frames_and_queued_frames_read_alike() -> None:
    """A frame written whole is read by ``pull``, and one pushed in a slot by ``read_whole``."""
    writer, reader = link_pair()
    first, second = np.arange(40, dtype=np.uint8), np.arange(40, dtype=np.uint8)[::-1].copy()
    assert writer.write_whole(1, SIG, view(first))
    writer.sends.append((Request(1, 0, 2, view(second)), SIG, 0))
    assert writer.push()
    request, out = _queued_receive(reader, 40, 1)
    assert reader.pull() and request.done
    np.testing.assert_array_equal(out, first)
    got = np.zeros(40, np.uint8)
    assert reader.read_whole(2, SIG, view(got)) is True
    np.testing.assert_array_equal(got, second)


def test_a_frame_that_is_not_one_slot_is_left_to_the_queue() -> None:
    writer, reader = link_pair(slot_bytes=64)
    big = np.arange(100, dtype=np.uint8)  # two pieces
    assert not writer.write_whole(5, SIG, view(big)), "more than a slot: queue it"
    writer.sends.append((Request(1, 0, 5, view(big)), SIG, 0))
    small = np.ones(8, np.uint8)
    assert not writer.write_whole(6, SIG, view(small)), "a frame queued before it goes first"
    assert writer.push()
    out = np.zeros(100, np.uint8)
    assert reader.read_whole(5, SIG, view(out)) is None, "a piece of several: pull reads it"
    assert not out.any()
    request, out = _queued_receive(reader, 100, 5)
    assert reader.pull() and request.done
    np.testing.assert_array_equal(out, big)


def test_a_pointer_frame_is_never_written_whole() -> None:
    writer, _ = link_pair(single_copy_bytes=16)
    assert not writer.write_whole(5, SIG, view(np.ones(32, np.uint8)))
    assert writer.write_whole(6, SIG, view(np.ones(8, np.uint8))), "below the pointer size"


def test_a_full_ring_takes_no_whole_frame() -> None:
    writer, reader = link_pair(slots=2)
    frame = np.ones(8, np.uint8)
    assert writer.write_whole(1, SIG, view(frame)) and writer.write_whole(2, SIG, view(frame))
    assert not writer.write_whole(3, SIG, view(frame)), "both slots are the reader's"
    assert reader.read_whole(1, SIG, view(np.zeros(8, np.uint8)))
    assert writer.write_whole(3, SIG, view(frame))


@pytest.mark.parametrize(
    ("tag", "signature", "nbytes", "field"),
    [(1, SIG + 1, 16, "signature"), (2, SIG, 16, "tag"), (1, SIG, 8, "nbytes")],
)
def test_a_frame_that_disagrees_is_refused_before_a_byte_lands(
    tag: int, signature: int, nbytes: int, field: str
) -> None:
    writer, reader = link_pair()
    assert writer.write_whole(1, SIG, view(np.full(16, 9, np.uint8)))
    out = np.zeros(nbytes, np.uint8)
    with pytest.raises(FrameMismatch, match=field):
        reader.read_whole(tag, signature, view(out))
    assert not out.any()


SEQ = wire.tag_seq(5, 0)  # collective 5's sequence field, as ``run_bound`` passes it to ``expect``


def _stray_frame_case() -> list:
    """Three ranks; rank 1 sends collective 5's frame with another signature to rank 0, which never receives from it."""
    t = shm_mesh(3, 1)
    t[1].expect(SEQ, SIG + 1)
    t[1].isend(0, 0, wire.make_tag(SEQ, 0, 0), SIG + 1, view(np.ones(8, np.uint8)))
    t[1].progress(0)
    return t


def test_a_stray_frame_of_the_collective_with_another_signature_fails_the_wait() -> None:
    """``expect`` looks at idle frames at most every ``IDLE_LOOK_EVERY``; a wait always looks."""
    t = _stray_frame_case()
    try:
        t[0].next_liveness = float("inf")  # expect itself does not look this time
        t[0].expect(SEQ, SIG)
        t[0].irecv(2, 0, wire.make_tag(SEQ, 0, 0), SIG, view(np.zeros(8, np.uint8)))
        with pytest.raises(FrameMismatch, match="signature") as info:
            drive_for(t[0], 5.0)  # rank 2 never sends: rank 0 waits, and the wait finds it
        assert info.value.peer == 1
    finally:
        for transport in t:
            transport.close()


def test_expect_finds_a_stray_frame_once_the_liveness_interval_passed() -> None:
    """The look at TCP news is due (1 ms) but its peek at idle frames is not (10 ms): nothing
    found; once both are due, the stray frame is."""
    t = _stray_frame_case()
    try:
        t[0].next_liveness, t[0].next_idle_look = 0.0, float("inf")
        t[0].expect(SEQ, SIG)  # the sockets polled, the rings not peeked at
        assert t[0].next_liveness > 0.0, "the look at TCP news did not run"
        t[0].next_liveness = t[0].next_idle_look = 0.0
        with pytest.raises(FrameMismatch, match="signature") as info:
            t[0].expect(SEQ, SIG)
        assert info.value.peer == 1
    finally:
        for transport in t:
            transport.close()
