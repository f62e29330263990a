"""The numpy reference of ``tests/reference.py`` accepts every order of evaluation and refuses wrong results.

An allreduce may add in any order and round on the way; these tests play
such reductions in numpy (random orders, rounding to the dtype after each
step, and to float16 per hop with fp16 on the wire) on values with NaN,
infinities, signed zeros, subnormals and overflow, and require the
reference to accept them, then damage one element and require it to refuse.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.reference import check_allreduce, round_to

FLOATS = ["float16", "float32", "float64", "bfloat16"]
SPECIALS = [np.nan, np.inf, -np.inf, 0.0, -0.0, 65504.0, 65520.0, -7e4, 2.0**-24, 3e-39, 1e-300, 1e38, 3e38]


def _inputs(name: str, size: int, count: int, seed: int) -> list[np.ndarray]:
    """Values already representable in ``name``: ordinary ones, specials, the far ends of the range."""
    rng = np.random.default_rng(seed)
    values = rng.uniform(-4, 4, (size, count)) * 10.0 ** rng.integers(-3, 4, (size, count))
    special = rng.random((size, count)) < 0.3
    values[special] = rng.choice(SPECIALS, int(special.sum()))
    return list(round_to(values, name))


def _play(inputs: list[np.ndarray], op: str, name: str, fp16: bool, rng: np.random.Generator) -> np.ndarray:
    """One order of evaluation: a random order of ranks, rounding every partial to ``name``
    (and to float16 before each hop when ``fp16``), then the final value through the wire once more."""
    order = rng.permutation(len(inputs))
    ufunc = {"sum": np.add, "avg": np.add, "min": np.minimum, "max": np.maximum, "prod": np.multiply}[op]

    def hop(x: np.ndarray) -> np.ndarray:
        return round_to(round_to(x, "float16"), name) if fp16 else x

    with np.errstate(all="ignore"):
        acc = inputs[order[0]]
        for rank in order[1:]:
            acc = round_to(ufunc(hop(acc), inputs[rank]), name)
        if op == "avg":
            acc = round_to(acc / len(inputs), name)
        return hop(acc)


def _storage(values: np.ndarray, name: str) -> tuple[np.ndarray, bool]:
    """``values`` as a buffer of ``name`` would hold them (bfloat16: uint16 bits)."""
    if name != "bfloat16":
        return values.astype(name), False
    return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16), True


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(FLOATS),
    op=st.sampled_from(["sum", "avg", "min", "max", "prod"]),
    size=st.integers(2, 5),
    fp16=st.booleans(),
    seed=st.integers(0, 2**32),
)
def test_every_order_of_evaluation_is_accepted(name: str, op: str, size: int, fp16: bool, seed: int) -> None:
    values = _inputs(name, size, 400, seed)
    rng = np.random.default_rng(seed)
    inputs = [_storage(x, name)[0] for x in values]
    bf16 = name == "bfloat16"
    for _ in range(3):
        result, _ = _storage(_play(values, op, name, fp16, rng), name)
        check_allreduce(result, inputs, op, "fp16" if fp16 else None, bfloat16=bf16)


@pytest.mark.parametrize("name", FLOATS)
@pytest.mark.parametrize("op", ["sum", "prod", "max"])
def test_wrong_results_are_refused(name: str, op: str) -> None:
    values = [
        np.array(v, np.float64) for v in ([1.5, 0.0, -0.0, 2.0, np.nan], [2.5, -0.0, -0.0, np.inf, 1.0])
    ]
    inputs = [_storage(x, name)[0] for x in values]
    bf16 = name == "bfloat16"
    right = _play(values, op, name, False, np.random.default_rng(0))
    check_allreduce(_storage(right, name)[0], inputs, op, bfloat16=bf16)
    for index, wrong in [(0, right[0] * 1.25), (1, -right[1] if op == "prod" else np.nan), (4, 7.0)]:
        damaged = right.copy()
        damaged[index] = wrong
        if op != "prod" and index == 1:  # a sum of +0 and -0 is +0; its sign is the damage
            damaged[index] = -0.0 if op == "sum" else np.nan
        with pytest.raises(AssertionError):
            check_allreduce(_storage(damaged, name)[0], inputs, op, bfloat16=bf16)


def test_integers_are_exact_and_wrap() -> None:
    inputs = [np.array([127, -128, 5], np.int8), np.array([1, -1, 5], np.int8)]
    check_allreduce(np.array([-128, 127, 10], np.int8), inputs, "sum")
    with pytest.raises(AssertionError):
        check_allreduce(np.array([-128, 127, 11], np.int8), inputs, "sum")


def test_overflow_on_the_wire_may_be_infinite_only_where_a_partial_sum_overflows() -> None:
    inputs = [np.array([6e4, 6e4, 1.0], np.float32), np.array([1e4, -1e4, 1.0], np.float32)]
    check_allreduce(np.array([np.inf, 5e4, 2.0], np.float32), inputs, "sum", "fp16")  # 7e4 > 65504
    with pytest.raises(AssertionError):  # 6e4 - 1e4 overflows in no order
        check_allreduce(np.array([np.inf, np.inf, 2.0], np.float32), inputs, "sum", "fp16")
    with pytest.raises(AssertionError):  # inputs of one sign never sum to NaN or -inf
        check_allreduce(np.array([-np.inf, 5e4, 2.0], np.float32), inputs, "sum", "fp16")
    with pytest.raises(AssertionError):  # 1 + 1 cannot overflow
        check_allreduce(np.array([np.inf, 5e4, np.inf], np.float32), inputs, "sum", "fp16")
