"""Run a schedule on device arrays, staging every segment through pinned host slots.

Theory of operation (the dataflow rules are those of
:mod:`ringcore.algo.execute`, whose compiled programs this reuses; only the
staging is new). A segment goes through these states:

* send: *ready* (its step's inputs are reduced) -> a free send slot of its
  connection -> (compress on the compute stream) -> download on the copy
  stream, which first waits for everything queued on the compute stream ->
  once the download's event fires, ``isend`` from the slot -> when the send
  completes, the slot is free;
* receive: no conflict (as on the host) -> a free receive slot of its
  connection -> ``irecv`` into the slot -> when it lands, upload into the
  segment's device region on the compute stream and record an event (the slot
  is free once it fires) -> the step's combine, queued on the compute stream
  behind the upload.

A region counts as being sent from the moment its download is queued until
its send completed, so no receive, combine or backup writes it meanwhile;
work on one region by the compute stream is ordered by that stream. The run
ends by waiting for both streams: when it returns, the result is in device
memory. On failure the transport is cancelled, the streams drained, and, with
``atomic`` (``RINGCORE_ATOMIC=1``), the caller's regions saved before in-place
writes are put back, as on the host.

The timeline records the collective, not its steps, for device buffers.

Slots are per connection and direction (so a connection never waits for a
slot another one holds: no new deadlock), at least two each (double
buffering), all carved from one pinned arena per communicator.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from ringcore.algo.execute import Executor, check_in_place
from ringcore.algo.program import Item, Key, Program, Route, compile_program
from ringcore.algo.steps import Buf, Schedule
from ringcore.algo.waiting import Watch
from ringcore.device.layer import DeviceArray, DeviceLayer, DeviceReducer, Event, Stream
from ringcore.errors import PeerFailure
from ringcore.transport.base import Request, Transport

_USER, _WORK = int(Buf.USER), int(Buf.WORK)


class Staging:
    """A communicator's device resources: its two streams and its pinned slots (reused)."""

    def __init__(self, layer: DeviceLayer, staging_bytes: int) -> None:
        self.layer = layer
        self.staging_bytes = staging_bytes
        self.compute: Stream = layer.stream()
        self.copy: Stream = layer.stream()
        self._arena = np.empty(0, np.uint8)
        self._layout: tuple[int, int] = (0, 0)

    def slots(
        self, routes: list[tuple[Route, str]], slot_bytes: int
    ) -> dict[tuple[Route, str], list[np.ndarray]]:
        """Free-slot lists per (route, direction), carved from the arena (grown only when too small)."""
        per_route = max(2, self.staging_bytes // max(1, slot_bytes))
        need = len(routes) * per_route * slot_bytes
        if self._arena.nbytes < need:
            self._arena = self.layer.pinned(need)
        out: dict[tuple[Route, str], list[np.ndarray]] = {}
        offset = 0
        for key in routes:
            out[key] = []
            for _ in range(per_route):
                out[key].append(self._arena[offset : offset + slot_bytes])
                offset += slot_bytes
        return out


def _slot_bytes(program: Program, arrays: list[Any]) -> int:
    """The largest segment on the wire (a send from USER travels in WORK's dtype)."""
    largest = 1
    for items in (*program.sends.values(), *program.recvs.values()):
        for _s, _k, key, _bits in items:
            array = arrays[_WORK if key[0] == _USER and arrays[_WORK] is not None else key[0]]
            largest = max(largest, (key[2] - key[1]) * array.dtype.itemsize)
    return largest


class StagedExecutor(Executor):
    """Runs one schedule on device arrays (see module docstring); arguments as ``Executor``'s.

    The dataflow bookkeeping (when a send may go, combining, marking steps done)
    is :class:`~ringcore.algo.execute.Executor`'s; this class replaces how
    segments are posted, staged and saved.
    """

    def __init__(
        self,
        transport: Transport,
        schedule: Schedule,
        arrays: dict[Buf, DeviceArray],
        reducer: DeviceReducer,
        seq: int,
        signature: int,
        timeout: float,
        staging: Staging,
        interrupt: Callable[[], str | None] | None = None,
        atomic: bool = True,
    ) -> None:
        program = compile_program(schedule, transport)
        self.transport, self.reducer, self.staging = transport, reducer, staging
        self.layer = staging.layer
        self.steps, self.segments, self.combines = program.steps, program.segments, program.combines
        self.arrays = [arrays.get(Buf.USER), arrays.get(Buf.WORK), arrays.get(Buf.STAGE)]
        user, work = self.arrays[_USER], self.arrays[_WORK]
        self.pack = user is not None and work is not None and work.dtype != user.dtype
        check_in_place(schedule, user, work, atomic)
        self.seq_bits = (seq & 0xFFFFFFFF) << 32
        self.signature, self.timeout, self.interrupt = signature, timeout, interrupt
        self.atomic = atomic
        self.timeline = None  # GPU collectives are recorded whole, not step by step
        self.step_done = [row[:] for row in program.step_done]
        self.done_upto = program.done_upto[:]
        self.after = program.after
        self.landing = program.landing
        routes = [(r, "send") for r in program.sends] + [(r, "recv") for r in program.recvs]
        self.free = staging.slots(routes, _slot_bytes(program, self.arrays))
        self.saved: list[Key] = []
        self.sending: dict[Key, int] = {}
        self.receiving: set[Key] = set()
        self.send_queues = {route: deque(items) for route, items in program.sends.items()}
        self.recv_queues = {route: deque(items) for route, items in program.recvs.items()}
        self.downloading: dict[Route, deque[tuple[Event | None, np.ndarray, Key, int, int]]] = {
            r: deque() for r in program.sends
        }
        self.posted_sends: dict[Route, deque[tuple[Request, np.ndarray, Key]]] = {
            r: deque() for r in program.sends
        }
        self.posted_recvs: dict[Route, deque[tuple[Request, np.ndarray, Item, Key]]] = {
            r: deque() for r in program.recvs
        }
        self.uploading: deque[tuple[Event, np.ndarray, Route]] = deque()
        self.to_combine: deque[tuple[Item, Key]] = deque()
        self.outstanding = sum(len(q) for q in self.send_queues.values()) + sum(
            len(q) for q in self.recv_queues.values()
        )

    def run(self) -> None:
        """Stage, post, progress and combine until done and both streams are idle; on failure restore USER."""
        try:
            self._run()
            self.layer.synchronize(self.staging.compute)
            self.layer.synchronize(self.staging.copy)
        except BaseException:
            self.transport.cancel()  # nothing may land in a slot, nor a slot in USER, after this
            self.layer.synchronize(self.staging.copy)
            self.layer.synchronize(self.staging.compute)
            self.restore()
            raise

    def restore(self) -> None:
        """Put back the caller's values saved before in-place writes (blocking)."""
        for key in reversed(self.saved):
            self.layer.copy(self._array(key), self._array((_WORK, key[1], key[2])), self.staging.compute)
        self.saved.clear()
        self.layer.synchronize(self.staging.compute)

    def _run(self) -> None:
        self.transport.expect(self.seq_bits >> 32, self.signature)
        watch = Watch(self.transport, self.timeout, self.interrupt, self.pending)
        while True:
            try:
                busy = self._post_sends() | self._stage_out() | self._post_recvs() | self._complete()
            except PeerFailure as err:  # a send or receive found the peer gone
                watch.fail(err)
            if not self.outstanding:
                return
            device_work = any(self.downloading.values()) or bool(self.uploading)
            watch.progress(0.0 if busy or device_work else 0.5, busy)

    def _array(self, key: Key) -> DeviceArray:
        return self.arrays[key[0]][key[1] : key[2]]

    def _nbytes(self, key: Key) -> int:
        return (key[2] - key[1]) * self.arrays[key[0]].dtype.itemsize

    def _post_sends(self) -> bool:
        """Queue the download of every ready segment that has a free slot."""
        posted = False
        for route, queue in self.send_queues.items():
            free = self.free[(route, "send")]
            while queue and free and self._send_ready(queue[0][0], queue[0][1]):
                _s, _k, key, bits = queue.popleft()
                if self.pack and key[0] == _USER:
                    packed = (_WORK, key[1], key[2])
                    self.reducer.convert(self._array(packed), self._array(key))
                    key = packed
                slot, nbytes, event = free.pop(), self._nbytes(key), None
                if nbytes:
                    self.layer.wait(self.staging.copy, self.layer.record(self.staging.compute))
                    self.layer.download(slot, self._array(key), self.staging.copy)
                    event = self.layer.record(self.staging.copy)
                self.sending[key] = self.sending.get(key, 0) + 1
                self.downloading[route].append((event, slot, key, bits, nbytes))
                posted = True
        return posted

    def _stage_out(self) -> bool:
        """Send every segment whose download finished (in order per connection)."""
        moved = False
        for route, staged in self.downloading.items():
            while staged and (staged[0][0] is None or staged[0][0].done()):
                _event, slot, key, bits, nbytes = staged.popleft()
                view = memoryview(slot[:nbytes])
                request = self.transport.isend(route[0], route[1], self.seq_bits | bits, self.signature, view)
                self.posted_sends[route].append((request, slot, key))
                moved = True
        return moved

    def _post_recvs(self) -> bool:
        posted = False
        for route, queue in self.recv_queues.items():
            free = self.free[(route, "recv")]
            while queue and free:
                s, k, key, bits = queue[0]
                if not self._recv_ready(s, k, key):
                    break
                if key[1] < key[2] and (key in self.sending or key in self.receiving):
                    break  # an empty region conflicts with nothing
                if key[0] == _USER and not self._save(key):
                    break
                queue.popleft()
                self.receiving.add(key)
                slot = free.pop()
                view = memoryview(slot[: self._nbytes(key)])
                request = self.transport.irecv(route[0], route[1], self.seq_bits | bits, self.signature, view)
                self.posted_recvs[route].append((request, slot, (s, k), key))
                posted = True
        return posted

    def _complete(self) -> bool:
        progressed = False
        for route, posted in self.posted_sends.items():
            while posted and posted[0][0].done:
                _, slot, key = posted.popleft()
                self.free[(route, "send")].append(slot)
                self.sending[key] -= 1
                if not self.sending[key]:
                    del self.sending[key]
                self.outstanding -= 1
                progressed = True
        for route, posted in self.posted_recvs.items():
            while posted and posted[0][0].done:
                _, slot, item, key = posted.popleft()
                if self._nbytes(key):
                    self.layer.upload(self._array(key), slot, self.staging.compute)
                    self.uploading.append((self.layer.record(self.staging.compute), slot, route))
                else:
                    self.free[(route, "recv")].append(slot)
                self.to_combine.append((item, key))
                progressed = True
        while self.uploading and self.uploading[0][0].done():
            _, slot, route = self.uploading.popleft()
            self.free[(route, "recv")].append(slot)
            progressed = True
        return self._drain_combines() or progressed

    def _save(self, user_key: Key) -> bool:
        """Back up a USER region into WORK before overwriting it; False if WORK is busy."""
        if not self.atomic:
            return True
        backup = (_WORK, user_key[1], user_key[2])
        if backup in self.sending or backup in self.receiving:
            return False
        self.layer.copy(self._array(backup), self._array(user_key), self.staging.compute)
        self.saved.append(user_key)
        return True

    def _commit(self, dst: Key, a: Key, b: Key, final: bool) -> None:
        """Reduce into USER instead of ``dst`` (WORK), leaving USER's old values in ``dst``."""
        user = (_USER, dst[1], dst[2])
        if not self.atomic:
            self.reducer.combine(self._array(user), self._array(a), self._array(b), final=final)
            return
        result = self.reducer.scratch_like(self._array(user))
        self.reducer.combine(result, self._array(a), self._array(b), final=final)
        self.layer.copy(self._array(dst), self._array(user), self.staging.compute)
        self.layer.copy(self._array(user), result, self.staging.compute)
        self.saved.append(user)

    def _waits(self) -> list[str]:
        waits = super()._waits()
        return waits + [
            f"device copy for rank {route[0]}" for route, staged in self.downloading.items() if staged
        ]
