"""This host's memory-copy bandwidth, the physical limit of an allreduce on one host.

    python bench/memcpy.py                   # 4K..256M
    python bench/memcpy.py 1M,16M,256M

For each size: the median over repeats of one ``np.copyto`` between two
float32 arrays that were touched before (no page faults), as GB/s of bytes
copied. Compare with busbw: a ring allreduce on one host moves every byte
through memory several times (into a shared slot, out of it, through the
reduction), so busbw is a fraction of this figure (bench/RESULTS.md says
which).
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np

from ringcore.bench.report import parse_size
from ringcore.bench.usage import answer_help


def copy_gbps(nbytes: int, repeats: int) -> float:
    src = np.ones(nbytes // 4, np.float32)
    dst = np.zeros_like(src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def main() -> None:
    answer_help(__doc__)
    sizes = (sys.argv[1] if len(sys.argv) > 1 else "4K,1M,16M,64M,256M").split(",")
    print(f"{'size':>8} {'copy GB/s':>10}")
    for text in sizes:
        nbytes = parse_size(text)
        repeats = max(5, min(2000, (1 << 30) // max(nbytes, 1)))
        print(f"{text:>8} {copy_gbps(nbytes, repeats):10.2f}")


if __name__ == "__main__":
    main()
