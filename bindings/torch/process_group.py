"""The torch.distributed backend "ringcore": a Python ``ProcessGroup`` over a ringcore Communicator.

``import ringcore.torch`` registers it; then ``dist.init_process_group("ringcore")``
(or ``dist.new_group(backend="ringcore")``) makes a group whose collectives run
on ringcore, and DistributedDataParallel trains on it as on gloo::

    import ringcore.torch  # noqa: F401  (registers the backend)
    import torch.distributed as dist

    dist.init_process_group("ringcore")  # was: "gloo"
    model = torch.nn.parallel.DistributedDataParallel(model)

Meeting. torch makes its own rendezvous (``init_method``, ``env://`` by
default) and hands the group's store to this backend; rank 0 of the group
serves ringcore's store on a port the kernel picks and publishes it in
torch's store (:func:`ringcore.new_communicator`), so every group, the default
one and each ``new_group``, has a communicator of its own and needs no port
of its own. Rank 0 listens on the interface that routes to the host of
torch's ``TCPStore`` (found through the ``PrefixStore`` chain), else to
``MASTER_ADDR``, else on loopback.

Timeout. torch passes the group's ``timeout`` (``init_process_group(timeout=...)``).
When it is torch's default (``default_pg_timeout``, 30 minutes: torch does not
say whether the user chose it), collectives keep ``RINGCORE_TIMEOUT`` (300 s
without progress); any other value replaces it for this group.

Launchers. ``env://`` needs ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` before this backend is ever called. torchrun and ringcore-run
set them; under mpirun or srun, :func:`register` (run by ``import
ringcore.torch``) fills in those missing from the launcher's own variables
(:mod:`ringcore.torch.launcher_env`).

Collectives. Implemented: ``all_reduce`` (SUM, AVG, PRODUCT, MIN, MAX),
``all_reduce_coalesced``, ``broadcast``, ``all_gather``,
``all_gather_into_tensor`` (``all_gather_single``), ``reduce_scatter``,
``reduce_scatter_tensor`` (``reduce_scatter_single``), ``barrier``, and the object collectives built on them (``all_gather_object``,
``broadcast_object_list``). Every other call (``send``, ``recv``, ``gather``,
``scatter``, ``reduce``, ``all_to_all``...) raises ``NotImplementedError``
naming it. Every collective but ``barrier`` runs on ringcore's async thread
and returns at once (results are copied into the output tensors there);
``barrier`` runs in the caller's thread and returns a finished Work. Either
way collectives run in call order, as ringcore orders them, so ranks must
call them in the same order, as with NCCL.

Work and errors. Arguments ringcore rejects raise ``TypeError``/``ValueError``
at the call. A failure between ranks is raised by ``work.wait()`` with its own
type, and fails ``work.get_future()`` with a ``RuntimeError``; futures complete
on ringcore's async thread (:mod:`ringcore.torch.work`).

Tensors: CPU tensors are reduced in place without a copy (DLPack); a
non-contiguous tensor goes through a contiguous copy. CUDA tensors take
ringcore's GPU path for ``all_reduce`` and ``broadcast`` only; the backend is
registered for ``devices=["cpu"]``.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, NoReturn

import numpy as np
import torch
import torch.distributed as dist

import ringcore
from ringcore.comm import Communicator
from ringcore.errors import RingcoreError
from ringcore.torch.launcher_env import export_launcher_env
from ringcore.torch.work import RingcoreWork

__all__ = ["BACKEND", "RingcoreProcessGroup", "RingcoreWork", "communicator", "register", "ringcore_group"]

BACKEND = "ringcore"

_IMPLEMENTED = (
    "all_reduce, all_reduce_coalesced, broadcast, all_gather, all_gather_single (all_gather_into_tensor), "
    "reduce_scatter, reduce_scatter_single (reduce_scatter_tensor), barrier"
)
_OPS = {
    dist.ReduceOp.RedOpType.SUM: "sum",
    dist.ReduceOp.RedOpType.AVG: "avg",
    dist.ReduceOp.RedOpType.PRODUCT: "prod",
    dist.ReduceOp.RedOpType.MIN: "min",
    dist.ReduceOp.RedOpType.MAX: "max",
}
_ANY_HOST = ("", "0.0.0.0", "::", "*")


# --------------------------------------------------------------------------- registration


def register() -> None:
    """Register the "ringcore" backend with torch.distributed; safe to call again.

    Also fills in torch's ``env://`` variables under mpirun and srun (see the
    module docstring).
    """
    export_launcher_env()
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])


def _create(store: dist.Store, rank: int, size: int, timeout: timedelta | None) -> RingcoreProcessGroup:
    """The backend's creator: torch calls it on every rank of a new group."""
    addr = store_host(store) or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    comm = ringcore.new_communicator(rank, size, store, addr=addr, timeout=collective_timeout(timeout))
    return RingcoreProcessGroup(comm)


def store_host(store: dist.Store) -> str | None:
    """The host of the ``TCPStore`` under ``store``'s ``PrefixStore``s, or None (another kind of store)."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    host = store.host if isinstance(store, dist.TCPStore) else None
    return None if host in _ANY_HOST else host


def collective_timeout(timeout: timedelta | None) -> float | None:
    """Seconds without progress before a collective fails: torch's ``timeout``, unless it is torch's default."""
    if timeout is None or timeout == dist.constants.default_pg_timeout:
        return None  # RINGCORE_TIMEOUT
    return timeout.total_seconds()


def ringcore_group(group: dist.ProcessGroup | None = None) -> RingcoreProcessGroup:
    """``group`` (default: the default group), checked to be a "ringcore" group.

    Raises:
        TypeError: it is another backend's group (the message names it).
    """
    group = dist.group.WORLD if group is None else group
    if not isinstance(group, RingcoreProcessGroup):
        backend = group.name() if isinstance(group, dist.ProcessGroup) else type(group).__name__
        raise TypeError(
            f"expected a 'ringcore' process group, got {backend!r}; call "
            "dist.init_process_group('ringcore') or pass dist.new_group(backend='ringcore')"
        )
    return group


def communicator(group: dist.ProcessGroup | None = None) -> Communicator:
    """The ringcore Communicator behind ``group`` (default: the default group); see :func:`ringcore_group`."""
    return ringcore_group(group).comm


# --------------------------------------------------------------------------- tensors


def _one(items: Sequence[Any], call: str) -> Any:
    if len(items) != 1:
        raise ValueError(f"ringcore backend: {call} takes one tensor per process, got {len(items)}")
    return items[0]


def _dense(tensor: torch.Tensor, call: str) -> tuple[torch.Tensor, Callable[[], None] | None]:
    """A contiguous tensor ringcore can use in place, and how to copy it back (None: it is ``tensor``)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"ringcore backend: {call} needs torch tensors, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise TypeError(f"ringcore backend: {call} supports dense tensors only, got {tensor.layout}")
    tensor = tensor.detach()
    if tensor.is_contiguous():
        return tensor, None
    work = tensor.contiguous()
    return work, lambda: tensor.copy_(work)


def _movable(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (contiguous) as a flat tensor of a dtype ringcore moves: bool and complex as bytes."""
    flat = tensor.reshape(-1)
    return flat.view(torch.uint8) if tensor.dtype == torch.bool or tensor.is_complex() else flat


def _to_torch(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A numpy result of ringcore's as a flat torch tensor of ``dtype`` (same bytes)."""
    return torch.from_numpy(np.ascontiguousarray(array).reshape(-1).view(np.uint8)).view(dtype)


def _reduce_op(opts: Any, call: str) -> str:
    op = opts.reduceOp.op if opts is not None else dist.ReduceOp.RedOpType.SUM
    if op not in _OPS:
        raise ValueError(
            f"ringcore backend: {call} does not support ReduceOp.{op.name}; "
            "use SUM, AVG, PRODUCT, MIN or MAX (or the gloo backend)"
        )
    return _OPS[op]


def _unsupported(call: str) -> Callable[..., NoReturn]:
    """A ProcessGroup method that raises ``NotImplementedError`` naming ``call`` (what the user called)."""

    def not_implemented(self: RingcoreProcessGroup, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(
            f"ringcore backend does not implement {call}; it implements {_IMPLEMENTED}. "
            "Use a gloo group for the rest: dist.new_group(backend='gloo')"
        )

    return not_implemented


# --------------------------------------------------------------------------- the group


class RingcoreProcessGroup(dist.ProcessGroup):
    """A torch.distributed process group whose collectives run on ``comm`` (see the module docstring)."""

    def __init__(self, comm: Communicator) -> None:
        super().__init__(comm.rank, comm.size)
        self.comm = comm
        self._finalizer = weakref.finalize(self, comm.shutdown)

    def getBackendName(self) -> str:
        return BACKEND

    def __repr__(self) -> str:
        return f"RingcoreProcessGroup(rank={self.comm.rank}, size={self.comm.size})"

    def shutdown(self) -> None:
        """Close the communicator (``dist.destroy_process_group`` calls it)."""
        self._finalizer()

    def abort(self) -> None:
        self._finalizer()

    # ----------------------------------------------------------------- async, in place

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> RingcoreWork:
        tensor = _one(tensors, "all_reduce")
        return self.allreduce_tensor(tensor, _reduce_op(opts, "all_reduce"), value=[tensor])

    def allreduce_tensor(
        self, tensor: torch.Tensor, op: str = "sum", compression: str | None = None, value: Any = None
    ) -> RingcoreWork:
        """Start an allreduce of ``tensor`` in place with ringcore's own options.

        Args:
            tensor: the tensor to reduce.
            op: ``"sum"``, ``"avg"``, ``"min"``, ``"max"`` or ``"prod"``.
            compression: ``None`` or ``"fp16"`` (float16 on the wire, accumulation in ``tensor``'s dtype).
            value: what the Work's future yields (default: ``tensor``).
        """
        dense, copy_back = _dense(tensor, "all_reduce")
        handle = self.comm.allreduce_async(dense, op=op, compression=compression)
        return RingcoreWork("all_reduce", tensor if value is None else value).follow(handle, copy_back)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> RingcoreWork:
        """One allreduce of the tensors flattened together (they must share a dtype)."""
        op = _reduce_op(opts, "all_reduce_coalesced")
        if not tensors:
            return self._finished("all_reduce_coalesced", [])
        dtypes = {t.dtype for t in tensors}
        if len(dtypes) > 1:
            names = ", ".join(sorted(str(d) for d in dtypes))
            raise ValueError(
                f"ringcore backend: all_reduce_coalesced needs tensors of one dtype, got {names}"
            )
        for tensor in tensors:
            _dense(tensor, "all_reduce_coalesced")
        flat = torch.cat([t.detach().reshape(-1) for t in tensors])

        def unflatten() -> None:
            for tensor, piece in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
                tensor.detach().copy_(piece.view(tensor.shape))

        handle = self.comm.allreduce_async(flat, op=op)
        return RingcoreWork("all_reduce_coalesced", tensors).follow(handle, unflatten)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> RingcoreWork:
        tensor = _one(tensors, "broadcast")
        root = opts.rootRank if opts is not None else 0
        if opts is not None and opts.rootTensor != 0:
            raise ValueError(f"ringcore backend: broadcast has one tensor, rootTensor is {opts.rootTensor}")
        dense, copy_back = _dense(tensor, "broadcast")
        movable = _movable(dense) if dense.device.type == "cpu" else dense
        handle = self.comm.broadcast_async(movable, root=root)
        return RingcoreWork("broadcast", tensors).follow(handle, copy_back)

    # ----------------------------------------------------------------- blocking, new arrays

    def allgather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> RingcoreWork:
        """``output_tensors[0][r]`` receives rank ``r``'s input (sizes may differ between ranks)."""
        outputs = _one(output_tensors, "all_gather")
        source = _one(input_tensors, "all_gather")
        if len(outputs) != self.comm.size:
            raise ValueError(
                f"ringcore backend: all_gather needs {self.comm.size} output tensors, got {len(outputs)}"
            )

        def place(gathered: torch.Tensor) -> None:
            sizes = [t.numel() for t in outputs]
            if gathered.numel() != sum(sizes):
                raise ValueError(
                    f"ringcore backend: all_gather's output tensors hold {sum(sizes)} elements, "
                    f"the ranks sent {gathered.numel()}"
                )
            for out, piece in zip(outputs, gathered.split(sizes), strict=True):
                out.detach().copy_(piece.view(out.shape))

        return self._gather(source, "all_gather", output_tensors, place)

    def all_gather_single(self, output: torch.Tensor, source: torch.Tensor, opts: Any = None) -> RingcoreWork:
        """``all_gather_into_tensor``: every rank's input concatenated into ``output``."""
        call = "all_gather_into_tensor"
        if output.numel() != source.numel() * self.comm.size:
            raise ValueError(
                f"ringcore backend: {call}'s output has {output.numel()} elements, expected "
                f"{self.comm.size} x {source.numel()} (world size x input)"
            )
        return self._gather(
            source, call, [output], lambda gathered: output.detach().copy_(gathered.view(output.shape))
        )

    _allgather_base = all_gather_single  # what torch before 2.13 calls

    def reduce_scatter(
        self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any = None
    ) -> RingcoreWork:
        """``output_tensors[0]`` receives the reduction of every rank's ``input_tensors[0][rank]``."""
        output = _one(output_tensors, "reduce_scatter")
        inputs = _one(input_tensors, "reduce_scatter")
        if len(inputs) != self.comm.size or any(t.numel() != output.numel() for t in inputs):
            raise ValueError(
                f"ringcore backend: reduce_scatter needs {self.comm.size} input tensors of "
                f"{output.numel()} elements each, got {[t.numel() for t in inputs]}"
            )
        stacked = torch.stack([t.detach().reshape(-1) for t in inputs])
        return self._reduce_scatter(output, stacked, _reduce_op(opts, "reduce_scatter"), "reduce_scatter")

    def reduce_scatter_single(
        self, output: torch.Tensor, source: torch.Tensor, opts: Any = None
    ) -> RingcoreWork:
        """``reduce_scatter_tensor``: rank ``r`` receives the ``r``-th equal part of the reduced input."""
        call = "reduce_scatter_tensor"
        if source.numel() != output.numel() * self.comm.size:
            raise ValueError(
                f"ringcore backend: {call}'s input has {source.numel()} elements, expected "
                f"{self.comm.size} x {output.numel()} (world size x output)"
            )
        rows = _dense(source, call)[0].reshape(self.comm.size, output.numel())
        return self._reduce_scatter(output, rows, _reduce_op(opts, call), call)

    _reduce_scatter_base = reduce_scatter_single  # what torch before 2.13 calls

    def barrier(self, opts: Any = None) -> RingcoreWork:
        return self._run_now("barrier", [], self.comm.barrier)

    # ----------------------------------------------------------------- not implemented

    send = _unsupported("dist.send / isend")
    recv = _unsupported("dist.recv / irecv")
    recv_anysource = _unsupported("dist.recv_anysource (recv without src)")
    gather = _unsupported("dist.gather")
    scatter = _unsupported("dist.scatter")
    reduce = _unsupported("dist.reduce")
    alltoall = _unsupported("dist.all_to_all")
    all_to_all_single = _unsupported("dist.all_to_all_single")
    alltoall_base = _unsupported("dist.all_to_all_single (alltoall_base)")
    allgather_coalesced = _unsupported("dist.all_gather_coalesced")
    all_gather_single_coalesced = _unsupported("all_gather_into_tensor_coalesced")
    allgather_into_tensor_coalesced = _unsupported("allgather_into_tensor_coalesced")
    reduce_scatter_single_coalesced = _unsupported("reduce_scatter_tensor_coalesced")
    reduce_scatter_tensor_coalesced = _unsupported("reduce_scatter_tensor_coalesced")

    # ----------------------------------------------------------------- helpers

    def _gather(
        self, source: torch.Tensor, call: str, value: Any, place: Callable[[torch.Tensor], Any]
    ) -> RingcoreWork:
        """Start gathering every rank's ``source``; ``place`` gets them concatenated, flat, in its dtype."""
        dense = _dense(source, call)[0]
        handle = self.comm.allgather_async(_movable(dense))
        return RingcoreWork(call, value).follow(
            handle, lambda: place(_to_torch(handle.wait(0), source.dtype))
        )

    def _reduce_scatter(self, output: torch.Tensor, rows: torch.Tensor, op: str, call: str) -> RingcoreWork:
        handle = self.comm.reduce_scatter_async(rows, op=op)

        def place() -> None:
            output.detach().copy_(_to_torch(handle.wait(0), rows.dtype).view(output.shape))

        return RingcoreWork(call, [output]).follow(handle, place)

    def _run_now(self, call: str, value: Any, run: Callable[[], None]) -> RingcoreWork:
        """Run a blocking collective here; ringcore's errors go into the Work, bad arguments raise."""
        work = RingcoreWork(call, value)
        try:
            run()
        except RingcoreError as err:
            work.finish(err)
        else:
            work.finish()
        return work

    def _finished(self, call: str, value: Any) -> RingcoreWork:
        work = RingcoreWork(call, value)
        work.finish()
        return work
