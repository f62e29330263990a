"""Inputs and expected results for ``ringcore-bench -c 1``: counting wrong elements.

Rank ``r`` fills its input with the periodic pattern ``(i + r) % period + 1``
(period 2 for ``prod``, 4 otherwise). The values are small integers, so sums
and products over a few dozen ranks are exact in every datatype, float16 and
fp16 compression included, and every rank can compute the exact expected
result for itself: the result is periodic too, so it is built from one period
instead of from all the ranks' full inputs. Only ``avg`` (a division) is
compared with a tolerance.
"""

from __future__ import annotations

import numpy as np

_REDUCE = {"sum": np.add, "avg": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}


def period(op: str) -> int:
    """Length of the input pattern: short for ``prod`` so products stay small."""
    return 2 if op == "prod" else 4


def _base(rank: int, op: str, dtype: np.dtype) -> np.ndarray:
    m = period(op)
    return np.array([(k + rank) % m + 1 for k in range(m)], dtype=np.float64).astype(dtype)


def pattern(rank: int, count: int, op: str, dtype: np.dtype) -> np.ndarray:
    """Rank ``rank``'s input: ``count`` elements of ``(i + rank) % period + 1``."""
    return np.resize(_base(rank, op, dtype), count)


def _reduced_base(nranks: int, op: str, dtype: np.dtype) -> np.ndarray:
    """One period of the reduction over all ranks, in ``dtype`` (integers wrap as numpy does)."""
    if op == "avg":
        total = sum(_base(r, op, np.dtype(np.float64)) for r in range(nranks))
        return (total / nranks).astype(dtype)
    acc = _base(0, op, dtype)
    for r in range(1, nranks):
        acc = _REDUCE[op](acc, _base(r, op, dtype))
    return acc


def split_bounds(count: int, nranks: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of chunk ``rank`` under ``np.array_split(range(count), nranks)``."""
    small, extra = divmod(count, nranks)
    start = rank * small + min(rank, extra)
    return start, start + small + (1 if rank < extra else 0)


def expected(
    test: str, rank: int, nranks: int, in_count: int, op: str, dtype: np.dtype, root: int
) -> np.ndarray:
    """The result rank ``rank`` must hold after ``test`` on the :func:`pattern` inputs.

    Args:
        test: ``allreduce``, ``broadcast``, ``allgather`` or ``reduce_scatter``.
        rank: This rank.
        nranks: Number of ranks.
        in_count: Elements of each rank's input.
        op: Reduction name (ignored by broadcast and allgather).
        dtype: Element type.
        root: Broadcast root.

    Returns:
        The expected output array.
    """
    if test == "broadcast":
        return pattern(root, in_count, op, dtype)
    if test == "allgather":
        return np.concatenate([pattern(r, in_count, op, dtype) for r in range(nranks)])
    full = _reduced_base(nranks, op, dtype)
    if test == "allreduce":
        return np.resize(full, in_count)
    if test == "reduce_scatter":
        start, stop = split_bounds(in_count, nranks, rank)
        return np.resize(np.roll(full, -(start % len(full))), stop - start)
    raise ValueError(f"unknown test {test!r}")


def count_wrong(got: np.ndarray, want: np.ndarray, op: str) -> int:
    """Elements of ``got`` that differ from ``want``; a length mismatch counts every element.

    ``avg`` allows rounding: relative 1e-2 for 16-bit floats, 1e-5 for wider
    floats, and 1 for integers (floor or round-to-nearest are both accepted).
    """
    if got.shape != want.shape:
        return max(got.size, want.size)
    if op != "avg":
        return int(np.count_nonzero(got != want))
    if np.issubdtype(want.dtype, np.integer):
        diff = np.abs(got.astype(np.int64) - want.astype(np.int64))
        return int(np.count_nonzero(diff > 1))
    rtol = 1e-2 if want.dtype.itemsize <= 2 else 1e-5
    ok = np.isclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol, atol=0.0)
    return int(np.count_nonzero(~ok))


def steady_value(op: str) -> float:
    """A fill value that in-place repetitions leave unchanged (0 for sum, 1 otherwise)."""
    return 0.0 if op == "sum" else 1.0
