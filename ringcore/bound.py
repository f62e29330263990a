"""In-place allreduces of a remembered layout: planned once, bound per call.

Why. Above ``RINGCORE_SMALL_BYTES`` an allreduce's bytes are moved by the
kernel and added by numpy, yet its Python still counts: a 1 MiB allreduce
made about 165 Python calls at N=2 and 250 at N=4, and on a host with a
small L2 each one runs cold, because the 512 KiB copies between them evict
the interpreter's working set. Validating the array, planning the slices,
choosing and compiling the schedule, and the executor's set-up were about
half of them. Measured on 2 cores before this path existed, planning once
took a 1 MiB allreduce from 1.50 to 1.15 ms at N=2 and from 3.81 to 3.24 ms
at N=4 (median of 6 rounds, ``bench/RESULTS.md``, 4 Dec 17:40).

Theory of operation. Like :mod:`ringcore.latency`'s small layouts, a layout
(dtype, shape, strides, op, compression) that passed validation is
remembered by :meth:`Communicator._allreduce_plan`. When it is above the
small limit, it gets a :class:`BoundAllreduce`. The first call's turn
decides whether the layout qualifies and, if so, keeps the reducer and each
slice's bounds, schedule and compiled steps. Later blocking calls go through
``Communicator._call_bound``. Each one takes the communicator's scratch
views, binds the steps to them and to the caller's array
(:func:`ringcore.algo.lockstep.bind`), and runs them with
:func:`ringcore.latency.run_steps`. The frames, tags and checks are the
general plan's, so ranks on either path agree.

What qualifies: a CPU buffer on a world of more than one rank, with no
timeline. Every slice's schedule (``allreduce_slice_bytes``; most layouts
have one slice, and slices of one layout have at most two lengths) must run
in lockstep (:func:`ringcore.algo.lockstep.fits`, which refuses one that
writes the caller's buffer under ``RINGCORE_ATOMIC=1``) and in place: the
wire dtype is the caller's, no input is copied to WORK first, and the result
lands in the caller's slice. That covers the one-segment ring and
halving-doubling at the default settings. Anything else, such as fp16
compression or the pipelined ring, keeps the general plan. Slices run one
after another with the general plan's tags (schedule ``part`` of the
collective), so a failure's note says the same: which slices already hold
the result, and which elements may hold partial sums.

Scratch. A layout keeps no memory of its own. Each call takes the views of
the communicator's pools (``Context.scratch_views``), which are dropped
whenever a pool grows, so a remembered layout never keeps an outgrown pool
alive.

Failure. It is the same as the general plan's. A failure is translated and
broadcast by ``Context.fail``, and its error gets the note that names
the elements that may hold partial sums (:func:`ringcore.collectives.note_failure`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ringcore import collectives
from ringcore.algo import lockstep
from ringcore.algo.steps import Buf, Schedule
from ringcore.buffers import Buffer
from ringcore.descriptor import Descriptor
from ringcore.latency import KeptAllreduce, can_keep, run_steps
from ringcore.ops import Compression, ReduceOp

if TYPE_CHECKING:
    from ringcore.context import Context


class BoundAllreduce(KeptAllreduce):
    """One in-place allreduce layout above the small limit; planned in its first turn."""

    def __init__(self, ctx: Context, buffer: Buffer, op: ReduceOp, compression: Compression) -> None:
        super().__init__(ctx, buffer, op, compression)
        self.pieces: tuple[tuple[int, int, Schedule, lockstep.Compiled], ...] | None = None  # per slice

    @property
    def bound(self) -> bool:
        """Whether the plan is kept: calls can skip planning (``Communicator._call_bound``)."""
        return self.pieces is not None

    def _run_flat(self, flat: np.ndarray, seq: int) -> None:
        """``run`` on the flat storage view (``Buffer.array``), slice by slice as the general plan."""
        assert self.pieces is not None
        ctx, wire_dtype, atomic = self.ctx, self.reducer.wire_dtype, self.ctx.settings.atomic
        for part, (start, count, schedule, compiled) in enumerate(self.pieces):
            arrays = {
                **ctx.scratch_views(schedule.scratch, count, wire_dtype),
                Buf.USER: flat[start : start + count],
            }
            try:
                try:
                    steps = lockstep.bind(compiled, arrays)
                    run_steps(ctx, steps, compiled.early, self.reducer, seq, self.signature, part)
                except BaseException as err:
                    ctx.fail(Descriptor("allreduce", seq, *self.fields), err)
            except BaseException as err:
                exposed = count if collectives.writes_user(schedule) and not atomic else 0
                collectives.note_failure(err, start, exposed, self.count)
                raise

    def _prepare(self) -> bool:
        """Keep the slices' schedules (in the turn); False, for good, when the layout does not qualify."""
        ctx = self.ctx
        assert ctx.transport is not None
        reducer = ctx.reducer(self.dtype, self.op, self.compression)
        if reducer.wire_dtype != self.dtype.storage:  # not in place: compression
            self.general = True
            return False
        itemsize = reducer.wire_dtype.itemsize
        bounds = collectives.slice_bounds(self.count, ctx.allreduce_slice_bytes, itemsize)
        pieces = []
        for start, count in bounds:
            schedule = collectives.allreduce_schedule(ctx, count, itemsize, True, sliced=len(bounds) > 1)
            if not self._qualifies(schedule, count, reducer):
                self.general = True
                return False
            pieces.append((start, count, schedule, lockstep.compile_steps(schedule, ctx.transport)))
        self.reducer, self.pieces = reducer, tuple(pieces)
        return True

    def _qualifies(self, schedule: Schedule, count: int, reducer: Any) -> bool:
        """Whether ``schedule`` runs in lockstep, in place, with its result in the caller's slice."""
        ctx = self.ctx
        assert ctx.transport is not None
        dtypes = {Buf.WORK: np.empty(0, reducer.wire_dtype), Buf.USER: np.empty(0, self.dtype.storage)}
        result = schedule.result
        return (
            not schedule.prefill_work
            and result is not None
            and (result.buf, result.start, result.count) == (Buf.USER, 0, count)
            and lockstep.fits(schedule, ctx.transport, dtypes, ctx.settings.atomic)  # it compares dtypes
        )


def bound_allreduce(
    ctx: Context, buffer: Buffer, op: ReduceOp, compression: Compression
) -> BoundAllreduce | None:
    """A :class:`BoundAllreduce` for ``buffer``'s layout, or None where the general path must run."""
    if not can_keep(ctx, buffer) or buffer.nbytes <= ctx.settings.small_bytes:
        return None
    return BoundAllreduce(ctx, buffer, op, compression)
