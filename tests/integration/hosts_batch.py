"""Rank program of ``test_hosts.py``: a batch of mixed collectives, each rank's results pickled.

Usage: ``ringcore-run ... python tests/integration/hosts_batch.py OUT_DIR SEED TOTAL`` with the
repository on ``PYTHONPATH``. The batch is ``tests.tasks.soak`` (the soak test's plan: every
collective, random sizes, dtypes, ops, roots and compression, from ``(seed, index, rank)``), so
the test rebuilds every input and checks every result with numpy.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import ringcore
from tests import tasks


def main() -> None:
    out, seed, total = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    comm = ringcore.init()
    results = tasks.soak(comm, seed, total)
    (out / f"{comm.rank}.pkl").write_bytes(pickle.dumps(results))
    ringcore.shutdown()


if __name__ == "__main__":
    main()
