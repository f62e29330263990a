"""Two or more settings side by side in one job: wall, user and system time per allreduce.

    ringcore-run -np 2 python bench/ab_settings.py 64M ATOMIC=1 ATOMIC=0
    ringcore-run -np 4 python bench/ab_settings.py 64M SEGMENT_BYTES=512K SEGMENT_BYTES=2M

Each variant names ``RINGCORE_*`` variables (without the prefix; several joined
by ``+``). The job alternates blocks of every variant (so the machine's noise
hits them alike) and rank 0 prints, per variant, the median over blocks of the
time per allreduce and of this rank's user and system CPU (``os.times``), and
the form its plan took (``ringcore.plans.allreduce``). Every variant's result
is checked against numpy first.

A variant replaces the settings the plans read (the communicator's context's)
and forgets the kept plans, so its first allreduce plans again under it. Only
settings read per collective can vary within a job (:data:`PER_COLLECTIVE`);
those the transport took at ``init`` (``SHM_BYTES``, ``SPIN_US``...) are
refused: compare them in separate jobs.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import numpy as np

import ringcore
from ringcore.bench.report import parse_size
from ringcore.config import Settings, assignments
from ringcore.errors import ConfigError

# The settings plans and executors read at every collective; the rest are taken at init.
PER_COLLECTIVE = frozenset(
    {"timeout", "segment_bytes", "small_bytes", "halving_bytes", "slice_bytes", "hierarchical", "atomic"}
)


def variant_settings(base: Settings, text: str) -> Settings:
    """``base`` with the ``RINGCORE_*`` variables of ``text`` (``NAME=VALUE+NAME=VALUE``) applied.

    Raises:
        ConfigError: ``text`` is not ``NAME=VALUE+...`` of known settings (:func:`assignments`).
        SystemExit: a variable names a setting taken at init, which a running job cannot change.
    """
    parsed = Settings.from_env(assignments(text))
    defaults = Settings.from_env({})
    changed = {
        f.name: getattr(parsed, f.name)
        for f in dataclasses.fields(Settings)
        if getattr(parsed, f.name) != getattr(defaults, f.name)
    }
    fixed = sorted(set(changed) - PER_COLLECTIVE)
    if fixed:
        raise SystemExit(
            f"ab_settings: {', '.join(fixed)} in {text!r} is taken at init; "
            "compare it in separate jobs (RINGCORE_... ringcore-run ...)"
        )
    return dataclasses.replace(base, **changed)


def use(comm: ringcore.Communicator, settings: Settings) -> None:
    """Run the next collectives under ``settings``: the context's copy, and no plan kept from before."""
    comm.settings = comm.ctx.settings = settings
    comm.clear_plan_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("size", help="buffer size, e.g. 64M (float32)")
    parser.add_argument("variants", nargs="+", help="e.g. ATOMIC=1 or SEGMENT_BYTES=2M+ATOMIC=0")
    parser.add_argument("--iters", type=int, default=0, help="allreduces per block (default: ~1 GiB)")
    parser.add_argument("--blocks", type=int, default=5)
    args = parser.parse_args()
    for text in args.variants:
        try:
            assignments(text)
        except ConfigError as err:
            parser.error(f"variant {err} (one size per job: run it again for another)")
    comm = ringcore.init()
    count = parse_size(args.size) // 4
    iters = args.iters or max(3, (1 << 30) // max(1, count * 4))
    base = comm.settings
    variants = {text: variant_settings(base, text) for text in args.variants}
    check = np.arange(count, dtype=np.float32) % 7
    x = np.zeros(count, np.float32)
    forms = {}
    for text, settings in variants.items():
        use(comm, settings)
        got = ringcore.allreduce(check + comm.rank)
        want = check * comm.size + comm.size * (comm.size - 1) / 2
        if not np.array_equal(got, want):
            raise SystemExit(f"rank {comm.rank}: wrong result with {settings}")
        ringcore.allreduce(x)
        stats = comm.plan_cache()  # a route chosen per call (one-shot, direct) names itself
        forms[text] = "+".join(sorted(stats["routed"] or stats["forms"]))
    results: dict[str, list[tuple[float, float, float]]] = {text: [] for text in variants}
    for _ in range(args.blocks):
        for text, settings in variants.items():
            use(comm, settings)
            ringcore.allreduce(x)
            ringcore.barrier()
            before, start = os.times(), time.perf_counter()
            for _ in range(iters):
                ringcore.allreduce(x)
            wall, after = (time.perf_counter() - start) / iters, os.times()
            user, system = (after.user - before.user) / iters, (after.system - before.system) / iters
            results[text].append((wall * 1e3, user * 1e3, system * 1e3))
    use(comm, base)
    if comm.rank == 0:
        factor = 2 * (comm.size - 1) / comm.size
        for text, rows in results.items():
            wall, user, system = np.median(np.array(rows), axis=0)
            print(
                f"N={comm.size} {args.size} {text:32s} {wall:8.3f} ms  busbw "
                f"{count * 4 * factor / wall / 1e6:6.3f} GB/s  user {user:6.3f} ms  sys {system:6.3f} ms"
                f"  form {forms[text]}"
            )
    ringcore.shutdown()


if __name__ == "__main__":
    main()
