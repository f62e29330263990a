"""Reductions and fp16 compression on numpy arrays: the reference kernels.

Rules every implementation (numpy here, CUDA later) must follow so a mixed
ring of ranks agrees bit for bit:

* Values are combined in the *accumulation dtype*: the caller's dtype, except
  bfloat16, which is widened to float32 (exactly: its bits shifted left 16).
* ``op(a, b)`` is evaluated once per element, rounded to the accumulation
  dtype; ``avg`` then divides by the world size (true division) in that dtype.
* Narrowing to the storage or wire dtype rounds to nearest, ties to even
  (numpy's float casts, or torch's for float16 when the process has torch,
  see :mod:`ringcore.kernels.casts`; a bit-exact routine for bfloat16, NaN
  kept quiet).

The hot path (same dtype everywhere, the common case) is one ufunc call with
``out=``; mixed dtypes (compression, bfloat16) go through one reusable
scratch array per :class:`Reducer`, never a fresh temporary per call.

Overflow to inf, NaN inputs and integer wrap-around are results, not
warnings: callers run these kernels under :func:`ignoring_fp_errors` (the communicator
does, once per collective, not once per segment).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from ringcore.buffers import DType
from ringcore.kernels.casts import borrows_torch, cast
from ringcore.ops import Compression, ReduceOp

UFUNCS = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.PROD: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
}

_BF16_ROUND = np.uint32(0x7FFF)
_BF16_QUIET = np.uint16(0x0040)

T = TypeVar("T")


def _errstate_variable() -> tuple[Any, Any]:
    """numpy 2's context variable behind ``np.errstate`` and its "ignore everything" value.

    Private to numpy, so used only after checking here that setting it does
    what ``np.errstate(all="ignore")`` does; ``(None, None)`` otherwise.
    """
    try:
        from numpy._core._ufunc_config import _extobj_contextvar, _make_extobj

        ignore = _make_extobj(all="ignore")
    except (ImportError, AttributeError, TypeError):  # another numpy layout
        return None, None
    with np.errstate(all="raise"):
        token = _extobj_contextvar.set(ignore)
        try:
            works = set(np.geterr().values()) == {"ignore"}
        finally:
            _extobj_contextvar.reset(token)
        works = works and set(np.geterr().values()) == {"raise"}
    return (_extobj_contextvar, ignore) if works else (None, None)


# numpy's error-state variable and the value that ignores every error (None, None: use np.errstate);
# the communicator's turn sets it inline (Communicator._run), everything else through ignoring_fp_errors.
FP_ERRORS, IGNORE_FP_ERRORS = _errstate_variable()


def ignoring_fp_errors(run: Callable[..., T], *args: Any) -> T:
    """``run(*args)`` with numpy's floating-point errors ignored, as under ``np.errstate(all="ignore")``.

    The same context variable, set without building an ``errstate`` (about 1.4
    us, a tenth of a small allreduce's Python) and reset on the way out, so
    the caller's own error state is back afterwards.
    """
    if FP_ERRORS is None:
        with np.errstate(all="ignore"):
            return run(*args)
    token = FP_ERRORS.set(IGNORE_FP_ERRORS)
    try:
        return run(*args)
    finally:
        FP_ERRORS.reset(token)


def bf16_to_f32(src: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Widen bfloat16 bits (uint16) into ``out`` (float32), exactly."""
    bits = out.view(np.uint32)
    np.copyto(bits, src, casting="unsafe")
    np.left_shift(bits, 16, out=bits)
    return out


def f32_to_bf16(src: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Round float32 ``src`` to bfloat16 bits in ``out`` (uint16), nearest-even."""
    bits = src.view(np.uint32)
    lsb = np.right_shift(bits, 16) & np.uint32(1)
    rounded = np.right_shift(bits + _BF16_ROUND + lsb, 16)
    np.copyto(out, rounded, casting="unsafe")
    nan = np.isnan(src)
    if nan.any():
        out[nan] = np.right_shift(bits[nan], 16).astype(np.uint16) | _BF16_QUIET
    return out


class Reducer:
    """The kernels of one collective: combine (with avg's final division) and convert.

    Args:
        dtype: the caller's element type.
        op: the reduction.
        compression: what travels on the wire.
        world: the world size (``avg`` divides by it).
    """

    def __init__(self, dtype: DType, op: ReduceOp, compression: Compression, world: int) -> None:
        self.dtype = dtype
        self.op = op
        self.world = world
        self.divides = (
            op is ReduceOp.AVG and world > 1
        )  # avg's final division (an enum's lookup costs 0.1 us)
        self.ufunc = UFUNCS[op]
        self.acc_dtype = np.dtype(np.float32) if dtype.name == "bfloat16" else dtype.storage
        compressed = compression is Compression.FP16 and dtype.name != "float16"
        self.wire_dtype = np.dtype(np.float16) if compressed else dtype.storage
        self._scratch = np.empty(0, self.acc_dtype)
        self._widen = np.empty(0, self.acc_dtype)
        self._result: np.ndarray | None = None

    def reduce(self, dst: np.ndarray, inputs: list[np.ndarray]) -> None:
        """``dst = op(inputs[0], inputs[1], ...)``, combined in list order, with avg's division at the end.

        The inputs (two or more) share one dtype. Bit for bit what ``combine`` gives
        pairwise in the same order: the same ufunc calls, with one dtype check for all.
        """
        last = len(inputs) - 1
        acc = self.acc_dtype
        if dst.dtype is not acc or inputs[0].dtype is not acc:
            self.combine(dst, inputs[0], inputs[1], final=last == 1)
            for index in range(2, last + 1):
                self.combine(dst, dst, inputs[index], final=index == last)
            return
        ufunc = self.ufunc
        ufunc(inputs[0], inputs[1], out=dst)
        for index in range(2, last + 1):
            ufunc(dst, inputs[index], out=dst)
        if self.divides:
            np.divide(dst, self.world, out=dst, casting="unsafe")

    def combine(self, dst: np.ndarray, a: np.ndarray, b: np.ndarray, final: bool = False) -> None:
        """``dst = op(a, b)`` element-wise; with ``final``, apply avg's division too."""
        scale = final and self.divides
        acc = self.acc_dtype
        # The identity test first: a 4 KiB combine's dtype comparisons cost a third of it.
        if (dst.dtype is acc and a.dtype is acc and b.dtype is acc) or dst.dtype == a.dtype == b.dtype == acc:
            self.ufunc(a, b, out=dst)
            if scale:
                np.divide(dst, self.world, out=dst, casting="unsafe")
            return
        acc = self._scratch_for(dst.size)
        self.ufunc(self._load(a, self._widen_for(a.size)), self._load(b, acc), out=acc)
        if scale:
            np.divide(acc, self.world, out=acc, casting="unsafe")
        self._store(dst, acc)

    def convert(self, dst: np.ndarray, src: np.ndarray) -> None:
        """Copy ``src`` into ``dst``, rounding when the dtypes differ (compression)."""
        if dst.dtype == src.dtype:
            dst[...] = src  # np.copyto's dispatch costs a 4 KiB copy twice the copy itself
        elif self._is_bf16(dst) or self._is_bf16(src):
            self._store(dst, self._load(src, self._scratch_for(src.size)))
        else:
            cast(dst, src)

    def scratch_like(self, x: np.ndarray) -> np.ndarray:
        """A reusable array shaped and typed like ``x`` (not shared with ``combine``'s own)."""
        if getattr(self, "_result", None) is None or self._result.nbytes < x.nbytes:
            self._result = np.empty(x.nbytes, np.uint8)
        return self._result[: x.nbytes].view(x.dtype)

    def _is_bf16(self, x: np.ndarray) -> bool:
        return self.dtype.name == "bfloat16" and x.dtype == np.uint16

    def _load(self, x: np.ndarray, scratch: np.ndarray) -> np.ndarray:
        """``x`` in the accumulation dtype (widened into ``scratch`` when it differs)."""
        if self._is_bf16(x):
            return bf16_to_f32(x, scratch)
        if x.dtype == np.float16 and scratch.dtype == np.float32 and borrows_torch():
            cast(scratch, x)  # torch's widening; without torch the ufunc's own cast is the rule
            return scratch
        return x

    def _store(self, dst: np.ndarray, acc: np.ndarray) -> None:
        if self._is_bf16(dst):
            if acc.dtype != np.float32:  # e.g. unpacking fp16 wire values into bfloat16
                widened = self._widen_for(acc.size)
                np.copyto(widened, acc, casting="unsafe")
                acc = widened
            f32_to_bf16(acc, dst)
        else:
            cast(dst, acc)

    def _scratch_for(self, count: int) -> np.ndarray:
        if self._scratch.size < count:
            self._scratch = np.empty(count, self.acc_dtype)
        return self._scratch[:count]

    def _widen_for(self, count: int) -> np.ndarray:
        if self._widen.size < count:
            self._widen = np.empty(count, self.acc_dtype)
        return self._widen[:count]
