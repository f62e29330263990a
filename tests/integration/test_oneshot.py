"""The one-shot allreduce of small inputs on one host (``ringcore.plans.oneshot``), across real processes,
and the one-shot broadcast, allgather and reduce_scatter.

Every rank posts its input in its shared-memory mailbox, waits once for
every peer's and reduces all of them (or, on a crowded host, one rank
reduces for all and publishes the result). Checked here: the results against
numpy and against the rings (``RINGCORE_DIRECT_BYTES=0``) on the same
inputs, for kept plans and one-call buffers, every rank with the same bits;
a (fake) GPU buffer on one rank sends every rank to the ring; a rank on
another route (a larger buffer) is a ``MismatchError`` on every rank, not a
timeout; one reducer takes turns and gives the bits of every rank reducing;
the mailboxes leave nothing in ``/dev/shm``. The small route's
failure tests (a dead, stopped or disagreeing peer) run on both routes in
``test_small_path.py``.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tests import tasks
from tests.cluster import Cluster, free_port
from tests.conftest import RING_ONLY
from tests.gpu import tasks as gpu_tasks
from tests.integration.test_halving_doubling import start_rank
from tests.reference import check_allreduce

KIB = 1024
CASES = [  # (dtype, op, bytes): at most RINGCORE_SMALL_BYTES (64 KiB)
    ("float32", "sum", 4 * KIB),
    ("float64", "avg", 8 * KIB + 8),
    ("int32", "max", 64 * KIB),
    ("int64", "prod", 1 * KIB),
    ("float16", "min", 2 * KIB + 2),
    ("uint16", "sum", 6),
]


def _ringcore_files() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("ringcore-")}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("size", [2, 3, 4])
def test_small_allreduces_go_one_shot_and_match_numpy_and_the_rings(size: int) -> None:
    rng = np.random.default_rng(size)
    cases = []
    for dtype, op, nbytes in CASES:
        low, high = (1, 3) if op == "prod" else (-50, 50)
        count = nbytes // np.dtype(dtype).itemsize
        cases.append((dtype, op, [rng.integers(low, high, count).astype(dtype) for _ in range(size)]))
    with Cluster(size, env=RING_ONLY, timeout=120) as cluster:
        rings = [cluster.results(tasks.allreduce_routed, inputs, op) for _, op, inputs in cases]
    before = _ringcore_files()
    with Cluster(size, timeout=120) as cluster:
        assert _ringcore_files() <= before, "a mailbox or segment was left in /dev/shm after set-up"
        for (dtype, op, inputs), by_ring in zip(cases, rings, strict=True):
            for kind in ("numpy", "array"):
                if kind == "array" and dtype == "float16":
                    continue  # array.array has no float16
                reports = cluster.results(tasks.allreduce_routed, inputs, op, kind)
                for rank, (report, ring) in enumerate(zip(reports, by_ring, strict=True)):
                    where = f"rank {rank} {kind} {dtype} {op} {inputs[0].nbytes} bytes:"
                    assert ring["posted"] == 0, f"{where} RINGCORE_DIRECT_BYTES=0 posted"
                    assert report["posted"] == 1, f"{where} not one-shot"
                    check_allreduce(report["result"], inputs, op, where=where)
                    np.testing.assert_allclose(report["result"], ring["result"], rtol=1e-6, err_msg=where)
                first = reports[0]["result"]
                for report in reports[1:]:  # the same inputs reduced in the same order on every rank
                    assert first.tobytes() == report["result"].tobytes()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("size", [2, 3, 4])
def test_one_reducer_takes_turns_and_gives_every_rank_the_bits_of_every_rank_reducing(size: int) -> None:
    """``RINGCORE_ONE_REDUCER=1``: in each one-shot allreduce exactly one rank (``seq % N``, so each in
    turn) publishes the result, and every rank ends with the bits it has where every rank reduces
    (``=0``, where none publishes), which match numpy."""
    rng = np.random.default_rng(70 + size)
    cases = []
    for dtype, op, nbytes in CASES:
        low, high = (1, 3) if op == "prod" else (-50, 50)
        count = nbytes // np.dtype(dtype).itemsize
        cases.append((op, [rng.integers(low, high, count).astype(dtype) for _ in range(size)]))
    runs = {}
    for one in ("1", "0"):
        with Cluster(size, env={"RINGCORE_ONE_REDUCER": one}, timeout=120) as cluster:
            runs[one] = [cluster.results(tasks.allreduce_reduced_by, inputs, op) for op, inputs in cases]
    reducers = set()
    for call, ((op, inputs), ones, everys) in enumerate(zip(cases, runs["1"], runs["0"], strict=True)):
        published = [rank for rank, report in enumerate(ones) if report["published"]]
        assert len(published) == 1, f"call {call}: ranks {published} published a result"
        reducers.update(published)
        assert not any(report["published"] for report in everys), f"call {call}: published with =0"
        for rank, (one, every) in enumerate(zip(ones, everys, strict=True)):
            where = f"call {call} rank {rank} {inputs[0].dtype} {op}:"
            assert one["one_reducer"] and not every["one_reducer"], where
            assert one["posted"] == every["posted"] == 1, f"{where} not one-shot"
            check_allreduce(one["result"], inputs, op, where=where)
            assert one["result"].tobytes() == every["result"].tobytes(), where
    assert len(reducers) == min(size, len(cases)), f"the reducers did not take turns: {reducers}"


def test_ranks_that_differ_on_one_reducer_fail_at_init_naming_it() -> None:
    port = free_port()
    ranks = [start_rank(rank, 3, port, {"RINGCORE_ONE_REDUCER": "1"} if rank else {}) for rank in range(3)]
    for proc in ranks:
        report = json.loads(proc.communicate(timeout=60)[0].strip().splitlines()[-1])
        assert report["error"] == "ConfigError", report
        assert "ranks disagree on RINGCORE_ONE_REDUCER" in report["message"], report


@pytest.mark.timeout(180)
@pytest.mark.parametrize("one", ["0", "1"], ids=["every-rank", "one-reducer"])
def test_a_gpu_buffer_among_host_ones_sends_every_rank_to_the_ring(one: str) -> None:
    """Rank 1's (fake) GPU buffer posts that it does not take part: all three ranks run the ring,
    every rank reducing or one for all (which then publishes that only two take part)."""
    rng = np.random.default_rng(12)
    inputs = list((rng.standard_normal((3, 3000)) * 3).astype(np.float32))  # 12 KB: small
    with Cluster(3, env={"RINGCORE_ONE_REDUCER": one}, timeout=60) as cluster:
        cluster.results(gpu_tasks.use_fake, 2)
        before = cluster.results(tasks.mailbox_posts)
        results = cluster.results(gpu_tasks.mixed_ring, inputs, "sum", None)
        after = cluster.results(tasks.mailbox_posts)
        host = cluster.results(tasks.allreduce_routed, inputs, "sum")
    assert [b - a for a, b in zip(before, after, strict=True)] == [1, 1, 1], (
        "every rank posted, rank 1 absent"
    )
    for rank, result in enumerate(results):
        check_allreduce(result.view(np.float32), inputs, "sum", where=f"rank {rank}, mixed")
        assert result.tobytes() == results[0].tobytes(), "ranks disagree on the bits"
    assert [report["posted"] for report in host] == [1, 1, 1], "all-host ranks went one-shot"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("one", ["0", "1"], ids=["every-rank", "one-reducer"])
@pytest.mark.parametrize("gpu_ranks", [[0, 1, 2], [1]], ids=["all-gpu", "mixed"])
def test_a_job_of_gpu_buffers_posts_once_per_signature_then_goes_straight_to_the_ring(
    gpu_ranks: list[int], one: str
) -> None:
    """Every rank's buffer on a (fake) GPU: the first small allreduce, broadcast and large allreduce
    (the direct route's vote) of a layout post that the rank does not take part, and later ones go
    straight to the ring with no post. With one GPU rank among host ones every call posts."""
    rng = np.random.default_rng(5)
    inputs = {
        "small": list(rng.integers(-50, 50, (3, 3000)).astype(np.float32)),  # 12 KB: one shot
        "broadcast": list(rng.integers(-50, 50, (3, 4000)).astype(np.float64)),  # 32 KB: one shot
        "large": list(rng.integers(-50, 50, (3, 300_000)).astype(np.float32)),  # 1.2 MB: the vote
    }
    rounds = 3
    with Cluster(3, env={"RINGCORE_ONE_REDUCER": one}, timeout=120) as cluster:
        cluster.results(gpu_tasks.use_fake, 4)
        reports = cluster.results(gpu_tasks.repeated_posts, inputs, rounds, gpu_ranks)
    every_call = [1, 1, 1] * rounds
    want_posts = [1, 1, 1] + [0, 0, 0] * (rounds - 1) if len(gpu_ranks) == 3 else every_call
    for rank, report in enumerate(reports):
        assert report["posts"] == want_posts, (rank, report["posts"])
        for call, result in enumerate(report["results"]):
            kind = ("small", "broadcast", "large")[call % 3]
            where = f"rank {rank} call {call} ({kind})"
            if kind == "broadcast":
                np.testing.assert_array_equal(result, inputs[kind][0], err_msg=where)
            else:
                check_allreduce(result, inputs[kind], "sum", where=where)
            assert result.tobytes() == reports[0]["results"][call].tobytes(), where


@pytest.mark.timeout(120)
@pytest.mark.parametrize("large", [100_000, 600_000], ids=["ring", "vote"])
def test_a_rank_on_another_route_is_a_mismatch_on_every_rank(large: int) -> None:
    """Rank 0 passes 400 KB (the ring) or 2.4 MB (the direct route's vote) where ranks 1-2 pass 400 bytes."""
    with Cluster(3, env={"RINGCORE_TIMEOUT": "20"}, timeout=60) as cluster:
        reports = cluster.results(tasks.allreduce_of_rank_counts, [large, 100, 100])
    for rank, report in enumerate(reports):
        assert report["error"] == "MismatchError", (rank, report)
        assert f"({large},)" in report["message"] and "(100,)" in report["message"], (rank, report)
        assert report["untouched"], (rank, report)


def _posted_calls(size: int) -> tuple[list[tuple[str, object]], list[int]]:
    """Broadcasts, allgathers and reduce_scatters, and how many posts each makes on one host."""
    rng = np.random.default_rng(40 + size)
    calls: list[tuple[str, object]] = []
    for dtype, shape, root in [
        ("float32", (1000,), size - 1),
        ("int64", (3, 17), 0),
        ("float16", (5, 5), 1),
        ("uint8", (0,), 0),
    ]:
        calls.append(("broadcast", ([rng.integers(-99, 99, shape).astype(dtype) for _ in range(size)], root)))
    calls.append(("allgather", [rng.integers(-9, 9, (rank, 7)).astype(np.float32) for rank in range(size)]))
    big = [rng.integers(-9, 9, (1400 if rank == size - 1 else 3, 100)) for rank in range(size)]
    calls.append(("allgather", [rows.astype(np.float64) for rows in big]))  # the last rank's 1.1 MB: the ring
    for dtype, op in [("float32", "sum"), ("int32", "max"), ("float64", "avg")]:
        inputs = [rng.integers(-50, 50, (size * 3 + 1, 5)).astype(dtype) for _ in range(size)]
        calls.append(("reduce_scatter", (inputs, op)))
    large = [rng.integers(-5, 5, (size * 4, 70_000)).astype(np.float32) for _ in range(size)]  # past a slot
    calls.append(("reduce_scatter", (large, "sum")))
    return calls, [1, 1, 1, 1, 1, 1, 1, 1, 1, 0]


def _reference(kind: str, args: object, rank: int, size: int) -> np.ndarray:
    if kind == "broadcast":
        inputs, root = args  # type: ignore[misc]
        return inputs[root]
    if kind == "allgather":
        return np.concatenate(args)  # type: ignore[arg-type]
    inputs, op = args  # type: ignore[misc]
    stacked = np.stack(inputs)
    reduced = {"sum": stacked.sum(0), "max": stacked.max(0), "avg": stacked.sum(0) / size}[op]
    return np.array_split(reduced.astype(inputs[0].dtype), size)[rank]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("size", [2, 3, 4])
def test_small_broadcasts_and_gathers_go_one_shot_and_match_numpy_and_tcp(size: int) -> None:
    """The same calls over TCP (no mailboxes) and on one host: the same bits, and numpy's."""
    calls, expected_posts = _posted_calls(size)
    with Cluster(size, env={"RINGCORE_TRANSPORT": "tcp"}, timeout=120) as cluster:
        over_tcp = cluster.results(tasks.posted_collectives, calls)
    with Cluster(size, timeout=120) as cluster:
        posted = cluster.results(tasks.posted_collectives, calls)
    for rank in range(size):
        assert posted[rank]["posts"] == expected_posts, f"rank {rank}: {posted[rank]['posts']}"
        for (kind, args), got, by_tcp in zip(
            calls, posted[rank]["results"], over_tcp[rank]["results"], strict=True
        ):
            where = f"rank {rank} {kind} {got.dtype} {got.shape}"
            np.testing.assert_allclose(got, _reference(kind, args, rank, size), rtol=1e-12, err_msg=where)
            assert got.dtype == by_tcp.dtype and got.shape == by_tcp.shape, where
            # integer-valued inputs: every order of reduction gives the same bits
            assert got.tobytes() == by_tcp.tobytes(), f"{where}: not the general route's bits"
