"""Schedules checked in memory by ``simulate``: pairing, data flow, and the chunk / segment math.

No transport here: every rank's steps are played against each other by
``tests.simulate`` and the results compared with numpy. World sizes
1..13 (odd sizes, non-powers of two) and counts 0, 1, 2, N-1, 64, 1000 and a
prime, as Gloo's tests do.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringcore.algo import broadcast as chain
from ringcore.algo import halving_doubling, recursive_doubling, ring
from ringcore.algo.steps import Buf, Region, Schedule, Step, chunk_bounds, segment_count, split_bounds
from ringcore.buffers import DTYPES
from ringcore.kernels.numpy_ops import Reducer
from ringcore.ops import Compression, ReduceOp
from tests import simulate
from tests.simulate import ScheduleError

SIZES = range(2, 14)
PRIME = 997
INT_OPS = (ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX)
FLOAT_OPS = (*INT_OPS, ReduceOp.AVG)
ALLREDUCES = {
    "ring": ring.allreduce,
    "ring_in_place": lambda *args: ring.allreduce(*args, True),
    "recursive_doubling": recursive_doubling.allreduce,
}


def counts_for(size: int) -> list[int]:
    return sorted({0, 1, 2, size - 1, 64, 1000, PRIME})


def reducer(dtype: str, op: ReduceOp, size: int) -> Reducer:
    return Reducer(DTYPES[dtype], op, Compression.NONE, size)


def make_inputs(size: int, count: int, dtype: str, op: ReduceOp, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if op is ReduceOp.PROD and dtype.startswith("float"):
        # near 1 so a product over 13 ranks neither overflows nor underflows
        return [rng.uniform(0.5, 1.5, count).astype(dtype) for _ in range(size)]
    if dtype.startswith("float"):
        return [rng.standard_normal(count).astype(dtype) for _ in range(size)]
    info = np.iinfo(dtype)
    return [rng.integers(info.min, info.max, count, dtype=dtype, endpoint=True) for _ in range(size)]


def reference(inputs: list[np.ndarray], op: ReduceOp) -> np.ndarray:
    """The reduction numpy computes, in the inputs' dtype (integers wrap, as the kernels do)."""
    stacked = np.stack(inputs)
    dtype = stacked.dtype
    if op is ReduceOp.SUM:
        return stacked.sum(axis=0, dtype=dtype)
    if op is ReduceOp.PROD:
        return stacked.prod(axis=0, dtype=dtype)
    if op is ReduceOp.MIN:
        return stacked.min(axis=0)
    if op is ReduceOp.MAX:
        return stacked.max(axis=0)
    return (stacked.astype(np.float64).sum(axis=0) / len(inputs)).astype(dtype)


def check(got: np.ndarray, want: np.ndarray, inputs: list[np.ndarray], op: ReduceOp) -> None:
    """Integers, min and max: exactly numpy's. Float sums and products: within rounding of numpy's.

    A schedule adds in its own order: each of the two results is within N-1
    roundings (one more for avg) of the exact value, a rounding being at most
    half an epsilon of the sum of magnitudes (of the product's magnitude for
    prod), so they differ by at most (N + 1) epsilons of it: a few units in
    the last place in float64 too, where a fixed ``rtol=1e-5`` would hide a
    sum carried out in float32.
    """
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    if want.dtype.kind != "f" or op in (ReduceOp.MIN, ReduceOp.MAX):
        np.testing.assert_array_equal(got, want)
        return
    n = len(inputs)
    if op is ReduceOp.PROD:
        scale = np.abs(want.astype(np.float64))
    else:
        scale = np.abs(np.stack(inputs).astype(np.float64)).sum(axis=0) / (n if op is ReduceOp.AVG else 1)
    bound = (n + 1) * float(np.finfo(want.dtype).eps) * scale
    error = np.abs(got.astype(np.float64) - want.astype(np.float64))
    assert np.all(error <= bound), f"off by up to {np.max(error - bound):.3g} beyond {n + 1} epsilons"


# --------------------------------------------------------------------------- segment math


@settings(deadline=None, max_examples=200)
@given(count=st.integers(0, 5000), parts=st.integers(1, 64))
def test_split_bounds_matches_array_split(count: int, parts: int) -> None:
    pieces = np.array_split(np.arange(count), parts)
    bounds = chunk_bounds(count, parts)
    assert [n for _, n in bounds] == [len(p) for p in pieces]
    for (start, n), piece in zip(bounds, pieces, strict=True):
        assert list(range(start, start + n)) == piece.tolist()
    assert all(split_bounds(count, parts, i) == bounds[i] for i in range(parts))


@settings(deadline=None, max_examples=200)
@given(
    largest=st.integers(0, 100_000),
    itemsize=st.sampled_from([1, 2, 4, 8]),
    elements=st.integers(1, 1 << 14),
)
def test_segment_count_is_the_fewest_that_fit(largest: int, itemsize: int, elements: int) -> None:
    # segment sizes in whole elements, as configured in practice (4 KiB and up)
    segment_bytes = elements * itemsize
    segments = segment_count(largest, itemsize, segment_bytes)
    assert segments == max(1, math.ceil(largest / elements))
    longest = max(n for _, n in chunk_bounds(largest, segments))
    assert longest * itemsize <= segment_bytes
    if segments > 1:  # one fewer segment would not fit
        assert max(n for _, n in chunk_bounds(largest, segments - 1)) * itemsize > segment_bytes


def test_segment_count_edges() -> None:
    assert segment_count(0, 4, 64) == 1
    assert segment_count(16, 4, 64) == 1
    assert segment_count(17, 4, 64) == 2
    assert segment_count(10, 4, 0) == 40  # a zero segment size is treated as one byte


@settings(deadline=None, max_examples=100)
@given(start=st.integers(0, 1000), count=st.integers(0, 1000), segments=st.integers(1, 40))
def test_region_segments_tile_the_region(start: int, count: int, segments: int) -> None:
    region = Region(Buf.WORK, start, count)
    pieces = [region.segment(k, segments) for k in range(segments)]
    assert all(p.buf is Buf.WORK for p in pieces)
    position = start
    for piece in pieces:
        assert piece.start == position
        position += piece.count
    assert position == start + count


# --------------------------------------------------------------------------- allreduce


@pytest.mark.parametrize("algorithm", sorted(ALLREDUCES))
@pytest.mark.parametrize("size", SIZES)
def test_allreduce_integers_exact(algorithm: str, size: int) -> None:
    make = ALLREDUCES[algorithm]
    for count in counts_for(size):
        for dtype, op in [("int32", o) for o in INT_OPS] + [
            ("uint8", ReduceOp.SUM),
            ("int64", ReduceOp.PROD),
        ]:
            inputs = make_inputs(size, count, dtype, op, seed=size * 7919 + count)
            schedules = [make(r, size, count, np.dtype(dtype).itemsize, 64) for r in range(size)]
            results = simulate.simulate(schedules, inputs, reducer(dtype, op, size))
            want = reference(inputs, op)
            for got in results:
                check(got, want, inputs, op)


@pytest.mark.parametrize("algorithm", sorted(ALLREDUCES))
@pytest.mark.parametrize("size", SIZES)
def test_allreduce_floats(algorithm: str, size: int) -> None:
    make = ALLREDUCES[algorithm]
    for count in (0, 1, size - 1, 64, PRIME):
        for dtype in ("float32", "float64"):
            for op in FLOAT_OPS:
                inputs = make_inputs(size, count, dtype, op, seed=count + size)
                schedules = [make(r, size, count, np.dtype(dtype).itemsize, 256) for r in range(size)]
                results = simulate.simulate(schedules, inputs, reducer(dtype, op, size))
                want = reference(inputs, op)
                for got in results:
                    check(got, want, inputs, op)


def test_allreduce_float16_integers_exact() -> None:
    """Small integers are exact in float16, so every order of additions gives the same sum."""
    size, count = 7, 100
    rng = np.random.default_rng(3)
    inputs = [rng.integers(-20, 20, count).astype(np.float16) for _ in range(size)]
    for make in ALLREDUCES.values():
        schedules = [make(r, size, count, 2, 32) for r in range(size)]
        for got in simulate.simulate(schedules, inputs, reducer("float16", ReduceOp.SUM, size)):
            np.testing.assert_array_equal(got, np.sum(inputs, axis=0, dtype=np.float16))


@pytest.mark.parametrize("size", SIZES)
def test_recursive_doubling_bitwise_identical_across_ranks(size: int) -> None:
    rng = np.random.default_rng(size)
    count = 333
    inputs = [
        (rng.standard_normal(count) * 10.0 ** rng.integers(-3, 4, count)).astype(np.float32)
        for _ in range(size)
    ]
    for op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PROD):
        schedules = [recursive_doubling.allreduce(r, size, count, 4, 1 << 20) for r in range(size)]
        results = simulate.simulate(schedules, inputs, reducer("float32", op, size))
        for got in results[1:]:
            assert got.tobytes() == results[0].tobytes()


@pytest.mark.parametrize("size", SIZES)
def test_ring_bitwise_identical_across_ranks(size: int) -> None:
    rng = np.random.default_rng(100 + size)
    inputs = [rng.standard_normal(PRIME).astype(np.float32) for _ in range(size)]
    schedules = [ring.allreduce(r, size, PRIME, 4, 1 << 20) for r in range(size)]
    results = simulate.simulate(schedules, inputs, reducer("float32", ReduceOp.SUM, size))
    for got in results[1:]:
        assert got.tobytes() == results[0].tobytes()


POWERS_OF_TWO = (4, 8, 16)
WITH_EXTRAS = (5, 6, 7, 12)  # the ranks past the largest power of two fold in and out


@pytest.mark.parametrize("size", POWERS_OF_TWO + WITH_EXTRAS)
@pytest.mark.parametrize("in_place", [False, True])
def test_halving_doubling_matches_numpy(size: int, in_place: bool) -> None:
    core = 1 << (size.bit_length() - 1)
    for count in sorted({core, core + 1, 2 * core - 1, 64, 1000, PRIME}):
        for dtype, op in [("int32", ReduceOp.SUM), ("int64", ReduceOp.PROD), ("int16", ReduceOp.MIN)]:
            inputs = make_inputs(size, count, dtype, op, seed=size * 31 + count)
            schedules = [halving_doubling.allreduce(r, size, count, in_place) for r in range(size)]
            for got in simulate.simulate(schedules, inputs, reducer(dtype, op, size)):
                check(got, reference(inputs, op), inputs, op)
        for op in FLOAT_OPS:
            inputs = make_inputs(size, count, "float64", op, seed=count)
            schedules = [halving_doubling.allreduce(r, size, count, in_place) for r in range(size)]
            results = simulate.simulate(schedules, inputs, reducer("float64", op, size))
            for got in results:
                check(got, reference(inputs, op), inputs, op)
                assert got.tobytes() == results[0].tobytes()  # every element reduced once, then copied


@pytest.mark.parametrize("size", POWERS_OF_TWO)
def test_halving_doubling_moves_the_rings_bytes_in_fewer_steps(size: int) -> None:
    count = 4096
    for rank in range(size):
        steps = halving_doubling.allreduce(rank, size, count).steps
        assert len(steps) == 2 * (size.bit_length() - 1)
        assert all(step.whole and step.send_peer == step.recv_peer for step in steps)
        sent = sum(step.send.count for step in steps if step.send is not None)
        assert sent == 2 * count * (size - 1) // size


@pytest.mark.parametrize("size", WITH_EXTRAS)
def test_halving_doubling_folds_extras_in_and_out_whole(size: int) -> None:
    """Ranks >= P hand over their input and get the result back: 2 steps; their partners 2 more."""
    count, core = 4096, 1 << (size.bit_length() - 1)
    rounds = core.bit_length() - 1
    for rank in range(size):
        steps = halving_doubling.allreduce(rank, size, count).steps
        assert all(step.whole for step in steps)
        if rank >= core:
            assert [(s.send_peer, s.recv_peer, s.label) for s in steps] == [
                (rank - core, None, "fold-in"),
                (None, rank - core, "fold-out"),
            ]
            assert steps[0].send == Region(Buf.USER, 0, count)
            assert steps[1].recv == Region(Buf.WORK, 0, count)
        elif rank + core < size:
            assert len(steps) == 2 * rounds + 2
            fold_in, fold_out = steps[0], steps[-1]
            assert (fold_in.recv_peer, fold_in.recv.count, fold_in.label) == (rank + core, count, "fold-in")
            assert (fold_out.send_peer, fold_out.send.count, fold_out.label) == (
                rank + core,
                count,
                "fold-out",
            )
            assert steps[1].send.buf == Buf.WORK  # halving starts from the folded vector
        else:
            assert len(steps) == 2 * rounds
            assert steps[0].send.buf == Buf.USER


def test_halving_doubling_applies_from_4_ranks_with_an_element_per_core_rank() -> None:
    assert [n for n in range(1, 18) if halving_doubling.applies(n, 100)] == list(range(4, 18))
    assert not halving_doubling.applies(8, 7)
    assert halving_doubling.applies(12, 8) and not halving_doubling.applies(12, 7)
    assert (halving_doubling.largest_frame(8, 101), halving_doubling.largest_frame(6, 101)) == (51, 101)
    assert [halving_doubling.byte_limit(n, 4096) for n in (4, 5, 8, 12)] == [4096, 1024, 4096, 1024]
    with pytest.raises(ValueError, match="world >= 4"):
        halving_doubling.allreduce(0, 3, 100)


@pytest.mark.parametrize("size", SIZES)
def test_step_counts(size: int) -> None:
    p2 = 1 << (size.bit_length() - 1)
    rounds = p2.bit_length() - 1
    for rank in range(size):
        assert len(ring.allreduce(rank, size, 100, 4, 64).steps) == 2 * (size - 1)
        steps = recursive_doubling.allreduce(rank, size, 100, 4, 64).steps
        if rank >= p2:
            assert len(steps) == 2
        else:
            assert len(steps) == rounds + (2 if rank < size - p2 else 0)
        assert len(chain.barrier(rank, size).steps) == math.ceil(math.log2(size))


# --------------------------------------------------------------------------- reduce_scatter, allgather


@pytest.mark.parametrize("size", SIZES)
def test_reduce_scatter(size: int) -> None:
    for count in counts_for(size):
        chunks = tuple(chunk_bounds(count, size))
        for dtype, op in [("int32", ReduceOp.SUM), ("int16", ReduceOp.MAX), ("float64", ReduceOp.AVG)]:
            inputs = make_inputs(size, count, dtype, op, seed=count)
            schedules = [
                ring.reduce_scatter(r, size, chunks, np.dtype(dtype).itemsize, 16) for r in range(size)
            ]
            results = simulate.simulate(schedules, inputs, reducer(dtype, op, size))
            want = reference(inputs, op)
            for rank, got in enumerate(results):
                start, n = chunks[rank]
                check(got, want[start : start + n], [x[start : start + n] for x in inputs], op)


@pytest.fixture
def seeded_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``simulate`` start WORK as a copy of USER: allgather expects WORK to hold the rank's chunk."""
    original = simulate._arrays

    def arrays(user: np.ndarray, red: Reducer) -> dict[Buf, np.ndarray]:
        made = original(user, red)
        made[Buf.WORK][:] = user
        return made

    monkeypatch.setattr(simulate, "_arrays", arrays)


@pytest.mark.usefixtures("seeded_work")
@pytest.mark.parametrize("size", range(1, 14))
def test_allgather(size: int) -> None:
    for count in counts_for(size):
        chunks = tuple(chunk_bounds(count, size))
        full = np.arange(count, dtype=np.int64) * 3 + 1
        inputs = []
        for rank in range(size):
            mine = np.full(count, -1, np.int64)  # every other chunk must be overwritten
            start, n = chunks[rank]
            mine[start : start + n] = full[start : start + n]
            inputs.append(mine)
        schedules = [ring.allgather(r, size, chunks, 8, 24) for r in range(size)]
        for got in simulate.simulate(schedules, inputs, reducer("int64", ReduceOp.SUM, size)):
            np.testing.assert_array_equal(got, full)


@pytest.mark.usefixtures("seeded_work")
def test_allgather_uneven_chunks() -> None:
    """Allgather with first dimensions that differ per rank (rows of 3 elements)."""
    rows = [2, 0, 5, 1]
    size = len(rows)
    starts = np.concatenate([[0], np.cumsum(rows)[:-1]])
    chunks = tuple((int(s) * 3, n * 3) for s, n in zip(starts, rows, strict=True))
    total = sum(rows) * 3
    full = np.arange(total, dtype=np.float32)
    inputs = []
    for start, n in chunks:
        mine = np.zeros(total, np.float32)
        mine[start : start + n] = full[start : start + n]
        inputs.append(mine)
    schedules = [ring.allgather(r, size, chunks, 4, 8) for r in range(size)]
    for got in simulate.simulate(schedules, inputs, reducer("float32", ReduceOp.SUM, size)):
        np.testing.assert_array_equal(got, full)


# --------------------------------------------------------------------------- broadcast, barrier


@pytest.mark.parametrize("size", SIZES)
def test_broadcast_every_root(size: int) -> None:
    for count in counts_for(size):
        for root in range(size):
            inputs = [np.full(count, rank + 100, np.int32) for rank in range(size)]
            inputs[root] = np.arange(count, dtype=np.int32) - 7
            schedules = [chain.broadcast(r, size, root, count, 4, 12) for r in range(size)]
            results = simulate.simulate(schedules, inputs, reducer("int32", ReduceOp.SUM, size))
            for got in results:
                np.testing.assert_array_equal(got, inputs[root])
            assert schedules[root].result is None


@pytest.mark.parametrize("size", range(1, 14))
def test_barrier_pairs_up(size: int) -> None:
    schedules = [chain.barrier(r, size) for r in range(size)]
    inputs = [np.arange(3, dtype=np.float32) + r for r in range(size)]
    results = simulate.simulate(schedules, inputs, reducer("float32", ReduceOp.SUM, size))
    for rank, got in enumerate(results):
        np.testing.assert_array_equal(got, inputs[rank])  # a barrier moves no data


@pytest.mark.parametrize("size", SIZES)
def test_barrier_everyone_hears_from_everyone(size: int) -> None:
    """Dissemination: following the frames, every rank is reachable from every rank."""
    heard = [{r} for r in range(size)]
    for phase in range(len(chain.barrier(0, size).steps)):
        before = [set(h) for h in heard]
        for rank in range(size):
            step = chain.barrier(rank, size).steps[phase]
            heard[rank] |= before[step.recv_peer]
    assert all(h == set(range(size)) for h in heard)


# --------------------------------------------------------------------------- a single rank


def _identity_case(kind: str, count: int) -> Schedule:
    if kind == "ring":
        return ring.allreduce(0, 1, count, 4, 16)
    if kind == "recursive_doubling":
        return recursive_doubling.allreduce(0, 1, count, 4, 16)
    if kind == "reduce_scatter":
        return ring.reduce_scatter(0, 1, tuple(chunk_bounds(count, 1)), 4, 16)
    return chain.broadcast(0, 1, 0, count, 4, 16)


@pytest.mark.parametrize("kind", ["ring", "recursive_doubling", "reduce_scatter", "broadcast"])
def test_single_rank_schedules_are_identity(kind: str) -> None:
    """At N = 1 every collective is the identity: the result region must hold the input.

    Known to fail (see the test report): ring/recursive-doubling/reduce-scatter at N = 1
    have no steps but name WORK, which nothing wrote, as the result; the broadcast sends
    to itself and then expects its acknowledgement first. The communicator never runs
    schedules at size 1, so only other callers of the schedules see this.
    """
    count = 10
    data = np.arange(count, dtype=np.float32) + 0.5
    results = simulate.simulate([_identity_case(kind, count)], [data], reducer("float32", ReduceOp.SUM, 1))
    np.testing.assert_array_equal(results[0], data)


# --------------------------------------------------------------------------- simulate catches broken schedules


def _pair(phase_a: int, phase_b: int, count_a: int = 4, count_b: int = 4) -> list[Schedule]:
    send = Step(1, Region(Buf.USER, 0, count_a), phase=phase_a)
    recv = Step(recv_peer=0, recv=Region(Buf.WORK, 0, count_b), phase=phase_b)
    return [Schedule((send,), 1, None), Schedule((recv,), 1, Region(Buf.WORK, 0, 4))]


def test_simulate_accepts_a_matched_pair() -> None:
    inputs = [np.arange(4, dtype=np.float32), np.zeros(4, np.float32)]
    results = simulate.simulate(_pair(3, 3), inputs, reducer("float32", ReduceOp.SUM, 2))
    np.testing.assert_array_equal(results[1], inputs[0])


def test_simulate_detects_phase_mismatch() -> None:
    inputs = [np.arange(4, dtype=np.float32)] * 2
    with pytest.raises(ScheduleError, match="phase"):
        simulate.simulate(_pair(0, 1), inputs, reducer("float32", ReduceOp.SUM, 2))


def test_simulate_detects_length_mismatch() -> None:
    inputs = [np.arange(4, dtype=np.float32)] * 2
    with pytest.raises(ScheduleError, match="items"):
        simulate.simulate(_pair(0, 0, 4, 3), inputs, reducer("float32", ReduceOp.SUM, 2))


def test_simulate_detects_deadlock() -> None:
    """Both ranks receive before they send: nothing can ever arrive."""
    schedules = [
        Schedule(
            (
                Step(recv_peer=1 - r, recv=Region(Buf.WORK, 0, 2), phase=0),
                Step(1 - r, Region(Buf.USER, 0, 2), phase=1),
            ),
            1,
            None,
        )
        for r in range(2)
    ]
    inputs = [np.zeros(2, np.float32)] * 2
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate.simulate(schedules, inputs, reducer("float32", ReduceOp.SUM, 2))


def test_simulate_detects_unreceived_frames() -> None:
    schedules = [Schedule((Step(1, Region(Buf.USER, 0, 2), phase=0),), 1, None), Schedule((), 1, None)]
    inputs = [np.zeros(2, np.float32)] * 2
    with pytest.raises(ScheduleError, match="never received"):
        simulate.simulate(schedules, inputs, reducer("float32", ReduceOp.SUM, 2))


def test_simulate_detects_a_broken_ring() -> None:
    """Take a real ring schedule and shift one rank's phases: the pairing check must notice."""
    size, count = 5, 50
    schedules = [ring.allreduce(r, size, count, 4, 64) for r in range(size)]
    broken = tuple(
        Step(s.send_peer, s.send, s.recv_peer, s.recv, s.reduce, s.final, s.whole, s.phase + (i == 3))
        for i, s in enumerate(schedules[2].steps)
    )
    schedules[2] = Schedule(broken, schedules[2].segments, schedules[2].result)
    inputs = [np.ones(count, np.float32)] * size
    with pytest.raises(ScheduleError):
        simulate.simulate(schedules, inputs, reducer("float32", ReduceOp.SUM, size))
