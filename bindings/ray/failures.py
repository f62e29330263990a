"""Waiting for every rank of a call, and naming the rank that failed it.

A call (``run`` or ``execute``) fails in one of three ways, told apart here:

- lost: a rank's actor, process or node died (any Ray error other than
  ``RayTaskError``). The job cannot go on with a rank missing, so the
  executor stops the other ranks at once (they would otherwise sit in a
  collective until ``RINGCORE_TIMEOUT``) and raises :class:`WorkerLost`.
- raised: a rank's function raised. That rank closed its communicator before
  returning (:mod:`ringcore.ray.worker`), so the others fail their
  collectives with ``PeerFailure`` and close theirs. The executor waits
  ``grace_s`` for them; ranks still busy then are stopped with the rest.
  :class:`WorkerError` names the root cause: the first error that is not a
  consequence of another rank's (``PeerFailure``, ``CommunicatorClosed``).
- timed out: ranks still running after the call's ``timeout_s``: stopped,
  :class:`WorkerTimeout`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import ray
from ray.exceptions import RayError, RayTaskError

from ringcore.errors import CommunicatorClosed, PeerFailure, RingcoreError
from ringcore.ray.layout import Slot

_CONSEQUENCES = (PeerFailure, CommunicatorClosed)


class WorkerError(RingcoreError):
    """A rank of a :class:`~ringcore.ray.RingcoreExecutor` failed; the message names the rank and node.

    Attributes:
        rank: the rank taken as the root cause (-1 when none is known).
        node_ip, node_id: where that rank ran.
        stopped: whether the executor stopped its workers (call ``start()`` again).
    """

    def __init__(self, message: str, slot: Slot | None, stopped: bool) -> None:
        super().__init__(message)
        self.rank = slot.rank if slot else -1
        self.node_ip = slot.node_ip if slot else ""
        self.node_id = slot.node_id if slot else ""
        self.stopped = stopped


class WorkerLost(WorkerError):
    """A rank's actor, its process or its node died."""


class WorkerTimeout(WorkerError, TimeoutError):
    """Ranks did not finish within the call's ``timeout_s``."""


@dataclasses.dataclass
class Outcome:
    """What came back from every rank of one call (indexed by rank)."""

    results: list[Any]
    errors: dict[int, BaseException]  # in the order they arrived
    unfinished: list[int]
    timed_out: bool

    @property
    def lost(self) -> list[int]:
        return [rank for rank, err in self.errors.items() if _is_lost(err)]

    @property
    def ok(self) -> bool:
        return not self.errors and not self.unfinished

    @property
    def must_stop(self) -> bool:
        """Whether some worker is dead or still busy, so the job cannot be reused."""
        return bool(self.lost or self.unfinished)


def collect(refs: Sequence[ray.ObjectRef], timeout_s: float | None, grace_s: float) -> Outcome:
    """Wait for the results of ``refs`` (one per rank), stopping early as the module docstring says."""
    pending = {ref: rank for rank, ref in enumerate(refs)}
    results: list[Any] = [None] * len(refs)
    errors: dict[int, BaseException] = {}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    grace_end: float | None = None
    while pending:
        ends = [end for end in (deadline, grace_end) if end is not None]
        wait_s = max(0.0, min(ends) - time.monotonic()) if ends else None
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=wait_s)
        if not ready:
            break
        rank = pending.pop(ready[0])
        try:
            results[rank] = ray.get(ready[0])
        except RayError as err:
            errors[rank] = err
            if _is_lost(err):
                break
            grace_end = grace_end or time.monotonic() + grace_s
    timed_out = bool(pending) and not errors
    return Outcome(results, errors, sorted(pending.values()), timed_out)


def describe(outcome: Outcome, slots: Sequence[Slot], what: str, stopped: bool) -> WorkerError:
    """The error for a failed call, naming the root-cause rank and its node (``slots`` by rank)."""
    after = _stopped_note(stopped)
    if outcome.timed_out:
        first = slots[outcome.unfinished[0]]
        return WorkerTimeout(
            f"{what}: {_ranks(outcome.unfinished)} did not finish in time ({first.where()} among them). {after}",
            first,
            stopped,
        )
    rank, err = _root_cause(outcome)
    error = _error(err, slots[rank], what, _others(outcome, rank), after, stopped)
    error.__cause__ = err
    return error


def _error(err: BaseException, slot: Slot, what: str, others: str, after: str, stopped: bool) -> WorkerError:
    if _is_lost(err):
        return WorkerLost(
            f"{what}: {slot.where()} died: {first_line(err)} ({type(err).__name__}).{others} {after}",
            slot,
            stopped,
        )
    cause = getattr(err, "cause", None) or err
    return WorkerError(
        f"{what}: {slot.where()} raised {type(cause).__name__}: {cause}.{others} {after}",
        slot,
        stopped,
    )


def _root_cause(outcome: Outcome) -> tuple[int, BaseException]:
    lost = outcome.lost
    if lost:
        return lost[0], outcome.errors[lost[0]]
    for rank, err in outcome.errors.items():
        if not isinstance(getattr(err, "cause", None), _CONSEQUENCES):
            return rank, err
    return next(iter(outcome.errors.items()))


def _others(outcome: Outcome, root: int) -> str:
    notes = []
    failed = [rank for rank in outcome.errors if rank != root]
    if failed:
        kinds = sorted(
            {type(getattr(outcome.errors[r], "cause", None) or outcome.errors[r]).__name__ for r in failed}
        )
        notes.append(f" {_ranks(failed).capitalize()} failed after it ({', '.join(kinds)}).")
    if outcome.unfinished and not outcome.lost:
        notes.append(f" {_ranks(outcome.unfinished).capitalize()} had not finished.")
    return "".join(notes)


def _stopped_note(stopped: bool) -> str:
    if stopped:
        return (
            "The executor stopped every worker and released its placement group: call start() for a new job."
        )
    return (
        "Every rank closed its ringcore communicator; the workers and their state are kept: "
        "the next run() starts with ringcore.init()."
    )


def _is_lost(err: BaseException) -> bool:
    return isinstance(err, RayError) and not isinstance(err, RayTaskError)


def first_line(err: BaseException) -> str:
    """The first non-empty line of ``err``'s message (300 characters at most), for messages."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return (lines[0] if lines else type(err).__name__)[:300]


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, sorted(ranks)))
