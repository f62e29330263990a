"""RingcoreExecutor: a ringcore job on Ray actors, placed, numbered and stopped by the driver.

Horovod's ``RayExecutor``, for ringcore::

    executor = RingcoreExecutor(num_workers=4, cpus_per_worker=2)
    executor.start()
    sums = executor.run(train, args=(config,))   # train() calls ringcore.init(); results by rank
    executor.shutdown()

``start()`` reserves one placement-group bundle per rank (``PACK`` by
default, or any strategy Ray knows), starts one actor in each, asks every
actor for its node, numbers the ranks node by node (:mod:`ringcore.ray.layout`),
finds a free port on rank 0's node, draws a fresh ``RINGCORE_SECRET``, and
exports the ``RINGCORE_*`` variables in every actor, so ``ringcore.init()``
(or ``ringcore.torch.init()``) inside the user's function joins the job.

Failures (:mod:`ringcore.ray.failures`): a rank that dies makes ``run`` raise
:class:`WorkerLost` naming the rank and node, after the executor stopped the
other actors and released the placement group (``start()`` makes a new job);
a rank whose function raises makes ``run`` raise :class:`WorkerError` once
the other ranks have closed their communicators, and the actors are kept.
Nothing is left in a collective either way.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ringcore.errors import RingcoreError
from ringcore.ray.failures import collect, describe
from ringcore.ray.layout import Slot, assign_ranks, rank_env
from ringcore.ray.worker import RingcoreWorker

__all__ = ["RingcoreExecutor"]

log = logging.getLogger("ringcore")
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


class RingcoreExecutor:
    """Runs functions on ``num_workers`` Ray actors that form one ringcore job.

    Args:
        num_workers: the world size.
        cpus_per_worker: CPUs each actor reserves.
        use_gpu: reserve GPUs too (``gpus_per_worker`` each, default 1); Ray sets
            ``CUDA_VISIBLE_DEVICES`` in each actor.
        gpus_per_worker: GPUs per actor; only with ``use_gpu``.
        env: environment variables for every actor, set when its process starts
            (e.g. ``{"RINGCORE_TIMEOUT": "60", "OMP_NUM_THREADS": "2"}``).
        placement_strategy: ``"PACK"`` (fill nodes in turn), ``"SPREAD"``, or their
            ``STRICT_`` forms, as Ray's placement groups take them.
        start_timeout_s: how long ``start()`` waits for Ray to place every worker.
        grace_s: after a rank's function raised, how long the other ranks get to
            finish before they are stopped.
    """

    def __init__(
        self,
        num_workers: int,
        cpus_per_worker: float = 1,
        use_gpu: bool = False,
        gpus_per_worker: float | None = None,
        env: Mapping[str, str] | None = None,
        placement_strategy: str = "PACK",
        start_timeout_s: float = 120.0,
        grace_s: float = 30.0,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"RingcoreExecutor: num_workers must be at least 1, got {num_workers}")
        if gpus_per_worker is not None and not use_gpu:
            raise ValueError("RingcoreExecutor: gpus_per_worker needs use_gpu=True")
        if placement_strategy not in STRATEGIES:
            raise ValueError(
                f"RingcoreExecutor: placement_strategy {placement_strategy!r} is not one of {', '.join(STRATEGIES)}"
            )
        self.num_workers = num_workers
        self.cpus_per_worker = cpus_per_worker
        self.gpus_per_worker = (1 if gpus_per_worker is None else gpus_per_worker) if use_gpu else 0
        self.env = {str(k): str(v) for k, v in (env or {}).items()}
        self.placement_strategy = placement_strategy
        self.start_timeout_s = start_timeout_s
        self.grace_s = grace_s
        self.slots: list[Slot] = []  # by rank, while started
        self._actors: list[Any] = []  # by rank
        self._group: PlacementGroup | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def started(self) -> bool:
        return bool(self._actors)

    def start(
        self,
        executable_cls: type | None = None,
        executable_args: Sequence[Any] = (),
        executable_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        """Place the workers and give each its rank; ``execute`` passes ``executable_cls(...)`` to functions.

        Raises:
            RingcoreError: already started, or Ray could not place every worker in time.
        """
        if self.started:
            raise RingcoreError("RingcoreExecutor.start: already started; call shutdown() first")
        self._group = self._reserve()
        actors: list[Any] = []
        try:
            actors.extend(self._actor(bundle) for bundle in range(self.num_workers))
            self._number(actors)
            addr = self.slots[0].node_ip
            port = ray.get(self._actors[0].free_port.remote(addr))
            secret = secrets.token_hex(32)  # fresh for every job: ranks of an old one cannot join
            setups = [
                actor.setup.remote(
                    rank_env(slot, self.num_workers, addr, port, secret),
                    executable_cls,
                    tuple(executable_args),
                    dict(executable_kwargs or {}),
                )
                for actor, slot in zip(self._actors, self.slots, strict=True)
            ]
            ray.get(setups)
        except BaseException:
            self._stop(actors)
            raise
        log.info("ringcore.ray: %d workers started, rank 0 serves at %s:%d", self.num_workers, addr, port)

    def run(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> list[Any]:
        """``fn(*args, **kwargs)`` on every rank; the results in rank order.

        Raises:
            WorkerLost: a rank died (the executor stopped; ``start()`` again).
            WorkerError: a rank's ``fn`` raised (the message names it; ``__cause__`` is Ray's error).
            WorkerTimeout: ``timeout_s`` passed with ranks still running (the executor stopped).
        """
        refs = [actor.run.remote(fn, tuple(args), dict(kwargs or {})) for actor in self._live()]
        return self._gather(refs, f"run({_name(fn)})", timeout_s)

    def execute(self, fn: Callable[[Any], Any], timeout_s: float | None = None) -> list[Any]:
        """``fn(state)`` on every rank, where ``state`` is that actor's ``executable_cls`` instance
        (an empty ``types.SimpleNamespace`` without one); the results in rank order. Errors as ``run``."""
        refs = [actor.execute.remote(fn) for actor in self._live()]
        return self._gather(refs, f"execute({_name(fn)})", timeout_s)

    def shutdown(self) -> None:
        """Close every rank's communicator, stop the actors, release the placement group; idempotent."""
        if self._actors:
            try:
                ray.get([actor.reset.remote() for actor in self._actors], timeout=30)
            except (GetTimeoutError, ray.exceptions.RayError) as err:
                log.warning("ringcore.ray: shutdown: not every worker closed its communicator: %r", err)
        self._stop()

    def __enter__(self) -> RingcoreExecutor:
        if not self.started:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ internals

    def _reserve(self) -> PlacementGroup:
        bundle = {"CPU": self.cpus_per_worker}
        if self.gpus_per_worker:
            bundle["GPU"] = self.gpus_per_worker
        group = placement_group(
            [dict(bundle) for _ in range(self.num_workers)], strategy=self.placement_strategy
        )
        try:
            ray.get(group.ready(), timeout=self.start_timeout_s)
        except GetTimeoutError:
            remove_placement_group(group)
            raise RingcoreError(
                f"RingcoreExecutor.start: Ray could not place {self.num_workers} workers of {bundle} "
                f"({self.placement_strategy}) within {self.start_timeout_s:g} s; the cluster has "
                f"{ray.available_resources()} available of {ray.cluster_resources()}"
            ) from None
        return group

    def _number(self, actors: list[Any]) -> None:
        """Ask each actor (in bundle order) for its node; keep actors and slots in rank order."""
        described = ray.get([actor.describe.remote() for actor in actors])
        slots = assign_ranks([(node_id, ip) for node_id, ip, _ in described])
        slots = [
            dataclasses.replace(slot, pid=pid) for slot, (_, _, pid) in zip(slots, described, strict=True)
        ]
        self.slots = sorted(slots, key=lambda slot: slot.rank)
        self._actors = [actors[slot.bundle] for slot in self.slots]

    def _actor(self, bundle: int) -> Any:
        assert self._group is not None
        options: dict[str, Any] = {
            "num_cpus": self.cpus_per_worker,
            "num_gpus": self.gpus_per_worker,
            "max_restarts": 0,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                self._group, placement_group_bundle_index=bundle
            ),
        }
        if self.env:
            options["runtime_env"] = {"env_vars": dict(self.env)}
        return _RemoteWorker.options(**options).remote()

    def _live(self) -> list[Any]:
        if not self._actors:
            raise RingcoreError("RingcoreExecutor: not started; call start() first")
        return self._actors

    def _gather(self, refs: list[Any], what: str, timeout_s: float | None) -> list[Any]:
        try:
            outcome = collect(refs, timeout_s, self.grace_s)
        except BaseException:  # Ctrl-C in the driver: leave no rank running, let alone in a collective
            self._stop()
            raise
        if outcome.ok:
            return outcome.results
        slots = list(self.slots)
        stop = outcome.must_stop
        if stop:
            self._stop()
        raise describe(outcome, slots, what, stopped=stop)  # its __cause__: Ray's error for that rank

    def _stop(self, actors: list[Any] | None = None) -> None:
        for actor in actors if actors is not None else self._actors:
            ray.kill(actor, no_restart=True)
        self._actors, self.slots = [], []
        if self._group is not None:
            remove_placement_group(self._group)
            self._group = None


_RemoteWorker = ray.remote(RingcoreWorker)


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)
