"""``join()``: a rank out of data keeps serving the others' collectives with zeros, as Horovod's does.

ringcore has no coordinator that negotiates each tensor (Horovod's does, every
cycle), so a rank inside ``join()`` learns what the others are about to do
from an *announcement*: before each of its collectives, ``ringcore.torch``
allreduces (sum) a small int64 vector, the **control vector**:

    [1, kind, dtype, op, compression, root or optimizer id, ndim, dim0 ... dim9]

A rank in ``join()`` loops on the same allreduce contributing zeros. The sum's
first element counts the ranks still active; the rest, divided by it, is the
call every active rank is making (they must agree anyway, and if they do not,
the call itself fails with ``MismatchError`` on every rank). The joined rank
then makes that call with zeros of that shape (an allreduce), with no rows
(an allgather, so nothing of it appears), or as a receiver (a broadcast). An
optimizer step is one announcement for all its buckets: the joined rank
replays the buckets of the same ``DistributedOptimizer`` (ranks build the same
buckets in the same order, see :mod:`ringcore.torch.fusion`). When the first
element is 0 every rank has joined, and ``join()`` returns on all of them
the rank that joined last. ``Average`` still divides by the world size, so
joined ranks count as zeros, as in Horovod.

Cost: one 128-byte allreduce per collective (per optimizer step for the
gradients), issued on the same path as the collective (async with async
ones), whether or not a rank ever joins: a few tens of microseconds on
loopback, nothing next to a training step.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from ringcore.comm import Communicator
from ringcore.errors import MismatchError, RingcoreError
from ringcore.ops import Compression as WireCompression
from ringcore.ops import ReduceOp
from ringcore.torch import objects
from ringcore.torch.tensors import DTYPES, for_ringcore

KINDS = ("allreduce", "allgather", "broadcast", "reduce_scatter", "barrier", "objects", "step")
_OPS = tuple(ReduceOp)
_COMPRESSIONS = tuple(WireCompression)
_MAX_DIMS = 10
_LENGTH = 7 + _MAX_DIMS
_NAME = "join: announce"


@dataclasses.dataclass(frozen=True)
class Call:
    """One collective as every rank makes it: what a joined rank needs to make it too.

    ``ident`` is the root of a broadcast (``kind="objects"``: root, or -1 for an
    allgather of objects) or the optimizer of a ``"step"``.
    """

    kind: str
    dtype: torch.dtype = torch.uint8
    shape: tuple[int, ...] = ()
    op: ReduceOp = ReduceOp.SUM
    compression: WireCompression = WireCompression.NONE
    ident: int = 0


class Stepper(Protocol):
    """What a joined rank replays for an optimizer's step: its buckets' allreduces, with zeros."""

    def replay_with_zeros(self, comm: Communicator) -> None: ...


@dataclasses.dataclass
class _State:
    joined: bool = False
    rounds: int = 0  # announcements so far: the same count on every rank
    steppers: dict[int, weakref.ref[Stepper]] = dataclasses.field(default_factory=dict)


_states: weakref.WeakKeyDictionary[Communicator, _State] = weakref.WeakKeyDictionary()


def _state(comm: Communicator) -> _State:
    state = _states.get(comm)
    if state is None:
        state = _states[comm] = _State()
    return state


def register_stepper(comm: Communicator, stepper: Stepper) -> int:
    """A number for ``stepper`` (the same on every rank when made in the same order)."""
    state = _state(comm)
    ident = len(state.steppers)
    state.steppers[ident] = weakref.ref(stepper)
    return ident


def announce(comm: Communicator, call: Call, blocking: bool = True) -> None:
    """Tell ranks inside ``join()`` about ``call``, which this rank makes next.

    Raises:
        ValueError: a shape with more than 10 dimensions.
        RingcoreError: this rank is inside ``join()`` (from another thread).
    """
    if comm.size == 1:
        return
    state = _state(comm)
    if state.joined:
        raise RingcoreError(f"{call.kind}: this rank is inside join(), which must return first")
    vector = encode(call)
    if blocking:
        comm.allreduce(vector, name=_NAME)
    else:
        comm.allreduce_async(vector, name=_NAME)
    state.rounds += 1


def join(comm: Communicator) -> int:
    """Serve the other ranks' collectives until every rank has joined; the rank that joined last."""
    if comm.size == 1:
        return comm.rank
    state = _state(comm)
    joined_at = state.rounds
    state.joined = True
    try:
        while True:
            vector = np.zeros(_LENGTH, np.int64)
            comm.allreduce(vector, name=_NAME)
            state.rounds += 1
            active = int(vector[0])
            if active == 0:
                break
            _replay(comm, state, decode(vector // active))
    finally:
        state.joined = False
    last = np.array([joined_at * comm.size + comm.rank], np.int64)
    comm.allreduce(last, op="max", name="join: last")
    return int(last[0]) % comm.size


def encode(call: Call) -> np.ndarray:
    if len(call.shape) > _MAX_DIMS:
        raise ValueError(f"{call.kind}: tensors of more than {_MAX_DIMS} dimensions are not supported")
    vector = np.zeros(_LENGTH, np.int64)
    vector[:7] = (
        1,
        KINDS.index(call.kind),
        DTYPES.index(call.dtype),
        _OPS.index(call.op),
        _COMPRESSIONS.index(call.compression),
        call.ident,
        len(call.shape),
    )
    vector[7 : 7 + len(call.shape)] = call.shape
    return vector


def decode(vector: np.ndarray) -> Call:
    kind, dtype, op, compression, ident, ndim = (int(v) for v in vector[1:7])
    return Call(
        KINDS[kind],
        DTYPES[dtype],
        tuple(int(n) for n in vector[7 : 7 + ndim]),
        _OPS[op],
        _COMPRESSIONS[compression],
        ident,
    )


def _replay(comm: Communicator, state: _State, call: Call) -> None:
    """Make ``call`` as a rank with nothing to contribute."""
    zeros = torch.zeros(call.shape, dtype=call.dtype)
    if call.kind == "allreduce":
        comm.allreduce(for_ringcore(zeros), op=call.op, compression=call.compression, name="join")
    elif call.kind == "allgather":
        comm.allgather(for_ringcore(torch.zeros((0, *call.shape[1:]), dtype=call.dtype)), name="join")
    elif call.kind == "reduce_scatter":
        comm.reduce_scatter(for_ringcore(zeros), op=call.op, compression=call.compression, name="join")
    elif call.kind == "barrier":
        comm.barrier()
    elif call.kind == "broadcast":
        _receive(comm, call.ident, lambda buf: comm.broadcast(buf, root=call.ident, name="join"), zeros)
    elif call.kind == "objects" and call.ident < 0:
        objects.allgather_object(comm, name="join")
    elif call.kind == "objects":
        _receive(comm, call.ident, lambda _: objects.broadcast_object(comm, None, call.ident), zeros)
    else:
        stepper = state.steppers.get(call.ident)
        if stepper is None or stepper() is None:
            raise RingcoreError(
                f"join(): the other ranks step DistributedOptimizer #{call.ident}, which this rank "
                "does not have; make the same optimizers on every rank"
            )
        stepper().replay_with_zeros(comm)  # type: ignore[union-attr]


def _receive(comm: Communicator, root: int, run: Callable[[Any], Any], zeros: torch.Tensor) -> None:
    """A broadcast's receiving side; a joined root cannot send, so every rank fails instead."""
    if root != comm.rank:
        run(for_ringcore(zeros))
        return
    try:  # the shapes differ on purpose: every rank raises MismatchError instead of waiting
        comm.broadcast(np.zeros(0, np.uint8), root=root, name="join: root has joined")
    except MismatchError as err:
        raise RingcoreError(
            f"broadcast from root {root}: this rank had already called join(), so it has nothing "
            "to send; broadcast from a rank that has not joined"
        ) from err
