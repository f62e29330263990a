"""The CUDA kernels' source and the names of their instantiations: pure Python, no GPU needed.

``cuda/reduce.cu`` holds two templates, ``rc_combine<D, A, B, L, C, OP>`` and
``rc_convert<D, S, M>``. Every type is chosen here, with the same rules as
:class:`ringcore.kernels.numpy_ops.Reducer` (so the two agree bit for bit):

* ``combine(dst, a, b)`` with every dtype equal to the accumulator runs in
  that dtype (numpy's one-ufunc fast path); otherwise bfloat16 operands are
  widened to float32, the loop type ``L`` is numpy's ``result_type`` of the
  two operands, the result is cast to the accumulator ``C`` (float32 for
  bfloat16, else the caller's dtype), scaled for avg, and narrowed to ``D``.
* ``convert(dst, src)`` goes through float32 for bfloat16 sources.

A collective needs a handful of instantiations: the same-dtype combine, and
with compression every mix of the caller's and the wire dtype; they are named
by :func:`instantiations` and compiled together, lazily, by the CuPy layer
(``name_expressions``) or ahead of time by the tests (``nvcc``), which append
:func:`explicit_instantiations` to the source.
"""

from __future__ import annotations

import functools
import itertools
from importlib import resources

import numpy as np

from ringcore.buffers import DTYPES, DType
from ringcore.ops import Compression, ReduceOp

OPS = {ReduceOp.SUM: 0, ReduceOp.AVG: 0, ReduceOp.PROD: 1, ReduceOp.MIN: 2, ReduceOp.MAX: 3}
COMPILE_OPTIONS = ("-std=c++17", "--fmad=false")  # no fused multiply-add: numpy rounds every op

_C_TYPES = {
    "float16": "rc_f16",
    "bfloat16": "rc_bf16",
    "float32": "float",
    "float64": "double",
    "int8": "rc_i8",
    "int16": "rc_i16",
    "int32": "rc_i32",
    "int64": "rc_i64",
    "uint8": "rc_u8",
    "uint16": "rc_u16",
    "uint32": "rc_u32",
    "uint64": "rc_u64",
}
_F16, _F32 = np.dtype(np.float16), np.dtype(np.float32)


@functools.cache
def source() -> str:
    """The text of ``cuda/reduce.cu``."""
    return resources.files("ringcore.kernels").joinpath("cuda/reduce.cu").read_text()


def c_type(dtype: DType, x: np.dtype) -> str:
    """The C type of an array ``x`` of a collective on ``dtype`` (uint16 is bfloat16 there)."""
    if dtype.name == "bfloat16" and x == np.uint16:
        return "rc_bf16"
    return _C_TYPES[x.name]


def acc_dtype(dtype: DType) -> np.dtype:
    """The accumulation dtype: float32 for bfloat16, else the caller's."""
    return _F32 if dtype.name == "bfloat16" else dtype.storage


def wire_dtype(dtype: DType, compression: Compression) -> np.dtype:
    """What travels on the wire: float16 with compression (of a float buffer), else the storage dtype."""
    compressed = compression is Compression.FP16 and dtype.name != "float16" and dtype.is_float
    return _F16 if compressed else dtype.storage


def combine_name(dtype: DType, op: ReduceOp, dst: np.dtype, a: np.dtype, b: np.dtype) -> str:
    """The ``rc_combine`` instantiation ``Reducer.combine`` would mirror for these arrays."""
    acc = acc_dtype(dtype)
    if dst == a == b == acc:
        loop = acc
    else:
        widened = [_F32 if c_type(dtype, x) == "rc_bf16" else x for x in (a, b)]
        loop = np.result_type(*widened)
    types = [c_type(dtype, x) for x in (dst, a, b)]
    loop_c, acc_c = _C_TYPES[loop.name], _C_TYPES[acc.name]
    return f"rc_combine<{', '.join(types)}, {loop_c}, {acc_c}, {OPS[op]}>"


def convert_name(dtype: DType, dst: np.dtype, src: np.dtype) -> str:
    """The ``rc_convert`` instantiation for ``dst <- src`` (different dtypes)."""
    s = c_type(dtype, src)
    middle = "float" if s == "rc_bf16" else s
    return f"rc_convert<{c_type(dtype, dst)}, {s}, {middle}>"


def instantiations(dtype: DType, compression: Compression) -> tuple[str, ...]:
    """Every kernel a collective on ``dtype`` may launch, for all ops (one module per pair)."""
    storage, wire = dtype.storage, wire_dtype(dtype, compression)
    kinds = sorted({storage, wire}, key=str)
    ops = [ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX]
    names = [combine_name(dtype, op, d, a, b) for op in ops for d, a, b in itertools.product(kinds, repeat=3)]
    if wire != storage:
        names += [convert_name(dtype, wire, storage), convert_name(dtype, storage, wire)]
    return tuple(dict.fromkeys(names))


def all_instantiations() -> tuple[str, ...]:
    """Every kernel any collective may launch (what the compile tests build)."""
    names: dict[str, None] = {}
    for dtype in DTYPES.values():
        for compression in (Compression.NONE, Compression.FP16):
            names.update(dict.fromkeys(instantiations(dtype, compression)))
    return tuple(names)


def explicit_instantiations(names: tuple[str, ...]) -> str:
    """C++ explicit instantiations of ``names``, for compilers without name expressions (nvcc)."""
    lines = []
    for name in names:
        t = name[name.index("<") + 1 : -1].split(", ")
        if name.startswith("rc_combine<"):
            params = f"({t[0]}*, const {t[1]}*, const {t[2]}*, long long, long long, int, double)"
        else:
            params = f"({t[0]}*, const {t[1]}*, long long, long long)"
        lines.append(f"template __global__ void {name}{params};")
    return "\n".join(lines) + "\n"


def vector_head(pointers: list[int], itemsizes: list[int], count: int) -> int:
    """Leading elements to process one by one so every pointer is aligned to its 16-byte pack.

    The kernels read ``16 / max(itemsize)`` elements per pack; when the
    pointers cannot all be aligned by skipping the same number of elements,
    the whole range is done element by element (``count``).
    """
    width = 16 // max(itemsizes)
    heads = set()
    for pointer, size in zip(pointers, itemsizes, strict=True):
        align = width * size
        heads.add(((-pointer) % align) // size if pointer % size == 0 else count)
    head = heads.pop() if len(heads) == 1 else count
    return min(head, count)
