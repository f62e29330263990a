"""Security tests: authentication, hostile bytes on every port, TLS. Helpers shared by the modules."""

from __future__ import annotations

import contextlib
import socket

import pytest

from tests.cluster import free_port

BOUND = 5.0  # seconds any rejection may take, far above the handshake timeouts used here


def recv_all(sock: socket.socket, bound: float = BOUND) -> bytes:
    """Everything the peer sends until it closes (a reset counts as closed); fails after ``bound`` s."""
    sock.settimeout(bound)
    data = bytearray()
    while True:
        try:
            chunk = sock.recv(4096)
        except TimeoutError:
            pytest.fail(f"the server kept the connection open for more than {bound} s")
        except OSError:  # ECONNRESET: it closed with our bytes unread
            return bytes(data)
        if not chunk:
            return bytes(data)
        data += chunk


def poke(port: int, payload: bytes) -> bytes:
    """Connect to 127.0.0.1:``port``, send ``payload``, close our side; what came back before it closed."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=BOUND)
    try:
        with contextlib.suppress(OSError):
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
        return recv_all(sock)
    finally:
        sock.close()


def free_range(width: int) -> tuple[int, int]:
    """A run of ``width`` ports on 127.0.0.1 that are free right now, below the ephemeral range.

    Free now is the best a test can know: see :func:`tests.cluster.free_port`.
    """
    low = free_port(width - 1)
    return low, low + width - 1
