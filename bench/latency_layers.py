"""What a small allreduce's time is made of: ``ringcore-run -np N python bench/latency_layers.py [ITERS]``.

Runs the same float32 sum of 1024 elements (4 KiB) back to back, ``ITERS`` times
(default 20000 / N**2), with ringcore's route entered at each of its layers in
turn, shared memory between the ranks of this host; rank 0 prints the time per
allreduce of each, for 3 rounds, and what each layer adds:

- ``floor``: the recursive-doubling steps by hand on the rings: write the
  vector into the peer's ring, poll for the peer's with ``sched_yield``, add.
  No checks, no requests, no timeout: what no Python engine on these rings
  can undercut.
- ``swap``: the same steps through the transport's latency path
  (``ShmTransport.expect`` and ``swap``: frame checks, doorbells, timeout).
- ``lockstep``: the plan's bound steps run by ``lockstep.run_bound``.
- ``plan``: the kept plan's small form (copy in, steps, copy out) with the
  timeout and stall check (``AllreducePlan._run_small``).
- ``mailbox``: the one-shot allreduce by hand on the mailboxes (write the
  input, post it, poll every peer's post with ``sched_yield``, add the N
  inputs): no checks, no timeout.
- ``one``: the same with one reducer (:mod:`ringcore.plans.oneshot`, "One reducer"): rank
  ``seq % N`` polls every post, adds, writes the result over its input and publishes it; the
  others poll its result word and copy.
- ``oneshot``: the plan's one-shot route (``OneShotRoute.run``: the post,
  the transport's wait, the signature checks, the reduce), which
  ``ringcore.allreduce`` takes on one host (:mod:`ringcore.plans.oneshot`).
- ``turn``: the communicator's turn (ordering with async handles, stall
  record, numpy's error state): ``Communicator._run``.
- ``api``: ``ringcore.allreduce``: the plan cache's lookup on top.

The first five are the rings' route (recursive doubling), the next three the
mailboxes' (``oneshot`` takes one reducer where the host's ranks outnumber its
CPUs: its hand-written row is then ``one``, elsewhere ``mailbox``); ``turn``
and ``api`` add their layers to the one-shot route.

Then the same allreduce in ``compare.py``'s pattern (``barrier; t0; op; t1``,
the median over iterations of the slowest rank): ``hand`` (a barrier and the
one-shot allreduce, both by hand on the mailboxes), ``hand_one`` (the same
with one reducer) against ``api``
(``ringcore.barrier`` and ``ringcore.allreduce``). With more ranks than cores,
back-to-back loops hide what the pattern shows: each core runs every one of
its ranks' Python between one barrier and the slowest rank's return, so the
hand-written row is what no Python engine on this host can undercut there.

The layers reach into ringcore's internals, so this is a measuring tool for
this revision, not an API. Results are checked against the sum.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import ringcore
from ringcore.algo import lockstep
from ringcore.api import communicator
from ringcore.bench.usage import answer_help
from ringcore.plans.base import run_steps
from ringcore.plans.oneshot import OneShotRoute
from ringcore.transport import shm_ring
from ringcore.transport.shm import ShmTransport
from ringcore.transport.shm_mailbox import RESULT

COUNT = 1024


def layers(x: np.ndarray, work: np.ndarray) -> dict[str, Callable[[int], None]]:
    """One callable per layer, each reducing ``x`` into ``work`` as collective ``seq``."""
    comm = communicator()
    ctx, transport = comm.ctx, comm.ctx.transport
    if not isinstance(transport, ShmTransport) or transport.remote:
        raise SystemExit(
            "latency_layers: needs every rank on this host over shared memory (RINGCORE_TRANSPORT=auto)"
        )
    rank, size = ctx.rank, ctx.size
    if size & (size - 1):
        raise SystemExit(
            "latency_layers: needs a power-of-two number of ranks (the floor is recursive doubling)"
        )
    ringcore.allreduce(work)
    plan = comm._allreduce_plan(work, "sum", None)
    route, plan.direct = plan.direct, None
    ringcore.allreduce(work)  # the plan's own form, prepared in its first turn
    plan.direct = route
    if not isinstance(route, OneShotRoute) or transport.mailbox is None:
        raise SystemExit("latency_layers: the 4 KiB plan has no one-shot route (RINGCORE_DIRECT_BYTES=0?)")
    if plan.form != "small":
        raise SystemExit(f"latency_layers: the 4 KiB plan runs as {plan.form!r}, not 'small'")
    stage = np.empty(COUNT, np.float32)
    sent, got = memoryview(work).cast("B"), memoryview(stage).cast("B")
    signature = plan.signature
    partners = [rank ^ (1 << i) for i in range(size.bit_length() - 1)]

    def floor(seq: int) -> None:
        work[...] = x
        for step, peer in enumerate(partners, 1):
            link = transport.links[(peer, 0)]
            link.outbound.write((seq << 32) | step, signature, sent.nbytes, 0, sent)
            shm_ring.fence()
            while link.inbound.peek() is None:
                os.sched_yield()
            link.inbound.take(got, got.nbytes)
            np.add(*((work, stage) if rank < peer else (stage, work)), out=work)

    def swap(seq: int) -> None:
        work[...] = x
        transport.expect(seq, signature)
        for step, peer in enumerate(partners, 1):
            pair = transport.swap((peer, 0, sent), (peer, 0, got), (seq << 32) | step, signature)
            while pair is not None and not all(request is None or request.done for request in pair):
                transport.progress(0.5)
            np.add(*((work, stage) if rank < peer else (stage, work)), out=work)

    def bound(seq: int) -> None:
        plan._work[...] = x
        lockstep.run_bound(
            transport, plan._steps, plan._early, plan.reducer, (seq & 0xFFFFFFFF) << 32, signature, 30.0
        )
        work[...] = plan._work

    def steps(seq: int) -> None:
        plan._work[...] = x
        run_steps(ctx, plan._steps, plan._early, plan.reducer, seq, signature)
        work[...] = plan._work

    def small(seq: int) -> None:
        work[...] = x
        plan._run_small(work, seq)

    mailbox = transport.mailbox
    others = [peer for peer in range(size) if peer != rank]

    def posted(seq: int, reducer: int = -1) -> None:
        """By hand: every rank reduces, or (``reducer`` >= 0) that rank reduces and publishes for all."""
        slot = mailbox.slot
        inputs = mailbox.inputs(slot, x.nbytes, x.dtype)
        inputs[rank][...] = x
        mailbox.post(seq, signature, 1, x.nbytes)
        if reducer >= 0 and rank != reducer:
            head = mailbox.header(reducer, slot)
            while head[RESULT] != seq:
                os.sched_yield()
            work[...] = inputs[reducer]
            return
        for peer in others:
            while not mailbox.posted(peer, slot, seq):
                os.sched_yield()
        np.add(inputs[0], inputs[1], out=work)
        for index in range(2, size):
            np.add(work, inputs[index], out=work)
        if reducer >= 0:
            inputs[rank][...] = work
            mailbox.publish(slot, seq, size)

    def one_reducer(seq: int) -> None:
        posted(seq, seq % size)

    def oneshot(seq: int) -> None:
        work[...] = x
        route.run(work, seq)

    def turn(seq: int) -> None:
        work[...] = x
        comm._run(plan, work, None)

    def api(seq: int) -> None:
        work[...] = x
        ringcore.allreduce(work)

    return {
        "floor": floor,
        "swap": swap,
        "lockstep": bound,
        "plan": steps,
        "small": small,
        "mailbox": posted,
        "one": one_reducer,
        "oneshot": oneshot,
        "turn": turn,
        "api": api,
    }


def hand_barrier() -> Callable[[int], None]:
    """A barrier by hand on the mailboxes: post nothing, poll every peer's post with ``sched_yield``.

    It rings no doorbells, so it is safe only beside waiters that poll (the hand-written rows):
    ringcore's own waits may sleep on their doorbell.
    """
    comm = communicator()
    mailbox, rank = comm.ctx.transport.mailbox, comm.ctx.rank
    others = [peer for peer in range(comm.ctx.size) if peer != rank]

    def barrier(seq: int) -> None:
        slot = mailbox.post(seq, 0, 1, 0)
        for peer in others:
            while not mailbox.posted(peer, slot, seq):
                os.sched_yield()

    return barrier


def in_pattern(barrier: Callable[[], None], op: Callable[[], None], iters: int) -> float:
    """``compare.py``'s time of ``op``: ``barrier; t0; op; t1``, median over iterations of the slowest rank (us)."""
    times = np.empty(iters)
    for i in range(iters):
        barrier()
        start = time.perf_counter()
        op()
        times[i] = (time.perf_counter() - start) * 1e6
    grid = ringcore.allgather(times).reshape(ringcore.size(), iters)
    return float(np.median(grid.max(axis=0)))


def main() -> None:
    answer_help(__doc__)
    ringcore.init()
    size = ringcore.size()
    iters = int(sys.argv[1]) if len(sys.argv) > 1 else 20000 // size**2
    x = np.full(COUNT, ringcore.rank() + 1, np.float32)
    want = np.full(COUNT, size * (size + 1) / 2, np.float32)
    work = np.empty(COUNT, np.float32)
    comm = communicator()
    times: dict[str, list[float]] = {}
    for _ in range(3):
        for name, run in layers(x, work).items():
            ringcore.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                run(0 if name in ("turn", "api") else next_seq(comm))
            times.setdefault(name, []).append((time.perf_counter() - start) / iters * 1e6)
            if not np.array_equal(work, want):
                raise SystemExit(f"latency_layers: {name} gave {work[:4]}, expected {want[:4]}")
    if ringcore.rank() == 0:
        print(
            f"4 KiB allreduce, N={size}, {iters} back to back; us per allreduce in 3 rounds, layer's own share"
        )
        before = None
        for name, values in times.items():
            best = min(values)
            added = "" if before is None else f"+{best - before:.1f}"
            print(f"  {name:9s} {' '.join(f'{v:6.1f}' for v in values)}   {added}")
            before = best
    patterns = pattern_times(x, work, want, iters)
    if ringcore.rank() == 0:
        print("in compare.py's pattern (barrier; op), us per allreduce of the slowest rank, 3 rounds")
        for name, values in patterns.items():
            print(f"  {name:9s} {' '.join(f'{v:6.1f}' for v in values)}")
    ringcore.shutdown()


def next_seq(comm: Any) -> int:
    """Below the turn: take a ticket and pass its turn, as the communicator would; the collective's number."""
    seq = next(comm._tickets) + 1
    comm._turn += 1
    return seq


def pattern_times(x: np.ndarray, work: np.ndarray, want: np.ndarray, iters: int) -> dict[str, list[float]]:
    """The hand-written barrier and one-shot allreduce, and ringcore's, in ``compare.py``'s pattern
    (results checked against ``want``)."""
    comm = communicator()
    hands = layers(x, work)
    barrier = hand_barrier()

    def numbered(run: Callable[[int], None]) -> Callable[[], None]:
        def call() -> None:
            run(next_seq(comm))

        return call

    def api() -> None:
        work[...] = x
        ringcore.allreduce(work)

    rows = {
        "hand": (numbered(barrier), numbered(hands["mailbox"])),
        "hand_one": (numbered(barrier), numbered(hands["one"])),
        "api": (ringcore.barrier, api),
    }
    times: dict[str, list[float]] = {}
    for _ in range(3):
        for name, (wait, op) in rows.items():
            work[...] = 0
            times.setdefault(name, []).append(in_pattern(wait, op, iters))
            if not np.array_equal(work, want):
                raise SystemExit(
                    f"latency_layers: {name} in the pattern gave {work[:4]}, expected {want[:4]}"
                )
    return times


if __name__ == "__main__":
    main()
