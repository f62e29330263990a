"""``ElasticSampler``: this rank's shard of the samples an epoch has not processed yet (Horovod's
``hvd.elastic.ElasticSampler``).

::

    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True)
    loader = torch.utils.data.DataLoader(dataset, batch_size=32, sampler=sampler)
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0)

    @hvd.elastic.run
    def train(state):
        while state.epoch < epochs:
            for batch, (x, y) in enumerate(loader):  # this rank's share of what is left
                ...  # forward, backward, optimizer.step()
                state.sampler.record_batch(batch, 32)
                state.commit()
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()

Every rank draws one order (a permutation seeded by ``seed + epoch``) of the
samples not yet processed, pads it to a multiple of the world size with its
own first samples, as ``DistributedSampler`` does, and takes every ``size``-th
from its rank. ``record_batch`` marks the samples of this rank's batch done. In
a :class:`~ringcore.torch.elastic.TorchState` a commit keeps the sampler's
``state_dict()``, a rollback loads it back, and a sync (after a change of
world) takes the union of every rank's committed samples and rank 0's epoch,
then shards what is left over the new world: no sample is trained twice in an
epoch, nor skipped, across the change, beyond the last commit's batches.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sized
from typing import Any

import torch

import ringcore


class ElasticSampler(torch.utils.data.Sampler[int]):
    """This rank's share of the samples of ``dataset`` that the current epoch has not processed.

    Args:
        dataset: Anything with ``len()``.
        shuffle: A new order each epoch (the same on every rank), else the dataset's order.
        seed: The shuffle's seed; epoch ``e`` uses ``seed + e``.
        num_replicas, rank: The world (default: the job's, read again at each :meth:`reset`).
    """

    def __init__(
        self,
        dataset: Sized,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> None:
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self._world = (num_replicas, rank)
        self.epoch = 0
        self.processed_indices: set[int] = set()
        self.indices: list[int] = []
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: nothing processed, a new order."""
        self.epoch = epoch
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Mark done the samples of this rank's batch ``batch_idx`` of ``batch_size`` (this epoch's order)."""
        start = batch_idx * batch_size
        self.record_indices(self.indices[start : start + batch_size])

    def record_indices(self, indices: Iterable[int]) -> None:
        """Mark ``indices`` (dataset positions) done."""
        self.processed_indices.update(int(index) for index in indices)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "processed_indices": set(self.processed_indices)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.processed_indices = set(state["processed_indices"])
        self.reset()

    def reset(self) -> None:
        """Shard what is left of the epoch over the world as it is now (after a change of world too)."""
        replicas, rank = self._world
        self.num_replicas = ringcore.size() if replicas is None else replicas
        self.rank = ringcore.rank() if rank is None else rank
        if not 0 <= self.rank < self.num_replicas:
            raise ValueError(f"ElasticSampler: rank {self.rank} is outside a world of {self.num_replicas}")
        left = [index for index in range(len(self.dataset)) if index not in self.processed_indices]
        if self.shuffle:
            order = torch.randperm(len(left), generator=torch.Generator().manual_seed(self.seed + self.epoch))
            left = [left[k] for k in order.tolist()]
        self.num_samples = math.ceil(len(left) / self.num_replicas)
        padded = (left * (1 + self.num_samples * self.num_replicas // max(1, len(left))))[
            : self.num_samples * self.num_replicas
        ]
        self.indices = padded[self.rank :: self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples
