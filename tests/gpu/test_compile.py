"""Every CUDA kernel instantiation compiles for sm_80 (A100) and sm_90 (H100/H200), with or without a GPU.

Uses nvcc (``-cubin``: the full compile, ptxas included). Fails if a kernel
does not compile; skips only when there is no nvcc at all.
"""

from __future__ import annotations

import pathlib

import pytest

from ringcore.kernels import cuda_source
from tests.gpu import native


@pytest.mark.timeout(600)
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_kernel_compiles(arch: str, tmp_path: pathlib.Path) -> None:
    if native.nvcc() is None:
        pytest.skip(
            "no CUDA compiler: nvcc is not on PATH nor in /usr/local/cuda/bin (install the CUDA toolkit)"
        )
    names = cuda_source.all_instantiations()
    result = native.nvcc_compile(arch, names, tmp_path / f"reduce-{arch}.cubin")
    assert result.returncode == 0, f"nvcc failed for {arch}:\n{result.stderr[-4000:]}"
    assert (tmp_path / f"reduce-{arch}.cubin").stat().st_size > 0


def test_instantiations_cover_every_collective() -> None:
    names = cuda_source.all_instantiations()
    assert "rc_combine<rc_f16, rc_f16, float, float, float, 0>" in names  # compressed float32 sum
    assert "rc_convert<rc_f16, rc_bf16, float>" in names  # bfloat16 -> fp16 compression
    assert "rc_combine<rc_i64, rc_i64, rc_i64, rc_i64, rc_i64, 1>" in names
    assert all(name.count("<") == 1 for name in names)
