"""The lockstep executor (one-segment schedules, step by step) over the zero-capacity loopback.

It must compute what the pipelined Executor computes, bit for bit, with the
same frames (a rank running one and its peers the other still agree), and it
must refuse the schedules it cannot run safely.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from ringcore.algo import broadcast as chain
from ringcore.algo import lockstep, recursive_doubling, ring
from ringcore.algo.execute import Executor
from ringcore.algo.lockstep import LockstepExecutor
from ringcore.algo.steps import Buf, Schedule
from ringcore.buffers import DTYPES
from ringcore.errors import CollectiveTimeout, PeerFailure
from ringcore.kernels.numpy_ops import Reducer
from ringcore.ops import Compression, ReduceOp
from ringcore.transport.base import FrameMismatch
from ringcore.transport.loopback import LoopbackNetwork
from tests.unit.test_executor import (
    RUN_TIMEOUT,
    SIGNATURE,
    int_inputs,
    reference,
    run_alone,
    run_ranks,
    scratch_arrays,
)

pytestmark = pytest.mark.timeout(60)

SEGMENT = 1 << 20  # every test schedule is one segment


def allreduce(
    inputs: list[np.ndarray],
    op: ReduceOp,
    lockstep_ranks: set[int],
    compression: Compression = Compression.NONE,
) -> list[np.ndarray]:
    """Recursive doubling on every rank; ranks in ``lockstep_ranks`` run in lockstep, the rest pipelined."""
    size, count = len(inputs), inputs[0].size
    dtype = DTYPES[inputs[0].dtype.name]

    def body(rank: int, network: LoopbackNetwork) -> np.ndarray:
        reducer = Reducer(dtype, op, compression, size)
        schedule = recursive_doubling.allreduce(rank, size, count, reducer.wire_dtype.itemsize, SEGMENT)
        user = inputs[rank].copy()
        arrays = scratch_arrays(schedule, user, reducer.wire_dtype, reducer)
        transport = network.transport(rank)
        assert lockstep.fits(schedule, transport, arrays)
        kind = LockstepExecutor if rank in lockstep_ranks else Executor
        kind(transport, schedule, arrays, reducer, 3, SIGNATURE, RUN_TIMEOUT).run()
        assert arrays[Buf.USER].tobytes() == inputs[rank].tobytes(), "USER must not be written"
        result = schedule.result
        reducer.convert(user, arrays[result.buf][result.start : result.start + result.count])
        return user

    return run_ranks(size, body)  # type: ignore[return-value]


@pytest.mark.parametrize("size", range(2, 8))
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MAX, ReduceOp.PROD])
def test_recursive_doubling_matches_numpy(size: int, op: ReduceOp) -> None:
    for count in (0, 1, 33):
        inputs = int_inputs(size, count, seed=count + size, dtype="int64")
        for got in allreduce(inputs, op, set(range(size))):
            np.testing.assert_array_equal(got, reference(inputs, op))


@pytest.mark.parametrize("size", [2, 3, 5])
def test_bitwise_identical_to_the_executor_and_mixable_with_it(size: int) -> None:
    """Same frames: a ring where some ranks run lockstep and some the Executor agrees bit for bit."""
    rng = np.random.default_rng(size)
    inputs = [rng.standard_normal(257).astype(np.float32) for _ in range(size)]
    for compression in (Compression.NONE, Compression.FP16):
        pipelined = allreduce(inputs, ReduceOp.AVG, set(), compression)
        stepped = allreduce(inputs, ReduceOp.AVG, set(range(size)), compression)
        mixed = allreduce(inputs, ReduceOp.AVG, {0}, compression)
        for results in (stepped, mixed):
            assert [r.tobytes() for r in results] == [r.tobytes() for r in pipelined]
        np.testing.assert_allclose(pipelined[0], reference(inputs, ReduceOp.AVG), rtol=1e-2, atol=1e-2)


def run_lockstep(size: int, make: object, arrays_for: object) -> list[dict[Buf, np.ndarray]]:
    def body(rank: int, network: LoopbackNetwork) -> dict[Buf, np.ndarray]:
        schedule = make(rank)  # type: ignore[operator]
        arrays = arrays_for(rank, schedule)  # type: ignore[operator]
        transport = network.transport(rank)
        assert lockstep.fits(schedule, transport, arrays)
        reducer = Reducer(DTYPES["int32"], ReduceOp.SUM, Compression.NONE, size)
        LockstepExecutor(transport, schedule, arrays, reducer, 5, SIGNATURE, RUN_TIMEOUT).run()
        return arrays

    return run_ranks(size, body)  # type: ignore[return-value]


@pytest.mark.parametrize("size", [2, 3, 6])
def test_broadcast_barrier_and_allgather(size: int) -> None:
    count = 10
    data = np.arange(count, dtype=np.int32) * 7

    def arrays(rank: int, schedule: Schedule) -> dict[Buf, np.ndarray]:
        user = data.copy() if rank == 1 else np.zeros(count, np.int32)
        return scratch_arrays(schedule, user, np.dtype(np.int32))

    for rank, got in enumerate(
        run_lockstep(size, lambda r: chain.broadcast(r, size, 1, count, 4, SEGMENT), arrays)
    ):
        result = got[Buf.USER] if rank == 1 else got[Buf.WORK]
        np.testing.assert_array_equal(result, data)

    run_lockstep(size, lambda r: chain.barrier(r, size), lambda r, s: {Buf.WORK: np.empty(0, np.uint8)})

    chunks = tuple((r * 3, 3) for r in range(size))

    def gathered(rank: int, schedule: Schedule) -> dict[Buf, np.ndarray]:
        work = np.full(3 * size, -1, np.int32)
        work[rank * 3 : rank * 3 + 3] = rank
        return {Buf.WORK: work}

    for got in run_lockstep(size, lambda r: ring.allgather(r, size, chunks, 4, SEGMENT), gathered):
        np.testing.assert_array_equal(got[Buf.WORK], np.repeat(np.arange(size, dtype=np.int32), 3))


def test_fits_refuses_what_needs_the_pipelined_executor() -> None:
    transport = LoopbackNetwork(3, 1).transport(0)
    user = np.zeros(300, np.float32)
    arrays = scratch_arrays(ring.allreduce(0, 3, 300, 4, 64, True), user, np.dtype(np.float32))
    assert not lockstep.fits(recursive_doubling.allreduce(0, 3, 300, 4, 64), transport, arrays)  # segments
    in_place = ring.allreduce(0, 3, 300, 4, SEGMENT, True)
    assert not lockstep.fits(in_place, transport, arrays, atomic=True)  # writes USER, must restore it
    assert lockstep.fits(in_place, transport, arrays)  # writes USER, no backup (tests/unit/test_in_place.py)
    assert lockstep.fits(ring.allreduce(0, 3, 300, 4, SEGMENT, False), transport, arrays)
    packed = {Buf.USER: user, Buf.WORK: np.zeros(300, np.float16)}  # sends USER in another dtype
    assert not lockstep.fits(ring.allreduce(0, 3, 300, 2, SEGMENT, False), transport, packed)


def test_a_silent_peer_times_out_naming_it() -> None:
    network = LoopbackNetwork(2, 1)
    schedule = recursive_doubling.allreduce(0, 2, 4, 4, SEGMENT)
    arrays = scratch_arrays(schedule, np.ones(4, np.int32), np.dtype(np.int32))
    reducer = Reducer(DTYPES["int32"], ReduceOp.SUM, Compression.NONE, 2)
    executor = LockstepExecutor(network.transport(0), schedule, arrays, reducer, 9, SIGNATURE, 0.3)
    with pytest.raises(CollectiveTimeout, match="rank 1"):
        executor.run()


def test_disagreeing_broadcast_roots_are_caught_over_rdma() -> None:
    """Rank 0 thinks it is the root, ranks 1-2 think rank 1 is: rank 1 never receives from rank 0.

    Over RDMA a send waits for the receiver's announcement, so only rank 0's early-posted
    acknowledgement receive (announced with its signature) lets rank 1 see the disagreement;
    without it every rank would wait for the timeout.
    """
    from tests.conformance.test_transport import rdma_fake_mesh

    transports = rdma_fake_mesh(3, 1)
    roots = [0, 1, 1]
    errors: list[BaseException | None] = [None] * 3

    def body(rank: int) -> None:
        schedule = chain.broadcast(rank, 3, roots[rank], 16, 4, SEGMENT)
        arrays = scratch_arrays(schedule, np.zeros(16, np.int32), np.dtype(np.int32))
        reducer = Reducer(DTYPES["int32"], ReduceOp.SUM, Compression.NONE, 3)
        try:
            LockstepExecutor(transports[rank], schedule, arrays, reducer, 4, 1000 + roots[rank], 3.0).run()
        except BaseException as err:
            errors[rank] = err

    threads = [threading.Thread(target=body, args=(rank,), daemon=True) for rank in range(3)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    finally:
        for transport in transports:
            transport.close()
    assert isinstance(errors[1], FrameMismatch) and errors[1].field == "signature", errors


def test_a_rank_that_did_not_run_past_its_timeout_reports_the_timeout() -> None:
    late = run_alone(LockstepExecutor, nap=0.5)
    assert isinstance(late, CollectiveTimeout) and "did not run" in str(late), late
    fresh = run_alone(LockstepExecutor, nap=0.0, timeout=10.0)  # a pause of this thread is no timeout
    assert isinstance(fresh, PeerFailure) and fresh.peer == 1, fresh
