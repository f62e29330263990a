"""Wall time and every rank's user and system CPU per allreduce, for ringcore or Open MPI.

    ringcore-run -np 4 python bench/cpu_per_op.py 1M
    mpirun --allow-run-as-root --oversubscribe -np 4 --mca btl tcp,self \\
        python bench/cpu_per_op.py 1M --engine mpi

With more ranks than cores, the wall time of back-to-back allreduces is about
the ranks' CPU summed over the cores, so the engine that burns less CPU per op
wins; this shows where. Float32 sum in place (Open MPI with ``MPI_IN_PLACE``, as
``bench/compare.py``'s peer: out of place it copies the input first), back to
back after a warm-up, or ``barrier; op`` with ``--barrier`` (the benchmarks'
loop, the barrier's CPU included); rank 0 prints the wall time per op and each
rank's ``os.times`` user and system time per op; every rank then checks one allreduce
against the exact sum (exit status 1 when any element is wrong).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import numpy as np

from ringcore.bench.report import parse_size


def measure(
    allreduce: Callable[[], None], barrier: Callable[[], None], iters: int, with_barrier: bool = False
) -> tuple[float, float, float]:
    """Seconds of wall, user and system time per call (``barrier; call`` with ``with_barrier``)."""

    def one() -> None:
        if with_barrier:
            barrier()
        allreduce()

    for _ in range(max(5, iters // 4)):
        one()
    barrier()
    start, cpu = time.perf_counter(), os.times()
    for _ in range(iters):
        one()
    wall, after = time.perf_counter() - start, os.times()
    return wall / iters, (after.user - cpu.user) / iters, (after.system - cpu.system) / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("size", help="buffer size, e.g. 1M (float32)")
    parser.add_argument("--engine", choices=("ringcore", "mpi"), default="ringcore")
    parser.add_argument("--iters", type=int, default=200, help="allreduces measured (default: 200)")
    parser.add_argument(
        "--barrier", action="store_true", help="time barrier; allreduce, as the benchmarks do"
    )
    args = parser.parse_args()
    x = np.zeros(parse_size(args.size) // 4, np.float32)  # zeros: in-place sums stay 0
    if args.engine == "mpi":
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        op = [x, MPI.FLOAT]

        def allreduce() -> None:
            world.Allreduce(MPI.IN_PLACE, op, op=MPI.SUM)

        rank, size = world.rank, world.size
        wall, user, system = measure(allreduce, world.Barrier, args.iters, args.barrier)
        wrong = check(x, rank, size, allreduce)
        cpu, wrong = world.gather((user, system)), world.allreduce(wrong)
    else:
        import ringcore

        comm = ringcore.init()
        rank, size = comm.rank, comm.size
        wall, user, system = measure(lambda: comm.allreduce(x), comm.barrier, args.iters, args.barrier)
        wrong = check(x, rank, size, lambda: comm.allreduce(x))
        cpu = comm.allgather(np.array([user, system])).reshape(-1, 2)
        wrong = int(comm.allreduce(np.array([wrong]))[0])
        ringcore.shutdown()
    if rank == 0:
        per_rank = ", ".join(f"{u * 1e3:.2f}+{s * 1e3:.2f}" for u, s in cpu)
        print(
            f"{args.engine} N={size} {args.size}{' barrier;op' if args.barrier else ''}: {wall * 1e3:.2f} ms"
            f" per op; user+sys ms per rank: {per_rank}; wrong elements: {wrong}"
        )
    raise SystemExit(1 if wrong else 0)


def check(x: np.ndarray, rank: int, size: int, allreduce: Callable[[], None]) -> int:
    """Elements of one more allreduce, of ``rank + 1`` on every rank, that differ from the sum."""
    x[:] = rank + 1
    allreduce()
    return int(np.count_nonzero(x != size * (size + 1) / 2))


if __name__ == "__main__":
    main()
