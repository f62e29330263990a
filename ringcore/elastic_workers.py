"""What the elastic driver works with: its options, its record of each worker, and the pool that runs them.

The driver (:mod:`ringcore.elastic_driver`) starts, watches and stops
workers through a :class:`Pool`: ``ringcore-run``'s is its
:class:`~ringcore.processes.Job` (processes, signals, exit codes);
``ringcore.ray``'s elastic executor passes Ray actors and a ``room``
callable (how many more workers Ray can place now), which, like a discovery
script, makes the driver replace lost workers.

Each worker the driver started has a :class:`Worker` record: where it runs,
when it started, whether it was ever a member of a generation, and its
check-ins (``ready``) against the driver's answers (``answered``): a worker
waits while it has a check-in the driver has not answered. A worker that
failed becomes a :class:`Failure`, so the driver can name the first one when
the job ends.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol

from ringcore import hosts


@dataclasses.dataclass(frozen=True)
class ElasticOptions:
    """The elastic part of ``ringcore-run``'s command line.

    Attributes:
        min_np: Fewest workers the job runs with (``--min-np``).
        max_np: Most workers at once (``--max-np``); ``None``: as many as the hosts have slots.
        discovery: ``--host-discovery-script``: a shell command printing ``host:slots`` lines.
        timeout: ``--elastic-timeout``: seconds of every bound the driver keeps (:mod:`ringcore.elastic_driver`).
        cooldown: ``--failure-cooldown``: seconds a host gets no new worker after one failed there.
    """

    min_np: int
    max_np: int | None
    discovery: str | None = None
    timeout: float = 60.0
    cooldown: float = 10.0


@dataclasses.dataclass
class Worker:
    """One worker process, as the driver sees it.

    Attributes:
        seat: Its host and slot there (``seat.rank`` is the worker's number).
        started: When it was started (``time.monotonic()``).
        joined: Whether it was ever a member of a generation.
        ready: Its last check-in's number (0: none yet); it waits while ``ready > answered``.
        answered: The last check-in the driver answered.
        kill_at: Set once the driver stopped it: when SIGKILL follows SIGTERM.
    """

    seat: hosts.Slot
    started: float
    joined: bool = False
    ready: int = 0
    answered: int = 0
    kill_at: float | None = None

    @property
    def waiting(self) -> bool:
        return self.ready > self.answered


@dataclasses.dataclass(frozen=True)
class Failure:
    """A worker that failed: how, in words, and the launcher's exit code for it."""

    worker: int
    how: str
    code: int


# A worker's environment beyond the job's (RINGCORE_ELASTIC_WORKER...), and where it runs -> its number.
StartWorker = Callable[[hosts.Slot, dict[str, str]], int]


class Messages(Protocol):
    """Where the driver's messages go (``ringcore-run``'s :class:`~ringcore.processes.Sink`)."""

    def message(self, text: str) -> None: ...


class Pool(Protocol):
    """The workers' processes as the driver sees them; :class:`~ringcore.processes.Job` is one.

    Workers are numbered in start order (the driver's :data:`StartWorker` adds them).
    A worker *exits* once, with a return code: 0 when its function returned.
    """

    exits: dict[int, int]  # worker -> return code, once seen to exit

    @property
    def sink(self) -> Messages: ...

    def collect(self, timeout: float) -> list[tuple[int, int]]:
        """Wait up to ``timeout`` s for exits; the new ``(worker, returncode)`` pairs.

        An exception raised here ends the job: it leaves :meth:`ringcore.elastic_driver.Driver.run`, which closes the store.
        """
        ...

    def running(self) -> list[int]:
        """Workers not yet seen to exit."""
        ...

    def send(self, workers: Sequence[int], signum: int) -> None:
        """Stop ``workers``: SIGTERM first, SIGKILL after the grace (a pool may stop at once)."""
        ...

    def stop(self, grace: float) -> list[int]:
        """Stop every worker still running; return those workers."""
        ...

    def describe(self, worker: int, returncode: int) -> tuple[str, int]:
        """How ``worker`` ended, in words, and the driver's exit code for it."""
        ...
