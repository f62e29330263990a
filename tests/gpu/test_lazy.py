"""The GPU path loads only when a GPU buffer arrives: ``import ringcore`` never needs CuPy."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

HAS_CUPY = importlib.util.find_spec("cupy") is not None


def test_import_ringcore_loads_no_gpu_code() -> None:
    code = (
        "import sys, ringcore, numpy as np; "
        "ringcore.buffers.as_buffer(np.zeros(3), writable=True); "
        "print(sorted(m for m in sys.modules if m.startswith(('cupy', 'ringcore.device', 'ringcore.kernels.cupy'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.skipif(HAS_CUPY, reason="CuPy is installed here")
def test_gpu_buffer_without_cupy_says_what_to_install() -> None:
    from ringcore import device

    previous = device.use(None)
    try:
        with pytest.raises(TypeError, match="CuPy"):
            device.layer()
    finally:
        device.use(previous)
