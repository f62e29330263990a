"""Horovod's tensor collectives on ringcore: allreduce, allgather, broadcast, reducescatter, barrier, join.

Data flow. An in-place call (``allreduce_``, ``broadcast_``) hands ringcore a
zero-copy view of the caller's contiguous CPU tensor (see
:mod:`ringcore.torch.tensors`), and ringcore reduces into it as the bytes
arrive. A non-contiguous tensor is reduced in a contiguous copy, copied back
when the call completes. Out-of-place calls (``allreduce``, ``broadcast``)
reduce a fresh contiguous copy and return it; they are differentiable as in
Horovod (the gradient of an allreduce is the same allreduce of the
gradient; of an allgather, this rank's rows of the averaged gradient; of a
broadcast, the averaged gradient on the root and zeros elsewhere).
``allgather`` and ``reducescatter`` return new tensors.

Ops. ``Average`` of floating-point tensors is ringcore's ``avg`` (sum, then
one division by the world size); of integers, a sum floor-divided by the
world size, as Horovod does. ``prescale_factor`` multiplies the input
before the reduction, ``postscale_factor`` the result. ``Compression.fp16``
applies to floating-point tensors; integer tensors travel as they are.

Every call is announced first (:mod:`ringcore.torch.joining`), so ranks inside
``join()`` can take part. ``*_async`` calls return a :class:`Handle`;
``synchronize(handle)`` waits and returns the result, ``poll(handle)`` says
whether it is ready. Do not touch the tensor in between.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

import ringcore
from ringcore.comm import Communicator
from ringcore.ops import Compression as WireCompression
from ringcore.ops import ReduceOp
from ringcore.torch import joining, objects
from ringcore.torch.basics import Average, Compression, Sum, communicator, reduce_op, wire_compression
from ringcore.torch.joining import Call, announce
from ringcore.torch.tensors import check_tensor, check_writable, for_ringcore, from_ringcore, host, is_float


class Handle:
    """The future result of an ``*_async`` call: ``synchronize(handle)`` returns it."""

    def __init__(self, inner: ringcore.Handle, finish: Callable[[Any], torch.Tensor]) -> None:
        self._inner = inner
        self._finish = finish
        self._result: torch.Tensor | None = None

    def poll(self) -> bool:
        """True once the collective is done (successfully or not): ``wait()`` will not block."""
        return self._result is not None or self._inner.done()

    def wait(self) -> torch.Tensor:
        """Block until done; the result tensor, or the collective's error."""
        if self._result is None:
            self._result = self._finish(self._inner.wait())
        return self._result


def synchronize(handle: Handle | GroupHandle) -> Any:
    """Wait for an ``*_async`` call; its result tensor, or list of them (raises the collective's error)."""
    return handle.wait()


def poll(handle: Handle | GroupHandle) -> bool:
    """Whether an ``*_async`` call is done."""
    return handle.poll()


# ------------------------------------------------------------------ allreduce


@dataclasses.dataclass
class _Reduction:
    """An allreduce made ready: what ringcore reduces, and what to do once it has."""

    target: torch.Tensor  # contiguous: ringcore reduces it in place
    call: Call
    result: torch.Tensor  # what the caller gets (``target``, or the non-contiguous original)
    divisor: int = 1  # Average of integers: floor division by the world size
    postscale: float = 1.0

    def start(self, comm: Communicator, name: str | None, blocking: bool) -> Any:
        announce(comm, self.call, blocking)
        issue = comm.allreduce if blocking else comm.allreduce_async
        return issue(for_ringcore(self.target), op=self.call.op, compression=self.call.compression, name=name)

    def finish(self, _: Any = None) -> torch.Tensor:
        with torch.no_grad():
            if self.divisor != 1:
                self.target.div_(self.divisor, rounding_mode="floor")
            if self.postscale != 1.0:
                self.target.mul_(self.postscale)
            if self.result is not self.target:
                self.result.copy_(self.target)
        return self.result


def _reduction(
    tensor: Any,
    op: ReduceOp,
    compression: Any,
    prescale_factor: float,
    postscale_factor: float,
    in_place: bool,
    what: str,
) -> _Reduction:
    tensor = check_tensor(tensor, what)
    if in_place:
        check_writable(tensor, what)
    floating = is_float(tensor)
    if not floating and (prescale_factor != 1.0 or postscale_factor != 1.0):
        raise ValueError(f"{what}: prescale_factor and postscale_factor need a floating-point tensor")
    if not in_place:
        target = tensor.detach().clone(memory_format=torch.contiguous_format)
    else:
        target = tensor if tensor.is_contiguous() else tensor.detach().contiguous()
    comp = wire_compression(compression) if floating else WireCompression.NONE
    divisor = 1
    if op is Average and not floating:
        op, divisor = Sum, communicator().size
    if prescale_factor != 1.0:
        with torch.no_grad():
            target.mul_(prescale_factor)
    call = Call("allreduce", tensor.dtype, tuple(tensor.shape), op, comp)
    result = tensor if in_place else target
    return _Reduction(target, call, result, divisor, float(postscale_factor))


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    compression: Any = Compression.none,
) -> Handle:
    """Start reducing ``tensor`` over all ranks, in place; ``synchronize(handle)`` returns ``tensor``."""
    comm = communicator()
    red = _reduction(
        tensor, reduce_op(op, average), compression, prescale_factor, postscale_factor, True, "allreduce_"
    )
    return Handle(red.start(comm, name, blocking=False), red.finish)


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    compression: Any = Compression.none,
) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks, in place (default op: ``Average``); returns ``tensor``.

    Raises:
        TypeError, ValueError: not a tensor, an unsupported dtype, a leaf that requires grad
            (outside ``torch.no_grad()``), scale factors on an integer tensor.
        NotImplementedError: ``op=Adasum``.
        ringcore.MismatchError, PeerFailure, CollectiveTimeout: see ``ringcore.errors``.
    """
    comm = communicator()
    red = _reduction(
        tensor, reduce_op(op, average), compression, prescale_factor, postscale_factor, True, "allreduce_"
    )
    return red.finish(red.start(comm, name, blocking=True))


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    compression: Any = Compression.none,
) -> Handle:
    """Start an out-of-place allreduce; ``synchronize(handle)`` returns a new tensor."""
    comm = communicator()
    red = _reduction(
        tensor, reduce_op(op, average), compression, prescale_factor, postscale_factor, False, "allreduce"
    )
    return Handle(red.start(comm, name, blocking=False), red.finish)


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: Any = Compression.none,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """A new tensor: ``tensor`` reduced over all ranks (default op: ``Average``); differentiable."""
    reduce = reduce_op(op, average)
    return _AllreduceFunction.apply(tensor, reduce, name, compression, prescale_factor, postscale_factor)


class _AllreduceFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, op: ReduceOp, name: Any, comp: Any, pre: float, post: float):
        ctx.args = (op, name, comp, pre, post)
        red = _reduction(tensor, op, comp, pre, post, False, "allreduce")
        return red.finish(red.start(communicator(), name, blocking=True))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        op, name, comp, pre, post = ctx.args
        if op not in (Sum, Average):
            raise RuntimeError(f"allreduce with op {op.value!r} is not differentiable; use Sum or Average")
        reduced = _AllreduceFunction.apply(grad.contiguous(), op, name, comp, pre, post)
        return reduced, None, None, None, None, None


# ------------------------------------------------------------------ grouped allreduce


class GroupHandle:
    """The future results of a ``grouped_allreduce_async*`` call: ``synchronize(handle)`` returns the list."""

    def __init__(self, handles: list[Handle]) -> None:
        self._handles = handles

    def poll(self) -> bool:
        return all(handle.poll() for handle in self._handles)

    def wait(self) -> list[torch.Tensor]:
        return [handle.wait() for handle in self._handles]


def _grouped(tensors: Any, what: str, in_place: bool, scaled: bool) -> list[Any]:
    """The group as a list, every tensor checked before any is reduced (as Horovod checks a group)."""
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{what} takes a list of tensors, got {type(tensors).__name__}")
    for tensor in tensors:
        check_tensor(tensor, what)
        if in_place:
            check_writable(tensor, what)
        if scaled and not is_float(tensor):
            raise ValueError(f"{what}: prescale_factor and postscale_factor need floating-point tensors")
    return list(tensors)


def _member(name: str | None, index: int) -> str | None:
    return None if name is None else f"{name}.{index}"


def grouped_allreduce_async_(
    tensors: list[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    compression: Any = Compression.none,
) -> GroupHandle:
    """Start reducing every tensor of the list in place, one collective each, issued together in
    order (ringcore runs them back to back); ``synchronize(handle)`` returns the list."""
    scales = (prescale_factor, postscale_factor)
    return _start_group(allreduce_async_, True, tensors, average, name, op, scales, compression)


def grouped_allreduce_(
    tensors: list[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    compression: Any = Compression.none,
) -> list[torch.Tensor]:
    """Reduce every tensor of the list in place (Horovod's grouped allreduce); returns the list."""
    handle = grouped_allreduce_async_(
        tensors, average, name, op, prescale_factor, postscale_factor, compression
    )
    return handle.wait()


def grouped_allreduce_async(
    tensors: list[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    compression: Any = Compression.none,
) -> GroupHandle:
    """Start an out-of-place allreduce of every tensor of the list; ``synchronize`` returns new tensors."""
    scales = (prescale_factor, postscale_factor)
    return _start_group(allreduce_async, False, tensors, average, name, op, scales, compression)


def _start_group(
    start: Callable[..., Handle],
    in_place: bool,
    tensors: Any,
    average: bool | None,
    name: str | None,
    op: Any,
    scales: tuple[float, float],
    compression: Any,
) -> GroupHandle:
    """``start`` (``allreduce_async`` or ``allreduce_async_``) on every tensor of the checked group, in order."""
    what = "grouped_allreduce_async_" if in_place else "grouped_allreduce_async"
    group = _grouped(tensors, what, in_place, scales != (1.0, 1.0))
    return GroupHandle(
        [start(t, average, _member(name, i), op, *scales, compression) for i, t in enumerate(group)]
    )


def grouped_allreduce(
    tensors: list[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    compression: Any = Compression.none,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[torch.Tensor]:
    """New tensors: every tensor of the list reduced over all ranks; differentiable, as ``allreduce``."""
    group = _grouped(tensors, "grouped_allreduce", False, prescale_factor != 1.0 or postscale_factor != 1.0)
    return [
        allreduce(t, average, _member(name, i), compression, op, prescale_factor, postscale_factor)
        for i, t in enumerate(group)
    ]


# ------------------------------------------------------------------ allgather


def _allgather_start(
    tensor: Any, name: str | None, blocking: bool
) -> tuple[Any, Callable[[Any], torch.Tensor]]:
    tensor = check_tensor(tensor, "allgather")
    if tensor.dim() == 0:
        raise ValueError("allgather needs a tensor with at least one dimension, got a 0-d tensor")
    comm = communicator()
    source = host(tensor)
    announce(comm, Call("allgather", tensor.dtype, (0, *tensor.shape[1:])), blocking)
    issue = comm.allgather if blocking else comm.allgather_async
    return issue(for_ringcore(source), name=name), lambda out: from_ringcore(out, tensor)


def allgather_async(tensor: torch.Tensor, name: str | None = None) -> Handle:
    """Start an allgather; ``synchronize(handle)`` returns every rank's rows, concatenated."""
    return Handle(*_allgather_start(tensor, name, blocking=False))


def allgather(tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated on dimension 0 (first dimensions may differ); differentiable."""
    return _AllgatherFunction.apply(tensor, name)


class _AllgatherFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: Any):
        ctx.rows, ctx.name = tensor.shape[0] if tensor.dim() else 0, name
        raw, finish = _allgather_start(tensor, name, blocking=True)
        return finish(raw)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        reduced = allreduce(grad.contiguous(), op=Average, name=ctx.name)
        rows = allgather(torch.tensor([ctx.rows], dtype=torch.int64), name=ctx.name)
        offset = int(rows[: communicator().rank].sum())
        return reduced.narrow(0, offset, ctx.rows), None


# ------------------------------------------------------------------ broadcast


def _broadcast_start(tensor: Any, root_rank: int, name: str | None, in_place: bool, blocking: bool):
    tensor = check_tensor(tensor, "broadcast_" if in_place else "broadcast")
    comm = communicator()
    if in_place:
        check_writable(tensor, "broadcast_")
        target = tensor if tensor.is_contiguous() else tensor.detach().contiguous()
    else:
        target = tensor.detach().clone(memory_format=torch.contiguous_format)
    result = tensor if in_place else target
    announce(comm, Call("broadcast", tensor.dtype, tuple(tensor.shape), ident=int(root_rank)), blocking)
    issue = comm.broadcast if blocking else comm.broadcast_async

    def finish(_: Any) -> torch.Tensor:
        if result is not target:
            with torch.no_grad():
                result.copy_(target)
        return result

    return issue(for_ringcore(target), root=root_rank, name=name), finish


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> Handle:
    """Start copying ``root_rank``'s ``tensor`` into every rank's, in place."""
    return Handle(*_broadcast_start(tensor, root_rank, name, in_place=True, blocking=False))


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    """Copy ``root_rank``'s ``tensor`` into every rank's ``tensor``, in place; returns it."""
    raw, finish = _broadcast_start(tensor, root_rank, name, in_place=True, blocking=True)
    return finish(raw)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> Handle:
    """Start an out-of-place broadcast; ``synchronize(handle)`` returns a new tensor."""
    return Handle(*_broadcast_start(tensor, root_rank, name, in_place=False, blocking=False))


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    """A new tensor holding ``root_rank``'s ``tensor``; differentiable."""
    return _BroadcastFunction.apply(tensor, root_rank, name)


class _BroadcastFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: Any):
        ctx.root, ctx.name = root_rank, name
        raw, finish = _broadcast_start(tensor, root_rank, name, in_place=False, blocking=True)
        return finish(raw)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        reduced = allreduce(grad.contiguous(), op=Average, name=ctx.name)
        if communicator().rank != ctx.root:
            reduced = reduced * 0
        return reduced, None, None


# ------------------------------------------------------------------ reducescatter


def _reducescatter_start(
    tensor: Any, op: ReduceOp, compression: Any, pre: float, post: float, name: str | None, blocking: bool
):
    tensor = check_tensor(tensor, "reducescatter")
    if tensor.dim() == 0:
        raise ValueError("reducescatter needs a tensor with at least one dimension, got a 0-d tensor")
    floating = is_float(tensor)
    if not floating and (pre != 1.0 or post != 1.0):
        raise ValueError("reducescatter: prescale_factor and postscale_factor need a floating-point tensor")
    comm = communicator()
    source = host(tensor) if pre == 1.0 else host(tensor) * pre
    comp = wire_compression(compression) if floating else WireCompression.NONE
    divisor = 1
    if op is Average and not floating:
        op, divisor = Sum, comm.size
    announce(comm, Call("reduce_scatter", tensor.dtype, tuple(tensor.shape), op, comp), blocking)
    issue = comm.reduce_scatter if blocking else comm.reduce_scatter_async

    def finish(out: Any) -> torch.Tensor:
        result = from_ringcore(out, tensor)
        if divisor != 1:
            result.div_(divisor, rounding_mode="floor")
        return result if post == 1.0 else result.mul_(post)

    return issue(for_ringcore(source), op=op, compression=comp, name=name), finish


def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: Any = Compression.none,
    op: Any = Average,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Handle:
    """Start a reducescatter; ``synchronize(handle)`` returns this rank's rows of the result."""
    reduce = reduce_op(op)
    return Handle(
        *_reducescatter_start(tensor, reduce, compression, prescale_factor, postscale_factor, name, False)
    )


def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: Any = Compression.none,
    op: Any = Average,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """This rank's rows (the first ``rows % size`` ranks get one more) of ``tensor`` reduced over ranks.

    Differentiable: the gradient is the allgather of the ranks' gradients (divided by the
    world size for ``Average``).
    """
    reduce = reduce_op(op)
    return _ReducescatterFunction.apply(tensor, reduce, name, compression, prescale_factor, postscale_factor)


class _ReducescatterFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, op: ReduceOp, name: Any, comp: Any, pre: float, post: float):
        ctx.op, ctx.name, ctx.scale = op, name, pre * post
        raw, finish = _reducescatter_start(tensor, op, comp, pre, post, name, True)
        return finish(raw)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        if ctx.op not in (Sum, Average):
            raise RuntimeError(f"reducescatter with op {ctx.op.value!r} is not differentiable")
        gathered = allgather(grad.contiguous(), name=ctx.name)
        scale = ctx.scale / (communicator().size if ctx.op is Average else 1)
        return gathered * scale if scale != 1.0 else gathered, None, None, None, None, None


# ------------------------------------------------------------------ the rest


def barrier() -> None:
    """Return once every rank has entered the barrier."""
    comm = communicator()
    announce(comm, Call("barrier"))
    comm.barrier()


def join(device: int = -1) -> int:
    """This rank is out of data: serve the others' collectives with zeros until all have joined.

    Returns the rank that joined last (the same on every rank). ``device`` is
    accepted for Horovod's signature and ignored. See :mod:`ringcore.torch.joining`.
    """
    return joining.join(communicator())


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None) -> Any:
    """``root_rank``'s ``obj`` (any picklable object) on every rank."""
    comm = communicator()
    announce(comm, Call("objects", ident=int(root_rank)))
    return objects.broadcast_object(comm, obj, root_rank, name=name)


def allgather_object(obj: Any, name: str | None = None) -> list[Any]:
    """Every rank's ``obj`` (any picklable object), in rank order."""
    comm = communicator()
    announce(comm, Call("objects", ident=-1))
    return objects.allgather_object(comm, obj, name=name)
