"""Recursive-doubling allreduce: the latency-optimal schedule for small buffers.

Theory of operation. The schedule works on WORK, which the caller fills with
this rank's values in the wire dtype first (``prefill_work``): both partners
of a pair then combine exactly the same operands, fp16 compression included.
Let P be the largest power of two <= N and E = N - P.
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
    work, stage = Region(Buf.WORK, 0, count), Region(Buf.STAGE, 0, count)
    if size == 1:
        return Schedule((), segments, Region(Buf.USER, 0, count))
    p2 = 1 << (size.bit_length() - 1)
    rounds = p2.bit_length() - 1
    last_phase = rounds + 1
    if rank >= p2:
        partner = rank - p2
        steps = (
            Step(partner, work, phase=0, label="fold-in"),
            Step(recv_peer=partner, recv=work, phase=last_phase, label="fold-out"),
        )
        return Schedule(steps, segments, work, prefill_work=True)
    steps: list[Step] = []
    if rank < size - p2:
        steps.append(
            Step(recv_peer=rank + p2, recv=stage, reduce=(work, work, stage), phase=0, label="fold-in")
        )
    for i in range(rounds):
        partner = rank ^ (1 << i)
        lo, hi = (work, stage) if rank < partner else (stage, work)
        steps.append(
            Step(
                partner,
                work,
                partner,
                stage,
                reduce=(work, lo, hi),
                final=i == rounds - 1,
                phase=i + 1,
                label="recursive-doubling",
            )
        )
    if rank < size - p2:
        steps.append(Step(rank + p2, work, phase=last_phase, label="fold-out"))
    return Schedule(tuple(steps), segments, work, prefill_work=True)
