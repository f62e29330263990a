"""Collectives on traced arrays (inside ``jax.jit``, ``grad``, ``vmap``): ordered ``io_callback`` and its rules.

Why ``io_callback(..., ordered=True)``. A collective must run exactly once per
call, on every rank, in program order: rank 0's first allreduce meets rank 1's
first allreduce. ``pure_callback`` promises none of that (XLA may drop it when
its result looks unused, run it twice, or reorder it against the others), and
an unordered ``io_callback`` may still be reordered: either is a deadlock or a
``MismatchError`` across ranks. An ordered ``io_callback`` is a side effect
that runs once, in program order, even when its result is unused.

What jax cannot do with it, and the rules given here instead:

- ``jax.vmap``: jax refuses to batch an ordered callback. Allreduce and
  broadcast act element by element, so the batched call is the same
  collective on the batched array (``custom_vmap``); allgather moves the batch
  axis behind the gathered one and back.
- Differentiation: jax has no JVP for an io_callback. With the global
  objective the sum of every rank's loss, the VJP of a sum-allreduce is a
  sum-allreduce of the cotangents and that of an avg-allreduce an
  avg-allreduce (as in Horovod); broadcast's is the sum of the cotangents on
  the root and zeros elsewhere (whose VJP is broadcast again); allgather's is
  this rank's rows of the summed cotangents. ``min``, ``max`` and ``prod``
  raise a ``TypeError`` when differentiated. Reverse mode only (``grad``,
  ``vjp``); forward mode (``jvp``, ``jacfwd``) is refused by jax.

The callbacks receive XLA's buffers as read-only arrays; each makes the one
host copy ringcore reduces in place (a broadcast's root sends its input as it
is, receivers fill a new buffer), and XLA copies the result back.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap
from jax.experimental import io_callback

import ringcore
from ringcore.jax import host
from ringcore.ops import Compression, ReduceOp

_CACHE = 1024  # (op, compression, name...) combinations whose wrapped functions are kept


def allreduce(flats: Sequence[jax.Array], op: ReduceOp, compression: Compression, name: str | None) -> tuple:
    """``host.allreduce`` of each traced flat buffer, in one ordered callback."""
    return _allreduce_fn(op, compression, name)(*flats)


def broadcast(flats: Sequence[jax.Array], root: int, name: str | None) -> tuple:
    """``host.broadcast`` of each traced flat buffer, in one ordered callback."""
    return _broadcast_fn(root, name)(*flats)


def allgather(x: jax.Array, rows: tuple[int, ...], name: str | None) -> jax.Array:
    """``host.allgather_rows``: ``rows`` (every rank's first dimension) gives the static output shape."""
    return _allgather_fn(rows, name)(x)


# ------------------------------------------------------------------ one function per collective


@functools.lru_cache(maxsize=_CACHE)
def _allreduce_fn(op: ReduceOp, compression: Compression, name: str | None) -> Callable[..., tuple]:
    def callback(*flats: Any) -> list:
        return host.allreduce([np.array(f, copy=True) for f in flats], op, compression, name)

    fn = _elementwise(callback)
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        return _with_vjp(fn, lambda: _allreduce_fn(op, compression, name))
    return _not_differentiable(fn, f"allreduce(op={op.value!r})")


@functools.lru_cache(maxsize=_CACHE)
def _broadcast_fn(root: int, name: str | None) -> Callable[..., tuple]:
    def callback(*flats: Any) -> list:
        return host.broadcast([np.asarray(f) for f in flats], root, name)

    return _with_vjp(_elementwise(callback), lambda: _sum_to_root_fn(root, name))


@functools.lru_cache(maxsize=_CACHE)
def _sum_to_root_fn(root: int, name: str | None) -> Callable[..., tuple]:
    def callback(*flats: Any) -> list:
        return host.sum_to_root([np.array(f, copy=True) for f in flats], root, name)

    return _with_vjp(_elementwise(callback), lambda: _broadcast_fn(root, name))


@functools.lru_cache(maxsize=_CACHE)
def _allgather_fn(rows: tuple[int, ...], name: str | None) -> Callable[[jax.Array], jax.Array]:
    def callback(x: Any) -> np.ndarray:
        return host.allgather_rows(np.asarray(x), rows, name)

    fn = jax.custom_vjp(_by_rows(callback, sum(rows)))

    def bwd(_: None, g: jax.Array) -> tuple:
        return (
            _gather_adjoint_fn(rows, ringcore.rank(), name)(g)
            if jnp.issubdtype(g.dtype, jnp.inexact)
            else None,
        )

    fn.defvjp(lambda x: (fn(x), None), bwd)
    return fn


@functools.lru_cache(maxsize=_CACHE)
def _gather_adjoint_fn(
    rows: tuple[int, ...], rank: int, name: str | None
) -> Callable[[jax.Array], jax.Array]:
    def callback(g: Any) -> np.ndarray:
        return host.slice_of_sum(np.array(g, copy=True), rows, name)

    # The output has this rank's rows (rank: at trace time, when allgather checked them against rows).
    return _not_differentiable(_by_rows(callback, rows[rank]), "allgather's gradient")


# ------------------------------------------------------------------ rules jax has no default for


def _ordered(callback: Callable[..., Any], specs: Any, *args: Any) -> Any:
    return io_callback(callback, specs, *args, ordered=True)


def _elementwise(callback: Callable[..., list]) -> Callable[..., tuple]:
    """``callback`` as an ordered effect on arrays that keep their shapes; batched element by element."""

    @custom_vmap
    def fn(*flats: jax.Array) -> tuple:
        specs = [jax.ShapeDtypeStruct(f.shape, f.dtype) for f in flats]
        return tuple(_ordered(callback, specs, *flats))

    @fn.def_vmap
    def rule(axis_size: int, in_batched: Sequence[bool], *flats: jax.Array) -> tuple[tuple, tuple]:
        return fn(*flats), tuple(in_batched)  # unbatched inputs give unbatched outputs

    return fn


def _by_rows(callback: Callable[[Any], np.ndarray], out_rows: int) -> Callable:
    """``callback`` as an ordered effect whose output has ``out_rows`` on axis 0; batched behind it."""

    @custom_vmap
    def fn(x: jax.Array) -> jax.Array:
        spec = jax.ShapeDtypeStruct((out_rows, *x.shape[1:]), x.dtype)
        return _ordered(callback, spec, x)

    @fn.def_vmap
    def rule(axis_size: int, in_batched: Sequence[bool], x: jax.Array) -> tuple[jax.Array, bool]:
        if not in_batched[0]:
            return fn(x), False
        return jnp.moveaxis(fn(jnp.moveaxis(x, 0, 1)), 1, 0), True

    return fn


def _with_vjp(fn: Callable[..., tuple], adjoint: Callable[[], Callable[..., tuple]]) -> Callable[..., tuple]:
    """``fn`` whose VJP is ``adjoint()`` applied to the floating-point cotangents (integers have none)."""
    wrapped = jax.custom_vjp(fn)

    def bwd(_: None, cotangents: tuple) -> tuple:
        inexact = [i for i, g in enumerate(cotangents) if jnp.issubdtype(g.dtype, jnp.inexact)]
        out: list[Any] = [None] * len(cotangents)
        if inexact:
            for i, g in zip(inexact, adjoint()(*(cotangents[i] for i in inexact)), strict=True):
                out[i] = g
        return tuple(out)

    wrapped.defvjp(lambda *flats: (fn(*flats), None), bwd)
    return wrapped


def _not_differentiable(fn: Callable, what: str) -> Callable:
    """``fn``, raising a ``TypeError`` that names ``what`` when jax differentiates it."""
    wrapped = jax.custom_jvp(fn)

    def jvp(primals: tuple, tangents: tuple) -> Any:
        raise TypeError(
            f"ringcore.jax: {what} is not differentiable; only allreduce with op 'sum' or 'avg', "
            "broadcast and allgather have gradients"
        )

    wrapped.defjvp(jvp)
    return wrapped
