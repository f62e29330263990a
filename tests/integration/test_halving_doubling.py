"""Halving-doubling allreduce over real processes and sockets: which sizes take it, and its results.

On a world of 4 or more, allreduces above ``RINGCORE_SMALL_BYTES``
and up to ``RINGCORE_HALVING_BYTES`` (wire bytes; a quarter of it when ranks
fold in) use halving-doubling; the
schedule itself is checked against numpy in memory in
``tests/unit/test_schedules.py``. Here: the size boundaries, results against
numpy and bit-identical across ranks (every op, integer and float dtypes, fp16
compression) at N=4, 6 (two extra ranks fold in and out) and 8, a dead peer
in the middle of one (an extra one too), sliced
buffers and frames too big for the GPU staging, which keep the ring, and ranks
that disagree on the threshold, which fail at init.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import ringcore
from tests import tasks
from tests.cluster import Background, Cluster, RankError, free_port, qualified

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("ring_only")]  # not the direct route

SMALL = 64 * 1024 // 4  # float32 elements at the default RINGCORE_SMALL_BYTES
HALVING = 4 * 1024 * 1024 // 4  # ... at the default RINGCORE_HALVING_BYTES


def reference(inputs: list[np.ndarray], op: str) -> np.ndarray:
    wide = np.stack([x.astype(np.float64 if x.dtype.kind == "f" else x.dtype) for x in inputs])
    if op == "avg":
        return wide.sum(axis=0) / len(inputs)
    ufunc = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}[op]
    return ufunc.reduce(wide, axis=0, dtype=wide.dtype)


def check_results(results: list[np.ndarray], want: np.ndarray, rtol: float) -> None:
    for got in results:
        assert got.tobytes() == results[0].tobytes(), "ranks disagree bit for bit"
    if want.dtype.kind == "f":
        np.testing.assert_allclose(results[0], want, rtol=rtol, atol=rtol)
    else:
        np.testing.assert_array_equal(results[0], want)


def test_sizes_between_the_thresholds_take_halving_doubling_on_4_ranks() -> None:
    with Cluster(4) as cluster:
        picked = {
            count: cluster.results(tasks.allreduce_algorithm, count, 4)
            for count in (SMALL, SMALL + 1, HALVING, HALVING + 1)
        }
    assert picked == {
        SMALL: ["recursive-doubling"] * 4,
        SMALL + 1: ["halving-doubling"] * 4,
        HALVING: ["halving-doubling"] * 4,
        HALVING + 1: ["ring"] * 4,
    }


def test_frames_must_fit_the_gpu_staging_twice() -> None:
    """Half the buffer is one frame; GPU ranks stage it, so it must fit twice in RINGCORE_GPU_STAGING_BYTES."""
    with Cluster(4, env={"RINGCORE_GPU_STAGING_BYTES": "1M"}) as cluster:
        fits = cluster.results(tasks.allreduce_algorithm, 262_144, 4)  # 1 MiB: 512 KiB frames
        too_big = cluster.results(tasks.allreduce_algorithm, 262_146, 4)
    assert fits == ["halving-doubling"] * 4
    assert too_big == ["ring"] * 4


def test_three_ranks_keep_the_ring_six_fold_two_extras_in() -> None:
    """At N=6 ranks 4 and 5 fold in and out: up to a quarter of the threshold, frames fitting the staging twice."""
    with Cluster(3) as cluster:
        assert cluster.results(tasks.allreduce_algorithm, 100_000, 4) == ["ring"] * 3
    with Cluster(6) as cluster:
        assert cluster.results(tasks.allreduce_algorithm, HALVING // 4, 4) == ["halving-doubling"] * 6
        assert cluster.results(tasks.allreduce_algorithm, HALVING // 4 + 1, 4) == ["ring"] * 6
    with Cluster(6, env={"RINGCORE_GPU_STAGING_BYTES": "1M"}) as cluster:
        fits = cluster.results(tasks.allreduce_algorithm, 131_072, 4)  # 512 KiB: whole frames fit twice
        too_big = cluster.results(tasks.allreduce_algorithm, 131_073, 4)
    assert fits == ["halving-doubling"] * 6
    assert too_big == ["ring"] * 6


@pytest.mark.parametrize("size", [4, 6, 8])
def test_halving_doubling_matches_numpy(size: int) -> None:
    rng = np.random.default_rng(size)
    count = 50_001  # 200 KB of float32: above the small path, odd so halves are uneven
    cases = [
        (np.float32, "sum", None, 1e-5),
        (np.float32, "avg", None, 1e-5),
        (np.float64, "max", None, 0.0),
        (np.float32, "sum", "fp16", 2e-2),
        (np.int32, "sum", None, 0.0),
        (np.int64, "prod", None, 0.0),
        (np.uint8, "min", None, 0.0),
    ]
    with Cluster(size) as cluster:
        assert cluster.results(tasks.allreduce_algorithm, count, 4) == ["halving-doubling"] * size
        for dtype, op, compression, rtol in cases:
            if np.dtype(dtype).kind == "f":
                inputs = [rng.standard_normal(count).astype(dtype) for _ in range(size)]
            else:
                inputs = [rng.integers(-3, 4, count).astype(dtype) for _ in range(size)]
            results = cluster.results(tasks.allreduce, inputs, op, compression, timeout=60)
            check_results(results, reference(inputs, op).astype(dtype), rtol)


def test_sliced_buffer_on_4_ranks_runs_a_ring_per_slice() -> None:
    rng = np.random.default_rng(11)
    inputs = [rng.standard_normal(300_000).astype(np.float32) for _ in range(4)]
    with Cluster(4, env={"RINGCORE_SLICE_BYTES": "256K"}) as cluster:
        reports = cluster.results(tasks.allreduce_recording_algorithms, inputs, timeout=60)
        whole = cluster.results(tasks.allreduce_recording_algorithms, [x[:60_000] for x in inputs])
    check_results([r for r, _ in reports], reference(inputs, "sum").astype(np.float32), 1e-5)
    for _, picked in reports:
        assert picked == ["ring"] * 5, picked  # 1.2 MB in slices of 256 KiB
    assert [picked for _, picked in whole] == [["halving-doubling"]] * 4  # 240 KB: one slice


def start_rank(rank: int, size: int, port: int, env: dict[str, str]) -> subprocess.Popen:
    """A rank in a fresh interpreter that runs ``ringcore.init()`` and prints its error, if any."""
    script = textwrap.dedent(
        """
        import json, ringcore
        try:
            ringcore.init()
            print(json.dumps({"error": None}))
        except Exception as err:
            print(json.dumps({"error": type(err).__name__, "message": str(err)}))
        """
    )
    base = {k: v for k, v in os.environ.items() if not k.startswith("RINGCORE_")}
    ids = {"RINGCORE_RANK": str(rank), "RINGCORE_SIZE": str(size), "RINGCORE_PORT": str(port)}
    full = {**base, **ids, "RINGCORE_ADDR": "127.0.0.1", "RINGCORE_SECRET": "t", **env}
    return subprocess.Popen([sys.executable, "-c", script], env=full, stdout=subprocess.PIPE, text=True)


def test_ranks_that_disagree_on_the_threshold_fail_at_init_naming_them() -> None:
    """Otherwise one rank would run halving-doubling, the rest the ring, and all would wait out the timeout."""
    port = free_port()
    ranks = [start_rank(r, 4, port, {"RINGCORE_HALVING_BYTES": "0"} if r == 3 else {}) for r in range(4)]
    reports = [json.loads(proc.communicate(timeout=60)[0].strip().splitlines()[-1]) for proc in ranks]
    for report in reports:
        assert report["error"] == "ConfigError", report
        message = report["message"]
        assert "RINGCORE_HALVING_BYTES" in message and "ranks 0-2 say 4194304" in message, message
        assert "rank 3 says 0" in message, message


@pytest.mark.parametrize(
    ("size", "victim", "atomic"),
    [(4, 2, "0"), (6, 4, "0"), (4, 2, "1")],  # 4 of 6 is an extra: it folds into 0
)
def test_dead_peer_mid_halving_doubling_fails_every_survivor_naming_it(
    size: int, victim: int, atomic: str, tmp_path: Path
) -> None:
    """Every survivor names the dead rank; its buffer is untouched outside the range its note gives.

    In place (the default) the last halving combine and the doubling steps
    write the caller's buffer, so the note may name all of it; with
    ``RINGCORE_ATOMIC=1`` the result is copied out after the last step, so
    a failed run leaves the buffer as it was. The victim kills itself halfway
    through its sends of the second allreduce.
    """
    count = 250_000  # 1 MB: halving-doubling, a few ms per allreduce
    survivors = [r for r in range(size) if r != victim]
    fault = (victim, "kill9", str(tmp_path / "killed_at"), 0.5)
    with Cluster(size, env={"RINGCORE_TIMEOUT": "20", "RINGCORE_ATOMIC": atomic}) as cluster:
        doomed = Background(
            cluster, tasks.allreduce_until_failure, count, 3, fault, ranks=[victim], timeout=90
        )
        working = Background(
            cluster, tasks.allreduce_until_failure, count, 3, fault, ranks=survivors, timeout=90
        )
        reports = working.join(60)
        (victim_report,) = doomed.join(30)
    assert isinstance(victim_report, RankError) and victim_report.type_name == "dead", victim_report
    for rank, report in zip(survivors, reports, strict=True):
        assert not isinstance(report, RankError), (rank, report)
        assert report["error"] == qualified(ringcore.PeerFailure), (rank, report)
        assert report["peer"] == victim and f"rank {victim}" in report["message"], (rank, report)
        assert report["rounds"] > 0, (rank, report)
        assert report["untouched"], (rank, report)
        allowed = [None, (0, 0)] if atomic == "1" else [None, (0, 0), (0, count)]
        assert report["exposed"] in allowed, (rank, report)


def test_an_extra_rank_that_mismatches_fails_every_rank_naming_it() -> None:
    """At N=6 rank 5 folds into rank 1: only rank 1 hears from it, yet every rank must name it."""
    good = ("allreduce", (np.ones(50_001, np.float32),), {})
    calls = [good] * 5 + [("allreduce", (np.ones(50_001, np.float64),), {})]
    with Cluster(6, env={"RINGCORE_TIMEOUT": "10"}) as cluster:
        reports = cluster.run(tasks.mismatch_then_retry, calls, timeout=60)
    assert not any(isinstance(report, RankError) for report in reports), reports
    for rank, report in enumerate(reports):
        assert report["error"] == qualified(ringcore.MismatchError), (rank, report)
        for words in ("dtype", "ranks 0-4 passed float32", "rank 5 passed float64"):
            assert words in report["message"], (rank, report["message"])
        assert report["untouched"], rank
