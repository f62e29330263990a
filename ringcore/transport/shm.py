"""Shared-memory transport: ranks on one host move frames through rings in ``/dev/shm``.

Composition. Like :mod:`ringcore.transport.rdma`, this wraps the job's TCP
mesh (:class:`~ringcore.transport.tcp.TcpTransport`). Frames to and from
peers on this host go through shared memory; frames to every other peer are
handed to the TCP transport untouched. The TCP connections to local peers
stay open and carry no data: they are how this rank learns that a local peer
died (its socket closes: ``PeerFailure`` naming it), shut down (BYE) or
aborted (an ABORT frame with its reason: ``PeerAborted``). A stopped peer is
noticed as nothing moving: the executors' wait loop raises
``CollectiveTimeout``.

Data path. Per ordered pair (sender -> receiver) one segment made by the
sender, with one ring of slots per channel (layout and memory order:
:mod:`ringcore.transport.shm_ring`), bounded by ``RINGCORE_SHM_BYTES`` and
never sized by a tensor. A send is done when its last piece is in a slot
(like TCP's send when its bytes are in the socket buffer); a receive reads
each piece's header, checks tag, signature and length against the posted
receive (``FrameMismatch`` before a byte lands in the view), copies the
payload into the view and releases the slot. FIFO per ``(peer, channel)``
holds because each ring is one stream.

Combining in place. A receive posted with ``irecv_lent`` (the lockstep
executor's, for a step whose combine reads the received bytes and nothing
after it does; :mod:`ringcore.algo.program`, "Lending") of a frame from
``LEND_FROM`` bytes, in slots, that its ring holds at once, is not copied
out: it completes with the slots' payloads (``Request.lent``), the executor
combines straight from them into its destination and then gives them
back (``release``). One memory pass instead of a copy and a pass. Until then that link
reads no later frame, and the sender's slots stay full (it waits, as for
any slow reader). Below 64 KiB the copy costs less than lending's Python
(4 KiB: +1.5 us at N=2); at 512 KiB to 1 MiB at N=2 it saves about a tenth
(``bench/HISTORY.md``, "Combining from the peer's slots").

Single copy. That is two copies per frame (into the slot, out of it), each
by one side. A frame of ``RINGCORE_SHM_SINGLE_COPY_BYTES`` or more to a peer
that proved at set-up it may read this rank's memory goes as one piece that
points to the sender's own bytes (their address in its process), unless the
kernel would refuse the copy from that buffer (device mappings such as
CUDA's pinned host memory: :class:`cma.Copyable`). The receiver copies them
straight into its posted view with one ``process_vm_readv``
(:mod:`ringcore.transport.cma`) and releases the slot, and only then is the
send done: the caller's bytes must not change before. One copy instead of
two, made by the receiver alone, which leaves the sender's core free; below
1 MiB the system call and its page pinning cost more than a second copy in
cache (``bench/HISTORY.md``, "one copy for large frames"). Only in a
collective whose buffers on this host (its bytes, from ``expect``, times this
host's ranks) outgrow the last-level cache (``RINGCORE_SHM_CACHE_BYTES``,
auto: the size the kernel reports): while they fit, the slots' two copies run
in cache at two to three times ``process_vm_readv``'s 11-12 GB/s, which pins
and copies page by page (N=2 4 MiB: 257 against 415 us per allreduce; N=4
4 MiB: 1307 against 1692; out of cache the two are level or the pointer
leads, ``bench/HISTORY.md``, "Pointers only past the cache"). A rank whose collective fails withdraws the pointers not
yet released before anything else (``cancel``), and a receiver that finds
its piece withdrawn after its copy discards it and raises the sender's
reason (its ABORT, waited for up to ``WITHDRAWN_GRACE`` s) or
``PeerFailure``: no rank takes bytes its sender may already be changing.

Waiting. ``progress`` polls the rings; with nothing to move it polls them in
a tight loop for ``TIGHT_SPIN`` s (no syscalls; skipped when this host's
ranks outnumber the CPUs this process may use, where the loop would burn the
time slice of the peer it waits for: 4 KiB at N=4 on 2 cores took 290 us
with it, 125-150 us without; never longer than ``spin``, so
``RINGCORE_SPIN_US=0`` means no spinning at all, as an emulated cluster
whose hosts share cores needs), then with ``sched_yield`` between polls
until ``spin`` s (``RINGCORE_SPIN_US``), looking at the TCP sockets too every
few yields, so an ABORT or a dead peer is seen while waiting on shared
memory ("Idle peers" below), and at every poll while frames to or from
other hosts are posted. Then it blocks,
like TCP's ``poll``, on something the kernel wakes: one ``poll`` over this
rank's doorbell FIFO and the TCP mesh's sockets, having said in the rings it
waits on that it sleeps (the protocol: "Doorbells" in
:mod:`ringcore.transport.shm_ring`). A peer that publishes a piece (or frees a
slot this rank waits for) rings the doorbell, a frame, ABORT or hang-up on
TCP wakes it as TCP would, and every block lasts at most ``BLOCK_MAX`` s, the
bound on a wake-up lost to store-load reordering.

Latency path. A lockstep step (:mod:`ringcore.algo.lockstep`) between ranks
of this host goes through ``swap``: the send into its ring at once, the
receive read from the peer's ring for up to ``spin`` s, the rest left to
``progress`` as posted requests; no queue walk and no wait loop per step
(4 KiB at N=4: 77-85 against 94-113 us). Because every frame is checked
before a byte of it lands, receives into the caller's buffer and lent ones
take it too (the in-place ring and halving-doubling: 128-512 KiB 7-23% less
time per allreduce, ``bench/HISTORY.md``, "Every lockstep step on the latency
path"). A frame that fits one slot is
written and read there with no request at all (``write_whole``,
``read_whole``, with ``pull``'s checks): back to back, 4 KiB at N=4 went
from 57-68 to 43-54 us, at N=2 from 11.2 to 9.7 us (with the idle-frame
look of ``expect`` rate-limited, below). A step whose peers are both on other
hosts takes TCP's own ``swap`` and ``exchange``, as it would without shared
memory; one with a peer of each kind is posted.

Idle peers. As :class:`~ringcore.transport.tcp.TcpTransport` looks at a
connection with nothing posted only when posted work cannot move, news of a
local peer (ABORT, BYE, hang-up) is heard at once when the posted work
involves that peer (a send to it or a receive from it), and otherwise only
once nothing has moved for ``IDLE_GRACE`` s, or when the next collective
starts (``expect``, and ``meet_posts`` in the mailboxes; at most every
``LIVENESS_EVERY`` s). A shared-memory send is done only once its last piece
is in a slot (a pointer: once the peer copied it), where TCP's is done once
its bytes are in the socket buffer,
so a rank here still waits on a live, slow peer where over TCP its data
would already be in; without the grace, a peer that finished this collective
and died in the next one would fail this one on every rank that waits.
Until it is heard, such a peer's socket stays out of the ``poll`` that
blocks (it would wake it at once, again and again). The TCP transport is
asked itself (``progress(0)``) when it has frames of its own to move, or
once the grace has passed.

Mailboxes. Where every rank of the job is on this host, each also has a
mailbox that it writes and every peer reads (:mod:`ringcore.transport.shm_mailbox`),
for the one-shot allreduce of small inputs (:mod:`ringcore.plans.oneshot`):
``meet_posts`` publishes this rank's input, rings the doorbells of peers asleep
on it, starts the collective and polls for the peers' posts; ``awaited`` names
those it still waits for, and ``progress`` waits for them as for posted frames
(same spin, yield and block, their news on TCP heard at once, their BYE a
failure), so the route waits through the executors' one wait loop
(:class:`ringcore.algo.waiting.Watch`).

Set-up: :mod:`ringcore.transport.shm_setup` finds the local peers, makes and
maps the segments and doorbells, and builds this transport.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import time
from collections import deque
from typing import Any

from ringcore.transport import cma, shm_ring, wire
from ringcore.transport.base import FrameMismatch, Request, check_frame
from ringcore.transport.registration import view_address
from ringcore.transport.shm_mailbox import RESULT, SEQ, Mailbox
from ringcore.transport.shm_ring import Doorbell, Ring, Segment
from ringcore.transport.tcp import TcpTransport
from ringcore.transport.wire import ProtocolError

log = logging.getLogger("ringcore")

TIGHT_SPIN = 50e-6  # seconds of polling without a syscall before yielding
LIVENESS_EVERY = 1e-3  # seconds between looks at the local peers' TCP news when a collective starts
IDLE_LOOK_EVERY = 10e-3  # seconds between those looks' peeks at frames waiting unasked (_check_idle)
BLOCK_MAX = 1e-3  # the longest block in poll: what a lost wake-up may cost (shm_ring, "Lost wake-ups")
IDLE_GRACE = 0.5  # seconds with nothing moving before news of a peer the posted work does not involve counts
WITHDRAWN_GRACE = 2.0  # seconds to wait for the reason of a peer that withdrew a frame (its ABORT)
LEND_FROM = 64 * 1024  # frames lent for a combine from this size; below, the copy costs less than lending
_YIELDS_PER_TCP_POLL = 8
_SEQ_FIELD = (1 << (32 - wire.PART_BITS)) - 1  # a collective's number as its tags hold it
_LIVENESS_EVENTS = select.POLLIN | getattr(select, "POLLRDHUP", 0x2000)


class Withdrawn(Exception):
    """A peer took back a frame this rank was copying from its memory: it gave up on the collective."""

    def __init__(self, peer: int, what: str) -> None:
        super().__init__(what)
        self.peer = peer
        self.what = what


class _Link:
    """One ``(peer, channel)`` carried by shared memory: the ring out, the ring in, their queues.

    ``point_from``: frames to the peer of at least this many bytes go as a
    pointer to this rank's bytes, which the peer copies with one
    ``process_vm_readv`` (0: never; the peer probed at set-up that it can).
    ``peer_pid``: the peer's pid, to copy the frames it points to (None: it
    may not point). ``pointing``: shared by the transport's links, whether the
    running collective points at all (``ShmTransport.expect``).
    """

    __slots__ = (
        "awaiting",
        "bell",
        "channel",
        "copyable",
        "held",
        "inbound",
        "outbound",
        "peer",
        "peer_pid",
        "point_from",
        "pointing",
        "recvs",
        "sends",
    )

    def __init__(
        self,
        peer: int,
        channel: int,
        outbound: Ring,
        inbound: Ring,
        bell: int,
        point_from: int = 0,
        peer_pid: int | None = None,
        copyable: cma.Copyable | None = None,
        pointing: list[bool] | None = None,
    ) -> None:
        self.peer = peer
        self.channel = channel
        self.outbound = outbound
        self.inbound = inbound
        self.bell = bell  # the peer's doorbell, open for writing
        self.point_from = point_from
        self.peer_pid = peer_pid
        self.copyable = copyable or cma.Copyable()
        self.pointing = pointing or [True]
        self.sends: deque[tuple[Request, int, int]] = deque()  # (request, signature, bytes written)
        self.recvs: deque[tuple[Request, int, int]] = deque()  # (request, signature, bytes read)
        self.awaiting: deque[tuple[Request, int]] = deque()  # sends pointed to, until their piece is released
        self.held: Request | None = None  # a receive lent its slots, until released: no later piece is read

    def busy(self) -> bool:
        return bool(self.sends or self.recvs or self.awaiting)

    def push(self) -> bool:
        """Write pieces of queued sends while slots are free; finish the sends the peer has copied."""
        moved = False
        ring = self.outbound
        while self.sends and ring.room():
            request, signature, done = self.sends[0]
            if (
                done == 0
                and self.point_from
                and request.nbytes >= self.point_from
                and self.pointing[0]
                and self.copyable(request.view)
            ):
                count = ring.point(
                    request.tag, signature, request.nbytes, 0, request.nbytes, view_address(request.view)
                )
                self.awaiting.append((request, count))
                self.sends.popleft()
                moved = True
                continue
            length = min(ring.slot_bytes, request.nbytes - done)
            ring.write(request.tag, signature, request.nbytes, done, request.view[done : done + length])
            moved = True
            done += length
            if done == request.nbytes:
                request.done = True
                self.sends.popleft()
            else:
                self.sends[0] = (request, signature, done)
        if moved:
            self._published()
        if self.awaiting:
            released = ring.released_upto()
            while self.awaiting and self.awaiting[0][1] <= released:
                self.awaiting.popleft()[0].done = True
                moved = True
        return moved

    def withdraw(self) -> None:
        """Take back the pointers the peer has not copied yet: this rank's bytes may change now."""
        for _, count in self.awaiting:
            self.outbound.withdraw(count)
        self.awaiting.clear()

    def pull(self) -> bool:
        """Read pieces into posted receives while they are there; raise on a frame that disagrees.

        Raises:
            FrameMismatch: the frame is not the one posted.
            Withdrawn: the peer took back a frame this rank was copying from its memory.
        """
        moved = False
        ring = self.inbound
        while self.recvs and self.held is None:
            piece = ring.peek()
            if piece is None:
                break
            request, signature, done = self.recvs[0]
            tag, _, nbytes, offset, length, address = piece
            if done == 0:
                check_frame(self.peer, signature, request.tag, request.nbytes, piece[1], tag, nbytes)
                if request.lent is not None and (address or not self.lendable(nbytes)):
                    request.lent = None  # a pointer, or more pieces than the ring holds: copied
            if offset != done or tag != request.tag or offset + length > request.nbytes:
                raise ProtocolError(
                    f"rank {self.peer} wrote bytes {offset}-{offset + length} of frame {tag:#x}, "
                    f"expected byte {done} of frame {request.tag:#x} ({request.nbytes} bytes)"
                )
            if address:
                self._copy(request.view[done : done + length], address)
                ring.take(None, 0)
            elif request.lent is not None:
                request.lent.append((done, ring.lend(length)))
            else:
                ring.take(request.view[done : done + length], length)
            moved = True
            done += length
            if done == request.nbytes:
                request.done = True
                self.recvs.popleft()
                if request.lent is not None:
                    self.held = request
            else:
                self.recvs[0] = (request, signature, done)
        if moved:
            self._released()
        return moved

    def write_whole(self, tag: int, signature: int, view: memoryview) -> bool:
        """Write a frame that fits one slot straight into the ring, when nothing is queued before it.

        The latency path's send (``ShmTransport.swap``): the piece ``push``
        would write, without a request. False, having done nothing, for a
        frame of several pieces or a pointer, or a full ring: queue it.
        """
        ring, nbytes = self.outbound, view.nbytes
        if (
            nbytes > ring.slot_bytes
            or (self.point_from and nbytes >= self.point_from and self.pointing[0])
            or self.sends
            or not ring.room()
        ):
            return False
        ring.write(tag, signature, nbytes, 0, view)
        self._published()
        return True

    def read_whole(self, tag: int, signature: int, view: memoryview) -> bool | None:
        """Read the next frame into ``view`` if it is there whole in one slot: True; False: not there yet.

        The latency path's receive (``ShmTransport.swap``), with ``pull``'s
        checks. None, having read nothing, for a frame in several pieces or
        a pointer: post a receive and ``pull`` it.

        Raises:
            FrameMismatch: the frame is not the one expected.
        """
        ring = self.inbound
        piece = ring.peek()
        if piece is None:
            return False
        length = piece[4]
        if piece[5] or piece[3] or length != piece[2]:  # a pointer, or one piece of several
            return None
        check_frame(self.peer, signature, tag, view.nbytes, piece[1], piece[0], piece[2])
        ring.take(view, length)
        self._released()
        return True

    def _published(self) -> None:
        """After writing pieces: wake the reader if it sleeps."""
        shm_ring.fence()  # the piece published before the reader's word is read (shm_ring)
        if self.outbound.reader_waits():
            shm_ring.ring_bell(self.bell)

    def _released(self) -> None:
        """After releasing slots: wake the writer if it sleeps for one."""
        shm_ring.fence()  # the slot released before the writer's word is read
        if self.inbound.writer_waits():
            shm_ring.ring_bell(self.bell)

    def lendable(self, nbytes: int) -> bool:
        """Whether a frame of ``nbytes`` fits the ring's slots at once, so it can be read in place."""
        ring = self.inbound
        return 0 < nbytes <= ring.slots * ring.slot_bytes

    def release(self) -> None:
        """Give back the slots read so far, those of a lent frame included, and wake a writer waiting for them."""
        self.held = None
        self.inbound.release()
        self._released()

    def _copy(self, into: memoryview, address: int) -> None:
        """Copy a frame the peer pointed to; raise ``Withdrawn`` unless it stayed published throughout."""
        if self.peer_pid is None:
            raise ProtocolError(
                f"rank {self.peer} pointed to its memory, which this rank did not agree to read"
            )
        try:
            cma.read(self.peer_pid, into, address)
        except OSError as err:
            raise Withdrawn(
                self.peer, f"could not be copied from its memory ({err.strerror or err})"
            ) from None
        shm_ring.fence()  # the copy done before the word is read again
        if not self.inbound.still_published():
            raise Withdrawn(self.peer, "was withdrawn while this rank copied it")

    def announce(self, episode: int) -> bool:
        """Say in the rings this link waits on that this rank sleeps; whether it waits on any."""
        waits = False
        if self.recvs:
            self.inbound.reader_asleep[0] = episode
            waits = True
        if (self.sends and not self.outbound.room()) or self.awaiting:
            self.outbound.writer_asleep[0] = episode
            waits = True
        return waits

    def wake(self) -> None:
        self.inbound.reader_asleep[0] = 0
        self.outbound.writer_asleep[0] = 0


class ShmTransport:
    """Shared memory to the peers on this host, TCP to the rest (see module docstring).

    Args:
        control: the job's TCP mesh; it carries the other peers' frames and everyone's liveness.
        links: ``(peer, channel) -> (outbound ring, inbound ring)`` for the local peers.
        segments: the mapped segments, unmapped at ``close``.
        doorbell: this rank's FIFO (None without local peers).
        bells: ``peer -> fd`` of each local peer's doorbell, open for writing.
        point_from: ``peer -> bytes``: frames to the peer from this size go as pointers (absent: never).
        peer_pids: ``peer -> pid`` of the local peers whose memory this rank may read (and write).
        cache_bytes: pointers only in collectives whose buffers on this host (the
            caller's bytes times its ranks) exceed this (``expect``; 0: in every one).
    """

    def __init__(
        self,
        control: TcpTransport,
        links: dict[tuple[int, int], tuple[Ring, Ring]],
        segments: list[Segment],
        doorbell: Doorbell | None = None,
        bells: dict[int, int] | None = None,
        point_from: dict[int, int] | None = None,
        peer_pids: dict[int, int] | None = None,
        cache_bytes: int = 0,
    ) -> None:
        self.rank = control.rank
        self.size = control.size
        self.channels = control.channels
        self.control = control
        bells = bells or {}
        self.point_from = point_from or {}
        self.peer_pids = peer_pids or {}
        self.copyable = copyable = cma.Copyable()  # which of this rank's buffers peers may copy from
        self.copies_everywhere = False  # every rank may copy from and to every other (shm_setup agrees on it)
        # process_vm_readv is slow next to memmove here (agreed too), and each rank's measurement
        # of it (this rank's first, then its peers')
        self.slow_kernel_copies = False
        self.kernel_copy_speeds: list[float] = []
        # This rank's direct-allreduce word in its own memory and the peers' addresses of theirs, read
        # where no mailboxes hold the words (ringcore.plans.direct, "Safety"; set by shm_setup).
        self.word: Any = None
        self.peer_words: dict[int, int] = {}
        self.mailbox: Mailbox | None = None  # every rank's, where all are on this host (shm_setup)
        # one rank reduces each one-shot allreduce for all (ringcore.plans.oneshot, "One reducer"):
        # where the host's ranks outnumber its CPUs, or RINGCORE_ONE_REDUCER (agreed; bootstrap sets it)
        self.one_reducer = False
        self.awaited: list[int] = []  # local peers whose post this rank waits for ("Mailboxes")
        self.awaited_post = (0, 0, SEQ)  # (slot, seq, header word) awaited: a post, or a result
        self.posts_seen = 0  # peers seen posted while a result is awaited: their posts are progress
        self.pointing = [True]  # whether the running collective points (expect), seen by every link
        self.cache_bytes = cache_bytes
        self.links = {
            key: _Link(
                key[0],
                key[1],
                out,
                into,
                bells[key[0]],
                self.point_from.get(key[0], 0),
                self.peer_pids.get(key[0]),
                copyable,
                self.pointing,
            )
            for key, (out, into) in links.items()
        }
        self.local = sorted({peer for peer, _ in links})
        self.host_ranks = len(self.local) + 1
        self.remote = len(self.local) < self.size - 1  # some peer is on another host
        self.segments = segments
        self.doorbell = doorbell
        self.bells = bells
        self.episode = 0  # the last sleep's number, stored in the rings it waited on
        self.liveness = select.poll()  # the local peers' TCP connections, which carry no data
        self.next_liveness = 0.0  # when expect() or meet_posts() may poll them again
        self.next_idle_look = 0.0  # when that look may peek at the rings again (_look_around)
        self.watched = {control.conns[(peer, 0)].fd: control.conns[(peer, 0)] for peer in self.local}
        for fd in self.watched:
            self.liveness.register(fd, _LIVENESS_EVENTS)
        self.unheard: set[int] = set()  # fds of local peers with news not yet looked at ("Idle peers")
        self.last_moved = 0.0  # perf_counter when the running collective last moved a byte
        self.spin = 200e-6  # seconds of polling before blocking (Settings.spin_seconds)
        self.tight_spin = TIGHT_SPIN if len(self.local) < len(os.sched_getaffinity(0)) else 0.0
        self.current = (-1, 0)
        self.lend_from = LEND_FROM  # irecv_lent's callers lend frames from this size (lockstep)
        self.closed = False
        self._remote: list[Request] = []  # requests handed to the TCP transport, not yet seen done

    @property
    def conns(self) -> dict[tuple[int, int], Any]:
        """The wrapped mesh's connections: every peer's liveness, and the data of peers on other hosts."""
        return self.control.conns

    # -- the Transport contract ---------------------------------------------------------------

    def expect(self, seq: int, signature: int, nbytes: int = 0) -> None:
        """Start collective ``seq``: first, any news of the local peers on TCP (one ``poll``).

        Its frames go as pointers (from ``point_from``) only where its buffers
        on this host, ``nbytes`` times this host's ranks, outgrow
        ``cache_bytes``, or where ``nbytes`` is not known ("Single copy" in the
        module docstring).

        A collective over shared memory may never wait long enough to look at
        TCP, so without this a local peer that aborted, shut down or lost its
        connections would go unnoticed for as long as its rings keep moving.
        At most every ``LIVENESS_EVERY`` s (1 ms): the ``poll`` costs about 0.5 us
        warm, a tenth of a 4 KiB allreduce's advantage over TCP at N=2. The look
        at frames already waiting where this collective posts no receive
        (``_check_idle``, 0.25 us per local peer warm, which every wait makes too)
        goes with it at most every ``IDLE_LOOK_EVERY`` s (10 ms). Cold, between two
        1 MiB allreduces at N=4 on 2 cores, the two took 6 us of CPU (the ``poll``
        2.4), and the rank that looks is often the one everyone waits for: both every
        1 ms cost 10-13 us of a 300 us call (``bench/HISTORY.md``, "The direct
        route's Python trimmed, the look at TCP news"). So while the rings keep
        moving, a peer's ABORT or hang-up is heard at the first collective that
        starts 1 ms or more after the last look (in the mailboxes, while a peer has
        yet to post), and in any wait past the spin at once: a rank that lost its
        network fails, within about a millisecond, a collective that still moves
        over shared memory (``tests/reliability/test_faults.py``).
        """
        self._start(seq, signature, nbytes)
        now = time.perf_counter()
        self.last_moved = now
        if self.unheard or now > self.next_liveness:
            self._look_around(now)

    def _start(self, seq: int, signature: int, nbytes: int) -> None:
        """Record collective ``seq`` as the running one: what the waits judge stray frames by, and
        whether its frames point (``expect``)."""
        self.current = (seq & 0xFFFFFFFF, signature)
        self.pointing[0] = not nbytes or nbytes * self.host_ranks > self.cache_bytes
        if self.remote:  # early frames on TCP are data of peers on other hosts: TCP judges them
            self.control.expect(seq, signature)
        else:
            self.control.current = self.current

    def _look_around(self, now: float) -> None:
        """The look at the local peers' TCP news, at most every ``LIVENESS_EVERY`` s, and at frames
        waiting unasked, at most every ``IDLE_LOOK_EVERY`` s (``expect``)."""
        self.next_liveness = now + LIVENESS_EVERY
        if self.watched:
            for fd, _ in self.liveness.poll(0):
                self._hear(fd)  # news from between collectives (or deferred by the last one) counts now
        if now > self.next_idle_look:
            self.next_idle_look = now + IDLE_LOOK_EVERY
            self._check_idle()

    def route(self, peer: int, segment: int) -> int:
        channel = segment % self.channels
        if (peer, 0) in self.links:
            return channel if (peer, channel) in self.links else 0
        return self.control.route(peer, segment)

    def isend(self, peer: int, channel: int, tag: int, signature: int, view: memoryview) -> Request:
        link = self.links.get((peer, channel))
        if link is None:
            return self._delegate(self.control.isend(peer, channel, tag, signature, view))
        request = Request(peer, channel, tag, _bytes(view))
        link.sends.append((request, signature, 0))
        return request

    def irecv(self, peer: int, channel: int, tag: int, signature: int, view: memoryview) -> Request:
        return self._post_receive(peer, channel, tag, signature, view, lend=False)

    def irecv_lent(self, peer: int, channel: int, tag: int, signature: int, view: memoryview) -> Request:
        """As ``irecv``, but a frame in slots stays there (``request.lent``) until :meth:`release`.

        Only a frame from a local peer, in slots (not a pointer), and no longer
        than its ring's slots, is lent; any other lands in ``view``.
        """
        return self._post_receive(peer, channel, tag, signature, view, lend=True)

    def release(self, request: Request) -> None:
        """Give back the slots of a lent receive; the link reads its next frames again."""
        link = self.links.get((request.peer, request.channel))
        if link is not None and link.held is request:
            link.release()
        request.lent = None

    def _post_receive(
        self, peer: int, channel: int, tag: int, signature: int, view: memoryview, lend: bool
    ) -> Request:
        link = self.links.get((peer, channel))
        if link is None:
            return self._delegate(self.control.irecv(peer, channel, tag, signature, view))
        request = Request(peer, channel, tag, _bytes(view))
        if lend:
            request.lent = []
        link.recvs.append((request, signature, 0))
        return request

    def swap(
        self,
        send: tuple[int, int, memoryview] | None,
        recv: tuple[int, int, memoryview] | None,
        tag: int,
        signature: int,
        lend: bool = False,
        scratch: bool = True,
    ) -> tuple[Request | None, Request | None] | None:
        """One lockstep step with no queue walk: the latency path, as ``TcpTransport.swap``.

        Peers on this host: the send goes into its ring at once, and the
        receive is read from the peer's ring for up to ``spin`` s (polling
        without a syscall for ``TIGHT_SPIN`` s, as ``progress`` does, then
        with ``sched_yield``); what is not done by then is returned as posted
        requests, which ``progress`` finishes. Every frame is checked before a
        byte of it lands (``pull``, ``read_whole``), so the receive may be the
        caller's memory (``scratch`` False); with ``lend`` it is posted as
        :meth:`irecv_lent` and returned even when done, so the caller finds
        the lent pieces. Peers both on other hosts: TCP's own ``swap``, which
        takes scratch receives only. None, having done nothing, for a step
        with one peer of each kind or a receive already queued on its link
        (post them); a send behind queued ones is queued after them.
        """
        out = self.links.get((send[0], send[1])) if send is not None else None
        into = self.links.get((recv[0], recv[1])) if recv is not None else None
        if out is None and into is None:  # both on other hosts: TCP's own path
            pair = self.control.swap(send, recv, tag, signature, scratch=scratch)
            if pair is not None:
                self.last_moved = time.perf_counter()
                self._remote.extend(request for request in pair if request is not None)
            return pair
        if (send is not None and out is None) or (recv is not None and into is None):
            return None
        if into is not None and (into.recvs or into.held is not None):
            return None  # a receive posted before this one reads first
        sent = received = None
        if out is not None and not out.write_whole(tag, signature, _bytes(send[2])):  # type: ignore[index]
            sent = self.isend(out.peer, out.channel, tag, signature, send[2])  # type: ignore[index]
            out.push()
            if sent.done:
                sent = None
        if into is not None:
            view = _bytes(recv[2])  # type: ignore[index]
            start = time.perf_counter()
            tight, deadline = min(self.tight_spin, self.spin), start + self.spin
            yielded = False
            if lend:
                received = self._post_receive(into.peer, into.channel, tag, signature, view, lend=True)
            while True:
                if received is None:
                    whole = into.read_whole(tag, signature, view)
                    if whole:
                        break
                    if whole is None:  # in pieces, or a pointer: pull reads it
                        received = self.irecv(into.peer, into.channel, tag, signature, view)
                if received is not None:
                    try:
                        into.pull()
                    except Withdrawn as gone:
                        raise self._withdrawn(gone) from None
                    if received.done:
                        if not lend:
                            received = None
                        break
                if sent is not None and out.push() and sent.done:  # type: ignore[union-attr]
                    sent = None
                now = time.perf_counter()
                if now > deadline and yielded:
                    if received is None:  # nothing of it yet: post it for progress
                        received = self.irecv(into.peer, into.channel, tag, signature, view)
                    break
                if now - start > tight:
                    os.sched_yield()  # at least once, as TCP's swap: the peer may be next on this core
                    yielded = True
        self.last_moved = time.perf_counter()
        return sent, received

    @property
    def exchange(self) -> Any:
        """TCP's ``exchange`` for steps between hosts (:meth:`_exchange`); None when every peer is on this host."""
        return self._exchange if self.remote else None

    def _exchange(self, sent: Request | None, received: Request | None) -> bool:
        """TCP's ``exchange`` for a step whose peers are both on other hosts; False otherwise."""
        if self._is_local(sent) or self._is_local(received):
            return False
        done = self.control.exchange(sent, received)
        if done:
            self.last_moved = time.perf_counter()
            self._remote = [request for request in self._remote if not request.done]
        return done

    def _is_local(self, request: Request | None) -> bool:
        return request is not None and (request.peer, 0) in self.links

    def progress(self, timeout: float) -> bool:
        moved = self._pump()
        if self._remote:
            moved = self._progress_remote(0) or moved
        if not moved and timeout > 0:
            if self.awaited or any(link.busy() for link in self.links.values()):
                moved = self._wait(timeout)
            else:
                moved = self._progress_remote(timeout)  # only TCP has work (or nothing has): it waits
                self._check_idle()
        if moved:
            self.last_moved = time.perf_counter()
        return moved

    def cancel(self) -> None:
        """Forget posted work; a frame half written or read leaves its ring mid-frame (abort/close only)."""
        for link in self.links.values():
            link.withdraw()
            link.sends.clear()
            link.recvs.clear()
            link.release()
        self._remote.clear()
        self.awaited = []
        self.control.cancel()

    def abort(self, reason: dict[str, Any]) -> None:
        self.awaited = []  # the collective failed: its posts are no longer waited for
        self.control.abort(reason)

    def peer_name(self, peer: int) -> str:
        return self.control.peer_name(peer)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.control.close()
        if self.mailbox is not None:
            self.mailbox.close()
            self.mailbox = None
        for link in self.links.values():
            link.withdraw()  # a peer still copying from this rank's buffers must not finish the copy
            link.outbound.drop()
            link.inbound.drop()
        self.links = {}
        for segment in self.segments:
            segment.close()
        for fd in self.bells.values():
            os.close(fd)
        self.bells = {}
        if self.doorbell is not None:
            self.doorbell.close()

    # -- the mailboxes ("Mailboxes", module docstring) ------------------------------------------

    def meet_posts(self, seq: int, signature: int, way: int, nbytes: int, reducer: int = -1) -> int:
        """Post this rank's part of collective ``seq`` (its ``nbytes`` already in its mailbox's next
        slot), start the collective and poll for every peer's post (``reducer`` >= 0: for that peer's
        result alone, "One reducer" in :mod:`ringcore.transport.shm_mailbox`); the slot.

        The mailboxes' latency path, one call where it was three (post, ``expect``,
        ``await_posts``): at N=4 on 2 cores a 4 KiB allreduce is the Python of its
        ranks, two to a core, so every call and attribute counts twice
        (``bench/HISTORY.md``, "The one-shot path flattened"). In order:

        - the post (``Mailbox.post``), a fence, and the doorbells of peers asleep on it;
        - the look at TCP when it is due (``expect``'s), and only while a word awaited is not
          there: a peer that posted (or published) may already have finished the collective and
          failed the next, and its ABORT is heard in the next one, where it belongs (the waits
          too, ``_tcp_news``);
        - the words polled for up to ``spin`` s (without a syscall for ``TIGHT_SPIN`` s,
          then with ``sched_yield``, at least once). The peers still awaited are
          ``awaited``; ``progress`` waits for them (the caller's wait loop).

        The collective is recorded as the running one (``_start``: what stray frames are
        judged by) only before a look or a wait, the only times it is read: collectives in
        the mailboxes send no frames.
        """
        mailbox = self.mailbox
        assert mailbox is not None
        slot = mailbox.post(seq, signature, way, nbytes)
        shm_ring.fence()  # the post stored before the peers' asleep words are read
        for peer in mailbox.sleepers():
            shm_ring.ring_bell(self.bells[peer])
        clock = time.perf_counter
        now = start = clock()
        if reducer < 0:
            heads, word = mailbox.peer_heads[slot], SEQ
        else:
            heads, word = mailbox.lone_heads[slot][reducer], RESULT
        if (self.unheard or now > self.next_liveness) and any(head[word] != seq for head in heads):
            # Only while a word awaited is not there: a peer that posted is alive and in this collective,
            # and may have finished it and failed the next (its ABORT), which must not fail this one.
            self._start(wire.tag_seq(seq, 0), signature, nbytes)
            self._look_around(now)
        deadline, tight = start + self.spin, min(self.tight_spin, self.spin)
        yielded = False
        for head in heads:  # in order: a peer once seen posted is not polled again
            while head[word] != seq:
                now = clock()
                if now - start < tight:
                    continue
                if yielded and now > deadline:  # past the spin: progress waits for the rest
                    self._start(wire.tag_seq(seq, 0), signature, nbytes)
                    self.awaited_post = (slot, seq, word)
                    peers = mailbox.peers if reducer < 0 else (reducer,)
                    self.awaited = [
                        peer for peer, head in zip(peers, heads, strict=True) if head[word] != seq
                    ]
                    self.posts_seen = self._posts_in(slot, seq)
                    self.last_moved = now
                    return slot
                os.sched_yield()
                yielded = True
        self.last_moved = now
        self.awaited = []
        return slot

    def publish(self, slot: int, seq: int, taking: int) -> None:
        """Publish the result of collective ``seq`` in this rank's ``slot`` (``Mailbox.publish``), a
        fence, and the doorbells of peers asleep on it."""
        mailbox = self.mailbox
        assert mailbox is not None
        mailbox.publish(slot, seq, taking)
        shm_ring.fence()
        for peer in mailbox.sleepers():
            shm_ring.ring_bell(self.bells[peer])

    def _posts(self) -> bool:
        """Drop the awaited peers whose awaited word is there; whether any was, or (awaiting a
        result) whether another peer posted: the reducer's wait moved, so this one did."""
        slot, seq, word = self.awaited_post
        heads = self.mailbox.heads  # type: ignore[union-attr]
        left = [peer for peer in self.awaited if heads[peer][slot][word] != seq]
        moved = len(left) < len(self.awaited)
        self.awaited = left
        if left and word != SEQ:
            seen = self._posts_in(slot, seq)
            moved, self.posts_seen = moved or seen > self.posts_seen, seen
        return moved

    def _posts_in(self, slot: int, seq: int) -> int:
        """How many peers have posted collective ``seq`` in ``slot``."""
        return sum(head[SEQ] == seq for head in self.mailbox.peer_heads[slot])  # type: ignore[union-attr]

    # -- moving and waiting --------------------------------------------------------------------

    def _delegate(self, request: Request) -> Request:
        self._remote.append(request)
        return request

    def _progress_remote(self, timeout: float) -> bool:
        moved = self.control.progress(timeout)
        if self._remote:
            self._remote = [request for request in self._remote if not request.done]
        return moved

    def _pump(self) -> bool:
        moved = bool(self.awaited) and self._posts()
        for link in self.links.values():
            if (link.sends or link.awaiting) and link.push():
                moved = True
            try:
                if link.recvs and link.pull():
                    moved = True
            except Withdrawn as gone:
                raise self._withdrawn(gone) from None
        return moved

    def _withdrawn(self, gone: Withdrawn) -> Exception:
        """What a withdrawn frame means: the peer's ABORT or hang-up, once it arrives, else a PeerFailure.

        A rank withdraws its pointers when its collective fails, before it
        sends ABORT with the reason, so the reason is usually a moment away.
        """
        conn = self.control.conns[(gone.peer, 0)]
        deadline = time.perf_counter() + WITHDRAWN_GRACE
        while time.perf_counter() < deadline and not (conn.departed or conn.early):
            if select.select([conn.fd], [], [], max(0.0, deadline - time.perf_counter()))[0]:
                conn.check_idle(self.current)  # raises on ABORT or hang-up
        return conn.fail(f"sent a frame that {gone.what}; it left the collective")

    def _wait(self, timeout: float) -> bool:
        """Poll, then block, until something moves or ``timeout`` s pass ("Waiting", module docstring)."""
        start = time.perf_counter()
        deadline = start + timeout
        polls = 0
        moved = False
        while True:
            now = time.perf_counter()
            if now > deadline:
                return moved
            if now - start > min(self.tight_spin, self.spin):  # RINGCORE_SPIN_US=0: no spinning at all
                if polls and now - start >= self.spin and self.doorbell is not None:
                    return self._block(deadline) or moved  # after one yield at least: the peer may be next
                os.sched_yield()
                polls += 1
                if polls % _YIELDS_PER_TCP_POLL == 0 and self._tcp_news():
                    return True
            if self._pump() or (self._remote and self._progress_remote(0)):
                if not self.awaited:
                    return True
                moved = True  # a post of several awaited: wait on for the rest, without returning

    def _block(self, deadline: float) -> bool:
        """Sleep in ``poll`` on the doorbell and the TCP sockets, ``BLOCK_MAX`` s at a time, until news."""
        assert self.doorbell is not None
        while True:
            left = deadline - time.perf_counter()
            if left <= 0:
                return False
            self.episode += 1
            waiting = [link for link in self.links.values() if link.announce(self.episode)]
            boxed = bool(self.awaited)
            if boxed:
                self.mailbox.announce(self.episode)  # type: ignore[union-attr]
            try:
                shm_ring.fence()  # the words stored before the rings are read again (shm_ring)
                if self._pump():
                    return True
                poller = self._poller()
                ready = poller.poll(max(1, int(min(BLOCK_MAX, left) * 1000)))
            finally:
                for link in waiting:
                    link.wake()
                if boxed:
                    self.mailbox.announce(0)  # type: ignore[union-attr]
            bell = any(fd == self.doorbell.fd for fd, _ in ready)
            if bell:
                self.doorbell.drain()
            if self._pump():
                return True
            if (len(ready) > bell or not ready) and self._tcp_news():
                return True

    def _poller(self) -> select.poll:
        """This rank's doorbell and every TCP socket with something to wait for, as ``TcpTransport`` polls.

        Before the grace, not the idle sockets whose news waits ("Idle peers", module docstring),
        nor those of peers on other hosts: only the TCP transport looks at those.
        """
        assert self.doorbell is not None
        poller = select.poll()
        poller.register(self.doorbell.fd, select.POLLIN)
        patient = not self._stale()
        for conn in self.control.conns.values():
            idle = not (conn.sends or conn.recvs)
            if patient and idle and (conn.fd in self.unheard or conn.fd not in self.watched):
                continue
            events = conn.poll_events()
            if events:
                poller.register(conn.fd, events)
        return poller

    def _tcp_news(self) -> bool:
        """Look at the TCP side once: its own frames, and ABORT, BYE or hang-up of peers ("Idle peers").

        True also where the looks found awaited posts (``_check_departed`` and
        ``_check_idle`` read them again before they judge a peer).
        """
        awaited = len(self.awaited)
        if awaited and self._posts() and not self.awaited:
            return True  # every post is in: news of a later collective waits for it (meet_posts)
        moved = self._progress_remote(0) if self._remote else False
        if not moved:
            if self._stale():
                self._progress_remote(0)  # nothing moves: TCP looks at every idle connection
            if self.watched:
                for fd, _ in self.liveness.poll(0):
                    self._hear(fd, self._involved())
        self._check_departed()
        self._check_idle()
        return moved or len(self.awaited) < awaited

    def _stale(self) -> bool:
        return time.perf_counter() - self.last_moved > IDLE_GRACE

    def _involved(self) -> set[int] | None:
        """The local peers the posted work sends to or receives from; None (all) past the grace."""
        if self._stale():
            return None
        return {link.peer for link in self.links.values() if link.busy()} | set(self.awaited)

    def _hear(self, fd: int, involved: set[int] | None = None) -> None:
        """Read a local peer's news on TCP (raising on ABORT or hang-up), or leave it for later.

        ``involved``: the peers whose news counts now (None: every peer).
        """
        conn = self.watched[fd]
        if involved is not None and conn.peer not in involved:
            self.unheard.add(fd)
            return
        self.unheard.discard(fd)
        if not (conn.departed or conn.early):
            conn.check_idle(self.current)
        if conn.departed or conn.early:  # its EOF or data stays readable: stop asking
            with contextlib.suppress(KeyError):
                self.liveness.unregister(fd)

    def _check_departed(self) -> None:
        """Fail when a local peer shut down (BYE) while posted work still involves it.

        Its last frames were in the rings before its BYE left on TCP, but this
        rank may read the BYE first (TCP is looked at between looks at the
        rings), so the rings are read once more before a frame counts as
        missing: a peer that finished the collective and shut down is no failure.
        """
        if self.awaited and any(self._departed(peer) for peer in self.awaited):
            self._posts()  # it may have posted before its BYE
            for peer in self.awaited:
                if self._departed(peer):
                    raise self.control.conns[(peer, 0)].fail(
                        "shut down (called shutdown()) before posting its part of this collective"
                    )
        gone = [link for link in self.links.values() if link.busy() and self._departed(link.peer)]
        if gone and self._pump():
            gone = [link for link in gone if link.busy()]
        if gone:
            link = gone[0]
            pending = f"{len(link.recvs)} receives, {len(link.sends) + len(link.awaiting)} sends posted"
            conn = self.control.conns[(link.peer, 0)]
            raise conn.fail(
                f"shut down (called shutdown()) while this rank still had frames for it ({pending})"
            )

    def _departed(self, peer: int) -> bool:
        conn = self.control.conns.get((peer, 0))
        return conn is not None and conn.departed

    def _check_idle(self) -> None:
        """A frame of the running collective waiting where no receive is posted must agree on the signature.

        While this rank waits for posts (a one-shot allreduce sends no frames at
        all), any frame of the collective, in any part, is a peer running another;
        while it waits for frames, so is a peer that posted the collective where
        this rank did not (``Mailbox.stray``).
        """
        seq, signature = self.current
        posting = self.awaited_post[1] & _SEQ_FIELD if self.awaited else -1
        if posting < 0 and self.mailbox is not None:
            stray = self.mailbox.stray(seq >> wire.PART_BITS)
            if stray is not None:
                raise FrameMismatch(stray[0], "signature", signature, stray[1])
        for link in self.links.values():
            if link.recvs:
                continue
            piece = link.inbound.peek()
            if piece is None:
                continue
            if piece[3] == 0 and piece[0] >> 32 == seq and piece[1] != signature:
                raise FrameMismatch(link.peer, "signature", signature, piece[1])
            if piece[0] >> (32 + wire.PART_BITS) == posting and link.peer in self.awaited:
                self._posts()  # a peer that posted and then saw every post may run the ring: a fallback
                if link.peer in self.awaited:
                    field, got = ("signature", piece[1]) if piece[1] != signature else ("tag", piece[0])
                    raise FrameMismatch(link.peer, field, signature if field == "signature" else 0, got)


def _bytes(view: memoryview) -> memoryview:
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")
