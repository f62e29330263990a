"""Pipelined chain broadcast along the ring, and the dissemination barrier.

Broadcast, theory of operation. Ranks form a chain root, root+1, ..., root-1
(or an order given, host by host on a job of several hosts).
The root sends its buffer in segments to root+1; every other rank receives
each segment into WORK and forwards it to its right neighbour as soon as it
has arrived, so all links carry data at once after a short fill. Then a
zero-byte acknowledgement travels back from the last rank to the root, each
rank passing it on only after it has received its own. So no rank returns
before every rank has received everything, and every frame was checked
against the collective's signature on the way: if any rank disagrees, every
rank fails, none returns early with a result.

Cost: N-1+segments-1 segment times for the data, N-1 empty hops for the
acknowledgement; each rank sends and receives the buffer once (busbw factor 1).

Barrier (dissemination): in round k rank r sends an empty frame to r+2^k and
receives one from r-2^k; after ceil(log2 N) rounds every rank has heard,
directly or not, from all others.
"""

from __future__ import annotations

import functools

from ringcore.algo.ring import neighbours
from ringcore.algo.steps import Buf, Region, Schedule, Step, segment_count

_EMPTY = Region(Buf.WORK, 0, 0)


@functools.lru_cache(maxsize=256)
def broadcast(
    rank: int,
    size: int,
    root: int,
    count: int,
    itemsize: int,
    segment_bytes: int,
    order: tuple[int, ...] | None = None,
) -> Schedule:
    """Chain broadcast from ``root``; non-roots' result is WORK, the root's is unchanged.

    ``order``: the chain, starting at ``root`` (default root, root+1, ...;
    :func:`ringcore.algo.hierarchical.chain_order` visits hosts one by one).
    """
    if size == 1:
        return Schedule((), 1, None)
    if order is None:
        left, right = neighbours(rank, size)
        position = (rank - root) % size
    else:
        position = order.index(rank)
        left, right = order[position - 1], order[(position + 1) % size]
    segments = segment_count(count, itemsize, segment_bytes)
    data = Region(Buf.WORK, 0, count)
    steps: list[Step] = []
    if position == 0:
        steps.append(Step(right, Region(Buf.USER, 0, count), phase=0, label="broadcast"))
    else:
        steps.append(Step(recv_peer=left, recv=data, phase=0, label="broadcast"))
        if position < size - 1:
            steps.append(Step(right, data, phase=0, label="broadcast"))
    if position < size - 1:
        steps.append(Step(recv_peer=right, recv=_EMPTY, whole=True, phase=1, label="acknowledge"))
    if position > 0:
        steps.append(Step(left, _EMPTY, whole=True, phase=1, label="acknowledge"))
    return Schedule(tuple(steps), segments, None if position == 0 else data)


@functools.lru_cache(maxsize=256)
def barrier(rank: int, size: int) -> Schedule:
    """Dissemination barrier: ceil(log2 N) rounds of empty frames."""
    return Schedule(tuple(dissemination(rank, tuple(range(size)))), 1, None)


def dissemination(rank: int, members: tuple[int, ...], first_phase: int = 0) -> list[Step]:
    """The dissemination rounds among ``members`` (``rank`` one of them), phases from ``first_phase``.

    In round k the member at position p sends an empty frame to the one at
    p+2^k and receives one from p-2^k.
    """
    size, position = len(members), members.index(rank)
    steps = []
    distance, phase = 1, first_phase
    while distance < size:
        steps.append(
            Step(
                members[(position + distance) % size],
                _EMPTY,
                members[(position - distance) % size],
                _EMPTY,
                whole=True,
                phase=phase,
                label="barrier",
            )
        )
        distance, phase = distance * 2, phase + 1
    return steps
