"""One TCP connection's failure paths, on real loopback sockets.

A peer that fails sends ABORT and later closes its socket; closing with our
frames unread makes the kernel reset the connection, and our next send then
fails before we have read the ABORT. The error must still be the peer's
ABORT (which names the real culprit), not a PeerFailure that blames the peer.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from ringcore.errors import PeerFailure
from ringcore.transport import wire
from ringcore.transport.base import PeerAborted, Request
from ringcore.transport.tcp_connection import _Conn, _Send

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def pair() -> Iterator[tuple[_Conn, socket.socket]]:
    """Our end of a connection (a ``_Conn`` to rank 1) and the peer's raw socket."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        ours = socket.create_connection(server.getsockname())
        theirs, _ = server.accept()
    ours.setblocking(False)
    conn = _Conn(ours, peer=1, channel=0, name="peer-host")
    yield conn, theirs
    ours.close()
    theirs.close()


def reset_by_peer(conn: _Conn, theirs: socket.socket, last_words: bytes) -> None:
    """The peer sends ``last_words`` and closes with our bytes unread: a reset."""
    conn.sock.send(b"unread by the peer")
    theirs.sendall(last_words)
    theirs.close()
    time.sleep(0.1)  # the RST lands


def queue_send(conn: _Conn, nbytes: int = 1 << 22) -> None:
    view = memoryview(bytearray(nbytes))
    conn.sends.append(_Send(Request(1, 0, 7, view), wire.pack(wire.DATA, 7, 0, nbytes)))


def test_send_into_a_reset_connection_reports_the_abort_the_peer_sent_first(pair) -> None:
    conn, theirs = pair
    reset_by_peer(
        conn, theirs, wire.abort_frame({"kind": "peer_failure", "culprit": 2, "message": "rank 2 died"})
    )
    queue_send(conn)
    with pytest.raises(PeerAborted) as caught:
        conn.pump_send()
    assert caught.value.peer == 1 and caught.value.reason["culprit"] == 2


def test_send_into_a_reset_connection_without_an_abort_blames_the_peer(pair) -> None:
    conn, theirs = pair
    reset_by_peer(conn, theirs, b"")
    queue_send(conn)
    with pytest.raises(
        PeerFailure, match=r"rank 1 \(peer-host\) broke the connection while we were sending"
    ) as caught:
        conn.pump_send()
    assert caught.value.peer == 1


def test_mid_frame_bytes_are_not_read_as_an_abort_header(pair) -> None:
    """Halfway through a frame from the peer, what follows is payload, whatever it looks like."""
    conn, theirs = pair
    reset_by_peer(conn, theirs, wire.abort_frame({"message": "payload that looks like an abort"}))
    conn.header_got = wire.HEADER_BYTES  # we are reading a frame's payload
    queue_send(conn)
    with pytest.raises(PeerFailure, match="broke the connection"):
        conn.pump_send()
