"""Tensor fusion: which gradients travel together, decided once, the same way on every rank.

Small gradients cost an allreduce each mostly in per-call overhead, so
``DistributedOptimizer`` packs them into flat *buckets* of at most
``RINGCORE_FUSION_THRESHOLD`` bytes. There is no negotiation round trip
(Horovod's coordinator has one every cycle): like DDP, buckets are fixed when
the optimizer is made, from the parameters in **reverse registration order**
(roughly the order backward produces their gradients), one dtype and device
per bucket, a new bucket whenever the next gradient would overflow the
threshold; a gradient larger than the threshold travels alone. Every rank
computes the same buckets from the same model (checked when the optimizer is
made), and they are launched strictly in bucket order, each as soon as all
its gradients are ready and every bucket before it has gone, so the ranks
issue the same allreduces in the same order while backward is still running.

A threshold of 0 gives every gradient a bucket of its own. ``groups`` (Horovod's
argument) replaces the size rule: an int splits each dtype's parameters into
that many buckets of about equal count, a list of parameter lists makes each
list a bucket.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch


@dataclasses.dataclass
class Bucket:
    """Gradients reduced by one allreduce: ``params[i]`` sits at ``offsets[i]`` of a flat buffer."""

    index: int
    params: list[torch.Tensor]
    names: list[str]
    offsets: list[int]
    numel: int
    dtype: torch.dtype
    device: torch.device

    @property
    def name(self) -> str:
        """How the timeline and stall warnings name the bucket."""
        if len(self.names) == 1:
            return self.names[0]
        return f"{self.names[0]} .. {self.names[-1]} ({len(self.names)} tensors)"


def plan_buckets(
    named: Sequence[tuple[str, torch.Tensor]], threshold: int, groups: Any = None
) -> list[Bucket]:
    """The buckets for ``named`` (registration order) under ``threshold`` bytes, or Horovod's ``groups``.

    Raises:
        ValueError: ``groups`` is neither None, a positive int nor a list of parameter lists,
            or names a parameter twice or one that is not in ``named``.
    """
    ordered = list(reversed(named))
    if groups is None:
        members = _by_size(ordered, threshold)
    elif isinstance(groups, int) and not isinstance(groups, bool) and groups > 0:
        members = _by_count(ordered, groups)
    elif isinstance(groups, (list, tuple)):
        members = _by_lists(ordered, groups)
    else:
        raise ValueError(f"groups must be None, a positive int or a list of parameter lists, got {groups!r}")
    buckets = []
    for index, group in enumerate(members):
        offsets, numel = [], 0
        for _, param in group:
            offsets.append(numel)
            numel += param.numel()
        first = group[0][1]
        buckets.append(
            Bucket(
                index, [p for _, p in group], [n for n, _ in group], offsets, numel, first.dtype, first.device
            )
        )
    return buckets


def _key(param: torch.Tensor) -> tuple[torch.dtype, torch.device]:
    return param.dtype, param.device


def _by_size(ordered: list[tuple[str, torch.Tensor]], threshold: int) -> list[list[tuple[str, torch.Tensor]]]:
    buckets: list[list[tuple[str, torch.Tensor]]] = []  # in the order their first gradient arrives
    open_: dict[tuple[torch.dtype, torch.device], tuple[list[tuple[str, torch.Tensor]], int]] = {}
    for name, param in ordered:
        key = _key(param)
        nbytes = param.numel() * param.element_size()
        members, used = open_.get(key, (None, 0))
        if members is None or used + nbytes > threshold:
            members, used = [], 0
            buckets.append(members)
        members.append((name, param))
        open_[key] = (members, used + nbytes)
    return buckets


def _by_count(ordered: list[tuple[str, torch.Tensor]], count: int) -> list[list[tuple[str, torch.Tensor]]]:
    per_key: dict[tuple[torch.dtype, torch.device], list[tuple[str, torch.Tensor]]] = {}
    for item in ordered:
        per_key.setdefault(_key(item[1]), []).append(item)
    out = []
    for items in per_key.values():
        parts = min(count, len(items))
        step = -(-len(items) // parts)
        out += [items[i : i + step] for i in range(0, len(items), step)]
    return out


def _by_lists(
    ordered: list[tuple[str, torch.Tensor]], groups: Sequence[Any]
) -> list[list[tuple[str, torch.Tensor]]]:
    position = {id(p): i for i, (_, p) in enumerate(ordered)}
    taken: set[int] = set()
    out = []
    for group in groups:
        members = []
        for param in group:
            if id(param) not in position:
                raise ValueError("groups names a parameter that the optimizer does not update")
            if id(param) in taken:
                raise ValueError("groups names a parameter twice")
            taken.add(id(param))
            members.append(ordered[position[id(param)]])
        for key in dict.fromkeys(_key(p) for _, p in members):  # a dict: the same order on every rank
            out.append(sorted((m for m in members if _key(m[1]) == key), key=lambda m: position[id(m[1])]))
    rest = [item for item in ordered if id(item[1]) not in taken]
    return out + [[item] for item in rest]
