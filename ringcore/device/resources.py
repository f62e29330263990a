"""A communicator's device resources: the layer, streams, pinned slots, kernels and device scratch.

Made when the first GPU buffer reaches a collective (``Context.device_context``)
and kept for the communicator's life, so pools and compiled kernels are reused.
"""

from __future__ import annotations

import numpy as np

from ringcore import device
from ringcore.algo.steps import Buf, Schedule
from ringcore.buffers import DType
from ringcore.device.layer import DeviceArray, DeviceReducer
from ringcore.device.staging import Staging
from ringcore.ops import Compression, ReduceOp


class DeviceContext:
    """A communicator's device state: layer, streams, pinned slots, kernels and device scratch."""

    def __init__(self, staging_bytes: int, world: int) -> None:
        self.layer = device.layer()
        self.staging_bytes = staging_bytes
        self.world = world
        self._staging: Staging | None = None
        self._reducers: dict[tuple[str, ReduceOp, Compression], DeviceReducer] = {}
        self._scratch: dict[Buf, DeviceArray] = {}
        self._empty: dict[np.dtype, DeviceArray] = {}  # WORK where a schedule has none: its dtype only

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
        """USER plus the device scratch buffers the schedule uses (grown, never shrunk).

        WORK is always there, for its dtype (the wire's): empty where the schedule never
        touches it, as on the host, so the hierarchical allreduce in place at two ranks a
        host holds STAGE alone (a slice of 96 MiB at the default bound, not two).
        """
        arrays = {Buf.USER: user}
        for buf in schedule.buffers - {Buf.USER}:
            nbytes = user.size * wire_dtype.itemsize
            pool = self._scratch.get(buf)
            if pool is None or pool.nbytes < nbytes:
                self.layer.synchronize(self.staging.compute)  # the old pool may still be in use
                pool = self._scratch[buf] = self.layer.empty(max(nbytes, 1), np.dtype(np.uint8))
            arrays[buf] = pool[:nbytes].view(wire_dtype)
        if Buf.WORK not in arrays:
            empty = self._empty.get(wire_dtype)
            if empty is None:
                empty = self._empty[wire_dtype] = self.layer.empty(0, wire_dtype)
            arrays[Buf.WORK] = empty
        return arrays

    def scratch_bytes(self) -> dict[str, int]:
        """Bytes of device scratch held, by buffer (for tests and tuning)."""
        return {buf.name: int(pool.nbytes) for buf, pool in self._scratch.items()}
