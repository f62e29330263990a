"""nccl-tests arithmetic and columns: sizes, counts, bandwidths, timing, formatting.

Everything here is pure (no processes, no sockets), so it is unit-tested
directly and shared by ``ringcore-bench`` and the peer workers of
``bench/compare.py``: every engine is measured and printed by the same rules.

The rules, as in nccl-tests (https://github.com/NVIDIA/nccl-tests, doc/PERFORMANCE.md):

- ``size`` is the largest buffer of the operation in bytes: for allgather the
  total *output*, for reduce_scatter the total *input*; ``count`` is the
  number of elements each rank passes to the call (for allgather and
  reduce_scatter: one rank's share).
- ``algbw = size / time``, in GB/s with GB = 1e9 bytes.
- ``busbw = algbw * factor``: allreduce ``2(n-1)/n``, allgather and
  reduce_scatter ``(n-1)/n``, broadcast ``1``. busbw is comparable to the
  link speed whatever n is.
- ``time`` is the median over the timed iterations of the slowest rank:
  every iteration is ``barrier; t0; op; t1``, and the per-rank times are
  gathered at the end so each iteration counts at its max over ranks.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterable, Sequence

import numpy as np

from ringcore.config import parse_size as _config_parse_size

TESTS = ("allreduce", "broadcast", "allgather", "reduce_scatter")
OPS = ("sum", "prod", "min", "max", "avg")

# -d accepts these names; value: (name nccl-tests prints, numpy dtype name)
DTYPE_ALIASES: dict[str, tuple[str, str]] = {
    "float": ("float", "float32"),
    "float32": ("float", "float32"),
    "half": ("half", "float16"),
    "float16": ("half", "float16"),
    "double": ("double", "float64"),
    "float64": ("double", "float64"),
    "int32": ("int32", "int32"),
    "int64": ("int64", "int64"),
    "int8": ("int8", "int8"),
    "uint8": ("uint8", "uint8"),
    "bfloat16": ("bfloat16", "bfloat16"),
}

HEADER = (
    "#       size         count      type   redop    root     time   algbw   busbw #wrong",
    "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)       ",
)


def parse_size(text: str) -> int:
    """Parse a byte count with an optional K/M/G suffix (powers of 1024).

    Args:
        text: e.g. ``"4096"``, ``"8K"``, ``"256M"``, ``"1G"``.

    Returns:
        The number of bytes.

    Raises:
        ValueError: ``text`` is not a size (``ringcore.ConfigError`` is one).
    """
    return _config_parse_size(text)


def parse_size_list(text: str) -> list[int]:
    """Parse ``"4K,1M,16M"`` into byte counts, in the order given."""
    return [parse_size(part) for part in text.split(",") if part.strip()]


def numpy_dtype(name: str) -> np.dtype:
    """Return the numpy dtype for a ``-d`` name.

    Raises:
        ValueError: unknown name, or ``bfloat16`` without the ``ml_dtypes`` package.
    """
    if name not in DTYPE_ALIASES:
        raise ValueError(f"unknown datatype {name!r}; use one of {', '.join(DTYPE_ALIASES)}")
    np_name = DTYPE_ALIASES[name][1]
    if np_name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise ValueError("datatype bfloat16 needs the ml_dtypes package") from None
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(np_name)


def type_label(name: str) -> str:
    """The type name nccl-tests prints for a ``-d`` name (``float32`` -> ``float``)."""
    return DTYPE_ALIASES[name][0]


def size_sweep(minbytes: int, maxbytes: int, stepfactor: float) -> list[int]:
    """Sizes from ``minbytes`` to ``maxbytes`` multiplying by ``stepfactor``.

    Raises:
        ValueError: bounds out of order, or a factor that would never reach ``maxbytes``.
    """
    if minbytes <= 0 or maxbytes < minbytes:
        raise ValueError(f"need 0 < minbytes <= maxbytes, got {minbytes} and {maxbytes}")
    if stepfactor <= 1 and maxbytes > minbytes:
        raise ValueError(f"stepfactor must be > 1 to go from {minbytes} to {maxbytes}, got {stepfactor}")
    sizes = [minbytes]
    while True:
        nxt = int(sizes[-1] * stepfactor)
        if nxt > maxbytes or nxt <= sizes[-1]:
            return sizes
        sizes.append(nxt)


@dataclasses.dataclass(frozen=True)
class Shape:
    """Element counts of one operation at one size.

    Attributes:
        nbytes: The printed ``size``: the largest buffer, in bytes.
        count: The printed ``count``: elements each rank passes to the call.
        in_count: Elements of each rank's input buffer.
        out_count: Elements of each rank's output buffer.
    """

    nbytes: int
    count: int
    in_count: int
    out_count: int


def shape(test: str, nbytes: int, itemsize: int, nranks: int) -> Shape:
    """Round ``nbytes`` down to whole elements (and whole per-rank shares) for ``test``.

    Args:
        test: One of :data:`TESTS`.
        nbytes: Requested size in bytes.
        itemsize: Bytes per element.
        nranks: Number of ranks.

    Returns:
        The counts; ``count`` is 0 when the size holds less than one element per rank.
    """
    total = nbytes // itemsize
    if test in ("allreduce", "broadcast"):
        return Shape(total * itemsize, total, total, total)
    share = total // nranks
    if test == "allgather":
        return Shape(share * nranks * itemsize, share, share, share * nranks)
    if test == "reduce_scatter":
        return Shape(share * nranks * itemsize, share, share * nranks, share)
    raise ValueError(f"unknown test {test!r}; use one of {', '.join(TESTS)}")


def bus_factor(test: str, nranks: int) -> float:
    """busbw / algbw for ``test`` on ``nranks`` ranks (nccl-tests doc/PERFORMANCE.md)."""
    if test == "allreduce":
        return 2.0 * (nranks - 1) / nranks
    if test in ("allgather", "reduce_scatter"):
        return (nranks - 1) / nranks
    if test == "broadcast":
        return 1.0
    raise ValueError(f"unknown test {test!r}; use one of {', '.join(TESTS)}")


def bandwidths(nbytes: int, time_us: float, test: str, nranks: int) -> tuple[float, float]:
    """Return ``(algbw, busbw)`` in GB/s (1e9 bytes) for ``nbytes`` moved in ``time_us``."""
    if time_us <= 0:
        return 0.0, 0.0
    algbw = nbytes / time_us / 1e3  # bytes/us = 1e6 B/s; /1e3 -> 1e9 B/s
    return algbw, algbw * bus_factor(test, nranks)


def median_of_max(times: np.ndarray | Sequence[Sequence[float]]) -> float:
    """The time of an operation: max over ranks per iteration, then median over iterations.

    Args:
        times: ``times[r][i]`` is rank r's duration of iteration i.

    Returns:
        The median over i of ``max_r times[r][i]``.

    Raises:
        ValueError: no ranks or no iterations.
    """
    grid = np.asarray(times, dtype=np.float64)
    if grid.ndim != 2 or grid.size == 0:
        raise ValueError(f"need a (ranks, iterations) array with at least one entry, got shape {grid.shape}")
    return float(np.median(grid.max(axis=0)))


def iteration_plan(nbytes: int, iters: int, warmup: int, budget: int) -> tuple[int, int]:
    """Iterations for one size, optionally capped by a byte budget.

    With ``budget`` > 0 a size gets ``clamp(budget // nbytes, 5, iters)`` timed
    iterations (never more than ``iters``) and ``min(warmup, max(1, timed // 5))``
    warmup iterations, so big sizes do not dominate the wall time. With
    ``budget`` == 0 it gets ``iters`` and ``warmup`` as given.

    Returns:
        ``(timed, warmup)``.
    """
    if budget <= 0:
        return iters, warmup
    timed = max(min(5, iters), min(iters, budget // max(1, nbytes)))
    return timed, min(warmup, max(1, timed // 5))


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the table.

    Attributes:
        nbytes: size(B).
        count: count (elements).
        dtype: type label (``float``, ``half``...).
        redop: reduction (``sum``...), or ``none`` for broadcast/allgather.
        root: the root rank, -1 when the operation has none.
        time_us: median-of-max time in microseconds.
        algbw: GB/s.
        busbw: GB/s.
        wrong: wrong elements (summed over ranks), or ``None`` when not checked.
    """

    nbytes: int
    count: int
    dtype: str
    redop: str
    root: int
    time_us: float
    algbw: float
    busbw: float
    wrong: int | None


def make_row(
    test: str, sh: Shape, dtype: str, redop: str, root: int, time_us: float, nranks: int, wrong: int | None
) -> Row:
    """Build a :class:`Row`, computing the bandwidths from ``sh.nbytes`` and ``time_us``."""
    algbw, busbw = bandwidths(sh.nbytes, time_us, test, nranks)
    return Row(sh.nbytes, sh.count, dtype, redop, root, time_us, algbw, busbw, wrong)


def format_time(time_us: float) -> str:
    """Seven characters, fewer decimals as the number grows (as nccl-tests does)."""
    if time_us >= 1e4:
        return f"{time_us:7.0f}"
    if time_us >= 1e2:
        return f"{time_us:7.1f}"
    return f"{time_us:7.2f}"


def format_row(row: Row) -> str:
    """One nccl-tests line: ``size count type redop root  time algbw busbw #wrong``."""
    wrong = "N/A" if row.wrong is None else str(row.wrong)
    return (
        f"{row.nbytes:12d}  {row.count:12d}  {row.dtype:>8s}  {row.redop:>6s}  {row.root:6d}"
        f"  {format_time(row.time_us)}  {row.algbw:6.2f}  {row.busbw:6.2f}  {wrong:>5s}"
    )


def avg_busbw(rows: Iterable[Row]) -> float:
    """Mean busbw over the rows (nccl-tests' "Avg bus bandwidth"); 0 with no rows."""
    values = [row.busbw for row in rows]
    return statistics.fmean(values) if values else 0.0


def footer(rows: Sequence[Row]) -> list[str]:
    """The closing lines: out-of-bounds count and average bus bandwidth."""
    checked = [row.wrong for row in rows if row.wrong is not None]
    lines = []
    if checked:
        bad = sum(checked)
        lines.append(f"# Out of bounds values : {bad} {'OK' if bad == 0 else 'FAILED'}")
    lines.append(f"# Avg bus bandwidth    : {avg_busbw(rows):g} ")
    return lines


def row_dict(row: Row) -> dict[str, object]:
    """A row as JSON-ready keys (``bytes``, ``time_us``, ``busbw``...)."""
    return {
        "bytes": row.nbytes,
        "count": row.count,
        "type": row.dtype,
        "redop": row.redop,
        "root": row.root,
        "time_us": round(row.time_us, 3),
        "algbw": round(row.algbw, 6),
        "busbw": round(row.busbw, 6),
        "wrong": row.wrong,
    }


def parse_row(line: str) -> dict[str, object] | None:
    """Read back a line printed by :func:`format_row` (``None`` for headers and other text)."""
    fields = line.split()
    if len(fields) != 9 or line.lstrip().startswith("#"):
        return None
    try:
        nbytes, count, root = int(fields[0]), int(fields[1]), int(fields[4])
        time_us, algbw, busbw = float(fields[5]), float(fields[6]), float(fields[7])
    except ValueError:
        return None
    wrong = None if fields[8] == "N/A" else int(fields[8])
    return {
        "bytes": nbytes,
        "count": count,
        "type": fields[2],
        "redop": fields[3],
        "root": root,
        "time_us": time_us,
        "algbw": algbw,
        "busbw": busbw,
        "wrong": wrong,
    }


def parse_table(text: str) -> list[dict[str, object]]:
    """Every row of a printed table, e.g. ``ringcore-bench``'s stdout."""
    return [row for row in map(parse_row, text.splitlines()) if row is not None]
