"""Setting up the TCP mesh: listen, connect, authenticate, say HELLO.

Each rank listens on one address (the chosen interface, a port in
``RINGCORE_PORT_RANGE`` if set), connects to every lower rank and accepts
every higher one (``tcp.needed_links``). Every connection first passes the
HMAC handshake of :mod:`ringcore.auth` bound to the job's session id, then
the connecting side sends a HELLO frame with its rank and channel.

Accepting runs on a background thread that hands each new socket to its own
short-lived handshake thread, so a stranger that connects and stays silent
delays nobody: it is dropped after ``handshake_timeout`` and logged. The
listener is closed as soon as the mesh is complete: no data port stays open
during the job.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import random
import socket
import threading
import time
from typing import Any

from ringcore import auth
from ringcore.errors import AuthenticationError, CollectiveTimeout, ConfigError, PeerFailure
from ringcore.sockets import connect_retry, fmt, recv_exact, size_buffers
from ringcore.transport import wire
from ringcore.transport.tcp import TcpTransport, needed_links
from ringcore.transport.tcp_connection import _Conn

log = logging.getLogger("ringcore")

Link = tuple[int, int]  # (peer, channel)


def make_listener(
    host: str, socket_buffer: int, port: int = 0, port_range: tuple[int, int] | None = None
) -> socket.socket:
    """A listening socket on ``host`` (never all interfaces unless ``host`` is ``0.0.0.0``).

    Raises:
        ConfigError: no free port in ``port_range``.
    """
    candidates = [port] if port or port_range is None else _shuffled(port_range)
    for candidate in candidates:
        listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        size_buffers(listener, socket_buffer)
        try:
            listener.bind((host, candidate))
        except OSError:
            listener.close()
            if port_range is None:
                raise
            continue
        listener.listen(512)
        return listener
    raise ConfigError(f"no free port on {host} in RINGCORE_PORT_RANGE={port_range[0]}-{port_range[1]}")


def _shuffled(port_range: tuple[int, int]) -> list[int]:
    ports = list(range(port_range[0], port_range[1] + 1))
    random.shuffle(ports)
    return ports


def connect_mesh(
    rank: int,
    size: int,
    channels: int,
    listener: socket.socket,
    addresses: list[tuple[str, int]],
    session: int,
    socket_buffer: int,
    timeout: float,
    key: bytes = b"",
    handshake_timeout: float = 10.0,
    liveness: float | None = None,
) -> TcpTransport:
    """Connect to lower ranks, accept higher ranks, close the listener, return the transport.

    With ``liveness`` seconds (``RINGCORE_TIMEOUT``), TCP keepalive and
    ``TCP_USER_TIMEOUT`` make the kernel fail a connection whose peer vanished
    without a word (power loss, a cut link) within that time, so the rank
    sees a :class:`~ringcore.errors.PeerFailure` naming the peer.

    Raises:
        CollectiveTimeout: a peer did not connect within ``timeout`` seconds.
        AuthenticationError: a peer we connected to failed the handshake.
    """
    deadline = time.monotonic() + timeout
    links = needed_links(rank, size, channels)
    acceptor = _Acceptor(
        listener, key, session, {link for link in links if link[0] > rank}, handshake_timeout
    )
    acceptor.start()
    conns: dict[Link, _Conn] = {}
    try:
        for peer, channel in (link for link in links if link[0] < rank):
            try:
                sock = connect_retry(addresses[peer], deadline, socket_buffer)
            except OSError as err:
                raise CollectiveTimeout(
                    f"could not connect to rank {peer} at {fmt(addresses[peer])} ({err}); is it running?"
                ) from None
            conns[(peer, channel)] = _Conn(sock, peer, channel, fmt(addresses[peer]))
            _introduce(sock, rank, channel, session, key, handshake_timeout, peer, fmt(addresses[peer]))
        while len(conns) < len(links):
            missing = sorted({p for p, c in links if (p, c) not in conns and p > rank})
            names = [f"rank {p} ({fmt(addresses[p])})" for p in missing]
            peer, channel, sock = acceptor.next(deadline, names)
            if (peer, channel) in conns:
                sock.close()
                continue
            conns[(peer, channel)] = _Conn(sock, peer, channel, fmt(addresses[peer]))
    except BaseException:
        for conn in conns.values():
            conn.sock.close()
        raise
    finally:
        acceptor.stop()
    for conn in conns.values():
        conn.sock.setblocking(False)
        if liveness is not None:
            watch_liveness(conn.sock, liveness)
    return TcpTransport(rank, size, channels, conns)


def watch_liveness(sock: socket.socket, seconds: float) -> None:
    """Keepalive probes after ``seconds / 3`` idle, and a cap on unacknowledged data."""
    idle = max(1, int(seconds / 3))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", max(1, idle // 3)), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(seconds * 1000))


def _introduce(
    sock: socket.socket,
    rank: int,
    channel: int,
    session: int,
    key: bytes,
    timeout: float,
    peer: int,
    conn_name: str,
) -> None:
    """Authenticate an outgoing connection, then say who we are (HELLO)."""
    try:
        auth.client_handshake(sock, key, auth.data_context(session), timeout)
    except AuthenticationError as err:
        raise AuthenticationError(f"rank {peer} failed the data-plane handshake: {err}") from None
    except OSError as err:
        name = conn_name
        raise PeerFailure(
            f"rank {peer} ({name}) went away during the data-plane handshake: {err}", peer, name
        ) from None
    sock.settimeout(None)
    sock.sendall(wire.pack(wire.HELLO, rank, channel, session))


class _Acceptor:
    """Accepts on a thread; each socket is authenticated on its own thread, then queued."""

    def __init__(
        self, listener: socket.socket, key: bytes, session: int, expected: set[Link], timeout: float
    ) -> None:
        self.listener = listener
        self.key = key
        self.session = session
        self.expected = expected
        self.timeout = timeout
        self.ready: queue.Queue[tuple[int, int, socket.socket]] = queue.Queue()
        self.thread = threading.Thread(target=self._accept_loop, name="ringcore-accept", daemon=True)
        self.stopped = False

    def start(self) -> None:
        if self.expected:
            self.thread.start()

    def next(self, deadline: float, missing: list[str]) -> tuple[int, int, socket.socket]:
        try:
            return self.ready.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise CollectiveTimeout(
                f"{', '.join(missing)} did not connect in time (RINGCORE_INIT_TIMEOUT); are they running "
                "with the same RINGCORE_SECRET, and can they reach this host?"
            ) from None

    def stop(self) -> None:
        self.stopped = True
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
        self.listener.close()
        if self.thread.is_alive():
            self.thread.join(timeout=5)

    def _accept_loop(self) -> None:
        while not self.stopped:
            try:
                sock, address = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._admit, args=(sock, address), daemon=True).start()

    def _admit(self, sock: socket.socket, address: Any) -> None:
        try:
            auth.server_handshake(sock, self.key, auth.data_context(self.session), self.timeout)
            sock.settimeout(self.timeout)
            kind, peer, channel, session = wire.unpack(recv_exact(sock, wire.HEADER_BYTES))
            if kind != wire.HELLO or session != self.session or (peer, channel) not in self.expected:
                raise wire.ProtocolError(f"unexpected hello (rank {peer}, channel {channel})")
        except (AuthenticationError, OSError, wire.ProtocolError) as err:
            log.warning("dropped a data connection from %s: %s", fmt(address), str(err))
            sock.close()
            return
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.stopped:
            sock.close()
            return
        self.ready.put((peer, channel, sock))
