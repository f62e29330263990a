"""GPU benchmark: CUDA kernel bandwidth against the device copy, and allreduce busbw of cupy buffers.

Run on a machine with a GPU and CuPy (``bench/gpu_check.sh`` runs it after
the GPU tests)::

    python3 bench/gpu_bench.py --kernel-mib 256 --sizes 4M,64M,256M --np 2,4 --json out.json

Kernels: each is timed with CUDA events (median of ``--reps`` after a
warm-up) on ``--kernel-mib`` MiB of float32-equivalent elements; GB/s counts
the bytes read and written, like the device-to-device copy measured in the
same run (``cudaMemcpyAsync``, also read + write).

Allreduce: N processes share the GPU and talk over TCP on 127.0.0.1
(``ringcore.init``); for each size, float32 buffers are reduced as host
numpy arrays, as cupy arrays, and as cupy arrays with fp16 compression.
Every timed iteration is ``barrier; t0; allreduce; t1``; the time is the
median over iterations of the slowest rank; ``busbw = size / time *
2(n-1)/n`` (nccl-tests' rules, GB = 1e9 bytes). The table comes last.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import statistics
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODES = ("host", "gpu", "gpu+fp16")


def parse_size(text: str) -> int:
    from ringcore.config import parse_size as parse

    return parse(text)


# --------------------------------------------------------------------------- kernels


def _kernel_cases() -> list[tuple[str, str, str, str, str, str]]:
    """(label, dtype, compression, op, kind, dtypes of dst/a/b or dst/src as storage names)."""
    return [
        ("sum float32", "float32", "none", "sum", "combine", "float32 float32 float32"),
        ("max float32", "float32", "none", "max", "combine", "float32 float32 float32"),
        ("avg float32 (final)", "float32", "none", "avg", "combine", "float32 float32 float32"),
        ("sum float16", "float16", "none", "sum", "combine", "float16 float16 float16"),
        ("sum bfloat16", "bfloat16", "none", "sum", "combine", "uint16 uint16 uint16"),
        ("sum float64", "float64", "none", "sum", "combine", "float64 float64 float64"),
        ("sum int32", "int32", "none", "sum", "combine", "int32 int32 int32"),
        ("sum int64", "int64", "none", "sum", "combine", "int64 int64 int64"),
        ("decompress+sum fp16<-fp16+fp32", "float32", "fp16", "sum", "combine", "float16 float16 float32"),
        ("decompress+sum fp16<-fp16+bf16", "bfloat16", "fp16", "sum", "combine", "float16 float16 uint16"),
        ("compress float32->fp16", "float32", "fp16", "sum", "convert", "float16 float32"),
        ("decompress fp16->float32", "float32", "fp16", "sum", "convert", "float32 float16"),
        ("compress bfloat16->fp16", "bfloat16", "fp16", "sum", "convert", "float16 uint16"),
    ]


def _time_events(cupy: Any, stream: Any, fn: Any, reps: int) -> float:
    fn()
    stream.synchronize()
    times = []
    for _ in range(reps):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) / 1e3)
    return statistics.median(times)


def bench_kernels(mib: int, reps: int) -> list[dict[str, Any]]:
    import cupy

    from ringcore.buffers import DTYPES
    from ringcore.kernels.cupy_ops import CudaReducer
    from ringcore.ops import Compression, ReduceOp

    stream = cupy.cuda.Stream(non_blocking=True)
    nbytes = mib << 20
    src, dst = cupy.ones(nbytes, np.uint8), cupy.empty(nbytes, np.uint8)
    copy_s = _time_events(
        cupy, stream, lambda: dst.data.copy_from_device_async(src.data, nbytes, stream), reps
    )
    rows = [{"kernel": "copy (device to device)", "gbps": 2 * nbytes / copy_s / 1e9, "bytes": 2 * nbytes}]
    count = nbytes // 4  # as many elements as a float32 buffer of that size
    for label, dtype, comp, op, kind, types in _kernel_cases():
        reducer = CudaReducer(DTYPES[dtype], ReduceOp(op), Compression(comp), 4, stream)
        arrays = [cupy.ones(count, np.dtype(t)) for t in types.split()]
        moved = sum(int(x.nbytes) for x in arrays)
        if kind == "combine":
            final = op == "avg"

            def run(arrays: list[Any] = arrays, reducer: Any = reducer, final: bool = final) -> None:
                reducer.combine(*arrays, final=final)
        else:

            def run(arrays: list[Any] = arrays, reducer: Any = reducer) -> None:
                reducer.convert(*arrays)

        seconds = _time_events(cupy, stream, run, reps)
        rows.append({"kernel": label, "gbps": moved / seconds / 1e9, "bytes": moved})
        del arrays
    copy = rows[0]["gbps"]
    for row in rows:
        row["of_copy"] = row["gbps"] / copy
    return rows


# --------------------------------------------------------------------------- allreduce


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _gpu_full(count: int, value: float, fake: bool) -> Any:
    if fake:  # a dry run without a GPU: the fake device layer (numpy, late streams)
        from ringcore import device
        from ringcore.device.fake import FakeCudaArray, FakeLayer

        device.use(FakeLayer())
        return FakeCudaArray(np.full(count, value, np.float32))
    import cupy

    return cupy.full(count, value, np.float32)


def _rank(rank: int, size: int, port: int, sizes: list[int], iters: int, fake: bool, results: Any) -> None:
    os.environ.setdefault("RINGCORE_TIMEOUT", "120")
    import ringcore

    comm = ringcore.init(rank=rank, size=size, addr="127.0.0.1", port=port)
    try:
        out = {}
        for nbytes in sizes:
            count = nbytes // 4
            host = np.full(count, rank + 1, np.float32)
            gpu = _gpu_full(count, rank + 1, fake)
            for mode in MODES:
                buf, compression = (
                    (host, None) if mode == "host" else (gpu, "fp16" if "fp16" in mode else None)
                )
                times = []
                for i in range(iters + 1):
                    comm.barrier()
                    start = time.perf_counter()
                    comm.allreduce(buf, compression=compression)
                    if i:  # the first is a warm-up (kernel compile, pinned slots)
                        times.append(time.perf_counter() - start)
                slowest = np.array(times)
                comm.allreduce(slowest, op="max")
                out[(nbytes, mode)] = float(np.median(slowest))
        if rank == 0:
            results.put(out)
    except BaseException as err:
        results.put({"error": f"rank {rank}: {type(err).__name__}: {err}"})
        raise
    finally:
        ringcore.shutdown()


def bench_allreduce(
    size: int, sizes: list[int], iters: int, timeout: float, fake: bool = False
) -> list[dict[str, Any]]:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    os.environ.setdefault("RINGCORE_SECRET", f"gpu-bench-{port}")  # the ranks inherit it
    procs = [
        ctx.Process(target=_rank, args=(r, size, port, sizes, iters, fake, results)) for r in range(size)
    ]
    for proc in procs:
        proc.start()
    try:
        out = results.get(timeout=timeout)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    if "error" in out:
        raise RuntimeError(out["error"])
    factor = 2 * (size - 1) / size
    return [
        {"np": size, "bytes": nbytes, "mode": mode, "time_s": t, "busbw": nbytes / t * factor / 1e9}
        for (nbytes, mode), t in sorted(out.items())
    ]


# --------------------------------------------------------------------------- report


def table(kernels: list[dict[str, Any]], allreduce: list[dict[str, Any]]) -> str:
    lines = []
    if kernels:
        lines += ["", "kernel                               GB/s   of copy", "-" * 54]
        lines += [f"{k['kernel']:<34} {k['gbps']:7.0f}  {k['of_copy']:7.0%}" for k in kernels]
    if allreduce:
        lines += ["", "allreduce float32, busbw GB/s (N processes on one GPU, TCP 127.0.0.1)"]
        lines += ["    size  N    host     gpu  gpu+fp16  gpu/host  fp16/gpu", "-" * 58]
        by = {(r["np"], r["bytes"], r["mode"]): r["busbw"] for r in allreduce}
        for n, nbytes in sorted({(r["np"], r["bytes"]) for r in allreduce}):
            host, gpu, fp16 = (by[(n, nbytes, m)] for m in MODES)
            lines.append(
                f"{nbytes >> 20:6d}M {n:2d} {host:7.3f} {gpu:7.3f} {fp16:9.3f} {gpu / host:8.0%} {fp16 / gpu:8.2f}x"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernel-mib", type=int, default=256, help="kernel buffer size in MiB (0: skip)")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--sizes", default="4M,64M,256M", help="allreduce sizes (empty: skip)")
    parser.add_argument("--np", default="2,4", help="process counts")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per process count")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--fake", action="store_true", help="dry run without a GPU (fake device, no kernels)")
    args = parser.parse_args(argv)
    kernels = bench_kernels(args.kernel_mib, args.reps) if args.kernel_mib and not args.fake else []
    if kernels:
        print(table(kernels, []), flush=True)
    allreduce: list[dict[str, Any]] = []
    sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    failures = []
    for n in (int(x) for x in args.np.split(",") if x and sizes):
        try:
            allreduce += bench_allreduce(n, sizes, args.iters, args.timeout, args.fake)
        except Exception as err:  # report what was measured, and why the rest is missing
            failures.append(f"N={n}: {err}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"kernels": kernels, "allreduce": allreduce, "failures": failures}, f, indent=1)
    print(table(kernels, allreduce))
    for failure in failures:
        print(f"FAILED {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
