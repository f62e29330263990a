"""Pytrees <-> one flat buffer per dtype: the fusion every collective of ``ringcore.jax`` runs on.

A gradient tree has tens of small leaves; one collective per leaf would pay
ringcore's per-call cost (a ticket, a descriptor check with the peers, a
schedule) tens of times. Instead the leaves are grouped by dtype, in the order
``jax.tree_util`` flattens them (the same on every rank that passes the same
structure), each group is packed into one flat buffer, each buffer is reduced
once, and the results are split back into the tree. The same :class:`Packing`
packs with numpy (eager arrays, on the host) or with ``jax.numpy`` (traced
arrays, inside ``jax.jit``, where XLA fuses the concatenation).

Eagerly, packing costs nothing extra: the packed host buffer is the copy a
reduction needs anyway (jax arrays are immutable) and the results are views
of it. Inside ``jax.jit`` it costs two passes over memory (XLA concatenates
before the callback and slices after it), which small leaves win back and
large ones do not: there, a leaf of ``TRACED_FUSE_BELOW`` bytes or more
travels in a buffer of its own (still in the call's one callback; measured:
``bench/HISTORY.md``, "ringcore.jax: one allreduce per dtype, not one per leaf").

Every leaf is checked here, before anything is sent: it must be an array
(jax or numpy) of a dtype ringcore reduces.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from ringcore.buffers import DTYPES, SUPPORTED

TRACED_FUSE_BELOW = 256 << 10  # bytes: inside jax.jit, larger leaves are not packed with others


@dataclasses.dataclass(frozen=True)
class Group:
    """Leaves of one dtype packed together into one flat buffer (or one large leaf alone).

    Attributes:
        dtype: the leaves' dtype (numpy's, ``ml_dtypes.bfloat16`` for bfloat16).
        indices: positions of the leaves in the flattened tree.
        shapes: their shapes, in the same order.
    """

    dtype: np.dtype
    indices: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]

    @property
    def count(self) -> int:
        """Elements in the packed buffer."""
        return sum(_size(shape) for shape in self.shapes)

    @property
    def offsets(self) -> list[int]:
        """Where each leaf but the first starts in the packed buffer."""
        return list(itertools.accumulate(_size(shape) for shape in self.shapes[:-1]))


@dataclasses.dataclass(frozen=True)
class Packing:
    """How a pytree's leaves map to flat buffers, one per dtype.

    Attributes:
        treedef: the tree's structure, to rebuild it.
        groups: one :class:`Group` per dtype (and, traced, per large leaf), in order of first appearance.
        traced: some leaf is a tracer (inside ``jax.jit``, ``grad``, ``vmap``...).
    """

    treedef: Any
    groups: tuple[Group, ...]
    traced: bool

    def pack(self, leaves: Sequence[Any], xp: Any) -> list[Any]:
        """One flat array per group, built with ``xp``: new, writable ones with numpy; traced with jax.numpy."""
        flats = []
        for group in self.groups:
            parts = [xp.ravel(leaves[i]) for i in group.indices]
            flats.append(parts[0] if len(parts) == 1 and xp is not np else xp.concatenate(parts))
        return flats

    def unpack(self, flats: Sequence[Any], xp: Any) -> list[Any]:
        """The leaves (in tree order) cut out of ``flats``, one flat array per group."""
        leaves: list[Any] = [None] * sum(len(group.indices) for group in self.groups)
        for group, flat in zip(self.groups, flats, strict=True):
            pieces = xp.split(flat, group.offsets)
            for i, shape, piece in zip(group.indices, group.shapes, pieces, strict=True):
                leaves[i] = piece.reshape(shape)
        return leaves

    def unflatten(self, leaves: Sequence[Any]) -> Any:
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


def packing(tree: Any, what: str) -> tuple[Packing, list[Any]]:
    """The :class:`Packing` of ``tree`` and its leaves, after checking every leaf.

    Raises:
        TypeError: a leaf is not a jax or numpy array, or has a dtype ringcore cannot reduce.
    """
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = [leaf for _, leaf in paths_leaves]
    dtypes = [_checked_dtype(leaf, path, what) for path, leaf in paths_leaves]
    traced = any(isinstance(leaf, jax.core.Tracer) for leaf in leaves)
    by_key: dict[Any, list[int]] = {}  # dtype, or a large leaf's own index
    for i, (leaf, dtype) in enumerate(zip(leaves, dtypes, strict=True)):
        alone = traced and _size(np.shape(leaf)) * dtype.itemsize >= TRACED_FUSE_BELOW
        by_key.setdefault(i if alone else dtype, []).append(i)
    groups = tuple(
        Group(dtypes[indices[0]], tuple(indices), tuple(tuple(np.shape(leaves[i])) for i in indices))
        for indices in by_key.values()
    )
    return Packing(treedef, groups, traced), leaves


def _describe(path: Sequence[Any]) -> str:
    """How messages name a leaf: ``leaf ['w1']``, or ``x`` for a bare array."""
    return f"leaf {jax.tree_util.keystr(tuple(path))}" if path else "x"


def _checked_dtype(leaf: Any, path: Sequence[Any], what: str) -> np.dtype:
    if not isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
        raise TypeError(
            f"{what}: {_describe(path)} is a {type(leaf).__name__}, not an array; "
            "pass jax arrays (or numpy arrays), or a pytree of them"
        )
    dtype = np.dtype(leaf.dtype)
    if dtype.name not in DTYPES:
        raise TypeError(
            f"{what}: {_describe(path)} has dtype {dtype}, which ringcore cannot reduce; supported: {SUPPORTED}"
        )
    return dtype


def _size(shape: Sequence[int]) -> int:
    return int(np.prod(shape, dtype=np.int64))
