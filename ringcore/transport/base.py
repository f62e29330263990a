"""The transport contract the algorithms are written against.

A transport connects this rank to its peers and moves *segments*: contiguous
memoryviews, each carried as one frame on one ``(peer, channel)`` connection.
It is non-blocking in the style of NCCL's network plugins: ``isend`` and
``irecv`` return a :class:`Request` at once, and nothing moves until
``progress`` is called (by the executor, in the collective's thread).

Ordering rule: on each ``(peer, channel)`` connection, frames are matched to
posted receives in the order both sides post them (FIFO, like one TCP
stream). Every frame carries a *tag* (collective sequence, step, segment) and
the collective's *signature* (a hash of what the rank was asked to do); the
receiver checks both, so ranks that disagree fail with a clear error instead
of reducing garbage.

Optional: a transport whose frames land in memory the receiver can read in
place (shared memory) also has ``irecv_lent``, which posts a receive as
``irecv`` does but may complete it with the bytes left where they arrived
(``Request.lent``), and ``release(request)``, which gives that memory back.
Until then no later frame on that connection is read. The lockstep
executor combines straight from lent bytes, which saves a copy.

What ``progress`` raises:
    PeerFailure: the peer closed the connection or the link broke.
    PeerAborted: the peer aborted the collective and said why.
    FrameMismatch: a frame's tag, signature or length differs from the posted receive.
"""

from __future__ import annotations

from typing import Any, Protocol

from ringcore.errors import RingcoreError


class Request:
    """One posted send or receive; ``done`` turns true when its bytes have moved.

    ``lent``: for a receive a transport lent (``irecv_lent``, shared memory),
    the frame's bytes where they arrived, as ``(byte offset, bytes)`` pieces,
    readable until the transport's ``release(request)``; None: they are in ``view``.
    """

    __slots__ = ("channel", "done", "lent", "nbytes", "peer", "tag", "view")

    def __init__(self, peer: int, channel: int, tag: int, view: memoryview) -> None:
        self.peer = peer
        self.channel = channel
        self.tag = tag
        self.view = view
        self.nbytes = view.nbytes
        self.done = False
        self.lent: list[tuple[int, memoryview]] | None = None


class FrameMismatch(RingcoreError):
    """A frame differs from the receive posted for it (ranks disagree)."""

    def __init__(self, peer: int, field: str, expected: int, got: int) -> None:
        super().__init__(f"frame from rank {peer}: {field} {got:#x}, expected {expected:#x}")
        self.peer = peer
        self.field = field
        self.expected = expected
        self.got = got


def check_frame(
    peer: int, signature: int, tag: int, nbytes: int, got_signature: int, got_tag: int, got_nbytes: int
) -> None:
    """Every transport's header check: raise ``FrameMismatch`` on the first field that differs.

    The fields are compared in the order signature, tag, length, against the
    receive posted for the frame from ``peer``.
    """
    if got_signature != signature:
        raise FrameMismatch(peer, "signature", signature, got_signature)
    if got_tag != tag:
        raise FrameMismatch(peer, "tag", tag, got_tag)
    if got_nbytes != nbytes:
        raise FrameMismatch(peer, "nbytes", nbytes, got_nbytes)


class PeerAborted(RingcoreError):
    """The peer sent an ABORT frame; ``reason`` is its decoded explanation.

    ``waiting``: what this rank was itself waiting for when the ABORT came,
    and for how long (set by the executors' wait loop; "" if unknown).
    """

    def __init__(self, peer: int, reason: dict[str, Any]) -> None:
        super().__init__(f"rank {peer} aborted: {reason.get('message', reason)}")
        self.peer = peer
        self.reason = reason
        self.waiting = ""


class Transport(Protocol):
    """What an algorithm may ask of the network."""

    rank: int
    size: int
    channels: int

    def isend(self, peer: int, channel: int, tag: int, signature: int, view: memoryview) -> Request:
        """Queue ``view`` to be sent to ``peer``; the caller must not change it until done."""
        ...

    def irecv(self, peer: int, channel: int, tag: int, signature: int, view: memoryview) -> Request:
        """Post a receive of exactly ``view.nbytes`` bytes from ``peer`` into ``view``."""
        ...

    def expect(self, seq: int, signature: int, nbytes: int = 0) -> None:
        """Announce the running collective, so stray frames of it can be checked too.

        ``nbytes``: the bytes of the caller's buffer it reduces or moves (0:
        unknown); a transport may choose how to move large frames by it
        (shared memory: pointers only where the buffers outgrow the cache).
        """
        ...

    def route(self, peer: int, segment: int) -> int:
        """The channel that carries ``segment`` to or from ``peer`` (same answer on both sides)."""
        ...

    def progress(self, timeout: float) -> bool:
        """Move bytes; block up to ``timeout`` s when nothing can move. True if anything moved."""
        ...

    def cancel(self) -> None:
        """Forget every posted send and receive: no byte lands in their views afterwards."""
        ...

    def abort(self, reason: dict[str, Any]) -> None:
        """Best effort: tell every peer this rank is abandoning the current collective."""
        ...

    def peer_name(self, peer: int) -> str:
        """``host:port`` of a peer, for error messages."""
        ...

    def close(self) -> None:
        """Close every connection; idempotent."""
        ...
