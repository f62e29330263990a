"""``allreduce``, ``broadcast``, ``allgather`` on jax arrays and pytrees: check, then run eagerly or traced.

Every function checks all its arguments first (``TypeError``/``ValueError``,
or ``RingcoreError`` before ``ringcore.init()``), so a bad call sends nothing.
Then it takes one of two routes: traced arguments (inside ``jax.jit``,
``grad``, ``vmap``...) go through :mod:`ringcore.jax.traced`'s ordered
``io_callback``; concrete ones are copied to the host, reduced by
:mod:`ringcore.jax.host` and put back on the input's device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import ringcore
from ringcore.jax import host, traced, trees
from ringcore.ops import Compression, ReduceOp
from ringcore.plans import validate


def allreduce(x: Any, op: Any = "sum", compression: Any = None, name: str | None = None) -> Any:
    """Reduce ``x`` (a jax array or a pytree of them) over all ranks; returns new arrays.

    The leaves of one dtype travel as one flat buffer, reduced once (fusion):
    a gradient tree costs one collective per dtype, not one per leaf.

    Args:
        x: a jax (or numpy) array, or a pytree of them: the same structure,
            shapes and dtypes on every rank.
        op: ``"sum"``, ``"avg"``, ``"min"``, ``"max"``, ``"prod"`` or a ``ringcore.ReduceOp``.
        compression: ``None`` or ``"fp16"`` (float16 on the wire, see ``ringcore.allreduce``).
        name: a label for ringcore's timeline and stall warnings.

    Returns:
        ``x``'s structure holding the reduced jax arrays (traced inside ``jax.jit``).

    Raises:
        TypeError, ValueError: a leaf that is not an array, a dtype ringcore
            cannot reduce (bool, complex...), an unknown op, ``avg`` or
            ``fp16`` on integers; before anything is sent.
        RingcoreError: ``ringcore.init()`` was not called; or what
            ``ringcore.allreduce`` raises (inside ``jax.jit``, such errors
            reach the caller as jax's runtime error, carrying ringcore's message).
    """
    ringcore.communicator()
    packing, leaves = trees.packing(x, "allreduce")
    reduce_op, comp = _checked_reduction(packing, op, compression)
    if not packing.groups:
        return x
    if packing.traced:
        flats = traced.allreduce(packing.pack(leaves, jnp), reduce_op, comp, name)
        return packing.unflatten(packing.unpack(flats, jnp))
    jax.effects_barrier()  # collectives of jitted calls still running come first, as they were called first
    flats = host.allreduce(packing.pack(leaves, np), reduce_op, comp, name)
    return _to_jax(packing, flats, leaves)


def broadcast(x: Any, root: int = 0, name: str | None = None) -> Any:
    """``root``'s ``x`` (a jax array or a pytree of them) on every rank; new arrays.

    Fused by dtype like :func:`allreduce`. On the root, the result is ``x``
    itself (jax arrays are immutable; numpy leaves become jax arrays).

    Args:
        x: the same structure, shapes and dtypes on every rank (only the root's values matter).
        root: the rank whose values everyone receives.
        name: a label for ringcore's timeline and stall warnings.

    Raises:
        TypeError, ValueError: bad leaves, or a root that is not a rank; before anything is sent.
        RingcoreError: ``ringcore.init()`` was not called; or what ``ringcore.broadcast`` raises.
    """
    comm = ringcore.communicator()
    packing, leaves = trees.packing(x, "broadcast")
    validate.check_root(root, comm.size, "broadcast")
    if not packing.groups:
        return x
    if packing.traced:
        flats = traced.broadcast(packing.pack(leaves, jnp), int(root), name)
        return packing.unflatten(packing.unpack(flats, jnp))
    jax.effects_barrier()
    if comm.rank == root:
        host.broadcast(packing.pack(leaves, np), root, name)
        return packing.unflatten(
            [leaf if isinstance(leaf, jax.Array) else jnp.array(leaf) for leaf in leaves]
        )
    flats = host.broadcast([np.empty(group.count, group.dtype) for group in packing.groups], root, name)
    return _to_jax(packing, flats, leaves)


def allgather(x: Any, name: str | None = None, rows: Sequence[int] | None = None) -> jax.Array:
    """Every rank's ``x`` concatenated on axis 0, in rank order; a new array.

    Eagerly, first dimensions may differ between ranks. Inside ``jax.jit`` the
    output shape must be known when tracing: every rank passes the same shape,
    or ``rows`` lists each rank's first dimension. Inside ``jax.jit``, or
    given ``rows``, the ranks first check together what each passed (one
    small extra collective), so a wrong shape fails on every rank instead of
    leaving some waiting.

    Args:
        x: one jax (or numpy) array with at least one dimension; trailing
            dimensions and dtype the same on every rank.
        name: a label for ringcore's timeline and stall warnings.
        rows: every rank's first dimension, by rank (optional).

    Raises:
        TypeError, ValueError: not one array, 0-d, a bad dtype, or ``rows``
            that does not fit this rank's ``x``; before anything is sent.
        RingcoreError: ``ringcore.init()`` was not called; or what ``ringcore.allgather`` raises.
    """
    comm = ringcore.communicator()
    packing, leaves = trees.packing(x, "allgather")
    if len(leaves) != 1 or not jax.tree_util.treedef_is_leaf(packing.treedef):
        raise TypeError(f"allgather takes one array, got a {type(x).__name__}; gather each leaf on its own")
    shape = tuple(np.shape(x))
    empty = validate.as_buffer(
        np.empty((0, *shape[1:]) if shape else (), np.dtype(x.dtype)), writable=False, what="allgather input"
    )
    validate.rows(empty, "allgather")  # a bad dtype or a 0-d array: refused before anything is sent
    checked = None if rows is None else _checked_rows(rows, shape[0], comm.rank, comm.size)
    if packing.traced:
        return traced.allgather(x, checked or (shape[0],) * comm.size, name)
    jax.effects_barrier()
    if checked is None:
        return _on_device(host.allgather(np.asarray(x), name), x)
    return _on_device(host.allgather_rows(np.asarray(x), checked, name), x)


def _checked_reduction(packing: trees.Packing, op: Any, compression: Any) -> tuple[ReduceOp, Compression]:
    """``op`` and ``compression`` parsed and checked against every group's dtype, as ringcore checks them."""
    for group in packing.groups:
        validate.check_allreduce(np.empty(0, group.dtype), op, compression)
    return ReduceOp.parse(op), Compression.parse(compression)


def _checked_rows(rows: Sequence[int], mine: int, rank: int, size: int) -> tuple[int, ...]:
    if (
        isinstance(rows, (str, bytes))
        or not hasattr(rows, "__iter__")
        or not all(isinstance(n, (int, np.integer)) and not isinstance(n, bool) for n in rows)
    ):
        raise TypeError(f"allgather: rows must be a sequence of ints, got {rows!r}")
    checked = tuple(int(n) for n in rows)
    if len(checked) != size or any(n < 0 for n in checked) or checked[rank] != mine:
        raise ValueError(
            f"allgather: rows must list {size} first dimensions, one per rank, with rank {rank}'s "
            f"equal to its x.shape[0] = {mine}; got {list(checked)}"
        )
    return checked


def _to_jax(packing: trees.Packing, flats: list[np.ndarray], leaves: list[Any]) -> Any:
    """The tree of jax arrays cut out of the reduced host ``flats``, each on its input leaf's device.

    The pieces are host buffers of ours, so jax may keep them instead of
    copying (``may_alias``); those bound for the default device go in one
    ``device_put`` (per-call overhead is most of a small tree's time).
    """
    pieces = packing.unpack(flats, np)
    placed: list[Any] = [None] * len(pieces)
    default = []
    for i, (piece, leaf) in enumerate(zip(pieces, leaves, strict=True)):
        target = _placement(piece, leaf)
        if target is None:
            default.append(i)
        else:
            placed[i] = jax.device_put(piece, target, may_alias=True)
    for i, array in zip(default, jax.device_put([pieces[i] for i in default], may_alias=True), strict=True):
        placed[i] = array
    return packing.unflatten(placed)


def _on_device(result: np.ndarray, like: Any) -> jax.Array:
    """``result`` (a host buffer of ours, so jax may keep it) on ``like``'s device."""
    return jax.device_put(result, _placement(result, like), may_alias=True)


def _placement(result: np.ndarray, like: Any) -> Any:
    """Where ``result`` goes: ``like``'s sharding or device if it was placed there on purpose, else None."""
    if isinstance(like, jax.Array) and like.committed:
        if like.shape == result.shape:
            return like.sharding
        if len(like.devices()) == 1:
            return next(iter(like.devices()))
    return None
