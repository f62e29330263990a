"""``ringcore.torch.elastic.ElasticSampler``: shards of what an epoch has left, and its place in a
``TorchState`` (commit, rollback, sync across real processes)."""

from __future__ import annotations

import math

import pytest

from tests.bindings import hvd_tasks
from tests.cluster import Cluster

torch = pytest.importorskip("torch")

from ringcore.torch.elastic import ElasticSampler, TorchState  # noqa: E402 - after the skip


def shards(samples: int, replicas: int, **kwargs: object) -> list[ElasticSampler]:
    return [ElasticSampler(range(samples), num_replicas=replicas, rank=r, **kwargs) for r in range(replicas)]


def test_shards_cover_every_sample_once_padded_to_equal_lengths() -> None:
    parts = shards(10, 3, seed=1)
    assert [len(part) for part in parts] == [4, 4, 4]
    taken = [index for part in parts for index in part]
    assert sorted(set(taken)) == list(range(10)) and len(taken) == 12  # two samples twice: the padding
    order = [index for trio in zip(*parts, strict=True) for index in trio]
    assert order[10:] == order[:2], "the padding repeats the order's first samples, as DistributedSampler"


def test_one_order_per_epoch_and_seed_the_same_on_every_rank() -> None:
    plain = shards(8, 2, shuffle=False)
    assert [list(part) for part in plain] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    first, again = shards(64, 2, seed=3), shards(64, 2, seed=3)
    assert [list(p) for p in first] == [list(p) for p in again]
    for part in first:
        part.set_epoch(1)
    assert [list(p) for p in first] != [list(p) for p in again]


def test_recorded_batches_leave_the_rest_to_a_new_world() -> None:
    old = shards(20, 2, seed=5)
    done = set()
    for part in old:
        part.record_batch(1, 3)  # this rank's second batch of three
        done |= part.processed_indices
    assert len(done) == 6
    state = old[0].state_dict() | {"processed_indices": done}
    new = shards(20, 3, seed=5)
    for part in new:
        part.load_state_dict(state)
    taken = {index for part in new for index in part}
    assert taken == set(range(20)) - done
    assert all(len(part) == math.ceil(14 / 3) for part in new)
    new[0].set_epoch(2)
    assert len(new[0]) == math.ceil(20 / 3) and not new[0].processed_indices


def test_a_rank_outside_the_world_and_a_taken_name_are_refused() -> None:
    with pytest.raises(ValueError, match="rank 2 is outside a world of 2"):
        ElasticSampler(range(4), num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="commit"):
        TorchState(commit=ElasticSampler(range(4), num_replicas=1, rank=0))


def test_commit_and_rollback_keep_the_committed_samples_only() -> None:
    sampler = ElasticSampler(range(12), num_replicas=1, rank=0)
    state = TorchState(sampler=sampler, epoch=0)
    first = set(sampler.indices[:4])
    sampler.record_batch(0, 4)
    state.save()
    sampler.record_batch(1, 4)
    assert len(sampler.processed_indices) == 8
    state.restore()
    assert state.sampler.processed_indices == first
    assert set(state.sampler) == set(range(12)) - first and len(state.sampler) == 8


@pytest.mark.timeout(180)
@pytest.mark.parametrize("size", [2, 3])
def test_sync_takes_every_ranks_committed_samples_and_reshards_the_rest(size: int) -> None:
    with Cluster(size, timeout=120) as cluster:
        found = cluster.results(hvd_tasks.sampler_sync, 30, 4)
    committed = set().union(*(rank["first"] for rank in found))
    assert len(committed) == 4 * size
    for rank in found:
        assert rank["done"] == sorted(committed), (
            "the union of committed batches; the uncommitted one rolled back"
        )
    left = [index for rank in found for index in rank["shard"]]
    assert set(left) == set(range(30)) - committed
    assert all(len(rank["shard"]) == math.ceil((30 - 4 * size) / size) for rank in found)
