"""Every collective against numpy, on live clusters of 1-5 processes over real TCP.

Hypothesis draws the arguments (shape, dtype, op, root, compression, a seed);
numpy builds the values and the reference. Each rank's result must equal the
reference (exactly for integers, whose sums and products wrap around in the
array's dtype as numpy's do; within a rounding bound for floats), and every
rank must hold bitwise the same bytes.

Clusters are module-scoped, one per configuration, and reused by every
example; a cluster on which a rank failed is restarted before the next example
so that one failure does not cascade into the rest. The ``ring*``
configurations shrink ``RINGCORE_SMALL_BYTES`` and ``RINGCORE_SEGMENT_BYTES``
so that a few thousand elements already take the ring path in several
segments over two channels (``ring4`` and ``ring5`` with halving-doubling
off); ``halving4`` and ``halving5`` (whose rank 4 folds into rank 0) send
them through halving-doubling.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import tasks
from tests.cluster import Cluster, RankError
from tests.reference import check_allreduce

try:
    import ml_dtypes

    BFLOAT16: np.dtype | None = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # bfloat16 is then covered through torch only
    BFLOAT16 = None

HAS_TORCH = importlib.util.find_spec("torch") is not None

RING_ENV = {"RINGCORE_SMALL_BYTES": "256", "RINGCORE_SEGMENT_BYTES": "4K", "RINGCORE_CHANNELS": "2"}
CONFIGS: dict[str, tuple[int, dict[str, str]]] = {
    "n1": (1, {}),
    "n2": (2, {}),
    "n3": (3, {}),
    "n4": (4, {}),
    "n5": (5, {}),
    "ring2": (2, RING_ENV),
    "ring3": (3, RING_ENV),
    "ring5": (5, {**RING_ENV, "RINGCORE_HALVING_BYTES": "0"}),
    "ring4": (4, {**RING_ENV, "RINGCORE_HALVING_BYTES": "0"}),
    "halving4": (4, {"RINGCORE_SMALL_BYTES": "256", "RINGCORE_HALVING_BYTES": "1M"}),
    "halving5": (5, {"RINGCORE_SMALL_BYTES": "256", "RINGCORE_HALVING_BYTES": "1M"}),  # rank 4 folds in
}

FLOATS = ["float16", "float32", "float64"] + (["bfloat16"] if BFLOAT16 is not None else [])
INTS = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
OPS = ["sum", "avg", "min", "max", "prod"]
UFUNCS = {"sum": np.add, "avg": np.add, "min": np.minimum, "max": np.maximum, "prod": np.multiply}
FP16_UNIT = 2.0**-10  # float16's machine epsilon: one rounding costs at most half of it, relative

# RINGCORE_TEST_EXAMPLES scales every property down, e.g. in the slow Soft-RoCE guest of ci/rdma-vm.
EXAMPLES = int(os.environ.get("RINGCORE_TEST_EXAMPLES", "40"))
PROPERTY = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


class LiveCluster:
    """A cluster that is started on first use and restarted after any rank failed."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.size, self.env = CONFIGS[name]
        self.cluster: Cluster | None = None

    def run(self, fn: Any, *args: Any) -> list[Any]:
        if self.cluster is None:
            self.cluster = Cluster(self.size, env=self.env)
        out = self.cluster.run(fn, *args, timeout=60)
        errors = {r: v for r, v in enumerate(out) if isinstance(v, RankError)}
        if errors:
            self.close()
            details = "\n".join(f"rank {r}: {e.type_name}: {e.message}\n{e.trace}" for r, e in errors.items())
            raise AssertionError(f"{self.name}: ranks failed:\n{details}")
        return out

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.close()
            self.cluster = None


@pytest.fixture(scope="module", params=list(CONFIGS))
def live(request: pytest.FixtureRequest) -> Any:
    cluster = LiveCluster(request.param)
    yield cluster
    cluster.close()


# ---------------------------------------------------------------------------- strategies

COUNTS = st.one_of(
    st.sampled_from([0, 1, 2, 3, 4, 5, 7, 11, 13, 127, 1021, 4099, 10007]),
    st.integers(0, 40_000),
)


@st.composite
def shapes(draw: Any, min_dims: int = 0) -> tuple[int, ...]:
    """Flat (0, 1, primes, fewer elements than ranks, tens of thousands), 0-d or 2-3-d."""
    kind = draw(st.sampled_from(["flat", "flat", "multi", "0d"] if min_dims == 0 else ["flat", "multi"]))
    if kind == "0d":
        return ()
    if kind == "flat":
        return (draw(COUNTS),)
    return tuple(draw(st.lists(st.integers(0, 24), min_size=2, max_size=3)))


def dtype_of(name: str) -> np.dtype:
    return BFLOAT16 if name == "bfloat16" else np.dtype(name)


def ops_for(dtype: str) -> list[str]:
    return OPS if dtype in FLOATS else [op for op in OPS if op != "avg"]


def make_input(dtype: str, shape: tuple[int, ...], op: str, rng: np.random.Generator) -> np.ndarray:
    """Floats of magnitude 1/4..4 (1/2..2 for prod: no overflow, no zeros); integers over their full range."""
    if dtype in INTS:
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    low, high = (0.5, 2.0) if op == "prod" else (0.25, 4.0)
    values = rng.uniform(low, high, size=shape) * rng.choice([-1.0, 1.0], size=shape)
    return np.asarray(values).astype(dtype_of(dtype))


def make_inputs(dtype: str, shapes_: list[tuple[int, ...]], op: str, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [make_input(dtype, shape, op, rng) for shape in shapes_]


# ---------------------------------------------------------------------------- references


def eps(dtype: str) -> float:
    return 2.0**-7 if dtype == "bfloat16" else float(np.finfo(dtype).eps)


def tiny(dtype: str) -> float:
    """The smallest normal number (bfloat16 has float32's exponent range)."""
    return float(np.finfo(np.float32 if dtype == "bfloat16" else dtype).tiny)


def reference(inputs: list[np.ndarray], op: str) -> np.ndarray:
    """Integers: the reduction in their own dtype (wrapping); floats: exact-ish, in float64."""
    if inputs[0].dtype.kind in "iu":
        return functools.reduce(UFUNCS[op], inputs)
    wide = np.stack([x.astype(np.float64) for x in inputs])
    result = UFUNCS[op].reduce(wide, axis=0)
    return result / len(inputs) if op == "avg" else result


def tolerance(inputs: list[np.ndarray], op: str, dtype: str, ref: np.ndarray, compression: Any) -> np.ndarray:
    """Element-wise bound on |result - reference| for a float reduction over N ranks.

    Each of the N-1 combines rounds once to the dtype (bounded by eps * the
    sum of magnitudes); avg divides once more. fp16 compression adds at most
    one float16 rounding per hop: (N+1) * 2**-10 * sum_r |x_r|.
    """
    n = len(inputs)
    magnitude = np.stack([np.abs(x.astype(np.float64)) for x in inputs]).sum(axis=0)
    e = eps(dtype)
    if op == "sum":
        scale, bound = magnitude, n * e * magnitude
    elif op == "avg":
        scale, bound = magnitude / n, e * magnitude + e * np.abs(ref)
    elif op == "prod":
        scale, bound = np.abs(ref), 2 * n * e * np.abs(ref)
    else:  # min, max pick one of the inputs: exact
        scale, bound = np.abs(ref), np.zeros_like(ref)
    if compression == "fp16":
        bound = bound + (n + 1) * FP16_UNIT * scale + 1e-6
    return bound + tiny(dtype)


def assert_identical(results: list[np.ndarray]) -> None:
    """Every rank holds the same dtype, shape and bytes."""
    first = results[0]
    for rank, result in enumerate(results):
        assert result.dtype == first.dtype and result.shape == first.shape, (rank, result.dtype, result.shape)
        assert result.tobytes() == first.tobytes(), f"rank {rank} differs from rank 0 in its bytes"


def assert_reduced(
    result: np.ndarray, inputs: list[np.ndarray], op: str, dtype: str, compression: Any = None
) -> None:
    ref = reference(inputs, op)
    assert result.dtype == dtype_of(dtype), (result.dtype, dtype)
    assert result.shape == ref.shape, (result.shape, ref.shape)
    if dtype in INTS:
        np.testing.assert_array_equal(result, ref)
        return
    got = result.astype(np.float64)
    bound = tolerance(inputs, op, dtype, ref, compression)
    error = np.abs(got - ref)
    bad = ~(error <= bound)
    assert not bad.any(), (
        f"{int(bad.sum())} of {ref.size} elements off; first at {np.argwhere(bad)[0]}: "
        f"got {got[bad][0]!r}, expected {ref[bad][0]!r} within {bound[bad][0]!r}"
    )


# ---------------------------------------------------------------------------- allreduce


@pytest.mark.timeout(240)
@PROPERTY
@given(data=st.data())
def test_allreduce_matches_numpy(live: LiveCluster, data: st.DataObject) -> None:
    dtype = data.draw(st.sampled_from(FLOATS + INTS), label="dtype")
    op = data.draw(st.sampled_from(ops_for(dtype)), label="op")
    shape = data.draw(shapes(), label="shape")
    inputs = make_inputs(dtype, [shape] * live.size, op, data.draw(st.integers(0, 2**32), label="seed"))
    results = live.run(tasks.allreduce, inputs, op)
    assert_identical(results)
    assert_reduced(results[0], inputs, op, dtype)


@pytest.mark.timeout(240)
@PROPERTY
@given(data=st.data())
def test_allreduce_fp16_compression(live: LiveCluster, data: st.DataObject) -> None:
    dtype = data.draw(st.sampled_from(["float32", "float64"]), label="dtype")
    op = data.draw(st.sampled_from(OPS), label="op")
    shape = data.draw(shapes(), label="shape")
    inputs = make_inputs(dtype, [shape] * live.size, op, data.draw(st.integers(0, 2**32), label="seed"))
    results = live.run(tasks.allreduce, inputs, op, "fp16")
    assert_identical(results)
    assert_reduced(results[0], inputs, op, dtype, compression="fp16")


# NaN, infinities, signed zeros, subnormals, the ends of each format's range and float16's (fp16 on
# the wire overflows past 65504, rounds to infinity from 65520 and flushes below 2**-25).
SPECIALS = [np.nan, np.inf, -np.inf, 0.0, -0.0, 65504.0, 65520.0, -7e4, 2.0**-24, 2.0**-25, 1e-40, 3e38]
SPECIAL_CONFIGS = ["n1", "n2", "n4", "ring3", "ring5", "halving5"]


def special_values(dtype: str) -> st.SearchStrategy[float]:
    """Floats of ``dtype``'s width with NaN, infinities, subnormals, and the values above."""
    width = {"float16": 16, "float64": 64}.get(dtype, 32)  # bfloat16: drawn as float32, then rounded
    info = np.finfo(np.float32 if dtype == "bfloat16" else dtype)
    ends = [float(info.max), -float(info.max), float(info.tiny), float(info.smallest_subnormal)]
    return st.one_of(
        st.sampled_from(SPECIALS + ends),
        st.floats(width=width, allow_nan=True, allow_infinity=True, allow_subnormal=True),
    )


def special_inputs(data: st.DataObject, size: int, dtype: str, counts: list[int]) -> list[np.ndarray]:
    """One array per rank: ordinary values with specials drawn by hypothesis scattered over them."""
    count = data.draw(st.sampled_from(counts), label="count")
    pool = data.draw(st.lists(special_values(dtype), min_size=1, max_size=12), label="specials")
    density = data.draw(st.sampled_from([0.05, 0.5, 1.0]), label="density")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32), label="seed"))
    values = rng.uniform(-4, 4, (size, count))
    chosen = rng.random((size, count)) < density
    values[chosen] = rng.choice(np.array(pool), int(chosen.sum()))
    with np.errstate(over="ignore"):  # float16's overflow to infinity is one of the values wanted
        return list(values.astype(dtype_of(dtype)))


@pytest.mark.parametrize("live", SPECIAL_CONFIGS, indirect=True)
@pytest.mark.timeout(240)
@settings(PROPERTY, max_examples=min(25, EXAMPLES))
@given(data=st.data())
def test_allreduce_special_values_match_numpy(live: LiveCluster, data: st.DataObject) -> None:
    """Specials scattered over ordinary values, every float dtype, op and compression, against
    ``tests/reference.py`` (numpy's semantics: exact for min and max, NaN where numpy has NaN,
    infinities with their sign, sums and products within rounding where no partial result can
    overflow, and only what every order of evaluation agrees on where one can)."""
    dtype = data.draw(st.sampled_from(FLOATS), label="dtype")
    op = data.draw(st.sampled_from(OPS), label="op")
    compression = data.draw(st.sampled_from([None, "fp16"]), label="compression")
    inputs = special_inputs(data, live.size, dtype, [1, 3, 64, 1021, 3001])
    results = live.run(tasks.allreduce, inputs, op, compression)
    assert_identical(results)
    check_allreduce(results[0], inputs, op, compression, where=f"{live.name} {dtype}")


@pytest.mark.parametrize("live", SPECIAL_CONFIGS, indirect=True)
@pytest.mark.timeout(240)
@settings(PROPERTY, max_examples=min(25, EXAMPLES))
@given(data=st.data())
def test_reduce_scatter_special_values_match_numpy(live: LiveCluster, data: st.DataObject) -> None:
    """The same values through reduce_scatter: each rank's chunk against the reference."""
    dtype = data.draw(st.sampled_from(FLOATS), label="dtype")
    op = data.draw(st.sampled_from(OPS), label="op")
    compression = data.draw(st.sampled_from([None, "fp16"]), label="compression")
    inputs = special_inputs(data, live.size, dtype, [1, 7, 64, 3001])
    results = live.run(tasks.reduce_scatter, inputs, op, compression)
    for rank, result in enumerate(results):
        chunks = [np.array_split(x, live.size)[rank] for x in inputs]
        check_allreduce(result, chunks, op, compression, where=f"{live.name} {dtype} rank {rank}")


@pytest.mark.timeout(240)
@PROPERTY
@given(data=st.data())
def test_allreduce_async_in_order(live: LiveCluster, data: st.DataObject) -> None:
    """Several async allreduces in flight, then a blocking one: each buffer gets its own reduction."""
    k = data.draw(st.integers(1, 4), label="buffers")
    dtypes = data.draw(st.lists(st.sampled_from(FLOATS + INTS), min_size=k, max_size=k), label="dtypes")
    ops = [data.draw(st.sampled_from(ops_for(d)), label="op") for d in dtypes]
    shapes_ = [data.draw(shapes(), label="shape") for _ in dtypes]
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32), label="seed"))
    buffers = zip(dtypes, shapes_, ops, strict=True)
    per_buffer = [[make_input(d, s, op, rng) for _ in range(live.size)] for d, s, op in buffers]
    per_rank = [[inputs[r] for inputs in per_buffer] for r in range(live.size)]
    results = live.run(tasks.allreduce_async_many, per_rank, ops)
    assert all(same for _, same in results), "a handle did not return its own buffer"
    for i, (dtype, op) in enumerate(zip(dtypes, ops, strict=True)):
        assert_identical([bufs[i] for bufs, _ in results])
        assert_reduced(results[0][0][i], per_buffer[i], op, dtype)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("count", [1, 3, 64, 1000, 20_011])
def test_fp16_compression_bitwise_identical_fixed_sizes(live: LiveCluster, count: int) -> None:
    """Deterministic companion of the property above: small buffers take recursive doubling."""
    rng = np.random.default_rng(count)
    inputs = [rng.uniform(-4, 4, count).astype(np.float32) for _ in range(live.size)]
    results = live.run(tasks.allreduce, inputs, "sum", "fp16")
    assert_identical(results)
    assert_reduced(results[0], inputs, "sum", "float32", compression="fp16")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16", "int32", "uint64"])
def test_allreduce_every_op_on_a_large_prime_count(live: LiveCluster, dtype: str) -> None:
    """30011 elements: the ring path in the ring* clusters (several 4 KiB segments per chunk)."""
    if dtype not in FLOATS + INTS:
        pytest.skip("bfloat16 needs ml_dtypes")
    for op in ops_for(dtype):
        inputs = make_inputs(dtype, [(30_011,)] * live.size, op, seed=len(dtype) * 10 + OPS.index(op))
        results = live.run(tasks.allreduce, inputs, op)
        assert_identical(results)
        assert_reduced(results[0], inputs, op, dtype)


# ---------------------------------------------------------------------------- broadcast, allgather


@pytest.mark.timeout(240)
@PROPERTY
@given(data=st.data())
def test_broadcast_copies_root(live: LiveCluster, data: st.DataObject) -> None:
    dtype = data.draw(st.sampled_from(FLOATS + INTS), label="dtype")
    shape = data.draw(shapes(), label="shape")
    root = data.draw(st.integers(0, live.size - 1), label="root")
    inputs = make_inputs(dtype, [shape] * live.size, "sum", data.draw(st.integers(0, 2**32), label="seed"))
    results = live.run(tasks.broadcast, inputs, root)
    for rank, result in enumerate(results):
        assert result.dtype == inputs[root].dtype and result.shape == shape
        assert result.tobytes() == inputs[root].tobytes(), f"rank {rank} does not hold root {root}'s buffer"


@pytest.mark.timeout(240)
@PROPERTY
@given(data=st.data())
def test_allgather_concatenates(live: LiveCluster, data: st.DataObject) -> None:
    dtype = data.draw(st.sampled_from(FLOATS + INTS), label="dtype")
    trailing = tuple(data.draw(st.lists(st.integers(0, 6), max_size=2), label="trailing"))
    rows = data.draw(
        st.lists(st.one_of(st.integers(0, 3), st.integers(0, 3000)), min_size=live.size, max_size=live.size),
        label="rows",
    )
    shapes_ = [(n, *trailing) for n in rows]
    inputs = make_inputs(dtype, shapes_, "sum", data.draw(st.integers(0, 2**32), label="seed"))
    expected = np.concatenate(inputs)
    results = live.run(tasks.allgather, inputs)
    for rank, result in enumerate(results):
        assert result.dtype == expected.dtype and result.shape == expected.shape, (rank, result.shape)
        assert result.tobytes() == expected.tobytes(), f"rank {rank} gathered something else"


# ---------------------------------------------------------------------------- reduce_scatter


@pytest.mark.timeout(240)
@PROPERTY
@given(data=st.data())
def test_reduce_scatter_gives_each_rank_its_chunk(live: LiveCluster, data: st.DataObject) -> None:
    dtype = data.draw(st.sampled_from(FLOATS + INTS), label="dtype")
    op = data.draw(st.sampled_from(ops_for(dtype)), label="op")
    compression = data.draw(st.sampled_from([None, "fp16"]), label="compression")
    if dtype not in ("float32", "float64"):
        compression = None
    shape = data.draw(shapes(min_dims=1), label="shape")
    inputs = make_inputs(dtype, [shape] * live.size, op, data.draw(st.integers(0, 2**32), label="seed"))
    results = live.run(tasks.reduce_scatter, inputs, op, compression)
    for rank, result in enumerate(results):
        chunk_inputs = [np.array_split(x, live.size)[rank] for x in inputs]
        assert result.shape == chunk_inputs[0].shape, (rank, result.shape, chunk_inputs[0].shape)
        assert_reduced(result, chunk_inputs, op, dtype, compression)


# ---------------------------------------------------------------------------- barrier


@pytest.mark.timeout(120)
@settings(
    max_examples=min(8, EXAMPLES), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_barrier_waits_for_the_last_rank(live: LiveCluster, data: st.DataObject) -> None:
    """No rank leaves the barrier before the last one entered it (wall clocks of one machine)."""
    delays = data.draw(
        st.lists(st.sampled_from([0.0, 0.0, 0.02, 0.1]), min_size=live.size, max_size=live.size),
        label="delays",
    )
    times = live.run(tasks.barrier_times, delays)
    last_entered = max(entered for entered, _ in times)
    first_left = min(left for _, left in times)
    assert first_left >= last_entered, (
        f"a rank left at {first_left} before the last entered at {last_entered}"
    )


# ---------------------------------------------------------------------------- torch tensors


@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
@pytest.mark.parametrize("live", ["n3", "ring3"], indirect=True)
@pytest.mark.timeout(240)
@settings(
    max_examples=min(15, EXAMPLES), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_torch_cpu_tensors_in_place(live: LiveCluster, data: st.DataObject) -> None:
    """float32, int64 and bfloat16 CPU tensors reduce in place (same storage) like numpy arrays."""
    dtype = data.draw(st.sampled_from(["float32", "int64", "bfloat16"]), label="dtype")
    op = data.draw(
        st.sampled_from(["sum", "max", "prod"] + (["avg"] if dtype != "int64" else [])), label="op"
    )
    shape = data.draw(shapes(), label="shape")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32), label="seed"))
    source = "int64" if dtype == "int64" else "float32"
    inputs = [make_input(source, shape, op, rng) for _ in range(live.size)]
    results = live.run(tasks.torch_allreduce, inputs, dtype, op)
    assert all(in_place for _, _, in_place in results), "the tensor was not reduced in place"
    assert_identical([result for _, result, _ in results])
    given_inputs = [given_ for given_, _, _ in results]  # as the tensors held them (bfloat16-rounded)
    result = results[0][1]
    if dtype == "int64":
        np.testing.assert_array_equal(result, reference(given_inputs, op))
        return
    ref = reference(given_inputs, op)
    bound = tolerance(given_inputs, op, dtype, ref, None)
    assert np.all(np.abs(result - ref) <= bound), np.max(np.abs(result - ref) - bound)
