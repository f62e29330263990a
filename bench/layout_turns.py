"""Two Python processes taking turns on one CPU, in one address layout and in random ones.

    python bench/layout_turns.py            # 4 launches of each, alternated
    python bench/layout_turns.py 8 --cpu 1

Each process does about 2 us of interpreter work, then ``sched_yield``, 20000 times; two run
at once pinned to one CPU, so the core switches between them every round, as between ringcore's
crowded ranks waiting on each other. Printed: microseconds per round of each process, for a pair
started with address-space randomization (each process at its own random addresses) and for a
pair started without it (``personality(ADDR_NO_RANDOMIZE)``, what ``ringcore-run --aslr off``
and ``setarch -R`` set: one layout), and one process alone. No ringcore code runs in the
children: this shows what ``ringcore-run``'s one layout for crowded ranks rests on
(``bench/HISTORY.md``, "One address layout for crowded ranks").
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from ringcore.rank_agent import personality, set_layout

ROUNDS, WORK = 20000, 20


def child(cpu: int) -> None:
    """Take ROUNDS turns on ``cpu``; print microseconds per round."""
    os.sched_setaffinity(0, {cpu})
    table = {i: i for i in range(8)}

    def work() -> int:
        total = 0
        for i in range(WORK):
            total += table.get(i & 7, 0) + len(str(i))
        return total

    work()
    print("ready", flush=True)
    sys.stdin.readline()  # the parent's go, once every copy is ready
    start = time.perf_counter()
    for _ in range(ROUNDS):
        work()
        os.sched_yield()
    print(f"{(time.perf_counter() - start) / ROUNDS * 1e6:.2f}")


def launch(copies: int, cpu: int, one_layout: bool) -> list[str]:
    """Start ``copies`` children at once; their microseconds per round."""
    argv = [sys.executable, __file__, "--child", "--cpu", str(cpu)]
    before = set_layout(one_layout)  # without randomization, or with it even under setarch -R
    try:
        procs = [
            subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            for _ in range(copies)
        ]
    finally:
        if before is not None:
            personality(before)
    for proc in procs:  # every copy up and waiting
        assert proc.stdout is not None
        proc.stdout.readline()
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    return [proc.communicate(timeout=120)[0].strip() for proc in procs]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("launches", nargs="?", type=int, default=4, help="launches of each kind (default 4)")
    first = min(os.sched_getaffinity(0))
    parser.add_argument("--cpu", type=int, default=first, help=f"the CPU they share (default {first})")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.cpu)
        return
    print("us per round: random layouts | one layout | alone")
    for _ in range(args.launches):
        spread = launch(2, args.cpu, one_layout=False)
        same = launch(2, args.cpu, one_layout=True)
        alone = launch(1, args.cpu, one_layout=False)
        print(f"{' '.join(spread):>13} | {' '.join(same):>11} | {alone[0]}")


if __name__ == "__main__":
    main()
