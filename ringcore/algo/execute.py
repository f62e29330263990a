"""Run a :class:`~ringcore.algo.steps.Schedule` over a transport: the only algo code that does I/O.

Theory of operation. The schedule is compiled once into a
:class:`~ringcore.algo.program.Program` (every (step, segment) item with its
regions cut, queued per connection in the order the transport's FIFO
matching needs; cached per transport). Each run posts every send and receive
as soon as it is allowed:

* a send of segment k at step s waits until segment k of every earlier step
  has been received and combined (``done_upto[k] >= s``): what it sends is
  what those steps produced. Steps that run ``alongside`` one another touch
  none of each other's regions, so they wait only for the steps before
  their group (``after[s]``);
* a receive waits until no pending send reads, and no pending receive or
  combine uses, the region it writes (a region sent at step s and received
  into at step s+N is safe), and until the last earlier step that received
  into the same region has combined it (``Program.landing``), whichever
  connection gets its turn first (a GPU rank's staging slots run out per
  connection);
* a combine of segment k at step s waits until segment k of every earlier
  step is done, and until no pending send still reads the region it writes:
  receives are posted ahead, so a frame can arrive before an earlier step has
  written the region its combine reads (the hierarchical allreduce's
  cross-host frames race the same host's local ones);
* a ``whole`` step (one frame, not pipelined) sends, and receives into a
  non-empty region, only once every earlier step is done, so regions that
  nest from step to step (halving-doubling) are written in step order.

Receives are posted ahead, so the kernel can land segment k+1 while this
thread combines segment k and sends it on. All waiting happens in
``transport.progress``; when nothing has moved for ``timeout`` seconds the run
raises :class:`~ringcore.errors.CollectiveTimeout` naming what it waits for.
A rank that could not run for longer than ``timeout`` (stopped, starved) and
then finds a peer gone raises the timeout too: its peers gave up on it, so
the peer that closed is not the cause (:mod:`ringcore.algo.waiting`, the one
wait loop every executor shares).

Compression: a send from USER when the wire dtype differs first converts the
segment into the same region of WORK (which is in the wire dtype).

In-place schedules write USER as they go: the allgather receives into it and
the last reduce (a ``commit`` combine) writes there. With ``atomic``
(``RINGCORE_ATOMIC=1``), before the first write into a region of USER its
values are saved into the same region of WORK, and if the run fails every
saved region is put back before the error propagates, so the caller's buffer
is untouched. That costs one copy of the buffer per run (a quarter of the
time of an N=2 allreduce on loopback), so it is off by default: a failed run
then leaves the regions it had written partly reduced, as Gloo, NCCL and MPI
do. Only a dead or stalled peer can fail a run after USER is written: every
rank's signature has been checked, directly or through the ring (or the
halving pairs), before any rank's reduced data can reach USER, so a mismatch
never touches it; the hierarchical allreduce in place is the exception
(``Schedule.early_user``: its local rounds write USER before frames from other
hosts arrive). :func:`check_in_place` refuses, before anything is sent,
an in-place schedule whose WORK cannot hold the backups.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from ringcore.algo.program import Item, Key, Route, compile_program
from ringcore.algo.steps import Buf, Schedule
from ringcore.algo.waiting import Watch
from ringcore.errors import PeerFailure
from ringcore.kernels.numpy_ops import Reducer
from ringcore.timeline import Timeline
from ringcore.transport import wire
from ringcore.transport.base import Request, Transport

_USER, _WORK, _STAGE = Buf.USER, Buf.WORK, Buf.STAGE  # plain names: enum attribute access is slow


def check_in_place(schedule: Schedule, user: Any, work: Any, atomic: bool) -> None:
    """Refuse an in-place schedule (result in USER) whose WORK cannot serve it, before anything is sent.

    Sends from USER go out as they are, so WORK must have the caller's dtype
    (no compression); with ``atomic``, every region of USER is backed up into
    the same region of WORK, so WORK must be as long as USER.
    """
    if user is None or work is None or not schedule.steps:
        return
    if schedule.result is None or schedule.result.buf != _USER:
        return
    if work.dtype != user.dtype:
        raise ValueError("an in-place schedule needs WORK in the caller's dtype (no compression)")
    if atomic and work.size < user.size:
        raise ValueError(
            f"an in-place schedule with atomic backups needs WORK as long as the caller's buffer "
            f"({work.size} < {user.size} elements)"
        )


class Executor:
    """Runs one schedule to completion (see module docstring).

    Args:
        transport: the connections to use.
        schedule: this rank's steps.
        arrays: the flat arrays each ``Buf`` of the schedule refers to.
        reducer: the kernels (combine, convert) for this collective.
        seq: the collective's sequence number (in frame tags).
        signature: the hash of the collective's arguments (in frame headers).
        timeout: seconds without progress before giving up.
        timeline: where to record one event per step, or ``None``.
        interrupt: polled while waiting; a message it returns aborts the run
            with :class:`~ringcore.errors.CollectiveTimeout` (stall shutdown).
        atomic: back up USER before in-place writes and restore it on failure.
    """

    def __init__(
        self,
        transport: Transport,
        schedule: Schedule,
        arrays: dict[Buf, np.ndarray],
        reducer: Reducer,
        seq: int,
        signature: int,
        timeout: float,
        timeline: Timeline | None = None,
        interrupt: Callable[[], str | None] | None = None,
        atomic: bool = True,
    ) -> None:
        program = compile_program(schedule, transport)
        self.atomic = atomic
        self.timeline = timeline
        self.interrupt = interrupt
        if timeline is not None:
            self.step_left = list(program.items_per_step)
            self.step_times: list[list[float]] = [[0.0, 0.0] for _ in program.steps]
            self.waited_us = 0.0
        self.transport = transport
        self.steps = program.steps
        self.segments = program.segments
        self.combines = program.combines
        user, work = arrays.get(_USER), arrays.get(_WORK)
        self.arrays = [user, work, arrays.get(_STAGE)]
        self.reducer = reducer
        self.seq_bits = (seq & 0xFFFFFFFF) << 32
        self.signature = signature
        self.timeout = timeout
        self.pack = work is not None and user is not None and work.dtype != user.dtype
        check_in_place(schedule, user, work, atomic)
        self.step_done = [row[:] for row in program.step_done]
        self.done_upto = program.done_upto[:]
        self.after = program.after
        self.landing = program.landing
        self.saved: list[Key] = []  # USER regions whose old values wait in WORK
        self.sending: dict[Key, int] = {}
        self.receiving: set[Key] = set()
        self.send_queues = {route: deque(items) for route, items in program.sends.items()}
        self.recv_queues = {route: deque(items) for route, items in program.recvs.items()}
        self.posted_sends: dict[Route, deque[tuple[Request, Key, int]]] = {r: deque() for r in program.sends}
        self.posted_recvs: dict[Route, deque[tuple[Request, Item, Key]]] = {r: deque() for r in program.recvs}
        self.to_combine: deque[tuple[Item, Key]] = deque()
        self.outstanding = sum(len(q) for q in self.send_queues.values()) + sum(
            len(q) for q in self.recv_queues.values()
        )

    def run(self) -> None:
        """Post, progress and combine until every step is done; on failure, restore USER."""
        try:
            self._run()
        except BaseException:
            self.transport.cancel()  # nothing may land in USER after it is restored
            self.restore()
            raise

    def restore(self) -> None:
        """Put back the caller's values saved before in-place writes."""
        for key in reversed(self.saved):
            np.copyto(self._array(key), self._array((_WORK, key[1], key[2])))
        self.saved.clear()

    def _run(self) -> None:
        user = self.arrays[_USER]
        self.transport.expect(self.seq_bits >> 32, self.signature, 0 if user is None else user.nbytes)
        watch = Watch(self.transport, self.timeout, self.interrupt, self.pending)
        while True:
            try:
                busy = self._post_sends() | self._post_recvs() | self._complete()
            except PeerFailure as err:  # a send or receive found the peer gone
                watch.fail(err)
            if not self.outstanding:
                if self.timeline is not None:
                    self._record()
                return
            if busy or self.timeline is None:
                watch.progress(0.0 if busy else 0.5, busy)
            else:
                before = Timeline.now_us()
                watch.progress(0.5)
                self.waited_us += Timeline.now_us() - before

    def _view(self, key: Key) -> memoryview:
        return memoryview(self.arrays[key[0]][key[1] : key[2]]).cast("B")

    def _array(self, key: Key) -> np.ndarray:
        return self.arrays[key[0]][key[1] : key[2]]

    def _send_ready(self, s: int, k: int) -> bool:
        if self.steps[s].whole:
            return min(self.done_upto) >= s
        return self.done_upto[k] >= self.after[s]

    def _recv_ready(self, s: int, k: int, key: Key) -> bool:
        """Whether step ``s``'s receive of segment ``k`` into ``key`` may be posted now.

        A whole step posts a non-empty receive, like its send, once every
        earlier step is done: its region may then overlap earlier steps'
        regions (halving-doubling's nested halves) without data landing, or
        being combined, out of order. Empty receives (acknowledgements,
        barrier rounds) have nothing to order and are posted at once, so RDMA
        announces them early. A receive into the region an earlier step
        received into waits until that step's segment is combined
        (``Program.landing``: the in-place hierarchical allreduce lands a
        block's local and cross-host frames in one STAGE block), whatever the
        order in which connections get their turn (a GPU rank's run out of
        staging slots on one).
        """
        if key[1] == key[2]:
            return True
        if self.steps[s].whole:
            return min(self.done_upto) >= s
        before = self.landing.get((s, k))
        return before is None or self.step_done[before][k]

    def _post_sends(self) -> bool:
        posted = False
        for route, queue in self.send_queues.items():
            while queue and self._send_ready(queue[0][0], queue[0][1]):
                s, _k, key, bits = queue.popleft()
                if self.pack and key[0] == Buf.USER:
                    packed = (int(Buf.WORK), key[1], key[2])
                    self.reducer.convert(self._array(packed), self._array(key))
                    key = packed
                if self.timeline is not None:
                    self._started(s)
                request = self.transport.isend(
                    route[0], route[1], self.seq_bits | bits, self.signature, self._view(key)
                )
                self.sending[key] = self.sending.get(key, 0) + 1
                self.posted_sends[route].append((request, key, s))
                posted = True
        return posted

    def _post_recvs(self) -> bool:
        posted = False
        for route, queue in self.recv_queues.items():
            while queue:
                s, k, key, bits = queue[0]
                if not self._recv_ready(s, k, key):
                    break
                if key[1] < key[2] and (key in self.sending or key in self.receiving):
                    break  # an empty region conflicts with nothing
                if key[0] == _USER and not self._save(key):
                    break
                queue.popleft()
                self.receiving.add(key)
                if self.timeline is not None:
                    self._started(s)
                request = self.transport.irecv(
                    route[0], route[1], self.seq_bits | bits, self.signature, self._view(key)
                )
                self.posted_recvs[route].append((request, (s, k), key))
                posted = True
        return posted

    def _complete(self) -> bool:
        progressed = False
        for posted in self.posted_sends.values():
            while posted and posted[0][0].done:
                _, key, s = posted.popleft()
                self.sending[key] -= 1
                if not self.sending[key]:
                    del self.sending[key]
                self.outstanding -= 1
                if self.timeline is not None:
                    self._finished_item(s)
                progressed = True
        for posted in self.posted_recvs.values():
            while posted and posted[0][0].done:
                _, item, key = posted.popleft()
                self.to_combine.append((item, key))
                progressed = True
        return self._drain_combines() or progressed

    def _drain_combines(self) -> bool:
        """Combine every received segment that may be combined now; whether any was."""
        queue = self.to_combine
        combined = False
        while queue:
            if self._combine(*queue[0]):
                queue.popleft()
            else:  # the oldest must wait: one behind it may be what it waits for
                for index in range(1, len(queue)):
                    if self._combine(*queue[index]):
                        del queue[index]
                        break
                else:
                    return combined
            self.outstanding -= 1
            combined = True
        return combined

    def _combine(self, item: Item, recv_key: Key) -> bool:
        """Combine a received segment (if the step says so); False if it must wait."""
        s, k = item
        if (min(self.done_upto) if self.steps[s].whole else self.done_upto[k]) < self.after[s]:
            return False  # an earlier step of this segment is not done: it may still write these regions
        regions = self.combines[item]
        if regions is not None:
            dst, a, b = regions
            if dst[1] < dst[2] and dst in self.sending:
                return False
            step = self.steps[item[0]]
            if step.commit:
                self._commit(dst, a, b, step.final)
            else:
                self.reducer.combine(self._array(dst), self._array(a), self._array(b), final=step.final)
        self.receiving.discard(recv_key)
        self._mark_done(*item)
        if self.timeline is not None:
            self._finished_item(item[0])
        return True

    def _save(self, user_key: Key) -> bool:
        """Back up a USER region into WORK before overwriting it; False if WORK is busy."""
        if not self.atomic:
            return True
        backup = (_WORK, user_key[1], user_key[2])
        if backup in self.sending or backup in self.receiving:
            return False
        np.copyto(self._array(backup), self._array(user_key))
        self.saved.append(user_key)
        return True

    def _commit(self, dst: Key, a: Key, b: Key, final: bool) -> None:
        """Reduce into USER instead of ``dst`` (WORK); ``atomic``: leave USER's old values in ``dst``."""
        user = (_USER, dst[1], dst[2])
        if not self.atomic:
            self.reducer.combine(self._array(user), self._array(a), self._array(b), final=final)
            return
        result = self.reducer.scratch_like(self._array(user))
        self.reducer.combine(result, self._array(a), self._array(b), final=final)
        np.copyto(self._array(dst), self._array(user))
        np.copyto(self._array(user), result)
        self.saved.append(user)

    def _started(self, s: int) -> None:
        if not self.step_times[s][0]:
            self.step_times[s][0] = Timeline.now_us()

    def _finished_item(self, s: int) -> None:
        self.step_left[s] -= 1
        if not self.step_left[s]:
            self.step_times[s][1] = Timeline.now_us()

    def _record(self) -> None:
        """One timeline event per step, nested in the collective's event written by the comm."""
        assert self.timeline is not None
        for s, (start, end) in enumerate(self.step_times):
            step = self.steps[s]
            args = {"peer_send": step.send_peer, "peer_recv": step.recv_peer, "segments": self.segments}
            if s == 0:
                args["wait_us"] = round(self.waited_us, 1)
            self.timeline.complete(f"{step.label or 'step'} {s}", "step", start, end, args, track=1 + s)

    def _mark_done(self, s: int, k: int) -> None:
        parts = range(self.segments) if self.steps[s].whole else (k,)
        for part in parts:
            self.step_done[s][part] = True
            self._advance(part)

    def _advance(self, part: int) -> None:
        upto = self.done_upto[part]
        while upto < len(self.steps) and self.step_done[upto][part]:
            upto += 1
        self.done_upto[part] = upto

    def pending(self) -> str:
        """What the run is waiting for, for error messages."""
        return "waiting for " + (", ".join(self._waits()[:4]) or "nothing posted")

    def _waits(self) -> list[str]:
        waits = [
            f"receive from rank {route[0]} ({wire.describe_tag(posted[0][0].tag)})"
            for route, posted in self.posted_recvs.items()
            if posted
        ]
        return waits + [f"send to rank {route[0]}" for route, posted in self.posted_sends.items() if posted]
