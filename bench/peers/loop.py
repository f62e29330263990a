"""The timing loop every peer worker runs, mirroring ``ringcore-bench``.

A worker wraps its library in a :class:`Peer` and calls :func:`run`. Per size:
warmup iterations, then timed ``barrier; t0; allreduce; t1`` iterations, then
the per-rank times are gathered and the size's time is the median over
iterations of the slowest rank (:func:`ringcore.bench.report.median_of_max`);
last one untimed allreduce on the check pattern counts wrong elements. Rank 0
prints one JSON line per size::

    {"engine": "gloo", "n": 4, "bytes": 4096, "count": 1024, "time_us": ..., "busbw": ..., "wrong": 0, ...}
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Protocol, TextIO

import numpy as np

from ringcore.bench import data, report

DTYPE = np.dtype(np.float32)


class Peer(Protocol):
    """What the loop needs from a library: in-place float32 sum allreduce and friends."""

    rank: int
    size: int

    def allreduce(self, buf: np.ndarray) -> None:
        """Sum ``buf`` over all ranks, in place."""

    def barrier(self) -> None:
        """Wait for every rank."""

    def allgather(self, values: np.ndarray) -> np.ndarray:
        """Every rank's ``values`` (same length and dtype everywhere) stacked as ``(size, len)``."""


def add_args(parser: argparse.ArgumentParser) -> None:
    """The options every worker accepts (``compare.py`` passes them)."""
    parser.add_argument("--sizes", required=True, help="comma list of sizes, K/M/G suffixes allowed")
    parser.add_argument("--iters", type=int, default=20, help="timed iterations per size")
    parser.add_argument("--warmup", type=int, default=5, help="warmup iterations per size")
    parser.add_argument("--budget", default="0", help="cap iterations at budget/size (see ringcore-bench)")
    parser.add_argument("--engine", default="peer", help="label of the JSON lines")


def run(peer: Peer, args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """Measure every size of ``args.sizes``, then close ``peer`` (if it has ``close``); 1 when any result was wrong."""
    try:
        return _measure(peer, args, out)
    finally:
        close = getattr(peer, "close", None)
        if close is not None:
            close()


def _measure(peer: Peer, args: argparse.Namespace, out: TextIO) -> int:
    budget = report.parse_size(args.budget)
    bad = 0
    for nbytes in report.parse_size_list(args.sizes):
        shape = report.shape("allreduce", nbytes, DTYPE.itemsize, peer.size)
        iters, warmup = report.iteration_plan(shape.nbytes, args.iters, args.warmup, budget)
        buf = np.zeros(shape.count, dtype=DTYPE)  # zeros: in-place sums stay 0
        for _ in range(warmup):
            peer.barrier()
            peer.allreduce(buf)
        times = np.empty(iters, dtype=np.float64)
        for i in range(iters):
            peer.barrier()
            t0 = time.perf_counter_ns()
            peer.allreduce(buf)
            times[i] = (time.perf_counter_ns() - t0) / 1e3
        grid = peer.allgather(times)
        wrong = _check(peer, buf) if getattr(peer, "checked", True) else None  # None: not an allreduce
        bad += wrong or 0
        if peer.rank == 0:
            time_us = report.median_of_max(grid)
            row = report.make_row("allreduce", shape, "float", "sum", -1, time_us, peer.size, wrong)
            line = {"engine": args.engine, "n": peer.size, **report.row_dict(row)}
            out.write(json.dumps({**line, "iters": iters, "warmup": warmup}) + "\n")
            out.flush()
    return 1 if bad else 0


def _check(peer: Peer, buf: np.ndarray) -> int:
    buf[:] = data.pattern(peer.rank, buf.size, "sum", DTYPE)
    peer.barrier()
    peer.allreduce(buf)
    want = data.expected("allreduce", peer.rank, peer.size, buf.size, "sum", DTYPE, 0)
    mine = data.count_wrong(buf, want, "sum")
    return int(peer.allgather(np.array([mine], dtype=np.float64)).sum())
