"""ringcore.jax: ringcore's collectives on jax arrays and pytrees, eagerly and inside ``jax.jit``.

>>> import jax, jax.numpy as jnp, ringcore.jax as rj
>>> rj.init()                                       # ringcore.init(): rank/size from the launcher
>>> grads = {"w": jnp.ones((64, 32)), "b": jnp.zeros(32)}
>>> grads = rj.allreduce(grads, op="avg")           # new arrays: jax arrays are immutable
>>> step = jax.jit(lambda g: rj.allreduce(g, op="avg"))   # the same, inside jit

Design.

- One communicator: every function runs on ``ringcore.init()``'s default
  communicator, looked up at each call. ``init``, ``shutdown``, ``rank``...
  are ringcore's, re-exported. ``import ringcore`` never imports jax; this
  package does.
- Fusion (:mod:`~ringcore.jax.trees`): a pytree's leaves of one dtype are
  packed into one flat buffer and reduced once, so a gradient tree costs one
  collective per dtype instead of one per leaf. Inside ``jax.jit``, leaves of
  256 KiB or more go alone, since XLA's packing copies cost them more than it
  saves (measured: ``bench/HISTORY.md``, "ringcore.jax: one allreduce per
  dtype").
- Eager arrays (:mod:`~ringcore.jax.api`, :mod:`~ringcore.jax.host`): jax
  arrays are immutable, and so is any view of one (``np.asarray`` of a CPU
  array, or its DLPack export), so an in-place reduction needs one host copy
  either way: the packed buffer is that copy. The results are cut out of it
  and go back to each input's device (its sharding when it had one placed),
  aliased rather than copied where jax can (``device_put(may_alias=True)``).
  A broadcast's root returns its input as it is, and receivers fill a new
  buffer; allgather sends a read-only view of its input. Arrays on
  accelerators take the same host route. Before an eager collective,
  ``jax.effects_barrier()`` lets collectives of jitted calls still in flight
  finish first, so every rank runs them in the order it called them (on the
  CPU backend jax returns from such a call only after its callbacks ran; the
  barrier is for asynchronous backends).
- Traced arrays (:mod:`~ringcore.jax.traced`): ``jax.experimental.io_callback(...,
  ordered=True)``, which runs exactly once per call, in program order; not
  ``pure_callback``, which jax may repeat, drop or reorder: a deadlock across
  ranks. The packing is done by XLA; the callback makes the host copy.
  ``vmap`` works (custom batching rules); reverse-mode differentiation works
  for allreduce ``sum``/``avg`` (the VJP is the same allreduce of the
  cotangents), broadcast and allgather; ``min``/``max``/``prod`` raise a
  ``TypeError`` when differentiated; forward mode (``jvp``) is unsupported.
  Inside ``jax.jit``, allgather needs every rank's first dimension at trace
  time (the same shape everywhere, or ``rows=``). A ringcore error inside a
  jitted call reaches the caller as jax's runtime error with ringcore's message.

Every rank must call the same collectives, in the same order, with the same
tree structure, shapes and dtypes (as with ringcore itself).
"""

from ringcore import init, is_initialized, local_rank, local_size, rank, shutdown, size
from ringcore.jax.api import allgather, allreduce, broadcast

__all__ = [
    "allgather",
    "allreduce",
    "broadcast",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "rank",
    "shutdown",
    "size",
]
