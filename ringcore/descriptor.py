"""What a rank was asked to do in one collective, and how ranks that disagree are told apart.

Every frame of a collective carries ``Descriptor.signature()``, a 64-bit hash
of the arguments all ranks must agree on; a receiver that sees another
signature knows the ranks disagree. The full descriptors are then compared
through the rendezvous store, and :func:`explain` writes the message every
rank raises, e.g. ``allreduce #3: ranks disagree on shape: ranks 0-2 passed
(1000,), rank 3 passed (1024,)``.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any, NamedTuple

import msgpack


class Descriptor(NamedTuple):
    """The arguments of one collective on one rank.

    ``shape`` is the part of the shape ranks must agree on (allgather: all but
    the first dimension). A named tuple: one is made per collective, so it
    must be cheap to build.
    """

    kind: str
    seq: int
    dtype: str
    shape: tuple[int, ...]
    op: str | None = None
    root: int | None = None
    compression: str | None = None
    memory: str | None = None  # symmetric memory the collective runs on (ringcore.symmetric), else None

    def signature(self) -> int:
        return _signature(
            self.kind, self.dtype, self.shape, self.op, self.root, self.compression, self.memory
        )

    def record(self) -> dict[str, Any]:
        return {**self._asdict(), "shape": list(self.shape)}

    @property
    def title(self) -> str:
        return f"{self.kind} #{self.seq}"


@functools.lru_cache(maxsize=1024)
def _signature(*fields: Any) -> int:
    packed = msgpack.packb([list(f) if isinstance(f, tuple) else f for f in fields])
    return int.from_bytes(hashlib.blake2b(packed, digest_size=8).digest(), "little")


_FIELDS = ("kind", "seq", "dtype", "shape", "op", "root", "compression", "memory")


def explain(mine: Descriptor, records: dict[int, dict[str, Any]], size: int) -> str:
    """Describe how the ranks' descriptors differ; names ranks and values."""
    parts = []
    for field in _FIELDS:
        groups: dict[str, list[int]] = {}
        for rank, record in sorted(records.items()):
            groups.setdefault(_show(field, record.get(field)), []).append(rank)
        if len(groups) > 1:
            listed = ", ".join(f"{rank_list(ranks)} passed {value}" for value, ranks in groups.items())
            parts.append(f"{_NAMES[field]}: {listed}")
    missing = [r for r in range(size) if r not in records]
    text = "; ".join(parts) or "the ranks' frames disagreed, but every rank that reported asked for the same"
    if missing:
        text += f" (no report from {rank_list(missing)}: they may be elsewhere or done)"
    return f"{mine.title}: ranks disagree on {text}"


_NAMES = {
    "kind": "the collective",
    "seq": "the collective number",
    "dtype": "dtype",
    "shape": "shape",
    "op": "op",
    "root": "root",
    "compression": "compression",
    "memory": "memory (arrays from ringcore.empty, at one offset, on every rank or none)",
}


def _show(field: str, value: Any) -> str:
    if field == "shape" and isinstance(value, list):
        return str(tuple(value))
    if field == "memory" and value is None:
        return "ordinary memory"
    return str(value)


def rank_list(ranks: list[int]) -> str:
    """``rank 3``, ``ranks 0-2``, ``ranks 0, 2, 5``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))
