"""TCP transport: raw non-blocking sockets driven by one progress loop.

Data path. A DATA frame is a 32-byte header (``transport.wire``) and the
segment's bytes. Sends go out with ``sendmsg([header, payload])`` straight
from the segment's memoryview; receives read the header, check it against the
posted receive, then ``recv_into`` the destination view. Payload bytes are
never pickled, and copied in user space only on ``swap``'s small frames (below).

Concurrency. There are no I/O threads: the collective's own thread calls
``progress()``, which pushes every connection with queued sends and pulls
every connection with posted receives until the kernel says ``EAGAIN``, then
keeps trying for ``spin`` seconds (waking a sleeping peer costs more than a
small allreduce), calling ``sched_yield`` between tries, and only then sleeps
in ``poll``. Sends and receives therefore interleave (no deadlock when socket
buffers fill), and large socket buffers (``RINGCORE_SOCKET_BUFFER``; 0 leaves
them to the kernel's autotuning) let the kernel keep moving bytes while the
thread is reducing a segment.

Latency path. A small collective run step by step
(:mod:`ringcore.algo.lockstep`) waits on one send and one receive at a time;
``exchange`` spins on just those two sockets and reads a frame's header and
payload with one ``recvmsg_into`` (into scratch memory only: an unexpected
frame is recognised after its first bytes landed). The queues stay the source
of truth, so ``progress`` takes over wherever ``exchange`` stops. ``swap``
does the same for one step without posting anything; a frame of at most
``STAGE_BYTES`` goes out as one buffer (``send(header + payload)``) and
comes in whole into the connection's staging buffer (one ``recv_into``),
then is copied to the view: per 4 KiB frame that costs about 3 us less than
``sendmsg`` and ``recvmsg_into`` of two buffers. While they spin they
ask ``poll`` whether the socket is readable before reading again: a read
that finds nothing raises ``BlockingIOError``, which costs four times a
``poll`` of one socket, CPU a spinning rank takes from the rank it waits for
when they share a core.

Idle connections. ``progress`` looks at connections with nothing posted
(an ABORT, a peer that hung up, an early frame that shows a disagreement)
only when posted work cannot move: a rank whose frame arrived together with
an ABORT of the next collective finishes this one and fails the next.

Yielding lets whatever shares the core run first: a peer rank when there are
more ranks than cores (Open MPI's ``mpi_yield_when_idle``), and the kernel's
own ``ksoftirqd``, which processes loopback packets once softirqs back up. A
rank alone on its core pays a syscall per try; without the yield, N=2 runs
at 1M-16M fell into a mode of ~1.0 GB/s instead of 2.1-3.0 in five of six
runs (``ringcore-bench --np 2 -b 1M -e 16M -f 4``).

Connections. Channel 0 is a full mesh, so any algorithm can reach any peer
and every rank notices a dead or aborting peer during any collective, even
one it is not exchanging data with right now; channels ``1..C-1`` go to the
ring neighbours only and carry every C-th segment (``needed_links``). How
the mesh is set up and authenticated is :mod:`ringcore.transport.mesh`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import time
from collections import deque
from typing import Any

from ringcore.errors import PeerFailure
from ringcore.transport import wire
from ringcore.transport.base import FrameMismatch, PeerAborted, Request

log = logging.getLogger("ringcore")

_POLLIN = select.POLLIN | select.POLLPRI
_POLLRDHUP = getattr(select, "POLLRDHUP", 0x2000)
_ABORT_WAIT = 1.0  # seconds abort() may block per connection to get its frame out
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
        if got_signature != signature:
            raise FrameMismatch(self.peer, "signature", signature, got_signature)
        if got_tag != tag:
            raise FrameMismatch(self.peer, "tag", tag, got_tag)
        if got_nbytes != nbytes:
            raise FrameMismatch(self.peer, "nbytes", nbytes, got_nbytes)

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


class TcpTransport:
    """Non-blocking TCP transport over an established mesh (see module docstring)."""

    def __init__(self, rank: int, size: int, channels: int, conns: dict[tuple[int, int], _Conn]) -> None:
        self.rank = rank
        self.size = size
        self.channels = channels
        self.conns = conns
        self.by_fd = {conn.fd: conn for conn in conns.values()}
        self.names = {peer: conn.name for (peer, _), conn in conns.items()}
        self.closed = False
        self.current = (-1, 0)  # (seq, signature) of the running collective
        self.spin = 0.0  # seconds to busy-poll before sleeping in poll (Settings.spin_seconds)

    def expect(self, seq: int, signature: int) -> None:
        """Start collective ``seq``; a frame that arrived early may already show a disagreement."""
        self.current = (seq & 0xFFFFFFFF, signature)
        for conn in self.conns.values():
            if conn.early and not conn.recvs and not conn.hangup:
                conn.check_idle(self.current)  # it was judged against the previous collective

    def conn(self, peer: int, channel: int) -> _Conn:
        conn = self.conns.get((peer, channel))
        if conn is None:
            raise ValueError(f"rank {self.rank} has no connection to rank {peer}")
        return conn

    def route(self, peer: int, segment: int) -> int:
        channel = segment % self.channels
        return channel if (peer, channel) in self.conns else 0

    def isend(self, peer: int, channel: int, tag: int, signature: int, view: memoryview) -> Request:
        conn = self.conn(peer, channel)
        request = Request(peer, conn.channel, tag, view)
        conn.sends.append(_Send(request, wire.pack(wire.DATA, tag, signature, view.nbytes)))
        return request

    def irecv(self, peer: int, channel: int, tag: int, signature: int, view: memoryview) -> Request:
        conn = self.conn(peer, channel)
        request = Request(peer, conn.channel, tag, view)
        conn.recvs.append((request, signature))
        return request

    def progress(self, timeout: float) -> bool:
        if self._pump():
            return True
        if timeout > 0 and self.spin:
            deadline = time.perf_counter() + min(self.spin, timeout)
            while time.perf_counter() < deadline:
                os.sched_yield()
                if self._pump():
                    return True
        poller = select.poll()
        for conn in self.conns.values():
            if conn.departed and (conn.sends or conn.recvs):
                raise conn.fail("shut down (called shutdown()) while this rank still had frames for it")
            poller.register(conn.fd, conn.poll_events())
        ready = poller.poll(max(0, int(timeout * 1000)))
        if not ready:
            return False
        # Posted work first: when a receive's frame and a peer's ABORT of the next collective
        # arrive together, this collective completes, and the next one fails on the ABORT.
        if self._pump():
            return True
        for fd, events in ready:
            conn = self.by_fd[fd]
            if conn.recvs or not events & (_POLLIN | _POLLRDHUP | select.POLLHUP | select.POLLERR):
                continue
            if conn.early:
                conn.hangup = True  # EOF waits behind unread data; no need to spin on it
            else:
                conn.check_idle(self.current)
        return False

    def swap(
        self,
        send: tuple[int, int, memoryview] | None,
        recv: tuple[int, int, memoryview] | None,
        tag: int,
        signature: int,
    ) -> tuple[Request | None, Request | None] | None:
        """One lockstep step straight on its sockets, with no request unless it must wait.

        ``send``/``recv`` are ``(peer, channel, view)``; ``recv`` must be scratch
        memory (see ``pull_scratch``). Returns None, having done nothing, when
        either connection has frames queued (post with ``isend``/``irecv``
        instead). Otherwise sends, then receives for up to ``spin`` seconds,
        and returns what is left as queued requests (None for each part that
        is done), exactly as if they had been posted and half moved, so
        ``progress`` finishes them.
        """
        send_conn = self.conns[(send[0], send[1])] if send is not None else None
        recv_conn = self.conns[(recv[0], recv[1])] if recv is not None else None
        if (send_conn is not None and send_conn.sends) or (recv_conn is not None and recv_conn.recvs):
            return None
        sent = None
        if send_conn is not None:
            view = send[2]  # type: ignore[index]
            header = wire.pack(wire.DATA, tag, signature, view.nbytes)
            try:
                if view.nbytes <= STAGE_BYTES:  # one buffer: send() costs about 1 us less than sendmsg()
                    moved = send_conn.sock.send(header + view)
                else:
                    moved = send_conn.sock.sendmsg([header, view])
            except (BlockingIOError, InterruptedError):
                moved = 0
            except OSError as err:
                raise send_conn.send_failed(err) from None
            if moved < wire.HEADER_BYTES + view.nbytes:
                sent = Request(send[0], send_conn.channel, tag, view)  # type: ignore[index]
                queued = _Send(sent, header)
                queued.offset = moved
                send_conn.sends.append(queued)
        if recv_conn is None:
            return sent, None
        view = recv[2]  # type: ignore[index]
        got, total, deadline = 0, wire.HEADER_BYTES + view.nbytes, 0.0
        staged = view.nbytes <= STAGE_BYTES
        ready = True  # the first try reads; after a miss, poll before reading again
        while got < total:
            if ready:
                if staged:
                    now_got = recv_conn.read_staged(got, total, tag, signature)
                else:
                    now_got = recv_conn.read_frame(view, got, tag, signature)
                if now_got is not None:
                    got = now_got
                    continue
            if sent is not None and send_conn.pump_send() and sent.done:  # type: ignore[union-attr]
                sent = None
            now = time.perf_counter()
            if not deadline:
                deadline = now + self.spin
            elif now > deadline:  # hand over to progress: as if posted with irecv and half read
                if staged:
                    recv_conn.unstage(view, got)
                received = Request(recv[0], recv_conn.channel, tag, view)  # type: ignore[index]
                recv_conn.header_got = min(got, wire.HEADER_BYTES)
                recv_conn.payload_got = got - recv_conn.header_got
                recv_conn.recvs.append((received, signature))
                return sent, received
            os.sched_yield()
            ready = recv_conn.readable()
        if staged:
            view[:] = recv_conn.stage[wire.HEADER_BYTES : total]
        recv_conn.early = False
        return sent, None

    def exchange(self, sent: Request | None, received: Request | None) -> bool:
        """Finish one send and one receive on their own sockets, spinning at most ``spin`` s.

        The latency path of :class:`~ringcore.algo.lockstep.LockstepExecutor`:
        no walk over every connection per try, and one ``recvmsg_into`` per
        frame (``pull_scratch``, so ``received`` must land in scratch memory).
        Both requests must be first in their connection's queue; the queues
        stay the source of truth, so when this returns False (not done, or not
        at the head) ``progress`` carries on from where it stopped.
        """
        send_conn = recv_conn = None
        if sent is not None and not sent.done:
            send_conn = self.conns[(sent.peer, sent.channel)]
            if send_conn.sends[0].request is not sent:
                return False
        if received is not None and not received.done:
            recv_conn = self.conns[(received.peer, received.channel)]
            if recv_conn.recvs[0][0] is not received:
                return False
        deadline, ready = 0.0, True  # the first try reads; after a miss, poll before reading again
        while True:
            moved = False
            if send_conn is not None:
                moved = send_conn.pump_send()
                if sent.done:  # type: ignore[union-attr]
                    send_conn = None
            if recv_conn is not None and ready:
                moved = recv_conn.pull_scratch() or moved
                if received.done:  # type: ignore[union-attr]
                    recv_conn = None
            if send_conn is None and recv_conn is None:
                return True
            if not moved:
                now = time.perf_counter()
                if not deadline:
                    deadline = now + self.spin
                elif now > deadline:
                    return False
                os.sched_yield()
            ready = recv_conn is not None and recv_conn.readable()

    def _pump(self) -> bool:
        moved = False
        for conn in self.conns.values():
            if conn.sends and conn.pump_send():
                moved = True
            if conn.recvs and conn.pump_recv():
                moved = True
        return moved

    def cancel(self) -> None:
        """Drop queued frames; the streams are then mid-frame, so only abort/close may follow."""
        for conn in self.conns.values():
            conn.recvs.clear()
            partial = conn.sends[0] if conn.sends and conn.sends[0].offset else None
            conn.sends.clear()
            if partial is not None:
                conn.sends.append(partial)  # abort() must still see that a frame is half sent
            conn.header_got = conn.payload_got = 0

    def abort(self, reason: dict[str, Any]) -> None:
        """Send ABORT on every connection, first finishing a half-sent frame.

        The rest of that frame must go out, or the ABORT would land in the middle
        of its payload and the peer would only see the connection close, and
        blame this rank instead of the real culprit. Its bytes mean nothing now
        (the peer fails on the ABORT and restores its own buffers). Bounded: a
        peer that does not read gets ``_ABORT_WAIT`` seconds, then just EOF.
        """
        frame = wire.abort_frame(reason)
        for conn in self.conns.values():
            rest = conn.sends[0].remaining() if conn.sends and conn.sends[0].offset else []
            try:
                conn.sock.settimeout(_ABORT_WAIT)
                for part in rest:
                    conn.sock.sendall(part)
                conn.sock.sendall(frame)
                conn.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            finally:
                with contextlib.suppress(OSError):
                    conn.sock.setblocking(False)

    def peer_name(self, peer: int) -> str:
        return self.names.get(peer, "?")

    def close(self) -> None:
        """Say BYE on every connection that is between frames, then close them all."""
        if self.closed:
            return
        self.closed = True
        bye = wire.pack(wire.BYE, 0, 0, 0)
        for conn in self.conns.values():
            try:
                if not (conn.sends and conn.sends[0].offset):
                    conn.sock.send(bye)
                conn.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        for conn in self.conns.values():
            with contextlib.suppress(OSError):
                conn.sock.close()


def needed_links(rank: int, size: int, channels: int) -> list[tuple[int, int]]:
    """``(peer, channel)`` pairs this rank is connected to: mesh on 0, ring neighbours on the rest."""
    links = [(peer, 0) for peer in range(size) if peer != rank]
    if size > 1:
        neighbours = sorted({(rank + 1) % size, (rank - 1) % size})
        links += [(peer, ch) for ch in range(1, channels) for peer in neighbours]
    return links
