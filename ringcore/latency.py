"""Small allreduces and barriers bound once: each call only copies, moves and reduces.

Why. A 4 KiB allreduce moves two frames per round, but the general path
plans it from scratch on every call: it builds a plan, a descriptor, picks a
schedule, finds scratch, compiles and binds the steps, and wraps it all in
layers meant for slices, GPUs and timelines. That Python is what a small
allreduce costs: at N=4 on 2 cores every microsecond of it costs about two of
wall time, since four ranks share two cores (a spinning busy loop of 30, 60
and 100 us per call added 74, 138 and 225 us).

Theory of operation. :meth:`Communicator._allreduce_plan` remembers each
validated layout (dtype, shape, strides, op, compression). For a layout that
qualifies (:func:`small_allreduce`), it also keeps a :class:`SmallAllreduce`:
the signature, the reducer, the recursive-doubling schedule bound to its own
scratch views (:func:`ringcore.algo.lockstep.bind`). A call then copies the
caller's array into WORK, runs the bound steps with
:func:`ringcore.algo.lockstep.run_bound` (the same frames, tags and checks as
every other path, so ranks on different paths agree; over TCP each step is
one ``TcpTransport.swap``) and copies the result back. Blocking and
``allreduce_async`` calls alike. Ordering, failure handling and the stall inspector are the
communicator's own (tickets and turns, ``Context.fail``). Binding touches the
communicator's scratch and caches, so it happens in the first call's turn,
like everything else that does; until then, and for good if the schedule
turns out not to qualify, the general plan runs. Once bound, a blocking
call skips planning altogether (``Communicator._call_bound``: no plan,
Buffer or closure per call, numpy's error state set through its context
variable, ``numpy_ops.quietly``); that took a 4 KiB call's own Python from
12 to under 6 us.

What qualifies: a CPU buffer of at most ``RINGCORE_SMALL_BYTES`` on a world
of more than one rank, no timeline (which wants per-collective events), and a
schedule that runs in lockstep without touching the caller's buffer. The
caller's array is written only after every step succeeded, so a failure
leaves it untouched. Each layout has scratch of its own, so the bytes a
transport's latency path may spill into a receive view before it recognises
an ABORT only ever land there.

Barriers. ``barrier()`` is the other call a training loop makes all the time
(and every benchmark iteration makes before its timed call, where its exit
skew lands in the measurement). Its dissemination schedule carries no data,
so it is bound once per communicator (:class:`BoundBarrier`), with the same
rules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ringcore import collectives
from ringcore.algo import broadcast as chain
from ringcore.algo import lockstep
from ringcore.algo.steps import Buf
from ringcore.buffers import DTYPES, Buffer, storage_view
from ringcore.descriptor import Descriptor
from ringcore.ops import Compression, ReduceOp
from ringcore.transport import wire

if TYPE_CHECKING:
    from ringcore.context import Context


class KeptAllreduce:
    """An allreduce layout that keeps what its first turn works out; calls then skip planning.

    Subclasses say what they keep (:meth:`_prepare`, in the first call's turn,
    False for good when the layout does not qualify), whether they have it
    (``bound``) and how a call runs on it (:meth:`_run_flat`).
    """

    def __init__(self, ctx: Context, buffer: Buffer, op: ReduceOp, compression: Compression) -> None:
        self.ctx = ctx
        self.dtype, self.op, self.compression = buffer.dtype, op, compression
        self.count, self.nbytes = buffer.count, buffer.nbytes
        self.fields = (buffer.dtype.name, buffer.shape, op.value, None, compression.value)
        self.signature = Descriptor("allreduce", 0, *self.fields).signature()
        self.details = {"dtype": buffer.dtype.name, "count": self.count, "op": op.value}
        self.details["compression"] = compression.value
        self.general = False  # the first turn found a schedule this path cannot run
        self.reducer: Any = None

    @property
    def bound(self) -> bool:
        """Whether the layout's plan is kept: calls can skip planning (``Communicator._call_bound``)."""
        raise NotImplementedError

    def plan(self, obj: Any, buffer: Buffer) -> collectives.Plan:
        """The plan of one call on ``buffer`` (``obj``'s, already validated), returning ``obj``."""
        if self.general:
            return collectives.plan_checked_allreduce(obj, buffer, self.op, self.compression)

        def run(ctx: Context, seq: int) -> Any:
            if not self.bound and not self._prepare():
                general = collectives.plan_checked_allreduce(obj, buffer, self.op, self.compression)
                return general.run(ctx, seq)
            self._run_flat(buffer.array, seq)
            return obj

        return collectives.Plan("allreduce", run, nbytes=self.nbytes, details=self.details)

    def run(self, array: np.ndarray, seq: int) -> None:
        """Reduce the caller's ``array`` (this layout's, writable) as collective ``seq``, in its turn."""
        self._run_flat(storage_view(array, self.dtype), seq)

    def _run_flat(self, array: np.ndarray, seq: int) -> None:
        raise NotImplementedError

    def _prepare(self) -> bool:
        raise NotImplementedError


class SmallAllreduce(KeptAllreduce):
    """One small allreduce layout; bound to its schedule, scratch and frames in its first turn."""

    def __init__(self, ctx: Context, buffer: Buffer, op: ReduceOp, compression: Compression) -> None:
        super().__init__(ctx, buffer, op, compression)
        self.steps: tuple[lockstep.Bound, ...] | None = None
        self.early: tuple[int, ...] = ()
        self.work = np.empty(0)

    @property
    def bound(self) -> bool:
        """Whether the steps are bound: calls can skip planning (``Communicator._call_bound``)."""
        return self.steps is not None

    def _run_flat(self, array: np.ndarray, seq: int) -> None:
        """``run`` on the flat storage view (``Buffer.array``); the caller's memory is written only on success."""
        assert self.steps is not None
        ctx, reducer = self.ctx, self.reducer
        try:
            reducer.convert(self.work, array)
            run_steps(ctx, self.steps, self.early, reducer, seq, self.signature)
        except BaseException as err:
            ctx.fail(Descriptor("allreduce", seq, *self.fields), err)
        reducer.convert(array, self.work)

    def _prepare(self) -> bool:
        """Bind the schedule to scratch (in the turn); False, for good, when it does not qualify."""
        ctx, count = self.ctx, self.count
        assert ctx.transport is not None
        reducer = ctx.reducer(self.dtype, self.op, self.compression)
        itemsize = reducer.wire_dtype.itemsize
        schedule = collectives.allreduce_schedule(
            ctx, count, itemsize, reducer.wire_dtype == self.dtype.storage
        )
        # Scratch of its own (at most 2 x RINGCORE_SMALL_BYTES): views into the communicator's
        # pools would keep an outgrown pool alive for as long as the layout is remembered.
        views = {buf: np.empty(count, reducer.wire_dtype) for buf in (*schedule.scratch, Buf.WORK)}
        compiled = lockstep.compile_steps(schedule, ctx.transport)
        result = schedule.result
        if (
            count > max(1, ctx.allreduce_slice_bytes // itemsize)  # sliced (never at default sizes)
            or not lockstep.fits(schedule, ctx.transport, views)
            or compiled.touches_user
            or not schedule.prefill_work
            or result is None
            or (result.buf, result.start, result.count) != (Buf.WORK, 0, count)
        ):
            self.general = True
            return False
        self.reducer, self.work, self.early = reducer, views[Buf.WORK], compiled.early
        self.steps = lockstep.bind(compiled, views)
        return True


def can_keep(ctx: Context, buffer: Buffer) -> bool:
    """Whether an allreduce of ``buffer``'s layout may keep its plan: a CPU buffer on a world of 2+, no timeline."""
    return ctx.size > 1 and ctx.transport is not None and ctx.timeline is None and buffer.device == "cpu"


def small_allreduce(
    ctx: Context, buffer: Buffer, op: ReduceOp, compression: Compression
) -> SmallAllreduce | None:
    """A :class:`SmallAllreduce` for ``buffer``'s layout, or None where the general path must run."""
    if not can_keep(ctx, buffer) or buffer.nbytes > ctx.settings.small_bytes:
        return None
    return SmallAllreduce(ctx, buffer, op, compression)


class BoundBarrier:
    """The dissemination barrier's steps, bound once per communicator (they carry no data)."""

    def __init__(self, ctx: Context) -> None:
        assert ctx.transport is not None
        compiled = lockstep.compile_steps(chain.barrier(ctx.rank, ctx.size), ctx.transport)
        self.ctx = ctx
        self.steps = lockstep.bind(compiled, {Buf.WORK: np.empty(0, np.uint8)})
        self.early = compiled.early
        self.reducer = ctx.reducer(DTYPES["uint8"], ReduceOp.SUM, Compression.NONE)
        self.signature = Descriptor("barrier", 0, "uint8", ()).signature()

    def run(self, seq: int) -> None:
        try:
            run_steps(self.ctx, self.steps, self.early, self.reducer, seq, self.signature)
        except BaseException as err:
            self.ctx.fail(Descriptor("barrier", seq, "uint8", ()), err)


def run_steps(
    ctx: Context,
    steps: tuple[lockstep.Bound, ...],
    early: tuple[int, ...],
    reducer: Any,
    seq: int,
    signature: int,
    part: int = 0,
) -> None:
    """Run bound steps as schedule ``part`` of collective ``seq``, with the communicator's timeout and stall check."""
    assert ctx.transport is not None
    lockstep.run_bound(
        ctx.transport,
        steps,
        early,
        reducer,
        (wire.tag_seq(seq, part) & 0xFFFFFFFF) << 32,
        signature,
        ctx.settings.timeout,
        ctx.stall.interruption if ctx.stall is not None else None,
    )


def plan_barrier(ctx: Context) -> collectives.Plan:
    """A barrier on bound steps, or the general plan where a timeline wants its events."""
    if ctx.size < 2 or ctx.transport is None or ctx.timeline is not None:
        return collectives.plan_barrier()

    def run(ctx: Context, seq: int) -> None:
        barrier = ctx.bound_barrier
        if barrier is None:  # bound in the turn, like everything touching comm state
            barrier = ctx.bound_barrier = BoundBarrier(ctx)
        barrier.run(seq)

    return collectives.Plan("barrier", run)
