"""Mailboxes: one segment per rank that its owner writes and every local peer reads, for small inputs.

A small allreduce on one host is a handful of microseconds of memory work
and many more of waiting, so what it costs is how many times each rank
must wait for another. Through the pair rings (:mod:`ringcore.transport.shm_ring`)
recursive doubling waits ``log2 N`` times, each on one partner's frame; with
a mailbox each rank writes its input once, where every peer can read it, and
waits once, for every peer's (the one-shot allreduce of
:mod:`ringcore.plans.oneshot`). Measured on 2 cores with 4 ranks, 4 KiB float32
sum, the same loop by hand in one job: 23 us per allreduce against 38-51 us on
the rings (``bench/HISTORY.md``, "Small allreduces in one shot").

Layout of a rank's mailbox (``segment_bytes``)::

    [asleep u64 | pad to 64 B]
    [word i64 | pad to 64 B]
    [slot 0: seq u64 | signature u64 | way u64 | nbytes u64 | result u64 | taking u64 | pad to 64 B]
    [payload: slot_bytes]
    [slot 1: ...]

The owner's ``k``-th post (k = 0, 1, ...) goes in slot ``k % 2``: payload
and header words first, then ``seq`` (the collective's number, never 0) last, so a
reader that sees ``seq`` sees the rest (x86-64's store order, as for the
rings). Two slots are enough: a rank makes post ``k + 2`` only after every
peer made post ``k + 1`` (it waited for them), and a peer makes post ``k + 1``
only once it has read everything of post ``k``. Every rank posts in the same
collectives (the route is chosen alike on every rank), so the ``k`` agree.

One reducer. Where one rank reduces a collective for all (the one-shot
allreduce on a host whose ranks outnumber its cores, :mod:`ringcore.plans.oneshot`,
"One reducer"), it writes the result over its input in the slot of its post,
then ``taking`` (how many ranks posted that they take part) and, last,
``result`` = ``seq`` (:meth:`Mailbox.publish`); its peers wait for that word
instead of every post. The slot rule still holds: a peer reads the result
before its next post, and the reducer writes that slot again only two posts on.

Waiting. A reader that blocks stores a fresh episode in its own ``asleep``
word, looks once more, and sleeps on its doorbell; a poster, after storing
``seq``, fences and rings the doorbell of every peer whose word holds an
episode it has not rung for: the rings' protocol ("Doorbells" in
:mod:`ringcore.transport.shm_ring`), with the transport's one wait loop
(:meth:`ringcore.transport.shm.ShmTransport.progress`).

The word. The direct allreduce's safety word of its owner (:mod:`ringcore.plans.direct`,
"Safety"): ``seq`` while the owner reads and writes its peers' buffers, ``-seq`` once
it gave up. Peers read it with a load, where reading it from the owner's memory
through the kernel cost a system call per peer and call (4 us each at N=4).

Files. Made and mapped at set-up (:mod:`ringcore.transport.shm_setup`), like the
ring segments: 0600, unguessable names, unlinked once every peer mapped them.
"""

from __future__ import annotations

import numpy as np

from ringcore.transport.shm_ring import Segment

# The largest input a mailbox holds: RINGCORE_DIRECT_BYTES' auto limit from three ranks, so that every
# allreduce below the direct route's sizes fits the two-shot route (ringcore.plans.oneshot; longer ones,
# where the limit is higher, go in pieces of it); broadcasts and gathers up to it go one shot. Each
# rank's 2 MiB are reserved in /dev/shm at set-up (fallocate).
SLOT_BYTES = 1024 * 1024
_LINE = 64
_HEAD = 2 * _LINE  # the asleep word's line, the safety word's line
SEQ, SIGNATURE, WAY, NBYTES, RESULT, TAKING = range(6)  # a slot header's words
SEQ_BITS = 24  # a collective's number as a frame's tag holds it (ringcore.transport.wire.tag_seq)


def segment_bytes(slot_bytes: int = SLOT_BYTES) -> int:
    """Bytes of one rank's mailbox with slots of ``slot_bytes``."""
    return _HEAD + 2 * (_LINE + slot_bytes)


class Mailbox:
    """This rank's mailbox and its local peers', mapped (module docstring).

    Args:
        rank: this rank.
        segments: ``rank -> Segment`` of every rank of the job, this one's included.
        slot_bytes: the payload room of each slot.
    """

    def __init__(self, rank: int, segments: dict[int, Segment], slot_bytes: int = SLOT_BYTES) -> None:
        self.rank = rank
        self.slot_bytes = slot_bytes
        self.segments = segments
        self.posts = 0  # posts this rank made: the next goes in slot posts % 2
        self.slot = 0  # the slot of this rank's next post: write its input into payload(rank, slot) first
        self.peers = sorted(peer for peer in segments if peer != rank)
        self.rung = dict.fromkeys(self.peers, 0)  # each peer's last episode this rank rang for
        self.asleep: dict[int, memoryview] = {}
        self.words: dict[int, memoryview] = {}  # rank -> its direct allreduce's word, as i64
        self.heads: dict[int, tuple[memoryview, memoryview]] = {}  # rank -> each slot's header, as u64
        self.payloads: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._views: dict[tuple[int, int, np.dtype], list[np.ndarray]] = {}
        stride = _LINE + slot_bytes
        for owner, segment in segments.items():
            data = segment.bytes
            assert data is not None and data.nbytes >= segment_bytes(slot_bytes)
            self.asleep[owner] = memoryview(data[:8]).cast("Q")
            self.words[owner] = memoryview(data[_LINE : _LINE + 8]).cast("q")
            heads = [
                memoryview(data[_HEAD + i * stride : _HEAD + _LINE + i * stride]).cast("Q") for i in (0, 1)
            ]
            self.heads[owner] = (heads[0], heads[1])
            pay = [data[_HEAD + _LINE + i * stride : _HEAD + _LINE + i * stride + slot_bytes] for i in (0, 1)]
            self.payloads[owner] = (pay[0], pay[1])
        # Per slot, the peers' headers in ``peers`` order: the waits read them with no call per peer.
        self.peer_heads = tuple([self.heads[peer][i] for peer in self.peers] for i in (0, 1))
        # Per slot and rank, that rank's header alone: what a wait for its result reads ("One reducer").
        self.lone_heads = tuple({owner: [self.heads[owner][i]] for owner in self.heads} for i in (0, 1))
        self._peer_asleep = [(peer, self.asleep[peer]) for peer in self.peers]

    def post(self, seq: int, signature: int, way: int, nbytes: int) -> int:
        """Publish this rank's input of collective ``seq``, already in its next slot; the slot."""
        slot = self.slot
        self.posts += 1
        self.slot = self.posts & 1  # an attribute, not a property: 3.11 does not specialise those
        head = self.heads[self.rank][slot]
        head[1], head[2], head[3] = signature, way, nbytes
        head[0] = seq  # last: the post is now the peers'
        return slot

    def publish(self, slot: int, seq: int, taking: int) -> None:
        """Say that the result of collective ``seq`` is in this rank's ``slot`` (where its input was),
        and that ``taking`` ranks took part ("One reducer"); a fence and the doorbells are the caller's."""
        head = self.heads[self.rank][slot]
        head[TAKING] = taking
        head[RESULT] = seq  # last: the result is now the peers'

    def posted(self, peer: int, slot: int, seq: int) -> bool:
        """Whether ``peer`` has posted collective ``seq`` in ``slot``."""
        return self.heads[peer][slot][0] == seq

    def header(self, peer: int, slot: int) -> memoryview:
        """``peer``'s header in ``slot`` as u64 words: ``[seq, signature, way, nbytes, ...]``."""
        return self.heads[peer][slot]

    def payload(self, peer: int, slot: int) -> np.ndarray:
        """``peer``'s payload room in ``slot``, as bytes (its post's first ``nbytes`` are the input)."""
        return self.payloads[peer][slot]

    def stray(self, number: int) -> tuple[int, int] | None:
        """``(peer, its signature)`` of a peer that posted collective ``number`` (24 bits, as tags
        hold it) where this rank did not: it runs the one-shot route where this rank runs another.

        None where this rank posted it too, or no peer did. Ranks post in the same
        collectives and a peer is at most one post ahead, so a slot of this rank's holds
        any number a peer's still holds; the 24 bits wrap only for posts 2**24 collectives old.
        """
        if not number:
            return None  # collective 0 (the world's first barrier) is never posted
        mask = (1 << SEQ_BITS) - 1
        if any(head[0] & mask == number for head in self.heads[self.rank]):
            return None
        for peer in self.peers:
            for head in self.heads[peer]:
                if head[0] & mask == number:
                    return peer, head[1]
        return None

    def inputs(self, slot: int, nbytes: int, dtype: np.dtype) -> list[np.ndarray]:
        """Every rank's first ``nbytes`` in ``slot`` as ``dtype``, in rank order (kept: 16 layouts)."""
        key = (slot, nbytes, dtype)
        views = self._views.get(key)
        if views is None:
            views = [self.payloads[rank][slot][:nbytes].view(dtype) for rank in sorted(self.payloads)]
            if len(self._views) >= 16:
                self._views.clear()
            self._views[key] = views
        return views

    def announce(self, episode: int) -> None:
        """Say that this rank sleeps waiting for posts (``episode``), or no longer (0)."""
        self.asleep[self.rank][0] = episode

    def sleepers(self) -> list[int]:
        """The peers asleep in an episode this rank has not rung for (call after posting, and a fence)."""
        woken = []
        rung = self.rung
        for peer, word in self._peer_asleep:
            episode = word[0]
            if episode and episode != rung[peer]:
                rung[peer] = episode
                woken.append(peer)
        return woken

    def close(self) -> None:
        """Forget the views and unmap every mailbox."""
        self.asleep, self.words, self.heads, self.payloads, self._views = {}, {}, {}, {}, {}
        self.peer_heads, self.lone_heads, self._peer_asleep = ([], []), ({}, {}), []
        for segment in self.segments.values():
            segment.close()
        self.segments = {}
