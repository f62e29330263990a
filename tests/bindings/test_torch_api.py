"""ringcore.torch's Horovod API over real processes: every collective against numpy, gradients, errors."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from tests.bindings import hvd_tasks
from tests.cluster import Cluster

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module", params=[2, 3])
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    with Cluster(request.param, timeout=120) as cluster:
        yield cluster


def inputs(n: int, shape: tuple[int, ...], seed: int, integers: bool = False) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if integers:
        return [rng.integers(-50, 50, size=shape).astype(np.float64) for _ in range(n)]
    return [rng.standard_normal(shape) for _ in range(n)]


REFERENCE = {
    "sum": lambda xs: np.sum(xs, axis=0),
    "average": lambda xs: np.mean(xs, axis=0),
    "min": lambda xs: np.min(xs, axis=0),
    "max": lambda xs: np.max(xs, axis=0),
    "product": lambda xs: np.prod(xs, axis=0),
}


@pytest.mark.parametrize("op", sorted(REFERENCE))
@pytest.mark.parametrize("in_place", [True, False])
def test_allreduce_matches_numpy_for_every_op(cluster: Cluster, op: str, in_place: bool) -> None:
    xs = inputs(cluster.size, (4, 33), seed=len(op))
    expected = REFERENCE[op](np.stack([x.astype(np.float32) for x in xs]))
    for out in cluster.results(hvd_tasks.allreduce, xs, "float32", op, in_place):
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float64", "float16", "bfloat16", "int32", "int64", "uint8"])
def test_allreduce_sums_and_averages_every_dtype(cluster: Cluster, dtype: str) -> None:
    xs = [np.abs(x) for x in inputs(cluster.size, (257,), seed=3, integers=True)]
    cast = [torch.from_numpy(x).to(getattr(torch, dtype)).to(torch.float64).numpy() for x in xs]
    for op in ("sum", "average"):
        outs = cluster.results(hvd_tasks.allreduce, xs, dtype, op, True)
        if op == "sum":
            expected = np.sum(cast, axis=0)
        elif dtype.startswith(("int", "uint")):
            expected = np.floor_divide(np.sum(cast, axis=0), cluster.size)  # Horovod's integer average
        else:
            expected = np.mean(cast, axis=0)
        rtol = {"float16": 2e-3, "bfloat16": 1e-2}.get(dtype, 1e-12)
        for out in outs:
            np.testing.assert_allclose(out, expected, rtol=rtol)
        assert all(np.array_equal(out, outs[0]) for out in outs)


def test_scale_factors_and_fp16_compression(cluster: Cluster) -> None:
    xs = inputs(cluster.size, (1000,), seed=5)
    total = np.sum([x.astype(np.float32) for x in xs], axis=0)
    outs = cluster.results(
        hvd_tasks.allreduce, xs, "float32", "sum", False, {"prescale_factor": 0.5, "postscale_factor": 3.0}
    )
    for out in outs:
        np.testing.assert_allclose(out, total * 1.5, rtol=1e-5, atol=1e-5)
    outs = cluster.results(hvd_tasks.allreduce, xs, "float32", "average", True, {"compression": "fp16"})
    for out in outs:  # fp16 on the wire: one rounding per hop
        np.testing.assert_allclose(out, total / cluster.size, rtol=5e-3, atol=5e-3)
    assert all(np.array_equal(out, outs[0]) for out in outs), (
        "fp16 compression must leave ranks bit-identical"
    )


def test_in_place_allreduce_of_a_non_contiguous_tensor_writes_back(cluster: Cluster) -> None:
    n = cluster.size
    expected = (np.arange(12, dtype=np.float32).reshape(3, 4) * sum(range(1, n + 1))).astype(np.float32)
    for out in cluster.results(hvd_tasks.allreduce_non_contiguous):
        np.testing.assert_array_equal(out, expected)


def test_allgather_concatenates_ragged_rows(cluster: Cluster) -> None:
    xs = [np.full((r + 1, 3), r, np.float32) for r in range(cluster.size)]
    for out in cluster.results(hvd_tasks.allgather, xs):
        np.testing.assert_array_equal(out, np.concatenate(xs))


@pytest.mark.parametrize("in_place", [True, False])
def test_broadcast_from_a_non_zero_root(cluster: Cluster, in_place: bool) -> None:
    xs = inputs(cluster.size, (5, 7), seed=11)
    root = cluster.size - 1
    for rank, (out, tensor) in enumerate(cluster.results(hvd_tasks.broadcast, xs, root, in_place)):
        np.testing.assert_array_equal(out, xs[root])
        np.testing.assert_array_equal(tensor, xs[root] if in_place else xs[rank])


@pytest.mark.parametrize("op", ["sum", "average", "max"])
def test_reducescatter_gives_each_rank_its_rows(cluster: Cluster, op: str) -> None:
    xs = inputs(cluster.size, (11, 2), seed=13)  # 11 rows: the first ranks get one more
    full = REFERENCE[op](np.stack(xs))
    for rank, out in enumerate(cluster.results(hvd_tasks.reducescatter, xs, op)):
        np.testing.assert_allclose(out, np.array_split(full, cluster.size)[rank], rtol=1e-12)


def test_async_calls_complete_in_any_order(cluster: Cluster) -> None:
    n = cluster.size
    for rank, out in enumerate(cluster.results(hvd_tasks.async_calls)):
        scattered, broadcast, gathered, averaged, summed, *grouped = out
        ranks = np.arange(n)
        np.testing.assert_array_equal(grouped[0], np.full(2, ranks.sum(), np.float32))  # in place, Sum
        np.testing.assert_array_equal(grouped[1], np.arange(3) * (ranks + 1).sum())
        np.testing.assert_allclose(grouped[2], np.full(2, ranks.mean()))  # out of place, Average
        np.testing.assert_allclose(grouped[3], np.full(1, 2 * ranks.mean()))
        np.testing.assert_array_equal(summed, np.full(5, n * (n + 1) / 2))
        np.testing.assert_allclose(averaged, np.full(3, (n - 1) / 2))
        np.testing.assert_array_equal(gathered[:, 0], np.repeat(np.arange(n), np.arange(1, n + 1)))
        np.testing.assert_array_equal(broadcast, np.full(4, n - 1.0))
        full = np.arange(7.0) * n * (n + 1) / 2
        np.testing.assert_array_equal(scattered, np.array_split(full, n)[rank])


def test_objects_travel_by_pickle(cluster: Cluster) -> None:
    for shared, everyone in cluster.results(hvd_tasks.objects):
        assert shared == {"rank": 1, "data": [0, 1, 2, 3]}
        assert everyone == [("rank", r, "x" * r) for r in range(cluster.size)]


def test_gradients_follow_horovod(cluster: Cluster) -> None:
    """The chain rule through each collective, as Horovod defines it (y_i weighted by i+1)."""
    n = cluster.size
    weights = np.arange(1.0, 5.0)
    for rank, grads in enumerate(cluster.results(hvd_tasks.gradients)):
        k = rank + 1
        np.testing.assert_allclose(grads["sum"], k * n * weights)  # Sum's gradient: the sum of gradients
        np.testing.assert_allclose(grads["average"], k * weights)  # the average of equal gradients
        rows = np.arange(1.0, n * (n + 1) / 2 + 1)  # allgather: my rows of the averaged gradient
        offset = rank * (rank + 1) // 2
        expected = np.zeros(4)
        expected[: rank + 1] = k * rows[offset : offset + rank + 1]
        np.testing.assert_allclose(grads["allgather"], expected)
        np.testing.assert_allclose(grads["broadcast"], weights * k if rank == 1 else np.zeros(4))
        chunks = np.array_split(np.arange(4), n)
        per_rank = [np.arange(1.0, len(c) + 1) for c in chunks]
        np.testing.assert_allclose(grads["reducescatter"], k * np.concatenate(per_rank))


def test_bad_input_is_refused_before_anything_is_sent(cluster: Cluster) -> None:
    for errors in cluster.results(hvd_tasks.bad_input):
        assert errors["not a tensor"].startswith("TypeError: allreduce must be a torch.Tensor")
        assert errors["bool tensor"].startswith("TypeError") and "torch.bool" in errors["bool tensor"]
        assert (
            errors["leaf requires grad"].startswith("ValueError")
            and "no_grad" in errors["leaf requires grad"]
        )
        assert errors["adasum"].startswith("NotImplementedError: Adasum")
        assert (
            errors["scale on ints"].startswith("ValueError") and "floating-point" in errors["scale on ints"]
        )
        assert errors["root out of range"].startswith("ValueError") and "root" in errors["root out of range"]
        assert errors["0-d allgather"].startswith("ValueError")
        assert errors["unknown compression"].startswith("ValueError: unknown compression"), errors
        assert "hvd.Compression.none and hvd.Compression.fp16" in errors["unknown compression"], errors
        assert errors["optimizer op"].startswith("ValueError: DistributedOptimizer reduces")
        assert errors["not an optimizer"].startswith("TypeError")
        assert errors["after"] == str([float(cluster.size)] * 3)


def test_a_call_before_init_says_to_call_init() -> None:
    import ringcore
    import ringcore.torch as hvd

    assert not ringcore.is_initialized()
    for call in (hvd.rank, lambda: hvd.allreduce(torch.ones(2)), lambda: hvd.broadcast_object(1)):
        with pytest.raises(ringcore.RingcoreError, match=r"call hvd.init\(\)"):
            call()


def test_import_ringcore_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = "import sys, ringcore; ringcore.init(); print('torch' in sys.modules, 'jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_the_names_horovod_scripts_use_exist() -> None:
    """What horovod.torch's examples and synthetic benchmark call, so `import ringcore.torch as hvd` is the only change."""
    import ringcore.torch as hvd

    names = [
        "init",
        "shutdown",
        "is_initialized",
        "rank",
        "size",
        "local_rank",
        "local_size",
        "cross_rank",
        "cross_size",
        "Average",
        "Sum",
        "Min",
        "Max",
        "Product",
        "Adasum",
        "Compression",
        "allreduce",
        "allreduce_",
        "allreduce_async",
        "allreduce_async_",
        "synchronize",
        "poll",
        "allgather",
        "allgather_async",
        "broadcast",
        "broadcast_",
        "broadcast_async",
        "broadcast_async_",
        "reducescatter",
        "reducescatter_async",
        "broadcast_object",
        "allgather_object",
        "barrier",
        "join",
        "DistributedOptimizer",
        "broadcast_parameters",
        "broadcast_optimizer_state",
        "SyncBatchNorm",
        "nccl_built",
        "mpi_built",
        "gloo_built",
        "mpi_enabled",
        "gloo_enabled",
        "mpi_threads_supported",
        "cuda_built",
        "rocm_built",
    ]
    missing = [name for name in names if not hasattr(hvd, name)]
    assert not missing, missing
    assert hvd.Compression.fp16 is not hvd.Compression.none
    assert not hvd.nccl_built() and not hvd.mpi_built()  # ringcore is neither; scripts branch on it
