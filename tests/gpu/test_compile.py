"""Every CUDA kernel instantiation compiles for sm_80 (A100) and sm_90 (H100/H200), with or without a GPU.

Two compilers, each used where it is installed: nvcc (``-cubin``, ptxas
included) and NVRTC through CuPy's bindings with the same name expressions
``cupy.RawModule`` resolves at run time. A test fails if a kernel does not
compile with any compiler that is there; it skips only when neither is.
"""

from __future__ import annotations

import pathlib

import pytest

from ringcore.kernels import cuda_source
from tests.gpu import native


@pytest.mark.timeout(900)
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_kernel_compiles(arch: str, tmp_path: pathlib.Path) -> None:
    names = cuda_source.all_instantiations()
    compilers = []
    if native.nvcc() is not None:
        compilers.append("nvcc")
        result = native.nvcc_compile(arch, names, tmp_path / f"reduce-{arch}.cubin")
        assert result.returncode == 0, f"nvcc failed for {arch}:\n{result.stderr[-4000:]}"
        assert (tmp_path / f"reduce-{arch}.cubin").stat().st_size > 0
    if native.nvrtc_unavailable() is None:
        compilers.append("nvrtc")
        cubin, lowered = native.nvrtc_compile(arch, names)
        assert cubin and all(name.startswith("_Z") for name in lowered)
    if not compilers:
        pytest.skip(
            "no CUDA compiler: nvcc is not on PATH nor in /usr/local/cuda/bin, and CuPy's NVRTC "
            f"is unusable ({native.nvrtc_unavailable()}); install the CUDA toolkit or "
            "cupy-cuda12x with nvidia-cuda-nvrtc-cu12"
        )


def test_instantiations_cover_every_collective() -> None:
    names = cuda_source.all_instantiations()
    assert "rc_combine<rc_f16, rc_f16, float, float, float, 0>" in names  # compressed float32 sum
    assert "rc_convert<rc_f16, rc_bf16, float>" in names  # bfloat16 -> fp16 compression
    assert "rc_combine<rc_i64, rc_i64, rc_i64, rc_i64, rc_i64, 1>" in names
    assert all(name.count("<") == 1 for name in names)
