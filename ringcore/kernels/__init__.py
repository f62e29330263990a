"""Element-wise kernels: reductions and fp16 compression.

:mod:`ringcore.kernels.numpy_ops` is the reference implementation used for
host buffers; a CUDA implementation must match it bit for bit.
"""
