"""Run a one-segment schedule step by step: the latency path for small collectives.

Why. Small allreduces (recursive doubling), barriers and the count exchange of
allgather move one frame per step. For them the dataflow bookkeeping of
:class:`~ringcore.algo.execute.Executor` (per-segment readiness, region
conflicts, queues per connection) costs more than the bytes: a 4 KiB
allreduce spent about a third of its CPU there.

Theory of operation. Step by step, in order: post the step's send and its
receive, progress the transport until both are done, then combine. One step
never overlaps the next, so no region can be written while a send still
reads it and no conflict tracking is needed. The frames are exactly the
Executor's (same tags, same connection, same order, same checks), so a rank
running this and a rank running the Executor agree. One exception to "in
order", as in the Executor: empty receives (acknowledgements, barrier rounds)
that are first on their connection are posted before the first step. Over
RDMA a posted receive announces itself (with the collective's signature) to
the sender, so a peer that disagrees (e.g. on a broadcast's root, and so
never receives from this rank) learns of it at once instead of both waiting
until the timeout.

What it does not do, so :func:`fits` sends those schedules to the Executor:
pipelining (more than one segment), writing the caller's buffer (in-place
receives and ``commit`` steps need the backup and restore), converting USER to
the wire dtype on the fly, and per-step timeline events.

Deadlock. Waiting for the step's send before its receive completes is safe:
``progress`` moves every posted frame both ways, and in every schedule a
step's send is matched by a receive its peer posts in the same step
(ring, recursive doubling, dissemination barrier) or in a step that does not
wait on this rank (the chain broadcast's forward and acknowledgement).
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from collections.abc import Callable

import numpy as np

from ringcore.algo.execute import PerTransport, cached_per_transport
from ringcore.algo.steps import Buf, Region, Schedule
from ringcore.errors import CollectiveTimeout
from ringcore.kernels.numpy_ops import Reducer
from ringcore.transport import wire
from ringcore.transport.base import Request, Transport

Key = tuple[int, int, int]  # (buffer, first element, end element)
Frame = tuple[int, int, Key]  # (peer, channel, region)


@dataclasses.dataclass(frozen=True)
class Compiled:
    """A schedule's steps with tags, connections and regions worked out once."""

    steps: tuple[tuple[int, Frame | None, Frame | None, tuple[Key, Key, Key] | None, bool], ...]
    eligible: bool  # one segment, never writes USER
    sends_user: bool  # some step sends straight from USER (needs WORK in the same dtype)
    early: tuple[int, ...]  # steps whose (empty) receive is posted before the first step


_compiled: PerTransport[Compiled] = weakref.WeakKeyDictionary()


def compile_steps(schedule: Schedule, transport: Transport) -> Compiled:
    """Work ``schedule`` out for ``transport``, cached like the Executor's programs."""
    return cached_per_transport(_compiled, schedule, transport, _compile)


def _compile(schedule: Schedule, transport: Transport) -> Compiled:
    def key(region: Region) -> Key:
        return (int(region.buf), region.start, region.start + region.count)

    steps: list[tuple[int, Frame | None, Frame | None, tuple[Key, Key, Key] | None, bool]] = []
    eligible = schedule.segments == 1
    sends_user = False
    early: list[int] = []
    receiving_from: set[tuple[int, int]] = set()  # routes some earlier step receives on
    for index, step in enumerate(schedule.steps):
        send = recv = None
        if step.send is not None:
            send = (step.send_peer, transport.route(step.send_peer, 0), key(step.send))
            sends_user = sends_user or step.send.buf == Buf.USER
        if step.recv is not None:
            recv = (step.recv_peer, transport.route(step.recv_peer, 0), key(step.recv))
            eligible = eligible and step.recv.buf != Buf.USER
            if step.recv.count == 0 and recv[:2] not in receiving_from:
                early.append(index)
            receiving_from.add(recv[:2])
        eligible = eligible and not step.commit
        reduce = (key(step.reduce[0]), key(step.reduce[1]), key(step.reduce[2])) if step.reduce else None
        steps.append((wire.make_tag(0, step.phase, 0), send, recv, reduce, step.final))
    return Compiled(tuple(steps), eligible, sends_user, tuple(early))


def fits(schedule: Schedule, transport: Transport, arrays: dict[Buf, np.ndarray]) -> bool:
    """True when ``schedule`` can run in lockstep (see the module docstring)."""
    compiled = compile_steps(schedule, transport)
    if not compiled.eligible:
        return False
    if compiled.sends_user:
        user, work = arrays.get(Buf.USER), arrays.get(Buf.WORK)
        return user is None or work is None or user.dtype == work.dtype
    return True


class LockstepExecutor:
    """Runs a schedule accepted by :func:`fits`; the arguments are the Executor's."""

    def __init__(
        self,
        transport: Transport,
        schedule: Schedule,
        arrays: dict[Buf, np.ndarray],
        reducer: Reducer,
        seq: int,
        signature: int,
        timeout: float,
        interrupt: Callable[[], str | None] | None = None,
    ) -> None:
        self.transport = transport
        self.compiled = compile_steps(schedule, transport)
        self.arrays = [arrays.get(Buf.USER), arrays.get(Buf.WORK), arrays.get(Buf.STAGE)]
        self.reducer = reducer
        self.seq_bits = (seq & 0xFFFFFFFF) << 32
        self.signature = signature
        self.timeout = timeout
        self.interrupt = interrupt

    def run(self) -> None:
        """Run every step; on failure, drop whatever is still queued and re-raise."""
        try:
            self._run()
        except BaseException:
            self.transport.cancel()
            raise

    def _run(self) -> None:
        transport, signature, seq_bits, arrays = self.transport, self.signature, self.seq_bits, self.arrays
        transport.expect(seq_bits >> 32, signature)
        posted = {index: self._receive(index) for index in self.compiled.early}
        for index, (tag_bits, send, recv, reduce, final) in enumerate(self.compiled.steps):
            sent = received = None
            if send is not None:
                peer, channel, (buf, lo, hi) = send
                view = memoryview(arrays[buf][lo:hi]).cast("B")
                sent = transport.isend(peer, channel, seq_bits | tag_bits, signature, view)
            if recv is not None:
                received = posted[index] if index in posted else self._receive(index)
            if not ((sent is None or sent.done) and (received is None or received.done)):
                self._wait(sent, received)
            if reduce is not None:
                dst, a, b = reduce
                self.reducer.combine(
                    arrays[dst[0]][dst[1] : dst[2]],
                    arrays[a[0]][a[1] : a[2]],
                    arrays[b[0]][b[1] : b[2]],
                    final,
                )

    def _receive(self, index: int) -> Request:
        tag_bits, _, recv, _, _ = self.compiled.steps[index]
        assert recv is not None
        peer, channel, (buf, lo, hi) = recv
        view = memoryview(self.arrays[buf][lo:hi]).cast("B")
        return self.transport.irecv(peer, channel, self.seq_bits | tag_bits, self.signature, view)

    def _wait(self, sent: Request | None, received: Request | None) -> None:
        transport = self.transport
        last_moved = time.monotonic()
        while not ((sent is None or sent.done) and (received is None or received.done)):
            if transport.progress(0.5):
                last_moved = time.monotonic()
            elif time.monotonic() - last_moved > self.timeout:
                raise CollectiveTimeout(
                    f"no progress for {self.timeout:g} s: {self._pending(sent, received)}"
                )
            elif self.interrupt is not None and (reason := self.interrupt()):
                raise CollectiveTimeout(reason)

    @staticmethod
    def _pending(sent: Request | None, received: Request | None) -> str:
        waits = [
            f"{what} rank {request.peer} ({wire.describe_tag(request.tag)})"
            for what, request in (("send to", sent), ("receive from", received))
            if request is not None and not request.done
        ]
        return "waiting for " + ", ".join(waits)
