"""One connection of the TCP transport: a socket to one peer on one channel, its queues and its frames.

Data path. A DATA frame is a 32-byte header (``transport.wire``) and the
segment's bytes. Sends go out with ``sendmsg([header, payload])`` straight
from the segment's memoryview; receives read the header, check it against the
posted receive, then ``recv_into`` the destination view. Payload bytes are
never pickled, and copied in user space only on ``swap``'s small frames
(``read_staged``).

A connection keeps its queued sends (:class:`_Send`: header, payload, and
how much has gone out) and its posted receives, with how much of the head
receive's header and payload has arrived, so one frame can be read across
many calls and handed between ``pump_recv`` (the progress loop's path) and
the latency paths' ``read_frame``/``read_staged``. A header is checked the
moment it completes: an ABORT becomes ``PeerAborted`` with the peer's
reason, a BYE marks the peer *departed*, any other frame than the DATA frame
expected is a ``FrameMismatch``. Data that arrives with no receive posted
(``early``) is judged by ``check_idle``, and a failed send looks for an ABORT
waiting to be read before it blames the peer (``send_failed``).

The transport over all the connections, and its progress loop, is
:mod:`ringcore.transport.tcp`.
"""

from __future__ import annotations

import contextlib
import select
import socket
from collections import deque
from typing import Any

from ringcore.errors import PeerFailure
from ringcore.transport import wire
from ringcore.transport.base import FrameMismatch, PeerAborted, Request, check_frame

_POLLIN = select.POLLIN | select.POLLPRI
_POLLRDHUP = getattr(select, "POLLRDHUP", 0x2000)
STAGE_BYTES = 16 * 1024  # swap: payloads up to this go out and come in joined to their header


class _Send:
    """A queued frame: header then payload, with how much has gone out."""

    __slots__ = ("header", "offset", "request")

    def __init__(self, request: Request, header: bytes) -> None:
        self.request = request
        self.header = header
        self.offset = 0

    def remaining(self) -> list[Any]:
        if self.offset < wire.HEADER_BYTES:
            return [memoryview(self.header)[self.offset :], self.request.view]
        return [self.request.view[self.offset - wire.HEADER_BYTES :]]


class _Conn:
    """One socket to one peer on one channel, with its send and receive queues."""

    def __init__(self, sock: socket.socket, peer: int, channel: int, name: str) -> None:
        self.sock = sock
        self.peer = peer
        self.channel = channel
        self.name = name
        self.fd = sock.fileno()
        self.sends: deque[_Send] = deque()
        self.recvs: deque[tuple[Request, int]] = deque()
        self.header = bytearray(wire.HEADER_BYTES)
        self.stage = memoryview(bytearray(wire.HEADER_BYTES + STAGE_BYTES))  # read_staged's frame
        self.header_got = 0
        self.payload_got = 0
        self.early = False  # unread data waits for a receive not yet posted
        self.departed = False  # the peer said BYE: it shut down cleanly
        self.hangup = False  # the peer closed after early data: the receive that reads it will fail
        self.poller = select.poll()  # readable(): this socket alone
        self.poller.register(self.fd, select.POLLIN)

    def readable(self) -> bool:
        """Whether a read would not block (data, EOF or an error), without reading.

        What the spinning latency paths ask before each read: a read that finds
        nothing raises ``BlockingIOError``, and building that exception (errno,
        message decoded from the locale) costs about 2 us, four times a
        ``poll`` of one socket. Spinning ranks share the CPUs with the ranks
        they wait for, so what they burn is taken from those.
        """
        return bool(self.poller.poll(0))

    def fail(self, what: str) -> PeerFailure:
        return PeerFailure(f"rank {self.peer} ({self.name}) {what}", self.peer, self.name)

    def send_failed(self, err: OSError) -> Exception:
        """What a failed send means: the peer's ABORT if one waits to be read, else a PeerFailure.

        A peer that failed (say, it saw a third rank die) sends ABORT naming the
        culprit, and later closes its socket. Closing with our frames unread
        resets the connection, so our next send can fail before we read that
        ABORT, and we would blame the messenger. The reset does not drop what
        already arrived, so a frame boundary on our side is checked first.
        """
        if self.header_got == 0 and not self.early:
            with contextlib.suppress(OSError, wire.ProtocolError):
                head = self.sock.recv(wire.HEADER_BYTES, socket.MSG_PEEK | socket.MSG_DONTWAIT)
                if len(head) == wire.HEADER_BYTES and wire.unpack(head)[0] == wire.ABORT:
                    return self._take_abort(head)
        return self.fail(f"broke the connection while we were sending ({err.strerror})")

    def _take_abort(self, head: bytes) -> PeerAborted:
        """Consume the ABORT whose header ``head`` was peeked, and say what the peer said."""
        self.sock.recv(wire.HEADER_BYTES)
        return PeerAborted(self.peer, wire.decode_abort(self._read_control(wire.unpack(head)[3])))

    def pump_send(self) -> bool:
        moved = False
        while self.sends:
            op = self.sends[0]
            try:
                sent = self.sock.sendmsg(op.remaining())
            except (BlockingIOError, InterruptedError):
                return moved
            except OSError as err:
                raise self.send_failed(err) from None
            op.offset += sent
            moved = True
            if op.offset == wire.HEADER_BYTES + op.request.nbytes:
                op.request.done = True
                self.sends.popleft()
        return moved

    def pump_recv(self) -> bool:
        moved = False
        while self.recvs:
            request, signature = self.recvs[0]
            if self.header_got < wire.HEADER_BYTES:
                got = self._read(memoryview(self.header)[self.header_got :])
                if got is None:
                    return moved
                moved = True
                self.header_got += got
                if self.header_got < wire.HEADER_BYTES:
                    continue
                self._check_header(request.tag, request.nbytes, signature)
            while self.payload_got < request.nbytes:
                got = self._read(request.view[self.payload_got :])
                if got is None:
                    return moved
                moved = True
                self.payload_got += got
            request.done = True
            self.recvs.popleft()
            self.header_got = self.payload_got = 0
            self.early = False
        return moved

    def pull_scratch(self) -> bool:
        """``pump_recv`` for the head receive, header and payload in one ``recvmsg_into``.

        One syscall per small frame instead of two. Only for receives into
        scratch memory: a frame other than the expected one (an ABORT, a
        mismatch) is recognised only after its first bytes spilled into the
        view. An ABORT's spilled bytes are its reason and are read from there.
        """
        request, signature = self.recvs[0]
        moved = False
        while self.header_got < wire.HEADER_BYTES:
            got = self.read_frame(request.view, self.header_got + self.payload_got, request.tag, signature)
            if got is None:
                return moved
            moved = True
            self.header_got = min(got, wire.HEADER_BYTES)
            self.payload_got = got - self.header_got
        return self.pump_recv() or moved

    def read_frame(self, view: memoryview, got: int, tag: int, signature: int) -> int | None:
        """One ``recvmsg_into`` of a frame of which ``got`` bytes are in (header, then ``view``).

        Returns the new count, or None when nothing was there. The header is
        checked the moment it completes (see ``pull_scratch`` on spilled bytes).
        """
        parts = (
            [memoryview(self.header)[got:], view]
            if got < wire.HEADER_BYTES
            else [view[got - wire.HEADER_BYTES :]]
        )
        try:
            moved = self.sock.recvmsg_into(parts)[0]
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as err:
            raise self.fail(f"broke the connection ({err.strerror})") from None
        if moved == 0:
            raise self.fail("closed the connection")
        if got < wire.HEADER_BYTES <= got + moved:
            self._check_header(tag, view.nbytes, signature, view[: got + moved - wire.HEADER_BYTES])
        return got + moved

    def read_staged(self, got: int, total: int, tag: int, signature: int) -> int | None:
        """``read_frame`` for a frame of at most ``STAGE_BYTES``, read whole into ``stage``.

        A plain ``recv_into`` of one buffer costs about 3 us less than
        ``recvmsg_into`` of two (CPython builds an iovec and a result tuple),
        and a 4 KiB copy out of ``stage`` a tenth of that. The header is
        checked the moment it completes, from ``stage``.
        """
        moved = self._read(self.stage[got:total])
        if moved is None:
            return None
        if got < wire.HEADER_BYTES <= got + moved:
            head = self.stage[: wire.HEADER_BYTES]
            self._check_header(
                tag, total - wire.HEADER_BYTES, signature, self.stage[wire.HEADER_BYTES : got + moved], head
            )
        return got + moved

    def unstage(self, view: memoryview, got: int) -> None:
        """Move the first ``got`` bytes of a staged frame to where ``pump_recv`` carries on from."""
        head = min(got, wire.HEADER_BYTES)
        self.header[:head] = self.stage[:head]
        if got > wire.HEADER_BYTES:
            view[: got - wire.HEADER_BYTES] = self.stage[wire.HEADER_BYTES : got]

    def _read(self, view: memoryview) -> int | None:
        try:
            got = self.sock.recv_into(view)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as err:
            raise self.fail(f"broke the connection ({err.strerror})") from None
        if got == 0:
            raise self.fail("closed the connection")
        return got

    def _check_header(
        self,
        tag: int,
        nbytes: int,
        signature: int,
        spilled: memoryview | None = None,
        head: memoryview | None = None,
    ) -> None:
        """Raise unless the header just read is the DATA frame expected (``tag``, ``nbytes`` bytes).

        ``spilled``: payload bytes read together with the header (``pull_scratch``);
        ``head``: where the header is, when not in ``self.header`` (``read_staged``).
        """
        kind, got_tag, got_signature, got_nbytes = wire.unpack(self.header if head is None else head)
        if kind == wire.ABORT:
            head = bytes(spilled[:got_nbytes]) if spilled is not None else b""
            raise PeerAborted(self.peer, wire.decode_abort(head + self._read_control(got_nbytes - len(head))))
        if kind == wire.BYE:
            self.departed = True
            raise self.fail("shut down (called shutdown()) while this rank still expected data from it")
        if kind != wire.DATA:
            raise wire.ProtocolError(f"unexpected frame kind {kind} from rank {self.peer}")
        check_frame(self.peer, signature, tag, nbytes, got_signature, got_tag, got_nbytes)

    def _read_control(self, nbytes: int) -> bytes:
        """Read a small control payload, waiting at most a few seconds."""
        self.sock.settimeout(2.0)
        data = bytearray()
        try:
            while len(data) < nbytes and (chunk := self.sock.recv(nbytes - len(data))):
                data += chunk
        except OSError:
            pass
        finally:
            self.sock.setblocking(False)
        return bytes(data)

    def check_idle(self, current: tuple[int, int]) -> None:
        """Look at unread data on a connection with no posted receive.

        ``current`` is the running collective's ``(seq, signature)``: a frame of
        that collective with another signature means the ranks disagree, even
        if this rank never expected a frame from that peer.
        """
        try:
            head = self.sock.recv(wire.HEADER_BYTES, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as err:
            raise self.fail(f"broke the connection ({err.strerror})") from None
        if not head:
            raise self.fail("closed the connection")
        kind = wire.unpack(head)[0] if len(head) == wire.HEADER_BYTES else wire.DATA
        if kind == wire.ABORT:
            raise self._take_abort(head)
        if kind == wire.BYE:
            self.sock.recv(wire.HEADER_BYTES)
            self.departed = True
            return
        if len(head) == wire.HEADER_BYTES:
            _, tag, signature, _ = wire.unpack(head)
            if tag >> 32 == current[0] and signature != current[1]:
                raise FrameMismatch(self.peer, "signature", current[1], signature)
        self.early = True

    def poll_events(self) -> int:
        """What to wait for: room to send, data to receive, or news on an idle connection."""
        if self.departed:
            return 0
        events = select.POLLOUT if self.sends else 0
        if self.recvs:
            return events | _POLLIN | _POLLRDHUP
        if not self.early:
            return events | _POLLIN | _POLLRDHUP
        # Unread early data: its arrival is known; only a hang-up is news, and only once.
        return events if self.hangup else events | _POLLRDHUP
