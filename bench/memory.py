"""Peak memory an allreduce adds on each rank, beyond the caller's buffer.

    ringcore-run -np 2 python bench/memory.py 1G            # float32 sum
    ringcore-run -np 2 python bench/memory.py 1G fp16       # with fp16 compression

Each rank allocates and touches its buffer, reads its peak RSS (``ru_maxrss``),
runs one allreduce, and reads it again; the difference is what ringcore added
at its peak (scratch, staging, socket-side copies in user space). Rank 0 prints
every rank's figure. The speed issue's target: at most 64 MiB for 1 GiB.
"""

from __future__ import annotations

import resource
import sys

import numpy as np

import ringcore
from ringcore.bench.report import parse_size


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def main() -> None:
    nbytes = parse_size(sys.argv[1] if len(sys.argv) > 1 else "1G")
    compression = sys.argv[2] if len(sys.argv) > 2 else None
    ringcore.init()
    buf = np.ones(nbytes // 4, np.float32)  # np.ones touches every page
    ringcore.barrier()
    before = peak_rss_mib()
    ringcore.allreduce(buf, compression=compression)
    added = peak_rss_mib() - before
    ok = bool(buf[0] == ringcore.size() and buf[-1] == ringcore.size())
    rows = ringcore.allgather(np.array([[added, ok]], np.float64))
    if ringcore.rank() == 0:
        what = f"allreduce of {nbytes / 2**20:.0f} MiB float32" + (f", {compression}" if compression else "")
        for rank, (mib, good) in enumerate(rows):
            print(
                f"rank {rank}: {what}: peak RSS +{mib:.1f} MiB beyond the buffer; result {'ok' if good else 'WRONG'}"
            )
    ringcore.shutdown()


if __name__ == "__main__":
    main()
