"""The Communicator: validate, keep plans, order collectives, run their plans.

Route. Every collective takes one route: the Communicator validates its
arguments by making its plan (:mod:`ringcore.plans`), takes a ticket in
program order, and in its turn calls ``plan.run(obj, seq)`` (``_run``),
in the caller's thread for a blocking call (no hand-off, lowest latency) or on
one background thread for ``*_async`` calls (so ``allreduce_async`` overlaps
with the caller's compute). An allreduce of a numpy array looks its layout
(dtype, shape, strides, op, compression) up in the plan cache first
(:mod:`ringcore.plans.cache`): a hit skips validation, and the kept plan runs
the form its first turn prepared. Plans receive the
:class:`~ringcore.context.Context` (transport, scratch, reducers, device
resources; ``execute`` and ``fail``), never the Communicator.

Ordering. A collective runs only when all earlier tickets have finished.
Ranks must issue collectives in the same order, as with MPI/NCCL. A blocking
call whose turn it is takes no lock (two lock round trips were 1 us of a 4
KiB allreduce's 12 at N=2): tickets come from an ``itertools.count`` (one
atomic ``next`` under the GIL), and only the thread whose turn it is moves
``_turn`` on (besides ``_skip_abandoned``, under the lock, past tickets whose
callers were interrupted, which nobody runs). A thread that must wait counts
itself in ``_waiters`` under the condition's lock *before* it reads ``_turn``,
and the thread passing the turn reads ``_waiters`` *after* moving it: one of
the two sees the other, so the waiter either finds its turn or is notified.
The argument takes the GIL's one order of bytecodes: a free-threaded build
(3.13t), where ``next`` on a shared count is not atomic, would need the lock
back (not supported; tested on CPython 3.11).

A lost turn. A KeyboardInterrupt can land between taking a ticket and the
``try`` that passes its turn on (in ``_run``: Python checks for signals at
calls and backward jumps), and then no thread owns the turn. A thread waiting for
its own turn looks, every ``TURN_CHECK`` s, whether the collective whose turn
it is has started (``progress``); a blocking call's that has not started in
``LOST_TURN_GRACE`` s (at most ``RINGCORE_TIMEOUT``) is abandoned as an
interrupted one is, so the waiter gets ``CommunicatorClosed`` instead of
waiting forever. An async call's ticket is never lost (no signal reaches the
worker thread, and a ticket that could not be queued is abandoned at once),
though it may wait in the queue while a done-callback runs. An interrupt
inside the turn, before the plan's own failure handling, breaks the
communicator and tells the peers (``ctx.fail``), as one inside the plan does;
the turn is passed in an inner ``finally``, whatever the timeline's file does.

Failure. A collective that fails (a peer died, timed out, or the ranks
disagree) first tells every peer (an ABORT frame with the reason), so all
ranks fail promptly with an error that names the culprit, then marks the
communicator broken: later calls raise :class:`CommunicatorClosed` until
``shutdown()`` and a new ``init()``. A failure before any data moved (bad
arguments, ranks that disagree) leaves the caller's buffer untouched (but for
hosts that disagree in a hierarchical allreduce: the note says which elements
changed). A peer
that dies mid-allreduce can leave it partly reduced, as with Gloo and NCCL,
unless ``RINGCORE_ATOMIC=1`` (one more copy of the buffer per allreduce); the
error's note says which elements (see :mod:`ringcore.slicing`).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ringcore.algo.hierarchical import Grid
from ringcore.config import Settings
from ringcore.context import Context
from ringcore.descriptor import Descriptor
from ringcore.errors import CollectiveTimeout, CommunicatorClosed
from ringcore.kernels import numpy_ops
from ringcore.ops import Compression, ReduceOp
from ringcore.plans import allreduce, broadcast, gather
from ringcore.plans.barrier import BarrierPlan
from ringcore.plans.base import Plan
from ringcore.plans.cache import PlanCache
from ringcore.stall import Progress, StallInspector
from ringcore.store import StoreClient, StoreServer
from ringcore.symmetric import SymmetricMemory
from ringcore.timeline import Timeline, rank_path
from ringcore.transport.base import Transport

TURN_CHECK = 1.0  # seconds between a waiting thread's looks at whether the turn's collective started
LOST_TURN_GRACE = 10.0  # seconds a turn may go unstarted before it is taken for lost ("A lost turn")
_KEYED = frozenset({str, ReduceOp, Compression, type(None)})  # op and compression types a plan key holds

log = logging.getLogger("ringcore")


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
        except BaseException:  # even SystemExit: the async worker that calls it must live on
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
        grid: Grid | None = None,
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
        self._waiters = 0  # threads waiting in _await_turn for their ticket
        self._abandoned: set[int] = set()  # tickets whose caller was interrupted before its turn
        self._queued: set[int] = set()  # async tickets not yet taken up by the worker (never lost)
        self._tickets = itertools.count()  # next(): the next ticket, atomically ("Ordering")
        self._turn = 0  # the ticket whose collective runs now, or runs next
        self._closed = False
        self._jobs: queue.Queue[Any] = queue.Queue()
        self._worker: threading.Thread | None = None
        self._plans = PlanCache(settings.plan_cache_bytes)  # allreduce plans by numpy layout
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
            rank,
            size,
            settings,
            transport,
            store,
            self.timeline,
            self.stall,
            cache_slices,
            wide_segments,
            grid,
        )
        self._barrier = BarrierPlan(self.ctx)
        self.symmetric = SymmetricMemory(rank, size, shared=size > 1 and local_size == size)
        self.ctx.symmetric = self.symmetric

    @property
    def allreduce_slice_bytes(self) -> int:
        """Wire bytes per allreduce slice (``Settings.allreduce_slice_bytes``); equal on every rank.

        The hierarchical allreduce in place takes longer ones (``slicing.allreduce_slice_bytes``).
        """
        return self.ctx.allreduce_slice_bytes

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
                After a mismatch ``buf`` is untouched (the hierarchical allreduce
                across hosts that disagree: the note says otherwise). After a peer failure or
                timeout the error's note says which elements may be partly
                reduced (none with ``RINGCORE_ATOMIC=1``) and, above
                ``RINGCORE_SLICE_BYTES``, which already hold the result.
        """
        return self._run(self._allreduce_plan(buf, op, compression), buf, name)

    def _allreduce_plan(self, buf: Any, op: Any, compression: Any) -> Plan:
        """The kept plan of a writable numpy array's layout (made on a miss), else one for this call.

        A hit skips validation: an array whose dtype, shape and strides (hence
        contiguity) match a layout that passed it with the same op and
        compression, and which is still writable, validates the same. Nothing
        of the caller's array is kept. Only an op and a compression of plain types
        (``_KEYED``) make a key: the cache compares keys with ``==``, which an array
        passed as ``op`` would answer element by element (validation names it instead).
        """
        if (
            type(buf) is np.ndarray
            and buf.flags.writeable
            and type(op) in _KEYED
            and type(compression) in _KEYED
        ):
            key = (buf.dtype, buf.shape, buf.strides, op, compression)
            plan = self._plans.get(key)
            if plan is None:
                plan = allreduce.plan_for_layout(self.ctx, buf, op, compression)
                self._plans.put(key, plan)
            return plan
        return allreduce.plan_for_call(self.ctx, buf, op, compression)

    def plan_cache(self) -> dict[str, Any]:
        """What the plan cache holds: ``layouts``, ``scratch_bytes``, ``forms`` and ``calls`` per form.

        For tests and tuning; see :mod:`ringcore.plans.cache` and the forms in
        :mod:`ringcore.plans.allreduce`.
        """
        return self._plans.stats()

    def clear_plan_cache(self) -> None:
        """Forget every kept plan (their layouts' next calls validate and prepare again)."""
        self._plans.clear()

    def allreduce_async(
        self, buf: Any, op: Any = "sum", compression: Any = None, name: str | None = None
    ) -> Handle:
        """Start an allreduce; ``handle.wait()`` returns ``buf`` once it is reduced.

        Do not read or write ``buf`` until then.
        """
        return self._run_async(self._allreduce_plan(buf, op, compression), buf, name)

    def broadcast(self, buf: Any, root: int = 0, name: str | None = None) -> Any:
        """Copy ``root``'s ``buf`` into every rank's ``buf``, in place; returns ``buf``."""
        return self._run(broadcast.plan_broadcast(self.ctx, buf, root), buf, name)

    def broadcast_async(self, buf: Any, root: int = 0, name: str | None = None) -> Handle:
        """Start a broadcast; ``handle.wait()`` returns ``buf``."""
        return self._run_async(broadcast.plan_broadcast(self.ctx, buf, root), buf, name)

    def allgather(self, x: Any, name: str | None = None) -> np.ndarray:
        """Concatenate every rank's ``x`` along axis 0 (first dimensions may differ); a new array."""
        return self._run(gather.plan_allgather(self.ctx, x), x, name)

    def reduce_scatter(
        self, x: Any, op: Any = "sum", compression: Any = None, name: str | None = None
    ) -> np.ndarray:
        """This rank's chunk (``np.array_split`` of axis 0) of ``x`` reduced over all ranks; a new array."""
        return self._run(gather.plan_reduce_scatter(self.ctx, x, op, compression), x, name)

    def allgather_async(self, x: Any, name: str | None = None) -> Handle:
        """Start an allgather; ``handle.wait()`` returns the new array. Do not write ``x`` until then."""
        return self._run_async(gather.plan_allgather(self.ctx, x), x, name)

    def reduce_scatter_async(
        self, x: Any, op: Any = "sum", compression: Any = None, name: str | None = None
    ) -> Handle:
        """Start a reduce_scatter; ``handle.wait()`` returns this rank's chunk. Do not write ``x`` until then."""
        return self._run_async(gather.plan_reduce_scatter(self.ctx, x, op, compression), x, name)

    def barrier(self) -> None:
        """Return once every rank has entered the barrier."""
        self._run(self._barrier, None, None)

    def empty(self, shape: int | tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
        """A new, uninitialised numpy array in symmetric memory; a collective (see ``ringcore.empty``)."""
        shape = (shape,) if isinstance(shape, int | np.integer) else tuple(shape)
        if not all(isinstance(n, int | np.integer) and not isinstance(n, bool) for n in shape):
            raise TypeError(f"ringcore.empty: shape must be an int or a tuple of ints, got {shape!r}")
        if any(n < 0 for n in shape):
            raise ValueError(f"ringcore.empty: negative dimension in shape {shape}")
        dt = np.dtype(dtype)
        if dt.hasobject:
            raise TypeError(f"ringcore.empty: dtype {dt} holds Python objects, not bytes")

        def agree(ok: bool) -> bool:
            return bool(self.allreduce(np.array([int(ok)], np.int32), op="min")[0])

        return self.symmetric.empty(tuple(int(n) for n in shape), dt, self.allgather, agree)

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
        self.ctx.direct_voting = None  # its words are views of the mailboxes: dropped before they close
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
        self.symmetric.close()
        self.ctx.release()

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"Communicator(rank={self.rank}, size={self.size})"

    # ------------------------------------------------------------------ ordering

    def _take_ticket(self, kind: str) -> int:
        if self._closed:
            raise self._closed_error(kind)
        return next(self._tickets)

    def _closed_error(self, kind: str) -> CommunicatorClosed:
        return CommunicatorClosed(f"{kind}: the communicator was shut down; call ringcore.init() again")

    def _run_async(self, plan: Plan, obj: Any, name: str | None) -> Handle:
        """Queue ``plan`` on ``obj`` for the async thread; the handle completes in its turn.

        Under the lock: the one worker runs jobs in queue order, so tickets must be queued in
        the order they were taken (two threads calling at once), and none after shutdown's end.
        """
        with self._lock:
            ticket = self._take_ticket(plan.kind)
            handle = Handle(f"{plan.kind} #{ticket + 1}")
            self._queued.add(ticket)
            try:
                self._jobs.put((plan, obj, name, ticket, handle))
            except BaseException as err:  # e.g. KeyboardInterrupt: the ticket will never run
                self._queued.discard(ticket)
                self._abandon(ticket, err)
                raise
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name="ringcore-async", daemon=True)
                self._worker.start()
        return handle

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            plan, obj, name, ticket, handle = job
            self._queued.discard(ticket)
            try:
                handle._finish(result=self._run(plan, obj, name, ticket))
            except BaseException as err:  # handed to the caller through the handle
                handle._finish(error=err)

    def _run(self, plan: Plan, obj: Any, name: str | None, ticket: int | None = None) -> Any:
        """Run ``plan`` on ``obj`` in ``ticket``'s turn: wait for it, run ``plan.run(obj, seq)``, pass the turn on.

        A blocking call (``ticket`` None) takes its ticket here and runs in the caller's
        thread; the async worker passes the ticket the call took. The one place every
        collective runs: the checks before it (a broken
        communicator, a stall inspector's verdict), the progress record the
        stall inspector reads, the timeline's event, and numpy's floating-point
        errors ignored (overflow, NaN, wrap-around are results, not warnings).
        Every call here is time each rank's 4 KiB allreduce waits for, so the
        turn is passed inline.
        """
        if ticket is None:  # _take_ticket written out: a 4 KiB allreduce waits for every call here
            if self._closed:
                raise self._closed_error(plan.kind)
            ticket = next(self._tickets)
        seq = ticket + 1  # collectives are numbered from 1 in messages
        if self._turn != ticket:
            self._await_turn(ticket)
        timeline, start, progress = self.timeline, 0.0, self.progress
        try:  # from the first call after the turn is this thread's: a signal there passes it on too
            progress.seq, progress.kind, progress.name, progress.done = seq, plan.kind, name, False
            progress.version += 1  # last: the record is whole (stall.Progress)
            if timeline is not None:
                start = Timeline.now_us()
            if self.ctx.broken is not None or (self.stall is not None and self.stall.reason is not None):
                self._check_usable(plan.kind, seq)  # raises
            variable = numpy_ops.FP_ERRORS
            if variable is None:
                return numpy_ops.ignoring_fp_errors(plan.run, obj, seq)
            token = variable.set(
                numpy_ops.IGNORE_FP_ERRORS
            )  # ignoring_fp_errors, written out: one call fewer
            try:
                return plan.run(obj, seq)
            finally:
                variable.reset(token)
        except BaseException as err:
            if self.ctx.broken is None and not isinstance(err, Exception):
                # e.g. KeyboardInterrupt before the plan's own handling began: peers must not wait
                self.ctx.fail(Descriptor(plan.kind, seq, "", ()), err)
            raise
        finally:
            try:
                progress.done = True
                progress.version += 1
                if timeline is not None:
                    args = {"seq": seq, "name": name, "bytes": plan.nbytes, **plan.details}
                    timeline.complete(f"{plan.kind} #{seq}", "collective", start, Timeline.now_us(), args)
            finally:  # the turn passes whatever the timeline's file does
                self._turn += 1  # only this thread may move it now ("Ordering" in the module docstring)
                if self._abandoned or self._waiters:
                    with self._lock:
                        self._skip_abandoned()

    def _await_turn(self, ticket: int) -> None:
        """Wait until ``_turn`` is ``ticket``: counted in ``_waiters`` before reading it ("Ordering"),
        looking for a lost turn every ``TURN_CHECK`` s ("A lost turn")."""
        with self._cond:
            self._waiters += 1
            try:
                watched, since = -1, 0.0  # the turn whose start is awaited, since when
                while self._turn != ticket:
                    if self._turn > ticket:  # taken for lost while this thread was slow to reach it
                        raise CommunicatorClosed(
                            f"collective #{ticket + 1}: its turn was taken for lost; call ringcore.shutdown() "
                            "and ringcore.init() again"
                        ) from self.ctx.broken
                    try:
                        self._cond.wait(TURN_CHECK)
                    except BaseException as err:
                        # e.g. KeyboardInterrupt: later tickets must not wait for this one
                        self._abandon(ticket, err)
                        raise
                    turn, now = self._turn, time.monotonic()
                    if turn == ticket or self.progress.seq == turn + 1 or turn in self._queued:
                        watched = -1  # its collective runs, or waits in the queue behind a done-callback
                    elif watched != turn:
                        watched, since = turn, now
                    elif now - since > min(LOST_TURN_GRACE, self.settings.timeout):
                        self._abandon(turn, None)
            finally:
                self._waiters -= 1

    def _abandon(self, ticket: int, err: BaseException | None) -> None:
        """``ticket``'s caller gave up before its turn (``err``; None: its turn was lost, never
        started): skip it, and break the communicator.

        This rank will never run that collective while its peers will, so the
        ranks no longer agree on the order; later calls raise at once instead
        of waiting forever for the turn to pass.
        """
        with self._lock:
            self._abandoned.add(ticket)
            if self.ctx.broken is None:
                why = (
                    f"was interrupted ({type(err).__name__}) before its turn"
                    if err is not None
                    else "never started in its turn (its caller was interrupted, e.g. by KeyboardInterrupt, "
                    "as it took the turn)"
                )
                self.ctx.broken = CommunicatorClosed(
                    f"collective #{ticket + 1} {why}, so the ranks no longer agree on the order of collectives"
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
            numpy_ops.ignoring_fp_errors(self._barrier.run, None, 0)
