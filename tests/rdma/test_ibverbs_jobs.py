"""RDMA tests: ringcore jobs of real processes over a real verbs device (``RINGCORE_TRANSPORT=ibverbs``).

They skip with the reason unless an RDMA device is present; ``ci/rdma-vm``
runs them in a QEMU guest with Soft-RoCE (rdma_rxe), where they are real:
queue pairs, registered memory and RDMA writes through the guest kernel.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

import ringcore
from tests import tasks
from tests.cluster import Background, Cluster, RankError, qualified
from tests.rdma_support import needs_rdma

pytestmark = [pytest.mark.rdma, needs_rdma, pytest.mark.timeout(300)]

IB = {"RINGCORE_TRANSPORT": "ibverbs", "RINGCORE_TIMEOUT": "60", "RINGCORE_INIT_TIMEOUT": "90"}
RING = {
    **IB,
    "RINGCORE_SMALL_BYTES": "256",
    "RINGCORE_HALVING_BYTES": "0",
    "RINGCORE_SEGMENT_BYTES": "4K",
    "RINGCORE_CHANNELS": "2",
}


def reference(inputs: list[np.ndarray], op: str) -> np.ndarray:
    ufunc = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}[op]
    return ufunc.reduce(np.stack(inputs), axis=0)


@pytest.mark.parametrize(("size", "algorithm"), [(2, "ring"), (3, "ring"), (4, "halving-doubling")])
def test_collectives_match_numpy_over_rdma(size: int, algorithm: str) -> None:
    """Above 256 bytes: the ring (2 channels, 4 KiB segments) on 2 and 3 ranks, halving-doubling on 4."""
    rng = np.random.default_rng(size)
    env = RING if algorithm == "ring" else {**RING, "RINGCORE_HALVING_BYTES": "4M"}
    with Cluster(size, env=env, timeout=120) as cluster:
        reports = cluster.results(tasks.transport_report)
        assert {r["transport"] for r in reports} == {"RdmaTransport"}, reports
        assert cluster.results(tasks.allreduce_algorithm, 20_011, 4) == [algorithm] * size
        for dtype, op, count in [("float32", "sum", 20_011), ("int64", "max", 3), ("float64", "prod", 5000)]:
            inputs = [rng.integers(1, 4, count).astype(dtype) for _ in range(size)]
            for got in cluster.results(tasks.allreduce, inputs, op, timeout=120):
                np.testing.assert_array_equal(got, reference(inputs, op))
        inputs = [rng.standard_normal(9000).astype(np.float32) for _ in range(size)]
        for got in cluster.results(tasks.broadcast, inputs, size - 1, timeout=120):
            np.testing.assert_array_equal(got, inputs[size - 1])
        for got in cluster.results(tasks.allgather, inputs, timeout=120):
            np.testing.assert_array_equal(got, np.concatenate(inputs))
        compressed = cluster.results(tasks.allreduce, inputs, "sum", "fp16", timeout=120)
        bound = np.sum(np.abs(inputs), axis=0) * 2.0**-9 + 1e-3
        assert np.all(np.abs(compressed[0] - np.sum(inputs, axis=0)) <= bound)
        assert all(np.array_equal(c, compressed[0]) for c in compressed)


def test_auto_picks_rdma_when_every_rank_has_it() -> None:
    with Cluster(2, env={"RINGCORE_TRANSPORT": "auto"}, timeout=120) as cluster:
        assert [r["transport"] for r in cluster.results(tasks.transport_report)] == ["RdmaTransport"] * 2


def test_repeated_allreduce_of_one_tensor_registers_it_once() -> None:
    with Cluster(2, env=IB, timeout=120) as cluster:
        reports = cluster.results(tasks.repeated_allreduce, 100_000, 5, timeout=120)
    for report in reports:
        assert report["ok"], report
        assert report["after"] == report["first"], f"buffers were registered again: {report}"


def test_mismatch_fails_every_rank_over_rdma() -> None:
    calls = [("allreduce", (np.ones(n, np.float32),), {}) for n in (1000, 1001, 1000)]
    with Cluster(3, env=IB, timeout=120) as cluster:
        reports = cluster.run(tasks.mismatch_then_retry, calls, None, timeout=120)
    assert [r["error"] for r in reports] == [qualified(ringcore.MismatchError)] * 3, reports
    assert all(r["untouched"] for r in reports), reports


def test_killed_rank_gives_peer_failure_naming_it() -> None:
    with Cluster(3, env=IB, timeout=120) as cluster:
        working = Background(
            cluster, tasks.allreduce_until_failure, 50_000, 10_000, ranks=[0, 2], timeout=120
        )
        Background(cluster, tasks.allreduce_until_failure, 50_000, 10_000, ranks=[1], timeout=120)
        time.sleep(3.0)
        cluster.kill(1)
        reports = working.join(150)
    for rank, report in zip([0, 2], reports, strict=True):
        assert not isinstance(report, RankError), (rank, report)
        assert report["error"] == qualified(ringcore.PeerFailure), (rank, report)
        assert report["peer"] == 1 and "rank 1" in report["message"], (rank, report)
        assert report["untouched"], (rank, report)


def test_empty_gid_index_is_a_config_error_on_every_rank() -> None:
    env = {**IB, "RINGCORE_IB_GID_INDEX": "3"}  # Soft-RoCE on an interface without IPv4: index 3 is empty
    with pytest.raises(RuntimeError) as info:
        Cluster(2, env=env, timeout=120)
    assert "ConfigError" in str(info.value) and "RINGCORE_IB_GID_INDEX" in str(info.value)


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv to drop CAP_IPC_LOCK")
def test_locked_memory_limit_is_explained() -> None:
    """Without CAP_IPC_LOCK and with ``ulimit -l 256`` (KiB), registering 8 MiB must fail clearly."""
    script = (
        "import numpy as np, ringcore\n"
        "ringcore.init()\n"
        "try:\n"
        "    ringcore.allreduce(np.ones(2 << 20, np.float32))\n"
        "except Exception as err:\n"
        "    print('ERROR', type(err).__name__, err)\n"
    )
    runner = os.path.join(os.path.dirname(sys.executable), "ringcore-run")
    command = (
        f"ulimit -l 256; exec setpriv --inh-caps=-ipc_lock --bounding-set=-ipc_lock "
        f'{runner} -np 2 {sys.executable} -c "{script}"'
    )
    env = {**os.environ, **IB, "RINGCORE_TIMEOUT": "20"}
    done = subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True, timeout=240)
    output = done.stdout + done.stderr
    assert "ulimit -l" in output and "locked-memory limit is 256 KiB" in output, output
