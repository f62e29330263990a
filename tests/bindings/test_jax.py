"""ringcore.jax over real processes: collectives against numpy, eager and in ``jax.jit``, and a
data-parallel training step on digits that equals one process.

One cluster per world size (2 and 3) serves every test of that size; the
ranks import jax in their first task. The one-process reference trains in
the test's own process.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("sklearn")

import ringcore  # noqa: E402
from tests.bindings import jax_tasks  # noqa: E402
from tests.cluster import Cluster  # noqa: E402

ENV = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false"}
STEPS = 15
# Same math, different float32 rounding: shard means averaged vs one mean over the batch.
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"N={n}")
def cluster(request: Any) -> Any:
    with Cluster(request.param, env=ENV, timeout=120) as live:
        yield live


# ------------------------------------------------------------------ numpy references


def _reduce(stack: np.ndarray, op: str) -> np.ndarray:
    if op == "avg":
        return (stack.astype(np.float64).sum(axis=0) / len(stack)).astype(stack.dtype)
    return {"sum": np.sum, "min": np.min, "max": np.max, "prod": np.prod}[op](stack, axis=0).astype(
        stack.dtype
    )


def _tree_reduce(trees: list[dict[str, Any]], op: str) -> dict[str, Any]:
    return jax.tree_util.tree_map(lambda *leaves: _reduce(np.stack(leaves), op), *trees)


def _assert_tree_equal(got: Any, want: Any) -> None:
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, w.dtype, g.shape, w.shape)
        np.testing.assert_array_equal(g.astype(np.float64), w.astype(np.float64))


def _same_on_every_rank(results: list[Any]) -> Any:
    for other in results[1:]:
        _assert_tree_equal(other, results[0])
    return results[0]


# ------------------------------------------------------------------ tests


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_collectives_match_numpy(cluster: Cluster, mode: str) -> None:
    n = cluster.size
    out = cluster.results(jax_tasks.collectives, mode)
    for dtype in ("float32", "int32"):
        stack = np.stack([jax_tasks.inputs(r, dtype) for r in range(n)])
        for op in jax_tasks.OPS:
            if op == "avg" and dtype == "int32":
                continue
            got = _same_on_every_rank([o[f"{dtype} {op}"] for o in out])
            assert got.dtype == np.dtype(dtype), (op, got.dtype)
            if dtype == "int32" or op in ("min", "max"):
                np.testing.assert_array_equal(got, _reduce(stack, op), err_msg=f"{dtype} {op}")
            else:  # the ring adds in another order than numpy
                np.testing.assert_allclose(
                    got, _reduce(stack, op), rtol=1e-6, atol=1e-6, err_msg=f"{dtype} {op}"
                )
    trees = [jax_tasks.tree(r) for r in range(n)]
    _assert_tree_equal(_same_on_every_rank([o["tree sum"] for o in out]), _tree_reduce(trees, "sum"))
    _assert_tree_equal(_same_on_every_rank([o["tree max"] for o in out]), _tree_reduce(trees, "max"))
    _assert_tree_equal(_same_on_every_rank([o["tree broadcast"] for o in out]), trees[n - 1])
    ragged = np.concatenate([jax_tasks.gathered(r) for r in range(n)])
    _assert_tree_equal(_same_on_every_rank([o["gather"] for o in out]), ragged)
    if mode == "eager":
        _assert_tree_equal(_same_on_every_rank([o["gather ragged"] for o in out]), ragged)
    _assert_tree_equal(
        _same_on_every_rank([o["gather equal"] for o in out]), np.tile(jax_tasks.gathered(0), (n, 1))
    )
    if mode == "jit":
        total = n * (n + 1) // 2
        for big, small in zip(*[iter(out[0]["interleaved"])] * 2, strict=True):
            np.testing.assert_array_equal(big, np.full((64, 1024), total, np.float32))
            np.testing.assert_array_equal(small, np.full(3, total, np.int32))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_data_parallel_training_equals_one_process(cluster: Cluster, mode: str) -> None:
    n = cluster.size
    ranks = cluster.results(jax_tasks.train_rank, STEPS, mode, timeout=180)
    one = jax_tasks.train(STEPS, 0, 1, "local")
    assert one["losses"][-1] < 0.7 * one["losses"][0], one["losses"]  # it does learn
    for r, result in enumerate(ranks):
        _assert_tree_equal(result["params"], ranks[0]["params"])  # bit-identical across ranks
        for key, want in one["params"].items():
            np.testing.assert_allclose(
                result["params"][key], want, rtol=RTOL, atol=ATOL, err_msg=f"N={n} {mode} rank {r} {key}"
            )
        np.testing.assert_allclose(result["losses"], one["losses"], rtol=RTOL, atol=ATOL)
    moved = max(float(np.abs(ranks[0]["params"][k] - v).max()) for k, v in jax_tasks.initial_params().items())
    assert moved > 0.1, moved


@pytest.mark.timeout(240)
def test_gradients_and_vmap_through_collectives(cluster: Cluster) -> None:
    n = cluster.size
    weights = n * (n + 1) / 2  # sum of the ranks' loss weights r + 1
    x = jax_tasks.inputs(0, "float32")
    for r, out in enumerate(cluster.results(jax_tasks.gradients)):
        np.testing.assert_allclose(out["sum"], np.full_like(x, weights))
        np.testing.assert_allclose(out["avg"], np.full_like(x, weights / n), rtol=1e-6)
        np.testing.assert_allclose(out["broadcast"], np.full_like(x, weights if r == n - 1 else 0.0))
        np.testing.assert_allclose(out["allgather"], np.full((1, 3), r * weights))
        stack = np.stack([jax_tasks.inputs(s, "float32") for s in range(n)])
        np.testing.assert_allclose(out["vmap"], stack.sum(axis=0), rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(out["vmap allgather"], np.tile(jax_tasks.gathered(0), (n, 1)))


EXPECTED_ERRORS = {
    "complex": ("TypeError", ["allreduce", "complex64"]),
    "bool": ("TypeError", ["allreduce", "['flags']", "bool"]),
    "python floats": ("TypeError", ["allreduce", "leaf [0]", "float", "not an array"]),
    "string": ("TypeError", ["broadcast", "str", "not an array"]),
    "avg on ints": ("ValueError", ["allreduce", "avg", "int32"]),
    "fp16 on ints": ("ValueError", ["fp16", "int32"]),
    "unknown op": ("ValueError", ["median"]),
    "root too big": ("ValueError", ["broadcast", "root"]),
    "root str": ("TypeError", ["broadcast", "root", "str"]),
    "allgather 0-d": ("ValueError", ["allgather", "0-d"]),
    "allgather tree": ("TypeError", ["allgather", "one array", "dict"]),
    "allgather rows": ("ValueError", ["allgather", "rows"]),
    "jit complex": ("TypeError", ["allreduce", "['c']", "complex64"]),
    "jit avg on ints": ("ValueError", ["allreduce", "avg", "int32"]),
    "jit root": ("ValueError", ["broadcast", "root -1"]),
    "grad of max": ("TypeError", ["allreduce(op='max')", "not differentiable"]),
}


@pytest.mark.timeout(240)
def test_bad_input_raises_before_anything_is_sent(cluster: Cluster) -> None:
    n = cluster.size
    out = cluster.results(jax_tasks.bad_inputs, 1)
    errors = out[1]["errors"]
    assert set(errors) == set(EXPECTED_ERRORS)
    for case, (kind, words) in EXPECTED_ERRORS.items():
        got_kind, message = errors[case]
        assert got_kind == kind, (case, got_kind, message)
        for word in words:
            assert word in message, (case, word, message)
    for result in out:  # had a bad call sent anything, this allreduce would disagree or hang
        np.testing.assert_array_equal(result["after"], np.full(3, n * (n + 1) / 2, np.float32))


@pytest.mark.timeout(240)
def test_ragged_allgather_in_jit_fails_on_every_rank(cluster: Cluster) -> None:
    n = cluster.size
    for result in cluster.results(jax_tasks.ragged_in_jit):
        assert "ranks passed first dimensions" in result["error"], result["error"]
        assert str(list(range(1, n + 1))) in result["error"], result["error"]
        np.testing.assert_array_equal(result["after"], np.full(2, n * (n + 1) / 2, np.float32))


# ------------------------------------------------------------------ one process, no cluster


@pytest.mark.timeout(60)
def test_calls_before_init_raise() -> None:
    import jax.numpy as jnp

    import ringcore.jax as rj

    if ringcore.is_initialized():
        pytest.skip("this process already called ringcore.init()")
    for call in (
        lambda: rj.allreduce(jnp.ones(3)),
        lambda: rj.broadcast({"w": jnp.ones(3)}),
        lambda: rj.allgather(jnp.ones((2, 3))),
        lambda: jax.jit(rj.allreduce)(jnp.ones(3)),
    ):
        with pytest.raises(ringcore.RingcoreError, match="not initialized"):
            call()


@pytest.mark.timeout(60)
def test_import_ringcore_does_not_import_jax() -> None:
    code = "import sys, ringcore; ringcore.allreduce; assert 'jax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=50)
