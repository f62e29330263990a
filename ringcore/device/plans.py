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

import numpy as np

from ringcore import device
from ringcore.algo import broadcast as chain
from ringcore.algo.steps import Buf, Schedule
from ringcore.buffers import Buffer, DType
from ringcore.descriptor import Descriptor
from ringcore.device.layer import DeviceArray, DeviceReducer
from ringcore.device.staging import Staging
from ringcore.ops import Compression, ReduceOp

if TYPE_CHECKING:
    from ringcore.comm import Communicator


class DeviceContext:
    """A communicator's device state: layer, streams, pinned slots, kernels and device scratch."""

    def __init__(self, staging_bytes: int, world: int) -> None:
        self.layer = device.layer()
        self.staging_bytes = staging_bytes
        self.world = world
        self._staging: Staging | None = None
        self._reducers: dict[tuple[str, ReduceOp, Compression], DeviceReducer] = {}
        self._scratch: dict[Buf, DeviceArray] = {}

    @property
    def staging(self) -> Staging:
        """Streams and pinned slots, made on first use (after a buffer told the layer its GPU)."""
        if self._staging is None:
            self._staging = Staging(self.layer, self.staging_bytes)
        return self._staging

    def reducer(self, dtype: DType, op: ReduceOp, compression: Compression) -> DeviceReducer:
        key = (dtype.name, op, compression)
        if key not in self._reducers:
            self._reducers[key] = self.layer.reducer(dtype, op, compression, self.world, self.staging.compute)
        return self._reducers[key]

    def scratch_arrays(
        self, schedule: Schedule, user: DeviceArray, wire_dtype: np.dtype
    ) -> dict[Buf, DeviceArray]:
        """USER plus the device scratch buffers the schedule uses (grown, never shrunk)."""
        arrays = {Buf.USER: user}
        for buf in schedule.buffers - {Buf.USER} | {Buf.WORK}:
            nbytes = user.size * wire_dtype.itemsize
            pool = self._scratch.get(buf)
            if pool is None or pool.nbytes < nbytes:
                self.layer.synchronize(self.staging.compute)  # the old pool may still be in use
                pool = self._scratch[buf] = self.layer.empty(max(nbytes, 1), np.dtype(np.uint8))
            arrays[buf] = pool[:nbytes].view(wire_dtype)
        return arrays


def allreduce(comm: Communicator, desc: Descriptor, buffer: Buffer, op: ReduceOp, comp: Compression) -> None:
    """In-place allreduce of a device buffer (``comm.size > 1``), in the host plan's slices.

    The slices, each slice's schedule and its tags are the host plan's
    (``collectives.slice_bounds``, ``allreduce_schedule``), so host and device
    ranks share a ring at every size, and device scratch is one slice's.
    """
    from ringcore.collectives import allreduce_schedule, note_failure, slice_bounds, writes_user

    ctx = comm.device_context()
    user = ctx.layer.wrap(buffer)  # first: it tells the layer which GPU this process uses
    with ctx.layer.context():
        ctx.layer.after_producer(ctx.staging.compute, buffer)
        reducer = ctx.reducer(buffer.dtype, op, comp)
        in_place = reducer.wire_dtype == buffer.dtype.storage
        itemsize = reducer.wire_dtype.itemsize
        bounds = slice_bounds(buffer.count, comm.allreduce_slice_bytes, itemsize)
        for part, (start, count) in enumerate(bounds):
            piece = user[start : start + count]
            schedule = allreduce_schedule(comm, count, itemsize, in_place, sliced=len(bounds) > 1)
            arrays = ctx.scratch_arrays(schedule, piece, reducer.wire_dtype)
            if schedule.prefill_work:
                reducer.convert(arrays[Buf.WORK], piece)
            try:
                comm.execute(desc, schedule, arrays, reducer, sub=part, staging=ctx.staging)
            except BaseException as err:
                exposed = count if writes_user(schedule) and not comm.settings.atomic else 0
                note_failure(err, start, exposed, buffer.count)
                raise
            if schedule.result is not None and schedule.result.buf != Buf.USER:
                reducer.convert(piece, arrays[Buf.WORK])
        ctx.layer.synchronize(ctx.staging.compute)


def broadcast(comm: Communicator, desc: Descriptor, buffer: Buffer, root: int) -> None:
    """In-place broadcast of a device buffer from ``root`` (``comm.size > 1``), in the host plan's slices."""
    from ringcore.collectives import failure_note, slice_bounds

    ctx = comm.device_context()
    user = ctx.layer.wrap(buffer)  # first: it tells the layer which GPU this process uses
    with ctx.layer.context():
        ctx.layer.after_producer(ctx.staging.compute, buffer)
        reducer = ctx.reducer(buffer.dtype, ReduceOp.SUM, Compression.NONE)
        itemsize = buffer.dtype.itemsize
        bounds = slice_bounds(buffer.count, comm.settings.scratch_slice_bytes(), itemsize)
        for part, (start, count) in enumerate(bounds):
            piece = user[start : start + count]
            schedule = chain.broadcast(
                comm.rank, comm.size, root, count, itemsize, comm.settings.segment_size()
            )
            arrays = ctx.scratch_arrays(schedule, piece, buffer.dtype.storage)
            with failure_note(start, 0, buffer.count):
                comm.execute(desc, schedule, arrays, reducer, sub=part, staging=ctx.staging)
            if schedule.result is not None:
                ctx.layer.copy(piece, arrays[Buf.WORK], ctx.staging.compute)
        ctx.layer.synchronize(ctx.staging.compute)
