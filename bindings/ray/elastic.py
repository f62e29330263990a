"""ElasticRingcoreExecutor: an elastic ringcore job on Ray actors (Horovod's ``ElasticRayExecutor``).

::

    def train():                          # the whole worker: as a script under an elastic ringcore-run
        ringcore.init()                   # joins the driver's first generation
        state = ringcore.elastic.State(epoch=0, w=np.zeros(1000, np.float32))

        @ringcore.elastic.run
        def loop(state):
            ...                           # allreduce, state.commit() after each step
            return state.w

        return loop(state)

    executor = ElasticRingcoreExecutor(min_workers=2, max_workers=4)
    weights = executor.run(train)         # the last generation's results, in rank order

``run`` plays ``ringcore-run``'s part in an elastic job, in the Ray driver
process: it serves the job's store on this node's address (the one Ray uses,
so the actors reach it) with a fresh secret, and runs the elastic driver
(:class:`ringcore.elastic_driver.Driver`) over a pool of actors
(:mod:`ringcore.ray.elastic_pool`), one per worker. The driver forms each
generation from the live workers (survivors first, in their order), ends it
when a worker is lost (its actor died or was killed: Ray fails its call) or
when a new one waits to join, and starts a replacement whenever Ray has free
resources for one, up to ``max_workers``; the survivors roll back to their
last commit and the newcomers take rank 0's state (``ringcore.elastic``).
Below ``min_workers`` for ``elastic_timeout_s`` the job fails, naming the lost
workers, and every actor is stopped. A worker whose function raises an error
of its own (not a failure of the world) ends the job at once: a replacement
would raise it too.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ray

from ringcore import hosts
from ringcore.config import Settings
from ringcore.elastic_driver import EXIT_TIMEOUT, Driver, ElasticOptions, serve_store
from ringcore.errors import RingcoreError
from ringcore.processes import SignalCatcher
from ringcore.ray.elastic_pool import LOST, ActorPool, FunctionRaised
from ringcore.ray.failures import WorkerError, WorkerLost, WorkerTimeout

__all__ = ["ElasticRingcoreExecutor"]

log = logging.getLogger("ringcore")
FLAGS = {
    "min_np": "min_workers",
    "elastic_timeout": "elastic_timeout_s",
    "timeout": "timeout_s",
    "no_check_in": "could Ray place and start its actor (free resources), and does the function call "
    "ringcore.init() or a @ringcore.elastic.run function?",
}
GRACE_S = 5.0  # how long stopping the actors waits for Ray to confirm


class ElasticRingcoreExecutor:
    """Runs a function on ``min_workers``..``max_workers`` Ray actors that form an elastic ringcore job.

    Args:
        min_workers: Fewest workers the job goes on with.
        max_workers: Most workers at once; lost ones are replaced up to this many.
        cpus_per_worker: CPUs each actor reserves.
        use_gpu: Reserve GPUs too (``gpus_per_worker`` each, default 1).
        gpus_per_worker: GPUs per actor; only with ``use_gpu``.
        resources_per_worker: Other Ray resources each actor reserves (``{"accelerator": 1}``).
        env: Environment variables for every actor (``RINGCORE_INIT_TIMEOUT`` defaults
            to ``elastic_timeout_s``).
        elastic_timeout_s: How long the job waits below ``min_workers``, for a member to
            come back to the rendezvous, and for a new actor to join (Ray places and starts it
            meanwhile: leave room for that).
        failure_cooldown_s: After a worker is lost, how long before a replacement starts,
            doubled for each further loss (a function that kills its process is not restarted in a loop).
    """

    def __init__(
        self,
        min_workers: int,
        max_workers: int,
        cpus_per_worker: float = 1,
        use_gpu: bool = False,
        gpus_per_worker: float | None = None,
        resources_per_worker: Mapping[str, float] | None = None,
        env: Mapping[str, str] | None = None,
        elastic_timeout_s: float = 60.0,
        failure_cooldown_s: float = 10.0,
    ) -> None:
        if not 1 <= min_workers <= max_workers:
            raise ValueError(
                f"ElasticRingcoreExecutor: need 1 <= min_workers <= max_workers, got {min_workers} and {max_workers}"
            )
        if gpus_per_worker is not None and not use_gpu:
            raise ValueError("ElasticRingcoreExecutor: gpus_per_worker needs use_gpu=True")
        self.min_workers, self.max_workers = min_workers, max_workers
        self.resources = {"CPU": float(cpus_per_worker), **(resources_per_worker or {})}
        if use_gpu:
            self.resources["GPU"] = float(1 if gpus_per_worker is None else gpus_per_worker)
        if not any(need > 0 for need in self.resources.values()):
            raise ValueError("ElasticRingcoreExecutor: each worker must reserve some resource")
        self.env = {str(k): str(v) for k, v in (env or {}).items()}
        self.elastic_timeout_s = elastic_timeout_s
        self.failure_cooldown_s = failure_cooldown_s
        self._pool: ActorPool | None = None
        self._driver: Driver | None = None  # the running job's
        self._last: tuple[int, list[int]] = (0, [])  # the last job's last generation and its workers

    def run(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every worker until the last generation's members return.

        Returns:
            Their results, in rank order.

        Raises:
            WorkerLost: Fewer than ``min_workers`` were left for ``elastic_timeout_s`` (the message
                names the workers lost); every actor is stopped.
            WorkerError: A worker's function raised (its error is the ``__cause__``).
            WorkerTimeout: ``timeout_s`` passed first.
            RingcoreError: The job's store cannot be served on this node's address.
        """
        if not ray.is_initialized():
            ray.init()  # as Ray's own calls do
        addr = ray.util.get_node_ip_address()  # Ray's address of this node: the actors reach it
        secret = secrets.token_hex(32)  # fresh for every job: workers of another cannot join
        try:
            store, client = serve_store(addr, 0, secret.encode(), Settings.from_env())
        except OSError as err:
            raise RingcoreError(
                f"ElasticRingcoreExecutor: cannot serve the job's store on {addr}: {err}"
            ) from None
        env = {"RINGCORE_INIT_TIMEOUT": f"{self.elastic_timeout_s:g}", **self.env}
        env.update(RINGCORE_ADDR=addr, RINGCORE_PORT=str(store.port), RINGCORE_SECRET=secret)
        pool = ActorPool(fn, args, kwargs or {}, self.resources, env)
        options = ElasticOptions(
            self.min_workers, self.max_workers, None, self.elastic_timeout_s, self.failure_cooldown_s
        )
        try:
            first = max(self.min_workers, min(self.max_workers, pool.room()))
        except BaseException:
            client.close()
            store.close()
            raise
        driver = Driver(
            pool,
            options,
            first,
            [hosts.Host(addr, self.max_workers)],  # one "host": Ray places the actors
            pool.start,
            store,
            client,
            GRACE_S,
            timeout_s or 0,
            room=pool.room,
            flags=FLAGS,
        )  # from here driver.run() closes the store
        self._pool, self._driver = pool, driver
        try:
            code = driver.run(SignalCatcher())  # not installed: Ctrl-C raises KeyboardInterrupt here
        except FunctionRaised as raised:
            reason = str(raised)
            if raised.worker in driver.members:
                reason += f" (rank {driver.members.index(raised.worker)} of generation {driver.generation})"
            error = self._error(fn, reason + _stopped(pool.stop(GRACE_S)), pool, raised.worker)
            raise error from error.__cause__
        finally:
            pool.close()
            self._last = (driver.generation, list(driver.members))
            self._pool = self._driver = None
        if code == 0:
            return [pool.results[n] for n in driver.members]
        first_failed = driver.failures[0].worker if driver.failures else None
        reason = pool.sink.lines[-1] if pool.sink.lines else f"the driver ended with code {code}"
        error = self._error(fn, reason, pool, first_failed, code)
        raise error from error.__cause__

    @property
    def generation(self) -> int:
        """The running job's current generation (1, 2, ...), or the last job's last one; 0 before any."""
        driver = self._driver
        return driver.generation if driver is not None else self._last[0]

    @property
    def members(self) -> list[int]:
        """The workers of :attr:`generation`, in rank order."""
        driver = self._driver
        return list(driver.members) if driver is not None else list(self._last[1])

    def workers(self) -> dict[int, Any]:
        """The actors of the running job's live workers, by worker number (empty between runs)."""
        pool = self._pool
        if pool is None:
            return {}
        return {n: pool.members[n].handle for n in pool.running()}

    def _error(
        self, fn: Callable[..., Any], reason: str, pool: ActorPool, worker: int | None, code: int = 1
    ) -> WorkerError:
        cause = pool.errors.get(worker) if worker is not None else None
        message = f"ElasticRingcoreExecutor.run({_name(fn)}): {reason}"
        if len(pool.failures) > 1:
            message += ". Every failure: " + "; ".join(pool.failures)
        if code == EXIT_TIMEOUT:
            error: WorkerError = WorkerTimeout(message, None, stopped=True)
        elif worker is not None and pool.exits.get(worker) == LOST:
            error = WorkerLost(message, None, stopped=True)
        else:
            error = WorkerError(message, None, stopped=True)
        error.__cause__ = cause
        return error


def _stopped(workers: list[int]) -> str:
    return "; stopped workers " + ", ".join(map(str, workers)) if workers else ""


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)
