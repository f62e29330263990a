"""Task functions the test cluster runs on each rank: ``fn(comm, *args)``, picklable by name."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
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
    if case == "op_unhashable":  # the validation cache's key cannot hold it
        return lambda c: c.allreduce(floats, op=["sum"]), floats
    if case == "compression_unhashable":
        return lambda c: c.allreduce(floats, compression=["fp16"]), floats
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


def exposed_range(err: BaseException) -> tuple[int, int] | None:
    """The elements a failed allreduce's note says may hold partial sums, or None."""
    import re

    notes = " ".join(getattr(err, "__notes__", []))
    match = re.search(r"elements \[(\d+), (\d+)\) of \d+ may hold partial sums", notes)
    return (int(match.group(1)), int(match.group(2))) if match else None


def untouched_except_noted(buf: np.ndarray, original: np.ndarray, err: BaseException) -> bool:
    """Whether a failed allreduce kept the caller's values everywhere its note does not name."""
    start, end = exposed_range(err) or (0, 0)
    return bool(np.array_equal(buf[:start], original[:start]) and np.array_equal(buf[end:], original[end:]))


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
                    "peer": getattr(err, "peer", None),
                    "rounds": rounds,
                    "untouched": untouched_except_noted(buf, original, err),
                    "exposed": exposed_range(err),
                    "failed_at": time.time(),
                }
    return {"error": "no error", "rounds": max_rounds}


def exit_or_barrier(comm: Any, victim: int) -> str:
    """Every rank enters a barrier; the victim exits abruptly (``os._exit(3)``) from inside it, at its first send."""
    import os

    if comm.rank == victim:
        SendTrigger(comm.transport).arm(1, lambda: os._exit(3))
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


# ---------------------------------------------------------------------------- reliability: fault injection


def _stamp(path: str) -> None:
    """Write the wall-clock time of an injected fault to ``path`` (atomically, so a reader never sees half)."""
    import os
    import time

    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as out:
        out.write(repr(time.time()))
    os.replace(tmp, path)


def _inject(comm: Any, fault: str, stamp: str) -> None:
    """Do ``fault`` to this rank now, from inside its own process.

    ``kill9``: SIGKILL itself. ``sigstop``: SIGSTOP itself (the test sends
    SIGCONT later). ``cut_all``: this rank loses its network (shut down every
    data socket). ``cut_one``: only the link to the right ring neighbour is cut.
    """
    import os
    import signal
    import socket

    _stamp(stamp)
    if fault == "kill9":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault == "sigstop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif fault in ("cut_all", "cut_one"):
        right = (comm.rank + 1) % comm.size
        for (peer, _channel), conn in comm.transport.conns.items():
            if fault == "cut_all" or peer == right:
                conn.sock.shutdown(socket.SHUT_RDWR)
    else:
        raise ValueError(fault)


def _hook_phase(comm: Any, fault: str, phase: str, after: int, stamp: str) -> Any:
    """Wrap ``Executor._combine`` (once per received segment) to inject ``fault`` at the
    ``after``-th segment received in a step labelled ``phase``; returns an undo function."""
    from ringcore.algo import execute

    original = execute.Executor._combine
    seen = [0]

    def combine(self: Any, item: Any, recv_key: Any) -> bool:
        if seen[0] < after and self.steps[item[0]].label == phase:
            seen[0] += 1
            if seen[0] == after:
                _inject(comm, fault, stamp)
        return original(self, item, recv_key)

    execute.Executor._combine = combine

    def undo() -> None:
        execute.Executor._combine = original

    return undo


class SendTrigger:
    """Counts the sends this rank's transport posts and runs an action just before a chosen one.

    Every executor (the pipelined one, the latency path, the staged GPU one)
    posts its sends through the transport's ``isend``, or ``swap`` on TCP's
    latency path; wrapping those two calls on the instance locates a point
    inside any collective without reaching into an executor. ``arm(at,
    action)`` runs ``action`` before the ``at``-th send from then on;
    ``remove()`` restores the transport.
    """

    def __init__(self, transport: Any) -> None:
        self.transport = transport
        self.posted = 0
        self.fire_at = 0
        self.action: Any = None
        isend, swap = transport.isend, getattr(transport, "swap", None)

        def counted_isend(*args: Any) -> Any:
            self._count()
            return isend(*args)

        def counted_swap(send: Any, *rest: Any) -> Any:
            if send is not None:
                self._count()
            return swap(send, *rest)  # type: ignore[misc]

        transport.isend = counted_isend
        self.patched = ["isend"]
        if swap is not None:
            transport.swap = counted_swap
            self.patched.append("swap")

    def _count(self) -> None:
        self.posted += 1
        if self.action is not None and self.posted == self.fire_at:
            action, self.action = self.action, None
            action()

    def arm(self, at: int, action: Any) -> None:
        self.posted, self.fire_at, self.action = 0, at, action

    def remove(self) -> None:
        for name in self.patched:
            self.transport.__dict__.pop(name, None)


@contextlib.contextmanager
def fault_in_round_one(comm: Any, fault: tuple[int, str, str, float] | None) -> Iterator[Any]:
    """Yield ``next_round(i)``, to call before each round; with ``fault = (victim, kind, stamp, fraction)``
    the victim injects ``kind`` inside round 1, at the send ``fraction`` of the way through the sends
    it posted in round 0 (which every rank completes)."""
    if fault is None or comm.rank != fault[0]:
        yield lambda round_: None
        return
    _, kind, stamp, fraction = fault
    trigger = SendTrigger(comm.transport)
    trigger.arm(0, None)

    def next_round(round_: int) -> None:
        if round_ == 1:
            trigger.arm(max(1, round(fraction * trigger.posted)), lambda: _inject(comm, kind, stamp))

    try:
        yield next_round
    finally:
        trigger.remove()


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


def init_with_fault(
    rank: int,
    size: int,
    port: int,
    env: dict[str, str],
    victim: int,
    fault: str,
    stamp: str,
    results: Any,
    delay: float = 0.0,
) -> None:
    """Outside a Cluster: ``ringcore.init`` with the victim failing at a point of the rendezvous.

    ``fault``: ``"absent"`` (the victim never calls init), ``"after_join"``
    (SIGKILL once it has joined the store, before it publishes its address),
    ``"before_mesh"`` (SIGKILL after publishing its address, before connecting
    the mesh), ``"before_mesh_late"`` (the same 1.5 s later, once higher ranks
    have connected to its listener and wait in the handshake), ``"mid_handshake"`` (SIGKILL with its first data connection to a
    lower rank open but not yet authenticated; the victim must not be rank 0).
    Every other rank waits ``delay`` seconds, calls init and puts ``(rank, report)`` on ``results``.
    """
    import os
    import time

    os.environ.update(env)
    import ringcore
    from ringcore import bootstrap
    from ringcore.transport import mesh

    if rank == victim:
        if fault == "absent":
            _stamp(stamp)
            return

        def die(*args: Any, **kwargs: Any) -> Any:
            _inject(None, "kill9", stamp)

        if fault == "after_join":
            bootstrap.make_listener = die
        elif fault == "before_mesh":
            bootstrap.connect_mesh = die
        elif fault == "before_mesh_late":

            def linger_then_die(*args: Any, **kwargs: Any) -> Any:
                time.sleep(1.5)  # higher ranks' connections wait, unaccepted, in our listener's backlog
                die()

            bootstrap.connect_mesh = linger_then_die
        elif fault == "mid_handshake":
            mesh._introduce = die  # the TCP connection to a lower rank is open, not yet authenticated
        else:
            raise ValueError(fault)
    time.sleep(delay)
    report: dict[str, Any] = {"error": "no error"}
    started = time.time()
    try:
        ringcore.init(rank=rank, size=size, addr="127.0.0.1", port=port)
    except Exception as err:
        import traceback

        report.update(error=_qualified(err), message=str(err), peer=getattr(err, "peer", None))
        report["trace"] = traceback.format_exc()
        report["is_ringcore_error"] = isinstance(err, ringcore.RingcoreError)
    report["started"], report["failed_at"] = started, time.time()
    ringcore.shutdown()
    results.put((rank, report))


# ---------------------------------------------------------------------------- reliability: soak

SOAK_DTYPES = ("float32", "float64", "int32", "int64")


def soak_spec(seed: int, size: int, index: int) -> dict[str, Any]:
    """Collective number ``index`` of a soak run: the same on every rank and in the test."""
    rng = np.random.default_rng([seed, index])
    kind = str(
        rng.choice(
            [
                "allreduce",
                "allreduce",
                "allreduce",
                "async",
                "broadcast",
                "allgather",
                "reduce_scatter",
                "barrier",
            ]
        )
    )
    dtype = str(rng.choice(SOAK_DTYPES))
    count = int(rng.integers(50_000, 200_000)) if rng.random() < 0.02 else int(rng.integers(0, 3000))
    if rng.random() < 0.05:
        count = int(rng.integers(0, size + 1))  # fewer elements than ranks
    floating = dtype.startswith("float")
    op = str(rng.choice(["sum", "avg", "min", "max", "prod"] if floating else ["sum", "min", "max", "prod"]))
    compression = "fp16" if floating and op != "prod" and rng.random() < 0.15 else None
    return {
        "kind": kind,
        "dtype": dtype,
        "count": count,
        "op": op,
        "compression": compression,
        "root": int(rng.integers(0, size)),
        "rows": [int(n) for n in rng.integers(0, 40, size)],  # allgather: rows per rank may differ
        "width": int(rng.integers(1, 5)),
        "batch": int(rng.integers(2, 4)),
    }


def soak_input(seed: int, rank: int, index: int, spec: dict[str, Any], part: int = 0) -> np.ndarray:
    """This rank's input to collective ``index`` (``part`` numbers the buffers of an async batch)."""
    rng = np.random.default_rng([seed, index, rank, part])
    dtype = np.dtype(spec["dtype"])
    if spec["kind"] == "allgather":
        shape: tuple[int, ...] = (spec["rows"][rank], spec["width"])
    elif spec["kind"] == "reduce_scatter":
        shape = (max(1, spec["count"] // spec["width"]), spec["width"])
    else:
        shape = (spec["count"],)
    if spec["op"] == "prod":
        values = rng.choice([-1, 1, 2], size=shape) if dtype.kind == "i" else rng.uniform(0.5, 1.5, shape)
    elif dtype.kind == "i":
        values = rng.integers(-1000, 1000, size=shape)
    else:
        values = rng.uniform(-1, 1, shape)
    return values.astype(dtype)


def soak(comm: Any, seed: int, total: int) -> list[Any]:
    """Run ``total`` mixed collectives (see ``soak_spec``), sleeping 0-2 ms before some; return the results."""
    import time

    delays = np.random.default_rng([seed, comm.rank, 999])
    out: list[Any] = []
    for index in range(total):
        spec = soak_spec(seed, comm.size, index)
        if delays.random() < 0.25:
            time.sleep(delays.uniform(0, 0.002))
        kind, name = spec["kind"], f"soak.{index}"
        x = soak_input(seed, comm.rank, index, spec)
        if kind == "allreduce":
            out.append(comm.allreduce(x, op=spec["op"], compression=spec["compression"], name=name))
        elif kind == "async":
            bufs = [x] + [soak_input(seed, comm.rank, index, spec, part) for part in range(1, spec["batch"])]
            handles = [comm.allreduce_async(b, op=spec["op"], compression=spec["compression"]) for b in bufs]
            out.append([h.wait(timeout=60) for h in handles])
        elif kind == "broadcast":
            out.append(comm.broadcast(x, root=spec["root"], name=name))
        elif kind == "allgather":
            out.append(comm.allgather(x, name=name))
        elif kind == "reduce_scatter":
            out.append(comm.reduce_scatter(x, op=spec["op"], compression=spec["compression"], name=name))
        else:
            comm.barrier()
            out.append(None)
    return out


# ---------------------------------------------------------------------------- reliability: lifecycle


def _resources() -> tuple[list[str], list[str]]:
    """This process's open file descriptors (with what they point to) and live thread names."""
    import contextlib
    import os
    import threading

    fds = []
    for fd in sorted(os.listdir("/proc/self/fd"), key=int):
        with contextlib.suppress(OSError):  # OSError: the descriptor listdir itself used
            fds.append(f"{fd}->{os.readlink(f'/proc/self/fd/{fd}')}")
    return fds, sorted(t.name for t in threading.enumerate())


def _settle(baseline: tuple[list[str], list[str]], seconds: float = 5.0) -> tuple[list[str], list[str]]:
    """Resources now, waiting up to ``seconds`` for threads that are on their way out."""
    import time

    deadline = time.monotonic() + seconds
    while True:
        now = _resources()
        if (len(now[0]), len(now[1])) == (len(baseline[0]), len(baseline[1])) or time.monotonic() > deadline:
            return now
        time.sleep(0.05)


def lifecycle_cycles(rank: int, size: int, ports: list[int], env: dict[str, str], results: Any) -> None:
    """Outside a Cluster: init / allreduce / shutdown once per port, recording fds and threads.

    Puts ``(rank, report)`` on ``results``: the resources before the first init
    and after each shutdown, and each cycle's results.
    """
    import os

    os.environ.update(env)
    import ringcore

    report: dict[str, Any] = {"before": _resources(), "after": [], "sums": []}
    try:
        for cycle, port in enumerate(ports):
            ringcore.init(rank=rank, size=size, addr="127.0.0.1", port=port)
            small = np.full(100, float(rank + cycle), np.float64)
            big = np.full(200_000, float(rank + 1), np.float32)  # ring path
            ringcore.allreduce(small, name="small")
            ringcore.allreduce(big, op="max", name="big")
            report["sums"].append((float(small[0]), float(big.max())))
            ringcore.shutdown()
            report["after"].append(_resources())  # at once: shutdown() must have stopped everything
    except Exception as err:
        report["error"] = f"{type(err).__name__}: {err}"
    results.put((rank, report))


def reinit_after_failure(rank: int, ports: list[int], env: dict[str, str], stamp: str, results: Any) -> None:
    """Outside a Cluster: 3 ranks; rank 2 is SIGKILLed mid-allreduce; ranks 0 and 1 see the
    failure, shut down, and init again as a world of 2 on a new port.

    Ranks 0 and 1 put ``(rank, report)`` on ``results``: the error, what a
    collective on the broken communicator raised, the resources before the
    first init, after the failed communicator's shutdown and after the second
    job's shutdown, and the second job's allreduce result.
    """
    import os

    os.environ.update(env)
    import ringcore

    report: dict[str, Any] = {"before": _resources()}
    try:
        comm = ringcore.init(rank=rank, size=3, addr="127.0.0.1", port=ports[0])
        ringcore.allreduce(np.ones(10, np.float32))
        if rank == 2:
            _hook_phase(comm, "kill9", "scatter-reduce", 3, stamp)
        try:
            ringcore.allreduce(np.ones(1_000_000, np.float32))
            report["error"] = "no error"
        except ringcore.PeerFailure as err:
            report["error"], report["peer"] = "PeerFailure", err.peer
        try:
            ringcore.barrier()
        except Exception as err:
            report["broken"] = type(err).__name__
        ringcore.shutdown()
        report["after_failure"] = _settle(report["before"])
        ringcore.init(rank=rank, size=2, addr="127.0.0.1", port=ports[1])
        buf = np.full(300_000, float(rank + 1), np.float32)
        ringcore.allreduce(buf)
        report["second"] = (float(buf.min()), float(buf.max()), ringcore.size())
        ringcore.shutdown()
        report["after_second"] = _settle(report["before"])
    except Exception as err:
        report["crash"] = f"{type(err).__name__}: {err}"
    results.put((rank, report))


def timeline_job(comm: Any) -> int:
    """Collectives of every kind and algorithm; returns how many were issued."""
    comm.allreduce(np.ones(300_000, np.float32), name="big")
    comm.allreduce(np.ones(10, np.float64), op="max", name="small")
    comm.allreduce(np.ones(2, np.float32))  # fewer elements than ranks
    comm.broadcast(np.arange(50_000, dtype=np.int32), root=1, name="bcast")
    comm.allgather(np.ones((comm.rank + 1, 3), np.float32), name="gather")
    comm.reduce_scatter(np.ones((30, 2), np.float32), name="rs")
    comm.barrier()
    handles = [comm.allreduce_async(np.ones(n, np.float32), name=f"async{n}") for n in (10, 200_000)]
    for handle in handles:
        handle.wait(30)
    return 9


# ---------------------------------------------------------------------------- RDMA


def transport_report(comm: Any) -> dict[str, Any]:
    """Which transport this rank runs on, and its registration count so far."""
    transport = comm.transport
    cache = getattr(transport, "cache", None)
    return {"transport": type(transport).__name__, "registrations": getattr(cache, "registrations", None)}


def repeated_allreduce(comm: Any, count: int, rounds: int) -> dict[str, Any]:
    """Allreduce the same array ``rounds`` times; report registrations before and after the repeats."""
    buf = np.full(count, comm.rank + 1, np.float32)
    comm.allreduce(buf)
    first = comm.transport.cache.registrations
    for _ in range(rounds):
        comm.allreduce(buf)
    expected = (comm.size * (comm.size + 1) // 2) * comm.size**rounds
    return {"first": first, "after": comm.transport.cache.registrations, "ok": bool((buf == expected).all())}


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


def allreduce_algorithm(comm: Any, count: int, itemsize: int, sliced: bool = False) -> str:
    """Which allreduce schedule this communicator picks for ``count`` elements of ``itemsize`` bytes."""
    from ringcore.collectives import allreduce_schedule

    return _algorithm(allreduce_schedule(comm, count, itemsize, in_place=True, sliced=sliced))


def _algorithm(schedule: Any) -> str:
    if schedule.prefill_work:
        return "recursive-doubling"
    if schedule.steps and all(step.whole for step in schedule.steps):
        return "halving-doubling"
    return "ring"


def allreduce_recording_algorithms(comm: Any, inputs: list[np.ndarray]) -> tuple[np.ndarray, list[str]]:
    """``allreduce`` (sum), and the algorithm of every schedule its plan picked (one per slice)."""
    from ringcore import collectives

    picked: list[str] = []
    original = collectives.allreduce_schedule

    def recording(comm_: Any, count: int, itemsize: int, in_place: bool, sliced: bool = False) -> Any:
        schedule = original(comm_, count, itemsize, in_place, sliced)
        picked.append(_algorithm(schedule))
        return schedule

    collectives.allreduce_schedule = recording  # type: ignore[assignment]
    try:
        return allreduce(comm, inputs, "sum"), picked
    finally:
        collectives.allreduce_schedule = original  # type: ignore[assignment]


def allreduce_on_mixed_paths(
    comm: Any, count: int, cases: list[tuple[str, str, str | None]], rounds: int, value: Any, kept: Any
) -> dict[str, Any]:
    """Reduce each ``(dtype, op, compression)`` case ``rounds`` times, on kept and general paths at once.

    Rank r forgets its remembered layouts on rounds where (round + r) % 3 == 0,
    so that round it plans in full while the others may run kept plans: the
    frames must agree. ``value(rank, round, count, dtype)`` makes the input;
    ``kept(comm)`` counts the layouts running kept plans after each round.
    """
    out: dict[str, Any] = {"results": {}, "kept": []}
    for round_ in range(rounds):
        if (round_ + comm.rank) % 3 == 0:
            comm.clear_plan_cache()
        for dtype, op, compression in cases:
            x = value(comm.rank, round_, count, dtype)
            assert comm.allreduce(x, op=op, compression=compression) is x
            out["results"].setdefault(f"{dtype}-{op}-{compression}", []).append(x.copy())
        out["kept"].append(kept(comm))
    return out


def kept_layouts(comm: Any, kind: type | None = None) -> int:
    """How many of ``comm``'s remembered layouts keep their plan (of class ``kind``, any when None)."""
    from ringcore.latency import KeptAllreduce

    kind = kind or KeptAllreduce
    return sum(1 for entry in comm._checked.values() if isinstance(entry[3], kind) and entry[3].bound)


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


def many_layouts(comm: Any, counts: list[int], calls: int) -> tuple[list[bool], dict[str, int]]:
    """Allreduce (sum) float32 arrays of every length in ``counts``, ``calls`` times each; each result
    checked against the exact sum, and the plan cache's size afterwards."""
    ok = []
    for count in counts:
        for call in range(calls):
            x = np.full(count, comm.rank + call, np.float32)
            comm.allreduce(x)
            ok.append(bool(np.all(x == sum(r + call for r in range(comm.size)))))
    return ok, comm.plan_cache()
