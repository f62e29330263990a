"""The staged executor, every rank a thread over the zero-capacity loopback: fake device and real GPU.

The fake device runs queued copies and kernels late and in a seeded random
order (see :mod:`ringcore.device.fake`), so a send posted before its
download finished, a slot reused too early, or a combine racing a copy gives
wrong bytes. Results must equal the host executor's bit for bit, for the
ring (several segments per chunk, 1-3 channels), recursive doubling,
halving-doubling and broadcast; staging memory must stay bounded by the staging size. The same
tests run against the CuPy layer where a GPU is available.
"""

from __future__ import annotations

import numpy as np
import pytest

from ringcore.algo import broadcast as chain
from ringcore.algo import halving_doubling, hierarchical, recursive_doubling, ring
from ringcore.algo.execute import Executor
from ringcore.algo.steps import Buf
from ringcore.buffers import DTYPES
from ringcore.device.fake import FakeDeviceArray
from ringcore.device.staging import StagedExecutor, Staging
from ringcore.errors import CollectiveTimeout
from ringcore.kernels.numpy_ops import Reducer
from ringcore.ops import Compression, ReduceOp
from ringcore.transport.loopback import LoopbackNetwork
from tests.gpu.gpu import make_layer, to_device, to_host
from tests.unit.test_executor import RUN_TIMEOUT, SIGNATURE, run_ranks, scratch_arrays

pytestmark = pytest.mark.timeout(120)
LAYERS = ["fake", pytest.param("cupy", marks=pytest.mark.gpu)]


def inputs(size: int, count: int, dtype: str, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    storage = DTYPES[dtype].storage
    if dtype == "bfloat16":
        return [
            (rng.standard_normal(count).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
            for _ in range(size)
        ]
    if storage.kind == "f":
        return [(rng.standard_normal(count) * 10).astype(storage) for _ in range(size)]
    return [rng.integers(-1000, 1000, count).astype(storage) for _ in range(size)]


def host_allreduce(
    values: list[np.ndarray],
    dtype: str,
    op: ReduceOp,
    comp: Compression,
    algo: str,
    segment: int,
    channels: int,
    atomic: bool = True,
) -> list[np.ndarray]:
    size = len(values)

    def body(rank: int, network: LoopbackNetwork) -> np.ndarray:
        user = values[rank].copy()
        reducer = Reducer(DTYPES[dtype], op, comp, size)
        in_place = reducer.wire_dtype == user.dtype
        schedule = _schedule(algo, rank, size, user.size, reducer.wire_dtype.itemsize, segment, in_place)
        arrays = scratch_arrays(schedule, user, reducer.wire_dtype, reducer)
        with np.errstate(all="ignore"):
            Executor(
                network.transport(rank), schedule, arrays, reducer, 1, SIGNATURE, RUN_TIMEOUT, atomic=atomic
            ).run()
        if schedule.result is not None and schedule.result.buf != Buf.USER:
            reducer.convert(user, arrays[Buf.WORK])
        return user

    return run_ranks(size, body, channels)  # type: ignore[return-value]


HOST_GRIDS = {4: ((0, 1), (2, 3)), 6: ((0, 1, 2), (3, 4, 5)), 8: ((0, 1), (2, 3), (4, 5), (6, 7))}  # by size


def _schedule(algo: str, rank: int, size: int, count: int, itemsize: int, segment: int, in_place: bool):
    if algo == "hierarchical":
        return hierarchical.allreduce(rank, HOST_GRIDS[size], count, itemsize, segment, in_place)
    if algo == "ring":
        return ring.allreduce(rank, size, count, itemsize, segment, in_place)
    if algo == "halving_doubling":
        return halving_doubling.allreduce(rank, size, count, in_place)
    return recursive_doubling.allreduce(rank, size, count, itemsize, segment)


def staged_allreduce(
    kind, values, dtype, op, comp, algo, segment, channels, staging_bytes=64 << 10, atomic=True
):
    size = len(values)
    layers = [make_layer(kind, seed=rank + 17) for rank in range(size)]

    def body(rank: int, network: LoopbackNetwork) -> np.ndarray:
        layer = layers[rank]
        staging = Staging(layer, staging_bytes)
        user = to_device(layer, values[rank])
        reducer = layer.reducer(DTYPES[dtype], op, comp, size, staging.compute)
        in_place = reducer.wire_dtype == user.dtype
        schedule = _schedule(algo, rank, size, user.size, reducer.wire_dtype.itemsize, segment, in_place)
        arrays = {Buf.USER: user}
        for buf in schedule.buffers - {Buf.USER} | {Buf.WORK}:
            arrays[buf] = layer.empty(user.size, reducer.wire_dtype)
        if schedule.prefill_work:
            reducer.convert(arrays[Buf.WORK], user)
        transport = network.transport(rank)
        StagedExecutor(
            transport, schedule, arrays, reducer, 1, SIGNATURE, RUN_TIMEOUT, staging, atomic=atomic
        ).run()
        if schedule.result is not None and schedule.result.buf != Buf.USER:
            reducer.convert(user, arrays[Buf.WORK])
        layer.synchronize(staging.compute)
        assert not any(s.pending for s in getattr(layer, "streams", ()))
        return to_host(user), getattr(layer, "pinned_bytes", 0)

    out = run_ranks(size, body, channels)
    return [o[0] for o in out], [o[1] for o in out]


CASES = [
    ("float32", ReduceOp.SUM, Compression.NONE),
    ("float32", ReduceOp.AVG, Compression.FP16),
    ("float64", ReduceOp.MAX, Compression.FP16),
    ("bfloat16", ReduceOp.AVG, Compression.NONE),
    ("bfloat16", ReduceOp.SUM, Compression.FP16),
    ("float16", ReduceOp.PROD, Compression.NONE),
    ("int32", ReduceOp.MIN, Compression.NONE),
    ("int64", ReduceOp.SUM, Compression.NONE),
]


@pytest.mark.parametrize("kind", LAYERS)
@pytest.mark.parametrize(("dtype", "op", "comp"), CASES)
@pytest.mark.parametrize(("size", "channels"), [(2, 1), (3, 2), (4, 3)])
def test_ring_staged_equals_host(
    kind: str, dtype: str, op: ReduceOp, comp: Compression, size: int, channels: int
) -> None:
    values = inputs(size, 1003, dtype, seed=size)
    want = host_allreduce(values, dtype, op, comp, "ring", 256, channels)
    got, pinned = staged_allreduce(kind, values, dtype, op, comp, "ring", 256, channels, staging_bytes=1024)
    for rank in range(size):
        np.testing.assert_array_equal(
            got[rank].view(f"u{got[rank].itemsize}"), want[rank].view(f"u{want[rank].itemsize}")
        )
    # per connection (one in, one out per channel): the staging size, not the buffer size
    assert max(pinned) <= 2 * channels * 1024


@pytest.mark.parametrize("kind", LAYERS)
@pytest.mark.parametrize("size", sorted(HOST_GRIDS))
def test_hierarchical_in_place_staged_equals_host_with_few_staging_slots(kind: str, size: int) -> None:
    """A block's local and cross-host frames land in one STAGE block: with a few staging slots per
    connection the local one may be posted after the cross-host one is due, and must still land first."""
    values = inputs(size, 1 << 16, "float32", seed=size)
    args = (values, "float32", ReduceOp.SUM, Compression.NONE, "hierarchical", 8192, 1)
    want = host_allreduce(*args, atomic=False)  # in place: the schedule keeps no backups
    got, _ = staged_allreduce(kind, *args, staging_bytes=1200, atomic=False)
    for rank in range(size):
        assert got[rank].tobytes() == want[rank].tobytes()


@pytest.mark.parametrize("kind", LAYERS)
@pytest.mark.parametrize(("dtype", "op", "comp"), CASES[:4])
@pytest.mark.parametrize("size", [2, 3, 5])
def test_recursive_doubling_staged_equals_host(
    kind: str, dtype: str, op: ReduceOp, comp: Compression, size: int
) -> None:
    values = inputs(size, 37, dtype, seed=size + 7)
    want = host_allreduce(values, dtype, op, comp, "recursive_doubling", 1 << 20, 1)
    got, _ = staged_allreduce(kind, values, dtype, op, comp, "recursive_doubling", 1 << 20, 1)
    for rank in range(size):
        np.testing.assert_array_equal(
            got[rank].view(f"u{got[rank].itemsize}"), want[rank].view(f"u{want[rank].itemsize}")
        )


@pytest.mark.parametrize("kind", LAYERS)
@pytest.mark.parametrize(("dtype", "op", "comp"), CASES)
@pytest.mark.parametrize("size", [4, 6, 8])
def test_halving_doubling_staged_equals_host(
    kind: str, dtype: str, op: ReduceOp, comp: Compression, size: int
) -> None:
    values = inputs(size, 1003, dtype, seed=size + 11)
    want = host_allreduce(values, dtype, op, comp, "halving_doubling", 256, 1)
    staging = 2 * 8 * halving_doubling.largest_frame(size, 1003)  # the communicator's rule: fits twice
    got, pinned = staged_allreduce(kind, values, dtype, op, comp, "halving_doubling", 256, 1, staging)
    for rank in range(size):
        np.testing.assert_array_equal(
            got[rank].view(f"u{got[rank].itemsize}"), want[rank].view(f"u{want[rank].itemsize}")
        )
    # one connection per step's partner (and an extra's), each way: the staging size per connection and direction
    partners = (size.bit_length() - 1) + (size & (size - 1) != 0)
    assert max(pinned) <= 2 * partners * staging
    if dtype in ("float32", "int32", "int64") and comp is Compression.NONE:  # and numpy's
        ufunc = {ReduceOp.SUM: np.add, ReduceOp.MIN: np.minimum}[op]
        np.testing.assert_allclose(got[0], ufunc.reduce(np.stack(values), axis=0), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind", LAYERS)
@pytest.mark.parametrize("size", [2, 3, 4])
def test_broadcast_staged(kind: str, size: int) -> None:
    root = size - 1
    count = 777
    layers = [make_layer(kind, seed=rank) for rank in range(size)]
    source = np.arange(count, dtype=np.float32) * 1.5

    def body(rank: int, network: LoopbackNetwork) -> np.ndarray:
        layer = layers[rank]
        staging = Staging(layer, 4096)
        user = to_device(layer, source if rank == root else np.full(count, -1, np.float32))
        schedule = chain.broadcast(rank, size, root, count, 4, 512)
        arrays = {Buf.USER: user, Buf.WORK: layer.empty(count, np.dtype(np.float32))}
        reducer = layer.reducer(DTYPES["float32"], ReduceOp.SUM, Compression.NONE, size, staging.compute)
        StagedExecutor(
            network.transport(rank), schedule, arrays, reducer, 1, SIGNATURE, RUN_TIMEOUT, staging
        ).run()
        if schedule.result is not None:
            layer.copy(user, arrays[Buf.WORK], staging.compute)
        layer.synchronize(staging.compute)
        return to_host(user)

    for result in run_ranks(size, body):
        np.testing.assert_array_equal(result, source)


@pytest.mark.parametrize("kind", LAYERS)
def test_failure_restores_the_device_buffer(kind: str) -> None:
    """A rank that never shows up: the in-place ring times out and puts the caller's values back."""
    layer = make_layer(kind, seed=3)
    network = LoopbackNetwork(2, 1)
    staging = Staging(layer, 1024)
    original = np.arange(100, dtype=np.float32)
    user = to_device(layer, original)
    reducer = layer.reducer(DTYPES["float32"], ReduceOp.SUM, Compression.NONE, 2, staging.compute)
    schedule = ring.allreduce(0, 2, 100, 4, 64, True)
    arrays = {Buf.USER: user, Buf.WORK: layer.empty(100, np.dtype(np.float32))}
    with pytest.raises(CollectiveTimeout):
        StagedExecutor(network.transport(0), schedule, arrays, reducer, 1, SIGNATURE, 0.5, staging).run()
    np.testing.assert_array_equal(to_host(user), original)


def test_fake_device_array_is_not_host_memory() -> None:
    array = FakeDeviceArray(np.zeros(4, np.float32))
    with pytest.raises(TypeError):
        memoryview(array)  # type: ignore[arg-type]


@pytest.mark.timeout(30)
def test_a_staged_rank_that_did_not_run_past_its_timeout_reports_the_timeout() -> None:
    """The staged executor shares the wait loop: a rank stopped past its timeout that then finds its
    peer gone reports the timeout (its peers gave up on it); a peer that fails while it runs is the cause."""
    from ringcore.errors import PeerFailure
    from tests.unit.test_executor import PeerGoneAfter

    def run(nap: float) -> BaseException:
        layer = make_layer("fake", seed=4)
        staging = Staging(layer, 1024)
        reducer = layer.reducer(DTYPES["float32"], ReduceOp.SUM, Compression.NONE, 2, staging.compute)
        schedule = recursive_doubling.allreduce(0, 2, 4, 4, 1 << 20)
        arrays = {
            Buf.USER: to_device(layer, np.ones(4, np.float32)),
            Buf.WORK: layer.empty(4, np.dtype(np.float32)),
            Buf.STAGE: layer.empty(4, np.dtype(np.float32)),
        }
        transport = PeerGoneAfter(LoopbackNetwork(2, 1).transport(0), nap)
        with pytest.raises((PeerFailure, CollectiveTimeout)) as caught:
            StagedExecutor(transport, schedule, arrays, reducer, 5, SIGNATURE, 0.3, staging).run()
        return caught.value

    late = run(0.5)
    assert isinstance(late, CollectiveTimeout) and "did not run" in str(late), late
    fresh = run(0.0)
    assert isinstance(fresh, PeerFailure) and fresh.peer == 1, fresh
