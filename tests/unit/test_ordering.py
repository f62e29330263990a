"""Tickets and turns: collectives run in call order, and an interrupted caller never stalls the rest."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import ringcore
from ringcore.comm import Communicator
from ringcore.config import Settings
from ringcore.plans.base import CallPlan

pytestmark = pytest.mark.timeout(30)


def test_a_caller_interrupted_before_its_turn_breaks_the_communicator_instead_of_stalling_it() -> None:
    """Thread A holds the turn; B is interrupted while it waits; C, called after B, must not wait forever."""
    comm = Communicator(0, 1, 0, 1, Settings(), None)
    release, holding = threading.Event(), threading.Event()

    def hold(obj: Any, seq: int) -> None:
        holding.set()
        release.wait(10)

    first = threading.Thread(target=comm._run, args=(CallPlan("test", hold), None, None), daemon=True)
    first.start()
    assert holding.wait(10)
    real_wait, outcome = comm._cond.wait, {}

    def interrupted(timeout: Any = None) -> bool:
        raise KeyboardInterrupt

    comm._cond.wait = interrupted  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        comm.barrier()  # ticket 1, never run
    comm._cond.wait = real_wait  # type: ignore[method-assign]

    def third() -> None:
        try:
            comm.allreduce(np.ones(4, np.float32))
            outcome["error"] = None
        except BaseException as err:
            outcome["error"] = err

    waiter = threading.Thread(target=third, daemon=True)
    waiter.start()
    release.set()
    first.join(10)
    waiter.join(10)
    assert not waiter.is_alive(), "the call after the interrupted one waited forever"
    assert isinstance(outcome["error"], ringcore.CommunicatorClosed), outcome
    assert "#2 was interrupted (KeyboardInterrupt)" in str(outcome["error"])
    comm.shutdown()
