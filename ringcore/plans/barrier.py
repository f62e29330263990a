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
        self._steps: tuple[lockstep.Bound, ...] = ()
        self._early: tuple[int, ...] = ()
        self._reducer: Any = None

    def run(self, obj: Any, seq: int) -> None:
        ctx = self.ctx
        if ctx.size < 2:
            return
        if self._reducer is None:  # bound in the turn, like everything touching the transport
            self._bind()
        try:
            run_steps(ctx, self._steps, self._early, self._reducer, seq, self.signature)
        except BaseException as err:
            ctx.fail(Descriptor("barrier", seq, "uint8", ()), err)

    def _bind(self) -> None:
        ctx = self.ctx
        assert ctx.transport is not None
        if ctx.settings.hierarchical and hierarchical.applies(ctx.grid):
            schedule = hierarchical.barrier(ctx.rank, ctx.grid)  # type: ignore[arg-type]
        else:
            schedule = chain.barrier(ctx.rank, ctx.size)
        program = compile_program(schedule, ctx.transport)
        self._steps = lockstep.bind(program, {Buf.WORK: np.empty(0, np.uint8)})
        self._early = program.early
        self._reducer = ctx.reducer(DTYPES["uint8"], ReduceOp.SUM, Compression.NONE)
