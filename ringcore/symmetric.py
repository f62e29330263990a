"""Symmetric memory: arrays every rank of a one-host job can read from every other.

``ringcore.empty(shape, dtype)`` is a collective: every rank calls it, in the
same order, with the same shape and dtype, as it would ``torch.distributed``'s
symmetric memory or NCCL's ``ncclMemAlloc`` + window registration. Each rank
gets an ordinary numpy array whose memory is a ``memfd`` of its own, and maps
the same allocation of each peer. An allreduce of such an array (or of a
contiguous view of it, at the same offset on every rank) then needs no frames
of data at all: each rank reduces its share of the elements straight from the
peers' memory into its own array, and copies the other shares from the
peers' arrays (:mod:`ringcore.algo.direct`). That is one memory pass per
share and one copy, where a ring through slots makes two copies and a pass.

Exchange. The allocation allgathers each rank's ``(pid, fd, inode, bytes)``; every rank
opens the peers' memfds through ``/proc/<pid>/fd/<fd>`` (the kernel allows it
only to a process that may ptrace the owner: same user, and Yama's
``ptrace_scope`` permitting, as for ``process_vm_readv``), maps them, and an
allreduce of "every peer mapped" makes the answer the same on every rank.
Where any rank could not, the allocation is still a valid array on every
rank, and its allreduces take the ordinary route. Then each owner closes its
descriptor: nothing has a name anywhere (a memfd is never in ``/dev/shm``),
and the memory goes back to the kernel once every process that mapped it has
dropped it or died, however it ended.

Safety. Opening another process's descriptor needs the same permission as
reading its memory with ``process_vm_readv`` or a debugger, so a memfd shows a
rank's array to nobody who could not already read it. The memfd is sealed
against shrinking, so no peer's read can fault.
An allocation has a number (``serial``) that counts the collective
allocations of the communicator, the same on every rank; a collective on
symmetric memory carries the serial and offset in its signature, so ranks
that passed different allocations, or one where another passed ordinary
memory, fail with ``MismatchError`` before any rank reads a peer's memory.

Scope. Mapping peers needs every rank on this host (``local_size == size``);
in a job across hosts ``empty`` allocates locally and nothing is exchanged.
When the array is garbage-collected, this rank drops its peers' mappings too.
"""

from __future__ import annotations

import bisect
import dataclasses
import fcntl
import mmap
import os
import threading
import weakref
from collections.abc import Callable

import numpy as np

_NAME = "ringcore-symmetric"  # the memfd's name (in /proc/<pid>/fd/<fd>: "/memfd:ringcore-symmetric")
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


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


def create(nbytes: int) -> tuple[int, mmap.mmap]:
    """A sealed memfd of ``nbytes`` (at least one page) and its mapping: ``(fd, mapping)``."""
    fd = os.memfd_create(_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        length = max(nbytes, mmap.PAGESIZE)
        os.ftruncate(fd, length)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        return fd, mmap.mmap(fd, length)
    except BaseException:
        os.close(fd)
        raise


def open_peer(pid: int, fd: int, inode: int, nbytes: int) -> mmap.mmap | None:
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
        return mmap.mmap(peer_fd, max(nbytes, mmap.PAGESIZE))
    except OSError:
        return None
    finally:
        os.close(peer_fd)


class SymmetricMemory:
    """One communicator's symmetric allocations, found by address (see the module docstring).

    Args:
        rank, size: this rank and the world's size.
        shared: whether every rank runs on this host (only then are peers mapped).
    """

    def __init__(self, rank: int, size: int, shared: bool) -> None:
        self.rank, self.size, self.shared = rank, size, shared
        self.serials = 0
        self._starts: list[int] = []  # sorted
        self._by_start: dict[int, Allocation] = {}
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
        fd, own = create(nbytes)
        try:
            array = np.frombuffer(own, dtype, count).reshape(shape)
            if not self.shared:
                return array
            self.serials += 1
            record = [os.getpid(), fd, os.fstat(fd).st_ino, nbytes]
            records = exchange(np.array(record, np.int64)).reshape(self.size, len(record))
            sizes = records[:, 3].tolist()
            if len(set(sizes)) > 1:  # the same records on every rank: every rank raises this
                listed = ", ".join(f"rank {peer}: {size} bytes" for peer, size in enumerate(sizes))
                raise ValueError(
                    f"ringcore.empty #{self.serials}: the ranks asked for different sizes ({listed}); "
                    "every rank must allocate the same shape and dtype, in the same order"
                )
            memory: list[np.ndarray | None] = []
            mapped = True
            for peer, (pid, peer_fd, inode, _) in enumerate(records.tolist()):
                mapping = None
                if peer != self.rank:
                    mapping = open_peer(pid, peer_fd, inode, nbytes)
                    mapped = mapped and mapping is not None
                memory.append(None if mapping is None else np.frombuffer(mapping, np.uint8, nbytes))
            if not agree(mapped):
                return array
        finally:
            os.close(fd)  # every peer that could has mapped it: agree() waited for all
        start = array.ctypes.data
        self._add(Allocation(self.serials, self.rank, start, nbytes, memory))
        weakref.finalize(own, self._died, start)  # no reference to `own` is kept here
        return array

    def locate(self, array: np.ndarray) -> tuple[Allocation, int] | None:
        """The allocation that holds all of C-contiguous ``array``, and its byte offset there; else None."""
        if self._dead:
            self._purge()
        starts, by_start = self._starts, self._by_start  # one snapshot, whatever another thread does
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
            self._starts, self._by_start = [], {}

    # A finalizer runs wherever the garbage collector does, even inside _add in this thread,
    # so it only notes the start (_died); the registry is changed under the lock, by
    # replacement, and read from a snapshot.

    def _add(self, allocation: Allocation) -> None:
        self._purge()
        with self._lock:
            self._by_start = {**self._by_start, allocation.start: allocation}
            self._starts = sorted(self._by_start)

    def _died(self, start: int) -> None:
        self._dead.append(start)

    def _purge(self) -> None:
        with self._lock:
            by_start = dict(self._by_start)
            while self._dead:
                by_start.pop(self._dead.pop(), None)
            self._by_start, self._starts = by_start, sorted(by_start)
