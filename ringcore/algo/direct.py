"""The direct allreduce: each rank reduces its share from the peers' buffers and writes it into theirs.

Where every rank can read and write every other's buffer, an allreduce needs
no frames of data. A peer's buffer is a :class:`Peer`, reached one of two
ways: :class:`Mapped` (symmetric memory, :mod:`ringcore.symmetric`: loads and
stores) or through the kernel (any buffer of a process on this host:
``process_vm_readv`` into a piece of scratch, ``process_vm_writev`` back,
:class:`ringcore.plans.direct.Remote`).
With ``N`` ranks the elements are cut into ``N`` shares (:func:`shares`, on
64-byte boundaries from the array's start: no two ranks write one cache line
of an aligned array), and rank ``r``::

    sync 1   every rank's buffer holds its input
    reduce   mine[share r] = op(mine[share r], every peer's [share r])   } piece by piece,
    push     every peer's [share r] = mine[share r]                      } 256 KiB each
    sync 2   every share is in every buffer; nobody touches this rank's any more

Share ``r`` of any buffer is read or written by rank ``r`` alone between the
two synchronisations (the owner of a buffer touches only its own share), so
pushing needs no synchronisation after the reduce: rank ``r`` overwrites a
peer's input in share ``r`` only once it has read it. Per rank that is one
pass over its share reading all ``N`` inputs, and ``N-1`` copies of it: the
memory traffic of a ring's data alone, without the ring's copies through
slots. Pushing beats pulling the peers' shares after a third
synchronisation: on symmetric memory by 2-3x at 1 MiB (N=2: 103 against 326
us per allreduce), through the kernel by 1.1-1.5x from 1 to 64 MiB: the lines
a rank writes into a peer's buffer are the ones it has just read and reduced,
while pulled lines sit modified in the other core's cache (``bench/HISTORY.md``,
"Symmetric memory", "Ordinary buffers go direct").

The synchronisations, and the agreement that every rank's memory allows it,
are the caller's (:mod:`ringcore.plans.direct`), with the timeout, failure
handling, and the words that keep a rank from writing into a buffer whose
owner has returned. Every share is reduced once, by its owner, so all ranks
end with the same bits. A failure leaves the buffer undefined (a peer may pass
sync 1 before this rank notices that another died).
"""

from __future__ import annotations

import itertools
from typing import Any, Protocol

import numpy as np

ALIGN_BYTES = 64
PIECE_BYTES = 256 * 1024  # a share is reduced and pushed piece by piece, each piece still in L2


def shares(count: int, size: int, itemsize: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` element bounds of each rank's share: nearly equal, each starting a multiple of 64 bytes in."""
    step = max(1, ALIGN_BYTES // itemsize)
    units = -(-count // step)
    cuts = [min(count, (units * rank // size) * step) for rank in range(size + 1)]
    cuts[-1] = count
    return list(itertools.pairwise(cuts))


class Mapped:
    """A peer's array mapped into this process (symmetric memory): read and written in place."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def read(self, lo: int, hi: int) -> np.ndarray:
        return self.array[lo:hi]

    def write(self, mine: np.ndarray, lo: int, hi: int) -> None:
        self.array[lo:hi] = mine[lo:hi]


class Peer(Protocol):
    """A peer's buffer as the route reaches it: :class:`Mapped` here, or through the kernel
    (:class:`ringcore.plans.direct.Remote`)."""

    def read(self, lo: int, hi: int) -> np.ndarray: ...

    def write(self, mine: np.ndarray, lo: int, hi: int) -> None: ...


def reduce_and_push(mine: np.ndarray, peers: list[Peer], lo: int, hi: int, reducer: Any) -> None:
    """Reduce ``[lo, hi)`` of every array into ``mine`` and copy it into every peer's, piece by piece.

    Each piece is pushed while it is still in this core's cache: against the
    whole share reduced and then pushed, 0.65-0.83x the time at N=2 4-64 MiB
    and 0.62-0.81x at N=4 4-16 MiB (``bench/HISTORY.md``, "Symmetric memory").
    A peer reached through the kernel reads its pieces into scratch of ``PIECE_BYTES``.
    """
    step = max(1, PIECE_BYTES // mine.itemsize)
    for start in range(lo, hi, step):
        end = min(hi, start + step)
        reduce_share(mine, peers, start, end, reducer)
        push_share(mine, peers, start, end)


def reduce_share(mine: np.ndarray, peers: list[Peer], lo: int, hi: int, reducer: Any) -> None:
    """``mine[lo:hi] = op(mine, *peers)`` over ``[lo, hi)`` (avg's division once, with the last peer)."""
    acc = mine[lo:hi]
    last = len(peers) - 1
    for index, peer in enumerate(peers):
        reducer.combine(acc, acc, peer.read(lo, hi), final=index == last)


def push_share(mine: np.ndarray, peers: list[Peer], lo: int, hi: int) -> None:
    """Copy this rank's reduced ``[lo, hi)`` into every peer's buffer."""
    for peer in peers:
        peer.write(mine, lo, hi)
