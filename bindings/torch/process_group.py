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

import logging
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
LEAVE_WAIT = 5.0  # seconds a rank waits in shutdown() for rank 0 to leave first
_LEFT_KEY = "ringcore/left"  # in torch's store of the group, set by rank 0 on its way out
log = logging.getLogger("ringcore")

_IMPLEMENTED = (
    "all_reduce, all_reduce_coalesced, broadcast, all_gather, all_gather_single (all_gather_into_tensor), "
    "reduce_scatter, reduce_scatter_single (reduce_scatter_tensor), barrier, reduce, gather, scatter, "
    "all_gather_into_tensor_coalesced, reduce_scatter_tensor_coalesced"
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
    default = not dist.is_initialized()  # the default group: its rank 0 hosts torch's store
    comm = ringcore.new_communicator(rank, size, store, addr=addr, timeout=collective_timeout(timeout))
    return RingcoreProcessGroup(comm, store if default else None)


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

    def __init__(self, comm: Communicator, store: dist.Store | None = None) -> None:
        super().__init__(comm.rank, comm.size)
        self.comm = comm
        self._store = store  # the default group's (rank 0 hosts it): the ranks leave shutdown() through it
        self._finalizer = weakref.finalize(self, comm.shutdown)

    def getBackendName(self) -> str:
        return BACKEND

    def _set_group_name(self, name: str) -> None:
        """torch names every group it makes; the name lives on a C++ backend this group has none of."""
        self._group_name = name

    @property
    def group_name(self) -> str:
        """The name torch gave the group (functional collectives and device meshes look groups up by it)."""
        name = getattr(self, "_group_name", None)
        if name is None:
            raise RuntimeError("ProcessGroup name not set")
        return name

    def __repr__(self) -> str:
        return f"RingcoreProcessGroup(rank={self.comm.rank}, size={self.comm.size})"

    def shutdown(self) -> None:
        """Close the communicator (``dist.destroy_process_group`` calls it); rank 0 leaves first.

        In the default group rank 0 hosts torch's ``TCPStore``, which torch drops right after
        this returns. A rank that left sooner could start its next ``init_process_group`` on
        the old store (the same port), which then closes under it (``DistNetworkError: Failed
        to recv``; 2 launches in 6 on a loaded host, where gloo's ranks, which leave together,
        passed). So the others wait (``LEAVE_WAIT`` s at most) until rank 0 has closed the
        communicator and said so in the store: that narrows the window to the moments between
        rank 0's word and its store's end, as for gloo (15 re-inits in a row passed).
        """
        if not self._finalizer.alive:
            return
        self._finalizer()
        store, self._store = self._store, None
        if store is None:
            return
        try:
            if self.comm.rank == 0:
                store.set(_LEFT_KEY, b"1")
            else:
                store.wait([_LEFT_KEY], timedelta(seconds=LEAVE_WAIT))
        except Exception:  # rank 0 (or its store) is gone already: nothing to wait for
            log.debug("ringcore backend: leaving without rank 0's word", exc_info=True)

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

    # ----------------------------------------------------------------- coalesced: one after the other

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> RingcoreWork:
        """``all_gather_into_tensor`` of each pair (DTensor's ``full_tensor``): collectives run in
        order, so the Work finishes with the last."""
        call = "all_gather_into_tensor_coalesced"
        pairs = self._pairs(
            outputs, inputs, call, lambda out, src: out.numel() == src.numel() * self.comm.size
        )
        handles = [self.comm.allgather_async(_movable(_dense(src, call)[0])) for _, src in pairs]

        def place() -> None:
            for (output, source), handle in zip(pairs, handles, strict=True):
                output.detach().copy_(_to_torch(handle.wait(0), source.dtype).view(output.shape))

        return RingcoreWork(call, outputs).follow(handles[-1], place) if handles else self._finished(call, [])

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> RingcoreWork:
        """``reduce_scatter_tensor`` of each pair, in order; the Work finishes with the last."""
        call = "reduce_scatter_tensor_coalesced"
        op = _reduce_op(opts, call)
        pairs = self._pairs(
            outputs, inputs, call, lambda out, src: src.numel() == out.numel() * self.comm.size
        )
        rows = [_dense(src, call)[0].reshape(self.comm.size, out.numel()) for out, src in pairs]
        handles = [self.comm.reduce_scatter_async(row, op=op) for row in rows]

        def place() -> None:
            for (output, _), row, handle in zip(pairs, rows, handles, strict=True):
                output.detach().copy_(_to_torch(handle.wait(0), row.dtype).view(output.shape))

        return RingcoreWork(call, outputs).follow(handles[-1], place) if handles else self._finished(call, [])

    all_gather_single_coalesced = allgather_into_tensor_coalesced  # the names torch's trampoline calls
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def _pairs(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], call: str, fits: Callable[..., bool]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(output, input)`` pairs, every one checked with ``fits`` before anything is sent."""
        if len(outputs) != len(inputs):
            raise ValueError(f"ringcore backend: {call} got {len(outputs)} outputs for {len(inputs)} inputs")
        pairs = list(zip(outputs, inputs, strict=True))
        for output, source in pairs:
            if output.dtype != source.dtype:
                raise ValueError(
                    f"ringcore backend: {call}: an output of {output.dtype} for an input of {source.dtype}"
                )
            if not fits(output, source):
                raise ValueError(
                    f"ringcore backend: {call}: an output of {output.numel()} elements does not fit an input "
                    f"of {source.numel()} at world size {self.comm.size}"
                )
        return pairs

    # ----------------------------------------------------------------- rooted, built on the above

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> RingcoreWork:
        """``dist.reduce``: an allreduce whose result the root keeps; the others reduce a copy."""
        tensor = _one(tensors, "reduce")
        op = _reduce_op(opts, "reduce")
        root = opts.rootRank if opts is not None else 0
        target = tensor if self.comm.rank == root else tensor.detach().clone()
        return self.allreduce_tensor(target, op, value=[tensor])

    def gather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> RingcoreWork:
        """``dist.gather``: every rank's input into the root's list (an allgather the others drop)."""
        source = _one(input_tensors, "gather")
        root = opts.rootRank if opts is not None else 0
        outputs = _one(output_tensors, "gather") if self.comm.rank == root else []
        if self.comm.rank == root and len(outputs) != self.comm.size:
            raise ValueError(
                f"ringcore backend: gather needs {self.comm.size} output tensors, got {len(outputs)}"
            )
        if any(t.dtype != source.dtype for t in outputs):
            raise ValueError(
                f"ringcore backend: gather's output tensors must be {source.dtype}, as its input"
            )

        def place(gathered: torch.Tensor) -> None:
            sizes = [t.numel() for t in outputs]
            if outputs and gathered.numel() != sum(sizes):
                raise ValueError(
                    f"ringcore backend: gather's output tensors hold {sum(sizes)} elements, "
                    f"the ranks sent {gathered.numel()}"
                )
            for out, piece in zip(outputs, gathered.split(sizes) if outputs else [], strict=True):
                out.detach().copy_(piece.view(out.shape))

        return self._gather(source, "gather", output_tensors, place)

    def scatter(
        self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any = None
    ) -> RingcoreWork:
        """``dist.scatter``: part ``r`` of the root's list into rank ``r``'s output (a broadcast of every part)."""
        output = _one(output_tensors, "scatter")
        _dense(output, "scatter")
        root, size, count = (opts.rootRank if opts is not None else 0), self.comm.size, output.numel()
        if self.comm.rank == root:
            inputs = _one(input_tensors, "scatter")
            if len(inputs) != size or any(t.numel() != count or t.dtype != output.dtype for t in inputs):
                raise ValueError(
                    f"ringcore backend: scatter needs {size} input tensors of {count} {output.dtype} "
                    f"elements each, got {[(t.numel(), t.dtype) for t in inputs]}"
                )
            parts = torch.cat([t.detach().reshape(-1) for t in inputs])
        else:
            parts = torch.empty(size * count, dtype=output.dtype)
        start = self.comm.rank * count

        def place() -> None:
            output.detach().copy_(parts[start : start + count].view(output.shape))

        handle = self.comm.broadcast_async(_movable(parts), root=root)
        return RingcoreWork("scatter", [output]).follow(handle, place)

    # ----------------------------------------------------------------- not implemented

    send = _unsupported("dist.send / isend")
    recv = _unsupported("dist.recv / irecv")
    recv_anysource = _unsupported("dist.recv_anysource (recv without src)")
    alltoall = _unsupported("dist.all_to_all")
    all_to_all_single = _unsupported("dist.all_to_all_single")
    alltoall_base = _unsupported("dist.all_to_all_single (alltoall_base)")
    allgather_coalesced = _unsupported("dist.all_gather_coalesced")

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
