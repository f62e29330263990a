"""Hierarchical collectives: inside each host, across hosts, inside each host again.

Theory of operation, for H hosts of L ranks each (``grid[h][l]`` is the rank
with local rank ``l`` on host ``h``), as Horovod's hierarchical allreduce and
NCCL's tree-of-rings do, but with every local rank on the network at once.
The buffer is cut into H*L *blocks*; block ``(h, l)`` is the one rank
``grid[h][l]`` ends up owning, and *column* ``l`` is the H blocks ``(*, l)``.

Reduce-scatter (:func:`reduce_scatter_steps`):

1. Local: a ring among the L ranks of each host over the L columns. Afterwards
   local rank ``l`` holds column ``l`` summed over its host, in WORK (in the
   caller's buffer in place: "In place" below).
2. Across hosts: a ring among the H ranks with local rank ``l`` (one per host)
   over the blocks of column ``l``; each receive lands in STAGE and is added
   into WORK, or USER (the last add is ``final``: avg divides there, once). The L rings
   of a host run at the same time. Afterwards rank ``grid[h][l]`` holds block
   ``(h, l)`` reduced over every rank.

Allgather (:func:`allgather_steps`) walks the same way back: a ring across
hosts spreads column ``l`` among the ranks with local rank ``l``, then a ring
inside each host spreads the columns. Allreduce is the two in a row over
blocks that tile the buffer (column ``l`` contiguous: chunk ``l`` of an L-way
split, cut H ways); reduce-scatter and allgather take the caller's chunks as
blocks.

What it saves: each host's link carries ``(H-1)/H`` of the buffer each way per
half, where a flat ring of L*H ranks puts ``(LH-1)/LH`` of it on the one ring
edge that leaves each host (allreduce at 4 hosts x 2 ranks: 1.5 against 1.75
buffers, 0.86x the bytes). Broadcast needs no new schedule: a chain that
visits the hosts one after the other (:func:`chain_order`) crosses each host
link once, where a chain in rank order may cross at every hop.

Barrier (:func:`barrier`): a dissemination barrier inside each host, then one
across hosts among the ranks of each local rank (L of them at once). A rank
that finishes the second has heard, through a chain of frames, from every
rank of its column after that rank finished the first, which it did only
after every rank of its host had entered. So every rank has entered.
ceil(log2 L) + ceil(log2 H) rounds, of which only ceil(log2 H) cross hosts,
where the flat barrier's ceil(log2 LH) rounds all wait on a cross-host frame
(4 hosts x 2: 2 such rounds instead of 3).

Pipelining. A local step over a column is H steps, one per block, so every
region of a schedule is a block: all are cut into the same number of
segments, and segment ``k`` of a step depends only on segment ``k`` of earlier
steps, which the pipelined executor needs (:mod:`ringcore.algo.steps`); the
local steps pipeline with the cross-host ones. Cross-host reduce-scatter step
``s`` sends block ``h-s-1`` and adds into block ``h-s-2``, and a block is whole
inside the host after its last local round, so those rounds go block by
block in that order, each just before the cross-host step that first needs
its block and ``alongside`` the one before (they touch disjoint blocks); the
rounds before the last (L of 3 or more) go first, every block side by side.
The first cross-host step waits for segment ``k`` of two blocks, which the
local connection carries segment by segment, and the other blocks are
reduced inside the host while the link carries the first; no local round
that a cross-host step waits for waits for the cross-host step before. The
allgather walks back: block ``h`` is whole before the first cross-host step,
block ``h-t-1`` after step ``t``, so each block's first local round runs beside
the next cross-host step, and only the last block's first round (with the
later rounds, L of 3 or more) follows the last cross-host byte. Measured
(``bench/HISTORY.md``, "Another host", 4 hosts x 2 on 1 Gbit/s links): 64 MiB
0.97-0.98x the time of every block's local rounds side by side before the
first cross-host step and after the last. Run block after block instead, a
host's link sat idle while it reduced (or spread) H-1 whole blocks at the
start (and the end) of every slice: 25-45 ms of a 64 MiB allreduce.

A block of two segments or more is cut with a ramp (``RAMP``,
:func:`ringcore.algo.steps.segment_bounds`): its first two and last two
segments are 1/16 and 1/4 of the others, so the first cross-host frame waits
for a local round over 1/42 of a block of two full segments (a 32 MiB slice
at 4 x 2), not half of it, and the last local round after the last
cross-host byte is as short. Measured (``bench/HISTORY.md``,
"A ramp of segments"), 4 hosts x 2, 64 MiB, alternated with equal segments:
1 Gbit/s 875-885 ms against 891-897; 10 Gbit/s level (287-295 against
290-296). A block of one segment (16 MiB at 4 x 2) stays whole: there a ramp
gained 3% at 1 Gbit/s and cost 6% at 10 Gbit/s, where the Python per
segment, not the link, is the limit.

Out of place, the local reduce-scatter and the cross-host allgather receive
into the same WORK blocks; the executor posts receives route by route in the
order routes first appear, and step 0 is local, so the local receives are
posted first, as the data flow needs (a cross-host frame can arrive before
the local one it depends on: the executor's combine rule holds it back).
STAGE holds only this rank's column, packed, so the pages it touches are
``1/L`` of the buffer. Every element's final value is computed by one rank
and copied to the others, so all ranks end bit-identical.

In place (``allreduce(in_place=True)``: no compression, no backups), the
sums go straight into the caller's buffer: the last local round and every
cross-host step add the frame that landed in STAGE into USER, and both
allgathers receive into USER, so no copy of the whole buffer follows the last
byte (10-27 ms of a 64 MiB allreduce on a crowded host). A block's local frame
and its cross-host frame land in the same STAGE block, cut alike: the
executor posts every local receive first (step 0 is local) and holds the
cross-host receive of a segment until the local one's combine has read it.
A frame for a region of the caller's buffer exists only once what this rank
read from that region has gone round (every block's final value includes
this rank's share), so a receive posted ahead cannot land before the region
is read. *Scratch*: STAGE, this rank's column (1/L of the buffer), plus WORK
for the local rounds before the last (L of 3 or more: (L-2)/L), so in place
the allreduce's slices are L/(L-1) times as long for the same scratch bound
(:func:`ringcore.slicing.allreduce_slice_bytes`): a 64 MiB allreduce at 2
ranks a host is one slice. Measured (``bench/HISTORY.md``, "Half the
hierarchical scratch"), 4 hosts x 2, alternated with the WORK form and two
slices: 1 Gbit/s 64 MiB 875-887 ms against 882-900; 10 Gbit/s 16 MiB 60-67
against 66-72, 64 MiB 285-291 against 286-317. That needs no backups: with
``RINGCORE_ATOMIC=1`` the executor would save the caller's values into WORK,
so the atomic form runs out of place (WORK for every sum, 1 + 1/L of the
buffer touched).

Mismatches. A rank checks the signature of every frame it receives, but in
place its local rounds sum into the caller's buffer before any frame from
another host arrives, so where the hosts disagree (each host's ranks alike)
the ``MismatchError`` comes after that write: the schedule says so
(``Schedule.early_user``) and the error's note names the elements that may
hold partial sums. The ring and the atomic (out of place) form write the
caller's buffer only once every rank's frames have reached this rank, so
there a mismatch leaves it untouched. A check across hosts before the first
write would cost a hierarchical barrier per call (0.5 ms on the emulated 1
Gbit/s cluster, a seventh of a 256 KiB allreduce there).

Where it is used: :func:`ringcore.slicing.allreduce_schedule` and the gather
and broadcast plans, on a grid from :mod:`ringcore.placement`.
"""

from __future__ import annotations

import functools

from ringcore.algo.broadcast import dissemination
from ringcore.algo.steps import Buf, Region, Schedule, Step, chunk_bounds, segment_count

Grid = tuple[tuple[int, ...], ...]  # grid[host][local rank] = rank
Blocks = tuple[tuple[tuple[int, int], ...], ...]  # blocks[host][local rank] = (start, count)


def locate(grid: Grid, rank: int) -> tuple[int, int]:
    """``(host, local rank)`` of ``rank`` in ``grid``."""
    for host, ranks in enumerate(grid):
        if rank in ranks:
            return host, ranks.index(rank)
    raise ValueError(f"rank {rank} is not in the host grid {grid}")


def applies(grid: Grid | None) -> bool:
    """Whether ``grid`` has several hosts of several ranks each."""
    return grid is not None and len(grid) > 1 and len(grid[0]) > 1


class _Walk:
    """One rank's place in the grid, the blocks, and the steps made so far (phases follow their count)."""

    def __init__(self, rank: int, grid: Grid, blocks: Blocks) -> None:
        self.hosts, self.local = len(grid), len(grid[0])
        self.host, self.me = locate(grid, rank)
        self.blocks = blocks
        row = grid[self.host]
        self.left, self.right = row[(self.me - 1) % self.local], row[(self.me + 1) % self.local]
        self.up = grid[(self.host - 1) % self.hosts][self.me]
        self.down = grid[(self.host + 1) % self.hosts][self.me]
        packed, self.stage = 0, {}
        for h in range(self.hosts):  # this rank's column, packed into STAGE
            self.stage[h] = packed
            packed += blocks[h][self.me][1]
        self.steps: list[Step] = []

    def block(self, buf: Buf, host: int, local: int) -> Region:
        host, local = host % self.hosts, local % self.local
        start, count = self.blocks[host][local]
        return Region(buf, self.stage[host] if buf == Buf.STAGE else start, count)


def reduce_scatter_steps(walk: _Walk, in_place: bool = False) -> None:
    """Steps after which this rank holds its block (of USER, reduced over every rank) in WORK (USER ``in_place``).

    Cross-host step ``s`` sends block ``h-s-1`` of this rank's column and adds
    into block ``h-s-2``. A block is whole inside the host after its last local
    round, so those go in that order, each just before the cross-host step that
    first needs its block and alongside the one before; the rounds before the
    last (L of 3 or more) go first, every block side by side ("Pipelining",
    module docstring). In place, the last local round and the cross-host steps
    sum into the caller's buffer, each frame landing in STAGE (module
    docstring, "In place").
    """
    h, last = walk.host, walk.local - 2
    sums = Buf.USER if in_place else Buf.WORK
    order = [h - s - 1 for s in range(walk.hosts)]  # the blocks as the cross-host steps need them
    for r in range(last):
        for i, j in enumerate(order):
            _local_round(walk, j, r, alongside=i > 0)
    _local_round(walk, order[0], last, alongside=False, into=sums)  # what cross-host step 0 sends
    for s in range(walk.hosts - 1):  # this rank's column across hosts
        _local_round(walk, order[s + 1], last, alongside=True, into=sums)  # the block step s adds into
        sent, got = h - s - 1, h - s - 2
        own = walk.block(sums, got, walk.me)
        arrived = walk.block(Buf.STAGE, got, walk.me)
        walk.steps.append(
            Step(
                walk.down,
                walk.block(sums, sent, walk.me),
                walk.up,
                arrived,
                reduce=(own, arrived, own),
                final=s == walk.hosts - 2,
                phase=len(walk.steps),
                label="cross reduce-scatter",
            )
        )


def _local_round(walk: _Walk, j: int, r: int, alongside: bool, into: Buf = Buf.WORK) -> None:
    """Round ``r`` of the local reduce-scatter of block row ``j``: after round L-2, this rank's block
    ``(j, me)`` is summed over its host, in ``into``. A round after the first sends what the one before
    received. Into USER (the last round, in place), the frame lands in STAGE and the sum goes to USER."""
    sent, got = walk.me - r - 1, walk.me - r - 2
    mine = walk.block(Buf.USER, j, got)
    if into == Buf.USER:
        partial, arrived = mine, walk.block(Buf.STAGE, j, got)
    else:
        partial = arrived = walk.block(Buf.WORK, j, got)
    walk.steps.append(
        Step(
            walk.right,
            walk.block(Buf.USER if r == 0 else Buf.WORK, j, sent),
            walk.left,
            arrived,
            reduce=(partial, arrived, mine),
            phase=len(walk.steps),
            label="local reduce-scatter",
            alongside=alongside,
        )
    )


def allgather_steps(walk: _Walk, buf: Buf = Buf.WORK) -> None:
    """Steps that spread every rank's block (in ``buf``) to every rank's ``buf``.

    Block ``h`` is whole before the first cross-host step and block ``h-t-1``
    after cross-host step ``t``, so each block's first local round follows the
    step that completes it, alongside the next cross-host step: only the last
    block's first round, and the later rounds (L of 3 or more, every block side
    by side), are left after the last byte crosses hosts.
    """
    h, me = walk.host, walk.me
    for t in range(walk.hosts - 1):  # the column across hosts, each block spread as it comes
        walk.steps.append(
            Step(
                walk.down,
                walk.block(buf, h - t, me),
                walk.up,
                walk.block(buf, h - t - 1, me),
                phase=len(walk.steps),
                label="cross allgather",
            )
        )
        _spread(walk, buf, h - t, 0, alongside=True)
    _spread(walk, buf, h - walk.hosts + 1, 0, alongside=False)
    for t in range(1, walk.local - 1):
        for i in range(walk.hosts):
            _spread(walk, buf, h - i, t, alongside=i > 0)


def _spread(walk: _Walk, buf: Buf, j: int, t: int, alongside: bool) -> None:
    """Round ``t`` of the local allgather of block row ``j``: pass on this rank's column (round 0), else
    the one received the round before."""
    walk.steps.append(
        Step(
            walk.right,
            walk.block(buf, j, walk.me - t),
            walk.left,
            walk.block(buf, j, walk.me - t - 1),
            phase=len(walk.steps),
            label="local allgather",
            alongside=alongside,
        )
    )


RAMP = 2  # short segments at each end of a block of two or more segments (see "Pipelining")


def _schedule(
    walk: _Walk, result: Region, itemsize: int, segment_bytes: int, early_user: bool = False
) -> Schedule:
    """``walk``'s steps as a schedule, its blocks cut into segments: with a ramp where a block spans two or more."""
    segments = segment_count(max(n for row in walk.blocks for _, n in row), itemsize, segment_bytes)
    ramp = RAMP if segments >= 2 else 0
    return Schedule(tuple(walk.steps), segments + 2 * ramp, result, ramp=ramp, early_user=early_user)


@functools.lru_cache(maxsize=256)
def allreduce(
    rank: int, grid: Grid, count: int, itemsize: int, segment_bytes: int, in_place: bool = False
) -> Schedule:
    """Hierarchical allreduce of ``count`` elements over ``grid``; the result is all of WORK, or USER ``in_place``.

    In place (no compression, no backups: see the module docstring), the
    last local round and the cross-host steps sum into the caller's buffer
    and both allgathers receive straight into it: no copy of the whole buffer
    follows the last byte, and scratch is STAGE (WORK only for L of 3 or more).
    """
    hosts, local = len(grid), len(grid[0])
    columns = chunk_bounds(count, local)
    split = [chunk_bounds(n, hosts) for _, n in columns]
    blocks = tuple(
        tuple((columns[c][0] + split[c][h][0], split[c][h][1]) for c in range(local)) for h in range(hosts)
    )
    walk = _Walk(rank, grid, blocks)
    target = Buf.USER if in_place else Buf.WORK
    reduce_scatter_steps(walk, in_place)
    allgather_steps(walk, target)
    # in place, the local rounds sum into USER before any frame from another host: a mismatch across
    # hosts is found after that ("Mismatches" in the module docstring)
    return _schedule(walk, Region(target, 0, count), itemsize, segment_bytes, early_user=in_place)


def _rank_blocks(grid: Grid, chunks: tuple[tuple[int, int], ...]) -> Blocks:
    return tuple(tuple(chunks[rank] for rank in row) for row in grid)


@functools.lru_cache(maxsize=256)
def reduce_scatter(
    rank: int, grid: Grid, chunks: tuple[tuple[int, int], ...], itemsize: int, segment_bytes: int
) -> Schedule:
    """Hierarchical reduce-scatter of USER; the result is this rank's chunk of WORK."""
    blocks = _rank_blocks(grid, chunks)
    walk = _Walk(rank, grid, blocks)
    reduce_scatter_steps(walk)
    return _schedule(walk, Region(Buf.WORK, *chunks[rank]), itemsize, segment_bytes)


@functools.lru_cache(maxsize=256)
def allgather(
    rank: int, grid: Grid, chunks: tuple[tuple[int, int], ...], itemsize: int, segment_bytes: int
) -> Schedule:
    """Hierarchical allgather over WORK, which must already hold this rank's chunk."""
    blocks = _rank_blocks(grid, chunks)
    walk = _Walk(rank, grid, blocks)
    allgather_steps(walk)
    total = sum(n for _, n in chunks)
    return _schedule(walk, Region(Buf.WORK, 0, total), itemsize, segment_bytes)


@functools.lru_cache(maxsize=256)
def barrier(rank: int, grid: Grid) -> Schedule:
    """Dissemination inside this rank's host, then across hosts among its column (module docstring)."""
    host, me = locate(grid, rank)
    inside = dissemination(rank, grid[host])
    across = dissemination(rank, tuple(row[me] for row in grid), first_phase=len(inside))
    return Schedule(tuple(inside + across), 1, None)


def chain_order(grid: Grid, root: int) -> tuple[int, ...]:
    """A broadcast chain from ``root`` that visits the hosts one after the other: H-1 host crossings."""
    host, me = locate(grid, root)
    row = grid[host]
    first = row[me:] + row[:me]
    return first + tuple(rank for h in range(1, len(grid)) for rank in grid[(host + h) % len(grid)])
