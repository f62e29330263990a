"""Every CUDA kernel instantiation compiles for sm_80 (A100) and sm_90 (H100/H200), with or without a GPU.

Two compilers, each used where it is installed: nvcc (``-cubin``, ptxas
included) and NVRTC through CuPy's bindings with the same name expressions
``cupy.RawModule`` resolves at run time. A test fails if a kernel does not
compile with any compiler that is there; it skips only when neither is.
"""

from __future__ import annotations

import pathlib
import subprocess

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


@pytest.mark.timeout(600)
def test_kernels_never_flush_subnormals(tmp_path: pathlib.Path) -> None:
    """CuPy compiles with -ftz=true; the kernels must still keep subnormals, as numpy does."""
    if native.nvcc() is None:
        pytest.skip("no nvcc to read the kernels' PTX")
    src = tmp_path / "reduce.cu"
    src.write_text(
        cuda_source.source() + cuda_source.explicit_instantiations(cuda_source.all_instantiations())
    )
    ptx = tmp_path / "reduce.ptx"
    cmd = [
        native.nvcc(),
        "-ptx",
        "-arch=sm_90",
        "-std=c++17",
        "-fmad=false",
        "-ftz=true",
        "-o",
        str(ptx),
        str(src),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    flushing = [line.strip() for line in ptx.read_text().splitlines() if ".ftz" in line]
    assert not flushing, f"{len(flushing)} instructions flush subnormals, e.g. {flushing[:5]}"
    fused = [line.strip() for line in ptx.read_text().splitlines() if line.strip().startswith("fma.")]
    assert not fused, f"fused multiply-adds: {fused[:5]}"
