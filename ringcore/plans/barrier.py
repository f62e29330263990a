"""The barrier plan: the dissemination schedule's steps, bound once per communicator.

On a job of several hosts with several ranks each (the grid every rank
shares), the hierarchical barrier (:func:`ringcore.algo.hierarchical.barrier`)
unless ``RINGCORE_HIERARCHICAL=0``: fewer rounds wait on the network.

A barrier carries no data, so the Communicator keeps one plan, whose steps
are bound once (to an empty WORK) in the first barrier's turn; every barrier, including the numbered-zero one that confirms the world at
start-up, runs them in lockstep (:func:`ringcore.plans.base.run_steps`) with
the communicator's timeout, stall check and failure handling.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ringcore.algo import broadcast as chain
from ringcore.algo import hierarchical, lockstep
from ringcore.algo.program import compile_program
from ringcore.algo.steps import Buf
from ringcore.buffers import DTYPES
from ringcore.descriptor import Descriptor
from ringcore.ops import Compression, ReduceOp
from ringcore.plans.base import run_steps

if TYPE_CHECKING:
    from ringcore.context import Context


class BarrierPlan:
    """Every rank's barrier; ``run(None, seq)`` returns once every rank has entered it."""

    kind = "barrier"
    nbytes = 0

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.details: dict[str, Any] = {}
        self.signature = Descriptor("barrier", 0, "uint8", ()).signature()
        self._bound: BoundBarrier | None = None

    def run(self, obj: Any, seq: int) -> None:
        ctx = self.ctx
        if ctx.size < 2:
            return
        if self._bound is None:  # bound in the turn, like everything touching the transport
            self._bound = bound_barrier(ctx)
        try:
            self._bound.run(seq, self.signature)
        except BaseException as err:
            ctx.fail(Descriptor("barrier", seq, "uint8", ()), err)


class BoundBarrier:
    """The barrier's steps bound once; ``run(seq, signature, part)`` waits for every rank.

    Also the synchronisations inside a collective (the direct allreduce's,
    :mod:`ringcore.algo.direct`): its own signature and a ``part`` each.
    """

    def __init__(self, ctx: Context, steps: tuple[lockstep.Bound, ...], early: tuple[int, ...]) -> None:
        self.ctx, self.steps, self.early = ctx, steps, early
        self.reducer = ctx.reducer(DTYPES["uint8"], ReduceOp.SUM, Compression.NONE)

    def run(self, seq: int, signature: int, part: int = 0) -> None:
        run_steps(self.ctx, self.steps, self.early, self.reducer, seq, signature, part)


def bound_barrier(ctx: Context) -> BoundBarrier:
    """The job's barrier schedule (hierarchical across hosts of several ranks each), bound once per context.

    The barrier plan and every direct allreduce share it: the steps hold no
    state between runs.
    """
    assert ctx.transport is not None
    if ctx.barrier_steps is None:
        if ctx.settings.hierarchical and hierarchical.applies(ctx.grid):
            schedule = hierarchical.barrier(ctx.rank, ctx.grid)  # type: ignore[arg-type]
        else:
            schedule = chain.barrier(ctx.rank, ctx.size)
        program = compile_program(schedule, ctx.transport)
        steps = lockstep.bind(program, {Buf.WORK: np.empty(0, np.uint8)})
        ctx.barrier_steps = BoundBarrier(ctx, steps, program.early)
    return ctx.barrier_steps  # type: ignore[no-any-return]
