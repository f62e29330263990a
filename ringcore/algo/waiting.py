"""The one wait loop of every executor: move the transport, and decide when a collective has failed.

Each executor (pipelined, lockstep, staged) calls :meth:`Watch.progress`
whenever it has nothing left to post. The rules, once for all of them:

- progress: ``transport.progress(wait)`` moves every posted frame both ways;
  a call that moved something, or an executor that did some work of its own
  (``busy``), resets the clock;
- timeout: nothing moved for ``timeout`` seconds raises
  :class:`~ringcore.errors.CollectiveTimeout`, naming what the run waits for;
- overslept: a rank that could not run for longer than ``timeout`` (stopped,
  starved) and then finds a peer gone raises the timeout, not the
  ``PeerFailure``: its peers timed out on it and closed, so the peer whose
  connection is gone is not the cause;
- stall: ``interrupt`` (the stall inspector's, ``RINGCORE_STALL_SHUTDOWN``) is
  polled while idle; a message it returns fails the run with that message;
- a peer's ABORT carries what this rank itself was waiting for, and for how
  long (``PeerAborted.waiting``): when a peer gives up on a chain of waits
  (rank 0 on rank 2, which waits on a stopped rank 1), rank 2's error then
  names rank 1 too.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NoReturn

from ringcore.errors import CollectiveTimeout, PeerFailure
from ringcore.transport.base import PeerAborted, Transport


class Watch:
    """The clock of one collective's run (see the module docstring).

    Args:
        transport: the connections to move.
        timeout: seconds without progress before the run fails.
        interrupt: polled while idle; a message fails the run.
        pending: what the run waits for, for the timeout's message.
    """

    __slots__ = ("interrupt", "last_moved", "pending", "timeout", "transport")

    def __init__(
        self,
        transport: Transport,
        timeout: float,
        interrupt: Callable[[], str | None] | None,
        pending: Callable[[], str],
    ) -> None:
        self.transport = transport
        self.timeout = timeout
        self.interrupt = interrupt
        self.pending = pending
        self.last_moved = time.monotonic()

    def progress(self, wait: float, busy: bool = False) -> bool:
        """Move the transport for up to ``wait`` s; whether it moved anything.

        Raises:
            CollectiveTimeout: no progress for ``timeout`` s, a rank that overslept, or a stall.
            PeerFailure: a peer died while this rank was running.
        """
        try:
            moved = self.transport.progress(wait)
        except PeerFailure as err:
            self.fail(err)
        except PeerAborted as err:
            err.waiting = f"{self.pending()} for {time.monotonic() - self.last_moved:.1f} s"
            raise
        if busy or moved:
            self.last_moved = time.monotonic()
        elif time.monotonic() - self.last_moved > self.timeout:
            raise CollectiveTimeout(f"no progress for {self.timeout:g} s: {self.pending()}")
        elif self.interrupt is not None and (reason := self.interrupt()):
            raise CollectiveTimeout(reason)
        return moved

    def fail(self, err: PeerFailure) -> NoReturn:
        """Raise ``err``, seen while posting or progressing, or the timeout if this rank overslept."""
        late = overslept(err, self.last_moved, self.timeout)
        if late is not None:
            raise late from err
        raise err


def overslept(err: PeerFailure, last_moved: float, timeout: float) -> CollectiveTimeout | None:
    """The timeout to raise instead of ``err``, if this rank had not moved since ``last_moved`` for too long.

    None: ``err`` stands (the peer failed while this rank was running).
    """
    idle = time.monotonic() - last_moved
    if idle <= timeout:
        return None
    return CollectiveTimeout(
        f"no progress for {timeout:g} s: this rank did not run for {idle:.1f} s (stopped or starved),"
        f" so its peers gave up on it; then {err}"
    )
