"""Tasks on the direct allreduce of ordinary buffers (``ringcore.plans.direct``): routes, faults, late writers."""

from __future__ import annotations

import array
import os
import signal
import time
from typing import Any

import numpy as np


def allreduce_routed(comm: Any, inputs: list[np.ndarray], op: str, kind: str = "numpy") -> dict[str, Any]:
    """Allreduce this rank's input as a numpy array (a kept plan) or an ``array.array`` (a one-call plan).

    Returns the result, the calls that went direct (kept plans only: ``plan_cache``) and whether this
    communicator ever voted on the direct route.
    """
    x = inputs[comm.rank]
    before = comm.plan_cache()["calls"].get("direct", 0)
    if kind == "numpy":
        buf = x.copy()
        comm.allreduce(buf, op=op)
        result = buf
    else:
        typecode = {"float32": "f", "float64": "d", "int32": "i", "int64": "q"}[x.dtype.name]
        buf = array.array(typecode, x.tobytes())
        comm.allreduce(buf, op=op)
        result = np.frombuffer(buf, x.dtype).copy()
    return {
        "result": result,
        "direct": comm.plan_cache()["calls"].get("direct", 0) - before,
        "voted": comm.ctx.direct_voting is not None,
    }


def late_writer(comm: Any, count: int) -> dict[str, Any]:
    """Three ranks; rank 1 dies while rank 2 is slow to write into rank 0: rank 0 must not return before it.

    After a first direct allreduce, in the second: rank 1 kills itself 0.3 s
    into its first push; rank 2 sleeps 1 s before its first push (its reads
    done: rank 1 was alive), then writes into rank 0, then fails on rank 1.
    Rank 0 fails on rank 1's death; returns the error, and whether its buffer
    stayed as it was when the error reached it for the next 1.5 s.
    """
    from ringcore.algo import direct

    buf = np.empty(count, np.float64)
    buf[...] = comm.rank + 1
    comm.allreduce(buf)
    assert np.all(buf == comm.size * (comm.size + 1) / 2)
    buf[...] = comm.rank + 1
    real = direct.push_share
    calls = [0]

    def slow_or_fatal(mine: np.ndarray, peers: list[Any], lo: int, hi: int) -> None:
        calls[0] += 1
        if calls[0] == 1 and comm.rank == 1:
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGKILL)
        if calls[0] == 1 and comm.rank == 2:
            time.sleep(1.0)
        real(mine, peers, lo, hi)

    direct.push_share = slow_or_fatal
    report: dict[str, Any] = {"error": "no error", "message": "", "notes": []}
    try:
        comm.allreduce(buf)
    except Exception as err:
        report["error"], report["message"] = type(err).__name__, str(err)
        report["notes"] = list(getattr(err, "__notes__", []))
    finally:
        direct.push_share = real
    seen = buf.copy()
    time.sleep(1.5)
    report["stable"] = bool(np.array_equal(seen, buf))
    return report
