"""A worker's side of an elastic ``ringcore-run``: check in at the launcher's store, learn a rank, meet.

:mod:`ringcore.elastic_protocol` has the words (worker, generation) and the
keys. A worker checks in, waits for the launcher's answer (its generation,
rank and size), and meets the generation's other ranks through a
:class:`GenerationMeeting` (:func:`ringcore.new_communicator`): rank 0
serves the generation's own store on a port the kernel picks.

A worker checks in *before* it closes its old communicator: a rank 0 whose
store waits for a stopped peer to leave (``ringcore.store``, at most 10 s)
is not taken for a straggler.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from ringcore.api import new_communicator
from ringcore.comm import Communicator
from ringcore.config import Settings
from ringcore.elastic_protocol import BROKEN, ENDED, WORKER_VARIABLE, answer_key, meeting_prefix, ready_key
from ringcore.errors import CollectiveTimeout, ConfigError, PeerFailure
from ringcore.store import StoreClient, tls_contexts

ANSWER_POLL = 60.0  # seconds per wait for the launcher's answer; waiting for the next commit may take long
MEETING_POLL = 0.5  # seconds between looks at BROKEN while a generation's ranks meet


@dataclasses.dataclass(frozen=True)
class Assignment:
    """This worker's place in a generation."""

    generation: int
    rank: int
    size: int


class Rendezvous:
    """One worker's membership in an elastic job: check in, wait for the launcher, meet the generation.

    Args:
        worker: This worker's number (``RINGCORE_ELASTIC_WORKER``).
        settings: The worker's settings; ``addr``/``port`` are the launcher's store.
    """

    def __init__(self, worker: int, settings: Settings) -> None:
        self.worker = worker
        self.settings = settings
        self.assignment: Assignment | None = None
        self.comm: Communicator | None = None  # the communicator the last join made
        self._seq = 0
        self._checked_in = False
        self._store: StoreClient | None = None

    @property
    def generation(self) -> int:
        """The generation this worker is (or was last) a member of; 0 before its first."""
        return self.assignment.generation if self.assignment is not None else 0

    def store(self) -> StoreClient:
        """The connection to the launcher's store (made on first use)."""
        if self._store is None:
            settings = self.settings
            _, tls = tls_contexts(settings.tls_cert, settings.tls_key, settings.tls_ca)
            self._store = StoreClient(
                str(settings.addr),
                int(settings.port or 0),
                settings.init_timeout,
                settings.secret or b"",
                settings.handshake_timeout,
                tls,
            )
        return self._store

    def check_in(self) -> None:
        """Tell the launcher this worker has left its generation (or wants its first); once per join."""
        if self._checked_in:
            return
        self._seq += 1
        self.store().set(ready_key(self.worker), [self._seq, self.generation])
        self._checked_in = True

    def join(self) -> Communicator:
        """Check in (unless done already), wait for the launcher's answer, and meet the generation.

        Raises:
            RingcoreError: A member left before the generation met (``PeerFailure``,
                ``CollectiveTimeout``, rank 0's store gave up or closed): check in again.
        """
        self.check_in()
        answer = self._answer()
        self._checked_in = False
        self.assignment = Assignment(*(int(value) for value in answer))
        meeting = GenerationMeeting(self.store(), self.assignment.generation, self.settings.init_timeout)
        self.comm = new_communicator(
            self.assignment.rank, self.assignment.size, meeting, addr=str(self.settings.addr)
        )
        return self.comm

    def world_changing(self) -> bool:
        """Whether the launcher has ended this worker's generation (one store round trip)."""
        ended = self.store().mget([ENDED])[0]
        return ended is not None and int(ended) >= self.generation

    def _answer(self) -> list[Any]:
        key = answer_key(self.worker, self._seq)
        while True:
            try:
                return list(self.store().get(key, ANSWER_POLL))
            except CollectiveTimeout:
                continue  # newcomers wait for the members' next commit, however long that takes


class GenerationMeeting:
    """A :class:`ringcore.bootstrap.Meeting` over the launcher's store, under one generation's keys.

    ``get`` gives up when a member leaves the generation before its ranks met
    (``elastic/broken``), or after ``timeout`` s.
    """

    def __init__(self, store: StoreClient, generation: int, timeout: float) -> None:
        self.store = store
        self.generation = generation
        self.timeout = timeout
        self.prefix = meeting_prefix(generation)

    def set(self, key: str, value: bytes) -> None:
        self.store.set(self.prefix + key, value)

    def get(self, key: str) -> bytes:
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                return bytes(self.store.get(self.prefix + key, min(MEETING_POLL, self.timeout)))
            except CollectiveTimeout:
                pass
            broken = self.store.mget([BROKEN])[0]
            if broken is not None and int(broken) >= self.generation:
                raise PeerFailure(f"generation {self.generation} broke before its ranks met (a member left)")
            if time.monotonic() >= deadline:
                raise CollectiveTimeout(
                    f"generation {self.generation}: rank 0 did not publish its store within "
                    f"{self.timeout:g} s (RINGCORE_INIT_TIMEOUT)"
                )


def from_env() -> Rendezvous | None:
    """This process's :class:`Rendezvous` under an elastic ``ringcore-run``; ``None`` otherwise.

    Raises:
        ConfigError: ``RINGCORE_ELASTIC_WORKER`` is not a number, or the store's address is missing.
    """
    settings = Settings.from_env()
    if settings.elastic_worker is None:
        return None
    if not settings.addr or not settings.port:
        raise ConfigError(
            f"{WORKER_VARIABLE} is set but RINGCORE_ADDR/RINGCORE_PORT (ringcore-run's store) are not"
        )
    return Rendezvous(settings.elastic_worker, settings)
