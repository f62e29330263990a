"""``ringcore-bench``: nccl-tests' all_reduce_perf (and friends) for ringcore.

Run it under the launcher, or let it launch itself with ``--np``::

    ringcore-run -np 4 ringcore-bench -b 8M -e 256M -f 2
    ringcore-bench --np 4 -b 4K -e 64M -f 4 -c 1 --json out.json
    ringcore-bench --np 2 -t allgather -d half -b 1M -e 16M

Rank 0 prints nccl-tests' columns (``size count type redop root  time algbw
busbw #wrong``); the arithmetic lives in :mod:`ringcore.bench.report`, the
check data in :mod:`ringcore.bench.data`. Each timed iteration is ``barrier;
t0; op; t1``; at the end of a size the per-rank times are gathered with
``ringcore.allgather`` and the reported time is the median over iterations of
the slowest rank.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np

from ringcore.bench import data, report
from ringcore.kernels import casts

PROG = "ringcore-bench"
_NO_REDOP = ("broadcast", "allgather")


def build_parser() -> argparse.ArgumentParser:
    """The command line, with nccl-tests' short flags."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="nccl-tests' all_reduce_perf (and friends) for ringcore. Give --np N to launch N "
        "ranks, or run it under a launcher (ringcore-run -np N ringcore-bench ...); alone it is a "
        "world of one rank, whose collectives move nothing (busbw 0).",
        epilog="e.g. ringcore-bench --np 4 -b 4K -e 64M -f 4",
    )
    add = parser.add_argument
    add("-b", "--minbytes", default="32M", help="smallest size, K/M/G suffixes (default 32M)")
    add("-e", "--maxbytes", default="32M", help="largest size (default 32M)")
    add("-f", "--stepfactor", type=float, default=2.0, help="multiply the size by this (default 2)")
    add("--sizes", default=None, help="explicit comma list of sizes, e.g. 4K,1M,64M (overrides -b/-e/-f)")
    add("-n", "--iters", type=int, default=20, help="timed iterations per size (default 20)")
    add("-w", "--warmup_iters", type=int, default=5, help="untimed iterations first (default 5)")
    add("--budget", default="0", help="cap iterations at budget/size, at least 5 (default 0: no cap)")
    add("-c", "--check", type=int, choices=(0, 1), default=1, help="count wrong elements (default 1)")
    add("-o", "--op", choices=report.OPS, default="sum", help="reduction (default sum)")
    add(
        "-d",
        "--datatype",
        choices=list(report.DTYPE_ALIASES),
        default="float",
        help="element type (default float)",
    )
    add("-r", "--root", type=int, default=0, help="broadcast root (default 0)")
    add("-t", "--test", choices=report.TESTS, default="allreduce", help="collective (default allreduce)")
    add("--compression", choices=("none", "fp16"), default="none", help="allreduce wire format")
    add(
        "-R",
        "--symmetric",
        action="store_true",
        help="allocate the buffers with ringcore.empty (symmetric memory: on one host, the direct "
        "allreduce that reads the peers' arrays; nccl-tests' -R registers buffers likewise)",
    )
    add(
        "--with-torch",
        action="store_true",
        help="import torch first, as a PyTorch job has it: fp16 compression then borrows its "
        "vectorised casts (ringcore.kernels.casts)",
    )
    add("--json", default=None, metavar="FILE", help="rank 0 writes the results here")
    add("--np", type=int, default=None, metavar="N", help="launch N ranks with ringcore-run first")
    return parser


def strip_np(argv: Sequence[str]) -> list[str]:
    """``argv`` without ``--np N`` / ``--np=N``, for the ranks of a self-launch."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--np":
            skip = True
        elif not arg.startswith("--np="):
            out.append(arg)
    return out


def relaunch(nranks: int, argv: Sequence[str]) -> int:
    """Run this program as ``nranks`` ranks under ``ringcore.run``; return its exit code."""
    cmd = [sys.executable, "-m", "ringcore.run", "-np", str(nranks), "--no-prefix", "--"]
    cmd += [sys.executable, "-m", "ringcore.bench.cli", *strip_np(argv)]
    return subprocess.call(cmd)


def _under_launcher() -> bool:
    from ringcore.config import Settings

    return Settings.from_env().rank is not None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``ringcore-bench``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        sizes = _sizes(args)
    except ValueError as exc:
        parser.error(f"{'--sizes' if args.sizes else '-b/--minbytes or -e/--maxbytes'}: {exc}")
    try:
        dtype = report.numpy_dtype(args.datatype)
        budget = report.parse_size(args.budget)
    except ValueError as exc:
        parser.error(str(exc))
    if args.compression != "none" and args.test != "allreduce":
        parser.error(f"--compression {args.compression} applies to allreduce only, not {args.test}")
    if args.iters < 1 or args.warmup_iters < 0:
        parser.error("need -n >= 1 and -w >= 0")
    if args.np is not None and not _under_launcher():
        return relaunch(args.np, argv)
    if args.with_torch:
        try:
            import torch  # noqa: F401
        except ImportError:
            parser.error("--with-torch needs torch (pip install torch==2.13.0)")
    return Bench(args, sizes, dtype, budget).run()


def _sizes(args: argparse.Namespace) -> list[int]:
    if args.sizes:
        return report.parse_size_list(args.sizes)
    lo, hi = report.parse_size(args.minbytes), report.parse_size(args.maxbytes)
    return report.size_sweep(lo, hi, args.stepfactor)


class Bench:
    """One benchmark run inside a ringcore job: every size of the sweep, in order."""

    def __init__(self, args: argparse.Namespace, sizes: list[int], dtype: np.dtype, budget: int) -> None:
        self.args = args
        self.sizes = sizes
        self.dtype = dtype
        self.budget = budget
        self.redop = "none" if args.test in _NO_REDOP else args.op
        self.root = args.root if args.test == "broadcast" else -1
        self.plans: list[tuple[int, int]] = []  # (timed, warmup) iterations of each row

    def run(self) -> int:
        """Initialise ringcore, measure every size, print and save; return the exit code."""
        import ringcore

        ringcore.init()
        try:
            self.rank, self.nranks = ringcore.rank(), ringcore.size()
            if self.args.np is not None and self.args.np != self.nranks:
                raise SystemExit(f"{PROG}: --np {self.args.np} but the job has {self.nranks} ranks")
            if self.args.test == "broadcast" and not 0 <= self.args.root < self.nranks:
                raise SystemExit(f"{PROG}: root {self.args.root} is not a rank of 0..{self.nranks - 1}")
            rows = self._sweep()
        finally:
            ringcore.shutdown()
        if self.rank == 0 and self.args.json:
            self._write_json(rows)
        return 1 if any(row.wrong for row in rows) else 0

    def _sweep(self) -> list[report.Row]:
        import ringcore

        pids = ringcore.allgather(np.array([os.getpid()], dtype=np.int64))
        self._print(self._header(pids))
        rows: list[report.Row] = []
        for nbytes in self.sizes:
            shape = report.shape(self.args.test, nbytes, self.dtype.itemsize, self.nranks)
            if shape.count == 0:
                self._print([f"# {nbytes} B holds no element per rank: skipped"])
                continue
            rows.append(self._one_size(shape))
            self._print([report.format_row(rows[-1])])
        self._print([*report.footer(rows), "#"])
        return rows

    def _one_size(self, shape: report.Shape) -> report.Row:
        import ringcore

        a = self.args
        iters, warmup = report.iteration_plan(shape.nbytes, a.iters, a.warmup_iters, self.budget)
        if a.symmetric:
            buf = ringcore.empty(shape.in_count, self.dtype)
            buf[...] = data.steady_value(self.args.op)
        else:
            buf = np.full(shape.in_count, data.steady_value(self.args.op), dtype=self.dtype)
        call = self._operation(buf)
        for _ in range(warmup):
            ringcore.barrier()
            call()
        times = np.empty(iters, dtype=np.float64)
        for i in range(iters):
            ringcore.barrier()
            t0 = time.perf_counter_ns()
            call()
            times[i] = (time.perf_counter_ns() - t0) / 1e3
        grid = ringcore.allgather(times).reshape(self.nranks, iters)
        wrong = self._check(buf, call, shape) if self.args.check else None
        self.plans.append((iters, warmup))
        return report.make_row(
            self.args.test,
            shape,
            report.type_label(self.args.datatype),
            self.redop,
            self.root,
            report.median_of_max(grid),
            self.nranks,
            wrong,
        )

    def _operation(self, buf: np.ndarray) -> Callable[[], np.ndarray]:
        """The collective on ``buf`` as a no-argument call returning the result array."""
        import ringcore

        a = self.args
        if a.test == "allreduce":
            compression = None if a.compression == "none" else a.compression

            def allreduce() -> np.ndarray:
                ringcore.allreduce(buf, op=a.op, compression=compression)
                return buf

            return allreduce
        if a.test == "broadcast":

            def broadcast() -> np.ndarray:
                ringcore.broadcast(buf, root=a.root)
                return buf

            return broadcast
        if a.test == "allgather":
            return lambda: ringcore.allgather(buf)
        return lambda: ringcore.reduce_scatter(buf, op=a.op)

    def _check(self, buf: np.ndarray, call: Callable[[], np.ndarray], shape: report.Shape) -> int:
        """Run once on the check pattern; return wrong elements summed over ranks."""
        import ringcore

        a = self.args
        if a.test == "broadcast" and self.rank != a.root:
            buf[:] = 0  # the pattern never contains 0: stale data shows up as wrong
        else:
            buf[:] = data.pattern(self.rank, shape.in_count, a.op, self.dtype)
        ringcore.barrier()
        got = call()
        want = data.expected(a.test, self.rank, self.nranks, shape.in_count, a.op, self.dtype, a.root)
        mine = data.count_wrong(np.asarray(got), want, a.op)
        return int(ringcore.allgather(np.array([mine], dtype=np.int64)).sum())

    def _header(self, pids: np.ndarray) -> list[str]:
        a = self.args
        lines = [
            f"# {PROG} {a.test}: nranks {self.nranks} minBytes {min(self.sizes)} maxBytes {max(self.sizes)}"
            f" step: {a.stepfactor:g}(factor) warmup iters: {a.warmup_iters} iters: {a.iters}"
            f" budget: {self.budget} validation: {a.check} compression: {a.compression}"
            f" casts: {'torch' if casts.borrows_torch() else 'numpy'}",
            "#",
            "# Using ranks",
        ]
        lines += [f"#  Rank {r:2d} Pid {int(pid):7d}" for r, pid in enumerate(pids)]
        return [*lines, "#", *report.HEADER]

    def _print(self, lines: list[str]) -> None:
        if self.rank == 0:
            print("\n".join(lines), flush=True)

    def _write_json(self, rows: list[report.Row]) -> None:
        a = self.args
        doc = {
            "tool": PROG,
            "test": a.test,
            "nranks": self.nranks,
            "datatype": a.datatype,
            "op": self.redop,
            "root": self.root,
            "compression": a.compression,
            "casts": "torch" if casts.borrows_torch() else "numpy",
            "iters": a.iters,
            "warmup": a.warmup_iters,
            "budget": self.budget,
            "rows": [
                {**report.row_dict(row), "iters": it, "warmup": wu}
                for row, (it, wu) in zip(rows, self.plans, strict=True)
            ],
            "avg_busbw": report.avg_busbw(rows),
        }
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
