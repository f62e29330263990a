"""A rank that inits, allreduces and shuts down many times at one fixed address (run by test_reinit.py).

Prints ``cycles <n> fds <before> <after> threads <before> <after>`` once every cycle matched numpy.
"""

import os
import sys
import threading
import time

import numpy as np

import ringcore


def counts() -> tuple[int, int]:
    return len(os.listdir("/proc/self/fd")), threading.active_count()


cycles = int(sys.argv[1])
before = counts()
for cycle in range(cycles):
    ringcore.init()
    a = np.full(1 << 15, cycle + ringcore.rank(), np.float32)
    ringcore.allreduce(a)
    n = ringcore.size()
    assert a[0] == n * cycle + n * (n - 1) / 2, (cycle, a[0])
    ringcore.shutdown()
deadline = time.monotonic() + 15  # rank 0's retired store closes once every rank has left
while counts() != before and time.monotonic() < deadline:
    time.sleep(0.05)
after = counts()
print(f"cycles {cycles} fds {before[0]} {after[0]} threads {before[1]} {after[1]}", flush=True)
