"""Tasks on the direct allreduce of ordinary buffers (``ringcore.plans.direct``): routes, faults, late writers."""

from __future__ import annotations

import array
import os
import signal
import time
from typing import Any

import numpy as np


def can_copy(comm: Any) -> bool:
    """Whether every rank of this job may copy to and from every other (the direct route's condition)."""
    return bool(getattr(comm.ctx.transport, "copies_everywhere", False))


def kernel_copies(comm: Any) -> dict[str, Any]:
    """Whether this rank's transport found the kernel's copies slow, and the direct route's limit then."""
    from ringcore.plans.direct import direct_from

    return {
        "slow": bool(getattr(comm.ctx.transport, "slow_kernel_copies", False)),
        "speeds": list(getattr(comm.ctx.transport, "kernel_copy_speeds", [])),
        "direct_from": direct_from(comm.ctx),
    }


def allreduce_routed(comm: Any, inputs: list[np.ndarray], op: str, kind: str = "numpy") -> dict[str, Any]:
    """Allreduce this rank's input as a numpy array (a kept plan) or an ``array.array`` (a one-call plan).

    Returns the result, how many calls went direct after a vote (every plan's, one-call ones too),
    whether this communicator ever voted on the direct route, and how many inputs this rank posted
    in its mailbox (the one-shot route, ``ringcore.plans.oneshot``).
    """
    x = inputs[comm.rank]
    voting = comm.ctx.direct_voting
    before = voting.calls if voting is not None else 0
    mailbox = getattr(comm.ctx.transport, "mailbox", None)
    posts = mailbox.posts if mailbox is not None else 0
    if kind == "numpy":
        buf = x.copy()
        comm.allreduce(buf, op=op)
        result = buf
    else:
        typecode = {"float32": "f", "float64": "d", "int32": "i", "int64": "q", "uint16": "H"}[x.dtype.name]
        buf = array.array(typecode, x.tobytes())
        comm.allreduce(buf, op=op)
        result = np.frombuffer(buf, x.dtype).copy()
    voting = comm.ctx.direct_voting
    return {
        "result": result,
        "direct": (voting.calls if voting is not None else 0) - before,
        "voted": voting is not None,
        "posted": (mailbox.posts if mailbox is not None else 0) - posts,
    }


def late_writer(comm: Any, count: int, mode: str) -> dict[str, Any]:
    """Three ranks; rank 1 dies inside the second direct allreduce, and rank 2 is late for rank 0.

    Rank 1 kills itself 0.3 s into its first push (rank 2 has read its first piece by then). Rank 2
    waits until rank 0's word says it gave up (on rank 1's death), then:

    - ``write``: from inside its first push, 0.5 s later, still writes its piece into rank 0,
      then fails on rank 1. Rank 0 must not return before that write.
    - ``refuse``: before pushing at all: it finds that rank 0 gave up and writes nothing.

    Returns the error, its notes, whether this rank's buffer stayed as it was when the error
    reached it for the next 1.5 s, and (rank 2) whether it saw rank 0 give up before going on.
    """
    from ringcore.algo import direct
    from ringcore.plans import direct as route

    buf = np.empty(count, np.float64)
    buf[...] = comm.rank + 1
    comm.allreduce(buf)
    assert np.all(buf == comm.size * (comm.size + 1) / 2)
    buf[...] = comm.rank + 1
    voting = comm.ctx.direct_voting
    report: dict[str, Any] = {"error": "no error", "message": "", "notes": [], "saw rank 0 give up": False}

    def until_rank_0_gave_up() -> None:
        seq = int(voting.word[0])  # this rank's collective: it is writing
        deadline = time.monotonic() + 20
        while voting.words[0].read() != -seq and time.monotonic() < deadline:
            time.sleep(0.001)
        report["saw rank 0 give up"] = voting.words[0].read() == -seq

    real_push, real_gave_up, calls = direct.push_share, route.Voting.gave_up, [0]

    def push(mine: np.ndarray, peers: list[Any], lo: int, hi: int) -> None:
        calls[0] += 1
        if calls[0] == 1 and comm.rank == 1:
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGKILL)
        if calls[0] == 1 and comm.rank == 2 and mode == "write":
            until_rank_0_gave_up()
            time.sleep(0.5)  # long after: without the wait rank 0 would have returned and looked
        real_push(mine, peers, lo, hi)

    def gave_up(self: Any, seq: int) -> int | None:
        if comm.rank == 2 and mode == "refuse":
            until_rank_0_gave_up()
        return real_gave_up(self, seq)  # type: ignore[no-any-return]

    direct.push_share = push
    route.Voting.gave_up = gave_up  # type: ignore[method-assign]
    try:
        comm.allreduce(buf)
    except Exception as err:
        report["error"], report["message"] = type(err).__name__, str(err)
        report["notes"] = list(getattr(err, "__notes__", []))
    finally:
        direct.push_share, route.Voting.gave_up = real_push, real_gave_up  # type: ignore[method-assign]
    seen = buf.copy()
    time.sleep(1.5)
    report["stable"] = bool(np.array_equal(seen, buf))
    return report


def allreduce_of_rank_counts(comm: Any, counts: list[int]) -> dict[str, Any]:
    """Allreduce ``counts[rank]`` float32 elements on each rank (a mismatch where they differ).

    Returns the error's type and message, and whether the buffer stayed as it was.
    """
    import ringcore

    x = np.arange(counts[comm.rank], dtype=np.float32)
    before = x.copy()
    try:
        comm.allreduce(x)
    except ringcore.RingcoreError as err:
        return {"error": type(err).__name__, "message": str(err), "untouched": bool((x == before).all())}
    return {"error": "no error", "message": "", "untouched": bool((x == before).all())}


def allreduce_switching_buffers(comm: Any, count: int, switches: list[int]) -> dict[str, Any]:
    """Allreduce two kept float32 arrays of ``count`` elements, one layout, in the order ``switches[rank]``
    gives (0: the first array, 1: the second): ranks change memory at calls of their own.

    Returns each call's result and how many calls went direct.
    """
    arrays = [np.empty(count, np.float32), np.empty(count, np.float32)]
    voting = comm.ctx.direct_voting
    before = voting.calls if voting is not None else 0
    results = []
    for call, which in enumerate(switches[comm.rank]):
        buf = arrays[which]
        buf[...] = np.arange(count, dtype=np.float32) * (comm.rank + 1) + call
        comm.allreduce(buf)
        results.append(buf.copy())
    voting = comm.ctx.direct_voting
    return {"results": results, "direct": (voting.calls if voting is not None else 0) - before}


def allreduce_reduced_by(comm: Any, inputs: list[np.ndarray], op: str) -> dict[str, Any]:
    """``allreduce_routed`` of a numpy array, and whether this rank published the result for every
    rank (one reducer, ``ringcore.plans.oneshot``): its header's result word names the collective."""
    from ringcore.transport.shm_mailbox import RESULT

    mailbox = comm.ctx.transport.mailbox
    slot = mailbox.slot
    report = allreduce_routed(comm, inputs, op)
    report["published"] = mailbox.header(comm.rank, slot)[RESULT] == comm.progress.seq
    report["one_reducer"] = comm.ctx.transport.one_reducer
    return report


def mailbox_posts(comm: Any) -> int:
    """How many posts this rank made in its mailbox (the one-shot route's and the direct route's)."""
    return int(comm.ctx.transport.mailbox.posts)


def posted_collectives(comm: Any, calls: list[tuple[str, Any]]) -> dict[str, Any]:
    """Run ``calls`` (``("broadcast", (inputs, root))``, ``("allgather", inputs)``,
    ``("reduce_scatter", (inputs, op))``: one input per rank) in order; each result, and how
    many posts this rank made in its mailbox per call (0 without mailboxes)."""
    mailbox = getattr(comm.ctx.transport, "mailbox", None)
    results, posts = [], []
    for kind, args in calls:
        before = mailbox.posts if mailbox is not None else 0
        if kind == "broadcast":
            inputs, root = args
            buf = inputs[comm.rank].copy()
            results.append(comm.broadcast(buf, root=root).copy())
        elif kind == "allgather":
            results.append(comm.allgather(args[comm.rank]))
        else:
            inputs, op = args
            results.append(comm.reduce_scatter(inputs[comm.rank], op=op))
        posts.append((mailbox.posts if mailbox is not None else 0) - before)
    return {"results": results, "posts": posts}
