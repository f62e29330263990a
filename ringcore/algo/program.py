"""A schedule compiled for one transport: the one form every executor runs.

A :class:`~ringcore.algo.steps.Schedule` says what moves where; a
:class:`Program` adds what a transport needs to move it: every (step,
segment) item with its regions cut, its tag bits and its connection, queued
per connection in the order the transport's FIFO matching needs (step by
step, segment by segment; steps that run ``alongside`` one another
interleave, segment by segment), the combines, which leading steps each step
waits for, and the initial readiness state. The
pipelined executors (:class:`~ringcore.algo.execute.Executor`, the staged GPU
one) run those queues. A one-segment program also carries its steps in order
(:attr:`Program.lockstep`), which :mod:`ringcore.algo.lockstep` runs one at a
time, with the same tags, connections and regions, so a rank running either
executor agrees with its peers.

Lending. Each lockstep step also says whether its received bytes may stay
where they arrived (``lend``): when they are one operand of the step's
combine (1: ``a``, 2: ``b``) and nothing after the combine reads the region
they were meant for (it is the combine's destination, or no later step and
not the result reads it). A transport that keeps frames in memory the
receiver can read (shared memory's slots) then lends them for the combine
instead of copying them into that region first (:mod:`ringcore.algo.lockstep`).

Programs are cached per transport and schedule object (:func:`compile_program`;
the schedule builders are memoized), so a training loop that reduces the same
tensors compiles each schedule once.
"""

from __future__ import annotations

import dataclasses
import weakref

from ringcore.algo.steps import Buf, Region, Schedule, Step
from ringcore.transport import wire
from ringcore.transport.base import Transport

Key = tuple[int, int, int]  # (buffer, first element, end element)
Route = tuple[int, int]  # (peer, channel)
Item = tuple[int, int]  # (step, segment)
Frame = tuple[int, int, Key]  # (peer, channel, region)
LockstepStep = tuple[
    int, Frame | None, Frame | None, tuple[Key, Key, Key] | None, bool, int
]  # tag, send, recv, reduce, final, lend


def _key(region: Region) -> Key:
    return (int(region.buf), region.start, region.start + region.count)


@dataclasses.dataclass(frozen=True)
class Program:
    """A schedule compiled for one transport (see the module docstring)."""

    steps: tuple[Step, ...]
    segments: int
    sends: dict[Route, tuple[tuple[int, int, Key, int], ...]]  # (step, segment, source, tag bits)
    recvs: dict[Route, tuple[tuple[int, int, Key, int], ...]]  # (step, segment, target, tag bits)
    combines: dict[Item, tuple[Key, Key, Key] | None]
    items_per_step: tuple[int, ...]
    step_done: list[list[bool]]  # initial state: steps without a receive are done
    done_upto: list[int]  # initial state: per segment, how many leading steps are done
    after: tuple[int, ...]  # per step: how many leading steps its segment k waits for (its group's first)
    lockstep: tuple[LockstepStep, ...]  # one segment: the steps in order (a commit combines into USER)
    writes_user: bool  # some step receives or commits into USER (in place)
    sends_user: bool  # some step sends straight from USER (needs WORK in the same dtype)
    touches_user: bool  # some step sends from, receives into or reduces USER
    early: tuple[int, ...]  # lockstep: steps whose (empty) receive is posted before the first step
    # (step, segment) -> the last earlier step receiving into the same region: combined before this receive
    landing: dict[Item, int]


_programs: weakref.WeakKeyDictionary[object, dict[int, tuple[Schedule, Program]]] = (
    weakref.WeakKeyDictionary()
)
_CACHE_SIZE = 64  # programs kept per transport


def compile_program(schedule: Schedule, transport: Transport) -> Program:
    """``schedule`` compiled for ``transport``, kept per transport and schedule object (64 each, LRU).

    The entry holds the schedule, so its id stays unique while kept.
    """
    entries = _programs.setdefault(transport, {})
    entry = entries.pop(id(schedule), None)  # least recently used first, as every cache here
    if entry is None:
        if len(entries) >= _CACHE_SIZE:
            del entries[next(iter(entries))]
        entry = (schedule, _compile(schedule, transport))
    entries[id(schedule)] = entry
    return entry[1]


def waits_for(steps: tuple[Step, ...]) -> tuple[int, ...]:
    """Per step, how many leading steps its segments wait for: the first step of its ``alongside`` group.

    Raises:
        ValueError: a step runs alongside a whole step, is the first, or
            touches a region an earlier step of its group writes (or writes
            one it reads): it would then depend on that step after all.
    """
    after: list[int] = []
    for s, step in enumerate(steps):
        if step.alongside and (s == 0 or step.whole or steps[s - 1].whole):
            raise ValueError(
                f"step {s} runs alongside its predecessor, but one of them is whole or it is the first"
            )
        if step.alongside:
            for earlier in range(after[-1], s):
                if _conflict(steps[earlier], step):
                    raise ValueError(
                        f"step {s} runs alongside step {earlier}, but they touch the same region"
                    )
        after.append(after[-1] if step.alongside else s)
    return tuple(after)


def _conflict(x: Step, y: Step) -> bool:
    """Whether one of the steps writes a region the other reads or writes (two reads are no conflict).

    A ``commit`` also writes its destination's range of USER; empty regions touch nothing.
    """

    def reads(step: Step) -> list[Region]:
        return [r for r in (step.send, *(step.reduce or ())[1:]) if r is not None and r.count]

    def writes(step: Step) -> list[Region]:
        dst = step.reduce[0] if step.reduce else None
        committed = dataclasses.replace(dst, buf=Buf.USER) if dst is not None and step.commit else None
        return [r for r in (step.recv, dst, committed) if r is not None and r.count]

    return any(_overlap(w, r) for w in writes(x) for r in reads(y) + writes(y)) or any(
        _overlap(w, r) for w in writes(y) for r in reads(x)
    )


def _compile(schedule: Schedule, transport: Transport) -> Program:
    sends: dict[Route, list[tuple[int, int, Key, int]]] = {}
    recvs: dict[Route, list[tuple[int, int, Key, int]]] = {}
    combines: dict[Item, tuple[Key, Key, Key] | None] = {}
    landing: dict[Item, int] = {}
    received: dict[Key, int] = {}  # a region (cut) -> the last step so far that receives into it
    after = waits_for(schedule.steps)
    for s, step in enumerate(schedule.steps):
        for k in range(1) if step.whole else range(schedule.segments):

            def cut(region: Region, step: Step = step, k: int = k) -> Key:
                return _key(region if step.whole else region.segment(k, schedule.segments, schedule.ramp))

            bits = wire.make_tag(0, step.phase, k)
            if step.send is not None:
                route = (step.send_peer, transport.route(step.send_peer, k))
                sends.setdefault(route, []).append((s, k, cut(step.send), bits))
            if step.recv is not None:
                route = (step.recv_peer, transport.route(step.recv_peer, k))
                key = cut(step.recv)
                recvs.setdefault(route, []).append((s, k, key, bits))
                if key[1] < key[2]:  # a whole step marks every segment done: it counts as the earlier one too
                    if key in received and not step.whole:
                        landing[(s, k)] = received[key]
                    received[key] = s
                combines[(s, k)] = tuple(cut(r) for r in step.reduce) if step.reduce else None  # type: ignore[assignment]
    for items in (*sends.values(), *recvs.values()):  # a group's segments interleave
        items.sort(key=lambda item: (after[item[0]], item[1], item[0]))
    step_done = [[step.recv is None] * schedule.segments for step in schedule.steps]
    per_step = [0] * len(schedule.steps)
    for items in (*sends.values(), *recvs.values()):
        for s, *_ in items:
            per_step[s] += 1
    lockstep, writes_user, early = _in_order(schedule, transport)
    return Program(
        schedule.steps,
        schedule.segments,
        {route: tuple(items) for route, items in sends.items()},
        {route: tuple(items) for route, items in recvs.items()},
        combines,
        tuple(per_step),
        step_done,
        [leading_done(step_done, k) for k in range(schedule.segments)],
        after,
        lockstep,
        writes_user,
        sends_user=any(step.send is not None and step.send.buf == Buf.USER for step in schedule.steps),
        touches_user=writes_user
        or any(
            region.buf == Buf.USER
            for step in schedule.steps
            for region in (step.send, step.recv, *(step.reduce or ()))
            if region is not None
        ),
        early=early,
        landing=landing,
    )


def _in_order(
    schedule: Schedule, transport: Transport
) -> tuple[tuple[LockstepStep, ...], bool, tuple[int, ...]]:
    """The one-segment steps in order (empty for a pipelined schedule), whether they write USER, early receives.

    A ``commit`` combine without backups writes USER directly. Over a
    transport whose posted receives announce themselves (RDMA; TCP has a
    latency path, ``swap``, and announces nothing), an empty receive that is
    first on its connection is posted before the first step, as the
    Executor posts it (see :mod:`ringcore.algo.lockstep`).
    """
    writes_user = False
    steps: list[LockstepStep] = []
    early: list[int] = []
    announces = getattr(transport, "swap", None) is None
    receiving_from: set[tuple[int, int]] = set()  # routes some earlier step receives on
    for index, step in enumerate(schedule.steps):
        send = recv = None
        if step.send is not None:
            send = (step.send_peer, transport.route(step.send_peer, 0), _key(step.send))
        if step.recv is not None:
            recv = (step.recv_peer, transport.route(step.recv_peer, 0), _key(step.recv))
            writes_user = writes_user or step.recv.buf == Buf.USER
            if announces and step.recv.count == 0 and recv[:2] not in receiving_from:
                early.append(index)
            receiving_from.add(recv[:2])
        reduce = None
        if step.reduce is not None:
            dst, a, b = step.reduce
            if step.commit:  # without a backup, a commit is a combine into USER
                dst = dataclasses.replace(dst, buf=Buf.USER)
                writes_user = True
            reduce = (_key(dst), _key(a), _key(b))
        lend = _lend(schedule, index, reduce)
        steps.append((wire.make_tag(0, step.phase, 0), send, recv, reduce, step.final, lend))
    if schedule.segments != 1:
        return (), writes_user, ()
    return tuple(steps), writes_user, tuple(early)


def _lend(schedule: Schedule, index: int, reduce: tuple[Key, Key, Key] | None) -> int:
    """Whether step ``index``'s received bytes may stay where they arrived: the operand they are, or 0.

    They may when they are operand ``a`` (1) or ``b`` (2) of the step's
    combine and the region they were meant for is never read again: it is the
    combine's destination, or no later step sends or combines from it before
    a later receive overwrites all of it, and it is not part of the result.
    """
    step = schedule.steps[index]
    if reduce is None or step.recv is None or step.recv.count == 0:
        return 0
    got = _key(step.recv)
    which = 1 if got == reduce[1] else 2 if got == reduce[2] else 0
    if not which or got == reduce[0]:
        return which
    for after in schedule.steps[index + 1 :]:
        if after.send is not None and _overlap(step.recv, after.send):
            return 0
        if after.recv is not None and _covers(after.recv, step.recv):
            return which  # overwritten before anything reads it
        if after.reduce is not None and any(_overlap(step.recv, region) for region in after.reduce[1:]):
            return 0
    if schedule.result is not None and _overlap(step.recv, schedule.result):
        return 0
    return which


def _overlap(x: Region, y: Region) -> bool:
    return x.buf == y.buf and x.start < y.start + y.count and y.start < x.start + x.count


def _covers(outer: Region, inner: Region) -> bool:
    return (
        outer.buf == inner.buf
        and outer.start <= inner.start
        and inner.start + inner.count <= outer.start + outer.count
    )


def leading_done(step_done: list[list[bool]], part: int) -> int:
    """How many leading steps of segment ``part`` are done."""
    upto = 0
    while upto < len(step_done) and step_done[upto][part]:
        upto += 1
    return upto
