"""``ElasticSampler``: this rank's shard of what an epoch has left (Horovod's
``hvd.elastic.ElasticSampler``).

::

    hvd.init()
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

Design. An epoch has one order of the whole dataset, the same on every rank
(a permutation seeded by ``seed + epoch``, or the dataset's order). Rank ``r``
of ``N`` takes every ``N``-th sample of what is left from position ``r``,
padded to equal lengths with the first samples left, as ``DistributedSampler``
pads. So after every rank has run ``k`` batches of ``B`` samples, exactly the
first ``processed`` = ``k * B * N`` samples of the order are done, whichever
rank ran which, and the sampler's whole state is ``(epoch, processed)``, the
same on every rank. In a :class:`~ringcore.torch.elastic.TorchState` a commit
keeps it, a rollback loads it back, and a sync takes rank 0's, as it takes
rank 0's model: after a change of world (a rank lost or added) the new world
shards the rest of the same order, so the epoch goes on from the samples of
the model every rank now holds, none twice and none skipped.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import Any

import torch

from ringcore.torch import basics


class ElasticSampler(torch.utils.data.Sampler[int]):
    """This rank's share of the samples of ``dataset`` that the current epoch has not processed.

    Args:
        dataset: Anything with ``len()``.
        shuffle: A new order each epoch (the same on every rank), else the dataset's order.
        seed: The shuffle's seed; epoch ``e`` uses ``seed + e``.
        num_replicas, rank: The world (default: the job's, read again at each :meth:`reset`,
            so ``hvd.init()`` comes first).

    Raises:
        ValueError: ``rank`` is not in ``[0, num_replicas)``.
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
        self.processed = 0  # the first ``processed`` samples of the epoch's order are done
        self.num_replicas = self.rank = self.num_samples = 0
        self.indices: list[int] = []
        self._start = 0  # ``processed`` when this pass over the shard began
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Go to epoch ``epoch``: a new epoch starts afresh, the current one keeps what it has done
        (so calling it at the top of each epoch, as with ``DistributedSampler``, loses nothing)."""
        if epoch != self.epoch:
            self.epoch, self.processed = epoch, 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Mark done batch ``batch_idx`` (counted from 0 in this pass over the shard: a loop over the
        loader restarts at 0 after a sync) of ``batch_size`` samples, on every rank at once."""
        done = self._start + (batch_idx + 1) * batch_size * self.num_replicas
        self.processed = max(self.processed, min(len(self.dataset), done))

    def state_dict(self) -> dict[str, int]:
        """What a commit keeps: ``{"epoch": ..., "processed": ...}``."""
        return {"epoch": self.epoch, "processed": self.processed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take ``state`` (a :meth:`state_dict`) and shard what it leaves over the world as it is now."""
        self.epoch, self.processed = int(state["epoch"]), int(state["processed"])
        self.reset()

    def reset(self) -> None:
        """Shard what is left of the epoch over the world as it is now (after a change of world too).

        Raises:
            ValueError: This rank is not in the world.
        """
        replicas, rank = self._world
        self.num_replicas = basics.size() if replicas is None else replicas
        self.rank = basics.rank() if rank is None else rank
        if not 0 <= self.rank < self.num_replicas:
            raise ValueError(
                f"ElasticSampler: rank {self.rank} is outside a world of {self.num_replicas}; "
                "pass 0 <= rank < num_replicas, or neither to use the job's"
            )
        count = len(self.dataset)
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(count, generator=generator).tolist()
        else:
            order = list(range(count))
        left = order[self.processed :]
        self.num_samples = math.ceil(len(left) / self.num_replicas)
        total = self.num_samples * self.num_replicas
        padded = (left * (1 + total // max(1, len(left))))[:total]
        self.indices = padded[self.rank :: self.num_replicas]
        self._start = self.processed

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples
