"""Task functions the test cluster runs on each rank: ``fn(comm, *args)``, picklable by name."""

from __future__ import annotations

from typing import Any

import numpy as np


def identity(comm: Any) -> tuple[int, int, int, int]:
    return comm.rank, comm.size, comm.local_rank, comm.local_size


def allreduce(comm: Any, inputs: list[np.ndarray], op: str, compression: str | None = None) -> np.ndarray:
    buf = inputs[comm.rank].copy()
    out = comm.allreduce(buf, op=op, compression=compression)
    assert out is buf
    return buf


def allreduce_async(comm: Any, inputs: list[np.ndarray], op: str) -> list[np.ndarray]:
    bufs = [x.copy() for x in inputs]
    handles = [comm.allreduce_async(b, op=op) for b in bufs]
    return [h.wait(timeout=60) for h in handles]


def broadcast(comm: Any, inputs: list[np.ndarray], root: int) -> np.ndarray:
    buf = inputs[comm.rank].copy()
    comm.broadcast(buf, root=root)
    return buf


def allgather(comm: Any, inputs: list[np.ndarray]) -> np.ndarray:
    return comm.allgather(inputs[comm.rank])


def reduce_scatter(comm: Any, inputs: list[np.ndarray], op: str, compression: str | None = None) -> np.ndarray:
    return comm.reduce_scatter(inputs[comm.rank], op=op, compression=compression)


def barrier(comm: Any) -> bool:
    comm.barrier()
    return True


def per_rank(comm: Any, fn_name: str, per_rank_args: list[tuple]) -> Any:
    """Call a Communicator method with this rank's own arguments (for mismatch tests)."""
    args, kwargs = per_rank_args[comm.rank]
    return getattr(comm, fn_name)(*args, **kwargs)


def loop_allreduce(comm: Any, count: int, rounds: int) -> str:
    buf = np.ones(count, np.float32)
    for _ in range(rounds):
        comm.allreduce(buf)
    return "finished"


def check_then_allreduce(comm: Any, inputs: list[np.ndarray]) -> Any:
    """Return (error type, original buffer untouched?) after a failing allreduce."""
    buf = inputs[comm.rank].copy()
    try:
        comm.allreduce(buf)
    except Exception as err:
        return type(err).__name__, bool(np.array_equal(buf, inputs[comm.rank]))
    return "no error", True
