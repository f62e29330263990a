"""Elastic training on Ray: ElasticRingcoreExecutor replaces a lost actor and the job goes on from its commit.

One local Ray cluster of 4 CPUs serves the module (``tests/bindings/ray_cluster.py``;
no Ray process outlives it). Workers reserve one CPU each and train
``ray_elastic_tasks.train`` (a numpy model in a ``ringcore.elastic.State``).
Faults come from outside, as users meet them: the test kills an actor with
``ray.kill`` once rank 0 reports a step in the middle of an epoch, and takes
the freed CPUs with actors of its own when no replacement must fit.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from ringcore.ray import ElasticRingcoreExecutor, WorkerError, WorkerLost  # noqa: E402
from tests.bindings import ray_elastic_tasks as tasks  # noqa: E402
from tests.bindings.ray_cluster import local_cluster  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ENV = {"RINGCORE_TIMEOUT": "10", "OMP_NUM_THREADS": "1"}  # a dead peer is seen at once; 10 s bounds a stall
EPOCHS, BATCHES = 3, 12


@pytest.fixture(scope="module", autouse=True)
def ray_cluster() -> Iterator[str]:
    with local_cluster(4, {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}) as temp_dir:
        yield temp_dir


@ray.remote(num_cpus=1)
class Blocker:
    """Holds a CPU, so that Ray has no room for a replacement."""

    def ready(self) -> bool:
        return True


def when_progress(
    out: Path, reached: Callable[[int, int, int], bool], action: Callable[[], None]
) -> threading.Thread:
    """Run ``action`` on a thread once rank 0's progress (epoch, batch, size) satisfies ``reached``."""

    def watch() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                epoch, batch, size = map(int, (out / "progress").read_text().split())
            except (OSError, ValueError):
                epoch = batch = size = -1
            if epoch >= 0 and reached(epoch, batch, size):
                action()
                return
            time.sleep(0.02)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def kill(executor: ElasticRingcoreExecutor, workers: list[int], killed: list[tuple[int, Any]]) -> None:
    live = executor.workers()
    for worker in workers:
        ray.kill(live[worker], no_restart=True)
        killed.append((worker, live[worker]))


def wait_for_free_cpus(count: int) -> None:
    """Until Ray reports ``count`` free CPUs (the last test's actors release theirs as they die)."""
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0) < count:
        assert time.monotonic() < deadline, ray.available_resources()
        time.sleep(0.1)


def dead(handle: Any) -> bool:
    try:
        ray.get(handle.describe.remote(), timeout=10)
    except ray.exceptions.RayActorError:
        return True
    return False


def test_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="min_workers <= max_workers"):
        ElasticRingcoreExecutor(3, 2)
    with pytest.raises(ValueError, match="gpus_per_worker needs use_gpu"):
        ElasticRingcoreExecutor(1, 2, gpus_per_worker=1)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("victim", [1, 0], ids=["rank1", "rank0"])
def test_a_killed_actor_is_replaced_and_training_resumes_from_the_commit(tmp_path: Path, victim: int) -> None:
    wait_for_free_cpus(4)
    executor = ElasticRingcoreExecutor(2, 4, env=ENV, elastic_timeout_s=30, failure_cooldown_s=0.5)
    killed: list[tuple[int, Any]] = []
    watcher = when_progress(
        tmp_path, lambda e, b, s: (e, b) >= (1, 4), lambda: kill(executor, [victim], killed)
    )
    results = executor.run(tasks.train, args=(str(tmp_path), EPOCHS, BATCHES, 0.05, 4))
    watcher.join(5)

    assert [w for w, _ in killed] == [victim], "the watcher never saw rank 0 in epoch 1"
    survivors = [w for w in range(4) if w != victim]
    assert executor.members[:3] == survivors and executor.members[3] >= 4, executor.members  # a replacement
    assert executor.generation >= 2
    assert [r["worker"] for r in results] == executor.members
    assert [(r["rank"], r["size"]) for r in results] == [(rank, 4) for rank in range(4)]
    first = results[0]
    for result in results:
        same = {key: result[key] for key in ("epoch", "batch", "steps", "digest")}
        assert same == {key: first[key] for key in same}, (result["worker"], same)
    assert (first["epoch"], first["batch"], first["steps"]) == (
        EPOCHS,
        0,
        EPOCHS * BATCHES,
    )  # none lost, none twice
    np.testing.assert_allclose(first["w"], tasks.reference(EPOCHS, BATCHES), rtol=1e-4, atol=1e-5)
    assert all(r["resets"] and r["resets"][-1] == 4 for r in results if r["worker"] in survivors)
    assert dead(killed[0][1]) and executor.workers() == {}


@pytest.mark.timeout(75)
def test_too_few_left_fails_naming_the_lost_actors_and_stops_the_rest(tmp_path: Path) -> None:
    blockers = [Blocker.remote()]  # 4 CPUs: 3 workers and one blocker
    ray.get(blockers[0].ready.remote(), timeout=30)
    wait_for_free_cpus(3)
    executor = ElasticRingcoreExecutor(2, 3, env=ENV, elastic_timeout_s=10, failure_cooldown_s=1)
    killed: list[tuple[int, Any]] = []
    seen: dict[int, Any] = {}

    def take_cpus_and_kill() -> None:
        seen.update(executor.workers())
        blockers.extend(Blocker.remote() for _ in range(2))  # waiting for the CPUs the kills free
        kill(executor, [1, 2], killed)

    watcher = when_progress(tmp_path, lambda e, b, s: (e, b) >= (0, 3) and s == 3, take_cpus_and_kill)
    start = time.monotonic()
    try:
        with pytest.raises(WorkerLost) as caught:
            executor.run(tasks.train, args=(str(tmp_path), EPOCHS, BATCHES, 0.05))
        took = time.monotonic() - start
        watcher.join(5)
        message = str(caught.value)
        assert (
            "ElasticRingcoreExecutor.run(train): 1 worker left, fewer than min_workers 2, for 10 s" in message
        )
        assert "(elastic_timeout_s)" in message and "; stopped workers 0" in message, message
        assert "worker 1 (pid " in message and "worker 2 (pid " in message, message
        assert "died: " in message, message
        assert isinstance(caught.value.__cause__, ray.exceptions.RayActorError)
        assert took < 50, took
        assert sorted(seen) == [0, 1, 2] and len(killed) == 2 and executor.workers() == {}
        assert all(dead(handle) for handle in seen.values())  # the survivor too
    finally:
        for blocker in blockers:
            ray.kill(blocker, no_restart=True)


@pytest.mark.timeout(60)
def test_a_function_that_raises_ends_the_job_at_once() -> None:
    executor = ElasticRingcoreExecutor(2, 3, env=ENV, elastic_timeout_s=30)
    start = time.monotonic()
    with pytest.raises(WorkerError) as caught:
        executor.run(tasks.raise_on, args=(1,))
    assert time.monotonic() - start < 30
    assert not isinstance(caught.value, WorkerLost)
    message = str(caught.value)
    assert "ElasticRingcoreExecutor.run(raise_on): worker 1 (pid " in message, message
    assert "raised ValueError: boom on worker 1 (rank 1 of generation 1)" in message, message
    assert executor.workers() == {}
