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

_NVCC_BUILDS: dict[str, tuple[subprocess.CompletedProcess[str], pathlib.Path]] = {}


def _nvcc_build(
    arch: str, tmp_path_factory: pytest.TempPathFactory
) -> tuple[subprocess.CompletedProcess[str], pathlib.Path]:
    """nvcc's cubin of every kernel for ``arch``, built once per session, with its PTX kept.

    ``-ftz=true`` as CuPy passes it at run time; the PTX lands beside the cubin
    (``reduce-<arch>.ptx``), so the subnormal check reads it without a second build.
    """
    if arch not in _NVCC_BUILDS:
        out = tmp_path_factory.mktemp(f"nvcc-{arch}") / f"reduce-{arch}.cubin"
        extra = ("-ftz=true", "--keep", f"--keep-dir={out.parent}")
        names = cuda_source.all_instantiations()
        _NVCC_BUILDS[arch] = (native.nvcc_compile(arch, names, out, extra), out)
    return _NVCC_BUILDS[arch]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_kernel_compiles(arch: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    names = cuda_source.all_instantiations()
    compilers = []
    if native.nvcc() is not None:
        compilers.append("nvcc")
        result, cubin_path = _nvcc_build(arch, tmp_path_factory)
        assert result.returncode == 0, f"nvcc failed for {arch}:\n{result.stderr[-4000:]}"
        assert cubin_path.stat().st_size > 0
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


@pytest.mark.timeout(900)
def test_kernels_never_flush_subnormals(tmp_path_factory: pytest.TempPathFactory) -> None:
    """CuPy compiles with -ftz=true; the kernels must still keep subnormals, as numpy does."""
    if native.nvcc() is None:
        pytest.skip("no nvcc to read the kernels' PTX")
    result, cubin_path = _nvcc_build("sm_90", tmp_path_factory)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = [line.strip() for line in cubin_path.with_suffix(".ptx").read_text().splitlines()]
    flushing = [line for line in lines if ".ftz" in line]
    assert not flushing, f"{len(flushing)} instructions flush subnormals, e.g. {flushing[:5]}"
    fused = [line for line in lines if line.startswith("fma.")]
    assert not fused, f"fused multiply-adds: {fused[:5]}"
