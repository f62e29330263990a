"""The small route of kept allreduce plans: results, agreement, failures, each test both ways.

A small numpy allreduce keeps its plan per layout. On the rings
(``RINGCORE_DIRECT_BYTES=0``, or ranks on several hosts) its first turn binds
the recursive-doubling steps to scratch of its own (the small form,
``ringcore.plans.allreduce``); on one host every call takes the one-shot
route through the mailboxes (``ringcore.plans.oneshot``). The ``route``
fixture runs every test on each. Over real processes and sockets: mixed
with ranks on one-call plans in the same collective (the frames, or the
posts, must agree), against numpy for several dtypes, ops and fp16
compression (which keeps the rings), and with a peer that died or stopped,
where the caller's buffer must come back untouched and every survivor must
name the culprit.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ringcore
from tests import cluster, tasks
from tests.cluster import Cluster, RankError, qualified, run_with_stopped_rank
from tests.conftest import RING_ONLY

try:
    import ml_dtypes

    BFLOAT16: np.dtype | None = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # the bfloat16 layouts are then left out
    BFLOAT16 = None

CASES = [  # (dtype, op, compression)
    ("float32", "sum", None),
    ("float64", "avg", None),
    ("int32", "max", None),
    ("int64", "prod", None),
    ("float32", "sum", "fp16"),
]
ROUNDS = 5


def _value(rank: int, round_: int, count: int, dtype: str) -> np.ndarray:
    return ((np.arange(count) % 7) + rank + round_).astype(dtype)


@pytest.fixture(autouse=True, params=["ring", "oneshot", "one-reducer"])
def route(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every test three times: pinned to the rings, and on one host's default (the one-shot route)
    with every rank reducing and with one reducing for all (``RINGCORE_ONE_REDUCER``)."""
    with pytest.MonkeyPatch.context() as patch:
        if request.param == "ring":
            patch.setattr(cluster, "BASE_ENV", RING_ONLY)
        else:
            one = "1" if request.param == "one-reducer" else "0"
            patch.setattr(cluster, "BASE_ENV", {**cluster.BASE_ENV, "RINGCORE_ONE_REDUCER": one})
        yield request.param


def _bound(comm: Any) -> int:
    """How many of ``comm``'s kept plans run the job's small route (bound steps, or one-shot)."""
    return tasks.small_route(comm)[0]


def mixed_paths(comm: Any, count: int) -> dict[str, Any]:
    """Each case ROUNDS times, ranks switching between the bound and the general path."""
    return tasks.allreduce_on_mixed_paths(comm, count, CASES, ROUNDS, _value, _bound)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [2, 3, 4])
def test_bound_and_general_paths_agree_and_match_numpy(size: int, route: str) -> None:
    count = 999  # odd: recursive doubling's uneven halves
    with Cluster(size) as cluster:
        reports = cluster.results(mixed_paths, count, timeout=90)
    for dtype, op, compression in CASES:
        for round_ in range(ROUNDS):
            inputs = np.stack([_value(rank, round_, count, dtype) for rank in range(size)])
            want = {
                "sum": inputs.sum(0),
                "avg": inputs.sum(0) / size,
                "max": inputs.max(0),
                "prod": inputs.prod(0),
            }[op].astype(dtype)
            for rank, report in enumerate(reports):
                got = report["results"][f"{dtype}-{op}-{compression}"][round_]
                np.testing.assert_array_equal(
                    got, want, err_msg=f"{dtype} {op} {compression} round {round_} rank {rank}"
                )
    # Rounds after one where this rank kept its layouts ran on bound steps, or one-shot but for
    # fp16 compression, which keeps the rings.
    uncompressed = sum(compression is None for _, _, compression in CASES)
    for rank, report in enumerate(reports):
        assert max(report["kept"]) == (len(CASES) if route == "ring" else uncompressed), (rank, report)


def warm_then_report(comm: Any, count: int) -> int:
    x = np.ones(count, np.float32)
    for _ in range(3):
        comm.allreduce(x)
    return _bound(comm)


@pytest.mark.timeout(90)
def test_peer_dead_before_a_bound_allreduce() -> None:
    """The layout is bound on every rank; rank 1 dies; the others fail naming it, buffers untouched."""
    count = 1000  # tasks.allreduce_until_failure reduces float32 (count,): the warmed layout
    with Cluster(3, env={"RINGCORE_TIMEOUT": "20"}) as cluster:
        assert cluster.results(warm_then_report, count) == [1, 1, 1]
        cluster.kill(1)
        reports = cluster.run(tasks.allreduce_until_failure, count, 3, ranks=[0, 2], timeout=60)
    for rank, report in zip([0, 2], reports, strict=True):
        assert report["error"] == qualified(ringcore.PeerFailure), (rank, report)
        assert report["peer"] == 1 and "rank 1" in report["message"], (rank, report)
        assert report["rounds"] == 0 and report["untouched"], (rank, report)
        assert report["exposed"] is None, (rank, report)  # nothing of the caller's buffer was written


@pytest.mark.timeout(120)
def test_stopped_peer_times_out_a_bound_allreduce(tmp_path: Path) -> None:
    """Rank 1 stops itself (SIGSTOP) inside a bound allreduce: CollectiveTimeout, buffers untouched."""
    count, victim, survivors = 1000, 1, [0, 2]
    fault = (victim, "sigstop", str(tmp_path / "stopped_at"), 0.5)
    with Cluster(3, env={"RINGCORE_TIMEOUT": "3"}) as cluster:
        assert cluster.results(warm_then_report, count) == [1, 1, 1]
        reports, resumed = run_with_stopped_rank(
            cluster, tasks.allreduce_until_failure, count, 3, fault, victim=victim, survivors=survivors
        )
    for rank, report in zip(survivors, reports, strict=True):
        assert not isinstance(report, RankError), (rank, report)
        assert report["error"] == qualified(ringcore.CollectiveTimeout), (rank, report)
        assert report["rounds"] > 0 and report["untouched"], (rank, report)
        # Rank 0 waits on rank 1 itself. Rank 2 waits on rank 0: it names rank 1 when rank 0's
        # ABORT reaches it first, or rank 0 when its own timer fires first.
        assert "rank 1" in report["message"] or "from rank 0" in report["message"], (rank, report)
    assert not isinstance(resumed, RankError), resumed
    assert resumed["error"] in (qualified(ringcore.CollectiveTimeout), qualified(ringcore.PeerFailure))


@pytest.mark.timeout(90)
def test_mismatch_on_bound_layouts_names_the_rank() -> None:
    with Cluster(3, env={"RINGCORE_TIMEOUT": "10"}) as cluster:
        reports = cluster.results(tasks.other_op_on_rank_0, 100)
    for rank, report in enumerate(reports):
        assert report["error"] == "MismatchError", (rank, report)
        assert "rank 0 passed max" in report["message"] and "ranks 1-2 passed sum" in report["message"], (
            report
        )
        assert report["untouched"], (rank, report)


def async_then_small(comm: Any, big: int) -> dict[str, Any]:
    """A large allreduce_async in flight while bound small allreduces queue behind it, in order."""
    small = np.ones(64, np.float32)
    comm.allreduce(small)  # bind
    large = np.full(big, comm.rank + 1, np.float32)
    handle = comm.allreduce_async(large)
    results = []
    for step in range(5):
        small[:] = comm.rank + step
        comm.allreduce(small)
        results.append(small.copy())
    handle.wait(60)
    queued = [np.full(64, comm.rank + step, np.float32) for step in range(4)]  # bound layout, async
    handles = [comm.allreduce_async(x) for x in queued]
    for handle in handles:
        handle.wait(60)
    return {"large": float(large[0]), "small": results, "queued": queued, "bound": _bound(comm)}


@pytest.mark.timeout(90)
def test_bound_allreduce_waits_its_turn_behind_async_work() -> None:
    size = 3
    with Cluster(size) as cluster:
        reports = cluster.results(async_then_small, 2_000_000)
    for report in reports:
        assert report["large"] == sum(range(1, size + 1))
        for step, got in enumerate(report["small"]):
            np.testing.assert_array_equal(got, np.full(64, sum(range(size)) + size * step, np.float32))
        for step, got in enumerate(report["queued"]):
            np.testing.assert_array_equal(got, np.full(64, sum(range(size)) + size * step, np.float32))
        assert report["bound"] == 1


def barriers_then_a_mismatch(comm: Any, rounds: int) -> dict[str, Any]:
    """Barriers where a different rank enters last each round, then a barrier against an allreduce."""
    import time

    left = []
    before = comm.ctx.transport.mailbox.posts
    for round_ in range(rounds):
        comm.barrier()
        if comm.rank == round_ % comm.size:
            time.sleep(0.05)  # the last to enter: nobody may leave the next barrier before this rank
        entered = time.monotonic()
        comm.barrier()
        left.append((entered, time.monotonic()))
    posts = comm.ctx.transport.mailbox.posts - before  # one host: each barrier is a post in the mailboxes
    x = np.ones(10, np.float32)
    try:
        comm.barrier() if comm.rank == 1 else comm.allreduce(x)
    except ringcore.MismatchError as err:
        return {"left": left, "error": str(err), "posts": posts}
    return {"left": left, "error": None, "posts": posts}


def last_poster_looks_late(comm: Any) -> dict[str, Any]:
    """Rank 2 posts a barrier last and is slow to look at its TCP news; ranks 0 and 1 pass the barrier
    and fail the next collective (an allreduce against a barrier), so their ABORT is already there."""
    import time

    transport = comm.ctx.transport
    comm.barrier()
    if comm.rank == 2:
        time.sleep(0.2)  # the others wait in the barrier below
        look = transport._look_around

        def slow_look(now: float) -> None:
            time.sleep(0.5)  # long past the others' failure in the next collective
            look(now)

        transport._look_around = slow_look
        transport.next_liveness = 0.0  # the look is due at this rank's next post
    try:
        comm.barrier()
    except ringcore.MismatchError as err:
        return {"barrier": str(err)}
    try:
        comm.barrier() if comm.rank == 1 else comm.allreduce(np.ones(10, np.float32))
    except ringcore.MismatchError as err:
        return {"barrier": None, "next": str(err)}
    return {"barrier": None, "next": None}


@pytest.mark.timeout(90)
def test_a_barrier_every_rank_posted_is_not_failed_by_the_next_collectives_abort() -> None:
    """Every peer posted: the barrier holds, and the mismatch is every rank's error in the next collective."""
    with Cluster(3, env={"RINGCORE_TIMEOUT": "10"}) as cluster:
        reports = cluster.results(last_poster_looks_late)
    assert [report["barrier"] for report in reports] == [None] * 3, reports  # rank 2's held too
    for rank, report in enumerate(reports):  # and every rank was in the next collective
        assert report["next"] and "rank 1 passed barrier" in report["next"], (rank, report)


@pytest.mark.timeout(90)
def test_barriers_hold_and_a_mismatch_names_the_barrier() -> None:
    """Clocks are per process, but one host's monotonic clock is shared: compare them directly."""
    size, rounds = 3, 6
    with Cluster(size, env={"RINGCORE_TIMEOUT": "10"}) as cluster:
        reports = cluster.results(barriers_then_a_mismatch, rounds)
    for round_ in range(rounds):
        last_in = max(report["left"][round_][0] for report in reports)
        first_out = min(report["left"][round_][1] for report in reports)
        assert first_out >= last_in, f"round {round_}: a rank left the barrier before the last one entered"
    for report in reports:
        assert report["posts"] == 2 * rounds, report  # the barriers went through the mailboxes
        assert (
            report["error"]
            and "the collective" in report["error"]
            and "rank 1 passed barrier" in report["error"]
        )


def outgrown_pool(comm: Any) -> dict[str, Any]:
    """A bound layout must not keep the communicator's outgrown scratch pools alive."""
    import gc
    import weakref

    comm.reduce_scatter(np.ones((comm.size, 300_000), np.float32))  # past a mailbox's slot: pools of ~1.2 MB
    pools = [weakref.ref(pool) for pool in comm.ctx.scratch_pools()]
    x = np.ones(1000, np.float32)
    for _ in range(3):
        comm.allreduce(x)  # bound now
    comm.reduce_scatter(np.ones((comm.size, 3_000_000), np.float32))  # the pools grow
    gc.collect()
    return {"pools": len(pools), "alive": sum(ref() is not None for ref in pools), "bound": _bound(comm)}


@pytest.mark.timeout(60)
def test_bound_layouts_do_not_pin_outgrown_scratch() -> None:
    with Cluster(2) as cluster:
        reports = cluster.results(outgrown_pool)
    for report in reports:
        assert report["pools"] > 0 and report["bound"] == 1, report
        assert report["alive"] == 0, report


def small_calls(comm: Any) -> int:
    """How many calls ``comm``'s kept plans ran on the job's small route."""
    return tasks.small_route(comm)[1]


def shaped_layouts(comm: Any) -> dict[str, Any]:
    """N-d float32 and (with ml_dtypes) bfloat16 layouts, reduced until they run on bound steps."""
    dtypes = ["float32"] + (["bfloat16"] if BFLOAT16 is not None else [])
    out: dict[str, Any] = {"results": {}, "bound": 0}
    for round_ in range(4):
        for dtype in dtypes:
            for shape in [(3, 5, 7), (105,)]:
                x = _value(comm.rank, round_, 105, "float32").reshape(shape)
                x = x.astype(BFLOAT16) if dtype == "bfloat16" else x
                assert comm.allreduce(x) is x
                out["results"].setdefault(f"{dtype}-{shape}", []).append(x.astype(np.float32))
    out["bound"], out["bound calls"] = _bound(comm), small_calls(comm)
    return out


@pytest.mark.timeout(90)
def test_bound_layouts_of_any_shape_and_bfloat16_match_numpy() -> None:
    size = 3
    with Cluster(size) as cluster:
        reports = cluster.results(shaped_layouts)
    for round_ in range(4):
        want = sum(_value(rank, round_, 105, "float32") for rank in range(size))  # exact in bfloat16 too
        for rank, report in enumerate(reports):
            for key, rounds in report["results"].items():
                np.testing.assert_array_equal(rounds[round_].reshape(-1), want, err_msg=f"{key} rank {rank}")
    layouts = 2 * (1 + (BFLOAT16 is not None))
    for report in reports:
        assert report["bound"] == layouts
        # Round 1 validates and binds in its turn; every round runs the small form.
        assert report["bound calls"] == 4 * layouts, report["bound calls"]


def overflow_under_raise(comm: Any) -> dict[str, Any]:
    """float32 sums that overflow and NaNs, with the caller's numpy set to raise and warnings as errors."""
    results = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        old = np.seterr(all="raise")
        try:
            for _ in range(5):  # the first call validates and binds in its turn; all run the small form
                x = np.full(16, np.finfo(np.float32).max, np.float32)
                x[0] = np.nan
                comm.allreduce(x)
                results.append(x.copy())
            after = np.geterr()
        finally:
            np.seterr(**old)
    return {"results": results, "after": after, "bound": _bound(comm), "bound calls": small_calls(comm)}


@pytest.mark.timeout(90)
def test_overflow_and_nan_are_results_and_the_callers_error_state_is_kept() -> None:
    with Cluster(3) as cluster:
        reports = cluster.results(overflow_under_raise)
    for report in reports:
        assert report["bound"] == 1 and report["bound calls"] == 5
        assert report["after"] == {"divide": "raise", "over": "raise", "under": "raise", "invalid": "raise"}
        for got in report["results"]:
            assert np.isnan(got[0]) and np.isposinf(got[1:]).all(), got
