"""Allreduce bus bandwidth of one buffer size, the simple way (bench/ has the full tool).

ringcore-run -np 4 python examples/busbw.py 64      # MiB of float32
"""

import sys
import time

import numpy as np

import ringcore

ringcore.init()
mib = float(sys.argv[1]) if len(sys.argv) > 1 else 64.0
size = ringcore.size()
g = np.ones(int(mib * 2**20) // 4, np.float32)
times = []
for _ in range(7):
    ringcore.barrier()
    start = time.perf_counter()
    ringcore.allreduce(g)
    times.append(time.perf_counter() - start)
slowest = ringcore.allgather(np.array([np.median(times[1:])]))  # each rank's median, then the slowest
if ringcore.rank() == 0:
    t = float(slowest.max())
    busbw = g.nbytes / t * 2 * (size - 1) / size / 1e9
    print(f"allreduce {mib:g} MiB float32, {size} ranks: {t * 1e3:.1f} ms, busbw {busbw:.2f} GB/s")
ringcore.shutdown()
