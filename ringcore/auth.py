"""Mutual HMAC-SHA256 challenge-response: the first bytes of every connection.

Both the rendezvous store and the data plane open each connection with it,
before any other byte is parsed::

    client -> server   MAGIC | client_nonce                          (36 bytes)
    server -> client   MAGIC | server_nonce | HMAC(k, "S" ctx nc ns)  (68 bytes)
    client -> server   HMAC(k, "C" ctx nc ns)                         (32 bytes)

``k`` is the job's secret (``RINGCORE_SECRET``), ``ctx`` names what the
connection is for (the store, or the data plane of one job session), and
both nonces are fresh, so a recorded handshake cannot be replayed and a
message for one purpose cannot be reflected into another. Each side proves
it knows ``k`` without sending it. Only fixed-size fields are read, each
within the handshake timeout, so a stranger can make a rank allocate nothing
and wait no longer than that.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import time

from ringcore.errors import AuthenticationError
from ringcore.sockets import recv_exact

MAGIC = b"RCA1"
NONCE_BYTES = 32
MAC_BYTES = 32

STORE_CONTEXT = b"ringcore-store"


def data_context(session: int) -> bytes:
    """The context of one job's data-plane connections."""
    return b"ringcore-data" + session.to_bytes(8, "little")


def _mac(key: bytes, role: bytes, context: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return hmac.new(key, role + context + client_nonce + server_nonce, hashlib.sha256).digest()


def client_handshake(sock: socket.socket, key: bytes, context: bytes, timeout: float) -> None:
    """Prove to the server that we share ``key`` and check that it does too.

    Raises:
        AuthenticationError: the server does not know ``key``, is not ringcore, or is too slow.
        ConnectionError: the server closed the connection (it died, or rejected us).
    """
    deadline = time.monotonic() + timeout
    client_nonce = os.urandom(NONCE_BYTES)
    sock.sendall(MAGIC + client_nonce)
    reply = _recv_exact(sock, len(MAGIC) + NONCE_BYTES + MAC_BYTES, deadline)
    if reply[: len(MAGIC)] != MAGIC:
        raise AuthenticationError("the peer did not answer with ringcore's handshake")
    server_nonce = reply[len(MAGIC) : len(MAGIC) + NONCE_BYTES]
    expected = _mac(key, b"S", context, client_nonce, server_nonce)
    if not hmac.compare_digest(reply[-MAC_BYTES:], expected):
        raise AuthenticationError("the peer does not share this job's secret")
    sock.sendall(_mac(key, b"C", context, client_nonce, server_nonce))


def server_handshake(sock: socket.socket, key: bytes, context: bytes, timeout: float) -> None:
    """Check that the client shares ``key``, proving that we do too.

    Raises:
        AuthenticationError: bad magic, wrong MAC, or too slow.
        OSError: the connection failed.
    """
    try:
        _serve_handshake(sock, key, context, time.monotonic() + timeout)
    except ConnectionError:
        raise AuthenticationError("the client closed the connection during the handshake") from None


def _serve_handshake(sock: socket.socket, key: bytes, context: bytes, deadline: float) -> None:
    hello = _recv_exact(sock, len(MAGIC) + NONCE_BYTES, deadline)
    if hello[: len(MAGIC)] != MAGIC:
        raise AuthenticationError("the client did not start ringcore's handshake")
    client_nonce = hello[len(MAGIC) :]
    server_nonce = os.urandom(NONCE_BYTES)
    sock.sendall(MAGIC + server_nonce + _mac(key, b"S", context, client_nonce, server_nonce))
    answer = _recv_exact(sock, MAC_BYTES, deadline)
    if not hmac.compare_digest(answer, _mac(key, b"C", context, client_nonce, server_nonce)):
        raise AuthenticationError("the client does not know this job's secret")


def _recv_exact(sock: socket.socket, nbytes: int, deadline: float) -> bytes:
    try:
        return recv_exact(sock, nbytes, deadline)
    except TimeoutError:
        raise AuthenticationError("the handshake timed out") from None
    except ConnectionError:
        raise ConnectionError("the peer closed the connection during the handshake") from None
