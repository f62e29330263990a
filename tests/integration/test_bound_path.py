"""The in-place form of kept allreduce plans (``ringcore.plans.allreduce``): results, agreement, failures.

A numpy allreduce above ``RINGCORE_SMALL_BYTES`` keeps its plan per layout,
whose first turn compiles each slice's schedule once; calls then run it in
place. These
tests run it over real processes and sockets: mixed with ranks on the
general plan in the same collective, against numpy for several dtypes and
ops, with layouts that must keep the general plan (fp16, atomic), with a
peer that died (every survivor names it, and the note says which elements
may hold partial sums) and with the scratch pools growing under it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import ringcore
from tests import tasks
from tests.cluster import Cluster, qualified

pytestmark = pytest.mark.usefixtures("ring_only")  # the ring's forms and frames, not the direct route

COUNT = 100_003  # 400 KB of float32, above the 64 KiB small limit; odd, so chunks differ in length
CASES = [  # (dtype, op, compression, runs planned once)
    ("float32", "sum", None, True),
    ("float64", "avg", None, True),
    ("int32", "max", None, True),
    ("float32", "sum", "fp16", False),  # the wire dtype differs: not in place
]
ROUNDS = 5


def _value(rank: int, round_: int, count: int, dtype: str) -> np.ndarray:
    return ((np.arange(count) % 7) + rank + round_).astype(dtype)


def _planned(comm: Any) -> int:
    """How many of ``comm``'s remembered layouts run planned once."""
    return tasks.kept_layouts(comm, "in_place")


def mixed_paths(comm: Any, count: int) -> dict[str, Any]:
    """Each case ROUNDS times, ranks switching between the planned and the general path."""
    cases = [(dtype, op, compression) for dtype, op, compression, _ in CASES]
    return tasks.allreduce_on_mixed_paths(comm, count, cases, ROUNDS, _value, _planned)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("size", [2, 3, 4])
def test_planned_and_general_paths_agree_and_match_numpy(size: int) -> None:
    with Cluster(size) as cluster:
        reports = cluster.results(mixed_paths, COUNT, timeout=120)
    for dtype, op, compression, _ in CASES:
        for round_ in range(ROUNDS):
            inputs = np.stack([_value(rank, round_, COUNT, dtype) for rank in range(size)])
            want = {"sum": inputs.sum(0), "avg": inputs.sum(0) / size, "max": inputs.max(0)}[op]
            want = want.astype(np.float16).astype(dtype) if compression else want.astype(dtype)
            for rank, report in enumerate(reports):
                got = report["results"][f"{dtype}-{op}-{compression}"][round_]
                if compression:  # fp16 on the wire rounds partial sums: each rank's as the others'
                    np.testing.assert_allclose(got, want, rtol=1e-2, err_msg=f"rank {rank}")
                    np.testing.assert_array_equal(
                        got, reports[0]["results"][f"{dtype}-{op}-{compression}"][round_]
                    )
                else:
                    np.testing.assert_array_equal(
                        got, want, err_msg=f"{dtype} {op} round {round_} rank {rank}"
                    )
    planned = sum(1 for *_, once in CASES if once)
    for rank, report in enumerate(reports):
        # Rounds after one where this rank kept its layouts ran planned once, fp16 never.
        assert max(report["kept"]) == planned, (rank, report["kept"])


@pytest.mark.timeout(150)
@pytest.mark.parametrize("size", [2, 4])
def test_sliced_layouts_run_planned_slice_by_slice(size: int) -> None:
    """128 KiB slices: 400 KB runs as 4 slices (3 equal ones and a shorter last), on both paths."""
    with Cluster(size, env={"RINGCORE_SLICE_BYTES": "128K"}) as cluster:
        reports = cluster.results(mixed_paths, COUNT, timeout=120)
    for dtype, op, compression, once in CASES:
        if not once:
            continue
        for round_ in range(ROUNDS):
            inputs = np.stack([_value(rank, round_, COUNT, dtype) for rank in range(size)])
            want = {"sum": inputs.sum(0), "avg": inputs.sum(0) / size, "max": inputs.max(0)}[op].astype(dtype)
            for rank, report in enumerate(reports):
                got = report["results"][f"{dtype}-{op}-{compression}"][round_]
                np.testing.assert_array_equal(got, want, err_msg=f"{dtype} {op} round {round_} rank {rank}")
    for rank, report in enumerate(reports):
        assert max(report["kept"]) == 3, (rank, report["kept"])


def warm_then_report(comm: Any, count: int) -> tuple[int, np.ndarray]:
    """Three allreduces of one layout (ones, so 2, 4 and 8 at N=2); the layouts planned and the result."""
    x = np.ones(count, np.float32)
    for _ in range(3):
        comm.allreduce(x)
    return _planned(comm), x


@pytest.mark.timeout(90)
def test_atomic_keeps_the_general_plan() -> None:
    """RINGCORE_ATOMIC=1 must restore the caller's buffer on failure, which only the Executor does."""
    with Cluster(2, env={"RINGCORE_ATOMIC": "1"}) as cluster:
        reports = cluster.results(warm_then_report, COUNT)
    assert [planned for planned, _ in reports] == [0, 0]
    for _, result in reports:
        np.testing.assert_array_equal(result, np.full(COUNT, 8, np.float32))  # 1 -> 2 -> 4 -> 8


@pytest.mark.timeout(90)
def test_peer_dead_before_a_planned_allreduce() -> None:
    """The layout is planned on every rank; rank 1 dies; the others fail naming it."""
    with Cluster(3, env={"RINGCORE_TIMEOUT": "20"}) as cluster:
        assert [planned for planned, _ in cluster.results(warm_then_report, COUNT)] == [1, 1, 1]
        cluster.kill(1)
        reports = cluster.run(tasks.allreduce_until_failure, COUNT, 3, ranks=[0, 2], timeout=60)
    for rank, report in zip([0, 2], reports, strict=True):
        assert report["error"] == qualified(ringcore.PeerFailure), (rank, report)
        assert report["peer"] == 1 and "rank 1" in report["message"], (rank, report)
        assert report["rounds"] == 0 and report["untouched"], (rank, report)
        # In place, as on the general plan: the note names the elements that may hold partial sums.
        assert tuple(report["exposed"]) == (0, COUNT), (rank, report)


def outgrown_pool(comm: Any) -> dict[str, Any]:
    """A planned layout must neither keep outgrown scratch alive nor use it after the pools grow."""
    import gc
    import weakref

    x = np.full(COUNT, comm.rank + 1, np.float32)
    for _ in range(3):
        comm.allreduce(x)  # planned now; its scratch is the communicator's
        x[:] = comm.rank + 1
    pools = [weakref.ref(pool) for pool in comm.ctx.scratch_pools()]
    comm.reduce_scatter(np.ones((comm.size, 1_000_000), np.float32))  # the pools grow
    gc.collect()
    comm.allreduce(x)
    return {
        "pools": len(pools),
        "alive": sum(ref() is not None for ref in pools),
        "planned": _planned(comm),
        "result": float(x[0]),
        "exact": bool((x == x[0]).all()),
    }


@pytest.mark.timeout(60)
def test_planned_layouts_follow_the_pools() -> None:
    with Cluster(2) as cluster:
        reports = cluster.results(outgrown_pool)
    for report in reports:
        assert report["pools"] > 0 and report["planned"] == 1, report
        assert report["alive"] == 0, report
        assert report["result"] == 3.0 and report["exact"], report


LAYOUTS = 300  # distinct shapes, as a model reduced tensor by tensor (Horovod-style) has
LAYOUT_COUNTS = [17 + 3 * i if i % 10 else 20_000 + i for i in range(LAYOUTS)]  # every 10th above 64 KiB


def many_layouts(comm: Any) -> dict[str, Any]:
    """Three passes over LAYOUT_COUNTS arrays, each checked against numpy; how many stay planned."""
    out: dict[str, Any] = {"wrong": [], "kept": []}
    for pass_ in range(3):
        wrong = []
        for i, count in enumerate(LAYOUT_COUNTS):
            buf = comm.allreduce(_value(comm.rank, pass_ + i, count, "float32"))
            want = sum(_value(rank, pass_ + i, count, "float32") for rank in range(comm.size))
            if not np.array_equal(buf, want):
                wrong.append(count)
        out["wrong"].append(wrong)
        out["kept"].append(tasks.kept_layouts(comm))
    return out


@pytest.mark.timeout(120)
def test_hundreds_of_layouts_stay_planned() -> None:
    """A model's worth of distinct layouts is remembered: the later passes plan nothing."""
    with Cluster(2) as cluster:
        reports = cluster.results(many_layouts, timeout=100)
    for rank, report in enumerate(reports):
        assert report["wrong"] == [[], [], []], (rank, report["wrong"])
        assert report["kept"][1:] == [LAYOUTS, LAYOUTS], (rank, report["kept"])
