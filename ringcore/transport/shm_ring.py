"""One shared-memory segment per ordered pair of ranks on a host, and the rings of slots in it.

Layout. The sender of a pair (``src -> dst``) creates the segment and is the
only writer of its slots; the receiver is the only writer of each ring's
consumer counter. A segment holds one ring per channel the pair is connected
on (``needed_links``), each ``ring_bytes`` long::

    ring:  [released u64 | reader asleep u64 | pad to 64 B] [writer asleep u64 | pad to 64 B]
           [slot 0] [slot 1] ... [slot n-1]
    slot:  [ready u64 | tag u64 | signature u64 | nbytes u64 | offset u64 | length u64 |
            address u64 | pad] [payload]

A frame of ``nbytes`` goes in pieces of at most ``slot_bytes``, one per slot,
in order; a zero-byte frame is one empty piece. A piece with a non-zero
``address`` carries no payload: its ``length`` bytes are at that address in
the writer's memory, and the reader copies them from there with
``process_vm_readv`` (:mod:`ringcore.transport.cma`; the pair probed at
set-up that it may). The writer's bytes must stay as they are until the
reader releases that slot, so such a send is done only then. A writer that
gives up (``cancel``) first withdraws the pieces not yet released by storing
``ready = 0``; the reader, after its copy, checks that ``ready`` still holds
the piece's number, so it never takes bytes the writer may already be
changing. The k-th piece written to a
ring (k = 0, 1, ...) goes in slot ``k % n``, and is published by storing
``ready = k + 1`` last, after its header and payload. The reader of piece k
waits for ``ready == k + 1``, checks the header, copies the payload out and
stores ``released = k + 1`` (or, lending the frame, reads the payload in
place and stores ``released`` only once done with it); the writer reuses a slot only once
``k - released < n``. The counters never wrap (64 bits).

Doorbells. A side that has waited long enough blocks in ``poll`` instead of
polling the ring. Each rank owns one FIFO (:class:`Doorbell`) that every
local peer holds open for writing. Before blocking, the side stores a fresh
non-zero episode number in its "asleep" word of each ring it waits on (the
reader's word when it waits for a piece, the writer's when it waits for a
free slot), looks at the rings once more, then blocks on its FIFO. The
other side, after publishing (writer) or releasing (reader), reads the word
and, if it holds an episode it has not rung for yet, writes one byte to the
FIFO: at most one byte per peer per episode, and no syscall at all while
nobody sleeps. The waker never writes the word, so each word keeps one
writer.

Lost wake-ups. "Store the word, then load the counter" on one side against
"store the counter, then load the word" on the other is the pattern x86's
TSO does *not* keep in order (a store may wait in the store buffer while a
later load runs), and Python has no fence instruction: without one, both
sides miss each other (measured: 10-15% of blocks at N=4 on 2 cores slept
their whole bound). :func:`fence` takes and releases an uncontended lock,
whose atomic read-modify-write (a ``lock``-prefixed instruction in the C
library's semaphore or mutex) is a full fence on x86, for about 0.1 us;
both sides call it between their store and their load. That rests on how
CPython builds its locks, not on a promise, so every block is still bounded
(``BLOCK_MAX`` in :mod:`ringcore.transport.shm`): a lost wake-up costs at
most that.

Memory order. Single-writer counters stored as aligned 8-byte words (memoryview "Q") are
single instructions; x86-64 keeps stores in program order and loads in
program order (TSO), and every copy here is an opaque C call the compiler
cannot move the counter store across, so "payload, then counter" written is
"counter, then payload" read. Weaker memory models (ARM, POWER) would need
fences Python cannot issue: :func:`supported` says no there, and those ranks
use TCP.

Files. ``create`` makes the segment with ``O_CREAT | O_EXCL`` and mode 0600
under an unguessable name (``secrets.token_hex``), and reserves its pages
with ``posix_fallocate``, so a ``/dev/shm`` too small fails here with
``ENOSPC`` instead of a ``SIGBUS`` on first touch. ``attach`` maps a peer's
segment and unlinks it at once: from then on only the two mappings keep the
memory, and the kernel frees it when both processes are gone, however they
end.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import platform
import secrets
import stat
import struct
import threading

import numpy as np

SHM_DIR = "/dev/shm"
PREFIX = "ringcore-"
CONTROL_BYTES = 128  # the reader's line (released, asleep), then the writer's (asleep)
SLOT_HEADER_BYTES = 64
HEADER_FIELDS = 7  # ready, tag, signature, nbytes, offset, length, address
_FIELDS = struct.Struct("=6Q")  # a header after its ready word
MAX_SLOTS = 16
MAX_SLOT_BYTES = 512 * 1024  # a 512 KiB frame in one piece (bench/HISTORY.md, "512 KiB slots")


_FENCE = threading.Lock()


def fence() -> None:
    """A full memory fence on x86-64, for about 0.1 us (see "Lost wake-ups" in the module docstring)."""
    _FENCE.acquire()
    _FENCE.release()


def supported() -> str | None:
    """None when this host can carry frames in shared memory, else why not."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"{platform.machine()} is not x86-64 (the rings rely on its store order)"
    if not os.path.isdir(SHM_DIR):
        return f"{SHM_DIR} does not exist"
    return None


def new_name(kind: str) -> str:
    """An unguessable file name under /dev/shm."""
    return f"{PREFIX}{kind}-{secrets.token_hex(16)}"


def layout(total: int, rings: int) -> tuple[int, int, int]:
    """``(ring_bytes, slots, slot_bytes)`` for ``rings`` rings in ``total`` bytes; slots 0 if too small.

    Slots hold a power of two (at most ``MAX_SLOT_BYTES``), so a segment of
    the executors (a power of two) goes in whole pieces, not a full one and a
    sliver; at least two slots, so the writer fills one while the reader
    empties the other.
    """
    ring_bytes = (total // rings) // 64 * 64
    room = ring_bytes - CONTROL_BYTES
    fit = room // 2 - SLOT_HEADER_BYTES
    if fit < 64:
        return ring_bytes, 0, 0
    slot_bytes = min(MAX_SLOT_BYTES, 1 << (fit.bit_length() - 1))
    slots = min(MAX_SLOTS, room // (slot_bytes + SLOT_HEADER_BYTES))
    return ring_bytes, slots, slot_bytes


class Segment:
    """A mapped segment: the file's name (until unlinked) and its bytes as numpy."""

    def __init__(self, name: str, region: mmap.mmap) -> None:
        self.name = name
        self.region = region
        self.bytes: np.ndarray | None = np.frombuffer(region, np.uint8)

    @classmethod
    def create(cls, nbytes: int) -> Segment:
        """Make a fresh 0600 segment of ``nbytes``, all pages reserved.

        Raises:
            OSError: ``/dev/shm`` is missing, not writable, or too small (``ENOSPC``).
        """
        name = new_name("seg")
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)
            region = mmap.mmap(fd, nbytes)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        finally:
            os.close(fd)
        return cls(name, region)

    @classmethod
    def attach(cls, name: str, nbytes: int, unlink_it: bool = True) -> Segment:
        """Map a peer's segment and unlink it (see the module docstring).

        ``unlink_it`` False: a segment other peers map too (a mailbox), which its owner unlinks.
        """
        if not name.startswith(PREFIX) or "/" in name:
            raise OSError(f"not a ringcore segment name: {name!r}")
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            if os.fstat(fd).st_size != nbytes:
                raise OSError(f"segment {name} is {os.fstat(fd).st_size} bytes, expected {nbytes}")
            region = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
            if unlink_it:
                unlink(name)
        return cls(name, region)

    def close(self) -> None:
        """Drop this side's mapping (the memory goes when the peer's does too)."""
        self.bytes = None
        with contextlib.suppress(BufferError, ValueError):
            self.region.close()  # a view still exported (a ring not yet dropped) leaves it to the GC


def unlink(name: str) -> None:
    """Remove a segment's name if it is still there."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(SHM_DIR, name))


class Ring:
    """One direction of one channel: the slots one rank writes and its peer reads.

    Args:
        data: the ring's bytes in a mapped segment (``ring_bytes`` of :func:`layout`).
        slots, slot_bytes: as :func:`layout` gave them.
    """

    def __init__(self, data: np.ndarray, slots: int, slot_bytes: int) -> None:
        self.slots = slots
        self.slot_bytes = slot_bytes
        # Words as memoryviews of "Q": one aligned 8-byte load or store each, and reading one is
        # a fifth of numpy's cost; a header's fields go in and out with one struct call.
        words = memoryview(data[:CONTROL_BYTES]).cast("Q")
        self.released = words[0:1]  # written by the reader only
        self.reader_asleep = words[1:2]  # the reader's episode while it blocks, else 0
        self.writer_asleep = words[8:9]  # the writer's likewise, on its own cache line
        self.rung = 0  # the other side's last episode this side has rung for
        stride = SLOT_HEADER_BYTES + slot_bytes
        self.headers = [
            memoryview(data[CONTROL_BYTES + i * stride : CONTROL_BYTES + i * stride + 8 * HEADER_FIELDS])
            for i in range(slots)
        ]
        self.ready = [header.cast("Q")[0:1] for header in self.headers]
        start = CONTROL_BYTES + SLOT_HEADER_BYTES
        self.payloads = [
            memoryview(data[start + i * stride : start + i * stride + slot_bytes]) for i in range(slots)
        ]
        self.count = 0  # pieces this side has written (sender) or read (receiver)

    # -- the writer's side

    def room(self) -> bool:
        """Whether the next slot has been released by the reader."""
        return self.count - self.released[0] < self.slots

    def write(self, tag: int, signature: int, nbytes: int, offset: int, piece: memoryview) -> None:
        """Publish one piece of a frame in the next slot (call only when ``room()``)."""
        slot = self.count % self.slots
        length = piece.nbytes
        _FIELDS.pack_into(self.headers[slot], 8, tag, signature, nbytes, offset, length, 0)
        if length:
            self.payloads[slot][:length] = piece
        self.count += 1
        self.ready[slot][0] = self.count  # last: the piece is now the reader's

    def point(self, tag: int, signature: int, nbytes: int, offset: int, length: int, address: int) -> int:
        """Publish a piece whose bytes stay at ``address`` in this process; the count its release reaches."""
        slot = self.count % self.slots
        _FIELDS.pack_into(self.headers[slot], 8, tag, signature, nbytes, offset, length, address)
        self.count += 1
        self.ready[slot][0] = self.count
        return self.count

    def released_upto(self) -> int:
        """How many pieces the reader has released."""
        return self.released[0]

    def withdraw(self, count: int) -> None:
        """Take back piece ``count`` (as :meth:`point` returned it) if the reader has not released it."""
        ready = self.ready[(count - 1) % self.slots]
        if ready[0] == count and self.released[0] < count:
            ready[0] = 0

    def reader_waits(self) -> bool:
        """Whether the reader sleeps in an episode this writer has not rung for (then it must ring)."""
        episode = self.reader_asleep[0]
        if episode == 0 or episode == self.rung:
            return False
        self.rung = episode
        return True

    # -- the reader's side

    def peek(self) -> tuple[int, int, int, int, int, int] | None:
        """``(tag, signature, nbytes, offset, length, address)`` of the next piece, or None if not yet written."""
        slot = self.count % self.slots
        if self.ready[slot][0] != self.count + 1:
            return None
        return _FIELDS.unpack_from(self.headers[slot], 8)

    def still_published(self) -> bool:
        """Whether the next piece is still there, not withdrawn by its writer (after a copy from its memory)."""
        return self.ready[self.count % self.slots][0] == self.count + 1

    def take(self, into: memoryview | None, length: int) -> None:
        """Copy the next piece's payload into ``into`` (None: drop it) and release its slot."""
        slot = self.count % self.slots
        if into is not None and length:
            into[:length] = self.payloads[slot][:length]
        self.count += 1
        self.released[0] = self.count

    def lend(self, length: int) -> memoryview:
        """The next piece's payload where it lies; its slot stays the reader's until :meth:`release`."""
        slot = self.count % self.slots
        self.count += 1
        return self.payloads[slot][:length]

    def release(self) -> None:
        """Give back every slot read so far, lent ones included."""
        self.released[0] = self.count

    def writer_waits(self) -> bool:
        """Whether the writer sleeps (for a free slot) in an episode this reader has not rung for."""
        episode = self.writer_asleep[0]
        if episode == 0 or episode == self.rung:
            return False
        self.rung = episode
        return True

    def drop(self) -> None:
        """Forget the mapped views so the segment can be unmapped."""
        self.headers = []
        self.ready = []
        self.payloads = []
        self.released = self.reader_asleep = self.writer_asleep = memoryview(bytearray(8)).cast("Q")


class Doorbell:
    """This rank's FIFO in ``/dev/shm``, which local peers write a byte to to wake it (module docstring).

    Made like a segment (mode 0600, unguessable name, unlinked once every
    peer opened it). This rank holds it open read-write, so it never reads
    EOF whatever the writers do, and non-blocking, so draining stops at empty.
    """

    def __init__(self, name: str, fd: int) -> None:
        self.name = name
        self.fd = fd

    @classmethod
    def create(cls) -> Doorbell:
        """Make and open a fresh FIFO.

        Raises:
            OSError: ``/dev/shm`` is missing or does not allow it.
        """
        name = new_name("bell")
        path = os.path.join(SHM_DIR, name)
        os.mkfifo(path, 0o600)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_NOFOLLOW)
        except BaseException:
            unlink(name)
            raise
        return cls(name, fd)

    def drain(self) -> None:
        """Read every byte rung so far."""
        with contextlib.suppress(BlockingIOError):
            while len(os.read(self.fd, 4096)) == 4096:
                pass

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def open_bell(name: str) -> int:
    """Open a peer's doorbell for writing (non-blocking: a full FIFO already wakes its owner).

    Raises:
        OSError: not a ringcore FIFO, or gone.
    """
    if not name.startswith(PREFIX) or "/" in name:
        raise OSError(f"not a ringcore doorbell name: {name!r}")
    fd = os.open(os.path.join(SHM_DIR, name), os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    if not stat.S_ISFIFO(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{name} is not a FIFO")
    return fd


def ring_bell(fd: int) -> None:
    """Wake the owner of the doorbell ``fd``; a full FIFO will wake it anyway, a gone one is TCP's news."""
    with contextlib.suppress(BlockingIOError, BrokenPipeError):
        os.write(fd, b"\0")
