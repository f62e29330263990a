"""Halving-doubling allreduce (Rabenseifner): ring's bytes in 2 log2(N) steps instead of 2(N-1).

Theory of operation, for N a power of two. Reduce-scatter by recursive
halving: step i pairs r with r XOR (N >> (i+1)); the pair splits the range
both still hold in two halves, each sends the half it gives up and receives
the partner's values of the half it keeps into STAGE, then combines them into
WORK. Step 0 sends from and combines with the caller's buffer, so no copy of
the input is made. After log2(N) steps rank r holds 1/N of the buffer fully
reduced (the last combine is ``final``: avg divides there, once). Allgather
by recursive doubling walks the same pairs backwards: each sends what it
holds and receives the partner's part into WORK, doubling what it holds.

Every element's final value is computed by one rank and copied to the others,
so all ranks end bit-identical. The caller's buffer is written only after the
last step (by the plan's copy out of WORK), so a failed run leaves it
untouched.

The ranges halve from step to step, so a segment of one step does not line
up with the same segment of the next, and a step's STAGE range lies inside
the previous step's: every step is ``whole``, one frame sent and received
only once the steps before it are done (:mod:`ringcore.algo.execute`). With
no pipelining to hide a step's combine behind the next transfer, and frames
of half the buffer (GPU buffers stage whole frames through pinned slots),
the communicator uses it only up to ``RINGCORE_HALVING_BYTES``. Its steps are
labelled ``halving`` and ``doubling`` in the timeline.

Cost per rank: 2 log2(N) steps; 2(N-1)/N of the buffer sent and received
(as the ring); (N-1)/N of it combined. Where it wins: with fewer steps, a
rank waits on its peers fewer times; on 2 cores with 4 or 8 ranks (every
wait a context switch) 1.2-4.6x faster than the ring from 128 KiB to 4 MiB
(``bench/RESULTS.md``).
"""

from __future__ import annotations

import functools

from ringcore.algo.steps import Buf, Region, Schedule, Step


def applies(size: int, count: int) -> bool:
    """Whether the schedule exists: a power-of-two world of at least 4 and an element per rank."""
    return size >= 4 and size & (size - 1) == 0 and count >= size


@functools.lru_cache(maxsize=256)
def allreduce(rank: int, size: int, count: int) -> Schedule:
    """Halving-doubling allreduce of ``count`` elements; the result is all of WORK."""
    if not applies(size, count):
        raise ValueError(
            f"halving-doubling needs a power-of-two world >= 4 and count >= size ({size}, {count})"
        )
    rounds = size.bit_length() - 1
    held = (0, count)
    pairs: list[tuple[int, tuple[int, int], tuple[int, int]]] = []  # (partner, kept, given)
    steps: list[Step] = []
    for i in range(rounds):
        mask = size >> (i + 1)
        partner = rank ^ mask
        start, end = held
        middle = start + (end - start) // 2
        lower, upper = (start, middle - start), (middle, end - middle)
        kept, given = (lower, upper) if rank & mask == 0 else (upper, lower)
        source = Buf.USER if i == 0 else Buf.WORK
        mine = Region(Buf.WORK, *kept)
        steps.append(
            Step(
                partner,
                Region(source, *given),
                partner,
                Region(Buf.STAGE, *kept),
                reduce=(mine, Region(source, *kept), Region(Buf.STAGE, *kept)),
                final=i == rounds - 1,
                whole=True,
                phase=i,
                label="halving",
            )
        )
        pairs.append((partner, kept, given))
        held = (kept[0], kept[0] + kept[1])
    for j, (partner, kept, given) in enumerate(reversed(pairs)):
        steps.append(
            Step(
                partner,
                Region(Buf.WORK, *kept),
                partner,
                Region(Buf.WORK, *given),
                whole=True,
                phase=rounds + j,
                label="doubling",
            )
        )
    return Schedule(tuple(steps), 1, Region(Buf.WORK, 0, count))
