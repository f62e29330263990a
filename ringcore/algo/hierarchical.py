"""Hierarchical allreduce: inside each host, across hosts, inside each host again.

Theory of operation, for H hosts of L ranks each (``grid[h][l]`` is the rank
with local rank ``l`` on host ``h``), as Horovod's hierarchical allreduce and
NCCL's tree-of-rings do, but with every local rank on the network at once:

1. Local reduce-scatter: a ring among the L ranks of each host over the L
   *chunks* of the buffer. Afterwards local rank ``l`` holds chunk ``l``
   summed over its host, in WORK.
2. Cross-host allreduce of chunk ``l``: a ring among the H ranks with local
   rank ``l`` (one per host), over the H *blocks* of that chunk: a
   scatter-reduce (each receive lands in STAGE and is added into WORK; the
   last add is ``final``: avg divides there, once) and an allgather. The L
   rings of a host run at the same time, so each host's link carries
   ``2 (H-1)/H`` of the buffer each way, where a flat ring of L*H ranks puts
   ``2 (LH-1)/LH`` of it on the one ring edge that leaves each host (at 4
   hosts x 2 ranks: 1.5 against 1.75 buffers, 0.86x the time on a link-bound
   cluster).
3. Local allgather: a ring among the L ranks of each host spreads the chunks.

Every region is a block: the buffer is cut into L chunks and each chunk into H
blocks (``np.array_split`` boundaries), and a local step over a chunk is H
steps, one per block. So all regions of the schedule have (nearly) the same
length, every region is cut into the same number of segments, and segment
``k`` of a step depends only on segment ``k`` of earlier steps, which the
pipelined executor needs (:mod:`ringcore.algo.steps`): the local steps
pipeline with the cross-host ones.

STAGE holds only this rank's chunk (its regions are offset by the chunk's
first element), so the pages it touches are ``1/L`` of the buffer. Every
element's final value is computed by one rank and copied to the others, so
all ranks end bit-identical. The result is all of WORK.

Cost per rank: 2(L-1)H + 2(H-1) steps; (L-1)/L of the buffer sent twice over
the host's shared memory or loopback, 2(H-1)/(HL) of it over the network.
Where it is used: :func:`ringcore.slicing.allreduce_schedule`.
"""

from __future__ import annotations

import functools

from ringcore.algo.steps import Buf, Region, Schedule, Step, chunk_bounds, segment_count

Grid = tuple[tuple[int, ...], ...]  # grid[host][local rank] = rank


def locate(grid: Grid, rank: int) -> tuple[int, int]:
    """``(host, local rank)`` of ``rank`` in ``grid``."""
    for host, ranks in enumerate(grid):
        if rank in ranks:
            return host, ranks.index(rank)
    raise ValueError(f"rank {rank} is not in the host grid {grid}")


@functools.lru_cache(maxsize=256)
def allreduce(rank: int, grid: Grid, count: int, itemsize: int, segment_bytes: int) -> Schedule:
    """Hierarchical allreduce of ``count`` elements over ``grid``; the result is all of WORK."""
    hosts, local = len(grid), len(grid[0])
    host, me = locate(grid, rank)
    chunks = chunk_bounds(count, local)
    blocks = [[(first + start, n) for start, n in chunk_bounds(size, hosts)] for first, size in chunks]
    mine = chunks[me][0]  # STAGE regions are offset by this rank's chunk start

    def block(buf: Buf, chunk: int, j: int) -> Region:
        start, n = blocks[chunk % local][j % hosts]
        return Region(buf, start - mine if buf == Buf.STAGE else start, n)

    left, right = grid[host][(me - 1) % local], grid[host][(me + 1) % local]
    up, down = grid[(host - 1) % hosts][me], grid[(host + 1) % hosts][me]
    steps: list[Step] = []
    for s in range(local - 1):  # 1. reduce-scatter inside the host, block by block
        sent, got = me - s - 1, me - s - 2
        for j in range(hosts):
            partial = block(Buf.WORK, got, j)
            steps.append(
                Step(
                    right,
                    block(Buf.USER if s == 0 else Buf.WORK, sent, j),
                    left,
                    partial,
                    reduce=(partial, partial, block(Buf.USER, got, j)),
                    phase=len(steps),
                    label="local reduce-scatter",
                )
            )
    for s in range(hosts - 1):  # 2a. reduce-scatter of this rank's chunk across hosts
        sent, got = host - s - 1, host - s - 2
        own = block(Buf.WORK, me, got)
        steps.append(
            Step(
                down,
                block(Buf.WORK, me, sent),
                up,
                block(Buf.STAGE, me, got),
                reduce=(own, block(Buf.STAGE, me, got), own),
                final=s == hosts - 2,
                phase=len(steps),
                label="cross reduce-scatter",
            )
        )
    for t in range(hosts - 1):  # 2b. allgather of this rank's chunk across hosts
        steps.append(
            Step(
                down,
                block(Buf.WORK, me, host - t),
                up,
                block(Buf.WORK, me, host - t - 1),
                phase=len(steps),
                label="cross allgather",
            )
        )
    for t in range(local - 1):  # 3. allgather inside the host
        for j in range(hosts):
            steps.append(
                Step(
                    right,
                    block(Buf.WORK, me - t, j),
                    left,
                    block(Buf.WORK, me - t - 1, j),
                    phase=len(steps),
                    label="local allgather",
                )
            )
    largest = max(n for row in blocks for _, n in row)
    return Schedule(tuple(steps), segment_count(largest, itemsize, segment_bytes), Region(Buf.WORK, 0, count))


def applies(grid: Grid | None, count: int) -> bool:
    """Whether ``grid`` has several hosts of several ranks each, and every block of ``count`` an element."""
    return grid is not None and len(grid) > 1 and len(grid[0]) > 1 and count >= len(grid) * len(grid[0])
