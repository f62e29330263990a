"""ringcore's allreduce next to the bare Python ring of ``floor_worker``, blocks alternated in one job.

    ringcore-run -np 2 python bench/ab_floor.py 1M 4M 16M
    ringcore-run -np 4 python bench/ab_floor.py 1M --blocks 9

The bare ring (``floor-ring`` of :mod:`ringcore.bench.peers.floor_worker`)
moves the same bytes through shared-memory slots with nothing else: no frame
headers, tags, timeouts or failure detection. What ringcore takes beyond it
is its own bookkeeping. Both run in the same processes, in alternating blocks
of back-to-back allreduces, so a slow spell of the host hits both; rank 0
prints, per size, each one's median time per allreduce and CPU per rank
(``os.times``), and the ratio block by block, which is the figure to read on
a noisy host. Both results are checked against numpy first.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import numpy as np

import ringcore
from ringcore.bench.peers.floor_worker import FloorPeer
from ringcore.bench.report import parse_size


def timed_block(
    peer: FloorPeer, run: Callable[[np.ndarray], object], x: np.ndarray, iters: int
) -> tuple[float, float]:
    """Microseconds of wall time and of this rank's CPU per call of ``run(x)``, over ``iters`` calls."""
    peer.barrier()
    before, start = os.times(), time.perf_counter()
    for _ in range(iters):
        run(x)
    wall, after = time.perf_counter() - start, os.times()
    cpu = after.user - before.user + after.system - before.system
    return wall / iters * 1e6, cpu / iters * 1e6


def check(peer: FloorPeer, count: int) -> None:
    """Both engines sum a pattern right (the floor splits into equal chunks only: ``count`` % N == 0)."""
    want = np.arange(count, dtype=np.float32) % 7 * peer.size + peer.size * (peer.size - 1) / 2
    for name, run in (("ringcore", ringcore.allreduce), ("floor-ring", peer.allreduce)):
        got = np.arange(count, dtype=np.float32) % 7 + peer.rank
        run(got)
        if not np.array_equal(got, want):
            raise SystemExit(f"ab_floor: {name} gave a wrong sum on rank {peer.rank} ({count} elements)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("sizes", nargs="+", help="buffer sizes, e.g. 1M 4M (float32)")
    parser.add_argument("--blocks", type=int, default=7, help="blocks of each engine, alternated")
    parser.add_argument("--budget", default="256M", help="bytes reduced per block (sets the iterations)")
    args = parser.parse_args()
    peer = FloorPeer("floor-ring")
    try:
        for text in args.sizes:
            count = parse_size(text) // 4
            check(peer, count)
            x = np.zeros(count, np.float32)  # zeros: sums stay finite
            iters = max(5, parse_size(args.budget) // (count * 4))
            engines = {"ringcore": ringcore.allreduce, "floor-ring": peer.allreduce}
            rows: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
            for _ in range(args.blocks):
                for name, run in engines.items():
                    rows[name].append(timed_block(peer, run, x, iters))
            if peer.rank == 0:
                report(peer.size, text, rows)
    finally:
        peer.close()


def report(size: int, text: str, rows: dict[str, list[tuple[float, float]]]) -> None:
    """Each engine's median wall and CPU per allreduce, then ringcore's time over the floor's, per block."""
    for name, values in rows.items():
        wall, cpu = np.median(np.array(values), axis=0)
        print(f"N={size} {text:>5} {name:10s} {wall:9.1f} us  cpu/rank {cpu:9.1f} us", flush=True)
    ratios = [a[0] / b[0] for a, b in zip(rows["ringcore"], rows["floor-ring"], strict=True)]
    line = " ".join(f"{r:.2f}" for r in ratios)
    print(
        f"N={size} {text:>5} ringcore/floor-ring per block: {line}  median {np.median(ratios):.2f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
