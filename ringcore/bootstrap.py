"""From a :class:`~ringcore.rendezvous.WorldSpec` to a connected :class:`~ringcore.comm.Communicator`.

Sequence: rank 0 starts the store; every rank joins it through the HMAC
handshake (a wrong ``RINGCORE_SECRET`` fails here, with a message that says
so; a duplicate rank is an error), opens its data listener on the chosen
interface, publishes ``host:port``, reads everyone else's, checks that all
agree on the world size and on the settings that choose algorithms
(``AGREED_SETTINGS``), then connects the mesh
(``transport.mesh.connect_mesh``). The listener is closed once the mesh is
up, so no data port stays open. A last barrier over the new mesh makes
``init()`` succeed on every rank or on none: a rank that died after its
neighbours connected to it is reported (``PeerFailure``) at init, not at the
first collective.

Without ``RINGCORE_SECRET`` (set per job by ringcore-run) ringcore warns once
and runs the same protocol with an empty key, so a rank configured with a
secret still fails fast against one without.

Meeting through a store the job already has. A framework that made its own
rendezvous (torch.distributed's ``Store``, passed to a process-group backend)
hands it to :func:`bootstrap` as a :class:`Meeting`: rank 0 serves ringcore's
store on a port the kernel picks and publishes ``host:port`` there, so no
second fixed port is needed and every sub-group meets at its own store.
Without ``RINGCORE_SECRET``, rank 0 also publishes a fresh random secret
there: the mesh is then as private as the framework's store is.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import secrets
import socket
import time
from typing import Any, Protocol

import msgpack

from ringcore.comm import Communicator
from ringcore.config import Settings
from ringcore.descriptor import rank_list
from ringcore.errors import CollectiveTimeout, ConfigError, RingcoreError
from ringcore.placement import describe_me, place
from ringcore.plans import oneshot
from ringcore.rendezvous import WorldSpec, listen_address
from ringcore.store import REJECTED_KEY, StoreClient, StoreServer, tls_contexts
from ringcore.transport.mesh import connect_mesh, make_listener
from ringcore.transport.shm import ShmTransport
from ringcore.transport.tcp import TcpTransport

log = logging.getLogger("ringcore")
_warned_no_secret = False


class Meeting(Protocol):
    """A key-value store every rank of the job already reaches (``torch.distributed.Store`` is one)."""

    def set(self, key: str, value: bytes) -> None: ...

    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting until some rank sets it."""
        ...


_MEETING_KEY = "ringcore/store"


def bootstrap(world: WorldSpec, settings: Settings, meeting: Meeting | None = None) -> Communicator:
    """Rendezvous with the other ranks and connect to them.

    Args:
        world: this rank, the world size and where rank 0 serves the store
            (with ``meeting``: the address rank 0 listens on; others read it there).
        settings: the job's settings.
        meeting: a store the ranks already share, through which they find ringcore's
            (see the module docstring); ``None``: ``world`` says where it is.

    Raises:
        ConfigError: ranks disagree on the world size or on a setting of ``AGREED_SETTINGS``,
            or two claim the same rank.
        CollectiveTimeout: a rank did not show up within ``RINGCORE_INIT_TIMEOUT``.
    """
    if world.size == 1:
        return Communicator(0, 1, 0, 1, settings, None)
    server_tls, client_tls = tls_contexts(settings.tls_cert, settings.tls_key, settings.tls_ca)
    if meeting is not None:
        world, key, server = _meet(world, settings, meeting, server_tls)
    else:
        key = _secret(settings)
        server = _start_server(world, key, settings, server_tls) if world.rank == 0 else None
    store = listener = device = None
    try:
        store = _join_store(world, settings, key, client_tls)
        if world.rank == 0:
            store.set("session", secrets.randbits(63))
        if settings.transport in ("ibverbs", "auto"):
            device, records = _open_rdma(store, world, settings)
        host = listen_address(settings, world.addr, world.port)
        listener = make_listener(host, settings.socket_buffer, port_range=settings.port_range)
        store.set(f"peer/{world.rank}", _me(host, listener, world, settings))
        peers = _read_peers(store, world, settings.init_timeout)
        session = int(store.get("session", settings.init_timeout))
        addresses = [(p["host"], int(p["port"])) for p in peers]
        transport = connect_mesh(
            world.rank,
            world.size,
            settings.channels if device is None else 1,  # with RDMA, TCP only carries control frames
            listener,
            addresses,
            session,
            settings.socket_buffer,
            settings.init_timeout,
            key=key,
            handshake_timeout=settings.handshake_timeout,
            liveness=settings.timeout,
        )
        if device is not None:
            from ringcore.transport import ibverbs

            transport = ibverbs.connect(
                world.rank,
                world.size,
                settings.channels,
                device,
                records,
                transport,
                store,
                settings.init_timeout,
            )
            device = None  # the transport owns it now
        elif settings.transport in ("shm", "auto"):
            transport = _open_shm(transport, settings)
    except BaseException as err:
        for closable in (listener, store, device):
            if closable is not None:
                closable.close()
        if server is not None:
            server.close(reason=f"rank 0 gave up on init: {err}")
        raise
    listener.close()
    where = place(world.rank, peers, world.local_rank)
    tcp = isinstance(transport, (TcpTransport, ShmTransport))  # one host's ranks: slice for the cache
    if tcp:
        transport.spin = settings.spin_seconds()
    if isinstance(transport, ShmTransport):
        transport.control.spin = settings.spin_seconds()
        transport.one_reducer = oneshot.one_reducer(settings.one_reducer, where)
    comm = Communicator(
        world.rank,
        world.size,
        where.local_rank,
        where.local_size,
        settings,
        transport,
        store,
        server,
        cache_slices=where.cache_slices(tcp, isinstance(transport, ShmTransport)),
        wide_segments=where.wide_segments(tcp, isinstance(transport, ShmTransport)),
        cross_rank=where.cross_rank,
        cross_size=where.cross_size,
        grid=where.grid,
    )
    try:
        comm.confirm_world()
    except BaseException:
        comm.shutdown()
        raise
    return comm


def _join_store(world: WorldSpec, settings: Settings, key: bytes, tls: Any) -> StoreClient:
    """Connect to the store and join its job, retrying while the job that last used it ends.

    See :mod:`ringcore.store` (one address, many jobs): with one fixed address, a rank that
    re-initialises quickly may reach rank 0's store before rank 0 has started the
    next job in it.
    """
    deadline = time.monotonic() + settings.init_timeout
    while True:
        store = StoreClient(
            world.addr,
            world.port,
            max(0.1, deadline - time.monotonic()),
            key,
            settings.handshake_timeout,
            tls,
        )
        try:
            if store.join(world.rank):
                return store
        except BaseException:
            store.close()
            raise
        store.close()
        if time.monotonic() + _REJOIN_DELAY > deadline:
            raise CollectiveTimeout(
                f"rank {world.rank}: the rendezvous store at {world.addr}:{world.port} still served the "
                f"previous job after {settings.init_timeout:g} s (RINGCORE_INIT_TIMEOUT); did rank 0 "
                "call ringcore.init() again?"
            )
        time.sleep(_REJOIN_DELAY)


_REJOIN_DELAY = 0.02


def _meet(
    world: WorldSpec, settings: Settings, meeting: Meeting, tls: Any
) -> tuple[WorldSpec, bytes, StoreServer | None]:
    """Rank 0 serves the store on a free port and publishes it in ``meeting``; the others read it."""
    if world.rank == 0:
        key = settings.secret if settings.secret is not None else secrets.token_hex(32).encode()
        server = _start_server(dataclasses.replace(world, port=0), key, settings, tls)
        shared = key if settings.secret is None else b""
        meeting.set(_MEETING_KEY, msgpack.packb([world.addr, server.port, shared]))
        return dataclasses.replace(world, port=server.port), key, server
    addr, port, shared = msgpack.unpackb(meeting.get(_MEETING_KEY))
    key = settings.secret if settings.secret is not None else bytes(shared)
    return dataclasses.replace(world, addr=addr, port=int(port)), key, None


def _rejected(store: StoreClient) -> str:
    """What the store noted of the last connection that failed authentication, for a timeout's message."""
    try:
        note = store.mget([REJECTED_KEY])[0]
    except RingcoreError:
        return ""
    if note is None:
        return ""
    return (
        f" Meanwhile the store rejected a connection from {note}: a rank with a different "
        "RINGCORE_SECRET (or TLS settings) may be trying to join"
    )


def _open_rdma(store: StoreClient, world: WorldSpec, settings: Settings) -> tuple[Any, list[dict[str, Any]]]:
    """Open this rank's verbs device and learn every rank's; ``(None, [])`` means use TCP.

    Every rank publishes its queue pairs, or why it cannot use RDMA. With
    ``RINGCORE_TRANSPORT=auto`` one rank without RDMA makes every rank use TCP
    (and shared memory between ranks on one host, see ``_open_shm``);
    with ``ibverbs`` it is an error on every rank, naming that rank.
    """
    from ringcore.transport import ibverbs

    device, record = ibverbs.open_device(settings, world.rank, world.size, settings.channels)
    store.set(f"ib/{world.rank}", record)
    records = []
    for rank in range(world.size):
        try:
            records.append(store.get(f"ib/{rank}", settings.init_timeout))
        except CollectiveTimeout:
            if device is not None:
                device.close()
            # under auto (the default) this is the first wait for the other ranks: say it as such
            what = (
                "publish its RDMA queue pairs (or that it has none)"
                if settings.transport == "ibverbs"
                else f"join the rendezvous at {world.addr}:{world.port}"
            )
            raise CollectiveTimeout(
                f"rank {world.rank}: rank {rank} did not {what} within {settings.init_timeout:g} s "
                "(RINGCORE_INIT_TIMEOUT); is it running, with the same world size, RINGCORE_SECRET and "
                f"RINGCORE_TRANSPORT?{_rejected(store)}"
            ) from None
    failed = {rank: r["error"] for rank, r in enumerate(records) if "error" in r}
    if not failed:
        log.info("rank %d: RDMA transport on %s (GID %s)", world.rank, record["device"], record["gid"])
        return device, records
    if device is not None:
        device.close()
    culprit, why = min(failed.items())
    if settings.transport == "ibverbs":
        raise ConfigError(f"RINGCORE_TRANSPORT=ibverbs, but rank {culprit} cannot use RDMA: {why}")
    log.info(
        "RINGCORE_TRANSPORT=auto: using TCP (shared memory on one host) because rank %d cannot use RDMA: %s",
        culprit,
        why,
    )
    return None, []


def _open_shm(control: TcpTransport, settings: Settings) -> ShmTransport | TcpTransport:
    """Shared memory to the ranks on this host, the TCP mesh to the rest.

    ``RINGCORE_TRANSPORT=shm`` always wraps the mesh; ``auto`` (RDMA was not
    possible) hands back the plain TCP transport when no peer shares this
    rank's host, so ranks alone on their host pay nothing for the wrapper.
    """
    from ringcore.transport import shm_setup

    try:
        transport = shm_setup.connect(
            control,
            settings.shm_bytes,
            settings.init_timeout,
            settings.shm_single_copy_bytes,
            settings.shm_cache_bytes,
            settings.kernel_copies,
        )
    except BaseException:
        control.close()
        raise
    if settings.transport == "auto" and not transport.links:
        return control  # nothing of shared memory is held without links
    return transport


def _secret(settings: Settings) -> bytes:
    global _warned_no_secret
    if settings.secret is not None:
        return settings.secret
    if not _warned_no_secret:
        log.warning(
            "RINGCORE_SECRET is not set: connections are authenticated with an empty key, so any "
            "local process can join this job; set the same secret on every rank "
            "(ringcore-run does this for you)"
        )
        _warned_no_secret = True
    return b""


def _start_server(world: WorldSpec, key: bytes, settings: Settings, tls: Any) -> StoreServer:
    """Rank 0's store, retrying a port in use for ``_BIND_PATIENCE`` s.

    Between two jobs at one fixed address the port is free for a moment, and
    launchers often pick ports in the kernel's ephemeral range, where a
    connection being made on this host (a peer's connect, which the store
    refuses while down) may take it as its local port for as long as it lives.
    """
    deadline = time.monotonic() + min(_BIND_PATIENCE, settings.init_timeout)
    while True:
        try:
            return StoreServer(world.addr, world.port, key, settings.handshake_timeout, tls)
        except OSError as err:
            if err.errno == errno.EADDRINUSE and world.port and time.monotonic() < deadline:
                time.sleep(_REJOIN_DELAY)
                continue
            raise ConfigError(
                f"rank 0 could not serve the rendezvous store on {world.addr}:{world.port} ({err.strerror}); "
                "is another job using that port? Set RINGCORE_PORT (or MASTER_PORT) to a free one"
            ) from None


_BIND_PATIENCE = 5.0


# Settings that choose a collective's algorithm or slices: ranks that differ on one would run
# different schedules, whose frames need not clash, and wait for the timeout. Checked at init.
AGREED_SETTINGS = {
    "RINGCORE_SMALL_BYTES": "small_bytes",
    "RINGCORE_HALVING_BYTES": "halving_bytes",
    "RINGCORE_SLICE_BYTES": "slice_bytes",
    "RINGCORE_HIERARCHICAL": "hierarchical",
    "RINGCORE_GPU_STAGING_BYTES": "gpu_staging_bytes",
    "RINGCORE_ATOMIC": "atomic",  # allreduces on one host go direct only without it
    # before RINGCORE_DIRECT_BYTES, whose auto limit it moves: a difference here is named as itself
    "RINGCORE_KERNEL_COPIES": "kernel_copies",
    "RINGCORE_DIRECT_BYTES": "direct_bytes",
    "RINGCORE_ONE_REDUCER": "one_reducer",
}


def _agreed_value(settings: Settings, field: str, size: int) -> Any:
    """What a rank says about ``field``: its value, or for the direct route's limit what it means in a
    world of ``size``: where the direct route starts and where the mailboxes' shots stop, for every
    verdict on the kernel's copies set-up may reach (auto and an explicit 1M agree from three ranks
    with the copies pinned fast).

    Pinned ``slow`` may still turn out fast (where ranks may not copy from each other), so only
    ``fast`` leaves one verdict to compare.
    """
    if field != "direct_bytes":
        return getattr(settings, field)
    verdicts = (False,) if settings.kernel_copies == "fast" else (False, True)
    said = [
        f"direct from {settings.direct_from(size, slow)}, shots below {settings.mailboxes_below(size, slow)}"
        + (" if the kernel's copies prove slow" if slow else "")
        for slow in verdicts
    ]
    return "; ".join(said)


def _me(host: str, listener: socket.socket, world: WorldSpec, settings: Settings) -> dict[str, Any]:
    return {
        "host": host,
        "port": listener.getsockname()[1],
        "size": world.size,
        "pid": os.getpid(),
        "settings": {
            name: _agreed_value(settings, field, world.size) for name, field in AGREED_SETTINGS.items()
        },
        **describe_me(world.local_size, world.local_rank),
    }


def _read_peers(store: StoreClient, world: WorldSpec, timeout: float) -> list[dict[str, Any]]:
    peers = []
    for rank in range(world.size):
        try:
            peers.append(store.get(f"peer/{rank}", timeout))
        except CollectiveTimeout:
            raise CollectiveTimeout(
                f"rank {world.rank}: rank {rank} did not join the rendezvous at {world.addr}:{world.port} "
                f"within {timeout:g} s (RINGCORE_INIT_TIMEOUT); is it running, with the same world size and "
                f"RINGCORE_SECRET?{_rejected(store)}"
            ) from None
    sizes: dict[int, list[int]] = {}
    for rank, peer in enumerate(peers):
        sizes.setdefault(int(peer["size"]), []).append(rank)
    if len(sizes) > 1:
        listed = ", ".join(f"{rank_list(ranks)} say {size}" for size, ranks in sizes.items())
        raise ConfigError(f"ranks disagree on the world size: {listed}")
    for name in AGREED_SETTINGS:
        values: dict[Any, list[int]] = {}
        for rank, peer in enumerate(peers):
            values.setdefault(peer["settings"][name], []).append(rank)
        if len(values) > 1:
            listed = ", ".join(
                f"{rank_list(ranks)} {'say' if len(ranks) > 1 else 'says'} {'auto' if value is None else value}"
                for value, ranks in values.items()
            )
            raise ConfigError(
                f"ranks disagree on {name}: {listed}; it chooses how collectives run, "
                "so set the same value on every rank (or leave it unset everywhere)"
            )
    return peers
