"""The hierarchical allreduce: in memory (``simulate``), pipelined over the loopback transport, its grid.

Grids of 2-4 hosts of 2-3 ranks, hosts in rank order and interleaved (a
launcher that deals ranks round-robin), counts from one element per block up
to primes, against numpy; the cross-host bytes are what the module promises.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import types

import numpy as np
import pytest

from ringcore.algo import broadcast as chain
from ringcore.algo import hierarchical
from ringcore.algo.execute import Executor
from ringcore.algo.hierarchical import Grid
from ringcore.algo.program import compile_program, waits_for
from ringcore.algo.steps import Buf, Region, Step, chunk_bounds, segment_bounds
from ringcore.buffers import DTYPES
from ringcore.config import SCRATCH_SLICE_BYTES, Settings
from ringcore.kernels.numpy_ops import Reducer
from ringcore.ops import Compression, ReduceOp
from ringcore.placement import host_grid, place
from ringcore.slicing import allreduce_slice_bytes
from ringcore.transport.loopback import LoopbackNetwork
from tests import simulate
from tests.unit.test_executor import RUN_TIMEOUT, SIGNATURE, execute, reference, run_ranks, scratch_arrays

pytestmark = pytest.mark.timeout(120)

GRIDS = {
    "2x2": ((0, 1), (2, 3)),
    "4x2": ((0, 1), (2, 3), (4, 5), (6, 7)),
    "2x3": ((0, 1, 2), (3, 4, 5)),
    "3x2 interleaved": ((0, 3), (1, 4), (2, 5)),
    "2x4 shuffled": ((5, 0, 7, 2), (1, 6, 3, 4)),
    "3x3": ((0, 1, 2), (3, 4, 5), (6, 7, 8)),
}


def size_of(grid: Grid) -> int:
    return len(grid) * len(grid[0])


def inputs_for(grid: Grid, count: int, dtype: str, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if dtype.startswith("float"):
        return [rng.standard_normal(count).astype(dtype) for _ in range(size_of(grid))]
    return [rng.integers(-1000, 1000, count).astype(dtype) for _ in range(size_of(grid))]


@pytest.mark.parametrize("name", sorted(GRIDS))
def test_simulated_results_match_numpy_and_agree_bitwise(name: str) -> None:
    grid = GRIDS[name]
    size = size_of(grid)
    for count in sorted({size, size + 1, 64, 1000, 997}):
        for dtype, op in (("int32", ReduceOp.SUM), ("int64", ReduceOp.PROD), ("int16", ReduceOp.MIN)):
            inputs = inputs_for(grid, count, dtype, seed=count)
            schedules = [hierarchical.allreduce(r, grid, count, 8, 64) for r in range(size)]
            reducer = Reducer(DTYPES[dtype], op, Compression.NONE, size)
            for got in simulate.simulate(schedules, inputs, reducer):
                np.testing.assert_array_equal(got, reference(inputs, op))
        inputs = inputs_for(grid, count, "float64", seed=count)
        schedules = [hierarchical.allreduce(r, grid, count, 8, 64) for r in range(size)]
        results = simulate.simulate(
            schedules, inputs, Reducer(DTYPES["float64"], ReduceOp.AVG, Compression.NONE, size)
        )
        for got in results:
            np.testing.assert_allclose(got, reference(inputs, ReduceOp.AVG), rtol=1e-12, atol=1e-12)
            assert got.tobytes() == results[0].tobytes()  # each element reduced by one rank, then copied


@pytest.mark.parametrize("name", ["4x2", "2x3", "3x2 interleaved"])
@pytest.mark.parametrize("segment_bytes", [4, 64])
def test_pipelined_over_loopback_matches_numpy(name: str, segment_bytes: int) -> None:
    """Segments of one to a few elements: the local and cross-host steps pipeline in the executor."""
    grid = GRIDS[name]
    size, count = size_of(grid), 203
    inputs = inputs_for(grid, count, "int32", seed=size)
    reducer_of = lambda: Reducer(DTYPES["int32"], ReduceOp.SUM, Compression.NONE, size)  # noqa: E731

    def body(rank: int, network) -> np.ndarray:
        reducer = reducer_of()
        schedule = hierarchical.allreduce(rank, grid, count, 4, segment_bytes)
        arrays = scratch_arrays(schedule, inputs[rank].copy(), reducer.wire_dtype)
        execute(network, rank, schedule, arrays, reducer)
        result = schedule.result
        return arrays[result.buf][result.start : result.start + result.count].copy()

    for got in run_ranks(size, body, channels=2):
        np.testing.assert_array_equal(got, reference(inputs, ReduceOp.SUM))


def run_pipelined(grid: Grid, inputs: list[np.ndarray], segment_bytes: int, **options) -> list[np.ndarray]:
    """Allreduce ``inputs`` over the loopback transport (2 channels); each rank's result, as the plans commit it.

    ``options``: ``in_place`` (no backups, as ``slicing`` asks for it) and
    ``block_by_block`` (every step waits for the one before, as before
    ``alongside``: the general route the interleaved local rounds must agree with)
    and ``even`` (equal segments, no ramp at the ends of a block).
    """
    size, count = size_of(grid), inputs[0].size
    in_place, block_by_block = options.get("in_place", False), options.get("block_by_block", False)
    even = options.get("even", False)

    def body(rank: int, network) -> np.ndarray:
        reducer = Reducer(DTYPES[inputs[0].dtype.name], ReduceOp.SUM, Compression.NONE, size)
        schedule = hierarchical.allreduce(rank, grid, count, 4, segment_bytes, in_place)
        if block_by_block:
            steps = tuple(dataclasses.replace(step, alongside=False) for step in schedule.steps)
            schedule = dataclasses.replace(schedule, steps=steps)
        if even:
            schedule = dataclasses.replace(schedule, segments=schedule.segments - 2 * schedule.ramp, ramp=0)
        user = inputs[rank].copy()
        arrays = scratch_arrays(schedule, user, reducer.wire_dtype)
        Executor(
            network.transport(rank), schedule, arrays, reducer, 7, SIGNATURE, RUN_TIMEOUT, atomic=False
        ).run()
        result = schedule.result
        assert (result.buf == Buf.USER) == in_place
        return arrays[result.buf][result.start : result.start + result.count].copy()

    return run_ranks(size, body, channels=2)


@pytest.mark.parametrize("name", ["4x2", "2x3", "2x4 shuffled", "3x3"])
@pytest.mark.parametrize("segment_bytes", [4, 64])
def test_in_place_and_block_by_block_agree_bitwise_with_the_interleaved_route(
    name: str, segment_bytes: int
) -> None:
    """In place, the caller's buffer ends with the same bits; so does running local rounds block by block,
    or cutting blocks into equal segments (no ramp)."""
    grid = GRIDS[name]
    inputs = [x.astype(np.float32) for x in inputs_for(grid, 203, "float64", seed=len(grid))]
    interleaved = run_pipelined(grid, inputs, segment_bytes)
    for got in interleaved:
        np.testing.assert_allclose(got, reference(inputs, ReduceOp.SUM), rtol=1e-5, atol=1e-5)
        assert got.tobytes() == interleaved[0].tobytes()
    for options in (
        {"in_place": True},
        {"block_by_block": True},
        {"in_place": True, "block_by_block": True},
        {"even": True},
        {"in_place": True, "even": True},
    ):
        for got in run_pipelined(grid, inputs, segment_bytes, **options):
            assert got.tobytes() == interleaved[0].tobytes(), options


@pytest.mark.parametrize("name", sorted(GRIDS))
def test_in_place_simulated_matches_numpy(name: str) -> None:
    grid = GRIDS[name]
    size = size_of(grid)
    for count in sorted({size, size + 1, 997}):
        inputs = inputs_for(grid, count, "int64", seed=count)
        schedules = [hierarchical.allreduce(r, grid, count, 8, 64, True) for r in range(size)]
        assert all(s.result.buf == Buf.USER for s in schedules)
        reducer = Reducer(DTYPES["int64"], ReduceOp.SUM, Compression.NONE, size)
        for got in simulate.simulate(schedules, inputs, reducer):
            np.testing.assert_array_equal(got, reference(inputs, ReduceOp.SUM))
        floats = inputs_for(grid, count, "float64", seed=count)  # avg divides once, in the commit
        averaged = Reducer(DTYPES["float64"], ReduceOp.AVG, Compression.NONE, size)
        out_of_place = [hierarchical.allreduce(r, grid, count, 8, 64) for r in range(size)]
        expected = simulate.simulate(out_of_place, floats, averaged)[0]
        for got in simulate.simulate(schedules, floats, averaged):
            assert got.tobytes() == expected.tobytes()


def test_local_rounds_go_block_by_block_beside_the_cross_host_steps() -> None:
    """Each block's local rounds come just before the cross-host step that first needs it and run
    alongside the one before; the first cross-host step waits for two blocks' segment k, not all four,
    and only the last block's local allgather is left after the last byte crosses hosts."""
    grid, count, full = GRIDS["4x2"], 8 * 1000, 5
    schedule = hierarchical.allreduce(0, grid, count, 4, 1000 * 4 // full)
    segments = full + 2 * hierarchical.RAMP  # short ones at each end of a block (see the ramp's test)
    assert (schedule.segments, schedule.ramp) == (segments, hierarchical.RAMP)
    labels = [step.label for step in schedule.steps]
    assert labels == [
        *["local reduce-scatter"] * 2,
        "cross reduce-scatter",
        "local reduce-scatter",
        "cross reduce-scatter",
        "local reduce-scatter",
        "cross reduce-scatter",
        *["cross allgather", "local allgather"] * 3,
        "local allgather",
    ]
    program = compile_program(schedule, LoopbackNetwork(8, 1).transport(0))
    assert program.after == (0, 0, 2, 2, 4, 4, 6, 7, 7, 9, 9, 11, 11, 13)
    cross = [step for step in schedule.steps if step.label.startswith("cross")]
    local = [step for step in schedule.steps if step.label == "local reduce-scatter"]
    # rank 0 is host 0: cross step s sends block h-s-1 and adds into h-s-2, the order of the local blocks
    assert [step.recv.start for step in local] == [
        grid_block_start(count, 4, 2, host, 0) for host in (3, 2, 1, 0)
    ]
    assert cross[0].send.start == local[0].recv.start and cross[0].reduce[0].start == local[1].recv.start
    local_sends = program.sends[(1, 0)]  # rank 0's local peer
    head = [(s, k) for s, k, _key, _bits in local_sends[:4]]
    assert head == [(0, 0), (1, 0), (0, 1), (1, 1)]  # the first two blocks interleave segment by segment
    assert [s for s, *_ in local_sends[-segments:]] == [13] * segments
    assert [(s, k) for s, k, _key, _bits in program.sends[(2, 0)]] == sorted(
        (s, k) for s, k, _key, _bits in program.sends[(2, 0)]
    )  # dependent cross-host steps stay step by step


def test_blocks_of_two_segments_or_more_ramp_up_and_down() -> None:
    """The first and last two segments of every block are 1/16 and 1/4 of the others, every block is
    cut alike, and a block of one segment stays whole (no extra frames where there is no pipeline)."""
    grid, count = GRIDS["4x2"], 8 * 4200
    schedule = hierarchical.allreduce(
        0, grid, count, 4, 4200 * 4 // 2
    )  # two segments per block, then the ramp
    assert (schedule.segments, schedule.ramp) == (6, 2)
    program = compile_program(schedule, LoopbackNetwork(8, 1).transport(0))
    for route in program.sends:
        by_step: dict[int, list[int]] = {}
        for s, _k, key, _bits in program.sends[route]:
            by_step.setdefault(s, []).append(key[2] - key[1])
        for lengths in by_step.values():
            assert lengths == [100, 400, 1600, 1600, 400, 100]
    whole = hierarchical.allreduce(0, grid, count, 4, 4200 * 4)
    assert (whole.segments, whole.ramp) == (1, 0)


@pytest.mark.parametrize("count", [0, 1, 5, 41, 42, 1000, 4097])
@pytest.mark.parametrize("segments", [1, 2, 5, 6, 9, 3000])
def test_segment_cuts_tile_the_region(count: int, segments: int) -> None:
    """With or without a ramp, the segments tile the region in order; without one they are array_split's."""
    for ramp in (0, 1, 2):
        cuts = [segment_bounds(count, segments, ramp, k) for k in range(segments)]
        assert [start for start, _ in cuts] == list(
            itertools.accumulate([0] + [n for _, n in cuts[:-1]])
        ) and sum(n for _, n in cuts) == count
        if ramp == 0:
            assert [n for _, n in cuts] == [len(part) for part in np.array_split(np.arange(count), segments)]
        elif segments > 2 * ramp and count >= 42 * segments:
            assert cuts[0][1] < cuts[ramp][1] and cuts[-1][1] < cuts[-1 - ramp][1]


@pytest.mark.parametrize("name", sorted(GRIDS))
def test_no_cross_host_step_waits_on_a_local_round_that_waits_on_the_one_before(name: str) -> None:
    """Between two cross-host steps every local round runs alongside the first (L of 3 or more too),
    so the cross-host chain never waits for a local transfer that waits for it."""
    grid = GRIDS[name]
    for rank in range(size_of(grid)):
        for schedule in (
            hierarchical.allreduce(rank, grid, 997, 4, 64),
            hierarchical.allreduce(rank, grid, 997, 4, 64, True),
        ):
            after = waits_for(schedule.steps)
            cross = [i for i, step in enumerate(schedule.steps) if step.label.startswith("cross")]
            for before, nxt in itertools.pairwise(cross):
                assert all(after[i] <= before for i in range(before + 1, nxt)), (rank, after)


def grid_block_start(count: int, hosts: int, local: int, host: int, column: int) -> int:
    """Where block ``(host, column)`` starts: column ``column`` of a ``local``-way split, cut ``hosts`` ways."""
    columns = chunk_bounds(count, local)
    return columns[column][0] + chunk_bounds(columns[column][1], hosts)[host][0]


def test_alongside_is_refused_where_it_cannot_hold() -> None:
    def block(j: int, alongside: bool = True, whole: bool = False) -> Step:
        """Send USER block j, receive into WORK block j, add USER block j: touches block j only."""
        mine, got = Region(Buf.USER, j, 1), Region(Buf.WORK, j, 1)
        return Step(1, mine, 1, got, reduce=(got, got, mine), alongside=alongside, whole=whole)

    with pytest.raises(ValueError, match="step 0 runs alongside"):
        waits_for((block(0),))
    with pytest.raises(ValueError, match="step 1 runs alongside"):
        waits_for((block(0, alongside=False, whole=True), block(1)))
    assert waits_for((block(0, False), block(1), block(2), block(3, False), block(4))) == (0, 0, 0, 3, 3)
    with pytest.raises(ValueError, match="step 2 runs alongside step 0, but they touch the same region"):
        waits_for((block(0, False), block(1), block(0)))  # writes WORK block 0 again
    reader = Step(1, Region(Buf.WORK, 0, 1), 1, Region(Buf.STAGE, 0, 1), alongside=True)
    with pytest.raises(ValueError, match="step 1 runs alongside step 0"):
        waits_for((block(0, False), reader))  # sends what step 0 receives
    shared_read = Step(1, Region(Buf.USER, 0, 1), 1, Region(Buf.STAGE, 0, 1), alongside=True)
    assert waits_for((block(0, False), shared_read)) == (0, 0)  # both read USER block 0: no conflict
    committing = dataclasses.replace(block(0, False), commit=True)  # writes USER block 0 too
    with pytest.raises(ValueError, match="step 1 runs alongside step 0"):
        waits_for((committing, shared_read))
    wide = Step(1, Region(Buf.USER, 0, 4), 1, Region(Buf.WORK, 0, 4))
    empty = Step(1, Region(Buf.USER, 2, 0), 1, Region(Buf.WORK, 2, 0), alongside=True)
    assert waits_for((wide, empty)) == (0, 0)  # an empty region, even inside another, touches nothing


def test_fp16_compression_rounds_once_per_hop_and_agrees_bitwise() -> None:
    grid = GRIDS["4x2"]
    size, count = 8, 500
    inputs = inputs_for(grid, count, "float32", seed=5)

    def body(rank: int, network) -> np.ndarray:
        reducer = Reducer(DTYPES["float32"], ReduceOp.SUM, Compression.FP16, size)
        schedule = hierarchical.allreduce(rank, grid, count, 2, 128)
        arrays = scratch_arrays(schedule, inputs[rank].copy(), reducer.wire_dtype, reducer)
        execute(network, rank, schedule, arrays, reducer)
        out = np.empty(count, np.float32)
        reducer.convert(out, arrays[Buf.WORK])
        return out

    results = run_ranks(size, body)
    for got in results:
        np.testing.assert_allclose(got, reference(inputs, ReduceOp.SUM), rtol=0, atol=0.05)
        assert got.tobytes() == results[0].tobytes()


@pytest.mark.parametrize("name", ["4x2", "2x3", "2x4 shuffled"])
def test_each_host_sends_the_bandwidth_optimal_share_across_hosts(name: str) -> None:
    """2(H-1)/H of the buffer leaves each host (shared by its L ranks); the rest moves inside hosts."""
    grid = GRIDS[name]
    hosts, local = len(grid), len(grid[0])
    count = hosts * local * 100
    home = {rank: h for h, row in enumerate(grid) for rank in row}
    for h, row in enumerate(grid):
        out = 0
        for rank in row:
            for step in hierarchical.allreduce(rank, grid, count, 4, 1 << 20).steps:
                if step.send is not None and home[step.send_peer] != h:
                    out += step.send.count
        assert out == 2 * (hosts - 1) * count // hosts


def test_stage_holds_only_this_ranks_chunk() -> None:
    grid, count = GRIDS["4x2"], 8000
    for rank in range(8):
        schedule = hierarchical.allreduce(rank, grid, count, 4, 1 << 20)
        stage = [
            r
            for step in schedule.steps
            for r in (step.recv, *(step.reduce or ()))
            if r and r.buf == Buf.STAGE
        ]
        assert stage and max(r.start + r.count for r in stage) <= count // 2


def test_applies_only_to_several_hosts_of_several_ranks() -> None:
    assert hierarchical.applies(GRIDS["4x2"])
    assert not hierarchical.applies(((0, 1, 2, 3),))  # one host
    assert not hierarchical.applies(((0,), (1,), (2,)))  # one rank per host
    assert not hierarchical.applies(None)


def record(hostname: str, local_size: int | None = None, local_rank: int | None = None) -> dict:
    return {"hostname": hostname, "cpus": [0], "local_size": local_size, "local_rank": local_rank}


def test_the_grid_orders_hosts_by_lowest_rank_and_ranks_by_local_rank() -> None:
    records = [record("b"), record("a"), record("b"), record("a")]
    assert place(0, records).grid == ((0, 2), (1, 3))
    declared = [record("a", 2, 1), record("a", 2, 0), record("b", 2, 0), record("b", 2, 1)]
    assert all(place(r, declared).grid == ((1, 0), (2, 3)) for r in range(4))


def test_no_grid_for_unequal_hosts_or_a_local_size_the_host_names_contradict() -> None:
    assert place(0, [record("a"), record("a"), record("b")]).grid is None
    netns = [record("vm", 1, 0) for _ in range(4)]  # emulated hosts that share a host name
    assert place(0, netns).grid is None
    assert host_grid({"a": [0, 1]}, [0, 0], [None, None]) is None  # two ranks claim local rank 0


def uneven_chunks(size: int, seed: int) -> tuple[tuple[int, int], ...]:
    """Chunks of 0 to 40 elements, one per rank, back to back (allgather's rows may differ)."""
    counts = np.random.default_rng(seed).integers(0, 40, size)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    return tuple((int(s), int(n)) for s, n in zip(starts, counts, strict=True))


@pytest.mark.parametrize("name", sorted(GRIDS))
def test_reduce_scatter_gives_each_rank_its_chunk_reduced(name: str) -> None:
    grid = GRIDS[name]
    size = size_of(grid)
    for seed in range(3):
        chunks = uneven_chunks(size, seed)
        count = sum(n for _, n in chunks)
        inputs = inputs_for(grid, count, "int64", seed=seed)
        schedules = [hierarchical.reduce_scatter(r, grid, chunks, 8, 32) for r in range(size)]
        results = simulate.simulate(
            schedules, inputs, Reducer(DTYPES["int64"], ReduceOp.SUM, Compression.NONE, size)
        )
        total = np.sum(inputs, axis=0)
        for rank, got in enumerate(results):
            start, n = chunks[rank]
            np.testing.assert_array_equal(got, total[start : start + n])


@pytest.mark.parametrize("name", sorted(GRIDS))
def test_allgather_spreads_every_chunk_to_every_rank(name: str) -> None:
    grid = GRIDS[name]
    size = size_of(grid)
    for seed in range(3):
        chunks = uneven_chunks(size, seed)
        count = sum(n for _, n in chunks)
        full = np.arange(count, dtype=np.int32) * 7 + 1
        schedules = [hierarchical.allgather(r, grid, chunks, 4, 32) for r in range(size)]
        # allgather starts from WORK holding this rank's chunk: simulate's prefill puts USER there
        schedules = [dataclasses.replace(s, prefill_work=True) for s in schedules]
        inputs = []
        for rank in range(size):
            mine = np.zeros(count, np.int32)
            start, n = chunks[rank]
            mine[start : start + n] = full[start : start + n]
            inputs.append(mine)
        reducer = Reducer(DTYPES["int32"], ReduceOp.SUM, Compression.NONE, size)
        for got in simulate.simulate(schedules, inputs, reducer):
            np.testing.assert_array_equal(got, full)


@pytest.mark.parametrize("name", sorted(GRIDS))
def test_the_broadcast_chain_crosses_each_host_boundary_once(name: str) -> None:
    grid = GRIDS[name]
    size = size_of(grid)
    home = {rank: h for h, row in enumerate(grid) for rank in row}
    for root in range(size):
        order = hierarchical.chain_order(grid, root)
        assert order[0] == root and sorted(order) == list(range(size))
        assert sum(home[a] != home[b] for a, b in itertools.pairwise(order)) == len(grid) - 1
        data = np.arange(50, dtype=np.int64) + 100 * root
        inputs = [data if r == root else np.zeros(50, np.int64) for r in range(size)]
        schedules = [chain.broadcast(r, size, root, 50, 8, 64, order) for r in range(size)]
        reducer = Reducer(DTYPES["int64"], ReduceOp.SUM, Compression.NONE, size)
        for got in simulate.simulate(schedules, inputs, reducer):
            np.testing.assert_array_equal(got, data)


@pytest.mark.parametrize("name", sorted(GRIDS))
def test_the_barrier_reaches_every_rank_and_crosses_hosts_only_between_columns(name: str) -> None:
    """Round by round, every rank hears (through a chain of frames) from every rank; few rounds cross hosts."""
    grid = GRIDS[name]
    size = size_of(grid)
    home = {rank: h for h, row in enumerate(grid) for rank in row}
    schedules = [hierarchical.barrier(rank, grid) for rank in range(size)]
    rounds = {len(s.steps) for s in schedules}
    assert rounds == {math.ceil(math.log2(len(grid[0]))) + math.ceil(math.log2(len(grid)))}
    heard = [{rank} for rank in range(size)]
    for i in range(rounds.pop()):
        before = [set(h) for h in heard]
        for rank, schedule in enumerate(schedules):
            step = schedule.steps[i]
            match = schedules[step.send_peer].steps[i]
            assert match.recv_peer == rank and match.phase == step.phase, "a send without its receive"
            heard[rank] |= before[step.recv_peer]
            crosses = home[step.send_peer] != home[rank]
            assert crosses == (i >= math.ceil(math.log2(len(grid[0])))), "only the second part crosses hosts"
    assert all(h == set(range(size)) for h in heard)


@pytest.mark.parametrize("name", ["4x2", "3x2 interleaved", "2x4 shuffled"])
def test_the_barrier_runs_over_the_loopback_transport(name: str) -> None:
    from tests.unit.test_lockstep import run_lockstep

    grid = GRIDS[name]
    run_lockstep(
        size_of(grid),
        lambda rank: hierarchical.barrier(rank, grid),
        lambda rank, schedule: {Buf.WORK: np.empty(0, np.uint8)},
    )


def test_in_place_the_scratch_is_stage_and_the_slices_grow_to_fill_the_same_bound() -> None:
    """In place at 2 ranks a host the allreduce touches only STAGE (half a slice), so its slices are
    twice as long; with L ranks a host, L/(L-1). Out of place, compressed or atomic: the bound as is."""
    for grid, scratch, factor in (
        (GRIDS["4x2"], (Buf.STAGE,), 2),
        (GRIDS["3x3"], (Buf.WORK, Buf.STAGE), 1.5),
    ):
        assert hierarchical.allreduce(0, grid, 6000, 4, 1024, True).scratch == scratch
        assert hierarchical.allreduce(0, grid, 6000, 4, 1024).scratch == (Buf.WORK, Buf.STAGE)
        settings = Settings()
        ctx = types.SimpleNamespace(settings=settings, grid=grid, allreduce_slice_bytes=SCRATCH_SLICE_BYTES)
        assert allreduce_slice_bytes(ctx, True) == SCRATCH_SLICE_BYTES * factor
        assert allreduce_slice_bytes(ctx, False) == SCRATCH_SLICE_BYTES
        for changed in ({"atomic": True}, {"hierarchical": False}, {"slice_bytes": 8 << 20}):
            ctx.settings = dataclasses.replace(settings, **changed)
            assert allreduce_slice_bytes(ctx, True) == SCRATCH_SLICE_BYTES, changed
        ctx.settings, ctx.grid = settings, None
        assert allreduce_slice_bytes(ctx, True) == SCRATCH_SLICE_BYTES
