"""The host side: ringcore's collectives on numpy buffers, for eager calls and for ``io_callback``.

Everything here runs on the default communicator (``ringcore.communicator()``,
looked up at each call, so a jitted function still works after
``shutdown()`` and ``init()`` again) and takes numpy arrays this module may
write: the flat buffers :class:`~ringcore.jax.trees.Packing` built, or the
copies :mod:`ringcore.jax.traced` made of what XLA handed its callback. Each
function returns new or reduced numpy arrays; turning them into jax arrays is
the caller's job.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

import ringcore
from ringcore.ops import Compression, ReduceOp


def allreduce(flats: Sequence[np.ndarray], op: ReduceOp, compression: Compression, name: str | None) -> list:
    """Reduce each writable flat buffer in place, in order; returns them."""
    comm = ringcore.communicator()
    for flat in flats:
        comm.allreduce(flat, op=op, compression=compression, name=_label(name, flat, flats))
    return list(flats)


def broadcast(flats: Sequence[np.ndarray], root: int, name: str | None) -> list:
    """Root's ``flats`` on every rank: the root sends its own (read-only is fine), others receive into new ones."""
    comm = ringcore.communicator()
    out = []
    for flat in flats:
        buf = flat if comm.rank == root else np.empty(flat.shape, flat.dtype)
        comm.broadcast(buf, root=root, name=_label(name, flat, flats))
        out.append(buf)
    return out


def sum_to_root(flats: Sequence[np.ndarray], root: int, name: str | None) -> list:
    """The sum over ranks on ``root``, zeros elsewhere (in place): the adjoint of :func:`broadcast`."""
    out = allreduce(flats, ReduceOp.SUM, Compression.NONE, name)
    if ringcore.communicator().rank != root:
        for flat in out:
            flat[...] = 0
    return out


def allgather(x: np.ndarray, name: str | None) -> np.ndarray:
    """Every rank's ``x`` concatenated on axis 0 (first dimensions may differ); a new array."""
    return ringcore.communicator().allgather(x, name=name)


def allgather_rows(x: np.ndarray, rows: Sequence[int], name: str | None) -> np.ndarray:
    """:func:`allgather` where every rank was told each rank's first dimension (``rows``).

    Every rank first gathers what every rank passed and expected, so all of
    them make the same decision: either all go on, or all raise, naming the
    first dimensions, instead of some waiting in a collective the others left.

    Raises:
        ValueError: on every rank, when a rank's ``rows`` is not what the ranks passed.
    """
    claims = np.array([[x.shape[0], *rows]], np.int64)
    seen = allgather(claims, None if name is None else f"{name}.rows")
    passed = [int(n) for n in seen[:, 0]]
    if any(list(expected) != passed for expected in seen[:, 1:].tolist()):
        raise ValueError(
            f"allgather: ranks passed first dimensions {passed}, but expected "
            f"{seen[:, 1:].tolist()} (by rank); inside jax.jit outputs need static shapes: pass the "
            "same shape on every rank, or allgather(x, rows=[first dimension of each rank])"
        )
    return allgather(x, name)


def slice_of_sum(g: np.ndarray, rows: Sequence[int], name: str | None) -> np.ndarray:
    """This rank's rows of the sum over ranks of ``g`` (in place): the adjoint of :func:`allgather_rows`."""
    comm = ringcore.communicator()
    comm.allreduce(g, op=ReduceOp.SUM, name=name)
    start = sum(rows[: comm.rank])
    return g[start : start + rows[comm.rank]]


def _label(name: str | None, flat: np.ndarray, flats: Sequence[np.ndarray]) -> str | None:
    """``name``, with the dtype when a pytree of several dtypes makes several collectives."""
    return f"{name}.{flat.dtype}" if name is not None and len(flats) > 1 else name
