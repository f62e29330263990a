"""Jobs of real processes over shared memory (``RINGCORE_TRANSPORT=shm``) on this host.

Sizes run from 4 KiB to 16 MiB, past the 4 MiB a pair of ranks may share
(``RINGCORE_SHM_BYTES``), so frames go around their ring in pieces. The
failure cases check what the transport promises beyond the data: a killed
rank is named by every survivor (its TCP connection closes) and leaves
nothing in ``/dev/shm``; ranks that disagree fail with ``MismatchError``.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest

import ringcore
from tests import tasks
from tests.cluster import Background, Cluster, kill_mid_allreduce, qualified, read_stamp
from tests.reference import check_allreduce

pytestmark = pytest.mark.usefixtures("ring_only")  # the ring's forms and frames, not the direct route

SHM = {"RINGCORE_TRANSPORT": "shm", "RINGCORE_TIMEOUT": "20"}
KIB = 1024


def ours() -> set[str]:
    """Files of ringcore in /dev/shm (segments and probes)."""
    return {name for name in os.listdir("/dev/shm") if name.startswith("ringcore-")}


def shm_peers(comm: object) -> dict[str, object]:
    """The rank's transport and the peers it reaches through shared memory (a Cluster task)."""
    transport = comm.transport  # type: ignore[attr-defined]
    return {
        "transport": type(transport).__name__,
        "local": list(getattr(transport, "local", [])),
        "single_copy": sorted(getattr(transport, "point_from", {})),
    }


@pytest.mark.timeout(240)
@pytest.mark.parametrize("size", [2, 3, 4])
def test_allreduce_matches_numpy(size: int) -> None:
    rng = np.random.default_rng(size)
    before = ours()
    with Cluster(size, env=SHM, timeout=120) as cluster:
        reports = cluster.results(shm_peers)
        for rank, report in enumerate(reports):
            others = [p for p in range(size) if p != rank]
            assert report == {"transport": "ShmTransport", "local": others, "single_copy": others}
        assert ours() <= before, "segments must be unlinked once the job is connected"
        cases = [
            ("float32", "sum", 4 * KIB),
            ("float64", "max", 64 * KIB),
            ("int32", "sum", 1024 * KIB),
            ("float32", "sum", 5 * 1024 * KIB + 12),
            ("float32", "min", 16 * 1024 * KIB),
        ]
        for dtype, op, nbytes in cases:
            count = nbytes // np.dtype(dtype).itemsize
            inputs = [rng.integers(-50, 50, count).astype(dtype) for _ in range(size)]
            for rank, got in enumerate(cluster.results(tasks.allreduce, inputs, op, timeout=120)):
                check_allreduce(got, inputs, op, where=f"rank {rank} {dtype} {nbytes} bytes:")


@pytest.mark.timeout(180)
def test_broadcast_allgather_reduce_scatter() -> None:
    size = 3
    rng = np.random.default_rng(11)
    with Cluster(size, env=SHM, timeout=120) as cluster:
        inputs = [rng.standard_normal(1_000_003).astype(np.float32) for _ in range(size)]
        for got in cluster.results(tasks.broadcast, inputs, 2, timeout=120):
            np.testing.assert_array_equal(got, inputs[2])
        small = [x[:9001] for x in inputs]
        for got in cluster.results(tasks.allgather, small, timeout=120):
            np.testing.assert_array_equal(got, np.concatenate(small))
        ints = [rng.integers(0, 100, 3 * 70_000).astype(np.int64) for _ in range(size)]
        total = np.sum(ints, axis=0)
        for rank, got in enumerate(cluster.results(tasks.reduce_scatter, ints, "sum", timeout=120)):
            np.testing.assert_array_equal(np.asarray(got).ravel(), total[rank * 70_000 : (rank + 1) * 70_000])


@pytest.mark.timeout(150)
def test_killed_rank_is_named_and_leaves_nothing_in_dev_shm(tmp_path: Path) -> None:
    size, victim = 3, 1
    before = ours()
    with Cluster(size, env=SHM) as cluster:
        survivors, reports, _ = kill_mid_allreduce(cluster, victim, tmp_path / "killed_at", 2_000_000)
        for rank, report in zip(survivors, reports, strict=True):
            assert report["error"] == qualified(ringcore.PeerFailure), (rank, report)
            assert report["peer"] == victim and f"rank {victim}" in report["message"], (rank, report)
            assert report["rounds"] >= 1, (rank, report)
        assert ours() <= before, f"left in /dev/shm after kill -9: {sorted(ours() - before)}"
    assert ours() <= before


@pytest.mark.timeout(120)
def test_mismatch_fails_every_rank() -> None:
    calls = [("allreduce", (np.ones(n, np.float32),), {}) for n in (100_000, 100_001, 100_000)]
    with Cluster(3, env=SHM, timeout=60) as cluster:
        reports = cluster.run(tasks.mismatch_then_retry, calls, None, timeout=60)
    assert [r["error"] for r in reports] == [qualified(ringcore.MismatchError)] * 3, reports
    assert all("rank 1 passed (100001,)" in r["message"] for r in reports), reports


@pytest.mark.timeout(150)
def test_stopped_rank_times_out(tmp_path: Path) -> None:
    """A stopped local rank (SIGSTOP) moves nothing in shared memory: the others time out, none hangs."""
    victim, survivors = 1, [0, 2]
    fault = (victim, "sigstop", str(tmp_path / "stopped_at"), 0.5)
    with Cluster(3, env={**SHM, "RINGCORE_TIMEOUT": "3"}) as cluster:
        try:
            stopped = Background(
                cluster, tasks.allreduce_until_failure, 2_000_000, 3, fault, ranks=[victim], timeout=90
            )
            working = Background(
                cluster, tasks.allreduce_until_failure, 2_000_000, 3, fault, ranks=survivors, timeout=90
            )
            reports = working.join(60)
            read_stamp(fault[2])
            for rank, report in zip(survivors, reports, strict=True):
                assert report["error"] == qualified(ringcore.CollectiveTimeout), (rank, report)
                assert report["rounds"] >= 1 and report["untouched"], (rank, report)
            cluster.kill(victim, signal.SIGCONT)
            (resumed,) = stopped.join(60)
            assert resumed["error"] in (
                qualified(ringcore.CollectiveTimeout),
                qualified(ringcore.PeerFailure),
            )
        finally:
            cluster.kill(victim, signal.SIGCONT)


@pytest.mark.timeout(120)
def test_auto_uses_shared_memory_between_ranks_on_one_host() -> None:
    """``RINGCORE_TRANSPORT=auto`` without RDMA: every pair of these ranks shares this host."""
    size = 3
    inputs = [np.full(300_000, rank + 1, np.float32) for rank in range(size)]
    with Cluster(size, env={"RINGCORE_TRANSPORT": "auto", "RINGCORE_TIMEOUT": "20"}, timeout=60) as cluster:
        for rank, report in enumerate(cluster.results(shm_peers)):
            assert report["transport"] == "ShmTransport"
            assert report["local"] == [p for p in range(size) if p != rank]
        for rank, got in enumerate(cluster.results(tasks.allreduce, inputs, "sum", timeout=60)):
            check_allreduce(got, inputs, "sum", where=f"rank {rank}:")


def lent_and_copied(comm: object, cases: list[tuple[list[np.ndarray], str]]) -> dict[str, object]:
    """Each allreduce combined from the peers' slots, then with every frame copied first (a Cluster task)."""
    from ringcore.algo import lockstep

    transport = comm.transport  # type: ignore[attr-defined]
    combined = lockstep._combine_lent
    lent = [0]

    def counted(*args: object) -> None:
        lent[0] += 1
        combined(*args)  # type: ignore[arg-type]

    lockstep._combine_lent = counted  # type: ignore[assignment]
    lend_from = transport.lend_from
    try:
        out: dict[str, object] = {}
        for label, threshold in (("lent", lend_from), ("copied", 1 << 62)):
            transport.lend_from = threshold
            out[label] = [
                comm.allreduce(inputs[comm.rank].copy(), op=op)  # type: ignore[attr-defined]
                for inputs, op in cases
            ]
            out[f"{label} combines"] = lent[0]
            lent[0] = 0
        return out
    finally:
        lockstep._combine_lent = combined  # type: ignore[assignment]
        transport.lend_from = lend_from


@pytest.mark.timeout(240)
@pytest.mark.parametrize("size", [2, 3, 4])
def test_combining_from_the_peers_slots_gives_the_bits_of_copying_first(size: int) -> None:
    """Ring, recursive and halving-doubling, with avg's division on the lent pieces: same bits either way."""
    rng = np.random.default_rng(size)
    shapes = [("float32", "sum", 64 * KIB), ("float64", "avg", 600 * KIB + 8), ("int32", "max", 1024 * KIB)]
    cases = []
    for dtype, op, nbytes in shapes:
        count = nbytes // np.dtype(dtype).itemsize
        cases.append(([rng.standard_normal(count).astype(dtype) * 100 for _ in range(size)], op))
    with Cluster(size, env=SHM, timeout=120) as cluster:
        reports = cluster.results(lent_and_copied, cases, timeout=120)
    for rank, report in enumerate(reports):
        assert report["lent combines"] > 0 and report["copied combines"] == 0, report
        for (inputs, op), lent, copied in zip(cases, report["lent"], report["copied"], strict=True):
            check_allreduce(lent, inputs, op, where=f"rank {rank}, {inputs[0].dtype} {op} lent:")
            assert lent.tobytes() == copied.tobytes(), f"rank {rank} {inputs[0].dtype} {op}"


@pytest.mark.timeout(180)
def test_single_copy_and_slots_give_the_same_bits() -> None:
    """Frames as pointers (one ``process_vm_readv``) or through the slots: every collective, same bits."""
    size = 3
    rng = np.random.default_rng(7)
    inputs = [rng.standard_normal(700_001).astype(np.float32) for _ in range(size)]
    got = {}
    for single_copy in ("0", "4K"):
        env = {**SHM, "RINGCORE_SHM_SINGLE_COPY_BYTES": single_copy, "RINGCORE_SHM_CACHE_BYTES": "0"}
        with Cluster(size, env=env, timeout=120) as cluster:
            reports = cluster.results(shm_peers)
            assert all(bool(r["single_copy"]) == (single_copy != "0") for r in reports), reports
            sums = cluster.results(tasks.allreduce, inputs, "sum", timeout=120)
            for rank, result in enumerate(sums):
                check_allreduce(result, inputs, "sum", where=f"rank {rank}, single copy from {single_copy}:")
            shared = cluster.results(
                tasks.broadcast, [x if r == 1 else np.zeros_like(x) for r, x in enumerate(inputs)], 1
            )
            got[single_copy] = (sums, shared)
    for a, b in zip(got["0"][0] + got["0"][1], got["4K"][0] + got["4K"][1], strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert all(np.asarray(x).tobytes() == inputs[1].tobytes() for x in got["4K"][1])


def pointed_by_cache(comm: object, inputs: list[np.ndarray], caches: list[int]) -> list[tuple[int, object]]:
    """Per cache size: the frames this rank pointed to in an allreduce of ``inputs``, and its result."""
    from ringcore.transport import shm_ring

    transport = comm.transport  # type: ignore[attr-defined]
    real = shm_ring.Ring.point
    pointed = [0]

    def counted(ring: shm_ring.Ring, *args: int) -> int:
        pointed[0] += 1
        return real(ring, *args)

    shm_ring.Ring.point = counted  # type: ignore[method-assign]
    try:
        out = []
        for cache in caches:
            transport.cache_bytes, pointed[0] = cache, 0
            result = comm.allreduce(inputs[comm.rank].copy())  # type: ignore[attr-defined]
            out.append((pointed[0], result))
        return out
    finally:
        shm_ring.Ring.point = real  # type: ignore[method-assign]


@pytest.mark.timeout(180)
def test_frames_go_as_pointers_only_where_the_buffers_outgrow_the_cache() -> None:
    """Every allreduce route hands the transport its bytes: 3 ranks x 2.8 MB point past 8 MB, not below."""
    size, count = 3, 700_001
    rng = np.random.default_rng(11)
    inputs = [rng.standard_normal(count).astype(np.float32) for _ in range(size)]
    caches = [16 << 20, 8 << 20, 0, 9 << 20]  # 3 x 2_800_004 bytes: above 8 MiB, below 9 MiB
    env = {**SHM, "RINGCORE_SHM_SINGLE_COPY_BYTES": "4K"}
    for extra in ({}, {"RINGCORE_ATOMIC": "1"}):  # in place (lockstep), then the pipelined executor
        with Cluster(size, env={**env, **extra}, timeout=120) as cluster:
            reports = cluster.results(pointed_by_cache, inputs, caches, timeout=120)
        for rank, report in enumerate(reports):
            counts = [pointed for pointed, _ in report]
            assert counts[0] == counts[3] == 0 and counts[1] > 0 and counts[2] > 0, (extra, rank, counts)
            for _, result in report:
                check_allreduce(result, inputs, "sum", where=f"rank {rank} {extra}:")
                assert np.asarray(result).tobytes() == np.asarray(report[0][1]).tobytes()
