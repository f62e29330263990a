"""The broadcast plan: root's buffer into every rank's, in one shot on one host, else in slices of bounded scratch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ringcore.algo.steps import Buf
from ringcore.descriptor import Descriptor
from ringcore.ops import Compression, ReduceOp
from ringcore.plans import oneshot
from ringcore.plans.base import CallPlan
from ringcore.plans.validate import as_buffer, check_root
from ringcore.slicing import broadcast_schedule, buffer_slices, failure_note

if TYPE_CHECKING:
    from ringcore.context import Context


def plan_broadcast(ctx: Context, obj: Any, root: int) -> CallPlan:
    """Copy ``root``'s ``obj`` into every rank's ``obj`` (validated here); the result is ``obj``.

    At most a mailbox's slot, where every rank has mailboxes: one shot
    (:func:`ringcore.plans.oneshot.exchange`): the root posts its buffer, every
    other rank posts that it takes part and copies the root's post; a rank
    whose buffer is on a GPU posts that it does not, and every rank runs the
    chain (with no post at all for this signature again, once every rank's was
    on a GPU: :func:`ringcore.plans.oneshot.decline`). Otherwise each slice
    (``RINGCORE_SLICE_BYTES`` of scratch) is a complete chain broadcast;
    non-root ranks receive into scratch and copy into their buffer once the
    slice is complete, so a failure leaves later slices untouched.
    """
    root = check_root(root, ctx.size, "broadcast")
    buffer = as_buffer(obj, writable=ctx.rank != root, what="broadcast buffer")

    def run(obj: Any, seq: int) -> Any:
        if ctx.size < 2:
            return obj
        desc = Descriptor("broadcast", seq, buffer.dtype.name, buffer.shape, None, root)
        mailbox = oneshot.mailbox_of(ctx)
        signature = desc.signature()
        if mailbox is not None and buffer.nbytes <= mailbox.slot_bytes and signature not in ctx.declined:
            host, mine = buffer.device == "cpu", ctx.rank == root
            posts = oneshot.exchange(
                ctx, desc, host, buffer.array if host and mine else None, buffer.nbytes if mine else 0
            )
            ways = {way for way, _, _ in posts}
            if ways == {oneshot.POSTED}:
                if not mine:
                    buffer.array.reshape(-1).view(np.uint8)[...] = posts[root][2]
                return obj
            if ways == {oneshot.ABSENT}:  # every buffer on a GPU
                oneshot.decline(ctx, signature)
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
