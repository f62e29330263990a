"""Collectives that fail (a peer dies or is cut, calls mismatch): what the error says, and what the buffer holds.

Each task returns the error's qualified type, message and peer, the rounds that
succeeded, and whether the caller's buffer kept its values outside the elements
the error's note names (or, for sliced reductions, holds the promised sums).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tests.tasks.faults import SendTrigger, _hook_phase, _inject, fault_in_round_one


def check_then_allreduce(comm: Any, inputs: list[np.ndarray]) -> Any:
    """Return (error type, original buffer untouched?) after a failing allreduce."""
    buf = inputs[comm.rank].copy()
    try:
        comm.allreduce(buf)
    except Exception as err:
        return type(err).__name__, bool(np.array_equal(buf, inputs[comm.rank]))
    return "no error", True


def exposed_range(err: BaseException) -> tuple[int, int] | None:
    """The elements a failed allreduce's note says may hold partial sums, or None."""
    import re

    notes = " ".join(getattr(err, "__notes__", []))
    match = re.search(r"elements \[(\d+), (\d+)\) of \d+ may hold partial sums", notes)
    return (int(match.group(1)), int(match.group(2))) if match else None


def done_upto(err: BaseException) -> int:
    """How many leading elements a failed sliced allreduce's note says already hold the result."""
    import re

    notes = " ".join(getattr(err, "__notes__", []))
    match = re.search(r"elements \[0, (\d+)\) of \d+ already hold the result", notes)
    return int(match.group(1)) if match else 0


def untouched_except_noted(buf: np.ndarray, original: np.ndarray, err: BaseException) -> bool:
    """Whether a failed allreduce kept the caller's values everywhere its notes do not name.

    The notes name the slices already reduced (``[0, done)``) and the
    elements the failed slice may have written; everything else must be as it was.
    """
    done = done_upto(err)
    start, end = exposed_range(err) or (done, done)
    if done and start != done:
        return False  # the failed slice starts where the finished ones end
    return bool(
        np.array_equal(buf[done:start], original[done:start]) and np.array_equal(buf[end:], original[end:])
    )


def mismatch_then_retry(
    comm: Any, per_rank_calls: list[tuple[str, tuple, dict]], delays: list[float] | None = None
) -> dict[str, Any]:
    """After this rank's delay, make its (possibly mismatched) call, then try one more allreduce.

    Array arguments are copied first; returns the error's type and message,
    whether those arrays were left untouched, and the retry's error type and message.
    """
    import time

    time.sleep(delays[comm.rank] if delays else 0.0)
    name, args, kwargs = per_rank_calls[comm.rank]
    args = tuple(a.copy() if isinstance(a, np.ndarray) else a for a in args)
    before = [a.copy() for a in args if isinstance(a, np.ndarray)]
    report: dict[str, Any] = {"error": "no error", "message": ""}
    try:
        getattr(comm, name)(*args, **kwargs)
    except Exception as err:
        report["error"], report["message"] = _qualified(err), str(err)
    after = [a for a in args if isinstance(a, np.ndarray)]
    report["untouched"] = all(np.array_equal(a, b) for a, b in zip(after, before, strict=True))
    try:
        comm.allreduce(np.ones(4, np.float32))
        report["retry"] = "no error"
    except Exception as err:
        report["retry"], report["retry_message"] = _qualified(err), str(err)
    return report


def _qualified(err: BaseException) -> str:
    """``module.Class`` of an exception, so tests can tell the exact type."""
    return f"{type(err).__module__}.{type(err).__qualname__}"


def allreduce_until_failure(
    comm: Any, count: int, max_rounds: int, fault: tuple[int, str, str, float] | None = None
) -> dict[str, Any]:
    """Allreduce a random float32 buffer (fresh copy each round) until a collective fails.

    Returns the error's type, message and ``peer`` attribute, the number of
    rounds that succeeded, whether the failed round left the buffer as it was
    outside the elements its note names, and those elements. ``fault``:
    ``(victim, kind, stamp, fraction)``: the victim injects ``kind`` (see
    :func:`_inject`) from inside round 1's allreduce (:class:`SendTrigger`).
    """
    import time

    original = np.random.default_rng(comm.rank).standard_normal(count, dtype=np.float32)
    buf = np.empty_like(original)
    with fault_in_round_one(comm, fault) as next_round:
        for rounds in range(max_rounds):
            next_round(rounds)
            np.copyto(buf, original)
            try:
                comm.allreduce(buf)
            except Exception as err:
                return {
                    "error": _qualified(err),
                    "message": str(err),
                    "notes": list(getattr(err, "__notes__", [])),
                    "peer": getattr(err, "peer", None),
                    "rounds": rounds,
                    "untouched": untouched_except_noted(buf, original, err),
                    "exposed": exposed_range(err),
                    "failed_at": time.time(),
                }
    return {"error": "no error", "rounds": max_rounds}


def exit_or_barrier(comm: Any, victim: int, kind: str = "barrier") -> str:
    """Every rank enters a barrier (or a 4 KiB ``kind``: broadcast, allgather, reduce_scatter); the
    victim exits abruptly (``os._exit(3)``) from inside it, at its first send (or post)."""
    import os

    if comm.rank == victim:
        SendTrigger(comm.transport).arm(1, lambda: os._exit(3))
    x = np.ones((comm.size, 1024 // comm.size), np.float32)
    calls = {
        "barrier": comm.barrier,
        "broadcast": lambda: comm.broadcast(x, root=0),
        "allgather": lambda: comm.allgather(x),
        "reduce_scatter": lambda: comm.reduce_scatter(x),
    }
    calls[kind]()
    return f"{kind} passed"


def partial_sums_after_fault(comm: Any, count: int, fault: tuple[int, str, str, float]) -> dict[str, Any]:
    """Allreduce ``x_r[i] = 2**r + 2**size * (i % 4096)`` (float32, exact) until the victim's fault, inside round 1.

    Any sum of these over a subset of ranks names its subset (the low bits)
    and its element (the rest), so the test can tell each element of the
    buffer a failed allreduce left: the input, a partial sum, or neither.
    Returns the error's type, peer and notes, the rounds that succeeded, and
    the buffer as the failure left it.
    """
    original = (2.0**comm.rank + 2.0**comm.size * (np.arange(count) % 4096)).astype(np.float32)
    buf = np.empty_like(original)
    with fault_in_round_one(comm, fault) as next_round:
        for rounds in range(3):
            next_round(rounds)
            np.copyto(buf, original)
            try:
                comm.allreduce(buf)
            except Exception as err:
                report = {"error": _qualified(err), "peer": getattr(err, "peer", None), "rounds": rounds}
                return {**report, "notes": " ".join(getattr(err, "__notes__", [])), "buf": buf}
    return {"error": "no error", "rounds": 3, "notes": "", "buf": buf}


def fault_rounds(
    comm: Any,
    count: int,
    victim: int,
    fault: str,
    phase: str,
    stamp: str,
    rounds: int = 3,
    after: int = 3,
    idle_gap: float = 0.3,
) -> dict[str, Any]:
    """Allreduce a random float32 buffer ``rounds`` times; the victim injects ``fault`` in round 0.

    ``phase`` is a step label (``"scatter-reduce"``, ``"allgather"``): the
    fault lands inside that phase of round 0's allreduce; or ``"idle"``: the
    victim injects it after round 0 returned, while the other ranks wait
    ``idle_gap`` seconds before round 1. Every rank checks each successful
    result against numpy; on the first failure it records the error, whether
    the buffer is untouched outside the elements the error's note names (and
    those), and what one more allreduce raises.
    """
    import time

    inputs = [
        np.random.default_rng([7, r]).standard_normal(count, dtype=np.float32) for r in range(comm.size)
    ]
    expected = np.sum(np.stack(inputs), axis=0, dtype=np.float64)
    original = inputs[comm.rank]
    undo = None
    if comm.rank == victim and phase != "idle":
        undo = _hook_phase(comm, fault, phase, after, stamp)
    report: dict[str, Any] = {"error": "no error", "rounds": 0, "results_ok": True}
    buf = np.empty_like(original)
    try:
        for round_ in range(rounds):
            if round_ == 1 and phase == "idle":
                if comm.rank == victim:
                    _inject(comm, fault, stamp)
                else:
                    time.sleep(idle_gap)
            np.copyto(buf, original)
            try:
                comm.allreduce(buf, name=f"round{round_}")
            except Exception as err:
                report.update(
                    error=_qualified(err),
                    message=str(err),
                    peer=getattr(err, "peer", None),
                    failed_at=time.time(),
                    untouched=untouched_except_noted(buf, original, err),
                    exposed=exposed_range(err),
                )
                break
            report["rounds"] = round_ + 1
            if not np.allclose(buf, expected, rtol=1e-4, atol=1e-4):
                report["results_ok"] = False
        if report["error"] != "no error":
            try:
                comm.allreduce(np.ones(4, np.float32))
                report["retry"] = "no error"
            except Exception as err:
                report["retry"], report["retry_message"] = _qualified(err), str(err)
    finally:
        if undo is not None:
            undo()
    return report


def sliced_allreduce_until_failure(
    comm: Any, count: int, max_rounds: int, fault: tuple[int, str, str, float] | None = None
) -> dict[str, Any]:
    """Allreduce (sum) a buffer reduced in several slices until a collective fails.

    Reports whether what the failure left matches its promise: the elements
    the error's note says are done hold the sum of every rank's input (each
    rank's input is rebuilt here from its seed), those it says may hold
    partial sums are skipped, and the rest are the caller's. ``fault``: as
    for :func:`allreduce_until_failure`.
    """
    inputs = [np.random.default_rng(r).standard_normal(count, dtype=np.float32) for r in range(comm.size)]
    want = np.sum(inputs, axis=0, dtype=np.float64)
    original = inputs[comm.rank]
    buf = np.empty_like(original)
    with fault_in_round_one(comm, fault) as next_round:
        for rounds in range(max_rounds):
            next_round(rounds)
            report = _sliced_round(comm, buf, original, want, rounds)
            if report is not None:
                return report
    return {"error": "no error", "rounds": max_rounds}


def _sliced_round(
    comm: Any, buf: np.ndarray, original: np.ndarray, want: np.ndarray, rounds: int
) -> dict[str, Any] | None:
    """One round of :func:`sliced_allreduce_until_failure`: its report if it failed or was wrong."""
    import re

    np.copyto(buf, original)
    try:
        comm.allreduce(buf)
    except Exception as err:
        notes = " ".join(getattr(err, "__notes__", []))
        match = re.search(r"elements \[0, (\d+)\) of \d+ already hold", notes)
        done = int(match.group(1)) if match else 0
        exposed = exposed_range(err) or (done, done)
        return {
            "error": _qualified(err),
            "rounds": rounds,
            "done": done,
            "exposed": exposed,
            "notes": notes,
            "done_reduced": bool(np.allclose(buf[:done], want[:done], rtol=1e-5, atol=1e-4)),
            "rest_untouched": exposed[0] == done
            and bool(np.array_equal(buf[exposed[1] :], original[exposed[1] :])),
        }
    if not np.allclose(buf, want, rtol=1e-5, atol=1e-4):
        return {"error": "wrong result", "rounds": rounds}
    return None


def other_count_past_2_32(comm: Any, count: int, longer: int) -> dict[str, Any]:
    """Every rank's collective numbers moved on to 2**32, then rank 0 allreduces ``longer`` float32
    where the others pass ``count``: the error (a MismatchError naming rank 0, not a timeout, where
    rank 0's input takes the pieces and theirs one slot), and whether the buffer stayed as it was."""
    import itertools

    import ringcore

    comm.barrier()
    ticket = (1 << 32) - 1  # the next collective is number 2**32: its low 32 bits are 0
    comm._tickets, comm._turn = itertools.count(ticket), ticket
    x = np.arange(longer if comm.rank == 0 else count, dtype=np.float32)
    before = x.copy()
    try:
        comm.allreduce(x)
    except ringcore.RingcoreError as err:
        return {"error": type(err).__name__, "message": str(err), "untouched": bool((x == before).all())}
    return {"error": "none"}


def op_by_rank(comm: Any, count: int, ops: list[str]) -> dict[str, Any]:
    """An allreduce of ``count`` float32 with op ``ops[rank]``: the error, its notes and whether the
    buffer stayed as it was."""
    import ringcore

    x = np.arange(count, dtype=np.float32) + comm.rank
    before = x.copy()
    try:
        comm.allreduce(x, op=ops[comm.rank])
    except ringcore.RingcoreError as err:
        notes = " ".join(getattr(err, "__notes__", []))
        return {"error": type(err).__name__, "notes": notes, "untouched": bool((x == before).all())}
    return {"error": "none"}


def other_op_on_rank_0(comm: Any, count: int) -> dict[str, Any]:
    """Sum and max layouts of ``count`` float32 kept on every rank, then rank 0 passes max where the
    others pass sum: the MismatchError's message, and whether the buffer stayed as it was."""
    import ringcore

    x = np.arange(count, dtype=np.float32)
    for op in ("sum", "max", "sum", "max"):
        comm.allreduce(x, op=op)
    before = x.copy()
    try:
        comm.allreduce(x, op="max" if comm.rank == 0 else "sum")
    except ringcore.MismatchError as err:
        return {"error": "MismatchError", "message": str(err), "untouched": bool((x == before).all())}
    return {"error": "none"}
