"""Cluster tasks for GPU buffers: each runs on every rank, with the fake device or a real GPU."""

from __future__ import annotations

from typing import Any

import numpy as np

from ringcore import device
from ringcore.device.fake import FakeCudaArray, FakeLayer


def use_fake(comm: Any, seed: int) -> None:
    """Make this rank's GPU buffers go through the fake device (before its first GPU buffer)."""
    device.use(FakeLayer(seed=seed + comm.rank))


def _bits(x: np.ndarray) -> np.ndarray:
    return x.view(f"u{x.itemsize}")


def fake_vs_host(comm: Any, cases: list[tuple[list[np.ndarray], bool, str, str | None]]) -> list[Any]:
    """Each case reduced as a fake GPU buffer and as a host buffer; both results' bits, per case."""
    out = []
    for inputs, bfloat16, op, compression in cases:
        host = inputs[comm.rank].copy()
        gpu = FakeCudaArray(inputs[comm.rank].copy(), bfloat16=bfloat16)
        comm.allreduce(gpu, op=op, compression=compression)
        if bfloat16:  # the host path takes bfloat16 as ml_dtypes or torch; use torch's CPU tensor
            import torch

            tensor = torch.from_numpy(host.view(np.int16)).view(torch.bfloat16)
            comm.allreduce(tensor, op=op, compression=compression)
        else:
            comm.allreduce(host, op=op, compression=compression)
        out.append((_bits(gpu.data), _bits(host)))
    return out


def fake_broadcast(comm: Any, inputs: list[np.ndarray], root: int) -> np.ndarray:
    gpu = FakeCudaArray(inputs[comm.rank].copy())
    comm.broadcast(gpu, root=root)
    return gpu.data


def fake_bad_input(comm: Any, case: str) -> tuple[str, str]:
    """A bad GPU buffer must fail on the calling rank before anything is sent."""
    data = np.zeros((4, 4), np.float32)
    objs = {
        "read_only": FakeCudaArray(data, read_only=True),
        "non_contiguous": FakeCudaArray(data[:, ::2]),
        "bool": FakeCudaArray(np.zeros(4, bool)),
        "avg_int": FakeCudaArray(np.zeros(4, np.int32)),
        "allgather": FakeCudaArray(data),
    }
    try:
        if case == "allgather":
            comm.allgather(objs[case])
        else:
            comm.allreduce(objs[case], op="avg" if case == "avg_int" else "sum")
    except (TypeError, ValueError) as err:
        return type(err).__name__, str(err)
    return "none", ""


def fake_then_host(comm: Any, count: int) -> float:
    """After a rejected GPU call the communicator still works."""
    buf = np.ones(count, np.float32)
    comm.allreduce(buf)
    return float(buf[0])


def real_vs_host(
    comm: Any, cases: list[tuple[list[np.ndarray], bool, str, str | None]], kind: str
) -> list[Any]:
    """As :func:`fake_vs_host` with real GPU buffers: ``kind`` is ``"cupy"`` or ``"torch"``."""
    import cupy

    out = []
    for inputs, bfloat16, op, compression in cases:
        x = inputs[comm.rank]
        use_torch = bfloat16 or (kind == "torch" and x.dtype != np.uint16)  # torch: no uint16 interface
        if use_torch:
            import torch

            gpu = torch.from_numpy(x.view(np.int16) if bfloat16 else x.copy()).cuda()
            gpu = gpu.view(torch.bfloat16) if bfloat16 else gpu
        else:
            gpu = cupy.asarray(x)
        comm.allreduce(gpu, op=op, compression=compression)
        if use_torch:
            gpu_bits = gpu.view(torch.int16).cpu().numpy() if bfloat16 else gpu.cpu().numpy()
        else:
            gpu_bits = cupy.asnumpy(gpu)
        host = x.copy()
        if bfloat16:
            tensor = torch.from_numpy(host.view(np.int16)).view(torch.bfloat16)
            comm.allreduce(tensor, op=op, compression=compression)
        else:
            comm.allreduce(host, op=op, compression=compression)
        out.append((_bits(np.ascontiguousarray(gpu_bits)), _bits(host)))
    return out


def real_broadcast(comm: Any, inputs: list[np.ndarray], root: int) -> np.ndarray:
    import cupy

    gpu = cupy.asarray(inputs[comm.rank])
    comm.broadcast(gpu, root=root)
    return cupy.asnumpy(gpu)


def mixed_ring(comm: Any, inputs: list[np.ndarray], op: str, compression: str | None) -> np.ndarray:
    """Odd ranks pass a (fake) GPU buffer, even ranks a host one, in the same collective."""
    x = inputs[comm.rank].copy()
    buf = FakeCudaArray(x) if comm.rank % 2 else x
    comm.allreduce(buf, op=op, compression=compression)
    return _bits(x)


def device_scratch(comm: Any) -> dict[str, int]:
    """Bytes of device scratch this rank holds, by buffer (none on a rank that never passed a GPU buffer)."""
    dev = comm.ctx._device
    return {} if dev is None else dev.scratch_bytes()


def use_mock_cupy(comm: Any) -> None:
    """Make this rank's GPU buffers go through ringcore's CuPy layer over tests/gpu/mock_cupy.py."""
    import sys

    from tests.gpu import mock_cupy

    sys.modules["cupy"] = mock_cupy.module()
    device.use(None)


def fake_async(comm: Any, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """Several GPU allreduces in flight on the async thread, then a host one, in order."""
    bufs = [FakeCudaArray(x.copy()) for x in inputs]
    handles = [
        comm.allreduce_async(b, op="sum", compression="fp16" if i % 2 else None) for i, b in enumerate(bufs)
    ]
    host = inputs[0].copy()
    comm.allreduce(host)
    for handle in handles:
        handle.wait(timeout=60)
    return [b.data for b in bufs] + [host]


def fake_until_failure(
    comm: Any, count: int, rounds: int, fault: tuple[int, str, str, float] | None = None
) -> tuple[str, bool, Any]:
    """Allreduce a GPU buffer (fresh input each round) until a collective fails.

    Returns the error's type, whether the buffer kept its input outside the
    elements the error's note says may hold partial sums, and those elements.
    ``fault``: the victim injects it from inside round 1 (``tests.tasks.fault_in_round_one``).
    """
    from ringcore.device.fake import FakeCudaArray as Array
    from tests.tasks import exposed_range, fault_in_round_one, untouched_except_noted

    original = np.full(count, comm.rank + 1, np.float32)  # sums differ from every input
    buf = Array(original.copy())
    with fault_in_round_one(comm, fault) as next_round:
        for round_ in range(rounds):
            next_round(round_)
            np.copyto(buf.data, original)
            try:
                comm.allreduce(buf)
            except Exception as err:
                return type(err).__name__, untouched_except_noted(buf.data, original, err), exposed_range(err)
    return "none", True, None


def repeated_posts(comm: Any, inputs: dict[str, list[np.ndarray]], rounds: int, gpu_ranks: list[int]) -> dict:
    """``rounds`` rounds of a small allreduce, a broadcast from rank 0 and a large allreduce, each
    buffer a fake GPU one on ``gpu_ranks`` and a host one elsewhere: every call's result, and how
    many posts this rank made in its mailbox for it."""
    mailbox = comm.ctx.transport.mailbox
    posts, results = [], []
    for _ in range(rounds):
        for kind in ("small", "broadcast", "large"):
            x = inputs[kind][comm.rank].copy()
            buf = FakeCudaArray(x) if comm.rank in gpu_ranks else x
            before = mailbox.posts
            if kind == "broadcast":
                comm.broadcast(buf, root=0)
            else:
                comm.allreduce(buf)
            posts.append(mailbox.posts - before)
            results.append(x)
    return {"posts": posts, "results": results}
