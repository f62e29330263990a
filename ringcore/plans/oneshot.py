"""Allreduce through the mailboxes on one host: one shot for small inputs, two shots for mid-sized ones.

A 4 KiB allreduce moves almost no bytes; its time is the ranks' waits for one
another, and on a host with fewer cores than ranks every wait is a trip
through the scheduler. Recursive doubling over the pair rings waits
``log2 N`` times, each on one partner. Here each rank waits once:

1. it copies its input into its mailbox's next slot and posts it
   (the signature, whether it took part, then ``seq``; the mailboxes:
   :mod:`ringcore.transport.shm_mailbox`);
2. it waits until every peer has posted ``seq`` (both in one call,
   ``ShmTransport.meet_posts``, which polls for a while; then the executors'
   wait loop, :class:`ringcore.algo.waiting.Watch`: the timeout, the stall
   check, a dead or departed peer named);
3. it checks every peer's signature (``MismatchError`` naming who differs,
   before the caller's buffer is touched) and reduces the ``N`` posted
   inputs, in rank order, into the caller's buffer (on a crowded host one
   rank reduces for all: "One reducer" below).

Every rank reduces the same inputs in the same order, so all end with the
same bits, and the caller's buffer is written only once nothing can fail:
a failure leaves it as it was. No synchronisation follows, because a rank
overwrites a slot only two posts later, once every peer has posted in
between and so has read it (the mailbox's two slots).

When. The route is chosen in :func:`ringcore.plans.direct.route_for`, for plans
of at most ``RINGCORE_SMALL_BYTES`` (at N=2 of up to a 1 MiB slot below
``RINGCORE_DIRECT_BYTES``: "Two shots" below) without compression, where
every rank is on this host and mapped every mailbox (agreed at set-up) and
``RINGCORE_DIRECT_BYTES`` is not 0 (which keeps every allreduce on the
rings). Every rank posts in every such allreduce: a rank
whose buffer is not in host memory (a GPU's) posts that it does not take
part, and then every rank runs its plan's own form, so host and GPU ranks
still meet in one ring. A rank that runs something else is found from
either side (``ShmTransport._check_idle``): its frames of this collective
reach a rank awaiting posts, or this rank's post reaches it while it awaits
frames (``Mailbox.stray``); ``MismatchError`` on every rank either way.

GPU memory. A job whose ranks all pass GPU buffers (several GPUs on one
host) would pay that post and wait before every small collective, for
nothing. Once every rank posted that it does not take part in a collective
of some signature (kind, dtype, shape, op...), :func:`decline` keeps the
signature in ``ctx.declined`` and later ones go straight to their plan's
form: the one-shot allreduce, the one-shot broadcast and the direct route's
vote (where every rank offered nothing: GPU memory, or host memory the
kernel cannot copy, as CUDA's pinned memory). Every rank saw the same posts,
so the ranks' choices stay alike; a later call of that signature with
ordinary host memory takes the rings too.

One reducer. Where the host's ranks outnumber its CPUs (``Placement.crowded``,
the same on every rank; ``RINGCORE_ONE_REDUCER=1`` or ``0`` decides instead:
:func:`one_reducer`, the one place it is chosen),
reducing on every rank is work the cores do ``N`` times over while the ranks
wait on one another: at N=4 on 2 cores, twelve adds where three would do. So
one rank, ``seq % N`` (a turn each), reduces for all: it waits for every
post and checks every signature, as above, reduces the inputs in rank order
into the caller's buffer, copies the result over its input in its slot and
publishes it (``ShmTransport.publish``: how many ranks take part, then
``seq`` in its header's result word, the doorbells). Every other rank posts
and waits for that word alone (the reducer published only once every
signature matched its own, this rank's included), and copies the result
out. The bits are those of every rank reducing: the same inputs, the same
order. A failure before the result is published leaves every other buffer
as it was (the reducer's own may be written, and its error's note says so);
the reducer's ``ctx.fail`` tells the others, which wait on it. A rank waiting
for the result counts every peer's post as progress (the reducer waits for
them), so the timeout is the time without progress, as in every other wait,
and a rank that times out names the ranks whose input the reducer awaits. With
cores for every rank, each rank's own adds run in parallel and one reducer
only adds its copy and a second hop to everyone's wait (N=2 on 2 cores, by
hand: 4.3 us against 2.9). Measured (``bench/HISTORY.md``, "One reducer on
crowded hosts"): by hand at N=3 and 4 on 2 cores, 0.83-0.88x the time of
every rank reducing; ``compare.py`` at 4-64 KiB, 1.06-1.41x the busbw.

Measured (``bench/HISTORY.md``, "Small allreduces in one shot"): the
hand-written floors, 4 KiB back to back, are 4.5 us at N=2 and 24.8 at N=4
through the mailboxes against 5.1 and 33.6 for recursive doubling on the
rings; ``compare.py`` gives the route 1.13-1.48x the rings' busbw at 4-64 KiB.

Two shots. Above ``RINGCORE_SMALL_BYTES`` one shot has every rank reduce
every element from ``N`` inputs, and the ring waits ``2(N-1)`` times for
frames of a few KiB. From there up to the mailbox's slot (1 MiB) and below
``RINGCORE_DIRECT_BYTES``, the two-shot route (:class:`TwoShotRoute`; the
name is TensorRT-LLM's, for its custom allreduce) posts twice:

1. as one shot: the input into the next slot, post, wait, signatures checked
   (a rank that does not take part sends every rank to the plan's form);
2. each rank reduces its share of the elements (:func:`ringcore.algo.direct.shares`,
   64-byte aligned) from the ``N`` posted inputs, in rank order, into its
   next slot, and posts that;
3. once every peer has posted its share, each rank copies the ``N`` shares
   into the caller's buffer.

Per rank that is one copy in, one pass over its share reading ``N`` inputs,
one copy out and two waits, where the ring makes ``2(N-1)`` of each through
slots. The caller's buffer is written only in step 3, once nothing can fail,
so a failure leaves it as it was, as one shot does (``RINGCORE_ATOMIC=1``
takes this route too). The slots follow the mailbox's rule: a rank posts
into a slot again two posts later, once every peer has posted in between,
so has read it. Each share is reduced once, by its owner, so every rank ends
with the same bits. Measured (``bench/HISTORY.md``, "Two shots"), busbw
against the ring at 128-512 KiB: N=4 1.48-2.30x, where one shot is
0.68-0.89x as fast as two. At N=2 one shot takes this range too: two shots
would have each rank add half the elements and copy the other half, one
shot's single add of the peer's input in another form, and wait once more
(one shot 1.05-1.16x two shots' busbw at 96-384 KiB; at N=3 two shots are
1.04-1.43x one shot's at 128-384 KiB). The choice is
:func:`ringcore.plans.direct.route_for`'s.

Pieces. From three ranks, without ``RINGCORE_ATOMIC``, an input longer than a
slot and below ``RINGCORE_DIRECT_BYTES`` (auto: only where the kernel's copies
are slow, up to 8 MiB: ``ringcore.config.Settings.direct_from``) goes two-shot
a slot's worth at a time: piece 0's posts carry ``seq`` as every other route's
do (so a rank whose input is one slot meets it there, and a mismatch is named),
piece ``k`` from 1 on ``seq`` with ``k`` above bit 48 (:func:`piece_number`), so a
peer's post of the piece before, two posts back in the same slot, is never
taken for this one. Piece ``k`` reaches the caller's buffer once its second
post is met, so a failure in a later piece leaves the pieces before it reduced
and the rest as it was, and the error's note says so
(:func:`ringcore.slicing.note_failure`). Measured on that host at N=4, fast
spells: 1.2-1.7x the direct route's busbw from 2 to 16 MiB (``bench/HISTORY.md``,
"Slow kernel copies").

The other collectives. :func:`exchange` is the same post and wait for a
broadcast (the root posts its buffer, every rank copies it), an allgather
(every rank posts its rows, every rank concatenates; a rank whose rows
outgrow the slot posts that it does not take part, with their size, which
stands in for the row counts' exchange) and a reduce_scatter (every rank
posts its input, each reduces its chunk from the N inputs in rank order),
each at most a slot and without compression, where every rank has mailboxes
(:mod:`ringcore.plans.broadcast`, :mod:`ringcore.plans.gather`). Their
plans' forms compile a schedule per call: at 4 KiB a broadcast took 73 us
at N=2 and 270 at N=4, an allgather 128 and 590 (``bench/HISTORY.md``,
"Small broadcasts and gathers in one shot"); with 1 MiB slots, at 512 KiB
and 1 MiB one shot takes 0.26-0.37x the rings' time for a broadcast,
0.45-0.74x for an allgather and 0.56-0.84x for a reduce_scatter ("Two shots").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ringcore.algo.direct import shares
from ringcore.algo.waiting import Watch
from ringcore.descriptor import Descriptor
from ringcore.plans.base import host_array, plan_reducer
from ringcore.slicing import note_failure
from ringcore.transport.base import FrameMismatch
from ringcore.transport.shm_mailbox import TAKING

if TYPE_CHECKING:
    from ringcore.context import Context
    from ringcore.placement import Placement
    from ringcore.plans.base import RoutedPlan
    from ringcore.transport.shm import ShmTransport
    from ringcore.transport.shm_mailbox import Mailbox

PIECE_SHIFT = 48  # a piece's number in its posts' sequence word, above any collective's number (Pieces)


def piece_number(seq: int, k: int) -> int:
    """What piece ``k`` of collective ``seq`` posts: ``seq`` itself for piece 0 (as every route posts
    it), ``k`` above it for the others; unique while ``seq`` stays below 2**48 (a million collectives
    a second for nine years) and pieces below 2**16 (64 GiB of 1 MiB slots)."""
    return seq | (k << PIECE_SHIFT) if k else seq


PIECES_WHY = "two shots reduce an input a mailbox slot (1 MiB) at a time"
ABSENT, POSTED = 0, 1  # a rank's post: its input is not in it (the plan's form runs), or it is
DECLINED_KEPT = 4096  # signatures kept in ctx.declined, then forgotten all at once (decline)


class OneShotRoute:
    """One plan's one-shot route (module docstring); ``run(obj, seq)`` False: the plan's form runs instead."""

    name = "oneshot"

    def __init__(self, plan: RoutedPlan, transport: ShmTransport) -> None:
        self.plan, self.ctx, self.transport = plan, plan.ctx, transport
        self.calls = 0
        self.storage = np.dtype(plan.dtype.storage)
        # What every call reads, bound once: at N=4 on 2 cores each lookup is paid twice a core.
        self.signature, self.nbytes, self.rank = plan.signature, plan.nbytes, plan.ctx.rank
        self.size = plan.ctx.size
        self.one_reducer = transport.one_reducer  # agreed at set-up ("One reducer")
        self.declined = plan.ctx.declined  # one set for the context's life (decline clears it in place)
        self._reduce: Any = None  # the plan's reducer's reduce, once made

    def run(self, obj: Any, seq: int) -> bool:
        signature = self.signature
        if signature in self.declined:  # every rank passed GPU memory to this collective before
            return False
        transport, rank = self.transport, self.rank
        mailbox = transport.mailbox
        assert mailbox is not None
        reducer = seq % self.size if self.one_reducer else -1  # -1: every rank reduces
        try:
            flat = host_array(self.plan, obj)
            slot = mailbox.slot
            # The slot's views are not kept here: they are the mailbox's, dropped when it closes.
            inputs = mailbox.inputs(slot, self.nbytes, self.storage)
            way = POSTED
            if flat is not None:
                inputs[rank][...] = flat
            else:
                way = ABSENT
            if reducer != rank:
                posted = meet(self.ctx, transport, seq, signature, way, self.nbytes, "input", reducer)
            else:  # this rank reduces for all: the result goes where its input was, then is published
                posted = meet(self.ctx, transport, seq, signature, way, self.nbytes)
                taking = posted + (way == POSTED)
                if taking < self.size:
                    transport.publish(slot, seq, taking)
                else:
                    try:
                        self._reducer()(flat, inputs)
                        inputs[rank][...] = flat
                        transport.publish(slot, seq, taking)
                    except BaseException as err:  # e.g. KeyboardInterrupt: the buffer may be written
                        note_failure(err, 0, self.plan.count, self.plan.count)
                        raise
        except BaseException as err:
            self.ctx.fail(Descriptor("allreduce", seq, *self.plan.fields), err)
        if flat is None or posted < len(mailbox.peers):
            if flat is None and not posted:
                decline(self.ctx, signature)
            return False
        if reducer < 0:
            self._finish(flat, inputs, seq)
        elif reducer != rank:
            flat[...] = inputs[reducer]  # its result, in one C call: no signal lands mid-copy
        self.calls += 1
        return True

    def _finish(self, flat: np.ndarray, inputs: list[np.ndarray], seq: int) -> None:
        """Every rank's input posted: reduce them all, in rank order, into the caller's buffer."""
        try:
            self._reducer()(flat, inputs)
        except BaseException as err:  # e.g. KeyboardInterrupt between two adds: the buffer is partly written
            note_failure(err, 0, self.plan.count, self.plan.count)
            raise

    def _reducer(self) -> Any:
        """The plan's reducer's ``reduce``, made once."""
        reduce = self._reduce
        if reduce is None:
            reduce = self._reduce = plan_reducer(self.plan).reduce
        return reduce


class TwoShotRoute(OneShotRoute):
    """One plan's two-shot route (module docstring, "Two shots"): the one-shot route's post and
    wait, then each rank reduces its share into its next slot, posts that, and copies every share out;
    an input longer than a slot in pieces of a slot, one after the other ("Pieces")."""

    name = "twoshot"

    def __init__(self, plan: RoutedPlan, transport: ShmTransport) -> None:
        super().__init__(plan, transport)
        self.one_reducer = False  # every rank reduces its share already
        mailbox = transport.mailbox
        assert mailbox is not None
        itemsize = self.storage.itemsize
        step = mailbox.slot_bytes // itemsize  # elements of a whole piece
        self.pieces = [
            (
                lo,
                min(plan.count, lo + step),
                [slice(a, b) for a, b in shares(min(step, plan.count - lo), plan.ctx.size, itemsize)],
            )
            for lo in range(0, max(plan.count, 1), step)
        ]
        self.shares = self.pieces[0][2]
        self.share = self.shares[self.rank]

    def run(self, obj: Any, seq: int) -> bool:
        if len(self.pieces) == 1:
            return super().run(obj, seq)
        if self.signature in self.declined:
            return False
        ctx, transport, mailbox = self.ctx, self.transport, self.transport.mailbox
        assert mailbox is not None
        reduce, rank, storage, itemsize = self._reducer(), self.rank, self.storage, self.storage.itemsize
        done = exposed = 0  # elements [0, done) hold the result, the next ``exposed`` may be changing
        try:
            flat = host_array(self.plan, obj)
            for k, (lo, hi, parts) in enumerate(self.pieces):
                number = piece_number(seq, k)
                nbytes = (hi - lo) * itemsize
                inputs = mailbox.inputs(mailbox.slot, nbytes, storage)
                if flat is not None:
                    inputs[rank][...] = flat[lo:hi]
                posted = meet(
                    ctx, transport, number, self.signature, ABSENT if flat is None else POSTED, nbytes
                )
                if flat is None or posted < len(mailbox.peers):  # the first piece's post decides it
                    if flat is None and not posted:
                        decline(ctx, self.signature)
                    return False
                outputs = mailbox.inputs(mailbox.slot, nbytes, storage)
                share = parts[rank]
                reduce(outputs[rank][share], [view[share] for view in inputs])
                meet(ctx, transport, number, self.signature, POSTED, nbytes, "reduced share")
                piece, exposed = flat[lo:hi], hi - lo
                for owner, part in enumerate(parts):
                    piece[part] = outputs[owner][part]
                done, exposed = hi, 0
        except BaseException as err:  # the peers wait for this rank's post: tell them
            try:
                ctx.fail(Descriptor("allreduce", seq, *self.plan.fields), err)
            except BaseException as failed:
                note_failure(failed, done, exposed, self.plan.count, PIECES_WHY)
                raise
        self.calls += 1
        return True

    def _finish(self, flat: np.ndarray, inputs: list[np.ndarray], seq: int) -> None:
        mailbox = self.transport.mailbox
        assert mailbox is not None
        share = self.share
        try:
            outputs = mailbox.inputs(mailbox.slot, self.nbytes, self.storage)
            self._reducer()(outputs[self.rank][share], [view[share] for view in inputs])
            meet(self.ctx, self.transport, seq, self.signature, POSTED, self.nbytes, "reduced share")
        except BaseException as err:  # the peers wait for this rank's share: tell them
            self.ctx.fail(Descriptor("allreduce", seq, *self.plan.fields), err)
        try:  # every share is reduced: the caller's buffer is written
            for rank, part in enumerate(self.shares):
                flat[part] = outputs[rank][part]
        except BaseException as err:  # e.g. KeyboardInterrupt between two shares' copies
            note_failure(err, 0, self.plan.count, self.plan.count)
            raise


def one_reducer(setting: bool | None, where: Placement) -> bool:
    """Whether one rank reduces each one-shot allreduce for all ("One reducer"): ``setting``
    (``RINGCORE_ONE_REDUCER``) where given, else where the job's one host runs more ranks than
    its CPUs. The same on every rank of a job with mailboxes (one host, agreed records)."""
    if setting is not None:
        return setting
    return where.one_host and where.crowded


def meet(
    ctx: Context,
    transport: ShmTransport,
    seq: int,
    signature: int,
    way: int,
    nbytes: int,
    what: str = "input",
    reducer: int = -1,
) -> int:
    """Post this rank's part of collective ``seq`` (``nbytes`` already in its mailbox's next slot, the
    mailbox's ``slot`` before the call), wait for every peer's and check their signatures; how many
    peers posted that they take part (``POSTED``).

    With ``reducer`` (a peer that reduces for all, "One reducer"), wait for its
    result instead, and take its word for the posts: it checked every signature
    against its own, and says how many ranks take part.

    The one-shot route's one synchronisation, and the direct route's two
    (:mod:`ringcore.plans.direct`). Raises what the caller's ``ctx.fail`` turns
    into every rank's error: ``FrameMismatch`` (a peer posted another
    collective, or sent frames of this one), ``CollectiveTimeout``, ``PeerFailure``.
    """
    slot = transport.meet_posts(seq, signature, way, nbytes, reducer)
    mailbox = transport.mailbox
    assert mailbox is not None
    if transport.awaited:
        stall = ctx.stall
        watch = Watch(
            transport,
            ctx.settings.timeout,
            stall.interruption if stall is not None else None,
            lambda: (
                f"waiting for the {what} of " + ", ".join(f"rank {p}" for p in transport.awaited)
                if reducer < 0
                else _awaiting_result(mailbox, slot, seq, reducer)
            ),
        )
        while transport.awaited:
            watch.progress(0.5)
    if reducer >= 0:  # published only once every signature matched the reducer's, so this rank's too
        return mailbox.heads[reducer][slot][TAKING] - (way == POSTED)  # type: ignore[no-any-return]
    taking = 0  # a loop, not sum(generator): a 4 KiB allreduce counts every call
    for head in mailbox.peer_heads[slot]:
        if head[1] != signature:
            for peer in mailbox.peers:  # who differs: only on the way to the error
                theirs = mailbox.header(peer, slot)[1]
                if theirs != signature:
                    raise FrameMismatch(peer, "signature", signature, theirs)
        if head[2] == POSTED:
            taking += 1
    return taking


def _awaiting_result(mailbox: Mailbox, slot: int, seq: int, reducer: int) -> str:
    """What a rank waiting for ``reducer``'s result of collective ``seq`` waits for, read from the
    posts: the ranks whose input the reducer still waits for, where a timeout names the culprit."""
    text = f"waiting for the result of rank {reducer}"
    if not mailbox.posted(reducer, slot, seq):
        return text + ", which has not posted its own input"
    missing = [peer for peer in mailbox.peers if peer != reducer and not mailbox.posted(peer, slot, seq)]
    if missing:
        return text + ", which waits for the input of " + ", ".join(f"rank {peer}" for peer in missing)
    return text + " (every rank posted its input)"


def decline(ctx: Context, signature: int) -> None:
    """Every rank posted ABSENT in a collective of ``signature`` (all its buffers on GPUs): later
    ones go straight to their plan's form, with no post and wait first ("GPU memory" above).

    Every rank saw the same posts, so every rank adds the same signatures in the same order and
    forgets them all at the same call (at ``DECLINED_KEPT``): the ranks' choices stay alike.
    """
    if len(ctx.declined) >= DECLINED_KEPT:
        ctx.declined.clear()
    ctx.declined.add(signature)


def mailbox_of(ctx: Context) -> Mailbox | None:
    """The job's mailboxes where every rank has them (one host, agreed at set-up), else None."""
    if ctx.size < 2:
        return None
    return getattr(ctx.transport, "mailbox", None)


def exchange(
    ctx: Context, desc: Descriptor, taking: bool, payload: np.ndarray | None, nbytes: int
) -> list[tuple[int, int, np.ndarray]]:
    """Post this rank's part of collective ``desc`` and wait for every rank's: ``(way, nbytes, bytes)``
    of each rank, in rank order (module docstring, "The other collectives").

    ``payload`` (contiguous, at most a slot) goes into this rank's next slot, ``nbytes`` into
    its header (the payload's size, or a size the peers should know); ``taking`` False posts
    that this rank does not take part. The bytes are the peers' slots, valid until this rank
    posts again. Failures become every rank's error (``ctx.fail``).
    """
    transport = ctx.transport
    mailbox = mailbox_of(ctx)
    assert mailbox is not None
    try:
        slot = mailbox.slot
        if payload is not None:
            mailbox.payload(ctx.rank, slot)[: payload.nbytes] = payload.reshape(-1).view(np.uint8)
        meet(ctx, transport, desc.seq, desc.signature(), POSTED if taking else ABSENT, nbytes)  # type: ignore[arg-type]
    except BaseException as err:
        ctx.fail(desc, err)
    posts = []
    for rank in range(ctx.size):
        header = mailbox.header(rank, slot)
        way, size = int(header[2]), int(header[3])
        posts.append((way, size, mailbox.payload(rank, slot)[: size if way == POSTED else 0]))
    return posts
