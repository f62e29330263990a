"""Recursive-doubling allreduce: the latency-optimal schedule for small buffers.

Theory of operation. Let P be the largest power of two <= N and E = N - P.
Ranks r >= P ("extras") first hand their whole vector to r - P, which
combines it into its own, and get the final result back at the end. Among the
P others, step i pairs r with r XOR 2^i; both send their whole current
vector, receive the partner's into STAGE and combine. Each pair evaluates
``op(lower rank's vector, higher rank's vector)``, the same expression on
both sides, so every rank ends bit-for-bit identical.

Cost per rank: log2(P) steps (+2 when N is not a power of two); the whole
buffer sent and received each step. Ring beats it on bandwidth once the
buffer is large; the comm picks by size (``RINGCORE_SMALL_BYTES``).
"""

from __future__ import annotations

import functools

from ringcore.algo.steps import Buf, Region, Schedule, Step, segment_count


@functools.lru_cache(maxsize=256)
def allreduce(rank: int, size: int, count: int, itemsize: int, segment_bytes: int) -> Schedule:
    """Recursive-doubling allreduce of ``count`` elements; the result is WORK."""
    segments = segment_count(count, itemsize, segment_bytes)
    whole = {buf: Region(buf, 0, count) for buf in Buf}
    p2 = 1 << (size.bit_length() - 1)
    rounds = p2.bit_length() - 1
    last_phase = rounds + 1
    if rank >= p2:
        partner = rank - p2
        steps = (
            Step(partner, whole[Buf.USER], phase=0),
            Step(recv_peer=partner, recv=whole[Buf.WORK], phase=last_phase),
        )
        return Schedule(steps, segments, whole[Buf.WORK])
    steps_list: list[Step] = []
    current = Buf.USER
    if rank < size - p2:
        reduce = (whole[Buf.WORK], whole[Buf.USER], whole[Buf.STAGE])
        steps_list.append(Step(recv_peer=rank + p2, recv=whole[Buf.STAGE], reduce=reduce, phase=0))
        current = Buf.WORK
    for i in range(rounds):
        partner = rank ^ (1 << i)
        mine, theirs = whole[current], whole[Buf.STAGE]
        lo, hi = (mine, theirs) if rank < partner else (theirs, mine)
        final = i == rounds - 1
        steps_list.append(
            Step(partner, mine, partner, theirs, reduce=(whole[Buf.WORK], lo, hi), final=final, phase=i + 1)
        )
        current = Buf.WORK
    if rank < size - p2:
        steps_list.append(Step(rank + p2, whole[Buf.WORK], phase=last_phase))
    return Schedule(tuple(steps_list), segments, whole[Buf.WORK])
