"""The broadcast plan: root's buffer into every rank's, in slices of bounded scratch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ringcore.algo.steps import Buf
from ringcore.descriptor import Descriptor
from ringcore.ops import Compression, ReduceOp
from ringcore.plans.base import CallPlan
from ringcore.plans.validate import as_buffer, check_root
from ringcore.slicing import broadcast_schedule, buffer_slices, failure_note

if TYPE_CHECKING:
    from ringcore.context import Context


def plan_broadcast(ctx: Context, obj: Any, root: int) -> CallPlan:
    """Copy ``root``'s ``obj`` into every rank's ``obj`` (validated here); the result is ``obj``.

    Each slice (``RINGCORE_SLICE_BYTES`` of scratch) is a complete chain
    broadcast; non-root ranks receive into scratch and copy into their buffer
    once the slice is complete, so a failure leaves later slices untouched.
    """
    root = check_root(root, ctx.size, "broadcast")
    buffer = as_buffer(obj, writable=ctx.rank != root, what="broadcast buffer")

    def run(obj: Any, seq: int) -> Any:
        if ctx.size < 2:
            return obj
        desc = Descriptor("broadcast", seq, buffer.dtype.name, buffer.shape, None, root)
        if buffer.device == "cuda":
            from ringcore.plans import device

            device.broadcast(ctx, desc, buffer, root)
            return obj
        reducer = ctx.reducer(buffer.dtype, ReduceOp.SUM, Compression.NONE)
        itemsize = buffer.dtype.itemsize
        for part, (start, piece) in enumerate(
            buffer_slices(buffer, ctx.settings.scratch_slice_bytes(), itemsize)
        ):
            schedule = broadcast_schedule(ctx, root, piece.count, itemsize)
            arrays = ctx.scratch_arrays(schedule, piece, buffer.dtype.storage)
            with failure_note(start, 0, buffer.count):
                ctx.execute(desc, schedule, arrays, reducer, sub=part)
            if schedule.result is not None:
                np.copyto(piece.array, arrays[Buf.WORK])
        return obj

    details = {"dtype": buffer.dtype.name, "count": buffer.count, "root": root}
    return CallPlan("broadcast", run, nbytes=buffer.nbytes, details=details)
