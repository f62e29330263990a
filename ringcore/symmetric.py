"""Symmetric memory: arrays every rank of a one-host job can read from every other.

``ringcore.empty(shape, dtype)`` is a collective: every rank calls it, in the
same order, with the same shape and dtype, as it would ``torch.distributed``'s
symmetric memory or NCCL's ``ncclMemAlloc`` + window registration. Each rank
gets an ordinary numpy array whose memory is a ``memfd`` of its own, and maps
the same allocation of each peer. An allreduce of such an array (or of a
contiguous view of it, at the same offset on every rank) then needs no frames
of data at all: each rank reduces its share of the elements straight from the
peers' memory into its own array, and writes the result into the peers'
arrays (:mod:`ringcore.algo.direct`). That is one memory pass per share and
one copy of it per peer, where a ring through slots makes two copies and a
pass.

Exchange. The allocation allgathers each rank's ``(pid, fd, inode, bytes)``; every rank
opens the peers' memfds through ``/proc/<pid>/fd/<fd>`` (the kernel allows it
to a process of the same user that may ptrace-read the owner), maps them
(:func:`map_shared`: the mapping holds no descriptor) and closes them, and an
allreduce of "every peer mapped" makes the answer the same on every rank.
Where any rank could not (or could not make its memfd), the allocation is
still a valid array on every rank, and its allreduces take the ordinary
route. Then each owner closes its descriptor: from then on nothing names the
memory (a memfd is never in ``/dev/shm``), and it goes back to the kernel once
every process that mapped it has dropped it or died, however it ended.

Safety. While ``empty`` runs, any process of the same user that may
ptrace-read the owner could open the memfd too (Yama's ``ptrace_scope``
restricts attaching, which ``process_vm_readv`` needs, not this); once it
returns, no descriptor names it. The memfd is sealed against shrinking, so no
peer's read can fault.
An allocation has a number (``serial``) that counts the collective
allocations of the communicator, the same on every rank. Where the ranks vote
on the direct route (:mod:`ringcore.plans.direct`: from ``RINGCORE_DIRECT_BYTES``,
where they may copy from each other) the vote compares serials and offsets,
and ranks that passed different memory meet through the kernel instead.
Elsewhere a collective on symmetric memory carries the serial and offset in
its signature, so ranks that passed different allocations, or one where
another passed ordinary memory, fail with ``MismatchError`` before any rank
reads a peer's memory.

Scope. Mapping peers needs every rank on this host (``local_size == size``);
in a job across hosts ``empty`` allocates locally and nothing is exchanged.
Once the array is garbage-collected, this rank drops its peers' mappings at
its next allocation or direct allreduce.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import dataclasses
import fcntl
import functools
import logging
import mmap
import os
import threading
import weakref
from collections.abc import Callable

import numpy as np

log = logging.getLogger("ringcore")

_NAME = "ringcore-symmetric"  # the memfd's name (in /proc/<pid>/fd/<fd>: "/memfd:ringcore-symmetric")
Mapping = ctypes.Array  # a shared mapping (map_shared): bytes at a fixed address, unmapped with the object


@dataclasses.dataclass
class Allocation:
    """One symmetric allocation: where this rank's array starts, and every peer's memory mapped here."""

    serial: int
    rank: int  # this rank: memory[rank] is None
    start: int  # this rank's address of its first byte
    nbytes: int
    memory: list[np.ndarray | None]  # memory[peer]: that peer's bytes as uint8, mapped here; None: this rank

    _views: dict[tuple[int, int, np.dtype], list[np.ndarray]] = dataclasses.field(default_factory=dict)

    def label(self, offset: int) -> str:
        """How a collective names the memory it runs on (its descriptor's ``memory`` field)."""
        return f"ringcore.empty #{self.serial} at byte {offset}"

    def peers(self, offset: int, count: int, dtype: np.dtype) -> list[np.ndarray]:
        """The peers' ``count`` elements at ``offset``, in ring order after this rank (kept: 8 layouts)."""
        key = (offset, count, dtype)
        views = self._views.get(key)
        if views is None:
            rank = self.rank
            order = self.memory[rank + 1 :] + self.memory[:rank]
            end = offset + count * dtype.itemsize
            views = [memory[offset:end].view(dtype) for memory in order if memory is not None]
            if len(self._views) >= 8:
                self._views.clear()
            self._views[key] = views
        return views


def create(nbytes: int) -> tuple[int, Mapping]:
    """A sealed memfd of ``nbytes`` (at least one page) and this process's mapping: ``(fd, mapping)``.

    Raises:
        OSError: the kernel refused the memfd, its size, its seals or the mapping.
    """
    fd = os.memfd_create(_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        length = max(nbytes, mmap.PAGESIZE)
        os.ftruncate(fd, length)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        return fd, map_shared(fd, length)
    except BaseException:
        os.close(fd)
        raise


def open_peer(pid: int, fd: int, inode: int, nbytes: int) -> Mapping | None:
    """Map process ``pid``'s memfd ``fd`` (inode ``inode``, ``nbytes``), or None where it cannot.

    None: no permission, the process or descriptor is gone, or the descriptor
    is another file (a pid from another pid namespace names another process:
    the inode, unique while the memfd lives, tells).
    """
    path = f"/proc/{pid}/fd/{fd}"
    try:
        if not os.readlink(path).startswith(f"/memfd:{_NAME}"):
            return None
        peer_fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        status = os.fstat(peer_fd)
        if status.st_ino != inode or status.st_size != max(nbytes, mmap.PAGESIZE):
            return None
        return map_shared(peer_fd, status.st_size)
    except OSError:
        return None
    finally:
        os.close(peer_fd)


def map_shared(fd: int, length: int) -> Mapping:
    """``length`` bytes of file ``fd`` mapped shared, read-write, holding no descriptor.

    Python's ``mmap.mmap`` keeps a duplicate of the descriptor for the
    mapping's life (until 3.13's ``trackfd``): N per allocation per rank, and
    the memfd reachable through ``/proc`` all along. This maps it with the C
    library instead; the mapping goes when the returned object does.
    """
    libc = _libc()
    address = libc.mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if address is None or address == ctypes.c_void_p(-1).value:
        code = ctypes.get_errno()
        raise OSError(code, f"mmap: {os.strerror(code)}")
    mapping = (ctypes.c_ubyte * length).from_address(address)
    weakref.finalize(mapping, libc.munmap, ctypes.c_void_p(address), ctypes.c_size_t(length))
    return mapping


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.restype = ctypes.c_int
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


class SymmetricMemory:
    """One communicator's symmetric allocations, found by address (see the module docstring).

    Args:
        rank, size: this rank and the world's size.
        shared: whether every rank runs on this host (only then are peers mapped).
    """

    def __init__(self, rank: int, size: int, shared: bool) -> None:
        self.rank, self.size, self.shared = rank, size, shared
        self.serials = 0
        self._registry: tuple[list[int], dict[int, Allocation]] = ([], {})  # (sorted starts, by start)
        self._dead: list[int] = []  # starts of allocations whose arrays are gone
        self._lock = threading.Lock()

    def empty(
        self,
        shape: tuple[int, ...],
        dtype: np.dtype,
        exchange: Callable[[np.ndarray], np.ndarray],
        agree: Callable[[bool], bool],
    ) -> np.ndarray:
        """A new array in memory of this rank's own, mapped by every peer where all can.

        ``exchange(record)`` allgathers every rank's int64 record; ``agree(ok)``
        is True only when ``ok`` is True on every rank. Both are collectives
        (the communicator's), so every rank calls this in the same order.
        """
        count = int(np.prod(shape, dtype=np.int64))
        nbytes = count * dtype.itemsize
        try:
            fd, own = create(nbytes)
        except OSError as err:  # still take part in the exchange: the peers are in it
            log.warning("ringcore.empty: no shared memory for %d bytes (%s); an ordinary array", nbytes, err)
            fd, own = -1, None
        array = np.empty(shape, dtype) if own is None else np.frombuffer(own, dtype, count).reshape(shape)
        if not self.shared:
            if fd >= 0:
                os.close(fd)
            return array
        try:
            self.serials += 1
            record = [os.getpid(), fd, os.fstat(fd).st_ino if fd >= 0 else -1, nbytes]
            records = exchange(np.array(record, np.int64)).reshape(self.size, len(record))
            sizes = records[:, 3].tolist()
            if len(set(sizes)) > 1:  # the same records on every rank: every rank raises this
                listed = ", ".join(f"rank {peer}: {size} bytes" for peer, size in enumerate(sizes))
                raise ValueError(
                    f"ringcore.empty #{self.serials}: the ranks asked for different sizes ({listed}); "
                    "every rank must allocate the same shape and dtype, in the same order"
                )
            memory: list[np.ndarray | None] = []
            mapped = own is not None
            for peer, (pid, peer_fd, inode, _) in enumerate(records.tolist()):
                mapping = None
                if peer != self.rank:
                    mapping = open_peer(pid, peer_fd, inode, nbytes) if peer_fd >= 0 else None
                    mapped = mapped and mapping is not None
                memory.append(None if mapping is None else np.frombuffer(mapping, np.uint8, nbytes))
            if not agree(mapped):
                return array
        finally:
            if fd >= 0:
                os.close(fd)  # every peer that could has mapped it: agree() waited for all
        start = array.ctypes.data
        self._add(Allocation(self.serials, self.rank, start, nbytes, memory))
        weakref.finalize(own, self._died, start)  # no reference to `own` is kept here
        return array

    def locate(self, array: np.ndarray) -> tuple[Allocation, int] | None:
        """The allocation that holds all of C-contiguous ``array``, and its byte offset there; else None."""
        if self._dead:
            self._purge()
        starts, by_start = self._registry  # one read: a consistent pair, whatever another thread does
        if not starts or not array.flags.c_contiguous:
            return None
        address = array.ctypes.data
        index = bisect.bisect_right(starts, address) - 1
        if index < 0:
            return None
        allocation = by_start[starts[index]]
        offset = address - allocation.start
        if offset + array.nbytes > allocation.nbytes:
            return None
        return allocation, offset

    def close(self) -> None:
        """Forget every allocation and drop the peers' mappings (the arrays stay valid)."""
        with self._lock:
            self._registry = ([], {})

    # A finalizer runs wherever the garbage collector does, even inside _add in this thread,
    # so it only notes the start (_died); the registry is replaced, whole, under the lock.

    def _add(self, allocation: Allocation) -> None:
        self._purge()
        with self._lock:
            by_start = {**self._registry[1], allocation.start: allocation}
            self._registry = (sorted(by_start), by_start)

    def _died(self, start: int) -> None:
        self._dead.append(start)

    def _purge(self) -> None:
        with self._lock:
            by_start = dict(self._registry[1])
            while self._dead:
                by_start.pop(self._dead.pop(), None)
            self._registry = (sorted(by_start), by_start)
