"""The allreduce plan: one per array layout, prepared in its first turn, one of three forms.

Route. ``Communicator.allreduce(buf)`` keys a numpy array's layout (dtype,
shape, strides, op, compression) in the plan cache (:mod:`ringcore.plans.cache`);
a miss validates the arguments and makes an :class:`AllreducePlan`, which the
cache keeps. Any other object (a torch tensor's buffer, a bytearray, CuPy
memory) gets a plan for that one call (:func:`plan_for_call`). Blocking and
async calls run the same plan, in their turn, through ``AllreducePlan.run``.

Forms. A kept plan's first turn prepares it (it touches the communicator's
scratch, caches and transport, so it happens in the turn, as everything that
does) and picks its form, here and nowhere else; later calls only run it:

- ``small`` (at most ``RINGCORE_SMALL_BYTES``): the recursive-doubling
  schedule's steps bound once to scratch of the plan's own
  (:func:`ringcore.algo.lockstep.bind`). A call copies the caller's array into
  WORK, runs the steps in lockstep (over TCP each is one ``swap``) and copies
  the result back, so a failure leaves the caller's array untouched. Own
  scratch, because views into the communicator's pools would keep an outgrown
  pool alive, and because bytes a transport's latency path spills into a
  receive view before it recognises an ABORT then only land there.
- ``in_place`` (above it): each slice's schedule compiled once; a call binds
  the steps to the pools' current views and to the caller's slice and runs
  them in lockstep. It qualifies when every slice's schedule runs in lockstep
  and in place (the wire dtype is the caller's, nothing is copied to WORK
  first, the result lands in the caller's slice): the one-segment ring and
  halving-doubling at the default settings.
- ``general``: everything else (fp16 compression, the pipelined ring, a
  timeline, GPU buffers, one-call plans): per slice, the schedule, scratch
  arrays and :meth:`Context.execute`, which picks the executor; GPU buffers
  go to :mod:`ringcore.plans.device` with the same slices and schedules.

Why three forms. A 4 KiB allreduce's cost is its Python: every microsecond
of it costs about two of wall time at N=4 on two cores, and planning per call
(a descriptor, a schedule, scratch views, compiling and binding steps) was
most of it. Above the small limit the kernel moves the bytes, yet planning per
call was still half a 1 MiB allreduce's Python calls. Measured:
``bench/HISTORY.md`` ("Small collectives without planning", "Fewer Python
calls per small step"). All forms send the same frames, tags and signatures,
so ranks whose plans took different forms still agree.

The routes on one host. Where every rank runs on this host, with no
compression, a call may instead take a route around the plan's form. At or
below the small limit it goes one-shot (:mod:`ringcore.plans.oneshot`): each
rank posts its input in a shared mailbox and reduces every rank's. Above it
and below ``RINGCORE_DIRECT_BYTES`` it goes two-shot (one shot at N=2): each
rank reduces its share of the posted inputs, posts that and copies the
shares out. From there, with ``RINGCORE_ATOMIC=0``, it goes direct
(:mod:`ringcore.plans.direct`): the ranks read and write each other's
buffers, and only a vote's and a barrier's small posts travel. That depends on where
each rank's memory lies (a CPU buffer, symmetric memory, a GPU), not on the
layout, so it is chosen per call, in :meth:`AllreducePlan.run`, and nowhere
else; where the ranks' memory does not allow it, they all run the plan's form.

Slices. Every form takes the slices of :mod:`ringcore.slicing` (tags numbered
by slice), shared with the GPU plans, so a failure's note says the same
whichever form ran: which slices already hold the result, and which elements
may hold partial sums (:func:`ringcore.slicing.note_failure`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ringcore.algo import lockstep
from ringcore.algo.program import Program, compile_program
from ringcore.algo.steps import Buf, Schedule
from ringcore.buffers import Buffer, checked_buffer, storage_view
from ringcore.descriptor import Descriptor
from ringcore.ops import Compression, ReduceOp
from ringcore.plans.base import run_steps
from ringcore.plans.direct import route_for
from ringcore.plans.validate import check_allreduce
from ringcore.slicing import (
    allreduce_schedule,
    allreduce_slice_bytes,
    buffer_slices,
    note_failure,
    slice_bounds,
    writes_user,
)

if TYPE_CHECKING:
    from ringcore.context import Context

Piece = tuple[int, int, Schedule, Program]  # (first element, count, schedule, its program)


class AllreducePlan:
    """An allreduce of one layout (see the module docstring); ``run(obj, seq)`` reduces ``obj`` in place."""

    kind = "allreduce"

    def __init__(
        self, ctx: Context, buffer: Buffer, op: ReduceOp, compression: Compression, *, kept: bool
    ) -> None:
        self.ctx = ctx
        self.dtype, self.op, self.compression = buffer.dtype, op, compression
        self.count, self.nbytes = buffer.count, buffer.nbytes
        self.fields = (buffer.dtype.name, buffer.shape, op.value, None, compression.value)
        self.signature = Descriptor("allreduce", 0, *self.fields).signature()
        self.details = {"dtype": buffer.dtype.name, "count": self.count, "op": op.value}
        self.details["compression"] = compression.value
        self.buffer = None if kept else buffer  # a one-call plan's; a kept one views each call's array
        preparable = kept and _can_prepare(ctx, buffer)
        self.small = preparable and buffer.nbytes <= ctx.settings.small_bytes
        self.holds = 2 * buffer.nbytes if self.small else 0  # scratch of its own, at most (small form)
        self.form = "unprepared" if preparable else "general"
        self.calls = 0
        self._run: Callable[[Any, int], None] = self._first if preparable else self._general
        self.reducer: Any = None
        self._steps: tuple[lockstep.Bound, ...] = ()
        self._early: tuple[int, ...] = ()
        self._work = np.empty(0)
        self._pieces: tuple[Piece, ...] = ()
        self.direct = route_for(self)  # after the fields it reads
        below = getattr(self.direct, "below", None)  # the two-shot route under the direct one
        self.routes = tuple(route for route in (self.direct, below) if route is not None)

    @property
    def direct_calls(self) -> int:
        """Calls that took a route chosen per call (``plan_cache()`` counts them apart from the form's)."""
        return sum(route.calls for route in self.routes)

    def run(self, obj: Any, seq: int) -> Any:
        """Reduce ``obj`` (this plan's layout, validated) as collective ``seq``, in its turn; returns ``obj``."""
        self.calls += 1
        if self.direct is None or not self.direct.run(obj, seq):
            self._run(obj, seq)
        return obj

    # ------------------------------------------------------------------ the first turn

    def _first(self, obj: Any, seq: int) -> None:
        if self.small and self._bind_small():
            self.form, self._run = "small", self._run_small
        elif not self.small and self._compile_in_place():
            self.form, self._run = "in_place", self._run_in_place
        else:
            self.form, self._run = "general", self._general
        self._run(obj, seq)

    def _bind_small(self) -> bool:
        """Bind the recursive-doubling steps to scratch of the plan's own; False where it does not qualify."""
        ctx, count = self.ctx, self.count
        assert ctx.transport is not None
        reducer = ctx.reducer(self.dtype, self.op, self.compression)
        itemsize = reducer.wire_dtype.itemsize
        schedule = allreduce_schedule(ctx, count, itemsize, reducer.wire_dtype == self.dtype.storage)
        views = {buf: np.empty(count, reducer.wire_dtype) for buf in (*schedule.scratch, Buf.WORK)}
        program = compile_program(schedule, ctx.transport)
        result = schedule.result
        if (
            count > max(1, ctx.allreduce_slice_bytes // itemsize)  # sliced (never at default sizes)
            or not lockstep.fits(schedule, ctx.transport, views)
            or program.touches_user
            or not schedule.prefill_work
            or result is None
            or (result.buf, result.start, result.count) != (Buf.WORK, 0, count)
        ):
            return False
        self.reducer, self._work, self._early = reducer, views[Buf.WORK], program.early
        self._steps = lockstep.bind(program, views)
        return True

    def _compile_in_place(self) -> bool:
        """Compile each slice's schedule once; False where one does not run in lockstep, in place."""
        ctx = self.ctx
        assert ctx.transport is not None
        reducer = ctx.reducer(self.dtype, self.op, self.compression)
        if reducer.wire_dtype != self.dtype.storage:  # not in place: compression
            return False
        itemsize = reducer.wire_dtype.itemsize
        bounds = slice_bounds(self.count, allreduce_slice_bytes(ctx, True), itemsize)
        pieces = []
        for start, count in bounds:
            schedule = allreduce_schedule(ctx, count, itemsize, True, sliced=len(bounds) > 1)
            if not self._runs_in_place(schedule, count, reducer):
                return False
            pieces.append((start, count, schedule, compile_program(schedule, ctx.transport)))
        self.reducer, self._pieces = reducer, tuple(pieces)
        return True

    def _runs_in_place(self, schedule: Schedule, count: int, reducer: Any) -> bool:
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

    # ------------------------------------------------------------------ the forms

    def _run_small(self, obj: Any, seq: int) -> None:
        """The caller's memory is written only once every step succeeded."""
        flat = storage_view(obj, self.dtype)
        ctx, reducer = self.ctx, self.reducer
        try:
            reducer.convert(self._work, flat)
            run_steps(ctx, self._steps, self._early, reducer, seq, self.signature, 0, self.nbytes)
        except BaseException as err:
            ctx.fail(Descriptor("allreduce", seq, *self.fields), err)
        reducer.convert(flat, self._work)

    def _run_in_place(self, obj: Any, seq: int) -> None:
        flat = storage_view(obj, self.dtype)
        ctx, wire_dtype, atomic = self.ctx, self.reducer.wire_dtype, self.ctx.settings.atomic
        for part, (start, count, schedule, program) in enumerate(self._pieces):
            arrays = {
                **ctx.scratch_views(schedule.scratch, count, wire_dtype),
                Buf.USER: flat[start : start + count],
            }
            try:
                try:
                    steps = lockstep.bind(program, arrays)
                    run_steps(ctx, steps, program.early, self.reducer, seq, self.signature, part, self.nbytes)
                except BaseException as err:
                    ctx.fail(Descriptor("allreduce", seq, *self.fields), err)
            except BaseException as err:
                exposed = count if writes_user(schedule) and not atomic else 0
                note_failure(err, start, exposed, self.count, early=schedule.early_user)
                raise

    def _general(self, obj: Any, seq: int) -> None:
        ctx = self.ctx
        if ctx.size < 2:
            return
        buffer = self.buffer if self.buffer is not None else checked_buffer(obj, self.dtype)
        desc = Descriptor("allreduce", seq, *self.fields)
        if buffer.device == "cuda":
            from ringcore.plans import device

            device.allreduce(ctx, desc, buffer, self.op, self.compression)
            return
        reducer = ctx.reducer(buffer.dtype, self.op, self.compression)
        in_place = reducer.wire_dtype == buffer.dtype.storage
        pieces = buffer_slices(buffer, allreduce_slice_bytes(ctx, in_place), reducer.wire_dtype.itemsize)
        for part, (start, piece) in enumerate(pieces):
            schedule = allreduce_schedule(
                ctx, piece.count, reducer.wire_dtype.itemsize, in_place, sliced=len(pieces) > 1
            )
            arrays = ctx.scratch_arrays(schedule, piece, reducer.wire_dtype)
            if schedule.prefill_work:
                reducer.convert(arrays[Buf.WORK], piece.array)
            try:
                ctx.execute(desc, schedule, arrays, reducer, sub=part)
            except BaseException as err:  # a plain try: a context manager costs small allreduces
                exposed = piece.count if writes_user(schedule) and not ctx.settings.atomic else 0
                note_failure(err, start, exposed, buffer.count, early=schedule.early_user)
                raise
            if schedule.result is not None and schedule.result.buf != Buf.USER:
                reducer.convert(piece.array, arrays[Buf.WORK])


def _can_prepare(ctx: Context, buffer: Buffer) -> bool:
    """Whether a kept plan may take a prepared form: a CPU buffer on a world of 2+, no timeline."""
    return ctx.size > 1 and ctx.transport is not None and ctx.timeline is None and buffer.device == "cpu"


def plan_for_layout(ctx: Context, array: np.ndarray, op: Any, compression: Any) -> AllreducePlan:
    """The plan to keep for ``array``'s layout (validated here; a writable numpy array)."""
    buffer, reduce_op, comp = check_allreduce(array, op, compression)
    return AllreducePlan(ctx, buffer, reduce_op, comp, kept=True)


def plan_for_call(ctx: Context, obj: Any, op: Any, compression: Any) -> AllreducePlan:
    """The plan of one allreduce of ``obj`` (validated here), not kept: it runs the general form."""
    buffer, reduce_op, comp = check_allreduce(obj, op, compression)
    return AllreducePlan(ctx, buffer, reduce_op, comp, kept=False)
