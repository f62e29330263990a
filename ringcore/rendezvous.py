"""Rendezvous: the key-value store ranks meet through, and launcher discovery.

Store. Rank 0 serves a small TCP key-value store at the rendezvous address;
every rank (rank 0 included) talks to it through a :class:`StoreClient`.
Messages are msgpack arrays behind a 4-byte length, bounded in size:
``["set", key, value]``, ``["get", key, timeout]`` (waits for the key),
``["add", key, delta]`` (an atomic counter). Ranks publish their listening
addresses there, agree on the world size and the job's session id, and, when
a collective fails because ranks disagree, publish what they were asked to
do so every rank can name the difference.

Discovery. ``discover()`` finds rank, size and the rendezvous address from,
in order: explicit arguments, ``RINGCORE_*`` (ringcore-run), torchrun's
``RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT``, OpenMPI's ``OMPI_COMM_WORLD_*``,
Slurm's ``SLURM_*``. Under mpirun or srun on one host with no address given,
the store is on loopback at a port derived from the job id. With
``MASTER_PORT`` (torchrun), the store uses ``MASTER_PORT + 1``: torch's own
store already listens on ``MASTER_PORT``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Mapping
from typing import Any

import msgpack

from ringcore.config import Settings
from ringcore.errors import CollectiveTimeout, ConfigError, RingcoreError

log = logging.getLogger("ringcore")

_LENGTH = struct.Struct("<I")
MAX_MESSAGE = 16 * 1024 * 1024
_PORT_BASE, _PORT_SPAN = 29500, 20000


# --------------------------------------------------------------------------- discovery


@dataclasses.dataclass(frozen=True)
class WorldSpec:
    """Who this process is and where the ranks meet."""

    rank: int
    size: int
    local_rank: int | None
    local_size: int | None
    addr: str
    port: int
    source: str


def discover(
    settings: Settings,
    env: Mapping[str, str] | None = None,
    rank: int | None = None,
    size: int | None = None,
    addr: str | None = None,
    port: int | None = None,
) -> WorldSpec:
    """Find rank, size and rendezvous address; explicit arguments win.

    Raises:
        ConfigError: incomplete or contradictory settings, or a multi-host job
            with no rendezvous address.
    """
    env = os.environ if env is None else env
    found = _from_launcher(settings, env)
    source = found.pop("source")
    rank = found.get("rank") if rank is None else rank
    size = found.get("size") if size is None else size
    if rank is None and size is None:
        rank, size, source = 0, 1, "default (no launcher found)"
    if rank is None or size is None:
        raise ConfigError(
            f"{source}: rank is {rank}, size is {size}; set both (e.g. RINGCORE_RANK and RINGCORE_SIZE)"
        )
    if not 0 <= rank < size:
        raise ConfigError(f"{source}: rank {rank} is outside a world of size {size}")
    addr = addr or found.get("addr")
    port = port or found.get("port")
    if size > 1 and addr is None:
        if not found.get("single_host"):
            raise ConfigError(
                f"{source}: no rendezvous address for a job across hosts; set RINGCORE_ADDR "
                "(or MASTER_ADDR) to rank 0's address, and RINGCORE_PORT to a free port"
            )
        addr = "127.0.0.1"
    if size > 1 and port is None:
        port = _derived_port(found.get("job_id"), source)
    return WorldSpec(
        rank,
        size,
        found.get("local_rank"),
        found.get("local_size"),
        addr or "127.0.0.1",
        int(port or 0),
        source,
    )


def _from_launcher(settings: Settings, env: Mapping[str, str]) -> dict[str, Any]:
    if settings.rank is not None or settings.size is not None:
        return {
            "source": "RINGCORE_* variables",
            "rank": settings.rank,
            "size": settings.size,
            "local_rank": settings.local_rank,
            "local_size": settings.local_size,
            "addr": settings.addr,
            "port": settings.port,
            "single_host": False,
        }
    master_port = _int(env, "MASTER_PORT")
    # torch's own TCPStore (torchrun's agent, init_process_group) owns MASTER_PORT: take the next one.
    shared = {
        "addr": settings.addr or env.get("MASTER_ADDR") or None,
        "port": settings.port or (master_port + 1 if master_port else None),
    }
    if "RANK" in env and "WORLD_SIZE" in env:
        return {
            "source": "torchrun variables",
            "rank": _int(env, "RANK"),
            "size": _int(env, "WORLD_SIZE"),
            "local_rank": _int(env, "LOCAL_RANK"),
            "local_size": _int(env, "LOCAL_WORLD_SIZE"),
            "single_host": False,
            **shared,
        }
    if "OMPI_COMM_WORLD_RANK" in env:
        size = _int(env, "OMPI_COMM_WORLD_SIZE")
        local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE")
        job = env.get("OMPI_MCA_ess_base_jobid") or env.get("PMIX_NAMESPACE") or f"ppid-{os.getppid()}"
        return {
            "source": "OpenMPI variables",
            "rank": _int(env, "OMPI_COMM_WORLD_RANK"),
            "size": size,
            "local_rank": _int(env, "OMPI_COMM_WORLD_LOCAL_RANK"),
            "local_size": local_size,
            "single_host": local_size == size,
            "job_id": job,
            **shared,
        }
    if "SLURM_PROCID" in env:
        nodes = _int(env, "SLURM_JOB_NUM_NODES") or _int(env, "SLURM_NNODES")
        job = f"{env.get('SLURM_JOB_ID', '')}.{env.get('SLURM_STEP_ID', '')}"
        return {
            "source": "Slurm variables",
            "rank": _int(env, "SLURM_PROCID"),
            "size": _int(env, "SLURM_NTASKS"),
            "local_rank": _int(env, "SLURM_LOCALID"),
            "local_size": None,
            "single_host": nodes == 1,
            "job_id": job,
            **shared,
        }
    return {"source": "environment", **shared}


def _int(env: Mapping[str, str], name: str) -> int | None:
    text = env.get(name, "").strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r} is not an integer") from None


def _derived_port(job_id: str | None, source: str) -> int:
    if not job_id:
        raise ConfigError(f"{source}: no rendezvous port; set RINGCORE_PORT (or MASTER_PORT)")
    digest = hashlib.sha256(job_id.encode()).digest()
    return _PORT_BASE + int.from_bytes(digest[:4], "little") % _PORT_SPAN


def listen_address(settings: Settings, store_addr: str, store_port: int) -> str:
    """The local address to listen on: ``RINGCORE_IFNAME``'s, else the one routing to the store."""
    if settings.ifname:
        return interface_address(settings.ifname)
    family = socket.AF_INET6 if ":" in store_addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((store_addr, store_port or 9))  # UDP connect sends nothing
            return str(probe.getsockname()[0])
        except OSError as err:
            raise ConfigError(f"no route to the rendezvous address {store_addr}: {err}") from None


def interface_address(ifname: str) -> str:
    """IPv4 address of a network interface (like ``NCCL_SOCKET_IFNAME``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            packed = fcntl.ioctl(
                probe.fileno(), 0x8915, struct.pack("256s", ifname.encode()[:15])
            )  # SIOCGIFADDR
        except OSError:
            names = ", ".join(name for _, name in socket.if_nameindex())
            raise ConfigError(
                f"RINGCORE_IFNAME={ifname!r} has no IPv4 address; interfaces: {names}"
            ) from None
    return socket.inet_ntoa(packed[20:24])


# --------------------------------------------------------------------------- framing


def send_message(sock: socket.socket, message: Any) -> None:
    payload = msgpack.packb(message, use_bin_type=True)
    sock.sendall(_LENGTH.pack(len(payload)) + payload)


def recv_message(sock: socket.socket) -> Any:
    (length,) = _LENGTH.unpack(_recv_exact(sock, _LENGTH.size))
    if length > MAX_MESSAGE:
        raise RingcoreError(f"store message of {length} bytes exceeds {MAX_MESSAGE}")
    return msgpack.unpackb(_recv_exact(sock, length), raw=False)


def _recv_exact(sock: socket.socket, nbytes: int) -> bytes:
    data = bytearray()
    while len(data) < nbytes:
        chunk = sock.recv(nbytes - len(data))
        if not chunk:
            raise ConnectionError("store connection closed")
        data += chunk
    return bytes(data)


# --------------------------------------------------------------------------- server


class StoreServer:
    """The key-value store, served by rank 0 on a background thread per client."""

    def __init__(self, host: str, port: int) -> None:
        self.data: dict[str, Any] = {}
        self.cond = threading.Condition()
        self.listener = socket.create_server((host, port), family=_family(host), reuse_port=False)
        self.port = self.listener.getsockname()[1]
        self.clients: list[socket.socket] = []
        self.closed = False
        self.thread = threading.Thread(target=self._accept_loop, name="ringcore-store", daemon=True)
        self.thread.start()

    def _accept_loop(self) -> None:
        while not self.closed:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            self.clients.append(sock)
            threading.Thread(
                target=self._serve, args=(sock,), name="ringcore-store-client", daemon=True
            ).start()

    def _serve(self, sock: socket.socket) -> None:
        try:
            while True:
                send_message(sock, self._handle(recv_message(sock)))
        except (OSError, RingcoreError, ValueError, msgpack.UnpackException):
            sock.close()

    def _handle(self, request: Any) -> list[Any]:
        try:
            return self._dispatch(request)
        except (TypeError, ValueError, OverflowError) as err:
            return ["error", f"bad arguments: {err}"]

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
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self.closed:
                    return ["timeout", None]
                self.cond.wait(min(remaining, 1.0))
            return ["ok", self.data[key]]

    def close(self) -> None:
        self.closed = True
        with self.cond:
            self.cond.notify_all()
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
        self.listener.close()
        for sock in self.clients:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        self.thread.join(timeout=5)


# --------------------------------------------------------------------------- client


class StoreClient:
    """A connection to the store; thread-safe (one request at a time)."""

    def __init__(self, host: str, port: int, timeout: float) -> None:
        self.address = (host, port)
        self.lock = threading.Lock()
        self.sock = _connect_with_retry(host, port, timeout)

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

    def add(self, key: str, delta: int) -> int:
        return int(self._call(["add", key, delta], 30.0)[1])

    def _call(self, request: list[Any], timeout: float) -> list[Any]:
        with self.lock:
            self.sock.settimeout(timeout)
            try:
                send_message(self.sock, request)
                reply = recv_message(self.sock)
            except (OSError, ConnectionError) as err:
                host, port = self.address
                raise RingcoreError(f"lost the rendezvous store at {host}:{port} (rank 0): {err}") from None
        if reply[0] == "error":
            raise RingcoreError(f"rendezvous store refused {request[0]}: {reply[1]}")
        return reply

    def close(self) -> None:
        self.sock.close()


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _connect_with_retry(host: str, port: int, timeout: float) -> socket.socket:
    deadline = time.monotonic() + timeout
    delay = 0.01
    while True:
        try:
            sock = socket.create_connection(
                (host, port), timeout=max(0.1, min(5.0, deadline - time.monotonic()))
            )
        except OSError as err:
            if time.monotonic() + delay > deadline:
                raise CollectiveTimeout(
                    f"could not reach the rendezvous store at {host}:{port} within {timeout:g} s ({err}); "
                    "is rank 0 running, and do RINGCORE_ADDR/RINGCORE_PORT point at it?"
                ) from None
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
            continue
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock
