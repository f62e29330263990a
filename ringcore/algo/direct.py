"""The direct allreduce: on symmetric memory, each rank reduces its share from the peers' arrays.

Where every rank's buffer can be read and written by every other
(:mod:`ringcore.symmetric`), an allreduce needs no frames of data. With ``N``
ranks the elements are cut into ``N`` shares (:func:`shares`, on 64-byte
boundaries from the array's start: no two ranks write one cache line of an
aligned array), and rank ``r``::

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
slots or the kernel. Pushing beats pulling the peers' shares after a third
synchronisation by 2-3x at 1 MiB (N=2: 103 against 326 us per allreduce): the
lines a rank writes into a peer's buffer are the ones it has just read
there, while pulled lines sit modified in the other core's cache
(``bench/HISTORY.md``, "Symmetric memory").

The synchronisations are the barrier's steps, run by the caller
(:mod:`ringcore.plans.allreduce`) with its timeout and failure handling.
Every share is reduced once, by its owner, so all ranks end with the same
bits. A failure leaves the buffer undefined (a peer may pass sync 1 before
this rank notices that another died), and a peer still finishing its share,
or stopped and resumed, may write it into this rank's buffer after this rank
has raised: such an array is not to be reused.
"""

from __future__ import annotations

import itertools
from typing import Any

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


def reduce_and_push(mine: np.ndarray, peers: list[np.ndarray], lo: int, hi: int, reducer: Any) -> None:
    """Reduce ``[lo, hi)`` of every array into ``mine`` and copy it into every peer's, piece by piece.

    Each piece is pushed while it is still in this core's cache: against the
    whole share reduced and then pushed, 0.65-0.83x the time at N=2 4-64 MiB
    and 0.62-0.81x at N=4 4-16 MiB (``bench/HISTORY.md``, "Symmetric memory").
    """
    step = max(1, PIECE_BYTES // mine.itemsize)
    for start in range(lo, hi, step):
        end = min(hi, start + step)
        reduce_share(mine, peers, start, end, reducer)
        push_share(mine, peers, start, end)


def reduce_share(mine: np.ndarray, peers: list[np.ndarray], lo: int, hi: int, reducer: Any) -> None:
    """``mine[lo:hi] = op(mine, *peers)`` over ``[lo, hi)`` (avg's division once, with the last peer)."""
    acc = mine[lo:hi]
    last = len(peers) - 1
    for index, peer in enumerate(peers):
        reducer.combine(acc, acc, peer[lo:hi], final=index == last)


def push_share(mine: np.ndarray, peers: list[np.ndarray], lo: int, hi: int) -> None:
    """Copy this rank's reduced ``[lo, hi)`` into every peer's buffer."""
    for peer in peers:
        peer[lo:hi] = mine[lo:hi]
