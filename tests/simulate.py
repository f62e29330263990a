"""Check schedules in memory, with no transport: every rank's steps, whole regions at a time.

``simulate`` plays all ranks' schedules against each other over unbounded
in-memory links, one step per rank per round, and returns each rank's
result. It checks what the schedules promise before any socket is involved:
that sends and receives pair up (same phase, same length), that nothing
deadlocks, and, compared with numpy by the tests, that the data flow computes
the right reduction. Pipelining by segments is the executor's business and is
tested over the loopback transport.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from ringcore.algo.steps import Buf, Region, Schedule, Step
from ringcore.kernels.numpy_ops import Reducer


class ScheduleError(AssertionError):
    """Schedules that do not fit together."""


def simulate(schedules: list[Schedule], inputs: list[np.ndarray], reducer: Reducer) -> list[np.ndarray]:
    """Run every rank's schedule; return each rank's result region (or its input if none)."""
    size = len(schedules)
    arrays = [_arrays(inputs[r], reducer) for r in range(size)]
    for rank in range(size):
        if schedules[rank].prefill_work:
            reducer.convert(arrays[rank][Buf.WORK], arrays[rank][Buf.USER])
    links: dict[tuple[int, int], deque[tuple[int, np.ndarray]]] = {}
    position = [0] * size
    sent = [False] * size
    while any(position[r] < len(schedules[r].steps) for r in range(size)):
        moved = False
        for rank in range(size):
            if position[rank] >= len(schedules[rank].steps):
                continue
            step = schedules[rank].steps[position[rank]]
            if step.send is not None and not sent[rank]:
                queue = links.setdefault((rank, step.send_peer), deque())
                queue.append((step.phase, _read(arrays[rank], step.send, reducer).copy()))
                sent[rank] = moved = True
            if step.recv is not None and not _receive(rank, step, links, arrays[rank], reducer):
                continue
            position[rank] += 1
            sent[rank] = False
            moved = True
        if not moved:
            raise ScheduleError(f"deadlock: ranks stuck at steps {position}")
    leftovers = {link: len(q) for link, q in links.items() if q}
    if leftovers:
        raise ScheduleError(f"frames never received: {leftovers}")
    return [_result(schedules[r], arrays[r]) for r in range(size)]


def _arrays(user: np.ndarray, reducer: Reducer) -> dict[Buf, np.ndarray]:
    return {
        Buf.USER: user.copy(),
        Buf.WORK: np.zeros(user.size, reducer.wire_dtype),
        Buf.STAGE: np.zeros(user.size, reducer.wire_dtype),
    }


def _slice(arrays: dict[Buf, np.ndarray], region: Region) -> np.ndarray:
    return arrays[region.buf][region.start : region.start + region.count]


def _read(arrays: dict[Buf, np.ndarray], region: Region, reducer: Reducer) -> np.ndarray:
    data = _slice(arrays, region)
    if data.dtype == reducer.wire_dtype:
        return data
    packed = np.empty(data.size, reducer.wire_dtype)
    reducer.convert(packed, data)
    return packed


def _receive(rank: int, step: Step, links: dict, arrays: dict[Buf, np.ndarray], reducer: Reducer) -> bool:
    queue = links.get((step.recv_peer, rank))
    if not queue:
        return False
    phase, data = queue.popleft()
    target = _slice(arrays, step.recv)
    if phase != step.phase or data.size != target.size:
        raise ScheduleError(
            f"rank {rank} expected phase {step.phase} ({target.size} items) from rank {step.recv_peer}, "
            f"got phase {phase} ({data.size} items)"
        )
    target[:] = data
    if step.reduce is not None:
        dst, a, b = step.reduce
        if step.commit:  # in place: the result goes to the same region of the caller's buffer
            dst = Region(Buf.USER, dst.start, dst.count)
        reducer.combine(_slice(arrays, dst), _slice(arrays, a), _slice(arrays, b), final=step.final)
    return True


def _result(schedule: Schedule, arrays: dict[Buf, np.ndarray]) -> np.ndarray:
    if schedule.result is None:
        return arrays[Buf.USER]
    return _slice(arrays, schedule.result)
