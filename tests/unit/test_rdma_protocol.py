"""The RDMA transport's protocol (announce, pair, write, credits, cancel) over fake verbs.

These are not RDMA tests: no verbs device is involved. They run the real
executor and the real :class:`~ringcore.transport.rdma.RdmaTransport` over
``tests.fake_verbs``, which keeps the RC rules the protocol depends on, with a
tiny receive depth so flow control is exercised on every run. The same
transport over a real device is tested in ``tests/rdma``.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from ringcore.algo import ring
from ringcore.algo.execute import Executor
from ringcore.algo.steps import Buf
from ringcore.buffers import DTYPES
from ringcore.kernels.numpy_ops import Reducer
from ringcore.ops import Compression, ReduceOp
from ringcore.transport.rdma import RdmaTransport, explain_status
from ringcore.transport.registration import RegistrationCache, owner_range
from tests.conformance.test_transport import in_parallel, rdma_fake_mesh
from tests.fake_verbs import FakeFabric

pytestmark = pytest.mark.timeout(60)

SIG = 0xAB


def fake_mesh(size: int, channels: int = 1, depth: int = 4) -> tuple[list[RdmaTransport], FakeFabric]:
    fabric = FakeFabric()
    return rdma_fake_mesh(size, channels, fabric, depth), fabric


def ring_allreduce(
    transports: list[RdmaTransport], inputs: list[np.ndarray], segment_bytes: int, seq: int, work: dict
) -> list[np.ndarray]:
    """Ring allreduce on every rank's thread; ``work`` keeps scratch arrays between calls, as the communicator does."""
    size, count = len(transports), inputs[0].size

    def body(rank: int) -> np.ndarray:
        reducer = Reducer(DTYPES["float32"], ReduceOp.SUM, Compression.NONE, size)
        schedule = ring.allreduce(rank, size, count, 4, segment_bytes)
        arrays = {buf: work.setdefault((rank, buf), np.zeros(count, np.float32)) for buf in schedule.buffers}
        arrays[Buf.USER] = inputs[rank]
        arrays.setdefault(Buf.WORK, work.setdefault((rank, Buf.WORK), np.zeros(count, np.float32)))
        if schedule.prefill_work:
            np.copyto(arrays[Buf.WORK], inputs[rank])
        Executor(transports[rank], schedule, arrays, reducer, seq, SIG, 10.0).run()
        result = schedule.result
        return arrays[result.buf][result.start : result.start + result.count].copy()

    return in_parallel(*[lambda rank=rank: body(rank) for rank in range(size)])  # type: ignore[return-value]


@pytest.mark.parametrize("size", [2, 3, 5])
@pytest.mark.parametrize("channels", [1, 2])
def test_ring_allreduce_with_many_more_segments_than_credits(size: int, channels: int) -> None:
    transports, fabric = fake_mesh(size, channels, depth=4)
    rng = np.random.default_rng(size)
    inputs = [rng.integers(-50, 50, 6000).astype(np.float32) for _ in range(size)]
    expected = np.sum(inputs, axis=0)
    work: dict = {}
    try:
        for seq in (1, 2):  # twice: the second run reuses every registration
            results = ring_allreduce(transports, [x.copy() for x in inputs], 256, seq, work)
            for got in results:
                np.testing.assert_array_equal(got, expected)
        assert all(device.most_waiting <= 1 for device in fabric.devices.values()), (
            "flow control let messages pile up at a receiver"
        )
    finally:
        for transport in transports:
            transport.close()


def test_buffers_are_registered_once_not_per_segment() -> None:
    transports, _ = fake_mesh(2, depth=8)
    inputs = [np.arange(4096, dtype=np.float32) for _ in range(2)]
    work: dict = {}
    try:
        ring_allreduce(transports, [x.copy() for x in inputs], 512, 1, work)
        first = [t.cache.registrations for t in transports]
        persistent = [x.copy() for x in inputs]
        ring_allreduce(transports, persistent, 512, 2, work)
        second = [t.cache.registrations for t in transports]
        ring_allreduce(transports, persistent, 512, 3, work)
        assert [t.cache.registrations for t in transports] == second
        assert all(0 < n <= 4 for n in first), first
    finally:
        for transport in transports:
            transport.close()


def test_cancel_refuses_late_writes_into_announced_receives() -> None:
    transports, _ = fake_mesh(2, depth=4)
    out = np.zeros(8, np.uint8)
    try:
        transports[1].irecv(0, 0, 5, SIG, memoryview(out))
        deadline = time.monotonic() + 5
        while not transports[0].links[0].readies and time.monotonic() < deadline:
            transports[1].progress(0.0)
            transports[0].progress(0.01)
        transports[1].cancel()
        request = transports[0].isend(1, 0, 5, SIG, memoryview(np.full(8, 9, np.uint8)))
        with pytest.raises(Exception, match="refused an RDMA write"):
            while not request.done and time.monotonic() < deadline:
                transports[0].progress(0.01)
        assert not out.any(), "a write landed after cancel()"
    finally:
        for transport in transports:
            transport.close()


class _Reg:
    def __init__(self, log: list) -> None:
        self.lkey = self.rkey = len(log)
        self.log = log

    def close(self) -> None:
        self.log.append(("close", self.lkey))


def test_registration_cache_covers_slices_and_forgets_dead_owners() -> None:
    log: list = []
    cache = RegistrationCache(lambda a, n, w: (log.append(("reg", a, n)), _Reg(log))[1])
    array = np.zeros(1000, np.float32)
    a1, r1 = cache.lookup(memoryview(array[10:20]).cast("B"), True)
    a2, r2 = cache.lookup(memoryview(array[500:900]).cast("B"), True)
    assert r1 is r2 and cache.registrations == 1
    assert a2 - a1 == 490 * 4
    assert log[0][2] == array.nbytes  # the whole owner, not the slice
    key = r1.lkey
    assert ("close", key) not in log
    del array, r1, r2
    cache.lookup(memoryview(np.ones(4, np.uint8)), False)  # a lookup reaps dead owners
    assert ("close", key) in log


def test_registration_cache_bounds_owners_it_must_hold() -> None:
    log: list = []
    cache = RegistrationCache(lambda a, n, w: _Reg(log), capacity=3)
    buffers = [bytearray(64) for _ in range(10)]  # bytearray has no weak references
    for buf in buffers:
        cache.lookup(memoryview(buf), True)
    assert len(cache) == 3
    assert sum(1 for entry in log if entry[0] == "close") == 7


def test_owner_range_of_a_view_is_its_base_array() -> None:
    base = np.zeros(100, np.int64)
    owner, start, end = owner_range(memoryview(base[30:40]).cast("B"))
    assert owner is base and end - start == base.nbytes


def test_completion_errors_say_what_to_check() -> None:
    assert "RINGCORE_IB_GID_INDEX" in explain_status("IBV_WC_RETRY_EXC_ERR")
    assert "IBV_WC_SOMETHING" in explain_status("IBV_WC_SOMETHING")
