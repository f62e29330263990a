"""ringcore.torch.SyncBatchNorm over real processes against torch's BatchNorm on the whole batch in one process.

One live cluster per world size (2 and 3) serves every case. Ranks hold uneven
(and sometimes empty) shares of the global batch. Tolerances: float32 results
with ``rtol=1e-5, atol=1e-5`` (values of order 1; observed: at most 1.4e-6,
float32 rounding), float64 ones with ``rtol=1e-10, atol=1e-12`` (observed:
5e-15); weights and buffers after 10 SGD steps on digits with ``rtol=1e-5,
atol=1e-6`` (observed: 2e-7; BatchNorm on each rank's shard alone is 1e-2 away).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.bindings import digits, sbn_tasks
from tests.cluster import Cluster, RankError

torch = pytest.importorskip("torch")

from ringcore.torch.sync_batch_norm import SyncBatchNorm  # noqa: E402

F32 = {"rtol": 1e-5, "atol": 1e-5}
F64 = {"rtol": 1e-10, "atol": 1e-12}
BATCH_NORMS = {
    2: torch.nn.BatchNorm1d,
    3: torch.nn.BatchNorm1d,
    4: torch.nn.BatchNorm2d,
    5: torch.nn.BatchNorm3d,
}


@pytest.fixture(scope="module", params=[2, 3], ids=["N=2", "N=3"])
def cluster(request: pytest.FixtureRequest) -> Any:
    with Cluster(request.param) as live:
        yield live


def uneven(total: int, n: int) -> list[int]:
    """Row counts of ``np.array_split`` (``total`` not a multiple of ``n`` gives uneven shards)."""
    return [len(part) for part in np.array_split(np.arange(total), n)]


def reference_batch_norm(shape: tuple[int, ...], seed: int, dtype: str, **kwargs: Any) -> Any:
    """torch's BatchNorm{1,2,3}d for ``shape`` with the case's weight and bias, in ``dtype``."""
    data = sbn_tasks.case(shape, seed, dtype)
    bn = BATCH_NORMS[len(shape)](shape[1], **kwargs).to(getattr(torch, dtype))
    if bn.affine:
        with torch.no_grad():
            bn.weight.copy_(torch.from_numpy(data["weight"]))
            bn.bias.copy_(torch.from_numpy(data["bias"]))
    return bn


def whole_batch(shape: tuple[int, ...], seed: int, dtype: str, affine: bool = True) -> dict[str, np.ndarray]:
    """Output, input gradient and weight/bias gradients of BatchNorm over the whole batch."""
    data = sbn_tasks.case(shape, seed, dtype)
    bn = reference_batch_norm(shape, seed, dtype, affine=affine, track_running_stats=affine)
    x = torch.from_numpy(data["x"]).requires_grad_()
    y = bn(x)
    (y * torch.from_numpy(data["g"])).sum().backward()
    grads = {"dweight": bn.weight.grad.numpy(), "dbias": bn.bias.grad.numpy()} if affine else {}
    return {"y": y.detach().numpy(), "dx": x.grad.numpy(), **grads}


def check_against_whole_batch(
    cluster: Cluster, shape: tuple[int, ...], sizes: list[int], dtype: str, **options: bool
) -> None:
    """``sbn_tasks.forward_backward`` on the ranks against ``whole_batch``, for the keys the ranks return."""
    affine, input_grad = options.get("affine", True), options.get("input_grad", True)
    out = cluster.results(sbn_tasks.forward_backward, shape, sizes, 7, dtype, affine, input_grad)
    want = whole_batch(shape, 7, dtype, affine)
    tol = F32 if dtype == "float32" else F64
    assert out[0].keys() <= want.keys()
    for key in out[0].keys() & {"y", "dx"}:
        np.testing.assert_allclose(np.concatenate([o[key] for o in out]), want[key], **tol, err_msg=key)
    for key in out[0].keys() & {"dweight", "dbias"}:  # local sums; over all ranks, the whole batch's
        np.testing.assert_allclose(sum(o[key] for o in out), want[key], **tol, err_msg=key)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize(
    "shape", [(10, 4), (11, 4, 5), (11, 4, 3, 2), (10, 4, 2, 2, 3)], ids=["1d", "1d-seq", "2d", "3d"]
)
def test_forward_and_gradients_equal_batch_norm_on_the_whole_batch(
    cluster: Cluster, shape: tuple[int, ...], dtype: str
) -> None:
    check_against_whole_batch(cluster, shape, uneven(shape[0], cluster.size), dtype)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "options",
    [{"affine": False, "input_grad": True}, {"affine": True, "input_grad": False}],
    ids=["no-affine", "input-needs-no-grad"],
)
def test_without_weights_or_without_input_gradient(cluster: Cluster, options: dict[str, bool]) -> None:
    """No weight and bias (no running stats either); or an input that needs no gradient (no backward allreduce)."""
    check_against_whole_batch(cluster, (11, 4, 3), uneven(11, cluster.size), "float32", **options)


@pytest.mark.timeout(60)
def test_a_rank_with_an_empty_batch_takes_part_and_gets_an_empty_output(cluster: Cluster) -> None:
    sizes = [0, 10] if cluster.size == 2 else [4, 0, 7]
    check_against_whole_batch(cluster, (sum(sizes), 4, 3), sizes, "float32")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum", "cumulative"])
@pytest.mark.parametrize("offset", [0.0, 1000.0], ids=["centered", "offset-1000"])
def test_running_stats_and_eval_mode_match_batch_norm(
    cluster: Cluster, momentum: float | None, offset: float
) -> None:
    """Running stats after 4 steps; then eval on one rank alone (no communication, so no hang).

    With values around 1000 (std 0.5-3) a float32 ``sum(x^2) / n - mean^2`` is off by
    0.6-52% per channel on these batches; the reference runs in float64.
    """
    sizes, steps, channels = uneven(11, cluster.size), 4, sbn_tasks.CHANNELS
    out = cluster.results(sbn_tasks.train_running_stats, sizes, steps, momentum, offset)
    bn = torch.nn.BatchNorm1d(channels, momentum=momentum).double()
    for step in range(steps):
        bn(torch.from_numpy(sbn_tasks.case((11, channels, 3), step, offset=offset)["x"]).double())
    for rank_buffers in out:
        np.testing.assert_allclose(rank_buffers["running_mean"], bn.running_mean.numpy(), **F32)
        np.testing.assert_allclose(rank_buffers["running_var"], bn.running_var.numpy(), **F32)
        assert rank_buffers["num_batches_tracked"] == steps

    x = sbn_tasks.case((5, channels, 3), 99, offset=offset)["x"]
    (alone,) = cluster.run(sbn_tasks.eval_kept, x, ranks=[0], timeout=20)
    assert not isinstance(alone, RankError), alone
    # Against float32 BatchNorm with rank 0's buffers: around 1000, float32 running means
    # are only good to 6e-5, whoever computes them.
    plain = torch.nn.BatchNorm1d(channels, momentum=momentum)
    plain.load_state_dict({k: torch.from_numpy(v) for k, v in out[0].items()}, strict=False)
    with torch.no_grad():
        want = plain.eval()(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(alone, want, **F32)
    # Had rank 0 communicated alone, the next collective would fail or disagree.
    check_against_whole_batch(cluster, (10, 4), uneven(10, cluster.size), "float32")


@pytest.mark.timeout(120)
def test_digits_training_matches_one_process_on_the_whole_batch(cluster: Cluster) -> None:
    pytest.importorskip("sklearn")
    steps, batch, lr = 10, 64, 0.5
    out = cluster.results(sbn_tasks.train_digits, steps, batch, lr)
    model = digits.torch_mlp(0, batch_norm=True)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        x, y = digits.batch(step, batch)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        opt.step()
    want = {name: t.detach().numpy() for name, t in model.state_dict().items()}
    for state in out:
        assert state.keys() == want.keys()
        for name, value in want.items():
            np.testing.assert_allclose(state[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def bad_input_cases(size: int) -> dict[str, tuple[list[tuple[int, ...]], list[str], dict[int, str]]]:
    """case -> (shape per rank, dtype per rank, words of the ValueError each rank raises)."""
    good, others = (3, 4), "other rank(s) passed input"
    return {
        "1d-everywhere": ([(4,)] * size, ["float32"] * size, dict.fromkeys(range(size), "at least 2D")),
        "wrong-channels-on-rank-1": (
            [good, (3, 5), *[good] * (size - 2)],
            ["float32"] * size,
            {r: "expected 4 channels" if r == 1 else others for r in range(size)},
        ),
        "integers-on-rank-0": (
            [good] * size,
            ["int64", *["float32"] * (size - 1)],
            {r: "floating-point" if r == 0 else others for r in range(size)},
        ),
        "one-value-per-channel": (
            [(1, 4), *[(0, 4)] * (size - 1)],
            ["float32"] * size,
            dict.fromkeys(range(size), "more than 1 value per channel"),
        ),
        "all-empty": ([(0, 4)] * size, ["float32"] * size, dict.fromkeys(range(size), "got 0 over all")),
    }


@pytest.mark.timeout(90)
def test_bad_input_raises_value_error_on_every_rank_and_the_job_goes_on(cluster: Cluster) -> None:
    """No rank waits for a rank that gave up: all raise after the one forward allreduce."""
    for name, (shapes, dtypes, words) in bad_input_cases(cluster.size).items():
        out = cluster.run(sbn_tasks.forward_shapes, shapes, dtypes, timeout=20)
        for rank, result in enumerate(out):
            assert isinstance(result, RankError), f"{name}: rank {rank} returned {result}"
            assert result.type_name == "ValueError", (
                f"{name}: rank {rank}: {result.type_name} {result.message}"
            )
            assert words[rank] in result.message, f"{name}: rank {rank}: {result.message}"
    assert (
        cluster.results(sbn_tasks.forward_shapes, [(3, 4, 2)] * cluster.size, ["float32"] * cluster.size)
        == [(3, 4, 2)] * cluster.size
    )


# ------------------------------------------------------------------ in one process, no communicator


def test_without_ringcore_initialized_it_is_batch_norm() -> None:
    import ringcore

    assert not ringcore.is_initialized()
    x = torch.from_numpy(sbn_tasks.case((6, 4, 3, 2), 3)["x"])
    sync, plain = SyncBatchNorm(4), torch.nn.BatchNorm2d(4)
    for train in (True, False):
        sync.train(train)
        plain.train(train)
        np.testing.assert_allclose(sync(x).detach().numpy(), plain(x).detach().numpy(), **F32)
    np.testing.assert_allclose(sync.running_var.numpy(), plain.running_var.numpy(), **F32)
    with pytest.raises(ValueError, match="expected 4 channels"):
        sync(torch.ones(2, 3))
    with pytest.raises(ValueError, match="at least 2D"):
        sync(torch.ones(4))


def test_convert_sync_batchnorm_keeps_weights_buffers_and_mode() -> None:
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 1),
        torch.nn.BatchNorm2d(4),
        torch.nn.Sequential(torch.nn.Flatten(), torch.nn.BatchNorm1d(16, affine=False, momentum=None)),
    )
    model[1](torch.randn(5, 4, 2, 2))  # non-default running stats
    model.eval()
    weight, running_var, keys = model[1].weight, model[1].running_var, list(model.state_dict())
    converted = SyncBatchNorm.convert_sync_batchnorm(model)
    assert converted is model
    assert isinstance(model[1], SyncBatchNorm) and isinstance(model[2][1], SyncBatchNorm)
    assert model[1].weight is weight and model[1].running_var is running_var
    assert model[2][1].weight is None and model[2][1].momentum is None
    assert not model[1].training and list(model.state_dict()) == keys
    assert isinstance(SyncBatchNorm.convert_sync_batchnorm(torch.nn.BatchNorm3d(2)), SyncBatchNorm)
