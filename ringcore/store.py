"""The rendezvous key-value store: served by rank 0, used by every rank.

Messages are msgpack arrays behind a 4-byte length, bounded in size:
``["set", key, value]``, ``["get", key, timeout]`` (waits for the key),
``["add", key, delta]`` (an atomic counter). Ranks publish their listening
addresses there, agree on the world size and the job's session id, and, when
a collective fails because ranks disagree, publish what they were asked to
do so every rank can name the difference.

Every connection first passes the HMAC handshake of :mod:`ringcore.auth`
(inside TLS when ``RINGCORE_TLS_CERT`` is set); a client that fails it, or is
too slow, is dropped and logged (and noted in the store under
``ringcore/rejected``, so a rank that times out can say a connection failed
authentication), and the store carries on. The server runs one thread per
client; pending handshakes are capped so a flood of strangers cannot pile up
threads.

One address, many jobs. ``shutdown()`` then ``init()`` at the same address
(every launcher gives a fixed ``MASTER_PORT``) must not let a rank that
re-initialises quickly meet the store of the job that is ending. Each rank
*joins* the store (``["join", rank, pid]``) and *leaves* it at shutdown (or
its joining connection closes: it died). A rank that joins again while the
store still serves the job it left, or while the store is retiring, is told
to retry, and reconnects until its init deadline. Rank 0's shutdown
*retires* its server: it waits until every member has left (at most
``RETIRE_GRACE`` s), then closes, so its next ``init()`` binds the address
afresh and nothing of one job leaks into the next.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import ssl
import struct
import threading
import time
from typing import Any

import msgpack

from ringcore import auth
from ringcore.errors import AuthenticationError, CollectiveTimeout, ConfigError, RingcoreError
from ringcore.sockets import connect_retry, recv_exact

log = logging.getLogger("ringcore")

_LENGTH = struct.Struct("<I")
MAX_MESSAGE = 1024 * 1024
MAX_PENDING_HANDSHAKES = 64
RETIRE_GRACE = 10.0  # seconds a retiring store waits for members that have not left
REJECTED_KEY = "ringcore/rejected"
_LEFT = "left"


def send_message(sock: socket.socket, message: Any) -> None:
    payload = msgpack.packb(message, use_bin_type=True)
    sock.sendall(_LENGTH.pack(len(payload)) + payload)


def recv_message(sock: socket.socket) -> Any:
    (length,) = _LENGTH.unpack(recv_exact(sock, _LENGTH.size))
    if length > MAX_MESSAGE:
        raise RingcoreError(f"store message of {length} bytes exceeds {MAX_MESSAGE}")
    return msgpack.unpackb(recv_exact(sock, length), raw=False)


# --------------------------------------------------------------------------- server


class StoreServer:
    """The key-value store, served by rank 0 on a background thread per client.

    Args:
        host, port: where to listen (never all interfaces unless ``host`` says so).
        key: the job's secret for the HMAC handshake.
        handshake_timeout: seconds a client has to complete it.
        tls: a server-side SSL context, or ``None`` for plain TCP.
    """

    def __init__(
        self,
        host: str,
        port: int,
        key: bytes = b"",
        handshake_timeout: float = 10.0,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.key = key
        self.handshake_timeout = handshake_timeout
        self.tls = tls
        self.pending = threading.BoundedSemaphore(MAX_PENDING_HANDSHAKES)
        self.data: dict[str, Any] = {}
        self.cond = threading.Condition()
        self.members: dict[int, Any] = {}  # rank -> its pid, or _LEFT once it has left
        self.retiring = False
        self.listener = socket.create_server((host, port), family=_family(host), reuse_port=False)
        self.host, self.port = host, self.listener.getsockname()[1]
        self.clients: set[socket.socket] = set()  # live connections, so close() can end them
        self.clients_lock = threading.Lock()
        self.closed = False
        self.failure: str | None = None
        self.threads: list[threading.Thread] = []
        self.thread = threading.Thread(target=self._accept_loop, name="ringcore-store", daemon=True)
        self.thread.start()

    def _accept_loop(self) -> None:
        while not self.closed:
            try:
                sock, address = self.listener.accept()
            except OSError:
                return
            if not self.pending.acquire(blocking=False):
                log.warning("store: too many pending handshakes; dropped %s:%s", *address[:2])
                sock.close()
                continue
            self._track(sock, add=True)
            thread = threading.Thread(
                target=self._serve, args=(sock, address), name="ringcore-store-client", daemon=True
            )
            self.threads = [t for t in self.threads if t.is_alive()] + [thread]
            thread.start()

    def _track(self, sock: socket.socket, add: bool) -> None:
        with self.clients_lock:
            if add:
                self.clients.add(sock)
            else:
                self.clients.discard(sock)

    def _admit(self, raw: socket.socket, address: Any) -> socket.socket | None:
        """TLS (if configured) and the HMAC handshake, within one deadline; ``None`` on failure."""
        deadline = time.monotonic() + self.handshake_timeout
        sock = raw
        try:
            if self.tls is not None:
                sock.settimeout(self.handshake_timeout)
                sock = self.tls.wrap_socket(sock, server_side=True)
                self._track(raw, add=False)
                self._track(sock, add=True)
            auth.server_handshake(sock, self.key, auth.STORE_CONTEXT, max(0.0, deadline - time.monotonic()))
        except (AuthenticationError, OSError) as err:
            if not self.closed:  # close() ends handshakes in progress: nothing was rejected
                log.warning("store: rejected a connection from %s:%s: %s", address[0], address[1], str(err))
                if isinstance(err, AuthenticationError):
                    with self.cond:
                        self.data[REJECTED_KEY] = f"{address[0]}:{address[1]} ({err})"
            self._track(sock, add=False)
            self._track(raw, add=False)
            sock.close()
            return None
        finally:
            self.pending.release()
        sock.settimeout(None)
        return sock

    def _serve(self, raw: socket.socket, address: Any) -> None:
        sock = self._admit(raw, address)
        if sock is None:
            return
        member: list[Any] = []  # (rank, pid) once this connection has joined
        try:
            while True:
                send_message(sock, self._handle(recv_message(sock), member))
        except (OSError, RingcoreError, ValueError, msgpack.UnpackException):
            self._track(sock, add=False)
            sock.close()
        finally:
            if member:  # a member whose connection closed has left (it shut down, or died)
                self._leave(*member)

    def _handle(self, request: Any, member: list[Any]) -> list[Any]:
        try:
            if isinstance(request, list) and len(request) >= 2 and request[0] in ("join", "leave"):
                return self._membership(request, member)
            return self._dispatch(request)
        except (TypeError, ValueError, OverflowError) as err:
            return ["error", f"bad arguments: {err}"]

    def _membership(self, request: list[Any], member: list[Any]) -> list[Any]:
        """``["join", rank, pid]`` and ``["leave", rank]`` (see the module docstring)."""
        rank = int(request[1])
        if request[0] == "leave":
            if member and member[0] == rank:
                self._leave(*member)
            return ["ok", None]
        pid = int(request[2])
        with self.cond:
            holder = self.members.get(rank)
            if self.retiring or holder == _LEFT:
                return ["retry", "the job that last used this store is still ending"]
            if holder is not None:
                return ["error", f"two processes claim rank {rank} (pids {holder} and {pid})"]
            self.members[rank] = pid
        member[:] = [rank, pid]
        return ["ok", None]

    def _leave(self, rank: int, pid: int) -> None:
        with self.cond:
            if self.members.get(rank) == pid:
                self.members[rank] = _LEFT
                self.cond.notify_all()

    def retire(self, grace: float = RETIRE_GRACE) -> None:
        """Rank 0 shuts down: refuse new members, wait until every member has left (``grace`` s at most), close."""
        deadline = time.monotonic() + grace
        with self.cond:
            self.retiring = True
            while any(state != _LEFT for state in self.members.values()) and not self.closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    log.debug("store: closing with ranks that did not leave: %s", self.members)
                    break
                self.cond.wait(remaining)
        self.close()

    def _dispatch(self, request: Any) -> list[Any]:
        if not isinstance(request, list) or not request or not isinstance(request[0], str):
            return ["error", "malformed request"]
        op, args = request[0], request[1:]
        if op == "set" and len(args) == 2:
            with self.cond:
                self.data[str(args[0])] = args[1]
                self.cond.notify_all()
            return ["ok", None]
        if op == "get" and len(args) == 2:
            return self._get(str(args[0]), float(args[1]))
        if op == "mget" and len(args) == 1 and isinstance(args[0], list) and len(args[0]) <= 4096:
            with self.cond:
                return ["ok", [self.data.get(str(key)) for key in args[0]]]
        if op == "add" and len(args) == 2:
            with self.cond:
                value = int(self.data.get(str(args[0]), 0)) + int(args[1])
                self.data[str(args[0])] = value
                self.cond.notify_all()
            return ["ok", value]
        return ["error", f"unknown request {op!r}"]

    def _get(self, key: str, timeout: float) -> list[Any]:
        deadline = time.monotonic() + timeout
        with self.cond:
            while key not in self.data:
                if self.failure is not None:
                    return ["error", self.failure]
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self.closed:
                    return ["timeout", None]
                self.cond.wait(min(remaining, 1.0))
            return ["ok", self.data[key]]

    def close(self, reason: str | None = None) -> None:
        """Stop serving; clients waiting for a key get ``reason`` (why rank 0 gave up) if given."""
        if reason is not None:
            with self.cond:
                self.failure = reason
                self.cond.notify_all()
            time.sleep(0.2)  # let waiting clients read the reason before their connections go
        self.closed = True
        with self.cond:
            self.cond.notify_all()
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
        self.listener.close()
        with self.clients_lock:
            clients, self.clients = list(self.clients), set()
        for sock in clients:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        self.thread.join(timeout=5)
        deadline = time.monotonic() + 5
        for thread in self.threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))


# --------------------------------------------------------------------------- client


class StoreLost(RingcoreError):
    """The connection to the store broke (rank 0 exited, or its store closed)."""


class StoreClient:
    """A connection to the store; thread-safe (one request at a time)."""

    def __init__(
        self,
        host: str,
        port: int,
        timeout: float,
        key: bytes = b"",
        handshake_timeout: float = 10.0,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.address = (host, port)
        self.lock = threading.Lock()
        self._credentials = (timeout, key, handshake_timeout, tls)
        deadline = time.monotonic() + timeout
        while True:
            sock = _connect_with_retry(host, port, max(0.0, deadline - time.monotonic()))
            try:
                if tls is not None:
                    sock.settimeout(handshake_timeout)
                    sock = tls.wrap_socket(sock, server_hostname=host)
                auth.client_handshake(sock, key, auth.STORE_CONTEXT, handshake_timeout)
                break
            except (AuthenticationError, ssl.SSLError) as err:
                sock.close()
                raise AuthenticationError(
                    f"authentication failed with the rendezvous store at {host}:{port} (rank 0): {err}; "
                    "every rank needs the same RINGCORE_SECRET (ringcore-run sets one per job) and the "
                    "same RINGCORE_TLS_* settings"
                ) from None
            except OSError as err:  # torn, not refused: e.g. a store closing as the last job ends
                sock.close()
                if time.monotonic() + 0.05 > deadline:
                    raise AuthenticationError(
                        f"the rendezvous store at {host}:{port} (rank 0) closed every connection during the "
                        f"handshake for {timeout:g} s ({err}); every rank needs the same RINGCORE_SECRET "
                        "and the same RINGCORE_TLS_* settings"
                    ) from None
                time.sleep(0.05)
        self.sock = sock

    def set(self, key: str, value: Any) -> None:
        self._call(["set", key, value], 30.0)

    def get(self, key: str, timeout: float) -> Any:
        """The value of ``key``, waiting up to ``timeout`` s for it to be set."""
        status, value = self._call(["get", key, timeout], timeout + 30.0)
        if status == "timeout":
            raise CollectiveTimeout(
                f"timed out after {timeout:g} s waiting for {key!r} in the rendezvous store"
            )
        return value

    def mget(self, keys: list[str]) -> list[Any]:
        """The values of ``keys`` now (``None`` where unset), without waiting."""
        return list(self._call(["mget", keys], 30.0)[1])

    def connect_again(self) -> StoreClient:
        """A second connection to the same store, with the same credentials."""
        return StoreClient(self.address[0], self.address[1], *self._credentials)

    def add(self, key: str, delta: int) -> int:
        return int(self._call(["add", key, delta], 30.0)[1])

    def join(self, rank: int) -> bool:
        """Become ``rank`` of the store's job; False: the last job is still ending, connect again later.

        Raises:
            ConfigError: another live process holds ``rank``.
        """
        try:
            status, _ = self._call(["join", rank, os.getpid()], 30.0)
        except StoreLost:  # the store closed as the last job ended: the next one comes up soon
            return False
        except RingcoreError as err:
            if "claim" in str(err):
                raise ConfigError(f"{err}; check RINGCORE_RANK / the launcher") from None
            raise
        return status == "ok"

    def leave(self, rank: int) -> None:
        """Tell the store this rank is done with its job (best effort: a store already gone is fine)."""
        with contextlib.suppress(RingcoreError):
            self._call(["leave", rank], 5.0)

    def _call(self, request: list[Any], timeout: float) -> list[Any]:
        with self.lock:
            self.sock.settimeout(timeout)
            try:
                send_message(self.sock, request)
                reply = recv_message(self.sock)
            except (OSError, ConnectionError) as err:
                host, port = self.address
                raise StoreLost(f"lost the rendezvous store at {host}:{port} (rank 0): {err}") from None
        if reply[0] == "error":
            raise RingcoreError(f"the rendezvous store refused {request[0]} {request[1]!r}: {reply[1]}")
        return reply

    def close(self) -> None:
        self.sock.close()


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _connect_with_retry(host: str, port: int, timeout: float) -> socket.socket:
    try:
        return connect_retry((host, port), time.monotonic() + timeout)
    except OSError as err:
        raise CollectiveTimeout(
            f"could not reach the rendezvous store at {host}:{port} within {timeout:g} s ({err}); "
            "is rank 0 running, and do RINGCORE_ADDR/RINGCORE_PORT point at it?"
        ) from None


def tls_contexts(
    cert: str | None, key: str | None, ca: str | None
) -> tuple[ssl.SSLContext | None, ssl.SSLContext | None]:
    """Server and client SSL contexts for the store, or ``(None, None)`` without a certificate.

    The server presents ``cert``/``key``; with ``ca`` it also requires client
    certificates signed by it. Clients verify the server against ``ca`` (host
    names are not checked: ranks meet by address) and present ``cert``/``key``.
    """
    if cert is None:
        if key is not None or ca is not None:
            raise ConfigError("RINGCORE_TLS_KEY / RINGCORE_TLS_CA need RINGCORE_TLS_CERT too")
        return None, None
    try:
        server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        server.load_cert_chain(cert, key)
        client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        client.check_hostname = False
        client.load_cert_chain(cert, key)
        if ca is not None:
            server.verify_mode = ssl.CERT_REQUIRED
            server.load_verify_locations(ca)
            client.load_verify_locations(ca)
        else:
            client.verify_mode = ssl.CERT_NONE
    except (OSError, ssl.SSLError) as err:
        raise ConfigError(f"cannot load the TLS certificate, key or CA ({err})") from None
    return server, client
