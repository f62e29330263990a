"""TCP transport: raw non-blocking sockets driven by one progress loop.

Data path. A DATA frame is a 32-byte header (``transport.wire``) and the
segment's bytes, sent and received straight from the segment's memoryview;
how one connection queues, reads and checks frames is
:mod:`ringcore.transport.tcp_connection`.

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
at 1M-16M often fell into a mode of half the bandwidth (measured:
``bench/HISTORY.md``).

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
from typing import Any

from ringcore.transport import wire
from ringcore.transport.base import Request
from ringcore.transport.tcp_connection import _POLLIN, _POLLRDHUP, STAGE_BYTES, _Conn, _Send

log = logging.getLogger("ringcore")

_ABORT_WAIT = 1.0  # seconds abort() may block per connection to get its frame out


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

    def expect(self, seq: int, signature: int, nbytes: int = 0) -> None:
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
        lend: bool = False,
        scratch: bool = True,
    ) -> tuple[Request | None, Request | None] | None:
        """One lockstep step straight on its sockets, with no request unless it must wait.

        ``send``/``recv`` are ``(peer, channel, view)``. The receive must land in
        scratch memory (``scratch``; see ``pull_scratch``): its single
        ``recvmsg_into`` would spill an unexpected frame's first bytes into the
        view. TCP lends nothing (``lend`` is ignored). Returns None, having done
        nothing, for a receive into the caller's memory or when either
        connection has frames queued (post with ``isend``/``irecv`` instead).
        Otherwise sends, then receives for up to ``spin`` seconds, and returns
        what is left as queued requests (None for each part that is done),
        exactly as if they had been posted and half moved, so ``progress``
        finishes them.
        """
        if recv is not None and not scratch:
            return None
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
