"""Module-level functions over one default communicator, like ``horovod`` and ``torch.distributed``."""

from __future__ import annotations

import atexit
import dataclasses
import logging
import socket
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from ringcore.bootstrap import Meeting, bootstrap
from ringcore.comm import Communicator, Handle
from ringcore.config import Settings, unknown_variables
from ringcore.errors import RingcoreError
from ringcore.rendezvous import WorldSpec, discover, listen_address

_default: Communicator | None = None
_lock = threading.Lock()
_atexit_registered = False
_unknown_warned = False  # unknown RINGCORE_* variables were warned about in this process
_joiner: Callable[[], Communicator] | None = None  # ringcore.elastic's, under an elastic ringcore-run


def init(
    rank: int | None = None,
    size: int | None = None,
    addr: str | None = None,
    port: int | None = None,
) -> Communicator:
    """Join the job and return its :class:`Communicator` (also the default for module functions).

    With no arguments, rank, size and the rendezvous address come from the
    launcher's environment (ringcore-run, torchrun, mpirun, srun); with none,
    this is a world of size 1. Explicit arguments override the environment.

    Raises:
        ConfigError: missing or contradictory settings (the message says which).
        CollectiveTimeout: the other ranks did not show up in time.
        RingcoreError: already initialized (call ``shutdown()`` first).
    """
    global _default, _atexit_registered
    with _lock:
        if _default is not None:
            raise RingcoreError(
                "ringcore is already initialized; call ringcore.shutdown() before init() again"
            )
        if _joiner is not None and (rank, size, addr, port) == (None, None, None, None):
            _default = _joiner()
        else:
            settings = Settings.from_env()
            world = discover(settings, rank=rank, size=size, addr=addr, port=port)
            _configure_logging(settings, world.rank)
            _warn_unknown_variables(world.local_rank in (None, 0))
            _default = bootstrap(world, settings)
        if not _atexit_registered:
            atexit.register(shutdown)
            _atexit_registered = True
        return _default


def new_communicator(
    rank: int, size: int, meeting: Meeting, addr: str = "127.0.0.1", timeout: float | None = None
) -> Communicator:
    """A Communicator of its own (not the default) for ranks that share a store already.

    For frameworks that did their own rendezvous: ``ringcore.torch``'s process
    group passes torch.distributed's ``Store``. Rank 0 serves ringcore's store on
    a free port of the interface that routes to ``addr`` (or ``RINGCORE_IFNAME``'s)
    and publishes it in ``meeting``; every other rank finds it there. Call it on
    every rank; close the result with ``shutdown()``.

    Args:
        rank, size: this rank and the world size.
        meeting: any object with torch's ``Store`` methods ``set(key, bytes)`` and a
            blocking ``get(key) -> bytes``.
        addr: an address of the job's rendezvous host (e.g. ``MASTER_ADDR``).
        timeout: seconds without progress before a collective fails (default
            ``RINGCORE_TIMEOUT``).
    """
    settings = Settings.from_env()
    if timeout is not None:
        settings = dataclasses.replace(settings, timeout=float(timeout))
    host = listen_address(settings, addr, 9) if rank == 0 and size > 1 else addr
    world = WorldSpec(rank, size, None, None, host, 0, "a shared store")
    _configure_logging(settings, rank)
    _warn_unknown_variables(rank == 0)
    return bootstrap(world, settings, meeting)


def set_joiner(joiner: Callable[[], Communicator] | None) -> None:
    """Have ``init()`` without arguments take its communicator from ``joiner()`` instead of discovery.

    ``ringcore.elastic`` sets one under an elastic ``ringcore-run``: each
    ``init()`` then joins the job's next generation. ``None`` removes it.
    """
    global _joiner
    _joiner = joiner


def shutdown() -> None:
    """Close the default communicator; safe to call twice or without ``init()``."""
    global _default
    with _lock:
        comm, _default = _default, None
    if comm is not None:
        comm.shutdown()


def is_initialized() -> bool:
    return _default is not None


def communicator() -> Communicator:
    """The default communicator made by :func:`init`."""
    if _default is None:
        raise RingcoreError("ringcore is not initialized; call ringcore.init() first")
    return _default


def rank() -> int:
    return communicator().rank


def size() -> int:
    return communicator().size


def local_rank() -> int:
    return communicator().local_rank


def local_size() -> int:
    return communicator().local_size


def allreduce(buf: Any, op: Any = "sum", compression: Any = None, name: str | None = None) -> Any:
    """See :meth:`Communicator.allreduce`."""
    comm = _default if _default is not None else communicator()  # no call: a 4 KiB allreduce counts them
    return comm._run(comm._allreduce_plan(buf, op, compression), buf, name)  # Communicator.allreduce


def allreduce_async(buf: Any, op: Any = "sum", compression: Any = None, name: str | None = None) -> Handle:
    """See :meth:`Communicator.allreduce_async`."""
    return communicator().allreduce_async(buf, op=op, compression=compression, name=name)


def broadcast(buf: Any, root: int = 0, name: str | None = None) -> Any:
    """See :meth:`Communicator.broadcast`."""
    return communicator().broadcast(buf, root=root, name=name)


def broadcast_async(buf: Any, root: int = 0, name: str | None = None) -> Handle:
    """See :meth:`Communicator.broadcast_async`."""
    return communicator().broadcast_async(buf, root=root, name=name)


def allgather(x: Any, name: str | None = None) -> np.ndarray:
    """See :meth:`Communicator.allgather`."""
    return communicator().allgather(x, name=name)


def reduce_scatter(x: Any, op: Any = "sum", compression: Any = None, name: str | None = None) -> np.ndarray:
    """See :meth:`Communicator.reduce_scatter`."""
    return communicator().reduce_scatter(x, op=op, compression=compression, name=name)


def empty(shape: int | tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
    """A new, uninitialised numpy array in symmetric memory: a collective, for the fastest allreduce on one host.

    Every rank calls it in the same order with the same shape and dtype. When
    every rank of the job runs on this host, each maps the others' arrays, and
    an allreduce of the array (or of one contiguous view of it, the same on
    every rank) reads the peers' memory directly instead of moving frames:
    one pass over this rank's share and one copy of it per peer (N=2, 1 to 256
    MiB: 1.8-3.0x the busbw of ordinary arrays, ``bench/RESULTS.md``).
    Elsewhere it is an ordinary array. See :mod:`ringcore.symmetric`.

    >>> grads = ringcore.empty(1 << 20)              # float32, on every rank
    >>> grads[...] = local_gradients
    >>> ringcore.allreduce(grads)
    """
    return communicator().empty(shape, dtype)


def barrier() -> None:
    """See :meth:`Communicator.barrier`."""
    comm = _default if _default is not None else communicator()
    comm.barrier()


class _RankFilter(logging.Filter):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank, self.host = rank, socket.gethostname()

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank, record.host = self.rank, self.host
        return True


def _warn_unknown_variables(speaks: bool) -> None:
    """Warn once per process (from one rank a host: ``speaks``) about ``RINGCORE_*`` variables nothing reads."""
    global _unknown_warned
    if _unknown_warned or not speaks:
        return
    _unknown_warned = True
    unknown = unknown_variables()
    if unknown:
        logging.getLogger("ringcore").warning(
            'ignoring %s: no such ringcore setting (README, "Environment variables")', ", ".join(unknown)
        )


def _configure_logging(settings: Settings, rank: int) -> None:
    logger = logging.getLogger("ringcore")
    logger.setLevel(settings.log_level if settings.log_level in logging._nameToLevel else "WARNING")
    if not any(getattr(h, "_ringcore", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler._ringcore = True  # type: ignore[attr-defined]
        handler.setFormatter(logging.Formatter("[ringcore %(levelname)s rank %(rank)s@%(host)s] %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    for handler in logger.handlers:
        handler.filters = [f for f in handler.filters if not isinstance(f, _RankFilter)]
        handler.addFilter(_RankFilter(rank))
