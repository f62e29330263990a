"""The allgather and reduce_scatter plans: rows split along the first dimension, host buffers only.

On one host with mailboxes, inputs of at most a slot go in one shot
(:func:`ringcore.plans.oneshot.exchange`), and an allgather's post stands in
for the row counts' exchange at any size.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from ringcore.algo import ring
from ringcore.algo.steps import Buf, chunk_bounds
from ringcore.buffers import DTYPES
from ringcore.descriptor import Descriptor
from ringcore.ops import Compression, ReduceOp
from ringcore.plans import oneshot
from ringcore.plans.base import CallPlan
from ringcore.plans.validate import as_buffer, as_caller_dtype, check_reduction, host_only, rows
from ringcore.slicing import gather_schedule

if TYPE_CHECKING:
    from ringcore.context import Context


def plan_allgather(ctx: Context, obj: Any) -> CallPlan:
    """Every rank's ``obj`` concatenated along axis 0 (first dimensions may differ): a new array.

    The ranks first learn each other's row counts, then gather the rows into
    one output array, in rank order. Where every rank has mailboxes (and rows
    have bytes), each posts its rows (or, past a slot, only their size) and
    every rank reads the counts from the posts; when every rank's rows were
    posted, that was the whole allgather. Otherwise the counts are an
    allgather of their own (sub-schedule 1) and the rows go round the ring.
    """
    buffer = host_only(as_buffer(obj, writable=False, what="allgather input"), "allgather")
    n_rows = rows(buffer, "allgather")
    row_count = math.prod(buffer.shape[1:])
    storage = np.dtype(buffer.dtype.storage)

    def run(obj: Any, seq: int) -> np.ndarray:
        trailing = buffer.shape[1:]
        desc = Descriptor("allgather", seq, buffer.dtype.name, trailing)
        mailbox, row_bytes = oneshot.mailbox_of(ctx), row_count * storage.itemsize
        if mailbox is not None and row_bytes:  # trailing, hence row_bytes, is the same on every rank
            fits = buffer.nbytes <= mailbox.slot_bytes
            posts = oneshot.exchange(ctx, desc, fits, buffer.array if fits else None, buffer.nbytes)
            if all(way == oneshot.POSTED for way, _, _ in posts):
                out = np.concatenate([data for _, _, data in posts]).view(storage)
                return as_caller_dtype(out, obj).reshape((out.size // row_count, *trailing))
            counts = [nbytes // row_bytes for _, nbytes, _ in posts]
        else:
            counts = _gather_counts(ctx, seq, buffer.dtype.name, trailing, n_rows)
        chunks = tuple((start * row_count, n * row_count) for start, n in _offsets(counts))
        out = np.empty(sum(counts) * row_count, storage)
        start, n = chunks[ctx.rank]
        out[start : start + n] = buffer.array
        if ctx.size > 1:
            reducer = ctx.reducer(buffer.dtype, ReduceOp.SUM, Compression.NONE)
            schedule = gather_schedule(ctx, "allgather", chunks, buffer.dtype.itemsize)
            ctx.execute(desc, schedule, {Buf.WORK: out}, reducer)
        return as_caller_dtype(out, obj).reshape((sum(counts), *trailing))

    return CallPlan(
        "allgather", run, nbytes=buffer.nbytes, details={"dtype": buffer.dtype.name, "rows": n_rows}
    )


def _gather_counts(ctx: Context, seq: int, dtype: str, trailing: tuple[int, ...], n_rows: int) -> list[int]:
    counts = np.zeros(ctx.size, np.int64)
    counts[ctx.rank] = n_rows
    if ctx.size > 1:
        desc = Descriptor("allgather", seq, dtype, trailing, None, None, "counts")
        reducer = ctx.reducer(DTYPES["int64"], ReduceOp.SUM, Compression.NONE)
        schedule = ring.allgather(ctx.rank, ctx.size, tuple((i, 1) for i in range(ctx.size)), 8, 1 << 20)
        ctx.execute(desc, schedule, {Buf.WORK: counts}, reducer, sub=1)
    return [int(c) for c in counts]


def _offsets(counts: list[int]) -> list[tuple[int, int]]:
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int)
    return [(int(s), int(n)) for s, n in zip(starts, counts, strict=False)]


def plan_reduce_scatter(ctx: Context, obj: Any, op: Any, compression: Any) -> CallPlan:
    """This rank's chunk (``np.array_split`` of axis 0) of ``obj`` reduced over all ranks: a new array.

    Where every rank has mailboxes, an input of at most a slot without compression
    goes in one shot: every rank posts it and reduces its own chunk from the N
    posts, in rank order. Otherwise the ring's reduce-scatter.
    """
    buffer = host_only(as_buffer(obj, writable=False, what="reduce_scatter input"), "reduce_scatter")
    n_rows = rows(buffer, "reduce_scatter")
    reduce_op, comp = ReduceOp.parse(op), Compression.parse(compression)
    check_reduction(buffer, reduce_op, comp, "reduce_scatter")
    row_count = math.prod(buffer.shape[1:])

    def run(obj: Any, seq: int) -> np.ndarray:
        desc = Descriptor(
            "reduce_scatter", seq, buffer.dtype.name, buffer.shape, reduce_op.value, None, comp.value
        )
        row_chunks = chunk_bounds(n_rows, ctx.size)
        chunks = tuple((start * row_count, n * row_count) for start, n in row_chunks)
        start, n = chunks[ctx.rank]
        out = np.empty(n, buffer.dtype.storage)
        reducer = ctx.reducer(buffer.dtype, reduce_op, comp)
        mailbox = oneshot.mailbox_of(ctx)
        if mailbox is not None and comp is Compression.NONE and buffer.nbytes <= mailbox.slot_bytes:
            posts = oneshot.exchange(ctx, desc, True, buffer.array, buffer.nbytes)
            inputs = [data.view(out.dtype)[start : start + n] for _, _, data in posts]
            reducer.reduce(out, inputs)  # each rank's chunk from the N inputs, in rank order
        elif ctx.size == 1:
            out[:] = buffer.array
        else:
            schedule = gather_schedule(ctx, "reduce_scatter", chunks, reducer.wire_dtype.itemsize)
            arrays = ctx.scratch_arrays(schedule, buffer, reducer.wire_dtype)
            ctx.execute(desc, schedule, arrays, reducer)
            reducer.convert(out, arrays[Buf.WORK][start : start + n])
        return as_caller_dtype(out, obj).reshape((row_chunks[ctx.rank][1], *buffer.shape[1:]))

    details = {"dtype": buffer.dtype.name, "count": buffer.count, "op": reduce_op.value}
    return CallPlan("reduce_scatter", run, nbytes=buffer.nbytes, details=details)
