"""What a rank is connected to: its store, the sockets it listens on, its data links, its transport's registrations."""

from __future__ import annotations

from typing import Any

import numpy as np


def store_address(comm: Any) -> tuple[str, int]:
    """``(host, port)`` of the rendezvous store this rank is connected to."""
    return tuple(comm.store.address)


def listening_report(comm: Any) -> dict[str, Any]:
    """Where this rank listens and the local/remote address of each data connection.

    ``store`` is rank 0's store listener (``None`` elsewhere); ``links`` lists
    ``(peer, channel, local address, remote address)`` for every mesh connection.
    """
    import os

    server = comm.server
    links = [
        (peer, channel, conn.sock.getsockname()[:2], conn.sock.getpeername()[:2])
        for (peer, channel), conn in comm.transport.conns.items()
    ]
    return {
        "pid": os.getpid(),
        "store": server.listener.getsockname()[:2] if server is not None else None,
        "links": links,
    }


def transport_report(comm: Any) -> dict[str, Any]:
    """Which transport this rank runs on, and its registration count so far."""
    transport = comm.transport
    cache = getattr(transport, "cache", None)
    return {"transport": type(transport).__name__, "registrations": getattr(cache, "registrations", None)}


def repeated_allreduce(comm: Any, count: int, rounds: int) -> dict[str, Any]:
    """Allreduce the same array ``rounds`` times; report registrations before and after the repeats."""
    buf = np.full(count, comm.rank + 1, np.float32)
    comm.allreduce(buf)
    first = comm.transport.cache.registrations
    for _ in range(rounds):
        comm.allreduce(buf)
    expected = (comm.size * (comm.size + 1) // 2) * comm.size**rounds
    return {"first": first, "after": comm.transport.cache.registrations, "ok": bool((buf == expected).all())}
