"""Small blocking-socket helpers shared by the store, the handshake and the mesh setup."""

from __future__ import annotations

import socket
import time
from typing import Any


def recv_exact(sock: socket.socket, nbytes: int, deadline: float | None = None) -> bytes:
    """Read exactly ``nbytes``.

    Raises:
        ConnectionError: the peer closed the connection first.
        TimeoutError: ``deadline`` (``time.monotonic()``) passed first.
    """
    data = bytearray()
    while len(data) < nbytes:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("timed out")
            sock.settimeout(remaining)
        chunk = sock.recv(nbytes - len(data))
        if not chunk:
            raise ConnectionError("connection closed")
        data += chunk
    return bytes(data)


def connect_retry(address: tuple[str, int], deadline: float, socket_buffer: int = 0) -> socket.socket:
    """Connect, retrying with backoff (the peer may not listen yet) until ``deadline``.

    Raises:
        OSError: the last connection error, once ``deadline`` has passed.
    """
    delay = 0.01
    while True:
        sock = socket.socket(socket.AF_INET6 if ":" in address[0] else socket.AF_INET, socket.SOCK_STREAM)
        size_buffers(sock, socket_buffer)
        sock.settimeout(max(0.1, min(5.0, deadline - time.monotonic())))
        try:
            sock.connect(address)
        except OSError:
            sock.close()
            if time.monotonic() + delay > deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
            continue
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock


def size_buffers(sock: socket.socket, nbytes: int) -> None:
    """Set SO_SNDBUF and SO_RCVBUF (before connect/listen, so TCP window scaling follows)."""
    if nbytes > 0:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, nbytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, nbytes)


def fmt(address: Any) -> str:
    """``host:port``."""
    return f"{address[0]}:{address[1]}"
