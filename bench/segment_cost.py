"""CPU time the engine spends per segment, for the transport in ``RINGCORE_TRANSPORT``.

Run under the launcher; rank 0 prints one line per segment size::

    RINGCORE_TRANSPORT=ibverbs ringcore-run -np 2 python bench/segment_cost.py 4M 16K 64K 512K

Each rank allreduces a float32 buffer of the first size with every segment
size given, and measures its own process CPU time (``time.process_time``) and
wall time per allreduce. ``cpu/segment`` divides CPU time by the segments this
rank sends and receives (the ring moves ``2 (N-1)`` chunks, each cut into
segments): what Python and the transport cost per segment, which is what a
larger segment amortises. Comparing transports in one run on one machine is
the point; the absolute figures depend on the machine.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time

import numpy as np

import ringcore
from ringcore.bench.usage import answer_help
from ringcore.config import parse_size


def main(argv: list[str]) -> None:
    answer_help(__doc__, argv)
    if len(argv) < 2:
        raise SystemExit(__doc__)
    nbytes, segments = parse_size(argv[0]), [parse_size(s) for s in argv[1:]]
    comm = ringcore.init()
    buf = np.ones(nbytes // 4, np.float32)
    for segment in segments:
        comm.settings = dataclasses.replace(comm.settings, segment_bytes=segment)
        comm.allreduce(buf)  # warm-up: compile the schedule, register the buffers
        iterations = max(3, min(20, (64 << 20) // nbytes))
        comm.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(iterations):
            comm.allreduce(buf)
        wall, cpu = (time.perf_counter() - wall) / iterations, (time.process_time() - cpu) / iterations
        per_rank = comm.allgather(np.array([wall, cpu]))
        chunk = math.ceil(nbytes / comm.size)
        count = 2 * 2 * (comm.size - 1) * math.ceil(chunk / segment)  # sends + receives per rank
        if comm.rank == 0:
            wall_max, cpu_mean = per_rank[0::2].max(), per_rank[1::2].mean()
            print(
                f"{type(comm.transport).__name__:14s} N={comm.size} size={nbytes:>10d} segment={segment:>8d} "
                f"time={wall_max * 1e3:8.2f} ms  cpu={cpu_mean * 1e3:8.2f} ms  "
                f"cpu/segment={cpu_mean / count * 1e6:7.1f} us  ({count} segment ops)",
                flush=True,
            )
    ringcore.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
