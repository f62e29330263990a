"""Per-collective plans: validated arguments -> descriptor, schedule, arrays, and the commit.

Each ``plan_*`` function runs in the caller's thread and raises
``TypeError``/``ValueError`` before anything is sent. It returns a
:class:`Plan`, whose ``run`` is executed later, in order, by the
communicator: it builds the schedule, runs it, and only then writes the
result into the caller's buffer (the *commit*), or, in place (the ring, and
halving-doubling without ``RINGCORE_ATOMIC``), lets the executor write it
there as it arrives. A collective that succeeds leaves the buffer fully
reduced. One that fails leaves it untouched, except an in-place one's when a
peer dies or stalls mid-run: that can leave partial sums, as Gloo, NCCL and
MPI do, unless ``RINGCORE_ATOMIC=1`` makes the executor back up what it
overwrites and restore it (one more copy of the buffer). The error's note names the elements that may hold partial sums.

Large buffers. Scratch (WORK, STAGE) is as long as the buffer, so an
allreduce or broadcast of more than ``RINGCORE_SLICE_BYTES`` (auto: 48 MiB)
runs as a sequence of complete collectives over equal slices (tags numbered
by slice), which bounds scratch memory by the slice. On a ring of one host
with a CPU per rank, allreduce slices are cache-sized instead (N MiB: see
``Settings.allreduce_slice_bytes``). A failure in slice k leaves slices
before it reduced and those after it untouched, and its error's note says
so.

GPU buffers (``Buffer.device == "cuda"``) take the same plans up to the run,
which hands them to :mod:`ringcore.device.plans` (allreduce and broadcast;
the other collectives refuse them before anything is sent).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ringcore.algo import broadcast as chain
from ringcore.algo import ring
from ringcore.algo.steps import Buf, chunk_bounds
from ringcore.buffers import DTYPES, Buffer, dlpack_only_cuda
from ringcore.buffers import as_buffer as _view
from ringcore.descriptor import Descriptor
from ringcore.ops import Compression, ReduceOp
from ringcore.slicing import allreduce_schedule, failure_note, note_failure, slice_bounds, writes_user

if TYPE_CHECKING:
    from ringcore.context import Context


@dataclasses.dataclass
class Plan:
    """A validated collective, ready to run when its turn comes."""

    kind: str
    run: Callable[[Context, int], Any]
    name: str | None = None
    nbytes: int = 0
    details: dict[str, Any] = dataclasses.field(default_factory=dict)


def as_buffer(obj: Any, *, writable: bool, what: str) -> Buffer:
    """:func:`ringcore.buffers.as_buffer`, after the device layer imported DLPack-only CUDA memory (JAX)."""
    if dlpack_only_cuda(obj):
        from ringcore import device

        obj = device.layer().from_dlpack(obj)
    return _view(obj, writable=writable, what=what)


def _check_reduction(buffer: Buffer, op: ReduceOp, compression: Compression, what: str) -> None:
    if op is ReduceOp.AVG and not buffer.dtype.is_float:
        raise ValueError(
            f"{what}: op 'avg' needs a floating-point buffer, got {buffer.dtype.name}; "
            "use 'sum' and divide by ringcore.size()"
        )
    if compression is Compression.FP16 and not buffer.dtype.is_float:
        raise ValueError(
            f"{what}: fp16 compression applies to floating-point buffers, got {buffer.dtype.name}"
        )


def _check_root(root: int, size: int, what: str) -> int:
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)):
        raise TypeError(f"{what}: root must be an int, got {type(root).__name__}")
    if not 0 <= root < size:
        raise ValueError(f"{what}: root {root} is not a rank of this world of size {size}")
    return int(root)


def check_allreduce(obj: Any, op: Any, compression: Any) -> tuple[Buffer, ReduceOp, Compression]:
    """Validate an allreduce's arguments (``TypeError``/``ValueError`` before anything is sent)."""
    buffer = as_buffer(obj, writable=True, what="allreduce buffer")
    reduce_op, comp = ReduceOp.parse(op), Compression.parse(compression)
    _check_reduction(buffer, reduce_op, comp, "allreduce")
    return buffer, reduce_op, comp


def plan_allreduce(obj: Any, op: Any, compression: Any, size: int) -> Plan:
    return plan_checked_allreduce(obj, *check_allreduce(obj, op, compression))


def plan_checked_allreduce(obj: Any, buffer: Buffer, reduce_op: ReduceOp, comp: Compression) -> Plan:
    """The plan of an allreduce whose arguments :func:`check_allreduce` accepted."""
    fields = (buffer.dtype.name, buffer.shape, reduce_op.value, None, comp.value)

    def run(ctx: Context, seq: int) -> Any:
        desc = Descriptor("allreduce", seq, *fields)
        if ctx.size > 1 and buffer.device == "cuda":
            from ringcore.device import plans

            plans.allreduce(ctx, desc, buffer, reduce_op, comp)
        elif ctx.size > 1:
            reducer = ctx.reducer(buffer.dtype, reduce_op, comp)
            in_place = reducer.wire_dtype == buffer.dtype.storage
            pieces = _slices(buffer, ctx.allreduce_slice_bytes, reducer.wire_dtype.itemsize)
            for part, (start, piece) in enumerate(pieces):
                schedule = allreduce_schedule(
                    ctx, piece.count, reducer.wire_dtype.itemsize, in_place, sliced=len(pieces) > 1
                )
                arrays = ctx.scratch_arrays(schedule, piece, reducer.wire_dtype)
                if schedule.prefill_work:
                    reducer.convert(arrays[Buf.WORK], piece.array)
                try:
                    ctx.execute(desc, schedule, arrays, reducer, sub=part)
                except BaseException as err:  # a plain try: a context manager costs small allreduces
                    exposed = piece.count if writes_user(schedule) and not ctx.settings.atomic else 0
                    note_failure(err, start, exposed, buffer.count)
                    raise
                if schedule.result is not None and schedule.result.buf != Buf.USER:
                    reducer.convert(piece.array, arrays[Buf.WORK])
        return obj

    details = {
        "dtype": buffer.dtype.name,
        "count": buffer.count,
        "op": reduce_op.value,
        "compression": comp.value,
    }
    return Plan("allreduce", run, nbytes=buffer.nbytes, details=details)


def plan_broadcast(obj: Any, root: int, rank: int, size: int) -> Plan:
    root = _check_root(root, size, "broadcast")
    buffer = as_buffer(obj, writable=rank != root, what="broadcast buffer")

    def run(ctx: Context, seq: int) -> Any:
        desc = Descriptor("broadcast", seq, buffer.dtype.name, buffer.shape, None, root)
        if ctx.size > 1 and buffer.device == "cuda":
            from ringcore.device import plans

            plans.broadcast(ctx, desc, buffer, root)
        elif ctx.size > 1:
            reducer = ctx.reducer(buffer.dtype, ReduceOp.SUM, Compression.NONE)
            for part, (start, piece) in enumerate(
                _slices(buffer, ctx.settings.scratch_slice_bytes(), buffer.dtype.itemsize)
            ):
                schedule = chain.broadcast(
                    ctx.rank,
                    ctx.size,
                    root,
                    piece.count,
                    buffer.dtype.itemsize,
                    ctx.settings.segment_size(),
                )
                arrays = ctx.scratch_arrays(schedule, piece, buffer.dtype.storage)
                with failure_note(start, 0, buffer.count):
                    ctx.execute(desc, schedule, arrays, reducer, sub=part)
                if schedule.result is not None:
                    np.copyto(piece.array, arrays[Buf.WORK])
        return obj

    details = {"dtype": buffer.dtype.name, "count": buffer.count, "root": root}
    return Plan("broadcast", run, nbytes=buffer.nbytes, details=details)


def _slices(buffer: Buffer, slice_bytes: int, wire_itemsize: int) -> list[tuple[int, Buffer]]:
    """``(first element, piece)`` per slice whose scratch fits ``slice_bytes`` (one piece if all fits).

    Scratch is in the wire dtype (half the caller's bytes with fp16
    compression), and it follows the slice, not the buffer: a 1 GiB allreduce
    needs one slice's worth. Each slice is a complete collective whose result
    is written as described in the module docstring (see :func:`failure_note`).
    """
    bounds = slice_bounds(buffer.count, slice_bytes, wire_itemsize)
    if len(bounds) == 1:
        return [(0, buffer)]
    return [
        (start, dataclasses.replace(buffer, array=buffer.array[start : start + count]))
        for start, count in bounds
    ]


def _host_only(buffer: Buffer, what: str) -> Buffer:
    if buffer.device != "cpu":
        raise TypeError(
            f"{what}: GPU buffers are supported by allreduce and broadcast only; "
            "pass a host copy (e.g. cupy.asnumpy(x) or tensor.cpu())"
        )
    return buffer


def _rows(buffer: Buffer, what: str) -> int:
    if not buffer.shape:
        raise ValueError(f"{what} needs an array with at least one dimension, got a 0-d array")
    return buffer.shape[0]


def plan_allgather(obj: Any) -> Plan:
    buffer = _host_only(as_buffer(obj, writable=False, what="allgather input"), "allgather")
    rows = _rows(buffer, "allgather")
    row_count = int(np.prod(buffer.shape[1:], dtype=np.int64))

    def run(ctx: Context, seq: int) -> np.ndarray:
        trailing = buffer.shape[1:]
        counts = _gather_counts(ctx, seq, buffer.dtype.name, trailing, rows)
        chunks = tuple((start * row_count, n * row_count) for start, n in _offsets(counts))
        out = np.empty(sum(counts) * row_count, buffer.dtype.storage)
        start, n = chunks[ctx.rank]
        out[start : start + n] = buffer.array
        if ctx.size > 1:
            desc = Descriptor("allgather", seq, buffer.dtype.name, trailing)
            reducer = ctx.reducer(buffer.dtype, ReduceOp.SUM, Compression.NONE)
            schedule = ring.allgather(
                ctx.rank, ctx.size, chunks, buffer.dtype.itemsize, ctx.settings.segment_size()
            )
            ctx.execute(desc, schedule, {Buf.WORK: out}, reducer)
        return _as_caller_dtype(out, obj).reshape((sum(counts), *trailing))

    return Plan("allgather", run, nbytes=buffer.nbytes, details={"dtype": buffer.dtype.name, "rows": rows})


def _gather_counts(ctx: Context, seq: int, dtype: str, trailing: tuple[int, ...], rows: int) -> list[int]:
    counts = np.zeros(ctx.size, np.int64)
    counts[ctx.rank] = rows
    if ctx.size > 1:
        desc = Descriptor("allgather", seq, dtype, trailing, None, None, "counts")
        reducer = ctx.reducer(DTYPES["int64"], ReduceOp.SUM, Compression.NONE)
        schedule = ring.allgather(ctx.rank, ctx.size, tuple((i, 1) for i in range(ctx.size)), 8, 1 << 20)
        ctx.execute(desc, schedule, {Buf.WORK: counts}, reducer, sub=1)
    return [int(c) for c in counts]


def _offsets(counts: list[int]) -> list[tuple[int, int]]:
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int)
    return [(int(s), int(n)) for s, n in zip(starts, counts, strict=False)]


def _as_caller_dtype(out: np.ndarray, obj: Any) -> np.ndarray:
    """bfloat16 results come back in the caller's numpy bfloat16 dtype when it has one."""
    dtype = getattr(obj, "dtype", None)
    if isinstance(dtype, np.dtype) and dtype.itemsize == out.itemsize and dtype != out.dtype:
        return out.view(dtype)
    return out


def plan_reduce_scatter(obj: Any, op: Any, compression: Any) -> Plan:
    buffer = _host_only(as_buffer(obj, writable=False, what="reduce_scatter input"), "reduce_scatter")
    rows = _rows(buffer, "reduce_scatter")
    reduce_op, comp = ReduceOp.parse(op), Compression.parse(compression)
    _check_reduction(buffer, reduce_op, comp, "reduce_scatter")
    row_count = int(np.prod(buffer.shape[1:], dtype=np.int64))

    def run(ctx: Context, seq: int) -> np.ndarray:
        desc = Descriptor(
            "reduce_scatter", seq, buffer.dtype.name, buffer.shape, reduce_op.value, None, comp.value
        )
        row_chunks = chunk_bounds(rows, ctx.size)
        chunks = tuple((start * row_count, n * row_count) for start, n in row_chunks)
        start, n = chunks[ctx.rank]
        out = np.empty(n, buffer.dtype.storage)
        reducer = ctx.reducer(buffer.dtype, reduce_op, comp)
        if ctx.size == 1:
            out[:] = buffer.array
        else:
            schedule = ring.reduce_scatter(
                ctx.rank, ctx.size, chunks, reducer.wire_dtype.itemsize, ctx.settings.segment_size()
            )
            arrays = ctx.scratch_arrays(schedule, buffer, reducer.wire_dtype)
            ctx.execute(desc, schedule, arrays, reducer)
            reducer.convert(out, arrays[Buf.WORK][start : start + n])
        return _as_caller_dtype(out, obj).reshape((row_chunks[ctx.rank][1], *buffer.shape[1:]))

    details = {"dtype": buffer.dtype.name, "count": buffer.count, "op": reduce_op.value}
    return Plan("reduce_scatter", run, nbytes=buffer.nbytes, details=details)


def plan_barrier() -> Plan:
    def run(ctx: Context, seq: int) -> None:
        if ctx.size > 1:
            empty = np.empty(0, np.uint8)
            reducer = ctx.reducer(DTYPES["uint8"], ReduceOp.SUM, Compression.NONE)
            desc = Descriptor("barrier", seq, "uint8", ())
            ctx.execute(desc, chain.barrier(ctx.rank, ctx.size), {Buf.WORK: empty}, reducer)

    return Plan("barrier", run)
