"""Ring allreduce = scatter-reduce then allgather, pipelined in segments.

Theory of operation. The buffer is cut into N chunks (``np.array_split``
boundaries); rank r sends to r+1 and receives from r-1.

* Scatter-reduce, steps s = 0..N-2: send chunk (r-s-1), receive chunk
  (r-s-2) into WORK and combine it with the caller's own values of that chunk.
  Step 0 sends straight from the caller's buffer; later steps forward what the
  previous step reduced. After N-1 steps rank r holds chunk r fully reduced
  (the last combine is ``final``: avg divides there, once).
* Allgather, steps t = 0..N-2: send chunk (r-t), receive chunk (r-t-1) into
  WORK, and forward it at the next step. In place (no compression), the final
  reduce moves chunk r into the caller's buffer and the allgather receives
  into it directly, saving a full copy after the last byte arrives; what it
  overwrites is backed up in WORK, whose partial sums are dead by then.

Each chunk is cut into ``segments`` pieces; segment k of step s+1 is sent as
soon as segment k of step s is reduced, so receiving segment k+1 overlaps
reducing segment k and sending it on.

Cost per rank: 2(N-1) steps; 2(N-1)/N of the buffer sent and received;
(N-1)/N of it combined. Reduce-scatter and allgather are the two halves
(N-1 steps, (N-1)/N of the buffer each).
"""

from __future__ import annotations

import functools

from ringcore.algo.steps import Buf, Region, Schedule, Step, chunk_bounds, segment_count

Chunks = tuple[tuple[int, int], ...]  # (start, count) per rank; a tuple so schedules can be memoized


def neighbours(rank: int, size: int) -> tuple[int, int]:
    """``(left, right)``: where this rank receives from and sends to."""
    return (rank - 1) % size, (rank + 1) % size


def scatter_reduce_steps(rank: int, size: int, chunks: Chunks, commit: bool = False) -> list[Step]:
    """N-1 steps after which rank r holds chunk r reduced over all ranks, in WORK (USER with ``commit``)."""
    left, right = neighbours(rank, size)
    steps = []
    for s in range(size - 1):
        send_chunk, recv_chunk = (rank - s - 1) % size, (rank - s - 2) % size
        source = Region(Buf.USER if s == 0 else Buf.WORK, *chunks[send_chunk])
        partial = Region(Buf.WORK, *chunks[recv_chunk])
        own = Region(Buf.USER, *chunks[recv_chunk])
        steps.append(
            Step(
                right,
                source,
                left,
                partial,
                reduce=(partial, partial, own),
                final=s == size - 2,
                phase=s,
                label="scatter-reduce",
                commit=commit and s == size - 2,
            )
        )
    return steps


def allgather_steps(
    rank: int, size: int, chunks: Chunks, first_phase: int = 0, buf: Buf = Buf.WORK
) -> list[Step]:
    """N-1 steps that spread every rank's chunk r (in ``buf``) to all ranks' ``buf``."""
    left, right = neighbours(rank, size)
    steps = []
    for t in range(size - 1):
        send_chunk, recv_chunk = (rank - t) % size, (rank - t - 1) % size
        steps.append(
            Step(
                right,
                Region(buf, *chunks[send_chunk]),
                left,
                Region(buf, *chunks[recv_chunk]),
                phase=first_phase + t,
                label="allgather",
            )
        )
    return steps


@functools.lru_cache(maxsize=256)
def allreduce(
    rank: int, size: int, count: int, itemsize: int, segment_bytes: int, in_place: bool = False
) -> Schedule:
    """Ring allreduce of ``count`` elements; the result is all of WORK, or USER ``in_place``.

    In place (only when WORK has the caller's dtype: no compression), the
    allgather receives straight into the caller's buffer, so no final copy
    follows the last byte; the executor backs up what it overwrites.
    """
    if size == 1:
        return Schedule((), 1, Region(Buf.USER, 0, count))
    chunks = tuple(chunk_bounds(count, size))
    target = Buf.USER if in_place else Buf.WORK
    steps = scatter_reduce_steps(rank, size, chunks, commit=in_place)
    steps += allgather_steps(rank, size, chunks, size - 1, buf=target)
    segments = segment_count(max(n for _, n in chunks), itemsize, segment_bytes)
    return Schedule(tuple(steps), segments, Region(target, 0, count))


@functools.lru_cache(maxsize=256)
def reduce_scatter(rank: int, size: int, chunks: Chunks, itemsize: int, segment_bytes: int) -> Schedule:
    """Ring reduce-scatter; the result is this rank's chunk of WORK."""
    if size == 1:
        return Schedule((), 1, Region(Buf.USER, *chunks[0]))
    segments = segment_count(max(n for _, n in chunks), itemsize, segment_bytes)
    steps = tuple(scatter_reduce_steps(rank, size, chunks))
    return Schedule(steps, segments, Region(Buf.WORK, *chunks[rank]))


@functools.lru_cache(maxsize=256)
def allgather(rank: int, size: int, chunks: Chunks, itemsize: int, segment_bytes: int) -> Schedule:
    """Ring allgather over WORK, which must already hold this rank's chunk."""
    segments = segment_count(max(n for _, n in chunks), itemsize, segment_bytes)
    total = sum(n for _, n in chunks)
    return Schedule(tuple(allgather_steps(rank, size, chunks)), segments, Region(Buf.WORK, 0, total))
