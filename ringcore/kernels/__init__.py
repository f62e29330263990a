"""Element-wise kernels: reductions and fp16 compression.

:mod:`ringcore.kernels.numpy_ops` is the reference implementation used for
host buffers. ``cuda/reduce.cu`` is the CUDA one, bit for bit the same;
:mod:`ringcore.kernels.cuda_source` names its instantiations (pure Python)
and :mod:`ringcore.kernels.cupy_ops` launches them through CuPy (imported
only when a GPU buffer arrives).
"""
