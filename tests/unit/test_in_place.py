"""In-place allreduces: the ring's allgather and halving-doubling's doubling write the caller's buffer.

Correct results over the zero-capacity loopback transport, both with and
without ``atomic``, on the pipelined Executor and (one-segment schedules,
without ``atomic``) in lockstep, also mixed in one world; when the run fails
at any point, the caller's buffer is restored bit for bit with ``atomic``
and, without it, holds only its own values and final sums.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest

from ringcore.algo import halving_doubling, lockstep, ring
from ringcore.algo.execute import Executor
from ringcore.algo.lockstep import LockstepExecutor
from ringcore.algo.steps import Buf, Schedule
from ringcore.buffers import DTYPES
from ringcore.errors import CollectiveTimeout, PeerFailure
from ringcore.kernels.numpy_ops import Reducer
from ringcore.ops import Compression, ReduceOp
from ringcore.transport.loopback import LoopbackNetwork

pytestmark = pytest.mark.timeout(60)

Make = Callable[[int, int, int, int], Schedule]  # (rank, size, count, itemsize) -> in-place schedule


def in_place_ring(segment_bytes: int) -> Make:
    return lambda rank, size, count, itemsize: ring.allreduce(
        rank, size, count, itemsize, segment_bytes, True
    )


def in_place_halving(rank: int, size: int, count: int, itemsize: int) -> Schedule:
    return halving_doubling.allreduce(rank, size, count, True)


class FailingReducer(Reducer):
    """Lockstep's injector: the combine after ``fail_after`` of them closes the transport and raises."""

    def arm(self, transport: object, fail_after: int) -> None:
        self.transport, self.left = transport, fail_after

    def combine(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if self.left == 0:
            self.transport.close()  # type: ignore[attr-defined]
            raise RuntimeError("injected failure")
        self.left -= 1
        return super().combine(*args, **kwargs)


def fail_after_items(executor: Executor, transport: object, fail_after: int) -> None:
    """The Executor's injector: the received item after ``fail_after`` of them closes and raises."""
    calls = [0]
    original = executor._combine

    def failing(*args):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] > fail_after:
            transport.close()  # type: ignore[attr-defined]
            raise RuntimeError("injected failure")
        return original(*args)

    executor._combine = failing  # type: ignore[method-assign]


def run_in_place(
    inputs,
    segment_bytes=64,
    channels=1,
    fail_rank=None,
    fail_after=0,
    timeout=10.0,
    atomic=True,
    make: Make | None = None,
    lockstep_ranks=frozenset(),
):
    """Run an in-place schedule (the ring by default) on every rank (threads); returns (buffers, errors)."""
    size, count = len(inputs), inputs[0].size
    make = make or in_place_ring(segment_bytes)
    network = LoopbackNetwork(size, channels)
    users = [x.copy() for x in inputs]
    errors: list[BaseException | None] = [None] * size

    def body(rank: int) -> None:
        kind = FailingReducer if rank == fail_rank and rank in lockstep_ranks else Reducer
        reducer = kind(DTYPES[str(inputs[0].dtype)], ReduceOp.SUM, Compression.NONE, size)
        schedule = make(rank, size, count, inputs[0].itemsize)
        arrays = {buf: np.full(count, 77, inputs[0].dtype) for buf in schedule.scratch}
        arrays = {Buf.WORK: np.full(count, 77, inputs[0].dtype), **arrays, Buf.USER: users[rank]}
        transport = network.transport(rank)
        executor: Executor | LockstepExecutor
        if rank in lockstep_ranks:
            assert lockstep.fits(schedule, transport, arrays, atomic)
            executor = LockstepExecutor(transport, schedule, arrays, reducer, 1, 99, timeout)
            if rank == fail_rank:
                reducer.arm(transport, fail_after)  # type: ignore[attr-defined]
        else:
            executor = Executor(transport, schedule, arrays, reducer, 1, 99, timeout, atomic=atomic)
            if rank == fail_rank:
                fail_after_items(executor, transport, fail_after)
        try:
            executor.run()
        except BaseException as err:  # collected for the test
            errors[rank] = err
            return
        result = schedule.result
        if result.buf != Buf.USER:  # halving-doubling's extras get the result in WORK; the plan copies it
            users[rank][:] = arrays[result.buf][result.start : result.start + result.count]

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 20)
    assert not any(t.is_alive() for t in threads)
    return users, errors


@pytest.mark.parametrize("size", [2, 3, 4, 5, 7])
@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize("atomic", [True, False])
def test_in_place_ring_matches_numpy(size: int, channels: int, atomic: bool) -> None:
    rng = np.random.default_rng(size * 10 + channels)
    for count in (size - 1, size, 37, 1000):
        inputs = [rng.integers(-1000, 1000, count).astype(np.int64) for _ in range(size)]
        users, errors = run_in_place(inputs, segment_bytes=24, channels=channels, atomic=atomic)
        assert errors == [None] * size
        for user in users:
            np.testing.assert_array_equal(user, np.sum(inputs, axis=0))


def test_in_place_floats_are_identical_on_every_rank() -> None:
    rng = np.random.default_rng(3)
    inputs = [rng.standard_normal(5000).astype(np.float32) for _ in range(5)]
    users, errors = run_in_place(inputs, segment_bytes=256)
    assert errors == [None] * 5
    assert len({u.tobytes() for u in users}) == 1
    np.testing.assert_allclose(users[0], np.sum(inputs, axis=0, dtype=np.float64), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fail_after", [0, 3, 14, 38])
def test_failure_at_any_point_restores_every_buffer(fail_after: int) -> None:
    """Ranks that fail (the injector, and its peers) hand back their input untouched."""
    size, count = 4, 400
    rng = np.random.default_rng(fail_after)
    inputs = [rng.standard_normal(count) for _ in range(size)]
    users, errors = run_in_place(inputs, segment_bytes=64, fail_rank=2, fail_after=fail_after, timeout=2.0)
    assert isinstance(errors[2], RuntimeError)
    for rank in range(size):
        if errors[rank] is None:
            np.testing.assert_allclose(users[rank], np.sum(inputs, axis=0))
        else:
            assert isinstance(errors[rank], (RuntimeError, PeerFailure, CollectiveTimeout))
            assert users[rank].tobytes() == inputs[rank].tobytes(), f"rank {rank} buffer not restored"


@pytest.mark.parametrize("fail_after", [3, 38, 45, 70])
def test_failure_without_atomic_leaves_only_own_values_and_final_sums(fail_after: int) -> None:
    """No backups: a failed rank's buffer mixes its input with finished sums, nothing else."""
    size, count = 4, 400
    rng = np.random.default_rng(fail_after)
    inputs = [rng.integers(-1000, 1000, count).astype(np.int64) for _ in range(size)]
    total = np.sum(inputs, axis=0)
    users, errors = run_in_place(
        inputs, segment_bytes=64, fail_rank=2, fail_after=fail_after, timeout=2.0, atomic=False
    )
    assert isinstance(errors[2], RuntimeError)
    written = 0
    for rank in range(size):
        own = users[rank] == inputs[rank]
        assert np.all(own | (users[rank] == total)), f"rank {rank} holds values that are neither"
        if errors[rank] is not None:
            written += int(np.sum(~own & (users[rank] == total)))
    if fail_after > 39:  # 3 x 13 scatter-reduce segments: rank 2 failed in the allgather, after writes
        assert written > 0


def test_in_place_refuses_a_compressed_wire() -> None:
    reducer = Reducer(DTYPES["float32"], ReduceOp.SUM, Compression.FP16, 2)
    schedule = ring.allreduce(0, 2, 100, 2, 64, True)
    arrays = {Buf.USER: np.zeros(100, np.float32), Buf.WORK: np.zeros(100, np.float16)}
    with pytest.raises(ValueError, match="in-place"):
        Executor(LoopbackNetwork(2).transport(0), schedule, arrays, reducer, 1, 1, 1.0)


# --------------------------------------------------------------------------- one-segment schedules in lockstep

LOCKSTEP_CASES = {"lockstep": lambda size: frozenset(range(size)), "mixed": lambda size: frozenset({0})}


@pytest.mark.parametrize("size", [4, 5, 6, 8])
@pytest.mark.parametrize("ranks", ["executor", "executor-atomic", *LOCKSTEP_CASES])
def test_in_place_halving_doubling_matches_numpy(size: int, ranks: str) -> None:
    rng = np.random.default_rng(size)
    core = 1 << (size.bit_length() - 1)
    lockstep_ranks = LOCKSTEP_CASES[ranks](size) if ranks in LOCKSTEP_CASES else frozenset()
    for count in (core, 2 * core + 1, 1000):
        inputs = [rng.integers(-1000, 1000, count).astype(np.int64) for _ in range(size)]
        users, errors = run_in_place(
            inputs, atomic=ranks == "executor-atomic", make=in_place_halving, lockstep_ranks=lockstep_ranks
        )
        assert errors == [None] * size
        for user in users:
            np.testing.assert_array_equal(user, np.sum(inputs, axis=0))


@pytest.mark.parametrize("size", [2, 3, 5])
@pytest.mark.parametrize("ranks", sorted(LOCKSTEP_CASES))
def test_one_segment_in_place_ring_in_lockstep_matches_numpy(size: int, ranks: str) -> None:
    rng = np.random.default_rng(size)
    inputs = [rng.standard_normal(999).astype(np.float32) for _ in range(size)]
    pipelined, _ = run_in_place(inputs, segment_bytes=1 << 20, atomic=False)
    users, errors = run_in_place(
        inputs, segment_bytes=1 << 20, atomic=False, lockstep_ranks=LOCKSTEP_CASES[ranks](size)
    )
    assert errors == [None] * size
    assert [u.tobytes() for u in users] == [u.tobytes() for u in pipelined]  # same frames, same sums
    np.testing.assert_allclose(users[0], np.sum(inputs, axis=0, dtype=np.float64), rtol=1e-5, atol=1e-5)


def test_lockstep_refuses_in_place_schedules_with_atomic() -> None:
    """Only the Executor backs up and restores the caller's buffer."""
    transport = LoopbackNetwork(4).transport(0)
    schedule = in_place_halving(0, 4, 100, 8)
    arrays = {Buf.USER: np.zeros(100), Buf.WORK: np.zeros(100), Buf.STAGE: np.zeros(100)}
    assert lockstep.fits(schedule, transport, arrays)
    assert not lockstep.fits(schedule, transport, arrays, atomic=True)
    assert lockstep.fits(halving_doubling.allreduce(0, 4, 100), transport, arrays, atomic=True)


@pytest.mark.parametrize("size", [4, 6])
@pytest.mark.parametrize(
    ("ranks", "fail_after"),
    [("executor", 0), ("executor", 1), ("executor", 3), ("lockstep", 0), ("lockstep", 1)],
)
def test_halving_doubling_failure_without_atomic_leaves_own_values_and_final_sums(
    size: int, ranks: str, fail_after: int
) -> None:
    """Rank 1 fails at a halving or doubling step; no buffer holds anything but its input or sums."""
    count = 64
    rng = np.random.default_rng(fail_after)
    inputs = [rng.integers(-1000, 1000, count).astype(np.int64) for _ in range(size)]
    total = np.sum(inputs, axis=0)
    lockstep_ranks = frozenset(range(size)) if ranks == "lockstep" else frozenset()
    users, errors = run_in_place(
        inputs,
        fail_rank=1,
        fail_after=fail_after,
        timeout=0.5,  # the loopback does not tell peers of a close: they time out
        atomic=False,
        make=in_place_halving,
        lockstep_ranks=lockstep_ranks,
    )
    assert isinstance(errors[1], RuntimeError)
    for rank in range(size):
        own = users[rank] == inputs[rank]
        assert np.all(own | (users[rank] == total)), f"rank {rank} holds values that are neither"
        if errors[rank] is not None:
            assert isinstance(errors[rank], (RuntimeError, PeerFailure, CollectiveTimeout)), errors[rank]


def test_atomic_in_place_needs_work_as_long_as_the_buffer_to_back_it_up() -> None:
    """Refused before anything is sent, instead of failing mid-run on the first backup."""
    schedule = ring.allreduce(0, 2, 100, 8, 64, True)
    short = {Buf.USER: np.zeros(100), Buf.WORK: np.zeros(10)}
    transport = LoopbackNetwork(2).transport(0)
    reducer = Reducer(DTYPES["float64"], ReduceOp.SUM, Compression.NONE, 2)
    with pytest.raises(ValueError, match="as long as the caller's buffer"):
        Executor(transport, schedule, short, reducer, 1, 1, 1.0, atomic=True)
    Executor(transport, schedule, short, reducer, 1, 1, 1.0, atomic=False)  # no backups, no need
