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
decides whether the layout qualifies and, if so, keeps the reducer, the
schedule and its compiled steps. Later blocking calls go through
``Communicator._call_bound``. Each one takes the communicator's scratch
views, binds the steps to them and to the caller's array
(:func:`ringcore.algo.lockstep.bind`), and runs them with
:func:`ringcore.latency.run_steps`. The frames, tags and checks are the
general plan's, so ranks on either path agree.

What qualifies: a CPU buffer that fits one slice (``allreduce_slice_bytes``)
on a world of more than one rank, with no timeline. Its schedule must run in
lockstep (:func:`ringcore.algo.lockstep.fits`, which refuses one that writes
the caller's buffer under ``RINGCORE_ATOMIC=1``) and in place: the wire
dtype is the caller's, no input is copied to WORK first, and the result
lands in the caller's buffer. That covers the one-segment ring and
halving-doubling at the default settings. Anything else, such as fp16
compression, the pipelined ring or sliced buffers, keeps the general plan.

Scratch. A layout keeps no memory of its own. Each call takes the views of
the communicator's pools (``Communicator.scratch_views``), which are dropped
whenever a pool grows, so a remembered layout never keeps an outgrown pool
alive.

Failure. It is the same as the general plan's. A failure is translated and
broadcast by ``Communicator.fail``, and its error gets the note that names
the elements that may hold partial sums (:func:`ringcore.collectives.note_failure`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ringcore import collectives
from ringcore.algo import lockstep
from ringcore.algo.steps import Buf, Schedule
from ringcore.buffers import Buffer, storage_view
from ringcore.descriptor import Descriptor
from ringcore.latency import run_steps
from ringcore.ops import Compression, ReduceOp

if TYPE_CHECKING:
    from ringcore.comm import Communicator


class BoundAllreduce:
    """One in-place allreduce layout above the small limit; planned in its first turn."""

    def __init__(self, comm: Communicator, buffer: Buffer, op: ReduceOp, compression: Compression) -> None:
        self.comm = comm
        self.dtype, self.op, self.compression = buffer.dtype, op, compression
        self.count = buffer.count
        self.fields = (buffer.dtype.name, buffer.shape, op.value, None, compression.value)
        self.signature = Descriptor("allreduce", 0, *self.fields).signature()
        self.details = {"dtype": buffer.dtype.name, "count": self.count, "op": op.value}
        self.details["compression"] = compression.value
        self.general = False  # planning found a schedule this path cannot run
        self.schedule: Schedule | None = None
        self.compiled: lockstep.Compiled | None = None
        self.reducer: Any = None

    @property
    def bound(self) -> bool:
        """Whether the plan is kept: calls can skip planning (``Communicator._call_bound``)."""
        return self.compiled is not None

    def plan(self, obj: Any, buffer: Buffer) -> collectives.Plan:
        """The plan of one call on ``buffer`` (``obj``'s, already validated), returning ``obj``."""
        if self.general:
            return collectives.plan_checked_allreduce(obj, buffer, self.op, self.compression)

        def run(comm: Communicator, seq: int) -> Any:
            if self.compiled is None and not self._plan_once():
                general = collectives.plan_checked_allreduce(obj, buffer, self.op, self.compression)
                return general.run(comm, seq)
            self._run_flat(buffer.array, seq)
            return obj

        return collectives.Plan("allreduce", run, nbytes=buffer.nbytes, details=self.details)

    def run(self, array: np.ndarray, seq: int) -> None:
        """Reduce the caller's ``array`` (this layout's, writable) as collective ``seq``, in its turn."""
        self._run_flat(storage_view(array, self.dtype), seq)

    def _run_flat(self, flat: np.ndarray, seq: int) -> None:
        """``run`` on the flat storage view (``Buffer.array``)."""
        assert self.schedule is not None and self.compiled is not None
        comm, schedule, compiled = self.comm, self.schedule, self.compiled
        arrays = comm.scratch_views(schedule.scratch, self.count, self.reducer.wire_dtype)
        arrays = {**arrays, Buf.USER: flat}
        try:
            try:
                steps = lockstep.bind(compiled, arrays)
                run_steps(comm, steps, compiled.early, self.reducer, seq, self.signature)
            except BaseException as err:
                comm.fail(Descriptor("allreduce", seq, *self.fields), err)
        except BaseException as err:
            exposed = self.count if collectives.writes_user(schedule) and not comm.settings.atomic else 0
            collectives.note_failure(err, 0, exposed, self.count)
            raise

    def _plan_once(self) -> bool:
        """Keep the schedule (in the turn); False, for good, when the layout does not qualify."""
        comm, count = self.comm, self.count
        assert comm.transport is not None
        reducer = comm.reducer(self.dtype, self.op, self.compression)
        itemsize = reducer.wire_dtype.itemsize
        in_place = reducer.wire_dtype == self.dtype.storage
        if not in_place or count > max(1, comm.allreduce_slice_bytes // itemsize):
            self.general = True
            return False
        schedule = collectives.allreduce_schedule(comm, count, itemsize, in_place)
        arrays = {**comm.scratch_views(schedule.scratch, count, reducer.wire_dtype)}
        arrays[Buf.USER] = np.empty(0, self.dtype.storage)  # fits() only compares dtypes
        result = schedule.result
        if (
            schedule.prefill_work
            or result is None
            or (result.buf, result.start, result.count) != (Buf.USER, 0, count)
            or not lockstep.fits(schedule, comm.transport, arrays, comm.settings.atomic)
        ):
            self.general = True
            return False
        self.reducer, self.schedule = reducer, schedule
        self.compiled = lockstep.compile_steps(schedule, comm.transport)
        return True


def bound_allreduce(
    comm: Communicator, buffer: Buffer, op: ReduceOp, compression: Compression
) -> BoundAllreduce | None:
    """A :class:`BoundAllreduce` for ``buffer``'s layout, or None where the general path must run."""
    if (
        comm.size < 2
        or comm.transport is None
        or comm.timeline is not None
        or buffer.device != "cpu"
        or buffer.nbytes <= comm.settings.small_bytes
    ):
        return None
    return BoundAllreduce(comm, buffer, op, compression)
