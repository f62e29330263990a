"""The job and its words, as Horovod names them: ``init``, ``rank``..., the reduce ops, compression.

``ringcore.torch`` works on ringcore's default communicator (``ringcore.init()``),
so a script may mix ``hvd.allreduce(tensor)`` and ``ringcore.allreduce(array)``.
``init()`` may be called again while initialized (Horovod allows it): it
keeps the communicator it has.
"""

from __future__ import annotations

from typing import Any

import ringcore
from ringcore.comm import Communicator
from ringcore.errors import RingcoreError
from ringcore.ops import Compression as WireCompression
from ringcore.ops import ReduceOp

Average = ReduceOp.AVG
Sum = ReduceOp.SUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PROD


class _AdasumOp:
    """Horovod's Adasum: not implemented by ringcore (using it raises ``NotImplementedError``)."""

    def __repr__(self) -> str:
        return "Adasum"


Adasum = _AdasumOp()


class Compression:
    """Horovod's gradient compression choices, mapped onto ringcore's wire compression.

    ``Compression.fp16`` sends float16 on the wire and accumulates in the tensor's own
    dtype, so every rank ends bit-identical (Horovod casts the whole tensor to float16
    and sums in float16). Integer tensors are sent as they are, as Horovod does.
    """

    none = WireCompression.NONE
    fp16 = WireCompression.FP16


def init() -> None:
    """Join the job (``ringcore.init()``), reading rank and size from the launcher; again: no-op."""
    if not ringcore.is_initialized():
        ringcore.init()


def shutdown() -> None:
    """Leave the job; safe without ``init()``."""
    ringcore.shutdown()


def is_initialized() -> bool:
    return ringcore.is_initialized()


def communicator() -> Communicator:
    """The default communicator, with an error that names the binding's ``init``."""
    if not ringcore.is_initialized():
        raise RingcoreError(
            "ringcore.torch is not initialized: call hvd.init() (ringcore.torch.init()) first"
        )
    return ringcore.communicator()


def rank() -> int:
    return communicator().rank


def size() -> int:
    return communicator().size


def local_rank() -> int:
    return communicator().local_rank


def local_size() -> int:
    return communicator().local_size


def cross_rank() -> int:
    """This rank's index among the ranks with its local rank (its host's index, on alike hosts)."""
    return communicator().cross_rank


def cross_size() -> int:
    """How many ranks share this rank's local rank (the number of hosts, on alike hosts)."""
    return communicator().cross_size


def reduce_op(op: Any, average: bool | None = None, default: ReduceOp = Average) -> ReduceOp:
    """Horovod's ``op=`` (or the deprecated ``average=``) as a :class:`ringcore.ReduceOp`.

    Raises:
        NotImplementedError: ``Adasum``.
        ValueError: an unknown op, or both ``op`` and ``average``.
    """
    if op is Adasum:
        raise NotImplementedError(
            "Adasum is not implemented by ringcore; use op=hvd.Average (the default), which "
            "averages gradients exactly, or op=hvd.Sum"
        )
    if average is not None:
        if op is not None:
            raise ValueError("pass op= or the deprecated average=, not both")
        return Average if average else Sum
    return default if op is None else ReduceOp.parse(op)


def wire_compression(compression: Any) -> WireCompression:
    """``Compression.none``/``Compression.fp16`` (or ringcore's names, ``None``) as ringcore's compression.

    Raises:
        ValueError: anything else, such as a Horovod ``Compressor`` class of the user's own.
    """
    try:
        return WireCompression.parse(compression)
    except ValueError:
        raise ValueError(
            f"unknown compression {compression!r}: ringcore offers hvd.Compression.none and "
            "hvd.Compression.fp16 (float16 on the wire), not Compressor classes of one's own"
        ) from None


# Horovod's build queries, which example scripts branch on: ringcore is none of these libraries.
def nccl_built() -> bool:
    """False: ringcore does not use NCCL (CUDA tensors take its own GPU path)."""
    return False


def mpi_built() -> bool:
    """False: ringcore needs no MPI (it runs under mpirun all the same)."""
    return False


def gloo_built() -> bool:
    """False: ringcore does not use Gloo."""
    return False


def mpi_enabled() -> bool:
    return False


def gloo_enabled() -> bool:
    return False


def mpi_threads_supported() -> bool:
    return False


def cuda_built() -> bool:
    """Whether ringcore's GPU path can run here (CuPy is installed)."""
    import importlib.util

    return importlib.util.find_spec("cupy") is not None


def rocm_built() -> bool:
    return False
