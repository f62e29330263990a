"""Each collective once per rank, called as a user calls it; the test checks the results against numpy.

Also what is built from them: repeated and async batches, a timed barrier, a torch
tensor, one call with a method and arguments of the rank's own (mismatch tests), a
job that issues every kind of collective (timeline tests), and a loop checked on the
rank that runs until a stop file appears (fuzz tests).
"""

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


def allreduce_with_torch_on(
    comm: Any, inputs: list[np.ndarray], op: str, compression: str | None, torch_ranks: list[int]
) -> tuple[np.ndarray, bool]:
    """``allreduce`` after importing torch on ``torch_ranks`` only; also whether casts borrowed it."""
    from ringcore.kernels import casts

    if comm.rank in torch_ranks:
        import torch  # noqa: F401
    return allreduce(comm, inputs, op, compression), casts.borrows_torch()


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


def reduce_scatter(
    comm: Any, inputs: list[np.ndarray], op: str, compression: str | None = None
) -> np.ndarray:
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


def allreduce_async_many(comm: Any, inputs: list[list[np.ndarray]], ops: list[str]) -> Any:
    """Start every buffer but the last as ``allreduce_async``, reduce the last one blocking, then wait.

    Returns the reduced buffers and whether every handle returned its own buffer.
    """
    bufs = [x.copy() for x in inputs[comm.rank]]
    handles = [comm.allreduce_async(b, op=op) for b, op in zip(bufs[:-1], ops[:-1], strict=True)]
    comm.allreduce(bufs[-1], op=ops[-1])
    same = [h.wait(timeout=60) is b for h, b in zip(handles, bufs[:-1], strict=True)]
    return bufs, all(same)


def barrier_times(comm: Any, delays: list[float]) -> tuple[float, float]:
    """Sleep this rank's delay, then return (wall time entering the barrier, wall time leaving it)."""
    import time

    time.sleep(delays[comm.rank])
    entered = time.time()
    comm.barrier()
    return entered, time.time()


def torch_allreduce(comm: Any, inputs: list[np.ndarray], dtype: str, op: str) -> Any:
    """Allreduce a CPU torch tensor of ``dtype`` built from this rank's input, in place.

    Returns (the input as the tensor held it, the result, whether the storage
    stayed the same), both as float64 (floats) or int64 numpy arrays.
    """
    import torch

    tensor = torch.from_numpy(inputs[comm.rank].copy()).to(getattr(torch, dtype))
    wide = torch.float64 if tensor.is_floating_point() else torch.int64
    given = tensor.to(wide).numpy().copy()
    ptr = tensor.data_ptr()
    out = comm.allreduce(tensor, op=op)
    return given, tensor.to(wide).numpy(), out is tensor and tensor.data_ptr() == ptr


def allreduce_checked_until(
    comm: Any, count: int, stop_file: str, max_rounds: int = 100_000
) -> dict[str, int]:
    """Allreduce known integer-valued buffers until rank 0 sees ``stop_file``; count wrong results.

    The last element is a stop flag only rank 0 sets, so every rank stops after
    the same round. Rank r contributes ``arange(count) * (r + 1) + round``.
    """
    import os

    weights = comm.size * (comm.size + 1) // 2
    base = np.arange(count, dtype=np.float64)
    wrong = rounds = 0
    while rounds < max_rounds:
        buf = np.empty(count + 1, np.float64)
        buf[:count] = base * (comm.rank + 1) + rounds
        buf[count] = 1.0 if comm.rank == 0 and os.path.exists(stop_file) else 0.0
        comm.allreduce(buf)
        if not np.array_equal(buf[:count], base * weights + rounds * comm.size):
            wrong += 1
        rounds += 1
        if buf[count] > 0:
            break
    return {"rounds": rounds, "wrong": wrong}


def timeline_job(comm: Any) -> int:
    """Collectives of every kind and algorithm; returns how many were issued."""
    comm.allreduce(np.ones(300_000, np.float32), name="big")
    comm.allreduce(np.ones(10, np.float64), op="max", name="small")
    comm.allreduce(np.ones(2, np.float32))  # fewer elements than ranks
    comm.broadcast(np.arange(50_000, dtype=np.int32), root=1, name="bcast")
    comm.allgather(np.ones((comm.rank + 1, 3), np.float32), name="gather")
    comm.reduce_scatter(np.ones((30, 2), np.float32), name="rs")
    comm.barrier()
    handles = [  # fp16 keeps the rings, whose steps the timeline shows (one host routes the others)
        comm.allreduce_async(np.ones(n, np.float32), name=f"async{n}", compression=compression)
        for n, compression in ((10, None), (200_000, "fp16"))
    ]
    for handle in handles:
        handle.wait(30)
    return 9


def async_new_arrays(comm: Any, inputs: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """allgather_async and reduce_scatter_async, with done-callbacks recording the order they ran."""
    import threading

    seen: list[str] = []
    done = threading.Event()
    gathered = comm.allgather_async(inputs[comm.rank])
    scattered = comm.reduce_scatter_async(inputs[comm.rank], op="sum")
    gathered.add_done_callback(lambda h: seen.append(f"allgather {h.exception()}"))
    scattered.add_done_callback(lambda h: (seen.append(f"reduce_scatter {h.exception()}"), done.set()))
    assert done.wait(60)
    late: list[str] = []
    gathered.add_done_callback(lambda h: late.append("at once"))  # already done: runs in this thread
    return gathered.wait(10), scattered.wait(10), seen + late
