"""Cross-memory attach: copy bytes straight out of, or into, another process's memory.

``process_vm_readv`` and ``process_vm_writev``, each one copy in the kernel.

The shared-memory transport moves a large frame with one copy instead of two
(into a slot, out of it): the sender publishes the address of its bytes in a
slot, and the receiver copies them from the sender's address space into its
own posted view in one system call (the single-copy path of Open MPI's
shared-memory transport and of NCCL's P2P/CMA). The kernel allows it where
the reader may ptrace the writer: same user, and, with Yama's
``ptrace_scope`` 1 or more, only when the writer allowed it, which ringcore
never does behind the caller's back. Whether it works is therefore probed
between each pair at set-up (:class:`Probe`), not assumed; where it does not,
frames go through the slots.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os
import sys
import time
from collections import OrderedDict
from collections.abc import Callable

from ringcore.transport.registration import owner_range, view_address


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


def _load() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        functions = (libc.process_vm_readv, libc.process_vm_writev)
    except (OSError, AttributeError):
        return None
    iovecs = ctypes.POINTER(_Iovec)
    for function in functions:
        function.argtypes = [ctypes.c_int, iovecs, ctypes.c_ulong, iovecs, ctypes.c_ulong, ctypes.c_ulong]
        function.restype = ctypes.c_ssize_t
    return libc


_LIBC = _load()


def available() -> bool:
    """Whether this platform has ``process_vm_readv`` (Linux 3.2+ with glibc or musl)."""
    return _LIBC is not None


def read(pid: int, into: memoryview, address: int) -> None:
    """Copy ``into.nbytes`` bytes at ``address`` in process ``pid`` into ``into`` (writable, contiguous).

    Raises:
        OSError: the process is gone (``ESRCH``), the range is not mapped there
            (``EFAULT``), reading it is not allowed (``EPERM``), or fewer bytes came.
    """
    Channel(pid).copy_in(address, view_address(into), into.nbytes)


class Transfer:
    """Copies in one direction between this process and process ``pid``, one system call each.

    The iovecs are aimed again only when the addresses or the length change, and
    the call is bound to them once (``call``, a ``functools.partial`` of the C
    function: no Python frame of its own). The direct allreduce copies the same
    piece from and to every peer in every call of a training loop
    (:mod:`ringcore.plans.direct`, whose ``Remote`` aims and calls it itself):
    aiming the iovecs anew each time cost a third of a copy's Python there.

    Args:
        pid: the other process.
        out: ``process_vm_writev`` (this process to the other), else ``process_vm_readv``.
    """

    __slots__ = ("_aimed", "call", "did", "here", "there")

    def __init__(self, pid: int, out: bool) -> None:
        assert _LIBC is not None
        self.here, self.there = _Iovec(), _Iovec()
        function = _LIBC.process_vm_writev if out else _LIBC.process_vm_readv
        # call(): copy what the iovecs name; the bytes copied, or -1 with errno set
        self.call = functools.partial(
            function, pid, ctypes.pointer(self.here), 1, ctypes.pointer(self.there), 1, 0
        )
        self._aimed = (0, 0, 0)  # (here, there, nbytes) the iovecs hold
        self.did = "wrote" if out else "read"

    def aim(self, here: int, there: int, nbytes: int) -> None:
        """Point the iovecs at ``nbytes`` at ``here`` (this process) and ``there`` (the other)."""
        self.here.base, self.here.length = here, nbytes
        self.there.base, self.there.length = there, nbytes
        self._aimed = (here, there, nbytes)

    def failure(self, got: int, nbytes: int) -> OSError:
        """The error of a ``call()`` that returned ``got`` where ``nbytes`` were asked (right after it)."""
        if got < 0:
            code = ctypes.get_errno()
            return OSError(code, os.strerror(code))
        return OSError(errno.EFAULT, f"{self.did} {got} of {nbytes} bytes")

    def move(self, here: int, there: int, nbytes: int) -> None:
        """Copy ``nbytes`` between ``here`` (this process) and ``there`` (the other), in this transfer's
        direction; raises ``OSError`` as :func:`read`."""
        if not nbytes:
            return
        if (here, there, nbytes) != self._aimed:
            self.aim(here, there, nbytes)
        got = self.call()
        if got != nbytes:
            raise self.failure(got, nbytes)


class Channel:
    """Copies between this process and process ``pid`` both ways, one system call each (two :class:`Transfer`)."""

    __slots__ = ("pid", "reads", "writes")

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.reads, self.writes = Transfer(pid, out=False), Transfer(pid, out=True)

    def copy_in(self, there: int, here: int, nbytes: int) -> None:
        """Copy ``nbytes`` at ``there`` in the process to ``here`` in this one; raises ``OSError`` as :func:`read`."""
        self.reads.move(here, there, nbytes)

    def copy_out(self, here: int, there: int, nbytes: int) -> None:
        """Copy ``nbytes`` at ``here`` in this process to ``there`` in the other; raises ``OSError`` as :func:`read`."""
        self.writes.move(here, there, nbytes)


class Word:
    """An 8-byte word at a fixed address in another process, read again and again cheaply.

    The direct allreduce reads each peer's word in every call where the ranks have no
    mailboxes, and in a loop after a failure (whether the peer still lives, with them;
    :mod:`ringcore.plans.direct`, "Safety"): the iovecs are built once.
    """

    def __init__(self, pid: int, address: int) -> None:
        assert _LIBC is not None
        self.pid = pid
        self.value = ctypes.c_int64()
        self.local = ctypes.pointer(_Iovec(ctypes.addressof(self.value), 8))
        self.remote = ctypes.pointer(_Iovec(address, 8))
        self.function = _LIBC.process_vm_readv

    def read(self) -> int | None:
        """The word's value now; None when it cannot be read (the process is gone)."""
        if self.function(self.pid, self.local, 1, self.remote, 1, 0) != 8:
            return None
        return self.value.value

    def alive(self) -> bool:
        """Whether the word's process is still there to read."""
        return self.read() is not None


class Probe:
    """A few random bytes this process keeps, so peers can check they may read its memory.

    It also holds the word peers read during a direct allreduce where the ranks
    have no mailboxes (:mod:`ringcore.plans.direct`, "Safety"; with mailboxes the
    word lies there and this one only tells peers the process is alive), never
    freed: a peer that reads it late must not find reused memory there.
    """

    def __init__(self) -> None:
        self.token = bytearray(os.urandom(16))
        self.address = view_address(memoryview(self.token))
        self.word = (ctypes.c_int64 * 8)()  # [0]: the word; 64 bytes of its own
        _KEPT.append(self.word)

    def record(self) -> dict[str, int | bytes]:
        """What a peer needs to try: this process's pid, the token's address and its value; the word's address."""
        return {
            "pid": os.getpid(),
            "address": self.address,
            "token": bytes(self.token),
            "word": ctypes.addressof(self.word),
        }


_KEPT: list[ctypes.Array] = []  # every probe's word


def readable(record: dict[str, object]) -> bool:
    """Whether this process can read the peer's memory: its probe token, read through its pid, matches.

    A pid from another pid namespace names another process (or none): the
    token does not match, and the answer is no.
    """
    if _LIBC is None:
        return False
    token = record.get("token")
    pid, address = record.get("pid"), record.get("address")
    if not (isinstance(token, bytes) and isinstance(pid, int) and isinstance(address, int)) or not token:
        return False
    into = bytearray(len(token))
    try:
        read(pid, memoryview(into), address)
    except OSError:
        return False
    return bytes(into) == token


def writable(record: dict[str, object]) -> bool:
    """Whether this process may also write the peer's memory: its probe token, written back unchanged.

    ``process_vm_writev`` passes the same permission check as reads, but a
    seccomp filter may allow one and not the other. Call it only where
    :func:`readable` said yes: it writes the token's own bytes.
    """
    if _LIBC is None:
        return False
    token, pid, address = record.get("token"), record.get("pid"), record.get("address")
    if not (isinstance(token, bytes) and isinstance(pid, int) and isinstance(address, int)) or not token:
        return False
    data = (ctypes.c_char * len(token)).from_buffer_copy(token)
    try:
        Channel(pid).copy_out(ctypes.addressof(data), address, len(token))
    except OSError:
        return False
    return True


class Copyable:
    """Which of this process's buffers a peer may copy from: the kernel refuses some memory.

    ``process_vm_readv`` pins the pages it reads, and mappings of device
    memory (``VM_IO``/``VM_PFNMAP``: CUDA's pinned host allocations among
    them) cannot be pinned so, whatever the permissions: the peer's copy
    would fail with ``EFAULT``. So before a frame goes as a pointer, the
    buffer that owns it is tried once, by reading its first and last byte
    through this process's own pid, and the answer is kept per address range
    (the ``capacity`` most recent).
    """

    def __init__(self, capacity: int = 64) -> None:
        self.capacity = capacity
        self.ranges: OrderedDict[tuple[int, int], bool] = OrderedDict()

    def __call__(self, view: memoryview) -> bool:
        _, start, end = owner_range(view)
        key = (start, end)
        known = self.ranges.get(key)
        if known is None:
            known = _readable_here(start, end)
            self.ranges[key] = known
            if len(self.ranges) > self.capacity:
                self.ranges.popitem(last=False)
        else:
            self.ranges.move_to_end(key)
        return known


def _readable_here(start: int, end: int) -> bool:
    byte = bytearray(1)
    try:
        for address in (start, end - 1):
            read(os.getpid(), memoryview(byte), address)
    except OSError:
        return False
    return True


PROBE_BYTES = 256 * 1024  # one piece of the direct route at N=4 1 MiB
PROBE_ROUNDS = 16


def relative_speed(nbytes: int = PROBE_BYTES, rounds: int = PROBE_ROUNDS) -> float:
    """How fast the kernel copies next to the C library: ``process_vm_readv``'s bytes per second over
    ``memmove``'s, the best of ``rounds`` copies of ``nbytes`` each, both within this process (about 0.5 ms).

    The kernel pins and maps each page it copies; how much that costs next to
    a plain copy in cache differs by host (0.22-0.27 on an AMD EPYC VM,
    0.52-0.53 on an Intel Xeon one), and so does which allreduce route is faster on
    one host (:meth:`ringcore.config.Settings.direct_from`). 0.0 where the
    kernel refuses the copy.
    """
    source, target = ctypes.create_string_buffer(nbytes), ctypes.create_string_buffer(nbytes)
    here, there = ctypes.addressof(target), ctypes.addressof(source)
    channel = Channel(os.getpid())
    try:
        kernel = _best(lambda: channel.copy_in(there, here, nbytes), rounds)
    except OSError:
        return 0.0
    user = _best(lambda: ctypes.memmove(here, there, nbytes), rounds)
    return user / kernel


def _best(copy: Callable[[], object], rounds: int) -> float:
    """The shortest of ``rounds`` timed calls of ``copy``, after one untimed (seconds)."""
    copy()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        copy()
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)
