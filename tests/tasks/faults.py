"""Fault injection from inside a rank: SIGKILL, SIGSTOP or cut links, at a chosen send or segment.

:class:`SendTrigger` counts a transport's sends and acts before a chosen one;
:func:`_hook_phase` acts at a chosen segment of a step phase; :func:`_inject` is
the fault itself, stamped with the wall-clock time for the test. Nothing here
runs a collective: the tasks in ``failures`` and ``lifecycle`` do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


def _stamp(path: str) -> None:
    """Write the wall-clock time of an injected fault to ``path`` (atomically, so a reader never sees half)."""
    import os
    import time

    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as out:
        out.write(repr(time.time()))
    os.replace(tmp, path)


def _inject(comm: Any, fault: str, stamp: str) -> None:
    """Do ``fault`` to this rank now, from inside its own process.

    ``kill9``: SIGKILL itself. ``sigstop``: SIGSTOP itself (the test sends
    SIGCONT later). ``cut_all``: this rank loses its network (shut down every
    data socket). ``cut_one``: only the link to the right ring neighbour is cut.
    """
    import os
    import signal
    import socket

    _stamp(stamp)
    if fault == "kill9":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault == "sigstop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif fault in ("cut_all", "cut_one"):
        right = (comm.rank + 1) % comm.size
        for (peer, _channel), conn in comm.transport.conns.items():
            if fault == "cut_all" or peer == right:
                conn.sock.shutdown(socket.SHUT_RDWR)
    else:
        raise ValueError(fault)


def _hook_phase(comm: Any, fault: str, phase: str, after: int, stamp: str) -> Any:
    """Wrap ``Executor._combine`` (once per received segment) to inject ``fault`` at the
    ``after``-th segment received in a step labelled ``phase``; returns an undo function."""
    from ringcore.algo import execute

    original = execute.Executor._combine
    seen = [0]

    def combine(self: Any, item: Any, recv_key: Any) -> bool:
        if seen[0] < after and self.steps[item[0]].label == phase:
            seen[0] += 1
            if seen[0] == after:
                _inject(comm, fault, stamp)
        return original(self, item, recv_key)

    execute.Executor._combine = combine

    def undo() -> None:
        execute.Executor._combine = original

    return undo


class SendTrigger:
    """Counts the sends this rank's transport posts and runs an action just before a chosen one.

    Every executor (the pipelined one, the latency path, the staged GPU one)
    posts its sends through the transport's ``isend``, or ``swap`` on the
    latency path, and the one-shot route its input through shared memory's
    ``meet_posts``; wrapping those calls on the instance locates a point
    inside any collective without reaching into an executor. ``arm(at,
    action)`` runs ``action`` before the ``at``-th send from then on;
    ``remove()`` restores the transport.
    """

    def __init__(self, transport: Any) -> None:
        self.transport = transport
        self.posted = 0
        self.fire_at = 0
        self.action: Any = None
        isend, swap = transport.isend, getattr(transport, "swap", None)

        def counted_isend(*args: Any) -> Any:
            self._count()
            return isend(*args)

        def counted_swap(send: Any, *rest: Any) -> Any:
            if send is not None:
                self._count()
            return swap(send, *rest)  # type: ignore[misc]

        def counted_post(*args: Any) -> Any:
            self._count()
            return post(*args)

        transport.isend = counted_isend
        self.patched = ["isend"]
        if swap is not None:
            transport.swap = counted_swap
            self.patched.append("swap")
        post = getattr(transport, "meet_posts", None) if getattr(transport, "mailbox", None) else None
        if post is not None:
            transport.meet_posts = counted_post
            self.patched.append("meet_posts")

    def _count(self) -> None:
        self.posted += 1
        if self.action is not None and self.posted == self.fire_at:
            action, self.action = self.action, None
            action()

    def arm(self, at: int, action: Any) -> None:
        self.posted, self.fire_at, self.action = 0, at, action

    def remove(self) -> None:
        for name in self.patched:
            self.transport.__dict__.pop(name, None)


@contextlib.contextmanager
def fault_in_round_one(comm: Any, fault: tuple[int, str, str, float] | None) -> Iterator[Any]:
    """Yield ``next_round(i)``, to call before each round; with ``fault = (victim, kind, stamp, fraction)``
    the victim injects ``kind`` inside round 1, at the send ``fraction`` of the way through the sends
    it posted in round 0 (which every rank completes)."""
    if fault is None or comm.rank != fault[0]:
        yield lambda round_: None
        return
    _, kind, stamp, fraction = fault
    trigger = SendTrigger(comm.transport)
    trigger.arm(0, None)

    def next_round(round_: int) -> None:
        if round_ == 1:
            trigger.arm(max(1, round(fraction * trigger.posted)), lambda: _inject(comm, kind, stamp))

    try:
        yield next_round
    finally:
        trigger.remove()
