"""ringcore next to Gloo and OpenMPI: allreduce(sum, float32) busbw on this machine, in one run.

    python bench/compare.py                                  # N=2,4; 4K..256M; 3 repeats
    python bench/compare.py --np 2,4 --repeat 1
    python bench/compare.py --engines ringcore,gloo --sizes 1M,16M --np 2
    python bench/compare.py --show bench/out/compare-XXXX.json   # re-print tables
    python bench/compare.py --engines ringcore,ringcore:SHM_SINGLE_COPY_BYTES=0,mpi-shm   # a setting beside peers
    python bench/compare.py --engines ringcore-symmetric,ringcore,mpi-shm   # buffers from ringcore.empty

The runs are interleaved (for each repeat, for each N, for each engine: the
whole size sweep) so that the machine's noise hits every engine alike; the
table shows the median busbw over repeats. Every engine measures the same
way as ``ringcore-bench`` (median over iterations of the slowest rank, same
iteration plan). Engines and how they are started: :mod:`ringcore.bench.engines`.
An engine that fails or times out is reported and the run goes on.

Writes ``compare-<time>.json`` (rewritten after every run, so partial results
survive), ``compare-<time>.png`` and one log per run under ``--out``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ringcore.bench import engines, plot, report, summary

DEFAULT_SIZES = "4K,1M,4M,16M,64M,256M"
DEFAULT_OUT = Path(__file__).resolve().parent / "out"


def build_parser() -> argparse.ArgumentParser:
    """The command line of compare.py."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--np", default="2,4", help="comma list of rank counts (default 2,4)")
    add("--sizes", default=DEFAULT_SIZES, help=f"comma list of sizes (default {DEFAULT_SIZES})")
    add("--repeat", type=int, default=3, help="interleaved repeats; the table shows medians (default 3)")
    add(
        "--engines",
        default=",".join(engines.ENGINES),
        help=(
            f"comma list (default: all engines; only when named: {','.join(engines.NAMED + engines.FLOORS)}; "
            "ringcore:NAME=VALUE+... runs ringcore with RINGCORE_NAME=VALUE)"
        ),
    )
    add("--out", type=Path, default=DEFAULT_OUT, help="output folder (default bench/out/)")
    add("--iters", type=int, default=20, help="timed iterations per size (default 20)")
    add("--warmup", type=int, default=5, help="warmup iterations per size (default 5)")
    add("--budget", default="1G", help="cap iterations at budget/size, at least 5 (default 1G; 0: no cap)")
    add("--timeout", type=float, default=300.0, help="seconds per engine run (default 300)")
    add("--label", default="", help="free text stored in the JSON")
    add("--show", type=Path, default=None, metavar="JSON", help="only print the tables of an earlier run")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the comparison (or ``--show`` an old one); exit 1 when any engine run failed."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.show:
        doc = json.loads(args.show.read_text())
        print_tables(doc["results"], doc["meta"]["engines"], doc["meta"]["np"])
        return 0
    names = [e for e in args.engines.split(",") if e]
    known = engines.ENGINES + engines.NAMED + engines.FLOORS
    unknown = sorted(set(names) - set(known) - {n for n in names if ":" in n})
    if unknown:
        parser.error(f"unknown engine(s) {', '.join(unknown)}; use {', '.join(known)} or ringcore:NAME=VALUE")
    try:
        for name in names:
            if ":" in name and not engines.variant_env(name):
                raise ValueError(f"engine {name!r}: only ringcore takes settings (ringcore:NAME=VALUE)")
        ns = [int(x) for x in args.np.split(",") if x]
        plan = engines.Plan(
            tuple(report.parse_size_list(args.sizes)),
            args.iters,
            args.warmup,
            report.parse_size(args.budget),
            args.timeout,
        )
    except ValueError as exc:
        parser.error(str(exc))
    return compare(args, names, ns, plan)


def compare(args: argparse.Namespace, names: list[str], ns: list[int], plan: engines.Plan) -> int:
    """The interleaved loop; prints progress, then the tables; writes JSON and PNG."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    workdir = args.out / f"compare-{stamp}"
    workdir.mkdir(parents=True, exist_ok=True)
    out_json = args.out / f"compare-{stamp}.json"
    meta = machine_meta() | {
        "argv": sys.argv,
        "label": args.label,
        "time": stamp,
        "engines": names,
        "np": ns,
        "plan": {"sizes": plan.sizes, "iters": plan.iters, "warmup": plan.warmup, "budget": plan.budget},
    }
    print(f"# compare: engines {','.join(names)}; N {ns}; sizes {args.sizes}; repeats {args.repeat}")
    results: list[dict[str, Any]] = []
    t_all = time.monotonic()
    for rep in range(args.repeat):
        for n in ns:
            for name in names:
                load = os.getloadavg()[0]
                tag = re.sub(r"[^\w.=+-]", "_", name)
                done = engines.run(name, n, plan, workdir, f"{tag}-n{n}-r{rep}")
                results.append({**vars(done), "rep": rep, "loadavg_before": round(load, 2)})
                print(progress_line(rep, args.repeat, done), flush=True)
                if done.error:
                    print("# " + done.error.replace("\n", "\n#   "), flush=True)
                _dump(out_json, meta, results)
    print_tables(results, names, ns)
    png = plot.busbw_plot(summary.summarize(results), names, args.out / f"compare-{stamp}.png", _title(meta))
    _dump(out_json, meta | {"wall_s": round(time.monotonic() - t_all, 1)}, results)
    print(f"# total wall {time.monotonic() - t_all:.0f} s; results {out_json}; plot {png}; logs {workdir}")
    return 0 if all(r["rc"] == 0 for r in results) else 1


def progress_line(rep: int, repeats: int, done: engines.Run) -> str:
    """``# [1/3] gloo N=2 rc 0 12.3 s | 4K 0.007 | 1M 0.42 | ...``"""
    cells = " | ".join(f"{summary.human_size(r['bytes'])} {r['busbw']:.3g}" for r in done.rows)
    return f"# [{rep + 1}/{repeats}] {done.engine} N={done.n} rc {done.rc} {done.wall_s:.1f} s | {cells}"


def print_tables(results: list[dict[str, Any]], names: list[str], ns: list[int]) -> None:
    """The busbw tables (one per N) and the list of failed runs."""
    summ = summary.summarize(results)
    for n in ns:
        print("#")
        print("\n".join(summary.table(summ, n, names)))
    failed = [r for r in results if r["rc"] != 0]
    for r in failed:
        print(f"# FAILED: {r['engine']} N={r['n']} repeat {r['rep'] + 1}: rc {r['rc']} (log {r['log']})")


def machine_meta() -> dict[str, Any]:
    """Where and with what the numbers were taken."""
    meta: dict[str, Any] = {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
    }
    for dist in ("numpy", "torch", "mpi4py"):
        try:
            meta[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            meta[dist] = None
    meta["mpirun"] = _first_line(["mpirun", "--version"])
    meta["git"] = _first_line(
        ["git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "--short", "HEAD"]
    )
    return meta


def _first_line(argv: list[str]) -> str | None:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=20, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.splitlines()[0] if out else None


def _title(meta: dict[str, Any]) -> str:
    return f"allreduce float32 sum, {meta['cpus']} CPUs, loopback; {meta['time']}"


def _dump(path: Path, meta: dict[str, Any], results: list[dict[str, Any]]) -> None:
    path.write_text(json.dumps({"meta": meta, "results": results}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
