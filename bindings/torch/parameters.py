"""Start every rank from the root's model and optimizer: ``broadcast_parameters``, ``broadcast_optimizer_state``.

``broadcast_parameters`` checks that every rank has the same tensors (names,
shapes, dtypes: ``MismatchError`` naming the first that differs), then packs
them per dtype into one flat buffer and broadcasts each buffer once: a
ResNet's 120 tensors travel as one or two broadcasts, not 120. The root's
tensors are copied into the buffer, the others' filled from it in place
(``model.state_dict()`` holds the module's own memory, so the model changes).

``broadcast_optimizer_state`` sends the root's ``optimizer.state_dict()``:
its structure (hyper-parameters, scalars, which state exists) as one pickled
object, its tensors through ``broadcast_parameters``; every other rank then
loads it. State the optimizer creates lazily (momentum buffers, Adam's
moments before the first step) arrives on ranks that do not have it yet, so
nothing steps with zero gradients to make it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch

from ringcore.torch.basics import communicator
from ringcore.torch.collectives import broadcast_, broadcast_object
from ringcore.torch.objects import check_same_layout
from ringcore.torch.tensors import check_tensor


def broadcast_parameters(params: Any, root_rank: int = 0) -> None:
    """Overwrite every rank's tensors with ``root_rank``'s, in place.

    Args:
        params: a ``state_dict()`` (taken in sorted key order, as Horovod does) or
            ``(name, tensor)`` pairs such as ``model.named_parameters()``.
        root_rank: whose values everyone ends with.

    Raises:
        TypeError: ``params`` is not a mapping or pairs of names and tensors.
        ringcore.MismatchError: the ranks' tensors differ (names, shapes or dtypes).
    """
    named = _pairs(params)
    comm = communicator()
    check_same_layout(comm, [(n, tuple(t.shape), str(t.dtype)) for n, t in named], "broadcast_parameters")
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for _, tensor in named:
        groups.setdefault((tensor.dtype, tensor.device), []).append(tensor.detach())
    for (dtype, device), tensors in groups.items():
        if comm.rank == root_rank:
            flat = torch.cat([t.reshape(-1) for t in tensors])
        else:
            flat = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=device)
        broadcast_(flat, root_rank, name=f"broadcast_parameters ({dtype})")
        if comm.rank != root_rank:
            _unpack(flat, tensors)


def _pairs(params: Any) -> list[tuple[str, torch.Tensor]]:
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, Iterable):
        items = list(params)
        if any(not isinstance(item, tuple) or len(item) != 2 for item in items):
            raise TypeError("broadcast_parameters takes a state_dict or (name, tensor) pairs")
    else:
        raise TypeError(
            f"broadcast_parameters takes a state_dict or (name, tensor) pairs, got {type(params).__name__}"
        )
    return [
        (str(name), check_tensor(t, f"broadcast_parameters: {name!r}")) for name, t in items if t is not None
    ]


@torch.no_grad()
def _unpack(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for tensor in tensors:
        tensor.copy_(flat[offset : offset + tensor.numel()].view(tensor.shape))
        offset += tensor.numel()


@dataclasses.dataclass(frozen=True)
class _Slot:
    """Where a state tensor was, in the pickled structure: its index, shape and dtype."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Give every rank ``root_rank``'s optimizer state and hyper-parameters (learning rates...).

    Raises:
        TypeError: not a ``torch.optim.Optimizer``.
        ringcore.MismatchError: the ranks' optimizers hold different parameters.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"broadcast_optimizer_state takes an optimizer, got {type(optimizer).__name__}")
    comm = communicator()
    tensors: list[torch.Tensor] = []
    structure = _hollow(optimizer.state_dict(), tensors) if comm.rank == root_rank else None
    structure = broadcast_object(structure, root_rank, name="broadcast_optimizer_state")
    if comm.rank != root_rank:
        slots = _slots(structure)
        tensors = [torch.empty(s.shape, dtype=s.dtype) for s in sorted(slots, key=lambda s: s.index)]
    broadcast_parameters([(f"state.{i}", t) for i, t in enumerate(tensors)], root_rank)
    if comm.rank != root_rank:
        optimizer.load_state_dict(_fill(structure, tensors))


def _hollow(value: Any, tensors: list[torch.Tensor]) -> Any:
    """``value`` with every tensor replaced by a :class:`_Slot` (the tensors appended to ``tensors``)."""
    if isinstance(value, torch.Tensor):
        tensors.append(value.detach().cpu().contiguous())
        return _Slot(len(tensors) - 1, tuple(value.shape), value.dtype)
    if isinstance(value, dict):
        return {key: _hollow(item, tensors) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_hollow(item, tensors) for item in value)
    return value


def _slots(value: Any) -> list[_Slot]:
    if isinstance(value, _Slot):
        return [value]
    if isinstance(value, dict):
        return [slot for item in value.values() for slot in _slots(item)]
    if isinstance(value, (list, tuple)):
        return [slot for item in value for slot in _slots(item)]
    return []


def _fill(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, _Slot):
        return tensors[value.index]
    if isinstance(value, dict):
        return {key: _fill(item, tensors) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_fill(item, tensors) for item in value)
    return value
