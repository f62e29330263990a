"""The barrier plan: one post in the mailboxes on one host, else the dissemination schedule's steps.

:func:`synchronise` is every "wait until every rank got here" of the library:
the barrier's, and the direct allreduce's two (:mod:`ringcore.plans.direct`).

- Where every rank of the job mapped every mailbox (one host,
  :mod:`ringcore.transport.shm_mailbox`), a barrier is an empty post and one
  wait for every peer's (:func:`ringcore.plans.oneshot.meet`: the timeout,
  the stall check, a dead or departed peer named, a peer in another
  collective a ``MismatchError``). The dissemination schedule waits
  ``log2 N`` times, each on one partner's frame: at N=4 on 2 cores
  ``ringcore.barrier()`` took 62 us back to back, and 32 us posted
  (``bench/HISTORY.md``, "Barriers in the mailboxes").
- Elsewhere, the dissemination steps (on a job of several hosts with several
  ranks each, the hierarchical barrier, :func:`ringcore.algo.hierarchical.barrier`,
  unless ``RINGCORE_HIERARCHICAL=0``: fewer rounds wait on the network),
  bound once per context (to an empty WORK) and run in lockstep
  (:func:`ringcore.plans.base.run_steps`) with the communicator's timeout,
  stall check and failure handling. So does the numbered-zero barrier that
  confirms the world at start-up, which no mailbox holds (a slot's number
  starts at 0).
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
from ringcore.plans import oneshot
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

    def run(self, obj: Any, seq: int) -> None:
        ctx = self.ctx
        if ctx.size < 2:
            return
        try:
            synchronise(ctx, seq, self.signature)
        except BaseException as err:
            ctx.fail(Descriptor("barrier", seq, "uint8", ()), err)


def synchronise(ctx: Context, seq: int, signature: int, part: int = 0) -> None:
    """Wait until every rank got here in collective ``seq`` (module docstring): an empty post in the
    mailboxes where the ranks have them, else the barrier's steps (schedule ``part``).

    Raises what the caller's ``ctx.fail`` turns into every rank's error.
    """
    transport = ctx.transport
    if seq and getattr(transport, "mailbox", None) is not None:
        oneshot.meet(ctx, transport, seq, signature, oneshot.POSTED, 0)  # type: ignore[arg-type]
    else:
        bound_barrier(ctx).run(seq, signature, part)  # bound in the turn, as all that touches the transport


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
