"""What an allreduce must return, worked out by numpy alone: the reference for results of any path.

Integers: the reduction in their own dtype (sums and products wrap, as
numpy's do), so every order gives the same bits and the check is exact.

Floats, where NaN, infinities, signed zeros and subnormals may be among the
inputs. min and max pick one of the inputs whatever the order, and NaN
propagates as ``np.minimum``/``np.maximum`` make it: exact. With fp16 on the
wire every value a rank ends with went through float16 (rounding is
monotonic, so the result is the min or max of the rounded inputs); a world
of one sends nothing, so its result is its input. Sums and products depend on
the order the engine adds in, which is not numpy's, so they are compared with
the exact value (float64) within a bound: N-1 roundings to the dtype, N
roundings to float16 on the wire with fp16 (a chunk crosses N-1 hops in the
scatter-reduce and one in the allgather), one for avg's division and one for
the float64 reference itself, each at most one unit roundoff of the sum of
magnitudes (of the product, for prod); plus a few of the smallest
subnormal's half-spacings, for rounding near zero. NaN must come out exactly
where numpy's exact result is NaN, infinities with their sign, and zero
sums of zeros with the sign IEEE gives them (-0 only if every input is -0).

Overflow and underflow are order-dependent: every value an engine holds on
the way is the sum (product) of a subset of the ranks' inputs, so where some
subset's sum reaches the largest finite value (float16's on the wire with
fp16), or some subset's product leaves the normal range, the element may
legitimately be an infinity (or, with inputs of both signs, NaN) instead of
the exact value. There only what holds in every order is checked: NaN
inputs (or +inf with -inf) give NaN, a sum of inputs of one sign never gives
NaN nor the other infinity, and a product's sign is the product of the signs.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np

UFUNCS = {"sum": np.add, "avg": np.add, "min": np.minimum, "max": np.maximum, "prod": np.multiply}

# (unit roundoff, largest finite, smallest normal, smallest subnormal) per float format
_FORMATS = {
    "float16": (2.0**-11, 65504.0, 2.0**-14, 2.0**-24),
    "bfloat16": (2.0**-8, float(np.uint32(0x7F7F0000).view(np.float32)), 2.0**-126, 2.0**-133),
    "float32": (2.0**-24, float(np.finfo(np.float32).max), 2.0**-126, 2.0**-149),
    "float64": (2.0**-53, float(np.finfo(np.float64).max), 2.0**-1022, 5e-324),
}


def format_name(x: np.ndarray, bfloat16: bool = False) -> str:
    """``float16``/``bfloat16``/``float32``/``float64``, or the integer dtype's name."""
    if bfloat16 or x.dtype.name == "bfloat16":
        return "bfloat16"
    return x.dtype.name


def as_float64(x: np.ndarray, bfloat16: bool = False) -> np.ndarray:
    """The values of ``x`` (bfloat16 as its uint16 bits with ``bfloat16``, or an ml_dtypes array)."""
    if bfloat16:
        return (np.asarray(x).view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    if x.dtype.name == "bfloat16":
        return x.astype(np.float32).astype(np.float64)
    return x.astype(np.float64)


def round_to(values: np.ndarray, name: str) -> np.ndarray:
    """``values`` rounded to nearest-even in float format ``name``, back as float64."""
    with np.errstate(over="ignore", invalid="ignore"):
        if name != "bfloat16":
            return values.astype(name).astype(np.float64)
        bits = values.astype(np.float32).view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16).astype(np.uint32).view(np.float32)
    return np.where(np.isnan(values), np.nan, rounded.astype(np.float64))


def check_allreduce(
    got: np.ndarray,
    inputs: list[np.ndarray],
    op: str,
    compression: str | None = None,
    bfloat16: bool = False,
    where: str = "",
) -> None:
    """Assert that ``got`` is what an allreduce of ``inputs`` (one array per rank) may return.

    ``got`` may be the result's bits (an unsigned view); ``bfloat16``: the
    arrays hold bfloat16 as uint16 bits. See the module docstring for the rules.
    """
    first = np.asarray(inputs[0])
    got = np.asarray(got).reshape(first.shape)
    if got.dtype != first.dtype:
        got = got.view(first.dtype)
    name = format_name(first, bfloat16)
    if name not in _FORMATS:
        want = functools.reduce(UFUNCS[op], [np.asarray(x) for x in inputs])
        np.testing.assert_array_equal(got, want, err_msg=f"{where} {op} (exact in {name})")
        return
    stack = np.stack([as_float64(np.asarray(x), bfloat16).ravel() for x in inputs])
    result = as_float64(got, bfloat16).ravel()
    if len(inputs) == 1:  # nothing is sent: the input itself, bit for bit where it is a number
        np.testing.assert_array_equal(result, stack[0], err_msg=f"{where} {op} (a world of one)")
        return
    if op in ("min", "max"):
        rounded = stack if compression is None else round_to(round_to(stack, "float16"), name)
        want = UFUNCS[op].reduce(rounded, axis=0)
        np.testing.assert_array_equal(result, want, err_msg=f"{where} {op} {compression} (exact)")
        return
    bad = _misreduced(result, stack, op, name, compression == "fp16")
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise AssertionError(
            f"{where} {op} {name} compression={compression}: {int(bad.sum())} of {bad.size} elements "
            f"impossible; first at {i}: got {result[i]!r} from inputs {stack[:, i].tolist()}"
        )


def _misreduced(result: np.ndarray, stack: np.ndarray, op: str, name: str, fp16: bool) -> np.ndarray:
    """A mask of the elements of a sum, avg or prod that no order of evaluation can give."""
    n = len(stack)
    unit, largest, normal, subnormal = _FORMATS[name]
    if fp16:  # float16 on the wire: its overflow, its roundings, its subnormals
        unit = max(unit, 2.0**-11)
        largest, normal, subnormal = min(largest, 65504.0), max(normal, 2.0**-14), max(subnormal, 2.0**-24)
    margin = (2 * n + 2) * unit
    with np.errstate(all="ignore"):
        if op == "prod":
            exact, ambiguous = _exact_prod(stack), _may_leave_range(stack, largest, normal, margin)
            scale = np.abs(exact)
        else:
            finite = np.where(np.isfinite(stack), stack, 0.0)
            exact = _exact_sum(stack) / (n if op == "avg" else 1)
            ambiguous = (np.abs(_subsets(finite, np.add)) >= largest * (1 - margin)).any(axis=0)
            scale = np.abs(finite).sum(axis=0) / (n if op == "avg" else 1)
        close = np.isfinite(exact) & (np.abs(result - exact) <= margin * scale + (2 * n + 2) * subnormal)
        direction = np.sign(np.nan_to_num(stack).sum(axis=0))
    nan_out = np.isnan(result)
    signed_zero = (result == 0) & (np.signbit(result) == np.signbit(exact))
    if op == "prod":  # a zero input gives an exact zero, signed as the product of the signs
        same = np.where(exact == 0, signed_zero, (result == exact) | close)
        ambiguous_ok = nan_out | (np.signbit(result) == np.signbit(exact))  # any order: the sign
    else:  # only zeros sum to an exact zero: -0 if every one is -0 (exact's sign, computed by IEEE)
        same = np.where((stack == 0).all(axis=0), signed_zero, (result == exact) | close)
        one_sign = (np.nan_to_num(stack) >= 0).all(axis=0) | (np.nan_to_num(stack) <= 0).all(axis=0)
        overflowed = np.isinf(result) & (~one_sign | (np.sign(result) == direction))
        ambiguous_ok = (nan_out & ~one_sign) | overflowed | (~nan_out & same)
    ok = np.where(np.isnan(exact), nan_out, np.where(ambiguous, ambiguous_ok, same & ~nan_out))
    return ~ok


def _exact_sum(stack: np.ndarray) -> np.ndarray:
    """The sum over rows: NaN with a NaN or both infinities, else the infinity, else the finite sum."""
    up, down = (stack == np.inf).any(axis=0), (stack == -np.inf).any(axis=0)
    # a quarter first: float64 inputs whose sum is finite never overflow on the way (and -0 + -0 is -0)
    finite = functools.reduce(np.add, np.where(np.isfinite(stack), stack, 0.0) / 4) * 4
    out = np.where(up, np.inf, np.where(down, -np.inf, finite))
    return np.where(np.isnan(stack).any(axis=0) | (up & down), np.nan, out)


def _exact_prod(stack: np.ndarray) -> np.ndarray:
    """The product over rows: NaN with a NaN or an infinity times a zero, else signed as IEEE says."""
    infinite, zero = np.isinf(stack).any(axis=0), (stack == 0).any(axis=0)
    finite = np.abs(np.where(np.isfinite(stack), stack, 1.0)).prod(
        axis=0
    )  # with a zero: 0, even past overflow
    magnitude = np.where(zero, 0.0, np.where(infinite, np.inf, finite))
    negative = np.bitwise_xor.reduce(np.signbit(stack), axis=0)
    out = np.where(negative, -magnitude, magnitude)
    return np.where(np.isnan(stack).any(axis=0) | (infinite & zero), np.nan, out)


def _may_leave_range(stack: np.ndarray, largest: float, normal: float, margin: float) -> np.ndarray:
    """Where some subset's product (of non-zero finite inputs) overflows or is not normal, in log2."""
    usable = np.isfinite(stack) & (stack != 0)
    logs = np.where(usable, np.log2(np.where(usable, np.abs(stack), 1.0)), 0.0)
    zero = np.isfinite(stack) & (stack == 0)
    sums = _subsets(logs, np.add)
    has_zero = _subsets(zero.astype(np.float64), np.add) > 0  # a product with a zero is an exact zero
    slack = 2 * margin
    out = (sums >= np.log2(largest) - slack) | (sums <= np.log2(normal) + slack)
    return (out & ~has_zero).any(axis=0)


def _subsets(stack: np.ndarray, ufunc: np.ufunc) -> np.ndarray:
    """``ufunc`` over every non-empty subset of the rows of ``stack`` (float64, exact enough)."""
    n = len(stack)
    rows = [
        ufunc.reduce(stack[list(subset)], axis=0)
        for k in range(1, n + 1)
        for subset in itertools.combinations(range(n), k)
    ]
    return np.stack(rows)
