"""Allreduce and broadcast on device buffers: the host plans' steps, with device arrays and staging.

The schedules are the host ones (same choice of ring or recursive doubling,
same segments), so a mixed ring of host and device ranks agrees bit for bit.
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
    """In-place allreduce of a device buffer (``comm.size > 1``)."""
    from ringcore.collectives import allreduce_schedule, failure_note, writes_user

    ctx = comm.device_context()
    user = ctx.layer.wrap(buffer)  # first: it tells the layer which GPU this process uses
    with ctx.layer.context():
        ctx.layer.after_producer(ctx.staging.compute, buffer)
        reducer = ctx.reducer(buffer.dtype, op, comp)
        in_place = reducer.wire_dtype == buffer.dtype.storage
        schedule = allreduce_schedule(comm, buffer.count, reducer.wire_dtype.itemsize, in_place)
        arrays = ctx.scratch_arrays(schedule, user, reducer.wire_dtype)
        if schedule.prefill_work:
            reducer.convert(arrays[Buf.WORK], user)
        exposed = buffer.count if writes_user(schedule) and not comm.settings.atomic else 0
        with failure_note(0, exposed, buffer.count):
            comm.execute(desc, schedule, arrays, reducer, staging=ctx.staging)
        if schedule.result is not None and schedule.result.buf != Buf.USER:
            reducer.convert(user, arrays[Buf.WORK])
        ctx.layer.synchronize(ctx.staging.compute)


def broadcast(comm: Communicator, desc: Descriptor, buffer: Buffer, root: int) -> None:
    """In-place broadcast of a device buffer from ``root`` (``comm.size > 1``)."""
    ctx = comm.device_context()
    user = ctx.layer.wrap(buffer)  # first: it tells the layer which GPU this process uses
    with ctx.layer.context():
        ctx.layer.after_producer(ctx.staging.compute, buffer)
        reducer = ctx.reducer(buffer.dtype, ReduceOp.SUM, Compression.NONE)
        schedule = chain.broadcast(
            comm.rank, comm.size, root, buffer.count, buffer.dtype.itemsize, comm.settings.segment_size()
        )
        arrays = ctx.scratch_arrays(schedule, user, buffer.dtype.storage)
        comm.execute(desc, schedule, arrays, reducer, staging=ctx.staging)
        if schedule.result is not None:
            ctx.layer.copy(user, arrays[Buf.WORK], ctx.staging.compute)
        ctx.layer.synchronize(ctx.staging.compute)
