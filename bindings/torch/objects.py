"""Picklable objects over the communicator: ``broadcast_object``, ``allgather_object``, model layouts.

An object travels as its pickle: a broadcast sends the length, then the
bytes; an allgather gathers every rank's length, then the bytes (ragged).
A rank may take part in an allgather without an object (``join()`` does):
it sends no bytes, and nothing of it appears in the result.

:func:`check_same_layout` compares a list of ``(name, shape, dtype)`` across
ranks with one 8-byte allgather, and only when the digests differ gathers
the lists themselves to say which entry differs where (``MismatchError`` on
every rank).
"""

from __future__ import annotations

import hashlib
import pickle
from typing import Any

import numpy as np

from ringcore.comm import Communicator
from ringcore.descriptor import rank_list
from ringcore.errors import MismatchError

_ABSENT = object()


def broadcast_object(comm: Communicator, obj: Any, root: int, name: str | None = None) -> Any:
    """``root``'s ``obj`` on every rank (a copy, through pickle)."""
    if comm.size == 1:
        return obj
    payload = np.frombuffer(pickle.dumps(obj), np.uint8) if comm.rank == root else None
    length = np.array([0 if payload is None else payload.size], np.int64)
    comm.broadcast(length, root=root, name=name)
    data = payload.copy() if payload is not None else np.empty(int(length[0]), np.uint8)
    comm.broadcast(data, root=root, name=name)
    return obj if comm.rank == root else pickle.loads(data.tobytes())


def allgather_object(comm: Communicator, obj: Any = _ABSENT, name: str | None = None) -> list[Any]:
    """Every rank's ``obj``, in rank order; ranks that pass none (``join()``) are left out."""
    payload = np.frombuffer(pickle.dumps(obj), np.uint8) if obj is not _ABSENT else np.empty(0, np.uint8)
    if comm.size == 1:
        return [] if obj is _ABSENT else [obj]
    lengths = comm.allgather(np.array([payload.size], np.int64), name=name)
    data = comm.allgather(payload, name=name)
    out, start = [], 0
    for length in lengths.tolist():
        if length:
            out.append(pickle.loads(data[start : start + length].tobytes()))
        start += length
    return out


Layout = list[tuple[str, tuple[int, ...], str]]


def check_same_layout(comm: Communicator, layout: Layout, what: str) -> None:
    """Raise ``MismatchError`` on every rank unless every rank passed the same ``layout``.

    Args:
        layout: ``(name, shape, dtype)`` of each tensor, in the order the ranks will reduce them.
        what: the caller, for the message (``"DistributedOptimizer"``).
    """
    if comm.size == 1:
        return
    digest = hashlib.blake2b(repr(layout).encode(), digest_size=8).digest()
    mine = np.frombuffer(digest, np.int64).copy()
    if len(set(comm.allgather(mine, name=f"{what}: layout").tolist())) == 1:
        return
    layouts = allgather_object(comm, layout, name=f"{what}: layouts")
    raise MismatchError(f"{what}: the ranks' models differ: {describe_difference(layouts)}")


def describe_difference(layouts: list[Layout]) -> str:
    """The first entry where the ranks' layouts differ, naming the ranks on each side."""
    longest = max(len(layout) for layout in layouts)
    for index in range(longest):
        seen: dict[Any, list[int]] = {}
        for rank, layout in enumerate(layouts):
            seen.setdefault(layout[index] if index < len(layout) else None, []).append(rank)
        if len(seen) > 1:
            return "; ".join(_entry(entry, ranks) for entry, ranks in seen.items())
    return "the same tensors in a different order"


def _entry(entry: Any, ranks: list[int]) -> str:
    if entry is None:
        return f"{rank_list(ranks)} {'have' if len(ranks) > 1 else 'has'} no more tensors"
    name, shape, dtype = entry
    return f"{rank_list(ranks)}: {name!r} of shape {tuple(shape)} ({dtype})"
