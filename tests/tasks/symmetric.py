"""Tasks on symmetric memory (``ringcore.empty``): the direct allreduce, its mismatches and failures."""

from __future__ import annotations

import os
import signal
from typing import Any

import numpy as np


def _direct_calls(comm: Any, buf: np.ndarray, op: str) -> int:
    """Calls of ``buf``'s plan that took the direct route (the one- and two-shot routes' are not counted)."""
    plan = comm._allreduce_plan(buf, op, None)
    return plan.direct.calls if plan.direct is not None and plan.direct.name == "direct" else 0  # type: ignore[no-any-return]


def allreduce_symmetric(
    comm: Any, inputs: list[np.ndarray], op: str, offset: int = 0, spare: int = 0
) -> dict[str, Any]:
    """Allreduce this rank's input in an array from ``comm.empty`` (at element ``offset`` of it).

    The array holds ``offset + count + spare`` elements; the elements around
    the view are filled with a marker that must survive. Returns the result,
    whether the direct route ran, and whether the marker is intact.
    """
    x = inputs[comm.rank]
    whole = comm.empty(offset + x.size + spare, x.dtype)
    whole[...] = np.array(7, x.dtype)
    view = whole[offset : offset + x.size]
    view[...] = x
    before = _direct_calls(comm, view, op)
    out = comm.allreduce(view, op=op)
    assert out is view
    outside = np.concatenate([whole[:offset], whole[offset + x.size :]])
    return {
        "result": view.copy(),
        "direct": _direct_calls(comm, view, op) - before,
        "outside intact": bool(np.all(outside == np.array(7, x.dtype))),
    }


def allreduce_symmetric_on(comm: Any, inputs: list[np.ndarray], symmetric_ranks: list[int]) -> dict[str, Any]:
    """Sum this rank's input in symmetric memory on ``symmetric_ranks``, in ordinary memory elsewhere.

    The symmetric array is allocated on every rank (a collective); returns the
    error's type and message and whether the buffer kept its input.
    """
    x = inputs[comm.rank]
    sym = comm.empty(x.size, x.dtype)
    buf = sym if comm.rank in symmetric_ranks else np.empty_like(x)
    buf[...] = x
    report: dict[str, Any] = {"error": "no error", "message": ""}
    try:
        comm.allreduce(buf)
    except Exception as err:
        report["error"], report["message"] = type(err).__name__, str(err)
    report["untouched"] = bool(np.array_equal(buf, x))
    report["result"] = buf.copy()
    voting = comm.ctx.direct_voting
    report["voted direct"] = voting.calls if voting is not None else 0
    return report


def empty_of_rank_sizes(comm: Any, sizes: list[int]) -> str:
    """``comm.empty`` of this rank's size; the error's type and message."""
    try:
        comm.empty(sizes[comm.rank], np.float32)
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def symmetric_is_mapped(comm: Any) -> dict[str, Any]:
    """Whether ``comm.empty``'s arrays are mapped by the peers, and how many ringcore files /dev/shm holds."""
    arr = comm.empty(1000)
    found = comm.symmetric.locate(arr)
    return {"mapped": found is not None, "shm files": sorted(os.listdir("/dev/shm"))}


def direct_then_fault(
    comm: Any, count: int, victim: int, fault: str, memory: str = "symmetric"
) -> dict[str, Any]:
    """Two direct allreduces; in the second, ``victim`` dies (``kill9``) or stops (``stop``) while pushing.

    The buffer comes from ``comm.empty`` (``memory="symmetric"``) or numpy
    (``"ordinary"``). The victim's push writes the first half of its share
    into one peer, then the fault hits. Returns the survivors' error type,
    message and notes.
    """
    from ringcore.algo import direct

    buf = comm.empty(count, np.float64) if memory == "symmetric" else np.empty(count, np.float64)
    buf[...] = comm.rank + 1
    comm.allreduce(buf)
    assert np.all(buf == comm.size * (comm.size + 1) / 2)
    buf[...] = comm.rank + 1
    if comm.rank == victim:
        real = direct.push_share

        def push_then_fault(mine: np.ndarray, peers: list[np.ndarray], lo: int, hi: int) -> None:
            real(mine, peers[:1], lo, (lo + hi) // 2)
            os.kill(os.getpid(), signal.SIGKILL if fault == "kill9" else signal.SIGSTOP)

        direct.push_share = push_then_fault
    report: dict[str, Any] = {"error": "no error", "message": "", "notes": []}
    try:
        comm.allreduce(buf)
    except Exception as err:
        report["error"], report["message"] = type(err).__name__, str(err)
        report["notes"] = list(getattr(err, "__notes__", []))
    return report
