"""Time per barrier, back to back: ``ringcore-run -np N python bench/barrier_time.py [ITERS]``.

Every rank times ``ITERS`` barriers (default 2000) after a warm-up; rank 0
prints the median over ranks of each rank's median time per barrier, the
spread, and the CPU time (user + system) all ranks together spent per barrier. On an emulated cluster: ``PER_HOST=2 bench/netns_cluster.sh launch 8
.venv/bin/python bench/barrier_time.py`` with ``RINGCORE_HIERARCHICAL=0|1``.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

import ringcore
from ringcore.bench.usage import answer_help


def main() -> None:
    answer_help(__doc__)
    iters = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    ringcore.init()
    for _ in range(max(10, iters // 10)):
        ringcore.barrier()
    times = np.empty(iters)
    cpu = os.times()
    for i in range(iters):
        start = time.perf_counter()
        ringcore.barrier()
        times[i] = time.perf_counter() - start
    after = os.times()
    spent = (after.user - cpu.user + after.system - cpu.system) / iters * 1e6
    medians, cpus = ringcore.allgather(np.array([[np.median(times) * 1e6, spent]])).T
    if ringcore.rank() == 0:
        print(
            f"barrier N={ringcore.size()}: {np.median(medians):.1f} us per barrier "
            f"(rank medians {medians.min():.1f}-{medians.max():.1f}); "
            f"CPU of all ranks {cpus.sum():.0f} us per barrier",
            flush=True,
        )
    ringcore.shutdown()


if __name__ == "__main__":
    main()
