"""The Communicator: validate, remember layouts, order collectives, run their plans.

Layers. The Communicator validates a collective's arguments, keys the array's
layout (dtype, shape, strides, op, compression) in a cache bounded in count
and in the scratch its layouts keep (``RINGCORE_PLAN_CACHE_BYTES``), and runs
the collective's plan in its turn, handing it the :class:`~ringcore.context.Context`
(transport, scratch, reducers, device resources; ``execute`` and ``fail``);
plans never see the Communicator.

Ordering. Every collective gets a ticket when it is called, in program order;
it runs only when all earlier tickets have finished. Blocking calls run in
the caller's thread (no hand-off, lowest latency); ``*_async`` calls run on
one background thread, so ``allreduce_async`` overlaps with the caller's
compute. Ranks must issue collectives in the same order, as with MPI/NCCL.

Failure. A collective that fails (a peer died, timed out, or the ranks
disagree) first tells every peer (an ABORT frame with the reason), so all
ranks fail promptly with an error that names the culprit, then marks the
communicator broken: later calls raise :class:`CommunicatorClosed` until
``shutdown()`` and a new ``init()``. A failure before any data moved (bad
arguments, ranks that disagree) leaves the caller's buffer untouched. A peer
that dies mid-allreduce can leave it partly reduced, as with Gloo and NCCL,
unless ``RINGCORE_ATOMIC=1`` (one more copy of the buffer per allreduce); the
error's note says which elements (see :mod:`ringcore.collectives`).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from ringcore import bound, collectives, latency
from ringcore.algo.steps import Buf
from ringcore.buffers import checked_buffer
from ringcore.config import Settings
from ringcore.context import Context
from ringcore.errors import CollectiveTimeout, CommunicatorClosed
from ringcore.kernels.numpy_ops import quietly
from ringcore.stall import Progress, StallInspector
from ringcore.store import StoreClient, StoreServer
from ringcore.timeline import Timeline, rank_path
from ringcore.transport.base import Transport

log = logging.getLogger("ringcore")

_CHECKED_CACHE = 4096  # array layouts whose validation is remembered (Communicator._allreduce_plan)


class Handle:
    """The future result of an ``*_async`` collective."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._event = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[Handle], None]] = []
        self._callback_lock = threading.Lock()

    def done(self) -> bool:
        """True once the collective finished, successfully or not."""
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> Any:
        """Block until done; return the result or raise the collective's error.

        Raises:
            TimeoutError: not done within ``timeout`` seconds (the collective goes on).
        """
        if not self._event.wait(timeout):
            raise TimeoutError(f"{self.kind} not finished after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result

    def exception(self) -> BaseException | None:
        """The collective's error once it is done (``None`` if it succeeded or is still running)."""
        return self._error if self._event.is_set() else None

    def add_done_callback(self, fn: Callable[[Handle], None]) -> None:
        """Call ``fn(handle)`` once the collective is done: at once if it already is.

        ``fn`` runs on ringcore's async thread (or the caller's, if done), so
        it must be quick and must not wait for another collective; exceptions
        it raises are logged, not propagated. Frameworks use it to complete
        their own futures (``ringcore.torch``'s process group).
        """
        with self._callback_lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        self._call(fn)

    def _finish(self, result: Any = None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error
        with self._callback_lock:
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            self._call(fn)

    def _call(self, fn: Callable[[Handle], None]) -> None:
        try:
            fn(self)
        except Exception:
            log.exception("%s: a done-callback raised", self.kind)


class Communicator:
    """A group of ranks connected to each other; every collective is a method.

    Made by :func:`ringcore.init`; use it directly to embed ringcore in a framework.
    """

    def __init__(
        self,
        rank: int,
        size: int,
        local_rank: int,
        local_size: int,
        settings: Settings,
        transport: Transport | None,
        store: StoreClient | None = None,
        server: StoreServer | None = None,
        cache_slices: bool = False,
        wide_segments: bool = False,
        cross_rank: int = 0,
        cross_size: int = 1,
    ) -> None:
        self.rank, self.size = rank, size
        self.local_rank, self.local_size = local_rank, local_size
        self.cross_rank, self.cross_size = cross_rank, cross_size  # among ranks with this local rank
        self.settings = settings
        self.cache_slices = cache_slices  # the same on every rank (shared rendezvous records)
        self.wide_segments = wide_segments  # TCP ring without cache slices: 2 MiB segments (segment_size)
        self.transport = transport
        self.store = store
        self.server = server
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)  # `with self._lock`: Condition's __enter__ is Python
        self._waiters = 0  # threads waiting in _run_turn for their ticket
        self._abandoned: set[int] = set()  # tickets whose caller was interrupted before its turn
        self._next_ticket = self._turn = 0
        self._closed = False
        self._jobs: queue.Queue[Any] = queue.Queue()
        self._worker: threading.Thread | None = None
        self._checked: dict[tuple[Any, ...], tuple[Any, ...]] = {}  # layouts that validated (_allreduce_plan)
        self._held: dict[tuple[Any, ...], int] = {}  # scratch bytes a layout in _checked keeps for itself
        self._held_bytes = 0
        self.progress = Progress()
        self.timeline: Timeline | None = None
        if settings.timeline:
            self.timeline = Timeline(rank_path(str(settings.timeline), rank, size), rank)
        self.stall: StallInspector | None = None
        if store is not None:
            self.stall = StallInspector(
                rank, size, store.address, store.connect_again, self.progress, settings
            )
        self.ctx = Context(
            rank, size, settings, transport, store, self.timeline, self.stall, cache_slices, wide_segments
        )

    @property
    def allreduce_slice_bytes(self) -> int:
        """Wire bytes per allreduce slice (``Settings.allreduce_slice_bytes``); equal on every rank."""
        return self.ctx.allreduce_slice_bytes

    @property
    def bound_barrier(self) -> Any:
        """The barrier's bound steps, once the first barrier made them."""
        return self.ctx.bound_barrier

    @property
    def _scratch(self) -> dict[Buf, np.ndarray]:
        return self.ctx._scratch  # the scratch pools (tests check they are released)

    # ------------------------------------------------------------------ public API

    def allreduce(self, buf: Any, op: Any = "sum", compression: Any = None, name: str | None = None) -> Any:
        """Reduce ``buf`` over all ranks, in place; returns ``buf``.

        Args:
            buf: a writable, contiguous array-like (numpy, CPU torch tensor, bytearray...).
            op: ``"sum"``, ``"avg"``, ``"min"``, ``"max"``, ``"prod"`` or a ``ReduceOp``.
            compression: ``None`` or ``"fp16"`` (float16 on the wire, accumulation in
                ``buf``'s dtype; all ranks still end bit-identical).
            name: a label for the timeline and the stall inspector (e.g. the tensor's name).

        Raises:
            TypeError, ValueError: bad arguments (before anything is sent).
            MismatchError, PeerFailure, CollectiveTimeout: see ``ringcore.errors``.
                After a mismatch ``buf`` is untouched. After a peer failure or
                timeout the error's note says which elements may be partly
                reduced (none with ``RINGCORE_ATOMIC=1``) and, above
                ``RINGCORE_SLICE_BYTES``, which already hold the result.
        """
        if type(buf) is np.ndarray:
            checked = self._checked_layout(buf, op, compression)[1]
            if (
                checked is not None
                and (layout := checked[3]) is not None  # latency.SmallAllreduce or bound.BoundAllreduce
                and layout.bound
                and buf.flags.writeable
            ):
                self._call_bound("allreduce", name, layout.run, buf)
                return buf
        return self._call(self._allreduce_plan(buf, op, compression), name)

    def _allreduce_plan(self, buf: Any, op: Any, compression: Any) -> collectives.Plan:
        """``plan_allreduce``, with validation skipped for numpy arrays shaped like ones that passed it.

        Validating costs a 4 KiB allreduce a noticeable part of its time, and
        training loops reduce arrays of the same few layouts every step. An
        array whose dtype, shape and strides (hence contiguity) match one that
        passed validation with the same op and compression, and which is still
        writable, validates the same, so only its :class:`Buffer` is made.
        Nothing of the caller's array is kept. A layout small enough for
        recursive doubling also keeps its steps bound to scratch
        (:mod:`ringcore.latency`); a larger one that runs in place keeps its
        schedule (:mod:`ringcore.bound`).
        """
        if type(buf) is not np.ndarray:
            return collectives.plan_allreduce(buf, op, compression, self.size)
        key, checked = self._checked_layout(buf, op, compression)
        if key is None:
            return collectives.plan_allreduce(buf, op, compression, self.size)
        if checked is not None and buf.flags.writeable:
            dtype, reduce_op, comp, layout = checked
            buffer = checked_buffer(buf, dtype)
            if layout is not None:
                return layout.plan(buf, buffer)
            return collectives.plan_checked_allreduce(buf, buffer, reduce_op, comp)
        buffer, reduce_op, comp = collectives.check_allreduce(buf, op, compression)
        layout = latency.small_allreduce(self.ctx, buffer, reduce_op, comp) or bound.bound_allreduce(
            self.ctx, buffer, reduce_op, comp
        )
        held = 2 * buffer.nbytes if isinstance(layout, latency.SmallAllreduce) else 0  # its own scratch
        self._forget_layouts(held)
        self._checked[key] = (buffer.dtype, reduce_op, comp, layout)
        if held:
            self._held[key] = held
            self._held_bytes += held
        return collectives.plan_checked_allreduce(buf, buffer, reduce_op, comp)

    def _forget_layouts(self, incoming: int) -> None:
        """Make room for a layout holding ``incoming`` bytes: forget the least recently used ones.

        The cache keeps at most ``_CHECKED_CACHE`` layouts and, of the scratch small
        layouts keep for themselves (two buffers of their size at most),
        ``RINGCORE_PLAN_CACHE_BYTES``: training with ever new shapes (sequence
        lengths, ragged batches) must not grow memory without bound.
        """
        limit = self.settings.plan_cache_bytes
        while self._checked and (len(self._checked) >= _CHECKED_CACHE or self._held_bytes + incoming > limit):
            oldest = next(iter(self._checked))  # the least recently used (_checked_layout)
            del self._checked[oldest]
            self._held_bytes -= self._held.pop(oldest, 0)

    def plan_cache(self) -> dict[str, int]:
        """What the layout cache holds: ``{"layouts": n, "scratch_bytes": bytes}`` (for tests and tuning)."""
        return {"layouts": len(self._checked), "scratch_bytes": self._held_bytes}

    def clear_plan_cache(self) -> None:
        """Forget every remembered layout (their next call validates and plans again)."""
        self._checked.clear()
        self._held.clear()
        self._held_bytes = 0

    def _checked_layout(
        self, buf: np.ndarray, op: Any, compression: Any
    ) -> tuple[tuple | None, tuple | None]:
        """``(key, validation)`` of ``buf``'s layout in the validation cache.

        ``validation`` is None for a layout not validated yet; ``key`` is None
        when ``op`` or ``compression`` is unhashable (the planner then says
        whether it is wrong). A hit moves the layout to the cache's end, so a
        full cache forgets the layout used least recently.
        """
        key = (buf.dtype, buf.shape, buf.strides, op, compression)
        try:
            checked = self._checked.pop(key, None)
        except TypeError:
            return None, None
        if checked is not None:
            self._checked[key] = checked
        return key, checked

    def allreduce_async(
        self, buf: Any, op: Any = "sum", compression: Any = None, name: str | None = None
    ) -> Handle:
        """Start an allreduce; ``handle.wait()`` returns ``buf`` once it is reduced.

        Do not read or write ``buf`` until then.
        """
        return self._call_async(self._allreduce_plan(buf, op, compression), name)

    def broadcast(self, buf: Any, root: int = 0, name: str | None = None) -> Any:
        """Copy ``root``'s ``buf`` into every rank's ``buf``, in place; returns ``buf``."""
        return self._call(collectives.plan_broadcast(buf, root, self.rank, self.size), name)

    def broadcast_async(self, buf: Any, root: int = 0, name: str | None = None) -> Handle:
        """Start a broadcast; ``handle.wait()`` returns ``buf``."""
        return self._call_async(collectives.plan_broadcast(buf, root, self.rank, self.size), name)

    def allgather(self, x: Any, name: str | None = None) -> np.ndarray:
        """Concatenate every rank's ``x`` along axis 0 (first dimensions may differ); a new array."""
        return self._call(collectives.plan_allgather(x), name)

    def reduce_scatter(
        self, x: Any, op: Any = "sum", compression: Any = None, name: str | None = None
    ) -> np.ndarray:
        """This rank's chunk (``np.array_split`` of axis 0) of ``x`` reduced over all ranks; a new array."""
        return self._call(collectives.plan_reduce_scatter(x, op, compression), name)

    def allgather_async(self, x: Any, name: str | None = None) -> Handle:
        """Start an allgather; ``handle.wait()`` returns the new array. Do not write ``x`` until then."""
        return self._call_async(collectives.plan_allgather(x), name)

    def reduce_scatter_async(
        self, x: Any, op: Any = "sum", compression: Any = None, name: str | None = None
    ) -> Handle:
        """Start a reduce_scatter; ``handle.wait()`` returns this rank's chunk. Do not write ``x`` until then."""
        return self._call_async(collectives.plan_reduce_scatter(x, op, compression), name)

    def barrier(self) -> None:
        """Return once every rank has entered the barrier."""
        bound = self.bound_barrier
        if bound is not None:
            self._call_bound("barrier", None, bound.run)
        else:
            self._call(latency.plan_barrier(self.ctx))

    def shutdown(self) -> None:
        """Finish queued async work, say goodbye to peers and close everything; idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
        if self._worker is not None:
            self._jobs.put(None)
            self._worker.join(timeout=self.settings.timeout)
        if self.stall is not None:
            self.stall.stop()
        if self.transport is not None:
            self.transport.close()
        if self.store is not None:
            self.store.leave(self.rank)
            self.store.close()
        if self.timeline is not None:
            self.timeline.close()
        if self.server is not None:
            self.server.retire()  # serves until every rank has left: see ringcore.store
        self.clear_plan_cache()
        self.ctx.release()

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"Communicator(rank={self.rank}, size={self.size})"

    # ------------------------------------------------------------------ ordering

    def _take_ticket(self, kind: str) -> tuple[int, int]:
        with self._lock:
            if self._closed:
                raise self._closed_error(kind)
            ticket = self._next_ticket
            self._next_ticket += 1
            seq = ticket + 1  # collectives are numbered from 1 in messages
        return ticket, seq

    def _closed_error(self, kind: str) -> CommunicatorClosed:
        return CommunicatorClosed(f"{kind}: the communicator was shut down; call ringcore.init() again")

    def _call(self, plan: collectives.Plan, name: str | None = None) -> Any:
        plan.name = name
        ticket, seq = self._take_ticket(plan.kind)
        return self._run_turn(plan, ticket, seq)

    def _call_async(self, plan: collectives.Plan, name: str | None = None) -> Handle:
        plan.name = name
        ticket, seq = self._take_ticket(plan.kind)
        handle = Handle(f"{plan.kind} #{seq}")
        self._jobs.put((plan, ticket, seq, handle))
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, name="ringcore-async", daemon=True)
            self._worker.start()
        return handle

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            plan, ticket, seq, handle = job
            try:
                handle._finish(result=self._run_turn(plan, ticket, seq))
            except BaseException as err:  # handed to the caller through the handle
                handle._finish(error=err)

    def _run_turn(self, plan: collectives.Plan, ticket: int, seq: int) -> Any:
        self._await_turn(ticket)
        start = Timeline.now_us() if self.timeline is not None else 0.0
        self.progress.enter(seq, plan.kind, plan.name)
        try:
            self._check_usable(plan.kind, seq)
            return quietly(plan.run, self.ctx, seq)  # overflow, NaN, wrap-around: results, not warnings
        finally:
            self.progress.leave()
            if self.timeline is not None:
                args = {"seq": seq, "name": plan.name, "bytes": plan.nbytes, **plan.details}
                self.timeline.complete(f"{plan.kind} #{seq}", "collective", start, Timeline.now_us(), args)
            self._pass_turn()

    def _call_bound(self, kind: str, name: str | None, run: Callable[..., None], *args: Any) -> None:
        """Run ``run(*args, seq)`` (bound steps: :mod:`ringcore.latency`) as a blocking collective.

        ``_call`` without a plan: the same ticket, turn, checks and progress
        record as :meth:`_run_turn`, without what a small collective pays most
        for per call (planning, a Buffer, the timeline, which bound collectives
        never have). :meth:`_take_ticket` and :meth:`_pass_turn` are written
        out: every call saved here is time each rank's 4 KiB allreduce waits for.
        """
        with self._lock:
            if self._closed:
                raise self._closed_error(kind)
            ticket = self._next_ticket
            self._next_ticket = ticket + 1
        seq = ticket + 1
        if self._turn != ticket:
            self._await_turn(ticket)
        self.progress.enter(seq, kind, name)
        try:
            self._check_usable(kind, seq)
            quietly(run, *args, seq)
        finally:
            self.progress.leave()
            with self._lock:  # _pass_turn
                self._turn += 1
                if self._abandoned or self._waiters:
                    self._skip_abandoned()

    def _await_turn(self, ticket: int) -> None:
        # Only the thread whose turn it is moves _turn on, so seeing it is ours needs no lock.
        if self._turn != ticket:
            with self._cond:
                while self._turn != ticket:
                    self._waiters += 1
                    try:
                        self._cond.wait()
                    except BaseException as err:
                        # e.g. KeyboardInterrupt: later tickets must not wait for this one
                        self._abandon(ticket, err)
                        raise
                    finally:
                        self._waiters -= 1

    def _abandon(self, ticket: int, err: BaseException) -> None:
        """``ticket``'s caller gave up before its turn: skip it, and break the communicator.

        This rank will never run that collective while its peers will, so the
        ranks no longer agree on the order; later calls raise at once instead
        of waiting forever for the turn to pass.
        """
        with self._lock:
            self._abandoned.add(ticket)
            if self.ctx.broken is None:
                self.ctx.broken = CommunicatorClosed(
                    f"collective #{ticket + 1} was interrupted ({type(err).__name__}) before its turn, "
                    "so the ranks no longer agree on the order of collectives"
                )
            self._skip_abandoned()

    def _check_usable(self, kind: str, seq: int) -> None:
        broken = self.ctx.broken
        if broken is not None:
            raise CommunicatorClosed(
                f"{kind} #{seq}: the communicator is unusable after an earlier failure "
                f"({broken}); call ringcore.shutdown() and ringcore.init() again"
            ) from broken
        if self.stall is not None and (reason := self.stall.interruption()):
            raise CollectiveTimeout(f"{kind} #{seq}: {reason}")

    def _pass_turn(self) -> None:
        with self._lock:
            self._turn += 1
            self._skip_abandoned()

    def _skip_abandoned(self) -> None:
        """Move the turn past abandoned tickets and wake the waiters (with the lock held)."""
        while self._turn in self._abandoned:
            self._abandoned.discard(self._turn)
            self._turn += 1
        if self._waiters:  # notify_all is slow Python even with nobody waiting
            self._cond.notify_all()

    def confirm_world(self) -> None:
        """A barrier outside the numbered collectives (#0): every rank is connected and alive."""
        if self.size > 1:
            quietly(collectives.plan_barrier().run, self.ctx, 0)
