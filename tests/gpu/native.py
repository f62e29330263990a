"""Build the CUDA kernels' element rules for the host (g++) or the device (nvcc), without a GPU.

``reduce.cu`` keeps its element rules (conversions, operations, NaN
handling) in plain C++ above the kernels. :func:`host_library` compiles
them with g++ into a shared library with one C entry point per kernel
instantiation, looping over host arrays, so tests compare them with numpy
bit for bit on any machine. :func:`nvcc_compile` builds the real kernels for
a GPU architecture (``-cubin``), which needs nvcc but no GPU.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile

from ringcore.kernels import cuda_source

BUILD = pathlib.Path(os.environ.get("RINGCORE_TEST_BUILD", tempfile.gettempdir())) / "ringcore-kernels"


def nvcc() -> str | None:
    """The nvcc on PATH or in the usual CUDA locations, or None."""
    found = shutil.which("nvcc")
    for candidate in (found, "/usr/local/cuda/bin/nvcc", "/usr/local/bin/nvcc"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def _harness(names: tuple[str, ...]) -> str:
    lines = [cuda_source.source(), "#include <cstddef>"]
    for i, name in enumerate(names):
        t = name[name.index("<") + 1 : -1].split(", ")
        args = ", ".join(t)
        if name.startswith("rc_combine<"):
            lines.append(
                f'extern "C" void k{i}(void* d, const void* a, const void* b, long long n, int s, double w) {{'
                f" for (long long i = 0; i < n; ++i) (({t[0]}*)d)[i] = combine_one<{args}>("
                f"((const {t[1]}*)a)[i], ((const {t[2]}*)b)[i], s, w); }}"
            )
        else:
            lines.append(
                f'extern "C" void k{i}(void* d, const void* a, long long n) {{'
                f" for (long long i = 0; i < n; ++i) (({t[0]}*)d)[i] = convert_one<{args}>("
                f"((const {t[1]}*)a)[i]); }}"
            )
    return "\n".join(lines) + "\n"


@functools.cache
def host_library() -> dict[str, ctypes._CFuncPtr]:
    """Every kernel instantiation's element rule as a host function, by name (needs g++)."""
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise FileNotFoundError("no C++ compiler (g++) to build the kernels' element rules for the host")
    names = cuda_source.all_instantiations()
    text = _harness(names)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    BUILD.mkdir(parents=True, exist_ok=True)
    lib = BUILD / f"host-{digest}.so"
    if not lib.exists():
        src = BUILD / f"host-{digest}.cpp"
        src.write_text(text)
        tmp = BUILD / f"host-{digest}.{os.getpid()}.so"
        cmd = [compiler, "-x", "c++", "-std=c++17", "-O1", "-ffp-contract=off", "-shared", "-fPIC"]
        subprocess.run([*cmd, "-o", str(tmp), str(src)], check=True, capture_output=True, text=True)
        tmp.replace(lib)
    handle = ctypes.CDLL(str(lib))
    return {name: getattr(handle, f"k{i}") for i, name in enumerate(names)}


def nvcc_compile(
    arch: str, names: tuple[str, ...], out: pathlib.Path, extra: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """Compile the kernels ``names`` for ``arch`` (e.g. ``sm_90``) into a cubin at ``out``.

    ``extra`` options follow ringcore's own (e.g. ``--keep`` to keep the PTX beside ``out``).
    """
    compiler = nvcc()
    if compiler is None:
        raise FileNotFoundError("nvcc")
    src = out.with_suffix(".cu")
    src.write_text(cuda_source.source() + cuda_source.explicit_instantiations(names))
    options = [opt.replace("--fmad", "-fmad") for opt in cuda_source.COMPILE_OPTIONS]
    cmd = [compiler, "-cubin", f"-arch={arch}", *options, *extra, "-o", str(out), str(src)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def nvrtc_unavailable() -> str | None:
    """Why CuPy's NVRTC cannot compile here (no GPU needed), or None when it can."""
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
    except Exception as err:  # not installed, or libnvrtc not found
        return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    return None


def nvrtc_compile(arch: str, names: tuple[str, ...]) -> tuple[bytes, list[str]]:
    """Compile through NVRTC with name expressions, as ``cupy.RawModule`` does; the cubin and lowered names.

    Raises:
        RuntimeError: the compile failed (the message holds NVRTC's log).
    """
    from cupy_backends.cuda.libs import nvrtc

    program = nvrtc.createProgram(cuda_source.source(), "reduce.cu", [], [])
    try:
        for name in names:
            nvrtc.addNameExpression(program, name)
        try:
            # CuPy adds -ftz=true to every compile; so does this, to build what CuPy builds
            options = [*cuda_source.COMPILE_OPTIONS, "-ftz=true", f"--gpu-architecture={arch}"]
            nvrtc.compileProgram(program, options)
        except nvrtc.NVRTCError as err:
            raise RuntimeError(
                f"NVRTC failed for {arch}: {err}\n{nvrtc.getProgramLog(program)[-4000:]}"
            ) from None
        return nvrtc.getCUBIN(program), [nvrtc.getLoweredName(program, name) for name in names]
    finally:
        nvrtc.destroyProgram(program)
