"""Elastic training: go on with the ranks that are left when one fails, and take in new ones (Horovod elastic).

::

    import numpy as np
    import ringcore
    import ringcore.elastic

    ringcore.init()  # under an elastic ringcore-run: joins the first generation
    state = ringcore.elastic.State(epoch=0, batch=0, w=np.zeros(1000, np.float32))

    @ringcore.elastic.run
    def train(state):
        while state.epoch < EPOCHS:
            while state.batch < BATCHES:
                g = gradient(state.w, shard(state.epoch, state.batch, ringcore.rank(), ringcore.size()))
                state.w -= LR * ringcore.allreduce(g, op="avg")
                state.batch += 1
                state.commit()  # count the batch, then commit: a rollback neither loses nor repeats it
            state.epoch, state.batch = state.epoch + 1, 0
            state.commit()

    train(state)

Launched with ``ringcore-run -np 4 --min-np 2 --max-np 4 python train.py``
(:mod:`ringcore.elastic_driver`). :func:`run` wraps the training function.
When a peer dies or stalls (``PeerFailure``, ``CollectiveTimeout``, then
``CommunicatorClosed``), every survivor rolls back to its last
:meth:`State.commit`, closes the communicator, checks in at the launcher,
joins the next generation (survivors keep their order, so the new rank 0 is
the oldest survivor), runs the :meth:`State.on_reset` callbacks, takes rank
0's committed state (:meth:`State.sync`) and calls the function again.
Workers that wait to join (new slots from ``--host-discovery-script``) make
the launcher end the generation; rank 0 learns it at the next commit and
tells the others, so every rank leaves at that commit
(:class:`HostsUpdatedInterrupt`) and the world grows without a rollback.

Import this module before ``ringcore.init()`` (or ``hvd.init()``): under an
elastic ``ringcore-run`` it makes ``init()`` join the launcher's first
generation, so ``ringcore.rank()`` and ``ringcore.size()`` hold before
``train(state)`` too; ``run`` joins if nothing did. Outside an elastic
launcher ``run`` syncs the state once and calls the function: a failure then
ends the job as it would without ``ringcore.elastic``.

What a rollback keeps: the attributes given to :class:`State` as they were at
the last commit (numpy arrays restored in place, so references to them stay
valid); ``ringcore.torch.elastic.TorchState`` adds a model, an optimizer and samplers.
Work done after the last commit is done again, on the new world's shards.
"""

from __future__ import annotations

import copy
import functools
import logging
import pickle
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import numpy as np

from ringcore import api, elastic_rendezvous
from ringcore.comm import Communicator
from ringcore.errors import (
    AuthenticationError,
    CollectiveTimeout,
    CommunicatorClosed,
    ConfigError,
    PeerFailure,
    RingcoreError,
)
from ringcore.store import StoreLost

__all__ = ["HostsUpdatedInterrupt", "State", "run"]

log = logging.getLogger("ringcore")

# What ends a generation on a survivor: the world failed it, not this rank's own code or arguments.
RECOVERABLE = (PeerFailure, CollectiveTimeout, CommunicatorClosed, StoreLost)
# What a generation that does not come together raises and another attempt cannot mend.
PERMANENT = (ConfigError, AuthenticationError)

_rendezvous = elastic_rendezvous.from_env()  # None outside an elastic ringcore-run
if _rendezvous is not None:
    api.set_joiner(_rendezvous.join)

F = TypeVar("F", bound=Callable[..., Any])


class HostsUpdatedInterrupt(RuntimeError):
    """Raised by :meth:`State.commit` on every rank when the launcher changes the world at this commit.

    :func:`run` catches it, re-forms the world and calls the training function
    again with the state just committed (nothing is rolled back).
    """


class State:
    """Training state that survives a change of world: committed in memory, synced from rank 0.

    Args:
        **values: The state's attributes (``epoch=0, batch=0, w=np.zeros(10)``): picklable
            values and numpy arrays. Read and change them as attributes; ``commit()`` snapshots them.

    Raises:
        ValueError: A name starts with ``_`` or is one of this class's methods.
    """

    def __init__(self, **values: Any) -> None:
        for name in values:
            if name.startswith("_") or hasattr(type(self), name):
                raise ValueError(f"State({name}=...): that name is taken by State itself; choose another")
        self.__dict__.update(values)
        self._names = tuple(values)
        self._saved: dict[str, Any] = {}
        self._reset_callbacks: list[Callable[[], None]] = []
        self.save()

    def commit(self) -> None:
        """Snapshot the state in memory, then check whether the launcher changes the world now.

        Call it on every rank at the same points (e.g. after each optimizer step).

        Raises:
            HostsUpdatedInterrupt: The world changes at this commit (on every rank at once).
        """
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise :class:`HostsUpdatedInterrupt` on every rank if the launcher ended this generation.

        Rank 0 asks the launcher's store (one round trip) and broadcasts the answer
        (8 bytes), so all ranks leave at the same commit. A no-op outside an elastic job.
        """
        if _rendezvous is None or not api.is_initialized():
            return
        comm = api.communicator()
        changing = np.zeros(1, np.int64)
        if comm.rank == 0:
            changing[0] = _rendezvous.world_changing()
        if comm.size > 1:
            comm.broadcast(changing, root=0, name="elastic: world changes")
        if changing[0]:
            raise HostsUpdatedInterrupt(
                f"the launcher ends generation {_rendezvous.generation} at this commit"
            )

    def save(self) -> None:
        """Snapshot the attributes (copies: later changes do not touch the snapshot)."""
        self._saved = {name: _copy(getattr(self, name)) for name in self._names}

    def restore(self) -> None:
        """Set the attributes back to the last snapshot; same-shaped numpy arrays are written in place."""
        for name, saved in self._saved.items():
            current = getattr(self, name, None)
            if _same_array(current, saved) and current.flags.writeable:
                np.copyto(current, saved)
            else:
                setattr(self, name, _copy(saved))

    def sync(self) -> None:
        """Make rank 0's last commit every rank's state and commit: restore, broadcast from rank 0, save.

        Arrays of ringcore's dtypes travel as in-place broadcasts, everything else as one pickle.
        """
        self.restore()
        if api.is_initialized() and api.communicator().size > 1:
            self._broadcast_from_root(api.communicator())
        self.save()

    def _broadcast_from_root(self, comm: Communicator) -> None:
        """Overwrite this rank's attributes with rank 0's (subclasses add what they hold)."""
        mine = {name: getattr(self, name) for name in self._names}
        layout = {
            name: ("array", value.shape, value.dtype.str) if _broadcastable(value) else ("value", value)
            for name, value in mine.items()
        }
        layout = broadcast_object(comm, layout if comm.rank == 0 else None, "elastic: state layout")
        for name in sorted(layout):
            kind, *spec = layout[name]
            if kind == "value":
                setattr(self, name, spec[0])
                continue
            shape, dtype = tuple(spec[0]), np.dtype(spec[1])
            target = mine.get(name)
            if not (_broadcastable(target) and target.shape == shape and target.dtype == dtype):
                target = np.empty(shape, dtype)
            comm.broadcast(target, root=0, name=f"elastic: {name}")
            setattr(self, name, target)
        self._names = tuple(layout)

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Functions :meth:`on_reset` calls, in order, after each change of world (e.g. to rescale the LR)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Run the reset callbacks: :func:`run` calls it after each new rendezvous, before ``sync()``."""
        for callback in self._reset_callbacks:
            callback()

    def __repr__(self) -> str:
        values = ", ".join(f"{name}={getattr(self, name)!r}" for name in self._names)
        return f"{type(self).__name__}({values})"


def run(func: F) -> F:
    """Decorate a training function ``func(state, *args, **kwargs)`` to survive changes of world.

    See the module docstring. Returns what ``func`` returns once it returns on this rank.

    Raises:
        ConfigError, AuthenticationError: The ranks of a generation cannot meet (settings
            that differ between workers, secrets that do not match).
        StoreLost: The launcher is gone.
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        state.save()  # what the caller set up since the state was made counts as committed
        if _rendezvous is None:
            if not api.is_initialized():
                api.init()
            state.sync()
            return func(state, *args, **kwargs)
        if not api.is_initialized() or api.communicator() is not _rendezvous.comm:
            api.shutdown()  # e.g. a world of one made by init() before this module was imported
            _rejoin(_rendezvous)
        reset = False
        while True:
            try:
                if reset:
                    state.on_reset()  # TorchState's moves a DistributedOptimizer over: a collective too
                state.sync()
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt as interrupt:
                log.info("elastic: %s", interrupt)
            except RECOVERABLE as err:
                log.warning(
                    "elastic: generation %d failed (%s: %s); rolling back to the last commit",
                    _rendezvous.generation,
                    type(err).__name__,
                    err,
                )
                state.restore()
            _rendezvous.check_in()  # before shutdown: rank 0's store may wait for a stalled peer to leave
            api.shutdown()
            _rejoin(_rendezvous)
            reset = True

    return wrapper  # type: ignore[return-value]


def _rejoin(rendezvous: elastic_rendezvous.Rendezvous) -> None:
    """Join the launcher's next generation, again after each failed attempt (a member that died meanwhile)."""
    while True:
        try:
            api.init()
            return
        except PERMANENT:
            raise
        except RingcoreError as err:  # a member died or stalled while the generation met
            log.warning(
                "elastic: generation %d did not form (%s); trying the next", rendezvous.generation, err
            )
            rendezvous.check_in()


def broadcast_object(comm: Communicator, obj: Any, name: str) -> Any:
    """Rank 0's ``obj`` on every rank, through pickle (length, then bytes)."""
    payload = np.frombuffer(pickle.dumps(obj), np.uint8) if comm.rank == 0 else np.empty(0, np.uint8)
    length = np.array([payload.size], np.int64)
    comm.broadcast(length, root=0, name=name)
    data = payload.copy() if comm.rank == 0 else np.empty(int(length[0]), np.uint8)
    comm.broadcast(data, root=0, name=name)
    return obj if comm.rank == 0 else pickle.loads(data.tobytes())


def _broadcastable(value: Any) -> bool:
    """A numpy array ringcore can broadcast in place (its dtypes; bool, complex, object travel pickled)."""
    return isinstance(value, np.ndarray) and value.dtype.kind in "iuf" and value.dtype.itemsize <= 8


def _same_array(current: Any, saved: Any) -> bool:
    return (
        isinstance(current, np.ndarray)
        and isinstance(saved, np.ndarray)
        and current.shape == saved.shape
        and current.dtype == saved.dtype
    )


def _copy(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return np.array(value, copy=True, order="C")
    return copy.deepcopy(value)
