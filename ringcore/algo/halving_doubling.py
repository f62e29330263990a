"""Halving-doubling allreduce (Rabenseifner): ring's bytes in 2 log2(N) steps instead of 2(N-1).

Theory of operation, for N a power of two. Reduce-scatter by recursive
halving: step i pairs r with r XOR (N >> (i+1)); the pair splits the range
both still hold in two halves, each sends the half it gives up and receives
the partner's values of the half it keeps into STAGE, then combines them into
WORK. Step 0 sends from the caller's buffer and receives straight into WORK,
then adds the caller's values into it in place: no copy of the input, and a
combine over two buffers instead of three, for less user CPU (measured:
``bench/HISTORY.md``, "Results written straight into the caller's buffer, in
lockstep"). After log2(N) steps rank r holds 1/N of the buffer fully
reduced (the last combine is ``final``: avg divides there, once). Allgather
by recursive doubling walks the same pairs backwards: each sends what it
holds and receives the partner's part into WORK, doubling what it holds.

Other world sizes, as MPICH does: with P the largest power of two <= N, the
N - P ranks r >= P ("extras") first send their whole input to r - P, which
receives it into WORK and adds its own input (``fold-in``; halving then
starts from WORK), and get the whole result back at the end (``fold-out``).
Two more steps and the whole buffer twice over one pair, which pays where
steps cost more than bytes (at N=6, 6 steps against the ring's 10), so only
up to a quarter of the threshold (:func:`byte_limit`).

Every element's final value is computed by one rank and copied to the others,
so all ranks end bit-identical.

In place. When WORK has the caller's dtype and ``RINGCORE_ATOMIC`` is off
(the default), the last halving combine writes its result into the caller's
buffer (a ``commit``) and the doubling steps send from and receive into it:
no copy of the result out of WORK follows the last step, a pass over the
whole buffer that was a visible share of a mid-sized allreduce's CPU (the
same section of ``bench/HISTORY.md``). A run that fails after that combine
leaves the caller's buffer with its own values and final sums, as the
in-place ring does. Otherwise the result ends in WORK and the plan copies it out after
the last step, so a failed run leaves the buffer untouched. An extra always
gets the result in WORK: its schedule has no other use for WORK, which an
in-place receive with ``RINGCORE_ATOMIC=1`` would need for its backup.
Ranks may differ in all this: the frames are the same.

The ranges halve from step to step, so a segment of one step does not line
up with the same segment of the next, and a step's STAGE range lies inside
the previous step's: every step is ``whole``, one frame sent and received
only once the steps before it are done (:mod:`ringcore.algo.execute`). With
no pipelining to hide a step's combine behind the next transfer, and frames
of half the buffer (all of it with extras; GPU buffers stage whole frames
through pinned slots, see :func:`largest_frame`), the communicator uses it
only up to ``RINGCORE_HALVING_BYTES``. Its steps are labelled ``halving``
and ``doubling`` in the timeline (``fold-in`` and ``fold-out`` with extras).

Cost per rank: 2 log2(N) steps; 2(N-1)/N of the buffer sent and received
(as the ring); (N-1)/N of it combined. With extras, 2 log2(P) + 2 steps, and
a rank with an extra also receives, combines and sends the whole buffer.
Where it wins: with fewer steps, a rank waits on its peers fewer times, which
counts most where every wait is a context switch (more ranks than cores);
above a few MiB the ring's pipelining wins instead, hence
``RINGCORE_HALVING_BYTES`` (measured: ``bench/HISTORY.md``, "Halving-doubling
for mid-sized allreduces" and, on 5-7 ranks, "Halving-doubling on 5, 6, 7...
ranks").
"""

from __future__ import annotations

import functools

from ringcore.algo.steps import Buf, Region, Schedule, Step


def applies(size: int, count: int) -> bool:
    """Whether the schedule exists: a world of at least 4 and an element per core rank."""
    return size >= 4 and count >= _core(size)


def largest_frame(size: int, count: int) -> int:
    """The most elements one frame carries: half the buffer, or all of it when extras fold in."""
    return count if size != _core(size) else count - count // 2


def byte_limit(size: int, halving_bytes: int) -> int:
    """The largest buffer (wire bytes) to use it for: ``halving_bytes``, a quarter of it with extras.

    Folding sends the whole buffer twice more over the extra's pair, so it
    pays for fewer bytes than halving-doubling proper: on a crowded host its
    lead over the ring shrinks with the size and is gone by 4 MiB, and on a
    link-bound network the pair moves about twice the ring's bytes (measured:
    ``bench/HISTORY.md``, "Halving-doubling on 5, 6, 7... ranks").
    """
    return halving_bytes if size == _core(size) else halving_bytes // 4


def _core(size: int) -> int:
    """The largest power of two <= ``size``: the ranks that run halving-doubling proper."""
    return 1 << (size.bit_length() - 1)


@functools.lru_cache(maxsize=256)
def allreduce(rank: int, size: int, count: int, in_place: bool = False) -> Schedule:
    """Halving-doubling allreduce of ``count`` elements; the result is all of WORK, or USER ``in_place``.

    In place (WORK in the caller's dtype), the last halving combine writes
    the caller's buffer (a ``commit``) and the doubling steps send from and
    receive into it, so no copy of the result follows the last step.
    """
    if not applies(size, count):
        raise ValueError(
            f"halving-doubling needs a world >= 4 and count >= its power-of-two core ({size}, {count})"
        )
    core = _core(size)
    whole = Region(Buf.WORK, 0, count)
    target = Buf.USER if in_place else Buf.WORK
    result = Region(target, 0, count)
    first = 1 if size > core else 0  # phase of the first halving step
    last = first + 2 * (core.bit_length() - 1)  # phase of the fold-out
    if rank >= core:  # an extra: hand the input over, get the result back
        partner = rank - core
        steps = (
            Step(partner, Region(Buf.USER, 0, count), whole=True, phase=0, label="fold-in"),
            Step(recv_peer=partner, recv=whole, whole=True, phase=last, label="fold-out"),
        )
        return Schedule(steps, 1, whole)  # into WORK even in place: no backup space to restore USER from
    extra = rank + core if rank + core < size else None
    steps: list[Step] = []
    source = Buf.USER
    if extra is not None:  # the extra's input lands in WORK, and USER is added into it in place
        reduce = (whole, whole, Region(Buf.USER, 0, count))
        steps.append(Step(recv_peer=extra, recv=whole, reduce=reduce, whole=True, phase=0, label="fold-in"))
        source = Buf.WORK
    steps.extend(_halving_doubling(rank, core, count, source, first, target))
    if extra is not None:
        steps.append(Step(extra, result, whole=True, phase=last, label="fold-out"))
    return Schedule(tuple(steps), 1, result)


def _halving_doubling(rank: int, core: int, count: int, source: Buf, first: int, target: Buf) -> list[Step]:
    """The steps among the ``core`` ranks; step 0 sends from and combines with ``source``.

    The last halving combine and the doubling steps write ``target``: USER
    in place (the combine as a ``commit``), else WORK.
    """
    rounds = core.bit_length() - 1
    held = (0, count)
    pairs: list[tuple[int, tuple[int, int], tuple[int, int]]] = []  # (partner, kept, given)
    steps: list[Step] = []
    for i in range(rounds):
        mask = core >> (i + 1)
        partner = rank ^ mask
        start, end = held
        middle = start + (end - start) // 2
        lower, upper = (start, middle - start), (middle, end - middle)
        kept, given = (lower, upper) if rank & mask == 0 else (upper, lower)
        step_source = source if i == 0 else Buf.WORK
        mine = Region(Buf.WORK, *kept)
        if step_source == Buf.USER:  # WORK is free: receive there, then add USER into it in place
            recv, reduce = mine, (mine, mine, Region(Buf.USER, *kept))
        else:
            recv = Region(Buf.STAGE, *kept)
            reduce = (mine, Region(step_source, *kept), recv)
        steps.append(
            Step(
                partner,
                Region(step_source, *given),
                partner,
                recv,
                reduce=reduce,
                final=i == rounds - 1,
                whole=True,
                phase=first + i,
                label="halving",
                commit=target == Buf.USER and i == rounds - 1,
            )
        )
        pairs.append((partner, kept, given))
        held = (kept[0], kept[0] + kept[1])
    for j, (partner, kept, given) in enumerate(reversed(pairs)):
        steps.append(
            Step(
                partner,
                Region(target, *kept),
                partner,
                Region(target, *given),
                whole=True,
                phase=first + rounds + j,
                label="doubling",
            )
        )
    return steps
