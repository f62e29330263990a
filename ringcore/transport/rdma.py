"""RDMA transport logic: receiver-driven zero-copy writes, independent of pyverbs.

Data path. Every ``(peer, channel)`` link is one reliable-connected queue pair.
A receive is announced, not waited for: ``irecv`` registers the destination
(through :class:`~ringcore.transport.registration.RegistrationCache`, so a
buffer is registered once, not per segment) and SENDs the peer a small READY
message: the receive's ticket (its number on the link), tag, signature, byte
count, address and rkey. The sender pairs its k-th ``isend`` on the link with the k-th READY
(the same FIFO rule as TCP), checks that signature, tag and length agree, and
posts one ``RDMA_WRITE_WITH_IMM`` straight from the source segment into the
destination. The immediate value carries the ticket, so the receiver's
completion says which receive landed; its payload never passes through a
staging copy on either side. This is the scheme of Gloo's ibverbs transport.

Flow control. Every message (READY, CREDIT, and a write with immediate)
consumes one of the ``depth`` receives the peer keeps posted on the link.
Each side counts the messages it sent and learns how many receives the peer
has re-posted from a counter carried in every message (the low 16 bits of the
immediate for writes), so it never has more than ``depth`` messages in
flight: receives posted far ahead wait in an outbox instead of overrunning
the peer. When many receives were re-posted and nothing else is going back,
an explicit CREDIT message returns them. The queue pairs also use infinite
RNR retry, so even a CREDIT sent past the limit is delivered, only later.

Progress. There are no threads: the collective's thread polls the completion
queue in batches. When nothing is ready it arms the completion channel and
sleeps in ``poll(2)`` on the channel's file descriptor together with the TCP
control connections, so the GIL is released while waiting and a peer that
dies or aborts wakes it at once. pyverbs calls hold the GIL, so none of them
is ever made in a blocking mode.

Control plane. The TCP mesh set up by :mod:`ringcore.transport.mesh` stays
open beside the queue pairs and carries ABORT and BYE frames; its sockets
are how a vanished peer is noticed (an RC queue pair alone only finds out
when it next sends). Data never travels on it.

The verbs themselves sit behind :class:`Device`; :mod:`ringcore.transport.ibverbs`
implements it with pyverbs, and the tests also drive this module through an
in-process fake.
"""

from __future__ import annotations

import select
import struct
import time
from collections import deque
from typing import Any, NamedTuple, Protocol

import numpy as np

from ringcore.errors import PeerFailure
from ringcore.transport import wire
from ringcore.transport.base import FrameMismatch, Request, check_frame
from ringcore.transport.registration import Registration, RegistrationCache
from ringcore.transport.tcp import TcpTransport

READY = 1
CREDIT = 2
REFUSE = 3  # the sender's frame does not match an announced receive: the receiver raises

# kind u8 | pad u8 | credits u16 | ticket u32 | rkey u32 | pad u32 | tag | signature | nbytes | address
CONTROL = struct.Struct("<BxHIIxxxxQQQQ")
SLOT_BYTES = 64
DEPTH = 128  # receives kept posted per link, and the most messages in flight towards a peer
CONTROL_GRACE = 2.0  # seconds a failed completion waits for the control plane's explanation
_MASK = 0xFFFF

# Completion kinds, as Device.poll reports them.
SENT = 0  # a SEND or WRITE this side posted has completed
RECEIVED = 1  # a control message landed in a receive slot
WRITTEN = 2  # a peer's write with immediate landed; ``imm`` says which receive


class Completion(NamedTuple):
    """One work completion, as the transport needs it."""

    link: int
    kind: int
    ok: bool
    status: str  # the verbs status name when not ok
    slot: int  # for RECEIVED / WRITTEN: which receive slot was consumed
    byte_len: int
    imm: int


class Device(Protocol):
    """The verbs a transport needs, for one rank (pyverbs or a test fake)."""

    fd: int  # readable after ``arm()`` once a completion is queued

    def register(self, address: int, nbytes: int, writable: bool) -> Registration: ...

    def post_recv(self, link: int, slot: int, address: int, nbytes: int, lkey: int) -> None: ...

    def post_send(self, link: int, data: bytes) -> None: ...

    def post_write(
        self, link: int, address: int, nbytes: int, lkey: int, remote: int, rkey: int, imm: int
    ) -> None: ...

    def poll(self, limit: int) -> list[Completion]: ...

    def arm(self) -> None: ...

    def consume_event(self) -> None: ...

    def close(self) -> None: ...


class _Ready(NamedTuple):
    ticket: int
    tag: int
    signature: int
    nbytes: int
    address: int
    rkey: int


class Link:
    """The state of one ``(peer, channel)`` queue pair (see module docstring)."""

    def __init__(self, index: int, peer: int, channel: int, slots: np.ndarray, lkey: int) -> None:
        self.index = index
        self.peer = peer
        self.channel = channel
        self.slots = slots  # depth * SLOT_BYTES receive buffers for control messages
        self.lkey = lkey
        self.sends: deque[tuple[Request, int]] = deque()  # waiting for their READY
        self.readies: deque[_Ready] = deque()  # READYs waiting for their send
        self.recvs: deque[tuple[Request, int, int]] = deque()  # (request, signature, ticket): not landed
        self.outbox: deque[tuple[Request, int, int]] = deque()  # READYs to send: (request, signature, ticket)
        self.posted: deque[Request | None] = deque()  # the send queue, in completion order
        self.next_ticket = 0  # numbers this link's receives, carried back in the immediate
        self.sent = 0  # messages that consumed a peer receive (mod 2^16)
        self.peer_reposted = 0  # the peer's re-posted receives, as it last told us
        self.reposted = 0  # our re-posted receives (mod 2^16)
        self.reported = 0  # ``reposted`` as we last told the peer
        self.refused = False  # a READY did not match our send: nothing more is paired here

    def can_send(self, depth: int) -> bool:
        return (self.sent - self.peer_reposted) & _MASK < depth and len(self.posted) < 2 * depth


class RdmaTransport:
    """The RDMA transport of one rank over an established set of connected queue pairs.

    Args:
        rank, size, channels: this rank's place, as for every transport.
        device: the verbs (already connected: ``link`` indices name queue pairs).
        links: ``(peer, channel)`` of each link index.
        control: the authenticated TCP mesh, kept for ABORT/BYE and liveness.
        depth: receives kept posted per link.
    """

    def __init__(
        self,
        rank: int,
        size: int,
        channels: int,
        device: Device,
        links: list[tuple[int, int]],
        control: TcpTransport,
        depth: int = DEPTH,
    ) -> None:
        self.rank = rank
        self.size = size
        self.channels = channels
        self.device = device
        self.control = control
        self.depth = depth
        self.cache = RegistrationCache(device.register)
        self.current = (-1, 0)
        self.closed = False
        self._armed = False
        self._slots = np.zeros(len(links) * depth * SLOT_BYTES, np.uint8)
        self._slots_mr = device.register(int(self._slots.ctypes.data), self._slots.nbytes, True)
        self.links: list[Link] = []
        self.by_route: dict[tuple[int, int], Link] = {}
        per_link = depth * SLOT_BYTES
        for index, (peer, channel) in enumerate(links):
            slots = self._slots[index * per_link : (index + 1) * per_link]
            link = Link(index, peer, channel, slots, self._slots_mr.lkey)
            self.links.append(link)
            self.by_route[(peer, channel)] = link

    def post_receives(self) -> None:
        """Post every link's control receives; call before the queue pairs reach RTR."""
        for link in self.links:
            for slot in range(self.depth):
                self._repost(link, slot, count=False)

    # -- the Transport contract ---------------------------------------------------------------

    def expect(self, seq: int, signature: int, nbytes: int = 0) -> None:
        self.current = (seq & 0xFFFFFFFF, signature)
        self.control.expect(seq, signature)
        for link in self.links:  # announcements that arrived during the previous collective
            for ready in link.readies if not link.sends else ():
                if ready.tag >> 32 == self.current[0] and ready.signature != signature:
                    raise FrameMismatch(link.peer, "signature", signature, ready.signature)

    def route(self, peer: int, segment: int) -> int:
        channel = segment % self.channels
        return channel if (peer, channel) in self.by_route else 0

    def link(self, peer: int, channel: int) -> Link:
        link = self.by_route.get((peer, channel))
        if link is None:
            raise ValueError(f"rank {self.rank} has no connection to rank {peer}")
        return link

    def isend(self, peer: int, channel: int, tag: int, signature: int, view: memoryview) -> Request:
        link = self.link(peer, channel)
        request = Request(peer, link.channel, tag, view)
        link.sends.append((request, signature))
        return request

    def irecv(self, peer: int, channel: int, tag: int, signature: int, view: memoryview) -> Request:
        link = self.link(peer, channel)
        request = Request(peer, link.channel, tag, view)
        ticket = link.next_ticket
        link.next_ticket = (ticket + 1) & 0xFFFFFFFF
        link.recvs.append((request, signature, ticket))
        link.outbox.append((request, signature, ticket))
        return request

    def progress(self, timeout: float) -> bool:
        moved = self._drain()
        moved = self._pump() or moved
        if moved or timeout <= 0:
            return moved
        self.control.progress(0)  # ABORT, BYE or a hang-up on the control mesh
        self._check_departed()
        if not self._armed:
            self.device.arm()
            self._armed = True
            if self._drain():  # completions that came before the channel was armed
                return self._pump() or True
        poller = select.poll()
        poller.register(self.device.fd, select.POLLIN)
        for fd in self.control.by_fd:
            poller.register(fd, select.POLLIN | select.POLLPRI)
        ready = poller.poll(max(0, int(timeout * 1000)))
        for fd, _events in ready:
            if fd == self.device.fd:
                self.device.consume_event()
                self._armed = False
        if any(fd != self.device.fd for fd, _ in ready):
            self.control.progress(0)
        moved = self._drain()
        return self._pump() or moved

    def cancel(self) -> None:
        """Forget posted work; deregister announced destinations so no late write lands."""
        for link in self.links:
            for request, _signature, _ticket in link.recvs:
                self.cache.invalidate(request.view)
            link.sends.clear()
            link.readies.clear()
            link.recvs.clear()
            link.outbox.clear()

    def abort(self, reason: dict[str, Any]) -> None:
        self.control.abort(reason)

    def peer_name(self, peer: int) -> str:
        return self.control.peer_name(peer)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.control.close()
        self.cache.clear()
        self._slots_mr.close()
        self.device.close()

    # -- the protocol ------------------------------------------------------------------------

    def _drain(self) -> bool:
        moved = False
        while completions := self.device.poll(32):
            moved = True
            for completion in completions:
                self._complete(completion)
        return moved

    def _complete(self, done: Completion) -> None:
        link = self.links[done.link]
        if not done.ok:
            raise self._failure(link, done.status)
        if done.kind == SENT:
            request = link.posted.popleft()
            if request is not None:
                request.done = True
            return
        if done.kind == WRITTEN:
            self._landed(link, done)
        else:
            self._control(link, done.slot)
        self._repost(link, done.slot % self.depth)

    def _landed(self, link: Link, done: Completion) -> None:
        link.peer_reposted = done.imm & _MASK
        if not link.recvs:
            raise wire.ProtocolError(f"rank {link.peer} wrote data this rank never announced")
        request, _signature, ticket = link.recvs.popleft()
        if done.imm >> 16 != ticket & _MASK or done.byte_len != request.nbytes:
            raise wire.ProtocolError(
                f"rank {link.peer} wrote {done.byte_len} bytes for receive {done.imm >> 16}, "
                f"expected {request.nbytes} bytes for receive {ticket & _MASK}"
            )
        request.done = True

    def _control(self, link: Link, slot: int) -> None:
        offset = (slot % self.depth) * SLOT_BYTES
        kind, credits, ticket, rkey, tag, signature, nbytes, address = CONTROL.unpack_from(link.slots, offset)
        link.peer_reposted = credits
        if kind == READY:
            ready = _Ready(ticket, tag, signature, nbytes, address, rkey)
            link.readies.append(ready)
            if not link.sends and ready.tag >> 32 == self.current[0] and ready.signature != self.current[1]:
                raise FrameMismatch(link.peer, "signature", self.current[1], ready.signature)
        elif kind == REFUSE:
            self._refused(link, ticket, tag, signature, nbytes)
        elif kind != CREDIT:
            raise wire.ProtocolError(f"unknown RDMA control message {kind} from rank {link.peer}")

    def _refused(self, link: Link, ticket: int, tag: int, signature: int, nbytes: int) -> None:
        """The peer's send does not match our announced receive ``ticket``: say how."""
        for request, expected_signature, announced in link.recvs:
            if announced == ticket:
                check_frame(
                    link.peer, expected_signature, request.tag, request.nbytes, signature, tag, nbytes
                )
                # It refused, so something differs; signature and tag agree, so the length.
                raise FrameMismatch(link.peer, "nbytes", request.nbytes, nbytes)
        raise wire.ProtocolError(
            f"rank {link.peer} refused receive {ticket}, which this rank never announced"
        )

    def _repost(self, link: Link, slot: int, count: bool = True) -> None:
        address = int(link.slots.ctypes.data) + slot * SLOT_BYTES
        self.device.post_recv(link.index, slot, address, SLOT_BYTES, link.lkey)
        if count:
            link.reposted = (link.reposted + 1) & _MASK

    def _pump(self) -> bool:
        """Post what may go: announced receives, paired writes, and owed credits."""
        moved = False
        for link in self.links:
            while link.outbox and link.can_send(self.depth):
                self._send_ready(link, *link.outbox.popleft())
                moved = True
            while link.sends and link.readies and link.can_send(self.depth) and not link.refused:
                self._write(link, link.readies.popleft())
                moved = True
            if (link.reposted - link.reported) & _MASK >= self.depth // 2 and len(link.posted) < self.depth:
                self._send_control(
                    link, CONTROL.pack(CREDIT, link.reposted, 0, 0, 0, 0, 0, 0)
                )  # past the limit on purpose
                moved = True
        return moved

    def _send_ready(self, link: Link, request: Request, signature: int, ticket: int) -> None:
        if request.nbytes:
            address, registration = self.cache.lookup(request.view, writable=True)
        else:  # nothing will be written: point at the control slots, which are registered anyway
            address, registration = int(link.slots.ctypes.data), self._slots_mr
        fields = (ticket, registration.rkey, request.tag, signature, request.nbytes, address)
        self._send_control(link, CONTROL.pack(READY, link.reposted, *fields))

    def _send_control(self, link: Link, message: bytes) -> None:
        link.reported = link.reposted
        link.sent = (link.sent + 1) & _MASK
        link.posted.append(None)
        self.device.post_send(link.index, message)

    def _write(self, link: Link, ready: _Ready) -> None:
        request, signature = link.sends[0]
        if (ready.signature, ready.tag, ready.nbytes) != (signature, request.tag, request.nbytes):
            # Like a TCP frame whose header does not match: the receiver is the one that fails.
            link.refused = True
            fields = (ready.ticket, 0, request.tag, signature, request.nbytes, 0)
            self._send_control(link, CONTROL.pack(REFUSE, link.reposted, *fields))
            return
        link.sends.popleft()
        if request.nbytes:
            address, registration = self.cache.lookup(request.view, writable=False)
            lkey = registration.lkey
        else:
            address, lkey = int(link.slots.ctypes.data), link.lkey
        imm = (ready.ticket & _MASK) << 16 | link.reposted
        link.reported = link.reposted
        link.sent = (link.sent + 1) & _MASK
        link.posted.append(request)
        self.device.post_write(link.index, address, request.nbytes, lkey, ready.address, ready.rkey, imm)

    def _check_departed(self) -> None:
        """Fail when a peer shut down (BYE) while posted work still involves it.

        Its last writes completed here before its BYE left on TCP, but their
        completions may be read after the BYE: they are drained once more
        before a frame counts as missing.
        """
        gone = [link for link in self.links if (link.sends or link.recvs) and self._departed(link.peer)]
        if gone and (self._drain() | self._pump()):
            gone = [link for link in gone if link.sends or link.recvs]
        if gone:
            conn = self.control.conns[(gone[0].peer, 0)]
            raise conn.fail("shut down (called shutdown()) while this rank still had frames for it")

    def _departed(self, peer: int) -> bool:
        conn = self.control.conns.get((peer, 0))
        return conn is not None and conn.departed

    def _failure(self, link: Link, status: str) -> PeerFailure:
        """The error for a failed work request, unless the control plane says why first.

        A rank that abandons a collective deregisters its announced receives
        (``cancel``) before its ABORT frame goes out, and a dead rank's queue
        pair fails writes before its TCP connection reports the death. So a
        failed completion is first given ``CONTROL_GRACE`` seconds for the real
        reason to arrive (``PeerAborted`` or ``PeerFailure`` from the control mesh).
        """
        deadline = time.monotonic() + CONTROL_GRACE
        while time.monotonic() < deadline:
            self.control.progress(0.05)
        name = self.peer_name(link.peer)
        return PeerFailure(f"rank {link.peer} ({name}): {explain_status(status)}", link.peer, name)


def explain_status(status: str) -> str:
    """A work-completion error in words, with what to check next."""
    hints = {
        "IBV_WC_RETRY_EXC_ERR": (
            "transport retry counter exceeded: its queue pair stopped acknowledging. Either the "
            "process died, or the GID chosen by RINGCORE_IB_GID_INDEX is not reachable from here "
            "(a link-local or loopback GID, or RoCE v1 on one side and v2 on the other)"
        ),
        "IBV_WC_RNR_RETRY_EXC_ERR": "receiver not ready, retries exhausted: its queue pair stopped receiving",
        "IBV_WC_REM_ACCESS_ERR": (
            "it refused an RDMA write (its destination was deregistered: it cancelled the collective "
            "or shut down)"
        ),
        "IBV_WC_WR_FLUSH_ERR": "the queue pair to it is in the error state (an earlier operation failed)",
        "IBV_WC_REM_OP_ERR": "its queue pair failed the operation",
    }
    return hints.get(status, f"RDMA completion failed with {status}")
