"""Reduction operators and compression modes accepted by the collectives."""

from __future__ import annotations

import enum


class ReduceOp(enum.Enum):
    """How allreduce and reduce_scatter combine the ranks' values."""

    SUM = "sum"
    AVG = "avg"
    MIN = "min"
    MAX = "max"
    PROD = "prod"

    @classmethod
    def parse(cls, op: ReduceOp | str) -> ReduceOp:
        """Accept a ``ReduceOp`` or its name (``"sum"``, ``"AVG"``...)."""
        if isinstance(op, cls):
            return op
        if isinstance(op, str) and (known := _REDUCE_OPS.get(op.lower())) is not None:
            return known
        names = ", ".join(repr(o.value) for o in cls)
        raise ValueError(f"unknown reduce op {op!r}; use one of {names} or ringcore.ReduceOp")


_REDUCE_OPS = {op.value: op for op in ReduceOp}  # name lookup without Enum's slow call by value


class Compression(enum.Enum):
    """What travels on the wire: the buffer's own dtype, or float16."""

    NONE = "none"
    FP16 = "fp16"

    @classmethod
    def parse(cls, compression: Compression | str | None) -> Compression:
        """Accept ``None``, ``"none"``, ``"fp16"`` or a ``Compression``."""
        if compression is None:
            return cls.NONE
        if isinstance(compression, cls):
            return compression
        if isinstance(compression, str):
            try:
                return cls(compression.lower())
            except ValueError:
                pass
        raise ValueError(f"unknown compression {compression!r}; use None or 'fp16'")
