"""Whether a real GPU is usable here, and moving arrays to and from a device layer in tests."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest

from ringcore.device.fake import FakeDeviceArray, FakeLayer


@functools.cache
def unavailable() -> str | None:
    """Why the real-GPU tests cannot run here, or None when they can."""
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed (pip install 'ringcore[gpu]'): the real-GPU tests need it"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as err:  # no driver, no device
        return f"CuPy found no usable CUDA device ({type(err).__name__}: {err})"
    return None if count else "CuPy found no CUDA device"


needs_gpu = [pytest.mark.gpu, pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))]


def make_layer(kind: str, seed: int = 0) -> Any:
    """A fresh device layer: ``"fake"``, ``"mock"`` or ``"cupy"`` (skips without a GPU)."""
    if kind == "fake":
        return FakeLayer(seed=seed)
    if kind == "mock":  # the CuPy layer over tests/gpu/mock_cupy.py (installed by the caller)
        from ringcore.device.cupy_layer import CupyLayer

        return CupyLayer()
    if unavailable():
        pytest.skip(str(unavailable()))
    from ringcore.device.cupy_layer import CupyLayer

    return CupyLayer()


def to_device(layer: Any, host: np.ndarray) -> Any:
    out = layer.empty(host.size, host.dtype)
    if isinstance(out, FakeDeviceArray):
        out.host[:] = host
    else:
        out.set(host)
    return out


def to_host(array: Any) -> np.ndarray:
    return array.host.copy() if isinstance(array, FakeDeviceArray) else array.get()
