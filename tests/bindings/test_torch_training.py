"""DistributedOptimizer trains like one process: digits shards on N ranks against the whole batch on one.

The reference runs here, in the test process, on the same data, initial weights
and batches (``tests/bindings/digits.py``); the ranks average their shards'
gradients with ``ringcore.torch``. Averaging the shards' mean gradients is the
whole batch's mean gradient when the shards are equal (96 rows split 2, 3 or 4
ways), so parameters must agree to float32 rounding.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import pytest

from tests.bindings import digits, hvd_tasks
from tests.cluster import Cluster

torch = pytest.importorskip("torch")
F = pytest.importorskip("torch.nn.functional")

pytestmark = pytest.mark.timeout(240)

BATCH = 96
STEPS = 20


def reference(
    steps: int,
    batch: int,
    passes: int = 1,
    optimizer: str = "sgd",
    active: list[list[int]] | None = None,
    world: int = 1,
    history: list[dict[str, np.ndarray]] | None = None,
) -> dict[str, np.ndarray]:
    """One process: the same model trained on whole global batches.

    ``active[step]`` (with ``world``): only those ranks' shards count at that step,
    and the gradient is divided by ``world``, as ranks inside ``join()`` contribute zeros.
    ``history`` collects the parameters after every step.
    """
    torch.set_num_threads(1)
    model = digits.torch_mlp(seed=0)
    opt = hvd_tasks._optimizer(model, optimizer)
    for step in range(steps):
        opt.zero_grad()
        if active is None:
            x, y = digits.batch(step, batch * passes)  # rows of global batches passes*step...
            F.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        else:
            for rank in active[step]:
                x, y = digits.shard(step, batch, rank, world)
                (F.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y)) / world).backward()
        opt.step()
        if history is not None:
            history.append(hvd_tasks.params_of(model))
    return hvd_tasks.params_of(model)


def assert_params_close(
    got: dict[str, np.ndarray], expected: dict[str, np.ndarray], rtol: float = 2e-5
) -> None:
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=rtol, atol=2e-6, err_msg=name)


@pytest.fixture(scope="module", params=[2, 3, 4])
def cluster(request: pytest.FixtureRequest):
    """At N=3 every allreduce is above the small limit: the buckets take the direct route."""
    env = {"RINGCORE_SMALL_BYTES": "0"} if request.param == 3 else None
    with Cluster(request.param, env=env, timeout=180) as cluster:
        yield cluster


def test_fused_buckets_take_the_direct_route_above_the_small_limit(cluster: Cluster) -> None:
    """The optimizer's bucket buffers are symmetric memory (ringcore.empty): on one host, direct."""
    expected = reference(5, BATCH)
    for params, calls in cluster.results(hvd_tasks.train_reporting_calls, 5, BATCH):
        assert_params_close(params, expected)
        assert (calls.get("direct", 0) >= 5) == (cluster.size == 3), calls


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_averaged_shards_train_like_one_process(cluster: Cluster, optimizer: str) -> None:
    expected = reference(STEPS, BATCH, optimizer=optimizer)
    outs = cluster.results(hvd_tasks.train, STEPS, BATCH, "none", 1, optimizer)
    for out in outs:
        assert_params_close(out, expected)
    for out in outs[1:]:  # every rank applies the same averaged gradient
        for name in expected:
            np.testing.assert_array_equal(out[name], outs[0][name])


def test_two_backward_passes_per_step_equal_twice_the_batch(cluster: Cluster) -> None:
    expected = reference(10, BATCH, passes=2)
    for out in cluster.results(hvd_tasks.train, 10, BATCH, "none", 2):
        assert_params_close(out, expected)


def test_uneven_shards_with_join(cluster: Cluster) -> None:
    """Rank r stops after 4 + 2r steps and joins; the others go on with zeros from it.

    A rank's model stops where it joined: rank r's parameters are the reference's after its own steps.
    """
    n = cluster.size
    steps = [4 + 2 * r for r in range(n)]
    active = [[r for r in range(n) if steps[r] > step] for step in range(max(steps))]
    history: list[dict[str, np.ndarray]] = []
    reference(max(steps), BATCH, active=active, world=n, history=history)
    for rank, (params, last) in enumerate(cluster.results(hvd_tasks.train_uneven_with_join, steps, BATCH)):
        assert last == n - 1
        assert_params_close(params, history[steps[rank] - 1])


def test_ranks_with_different_models_fail_on_every_rank_naming_the_parameter() -> None:
    with Cluster(3, timeout=60) as cluster:
        for message in cluster.results(hvd_tasks.different_models):
            assert message.startswith("MismatchError: DistributedOptimizer: the ranks' models differ")
            assert "'0.weight' of shape (33, 64)" in message and "rank 1" in message
            assert "ranks 0, 2: '0.weight' of shape (32, 64)" in message


def test_fp16_compression_reaches_fp32_accuracy() -> None:
    steps = 60
    with Cluster(2, timeout=120) as cluster:
        fp32 = cluster.results(hvd_tasks.train, steps, BATCH, "none")
        fp16 = cluster.results(hvd_tasks.train, steps, BATCH, "fp16")
    for name in fp32[0]:
        np.testing.assert_array_equal(fp16[0][name], fp16[1][name])  # bit-identical ranks
    accuracy16, accuracy32 = float(fp16[0]["accuracy"]), float(fp32[0]["accuracy"])
    assert accuracy32 > 0.9
    assert abs(accuracy16 - accuracy32) <= 0.01, (accuracy16, accuracy32)


def test_misuse_of_the_optimizer_says_what_to_do() -> None:
    with Cluster(2, timeout=60) as cluster:
        outs = cluster.results(hvd_tasks.optimizer_misuse)
    for found in outs:
        assert "zero_grad() was called after loss.backward()" in found["zero_grad"]
        assert "backward_passes_per_step=1" in found["passes"]
        assert "already averaged" in found["step after synchronize"]
    assert outs[0]["params"] == outs[1]["params"]


def test_broadcast_parameters_and_optimizer_state_from_the_root() -> None:
    with Cluster(3, timeout=60) as cluster:
        outs = cluster.results(hvd_tasks.broadcast_state)
    root = outs[0]
    assert root["lr"] == 0.01 and root["steps"] and set(root["steps"]) == {1.0}
    for out in outs[1:]:
        assert out["lr"] == root["lr"] and out["steps"] == root["steps"]
        for key, value in root["params"].items():
            np.testing.assert_array_equal(out["params"][key], value, err_msg=key)
        assert out["moments"].keys() == root["moments"].keys()
        for key, value in root["moments"].items():
            np.testing.assert_array_equal(out["moments"][key], value)
    assert int(root["params"]["1.num_batches_tracked"]) == 6  # 5, and the root's training step


def test_timeline_names_buckets_and_they_start_while_backward_runs() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        template = os.path.join(tmp, "trace.{rank}.json")
        env = {"RINGCORE_TIMELINE": template, "RINGCORE_FUSION_THRESHOLD": "300K"}
        with Cluster(2, env=env, timeout=120) as cluster:
            outs = cluster.results(hvd_tasks.timeline_overlap, template, 3)
        assert Path(template.format(rank=0)).exists()
    for out in outs:
        names = {e["name"] for e in out["events"]}
        assert any(name and name.startswith("7.bias") for name in names), (
            names
        )  # the last layer's bucket goes first
        assert "join: announce" in names
        during = [
            any(start < e["ts"] < end and e["name"] != "join: announce" for e in out["events"])
            for start, end in out["spans"]
        ]
        assert any(during), "no bucket allreduce started before backward ended"
