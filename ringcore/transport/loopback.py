"""In-process transport: ranks are threads, links are queues, capacity zero.

A send completes only when the matching receive is posted and the bytes are
copied, so an algorithm that waits for a send before posting the receive it
depends on deadlocks here (and times out in tests) instead of hiding behind
socket buffers. Used by the unit tests of the algorithms and by the
transport conformance suite.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

from ringcore.errors import PeerFailure
from ringcore.transport.base import FrameMismatch, PeerAborted, Request, check_frame

_ABORT = object()


class LoopbackNetwork:
    """The shared state of ``size`` in-process ranks; make one transport per rank."""

    def __init__(self, size: int, channels: int = 1) -> None:
        self.size = size
        self.channels = channels
        self.cond = threading.Condition()
        self.sends: dict[tuple[int, int, int], deque[Any]] = {}
        self.recvs: dict[tuple[int, int, int], deque[Any]] = {}
        self.closed: set[int] = set()
        self.version = 0

    def transport(self, rank: int) -> LoopbackTransport:
        return LoopbackTransport(self, rank)

    def link(self, src: int, dst: int, channel: int) -> tuple[deque[Any], deque[Any]]:
        key = (src, dst, channel)
        return self.sends.setdefault(key, deque()), self.recvs.setdefault(key, deque())

    def match(self, src: int, dst: int, channel: int) -> None:
        """Copy every matching (send, receive) pair at the heads of a link; call with ``cond`` held."""
        sends, recvs = self.link(src, dst, channel)
        while sends and recvs and sends[0] is not _ABORT:
            (send, signature), (recv, expected) = sends[0], recvs[0]
            if (send.tag, signature, send.nbytes) != (recv.tag, expected, recv.nbytes):
                return  # the receiver reports it in progress()
            recv.view[:] = send.view
            send.done = recv.done = True
            sends.popleft()
            recvs.popleft()
            self.version += 1
        self.cond.notify_all()


class LoopbackTransport:
    """One rank's endpoint of a :class:`LoopbackNetwork` (see ``transport.base``)."""

    def __init__(self, network: LoopbackNetwork, rank: int) -> None:
        self.network = network
        self.rank = rank
        self.size = network.size
        self.channels = network.channels
        self.current = (-1, 0)

    def expect(self, seq: int, signature: int, nbytes: int = 0) -> None:
        self.current = (seq & 0xFFFFFFFF, signature)

    def isend(self, peer: int, channel: int, tag: int, signature: int, view: memoryview) -> Request:
        req = Request(peer, channel, tag, view)
        with self.network.cond:
            self.network.link(self.rank, peer, channel)[0].append((req, signature))
            self.network.match(self.rank, peer, channel)
        return req

    def irecv(self, peer: int, channel: int, tag: int, signature: int, view: memoryview) -> Request:
        req = Request(peer, channel, tag, view)
        with self.network.cond:
            self.network.link(peer, self.rank, channel)[1].append((req, signature))
            self.network.match(peer, self.rank, channel)
        return req

    def route(self, peer: int, segment: int) -> int:
        return segment % self.channels

    def progress(self, timeout: float) -> bool:
        net = self.network
        with net.cond:
            start = net.version
            self._raise_errors()
            if net.version == start:
                net.cond.wait(timeout)
                self._raise_errors()
            return net.version != start

    def _raise_errors(self) -> None:
        """Raise what a real network would report for this rank's pending work."""
        net = self.network
        for (src, dst, _channel), recvs in net.recvs.items():
            if dst != self.rank or not recvs:
                continue
            sends = net.sends.get((src, dst, _channel))
            if sends and sends[0] is _ABORT:
                raise PeerAborted(src, net.sends[(src, -1, -1)][0] if (src, -1, -1) in net.sends else {})
            if sends:
                _check_head(src, sends[0], recvs[0])
            elif src in net.closed:
                raise PeerFailure(f"rank {src} (loopback) closed the connection", src, "loopback")
        for (src, dst, channel), sends in net.sends.items():
            if (
                dst == self.rank
                and sends
                and sends[0] is not _ABORT
                and not net.recvs.get((src, dst, channel))
            ):
                send, signature = sends[0]
                if send.tag >> 32 == self.current[0] and signature != self.current[1]:
                    raise FrameMismatch(src, "signature", self.current[1], signature)
        for (src, dst, _channel), sends in net.sends.items():
            if src == self.rank and sends and dst in net.closed:
                raise PeerFailure(f"rank {dst} (loopback) closed the connection", dst, "loopback")

    def cancel(self) -> None:
        """Forget this rank's posted receives; its sends stay queued, as bytes a TCP kernel already has."""
        net = self.network
        with net.cond:
            for (_src, dst, _channel), recvs in net.recvs.items():
                if dst == self.rank:
                    recvs.clear()
            net.version += 1
            net.cond.notify_all()

    def abort(self, reason: dict[str, Any]) -> None:
        net = self.network
        with net.cond:
            net.sends[(self.rank, -1, -1)] = deque([reason])
            for peer in range(self.size):
                for channel in range(self.channels):
                    if peer != self.rank:
                        net.link(self.rank, peer, channel)[0].appendleft(_ABORT)
            net.version += 1
            net.cond.notify_all()

    def peer_name(self, peer: int) -> str:
        return f"loopback rank {peer}"

    def close(self) -> None:
        with self.network.cond:
            self.network.closed.add(self.rank)
            self.network.version += 1
            self.network.cond.notify_all()


def _check_head(src: int, send_entry: Any, recv_entry: Any) -> None:
    (send, signature), (recv, expected) = send_entry, recv_entry
    check_frame(src, expected, recv.tag, recv.nbytes, signature, send.tag, send.nbytes)
