"""Peak memory an allreduce adds on each rank, beyond the caller's buffer.

    ringcore-run -np 2 python bench/memory.py 1G            # float32 sum
    ringcore-run -np 2 python bench/memory.py 1G fp16       # with fp16 compression
    ringcore-run -np 2 python bench/memory.py 1G symmetric  # the buffer from ringcore.empty

Each rank allocates and touches its buffer, reads its peak RSS (``ru_maxrss``),
runs one allreduce, and reads it again; the difference is what ringcore added
at its peak (scratch, staging, socket-side copies in user space). Rank 0 prints
every rank's figure. The speed issue's target: at most 64 MiB for 1 GiB.

With ``symmetric`` the buffer comes from ``ringcore.empty`` and the allreduce
is the direct route: a rank then touches its share of every peer's array, and
the kernel counts those shared pages in its RSS though they are the peers'
buffers, not new memory. So the private memory each rank gained (``RssAnon``
in ``/proc/self/status``, after the allreduce) is printed too.
"""

from __future__ import annotations

import resource
import sys

import numpy as np

import ringcore
from ringcore.bench.report import parse_size
from ringcore.bench.usage import answer_help


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def private_mib() -> float:
    """This process's anonymous (private) resident memory, MiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    return 0.0


def main() -> None:
    answer_help(__doc__)
    nbytes = parse_size(sys.argv[1] if len(sys.argv) > 1 else "1G")
    mode = sys.argv[2] if len(sys.argv) > 2 else None
    compression = mode if mode != "symmetric" else None
    ringcore.init()
    if mode == "symmetric":
        buf = ringcore.empty(nbytes // 4, np.float32)
        buf[...] = 1
    else:
        buf = np.ones(nbytes // 4, np.float32)  # np.ones touches every page
    ringcore.barrier()
    before, private_before = peak_rss_mib(), private_mib()
    ringcore.allreduce(buf, compression=compression)
    added, private = peak_rss_mib() - before, private_mib() - private_before
    ok = bool(buf[0] == ringcore.size() and buf[-1] == ringcore.size())
    rows = ringcore.allgather(np.array([[added, private, ok]], np.float64))
    if ringcore.rank() == 0:
        what = f"allreduce of {nbytes / 2**20:.0f} MiB float32" + (f", {mode}" if mode else "")
        for rank, (mib, own, good) in enumerate(rows):
            print(
                f"rank {rank}: {what}: peak RSS +{mib:.1f} MiB beyond the buffer (private +{own:.1f} MiB); "
                f"result {'ok' if good else 'WRONG'}"
            )
    ringcore.shutdown()


if __name__ == "__main__":
    main()
