"""The executor over the zero-capacity loopback transport: every rank is a thread.

A send completes only when the matching receive is posted, so any
send-before-receive ordering bug deadlocks here and surfaces as a
CollectiveTimeout. Segment sizes of a few elements force the multi-segment
pipeline, and 2-3 channels exercise the per-channel routing. Results are
compared with numpy and committed the way ``ringcore.plans`` do.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from ringcore.algo import broadcast as chain
from ringcore.algo import halving_doubling, recursive_doubling, ring
from ringcore.algo.execute import Executor
from ringcore.algo.steps import Buf, Schedule, chunk_bounds
from ringcore.buffers import DTYPES, DType
from ringcore.errors import CollectiveTimeout, PeerFailure
from ringcore.kernels.numpy_ops import Reducer
from ringcore.ops import Compression, ReduceOp
from ringcore.transport.loopback import LoopbackNetwork

pytestmark = pytest.mark.timeout(60)

RUN_TIMEOUT = 10.0  # seconds without progress before an executor gives up
ALLREDUCES = {"ring": ring.allreduce, "recursive_doubling": recursive_doubling.allreduce}
HALVING = {
    "halving_doubling": lambda rank, size, count, _itemsize, _segment: halving_doubling.allreduce(
        rank, size, count
    )
}
SIGNATURE = 0x5EED


def scratch_arrays(
    schedule: Schedule, user: np.ndarray, wire_dtype: np.dtype, reducer: Reducer | None = None
) -> dict[Buf, np.ndarray]:
    """As ``Communicator.scratch_arrays`` (garbage-filled) plus the prefill the allreduce plan does."""
    arrays = {Buf.USER: user}
    for buf in schedule.buffers - {Buf.USER}:
        arrays[buf] = np.full(user.size, 0x7F, np.uint8).repeat(wire_dtype.itemsize).view(wire_dtype)
    if Buf.WORK not in arrays:
        arrays[Buf.WORK] = np.empty(0, wire_dtype)
    if schedule.prefill_work:
        if reducer is None:
            np.copyto(arrays[Buf.WORK], user, casting="unsafe")
        else:
            reducer.convert(arrays[Buf.WORK], user)
    return arrays


def run_ranks(size: int, body: Callable[[int, LoopbackNetwork], object], channels: int = 1) -> list[object]:
    """Run ``body(rank, network)`` on one daemon thread per rank; re-raise the first error."""
    network = LoopbackNetwork(size, channels)
    results: list[object] = [None] * size
    errors: list[BaseException | None] = [None] * size

    def target(rank: int) -> None:
        try:
            results[rank] = body(rank, network)
        except BaseException as err:
            errors[rank] = err

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=RUN_TIMEOUT * 4)
    assert not any(t.is_alive() for t in threads), "a rank thread did not finish"
    for err in errors:
        if err is not None:
            raise err
    return results


def execute(network: LoopbackNetwork, rank: int, schedule: Schedule, arrays: dict, reducer: Reducer) -> None:
    Executor(network.transport(rank), schedule, arrays, reducer, 7, SIGNATURE, RUN_TIMEOUT).run()


def allreduce_all(
    inputs: list[np.ndarray],
    dtype: DType,
    op: ReduceOp,
    algorithm: str,
    segment_bytes: int,
    channels: int = 1,
    compression: Compression = Compression.NONE,
    delays: list[float] | None = None,
) -> list[np.ndarray]:
    """Allreduce ``inputs`` (one per rank) and commit into copies of them, as plan_allreduce does.

    ``delays``: seconds each rank waits before it starts.
    """
    size, count = len(inputs), inputs[0].size
    make = {**ALLREDUCES, **HALVING}[algorithm]

    def body(rank: int, network: LoopbackNetwork) -> np.ndarray:
        if delays:
            time.sleep(delays[rank])
        user = inputs[rank].copy()
        reducer = Reducer(dtype, op, compression, size)
        schedule = make(rank, size, count, reducer.wire_dtype.itemsize, segment_bytes)
        arrays = scratch_arrays(schedule, user, reducer.wire_dtype, reducer)
        execute(network, rank, schedule, arrays, reducer)
        result = schedule.result
        reducer.convert(user, arrays[result.buf][result.start : result.start + result.count])
        return user

    return run_ranks(size, body, channels)  # type: ignore[return-value]


def reference(inputs: list[np.ndarray], op: ReduceOp) -> np.ndarray:
    stacked = np.stack(inputs)
    if op is ReduceOp.SUM:
        return stacked.sum(axis=0, dtype=stacked.dtype)
    if op is ReduceOp.PROD:
        return stacked.prod(axis=0, dtype=stacked.dtype)
    if op is ReduceOp.MIN:
        return stacked.min(axis=0)
    if op is ReduceOp.MAX:
        return stacked.max(axis=0)
    return (stacked.astype(np.float64).sum(axis=0) / len(inputs)).astype(stacked.dtype)


def int_inputs(size: int, count: int, seed: int, dtype: str = "int32") -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(-1000, 1000, count).astype(dtype) for _ in range(size)]


# --------------------------------------------------------------------------- allreduce


@pytest.mark.parametrize("algorithm", sorted(ALLREDUCES))
@pytest.mark.parametrize("size", range(2, 9))
@pytest.mark.parametrize("channels", [1, 3])
def test_allreduce_matches_numpy(algorithm: str, size: int, channels: int) -> None:
    for count in (0, 1, size - 1, 64, 257):
        for op, segment_bytes in ((ReduceOp.SUM, 4), (ReduceOp.MAX, 12), (ReduceOp.PROD, 64)):
            inputs = int_inputs(size, count, seed=count * 31 + size)
            results = allreduce_all(inputs, DTYPES["int32"], op, algorithm, segment_bytes, channels)
            want = reference(inputs, op)
            for got in results:
                np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("algorithm", sorted(ALLREDUCES))
@pytest.mark.parametrize("size", [3, 5, 8])
def test_allreduce_floats_and_avg(algorithm: str, size: int) -> None:
    rng = np.random.default_rng(size)
    inputs = [rng.standard_normal(101) for _ in range(size)]
    for op in (ReduceOp.AVG, ReduceOp.MIN, ReduceOp.SUM):
        results = allreduce_all(inputs, DTYPES["float64"], op, algorithm, 40, channels=2)
        for got in results:
            np.testing.assert_allclose(got, reference(inputs, op), rtol=1e-12, atol=1e-12)
        for got in results[1:]:
            assert got.tobytes() == results[0].tobytes()


def test_many_segments_per_chunk() -> None:
    """One element per segment (4-byte segments, 200 elements on 3 ranks): deep pipelines."""
    inputs = int_inputs(3, 200, seed=9)
    for algorithm in ALLREDUCES:
        for got in allreduce_all(inputs, DTYPES["int32"], ReduceOp.SUM, algorithm, 4, channels=2):
            np.testing.assert_array_equal(got, reference(inputs, ReduceOp.SUM))


def test_back_to_back_collectives_reuse_the_transport() -> None:
    """Several collectives on the same transports (and cached programs), seq numbers increasing."""
    size, count = 4, 50
    inputs = int_inputs(size, count, seed=1)

    def body(rank: int, network: LoopbackNetwork) -> list[np.ndarray]:
        transport = network.transport(rank)
        outs = []
        for seq in range(1, 6):
            reducer = Reducer(DTYPES["int32"], ReduceOp.SUM, Compression.NONE, size)
            schedule = ring.allreduce(rank, size, count, 4, 16)
            user = inputs[rank] * seq
            arrays = scratch_arrays(schedule, user, reducer.wire_dtype, reducer)
            Executor(transport, schedule, arrays, reducer, seq, SIGNATURE, RUN_TIMEOUT).run()
            outs.append(arrays[Buf.WORK].copy())
        return outs

    for outs in run_ranks(size, body, channels=2):
        for seq, got in enumerate(outs, start=1):  # type: ignore[arg-type]
            np.testing.assert_array_equal(got, reference(inputs, ReduceOp.SUM) * seq)


# --------------------------------------------------------------------------- compression and bfloat16


def fp16_bound(inputs: list[np.ndarray]) -> np.ndarray:
    size = len(inputs)
    magnitude = np.sum([np.abs(x.astype(np.float64)) for x in inputs], axis=0)
    return (size + 1) * 2.0**-11 * magnitude + 1e-6


@pytest.mark.parametrize("algorithm", sorted(ALLREDUCES))
@pytest.mark.parametrize("size", [2, 3, 5, 8])
def test_fp16_compression_bitwise_identical_and_bounded(algorithm: str, size: int) -> None:
    """Every rank ends with the same bits, within one fp16 rounding per hop of the exact sum.

    Known to fail for recursive doubling (see the report): each side of a pair combines its
    own full-precision vector with the partner's fp16 copy, so the two sides round different
    operands.
    """
    rng = np.random.default_rng(size)
    count = 203
    inputs = [rng.standard_normal(count).astype(np.float32) for _ in range(size)]
    results = allreduce_all(
        inputs, DTYPES["float32"], ReduceOp.SUM, algorithm, 64, channels=2, compression=Compression.FP16
    )
    exact = np.sum([x.astype(np.float64) for x in inputs], axis=0)
    for got in results:
        assert got.dtype == np.float32
        assert np.all(np.abs(got - exact) <= fp16_bound(inputs))
    for got in results[1:]:
        assert got.tobytes() == results[0].tobytes()


@pytest.mark.parametrize("size", [4, 6, 8])
def test_halving_doubling_matches_numpy(size: int) -> None:
    """Whole steps: one frame per step on the first channel, whatever the segment size."""
    for count in (size, size + 1, 64, 257):
        for op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.PROD):
            inputs = int_inputs(size, count, seed=count * 17 + size)
            results = allreduce_all(inputs, DTYPES["int32"], op, "halving_doubling", 64)
            for got in results:
                np.testing.assert_array_equal(got, reference(inputs, op))


@pytest.mark.parametrize("size", [4, 5, 8])
def test_halving_doubling_fp16_bitwise_identical_and_bounded(size: int) -> None:
    rng = np.random.default_rng(size)
    inputs = [rng.standard_normal(203).astype(np.float32) for _ in range(size)]
    results = allreduce_all(
        inputs, DTYPES["float32"], ReduceOp.SUM, "halving_doubling", 64, compression=Compression.FP16
    )
    exact = np.sum([x.astype(np.float64) for x in inputs], axis=0)
    for got in results:
        assert np.all(np.abs(got - exact) <= fp16_bound(inputs))
        assert got.tobytes() == results[0].tobytes()


def test_halving_doubling_combines_in_step_order_when_a_later_partner_is_early() -> None:
    """Rank 0's first partner (rank 2) starts late, so its second partner's half arrives first.

    That half lands inside the region the first step still has to combine: it
    must wait until that step is done (whole steps post receives in order).
    """
    inputs = int_inputs(4, 1000, seed=3)
    results = allreduce_all(
        inputs, DTYPES["int32"], ReduceOp.SUM, "halving_doubling", 64, delays=[0.0, 0.0, 0.3, 0.0]
    )
    for got in results:
        np.testing.assert_array_equal(got, reference(inputs, ReduceOp.SUM))


def test_fp16_compression_ring_float64() -> None:
    size = 4
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal(77) for _ in range(size)]
    results = allreduce_all(inputs, DTYPES["float64"], ReduceOp.AVG, "ring", 16, compression=Compression.FP16)
    exact = np.mean(inputs, axis=0)
    for got in results:
        assert np.all(np.abs(got - exact) <= fp16_bound(inputs) / size)
        assert got.tobytes() == results[0].tobytes()


def to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 values that are exact in bfloat16 -> their bfloat16 bits."""
    bits = values.astype(np.float32).view(np.uint32)
    assert np.all(bits & 0xFFFF == 0), "test data must be exact in bfloat16"
    return (bits >> 16).astype(np.uint16)


def from_bf16_bits(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


@pytest.mark.parametrize("algorithm", sorted(ALLREDUCES))
@pytest.mark.parametrize("size", [2, 3, 6])
def test_bfloat16_small_integers_exact(algorithm: str, size: int) -> None:
    """Integers up to 64 in magnitude are exact in bfloat16, so any order of sums is exact."""
    rng = np.random.default_rng(size)
    values = [rng.integers(-8, 9, 90).astype(np.float32) for _ in range(size)]
    inputs = [to_bf16_bits(v) for v in values]
    for op in (ReduceOp.SUM, ReduceOp.MAX):
        results = allreduce_all(inputs, DTYPES["bfloat16"], op, algorithm, 6, channels=2)
        want = reference(values, op)
        for got in results:
            assert got.dtype == np.uint16
            np.testing.assert_array_equal(from_bf16_bits(got), want)


@pytest.mark.parametrize("algorithm", sorted(ALLREDUCES))
def test_bfloat16_random_bounded_and_identical(algorithm: str) -> None:
    size = 5
    rng = np.random.default_rng(11)
    raw = [rng.standard_normal(150).astype(np.float32) for _ in range(size)]
    inputs = [(x.view(np.uint32) >> 16).astype(np.uint16) for x in raw]  # truncated to bfloat16
    values = [from_bf16_bits(b).astype(np.float64) for b in inputs]
    results = allreduce_all(inputs, DTYPES["bfloat16"], ReduceOp.SUM, algorithm, 32)
    exact = np.sum(values, axis=0)
    bound = (size + 1) * 2.0**-8 * np.sum(np.abs(values), axis=0) + 1e-30
    for got in results:
        assert np.all(np.abs(from_bf16_bits(got) - exact) <= bound)
        assert got.tobytes() == results[0].tobytes()


# --------------------------------------------------------------------------- reduce_scatter, allgather


@pytest.mark.parametrize("size", range(2, 9))
def test_reduce_scatter(size: int) -> None:
    for count in (0, 1, size + 1, 130):
        chunks = tuple(chunk_bounds(count, size))
        inputs = int_inputs(size, count, seed=count + 5 * size, dtype="int64")

        def body(
            rank: int, network: LoopbackNetwork, chunks: tuple = chunks, inputs: list = inputs
        ) -> np.ndarray:
            reducer = Reducer(DTYPES["int64"], ReduceOp.SUM, Compression.NONE, size)
            schedule = ring.reduce_scatter(rank, size, chunks, 8, 24)
            arrays = scratch_arrays(schedule, inputs[rank].copy(), reducer.wire_dtype, reducer)
            execute(network, rank, schedule, arrays, reducer)
            start, n = chunks[rank]
            out = np.empty(n, np.int64)
            reducer.convert(out, arrays[Buf.WORK][start : start + n])
            return out

        want = reference(inputs, ReduceOp.SUM)
        for rank, got in enumerate(run_ranks(size, body, channels=2)):
            start, n = chunks[rank]
            np.testing.assert_array_equal(got, want[start : start + n])


@pytest.mark.parametrize("size", range(1, 9))
def test_allgather_uneven(size: int) -> None:
    rows = [(3 * r) % 4 for r in range(size)]  # includes ranks with no rows
    row_count = 3
    starts = np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(int)
    chunks = tuple((int(s) * row_count, n * row_count) for s, n in zip(starts, rows, strict=True))
    total = sum(rows) * row_count
    full = np.arange(total, dtype=np.float32) * 0.5

    def body(rank: int, network: LoopbackNetwork) -> np.ndarray:
        out = np.full(total, np.nan, np.float32)
        start, n = chunks[rank]
        out[start : start + n] = full[start : start + n]
        reducer = Reducer(DTYPES["float32"], ReduceOp.SUM, Compression.NONE, size)
        execute(network, rank, ring.allgather(rank, size, chunks, 4, 8), {Buf.WORK: out}, reducer)
        return out

    for got in run_ranks(size, body, channels=3):
        np.testing.assert_array_equal(got, full)


# --------------------------------------------------------------------------- broadcast, barrier


@pytest.mark.parametrize("size", range(2, 9))
def test_broadcast_every_root(size: int) -> None:
    for count in (0, 1, 37):
        for root in range(size):
            payload = np.arange(count, dtype=np.int16) * 3 - 5

            def body(
                rank: int, network: LoopbackNetwork, root: int = root, payload=payload, count: int = count
            ) -> np.ndarray:
                user = payload.copy() if rank == root else np.full(count, -1, np.int16)
                reducer = Reducer(DTYPES["int16"], ReduceOp.SUM, Compression.NONE, size)
                schedule = chain.broadcast(rank, size, root, count, 2, 6)
                arrays = scratch_arrays(schedule, user, np.dtype(np.int16))
                execute(network, rank, schedule, arrays, reducer)
                if schedule.result is not None:
                    np.copyto(user, arrays[Buf.WORK])
                return user

            for got in run_ranks(size, body, channels=2):
                np.testing.assert_array_equal(got, payload)


@pytest.mark.parametrize("size", range(1, 9))
def test_barrier_completes(size: int) -> None:
    def body(rank: int, network: LoopbackNetwork) -> int:
        empty = np.empty(0, np.uint8)
        reducer = Reducer(DTYPES["uint8"], ReduceOp.SUM, Compression.NONE, size)
        for seq in (1, 2):
            schedule = chain.barrier(rank, size)
            Executor(network.transport(rank), schedule, {Buf.WORK: empty}, reducer, seq, 1, RUN_TIMEOUT).run()
        return rank

    assert run_ranks(size, body) == list(range(size))


@pytest.mark.timeout(30)
def test_barrier_waits_for_the_last_rank() -> None:
    """No rank leaves the barrier before the late rank has entered it."""
    size = 5
    entered = threading.Event()
    left_early: list[int] = []

    def body(rank: int, network: LoopbackNetwork) -> None:
        if rank == 3:
            entered.wait(0.3)  # the others are in the barrier by now, and must still be there
            entered.set()
        reducer = Reducer(DTYPES["uint8"], ReduceOp.SUM, Compression.NONE, size)
        executor = Executor(network.transport(rank), chain.barrier(rank, size), {Buf.WORK: np.empty(0, np.uint8)},
                            reducer, 1, 1, RUN_TIMEOUT)  # fmt: skip
        executor.run()
        if not entered.is_set():
            left_early.append(rank)

    run_ranks(size, body)
    assert left_early == []


# --------------------------------------------------------------------------- failures


@pytest.mark.timeout(30)
@pytest.mark.parametrize("algorithm", sorted(ALLREDUCES))
def test_missing_rank_times_out(algorithm: str) -> None:
    size, count = 3, 40
    network = LoopbackNetwork(size)
    errors: dict[int, BaseException] = {}

    def target(rank: int) -> None:
        reducer = Reducer(DTYPES["float32"], ReduceOp.SUM, Compression.NONE, size)
        schedule = ALLREDUCES[algorithm](rank, size, count, 4, 32)
        arrays = scratch_arrays(schedule, np.ones(count, np.float32), reducer.wire_dtype, reducer)
        try:
            Executor(network.transport(rank), schedule, arrays, reducer, 1, SIGNATURE, 0.5).run()
        except BaseException as err:
            errors[rank] = err

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in (0, 1)]  # rank 2 never runs
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    assert not any(t.is_alive() for t in threads)
    assert sorted(errors) == [0, 1]
    for err in errors.values():
        assert isinstance(err, CollectiveTimeout)
        assert "no progress for 0.5 s" in str(err)
        assert "rank" in str(err)


@pytest.mark.timeout(30)
def test_signature_mismatch_fails_the_receiver() -> None:
    """Ranks that disagree (different signatures) fail instead of reducing each other's data."""
    from ringcore.transport.base import FrameMismatch

    size, count = 2, 8
    network = LoopbackNetwork(size)
    errors: dict[int, BaseException] = {}

    def target(rank: int) -> None:
        reducer = Reducer(DTYPES["float32"], ReduceOp.SUM, Compression.NONE, size)
        schedule = ring.allreduce(rank, size, count, 4, 1 << 20)
        arrays = scratch_arrays(schedule, np.ones(count, np.float32), reducer.wire_dtype, reducer)
        try:
            Executor(network.transport(rank), schedule, arrays, reducer, 1, 100 + rank, 1.0).run()
        except BaseException as err:
            errors[rank] = err

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    assert not any(t.is_alive() for t in threads)
    assert sorted(errors) == [0, 1]
    assert all(isinstance(e, FrameMismatch) and e.field == "signature" for e in errors.values())


class PeerGoneAfter:
    """A transport whose progress sleeps ``nap`` seconds, then finds rank 1 gone.

    With a nap longer than the executor's timeout it plays a rank that was
    stopped (SIGSTOP, a starved host) while its peers timed out and closed.
    """

    def __init__(self, inner: object, nap: float) -> None:
        self.inner = inner
        self.nap = nap

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def progress(self, timeout: float) -> bool:
        time.sleep(self.nap)
        raise PeerFailure("rank 1 (peer:1) closed the connection", 1, "peer:1")


def run_alone(kind: type, nap: float, timeout: float = 0.3) -> BaseException:
    """Rank 0 of 2 runs a small allreduce over :class:`PeerGoneAfter`; returns what it raised."""
    network = LoopbackNetwork(2)
    reducer = Reducer(DTYPES["int32"], ReduceOp.SUM, Compression.NONE, 2)
    schedule = recursive_doubling.allreduce(0, 2, 4, 4, 1 << 20)
    arrays = scratch_arrays(schedule, np.ones(4, np.int32), reducer.wire_dtype, reducer)
    transport = PeerGoneAfter(network.transport(0), nap)
    with pytest.raises((PeerFailure, CollectiveTimeout)) as caught:
        kind(transport, schedule, arrays, reducer, 5, SIGNATURE, timeout).run()
    return caught.value


@pytest.mark.timeout(30)
def test_a_rank_that_did_not_run_past_its_timeout_reports_the_timeout() -> None:
    """Its peers gave up on it and closed; the closed connection is not the cause."""
    late = run_alone(Executor, nap=0.5)
    assert isinstance(late, CollectiveTimeout), late
    assert "no progress for 0.3 s" in str(late) and "did not run" in str(late), late
    assert "rank 1 (peer:1) closed the connection" in str(late), late
    # A peer that fails while this rank is running is the cause; a long timeout, so that a loaded
    # machine pausing this thread cannot make it look late.
    fresh = run_alone(Executor, nap=0.0, timeout=10.0)
    assert isinstance(fresh, PeerFailure) and fresh.peer == 1, fresh
