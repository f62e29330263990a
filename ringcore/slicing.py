"""Slices, each collective's choice of schedule, and what a failed slice leaves: shared by host and GPU plans.

Large buffers. Scratch (WORK, STAGE) is as long as what one schedule
reduces, so an allreduce or broadcast of more than ``RINGCORE_SLICE_BYTES``
runs as a sequence of complete collectives over equal slices
(:func:`slice_bounds`, tags numbered by slice), which bounds scratch memory
by the slice (an allreduce's slice: :func:`allreduce_slice_bytes`; on the
host the bound counts the pages touched, while GPU pools hold a whole slice
of each buffer the schedule uses). Host and GPU plans (:mod:`ringcore.plans`,
:mod:`ringcore.plans.device`) take the same slices and the same schedule for
each (:func:`allreduce_schedule`), so host and GPU ranks share a ring at
every size. A failure in slice k leaves the slices before it reduced and
those after it untouched, and the error's note says so (:func:`note_failure`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ringcore.algo import broadcast as chain
from ringcore.algo import halving_doubling, hierarchical, recursive_doubling, ring
from ringcore.algo.steps import Buf, Schedule
from ringcore.buffers import Buffer
from ringcore.errors import MismatchError

if TYPE_CHECKING:
    from ringcore.context import Context


def allreduce_schedule(
    ctx: Context, count: int, itemsize: int, in_place: bool, sliced: bool = False
) -> Schedule:
    """The allreduce algorithm for ``count`` elements (a slice of a larger buffer when ``sliced``).

    As Gloo and NCCL do, by size: recursive doubling for small buffers
    (latency); on a job of several hosts with several ranks each (the
    same number on every host), the hierarchical allreduce
    (:mod:`ringcore.algo.hierarchical`) unless ``RINGCORE_HIERARCHICAL=0``;
    halving-doubling on a world of 4 or more up to
    ``RINGCORE_HALVING_BYTES`` (a quarter of it when ranks past the largest
    power of two fold in, see ``halving_doubling.byte_limit``): the ring's
    bytes in 2 log2(N) unpipelined steps instead of 2(N-1), so fewer waits on
    peers (measured: ``bench/HISTORY.md``, "Halving-doubling for mid-sized
    allreduces"); the pipelined ring for the rest, and for every slice of a
    sliced buffer.
    ``in_place`` (WORK in the caller's dtype) makes the ring, and
    halving-doubling and the hierarchical allreduce unless
    ``RINGCORE_ATOMIC=1``, write the result straight into the caller's buffer.
    Halving-doubling is also kept to buffers whose largest frame (half the
    buffer, all of it with extras) fits twice in ``RINGCORE_GPU_STAGING_BYTES``:
    GPU ranks stage whole frames through pinned slots, and pinned memory must
    stay at that size per connection.
    The choice depends only on the layout and on settings every rank shares
    (``bootstrap`` checks them at init), never on the buffer's device: host
    and GPU ranks can share a collective.
    """
    settings = ctx.settings
    nbytes = count * itemsize
    if nbytes <= settings.small_bytes or count < ctx.size:
        return recursive_doubling.allreduce(ctx.rank, ctx.size, count, itemsize, settings.segment_size())
    if settings.hierarchical and hierarchical.applies(ctx.grid):
        segment_bytes = settings.segment_size(wide=ctx.wide_segments)
        return hierarchical.allreduce(  # type: ignore[arg-type]
            ctx.rank, ctx.grid, count, itemsize, segment_bytes, in_place and not settings.atomic
        )
    if (
        not sliced
        and nbytes <= halving_doubling.byte_limit(ctx.size, settings.halving_bytes)
        and halving_doubling.largest_frame(ctx.size, count) * itemsize * 2 <= settings.gpu_staging_bytes
        and halving_doubling.applies(ctx.size, count)
    ):
        return halving_doubling.allreduce(ctx.rank, ctx.size, count, in_place and not settings.atomic)
    # Compressed rings (not in place) convert every segment on its way out: small segments
    # overlap those casts with the wire (measured: bench/HISTORY.md, "Loopback after plan reuse and 2 MiB
    # segments on crowded hosts").
    segment_bytes = settings.segment_size(
        wide=ctx.wide_segments and in_place, whole_chunk=ctx.cache_slices and in_place
    )
    return ring.allreduce(ctx.rank, ctx.size, count, itemsize, segment_bytes, in_place)


def broadcast_schedule(ctx: Context, root: int, count: int, itemsize: int) -> Schedule:
    """The broadcast chain for host and GPU buffers alike: host by host on a job of several hosts."""
    order = None
    if ctx.settings.hierarchical and hierarchical.applies(ctx.grid):
        order = hierarchical.chain_order(ctx.grid, root)  # type: ignore[arg-type]
    return chain.broadcast(ctx.rank, ctx.size, root, count, itemsize, ctx.settings.segment_size(), order)


def gather_schedule(ctx: Context, kind: str, chunks: tuple[tuple[int, int], ...], itemsize: int) -> Schedule:
    """The ring, or on a job of several multi-rank hosts above ``RINGCORE_SMALL_BYTES``, the hierarchy.

    Both halves of :mod:`ringcore.algo.hierarchical` take the caller's chunks
    as blocks, so the result lands where the ring's does.
    """
    segment_bytes = ctx.settings.segment_size()
    nbytes = sum(n for _, n in chunks) * itemsize
    if ctx.settings.hierarchical and hierarchical.applies(ctx.grid) and nbytes > ctx.settings.small_bytes:
        make = hierarchical.allgather if kind == "allgather" else hierarchical.reduce_scatter
        return make(ctx.rank, ctx.grid, chunks, itemsize, segment_bytes)  # type: ignore[arg-type]
    make = ring.allgather if kind == "allgather" else ring.reduce_scatter
    return make(ctx.rank, ctx.size, chunks, itemsize, segment_bytes)


def allreduce_slice_bytes(ctx: Context, in_place: bool) -> int:
    """Wire bytes per slice of an allreduce (``in_place``: WORK in the caller's dtype); equal on every rank.

    ``ctx.allreduce_slice_bytes`` bounds the scratch a slice touches. The
    hierarchical allreduce in place touches (L-1)/L of its slice (STAGE for
    this rank's column, WORK for the local rounds before the last; L ranks a
    host), so its slices are L/(L-1) times as long for the same bound: at 2
    ranks a host a 64 MiB allreduce is one slice, not two, and no host's link
    idles at a slice's end while the one before it drains (``bench/HISTORY.md``,
    "Half the hierarchical scratch"). ``RINGCORE_SLICE_BYTES`` is taken as set.
    """
    settings = ctx.settings
    bound = ctx.allreduce_slice_bytes
    if (
        settings.slice_bytes is None
        and in_place
        and not settings.atomic
        and settings.hierarchical
        and hierarchical.applies(ctx.grid)
    ):
        local = len(ctx.grid[0])  # type: ignore[index]
        return bound * local // (local - 1)
    return bound


def slice_bounds(count: int, slice_bytes: int, wire_itemsize: int) -> list[tuple[int, int]]:
    """``(first element, count)`` of each slice of a ``count``-element buffer (see :func:`_slices`)."""
    limit = max(1, slice_bytes // wire_itemsize)
    if count <= limit:
        return [(0, count)]
    per_slice = -(-count // -(-count // limit))  # equal slices: no short last one
    return [(start, min(per_slice, count - start)) for start in range(0, count, per_slice)]


def buffer_slices(buffer: Buffer, slice_bytes: int, wire_itemsize: int) -> list[tuple[int, Buffer]]:
    """``(first element, piece)`` per slice whose scratch fits ``slice_bytes`` (one piece if all fits).

    Scratch is in the wire dtype (half the caller's bytes with fp16
    compression), and it follows the slice, not the buffer: a 1 GiB allreduce
    needs one slice's worth.
    """
    bounds = slice_bounds(buffer.count, slice_bytes, wire_itemsize)
    if len(bounds) == 1:
        return [(0, buffer)]
    return [
        (start, dataclasses.replace(buffer, array=buffer.array[start : start + count]))
        for start, count in bounds
    ]


def writes_user(schedule: Schedule) -> bool:
    """Whether the executor writes the caller's buffer while it runs (the in-place ring)."""
    return bool(schedule.steps) and schedule.result is not None and schedule.result.buf == Buf.USER


@contextlib.contextmanager
def failure_note(start: int, exposed: int, count: int) -> Iterator[None]:
    """On failure, note which of the buffer's ``count`` elements hold what (see :func:`note_failure`)."""
    try:
        yield
    except BaseException as err:
        note_failure(err, start, exposed, count)
        raise


SLICES_WHY = "large buffers are reduced slice by slice, RINGCORE_SLICE_BYTES"


def note_failure(
    err: BaseException, start: int, exposed: int, count: int, why: str = SLICES_WHY, early: bool = False
) -> None:
    """Add notes to ``err`` saying which of the buffer's ``count`` elements hold what.

    ``start``: earlier slices (or pieces: ``why`` says which) are done; ``exposed``: how many
    elements from ``start`` on the failed run may have written (0 when it writes only after
    success, or with ``RINGCORE_ATOMIC=1``); the rest are untouched. Ranks
    that disagree fail before any reduced data reaches the buffer, except where the run wrote
    it ``early`` (``Schedule.early_user``: before every rank's frames reached this one).
    """
    if isinstance(err, MismatchError) and not early:
        exposed = 0
    if start:
        err.add_note(f"ringcore: elements [0, {start}) of {count} already hold the result ({why})")
    if exposed:
        err.add_note(
            f"ringcore: elements [{start}, {start + exposed}) of {count} may hold partial sums "
            "(set RINGCORE_ATOMIC=1 to have a failed allreduce restore them)"
        )
    if (start or exposed) and start + exposed < count:
        err.add_note("ringcore: the other elements are untouched")
