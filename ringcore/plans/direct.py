"""The direct route of an allreduce on one host: when it runs, how the ranks agree on it, its safety.

On one host a rank can reach its peers' memory, so an allreduce needs no
frames of data: each rank reduces its share of the elements straight from
the peers' buffers and writes the result into theirs
(:mod:`ringcore.algo.direct`). Two ways in:

- **remote**: any CPU buffer, through ``process_vm_readv``/``process_vm_writev``
  (:class:`Remote`: a piece is read into a scratch that
  stays in cache, combined, and written back to every peer, one system call per
  piece and peer). Open MPI's single copy does the same reads; here the ranks
  write their reduced shares too, so there is no second round of copies.
- **mapped**: arrays from ``ringcore.empty`` (:mod:`ringcore.symmetric`), at one
  offset on every rank: loads and stores, no system call at all.

When. A plan has a direct route (:func:`route_for`, the one place a route is
chosen) when the conditions hold alike on every rank: a world of 2+ on one host,
above ``RINGCORE_SMALL_BYTES``, no compression, ``RINGCORE_ATOMIC=0`` and
``RINGCORE_DIRECT_BYTES`` not 0 (all agreed at init). At or below the small limit
it has the one-shot route instead (:mod:`ringcore.plans.oneshot`), where every
rank mapped every mailbox, and above it the mailboxes' one or two shots below
``RINGCORE_DIRECT_BYTES`` (with ``RINGCORE_ATOMIC=1`` too, where they are the
plan's only route). Whether a call takes it depends on where each rank's memory
lies, so it is decided per call, in :meth:`DirectRoute.run` and nowhere else:

- From ``RINGCORE_DIRECT_BYTES`` (auto: 384 KiB at N=2, 1 MiB for more ranks;
  where the kernel's copies are slow next to ``memmove``, measured and agreed at
  set-up, 16 MiB at N=2 with the ring below it and 8 MiB for more, with two shots below it:
  ``Settings.direct_from``, :func:`direct_from`), where every rank may copy from and to
  every other (``ShmTransport.copies_everywhere``, probed and agreed at set-up),
  the ranks vote: each offers a row ``(way, address, allocation, offset)`` in a
  small allreduce (part ``VOTE_PART`` of the collective's tags): remote for a
  CPU buffer the kernel can copy (not CUDA's pinned memory), mapped for
  symmetric memory, nothing for a GPU buffer. All mapped at one allocation and
  offset: mapped; all at least remote: remote; otherwise every rank runs its
  plan's own form, and ranks with host and GPU buffers still meet in one ring.
  The vote is the route's first synchronisation ("every input is in place"),
  so it costs about the barrier it replaces; where it sends everyone to the
  ring (a job whose ranks all pass GPU buffers) it is one small allreduce more,
  once per signature: after a vote where every rank offered nothing, that
  signature skips the vote (:func:`ringcore.plans.oneshot.decline`). Below
  the limit the mailboxes' one or two shots are faster on ordinary buffers
  (the vote, a barrier and a system call per piece and peer against one or
  two waits: ``bench/HISTORY.md``, "Two shots"; before them the ring was
  faster below 1 MiB: "Ordinary buffers go direct").
- Below it, or where ranks may not copy (``RINGCORE_TRANSPORT=tcp``, Yama's
  ``ptrace_scope``), only symmetric memory goes direct, found by ``locate``,
  and the descriptor names the allocation, so a rank that passed other memory
  fails with ``MismatchError`` before any rank touches a peer's array. Other
  memory below it takes the two-shot route through the mailboxes where the
  ranks have them (``below``: :class:`ringcore.plans.oneshot.TwoShotRoute`; one
  shot at N=2), else the plan's form.

Safety. A rank writes into its peers' buffers, and a buffer is the caller's
again once its rank returns, even from a failure, and a peer may pass the first
synchronisation while another fails in it (at N=4 one that died after its first
round). So where ranks may copy from each other each rank keeps a word that
peers read: ``seq`` from before its first synchronisation until it has written
its last piece, ``0`` then, ``-seq`` once it gave up on collective ``seq``. It
lies in the rank's mailbox where the ranks have them (a load to read,
:class:`SharedWord`), else in the rank's own memory (its address exchanged at
set-up, ``cma.Probe``), read through ``process_vm_readv``, a system call per
peer and call (4 us each at N=4 1 MiB, a twentieth of the rank's CPU). Before
writing anything, a rank reads every peer's word and writes nothing where one
gave up (it waits in the last barrier for that peer's ABORT, which names the
cause). A peer whose process is gone: its buffer cannot be read through the
kernel (``PeerFailure`` naming it, before anything is written); a word in the
mailbox outlives its process, so on symmetric memory the closing barrier names
it, after this rank wrote into memory nobody owns any more. A rank that gives
up sets ``-seq`` and then waits (``WRITER_GRACE`` s at most) until no live
peer's word says ``seq``. A store, a fence, then a read of the other's word on
both sides: one of the two sees the other, so no rank writes into a buffer
whose owner returned.
A peer that stays stopped mid-write past the grace is named in the error's note:
this rank's buffer may still change. Where ranks may not copy from each other
there are no words; an array from ``ringcore.empty`` is then not to be reused
after a failure.
"""

from __future__ import annotations

import ctypes
import errno
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ringcore.algo import direct, lockstep, recursive_doubling
from ringcore.algo.program import compile_program
from ringcore.algo.steps import Buf
from ringcore.buffers import DTYPES, storage_view
from ringcore.config import AUTO_DIRECT_BYTES
from ringcore.descriptor import Descriptor
from ringcore.errors import PeerFailure
from ringcore.ops import Compression, ReduceOp
from ringcore.plans import oneshot
from ringcore.plans.barrier import synchronise
from ringcore.plans.base import RoutedPlan, host_array, plan_reducer, run_steps
from ringcore.plans.oneshot import OneShotRoute, TwoShotRoute
from ringcore.slicing import note_failure
from ringcore.transport import cma, shm_ring, wire
from ringcore.transport.shm import ShmTransport

if TYPE_CHECKING:
    from ringcore.context import Context

NONE, REMOTE, MAPPED = 0, 1, 2  # a rank's offer in the vote
FIELDS = 4  # way, address, allocation serial, byte offset
ROW_BYTES = FIELDS * 8
VOTE_PART = (1 << wire.PART_BITS) - 1  # not part 0, with which the ring may follow the vote
DONE_PART = VOTE_PART - 1
WRITER_GRACE = 10.0  # seconds a failing rank waits for peers still writing into its buffer


class Remote:
    """A peer's buffer in its own process, copied from and to with one system call per piece (``cma``).

    Each direction's :class:`ringcore.transport.cma.Transfer` (this peer's alone: nothing else
    aims it) stays aimed at the last piece it copied, so where a share is one piece (up to
    ``PIECE_BYTES``: at N=4 1 MiB, six copies a call) a training loop's calls make the system
    call with no Python between; a share of several pieces aims them again at every piece.

    Args:
        rank, pid, host: the peer, its process and its ``host:port`` (for errors).
        address: where the peer's buffer starts, in its process.
        mine: this rank's buffer (the same layout).
        scratch: a piece's room, where :meth:`read` lands (shared by the peers: each read is
            combined before the next).
    """

    __slots__ = (
        "_piece",
        "_read_at",
        "_write_at",
        "address",
        "here",
        "host",
        "itemsize",
        "rank",
        "reads",
        "scratch",
        "scratch_at",
        "writes",
    )

    def __init__(
        self, rank: int, pid: int, address: int, mine: np.ndarray, scratch: np.ndarray, host: str = ""
    ) -> None:
        self.rank, self.address, self.host = rank, address, host
        self.reads, self.writes = cma.Transfer(pid, out=False), cma.Transfer(pid, out=True)
        self.here, self.itemsize = _address(mine), mine.itemsize
        self.scratch = scratch.view(mine.dtype)
        self.scratch_at = _address(scratch)
        self._read_at = self._write_at = (-1, -1, 0)  # (lo, hi, bytes) each transfer is aimed at
        self._piece = self.scratch[:0]  # the scratch's view of the last piece read

    def read(self, lo: int, hi: int) -> np.ndarray:
        at = self._read_at
        if at[0] != lo or at[1] != hi:
            at = self._aim(self.reads, self.scratch_at, lo, hi)
            self._read_at, self._piece = at, self.scratch[: hi - lo]
        got = self.reads.call()
        if got != at[2]:
            raise self._failure("read", self.reads.failure(got, at[2]))
        return self._piece

    def write(self, mine: np.ndarray, lo: int, hi: int) -> None:
        at = self._write_at
        if at[0] != lo or at[1] != hi:
            at = self._write_at = self._aim(self.writes, self.here + lo * self.itemsize, lo, hi)
        got = self.writes.call()
        if got != at[2]:
            raise self._failure("write", self.writes.failure(got, at[2]))

    def _aim(self, transfer: cma.Transfer, here: int, lo: int, hi: int) -> tuple[int, int, int]:
        nbytes = (hi - lo) * self.itemsize
        transfer.aim(here, self.address + lo * self.itemsize, nbytes)
        return lo, hi, nbytes

    def _failure(self, what: str, err: OSError) -> PeerFailure:
        why = "its process is gone" if err.errno == errno.ESRCH else (err.strerror or str(err))
        return PeerFailure(f"rank {self.rank}: could not {what} its buffer ({why})", self.rank, self.host)


def _address(array: np.ndarray) -> int:
    """Where writable, C-contiguous, non-empty ``array`` starts: 0.45 us, where ``__array_interface__``
    builds a dict for 2.6 (a 1 MiB allreduce asks once a call)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(array))


class SharedWord:
    """A peer's word in its mailbox, read with a load: the direct route reads each peer's
    before every call, where a read through the kernel (:class:`ringcore.transport.cma.Word`)
    cost 4 us a peer at N=4.

    A word in shared memory outlives its process, so whether the owner is still alive
    (a rank that gave up waits only for live writers) is asked through the kernel.
    """

    __slots__ = ("probe", "view")

    def __init__(self, view: memoryview, probe: cma.Word) -> None:
        self.view, self.probe = view, probe

    def read(self) -> int:
        return int(self.view[0])

    def alive(self) -> bool:
        return self.probe.alive()


class Voting:
    """One context's means for the voting route, made in the first call's turn."""

    def __init__(self, ctx: Context, transport: ShmTransport) -> None:
        self.ctx, self.rank, self.size = ctx, ctx.rank, ctx.size
        self.pids = dict(transport.peer_pids)
        self.hosts = {peer: transport.peer_name(peer) for peer in self.pids}
        self.copyable = transport.copyable
        probes = {peer: cma.Word(self.pids[peer], address) for peer, address in transport.peer_words.items()}
        mailbox = self.mailbox = transport.mailbox
        self.word: Any  # [0]: this rank's word
        self.words: dict[int, SharedWord | cma.Word]
        self.shared: list[tuple[int, memoryview]] = []  # (peer, its word) where they lie in the mailboxes
        self.posted: list[list[memoryview]] = []  # per mailbox slot, every rank's row there
        if mailbox is not None:  # the words in the mailboxes (agreed at set-up): a load each
            self.word = mailbox.words[self.rank]
            self.words = {peer: SharedWord(mailbox.words[peer], probe) for peer, probe in probes.items()}
            self.shared = [(peer, mailbox.words[peer]) for peer in probes]
            # each slot's rows, every rank's, as int64 memoryviews: stores and a tolist, no numpy calls
            self.posted = [
                [memoryview(mailbox.payload(rank, slot)[:ROW_BYTES]).cast("q") for rank in range(self.size)]
                for slot in (0, 1)
            ]
        else:  # each in its rank's memory: a system call each
            self.word, self.words = transport.word, dict(probes)
        self.calls = 0  # calls that went direct on this context, every plan's (one-call plans' too)
        self.scratch = np.empty(direct.PIECE_BYTES, np.uint8)
        count = self.size * FIELDS
        schedule = recursive_doubling.allreduce(self.rank, self.size, count, 8, ctx.settings.segment_size())
        views = {buf: np.empty(count, np.int64) for buf in (*schedule.scratch, Buf.WORK)}
        program = compile_program(schedule, transport)
        if not schedule.prefill_work or not lockstep.fits(schedule, transport, views):
            raise RuntimeError("the direct route's vote does not run in lockstep")  # never at any size
        self.rows, self.early = views[Buf.WORK], program.early
        self.steps = lockstep.bind(program, views)
        self.summer = ctx.reducer(DTYPES["int64"], ReduceOp.SUM, Compression.NONE)

    def vote(self, row: list[int], seq: int, signature: int) -> list[list[int]]:
        """Every rank's row, in rank order: posted in the mailboxes where the ranks have them, else
        a sum of rows that are zero but for each rank's own."""
        mailbox = self.mailbox
        if mailbox is not None:
            posted = self.posted[mailbox.slot]
            mine = posted[self.rank]
            mine[0], mine[1], mine[2], mine[3] = row
            oneshot.meet(self.ctx, self.ctx.transport, seq, signature, oneshot.POSTED, ROW_BYTES)  # type: ignore[arg-type]
            return [rows.tolist() for rows in posted]
        rows = self.rows
        rows[:] = 0
        rows[self.rank * FIELDS : (self.rank + 1) * FIELDS] = row
        run_steps(self.ctx, self.steps, self.early, self.summer, seq, signature, VOTE_PART)
        return rows.reshape(self.size, FIELDS).tolist()  # type: ignore[no-any-return]

    def gave_up(self, seq: int) -> int | None:
        """A peer that gave up on ``seq`` (or, words read through the kernel, whose process is gone):
        nothing may be written (module docstring)."""
        shared = self.shared
        if shared:  # the words in the mailboxes: a load each
            for peer, view in shared:
                if view[0] == -seq:
                    return peer
            return None
        for peer, word in self.words.items():
            value = word.read()
            if value is None or value == -seq:  # a gone pid may name another process by now
                return peer
        return None

    def grace(self) -> float:
        """Seconds a rank that gave up waits for peers still writing into its buffer."""
        return min(WRITER_GRACE, self.ctx.settings.timeout)

    def quiesce(self, seq: int) -> list[int]:
        """Say this rank gave up on ``seq``; wait for peers not done with it; those that did not finish."""
        self.word[0] = -seq
        shm_ring.fence()  # the word stored before the peers' are read
        deadline = time.perf_counter() + self.grace()
        writing = list(self.words)
        while writing:
            words = self.words
            writing = [peer for peer in writing if words[peer].read() == seq and words[peer].alive()]
            if not writing or time.perf_counter() > deadline:
                break
            time.sleep(0.001)
        return writing


class DirectRoute:
    """One plan's direct route (module docstring); ``run(obj, seq)`` False: the plan's form runs instead."""

    name = "direct"

    def __init__(self, plan: RoutedPlan, below: OneShotRoute | None = None) -> None:
        self.plan, self.ctx = plan, plan.ctx
        self.below = below  # where this call's memory is not symmetric, below RINGCORE_DIRECT_BYTES
        self.direct_from = direct_from(plan.ctx)
        self.calls = 0
        self._copyable = -1  # the address of this plan's last buffer found copyable
        self._share: tuple[int, int] | None = None  # this rank's [lo, hi) of the plan's elements
        # The last vote whose peers were remote: its rows, and the peers they give (making them
        # cost 4 us a peer, a twentieth of a 1 MiB allreduce at N=4). Kept while every rank passes
        # the same memory (a training loop).
        self._voted: tuple[list[list[int]], list[direct.Peer]] = ([], [])
        self._reducer: Any = None

    def run(self, obj: Any, seq: int) -> bool:
        ctx, plan = self.ctx, self.plan
        voting = ctx.direct_voting
        if voting is None:
            transport = ctx.transport
            if isinstance(transport, ShmTransport) and transport.copies_everywhere:
                # made in the turn, as everything that touches the transport
                voting = ctx.direct_voting = Voting(ctx, transport)
        if voting is not None and plan.nbytes >= self.direct_from:
            if plan.signature in ctx.declined:  # every rank offered nothing before (GPU or pinned memory)
                return False
            try:
                flat = host_array(plan, obj)
                row = self._offer(flat, voting)
            except BaseException as err:  # the peers are in the vote already: tell them
                ctx.fail(Descriptor("allreduce", seq, *plan.fields), err)
            return self._run(
                flat, seq, plan.signature, DONE_PART, (), voting, self._vote, flat, row, voting, seq
            )
        symmetric = ctx.symmetric  # symmetric memory only: the descriptor names it
        found = symmetric.locate(obj) if plan.buffer is None and symmetric is not None else None
        if found is None:
            return self.below is not None and self.below.run(obj, seq)
        allocation, offset = found
        flat = storage_view(obj, plan.dtype)
        label = (allocation.label(offset),)
        signature = Descriptor("allreduce", seq, *plan.fields, *label).signature()
        return self._run(
            flat, seq, signature, 1, label, voting, self._meet, flat, allocation, offset, seq, signature
        )

    def _vote(
        self, flat: np.ndarray | None, row: list[int], voting: Voting, seq: int
    ) -> tuple[int, list[direct.Peer]]:
        """The first synchronisation where ranks may copy from each other: every rank's row, the way
        they agree on and the peers' buffers that way."""
        rows = voting.vote(row, seq, self.plan.signature)
        voted = self._voted
        if rows == voted[0]:  # every rank passed the memory of the last remote call
            return REMOTE, voted[1]
        way = _agreed(rows)
        if way == NONE:
            if all(row[0] == NONE for row in rows):
                oneshot.decline(self.ctx, self.plan.signature)  # the ring from now on, with no vote first
            return NONE, []
        assert flat is not None
        return way, self._peers(flat, rows, way, voting)

    def _meet(
        self, flat: np.ndarray, allocation: Any, offset: int, seq: int, signature: int
    ) -> tuple[int, list[direct.Peer]]:
        """The first synchronisation where only symmetric memory goes direct (the descriptor names it)."""
        synchronise(self.ctx, seq, signature, 0)
        return MAPPED, [direct.Mapped(view) for view in allocation.peers(offset, self.plan.count, flat.dtype)]

    def _run(
        self,
        flat: np.ndarray | None,
        seq: int,
        signature: int,
        last_part: int,
        label: tuple[str, ...],
        voting: Voting | None,
        agree: Callable[..., tuple[int, list[direct.Peer]]],
        *how: Any,
    ) -> bool:
        """Agree (``agree(*how)``: the first synchronisation), reduce and push, synchronise; False where
        the way is NONE. ``label``: the memory the descriptor names, if any."""
        ctx, plan = self.ctx, self.plan
        if voting is not None:
            voting.word[0] = seq
            shm_ring.fence()  # the word stored before this rank sends, so before any peer reads ours
        try:
            try:
                way, peers = agree(*how)  # every input is in place
                if way == NONE:
                    if voting is not None:
                        voting.word[0] = 0
                    return False
                assert flat is not None
                self.calls += 1
                if voting is not None:
                    voting.calls += 1
                gone = voting.gave_up(seq) if voting is not None else None
                if gone is None:
                    share, reducer = self._share, self._reducer
                    if share is None:  # the first call: both made, then kept together
                        reducer = plan_reducer(plan)
                        share = direct.shares(plan.count, ctx.size, flat.itemsize)[ctx.rank]
                        self._share, self._reducer = share, reducer
                    direct.reduce_and_push(flat, peers, share[0], share[1], reducer)
                if voting is not None:
                    voting.word[0] = 0
                synchronise(ctx, seq, signature, last_part)  # every share is in every buffer
                if gone is not None:  # its ABORT, with the reason, normally fails the barrier first
                    raise PeerFailure(
                        f"rank {gone} gave up on this allreduce before this rank wrote to it", gone
                    )
            except BaseException as err:
                ctx.fail(Descriptor("allreduce", seq, *plan.fields, *label), err)
        except BaseException as err:
            stuck = voting.quiesce(seq) if voting is not None else []
            note_failure(err, 0, plan.count, plan.count)  # a peer past the first sync may write any share
            for peer in stuck:
                err.add_note(
                    f"rank {peer} had not finished writing into this rank's buffer {voting.grace():g} s "  # type: ignore[union-attr]
                    "after this rank gave up (stopped?): the buffer may still change; do not reuse it"
                )
            raise
        return True

    def _offer(self, flat: np.ndarray | None, voting: Voting) -> list[int]:
        if flat is None or not flat.flags.c_contiguous:
            return [NONE, 0, 0, 0]
        address = _address(flat)
        if address != self._copyable:  # this plan's last buffer the kernel could copy: asked once
            if not voting.copyable(memoryview(flat)):
                return [NONE, 0, 0, 0]
            self._copyable = address
        symmetric = self.ctx.symmetric
        found = symmetric.locate(flat) if symmetric is not None else None
        if found is not None:
            return [MAPPED, address, found[0].serial, found[1]]
        return [REMOTE, address, 0, 0]

    def _peers(self, flat: np.ndarray, rows: list[list[int]], way: int, voting: Voting) -> list[direct.Peer]:
        """The peers' buffers in ring order after this rank, mapped or remote (the remote ones recorded
        in ``_voted`` with the rows that gave them, for :meth:`_vote` to reuse)."""
        rank, size, plan = self.ctx.rank, self.ctx.size, self.plan
        if way == MAPPED:
            found = self.ctx.symmetric.locate(flat)  # type: ignore[union-attr]
            assert found is not None
            return [direct.Mapped(view) for view in found[0].peers(found[1], plan.count, flat.dtype)]
        order = [(rank + step) % size for step in range(1, size)]
        scratch, pids, hosts = voting.scratch, voting.pids, voting.hosts
        peers: list[direct.Peer] = [
            Remote(peer, pids[peer], rows[peer][1], flat, scratch, hosts[peer]) for peer in order
        ]
        self._voted = (rows, peers)
        return peers


def _agreed(rows: list[list[int]]) -> int:
    """The way every rank can take: mapped at one allocation and offset, else remote, else none."""
    way = min([row[0] for row in rows])
    if way == MAPPED and len({(row[2], row[3]) for row in rows}) > 1:
        return REMOTE
    return way


def slow_copies(ctx: Context) -> bool:
    """Whether the kernel's copies are slow next to ``memmove`` on this host (agreed at set-up)."""
    return getattr(ctx.transport, "slow_kernel_copies", False)


def direct_from(ctx: Context) -> int:
    """Bytes from which ordinary buffers of ``ctx``'s allreduces go direct (``Settings.direct_from``)."""
    return ctx.settings.direct_from(ctx.size, slow_copies(ctx))


def route_for(plan: RoutedPlan) -> DirectRoute | OneShotRoute | None:
    """The plan's route chosen per call where its conditions hold, alike on every rank; None: its form alone.

    Where every rank mapped every mailbox, at most ``RINGCORE_SMALL_BYTES``: the
    one-shot route; above it and below ``RINGCORE_DIRECT_BYTES`` (``Settings.mailboxes_below``;
    1 MiB at least where ordinary buffers cannot go direct) and the mailbox's slot:
    the two-shot route, one shot again at N=2 (both :mod:`ringcore.plans.oneshot`); from three
    ranks without ``RINGCORE_ATOMIC`` an input longer than the slot goes two-shot in pieces.
    Above the small limit, where every rank is on this host and ``RINGCORE_ATOMIC=0``:
    :class:`DirectRoute` (module docstring), with that route below it for memory
    that is not symmetric.
    """
    ctx, settings = plan.ctx, plan.ctx.settings
    transport = ctx.transport
    if ctx.size < 2 or transport is None or not direct_from(ctx) or plan.compression is not Compression.NONE:
        return None
    mailbox = getattr(transport, "mailbox", None)
    boxed = mailbox is not None and plan.nbytes <= mailbox.slot_bytes
    if plan.nbytes <= settings.small_bytes:
        return OneShotRoute(plan, transport) if boxed else None  # type: ignore[arg-type]
    symmetric = ctx.symmetric
    mapped = not settings.atomic and symmetric is not None and symmetric.shared  # every rank on this host
    # Where ordinary buffers cannot go direct (RINGCORE_ATOMIC=1, ranks that may not copy from each
    # other), the mailboxes take them up to 1 MiB at any N. All of it agreed at set-up.
    remote = mapped and getattr(transport, "copies_everywhere", False)
    staged = None
    below = settings.mailboxes_below(ctx.size, slow_copies(ctx))
    # two shots take an input longer than a slot in pieces, where the buffer may change piece by piece
    pieces = mailbox is not None and ctx.size > 2 and not settings.atomic
    if (boxed or pieces) and plan.nbytes < (below if remote else max(below, AUTO_DIRECT_BYTES)):
        # two ranks: one shot's one add beats a second wait
        staged = (OneShotRoute if ctx.size == 2 else TwoShotRoute)(plan, transport)  # type: ignore[arg-type]
    return DirectRoute(plan, staged) if mapped else staged
