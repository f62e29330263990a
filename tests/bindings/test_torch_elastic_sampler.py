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
    """Every rank's sampler of one world, built here as each rank builds its own."""
    return [ElasticSampler(range(samples), num_replicas=replicas, rank=r, **kwargs) for r in range(replicas)]


def order(parts: list[ElasticSampler]) -> list[int]:
    """The samples in the order the ranks take them: rank 0's first, rank 1's first, ..."""
    return [index for group in zip(*parts, strict=True) for index in group]


def test_shards_cover_every_sample_once_padded_to_equal_lengths() -> None:
    parts = shards(10, 3, seed=1)
    assert [len(part) for part in parts] == [4, 4, 4]
    taken = order(parts)
    assert sorted(set(taken)) == list(range(10)) and len(taken) == 12
    assert taken[10:] == taken[:2], "the padding repeats the first samples left, as DistributedSampler's"
    assert [list(part) for part in shards(8, 2, shuffle=False)] == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_the_order_depends_on_seed_and_epoch_alone() -> None:
    first, again = order(shards(64, 2, seed=3)), order(shards(64, 4, seed=3))
    assert first == again, "one order of the epoch, however many ranks share it"
    moved = shards(64, 2, seed=3)
    for part in moved:
        part.set_epoch(1)
    assert order(moved) != first and sorted(order(moved)) == list(range(64))


def test_recorded_batches_are_a_prefix_the_next_world_goes_on_from() -> None:
    old = shards(20, 2, seed=5)
    whole = order(old)
    for part in old:
        part.record_batch(1, 3)  # every rank's second batch of three: 12 samples of the order done
    assert {part.processed for part in old} == {12}
    new = shards(20, 3, seed=5)
    for part in new:
        part.load_state_dict(old[0].state_dict())
    assert order(new)[:8] == whole[12:], "the rest of the same order, sharded over three"
    assert all(len(part) == math.ceil(8 / 3) for part in new)
    for part in new:  # a batch of the new pass counts from where the pass began
        part.record_batch(0, 2)
    assert {part.processed for part in new} == {18}


def test_set_epoch_keeps_the_current_epochs_progress_and_starts_a_new_one_afresh() -> None:
    sampler = ElasticSampler(range(12), num_replicas=2, rank=0)
    sampler.record_batch(0, 2)
    sampler.set_epoch(0)  # DistributedSampler's habit, at the top of the epoch: nothing lost
    assert sampler.processed == 4 and len(sampler) == 4
    sampler.set_epoch(1)
    assert sampler.processed == 0 and len(sampler) == 6


def test_what_is_left_may_be_less_than_a_sample_per_rank_or_nothing() -> None:
    parts = shards(7, 3, shuffle=False)
    for part in parts:
        part.load_state_dict({"epoch": 0, "processed": 6})
    assert [list(part) for part in parts] == [[6], [6], [6]]
    for part in parts:
        part.record_batch(0, 1)
        part.reset()
    assert [len(part) for part in parts] == [0, 0, 0] and not any(list(part) for part in parts)


def test_a_rank_outside_the_world_and_a_taken_name_are_refused() -> None:
    with pytest.raises(ValueError, match="rank 2 is outside a world of 2"):
        ElasticSampler(range(4), num_replicas=2, rank=2)
    with pytest.raises(ValueError, match=r"TorchState\(commit=...\)"):
        TorchState(commit=ElasticSampler(range(4), num_replicas=1, rank=0))


class Undeepcopyable(list):
    def __deepcopy__(self, memo: object) -> None:
        raise AssertionError("a commit copied the dataset")


def test_commit_and_rollback_keep_the_committed_place_and_never_copy_the_dataset() -> None:
    sampler = ElasticSampler(Undeepcopyable(range(12)), num_replicas=1, rank=0)
    state = TorchState(sampler=sampler, epoch=0)
    first = sampler.indices[:4]
    sampler.record_batch(0, 4)
    state.save()
    sampler.record_batch(1, 4)
    assert sampler.processed == 8
    state.restore()
    assert state.sampler is sampler and sampler.processed == 4
    assert set(sampler) == set(range(12)) - set(first) and len(sampler) == 8


@pytest.mark.timeout(180)
@pytest.mark.parametrize("size", [2, 3])
def test_sync_takes_rank_0s_place_in_the_epoch_and_reshards_the_rest(size: int) -> None:
    with Cluster(size, timeout=120) as cluster:
        found = cluster.results(hvd_tasks.sampler_sync, 30, 4)
    whole = order([ElasticSampler(range(30), seed=7, num_replicas=1, rank=0)])  # epoch 0's order
    expected = shards(30, size, seed=7)
    for part in expected:
        part.load_state_dict(
            {"epoch": 2, "processed": 4 * size}
        )  # the committed batch, the other rolled back
    assert order(expected)[: 30 - 4 * size] != whole[4 * size :], "epoch 2's order, not epoch 0's"
    for rank, got in enumerate(found):
        assert got["state"] == {"epoch": 2, "processed": 4 * size}, rank  # the newcomer's too
        assert got["shard"] == list(expected[rank]), rank
