"""Which plan a communicator runs: the allreduce algorithm by size, the forms of kept plans, the plan cache."""

from __future__ import annotations

from typing import Any

import numpy as np

from tests.tasks.collectives import allreduce


def allreduce_algorithm(comm: Any, count: int, itemsize: int, sliced: bool = False) -> str:
    """Which allreduce schedule this communicator picks for ``count`` elements of ``itemsize`` bytes."""
    from ringcore.slicing import allreduce_schedule

    return _algorithm(allreduce_schedule(comm.ctx, count, itemsize, in_place=True, sliced=sliced))


def _algorithm(schedule: Any) -> str:
    if schedule.prefill_work:
        return "recursive-doubling"
    if schedule.steps and all(step.whole for step in schedule.steps):
        return "halving-doubling"
    return "ring"


def allreduce_recording_algorithms(comm: Any, inputs: list[np.ndarray]) -> tuple[np.ndarray, list[str]]:
    """``allreduce`` (sum), and the algorithm of every schedule its plan picked (one per slice)."""
    from ringcore.plans import allreduce as plans

    picked: list[str] = []
    original = plans.allreduce_schedule

    def recording(comm_: Any, count: int, itemsize: int, in_place: bool, sliced: bool = False) -> Any:
        schedule = original(comm_, count, itemsize, in_place, sliced)
        picked.append(_algorithm(schedule))
        return schedule

    plans.allreduce_schedule = recording  # type: ignore[assignment]
    try:
        return allreduce(comm, inputs, "sum"), picked
    finally:
        plans.allreduce_schedule = original  # type: ignore[assignment]


def allreduce_on_mixed_paths(
    comm: Any, count: int, cases: list[tuple[str, str, str | None]], rounds: int, value: Any, kept: Any
) -> dict[str, Any]:
    """Reduce each ``(dtype, op, compression)`` case ``rounds`` times, on kept and general paths at once.

    Rank r forgets its remembered layouts on rounds where (round + r) % 3 == 0,
    so that round it plans in full while the others may run kept plans: the
    frames must agree. ``value(rank, round, count, dtype)`` makes the input;
    ``kept(comm)`` counts the layouts running kept plans after each round.
    """
    out: dict[str, Any] = {"results": {}, "kept": []}
    for round_ in range(rounds):
        if (round_ + comm.rank) % 3 == 0:
            comm.clear_plan_cache()
        for dtype, op, compression in cases:
            x = value(comm.rank, round_, count, dtype)
            assert comm.allreduce(x, op=op, compression=compression) is x
            out["results"].setdefault(f"{dtype}-{op}-{compression}", []).append(x.copy())
        out["kept"].append(kept(comm))
    return out


def kept_layouts(comm: Any, form: str | None = None) -> int:
    """How many of ``comm``'s kept plans run a prepared ``form`` ("small" or "in_place"; either when None)."""
    forms = comm.plan_cache()["forms"]
    return sum(forms.get(f, 0) for f in ((form,) if form else ("small", "in_place")))


def small_route(comm: Any) -> tuple[int, int]:
    """``(layouts, calls)`` of ``comm``'s kept plans on this job's small route: the one-shot route
    on one host (``ringcore.plans.oneshot``) unless ``RINGCORE_DIRECT_BYTES=0`` pins the rings,
    where the small form counts. A job that should go one-shot and did not counts nothing."""
    stats = comm.plan_cache()
    if comm.ctx.settings.direct_from(comm.size):
        return stats["routed"].get("oneshot", 0), stats["calls"].get("oneshot", 0)
    return kept_layouts(comm, "small"), stats["calls"].get("small", 0)


def many_layouts(comm: Any, counts: list[int], calls: int) -> tuple[list[bool], dict[str, int]]:
    """Allreduce (sum) float32 arrays of every length in ``counts``, ``calls`` times each; each result
    checked against the exact sum, and the plan cache's size afterwards."""
    ok = []
    for count in counts:
        for call in range(calls):
            x = np.full(count, comm.rank + call, np.float32)
            comm.allreduce(x)
            ok.append(bool(np.all(x == sum(r + call for r in range(comm.size)))))
    return ok, comm.plan_cache()
