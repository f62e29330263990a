"""Tasks the ranks of ``test_jax.py``'s clusters run (``fn(comm, *args)``), and the inputs both sides rebuild.

The ranks fork from a server that has not imported jax: every task imports
it (once per rank; ``JAX_PLATFORMS=cpu`` comes from the cluster's env). Tasks
return numpy arrays, so the test compares them with numpy references.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from tests.bindings import digits

OPS = ("sum", "avg", "min", "max", "prod")
SHAPE = (5, 7)
BATCH, LR, HIDDEN = 96, 0.5, 32  # global batch divisible by 2 and 3: equal shards


def inputs(rank: int, dtype: str) -> np.ndarray:
    """Rank ``rank``'s input: small values (products of 3 stay exact in int32 and float32's range)."""
    rng = np.random.default_rng(100 + rank)
    if dtype.startswith("int"):
        return rng.integers(-4, 5, SHAPE).astype(dtype)
    return rng.uniform(-2, 2, SHAPE).astype(dtype)


def tree(rank: int) -> dict[str, Any]:
    """A pytree of numpy leaves: several dtypes, a 0-d, an empty and a large leaf; sums stay exact."""
    rng = np.random.default_rng(200 + rank)
    return {
        "w": rng.integers(-8, 9, (4, 3)).astype(np.float32),
        "b": rng.integers(-8, 9, 3).astype(np.float32),
        "step": np.array(rank + 1, np.int32),
        "counts": rng.integers(0, 100, 6).astype(np.int32),
        "half": [rng.integers(-8, 9, 5).astype(_bfloat16()), np.zeros(0, np.float32)],
        "large": rng.integers(-8, 9, (256, 300)).astype(np.float32),  # over TRACED_FUSE_BELOW: alone in jit
    }


def gathered(rank: int) -> np.ndarray:
    """Rank ``rank``'s allgather input: ``rank + 1`` rows."""
    return np.arange((rank + 1) * 3, dtype=np.float32).reshape(rank + 1, 3) + 100 * rank


def _bfloat16() -> Any:
    import ml_dtypes

    return ml_dtypes.bfloat16


def _wrap(mode: str) -> Any:
    import jax

    return jax.jit if mode == "jit" else (lambda fn: fn)


def _host(result: Any) -> Any:
    """A tree of jax results as numpy, after checking every leaf is a jax array."""
    import jax

    leaves = jax.tree_util.tree_leaves(result)
    assert all(isinstance(leaf, jax.Array) for leaf in leaves), [type(leaf) for leaf in leaves]
    return jax.tree_util.tree_map(np.asarray, result)


# ------------------------------------------------------------------ collectives against numpy


def collectives(comm: Any, mode: str) -> dict[str, Any]:
    """Every op on float32 and int32, a pytree's allreduce and broadcast, allgather; eager or jitted."""
    import jax
    import jax.numpy as jnp

    import ringcore.jax as rj

    wrap = _wrap(mode)
    out: dict[str, Any] = {}
    for dtype in ("float32", "int32"):
        x = jnp.asarray(inputs(comm.rank, dtype))
        for op in OPS:
            if op != "avg" or dtype == "float32":
                out[f"{dtype} {op}"] = _host(wrap(functools.partial(rj.allreduce, op=op))(x))
    mine = tree(comm.rank)
    leaves = jax.tree_util.tree_map(jnp.asarray, mine)
    leaves["b"] = mine["b"]  # a numpy leaf: taken as it is, and left untouched
    out["tree sum"] = _host(wrap(rj.allreduce)(leaves))
    out["tree max"] = _host(wrap(functools.partial(rj.allreduce, op="max", name="tree"))(leaves))
    out["tree broadcast"] = _host(wrap(functools.partial(rj.broadcast, root=comm.size - 1))(leaves))
    assert np.array_equal(mine["b"], tree(comm.rank)["b"]), "the numpy leaf was written"
    rows = [r + 1 for r in range(comm.size)]
    out["gather"] = _host(wrap(functools.partial(rj.allgather, rows=rows))(jnp.asarray(gathered(comm.rank))))
    if mode == "eager":
        out["gather ragged"] = _host(rj.allgather(jnp.asarray(gathered(comm.rank))))
    out["gather equal"] = _host(wrap(rj.allgather)(jnp.asarray(gathered(0))))
    if mode == "jit":
        out["interleaved"] = _interleaved(comm)
    return out


def _interleaved(comm: Any, rounds: int = 20) -> list[np.ndarray]:
    """Jitted allreduces still running when an eager one of another shape starts: order is kept."""
    import jax
    import jax.numpy as jnp

    import ringcore.jax as rj

    jitted = jax.jit(rj.allreduce)
    big, small = jnp.full((64, 1024), comm.rank + 1.0), np.full(3, comm.rank + 1, np.int32)
    results = []
    for _ in range(rounds):
        results.append(jitted(big))  # dispatched; its collective runs on XLA's thread
        results.append(rj.allreduce(small))
    return [np.asarray(r) for r in results]


# ------------------------------------------------------------------ gradients, vmap


def gradients(comm: Any) -> dict[str, np.ndarray]:
    """VJPs through each collective inside ``jax.jit``, with rank ``r``'s loss weighted by ``r + 1``."""
    import jax
    import jax.numpy as jnp

    import ringcore.jax as rj

    weight = comm.rank + 1.0
    x = jnp.asarray(inputs(comm.rank, "float32"))
    rows = jnp.asarray(gathered(0))

    def grad(loss: Any, value: Any) -> np.ndarray:
        return np.asarray(jax.jit(jax.grad(loss))(value))

    return {
        "sum": grad(lambda v: weight * rj.allreduce(v).sum(), x),
        "avg": grad(lambda v: weight * rj.allreduce(v, op="avg").sum(), x),
        "broadcast": grad(lambda v: weight * rj.broadcast(v, root=comm.size - 1).sum(), x),
        "allgather": grad(lambda v: (weight * jnp.arange(comm.size)[:, None] * rj.allgather(v)).sum(), rows),
        "vmap": np.asarray(jax.jit(jax.vmap(rj.allreduce))(x)),
        "vmap allgather": np.asarray(jax.vmap(rj.allgather, in_axes=1, out_axes=1)(rows)),
    }


# ------------------------------------------------------------------ bad input


def bad_inputs(comm: Any, caller: int) -> dict[str, Any]:
    """On ``caller`` only, every bad call; then one good allreduce on all ranks, which fails if any sent."""
    import jax
    import jax.numpy as jnp

    import ringcore.jax as rj

    errors: dict[str, tuple[str, str]] = {}
    if comm.rank == caller:
        floats, ints = jnp.ones(4), jnp.ones(4, jnp.int32)
        cases = {
            "complex": lambda: rj.allreduce(jnp.ones(3, jnp.complex64)),
            "bool": lambda: rj.allreduce({"ok": floats, "flags": jnp.ones(3, bool)}),
            "python floats": lambda: rj.allreduce([1.0, 2.0]),
            "string": lambda: rj.broadcast("weights"),
            "avg on ints": lambda: rj.allreduce({"a": floats, "z": ints}, op="avg"),
            "fp16 on ints": lambda: rj.allreduce(ints, compression="fp16"),
            "unknown op": lambda: rj.allreduce(floats, op="median"),
            "root too big": lambda: rj.broadcast(floats, root=comm.size),
            "root str": lambda: rj.broadcast(floats, root="0"),
            "allgather 0-d": lambda: rj.allgather(jnp.float32(1)),
            "allgather tree": lambda: rj.allgather({"a": floats}),
            "allgather rows": lambda: rj.allgather(floats, rows=[4] * (comm.size + 1)),
            "jit complex": lambda: jax.jit(rj.allreduce)({"a": floats, "c": jnp.ones(2, jnp.complex64)}),
            "jit avg on ints": lambda: jax.jit(functools.partial(rj.allreduce, op="avg"))([floats, ints]),
            "jit root": lambda: jax.jit(functools.partial(rj.broadcast, root=-1))(floats),
            "grad of max": lambda: jax.grad(lambda v: rj.allreduce(v, op="max").sum())(floats),
        }
        for case, call in cases.items():
            try:
                call()
                errors[case] = ("nothing raised", "")
            except Exception as err:
                errors[case] = (type(err).__name__, str(err))
    after = rj.allreduce(jnp.full(3, comm.rank + 1.0))
    return {"errors": errors, "after": np.asarray(after)}


def ragged_in_jit(comm: Any) -> dict[str, Any]:
    """Inside jit without ``rows``, ranks of different first dimensions all fail; the job goes on."""
    import jax
    import jax.numpy as jnp

    import ringcore.jax as rj

    try:
        np.asarray(jax.jit(rj.allgather)(jnp.asarray(gathered(comm.rank))))
        error = "nothing raised"
    except Exception as err:
        error = f"{type(err).__name__}: {err}"
    return {"error": error, "after": np.asarray(rj.allreduce(jnp.full(2, comm.rank + 1.0)))}


# ------------------------------------------------------------------ data-parallel training on digits


def initial_params() -> dict[str, np.ndarray]:
    """The MLP 64 -> HIDDEN -> 10, from a fixed numpy seed."""
    rng = np.random.default_rng(0)
    return {
        "w1": (rng.standard_normal((digits.FEATURES, HIDDEN)) / np.sqrt(digits.FEATURES)).astype(np.float32),
        "b1": np.zeros(HIDDEN, np.float32),
        "w2": (rng.standard_normal((HIDDEN, digits.CLASSES)) / np.sqrt(HIDDEN)).astype(np.float32),
        "b2": np.zeros(digits.CLASSES, np.float32),
    }


def _loss(params: Any, x: Any, y: Any) -> Any:
    """Mean cross-entropy of the MLP over the rows of ``x``."""
    import jax
    import jax.numpy as jnp

    hidden = jax.nn.relu(x @ params["w1"] + params["b1"])
    logp = jax.nn.log_softmax(hidden @ params["w2"] + params["b2"])
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))


def train(steps: int, rank: int, world: int, mode: str) -> dict[str, Any]:
    """SGD on batches ``0..steps-1``; each rank on its shard, gradients averaged (``mode``: local/eager/jit).

    ``local`` is one process on the whole batch (no collective). ``eager``
    averages with ``rj.allreduce`` between jitted gradient and update steps;
    ``jit`` does the whole step, allreduce included, in one jitted function.
    """
    import jax

    import ringcore.jax as rj

    def sgd(params: Any, grads: Any) -> Any:
        return jax.tree_util.tree_map(lambda p, g: p - LR * g, params, grads)

    grad_fn, update = jax.jit(jax.value_and_grad(_loss)), jax.jit(sgd)

    @jax.jit
    def fused(params: Any, x: Any, y: Any) -> tuple[Any, Any]:
        loss, grads = jax.value_and_grad(_loss)(params, x, y)
        return sgd(params, rj.allreduce(grads, op="avg", name="grads")), loss

    params, losses = jax.tree_util.tree_map(jax.numpy.asarray, initial_params()), []
    for step in range(steps):
        x, y = digits.shard(step, BATCH, rank, world)
        if mode == "jit":
            params, loss = fused(params, x, y)
        else:
            loss, grads = grad_fn(params, x, y)
            params = update(params, rj.allreduce(grads, op="avg") if mode == "eager" else grads)
        losses.append(float(rj.allreduce(loss, op="avg")) if mode != "local" else float(loss))
    return {"params": jax.tree_util.tree_map(np.asarray, params), "losses": losses}


def train_rank(comm: Any, steps: int, mode: str) -> dict[str, Any]:
    return train(steps, comm.rank, comm.size, mode)
