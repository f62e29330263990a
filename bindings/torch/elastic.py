"""``ringcore.torch.elastic``: Horovod's ``hvd.elastic`` for PyTorch models (``TorchState``, ``run``).

::

    import ringcore.torch as hvd
    import ringcore.torch.elastic

    hvd.init()
    model, optimizer = Net(), torch.optim.SGD(...)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        while state.epoch < epochs:
            while state.batch < batches:
                ...  # this rank's shard of batch state.batch: forward, backward, optimizer.step()
                state.batch += 1
                state.commit()
            state.epoch, state.batch = state.epoch + 1, 0
            state.commit()

    train(state)

:class:`TorchState` is :class:`ringcore.elastic.State` plus a model, an
optimizer and samplers: a commit keeps copies of their ``state_dict()``s, a
rollback loads them back, and a sync takes rank 0's (the model's and the
optimizer's with ``broadcast_parameters`` and ``broadcast_optimizer_state``). After each new rendezvous a
``DistributedOptimizer`` is moved to the new communicator
(``optimizer.rebind()``) before the reset callbacks run; that checks the
model's layout as making the optimizer does, so make the model and the
``DistributedOptimizer`` between ``hvd.init()`` and ``train(state)`` with no
other collective in between, as above: a worker that joins later then issues
the same collectives as the ranks it joins. ``run`` and
``HostsUpdatedInterrupt`` are :mod:`ringcore.elastic`'s. :class:`ElasticSampler`
(:mod:`ringcore.torch.elastic_sampler`) resumes an epoch where the last commit left it.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from ringcore.comm import Communicator
from ringcore.elastic import HostsUpdatedInterrupt, State, run
from ringcore.torch.elastic_sampler import ElasticSampler
from ringcore.torch.objects import broadcast_object
from ringcore.torch.parameters import broadcast_optimizer_state, broadcast_parameters

__all__ = ["ElasticSampler", "HostsUpdatedInterrupt", "State", "TorchState", "run"]


class TorchState(State):
    """A model, an optimizer, samplers and plain values that survive a change of world.

    Args:
        model: Its parameters and buffers are committed, restored and synced (``state_dict()``).
        optimizer: Its state (momentum, Adam's moments, hyper-parameters) likewise.
        **values: More attributes, as for :class:`ringcore.elastic.State`; an
            :class:`ElasticSampler` among them is committed and restored by its ``state_dict()``
            and synced from rank 0 (:mod:`ringcore.torch.elastic_sampler`).

    Raises:
        ValueError: A name starts with ``_`` or is one of this class's methods.
    """

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        **values: Any,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self._model_saved: dict[str, Any] | None = None
        self._optimizer_saved: dict[str, Any] | None = None
        samplers = {name: value for name, value in values.items() if isinstance(value, ElasticSampler)}
        for name in samplers:
            if name.startswith("_") or hasattr(type(self), name):
                raise ValueError(
                    f"TorchState({name}=...): that name is taken by State itself; choose another"
                )
        self.__dict__.update(samplers)
        self._samplers = tuple(sorted(samplers))
        self._samplers_saved: dict[str, dict[str, int]] = {}
        super().__init__(**{name: value for name, value in values.items() if name not in samplers})

    def save(self) -> None:
        super().save()
        if self.model is not None:
            self._model_saved = copy.deepcopy(self.model.state_dict())
        if self.optimizer is not None:
            self._optimizer_saved = copy.deepcopy(self.optimizer.state_dict())
        self._samplers_saved = {name: getattr(self, name).state_dict() for name in self._samplers}

    def restore(self) -> None:
        super().restore()
        for name, saved in self._samplers_saved.items():
            getattr(self, name).load_state_dict(saved)
        if self.model is not None and self._model_saved is not None:
            self.model.load_state_dict(self._model_saved)
        if self.optimizer is not None and self._optimizer_saved is not None:
            # A copy: load_state_dict keeps the tensors it is given, and steps update them in place.
            self.optimizer.load_state_dict(copy.deepcopy(self._optimizer_saved))

    def on_reset(self) -> None:
        """Move a ``DistributedOptimizer`` to the new world's communicator, then run the reset callbacks."""
        rebind = getattr(self.optimizer, "rebind", None)  # a DistributedOptimizer's
        if rebind is not None:
            rebind()
        super().on_reset()

    def _broadcast_from_root(self, comm: Communicator) -> None:
        super()._broadcast_from_root(comm)
        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), root_rank=0)
        if self.optimizer is not None:
            broadcast_optimizer_state(self.optimizer, root_rank=0)
        if self._samplers:  # rank 0's place in each epoch, as its model: the new world shards the rest
            mine = {name: getattr(self, name).state_dict() for name in self._samplers}
            for name, state in broadcast_object(comm, mine, 0, "elastic: samplers").items():
                getattr(self, name).load_state_dict(state)
