"""GPU buffers end to end with the fake device: real processes, real TCP, every op, dtype, compression.

Each rank reduces the same inputs twice, as a (fake) GPU buffer, which takes
the whole device path (``__cuda_array_interface__`` -> device plans ->
staged executor with late-running streams -> pinned slots -> TCP), and as a
host buffer; the two results must be bitwise identical on every rank. The
fake device does its arithmetic with the host's ``Reducer`` itself, so the
GPU results are also checked against numpy alone (``tests/reference.py``):
host and device agreeing on a wrong answer would pass the first check, not
this one. The ``ring`` configuration shrinks segments so a few thousand
elements cross many segments over two channels; the default one takes
recursive doubling.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from tests import tasks as host_tasks
from tests.cluster import Background, Cluster, can_own_hostname
from tests.gpu import tasks
from tests.reference import check_allreduce

# the GPU path's bits are the host ring's: pinned to the ring (a mixed job's vote: tests/integration/test_direct.py)
pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("ring_only")]

RING_ENV = {
    "RINGCORE_SMALL_BYTES": "256",
    "RINGCORE_SEGMENT_BYTES": "4K",
    "RINGCORE_CHANNELS": "2",
    "RINGCORE_GPU_STAGING_BYTES": "64K",
}
HAS_TORCH = importlib.util.find_spec("torch") is not None
DTYPES = ["float16", "float32", "float64", "bfloat16", "int8", "int32", "int64", "uint16"]
OPS = ["sum", "avg", "min", "max", "prod"]


def make_inputs(size: int, count: int, dtype: str, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if dtype == "bfloat16":
        values = rng.standard_normal((size, count)).astype(np.float32) * 4
        values[:, :3] = [np.nan, -0.0, np.inf]
        return list((values.view(np.uint32) >> 16).astype(np.uint16))
    if dtype.startswith("float"):
        values = (rng.standard_normal((size, count)) * 4).astype(dtype)
        values[:, :3] = [np.nan, -0.0, np.inf]
        return list(values)
    info = np.iinfo(dtype)
    return list(rng.integers(info.min, info.max, (size, count), dtype=dtype, endpoint=True))


def cases(size: int, count: int) -> list:
    out = []
    for i, dtype in enumerate(DTYPES):
        if dtype == "bfloat16" and not HAS_TORCH:
            continue
        for j, op in enumerate(OPS):
            floating = dtype.startswith("float") or dtype == "bfloat16"
            if op == "avg" and not floating:
                continue
            for compression in (None, "fp16") if floating else (None,):
                inputs = make_inputs(size, count, dtype, seed=100 * i + j)
                out.append((inputs, dtype == "bfloat16", op, compression))
    return out


@pytest.mark.parametrize(("size", "env", "count"), [(2, RING_ENV, 5000), (3, RING_ENV, 3001), (4, {}, 100)])
def test_gpu_path_equals_host_path(size: int, env: dict, count: int) -> None:
    with Cluster(size, env=env) as cluster:
        cluster.results(tasks.use_fake, 11)
        all_cases = cases(size, count)
        results = cluster.results(tasks.fake_vs_host, all_cases, timeout=240)
        for c, (inputs, bfloat16, op, compression) in enumerate(all_cases):
            reference = results[0][c][1]
            for rank in range(size):
                gpu, host = results[rank][c]
                label = f"case {c} ({inputs[0].dtype}, bf16={bfloat16}, {op}, {compression}) rank {rank}"
                np.testing.assert_array_equal(gpu, host, err_msg=label)
                np.testing.assert_array_equal(host, reference, err_msg=label)
            check_allreduce(reference, inputs, op, compression, bfloat16, where=f"case {c}")


def test_broadcast_every_root() -> None:
    size = 3
    with Cluster(size, env=RING_ENV) as cluster:
        cluster.results(tasks.use_fake, 5)
        inputs = [np.arange(4000, dtype=np.float64) * (r + 1) for r in range(size)]
        for root in range(size):
            for result in cluster.results(tasks.fake_broadcast, inputs, root):
                np.testing.assert_array_equal(result, inputs[root])


@pytest.mark.parametrize(
    ("case", "error", "words"),
    [
        ("read_only", "ValueError", "read-only"),
        ("non_contiguous", "ValueError", "not contiguous"),
        ("bool", "TypeError", "bool"),
        ("avg_int", "ValueError", "avg"),
        ("allgather", "TypeError", "GPU buffers"),
    ],
)
def test_bad_gpu_buffers_fail_before_sending(case: str, error: str, words: str) -> None:
    with Cluster(2) as cluster:
        cluster.results(tasks.use_fake, 0)
        for name, message in cluster.results(tasks.fake_bad_input, case):
            assert name == error and words in message, message
        assert cluster.results(tasks.fake_then_host, 10) == [2.0, 2.0]


def check_mixed_ring(
    cluster: Cluster,
    inputs: list[np.ndarray],
    where: str,
    cases: tuple[tuple[str, str | None], ...] = (("sum", None), ("avg", "fp16")),
) -> None:
    """The mixed ring (fake-GPU ranks among host ranks) gives every rank the bits of an all-host allreduce."""
    for op, compression in cases:
        results = cluster.results(tasks.mixed_ring, inputs, op, compression)
        host = cluster.results(host_tasks.allreduce, inputs, op, compression)  # every rank on the host
        for result in results:
            np.testing.assert_array_equal(
                result, host[0].view(np.uint32), err_msg=f"{where}: {op} {compression}"
            )
        check_allreduce(results[1], inputs, op, compression, where=where)


def test_mixed_ring_of_host_and_gpu_ranks_agrees() -> None:
    size = 3
    rng = np.random.default_rng(9)
    inputs = list((rng.standard_normal((size, 6000)) * 3).astype(np.float32))
    with Cluster(size, env=RING_ENV) as cluster:
        cluster.results(tasks.use_fake, 2)
        check_mixed_ring(cluster, inputs, "mixed ring", (("sum", None), ("avg", "fp16"), ("max", "fp16")))


def test_async_gpu_allreduces() -> None:
    size = 2
    rng = np.random.default_rng(1)
    inputs = [rng.standard_normal(3000).astype(np.float32) for _ in range(4)]
    with Cluster(size, env=RING_ENV) as cluster:
        cluster.results(tasks.use_fake, 3)
        got = cluster.results(tasks.fake_async, inputs)
        for i, x in enumerate(inputs):
            want = cluster.results(host_tasks.allreduce, [x] * size, "sum", "fp16" if i % 2 else None)[0]
            for rank in range(size):
                np.testing.assert_array_equal(got[rank][i], want)
            check_allreduce(got[0][i], [x] * size, "sum", "fp16" if i % 2 else None, where=f"async {i}")
        np.testing.assert_array_equal(got[0][-1], inputs[0] * size)


@pytest.mark.parametrize("atomic", ["0", "1"])
def test_dead_peer_leaves_the_gpu_buffer_untouched_except_what_the_note_names(
    atomic: str, tmp_path: Path
) -> None:
    """Rank 1 kills itself inside the second GPU allreduce, halfway through its sends.

    With RINGCORE_ATOMIC=1 the note names nothing: the staged executor restored the buffer.
    """
    env = {**RING_ENV, "RINGCORE_TIMEOUT": "10", "RINGCORE_ATOMIC": atomic}
    fault = (1, "kill9", str(tmp_path / "killed_at"), 0.5)
    with Cluster(2, env=env) as cluster:
        cluster.results(tasks.use_fake, 8)
        survivor = Background(cluster, tasks.fake_until_failure, 200_000, 3, fault, ranks=[0], timeout=60)
        Background(cluster, tasks.fake_until_failure, 200_000, 3, fault, ranks=[1], timeout=60)
        ((error, untouched, exposed),) = survivor.join()
        assert error in ("PeerFailure", "CollectiveTimeout") and untouched, (error, untouched)
        assert (exposed is None) == (atomic == "1"), exposed


SLICED_ENV = {**RING_ENV, "RINGCORE_SLICE_BYTES": "64K", "RINGCORE_TIMEOUT": "20"}


def test_mixed_ring_agrees_well_above_the_slice_size() -> None:
    """240 KB of float32 in 64 KiB slices (120 KiB with fp16 on the wire): GPU ranks slice as host ranks do."""
    size = 3
    rng = np.random.default_rng(19)
    inputs = list((rng.standard_normal((size, 60_000)) * 3).astype(np.float32))
    with Cluster(size, env=SLICED_ENV) as cluster:
        cluster.results(tasks.use_fake, 3)
        check_mixed_ring(cluster, inputs, "sliced mixed ring")
        broadcast = [np.arange(40_000, dtype=np.float64) * (r + 1) for r in range(size)]
        for result in cluster.results(tasks.fake_broadcast, broadcast, 1):
            np.testing.assert_array_equal(result, broadcast[1])


@pytest.mark.skipif(not can_own_hostname(), reason="emulated hosts need root (a UTS namespace per rank)")
def test_mixed_ring_agrees_on_the_hierarchical_path() -> None:
    """Two emulated hosts of two ranks: host and (fake) GPU ranks share the hierarchical allreduce and broadcast."""
    size = 4
    rng = np.random.default_rng(12)
    inputs = list((rng.standard_normal((size, 20_001)) * 3).astype(np.float32))
    hostnames = ["host-a", "host-b", "host-a", "host-b"]
    with Cluster(size, env={**RING_ENV, "RINGCORE_TRANSPORT": "auto"}, hostnames=hostnames) as cluster:
        cluster.results(tasks.use_fake, 4)
        check_mixed_ring(cluster, inputs, "hierarchical mixed ring", cases=(("sum", None),))
        # in place at two ranks a host the schedule's scratch is STAGE alone: no WORK pool on the device
        for rank, held in enumerate(cluster.results(tasks.device_scratch)):
            assert held == ({"STAGE": 20_001 * 4} if rank % 2 else {}), (rank, held)
        check_mixed_ring(cluster, inputs, "hierarchical mixed ring", cases=(("avg", "fp16"),))
        for root in (0, 3):
            for got in cluster.results(tasks.fake_broadcast, inputs, root):
                np.testing.assert_array_equal(got, inputs[root])
