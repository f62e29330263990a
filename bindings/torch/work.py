"""The Work of the "ringcore" torch.distributed backend: one collective's ``wait()`` and future.

Work and errors. A failure between ranks (``PeerFailure``, ``CollectiveTimeout``,
``MismatchError``, ``CommunicatorClosed``) is raised by ``work.wait()`` (so by
every blocking call) with its own type. ``work.get_future()`` fails with a
``RuntimeError`` carrying the same message: DDP raises that from
``backward()``, and the error itself from the collectives it waits for in ``forward()``.
``wait(timeout)`` raises ``TimeoutError`` when the collective is
not done in time (it goes on; ``RINGCORE_TIMEOUT`` bounds it). Work objects
subclass ``torch.distributed.Work`` rather than wrapping a future with
``_create_work_from_future``, whose ``wait()`` returns True even when the
future failed.

Futures. A future's ``then`` callbacks run where it completes, and torch's
own hooks wait inside them for further collectives (``powerSGD_hook``). Those
run one after the other on ringcore's async thread, so futures are completed
on threads of their own (a pool that grows to ``COMPLETION_THREADS`` as
callbacks block): a callback may wait for a collective issued after it, and
``wait()`` itself returns as soon as the collective is done. A collective a
callback starts takes its place among the program's when the callback runs,
as on gloo, whose futures complete on its worker threads too: where several
callbacks start collectives at once, ranks may start them in different orders
(a ``MismatchError``, or, where the shapes agree, sums of the wrong tensors).
One chain of callbacks at a time is safe.

The process group that hands them out is :mod:`ringcore.torch.process_group`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ringcore.comm import Handle

__all__ = ["RingcoreWork"]

COMPLETION_THREADS = 64  # callbacks blocked at once before a later future's completion must wait for one
_completions: ThreadPoolExecutor | None = None  # made on first use: threads only as callbacks need them
_completions_lock = threading.Lock()


def _complete(future: torch.futures.Future[None]) -> None:
    """``future.set_result(None)`` on a completion thread, which runs its callbacks there."""
    global _completions
    if _completions is None:
        with _completions_lock:
            if _completions is None:
                _completions = ThreadPoolExecutor(COMPLETION_THREADS, thread_name_prefix="ringcore-future")
    try:
        _completions.submit(future.set_result, None)
    except RuntimeError:  # the interpreter is exiting (no new threads): run the callbacks here
        future.set_result(None)


class RingcoreWork(dist.Work):
    """The Work of one collective: ``wait()``, ``get_future()``, done once ringcore finishes it.

    Args:
        call: the collective, for messages (``"all_reduce"``).
        value: what the future yields on success (torch's convention: the output tensors).
    """

    def __init__(self, call: str, value: Any) -> None:
        super().__init__()
        self._call, self._value = call, value
        self._event = threading.Event()
        self._error: BaseException | None = None
        self._trigger: torch.futures.Future[None] = torch.futures.Future()
        # A ``then`` callback that raises is the only way Python can fail a future
        # for C++ readers (DDP); ``Future.set_exception`` stores a value.
        self._future = self._trigger.then(self._outcome)

    def finish(self, error: BaseException | None = None, after: Callable[[], None] | None = None) -> None:
        """Mark the collective done; run ``after`` (e.g. copy results out) first when it succeeded."""
        if error is None and after is not None:
            try:
                after()
            except Exception as err:
                error = err
        self._error = error
        self._event.set()
        _complete(self._trigger)  # off ringcore's async thread: callbacks may wait for collectives

    def follow(self, handle: Handle, after: Callable[[], None] | None = None) -> RingcoreWork:
        """Finish when ringcore's ``handle`` does (on ringcore's async thread); returns self."""
        handle.add_done_callback(lambda done: self.finish(done.exception(), after))
        return self

    def _outcome(self, _: torch.futures.Future[None]) -> Any:
        if self._error is not None:
            raise self._error
        return self._value

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until done; raise the collective's error (``PeerFailure``...) if it failed.

        Raises:
            TimeoutError: not done within ``timeout`` (zero or None: no limit); the collective goes on.
        """
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        if not self._event.wait(seconds or None):
            raise TimeoutError(f"ringcore backend: {self._call} not finished after {seconds:g} s")
        if self._error is not None:
            raise self._error
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        """A future of the output tensors; it fails (``RuntimeError``, same message) when the collective does."""
        return self._future

    def is_completed(self) -> bool:
        return self._event.is_set()

    def is_success(self) -> bool:
        return self._event.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> Any:
        self.wait()
        return self._value
