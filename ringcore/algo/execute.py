"""Run a :class:`~ringcore.algo.steps.Schedule` over a transport: the only algo code that does I/O.

Theory of operation. The schedule is unrolled into (step, segment) items.
Sends and receives are queued per connection in (step, segment) order, the
order the transport's FIFO matching needs, and each is posted as soon as it
is allowed:

* a send of segment k at step s waits until segment k of every earlier step
  has been received and combined (``done_upto[k] >= s``): what it sends is
  what those steps produced;
* a receive waits until no pending send reads, and no pending receive or
  combine uses, the region it writes (a region sent at step s and received
  into at step s+N is safe);
* a combine waits until no pending send still reads the region it writes.

Receives are posted ahead, so the kernel can land segment k+1 while this
thread combines segment k and sends it on. All waiting happens in
``transport.progress``; when nothing has moved for ``timeout`` seconds the run
raises :class:`~ringcore.errors.CollectiveTimeout` naming what it waits for.

Compression: a send from USER when the wire dtype differs first converts the
segment into the same region of WORK (which is in the wire dtype).
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np

from ringcore.algo.steps import Buf, Region, Schedule, Step
from ringcore.errors import CollectiveTimeout
from ringcore.kernels.numpy_ops import Reducer
from ringcore.transport import wire
from ringcore.transport.base import Request, Transport

Key = tuple[int, int, int]
Item = tuple[int, int]  # (step, segment)


def _key(region: Region) -> Key:
    return (int(region.buf), region.start, region.count)


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
    ) -> None:
        self.transport = transport
        self.steps = schedule.steps
        self.segments = schedule.segments
        self.arrays = arrays
        self.reducer = reducer
        self.seq = seq
        self.signature = signature
        self.timeout = timeout
        self.wire_dtype = arrays[Buf.WORK].dtype if Buf.WORK in arrays else None
        nsteps = len(self.steps)
        self.step_done = [[step.recv is None] * self.segments for step in self.steps]
        self.done_upto = [0] * self.segments
        self.sending: dict[Key, int] = {}
        self.receiving: set[Key] = set()
        self.send_queues: dict[tuple[int, int], deque[Item]] = {}
        self.recv_queues: dict[tuple[int, int], deque[Item]] = {}
        self.posted_sends: dict[tuple[int, int], deque[tuple[Request, Key]]] = {}
        self.posted_recvs: dict[tuple[int, int], deque[tuple[Request, Item]]] = {}
        self.to_combine: deque[Item] = deque()
        self._unroll(nsteps)

    def _parts(self, step: Step) -> range:
        return range(1) if step.whole else range(self.segments)

    def _region(self, region: Region, step: Step, k: int) -> Region:
        return region if step.whole else region.segment(k, self.segments)

    def _unroll(self, nsteps: int) -> None:
        for s in range(nsteps):
            step = self.steps[s]
            for k in self._parts(step):
                if step.send is not None:
                    route = (step.send_peer, self.transport.route(step.send_peer, k))
                    self.send_queues.setdefault(route, deque()).append((s, k))
                if step.recv is not None:
                    route = (step.recv_peer, self.transport.route(step.recv_peer, k))
                    self.recv_queues.setdefault(route, deque()).append((s, k))
        for route in self.send_queues:
            self.posted_sends[route] = deque()
        for route in self.recv_queues:
            self.posted_recvs[route] = deque()

    def run(self) -> None:
        """Post, progress and combine until every step is done."""
        last_moved = time.monotonic()
        while True:
            busy = self._post_sends() | self._post_recvs() | self._complete()
            if self._finished():
                return
            moved = self.transport.progress(0.0 if busy else 0.5)
            now = time.monotonic()
            if busy or moved:
                last_moved = now
            elif now - last_moved > self.timeout:
                raise CollectiveTimeout(f"no progress for {self.timeout:g} s: {self.pending()}")

    def _finished(self) -> bool:
        return not (
            self.to_combine
            or any(self.send_queues.values())
            or any(self.recv_queues.values())
            or any(self.posted_sends.values())
            or any(self.posted_recvs.values())
        )

    def _tag(self, s: int, k: int) -> int:
        return wire.make_tag(self.seq, self.steps[s].phase, k)

    def _view(self, region: Region) -> memoryview:
        array = self.arrays[region.buf][region.start : region.start + region.count]
        return memoryview(array).cast("B")

    def _send_ready(self, s: int, k: int) -> bool:
        if self.steps[s].whole:
            return min(self.done_upto) >= s
        return self.done_upto[k] >= s

    def _post_sends(self) -> bool:
        posted = False
        for route, queue in self.send_queues.items():
            while queue and self._send_ready(*queue[0]):
                s, k = queue.popleft()
                step = self.steps[s]
                region = self._wire_region(self._region(step.send, step, k))
                key = _key(region)
                request = self.transport.isend(route[0], route[1], self._tag(s, k), self.signature,
                                               self._view(region))  # fmt: skip
                self.sending[key] = self.sending.get(key, 0) + 1
                self.posted_sends[route].append((request, key))
                posted = True
        return posted

    def _wire_region(self, region: Region) -> Region:
        """Where a send's bytes come from: USER, or its compressed copy in WORK."""
        if region.buf != Buf.USER or self.wire_dtype is None or self.wire_dtype == self.arrays[Buf.USER].dtype:
            return region
        packed = Region(Buf.WORK, region.start, region.count)
        self.reducer.convert(self._array(packed), self._array(region))
        return packed

    def _array(self, region: Region) -> np.ndarray:
        return self.arrays[region.buf][region.start : region.start + region.count]

    def _post_recvs(self) -> bool:
        posted = False
        for route, queue in self.recv_queues.items():
            while queue:
                s, k = queue[0]
                step = self.steps[s]
                key = _key(self._region(step.recv, step, k))
                if key in self.sending or key in self.receiving:
                    break
                queue.popleft()
                self.receiving.add(key)
                view = self._view(self._region(step.recv, step, k))
                request = self.transport.irecv(route[0], route[1], self._tag(s, k), self.signature, view)
                self.posted_recvs[route].append((request, (s, k)))
                posted = True
        return posted

    def _complete(self) -> bool:
        progressed = False
        for posted in self.posted_sends.values():
            while posted and posted[0][0].done:
                _, key = posted.popleft()
                self.sending[key] -= 1
                if not self.sending[key]:
                    del self.sending[key]
                progressed = True
        for posted in self.posted_recvs.values():
            while posted and posted[0][0].done:
                self.to_combine.append(posted.popleft()[1])
                progressed = True
        while self.to_combine and self._combine(*self.to_combine[0]):
            self.to_combine.popleft()
            progressed = True
        return progressed

    def _combine(self, s: int, k: int) -> bool:
        """Combine a received segment (if the step says so); False if it must wait."""
        step = self.steps[s]
        if step.reduce is not None:
            dst, a, b = (self._region(r, step, k) for r in step.reduce)
            if _key(dst) in self.sending:
                return False
            self.reducer.combine(self._array(dst), self._array(a), self._array(b), final=step.final)
        self.receiving.discard(_key(self._region(step.recv, step, k)))
        self._mark_done(s, k)
        return True

    def _mark_done(self, s: int, k: int) -> None:
        parts = range(self.segments) if self.steps[s].whole else (k,)
        for part in parts:
            self.step_done[s][part] = True
            upto = self.done_upto[part]
            while upto < len(self.steps) and self.step_done[upto][part]:
                upto += 1
            self.done_upto[part] = upto

    def pending(self) -> str:
        """What the run is waiting for, for error messages."""
        waits = [
            f"receive from rank {route[0]} ({wire.describe_tag(self._tag(*posted[0][1]))})"
            for route, posted in self.posted_recvs.items()
            if posted
        ]
        waits += [f"send to rank {route[0]}" for route, posted in self.posted_sends.items() if posted]
        return "waiting for " + (", ".join(waits[:4]) or "nothing posted")
