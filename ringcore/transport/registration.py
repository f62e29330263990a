"""Memory-registration cache: which memory region covers a segment's bytes.

RDMA can only move bytes that were registered with the device (pinned, with
keys the NIC checks). Registering is slow (a system call that pins every
page), so it must not happen per segment: the first time a segment of some
buffer is sent or received, the cache registers the *whole* buffer that owns
it (the root numpy array, or the exporter's whole memory) and every later
segment of it, in this collective and in later ones, is a lookup.

Staleness is the classic trap of registration caches: if the buffer is freed
and its addresses reused, an old registration would make the NIC write into
pages that no longer belong to it. So every entry holds a weak reference to
the object that owns the memory and is dropped (and deregistered) when that
object dies; owners that cannot be weakly referenced are held strongly, and
the cache then keeps at most ``capacity`` entries, deregistering the least
recently used.

Device memory (GPUDirect) fits the same cache: entries are keyed by
``(device, address range)`` and the ``register`` callable decides how to
register (``MR`` for host memory, ``DmaBufMR`` for a CUDA allocation).
"""

from __future__ import annotations

import ctypes
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np


class Registration(Protocol):
    """What ``register`` returns: the keys of one memory region."""

    lkey: int
    rkey: int

    def close(self) -> None: ...


Register = Callable[[int, int, bool], Registration]  # (address, nbytes, writable)


class _Entry:
    __slots__ = ("end", "key", "owner", "registration", "start", "writable")

    def __init__(self, start: int, end: int, writable: bool, registration: Registration) -> None:
        self.start = start
        self.end = end
        self.writable = writable
        self.registration = registration
        self.owner: Any = None
        self.key = (start, end, writable)


def view_address(view: memoryview) -> int:
    """The address of the first byte of a contiguous memoryview (read-only ones too)."""
    if not view.nbytes:
        return 0
    if not view.readonly:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    return int(np.frombuffer(view, np.uint8).__array_interface__["data"][0])


def owner_range(view: memoryview) -> tuple[Any, int, int]:
    """The object that owns ``view``'s memory and the address range it owns."""
    owner = view.obj
    while isinstance(owner, np.ndarray) and isinstance(owner.base, np.ndarray):
        owner = owner.base
    address = view_address(view)
    try:
        whole = owner if isinstance(owner, np.ndarray) else np.frombuffer(memoryview(owner), np.uint8)
        start = int(whole.__array_interface__["data"][0])
        end = start + whole.nbytes
    except (TypeError, ValueError, BufferError):
        return view.obj, address, address + view.nbytes
    if not (whole.flags.c_contiguous and start <= address and address + view.nbytes <= end):
        return view.obj, address, address + view.nbytes
    return owner, start, end


class RegistrationCache:
    """Registered regions keyed by address range (see module docstring).

    Args:
        register: registers ``(address, nbytes, writable)`` with the device.
        capacity: most entries kept for owners that cannot be weakly referenced.
    """

    def __init__(self, register: Register, capacity: int = 16) -> None:
        self._register = register
        self._capacity = capacity
        self._entries: OrderedDict[tuple[int, int, bool], _Entry] = OrderedDict()
        self._dead: list[_Entry] = []
        self.registrations = 0  # how many times the device was asked (for tests and stats)

    def lookup(self, view: memoryview, writable: bool) -> tuple[int, Registration]:
        """``(address, registration)`` covering ``view``; registers its owner on a miss."""
        self._reap()
        address = view_address(view)
        end = address + view.nbytes
        for key, entry in reversed(self._entries.items()):
            if entry.start <= address and end <= entry.end and (entry.writable or not writable):
                self._entries.move_to_end(key)
                return address, entry.registration
        return address, self._add(view, writable).registration

    def invalidate(self, view: memoryview) -> None:
        """Deregister whatever covers ``view``: the device refuses any later access to it."""
        address = view_address(view)
        for key, entry in list(self._entries.items()):
            if entry.start <= address < entry.end or (view.nbytes == 0 and entry.start == address):
                del self._entries[key]
                entry.registration.close()

    def clear(self) -> None:
        """Deregister everything."""
        for entry in self._entries.values():
            entry.registration.close()
        self._entries.clear()
        self._reap()

    def __len__(self) -> int:
        return len(self._entries)

    def _add(self, view: memoryview, writable: bool) -> _Entry:
        owner, start, end = owner_range(view)
        entry = _Entry(start, end, writable, self._register(start, end - start, writable))
        self.registrations += 1
        try:
            entry.owner = weakref.ref(owner, lambda _ref, e=entry: self._dead.append(e))
        except TypeError:
            entry.owner = owner  # held strongly: bounded by capacity below
        stale = self._entries.pop(entry.key, None)
        if stale is not None:
            stale.registration.close()
        self._entries[entry.key] = entry
        self._evict()
        return entry

    def _evict(self) -> None:
        strong = [key for key, entry in self._entries.items() if not isinstance(entry.owner, weakref.ref)]
        for key in strong[: max(0, len(strong) - self._capacity)]:
            self._entries.pop(key).registration.close()

    def _reap(self) -> None:
        """Deregister entries whose owner died (their weakref callbacks queued them)."""
        while self._dead:
            entry = self._dead.pop()
            if self._entries.get(entry.key) is entry:
                del self._entries[entry.key]
                entry.registration.close()
