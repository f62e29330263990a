"""The Context: what plans and executors run with, made by the Communicator and handed down.

A plan (:mod:`ringcore.plans`) receives the Context, never the Communicator: it
holds the transport, the settings, the scratch pools and reducers kept between
collectives, the device resources, the timeline and the stall inspector, and
runs schedules (:meth:`Context.execute`: the executor is chosen here, once).
A failure goes through :meth:`Context.fail`: it tells every peer (an ABORT
frame with the reason), translates the error into the one every rank raises,
and marks the context broken, which the Communicator checks before each
collective. Imports run one way: the Communicator imports the plans and this
module; nothing here imports the Communicator.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

from ringcore.algo import lockstep
from ringcore.algo.execute import Executor
from ringcore.algo.hierarchical import Grid
from ringcore.algo.lockstep import LockstepExecutor
from ringcore.algo.steps import Buf, Schedule
from ringcore.buffers import Buffer, DType
from ringcore.config import Settings
from ringcore.descriptor import Descriptor, explain
from ringcore.errors import CollectiveTimeout, MismatchError, PeerFailure, RingcoreError
from ringcore.kernels.numpy_ops import Reducer
from ringcore.ops import Compression, ReduceOp
from ringcore.stall import StallInspector
from ringcore.store import StoreClient
from ringcore.timeline import Timeline
from ringcore.transport import wire
from ringcore.transport.base import FrameMismatch, PeerAborted, Transport
from ringcore.transport.wire import ProtocolError

if TYPE_CHECKING:
    from ringcore.device.resources import DeviceContext
    from ringcore.device.staging import Staging
    from ringcore.symmetric import SymmetricMemory

log = logging.getLogger("ringcore")

_EXPLAIN_WAIT = 10.0
_VIEW_CACHE = 64  # (scratch buffers, count, dtype) combinations whose views are kept


class Context:
    """One communicator's resources for running collectives (see the module docstring)."""

    def __init__(
        self,
        rank: int,
        size: int,
        settings: Settings,
        transport: Transport | None,
        store: StoreClient | None = None,
        timeline: Timeline | None = None,
        stall: StallInspector | None = None,
        cache_slices: bool = False,
        wide_segments: bool = False,
        grid: Grid | None = None,
    ) -> None:
        self.rank, self.size = rank, size
        self.settings = settings
        self.transport = transport
        self.store = store
        self.timeline = timeline
        self.stall = stall
        self.cache_slices = cache_slices  # the same on every rank (shared rendezvous records)
        self.wide_segments = wide_segments  # TCP ring without cache slices: 2 MiB segments (segment_size)
        self.grid = grid  # grid[host][local rank] = rank, when hosts are alike (placement.host_grid)
        self.broken: BaseException | None = None  # set by fail(): later collectives refuse to run
        self._scratch: dict[Buf, np.ndarray] = {}
        self._views: dict[tuple[Any, ...], dict[Buf, np.ndarray]] = {}
        self._reducers: dict[tuple[str, ReduceOp, Compression], Reducer] = {}
        self._device: DeviceContext | None = None
        self.symmetric: SymmetricMemory | None = None  # set by the Communicator (ringcore.symmetric)
        self.direct_voting: Any = None  # the direct allreduce's means, made in its first call (plans.direct)
        self.barrier_steps: Any = None  # the barrier's steps, bound once (plans.barrier.bound_barrier)
        # signatures every rank ran without its mailbox (plans.oneshot.decline)
        self.declined: set[int] = set()

    @property
    def allreduce_slice_bytes(self) -> int:
        """Wire bytes per allreduce slice (``Settings.allreduce_slice_bytes``); equal on every rank.

        The hierarchical allreduce in place takes longer ones (``slicing.allreduce_slice_bytes``).
        """
        return self.settings.allreduce_slice_bytes(self.size, self.cache_slices)

    def release(self) -> None:
        """Drop the scratch pools, reducers and device resources (the communicator shut down)."""
        self._scratch.clear()
        self._views.clear()
        self._reducers.clear()
        self._device = None
        self.barrier_steps = None

    def reducer(self, dtype: DType, op: ReduceOp, compression: Compression) -> Reducer:
        """The kernels for one kind of collective, kept so their scratch arrays are reused."""
        key = (dtype.name, op, compression)
        reducer = self._reducers.get(key)
        if reducer is None:
            reducer = self._reducers[key] = Reducer(dtype, op, compression, self.size)
        return reducer

    def device_context(self) -> DeviceContext:
        """Streams, pinned slots, kernels and scratch for GPU buffers, made when the first one arrives."""
        if self._device is None:
            from ringcore.device.resources import DeviceContext

            self._device = DeviceContext(self.settings.gpu_staging_bytes, self.size)
        return self._device

    def scratch_arrays(
        self, schedule: Schedule, buffer: Buffer, wire_dtype: np.dtype
    ) -> dict[Buf, np.ndarray]:
        """USER plus the scratch buffers the schedule uses, reused between collectives.

        The views into the pools are kept too (a small collective spends more
        making them than moving its bytes); they are dropped whenever a pool
        grows, so no view keeps an outgrown pool alive.
        """
        return {Buf.USER: buffer.array, **self.scratch_views(schedule.scratch, buffer.count, wire_dtype)}

    def scratch_pools(self) -> list[np.ndarray]:
        """The scratch pools kept between collectives (for tests and tuning: what memory is held)."""
        return list(self._scratch.values())

    def scratch_views(self, bufs: tuple[Buf, ...], count: int, wire_dtype: np.dtype) -> dict[Buf, np.ndarray]:
        """Views of ``count`` elements of each pool in ``bufs`` (WORK always present); do not modify the dict."""
        key = (bufs, count, wire_dtype)
        views = self._views.pop(key, None)  # kept least recently used first, as every cache here
        if views is None:
            views = self._make_views(bufs, count, wire_dtype)
            if len(self._views) >= _VIEW_CACHE:
                del self._views[next(iter(self._views))]
        self._views[key] = views
        return views

    def _make_views(self, bufs: tuple[Buf, ...], count: int, wire_dtype: np.dtype) -> dict[Buf, np.ndarray]:
        nbytes = count * wire_dtype.itemsize
        views = {}
        for buf in bufs:
            pool = self._scratch.get(buf)
            if pool is None or pool.nbytes < nbytes:
                self._views.clear()
                pool = self._scratch[buf] = np.empty(nbytes, np.uint8)
            views[buf] = pool[:nbytes].view(wire_dtype)
        if Buf.WORK not in views:
            views[Buf.WORK] = np.empty(0, wire_dtype)
        return views

    def execute(
        self,
        desc: Descriptor,
        schedule: Schedule,
        arrays: dict[Buf, np.ndarray],
        reducer: Any,
        sub: int = 0,
        staging: Staging | None = None,
    ) -> None:
        """Run one schedule; on failure, tell the peers, break the communicator and raise.

        ``sub`` numbers the schedules of one collective (allgather's two, a large
        allreduce's slices), so their frames carry different tags. With ``staging``, ``arrays`` are
        device arrays and the staged executor runs the schedule; one-segment
        schedules run in lockstep (:mod:`ringcore.algo.lockstep`) unless they
        write the caller's buffer with ``RINGCORE_ATOMIC=1``, the rest on the
        pipelined Executor.
        """
        if self.transport is None:
            raise RingcoreError("a world of size > 1 needs a transport")
        executor: Any
        common = (self.transport, schedule, arrays, reducer, wire.tag_seq(desc.seq, sub), desc.signature())
        timeout, interrupt, atomic = (
            self.settings.timeout,
            self.stall.interruption if self.stall is not None else None,
            self.settings.atomic,
        )
        if staging is not None:
            from ringcore.device.staging import StagedExecutor

            executor = StagedExecutor(*common, timeout, staging, interrupt=interrupt, atomic=atomic)
        elif (self.timeline is None or not desc.seq) and lockstep.fits(
            schedule, self.transport, arrays, atomic
        ):
            executor = LockstepExecutor(*common, timeout, interrupt=interrupt)
        else:
            timeline = self.timeline if desc.seq else None  # #0 is init's barrier, not the user's
            executor = Executor(*common, timeout, timeline=timeline, interrupt=interrupt, atomic=atomic)
        self.run_guarded(desc, executor.run)

    def run_guarded(self, desc: Descriptor, run: Callable[[], None]) -> None:
        """Call ``run`` (a schedule's execution); on failure, see :meth:`fail`."""
        try:
            run()
        except BaseException as err:
            self.fail(desc, err)

    def fail(self, desc: Descriptor, err: BaseException) -> NoReturn:
        """``desc`` failed with ``err``: tell the peers, break the communicator, raise."""
        if isinstance(err, (FrameMismatch, PeerAborted, PeerFailure, CollectiveTimeout, ProtocolError)):
            error = self._translate(desc, err)
            self.broken = error
            raise error from None
        # e.g. KeyboardInterrupt mid-collective: peers must not hang
        self._abort(
            {
                "kind": "peer_failure",
                "culprit": self.rank,
                "message": f"rank {self.rank} stopped {desc.title}: {type(err).__name__}",
            }
        )
        self.broken = err
        raise err

    def _translate(self, desc: Descriptor, err: Exception) -> RingcoreError:
        """Turn a transport-level failure into the error every rank should raise."""
        where = f"{desc.title} on rank {self.rank}"
        if isinstance(err, FrameMismatch) or (
            isinstance(err, PeerAborted) and err.reason.get("kind") == "mismatch"
        ):
            self._abort({"kind": "mismatch", "rank": self.rank, "message": f"{desc.title}: ranks disagree"})
            return MismatchError(self._explain_mismatch(desc))
        if isinstance(err, PeerAborted):
            reason = err.reason
            culprit = int(reason.get("culprit", err.peer))
            self._abort(reason)
            if reason.get("kind") == "timeout":
                mine = f"; rank {self.rank} itself had been {err.waiting}" if err.waiting else ""
                return CollectiveTimeout(f"{where}: rank {err.peer} gave up: {reason.get('message')}{mine}")
            host = self.transport.peer_name(culprit) if self.transport else ""
            return PeerFailure(f"{where}: {reason.get('message', 'peer aborted')}", culprit, host)
        if isinstance(err, PeerFailure):
            message = f"{where}: {err}"
            self._abort({"kind": "peer_failure", "culprit": err.peer, "message": str(err)})
            return PeerFailure(message, err.peer, err.host)
        if isinstance(err, CollectiveTimeout):
            self._abort({"kind": "timeout", "culprit": self.rank, "message": f"{desc.title}: {err}"})
            return CollectiveTimeout(f"{where}: {err}")
        self._abort({"kind": "protocol", "culprit": self.rank, "message": str(err)})
        return RingcoreError(f"{where}: {err}")

    def _abort(self, reason: dict[str, Any]) -> None:
        if self.transport is not None:
            self.transport.abort(reason)

    def _explain_mismatch(self, desc: Descriptor) -> str:
        """Compare every rank's descriptor through the store; the message names who differs."""
        if self.store is None:
            return f"{desc.title}: ranks disagree (no rendezvous store to compare their arguments)"
        try:
            self.store.set(f"mismatch/{self.rank}", desc.record())
            deadline = time.monotonic() + min(_EXPLAIN_WAIT, self.settings.timeout)
            records = {}
            for peer in range(self.size):
                try:
                    records[peer] = self.store.get(f"mismatch/{peer}", max(0.0, deadline - time.monotonic()))
                except CollectiveTimeout:
                    continue
        except RingcoreError as err:
            return f"{desc.title}: ranks disagree (could not compare arguments: {err})"
        return explain(desc, records, self.size)
