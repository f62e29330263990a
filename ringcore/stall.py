"""The stall inspector: who is missing from a collective that others wait in.

Every rank runs a heartbeat thread that publishes what it is doing (the
collective it last entered, its name, whether it finished) to the store
whenever that changes, at most every few seconds, over its own store
connection. Rank 0's thread also reads everyone's and, when some ranks have
been inside collective #n for ``RINGCORE_STALL_WARNING`` seconds (default
60) while others have not entered it, logs which ranks are missing, for
which collective and name, and repeats every ``RINGCORE_STALL_WARNING``
seconds. With ``RINGCORE_STALL_SHUTDOWN`` seconds set, rank 0 then publishes
a shutdown reason; every rank's collectives (the waiting ones and the next
one of a missing rank) fail with :class:`~ringcore.errors.CollectiveTimeout`.

Times are measured on rank 0's clock only, from when it first saw the stall,
so hosts' clocks need not agree.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ringcore.config import Settings
from ringcore.descriptor import rank_list
from ringcore.errors import RingcoreError
from ringcore.store import StoreClient

log = logging.getLogger("ringcore")

_ABORT_KEY = "stall/shutdown"


class Progress:
    """What this rank is doing; written by the collective's thread, read by the heartbeat.

    ``Communicator._run`` writes it directly: on entering a collective ``seq``, ``kind``,
    ``name`` and ``done = False``, on leaving ``done = True``, each time bumping ``version``
    last (what the heartbeat compares). Two method calls fewer per collective: a 4 KiB
    allreduce at N=4 on 2 cores pays every call twice.
    """

    __slots__ = ("done", "kind", "name", "seq", "version")

    def __init__(self) -> None:
        self.seq = 0
        self.kind = ""
        self.name: str | None = None
        self.done = True
        self.version = 0

    def record(self) -> dict[str, Any]:
        return {"seq": self.seq, "kind": self.kind, "name": self.name, "done": self.done}


class StallInspector:
    """Heartbeat on every rank, inspection on rank 0 (see module docstring)."""

    def __init__(
        self,
        rank: int,
        size: int,
        address: tuple[str, int],
        connect: Callable[[], StoreClient],
        progress: Progress,
        settings: Settings,
    ) -> None:
        self.rank = rank
        self.size = size
        self.progress = progress
        self.warning = settings.stall_warning
        self.shutdown_after = settings.stall_shutdown
        self.interval = max(0.05, min(5.0, self.warning / 4))
        self.connect = connect
        self.reason: str | None = None
        self.first_seen: dict[int, float] = {}
        self.last_warned: dict[int, float] = {}
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="ringcore-stall", daemon=True)
        self.thread.start()

    def interruption(self) -> str | None:
        """Why collectives must stop now (stall shutdown), or ``None``."""
        return self.reason

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=10)

    def _loop(self) -> None:
        try:
            store = self.connect()
        except RingcoreError as err:
            # The communicator's own store connection passed the same handshake, so this
            # means the store is gone: rank 0 finished (or died) and the job is ending.
            log.info("stall inspector not started: %s", str(err))
            return
        published = -1
        try:
            while not self.stopping.wait(self.interval):
                if self.progress.version != published:
                    published = self.progress.version
                    store.set(f"progress/{self.rank}", self.progress.record())
                if self.rank == 0:
                    self._inspect(store)
                elif self.shutdown_after is not None and self.reason is None:
                    self.reason = store.mget([_ABORT_KEY])[0]
        except RingcoreError:
            return  # the store is gone: the job is ending
        finally:
            store.close()

    def _inspect(self, store: StoreClient) -> None:
        records = store.mget([f"progress/{r}" for r in range(self.size)])
        stalled = _stalled(records)
        now = time.monotonic()
        self.first_seen = {seq: t for seq, t in self.first_seen.items() if stalled and seq == stalled[0]}
        if stalled is None:
            return
        seq, waiting, missing = stalled
        since = self.first_seen.setdefault(seq, now)
        if now - since >= self.warning and now - self.last_warned.get(seq, 0.0) >= self.warning:
            self.last_warned[seq] = now
            log.warning("stall: %s", _describe(records, seq, waiting, missing, now - since))
        if self.shutdown_after is not None and now - since >= self.shutdown_after and self.reason is None:
            self.reason = "stall inspector: " + _describe(records, seq, waiting, missing, now - since)
            store.set(_ABORT_KEY, self.reason)


def _stalled(records: list[Any]) -> tuple[int, list[int], list[int]] | None:
    """The newest unfinished collective some ranks wait in while others never entered it."""
    entered = [(r, rec) for r, rec in enumerate(records) if rec]
    inside = [rec["seq"] for _, rec in entered if not rec["done"]]
    if not inside:
        return None
    seq = max(inside)
    waiting = [r for r, rec in entered if rec["seq"] == seq and not rec["done"]]
    missing = [r for r, rec in enumerate(records) if not rec or rec["seq"] < seq]
    return (seq, waiting, missing) if missing else None


def _describe(records: list[Any], seq: int, waiting: list[int], missing: list[int], seconds: float) -> str:
    rec = records[waiting[0]]
    name = f" ({rec['name']!r})" if rec.get("name") else ""
    where = "; ".join(
        f"rank {r} last entered {records[r]['kind']} #{records[r]['seq']}"
        if records[r]
        else f"rank {r} none yet"
        for r in missing[:8]
    )
    return (
        f"{rec['kind']} #{seq}{name}: {rank_list(waiting)} have waited {seconds:.0f} s for "
        f"{rank_list(missing)}, which {'has' if len(missing) == 1 else 'have'} not entered it ({where})"
    )
