"""Allreduce and broadcast on device buffers: the host plans' steps, with device arrays and staging.

The slices and schedules are the host ones (same slices, same choice of ring
or recursive doubling, same segments), so a mixed ring of host and device
ranks agrees bit for bit at every size.
Differences: WORK and STAGE live in device memory (per communicator, reused),
the kernels are the device layer's, the executor is the staged one, and the
collective waits for the buffer's producer stream before reading it and for
its own streams before returning (so the result is complete, as for host
buffers).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ringcore.algo.steps import Buf
from ringcore.buffers import Buffer
from ringcore.descriptor import Descriptor
from ringcore.ops import Compression, ReduceOp
from ringcore.slicing import (
    allreduce_schedule,
    allreduce_slice_bytes,
    broadcast_schedule,
    failure_note,
    note_failure,
    slice_bounds,
    writes_user,
)

if TYPE_CHECKING:
    from ringcore.context import Context


def allreduce(ctx: Context, desc: Descriptor, buffer: Buffer, op: ReduceOp, comp: Compression) -> None:
    """In-place allreduce of a device buffer (``ctx.size > 1``), in the host plan's slices.

    The slices, each slice's schedule and its tags are the host plan's
    (:mod:`ringcore.slicing`), so host and device ranks share a ring at every
    size, and device scratch is a slice of each buffer the schedule uses (WORK
    and STAGE; STAGE alone for the in-place hierarchical allreduce at two ranks a
    host, whose slices are L/(L-1) times as long: ``slicing.allreduce_slice_bytes``).
    """
    dev = ctx.device_context()
    user = dev.layer.wrap(buffer)  # first: it tells the layer which GPU this process uses
    with dev.layer.context():
        dev.layer.after_producer(dev.staging.compute, buffer)
        reducer = dev.reducer(buffer.dtype, op, comp)
        in_place = reducer.wire_dtype == buffer.dtype.storage
        itemsize = reducer.wire_dtype.itemsize
        bounds = slice_bounds(buffer.count, allreduce_slice_bytes(ctx, in_place), itemsize)
        for part, (start, count) in enumerate(bounds):
            piece = user[start : start + count]
            schedule = allreduce_schedule(ctx, count, itemsize, in_place, sliced=len(bounds) > 1)
            arrays = dev.scratch_arrays(schedule, piece, reducer.wire_dtype)
            if schedule.prefill_work:
                reducer.convert(arrays[Buf.WORK], piece)
            try:
                ctx.execute(desc, schedule, arrays, reducer, sub=part, staging=dev.staging)
            except BaseException as err:
                exposed = count if writes_user(schedule) and not ctx.settings.atomic else 0
                note_failure(err, start, exposed, buffer.count, early=schedule.early_user)
                raise
            if schedule.result is not None and schedule.result.buf != Buf.USER:
                reducer.convert(piece, arrays[Buf.WORK])
        dev.layer.synchronize(dev.staging.compute)


def broadcast(ctx: Context, desc: Descriptor, buffer: Buffer, root: int) -> None:
    """In-place broadcast of a device buffer from ``root`` (``ctx.size > 1``), in the host plan's slices."""
    dev = ctx.device_context()
    user = dev.layer.wrap(buffer)  # first: it tells the layer which GPU this process uses
    with dev.layer.context():
        dev.layer.after_producer(dev.staging.compute, buffer)
        reducer = dev.reducer(buffer.dtype, ReduceOp.SUM, Compression.NONE)
        itemsize = buffer.dtype.itemsize
        bounds = slice_bounds(buffer.count, ctx.settings.scratch_slice_bytes(), itemsize)
        for part, (start, count) in enumerate(bounds):
            piece = user[start : start + count]
            schedule = broadcast_schedule(ctx, root, count, itemsize)
            arrays = dev.scratch_arrays(schedule, piece, buffer.dtype.storage)
            with failure_note(start, 0, buffer.count):
                ctx.execute(desc, schedule, arrays, reducer, sub=part, staging=dev.staging)
            if schedule.result is not None:
                dev.layer.copy(piece, arrays[Buf.WORK], dev.staging.compute)
        dev.layer.synchronize(dev.staging.compute)
