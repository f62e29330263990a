"""The two-shot allreduce on one host (``ringcore.plans.oneshot.TwoShotRoute``), across real processes.

Above ``RINGCORE_SMALL_BYTES`` and below ``RINGCORE_DIRECT_BYTES`` every rank
posts its input in its mailbox, reduces its share into its next slot, posts
that, and copies every share into its buffer; at N=2 the one-shot route takes
these sizes (one post, every rank reduces both inputs). Checked here: the results
against numpy and against the rings (``RINGCORE_DIRECT_BYTES=0``) on the same
inputs, for kept plans and one-call buffers, with every rank holding the same
bits; ``RINGCORE_ATOMIC=1`` takes the route too; symmetric memory of the same
sizes still goes direct; a peer that dies or stops between the two posts, or
passes another op, fails every survivor naming it, with its buffer as it was.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ringcore
from ringcore.config import Settings
from tests import tasks
from tests.cluster import Background, Cluster, RankError, free_port, qualified, run_with_stopped_rank
from tests.conftest import RING_ONLY
from tests.integration.test_halving_doubling import start_rank
from tests.reference import check_allreduce

KIB = 1024
CASES = [  # (dtype, op, bytes): above RINGCORE_SMALL_BYTES (64 KiB), below RINGCORE_DIRECT_BYTES (1 MiB)
    ("float32", "sum", 256 * KIB + 4),
    ("float64", "avg", 100 * KIB + 8),
    ("int32", "max", 1024 * KIB - 4),
    ("int64", "prod", 96 * KIB),
    ("float16", "min", 70 * KIB + 2),
    ("uint16", "sum", 64 * KIB + 2),
]
COUNT = 100_000  # float32 elements (400 KB) for the failure tests: two shots


def _inputs(size: int, seed: int) -> list[tuple[str, str, list[np.ndarray]]]:
    rng = np.random.default_rng(seed)
    cases = []
    for dtype, op, nbytes in CASES:
        low, high = (1, 3) if op == "prod" else (-50, 50)
        count = nbytes // np.dtype(dtype).itemsize
        cases.append((dtype, op, [rng.integers(low, high, count).astype(dtype) for _ in range(size)]))
    return cases


def plan_cache(comm: Any) -> dict[str, Any]:
    return comm.plan_cache()  # type: ignore[no-any-return]


def _route(nbytes: int, size: int) -> str:
    """The route the defaults give an ordinary buffer of ``nbytes`` on ``size`` ranks of one host."""
    if nbytes >= Settings().direct_from(size):
        return "direct"
    return "oneshot" if size == 2 else "twoshot"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("size", [2, 3, 4])
def test_mid_sized_allreduces_go_two_shot_or_one_and_match_numpy_and_the_rings(size: int) -> None:
    """From three ranks every case goes two-shot; at N=2 one shot, and direct from 384 KiB."""
    cases = _inputs(size, 30 + size)
    routes = [_route(inputs[0].nbytes, size) for _, _, inputs in cases]
    assert routes.count("direct") == (1 if size == 2 else 0), routes
    with Cluster(size, env=RING_ONLY, timeout=120) as cluster:
        rings = [cluster.results(tasks.allreduce_routed, inputs, op) for _, op, inputs in cases]
    with Cluster(size, timeout=120) as cluster:
        for (dtype, op, inputs), by_ring, route in zip(cases, rings, routes, strict=True):
            for kind in ("numpy", "array"):
                if kind == "array" and dtype == "float16":
                    continue  # array.array has no float16
                reports = cluster.results(tasks.allreduce_routed, inputs, op, kind)
                for rank, (report, ring) in enumerate(zip(reports, by_ring, strict=True)):
                    where = f"rank {rank} {kind} {dtype} {op} {inputs[0].nbytes} bytes, {route}:"
                    assert ring["posted"] == 0, f"{where} RINGCORE_DIRECT_BYTES=0 posted"
                    took = (report["direct"], report["posted"])
                    assert took == {"direct": (1, 2), "oneshot": (0, 1), "twoshot": (0, 2)}[route], (
                        where,
                        took,
                    )
                    check_allreduce(report["result"], inputs, op, where=where)
                    # integer-valued inputs: the ring's order of reduction gives the same bits
                    assert report["result"].tobytes() == ring["result"].tobytes(), where
                first = reports[0]["result"]
                for report in reports[1:]:
                    assert first.tobytes() == report["result"].tobytes(), "ranks disagree on the bits"
        stats = cluster.results(plan_cache)
    for rank, stat in enumerate(stats):
        assert stat["routed"] == dict(Counter(routes)), (rank, stat)


PIECES = [  # (dtype, op, bytes): longer than the mailbox's 1 MiB slot
    ("float32", "sum", 1024 * KIB + 64),
    ("int32", "max", 3 * 1024 * KIB + 12),
    ("float64", "avg", 2 * 1024 * KIB),
    ("float16", "sum", 1024 * KIB + 2),
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("size", [3, 4])
def test_inputs_longer_than_a_slot_go_two_shot_in_pieces(size: int) -> None:
    """Below ``RINGCORE_DIRECT_BYTES`` (8M here) from three ranks, a slot's worth at a time: two posts
    per piece, the ring's bits, every rank alike; ``RINGCORE_ATOMIC=1`` keeps them on the ring."""
    rng = np.random.default_rng(size)
    cases = []
    for dtype, op, nbytes in PIECES:
        count = nbytes // np.dtype(dtype).itemsize
        cases.append((dtype, op, [rng.integers(-50, 50, count).astype(dtype) for _ in range(size)]))
    with Cluster(size, env=RING_ONLY, timeout=120) as cluster:
        rings = [cluster.results(tasks.allreduce_routed, inputs, op) for _, op, inputs in cases]
    with Cluster(size, env={"RINGCORE_DIRECT_BYTES": "8M"}, timeout=120) as cluster:
        for (dtype, op, inputs), by_ring in zip(cases, rings, strict=True):
            pieces = -(-inputs[0].nbytes // (1024 * KIB))
            for kind in ("numpy", "array") if dtype != "float16" else ("numpy",):
                reports = cluster.results(tasks.allreduce_routed, inputs, op, kind)
                for rank, (report, ring) in enumerate(zip(reports, by_ring, strict=True)):
                    where = f"rank {rank} {kind} {dtype} {op} {inputs[0].nbytes} bytes:"
                    assert (report["direct"], report["posted"]) == (0, 2 * pieces), (where, report["posted"])
                    check_allreduce(report["result"], inputs, op, where=where)
                    assert report["result"].tobytes() == ring["result"].tobytes(), where
    _, op, inputs = cases[0]
    with Cluster(size, env={"RINGCORE_DIRECT_BYTES": "8M", "RINGCORE_ATOMIC": "1"}, timeout=60) as cluster:
        for rank, report in enumerate(cluster.results(tasks.allreduce_routed, inputs, op)):
            assert report["posted"] == 0, (rank, report["posted"])
            check_allreduce(report["result"], inputs, op, where=f"rank {rank} atomic")


def _rank_1_killed_at_its_last_post(
    tmp_path: Path, count: int, env: dict[str, str] | None = None
) -> list[Any]:
    """Three ranks allreduce ``count`` float32 until one fails; rank 1 kills itself in round 1 at the
    post matching round 0's last. The survivors' reports (ranks 0 and 2), checked to name rank 1."""
    fault = (1, "kill9", str(tmp_path / "killed_at"), 1.0)
    with Cluster(3, env={"RINGCORE_TIMEOUT": "20", **(env or {})}, timeout=60) as cluster:
        doomed = Background(cluster, tasks.allreduce_until_failure, count, 3, fault, ranks=[1], timeout=90)
        working = Background(
            cluster, tasks.allreduce_until_failure, count, 3, fault, ranks=[0, 2], timeout=90
        )
        reports = working.join(60)
        (victim,) = doomed.join(30)
    assert isinstance(victim, RankError) and victim.type_name == "dead", victim
    for rank, report in zip([0, 2], reports, strict=True):
        assert report["error"] == qualified(ringcore.PeerFailure), (rank, report)
        assert report["peer"] == 1 and "rank 1" in report["message"], (rank, report)
    return reports


@pytest.mark.timeout(90)
def test_a_peer_dead_in_a_later_piece_fails_every_rank_naming_the_pieces_done(tmp_path: Path) -> None:
    """Rank 1 kills itself at its fourth post (the second piece's share): the survivors' errors name
    it, the first piece holds the result and the rest of the buffer is as it was."""
    # float32, 1.2 MB: two pieces; round 0 posted four times, so rank 1 dies at its fourth post
    env = {"RINGCORE_DIRECT_BYTES": "8M"}
    for rank, report in zip([0, 2], _rank_1_killed_at_its_last_post(tmp_path, 300_000, env), strict=True):
        assert any("elements [0, 262144) of 300000 already hold the result" in n for n in report["notes"]), (
            report
        )
        assert report["untouched"], (rank, report)


@pytest.mark.timeout(120)
def test_atomic_allreduces_take_two_shots_and_symmetric_memory_still_goes_direct() -> None:
    """``RINGCORE_ATOMIC=1`` keeps the mailboxes' routes (a failure leaves the buffer as it was anyway),
    up to 1 MiB at N=2 too; an array from ``ringcore.empty`` of the same size goes direct (mapped), an
    ordinary one two-shot."""
    size = 3
    inputs = [np.arange(COUNT, dtype=np.float32) * (rank + 1) for rank in range(size)]
    with Cluster(size, env={"RINGCORE_ATOMIC": "1"}, timeout=60) as cluster:
        atomic = cluster.results(tasks.allreduce_routed, inputs, "sum")
    with Cluster(size, timeout=60) as cluster:
        mapped = cluster.results(tasks.allreduce_symmetric, inputs, "sum")
        ordinary = cluster.results(tasks.allreduce_routed, inputs, "sum")
    pair = [np.arange(150_000, dtype=np.float32) * (rank + 1) for rank in range(2)]  # 600 KB
    with Cluster(2, env={"RINGCORE_ATOMIC": "1"}, timeout=60) as cluster:
        atomic_pair = cluster.results(tasks.allreduce_routed, pair, "sum")
    for rank in range(2):  # past the auto direct limit of two ranks, which atomic jobs do not take
        assert (atomic_pair[rank]["posted"], atomic_pair[rank]["direct"]) == (1, 0), (rank, atomic_pair[rank])
        check_allreduce(atomic_pair[rank]["result"], pair, "sum", where=f"rank {rank} atomic, N=2")
    for rank in range(size):
        assert atomic[rank]["posted"] == 2, (rank, atomic[rank])
        check_allreduce(atomic[rank]["result"], inputs, "sum", where=f"rank {rank} atomic")
        assert mapped[rank]["direct"] == 1 and mapped[rank]["outside intact"], (rank, mapped[rank])
        check_allreduce(mapped[rank]["result"], inputs, "sum", where=f"rank {rank} symmetric")
        assert ordinary[rank]["posted"] == 2, (rank, ordinary[rank])
        assert ordinary[rank]["result"].tobytes() == mapped[rank]["result"].tobytes(), rank


@pytest.mark.timeout(90)
def test_a_peer_dead_between_the_two_posts_fails_every_rank_with_buffers_untouched(tmp_path: Path) -> None:
    """Rank 1 posts its input in round 1, then kills itself before posting its share."""
    for rank, report in zip([0, 2], _rank_1_killed_at_its_last_post(tmp_path, COUNT), strict=True):
        assert report["rounds"] == 1 and report["untouched"], (rank, report)
        assert report["exposed"] is None, (rank, report)  # nothing of the caller's buffer was written


@pytest.mark.timeout(120)
def test_a_peer_stopped_between_the_two_posts_times_out_every_rank(tmp_path: Path) -> None:
    victim, survivors = 1, [0, 2]
    fault = (victim, "sigstop", str(tmp_path / "stopped_at"), 1.0)
    with Cluster(3, env={"RINGCORE_TIMEOUT": "3"}, timeout=60) as cluster:
        reports, resumed = run_with_stopped_rank(
            cluster, tasks.allreduce_until_failure, COUNT, 3, fault, victim=victim, survivors=survivors
        )
    for rank, report in zip(survivors, reports, strict=True):
        assert not isinstance(report, RankError), (rank, report)
        assert report["error"] == qualified(ringcore.CollectiveTimeout), (rank, report)
        assert report["rounds"] == 1 and report["untouched"], (rank, report)
        assert "rank 1" in report["message"] or "from rank 0" in report["message"], (rank, report)
    assert not isinstance(resumed, RankError), resumed
    assert resumed["error"] in (qualified(ringcore.CollectiveTimeout), qualified(ringcore.PeerFailure))


@pytest.mark.timeout(90)
def test_another_op_on_one_rank_is_a_mismatch_naming_it() -> None:
    with Cluster(3, env={"RINGCORE_TIMEOUT": "10"}, timeout=60) as cluster:
        reports = cluster.results(tasks.other_op_on_rank_0, COUNT)
    for rank, report in enumerate(reports):
        assert report["error"] == "MismatchError", (rank, report)
        assert "rank 0 passed max" in report["message"] and "ranks 1-2 passed sum" in report["message"], (
            report
        )
        assert report["untouched"], (rank, report)


@pytest.mark.timeout(90)
def test_pieces_and_one_slot_meet_as_a_mismatch_past_2_32_collectives() -> None:
    """Rank 0's input takes two pieces, the others' one slot, at collective number 2**32: piece 0 is
    posted under the collective's whole number, as the one-slot route posts it, so every rank fails
    with the MismatchError naming rank 0 instead of waiting for a post it cannot recognise."""
    count = 256 * KIB  # 1 MiB of float32: one slot; rank 0 passes 1.5 MiB
    with Cluster(3, env={"RINGCORE_DIRECT_BYTES": "8M", "RINGCORE_TIMEOUT": "10"}, timeout=60) as cluster:
        reports = cluster.results(tasks.other_count_past_2_32, count, count * 3 // 2)
    for rank, report in enumerate(reports):
        assert report["error"] == "MismatchError", (rank, report)
        assert "rank 0" in report["message"], (rank, report)
        assert report["untouched"], (rank, report)


def test_auto_and_an_explicit_direct_limit_agree_where_they_mean_the_same_bytes() -> None:
    """From three ranks with the kernel's copies pinned fast auto means 1 MiB, so a rank that sets
    1M agrees with the rest; at N=2 auto means 384 KiB, and where the copies may prove slow 8 MiB
    from three ranks: the ranks fail at init naming both values. Pinned slow, an explicit limit
    equal to slow auto's direct limit still differs: at N=2 auto's shots stop at 384 KiB, and
    from three ranks pinned slow turns fast where ranks may not copy from each other."""
    fast, slow = {"RINGCORE_KERNEL_COPIES": "fast"}, {"RINGCORE_KERNEL_COPIES": "slow"}
    cases = (
        (3, fast, "1M", ()),
        (2, fast, "1M", ("393216", "1048576")),
        (3, {}, "1M", ("8388608", "1048576")),
        (2, slow, "16M", ("393216", "16777216")),
        (3, slow, "8M", ("1048576", "8388608")),
    )
    for size, common, explicit, named in cases:
        port = free_port()
        env = {**common, "RINGCORE_DIRECT_BYTES": explicit}
        ranks = [start_rank(rank, size, port, env if rank == size - 1 else common) for rank in range(size)]
        reports = [json.loads(proc.communicate(timeout=60)[0].strip().splitlines()[-1]) for proc in ranks]
        for report in reports:
            if not named:
                assert report["error"] is None, (size, common, report)
            else:
                assert report["error"] == "ConfigError", (size, common, report)
                assert "RINGCORE_DIRECT_BYTES" in report["message"], report
                assert all(number in report["message"] for number in named), (named, report)
