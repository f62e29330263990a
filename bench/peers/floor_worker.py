"""How fast the ring allreduce's bytes can move on this host: floors no engine that moves them can beat.

Two kinds of floor, each an engine of ``bench/compare.py`` (named with
``--engines``, never run by default):

- **The passes alone** (``floor-cma``, ``floor-shm``, ``floor-mix``). Each rank
  runs the memory passes its ring would make (:func:`ring_moves`: N-1 reduce
  steps, then N-1 copy steps, each on the chunk the ring hands it) straight
  against its left neighbour's memory, with no waiting, no frames, no checks:
  the bytes it reads are whatever the peer holds at that moment, so the
  results are not checked (``wrong`` is null). What is left is what the host's
  cores, caches and kernel charge for the bytes, with every rank running at
  once. How a step reaches the peer's bytes:

  - ``floor-cma``: ``process_vm_readv`` (one kernel copy, the single-copy path
    of Open MPI and of ringcore's frames from 1 MiB): a reduce step copies into
    a scratch piece and adds it; a copy step copies straight into the buffer.
  - ``floor-shm``: two user-space copies through shared memory: the sender's
    piece written into slots of its own, the receiver adding from them (a
    reduce step) or copying out of them (a copy step).
  - ``floor-mix``: reduce steps through shared memory, copy steps by
    ``process_vm_readv``.

- **The ring with its waits and nothing else** (``floor-ring``): a real ring
  allreduce through shared-memory slots, results checked, in about forty lines
  of Python: per piece, write it into a slot, publish a counter, poll the left
  peer's counter with ``sched_yield``, add from (or copy out of) its slot. No
  frame headers, tags, timeouts, failure detection or sleeping: the part of an
  engine's time that is not its own bookkeeping. ``FLOOR_PIECE_BYTES`` and
  ``FLOOR_SEGMENT_BYTES`` set the piece and the slots' total (1 MiB and 4 MiB).

Start it with ringcore-run, which also supplies the barrier and allgather the
timing loop needs (outside the timed region)::

    ringcore-run -np 2 python -m ringcore.bench.peers.floor_worker --sizes 1M,4M --engine floor-ring
"""

from __future__ import annotations

import argparse
import mmap
import os
import secrets
import sys

import numpy as np

from ringcore.bench.peers import loop
from ringcore.transport import cma
from ringcore.transport.registration import view_address

# One step's piece (ringcore: its single-copy frames) and a rank's slots (ringcore: RINGCORE_SHM_BYTES).
PIECE_BYTES = int(os.environ.get("FLOOR_PIECE_BYTES", 1 << 20))
SEGMENT_BYTES = int(os.environ.get("FLOOR_SEGMENT_BYTES", 4 << 20))
HEADER_BYTES = 128  # two int64 counters, each on its own cache line:
PRODUCED, CONSUMED = 0, 8  # pieces this rank wrote into its slots; pieces of its left peer's it has read
VARIANTS = {"floor-cma": ("cma", "cma"), "floor-shm": ("shm", "shm"), "floor-mix": ("shm", "cma")}
ENGINES = (*VARIANTS, "floor-ring")


def ring_moves(rank: int, size: int, count: int) -> list[tuple[str, int, int]]:
    """The ring's steps on ``rank``: ``(kind, start, count)`` of the chunk it takes from its left peer.

    ``kind`` is ``"reduce"`` (scatter-reduce: add the peer's chunk into ours)
    or ``"copy"`` (allgather: the peer's reduced chunk replaces ours).
    """
    bounds = np.linspace(0, count, size + 1).astype(np.int64)
    moves = []
    for step in range(size - 1):
        chunk = (rank - step - 1) % size
        moves.append(("reduce", int(bounds[chunk]), int(bounds[chunk + 1] - bounds[chunk])))
    for step in range(size - 1):
        chunk = (rank - step) % size
        moves.append(("copy", int(bounds[chunk]), int(bounds[chunk + 1] - bounds[chunk])))
    return moves


class FloorPeer:
    """:class:`loop.Peer` whose ``allreduce`` is a floor: the bare ring, or its passes alone (module docstring)."""

    def __init__(self, variant: str) -> None:
        import ringcore

        self.ringcore = ringcore
        ringcore.init()
        self.rank, self.size = ringcore.rank(), ringcore.size()
        self.variant = variant
        self.checked = variant == "floor-ring"
        self.left, self.right = (self.rank - 1) % self.size, (self.rank + 1) % self.size
        self.scratch = np.empty(PIECE_BYTES // 4, np.float32)
        self.slots, self.counters = self._map_segments()
        self.pieces = 0  # pieces this rank has sent through its slots (floor-ring), over all calls
        self.peer_buffer: tuple[int, int] = (0, 0)  # (address of this rank's buffer, the left peer's)
        pids = self.allgather(np.array([os.getpid()], np.float64))
        self.left_pid = int(pids[self.left, 0])

    def _map_segments(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Every rank's slots (float32) and counters (int64: pieces produced, consumed), mapped here.

        Each file is this user's alone (0600) and unlinked once every rank has mapped it.
        """
        token = np.array([secrets.randbits(48)], np.float64)
        self.ringcore.broadcast(token, root=0)
        path = f"/dev/shm/ringcore-floor-{int(token[0]):x}-{{}}"
        fd = os.open(path.format(self.rank), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, HEADER_BYTES + SEGMENT_BYTES)
        finally:
            os.close(fd)
        self.barrier()
        maps = []
        for peer in range(self.size):
            with open(path.format(peer), "r+b") as file:
                maps.append(mmap.mmap(file.fileno(), HEADER_BYTES + SEGMENT_BYTES))
        self.barrier()
        os.unlink(path.format(self.rank))
        slots = [np.frombuffer(m, np.float32, offset=HEADER_BYTES) for m in maps]
        counters = [np.frombuffer(m, np.int64, count=HEADER_BYTES // 8) for m in maps]
        return slots, counters

    def allreduce(self, buf: np.ndarray) -> None:
        """``floor-ring``: a real ring through the slots; the others: its passes alone (module docstring)."""
        if self.variant == "floor-ring":
            self._ring(buf)
        else:
            self._passes(buf, *VARIANTS[self.variant])

    def _passes(self, buf: np.ndarray, reduce_via: str, copy_via: str) -> None:
        """The ring's passes on ``buf`` (float32), against the left peer's buffer of the same size."""
        left_address = self._left_address(buf)
        slots, slot = SEGMENT_BYTES // PIECE_BYTES, 0
        for kind, start, count in ring_moves(self.rank, self.size, buf.size):
            via = reduce_via if kind == "reduce" else copy_via
            for first in range(start, start + count, PIECE_BYTES // 4):
                piece = buf[first : min(first + PIECE_BYTES // 4, start + count)]
                if via == "cma":
                    into = self.scratch[: piece.size] if kind == "reduce" else piece
                    cma.read(self.left_pid, memoryview(into).cast("B"), left_address + first * 4)
                    got = into
                else:
                    # write this piece into the next slot; read the slot the peer filled one piece
                    # ago, as a receiver behind its sender would (never lines being written now)
                    slot = (slot + 1) % slots
                    mine = slot * PIECE_BYTES // 4
                    theirs = (slot - 1) % slots * PIECE_BYTES // 4
                    self.slots[self.rank][mine : mine + piece.size] = piece
                    got = self.slots[self.left][theirs : theirs + piece.size]
                    if kind == "copy":
                        piece[...] = got
                if kind == "reduce":
                    np.add(piece, got, out=piece)

    def _ring(self, buf: np.ndarray) -> None:
        """The ring allreduce through the slots, with its waits and nothing else: no frames, no checks.

        Per piece ``k``: wait until the right peer has read slot ``k % slots``'s
        last piece, write the piece this rank sends into it and count it
        produced; wait until the left peer has produced piece ``k``, add it into
        (scatter-reduce) or copy it over (allgather) this rank's piece, count it
        consumed. Waiting polls the counter with ``sched_yield`` between looks.
        """
        size, piece_count = self.size, PIECE_BYTES // 4
        if buf.size % size:
            raise ValueError(f"floor-ring: {buf.size} elements do not split into {size} equal chunks")
        chunk = buf.size // size
        slots = SEGMENT_BYTES // PIECE_BYTES
        mine, left = self.slots[self.rank], self.slots[self.left]
        counts, left_counts, right_counts = (self.counters[r] for r in (self.rank, self.left, self.right))
        k = self.pieces
        for step in range(2 * (size - 1)):
            reduce = step < size - 1  # scatter-reduce, then allgather (whose steps count from 0 again)
            first_step = step if reduce else step - (size - 1)
            send = (self.rank - first_step + (0 if reduce else 1)) % size
            recv = (self.rank - first_step - (1 if reduce else 0)) % size
            for first in range(0, chunk, piece_count):
                n = min(piece_count, chunk - first)
                slot = (k % slots) * piece_count
                while right_counts[CONSUMED] < k - slots + 1:  # the right peer still reads this slot
                    os.sched_yield()
                mine[slot : slot + n] = buf[send * chunk + first : send * chunk + first + n]
                counts[PRODUCED] = k + 1
                while left_counts[PRODUCED] < k + 1:
                    os.sched_yield()
                target = buf[recv * chunk + first : recv * chunk + first + n]
                if reduce:
                    np.add(target, left[slot : slot + n], out=target)
                else:
                    target[...] = left[slot : slot + n]
                counts[CONSUMED] = k + 1
                k += 1
        self.pieces = k

    def _left_address(self, buf: np.ndarray) -> int:
        """The left peer's buffer address, asked for once per buffer (every rank calls this together)."""
        mine = view_address(memoryview(buf).cast("B"))
        if self.peer_buffer[0] != mine:
            addresses = self.allgather(np.array([mine], np.uint64).view(np.float64))
            self.peer_buffer = (mine, int(addresses[self.left].view(np.uint64)[0]))
        return self.peer_buffer[1]

    def barrier(self) -> None:
        """ringcore's barrier."""
        self.ringcore.barrier()

    def allgather(self, values: np.ndarray) -> np.ndarray:
        """Every rank's ``values`` stacked as ``(size, len)``."""
        return np.asarray(self.ringcore.allgather(np.ascontiguousarray(values).reshape(1, -1)))

    def close(self) -> None:
        self.ringcore.shutdown()


def main(argv: list[str] | None = None) -> int:
    """One rank; ringcore-run starts them all."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    loop.add_args(parser)
    args = parser.parse_args(argv)
    if args.engine not in ENGINES:
        parser.error(f"--engine must be one of {', '.join(ENGINES)}, not {args.engine!r}")
    if not cma.available():
        print("floor_worker: process_vm_readv is not available on this platform", file=sys.stderr)
        return 2
    return loop.run(FloorPeer(args.engine), args)


if __name__ == "__main__":
    sys.exit(main())
