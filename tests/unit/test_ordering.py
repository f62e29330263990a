"""Tickets and turns: collectives run in call order, and an interrupted caller never stalls the rest."""

from __future__ import annotations

import queue
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest

import ringcore
from ringcore.comm import Communicator
from ringcore.config import Settings
from ringcore.kernels import numpy_ops
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


def test_threads_racing_for_turns_run_every_ticket_once_in_order_and_none_waits_forever() -> None:
    """Blocking and async calls from four threads, thread switches forced every 5 us: the turn is
    passed without a lock, so a waiter that misses the pass would hang here (the test's timeout),
    and two collectives running at once would show in ``inside``."""
    comm = Communicator(0, 1, 0, 1, Settings(), None)
    ran: list[int] = []
    inside = [0, 0]  # running now, most ever at once

    def record(obj: Any, seq: int) -> None:
        inside[0] += 1
        inside[1] = max(inside)
        ran.append(seq)
        inside[0] -= 1

    def caller(index: int) -> None:
        for call in range(500):
            if index == 0 and call % 5 == 0:
                comm._run_async(CallPlan("test", record), None, None)
            else:
                comm._run(CallPlan("test", record), None, None)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(5e-6)
    try:
        threads = [threading.Thread(target=caller, args=(index,), daemon=True) for index in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(20)
        assert not any(thread.is_alive() for thread in threads), "a caller waited forever for its turn"
    finally:
        sys.setswitchinterval(switch)
        comm.shutdown()  # waits for the queued async calls
    assert inside[1] == 1, "two collectives ran at once"
    assert ran == list(range(1, 2001))


def test_a_turn_lost_to_an_interrupt_fails_the_next_call_instead_of_hanging_it() -> None:
    """A KeyboardInterrupt between taking a ticket and entering its turn leaves the turn unowned
    (here: a ticket taken and dropped); the next call waits ``RINGCORE_TIMEOUT`` (1 s here), not forever."""
    comm = Communicator(0, 1, 0, 1, Settings(timeout=1.0), None)
    comm.barrier()  # ticket 0 runs
    next(comm._tickets)  # ticket 1: taken, never run, as when interrupted at the call into its turn
    started = time.monotonic()
    with pytest.raises(ringcore.CommunicatorClosed, match="#2 never started in its turn"):
        comm.barrier()  # ticket 2
    assert time.monotonic() - started < 10
    with pytest.raises(ringcore.CommunicatorClosed):  # broken from now on, at once
        comm.barrier()
    comm.shutdown()


def test_an_async_call_waiting_behind_a_slow_done_callback_is_not_taken_for_lost() -> None:
    """The worker runs done-callbacks between jobs: the next async call's turn goes unstarted for as
    long as one runs (here 2.5 s, past the 1 s grace), and a blocking call behind it must just wait."""
    comm = Communicator(0, 1, 0, 1, Settings(timeout=1.0), None)
    ran: list[int] = []
    release = threading.Event()

    def held(obj: Any, seq: int) -> None:
        release.wait(10)
        ran.append(seq)

    first = comm._run_async(CallPlan("test", held), None, None)  # ticket 0
    first.add_done_callback(
        lambda handle: time.sleep(2.5)
    )  # added while the job is held: the worker calls it
    second = comm._run_async(CallPlan("test", lambda obj, seq: ran.append(seq)), None, None)  # ticket 1
    release.set()
    comm._run(CallPlan("test", lambda obj, seq: ran.append(seq)), None, None)  # ticket 2: no error
    second.wait()
    assert ran == [1, 2, 3]
    comm.shutdown()


def test_an_interrupt_inside_the_turn_breaks_the_communicator_and_passes_the_turn() -> None:
    """A KeyboardInterrupt after the turn began but before the plan ran: the communicator is broken
    (this rank skipped a collective its peers run) and the next call says so at once."""
    comm = Communicator(0, 1, 0, 1, Settings(), None)
    real = comm.stall

    class Interrupted:
        """A stall inspector whose verdict, read in the turn before the plan runs, is a Ctrl-C."""

        @property
        def reason(self) -> str | None:
            raise KeyboardInterrupt

    comm.stall = Interrupted()  # type: ignore[assignment]
    with pytest.raises(KeyboardInterrupt):
        comm.barrier()
    comm.stall = real
    assert isinstance(comm.ctx.broken, KeyboardInterrupt)
    with pytest.raises(ringcore.CommunicatorClosed, match="after an earlier failure"):
        comm.barrier()
    comm.shutdown()


def test_a_failing_timeline_still_passes_the_turn() -> None:
    """The timeline's write fails after the collective ran: the error reaches the caller, the next
    collective runs (the turn was passed in an inner ``finally``)."""
    comm = Communicator(0, 1, 0, 1, Settings(), None)

    class Failing:
        def complete(self, *args: Any) -> None:
            raise OSError("disk full")

    comm.timeline = Failing()  # type: ignore[assignment]
    with pytest.raises(OSError, match="disk full"):
        comm.barrier()
    comm.timeline = None
    ran: list[int] = []
    comm._run(CallPlan("test", lambda obj, seq: ran.append(seq)), None, None)
    assert ran == [2]
    comm.shutdown()


def test_a_caller_whose_turn_was_taken_for_lost_gets_an_error_not_a_wait() -> None:
    """The lost-turn watch moved the turn past this ticket while its caller was slow to reach it:
    the caller must fail at once, not wait for a turn that never comes back."""
    comm = Communicator(0, 1, 0, 1, Settings(), None)
    ticket = next(comm._tickets)
    comm._abandon(ticket, None)  # what the watch does to a turn nobody started
    ran: list[int] = []
    with pytest.raises(ringcore.CommunicatorClosed, match="#1: its turn was taken for lost"):
        comm._run(CallPlan("test", lambda obj, seq: ran.append(seq)), None, None, ticket)
    assert ran == []
    comm.shutdown()


def test_an_async_call_that_could_not_be_queued_breaks_the_communicator_instead_of_stalling_it() -> None:
    """A KeyboardInterrupt inside the queue's put: that ticket will never run, so later calls must
    fail at once rather than wait for it."""
    comm = Communicator(0, 1, 0, 1, Settings(), None)

    def interrupted(job: Any) -> None:
        raise KeyboardInterrupt

    comm._jobs.put = interrupted  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        comm._run_async(CallPlan("test", lambda obj, seq: None), None, None)
    assert comm._queued == set()
    with pytest.raises(ringcore.CommunicatorClosed, match="#1 was interrupted"):
        comm._run(CallPlan("test", lambda obj, seq: None), None, None)
    comm._jobs = queue.Queue()
    comm.shutdown()


def test_a_done_callback_raising_system_exit_leaves_the_async_worker_running() -> None:
    comm = Communicator(0, 1, 0, 1, Settings(), None)
    release = threading.Event()
    first = comm._run_async(CallPlan("test", lambda obj, seq: release.wait(10)), None, None)

    def leave(handle: Any) -> None:
        raise SystemExit

    first.add_done_callback(leave)  # added while the job is held: the worker calls it
    release.set()
    first.wait(10)
    second = comm._run_async(CallPlan("test", lambda obj, seq: seq), None, None)
    assert second.wait(10) == 2
    comm.shutdown()


@pytest.mark.parametrize("numpy_state", ["context variable", "np.errstate"])
def test_a_collective_runs_with_float_errors_ignored_and_the_callers_state_comes_back(
    numpy_state: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The turn sets numpy's error state itself (the context variable), or through ``np.errstate``
    where numpy has no such variable; either way the plan runs ignoring float errors, and the
    caller's state is back afterwards, also when the plan raises."""

    if numpy_state == "np.errstate":
        monkeypatch.setattr(numpy_ops, "FP_ERRORS", None)
    comm = Communicator(0, 1, 0, 1, Settings(), None)

    class Probe:
        kind, nbytes, details = "allreduce", 0, {}

        def __init__(self, fail: bool) -> None:
            self.fail = fail

        def run(self, obj: Any, seq: int) -> dict[str, str]:
            big = np.full(4, np.finfo(np.float32).max, np.float32)
            np.add(big, big, out=np.empty_like(big))  # overflow: raises under the caller's state
            if self.fail:
                raise ValueError("the plan failed")
            return np.geterr()

    with np.errstate(all="raise"):
        assert set(comm._run(Probe(False), None, None).values()) == {"ignore"}
        assert set(np.geterr().values()) == {"raise"}
        with pytest.raises(ValueError, match="the plan failed"):
            comm._run(Probe(True), None, None)
        assert set(np.geterr().values()) == {"raise"}
    comm.shutdown()
