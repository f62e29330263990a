"""Run a one-segment schedule step by step: the latency path for small collectives.

Why. Small allreduces (recursive doubling), barriers and the count exchange of
allgather move one frame per step. For them the dataflow bookkeeping of
:class:`~ringcore.algo.execute.Executor` (per-segment readiness, region
conflicts, queues per connection) costs more than the bytes: a 4 KiB
allreduce spent about a third of its CPU there.

Theory of operation. Step by step, in order: post the step's send and its
receive, progress the transport until both are done, then combine. One step
never overlaps the next, so no region can be written while a send still
reads it and no conflict tracking is needed. The frames are exactly the
Executor's (same tags, same connection, same order, same checks), so a rank
running this and a rank running the Executor agree. One exception to "in
order", as in the Executor: over RDMA, empty receives (acknowledgements,
barrier rounds) that are first on their connection are posted before the
first step. There a posted receive announces itself (with the collective's
signature) to the sender, so a peer that disagrees (e.g. on a broadcast's
root, and so never receives from this rank) learns of it at once instead of
both waiting until the timeout. Over TCP a posted receive announces nothing
(a disagreement shows in the frames themselves, read or peeked), and posting
early would only move those steps off the latency path (``swap``), which
made a barrier at N=4 on 2 cores slower (measured: ``bench/HISTORY.md``).

Binding. The steps in order are the program's (:attr:`ringcore.algo.program.Program.lockstep`,
the one compiled form every executor shares); :func:`bind` resolves their regions to views once;
:func:`run_bound` runs bound steps. The executor binds per call; a small
allreduce's kept plan (the small form of
:class:`ringcore.plans.allreduce.AllreducePlan`) binds once and reuses the
steps. A step goes through the transport's ``swap`` when it has one (the
latency path of TCP and of shared memory: one send and one receive with no
queue walk), and waiting through its ``exchange`` when it has one, else
``progress``.

Writing the caller's buffer. In-place schedules (halving-doubling, a
one-segment ring) receive into USER and combine into it (a ``commit`` step).
Without ``RINGCORE_ATOMIC`` nothing is backed up, so those steps run here
too: a commit combines straight into USER. Over TCP a receive into USER is
posted and progressed (header, then payload): TCP's ``swap`` refuses it, as
its single ``recvmsg_into`` would spill an unexpected frame's first bytes
into the caller's memory. Shared memory's ``swap`` checks each frame before
a byte lands, so it takes those receives, and lent ones, too.

Combining from a peer's memory. A step whose received bytes are only a
combine operand (``lend`` in the program: :mod:`ringcore.algo.program`) is
posted with the transport's ``irecv_lent`` when it has one (shared memory),
for frames from its ``lend_from`` bytes. If the transport lent the frame, the
combine reads the pieces where they arrived (:func:`_combine_lent`) and the
transport gets them back right after; otherwise the bytes are in the region
and the combine is the usual one. Same operands, same order: same bits.

What it does not do, so :func:`fits` sends those schedules to the Executor:
pipelining (more than one segment), writing the caller's buffer with
``atomic`` (the backup and restore), converting USER to the wire dtype on the
fly, and per-step timeline events.

Deadlock. Waiting for the step's send before its receive completes is safe:
``progress`` moves every posted frame both ways, and in every schedule a
step's send is matched by a receive its peer posts in the same step
(ring, recursive doubling, halving-doubling, dissemination barrier) or in a step that does not
wait on this rank (the chain broadcast's forward and acknowledgement).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ringcore.algo.program import Key, Program, compile_program
from ringcore.algo.steps import Buf, Schedule
from ringcore.algo.waiting import Watch
from ringcore.kernels.numpy_ops import Reducer
from ringcore.transport import wire
from ringcore.transport.base import Request, Transport

_BUFS = tuple(Buf)  # iterating an Enum class runs Python on every call
_LENDABLE_ITEMSIZES = (1, 2, 4, 8, 16)  # divide every slot (a power of two >= 64 bytes): no element is split


def fits(
    schedule: Schedule, transport: Transport, arrays: dict[Buf, np.ndarray], atomic: bool = False
) -> bool:
    """True when ``schedule`` can run in lockstep (see the module docstring).

    ``atomic``: the caller's buffer must be restored if the run fails, which
    only the Executor does, so a schedule that writes it is refused.
    """
    program = compile_program(schedule, transport)
    if program.segments != 1 or (atomic and program.writes_user):
        return False
    if program.sends_user or program.writes_user:
        user, work = arrays.get(Buf.USER), arrays.get(Buf.WORK)
        return user is None or work is None or user.dtype == work.dtype
    return True


Wire = tuple[int, int, memoryview]  # (peer, channel, bytes)
Bound = tuple[
    int, Wire | None, Wire | None, tuple[np.ndarray, np.ndarray, np.ndarray] | None, bool, bool, int
]


def bind(program: Program, arrays: dict[Buf, np.ndarray]) -> tuple[Bound, ...]:
    """``program``'s steps in order (:attr:`Program.lockstep`) with their regions resolved to views of ``arrays``.

    A step is ``(tag bits, (peer, channel, view) | None, same for the receive,
    (dst, a, b) arrays | None, final, scratch, lend)``; ``scratch`` is False when
    the receive lands in USER (see the module docstring); ``lend`` is the
    program's (which combine operand the received bytes are, 0: they must
    land in their region), kept where elements never straddle a slot. Binding once and
    running many times (the small form of :class:`ringcore.plans.allreduce.AllreducePlan`) saves a
    small allreduce the slicing and casting of every call.
    """

    by_buf = [arrays.get(buf) for buf in _BUFS]  # indexed by the int in a Key: no enum lookups
    raw: list[memoryview | None] = [None] * len(by_buf)  # each array's bytes, cast once

    def view(key: Key) -> np.ndarray:
        return by_buf[key[0]][key[1] : key[2]]  # type: ignore[index]

    def wire(key: Key) -> memoryview:
        buf, lo, hi = key
        whole = raw[buf]
        if whole is None:
            whole = raw[buf] = memoryview(by_buf[buf]).cast("B")  # type: ignore[arg-type]
        itemsize = by_buf[buf].itemsize  # type: ignore[union-attr]
        return whole[lo * itemsize : hi * itemsize]

    bound: list[Bound] = []
    for tag_bits, send, recv, reduce, final, lend in program.lockstep:
        wire_send = (send[0], send[1], wire(send[2])) if send else None
        wire_recv = (recv[0], recv[1], wire(recv[2])) if recv else None
        arrays_of = (view(reduce[0]), view(reduce[1]), view(reduce[2])) if reduce else None
        scratch = recv is None or recv[2][0] != Buf.USER
        if lend and arrays_of is not None and arrays_of[lend].itemsize not in _LENDABLE_ITEMSIZES:
            lend = 0
        bound.append((tag_bits, wire_send, wire_recv, arrays_of, final, scratch, lend))
    return tuple(bound)


def run_bound(
    transport: Transport,
    steps: tuple[Bound, ...],
    early: tuple[int, ...],
    reducer: Reducer,
    seq_bits: int,
    signature: int,
    timeout: float,
    interrupt: Callable[[], str | None] | None = None,
    nbytes: int = 0,
) -> None:
    """Run bound ``steps`` in order (see the module docstring); on failure, cancel and re-raise.

    ``nbytes``: the caller's bytes the collective reduces (``Transport.expect``).

    Every step not posted early is offered to the transport's ``swap``, which
    says which receives it takes (TCP's: scratch only, see the module
    docstring); only receives into scratch memory take ``exchange``.
    """
    try:
        transport.expect(seq_bits >> 32, signature, nbytes)
        swap = getattr(transport, "swap", None)  # a transport's latency path (TCP's, shared memory's)
        posted = (
            {index: _post_receive(transport, steps[index], seq_bits, signature) for index in early}
            if early
            else {}
        )
        for index, (tag_bits, send, recv, reduce, final, scratch, lend) in enumerate(steps):
            lends = lend and _lends(transport, recv)  # looked up only here: each lookup costs a small step
            pair = (
                None
                if swap is None or index in posted
                else swap(send, recv, seq_bits | tag_bits, signature, lends, scratch)
            )
            if pair is not None:
                sent, received = pair
                if (sent is not None and not sent.done) or (received is not None and not received.done):
                    _wait(transport, sent, received, timeout, interrupt)
            else:
                sent = received = None
                if send is not None:
                    sent = transport.isend(send[0], send[1], seq_bits | tag_bits, signature, send[2])
                if recv is not None:
                    if index in posted:
                        received = posted[index]
                    elif lends:
                        received = transport.irecv_lent(  # type: ignore[attr-defined]
                            recv[0], recv[1], seq_bits | tag_bits, signature, recv[2]
                        )
                    else:
                        received = transport.irecv(recv[0], recv[1], seq_bits | tag_bits, signature, recv[2])
                done = (sent is None or sent.done) and (received is None or received.done)
                exchange = None if done or not scratch else getattr(transport, "exchange", None)
                if not done and (exchange is None or not exchange(sent, received)):
                    _wait(transport, sent, received, timeout, interrupt)
            if reduce is not None:
                if received is not None and received.lent:
                    _combine_lent(reducer, reduce, lend, received.lent, final)
                    transport.release(received)  # type: ignore[attr-defined]
                else:
                    reducer.combine(reduce[0], reduce[1], reduce[2], final)
    except BaseException:
        transport.cancel()
        raise


class LockstepExecutor:
    """Runs a schedule accepted by :func:`fits`; the arguments are the Executor's."""

    def __init__(
        self,
        transport: Transport,
        schedule: Schedule,
        arrays: dict[Buf, np.ndarray],
        reducer: Reducer,
        seq: int,
        signature: int,
        timeout: float,
        interrupt: Callable[[], str | None] | None = None,
    ) -> None:
        self.transport = transport
        self.program = compile_program(schedule, transport)
        self.arrays = arrays
        self.user_bytes = arrays[Buf.USER].nbytes if Buf.USER in arrays else 0
        self.reducer = reducer
        self.seq_bits = (seq & 0xFFFFFFFF) << 32
        self.signature = signature
        self.timeout = timeout
        self.interrupt = interrupt

    def run(self) -> None:
        """Run every step; on failure, drop whatever is still queued and re-raise."""
        run_bound(
            self.transport,
            bind(self.program, self.arrays),
            self.program.early,
            self.reducer,
            self.seq_bits,
            self.signature,
            self.timeout,
            self.interrupt,
            self.user_bytes,
        )


def _combine_lent(
    reducer: Reducer,
    reduce: tuple[np.ndarray, np.ndarray, np.ndarray],
    lend: int,
    lent: list[tuple[int, memoryview]],
    final: bool,
) -> None:
    """The step's combine with operand ``lend`` (1: a, 2: b) read from the lent pieces where they lie."""
    dst, a, b = reduce
    dtype = reduce[lend].dtype
    for offset, piece in lent:
        lo = offset // dtype.itemsize
        hi = lo + piece.nbytes // dtype.itemsize
        got = np.frombuffer(piece, dtype)
        if lend == 1:
            reducer.combine(dst[lo:hi], got, b[lo:hi], final)
        else:
            reducer.combine(dst[lo:hi], a[lo:hi], got, final)


def _lends(transport: Transport, recv: Wire | None) -> bool:
    """Whether a lending step's receive goes to the transport's ``irecv_lent`` (shared memory: combine from its slots)."""
    return (
        recv is not None
        and getattr(transport, "irecv_lent", None) is not None
        and recv[2].nbytes >= getattr(transport, "lend_from", 0)
    )


def _post_receive(transport: Transport, step: Bound, seq_bits: int, signature: int) -> Request:
    tag_bits, _, recv, _, _, _, _ = step
    assert recv is not None
    return transport.irecv(recv[0], recv[1], seq_bits | tag_bits, signature, recv[2])


def _wait(
    transport: Transport,
    sent: Request | None,
    received: Request | None,
    timeout: float,
    interrupt: Callable[[], str | None] | None,
) -> None:
    watch = Watch(transport, timeout, interrupt, lambda: _pending(sent, received))
    while not ((sent is None or sent.done) and (received is None or received.done)):
        watch.progress(0.5)


def _pending(sent: Request | None, received: Request | None) -> str:
    waits = [
        f"{what} rank {request.peer} ({wire.describe_tag(request.tag)})"
        for what, request in (("send to", sent), ("receive from", received))
        if request is not None and not request.done
    ]
    return "waiting for " + ", ".join(waits)
