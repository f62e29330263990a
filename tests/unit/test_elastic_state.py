"""``ringcore.elastic.State`` and ``ringcore.torch.elastic.TorchState`` in one process (a world of one).

What a commit keeps, what a rollback restores (arrays in place, nothing
aliased with the snapshot), and ``run`` outside an elastic launcher. Jobs
that lose and gain ranks are in ``tests/integration/test_elastic.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

import ringcore
import ringcore.elastic
from ringcore import elastic_rendezvous
from ringcore.elastic_protocol import WORKER_VARIABLE
from ringcore.errors import ConfigError


def test_commit_and_restore_keep_values_and_arrays_in_place() -> None:
    w = np.arange(4.0, dtype=np.float32)
    state = ringcore.elastic.State(epoch=0, w=w, log=["start"])
    state.epoch, state.log = 3, [*state.log, "epoch 3"]
    state.w += 1
    state.commit()  # outside an elastic job: a snapshot, no question to any launcher
    state.epoch = 7
    state.w *= 100
    state.log.append("lost")
    state.restore()
    assert (state.epoch, state.log) == (3, ["start", "epoch 3"])
    assert state.w is w and w.tolist() == [1.0, 2.0, 3.0, 4.0]  # restored into the caller's array
    state.log.append("again")
    state.restore()
    assert state.log == ["start", "epoch 3"]  # the snapshot is not shared with the live value


def test_a_replaced_array_is_restored_as_a_copy() -> None:
    state = ringcore.elastic.State(w=np.zeros(3))
    state.w = np.ones(5)  # another shape: cannot be written in place
    state.restore()
    assert state.w.shape == (3,) and not state.w.any()


@pytest.mark.parametrize("name", ["_hidden", "commit", "sync", "on_reset"])
def test_names_state_uses_itself_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="taken by State itself"):
        ringcore.elastic.State(**{name: 1})


def test_reset_callbacks_run_in_order() -> None:
    calls: list[str] = []
    state = ringcore.elastic.State(epoch=0)
    state.register_reset_callbacks([lambda: calls.append("a"), lambda: calls.append("b")])
    state.on_reset()
    assert calls == ["a", "b"]
    assert repr(state) == "State(epoch=0)"


def test_run_outside_an_elastic_launcher_is_one_plain_call() -> None:
    state = ringcore.elastic.State(epoch=0, w=np.zeros(2))

    @ringcore.elastic.run
    def train(state: ringcore.elastic.State, epochs: int) -> str:
        while state.epoch < epochs:
            state.w += ringcore.allreduce(np.ones(2))  # a world of one
            state.epoch += 1
            state.commit()
        return f"{ringcore.size()} rank"

    try:
        state.epoch = 1  # set up after the state was made: counts as committed when train starts
        assert train(state, 3) == "1 rank"
        assert state.epoch == 3 and state.w.tolist() == [2.0, 2.0]
    finally:
        ringcore.shutdown()


def test_no_rendezvous_without_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(WORKER_VARIABLE, raising=False)
    assert elastic_rendezvous.from_env() is None
    monkeypatch.setenv(WORKER_VARIABLE, "two")
    with pytest.raises(ConfigError, match=r"RINGCORE_ELASTIC_WORKER=.two. is not an integer"):
        elastic_rendezvous.from_env()
    monkeypatch.setenv(WORKER_VARIABLE, "2")
    monkeypatch.delenv("RINGCORE_PORT", raising=False)
    with pytest.raises(ConfigError, match="RINGCORE_ADDR/RINGCORE_PORT"):
        elastic_rendezvous.from_env()


def test_torch_state_rolls_model_and_optimizer_back() -> None:
    torch = pytest.importorskip("torch")
    import ringcore.torch.elastic

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step() -> None:
        optimizer.zero_grad()
        model(torch.ones(4, 3)).sum().backward()
        optimizer.step()

    step()  # momentum buffers exist
    state = ringcore.torch.elastic.TorchState(model, optimizer, batch=1)
    committed = [p.detach().clone() for p in model.parameters()]
    momentum = [optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    for _ in range(2):
        step()
        state.batch += 1
        state.restore()
        assert state.batch == 1
        assert all(torch.equal(p, c) for p, c in zip(model.parameters(), committed, strict=True))
        # a step after a rollback must not write into the snapshot (load_state_dict keeps what it is given)
        assert all(
            torch.equal(optimizer.state[p]["momentum_buffer"], m)
            for p, m in zip(model.parameters(), momentum, strict=True)
        )
