"""``DistributedOptimizer``: gradients averaged over ranks while backward runs, then the wrapped step.

Wrapping. ``DistributedOptimizer(opt)`` returns an object of a subclass of
``type(opt)`` made on the fly (as Horovod does) that shares ``opt``'s state,
param groups, defaults and hooks: ``isinstance``, ``state_dict()``,
``load_state_dict()`` and LR schedulers created on the result work as with
``opt``. Use the result, not ``opt``, from then on.

Data flow. Each parameter gets a post-accumulate-grad hook. On the last of
``backward_passes_per_step`` backward passes, the hook copies the gradient
into its slot of its bucket's flat buffer (:mod:`ringcore.torch.fusion`; a
bucket of one contiguous gradient is reduced in place, no copy); when a
bucket is complete and every bucket before it has gone, it is handed to
ringcore's async thread (``allreduce_async``), so communication overlaps the
rest of backward. ``step()`` (or ``synchronize()``) sends what is left
(gradients that did not arrive: unused parameters, zeros if they have none),
waits for every bucket, scales, copies the results back into ``p.grad`` and
then runs the wrapped optimizer's step. The first bucket of a step is
preceded by one announcement for ranks in ``join()``
(:mod:`ringcore.torch.joining`).

Buffers. The CPU buckets of several gradients above ``RINGCORE_SMALL_BYTES``
(bfloat16 aside, without fp16 compression or ``RINGCORE_ATOMIC=1``) get their
flat buffers when the optimizer is made, in symmetric memory
(``ringcore.empty``, a collective, so it happens right after the layout
check, which covers what decides the buckets, in the same order on every
rank): in a job on one host their allreduces then read the peers' buffers
directly (the direct allreduce, :mod:`ringcore.algo.direct`) instead of
moving frames. Elsewhere they are ordinary memory, made at first use. A lone
gradient is reduced where it lies.

Averaging is ringcore's ``avg`` (sum, then one division by the world size);
with ``gradient_predivide_factor=f`` gradients are multiplied by ``1/f``
before the sum and by ``f/size`` after, as in Horovod. ``Compression.fp16``
is ringcore's wire compression: float16 on the wire, accumulation in the
gradient's dtype, bit-identical ranks.

Checks. Making the optimizer compares every rank's parameters (names,
shapes, dtypes) and fusion threshold with one small allgather; ranks whose
models differ get ``MismatchError`` naming the first parameter that differs.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from ringcore.comm import Communicator, Handle
from ringcore.ops import Compression as WireCompression
from ringcore.ops import ReduceOp
from ringcore.torch import joining
from ringcore.torch.basics import Average, Compression, Sum, communicator, reduce_op, wire_compression
from ringcore.torch.fusion import Bucket, plan_buckets
from ringcore.torch.objects import check_same_layout
from ringcore.torch.tensors import check_tensor, for_ringcore


class _Flight:
    """One bucket's allreduce in flight: what ringcore reduces, and whether that is ``p.grad`` itself."""

    def __init__(self, bucket: Bucket, target: torch.Tensor, handle: Handle, in_place: bool) -> None:
        self.bucket, self.target, self.handle, self.in_place = bucket, target, handle, in_place


class _DistributedOptimizer:
    """The methods the wrapped optimizer gains; see the module docstring."""

    def _setup_distributed(
        self,
        named_parameters: Any,
        compression: Any,
        backward_passes_per_step: int,
        op: Any,
        gradient_predivide_factor: float,
        groups: Any,
        sparse_as_dense: bool,
    ) -> None:
        comm = communicator()
        op = reduce_op(op)
        if op not in (Average, Sum):
            raise ValueError(f"DistributedOptimizer reduces gradients with Average or Sum, not {op.value!r}")
        if gradient_predivide_factor != 1.0 and op is not Average:
            raise ValueError("gradient_predivide_factor needs op=Average")
        if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int):
            raise TypeError("backward_passes_per_step must be an int")
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be at least 1, got {backward_passes_per_step}")
        named = _named_parameters(self, named_parameters)  # type: ignore[arg-type]
        threshold = comm.settings.fusion_threshold
        self._compression = wire_compression(compression)
        self._buckets = plan_buckets(named, threshold, groups)
        layout = [(name, tuple(p.shape), f"{p.dtype} on {p.device.type}") for name, p in named]
        buckets = tuple(len(b.params) for b in self._buckets)
        self._layout = [
            *layout,
            ("RINGCORE_FUSION_THRESHOLD", (threshold,), ""),
            ("buckets (groups)", buckets, ""),
            ("compression", (), self._compression.value),
        ]
        check_same_layout(comm, self._layout, "DistributedOptimizer")
        self._comm: Communicator = comm
        self._passes_per_step = backward_passes_per_step
        self._predivide = float(gradient_predivide_factor)
        self._wire_op = ReduceOp.SUM if op is Sum or self._predivide != 1.0 else ReduceOp.AVG
        self._postscale = self._predivide / comm.size if self._predivide != 1.0 else 1.0
        self._sparse_as_dense = sparse_as_dense
        self._bucket_of = {id(p): (b, i) for b in self._buckets for i, p in enumerate(b.params)}
        self._buffers = _symmetric_buffers(comm, self._buckets, self._compression)
        self._passes = {id(p): 0 for _, p in named}
        self._filled: list[set[int]] = [set() for _ in self._buckets]
        self._flights: list[_Flight] = []
        self._should_synchronize = True
        self._synchronized = False
        self._ident = joining.register_stepper(comm, self)
        self._hooks = [p.register_post_accumulate_grad_hook(_hook(self)) for _, p in named]

    def rebind(self) -> None:
        """Follow a new default communicator (``ringcore.torch.elastic``: each new world of an elastic job).

        Checks the layout on it as making the optimizer does, so ranks that rebind and a rank
        that has just made its optimizer issue the same collective, and forgets what was in
        flight on the old one.
        """
        comm = communicator()
        check_same_layout(comm, self._layout, "DistributedOptimizer")
        self._comm = comm
        self._buffers = _symmetric_buffers(comm, self._buckets, self._compression)
        self._postscale = self._predivide / comm.size if self._predivide != 1.0 else 1.0
        self._ident = joining.register_stepper(comm, self)
        self._flights, self._filled = [], [set() for _ in self._buckets]
        self._passes = dict.fromkeys(self._passes, 0)
        self._synchronized = False

    # ------------------------------------------------------------ while backward runs

    def _gradient_ready(self, param: torch.Tensor) -> None:
        key = id(param)
        passes = self._passes[key] + 1
        if passes > self._passes_per_step:
            raise RuntimeError(
                f"backward ran {passes} times before optimizer.step(), but DistributedOptimizer was told "
                f"backward_passes_per_step={self._passes_per_step}; call step() (or synchronize()) after "
                "that many passes, or raise backward_passes_per_step to accumulate more locally"
            )
        self._passes[key] = passes
        if passes == self._passes_per_step:
            bucket, slot = self._bucket_of[key]
            self._fill(bucket, slot, param)
            self._launch_ready()

    def _fill(self, bucket: Bucket, slot: int, param: torch.Tensor) -> None:
        if len(bucket.params) > 1:
            grad = self._gradient(param)
            view = self._buffer(bucket)[bucket.offsets[slot] : bucket.offsets[slot] + param.numel()]
            view.view(grad.shape).copy_(grad)
        self._filled[bucket.index].add(slot)

    def _gradient(self, param: torch.Tensor) -> torch.Tensor:
        grad = param.grad
        if grad is None:
            grad = param.grad = torch.zeros_like(param)
        if grad.is_sparse:
            if not self._sparse_as_dense:
                raise ValueError(
                    "DistributedOptimizer: a parameter has a sparse gradient; pass sparse_as_dense=True "
                    "(ringcore reduces dense tensors)"
                )
            grad = param.grad = grad.to_dense()
        return grad

    def _buffer(self, bucket: Bucket) -> torch.Tensor:
        buffer = self._buffers.get(bucket.index)
        if buffer is None:
            buffer = self._buffers[bucket.index] = torch.empty(
                bucket.numel, dtype=bucket.dtype, device=bucket.device
            )
        return buffer

    def _launch_ready(self) -> None:
        while len(self._flights) < len(self._buckets):
            bucket = self._buckets[len(self._flights)]
            if len(self._filled[bucket.index]) < len(bucket.params):
                return
            self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        if not self._flights:
            joining.announce(self._comm, joining.Call("step", ident=self._ident), blocking=False)
        target, in_place = self._target(bucket)
        if self._predivide != 1.0:
            target.mul_(1.0 / self._predivide)
        comp = self._compression if bucket.dtype.is_floating_point else WireCompression.NONE
        handle = self._comm.allreduce_async(
            for_ringcore(target), op=self._wire_op, compression=comp, name=bucket.name
        )
        self._flights.append(_Flight(bucket, target, handle, in_place))

    def _target(self, bucket: Bucket) -> tuple[torch.Tensor, bool]:
        """The flat tensor ringcore reduces (the bucket's buffer, or a lone contiguous gradient itself)."""
        if len(bucket.params) == 1:
            grad = self._gradient(bucket.params[0])
            if grad.is_contiguous() and grad.dtype == bucket.dtype:
                return grad.view(-1), True
            self._buffer(bucket).view(grad.shape).copy_(grad)
        return self._buffer(bucket), False

    # ------------------------------------------------------------ step

    @torch.no_grad()
    def synchronize(self) -> None:
        """Finish averaging every gradient (sending those that did not arrive); ``p.grad`` then holds it."""
        for bucket in self._buckets[len(self._flights) :]:
            for slot, param in enumerate(bucket.params):
                if slot not in self._filled[bucket.index]:
                    self._fill(bucket, slot, param)
        self._launch_ready()
        flights, self._flights = self._flights, []
        self._filled = [set() for _ in self._buckets]
        self._passes = dict.fromkeys(self._passes, 0)
        for flight in flights:
            flight.handle.wait()
            self._unpack(flight)
        self._synchronized = True

    def _unpack(self, flight: _Flight) -> None:
        if self._postscale != 1.0:
            flight.target.mul_(self._postscale)
        if flight.in_place:
            return
        bucket = flight.bucket
        for param, offset in zip(bucket.params, bucket.offsets, strict=True):
            if param.grad is not None:
                param.grad.copy_(flight.target[offset : offset + param.numel()].view(param.grad.shape))

    def replay_with_zeros(self, comm: Communicator) -> None:
        """A step's allreduces as a rank inside ``join()`` makes them: zeros, same buckets, same order."""
        for bucket in self._buckets:
            comp = self._compression if bucket.dtype.is_floating_point else WireCompression.NONE
            zeros = self._buffers.get(bucket.index)  # the same memory as the peers' (symmetric or not)
            if zeros is None:
                zeros = torch.zeros(bucket.numel, dtype=bucket.dtype, device=bucket.device)
            else:
                zeros.zero_()
            comm.allreduce(for_ringcore(zeros), op=self._wire_op, compression=comp, name="join")

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Within it, ``step()`` does not synchronize: for ``synchronize(); clip; step()``."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        """Average the gradients over ranks (unless in ``skip_synchronize()``), then step."""
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(
                    "optimizer.step() after optimizer.synchronize() without the skip_synchronize() "
                    "context: the gradients are already averaged, so step() does not average them again",
                    stacklevel=2,
                )
            else:
                self.synchronize()
        self._synchronized = False
        return super().step(closure)  # type: ignore[misc]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped ``zero_grad``; an error while gradients of a step are still being averaged."""
        if self._flights or any(self._passes.values()):
            raise RuntimeError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                "optimizer.synchronize(): gradients are still being averaged across ranks; call "
                "zero_grad() before backward, or after step()"
            )
        super().zero_grad(set_to_none)  # type: ignore[misc]


def _symmetric_buffers(
    comm: Communicator, buckets: list[Bucket], compression: WireCompression
) -> dict[int, torch.Tensor]:
    """Flat buffers in symmetric memory for the buckets whose allreduce can go direct (module docstring).

    CPU buckets of several gradients, above ``RINGCORE_SMALL_BYTES``, not
    bfloat16, with no fp16 on the wire, ``RINGCORE_ATOMIC=0`` and
    ``RINGCORE_DIRECT_BYTES`` not 0: the same buckets on every rank (the layout
    check covers what decides them).
    """
    buffers: dict[int, torch.Tensor] = {}
    if comm.settings.atomic or not comm.settings.direct_from(comm.size):
        return buffers
    for bucket in buckets:
        if len(bucket.params) < 2 or bucket.device.type != "cpu" or bucket.dtype is torch.bfloat16:
            continue
        dtype = torch.empty(0, dtype=bucket.dtype).numpy().dtype
        compressed = compression is not WireCompression.NONE and bucket.dtype.is_floating_point
        if compressed or bucket.numel * dtype.itemsize <= comm.settings.small_bytes:
            continue
        buffers[bucket.index] = torch.from_numpy(comm.empty(bucket.numel, dtype))
    return buffers


def _hook(optimizer: _DistributedOptimizer) -> Any:
    ref = weakref.ref(optimizer)  # the hook must not keep the optimizer alive

    def hook(param: torch.Tensor) -> None:
        if (opt := ref()) is not None:
            opt._gradient_ready(param)

    return hook


def _named_parameters(optimizer: torch.optim.Optimizer, named_parameters: Any) -> list[tuple[str, Any]]:
    """``(name, parameter)`` for every parameter the optimizer updates that requires grad."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is None:
        named = [(f"allreduce.noname.{i}", p) for i, p in enumerate(params)]
    else:
        named = list(named_parameters)
        if any(not isinstance(item, tuple) or len(item) != 2 for item in named):
            raise ValueError(
                "named_parameters must be (name, parameter) pairs, e.g. model.named_parameters()"
            )
        names = [name for name, _ in named]
        if len(set(names)) != len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"named_parameters has duplicate names: {twice}")
        known = {id(p) for _, p in named}
        missing = [i for i, p in enumerate(params) if id(p) not in known]
        if missing:
            raise ValueError(
                f"named_parameters was given, but {len(missing)} parameter(s) of the optimizer are not in it "
                "(pass model.named_parameters() of the whole model)"
            )
        updated = {id(p) for p in params}
        named = [(name, p) for name, p in named if id(p) in updated]
    for name, param in named:
        check_tensor(param, f"parameter {name!r}")
    return [(name, p) for name, p in named if p.requires_grad]


def DistributedOptimizer(  # Horovod's name: it makes an optimizer, like a class
    optimizer: torch.optim.Optimizer,
    named_parameters: Any = None,
    compression: Any = Compression.none,
    backward_passes_per_step: int = 1,
    op: Any = Average,
    gradient_predivide_factor: float = 1.0,
    groups: Any = None,
    sparse_as_dense: bool = False,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` first averages gradients over all ranks.

    Args:
        optimizer: any ``torch.optim.Optimizer``; use the returned object from now on.
        named_parameters: ``model.named_parameters()``, for names in errors and the timeline.
        compression: ``Compression.none`` or ``Compression.fp16`` (float16 on the wire).
        backward_passes_per_step: backward passes accumulated locally before each allreduce.
        op: ``Average`` (default) or ``Sum``; ``Adasum`` raises ``NotImplementedError``.
        gradient_predivide_factor: with ``Average``, scale by ``1/f`` before the sum, ``f/size`` after.
        groups: Horovod's explicit fusion groups (see :mod:`ringcore.torch.fusion`).
        sparse_as_dense: reduce sparse gradients as dense tensors (else they are an error).

    Raises:
        ringcore.MismatchError: the ranks' models (or ``RINGCORE_FUSION_THRESHOLD``) differ.
        ValueError, TypeError: bad arguments.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
    base = type(optimizer)
    cls = type(base.__name__, (_DistributedOptimizer, base), {"__module__": base.__module__})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)  # the same param groups, state, defaults and hooks
    wrapped._setup_distributed(
        named_parameters,
        compression,
        backward_passes_per_step,
        op,
        gradient_predivide_factor,
        groups,
        sparse_as_dense,
    )
    return wrapped
