"""Calls that must fail before anything is sent: one bad argument per case, the caller's object checked afterwards."""

from __future__ import annotations

from typing import Any

import numpy as np


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
