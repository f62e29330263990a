"""What every plan is, and the one runner of steps bound to arrays.

A plan is a validated collective: the Communicator made it in the caller's
thread (``TypeError``/``ValueError`` before anything is sent) and calls
``run(obj, seq)`` in the collective's turn, where ``obj`` is the caller's
object and ``seq`` the collective's number. ``run`` returns the result.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ringcore.algo import lockstep
from ringcore.buffers import storage_view
from ringcore.transport import wire

if TYPE_CHECKING:
    from ringcore.buffers import Buffer, DType
    from ringcore.context import Context
    from ringcore.ops import Compression, ReduceOp


class Plan(Protocol):
    """A collective ready to run in its turn (see the module docstring)."""

    kind: str
    nbytes: int
    details: dict[str, Any]

    def run(self, obj: Any, seq: int) -> Any: ...


class RoutedPlan(Protocol):
    """What a route chosen per call (direct, one-shot) reads of its allreduce plan (:class:`ringcore.plans.allreduce.AllreducePlan`)."""

    ctx: Context
    dtype: DType
    op: ReduceOp
    compression: Compression
    count: int
    nbytes: int
    fields: tuple[Any, ...]
    signature: int
    buffer: Buffer | None  # a one-call plan's validated buffer; None: a kept plan's, per call
    reducer: Any


def host_array(plan: RoutedPlan, obj: Any) -> np.ndarray | None:
    """This call's memory as the plan's flat storage array, or None where it is not host memory (a GPU's)."""
    if plan.buffer is not None:  # a one-call plan's validated buffer
        return plan.buffer.array if plan.buffer.device == "cpu" else None
    return storage_view(obj, plan.dtype)


def plan_reducer(plan: RoutedPlan) -> Any:
    """The plan's reducer, made on first use (a route may run before the plan's form ever did)."""
    if plan.reducer is None:
        plan.reducer = plan.ctx.reducer(plan.dtype, plan.op, plan.compression)
    return plan.reducer


@dataclasses.dataclass
class CallPlan:
    """The plan of one call: ``run`` closes over the validated arguments."""

    kind: str
    run: Callable[[Any, int], Any]
    nbytes: int = 0
    details: dict[str, Any] = dataclasses.field(default_factory=dict)


def run_steps(
    ctx: Context,
    steps: tuple[lockstep.Bound, ...],
    early: tuple[int, ...],
    reducer: Any,
    seq: int,
    signature: int,
    part: int = 0,
    nbytes: int = 0,
) -> None:
    """Run steps bound to arrays as schedule ``part`` of collective ``seq``, with the timeout and stall check.

    ``nbytes``: the caller's bytes the whole collective reduces (``Transport.expect``).
    """
    assert ctx.transport is not None
    lockstep.run_bound(
        ctx.transport,
        steps,
        early,
        reducer,
        (wire.tag_seq(seq, part) & 0xFFFFFFFF) << 32,
        signature,
        ctx.settings.timeout,
        ctx.stall.interruption if ctx.stall is not None else None,
        nbytes,
    )
