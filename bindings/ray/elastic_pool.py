"""The workers of an elastic Ray job: one actor each, started, watched and stopped for the elastic driver.

:class:`ActorPool` is a :class:`ringcore.elastic_driver.Pool` over Ray actors,
as ``ringcore-run``'s ``Job`` is one over processes:

- start: a worker is an :class:`~ringcore.ray.worker.ElasticWorker` actor whose
  process starts with ``RINGCORE_ELASTIC_WORKER`` and the driver's store in its
  environment (a runtime env of its own: the variables are there before
  anything in the process imports ``ringcore.elastic``); it is sent
  ``describe()`` (ready once Ray has placed it) and then the user's function.
- exit: the function's call resolving is the worker's exit: 0 when it
  returned, :data:`RAISED` when it raised, :data:`LOST` when the actor, its
  process or its node died (any other Ray error, ``ray.kill`` included). The
  actor is killed then, so its resources are free for a replacement.
- stop: ``ray.kill`` at once (a pool has no SIGTERM).
- room: how many more workers Ray can place now, from the cluster's free
  resources less the workers Ray has not placed yet (or placed so recently
  that the free resources Ray reports may not show them).

A function that raises anything but a failure of the world
(:data:`ringcore.elastic.RECOVERABLE`, seen outside ``@ringcore.elastic.run``,
e.g. a peer lost while ``ringcore.init()`` met) is a bug that a replacement would
repeat: :meth:`ActorPool.collect` raises :class:`FunctionRaised` and the job ends.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ray
from ray.exceptions import RayError, RayTaskError

from ringcore import hosts
from ringcore.elastic import RECOVERABLE
from ringcore.ray.failures import first_line
from ringcore.ray.worker import ElasticWorker

log = logging.getLogger("ringcore")

RAISED = 1  # the worker's function raised
LOST = 137  # its actor, process or node died (as a SIGKILLed process's 128 + 9)
SETTLE_S = 2.0  # after Ray placed a worker, how long free resources may not show it yet
REFRESH_S = 0.5  # how long one look at the cluster's free resources stays good


class FunctionRaised(Exception):
    """A worker's function raised an error that another worker would raise too (not a lost peer)."""

    def __init__(self, worker: int, how: str) -> None:
        super().__init__(how)
        self.worker = worker


class Log:
    """The driver's messages: kept for the executor's errors, and logged."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def message(self, text: str) -> None:
        self.lines.append(text)
        log.log(logging.INFO if text.startswith("generation ") else logging.WARNING, "ringcore.ray: %s", text)


@dataclasses.dataclass
class Member:
    """One worker's actor and its pending calls."""

    handle: Any
    call: ray.ObjectRef  # the user's function
    ping: ray.ObjectRef | None  # describe(): resolves once Ray placed the actor; None once seen
    placed_at: float | None = None
    where: str = "not running yet"


class ActorPool:
    """Workers as Ray actors for :class:`ringcore.elastic_driver.Driver` (see the module docstring).

    Args:
        fn, args, kwargs: What every worker runs.
        resources: What one worker reserves (``{"CPU": 1, "GPU": 1}``).
        env: Every worker's environment (the driver's store, the secret, the user's variables).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        resources: Mapping[str, float],
        env: Mapping[str, str],
    ) -> None:
        self.sink = Log()
        self.exits: dict[int, int] = {}
        self.members: dict[int, Member] = {}
        self.results: dict[int, Any] = {}
        self.errors: dict[int, BaseException] = {}
        self.failures: list[str] = []  # every failure described, in order
        self._call = (fn, tuple(args), dict(kwargs))
        self._resources = {name: float(need) for name, need in resources.items() if need > 0}
        self._env = dict(env)
        self._killed: set[int] = set()
        self._free: tuple[float, int] = (-REFRESH_S, 0)  # (when, workers the free resources hold)

    # ------------------------------------------------------------------ the driver's Pool

    def start(self, seat: hosts.Slot, worker_env: dict[str, str]) -> int:
        """Start worker ``seat.rank`` (the driver's :data:`~ringcore.elastic_driver.StartWorker`)."""
        number = len(self.members)
        options: dict[str, Any] = {
            "num_cpus": self._resources.get("CPU", 0),
            "num_gpus": self._resources.get("GPU", 0),
            "max_restarts": 0,
            "runtime_env": {"env_vars": {**self._env, **worker_env}},
        }
        custom = {k: v for k, v in self._resources.items() if k not in ("CPU", "GPU")}
        if custom:
            options["resources"] = custom
        handle = _RemoteWorker.options(**options).remote()
        ping = handle.describe.remote()  # an actor runs its calls in order: this one first
        fn, args, kwargs = self._call
        self.members[number] = Member(handle, handle.run.remote(fn, args, kwargs), ping)
        return number

    def collect(self, timeout: float) -> list[tuple[int, int]]:
        """Wait up to ``timeout`` s for calls to resolve; the new ``(worker, code)`` exits.

        Raises:
            FunctionRaised: A worker's function raised an error that is not a failure of the world.
        """
        self._note_placed()
        pending = {self.members[n].call: n for n in self.running()}
        if not pending:
            time.sleep(timeout)
            return []
        ready, rest = ray.wait(list(pending), num_returns=1, timeout=timeout)
        if ready and rest:
            ready += ray.wait(rest, num_returns=len(rest), timeout=0)[0]
        found = [(pending[ref], self._outcome(pending[ref], ref)) for ref in ready]
        self.exits.update(found)
        for number, code in found:
            self._kill(number)  # done: free its resources (its function left ringcore already)
            if code == RAISED and not isinstance(_cause(self.errors[number]), RECOVERABLE):
                raise FunctionRaised(number, self.describe(number, code)[0])
        return found

    def running(self) -> list[int]:
        return [n for n in self.members if n not in self.exits]

    def send(self, workers: Sequence[int], signum: int) -> None:
        """Kill ``workers``' actors, whatever the signal."""
        for number in workers:
            self._kill(number)

    def stop(self, grace: float) -> list[int]:
        """Kill every worker still running and wait up to ``grace`` s for Ray to say so; those workers."""
        self.collect(0)
        running = self.running()
        self.send(running, 0)
        calls = [self.members[n].call for n in running]
        if calls:
            ray.wait(calls, num_returns=len(calls), timeout=grace)
            for number in running:
                self.exits.setdefault(number, LOST)
        return running

    def describe(self, worker: int, returncode: int) -> tuple[str, int]:
        """``worker 2 (pid 4711 on node 10.0.0.7) died: ...``, and ``returncode``."""
        err = self.errors.get(worker)
        where = f"worker {worker} ({self.members[worker].where})"
        if isinstance(err, RayTaskError):
            cause = _cause(err)
            how = f"{where} raised {type(cause).__name__}: {first_line(cause)}"
        else:
            how = f"{where} died: {_died(err)} ({type(err).__name__})"
        self.failures.append(how)
        return how, returncode

    # ------------------------------------------------------------------ room and cleanup

    def room(self) -> int:
        """How many more workers Ray can place now (see the module docstring)."""
        self._note_placed()
        now = time.monotonic()
        if now - self._free[0] >= REFRESH_S:
            free = ray.available_resources()
            fits = min(
                (int(free.get(name, 0.0) // need) for name, need in self._resources.items()), default=0
            )
            self._free = (now, fits)
        unseen = [n for n in self.running() if _unseen(self.members[n], now)]
        return max(0, self._free[1] - len(unseen))

    def close(self) -> None:
        """Kill every actor of the pool (the job is over); idempotent."""
        for number in self.members:
            self._kill(number)

    def _outcome(self, number: int, ref: ray.ObjectRef) -> int:
        try:
            self.results[number] = ray.get(ref)
        except RayTaskError as err:
            self.errors[number] = err
            return RAISED
        except RayError as err:
            self.errors[number] = err
            return LOST
        return 0

    def _note_placed(self) -> None:
        pings = {m.ping: m for m in self.members.values() if m.ping is not None}
        if not pings:
            return
        ready, _ = ray.wait(list(pings), num_returns=len(pings), timeout=0)
        for ref in ready:
            member = pings[ref]
            member.ping, member.placed_at = None, time.monotonic()
            try:
                _, ip, pid = ray.get(ref)
            except RayError:
                continue  # died before it was placed, or right after: its call says how
            member.where = f"pid {pid} on node {ip}"

    def _kill(self, number: int) -> None:
        if number not in self._killed:
            self._killed.add(number)
            ray.kill(self.members[number].handle, no_restart=True)


def _unseen(member: Member, now: float) -> bool:
    """Whether Ray's free resources may still count ``member``'s share as free."""
    return member.placed_at is None or now - member.placed_at < SETTLE_S


def _died(err: BaseException | None) -> str:
    """Ray's words for a death: its first line and why (``ActorDiedError`` lists fields in between)."""
    if err is None:
        return "no result"
    lines = [line.strip() for line in str(err).splitlines() if line.strip() and not line[0].isspace()]
    return " ".join(lines[:2])[:300] or type(err).__name__


def _cause(err: BaseException) -> BaseException:
    return getattr(err, "cause", None) or err


_RemoteWorker = ray.remote(ElasticWorker)
