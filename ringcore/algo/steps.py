"""Step types and the chunk / segment arithmetic every schedule shares.

Words, as Gloo uses them: a *chunk* is the part of a buffer one rank is
responsible for (N chunks, ``np.array_split`` boundaries); a *segment* is the
pipelined piece of a region that travels as one frame. Every region of a
schedule is cut into the same number of segments (``Schedule.segments``, by
one rule: :func:`segment_bounds`), so
segment ``k`` of step ``s`` depends only on segment ``k`` of earlier steps and
the executor can pipeline step ``s+1`` of segment ``k`` with step ``s`` of
segment ``k+1``.

A schedule names buffers, not arrays: ``USER`` is the caller's memory,
``WORK`` a scratch buffer of the same length in the wire dtype, ``STAGE`` a
second scratch for algorithms that receive a whole peer vector before
combining it (recursive doubling). USER is read-only, except in an in-place
schedule, which receives into it and reduces into it (a ``commit`` step). With
``RINGCORE_ATOMIC=1`` the executor first saves each such region's old values
into the same region of WORK and puts them back if the collective fails; see
:mod:`ringcore.algo.execute`.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math


class Buf(enum.IntEnum):
    """The buffers a schedule refers to."""

    USER = 0
    WORK = 1
    STAGE = 2


@dataclasses.dataclass(frozen=True)
class Region:
    """``count`` elements of buffer ``buf`` starting at element ``start``."""

    buf: Buf
    start: int
    count: int

    def segment(self, k: int, segments: int, ramp: int = 0) -> Region:
        """Segment ``k`` of ``segments`` (see :func:`segment_bounds`)."""
        start, count = segment_bounds(self.count, segments, ramp, k)
        return Region(self.buf, self.start + start, count)


@dataclasses.dataclass(frozen=True)
class Step:
    """What one rank does in one step: send, receive, then combine what it received.

    Attributes:
        send_peer / send: a region to send to a peer.
        recv_peer / recv: a region to receive from a peer (always WORK or STAGE).
        reduce: ``(dst, a, b)``: after the receive, ``dst = op(a, b)``.
        final: the reduce yields final values (``avg`` divides by the world size).
        whole: not pipelined: one frame for the whole step, sent (and received,
            unless empty) after every segment of the earlier steps is done
            (acknowledgements, barriers, halving-doubling's nested halves).
        phase: the step number written in frame tags; sender and receiver of a
            frame use the same phase even when their step lists differ.
        label: what the step is part of, for the timeline (``"scatter-reduce"``...).
        commit: the reduce's result goes to the same region of USER, whose old
            values move to WORK as a backup (in-place allreduce).
        alongside: the step is independent of the one before it (and of every
            step that one runs alongside): it reads and writes none of their
            regions. It then waits only for the steps before that group, and
            a connection carries the group's segments interleaved (segment k
            of each step, then k+1), so a later step that needs segment k of
            all of them can start after k+1 segments, not after whole steps
            (the hierarchical allreduce's local steps, one per block).
    """

    send_peer: int | None = None
    send: Region | None = None
    recv_peer: int | None = None
    recv: Region | None = None
    reduce: tuple[Region, Region, Region] | None = None
    final: bool = False
    whole: bool = False
    phase: int = 0
    label: str = ""
    commit: bool = False
    alongside: bool = False


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A rank's steps for one collective, and where its result ends up (``None``: unchanged)."""

    steps: tuple[Step, ...]
    segments: int
    result: Region | None
    prefill_work: bool = False  # WORK must hold this rank's input (in the wire dtype) before the run
    ramp: int = 0  # short segments at each end of every region (see segment_bounds)
    # writes the caller's buffer before every rank's frames (and so its signature) reached this rank:
    # a mismatch found later leaves partial sums there (the hierarchical allreduce in place)
    early_user: bool = False

    @functools.cached_property
    def buffers(self) -> set[Buf]:
        used: set[Buf] = set()
        for step in self.steps:
            for region in (step.send, step.recv, *(step.reduce or ())):
                if region is not None:
                    used.add(region.buf)
        return used

    @functools.cached_property
    def scratch(self) -> tuple[Buf, ...]:
        """The buffers besides USER that the steps use, which the caller must provide."""
        return tuple(sorted(self.buffers - {Buf.USER}))


def split_bounds(count: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, length)`` of part ``index`` when ``count`` items are split into ``parts``."""
    base, extra = divmod(count, parts)
    return index * base + min(index, extra), base + (1 if index < extra else 0)


def segment_bounds(count: int, segments: int, ramp: int, index: int) -> tuple[int, int]:
    """``(start, length)`` of segment ``index`` of ``segments`` in a ``count``-element region.

    Without a ramp, equal segments (``np.array_split`` rule: the first ones
    are longer). With ``ramp`` r, the first r segments grow by fours up to
    the others' length and the last r shrink the same way (r=2, five
    segments or more: 1/16 and 1/4 of a middle segment at each end). A
    schedule whose first hop waits for work on segment 0 (the hierarchical
    allreduce: a local round before the link can start) gets its links busy
    sooner, and one whose last segment needs work after it arrives ends
    sooner; the segments in between stay long, so a region gets 2r more
    segments where equal short ones would multiply their number (and the
    Python spent per segment). Regions of one length are always cut alike,
    so segment ``k`` of a step still depends only on segment ``k`` of the
    steps before.
    """
    if not ramp:
        return split_bounds(count, segments, index)
    total = _ramp_weight_before(segments, segments, ramp)
    start = count * _ramp_weight_before(index, segments, ramp) // total
    return start, count * _ramp_weight_before(index + 1, segments, ramp) // total - start


def _ramp_weight_before(index: int, segments: int, ramp: int) -> int:
    """The summed weights of segments ``[0, index)``; segment ``i`` weighs ``4 ** min(i, segments-1-i, ramp)``."""
    if segments <= 2 * ramp:  # short: ends that meet
        return sum(4 ** min(i, segments - 1 - i, ramp) for i in range(index))
    head = min(index, ramp)
    middle = max(0, min(index, segments - ramp) - ramp)
    tail = max(0, index - (segments - ramp))  # of the last ramp segments, weights 4**(ramp-1) down
    return (4**head - 1) // 3 + middle * 4**ramp + (4**ramp - 4 ** (ramp - tail)) // 3


def chunk_bounds(count: int, parts: int) -> list[tuple[int, int]]:
    """All ``(start, length)`` pairs of an ``np.array_split`` of ``count`` items."""
    return [split_bounds(count, parts, i) for i in range(parts)]


def segment_count(largest_region: int, itemsize: int, segment_bytes: int) -> int:
    """How many segments the largest region needs so none exceeds ``segment_bytes``."""
    return max(1, math.ceil(largest_region * itemsize / max(1, segment_bytes)))
