"""The ``ray.util.collective`` backend "ringcore": collective groups of Ray actors over ringcore.

Ray keeps a registry of collective backends
(``ray.util.collective.backend_registry``, added in 2026 by ray-project/ray
PR 60701; tested with Ray 2.60). Older releases have none, and ringcore does
not patch Ray: there this module raises ``ImportError`` saying so. :func:`register`, run by
``import ringcore.ray.collective`` and by ringcore's worker setup hook
(:mod:`ringcore.ray.setup_hook`), adds :class:`RingcoreGroup` to it under
"RINGCORE"; then, in every actor::

    from ray.util import collective as col

    col.init_collective_group(world_size, rank, backend="ringcore", group_name="grads")
    col.allreduce(grads, group_name="grads")       # numpy arrays or torch tensors, in place

Ray asks for the backend in every process that makes a group: each actor,
and the driver too when it declares a group with ``create_collective_group``.

Meeting. The ranks of a group meet through Ray's internal key-value store
(``ray.experimental.internal_kv``, which Ray's own GLOO group uses too),
under a key of the job and the group name: rank 0 serves ringcore's store on
a port the kernel picks and publishes it there
(:func:`ringcore.new_communicator`), with a fresh secret unless
``RINGCORE_SECRET`` is set, and deletes the key once every rank has joined,
so a group made again under the same name meets afresh.

Collectives: ``allreduce`` (SUM, PRODUCT, MIN, MAX), ``broadcast`` and
``reduce`` in place; ``allgather`` into the given list of tensors;
``reducescatter`` of a list of ``world_size`` tensors into one; ``barrier``.
numpy arrays and CPU torch tensors (CUDA tensors for ``allreduce`` and
``broadcast``, through ringcore's GPU path); a tensor that requires grad is
reduced through ``.detach()``. ``send`` and ``recv`` raise
``NotImplementedError``: ringcore has no point-to-point operations.
``RINGCORE_TIMEOUT`` bounds every collective; Ray's ``timeout_ms`` options are
not used.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import ray
import ray.experimental.internal_kv as internal_kv

import ringcore
from ringcore.config import Settings
from ringcore.errors import CollectiveTimeout

try:
    from ray.util.collective.backend_registry import register_collective_backend
    from ray.util.collective.collective_group.base_collective_group import BaseGroup
    from ray.util.collective.types import ReduceOp
except ImportError as err:  # a Ray without the registry: say so rather than patch Ray
    raise ImportError(
        f"ringcore.ray.collective needs ray.util.collective.backend_registry, which Ray {ray.__version__} "
        "does not have; use RingcoreExecutor, or Ray Train with TorchConfig(backend='ringcore')"
    ) from err

__all__ = ["BACKEND", "RingcoreGroup", "register"]

BACKEND = "RINGCORE"
_OPS = {ReduceOp.SUM: "sum", ReduceOp.PRODUCT: "prod", ReduceOp.MIN: "min", ReduceOp.MAX: "max"}


def register() -> None:
    """Add the "ringcore" backend to ``ray.util.collective`` in this process; safe to call again."""
    with contextlib.suppress(ValueError):  # "already registered": by an earlier call in this process
        register_collective_backend(BACKEND, RingcoreGroup)


class KVMeeting:
    """Ray's internal key-value store as a ringcore meeting point (``set``, blocking ``get``)."""

    def __init__(self, prefix: str, timeout: float) -> None:
        self.prefix, self.timeout = prefix, timeout
        self.keys: list[str] = []

    def set(self, key: str, value: bytes) -> None:
        internal_kv._internal_kv_put(self.prefix + key, value, overwrite=True)
        self.keys.append(self.prefix + key)

    def get(self, key: str) -> bytes:
        deadline = time.monotonic() + self.timeout
        while (value := internal_kv._internal_kv_get(self.prefix + key)) is None:
            if time.monotonic() > deadline:
                raise CollectiveTimeout(
                    f"ray.util.collective ringcore group: rank 0 did not publish {self.prefix + key} "
                    f"within {self.timeout:g} s (RINGCORE_INIT_TIMEOUT); is rank 0 running?"
                )
            time.sleep(0.01)
        return value

    def clear(self) -> None:
        for key in self.keys:
            internal_kv._internal_kv_del(key)
        self.keys.clear()


class RingcoreGroup(BaseGroup):
    """One ``ray.util.collective`` group: a ringcore Communicator of its own."""

    def __init__(self, world_size: int, rank: int, group_name: str) -> None:
        super().__init__(world_size, rank, group_name)
        job = ray.get_runtime_context().get_job_id()
        meeting = KVMeeting(f"ringcore/collective/{job}/{group_name}/", Settings.from_env().init_timeout)
        self.comm = ringcore.new_communicator(rank, world_size, meeting, addr=ray.util.get_node_ip_address())
        meeting.clear()  # every rank has joined: the mesh is up on all of them

    @classmethod
    def backend(cls) -> str:
        return BACKEND

    @classmethod
    def check_backend_availability(cls) -> bool:
        return True

    def destroy_group(self) -> None:
        self.comm.shutdown()

    def allreduce(self, tensor: Sequence[Any], allreduce_options: Any = None) -> None:
        self.comm.allreduce(_inplace(tensor[0]), op=_op(allreduce_options))

    def broadcast(self, tensor: Sequence[Any], broadcast_options: Any = None) -> None:
        self.comm.broadcast(_inplace(tensor[0]), root=getattr(broadcast_options, "root_rank", 0))

    def reduce(self, tensor: Sequence[Any], reduce_options: Any = None) -> None:
        root = getattr(reduce_options, "root_rank", 0)
        buf = _inplace(tensor[0]) if self.rank == root else _copy(tensor[0])  # only the root's changes
        self.comm.allreduce(buf, op=_op(reduce_options))

    def allgather(
        self, tensor_list: Sequence[Sequence[Any]], tensor: Sequence[Any], allgather_options: Any = None
    ) -> None:
        outputs, x = tensor_list[0], _inplace(tensor[0])
        _check_list(outputs, self.world_size, "allgather")
        gathered = self.comm.allgather(x.reshape((1, *x.shape)))
        for out, part in zip(outputs, gathered, strict=True):
            _write(out, part, "allgather")

    def reducescatter(
        self, tensor: Sequence[Any], tensor_list: Sequence[Sequence[Any]], reducescatter_options: Any = None
    ) -> None:
        out, inputs = tensor[0], tensor_list[0]
        _check_list(inputs, self.world_size, "reducescatter")
        mine = self.comm.reduce_scatter(_stack(inputs), op=_op(reducescatter_options))
        _write(out, mine[0], "reducescatter")

    def barrier(self, barrier_options: Any = None) -> None:
        self.comm.barrier()

    def send(self, tensor: Sequence[Any], send_options: Any) -> None:
        raise NotImplementedError(
            "ray.util.collective backend 'ringcore' has no send(): ringcore has no point-to-point operations"
        )

    def recv(self, tensor: Sequence[Any], recv_options: Any) -> None:
        raise NotImplementedError(
            "ray.util.collective backend 'ringcore' has no recv(): ringcore has no point-to-point operations"
        )


def _op(options: Any) -> str:
    op = getattr(options, "reduceOp", ReduceOp.SUM)
    if op not in _OPS:
        raise ValueError(f"ray.util.collective backend 'ringcore' does not support {op}")
    return _OPS[op]


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


def _inplace(x: Any) -> Any:
    """``x`` itself, or the same memory without autograd for a tensor that requires grad."""
    return x.detach() if _is_torch(x) else x


def _copy(x: Any) -> Any:
    return x.detach().clone() if _is_torch(x) else np.array(x, copy=True)


def _stack(inputs: Sequence[Any]) -> Any:
    """The ``world_size`` inputs as one contiguous array, rank ``r``'s chunk at row ``r``."""
    if any(_is_torch(x) for x in inputs):
        import torch

        return torch.stack([x.detach() if _is_torch(x) else torch.from_numpy(np.asarray(x)) for x in inputs])
    return np.stack([np.asarray(x) for x in inputs])


def _write(out: Any, value: np.ndarray, what: str) -> None:
    """Copy ``value`` into the caller's ``out`` (numpy array or torch tensor) of the same shape."""
    if tuple(out.shape) != tuple(value.shape):
        raise ValueError(
            f"ray.util.collective ringcore {what}: output has shape {tuple(out.shape)}, the result {tuple(value.shape)}"
        )
    if _is_torch(out):
        import torch

        with torch.no_grad():
            out.copy_(torch.from_numpy(np.ascontiguousarray(value)))
    else:
        np.copyto(out, value)


def _check_list(tensors: Sequence[Any], size: int, what: str) -> None:
    if len(tensors) != size:
        raise ValueError(
            f"ray.util.collective ringcore {what}: {len(tensors)} tensors for a world of size {size}"
        )
