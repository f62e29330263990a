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
communicator's own (tickets and turns, ``Communicator.fail``). Binding touches the
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
    from ringcore.comm import Communicator


class KeptAllreduce:
    """An allreduce layout that keeps what its first turn works out; calls then skip planning.

    Subclasses say what they keep (:meth:`_prepare`, in the first call's turn,
    False for good when the layout does not qualify), whether they have it
    (``bound``) and how a call runs on it (:meth:`_run_flat`).
    """

    def __init__(self, comm: Communicator, buffer: Buffer, op: ReduceOp, compression: Compression) -> None:
        self.comm = comm
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

        def run(comm: Communicator, seq: int) -> Any:
            if not self.bound and not self._prepare():
                general = collectives.plan_checked_allreduce(obj, buffer, self.op, self.compression)
                return general.run(comm, seq)
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

    def __init__(self, comm: Communicator, buffer: Buffer, op: ReduceOp, compression: Compression) -> None:
        super().__init__(comm, buffer, op, compression)
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
        comm, reducer = self.comm, self.reducer
        try:
            reducer.convert(self.work, array)
            run_steps(comm, self.steps, self.early, reducer, seq, self.signature)
        except BaseException as err:
            comm.fail(Descriptor("allreduce", seq, *self.fields), err)
        reducer.convert(array, self.work)

    def _prepare(self) -> bool:
        """Bind the schedule to scratch (in the turn); False, for good, when it does not qualify."""
        comm, count = self.comm, self.count
        assert comm.transport is not None
        reducer = comm.reducer(self.dtype, self.op, self.compression)
        itemsize = reducer.wire_dtype.itemsize
        schedule = collectives.allreduce_schedule(
            comm, count, itemsize, reducer.wire_dtype == self.dtype.storage
        )
        # Scratch of its own (at most 2 x RINGCORE_SMALL_BYTES): views into the communicator's
        # pools would keep an outgrown pool alive for as long as the layout is remembered.
        views = {buf: np.empty(count, reducer.wire_dtype) for buf in (*schedule.scratch, Buf.WORK)}
        compiled = lockstep.compile_steps(schedule, comm.transport)
        result = schedule.result
        if (
            count > max(1, comm.allreduce_slice_bytes // itemsize)  # sliced (never at default sizes)
            or not lockstep.fits(schedule, comm.transport, views)
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


def can_keep(comm: Communicator, buffer: Buffer) -> bool:
    """Whether an allreduce of ``buffer``'s layout may keep its plan: a CPU buffer on a world of 2+, no timeline."""
    return comm.size > 1 and comm.transport is not None and comm.timeline is None and buffer.device == "cpu"


def small_allreduce(
    comm: Communicator, buffer: Buffer, op: ReduceOp, compression: Compression
) -> SmallAllreduce | None:
    """A :class:`SmallAllreduce` for ``buffer``'s layout, or None where the general path must run."""
    if not can_keep(comm, buffer) or buffer.nbytes > comm.settings.small_bytes:
        return None
    return SmallAllreduce(comm, buffer, op, compression)


class BoundBarrier:
    """The dissemination barrier's steps, bound once per communicator (they carry no data)."""

    def __init__(self, comm: Communicator) -> None:
        assert comm.transport is not None
        compiled = lockstep.compile_steps(chain.barrier(comm.rank, comm.size), comm.transport)
        self.comm = comm
        self.steps = lockstep.bind(compiled, {Buf.WORK: np.empty(0, np.uint8)})
        self.early = compiled.early
        self.reducer = comm.reducer(DTYPES["uint8"], ReduceOp.SUM, Compression.NONE)
        self.signature = Descriptor("barrier", 0, "uint8", ()).signature()

    def run(self, seq: int) -> None:
        try:
            run_steps(self.comm, self.steps, self.early, self.reducer, seq, self.signature)
        except BaseException as err:
            self.comm.fail(Descriptor("barrier", seq, "uint8", ()), err)


def run_steps(
    comm: Communicator,
    steps: tuple[lockstep.Bound, ...],
    early: tuple[int, ...],
    reducer: Any,
    seq: int,
    signature: int,
    part: int = 0,
) -> None:
    """Run bound steps as schedule ``part`` of collective ``seq``, with the communicator's timeout and stall check."""
    assert comm.transport is not None
    lockstep.run_bound(
        comm.transport,
        steps,
        early,
        reducer,
        (wire.tag_seq(seq, part) & 0xFFFFFFFF) << 32,
        signature,
        comm.settings.timeout,
        comm.stall.interruption if comm.stall is not None else None,
    )


def plan_barrier(comm: Communicator) -> collectives.Plan:
    """A barrier on bound steps, or the general plan where a timeline wants its events."""
    if comm.size < 2 or comm.transport is None or comm.timeline is not None:
        return collectives.plan_barrier()

    def run(comm: Communicator, seq: int) -> None:
        barrier = comm.bound_barrier
        if barrier is None:  # bound in the turn, like everything touching comm state
            barrier = comm.bound_barrier = BoundBarrier(comm)
        barrier.run(seq)

    return collectives.Plan("barrier", run)
