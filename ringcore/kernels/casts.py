"""float32 <-> float16 conversion, the cost centre of fp16 compression.

numpy converts float16 one element at a time (no SIMD path on x86,
numpy/numpy#28753), far slower than torch's vectorised (F16C / AVX-512)
loop (measured: ``bench/HISTORY.md``, "What limits ringcore here, measured").
ringcore never imports torch itself (seconds and hundreds of MiB), but when
the process already has it, as every PyTorch job does, :func:`cast` borrows
torch's loop for these two conversions. ``RINGCORE_TORCH_CASTS=0`` turns that off.

The copies go in pieces of 16384 elements, below torch's grain size (32768):
larger ones run on torch's OpenMP pool, whose threads then spin between
calls and take the cores other ranks need (measured: the same section).

Both round to nearest, ties to even, and agree bit for bit on every value
but one: a *signaling* NaN keeps its signaling bit in numpy and comes out
quieted from torch. Every other NaN, infinity, subnormal and overflow
converts identically (``tests/unit/test_casts.py``), so ranks that differ
in whether they have torch still end bit-identical unless a caller's data
holds signaling NaNs.
"""

from __future__ import annotations

import os
import sys

import numpy as np

_PAIRS = {(np.dtype(np.float16), np.dtype(np.float32)), (np.dtype(np.float32), np.dtype(np.float16))}
_PIECE = 16384  # elements: torch runs smaller copies on the calling thread
BORROW_TORCH: bool | None = None  # RINGCORE_TORCH_CASTS, read at the first cast (after ringcore.init's env)


def _borrowing() -> bool:
    global BORROW_TORCH
    if BORROW_TORCH is None:
        setting = os.environ.get("RINGCORE_TORCH_CASTS", "1").strip().lower()
        BORROW_TORCH = setting not in ("0", "false", "no", "off")
    return BORROW_TORCH


def cast(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src`` rounded to ``dst``'s dtype (same shape, contiguous)."""
    torch = sys.modules.get("torch") if _borrowing() else None
    if torch is not None and (dst.dtype, src.dtype) in _PAIRS and src.flags.writeable and dst.size:
        for to, source in zip(
            torch.from_numpy(dst).split(_PIECE), torch.from_numpy(src).split(_PIECE), strict=True
        ):
            to.copy_(source)
    else:
        np.copyto(dst, src, casting="unsafe")


def borrows_torch() -> bool:
    """Whether :func:`cast` uses torch's conversions in this process right now."""
    return _borrowing() and "torch" in sys.modules
