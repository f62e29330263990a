"""The mailboxes of the shared-memory transport (``ringcore.transport.shm_mailbox``) and its waits on them.

Transports of three ranks, connected in threads of this process over real
segments: posts and their headers, the two slots, waiting for posts through
``progress`` (woken from a block by the poster's doorbell), a frame of the
collective while waiting (a peer on another route), and set-up where one
rank has no mailbox (then none takes the one-shot route).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from ringcore.errors import PeerFailure
from ringcore.transport import shm_setup, wire
from ringcore.transport.base import FrameMismatch
from ringcore.transport.shm import ShmTransport
from tests.conformance.test_transport import SIG, drive, view
from tests.unit.test_shm_setup import close_all, connect_all, ours

pytestmark = pytest.mark.timeout(60)


def post(transport: ShmTransport, seq: int, signature: int, way: int = 1, nbytes: int = 0) -> int:
    """``meet_posts`` with no spin left for this transport (it stays so): post, look once,
    yield once; the slot (``awaited``: who is missing, the collective recorded as running)."""
    transport.spin = 0.0
    return transport.meet_posts(seq, signature, way, nbytes)


def test_every_rank_maps_every_mailbox_and_nothing_is_left_in_dev_shm() -> None:
    before = ours()
    transports = connect_all(3)
    try:
        assert ours() <= before, "a mailbox was left in /dev/shm after set-up"
        for rank, transport in enumerate(transports):
            assert transport.mailbox is not None
            assert transport.mailbox.peers == [peer for peer in range(3) if peer != rank]
    finally:
        close_all(transports)


def test_a_post_is_seen_by_every_peer_with_its_header_and_payload_in_alternate_slots() -> None:
    transports = connect_all(3)
    try:
        boxes = [transport.mailbox for transport in transports]
        assert all(box is not None for box in boxes)
        for seq in (1, 2, 3):
            slot = boxes[1].slot
            assert slot == (seq - 1) % 2
            boxes[1].payload(1, slot)[:8] = np.arange(8, dtype=np.uint8) + seq
            assert post(transports[1], seq, 0xABC, 1, 8) == slot
            for reader in (0, 2):
                assert boxes[reader].posted(1, slot, seq)
                assert not boxes[reader].posted(1, 1 - slot, seq)
                header = boxes[reader].header(1, slot)
                assert (header[1], header[2], header[3]) == (0xABC, 1, 8)
                np.testing.assert_array_equal(boxes[reader].payload(1, slot)[:8], np.arange(8) + seq)
    finally:
        close_all(transports)


def test_progress_waits_for_the_posts_and_a_sleeper_is_woken() -> None:
    """Rank 0 waits for ranks 1 and 2 with no spinning (it blocks at once); their posts wake it."""
    transports = connect_all(3)
    try:
        waiter = transports[0]
        assert post(waiter, 5, SIG) == 0
        assert waiter.awaited == [1, 2]
        assert not waiter.progress(0.01)  # nothing posted: nothing moved

        def post_later() -> None:
            time.sleep(0.05)
            for rank in (1, 2):
                post(transports[rank], 5, SIG)

        poster = threading.Thread(target=post_later)
        poster.start()
        deadline = time.monotonic() + 10
        while waiter.awaited and time.monotonic() < deadline:
            waiter.progress(0.5)
        poster.join()
        assert waiter.awaited == []
        assert waiter.mailbox is not None and waiter.mailbox.asleep[0][0] == 0  # not left announced
    finally:
        close_all(transports)


def test_a_wait_for_one_reducers_result_polls_its_word_alone_and_is_woken_by_the_publish(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ranks 0 and 1 wait for rank 2's result of collective 5 (one reducer): the other posts do not end
    the wait; rank 2's post does not either; its publish (after a waiter blocked) does, and says
    how many ranks took part. Blocks last 5 s here, so only the publish's doorbell wakes in time."""
    from ringcore.transport import shm
    from ringcore.transport.shm_mailbox import RESULT, TAKING

    monkeypatch.setattr(shm, "BLOCK_MAX", 5.0)
    transports = connect_all(3)
    try:
        waiters, reducer = transports[:2], transports[2]
        for waiter in waiters:
            waiter.spin = 0.0
            assert waiter.meet_posts(5, SIG, 1, 0, reducer=2) == 0
            assert waiter.awaited == [2]
        post(reducer, 5, SIG)  # every input is posted now: still no result
        for waiter in waiters:
            waiter.progress(0.01)
            assert waiter.awaited == [2]

        def publish_later() -> None:
            time.sleep(0.05)  # the waiters are asleep on their doorbells by now
            reducer.publish(0, 5, 3)

        publisher = threading.Thread(target=publish_later)
        publisher.start()
        start = time.monotonic()
        for waiter in waiters:
            while waiter.awaited and time.monotonic() < start + 10:
                waiter.progress(5.0)  # a publish that rang no doorbell would leave this asleep 5 s
        publisher.join()
        assert time.monotonic() - start < 3, "the publish did not wake a waiter"
        for waiter in waiters:
            assert waiter.awaited == []
            head = waiter.mailbox.header(2, 0)  # type: ignore[union-attr]
            assert (head[RESULT], head[TAKING]) == (5, 3)
    finally:
        close_all(transports)


def test_a_peers_post_is_progress_for_a_rank_awaiting_the_result() -> None:
    """Rank 0 awaits rank 2's result; rank 1's post is what rank 2 waits for, so it counts as progress
    (the timeout measures time without any), and nothing after it does not."""
    transports = connect_all(3)
    try:
        waiter = transports[0]
        waiter.spin = 0.0
        waiter.meet_posts(8, SIG, 1, 0, reducer=2)
        assert waiter.awaited == [2]
        assert not waiter.progress(0.01)
        post(transports[1], 8, SIG)
        assert waiter.progress(0.01)
        assert waiter.awaited == [2]
        assert not waiter.progress(0.01)
        post(transports[2], 8, SIG)  # the reducer's own post: progress too
        assert waiter.progress(0.01)
        assert not waiter.progress(0.01)
    finally:
        close_all(transports)


@pytest.mark.parametrize("part", [0, 255])
def test_a_frame_of_the_collective_while_waiting_for_posts_is_a_mismatch(part: int) -> None:
    """Rank 1 sends a frame of collective 7 (any part) where rank 0 waits for posts: another route."""
    transports = connect_all(2)
    try:
        waiter, other = transports
        post(waiter, 7, SIG)
        assert waiter.awaited == [1]
        frame = np.zeros(4, np.int32)
        sent = other.isend(0, 0, wire.tag_seq(7, part) << 32, SIG + 1, view(frame))
        drive(other, [sent])
        with pytest.raises(FrameMismatch) as caught:
            end = time.monotonic() + 10
            while time.monotonic() < end:
                waiter.progress(0.05)
        assert caught.value.peer == 1
    finally:
        close_all(transports)


def test_a_frame_from_a_peer_that_posted_is_a_fallback_not_a_mismatch() -> None:
    """Rank 1 posts collective 6, then (every post seen, one absent) runs the ring: its frame comes
    while rank 0 has not looked at the posts again. Rank 0 reads them and goes on."""
    transports = connect_all(2)
    try:
        waiter, other = transports
        post(waiter, 6, SIG)
        assert waiter.awaited == [1]
        post(other, 6, SIG, 0)
        frame = np.zeros(4, np.int32)
        sent = other.isend(0, 0, wire.tag_seq(6, 0) << 32, SIG, view(frame))
        drive(other, [sent])
        waiter._check_idle()  # before progress reads the posts again: no mismatch
        assert waiter.awaited == []
    finally:
        close_all(transports)


def test_a_post_of_the_collective_while_waiting_for_frames_is_a_mismatch() -> None:
    """Rank 1 posts collective 9 where rank 0 waits for a frame of it: another route."""
    transports = connect_all(2)
    try:
        waiter, other = transports
        frame = np.zeros(4, np.int32)
        waiter.expect(wire.tag_seq(9, 0), SIG)
        waiting = waiter.irecv(1, 0, wire.tag_seq(9, 0) << 32, SIG, view(frame))
        post(other, 9, SIG + 1)
        with pytest.raises(FrameMismatch) as caught:
            drive(waiter, [waiting], deadline=10)
        assert (caught.value.peer, caught.value.got) == (1, SIG + 1)
        waiter.cancel()
        assert waiter.mailbox is not None and waiter.mailbox.stray(8) is None  # only collective 9's
    finally:
        close_all(transports)


def test_a_peer_that_shuts_down_before_posting_fails_the_wait() -> None:
    """Rank 1 closes (BYE on TCP) while rank 0 waits for its post: PeerFailure naming it, not a timeout."""
    transports = connect_all(2)
    try:
        waiter, other = transports
        post(waiter, 4, SIG)
        assert waiter.awaited == [1]
        other.close()
        with pytest.raises(PeerFailure, match="before posting its part") as caught:
            end = time.monotonic() + 10
            while waiter.awaited and time.monotonic() < end:
                waiter.progress(0.05)
        assert caught.value.peer == 1
    finally:
        close_all(transports)


def test_one_rank_without_a_mailbox_leaves_every_rank_without(monkeypatch: pytest.MonkeyPatch) -> None:
    real, calls, lock = shm_setup._make_mailbox, [0], threading.Lock()

    def first_fails() -> object:
        with lock:
            calls[0] += 1
            first = calls[0] == 1
        return None if first else real()

    monkeypatch.setattr(shm_setup, "_make_mailbox", first_fails)
    before = ours()
    transports = connect_all(3)
    try:
        assert [transport.mailbox for transport in transports] == [None, None, None]
        assert all(transport.links for transport in transports)  # the rings still carry everything
        assert ours() <= before
    finally:
        close_all(transports)


def test_piece_numbers_never_repeat_a_post_two_back_in_the_same_slot() -> None:
    """Two-shot pieces post twice each, alternating the mailbox's two slots: every post's number differs
    from the one two posts before (the same slot), across a collective's pieces and from the collective
    before, also past 2**32 collectives, where piece 0's number is the collective's own."""
    from ringcore.plans.oneshot import piece_number

    for seq in (1, 2, (1 << 32) - 1, 1 << 32, (1 << 32) + 1, 5 * (1 << 32) + 3, (1 << 47) + 9):
        assert piece_number(seq, 0) == seq
        posts = [number for k in range(300) for number in (piece_number(seq, k),) * 2]  # input, share
        earlier = [piece_number(seq - 1, k) for k in (0, 299)]  # the collective before: one slot or pieces
        for before in earlier:
            run = [before, before, *posts]
            assert all(run[i] != run[i - 2] for i in range(2, len(run))), seq
        assert len(set(posts)) == 300
