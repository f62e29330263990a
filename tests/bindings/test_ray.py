"""ringcore on Ray: RingcoreExecutor, Ray Train's TorchTrainer on backend "ringcore", ray.util.collective.

One local Ray cluster (``ray.init(num_cpus=4)``, no dashboard, a small object
store, its own temp dir) serves every test that needs one; it is started with
ringcore's ``worker_process_setup_hook`` (``ringcore.ray.RUNTIME_ENV``), as the
README tells users to, so the Train and ``ray.util.collective`` tests also
prove that the hook registers both backends before Ray uses them. After the
module, no process of that cluster may remain.

The executor tests share one 3-rank executor (an odd size, all on one node);
the Train test runs the digits MLP for a few steps on 2 workers, once on
"ringcore" and once on "gloo", and compares the parameters bit for bit (two
ranks sum two values: the same float in either order).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.train")
pytest.importorskip("torch")
pytest.importorskip("sklearn")


import ringcore.ray  # noqa: E402
from ringcore.errors import RingcoreError  # noqa: E402
from ringcore.ray import RingcoreExecutor, WorkerError, WorkerLost, WorkerTimeout  # noqa: E402
from ringcore.ray.layout import assign_ranks, rank_env  # noqa: E402
from tests.bindings import ray_tasks  # noqa: E402
from tests.bindings.ray_cluster import local_cluster  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.data")  # Ray Train's own imports

ROOT = Path(__file__).resolve().parents[2]
N = 3
EXECUTOR_ENV = {"RINGCORE_TIMEOUT": "30", "OMP_NUM_THREADS": "1", "RC_TEST_ENV": "set"}


# ------------------------------------------------------------------ the cluster


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    """A local Ray cluster for the module, with ringcore's setup hook; no Ray process outlives it."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")  # one actor less per TorchTrainer
        env.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")  # notice sooner that training finished
        env_vars = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        with local_cluster(4, env_vars, **ringcore.ray.RUNTIME_ENV) as temp_dir:
            yield temp_dir


# ------------------------------------------------------------------ without a cluster


def test_ranks_are_numbered_node_by_node() -> None:
    nodes = [("b", "10.0.0.2"), ("a", "10.0.0.1"), ("b", "10.0.0.2"), ("c", "10.0.0.3"), ("a", "10.0.0.1")]
    slots = assign_ranks(nodes)
    assert [s.bundle for s in slots] == [0, 1, 2, 3, 4]
    assert [(s.rank, s.local_rank, s.local_size) for s in slots] == [
        (0, 0, 2),  # node b first: bundle 0 is rank 0
        (2, 0, 2),
        (1, 1, 2),
        (4, 0, 1),
        (3, 1, 2),
    ]
    env = rank_env(slots[2], 5, "10.0.0.2", 29400, "s3cret")
    assert env == {
        "RINGCORE_RANK": "1",
        "RINGCORE_SIZE": "5",
        "RINGCORE_LOCAL_RANK": "1",
        "RINGCORE_LOCAL_SIZE": "2",
        "RINGCORE_ADDR": "10.0.0.2",
        "RINGCORE_PORT": "29400",
        "RINGCORE_SECRET": "s3cret",
    }
    assert slots[3].where() == "rank 4 on node 10.0.0.3 (node id c...)"


@pytest.mark.timeout(60)
def test_setup_hook_registers_both_backends_when_their_modules_load() -> None:
    code = (
        "import sys, ringcore.ray\n"
        "ringcore.ray.setup_worker()\n"
        "print('torch' in sys.modules, 'ray.util.collective' in sys.modules)\n"
        "import torch.distributed as dist\n"
        "print('RINGCORE' in dist.Backend._plugins, sys.modules['torch'].__spec__.loader.__class__.__name__)\n"
        "from ray.util.collective.backend_registry import _global_registry\n"
        "print(_global_registry.is_registered('RINGCORE'))\n"
        "ringcore.ray.setup_worker()  # again, both loaded: registers at once, no error\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=50, cwd=ROOT, check=True
    )
    assert out.stdout.split("\n")[:3] == ["False False", "True SourceFileLoader", "True"], out


def test_after_import_runs_callbacks_once_the_module_is_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "rc_watched.py").write_text("VALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(logging.getLogger("ringcore"), "propagate", True)  # ringcore.init() may have cut it
    seen: list[Any] = []

    def broken() -> None:
        raise RuntimeError("no backend today")

    ringcore.ray.after_import("rc_watched", lambda: seen.append(sys.modules["rc_watched"].VALUE))
    ringcore.ray.after_import("rc_watched", broken)
    assert not seen and "rc_watched" not in sys.modules
    try:
        import rc_watched  # type: ignore[import-not-found]

        assert rc_watched.VALUE == 42 and seen == [42]  # after the module ran; its error only logged
        assert type(rc_watched.__loader__).__name__ == "SourceFileLoader"
        assert "registering ringcore after importing rc_watched failed" in caplog.text
        ringcore.ray.after_import("rc_watched", lambda: seen.append("now"))
        assert seen == [42, "now"]
    finally:
        sys.modules.pop("rc_watched", None)


def test_executor_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="num_workers"):
        RingcoreExecutor(0)
    with pytest.raises(ValueError, match="use_gpu"):
        RingcoreExecutor(2, gpus_per_worker=1)
    with pytest.raises(ValueError, match="placement_strategy 'DIAGONAL'"):
        RingcoreExecutor(2, placement_strategy="DIAGONAL")
    with pytest.raises(RingcoreError, match="not started"):
        RingcoreExecutor(2).run(print)


# ------------------------------------------------------------------ RingcoreExecutor


@pytest.fixture(scope="class")
def executor(ray_cluster: str) -> Iterator[RingcoreExecutor]:
    ex = RingcoreExecutor(N, env=EXECUTOR_ENV, placement_strategy="SPREAD", grace_s=15)
    ex.start()
    try:
        yield ex
    finally:
        ex.shutdown()


def _stack(count: int, dtype: str = "float32") -> np.ndarray:
    return np.stack([ray_tasks.inputs(r, count, dtype) for r in range(N)])


class TestExecutor:
    @pytest.mark.timeout(120)
    def test_collectives_match_numpy(self, executor: RingcoreExecutor) -> None:
        out = executor.run(ray_tasks.collectives, args=(7,), timeout_s=60)
        x = _stack(7)
        want = {
            "sum": x.sum(0),
            "avg": x.astype(np.float64).mean(0),
            "min": x.min(0),
            "max": x.max(0),
            "prod": x.prod(0),
            "int64 sum": _stack(7, "int64").sum(0),
            "broadcast": x[N - 1],
            "allgather": np.concatenate(
                [ray_tasks.inputs(r, 2 * (r + 1)).reshape(r + 1, 2) for r in range(N)]
            ),
        }
        for rank, o in enumerate(out):
            assert (o["rank"], o["size"], o["local"]) == (rank, N, (rank, N)), o  # one node: local = global
            assert o["env"] == "set" and o["secret set"]
            for name, value in want.items():
                np.testing.assert_allclose(o[name], value, rtol=1e-6, err_msg=f"rank {rank} {name}")
            np.testing.assert_allclose(o["reduce_scatter"], np.array_split(x.sum(0), N)[rank], rtol=1e-6)
        assert [s.rank for s in executor.slots] == list(range(N))

    @pytest.mark.timeout(60)
    def test_execute_runs_on_each_actors_state(self, executor: RingcoreExecutor) -> None:
        pids = executor.execute(ray_tasks.remember)
        assert executor.execute(ray_tasks.recall) == [(10 * r, pid) for r, pid in enumerate(pids)]
        assert len(set(pids)) == N

    @pytest.mark.timeout(180)
    def test_ray_util_collective_backend(self, executor: RingcoreExecutor) -> None:
        out = executor.run(ray_tasks.ray_collectives, args=("grads",), timeout_s=150)
        x = _stack(6)
        for rank, o in enumerate(out):
            assert o["registered by the hook"] and o["rank"] == rank
            for kind in ("numpy", "torch"):
                np.testing.assert_allclose(o[f"{kind} allreduce"], x.sum(0), rtol=1e-6)
                np.testing.assert_array_equal(o[f"{kind} allreduce max"], x.max(0))
                np.testing.assert_array_equal(o[f"{kind} broadcast"], x[N - 1])
                for r, part in enumerate(o[f"{kind} allgather"]):
                    np.testing.assert_array_equal(part, x[r].reshape(2, 3))
                scattered = sum(ray_tasks.inputs(r + 10 * rank, 3) for r in range(N))
                np.testing.assert_allclose(o[f"{kind} reducescatter"], scattered, rtol=1e-6)
        # the same group name again: the meeting key of the first group is gone
        again = executor.run(ray_tasks.ray_collectives, args=("grads",), timeout_s=60)
        np.testing.assert_allclose(again[0]["numpy allreduce"], x.sum(0), rtol=1e-6)

    @pytest.mark.timeout(90)
    def test_a_rank_that_raises_is_named_and_the_others_reset(self, executor: RingcoreExecutor) -> None:
        start = time.monotonic()
        with pytest.raises(WorkerError) as caught:
            executor.run(ray_tasks.raise_on, args=(1,), timeout_s=60)
        err = caught.value
        assert type(err) is WorkerError and (err.rank, err.node_ip, err.stopped) == (1, "127.0.0.1", False)
        assert str(err).startswith(
            f"run(raise_on): rank 1 (pid {executor.slots[1].pid}) on node 127.0.0.1 (node id "
        )
        assert "raised ValueError: boom on rank 1" in str(err) and "PeerFailure" in str(err), err
        assert time.monotonic() - start < 20  # PeerFailure at once, not RINGCORE_TIMEOUT (30 s)
        assert executor.started
        out = executor.run(ray_tasks.collectives, args=(5,), timeout_s=60)  # same actors, a new ringcore job
        np.testing.assert_allclose(out[2]["sum"], _stack(5).sum(0), rtol=1e-6)

    @pytest.mark.timeout(120)
    def test_a_killed_actor_is_named_and_the_others_are_stopped(self, executor: RingcoreExecutor) -> None:
        pids = executor.execute(ray_tasks.remember)
        assert pids == [slot.pid for slot in executor.slots]
        start = time.monotonic()
        with pytest.raises(WorkerLost) as caught:
            executor.run(ray_tasks.die_on, args=(1,), timeout_s=60)
        err = caught.value
        assert (err.rank, err.node_ip, err.stopped) == (1, "127.0.0.1", True)
        assert str(err).startswith(f"run(die_on): rank 1 (pid {pids[1]}) on node 127.0.0.1 (node id "), err
        assert "died" in str(err) and "call start() for a new job" in str(err), err
        assert time.monotonic() - start < 20
        assert not executor.started
        _wait_gone(pids)  # ranks 0 and 2 were stopped, not left in their allreduce loop
        executor.start(executable_cls=ray_tasks.Holder, executable_args=(100,))  # a new job on new actors
        assert executor.execute(ray_tasks.recall)[2][0] == 102
        out = executor.run(ray_tasks.collectives, args=(3,), timeout_s=60)
        np.testing.assert_allclose(out[0]["max"], _stack(3).max(0), rtol=1e-6)

    @pytest.mark.timeout(60)
    def test_a_call_past_its_timeout_stops_the_workers(self, executor: RingcoreExecutor) -> None:
        with pytest.raises(WorkerTimeout, match=r"run\(sleep\): ranks 0, 1, 2 did not finish in time"):
            executor.run(time.sleep, args=(60,), timeout_s=1)
        assert not executor.started  # the fixture's shutdown() has nothing left to do


def _wait_gone(pids: list[int], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while any(Path(f"/proc/{pid}").exists() and "Z" not in _state(pid) for pid in pids):
        assert time.monotonic() < deadline, f"workers {pids} still running"
        time.sleep(0.2)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


@pytest.mark.timeout(60)
def test_start_names_what_ray_could_not_place(ray_cluster: str) -> None:
    ex = RingcoreExecutor(2, placement_strategy="STRICT_SPREAD", start_timeout_s=2)  # one node: cannot
    with pytest.raises(RingcoreError, match=r"could not place 2 workers .* \(STRICT_SPREAD\)"):
        ex.start()
    assert not ex.started


# ------------------------------------------------------------------ Ray Train


def _fit(backend: str, out: Path, storage: str) -> dict[int, Any]:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    out.mkdir()
    trainer = TorchTrainer(
        ray_tasks.train_loop,
        train_loop_config={"steps": 5, "batch": 60, "out": str(out)},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        torch_config=TorchConfig(backend=backend),
        run_config=RunConfig(name=backend, storage_path=storage),
    )
    trainer.fit()
    return {rank: dict(np.load(out / f"rank{rank}.npz")) for rank in range(2)}


@pytest.mark.timeout(240)
def test_torch_trainer_on_ringcore_matches_gloo(ray_cluster: str, tmp_path: Path) -> None:
    storage = str(tmp_path / "results")
    runs = {backend: _fit(backend, tmp_path / backend, storage) for backend in ("ringcore", "gloo")}
    for backend, ranks in runs.items():
        assert str(ranks[0]["backend"]) == backend  # the process group Ray Train made
    params = [k for k in runs["gloo"][0] if k.startswith("param/")]
    assert len(params) == 4
    for rank in range(2):
        for name in params:  # 2 ranks: bit-equal
            np.testing.assert_array_equal(
                runs["ringcore"][rank][name], runs["gloo"][rank][name], err_msg=name
            )
            np.testing.assert_array_equal(
                runs["ringcore"][rank][name], runs["ringcore"][0][name], err_msg=name
            )
    losses = runs["ringcore"][0]["losses"]
    assert losses[-1] < losses[0], losses


@pytest.mark.timeout(240)
def test_the_readme_script_runs_on_the_cluster(ray_cluster: str, tmp_path: Path) -> None:
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    cmd = [sys.executable, str(ROOT / "examples" / "ray_digits.py"), "--epochs", "1"]
    cmd += ["--storage-path", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=220, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "executor: 2 ranks, each holds the sum of ranks 1: [1.0, 1.0]" in proc.stdout, proc.stdout
    accuracy = float(proc.stdout.split("TorchTrainer on ringcore: accuracy ")[1].split()[0])
    assert accuracy > 0.7, proc.stdout
