"""Shared memory to the peers on this host, TCP to the others, in one transport: how each step is served.

Four ranks in this process pretend to live on two hosts (ranks 0-1 and 2-3):
their host identity is patched per thread, so set-up gives each rank one
local peer over shared memory and two remote peers over TCP.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from ringcore.algo import recursive_doubling
from ringcore.algo.lockstep import LockstepExecutor
from ringcore.algo.steps import Buf
from ringcore.buffers import DTYPES
from ringcore.kernels.numpy_ops import Reducer
from ringcore.ops import Compression, ReduceOp
from ringcore.transport import shm, shm_setup
from ringcore.transport.base import FrameMismatch
from tests.conformance.test_transport import SIG, drive, in_parallel, tcp_mesh, view

pytestmark = pytest.mark.timeout(60)

_where = threading.local()


@pytest.fixture
def two_hosts(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Four shared-memory transports, ranks 0-1 on one host and 2-3 on another."""
    real = shm_setup._host_identity
    monkeypatch.setattr(shm_setup, "_host_identity", lambda: f"{real()}/host{_where.host}")
    controls = tcp_mesh(4, 1)

    def connect(rank: int):  # type: ignore[no-untyped-def]
        _where.host = rank // 2
        return shm_setup.connect(controls[rank], 64 << 10, 20.0)

    made = in_parallel(*[lambda rank=rank: connect(rank) for rank in range(4)])
    assert [t.local for t in made] == [[1], [0], [3], [2]]
    yield made
    for transport in made:
        transport.close()


def test_a_step_between_hosts_takes_tcps_latency_path(two_hosts: list) -> None:
    t = two_hosts
    out = np.zeros(100, np.uint8)
    frame = np.arange(100, dtype=np.uint8)
    drive(t[2], [t[2].isend(0, 0, tag, SIG, view(frame)) for tag in (7, 8)])
    pair = t[0].swap(None, (2, 0, view(out)), 7, SIG)
    assert pair is not None, "both peers remote: TCP's swap"
    _, received = pair
    if received is not None:
        drive(t[0], [received])
    np.testing.assert_array_equal(out, frame)
    second = t[0].irecv(2, 0, 8, SIG, view(out := np.zeros(100, np.uint8)))
    assert t[0].exchange(None, second) and second.done, "TCP's exchange finishes a remote receive"
    np.testing.assert_array_equal(out, frame)


def test_a_step_with_a_local_peer_takes_the_rings_latency_path(two_hosts: list) -> None:
    t = two_hosts
    frame, out = np.arange(10, dtype=np.uint8), np.zeros(10, np.uint8)
    assert t[1].swap((0, 0, view(frame)), None, 7, SIG) == (None, None), "done once in the ring"
    assert t[0].swap(None, (1, 0, view(out)), 7, SIG) == (None, None)
    np.testing.assert_array_equal(out, frame)
    buf = view(np.zeros(10, np.uint8))
    assert t[0].swap((2, 0, buf), (1, 0, buf), 8, SIG) is None, "one peer of each kind: post them"
    local = t[0].irecv(1, 0, 8, SIG, buf)
    assert not t[0].exchange(None, local), "exchange leaves local receives to progress"
    assert t[0].swap(None, (1, 0, buf), 9, SIG) is None, "a receive already queued on the link"
    t[0].cancel()


def test_a_late_local_frame_is_left_to_progress_and_a_wrong_one_refused(two_hosts: list) -> None:
    t = two_hosts
    t[0].spin = 0.001
    out = np.zeros(10, np.uint8)
    sent, received = t[0].swap(None, (1, 0, view(out)), 7, SIG)
    assert sent is None and received is not None and not received.done, "nothing came within the spin"
    frame = np.arange(10, dtype=np.uint8)
    assert t[1].swap((0, 0, view(frame)), None, 7, SIG) == (None, None)
    drive(t[0], [received])
    np.testing.assert_array_equal(out, frame)
    assert t[1].swap((0, 0, view(frame)), None, 8, SIG + 1) == (None, None)
    with pytest.raises(FrameMismatch, match="signature"):
        t[0].swap(None, (1, 0, view(out)), 8, SIG)
    t[0].cancel()


def test_recursive_doubling_over_both_paths_matches_numpy(two_hosts: list) -> None:
    """Round 1 pairs ranks of one host (shared memory), round 2 ranks of two hosts (TCP)."""
    swaps = []
    for transport in two_hosts:
        real = transport.control.swap
        transport.control.swap = lambda *args, real=real, **kw: swaps.append(args) or real(*args, **kw)
    rng = np.random.default_rng(0)
    inputs = [rng.integers(-100, 100, 1000).astype(np.int32) for _ in range(4)]
    for round_trip in range(3):  # several collectives: the paths alternate cleanly
        works = [x.copy() for x in inputs]

        def run(rank: int, works: list = works, seq: int = round_trip) -> None:
            schedule = recursive_doubling.allreduce(rank, 4, 1000, 4, 1 << 20)
            arrays = {Buf.WORK: works[rank], Buf.STAGE: np.empty(1000, np.int32), Buf.USER: inputs[rank]}
            reducer = Reducer(DTYPES["int32"], ReduceOp.SUM, Compression.NONE, 4)
            LockstepExecutor(two_hosts[rank], schedule, arrays, reducer, seq, SIG, 20.0).run()

        in_parallel(*[lambda rank=rank: run(rank) for rank in range(4)])
        for got in works:
            np.testing.assert_array_equal(got, np.sum(inputs, axis=0))
        assert swaps, "the round between hosts took TCP's latency path"


def test_no_spinning_at_all_when_spin_is_zero(two_hosts: list, monkeypatch: pytest.MonkeyPatch) -> None:
    """RINGCORE_SPIN_US=0 (an emulated cluster's default): a rank waiting on its ring yields once, then blocks.

    A busy loop would take the CPU of ranks it cannot see, those of other hosts on the same cores;
    one yield, as TCP's latency path makes, lets a peer on this core send before the rank sleeps.
    """
    t = two_hosts[0]
    t.spin = 0.0
    yields, blocks = [], []
    real_yield = shm.os.sched_yield
    monkeypatch.setattr(shm.os, "sched_yield", lambda: yields.append(1) or real_yield())
    monkeypatch.setattr(t, "_block", lambda deadline: blocks.append(len(yields)) or False)
    t.irecv(1, 0, 7, SIG, view(np.zeros(10, np.uint8)))
    assert not t.progress(0.01)
    assert blocks == [1], f"blocked after {blocks[0] if blocks else len(yields)} yields"
    t.cancel()
    yields.clear()
    pair = t.swap(None, (1, 0, view(np.zeros(10, np.uint8))), 8, SIG)
    assert pair is not None and pair[1] is not None, "nothing came: left to progress"
    assert len(yields) == 1, "the latency path too: one yield, then progress"
    t.cancel()
