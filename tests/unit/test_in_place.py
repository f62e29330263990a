"""The in-place ring allreduce: the allgather writes into the caller's buffer.

Correct results over the zero-capacity loopback transport, both with and
without ``atomic``; when the run fails at any point, the caller's buffer is
restored bit for bit with ``atomic`` and, without it, holds only its own
values and final sums.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from ringcore.algo import ring
from ringcore.algo.execute import Executor
from ringcore.algo.steps import Buf
from ringcore.buffers import DTYPES
from ringcore.errors import CollectiveTimeout, PeerFailure
from ringcore.kernels.numpy_ops import Reducer
from ringcore.ops import Compression, ReduceOp
from ringcore.transport.loopback import LoopbackNetwork

pytestmark = pytest.mark.timeout(60)


def run_in_place(inputs, segment_bytes, channels=1, fail_rank=None, fail_after=0, timeout=10.0, atomic=True):
    """Run the in-place ring on every rank (threads); returns (buffers, errors)."""
    size, count = len(inputs), inputs[0].size
    network = LoopbackNetwork(size, channels)
    users = [x.copy() for x in inputs]
    errors: list[BaseException | None] = [None] * size

    def body(rank: int) -> None:
        reducer = Reducer(DTYPES[str(inputs[0].dtype)], ReduceOp.SUM, Compression.NONE, size)
        schedule = ring.allreduce(rank, size, count, inputs[0].itemsize, segment_bytes, True)
        arrays = {Buf.USER: users[rank], Buf.WORK: np.full(count, 77, inputs[0].dtype)}
        transport = network.transport(rank)
        executor = Executor(transport, schedule, arrays, reducer, 1, 99, timeout, atomic=atomic)
        if rank == fail_rank:
            calls = [0]
            original = executor._combine

            def failing(*args):
                calls[0] += 1
                if calls[0] > fail_after:
                    network.transport(rank).close()
                    raise RuntimeError("injected failure")
                return original(*args)

            executor._combine = failing
        try:
            executor.run()
        except BaseException as err:  # collected for the test
            errors[rank] = err

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
