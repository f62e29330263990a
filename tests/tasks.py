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


def check_then_allreduce(comm: Any, inputs: list[np.ndarray]) -> Any:
    """Return (error type, original buffer untouched?) after a failing allreduce."""
    buf = inputs[comm.rank].copy()
    try:
        comm.allreduce(buf)
    except Exception as err:
        return type(err).__name__, bool(np.array_equal(buf, inputs[comm.rank]))
    return "no error", True


# ---------------------------------------------------------------------------- property tests


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


# ---------------------------------------------------------------------------- bad input


def _bad_input_case(case: str) -> tuple[Any, Any]:
    """(a call that must fail before sending anything, the caller's object to check afterwards)."""
    floats = np.arange(12, dtype=np.float32)
    ints = np.arange(12, dtype=np.int32)
    if case == "list":
        obj: Any = [1.0, 2.0, 3.0]
        return lambda c: c.allreduce(obj), obj
    if case == "str":
        obj = "1234"
        return lambda c: c.allreduce(obj), obj
    if case == "bytes":
        obj = b"\x01\x02\x03\x04"
        return lambda c: c.allreduce(obj), obj
    if case == "readonly":
        floats.flags.writeable = False
        return lambda c: c.allreduce(floats), floats
    if case == "non_contiguous":
        base = np.arange(24, dtype=np.float32).reshape(4, 6)
        return lambda c: c.allreduce(base[:, ::2]), base
    if case == "non_contiguous_allgather":
        base = np.arange(24, dtype=np.float32).reshape(4, 6)
        return lambda c: c.allgather(base.T), base
    if case == "object":
        obj = np.array([1, 2.5, None], dtype=object)
        return lambda c: c.allreduce(obj), obj
    if case == "bool":
        obj = np.array([True, False, True])
        return lambda c: c.allreduce(obj), obj
    if case == "complex":
        obj = np.arange(4, dtype=np.complex64)
        return lambda c: c.allreduce(obj), obj
    if case == "big_endian":
        obj = np.arange(4, dtype=">f4")
        return lambda c: c.allreduce(obj), obj
    if case == "unknown_op":
        return lambda c: c.allreduce(floats, op="median"), floats
    if case == "op_not_a_string":
        return lambda c: c.allreduce(floats, op=3), floats
    if case == "unknown_compression":
        return lambda c: c.allreduce(floats, compression="int8"), floats
    if case == "avg_on_ints":
        return lambda c: c.allreduce(ints, op="avg"), ints
    if case == "fp16_on_ints":
        return lambda c: c.allreduce(ints, compression="fp16"), ints
    if case == "async_avg_on_ints":
        return lambda c: c.allreduce_async(ints, op="avg"), ints
    if case == "reduce_scatter_avg_on_ints":
        return lambda c: c.reduce_scatter(ints, op="avg"), ints
    if case == "reduce_scatter_unknown_op":
        return lambda c: c.reduce_scatter(floats, op="mean"), floats
    if case == "broadcast_root_too_big":
        return lambda c: c.broadcast(floats, root=c.size), floats
    if case == "broadcast_root_negative":
        return lambda c: c.broadcast(floats, root=-1), floats
    if case == "broadcast_root_float":
        return lambda c: c.broadcast(floats, root=1.0), floats
    if case == "broadcast_root_str":
        return lambda c: c.broadcast(floats, root="0"), floats
    if case == "broadcast_root_bool":
        return lambda c: c.broadcast(floats, root=True), floats
    if case == "broadcast_async_root_too_big":
        return lambda c: c.broadcast_async(floats, root=c.size), floats
    if case == "allgather_0d":
        obj = np.array(3.0, dtype=np.float32)
        return lambda c: c.allgather(obj), obj
    if case == "reduce_scatter_0d":
        obj = np.array(3.0, dtype=np.float32)
        return lambda c: c.reduce_scatter(obj), obj
    raise KeyError(case)


def bad_input(comm: Any, case: str) -> tuple[str, str, bool]:
    """Run one bad call; return (exception type, message, caller's object unchanged?)."""
    call, obj = _bad_input_case(case)
    before = obj.copy() if isinstance(obj, np.ndarray) else obj
    try:
        call(comm)
    except Exception as err:
        if isinstance(obj, np.ndarray):
            unchanged = obj.dtype == before.dtype and obj.tobytes() == before.tobytes()
        else:
            unchanged = obj == before
        return type(err).__name__, str(err), unchanged
    return "no error", "", True


# ---------------------------------------------------------------------------- failures


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


def allreduce_until_failure(comm: Any, count: int, max_rounds: int) -> dict[str, Any]:
    """Allreduce a random float32 buffer (fresh copy each round) until a collective fails.

    Returns the error's type, message and ``peer`` attribute, the number of
    rounds that succeeded, and whether the failed round left the buffer as it was.
    """
    import time

    original = np.random.default_rng(comm.rank).standard_normal(count, dtype=np.float32)
    buf = np.empty_like(original)
    for rounds in range(max_rounds):
        np.copyto(buf, original)
        try:
            comm.allreduce(buf)
        except Exception as err:
            return {
                "error": _qualified(err),
                "message": str(err),
                "peer": getattr(err, "peer", None),
                "rounds": rounds,
                "untouched": bool(np.array_equal(buf, original)),
                "failed_at": time.time(),
            }
    return {"error": "no error", "rounds": max_rounds}


def exit_or_barrier(comm: Any, victim: int, delay: float) -> str:
    """The victim exits abruptly (``os._exit``) after ``delay`` s; every other rank enters a barrier."""
    import os
    import time

    if comm.rank == victim:
        time.sleep(delay)
        os._exit(3)
    comm.barrier()
    return "barrier passed"


def init_shutdown_cycles(rank: int, size: int, ports: list[int], results: Any) -> None:
    """Outside a Cluster: init / allreduce / shutdown once per port, in one process.

    Puts (rank, report) on ``results``; the report lists each cycle's result,
    the thread count before the first init and after each shutdown, and what a
    second ``init()`` without ``shutdown()`` raised.
    """
    import os
    import threading
    import time

    os.environ.update({"RINGCORE_TIMEOUT": "30", "RINGCORE_INIT_TIMEOUT": "30"})
    import ringcore

    report: dict[str, Any] = {"baseline": threading.active_count(), "sums": [], "threads": [], "reinit": None}
    try:
        for cycle, port in enumerate(ports):
            comm = ringcore.init(rank=rank, size=size, addr="127.0.0.1", port=port)
            if cycle == 0:
                try:
                    ringcore.init(rank=rank, size=size, addr="127.0.0.1", port=port)
                except Exception as err:
                    report["reinit"] = type(err).__name__
            buf = np.full(1000 + cycle, rank + 1 + 10 * cycle, np.float64)
            ringcore.allreduce(buf)
            big = np.full(100_000, float(rank + cycle), np.float32)  # ring path
            ringcore.allreduce(big, op="max")
            report["sums"].append((buf.tolist(), float(big.min()), float(big.max()), comm.size))
            ringcore.shutdown()
            deadline = time.monotonic() + 10
            while threading.active_count() > report["baseline"] and time.monotonic() < deadline:
                time.sleep(0.05)
            report["threads"].append(threading.active_count())
            report["initialized_after_shutdown"] = ringcore.is_initialized()
    except Exception as err:
        report["error"] = f"{type(err).__name__}: {err}"
    results.put((rank, report))


# ---------------------------------------------------------------------------- security tests


def store_address(comm: Any) -> tuple[str, int]:
    """``(host, port)`` of the rendezvous store this rank is connected to."""
    return tuple(comm.store.address)


def listening_report(comm: Any) -> dict[str, Any]:
    """Where this rank listens and the local/remote address of each data connection.

    ``store`` is rank 0's store listener (``None`` elsewhere); ``links`` lists
    ``(peer, channel, local address, remote address)`` for every mesh connection.
    """
    import os

    server = comm.server
    links = [
        (peer, channel, conn.sock.getsockname()[:2], conn.sock.getpeername()[:2])
        for (peer, channel), conn in comm.transport.conns.items()
    ]
    return {
        "pid": os.getpid(),
        "store": server.listener.getsockname()[:2] if server is not None else None,
        "links": links,
    }


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


def init_and_report(rank: int, size: int, *ports: int) -> dict[str, Any]:
    """Outside a Cluster: init, allreduce, shutdown once per store port; report sums or the error.

    Run in a fresh interpreter by the security tests (``python -c``), so its
    stderr (ringcore's log) can be captured.
    """
    import ringcore
    from ringcore.errors import AuthenticationError

    report: dict[str, Any] = {"sums": [], "error": None}
    try:
        for port in ports:
            comm = ringcore.init(rank=rank, size=size, addr="127.0.0.1", port=port)
            buf = np.full(16, float(rank + 1))
            comm.allreduce(buf)
            report["sums"].append(buf.tolist())
            ringcore.shutdown()
    except Exception as err:
        report.update(
            error=_qualified(err), message=str(err), authentication=isinstance(err, AuthenticationError)
        )
    return report
